"""The process's CPU memory: allocator tuning (keep large freed buffers in the process, or give
them back at once), and how much it may still allocate; and its CPU cores: how many it may use,
and how many of them other jobs leave free (torch's thread count).

glibc serves every allocation above its mmap threshold (128 KiB, rising to at most 32 MiB as
buffers are freed) with a fresh ``mmap`` and unmaps it again on free. A transformer step
allocates and frees attention-sized buffers (batch x head x query x key floats) many times over,
so every step page-faults the same memory back in; keeping the buffers makes a fine-tuning step
faster, and memory, once used, stays with the process until it exits. The command-line tools call
:func:`keep_freed_memory` unless ``HEADSURGEON_KEEP_FREED_MEMORY=0``; in a notebook, call it
once before long runs.

A model given a memory budget (:func:`headsurgeon.load_model` with ``device_map`` or
``max_memory``) calls :func:`return_freed_memory` instead: memory is then the constraint, and
glibc's rising threshold would otherwise keep on its heap the freed buffers of a part-by-part
load and every freed weight copy of an offloaded block. The measured effect of each:
[Sizes and memory: CPU speed](../sizes-and-memory.md#cpu-speed) and
[a checkpoint larger than its memory](../sizes-and-memory.md#a-checkpoint-larger-than-its-memory).

Usage::

    from headsurgeon.allocator import keep_freed_memory
    keep_freed_memory()  # False (and nothing changed) off glibc, e.g. macOS
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
import time
from pathlib import Path

__all__ = [
    "available_memory",
    "keep_freed_memory",
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


CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as the largest page-aligned int64, not as a word.
_NO_LIMIT = 2**62


def available_memory(cgroup_root: str | os.PathLike = CGROUP_ROOT) -> int | None:
    """The bytes this process may still allocate on the CPU: the least of the system's
    ``MemAvailable``, what its address-space limit leaves (``RLIMIT_AS``, as clusters set with
    ``ulimit -v``, less the address space in use) and what its memory cgroup leaves (v2
    ``memory.max - memory.current``, v1 ``memory.limit_in_bytes - memory.usage_in_bytes``, its
    own cgroup's and every parent's under ``cgroup_root``); None where none of them says.

    >>> available_memory() is None or available_memory() >= 0
    True
    """
    known = [
        left
        for left in (_meminfo_available(), _address_space_left(), _cgroup_left(Path(cgroup_root)))
        if left is not None
    ]
    return max(0, min(known)) if known else None


def _proc_fields(path: str) -> dict[str, str] | None:
    """``Name: value`` lines of a /proc file, or None where it cannot be read."""
    try:
        with open(path) as f:
            return dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None


def _meminfo_available() -> int | None:
    fields = _proc_fields("/proc/meminfo") or {}
    try:
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (KeyError, ValueError, IndexError):
        return None


def _address_space_left() -> int | None:
    """``RLIMIT_AS``'s soft limit less this process's address space (``VmSize``)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    fields = _proc_fields("/proc/self/status") or {}
    try:
        used = int(fields["VmSize"].split()[0]) * 1024
    except (KeyError, ValueError, IndexError):
        used = 0
    return limit - used


def _own_cgroups(root: Path, controller: str) -> list[tuple[str, Path]]:
    """This process's cgroup folders for ``controller``: ("v2", folder) and ("v1", folder),
    each its own cgroup first, then each parent."""
    own = {"v2": "/", "v1": "/"}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    own["v2"] = path
                elif controller in controllers.split(","):
                    own["v1"] = path
    except (OSError, ValueError):
        pass
    folders = []
    for version, base in (("v2", root), ("v1", root / controller)):
        parts = [p for p in own[version].split("/") if p and p != ".."]
        for depth in range(len(parts), -1, -1):  # own cgroup first, then each parent
            folders.append((version, base.joinpath(*parts[:depth])))
    return folders


