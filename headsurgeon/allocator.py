"""CPU allocator tuning: keep large freed buffers in the process, or give them back at once.

Exports:
    keep_freed_memory()     raise glibc's mmap and trim thresholds; True where applied
    return_freed_memory()   fix them at glibc's defaults: freed buffers go back to the system
    allocator_setting()     which of the two this process applied last ("keep", "return"), or
                            None: neither (glibc's own defaults)
    restore_setting(s)      apply what allocator_setting() returned earlier

glibc serves every allocation above its mmap threshold (128 KiB, rising to at most 32 MiB as
buffers are freed) with a fresh ``mmap`` and unmaps it again on free. A transformer step
allocates and frees attention-sized buffers (batch x head x query x key floats) many times over,
so every step page-faults the same memory back in. Keeping the buffers makes a masked
fine-tuning step of the bundled 4-layer organism (8 x 256 tokens, one thread) about 1.5x faster
here (1.6 s -> 1.1 s). The price: memory, once used, stays with the process until it exits (its
peak grew from 0.41 to 0.61 GiB above the model in that step). The command-line tools call
:func:`keep_freed_memory` unless ``HEADSURGEON_KEEP_FREED_MEMORY=0``; in a notebook, call it
once before long runs.

A model given a memory budget (:func:`headsurgeon.load_model` with ``device_map`` or
``max_memory``) calls :func:`return_freed_memory` instead: memory is then the constraint, and
glibc's rising threshold would otherwise keep on its heap the freed buffers of a part-by-part
load and every freed weight copy of an offloaded block (a few tens of MiB each, read from disk at
each forward). On a 24-layer, 1024-wide
float16 checkpoint given 300 MiB, the 3.x census peaked at 1.11 GiB anonymous with the rising
threshold and at 0.58 GiB with it fixed (``analyses/benchmarks/offload.py``).

Usage::

    from headsurgeon.allocator import keep_freed_memory
    keep_freed_memory()  # False (and nothing changed) off glibc, e.g. macOS
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = [
    "allocator_setting",
    "keep_freed_memory",
    "restore_setting",
    "return_freed_memory",
]

logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
_INT_MAX = 2**31 - 1  # mallopt takes an int
_GLIBC_DEFAULT = 128 * 2**10  # the three thresholds' defaults (mallopt(3))
# glibc has no getter for the thresholds: what this module set last ("keep", "return" or None).
_applied: str | None = None


def _mallopt(settings: tuple[tuple[int, int], ...]) -> bool:
    """Apply glibc ``mallopt`` settings; ``False`` where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # no C library found, or not glibc
        return False
    return all(mallopt(param, value) for param, value in settings)


def keep_freed_memory() -> bool:
    """Have glibc keep freed buffers up to 2 GiB for reuse; ``False`` where there is no glibc.

    Sets ``M_MMAP_THRESHOLD`` (heap, not ``mmap``, below 2 GiB), ``M_TRIM_THRESHOLD`` (never
    give the heap's free top back) and ``M_TOP_PAD`` (grow the heap 256 MiB at a time). Affects
    the whole process and every later allocation; idempotent.
    """
    applied = _mallopt(
        ((M_MMAP_THRESHOLD, _INT_MAX), (M_TRIM_THRESHOLD, _INT_MAX), (M_TOP_PAD, 256 * 2**20))
    )
    logger.debug("glibc allocator thresholds raised: %s", applied)
    _record("keep", applied)
    return applied


def return_freed_memory() -> bool:
    """Have glibc give every freed buffer above 128 KiB back to the system; ``False`` where
    there is no glibc.

    Sets the mmap, trim and top-pad thresholds to glibc's defaults; setting them fixes them, so
    the mmap threshold no longer rises as buffers are freed (undoing :func:`keep_freed_memory`
    too). Affects the whole process and every later allocation; idempotent.
    """
    applied = _mallopt(
        (
            (M_MMAP_THRESHOLD, _GLIBC_DEFAULT),
            (M_TRIM_THRESHOLD, _GLIBC_DEFAULT),
            (M_TOP_PAD, _GLIBC_DEFAULT),
        )
    )
    logger.debug("glibc allocator thresholds fixed at their defaults: %s", applied)
    _record("return", applied)
    return applied


def _record(setting: str, applied: bool) -> None:
    global _applied
    if applied:
        _applied = setting


def allocator_setting() -> str | None:
    """What this process set last: ``"keep"`` (:func:`keep_freed_memory`), ``"return"``
    (:func:`return_freed_memory`), or None (neither: glibc's defaults, or no glibc)."""
    return _applied


def restore_setting(setting: str | None) -> None:
    """Apply ``setting`` (an earlier :func:`allocator_setting`) again, e.g. after a tool's run.

    None after a change puts the thresholds back at glibc's default values; glibc offers no way
    to turn their rise with freed buffers back on, so that one difference stays.
    """
    global _applied
    if setting == _applied:
        return
    if setting == "keep":
        keep_freed_memory()
    elif setting == "return" or _applied is not None:
        return_freed_memory()
    _applied = setting
