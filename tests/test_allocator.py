"""headsurgeon.allocator: freed large buffers stay with the process (glibc only)."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

# Allocate and free a 256 MiB tensor; print the resident memory (MiB) before and after the free.
PROGRAM = """
import os, sys, torch
from headsurgeon.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
x = torch.ones(64 * 2**20)
held = rss()
del x
print(held, rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc behaviour")
@pytest.mark.slow  # a subprocess
def test_freed_buffers_stay_mapped_only_when_asked():
    if ctypes.util.find_library("c") is None:
        pytest.skip("no C library found")

    def held_and_after(mode: str) -> tuple[float, float]:
        out = subprocess.run(
            [sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True
        )
        held, after = map(float, out.stdout.split())
        return held, after

    held, after = held_and_after("default")
    assert held - after > 200  # glibc unmapped the buffer on free
    held, after = held_and_after("keep")
    assert held - after < 10  # kept for the next allocation


# Free a 16 MiB buffer twice: glibc's first unmap raises its mmap threshold above 16 MiB, so by
# default the second buffer comes from the heap and stays with the process when freed.
REUSED = """
import os, sys, torch
from headsurgeon.allocator import keep_freed_memory, return_freed_memory
if sys.argv[1] == "return":
    assert keep_freed_memory() and return_freed_memory()  # the second undoes the first
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
torch.ones(4 * 2**20).sum()  # allocated and freed once
x = torch.ones(4 * 2**20)
held = rss()
del x
print(held, rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc behaviour")
@pytest.mark.slow  # a subprocess
def test_returned_memory_goes_back_even_below_the_rising_threshold():
    if ctypes.util.find_library("c") is None:
        pytest.skip("no C library found")

    def freed(mode: str) -> float:
        out = subprocess.run(
            [sys.executable, "-c", REUSED, mode], capture_output=True, text=True, check=True
        )
        held, after = map(float, out.stdout.split())
        return held - after

    assert freed("default") < 4  # the rising threshold kept the 16 MiB buffer
    assert freed("return") > 12  # fixed at 128 KiB: unmapped on free


def test_a_memory_budget_returns_freed_memory(monkeypatch):
    import headsurgeon as hs
    from headsurgeon.loading import loaders

    calls = []
    monkeypatch.setattr(loaders, "return_freed_memory", lambda: calls.append(1) or True)
    hs.load_model("organism")
    assert calls == []
    hs.load_model("organism", max_memory={"cpu": "1GiB"})
    assert calls == [1]
