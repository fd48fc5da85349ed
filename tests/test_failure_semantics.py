"""Failure semantics of the command-line tools (issue 13, categories 1, 4, 7, 8, 9).

Bad output locations, text paths that are not text files, unusable options and models are one
``error:`` line with exit status 2 before any model is loaded; an OS error while writing names the
final path and the fix; two runs never share an output folder; what a killed run left beside its
output is cleaned by the next run of it; a repair that never trained leaves no ``.partial``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import TEXT, error_line

import headsurgeon.cli
import headsurgeon.cli.blindness
import headsurgeon.cli.classify
import headsurgeon.cli.repair
import headsurgeon.cli.repair_run
from headsurgeon.data import read_texts, to_sequences
from headsurgeon.errors import DataError, OutputBusyError, OutputWriteError
from headsurgeon.outputs import atomic_directory, atomic_write_text, claim_output, mark_folder

TOOLS = {
    "classify": (headsurgeon.cli.classify.main, []),
    "blindness": (headsurgeon.cli.blindness.main, ["--measure"]),
    "repair": (headsurgeon.cli.repair.main, []),
}


@pytest.fixture()
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return path


def entries(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# --- 1. the output location is checked before any model is loaded --------------------------------


BAD_OUTS = {
    "under a file": (lambda tmp: tmp / "file" / "out", "/file is a file"),
    "an existing file": (lambda tmp: tmp / "file", "is a file; choose a folder name"),
    "a name too long": (lambda tmp: tmp / ("x" * 300), "choose a shorter name"),
}


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("case", BAD_OUTS)
def test_a_bad_output_location_fails_before_the_model_loads(
    tool, case, bloom_dir, tmp_path, no_model, capsys
):
    main, extra = TOOLS[tool]
    (tmp_path / "file").write_text("mine")
    make_out, message = BAD_OUTS[case]
    line = error_line(main, [bloom_dir, *extra, "--out", make_out(tmp_path)], capsys)
    assert message in line
    assert entries(tmp_path) == ["file"] and (tmp_path / "file").read_text() == "mine"


def test_a_folder_that_is_not_writable_fails_before_the_model_loads(
    bloom_dir, tmp_path, no_model, capsys, monkeypatch
):
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    if os.geteuid() != 0:  # root writes anywhere: there, the permission check is simulated
        readonly.chmod(0o555)
    else:
        real_access = os.access
        monkeypatch.setattr(
            os, "access", lambda p, mode: False if str(p) == str(readonly) else real_access(p, mode)
        )
    try:
        main = headsurgeon.cli.classify.main
        line = error_line(main, [bloom_dir, "--out", readonly / "sub" / "out"], capsys)
    finally:
        readonly.chmod(0o755)
    assert f"{readonly} is not writable" in line and "choose a folder you can write to" in line
    assert entries(readonly) == []


@pytest.mark.slow  # a subprocess
def test_unwritable_out_fails_before_the_census(bloom_dir, tmp_path):
    (tmp_path / "file").write_text("x")
    argv = [str(bloom_dir), "--threads", "1", "--out", str(tmp_path / "file" / "out")]
    done = subprocess.run(
        [sys.executable, "-m", "headsurgeon", "classify", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()  # no census progress bar: it never started
    assert line == f"error: cannot create {tmp_path}/file/out: {tmp_path}/file is a file; " + (
        "choose a folder path"
    )


def test_a_full_disk_while_writing_names_the_output_not_a_temporary(
    bloom_dir, text_file, tmp_path, capsys, monkeypatch
):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    out = tmp_path / "out"
    argv = [bloom_dir, "--texts", text_file, "--seq-len", "32", "--n-seqs", "4", "--out", out]
    line = error_line(headsurgeon.cli.classify.main, argv, capsys)
    assert line.startswith(f"error: could not write {out}/")
    assert "No space left on device; free disk space" in line and ".tmp-" not in line
    assert entries(tmp_path) == ["text.txt"]  # no output, temporary or lock file left


def test_a_write_error_deep_in_an_output_names_its_final_path(tmp_path, monkeypatch):
    out = tmp_path / "out"

    def denied(fd):
        raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(OutputWriteError) as error, atomic_directory(out) as tmp:
        atomic_write_text(tmp / "a.txt", "fine")
        with atomic_directory(tmp / "model") as inner:  # as save_hf writes report/model/
            monkeypatch.setattr(os, "fsync", denied)
            atomic_write_text(inner / "config.json", "{}")
    assert str(error.value) == (
        f"could not write {out}/model/config.json: Permission denied; choose a folder you can "
        "write to"
    )
    assert error.value.errno == errno.EACCES and isinstance(error.value, OSError)
    assert entries(tmp_path) == []


REPAIR_ARGS = [
    "--seq-len",
    "32",
    "--n-seqs",
    "8",
    "--train-seq-len",
    "32",
    "--steps",
    "2",
    "--batch-size",
    "4",
    "--passes",
    "1",
    "--quiet",
]


def repair_argv(bloom_dir, text_file, *extra):
    texts = ["--texts", text_file, "--corpus", text_file, "--eval-corpus", text_file]
    texts += ["--allow-eval-on-train"]
    return [str(a) for a in [bloom_dir, *texts, *REPAIR_ARGS, *extra]]


def test_repair_full_disk_keeps_the_training_and_resume_finishes_it(
    bloom_dir, text_file, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "out"
    real_write_report = headsurgeon.cli.repair_run.write_report

    def on_a_full_disk(*args, **kwargs):
        def full(fd):
            raise OSError(errno.ENOSPC, "No space left on device")

        with monkeypatch.context() as m:
            m.setattr(os, "fsync", full)
            return real_write_report(*args, **kwargs)

    monkeypatch.setattr(headsurgeon.cli.repair_run, "write_report", on_a_full_disk)
    argv = repair_argv(bloom_dir, text_file, "--heads", "L0H0", "--out", out)
    line = error_line(headsurgeon.cli.repair.main, argv, capsys)
    assert f"could not write {out}/" in line and "No space left on device" in line
    assert line.endswith(
        f"{out}.partial keeps the finished training: continue it with --resume {out}"
    )
    assert not out.exists() and (tmp_path / "out.partial" / "pass1" / "done.json").exists()

    monkeypatch.setattr(headsurgeon.cli.repair_run, "write_report", real_write_report)
    resume = repair_argv(bloom_dir, text_file, "--heads", "L0H0", "--resume", out)
    cli = headsurgeon.cli.repair
    assert cli.main(resume) in (0, cli.EXIT_DAMAGED, cli.EXIT_WORSE)
    assert json.loads((out / "report.json").read_text())["targeted"] == ["L0H0"]
    assert entries(tmp_path) == ["out", "text.txt"]


# --- 4. a path argument is a path --------------------------------------------------------------


def bad_texts(tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "binary.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("  \n")
    return {
        "nope.txt": "text file nope.txt does not exist",
        str(tmp_path / "folder"): "is a folder",
        str(tmp_path / "binary.bin"): "is not text (it holds NUL bytes",
        str(tmp_path / "latin1.txt"): "is not UTF-8 (byte 0xe9 at offset 3)",
        str(tmp_path / "empty.txt"): "is empty",
    }


@pytest.mark.parametrize(
    "tool, option",
    [
        ("classify", "--texts"),
        ("blindness", "--texts"),
        ("repair", "--texts"),
        ("repair", "--corpus"),
        ("repair", "--eval-corpus"),
    ],
)
def test_a_text_path_that_is_no_text_file_is_one_line_before_loading(
    tool, option, bloom_dir, tmp_path, no_model, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    main, extra = TOOLS[tool]
    for path, message in bad_texts(tmp_path).items():
        argv = [bloom_dir, *extra, option, path, "--out", tmp_path / "out"]
        line = error_line(main, argv, capsys)
        assert line.startswith(f"error: {option}: text file {path}") and message in line, line
    assert not (tmp_path / "out").exists()


def test_library_paths_are_never_taken_for_text(tiny_model, tmp_path):
    from pathlib import Path

    with pytest.raises(DataError, match="text file nope.txt does not exist"):
        to_sequences(tiny_model, [Path("nope.txt")], seq_len=8)
    for path, message in bad_texts(tmp_path).items():
        with pytest.raises(DataError, match="text file") as error:
            read_texts([path])
        assert message in str(error.value)


# --- 7. one run per output folder ------------------------------------------------------------


HOLD = """
import os, sys, time
import headsurgeon.cli.classify as tool
import headsurgeon.domains as measure  # the tool's census runs through classify_sequences
census = measure.run_census
def held(*args, **kwargs):  # the census waits until the test says go
    while not os.path.exists(os.environ["GO"]):
        time.sleep(0.05)
    return census(*args, **kwargs)
