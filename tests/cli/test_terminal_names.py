"""Names with terminal escape codes (issue 41, terminals): a model folder, corpus file or output
folder named with ESC, BEL or a bidirectional override prints its name escaped, in every line the
tools write (summary, log lines, error lines), and never sends the codes to the terminal."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from conftest import TEXT, error_line

import headsurgeon.cli.classify
from headsurgeon.errors import shown

HOSTILE = "m\x1b[31mred\x07\u202e"
ESCAPED = "m\\x1b[31mred\\x07\\u202e"
RAW = ("\x1b", "\x07", "\u202e")


def test_shown_escapes_what_moves_the_terminal_and_keeps_the_rest():
    assert shown(HOSTILE) == ESCAPED
    assert shown("modèle 模型\n\tok") == "modèle 模型\n\tok"
    assert shown("a\nb\x9b2J", keep="") == "a\\nb\\x9b2J"  # C1 CSI too
    assert shown(shown(HOSTILE)) == ESCAPED  # escaping twice changes nothing


@pytest.mark.slow  # a subprocess: the tool's own logging and printing, as a terminal gets them
def test_a_hostile_model_folder_and_corpus_reach_the_terminal_escaped(bloom_dir, tmp_path):
    folder = tmp_path / HOSTILE
    shutil.copytree(bloom_dir, folder)
    texts = tmp_path / f"corpus{HOSTILE}.txt"
    texts.write_text(TEXT)
    argv = [folder, "--texts", texts, "--seq-len", "16", "--n-seqs", "2", "--out", tmp_path / "o"]
    done = subprocess.run(
        [sys.executable, "-m", "headsurgeon", "classify", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    for stream in (done.stdout, done.stderr):
        assert not any(code in stream for code in RAW), stream
    assert ESCAPED in done.stdout  # the summary names the model by its (escaped) folder name


def test_error_lines_show_a_hostile_name_escaped(tmp_path, capsys):
    texts = tmp_path / "text.txt"
    texts.write_text(TEXT)
    missing = tmp_path / f"{HOSTILE}\nerror: forged"
    line = error_line(headsurgeon.cli.classify.main, [missing, "--texts", texts], capsys)
    assert ESCAPED + "\\nerror: forged" in line and not any(code in line for code in RAW)
    # argparse's own error line (a bad option value) too.
    line = error_line(headsurgeon.cli.classify.main, ["--dtype", HOSTILE], capsys)
    assert ESCAPED in line and not any(code in line for code in RAW)