def _cgroup_left(root: Path) -> int | None:
    """The least a memory cgroup of this process leaves: its own and each parent's."""
    lefts = []
    for version, folder in _own_cgroups(root, "memory"):
        files = (
            ("memory.max", "memory.current")
            if version == "v2"
            else ("memory.limit_in_bytes", "memory.usage_in_bytes")
        )
        limit, used = (_read_int(folder / name) for name in files)
        if limit is not None and limit < _NO_LIMIT:
            lefts.append(limit - (used or 0))
    return min(lefts) if lefts else None


def usable_cores(cgroup_root: str | os.PathLike = CGROUP_ROOT) -> int:
    """The cores this process may run on: its CPU affinity (``taskset``, a scheduler's
    allocation), capped by its cgroup's CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``,
    rounded up), at least 1.

    >>> usable_cores() >= 1
    True
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on macOS or Windows
        cores = os.cpu_count() or 1
    for version, folder in _own_cgroups(Path(cgroup_root), "cpu"):
        if version == "v2":
            quota, period = _read_fields(folder / "cpu.max")
        else:
            quota = _read_int(folder / "cpu.cfs_quota_us")
            period = _read_int(folder / "cpu.cfs_period_us")
        if quota is not None and quota > 0 and period:
            cores = min(cores, math.ceil(quota / period))
    return max(1, cores)


def _read_fields(path: Path) -> tuple[int | None, int | None]:
    """The two integers of a cgroup v2 file such as ``cpu.max`` (``max`` is None)."""
    try:
        words = path.read_text().split()
    except OSError:
        return None, None
    values = [int(w) if w.isdigit() else None for w in words[:2]]
    return (values + [None, None])[0], (values + [None, None])[1]


def _busy_jiffies() -> tuple[int, int] | None:
    """Clock ticks the machine's CPUs spent busy, and this process: /proc/stat's first line
    (all but idle and iowait), /proc/self/stat's user and system time."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    return sum(fields) - fields[3] - fields[4], int(own[11]) + int(own[12])


def other_load(sample: float = 0.25) -> float:
    """How many cores other jobs keep busy: the 1-minute load average, or, when lower, the busy
    cores measured over ``sample`` seconds less this process's own use then (the load average
    also counts this process's last minute, e.g. a census just run in the same notebook).
    0 where neither can be read.

    >>> other_load() >= 0
    True
    """
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on Windows
        load = 0.0
    before = _busy_jiffies()
    if before is None or round(load) == 0:  # idle: no need to measure (a quarter second)
        return load
    started = time.monotonic()
    time.sleep(sample)
    after = _busy_jiffies()
    if after is None:
        return load
    ticks = (time.monotonic() - started) * os.sysconf("SC_CLK_TCK")
    measured = ((after[0] - before[0]) - (after[1] - before[1])) / ticks
    return max(0.0, min(load, measured))


def free_cores(cores: int | None = None, load: float | None = None) -> int:
    """The usable cores other jobs leave free: ``cores`` (default :func:`usable_cores`) less
    the rounded ``load`` (default :func:`other_load`), at least 1: torch's thread count that
    does not make threads wait on busy cores (each step waits for its slowest thread)."""
    cores = usable_cores() if cores is None else cores
    load = other_load() if load is None else load
    return max(1, cores - round(load))


def too_many_threads(threads: int) -> tuple[int, str] | None:
    """None when ``threads`` fit the cores other jobs leave free (one thread always does);
    else (:func:`free_cores`, why: ``"other jobs keep 2 of the 2 usable cores busy (load
    4.6)"``)."""
    if threads <= 1:
        return None
    cores, load = usable_cores(), other_load()
    free = free_cores(cores, load)
    if threads <= free:
        return None
    busy = min(cores, round(load))
    return free, f"other jobs keep {busy} of the {cores} usable cores busy (load {load:.1f})"


def _read_int(path: Path) -> int | None:
    """The integer a cgroup file holds, or None (missing, unreadable, ``max``)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
