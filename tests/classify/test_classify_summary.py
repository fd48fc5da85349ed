"""The classify summary names what a reader looks for first (issue 52 item 4): every sick head
with its label, a head table that cannot leave one out, the text it read; and a sample asked
larger than the text is one warning line, whatever the text's source."""

from __future__ import annotations

import json
import logging

import pytest

import headsurgeon as hs
from headsurgeon.cli.classify import main

# organism-injured's six planted injuries (docs/organisms.md), as the summary names them.
PLANTED = (
    "sick heads (6): L1H7 BOS-sink, L1H12 BOS-sink, L2H10 BOS-sink, L2H14 dead, "
    "L3H4 dead (output share 0.000), L3H15 dead"
)


def _classify(tmp_path, *argv):
    out = tmp_path / "out"
    assert main([*argv, "--seq-len", "64", "--no-secondary-sinks", "--out", str(out)]) == 0
    return (out / "summary.txt").read_text().splitlines()


def test_the_summary_names_every_sick_head_and_lists_them_first(tmp_path, capsys):
    summary = _classify(tmp_path, "organism-injured", "--n-seqs", "4")
    assert summary == capsys.readouterr().out.splitlines()[: len(summary)]
    assert summary[0].startswith(
        "organism-injured: 4 layers x 16 heads, 4 sequences x 64 tokens of bundled held-out "
        "corpora (shakespeare, python-docs), position 0 = "
    )
    assert PLANTED in summary
    # L3H4 is dead by its output share, with a low BOS mass: a table by BOS mass alone missed it.
    start = next(i for i, x in enumerate(summary) if x.startswith("top 10 heads: the sick")) + 2
    rows = [line.split() for line in summary[start : start + 10]]
    assert [row[-1] for row in rows[:6]] == ["dead"] * 2 + ["BOS-sink"] * 3 + ["dead"]
    assert {(r[0], r[1]) for r in rows[:6]} == {
        ("1", "7"), ("1", "12"), ("2", "10"), ("2", "14"), ("3", "4"), ("3", "15")
    }  # fmt: skip
    assert all(row[-1] == "healthy" for row in rows[6:])


def test_more_sequences_than_the_text_holds_is_one_warning_naming_all_three(tmp_path, caplog):
    rows = [
        {"text": f"Row {i}: the quick brown fox jumps over the lazy dog. " * 8} for i in range(6)
    ]
    folder = tmp_path / "private" / "my-set"
    folder.mkdir(parents=True)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING, logger="headsurgeon"):
        summary = _classify(
            tmp_path, "organism-injured", "--dataset", str(folder), "--n-seqs", "100000"
        )
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert warned[0].startswith(
        "asked for 100000 sequences of 64 tokens, but the text (dataset my-set, split train, "
        "column text, revision "
    )
    held = int(warned[0].split("holds only ")[1].split(":")[0])
    assert 0 < held < 100 and warned[0].endswith(f": using those {held}")
    assert f"{held} sequences x 64 tokens of dataset my-set, split train, column text" in summary[0]
    assert str(tmp_path) not in "\n".join(summary) and "private" not in summary[0]


def test_texts_files_and_the_bundled_corpora_reach_the_same_warning(tmp_path, caplog):
    text = tmp_path / "notes.txt"
    text.write_text("A short note that holds a few windows of tokens. " * 20)
    model = hs.load_model("organism-injured")
    with caplog.at_level(logging.WARNING, logger="headsurgeon"):
        hs.to_sequences(model, [text], seq_len=64, n_seqs=1000)
        hs.to_sequences(model, seq_len=4096, n_seqs=1000)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2
    assert warned[0].startswith("asked for 1000 sequences of 64 tokens, but the text (notes.txt)")
    assert warned[1].startswith(
        "asked for 1000 sequences of 4096 tokens, but the text (bundled held-out corpora"
    )


@pytest.mark.parametrize("n_seqs", [None, 2])
def test_no_warning_when_the_text_holds_what_was_asked(caplog, n_seqs):
    model = hs.load_model("organism-injured")
    with caplog.at_level(logging.WARNING, logger="headsurgeon"):
        hs.to_sequences(model, ["some text " * 100], seq_len=16, n_seqs=n_seqs)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
