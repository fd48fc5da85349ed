"""The tools answer at once: ``--help``, usage errors, a bad ``--texts`` file, a missing MODEL
folder, an unknown model name and an output folder that may not be written are
answered before torch, TransformerLens, transformers, pandas or plotly is imported, by every entry
(``python -m headsurgeon TOOL``, the console script's ``headsurgeon.cli.TOOL:entry``); the
deprecated ``python -m headsurgeon.TOOL`` answers the same after one line naming the new form;
and every option's ``--help`` shows its help and default."""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from importlib.metadata import version

import pytest

from headsurgeon.cli.options import ArgumentParser, help_with_default, shown_default

TOOLS = ("classify", "blindness", "repair")
HEAVY = ("torch", "transformer_lens", "transformers", "pandas", "plotly")
# (arguments, exit status, what the one line says)
CASES = [
    (["--help"], 0, "usage:"),
    (["--no-such-option"], 2, "unrecognized arguments: --no-such-option"),
    (["--n-seqs", "0"], 2, "expected a positive integer"),
    (["--texts", "missing.txt"], 2, "text file missing.txt does not exist"),
    (["./no-such-folder"], 2, "model folder ./no-such-folder does not exist"),
    (["bloom-56m"], 2, "unknown model 'bloom-56m': did you mean bloom-560m"),
    (["--version"], 0, f"headsurgeon {version('headsurgeon')}\n"),  # as python -m headsurgeon's
]
# How each entry runs a tool with ARGS inside the child (runpy: as python -m does).
ENTRIES = {
    "python -m headsurgeon TOOL": (
        "sys.argv = ['headsurgeon', TOOL, *ARGS]; "
        "runpy.run_module('headsurgeon', run_name='__main__', alter_sys=True)"
    ),
    "headsurgeon-TOOL": "importlib.import_module('headsurgeon.cli.' + TOOL).entry(ARGS)",
}


def answers(entry: str, tool: str, cases: list[list[str]], cwd) -> tuple[list, list[str], str]:
    """Run each of ``cases`` through ``entry`` in one fresh interpreter: the exit statuses, the
    heavy modules loaded by the end, and stdout + stderr."""
    code = (
        "import importlib, runpy, sys\n"
        f"TOOL = {tool!r}\n"
        "codes = []\n"
        f"for ARGS in {cases!r}:\n"
        "    try:\n"
        f"        {ENTRIES[entry]}\n"
        "    except SystemExit as e:\n"
        "        codes.append(e.code)\n"
        f"print(codes, sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=300
    )
    *_, last = done.stdout.strip().splitlines()
    codes, heavy = last.split("] ", 1)
    return ast.literal_eval(codes + "]"), ast.literal_eval(heavy), done.stdout + done.stderr


@pytest.mark.slow  # subprocesses
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("tool", TOOLS)
def test_what_needs_no_model_is_answered_before_any_heavy_import(tool, entry, tmp_path):
    codes, heavy, output = answers(entry, tool, [args for args, _, _ in CASES], tmp_path)
    assert codes == [code for _, code, _ in CASES], output
    for _, _, said in CASES:
        assert said in output
    assert "Traceback" not in output
    assert heavy == [], f"{entry} ({tool}) imported {heavy} before answering"


@pytest.mark.slow  # subprocesses
def test_the_old_entry_warns_once_and_answers_as_the_new_one(tmp_path):
    """``python -m headsurgeon.TOOL``, for one release: one line on stderr naming ``python -m
    headsurgeon TOOL``, then the same answer and exit status. (classify here: its package imports
    pandas only; tests/cli/test_cli.py runs every tool's old entry in-process.)"""
    tool = "classify"
    for args, code, said in CASES[:3]:
        old, new = (
            subprocess.run(
                [sys.executable, "-m", *entry, *args],
                capture_output=True,
                text=True,
                cwd=tmp_path,
                timeout=300,
            )
            for entry in ([f"headsurgeon.{tool}"], ["headsurgeon", tool])
        )
        assert old.returncode == new.returncode == code, old.stderr
        warning, *rest = old.stderr.splitlines(keepends=True)
        assert f"python -m headsurgeon.{tool} is deprecated" in warning
        assert f"use python -m headsurgeon {tool} " in warning
        assert (old.stdout, "".join(rest)) == (new.stdout, new.stderr)
        assert said in new.stdout + new.stderr


