"""Shared command-line options (headsurgeon.cli)."""

from __future__ import annotations

import argparse
import importlib
import runpy
import sys

import pytest
import torch

from headsurgeon.cli import add_model_args


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


# --- the entries: python -m headsurgeon TOOL, python -m headsurgeon.TOOL, headsurgeon-TOOL --------


@pytest.mark.parametrize("tool", ["classify", "blindness", "repair"])
def test_every_entry_of_a_tool_reaches_its_main_with_the_same_arguments(tool, monkeypatch):
    """``python -m headsurgeon TOOL ARGS``, ``python -m headsurgeon.TOOL ARGS`` and the console
    script ``headsurgeon-TOOL ARGS`` call the one ``headsurgeon.cli.TOOL.main`` with ARGS."""
    module = importlib.import_module(f"headsurgeon.cli.{tool}")
    calls = []
    monkeypatch.setattr(module, "main", lambda argv: calls.append(list(argv)))
    monkeypatch.setenv("HEADSURGEON_KEEP_FREED_MEMORY", "0")
    args = ["organism-injured", "--out", "A"]
    entries = {  # sys.argv as each entry sees it, and how Python starts it
        "python -m headsurgeon": (["-m", tool, *args], "headsurgeon"),
        "python -m headsurgeon.TOOL": (["-m", *args], f"headsurgeon.{tool}"),
        "console script": ([f"headsurgeon-{tool}", *args], None),
    }
    for name, (argv, package) in entries.items():
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as exit:
            runpy.run_module(package, run_name="__main__") if package else module.entry()
        assert exit.value.code == 0, name
    assert calls == [args, args, args]


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


def test_importing_the_cli_outside_a_tool_installs_no_ctrl_c_handler():
    """Only a starting tool (an entry, a console script) gets the one-line Ctrl-C handler; a
    notebook or a test that imports ``headsurgeon.cli`` keeps Python's own."""
    import signal

    import headsurgeon.cli

    assert not headsurgeon.cli._starting_a_tool()
    assert signal.getsignal(signal.SIGINT) is not headsurgeon.cli._interrupted_while_starting
