"""Corpora as Hugging Face datasets and lazy iterables (headsurgeon.corpus_sources): each way a
dataset can come (JSON Lines folder, save_to_disk folder, Parquet file, a Dataset in memory, a
cached hub name) gives the tokens of its rows joined, with a record of where they came from;
bad datasets are one line; lazy sources are read only as far as the sample needs."""

from __future__ import annotations

import gzip
import itertools
import json
import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from conftest import TEXT

import headsurgeon as hs
from headsurgeon import data
from headsurgeon.corpus_sources import (
    ROW_SEPARATOR,
    TextSource,
    dataset_texts,
    load_dataset_texts,
    text_source,
)
from headsurgeon.errors import DataError, InvalidArgumentError

ROOT = Path(__file__).resolve().parents[1]
ROWS = [sentence.strip() + "." for sentence in TEXT.split(".") if sentence.strip()][:40]


def write_jsonl(path, rows, key="text"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({key: row, "n": i}) + "\n" for i, row in enumerate(rows)))
    return path


@pytest.fixture()
def jsonl_dir(tmp_path):
    folder = tmp_path / "my-corpus"
    write_jsonl(folder / "train.jsonl", ROWS)
    write_jsonl(folder / "test.jsonl", ROWS[::-1])
    return folder


def joined_tokens(model, rows, **cut):
    """What a dataset of ``rows`` must give: the rows joined by a blank line, cut as one text."""
    return hs.to_sequences(model, ROW_SEPARATOR.join(rows), **cut).tokens


def test_a_json_lines_folder_gives_its_rows_joined_with_a_record(tiny_model, jsonl_dir):
    seqs = hs.to_sequences(tiny_model, load_dataset_texts(jsonl_dir), seq_len=16)
    assert torch.equal(seqs.tokens, joined_tokens(tiny_model, ROWS, seq_len=16))
    assert seqs.dataset["name"] == "my-corpus" and seqs.dataset["split"] == "train"
    assert seqs.dataset["column"] == "text" and len(seqs.dataset["revision"]) == 16
    assert seqs.source == (
        f"dataset my-corpus, split train, column text, revision {seqs.dataset['revision']}"
    )
    assert str(jsonl_dir.parent) not in seqs.source  # outputs carry no machine paths
    test = hs.to_sequences(tiny_model, load_dataset_texts(jsonl_dir, split="test"), seq_len=16)
    assert torch.equal(test.tokens, joined_tokens(tiny_model, ROWS[::-1], seq_len=16))


def test_save_to_disk_folders_and_parquet_files_give_the_same_tokens(tiny_model, tmp_path):
    table = datasets.Dataset.from_dict({"text": ROWS, "n": list(range(len(ROWS)))})
    table.save_to_disk(tmp_path / "saved")
    datasets.DatasetDict({"train": table, "validation": table}).save_to_disk(tmp_path / "splits")
    table.to_parquet(tmp_path / "rows.parquet")
    expected = joined_tokens(tiny_model, ROWS, seq_len=16)
    for source in (
        load_dataset_texts(tmp_path / "saved"),
        load_dataset_texts(tmp_path / "splits", split="validation"),
        load_dataset_texts(tmp_path / "rows.parquet"),
        table,  # a Dataset in memory, given to a verb as it is
        dataset_texts(table.to_iterable_dataset()),
    ):
        assert torch.equal(hs.to_sequences(tiny_model, source, seq_len=16).tokens, expected)
    with pytest.raises(DataError, match=r"saved is one split \(train\), not test; leave out"):
        load_dataset_texts(tmp_path / "saved", split="test")
    census = hs.run_census(tiny_model, load_dataset_texts(tmp_path / "rows.parquet"), seq_len=16)
    assert census.attrs["data"].startswith("dataset rows.parquet, split train, column text, ")
    assert census.attrs["dataset"]["name"] == "rows.parquet"
    assert "dataset" not in hs.run_census(tiny_model, ROWS, seq_len=8).attrs


