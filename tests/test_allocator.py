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
