"""--dataset, --split, --column: the tools read a Hugging Face dataset (here a JSON Lines folder
made in the test) and record its name, split, column and revision in their outputs; bad uses are
one line before any model is loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEXT, error_line

from headsurgeon.cli import classify, repair

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def dataset_dir(tmp_path):
    folder = tmp_path / "corpus-ds"
    folder.mkdir()
    rows = [line.strip() for line in TEXT.split(".") if line.strip()]
    for split, ordered in (("train", rows), ("test", rows[::-1])):
        lines = "".join(json.dumps({"text": r}) + "\n" for r in ordered)
        (folder / f"{split}.jsonl").write_text(lines)
    return folder


@pytest.mark.slow
def test_classify_reads_a_json_lines_dataset_and_records_it(dataset_dir, tmp_path):
    """The acceptance command of issue 42, in a subprocess as a user runs it."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "headsurgeon", "classify", "organism", "--dataset"]
    command += [str(dataset_dir), "--n-seqs", "2", "--seq-len", "32", "--out", str(out)]
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    metadata = json.loads((out / "heads.json").read_text())["metadata"]
    data, revision = metadata["data"], metadata["dataset"]["revision"]
    assert data == f"dataset corpus-ds, split train, column text, revision {revision}", data
    assert metadata["dataset"] == {
        "name": "corpus-ds",
        "split": "train",
        "column": "text",
        "revision": revision,
    }
    assert len(revision) == 16  # the files' fingerprint
    assert data in (out / "index.html").read_text()  # the page's line naming the data
    assert str(tmp_path) not in (out / "heads.json").read_text()  # no machine paths


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--dataset", "{ds}", "--texts", "{ds}/train.jsonl"], "not allowed with argument"),
        (["--dataset", "./no/such/folder"], "dataset ./no/such/folder does not exist"),
        (["--dataset", "{ds}/train.jsonl.txt"], "does not exist"),
    ],
)
def test_classify_dataset_misuse_is_one_line_before_loading(
    dataset_dir, no_model, capsys, argv, needle
):
    argv = [a.replace("{ds}", str(dataset_dir)) for a in argv]
    line = error_line(classify.main, ["organism", *argv, "--out", "unused"], capsys)
    assert needle in line, line


def test_repair_eval_split_needs_the_dataset_and_excludes_the_corpus(
    dataset_dir, no_model, capsys, tmp_path
):
    out = ["--out", str(tmp_path / "out")]
    line = error_line(repair.main, ["organism", "--eval-split", "test", *out], capsys)
    assert "--eval-split applies to --dataset; give --dataset too" in line
    text = tmp_path / "a.txt"
    text.write_text(TEXT)
    argv = ["organism", "--dataset", dataset_dir, "--corpus", text, *out]
    assert "not allowed with argument" in error_line(repair.main, argv, capsys)


def test_the_dataset_folder_is_an_input_no_output_may_take(dataset_dir, no_model, capsys):
    argv = ["organism", "--dataset", dataset_dir, "--out", dataset_dir / "out"]
    line = error_line(classify.main, argv, capsys)
    assert "input" in line, line


def test_repair_trains_on_the_dataset_and_evaluates_on_its_other_split(
    injured, dataset_dir, tmp_path
):
    out = tmp_path / "out"
    argv = [injured, "--dataset", dataset_dir, "--eval-split", "test", "--prepend-bos"]
    argv += ["--seq-len", "32", "--n-seqs", "8", "--train-seq-len", "32", "--passes", "1"]
    argv += ["--steps", "2", "--no-control", "--quiet", "--out", out]
    # The test split holds the training rows reversed: some held-out sequences are training
    # sequences, refused unless allowed, and then said under the verdict.
    argv += ["--allow-eval-on-train"]
    repair.main([str(a) for a in argv])
    settings = json.loads((out / "report.json").read_text())["settings"]
    shared, n_eval = settings["eval_on_train"]
    assert 0 < shared < n_eval
    verdict = (out / "report.md").read_text().split("## ")[0]
    assert f"**Judged on the training text**: {shared} of the {n_eval} held-out" in verdict
    revision = settings["train_data"].rsplit(" ", 1)[1]
    assert (
        settings["train_data"]
        == f"dataset corpus-ds, split train, column text, revision {revision}"
    )
    assert (
        settings["eval_data"] == f"dataset corpus-ds, split test, column text, revision {revision}"
    )
    assert settings["census_data"].startswith("bundled held-out corpora")


@pytest.mark.parametrize("given", ["~/corpus-ds", "~/corpus-ds/", "~/../home/corpus-ds"])
def test_a_quoted_tilde_dataset_is_the_path_the_overlap_check_sees(
    dataset_dir, no_model, capsys, monkeypatch, given
):
    """'~' past the shell (quoted) is expanded once, for reading and for the overlap check
    alike: a report inside the dataset folder is refused (it was written there)."""
    home = dataset_dir.parent / "home"
    home.mkdir()
    (home / "corpus-ds").symlink_to(dataset_dir)
    monkeypatch.setenv("HOME", str(home))
    argv = ["organism", "--dataset", given, "--out", dataset_dir / "report"]
    line = error_line(classify.main, argv, capsys)
    assert "the input" in line and "choose a folder outside them" in line, line
    assert sorted(p.name for p in dataset_dir.iterdir()) == ["test.jsonl", "train.jsonl"]


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("empty.jsonl", b"", "dataset file empty.jsonl is empty (0 bytes)"),
        ("deep.jsonl", b'{"text": ' + b"[" * 300 + b"]" * 300 + b"}\n", "nests deeper than"),
        ("rows.jsonl", b'{"text": "a"}\n{"text": 7}\n', "holds int values, not text"),
    ],
)
def test_a_dataset_refused_while_read_leaves_no_lock_nor_output(
    tmp_path, capsys, name, content, needle
):
    (tmp_path / name).write_bytes(content)
    argv = ["organism", "--dataset", tmp_path / name, "--n-seqs", "2", "--out", tmp_path / "out"]
    line = error_line(classify.main, argv, capsys)
    assert needle in line and str(tmp_path) not in line, line
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no .out.lock, no out, no twin