def test_the_revision_follows_the_files_content(jsonl_dir):
    before = load_dataset_texts(jsonl_dir).record["revision"]
    assert load_dataset_texts(jsonl_dir).record["revision"] == before
    write_jsonl(jsonl_dir / "train.jsonl", ROWS[1:])
    assert load_dataset_texts(jsonl_dir).record["revision"] != before


def test_a_generator_gives_what_the_same_list_gives(tiny_model):
    texts = [TEXT, TEXT[::-1]]
    seqs = hs.to_sequences(tiny_model, (t for t in texts), seq_len=16, n_seqs=5)
    assert torch.equal(seqs.tokens, hs.to_sequences(tiny_model, texts, seq_len=16, n_seqs=5).tokens)
    assert seqs.source == "texts from a generator" and seqs.dataset is None


def test_lazy_sources_are_read_only_as_far_as_the_sample_needs(tiny_model, monkeypatch):
    monkeypatch.setattr(data, "MIN_SAMPLE_TOKENS", 1000)
    endless = itertools.cycle([TEXT])  # never ends: reading it whole would never return
    assert hs.to_sequences(tiny_model, endless, seq_len=16, n_seqs=4).n_seqs == 4
    rows = datasets.IterableDataset.from_generator(
        lambda: ({"text": row} for _ in itertools.count() for row in ROWS)
    )
    assert hs.to_sequences(tiny_model, rows, seq_len=16, n_seqs=4).n_seqs == 4


def test_the_text_column_is_text_or_the_only_string_column_else_chosen(tiny_model):
    two = datasets.Dataset.from_dict({"title": ROWS, "body": ROWS[::-1], "n": [1] * len(ROWS)})
    with pytest.raises(DataError, match=r"several text columns \(title, body, n\); choose one"):
        hs.to_sequences(tiny_model, two)
    seqs = hs.to_sequences(tiny_model, dataset_texts(two, "body"), seq_len=16)
    assert torch.equal(seqs.tokens, joined_tokens(tiny_model, ROWS[::-1], seq_len=16))
    only = datasets.Dataset.from_dict({"body": ROWS, "n": [1] * len(ROWS)})
    assert dataset_texts(only).record["column"] == "body"


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda d: load_dataset_texts(d, column="nope"), "has no column 'nope'; its columns: "),
        (lambda d: load_dataset_texts(d, column="n"), "column 'n' of dataset my-corpus is"),
        (lambda d: load_dataset_texts(d, split="validation"), "validation"),
        (lambda d: load_dataset_texts(d / "train.jsonl", split="test"), "one split (train)"),
        (lambda d: load_dataset_texts(d / "missing"), "does not exist"),
        (lambda d: load_dataset_texts(d / "notes"), "holds no .jsonl, .json, .parquet, .csv"),
        (lambda d: load_dataset_texts(d / "notes"), "text files are texts: pass their paths"),
        (lambda d: load_dataset_texts(d / "notes" / "a.txt"), "is not one of .jsonl"),
        (lambda d: load_dataset_texts("someone/not-cached", cache_dir=d), "datasets.load_dataset("),
    ],
)
def test_bad_datasets_are_one_line(jsonl_dir, make, needle):
    (jsonl_dir / "notes").mkdir()
    (jsonl_dir / "notes" / "a.txt").write_text(TEXT)
    with pytest.raises((DataError, InvalidArgumentError)) as info:
        make(jsonl_dir)
    message = str(info.value)
    assert needle in message and len(message.splitlines()) == 1, message
    assert "--" not in message, message  # Python's keywords (split=), not the tools' options


def test_a_text_source_iterates_its_texts_and_takes_the_first_n(jsonl_dir):
    texts = load_dataset_texts(jsonl_dir)
    assert texts.take(3) == ROWS[:3]  # a dataset's texts are its rows
    assert next(iter(texts)) == ROWS[0]
    assert list(texts) == ROWS and texts.take(1000) == ROWS  # read afresh each time
    with pytest.raises(InvalidArgumentError, match="n must be"):
        texts.take(0)
    lazy = text_source(iter(["one text", "another"]))
    assert list(lazy) == ["one text", "another"]
    with pytest.raises(DataError, match="read already"):
        lazy.take(1)  # a generator is read once