@pytest.mark.slow  # a subprocess
@pytest.mark.parametrize("tool", TOOLS)
def test_an_output_folder_the_tool_may_not_write_is_refused_before_heavy_imports(tool, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("a file")
    cases = [["organism", "--out", "out"], ["organism", "--out", "file"]]
    codes, heavy, output = answers("python -m headsurgeon TOOL", tool, cases, tmp_path)
    assert codes == [2, 2] and "already holds files" in output and "is a file" in output, output
    assert heavy == []
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "out"]


@pytest.mark.slow  # a subprocess
def test_the_version_and_the_tool_list_need_no_heavy_import(tmp_path):
    code = (
        "import runpy, sys\n"
        "for argv in (['--version'], ['--help'], ['nope']):\n"
        "    sys.argv = ['headsurgeon', *argv]\n"
        "    try:\n"
        "        runpy.run_module('headsurgeon', run_name='__main__', alter_sys=True)\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith("headsurgeon ") and "unknown tool 'nope'" in done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow  # a subprocess
@pytest.mark.parametrize(
    "args",
    [
        ["classify", "bloom-560m"],
        ["repair", "bloom-560m"],
        ["blindness", "bloom-560m", "--measure"],
    ],
)
def test_a_hub_model_missing_from_the_cache_is_answered_before_any_heavy_import(args, tmp_path):
    """Offline with an empty cache: one line naming the model, the cache and how to get it, exit
    2, torch and TransformerLens never imported (it took 21-29 s after importing them)."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['headsurgeon', *{args!r}]\n"
        "try:\n"
        "    runpy.run_module('headsurgeon', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as e:\n"
        f"    print(e.code, sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.stdout.strip() == "2 []", done.stdout + done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("error: bigscience/bloom-560m is not in the Hugging Face cache")
    assert str(tmp_path / "hf" / "hub") in line and "HF_HUB_OFFLINE=1" in line
    assert "run once online" in line and "hf download bigscience/bloom-560m" in line
    assert "local checkpoint folder" in line


def parsers() -> dict[str, argparse.ArgumentParser]:
    import importlib

    return {tool: importlib.import_module(f"headsurgeon.cli.{tool}")._parser() for tool in TOOLS}


@pytest.mark.parametrize("tool", TOOLS)
def test_every_option_has_help_and_shows_its_default(tool):
    parser = parsers()[tool]
    assert isinstance(parser, ArgumentParser)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help, f"{tool} {name} has no help text"
        default = shown_default(action)
        if default is not None:
            assert default in help_with_default(action), f"{tool} {name} hides its default"
    text = " ".join(parser.format_help().split())
    assert "--sink-threshold" not in text or "(default: 0.5)" in text


def test_a_default_is_added_unless_the_help_names_it():
    parser = ArgumentParser(prog="tool")
    plain = parser.add_argument("--a", default=3, help="a count")
    named = parser.add_argument("--b", default=0.3, help="a share (default 0.3: Gu et al.'s)")
    listed = parser.add_argument("--c", nargs="+", default=["x", "y"], help="some")
    flag = parser.add_argument("--no-d", dest="d", action="store_false", help="skip d")
    percent = parser.add_argument("--e", default="5%", help="a share")
    zero = parser.add_argument("--f", type=int, default=0, help="a seed")
    assert help_with_default(plain) == "a count (default: 3)"
    assert help_with_default(named) == named.help
    assert help_with_default(listed) == "some (default: x y)"
    assert help_with_default(flag) == "skip d" and shown_default(flag) is None
    assert help_with_default(zero) == "a seed (default: 0)"
    assert "(default: 5%)" in " ".join(parser.format_help().split())
    assert help_with_default(percent).endswith("(default: 5%%)")  # argparse's % formatting
