"""torch's threads on a busy machine (issue 52 item 2): the command line lowers its default to
the cores other jobs leave free and says so in one line; the library warns once, naming the fix,
and changes nothing. The load and the cores are injected: no real load is needed."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from headsurgeon import allocator
from headsurgeon.allocator import free_cores, too_many_threads, usable_cores
from headsurgeon.cli import loads
from headsurgeon.finetune import trainer


@pytest.fixture()
def busy(monkeypatch):
    """A 2-core machine at load 4.6; torch at 2 threads (put back after)."""
    monkeypatch.setattr(allocator, "usable_cores", lambda: 2)
    monkeypatch.setattr(allocator, "other_load", lambda: 4.6)
    monkeypatch.setattr(trainer, "_WARNED_THREADS", set())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_free_cores_are_the_usable_ones_less_the_rounded_load():
    assert free_cores(cores=2, load=4.6) == 1  # at least one
    assert free_cores(cores=8, load=2.4) == 6
    assert free_cores(cores=2, load=0.3) == 2


def test_the_cgroup_quota_caps_the_usable_cores(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 cores: 2 threads
    assert usable_cores(tmp_path) == min(2, usable_cores())
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(tmp_path) == usable_cores()


def test_one_thread_always_fits_and_two_do_not_on_a_busy_machine(busy):
    assert too_many_threads(1) is None
    assert too_many_threads(2) == (1, "other jobs keep 2 of the 2 usable cores busy (load 4.6)")


def test_the_command_line_lowers_its_default_and_names_threads_in_one_line(busy, caplog):
    with caplog.at_level(logging.INFO, logger="headsurgeon"):
        loads.use_threads(argparse.Namespace(threads=None))
    assert torch.get_num_threads() == 1
    [line] = [r.getMessage() for r in caplog.records]
    assert line == (
        "other jobs keep 2 of the 2 usable cores busy (load 4.6): torch uses 1 thread, not 2 "
        "(--threads N sets the count)"
    )


def test_threads_given_are_used_as_given(busy, caplog):
    with caplog.at_level(logging.INFO, logger="headsurgeon"):
        loads.use_threads(argparse.Namespace(threads=2))
    assert torch.get_num_threads() == 2 and not caplog.records


def test_the_library_warns_once_and_leaves_the_thread_count_alone(busy, caplog):
    with caplog.at_level(logging.WARNING, logger="headsurgeon"):
        trainer.warn_busy_threads()
        trainer.warn_busy_threads()
    assert torch.get_num_threads() == 2
    [line] = [r.getMessage() for r in caplog.records]
    assert "other jobs keep 2 of the 2 usable cores busy (load 4.6)" in line
    assert "torch.set_num_threads(1)" in line


def test_an_idle_machine_hears_nothing(busy, monkeypatch, caplog):
    monkeypatch.setattr(allocator, "other_load", lambda: 0.2)
    with caplog.at_level(logging.INFO, logger="headsurgeon"):
        loads.use_threads(argparse.Namespace(threads=None))
        trainer.warn_busy_threads()
    assert torch.get_num_threads() == 2 and not caplog.records


def test_the_measured_load_is_a_number_of_cores():
    assert 0 <= allocator.other_load(sample=0.05)