def test_a_missing_split_names_the_keyword_in_python_and_the_option_in_the_tools(jsonl_dir):
    from headsurgeon.cli.session import in_option_terms

    with pytest.raises(DataError) as python:
        load_dataset_texts(jsonl_dir, split="validation")
    assert "give split= one of train, test" in str(python.value)
    with pytest.raises(DataError) as tool, in_option_terms({"split=": "--split"}):
        load_dataset_texts(jsonl_dir, split="validation")
    assert "give --split one of train, test" in str(tool.value)


def test_non_text_values_and_empty_datasets_are_one_line_when_read(tiny_model):
    # Features unknown until read: the values are checked as they come.
    mixed = datasets.IterableDataset.from_generator(
        lambda: iter([{"text": "some words here"}, {"text": 3}])
    )
    with pytest.raises(DataError, match="column 'text' of dataset .* holds int values, not text"):
        hs.to_sequences(tiny_model, mixed, seq_len=4)
    features = datasets.Features({"text": datasets.Value("string")})
    empty = datasets.Dataset.from_dict({"text": []}, features=features)
    with pytest.raises(DataError, match="dataset in memory has no rows; give a dataset with rows"):
        hs.to_sequences(tiny_model, empty)
    blank = datasets.Dataset.from_dict({"text": ["", None]}, features=features)
    with pytest.raises(DataError, match=r"has no text in column 'text' \(its 2 rows are empty"):
        hs.to_sequences(tiny_model, blank)
    with pytest.raises(DataError, match="no texts given"):
        hs.to_sequences(tiny_model, iter([]))
    with pytest.raises(DataError, match="one is of type int"):
        hs.to_sequences(tiny_model, iter([TEXT, 3]))
    splits = datasets.DatasetDict({"train": empty})
    with pytest.raises(DataError, match=r"holds splits \(train\); pass one of them"):
        hs.to_sequences(tiny_model, splits)


def test_a_dataset_source_serves_every_read_an_iterator_one(tiny_model, jsonl_dir):
    source = load_dataset_texts(jsonl_dir)
    first = hs.to_sequences(tiny_model, source, seq_len=16)
    again = hs.to_sequences(tiny_model, source, seq_len=16)  # a notebook's second verb
    assert torch.equal(first.tokens, again.tokens)
    generator = (t for t in ROWS)
    hs.to_sequences(tiny_model, generator, seq_len=16)
    with pytest.raises(DataError, match="generator read before gives none"):
        hs.to_sequences(tiny_model, generator, seq_len=16)
    once = text_source(t for t in ROWS)
    hs.to_sequences(tiny_model, once, seq_len=16)
    with pytest.raises(DataError, match="read already"):
        hs.to_sequences(tiny_model, once, seq_len=16)
    texts = {ROWS[0]}  # a container is no iterator: read afresh
    assert torch.equal(
        hs.to_sequences(tiny_model, texts, seq_len=8).tokens,
        hs.to_sequences(tiny_model, texts, seq_len=8).tokens,
    )


def test_lists_tensors_and_paths_are_not_lazy_sources(tmp_path):
    for given in (["a text"], ("a text",), "a text", tmp_path, torch.zeros(2, 3), None):
        assert text_source(given) is None
    assert isinstance(text_source(iter(["a"])), TextSource)


def test_texts_of_reads_a_dataset_as_one_text(jsonl_dir):
    assert data.texts_of(load_dataset_texts(jsonl_dir)) == [ROW_SEPARATOR.join(ROWS)]


