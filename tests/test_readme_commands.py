"""Every command in the README is run: its tools' lines here, at a small size, and the rest
(install, docs, tests) by the CI, which runs them as written; every output line the README
quotes is printed, in the form it quotes, by the command it belongs to."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
COMMANDS = README.split("[start:commands]", 1)[1].split("[end:commands]", 1)[0]

# Appended to each tool's command (a later option wins): the same run on less text.
SMALL = {
    "classify": ["--n-seqs", "8", "--seq-len", "64"],
    "repair": ["--seq-len", "32", "--n-seqs", "8", "--train-seq-len", "32"],
    "blindness": [],
}
SMALL["repair"] += ["--n-eval-seqs", "4", "--steps", "2", "--batch-size", "4"]
MEASURED = ["--seq-len", "64"]  # blindness --measure


def bash_lines() -> list[str]:
    """Every command line of the README's bash blocks, comments removed."""
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    lines = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line]


def tool_lines() -> list[str]:
    return [line for line in bash_lines() if line.startswith("python -m headsurgeon ")]


def quoted_form(quote: str) -> re.Pattern:
    """The README's quoted line as a pattern: any numbers, labels and head names where it
    shows some, anything where it writes ``...``."""
    pattern = re.escape(quote.removesuffix("...").rstrip(". "))
    pattern = re.sub(r"L\d+H\d+", r"L\\d+H\\d+", pattern)
    pattern = re.sub(r"BOS\\-sink|dead", "(?:BOS-sink|dead)", pattern)
    return re.compile(re.sub(r"\d+(?:\\\.\d+)?", r"\\d+(?:\\.\\d+)?", pattern))


def quotes(tool: str) -> list[str]:
    """The output lines the README quotes for ``tool``'s item of the commands' list."""
    items = re.findall(r"^\d+\. \*\*([a-z ]+)\*\*(.*?)(?=^\d+\. |\Z)", COMMANDS, re.S | re.M)
    said = " ".join(text for name, text in items if name.split()[0] == tool)
    found = re.findall(r"(?:prints, among its lines,|ends with)\s+`([^`]+)`", said)
    return [re.sub(r"\s+", " ", quote) for quote in found]  # a quote may wrap in the README


def test_every_other_readme_command_is_one_the_ci_runs():
    others = [line for line in bash_lines() if line not in tool_lines()]
    assert others, "the README's install, docs and test commands"
    for line in others:
        # The install's lines: tests/test_readme_install.py holds them equal to the CI's.
        if not line.startswith(("pip install", "python -m pip install", "python3 -m venv")):
            assert line in CI, line


def test_the_quotes_are_found():
    assert quotes("classify") and quotes("repair"), "the README quotes what these print"


@pytest.mark.slow  # a subprocess each
@pytest.mark.parametrize("line", tool_lines(), ids=lambda line: " ".join(line.split()[3:5]))
def test_each_readme_tool_command_runs_and_prints_what_the_readme_quotes(line, tmp_path):
    words = shlex.split(line)
    tool = words[3]
    small = SMALL[tool] + (MEASURED if "--measure" in words else []) + ["--threads", "1"]
    done = subprocess.run(
        [sys.executable, *words[1:], *small],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-2000:]
    for quote in quotes(tool):
        assert quoted_form(quote).search(output), f"{quote!r} not in:\n{output[-3000:]}"


def test_the_readme_stays_short():
    """A first page, not a manual: the manual is docs/ (issue 52 asked for under 120 lines)."""
    assert len(README.splitlines()) < 120