measure.run_census = held
sys.argv[0] = "classify"
tool.entry()
"""


@pytest.mark.slow  # subprocesses
def test_two_concurrent_classify_runs_into_one_folder(bloom_dir, text_file, tmp_path):
    out = tmp_path / "out"
    argv = [
        str(bloom_dir),
        "--texts",
        str(text_file),
        "--seq-len",
        "32",
        "--n-seqs",
        "4",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    env = dict(os.environ, GO=str(tmp_path / "go"))
    first = subprocess.Popen(
        [sys.executable, "-c", HOLD, *argv],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / ".out.lock").exists() or not (tmp_path / ".out.lock").read_text():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        # The first run holds the folder and waits in its census: the second starts now.
        second = subprocess.run(
            [sys.executable, "-m", "headsurgeon", "classify", *argv],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert first.poll() is None  # really concurrent: the first is still running
    finally:
        (tmp_path / "go").touch()
        stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    assert f"wrote {out}/" in stdout
    assert second.returncode == 2 and "wrote" not in second.stdout
    [line] = second.stderr.strip().splitlines()
    assert line.startswith(f"error: {out} is being written by another run that is still going ")
    assert f"(pid {first.pid} on " in line and "interrupted" not in line
    assert "heads.csv" in entries(out)
    assert entries(tmp_path) == ["go", "out", "text.txt"]  # no lock or temporary left


def test_a_second_claim_fails_and_a_dead_runs_lock_is_taken_over(tmp_path):
    out = tmp_path / "out"
    with claim_output(out):
        with pytest.raises(OutputBusyError, match=f"pid {os.getpid()} on ") as busy:
            with claim_output(out):
                pytest.fail("two claims of one folder")
        assert "interrupted" not in str(busy.value)
    assert entries(tmp_path) == []
    (tmp_path / ".out.lock").write_text("999999999 elsewhere 2026-01-01T00:00:00\n")  # killed
    with claim_output(out):
        pid = (tmp_path / ".out.lock").read_text().split()[0]
        assert pid == str(os.getpid())
    assert entries(tmp_path) == []


def test_a_resume_while_the_run_is_alive_is_refused_without_calling_it_interrupted(
    bloom_dir, tmp_path, no_model, capsys
):
    out = tmp_path / "out"
    (tmp_path / "out.partial").mkdir()
    (tmp_path / "out.partial" / "run.json").write_text("{}")
    with claim_output(out):  # the run that writes out (and out.partial) is still going
        line = error_line(headsurgeon.cli.repair.main, [bloom_dir, "--resume", out], capsys)
    assert "is being written by another run that is still going" in line
    assert "interrupted" not in line
    assert entries(tmp_path / "out.partial") == ["run.json"]


# --- 8. leftovers of a killed run ----------------------------------------------------------------


def test_a_killed_writes_temporaries_are_removed_by_the_next_run(tmp_path, caplog):
    caplog.set_level("INFO", logger="headsurgeon")
    out = tmp_path / "out"
    (tmp_path / ".out.tmp-0123456789ab" / "model").mkdir(parents=True)
    (tmp_path / ".out.tmp-0123456789ab" / "model" / "model.safetensors").write_bytes(b"x" * 1000)
    mark_folder(tmp_path / ".out.tmp-0123456789ab", "test", [])  # as a run marks it first
    (tmp_path / ".report.md.tmp-0123456789ab").write_text("another output's")
    (tmp_path / ".out2.tmp-0123456789ab").mkdir()  # another output's
    with claim_output(out):
        pass
    assert entries(tmp_path) == [".out2.tmp-0123456789ab", ".report.md.tmp-0123456789ab"]
    assert "removed 1 temporary folder(s) of" in caplog.text


def test_an_output_a_killed_run_was_replacing_is_put_back(tmp_path, capsys):
    out = tmp_path / "out"
    (tmp_path / ".out.old-0123456789ab").mkdir()  # killed between the two renames
    (tmp_path / ".out.old-0123456789ab" / "heads.csv").write_text("the previous result")
    mark_folder(tmp_path / ".out.old-0123456789ab", "test")
    (tmp_path / ".out.tmp-ba9876543210").mkdir()
    mark_folder(tmp_path / ".out.tmp-ba9876543210", "test", [])
    with claim_output(out, overwrite=True):
        assert (out / "heads.csv").read_text() == "the previous result"
    assert entries(tmp_path) == ["out"]


def test_a_folder_that_appeared_meanwhile_is_kept_without_overwrite(tmp_path):
    from headsurgeon.errors import OutputExistsError

    out = tmp_path / "out"
    with pytest.raises(OutputExistsError, match="appeared while this run wrote it"):
        with atomic_directory(out) as tmp:
            atomic_write_text(tmp / "mine.txt", "mine")
            out.mkdir()
            (out / "theirs.txt").write_text("theirs")  # another writer finished first
    assert entries(out) == ["theirs.txt"]
    assert entries(tmp_path) == ["out"]


# --- 9. options and models checked before work, no .partial without training ------------------


def test_repair_refuses_float16_before_loading(bloom_dir, tmp_path, no_model, capsys):
    out = tmp_path / "out"
    line = error_line(
        headsurgeon.cli.repair.main, [bloom_dir, "--dtype", "float16", "--out", out], capsys
    )
    assert line.startswith("error: --dtype float16: fine-tuning a float16 model needs loss")
    assert entries(tmp_path) == []


def test_repair_heads_are_checked_against_the_model_before_loading(
    bloom_dir, tmp_path, no_model, capsys
):
    argv = [bloom_dir, "--heads", "L5H0", "--out", tmp_path / "out"]
    line = error_line(headsurgeon.cli.repair.main, argv, capsys)
    assert "L5H0 is out of range" in line
    assert entries(tmp_path) == []


def test_a_repair_that_never_trained_leaves_no_partial_and_is_not_blocked_by_one(
    bloom_dir, text_file, tmp_path, capsys
):
    out = tmp_path / "out"
    # What a run killed during its first census leaves: the run's identity, no training.
    (tmp_path / "out.partial").mkdir()
    (tmp_path / "out.partial" / "run.json").write_text("{}")
    mark_folder(tmp_path / "out.partial", headsurgeon.cli.repair_run.WORK_WRITER)
    line = error_line(
        headsurgeon.cli.repair.main, repair_argv(bloom_dir, text_file, "--out", out), capsys
    )
    assert "nothing to repair" in line  # the healthy model's census: it never trained
    assert entries(tmp_path) == ["text.txt"]


def test_a_model_without_tokenizer_says_so_to_a_cli_user(bloom_dir, text_file, tmp_path, capsys):
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(bloom_dir, folder)
    for path in folder.glob("*token*"):
        path.unlink()
    for tool, argv in [
        (headsurgeon.cli.classify.main, [folder, "--texts", text_file]),
        (headsurgeon.cli.blindness.main, [folder, "--measure"]),
        (headsurgeon.cli.repair.main, repair_argv(folder, text_file, "--heads", "L0H0")),
    ]:
        line = error_line(tool, [*argv, "--out", tmp_path / "out"], capsys)
        assert f"{folder} has no tokenizer, so " in line and "cannot be tokenised" in line
        assert "add the tokenizer files" in line and "token tensors" not in line
        assert sorted(entries(tmp_path)) == ["no-tokenizer", "text.txt"]