def test_a_dataset_in_the_hub_cache_is_read_with_its_commit(tiny_model, tmp_path):
    """A cache entry laid out as datasets lays out a hub dataset it downloaded
    (NAMESPACE___NAME/CONFIG/VERSION/COMMIT/NAME-SPLIT.arrow): read from there, no network."""
    table = datasets.Dataset.from_dict({"text": ROWS})
    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = tmp_path / "cache" / "someone___tiny" / "default" / "0.0.0" / commit
    folder.mkdir(parents=True)
    with datasets.arrow_writer.ArrowWriter(path=str(folder / "tiny-train.arrow")) as writer:
        writer.write_table(table.data.table)
        writer.finalize()
    info = datasets.DatasetInfo(
        dataset_name="tiny",
        config_name="default",
        features=table.features,
        splits=datasets.SplitDict({"train": datasets.SplitInfo("train", num_examples=len(ROWS))}),
    )
    info.write_to_directory(str(folder))
    source = load_dataset_texts("someone/tiny", cache_dir=tmp_path / "cache")
    assert source.record == {
        "name": "someone/tiny",
        "split": "train",
        "column": "text",
        "revision": commit,
    }
    seqs = hs.to_sequences(tiny_model, source, seq_len=16)
    assert torch.equal(seqs.tokens, joined_tokens(tiny_model, ROWS, seq_len=16))


def test_a_lazy_source_read_whole_is_bounded(tiny_model, monkeypatch, jsonl_dir):
    from headsurgeon import corpus_sources

    monkeypatch.setattr(corpus_sources, "MAX_TEXT_BYTES", 500)
    with pytest.raises(DataError, match="my-corpus holds more than .* sample it with n_seqs="):
        hs.to_sequences(tiny_model, load_dataset_texts(jsonl_dir), seq_len=16)
    with pytest.raises(DataError, match="the texts hold more than .* sample them with n_seqs="):
        hs.to_sequences(tiny_model, itertools.repeat(TEXT), seq_len=16)


def test_perplexity_scores_a_dataset_as_its_joined_text(tiny_model, jsonl_dir):
    given = hs.perplexity(tiny_model, load_dataset_texts(jsonl_dir), window=16, progress=False)
    joined = hs.perplexity(tiny_model, ROW_SEPARATOR.join(ROWS), window=16, progress=False)
    assert given == joined


_CAPPED = """
import gzip, json, resource, sys
import headsurgeon as hs
from headsurgeon import data
from headsurgeon.errors import HeadsurgeonError
info = hs.model_info(hs.load_model("organism"))
source = hs.load_dataset_texts(sys.argv[1])  # datasets imported: in the baseline
size = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + (320 << 20),) * 2)
try:
    print("shape", list(data.as_sequences(info, source, seq_len=16, n_seqs=2).tokens.shape))
except (HeadsurgeonError, MemoryError) as e:
    print("error", type(e).__name__, e)
"""


@pytest.mark.slow
def test_rows_of_1_mb_are_read_by_bytes_until_the_windows_exist(tmp_path):
    """64 rows of 1 MB in a 200 KB .jsonl.gz, 2 x 16 tokens asked for, in a process whose
    address space is capped 320 MB above its baseline: reading stops after the first rows (it
    read 1,000 rows at a time, re-cut the joined text quadratically, and ran out of memory)."""
    row = json.dumps({"text": "lorem ipsum dolor sit amet " * 37_000}) + "\n"  # 1 MB
    path = tmp_path / "big.jsonl.gz"
    path.write_bytes(gzip.compress((row * 64).encode(), compresslevel=1))
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", _CAPPED, str(path)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.strip() == "shape [2, 16]", done.stdout + done.stderr[-2000:]


def test_a_dataset_is_read_only_until_its_windows_exist(tiny_model, tmp_path):
    """n_seqs x seq_len tokens of a dataset read from its start, in chunks of about a MiB: the
    rows after them never are (it read the first 2**23 tokens, thousands of rows)."""
    read = []

    def rows():
        for i in itertools.count():
            read.append(i)
            yield {"text": f"{TEXT} {i}"}

    stream = datasets.IterableDataset.from_generator(rows)
    seqs = hs.to_sequences(tiny_model, stream, seq_len=16, n_seqs=3)
    assert seqs.tokens.shape == (3, 16) and len(read) < 1000  # 1 MiB: about 260 rows


