"""Shared command-line options (headsurgeon.cli)."""

from __future__ import annotations

import argparse

import pytest
import torch

from headsurgeon.cli import add_model_args


@pytest.fixture()
def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tool")
    add_model_args(parser)
    return parser


def test_threads_flag_sets_torch_threads(parser):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert parser.parse_args([]).threads is None
        assert torch.get_num_threads() == 2  # untouched without the flag
        assert parser.parse_args(["--threads", "1"]).threads == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_threads_flag_rejects_non_positive_counts_in_one_line(parser, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--threads", value])
    assert exit_info.value.code == 2
    assert f"expected a positive integer, got '{value}'" in capsys.readouterr().err
