"""Shared command-line options (headsurgeon.cli)."""

from __future__ import annotations

import argparse
import importlib
import runpy
import signal
import subprocess
import sys

import pytest
import torch

from headsurgeon import cli
from headsurgeon.cli.options import add_model_args


@pytest.fixture()
def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tool")
    add_model_args(parser)
    return parser


def test_threads_flag_sets_torch_threads_once_the_work_begins(parser, monkeypatch):
    from headsurgeon.cli import loads
    from headsurgeon.cli.loads import use_threads

    monkeypatch.setattr(loads, "too_many_threads", lambda threads: None)  # an idle machine
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        use_threads(parser.parse_args([]))
        assert torch.get_num_threads() == 2  # untouched without the flag
        args = parser.parse_args(["--threads", "1"])
        assert args.threads == 1 and torch.get_num_threads() == 2  # parsing imports no torch
        use_threads(args)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_threads_flag_rejects_non_positive_counts_in_one_line(parser, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--threads", value])
    assert exit_info.value.code == 2
    assert f"expected a positive thread count, got '{value}'" in capsys.readouterr().err


# --- the entries: python -m headsurgeon TOOL, headsurgeon-TOOL (python -m headsurgeon.TOOL warns)


@pytest.mark.parametrize("tool", ["classify", "blindness", "repair"])
def test_every_entry_of_a_tool_reaches_its_main_with_the_same_arguments(tool, monkeypatch, capsys):
    """``python -m headsurgeon TOOL ARGS`` and the console script ``headsurgeon-TOOL ARGS`` call
    the one ``headsurgeon.cli.TOOL.main`` with ARGS; so does the deprecated ``python -m
    headsurgeon.TOOL ARGS``, after one line on stderr naming the new form."""
    module = importlib.import_module(f"headsurgeon.cli.{tool}")
    calls = []
    monkeypatch.setattr(module, "main", lambda argv: calls.append(list(argv)))
    monkeypatch.setenv("HEADSURGEON_KEEP_FREED_MEMORY", "0")
    args = ["organism-injured", "--out", "A"]
    entries = {  # sys.argv as each entry sees it, and how Python starts it
        "python -m headsurgeon": (["-m", tool, *args], "headsurgeon"),
        "console script": ([f"headsurgeon-{tool}", *args], None),
        "python -m headsurgeon.TOOL": (["-m", *args], f"headsurgeon.{tool}"),
    }
    errors = []
    for name, (argv, package) in entries.items():
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as exit:
            runpy.run_module(package, run_name="__main__") if package else module.entry()
        assert exit.value.code == 0, name
        errors.append(capsys.readouterr().err)
    assert calls == [args, args, args]
    assert errors[:2] == ["", ""]
    assert errors[2].count("\n") == 1
    assert f"python -m headsurgeon.{tool} is deprecated" in errors[2]
    assert f"use python -m headsurgeon {tool} " in errors[2]


def test_run_installs_the_starting_handlers_and_gives_them_back_when_no_work_began(
    monkeypatch,
):
    """``run`` (not an import) installs the one-line Ctrl-C and SIGTERM handlers of a starting
    tool; a run that ends before its work began (``--help``, a refusal) puts the caller's back."""
    monkeypatch.setenv("HEADSURGEON_KEEP_FREED_MEMORY", "0")
    signals = (signal.SIGINT, signal.SIGTERM)
    during = []
    tool = importlib.import_module("headsurgeon.cli.classify")
    monkeypatch.setattr(
        tool, "main", lambda argv: during.append([signal.getsignal(s) for s in signals])
    )
    # Python's defaults, whatever the suite inherited: a suite run as a background job has
    # SIGINT ignored, and run rightly leaves an ignored signal alone.
    inherited = [signal.signal(signal.SIGINT, signal.default_int_handler)]
    inherited.append(signal.signal(signal.SIGTERM, signal.SIG_DFL))
    try:
        before = [signal.getsignal(s) for s in signals]
        with pytest.raises(SystemExit) as exit:
            cli.run("classify", [])
        after = [signal.getsignal(s) for s in signals]
    finally:
        for signum, handler in zip(signals, inherited, strict=True):
            signal.signal(signum, handler)
    assert exit.value.code == 0
    assert during == [[cli._interrupted_while_starting] * 2]
    assert after == before


@pytest.mark.slow  # a subprocess
def test_importing_the_cli_installs_no_handler_even_in_a_console_script():
    code = (
        "import signal, sys; sys.argv[0] = 'headsurgeon-classify'; "
        "before = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]; "
        "import headsurgeon.cli.classify; "
        "print(before == [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "True", done.stderr


@pytest.mark.parametrize("argv", [[], ["nope"], ["--classify"]])
def test_python_m_headsurgeon_without_a_known_tool_is_one_usage_line(argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["-m", *argv])
    with pytest.raises(SystemExit) as exit:
        runpy.run_module("headsurgeon", run_name="__main__")
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "python -m headsurgeon {classify,blindness,repair}" in err


def test_python_m_headsurgeon_help_lists_the_tools_and_version_prints_it(monkeypatch, capsys):
    from importlib.metadata import version

    for flag in ("--help", "--version"):
        monkeypatch.setattr(sys, "argv", ["-m", flag])
        with pytest.raises(SystemExit) as exit:
            runpy.run_module("headsurgeon", run_name="__main__")
        assert exit.value.code == 0
    out = capsys.readouterr().out
    assert all(f"  {tool} " in out for tool in ("classify", "blindness", "repair"))
    assert out.endswith(f"headsurgeon {version('headsurgeon')}\n")