_NESTED = """
import sys
from pathlib import Path
from headsurgeon.cli import classify, run
for path in sys.argv[1:]:
    out = Path(path).with_suffix(".out")
    try:
        run("classify", ["organism", "--dataset", path, "--n-seqs", "2", "--out", str(out)])
    except SystemExit as e:
        print("exit", e.code, flush=True)
"""

NESTED = {
    "deep.jsonl": b'{"text": ' + b"[" * 20_000 + b"]" * 20_000 + b"}\n",
    "late.jsonl.gz": b'{"text": "a row"}\n{"text": ' + b"[" * 20_000 + b"\n",
    "deep.json": b"[" * 20_000 + b"]" * 20_000 + b"\n",
    "pretty.json": b"[\n" * 5_000 + b"]\n" * 5_000,
}


@pytest.mark.slow
def test_json_nested_20000_deep_is_one_line_and_leaves_no_lock(tmp_path):
    """In a subprocess, so that a crash (pyarrow's reader segfaulted, leaving the output's
    lock behind) fails this test only: each file is one line, exit 2, nothing left."""
    for name, rows in NESTED.items():
        (tmp_path / name).write_bytes(gzip.compress(rows) if name.endswith(".gz") else rows)
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", _NESTED, *(str(tmp_path / name) for name in NESTED)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:-1] == ["exit 2"] * len(NESTED), done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == len(NESTED), done.stderr
    for name, error in zip(NESTED, errors, strict=True):
        assert f"{name}: line " in error and "nests deeper than 100 levels of JSON" in error
    assert "Traceback" not in done.stderr and str(tmp_path) not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(NESTED)  # no lock, no output


def test_paths_are_read_as_named_never_as_globs(tiny_model, tmp_path):
    write_jsonl(tmp_path / "data[1].jsonl", ROWS[:20])
    write_jsonl(tmp_path / "a*.jsonl", ROWS[:20])
    write_jsonl(tmp_path / "ab.jsonl", ROWS[20:])  # what the glob a*.jsonl also matched
    write_jsonl(tmp_path / "set[x]" / "train.jsonl", ROWS[:20])
    write_jsonl(tmp_path / "set*" / "train.jsonl", ROWS[:20])
    write_jsonl(tmp_path / "setA" / "train.jsonl", ROWS[20:])
    expected = joined_tokens(tiny_model, ROWS[:20], seq_len=8)
    for given in ("data[1].jsonl", "a*.jsonl", "set[x]", "set*"):
        seqs = hs.to_sequences(tiny_model, load_dataset_texts(tmp_path / given), seq_len=8)
        assert torch.equal(seqs.tokens, expected), given


def test_a_save_to_disk_folder_is_read_only_inside_itself(tmp_path):
    table = datasets.Dataset.from_dict({"text": ROWS})
    table.save_to_disk(tmp_path / "other")
    for name, rename in (("up", "../other/{}"), ("absolute", str(tmp_path / "other") + "/{}")):
        table.save_to_disk(tmp_path / name)
        state = json.loads((tmp_path / name / "state.json").read_text())
        for entry in state["_data_files"]:
            (tmp_path / name / entry["filename"]).unlink()
            entry["filename"] = rename.format(entry["filename"])
        (tmp_path / name / "state.json").write_text(json.dumps(state))
        with pytest.raises(DataError, match="state.json names a data file outside its folder"):
            load_dataset_texts(tmp_path / name)
    datasets.DatasetDict({"train": table}).save_to_disk(tmp_path / "splits")
    (tmp_path / "splits" / "dataset_dict.json").write_text(json.dumps({"splits": ["../other"]}))
    with pytest.raises(DataError, match="names a split outside its folder"):
        load_dataset_texts(tmp_path / "splits")
    # A symbolic link in a dataset folder to a file outside it: refused too, as a state is.
    write_jsonl(tmp_path / "elsewhere" / "train.jsonl", ROWS)
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "train.jsonl").symlink_to(tmp_path / "elsewhere" / "train.jsonl")
    with pytest.raises(DataError, match="train.jsonl lies outside the dataset folder linked"):
        load_dataset_texts(tmp_path / "linked")


@pytest.mark.parametrize(
    ("name", "make", "needle"),
    [
        ("x.jsonl", lambda p: p.write_text(""), "dataset file x.jsonl is empty (0 bytes)"),
        ("x.parquet", lambda p: p.write_bytes(b""), "dataset file x.parquet is empty"),
        ("x.parquet", lambda p: _zero_rows(p), "dataset x.parquet has no rows"),
        ("x.csv", lambda p: p.write_text("text\n"), "dataset x.csv has no rows"),
        ("x.jsonl", lambda p: p.symlink_to(p), "x.jsonl is a symbolic link loop"),
        ("x.jsonl", lambda p: p.symlink_to(p.parent / "y"), "x.jsonl is a broken symbolic link"),
        ("x.jsonl", lambda p: os.mkfifo(p), "x.jsonl is a FIFO (named pipe)"),
        (
            "x.jsonl",
            lambda p: p.write_text('{"text": "a"}\n{oops\n'),
            "x.jsonl: line 2 is not JSON",
        ),
        ("x.jsonl", lambda p: p.write_text('["a"]\n'), "line 1 is a JSON list, not an object"),
        ("x.jsonl", lambda p: p.write_text('{"n": 1}\n'), "has no text column (n)"),
        ("x.jsonl", lambda p: p.write_text('{"text": 1}\n'), "column 'text' of dataset x.jsonl"),
        ("x.jsonl", lambda p: p.write_bytes(b'{"text": "\xff"}\n'), "line 1 is not UTF-8"),
    ],
)
def test_bad_files_name_the_real_cause_in_one_line(tiny_model, tmp_path, name, make, needle):
    make(tmp_path / name)
    with pytest.raises(DataError) as info:
        hs.to_sequences(tiny_model, load_dataset_texts(tmp_path / name), seq_len=8)
    message = str(info.value)
    assert needle in message and len(message.splitlines()) == 1, message
    assert str(tmp_path) not in message  # outputs carry no machine paths


def _zero_rows(path):
    features = datasets.Features({"text": datasets.Value("string")})
    datasets.Dataset.from_dict({"text": []}, features=features).to_parquet(path)


@pytest.mark.parametrize(
    ("name", "content"),
    [("x.parquet", b"not parquet at all"), ("x.json", b"{oops"), ("x.csv", b"text\n\xff\xfe\n")],
)
def test_the_datasets_logger_names_no_path_of_the_users(
    tiny_model, tmp_path, caplog, capfd, monkeypatch, name, content
):
    """datasets logs a file it cannot read by its absolute path; while it reads for us it is
    silent (our one line names the file), asks the network nothing, and its own settings are
    restored after."""
    (tmp_path / name).write_bytes(content)
    caplog.set_level(logging.DEBUG)
    level = logging.getLogger("datasets").level
    asked = []  # hosts looked up: datasets swallows the error of a request that fails

    def lookup(host, *args, **kwargs):
        asked.append(host)
        raise OSError("no network here")

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    with pytest.raises(DataError) as info:
        hs.to_sequences(tiny_model, load_dataset_texts(tmp_path / name), seq_len=8)
    assert f"cannot read dataset {name} (" in str(info.value), info.value
    shown = [str(info.value), caplog.text, *capfd.readouterr()]
    assert not any(str(tmp_path) in text for text in shown), shown
    assert logging.getLogger("datasets").level == level
    assert not asked, asked


def test_a_folder_whose_data_file_is_no_file_says_which(tmp_path):
    for folder, make, kind in (
        ("loop", lambda p: p.symlink_to(p), "a symbolic link loop"),
        ("fifo", os.mkfifo, "a FIFO (named pipe)"),
    ):
        (tmp_path / folder).mkdir()
        make(tmp_path / folder / "train.jsonl")
        with pytest.raises(DataError, match=f"dataset file train.jsonl is {re.escape(kind)}"):
            load_dataset_texts(tmp_path / folder)
