"""Atomic writes and claimed output folders: outputs appear whole or not at all, one run each.

Exports:
    atomic_write_bytes(path, data)      write a file through a temporary file and a rename
    atomic_write_text(path, text)       the same for text
    atomic_directory(path, overwrite)   context manager: fill a temporary folder, then rename it
    check_output_dir(path, overwrite)   refuse a file, a non-empty folder (unless overwrite) or a
                                        location that cannot be created or written, before work
    claim_output(path, overwrite)       context manager: hold ``path`` for one run (a lock file
                                        beside it), after removing what a killed run left there

A folder that already holds files is never written into unless ``overwrite=True``: the old
folder is replaced only after the new one is complete, and without ``overwrite`` the final rename
fails rather than replace a folder that appeared meanwhile. An ``OSError`` while writing (a full
disk, a read-only folder) becomes one :class:`~headsurgeon.errors.OutputWriteError` line naming
the final path (never the hidden temporary one) and what to do.

>>> import tempfile, pathlib
>>> root = pathlib.Path(tempfile.mkdtemp())
>>> with claim_output(root / "out") as out, atomic_directory(out) as tmp:
...     _ = atomic_write_text(tmp / "a.txt", "hello")
>>> sorted(p.name for p in (root / "out").iterdir()), sorted(p.name for p in root.iterdir())
(['a.txt'], ['out'])
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

from headsurgeon.errors import (
    HeadsurgeonError,
    OutputBusyError,
    OutputExistsError,
    OutputWriteError,
)

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "check_output_dir",
    "atomic_directory",
    "claim_output",
]

logger = logging.getLogger(__name__)

_FIXES = {
    errno.ENOSPC: "free disk space (or choose a folder on another disk) and run again",
    errno.EDQUOT: "free space within your disk quota and run again",
    errno.EACCES: "choose a folder you can write to",
    errno.EPERM: "choose a folder you can write to",
    errno.EROFS: "the file system is read-only: choose a folder on a writable one",
    errno.ENAMETOOLONG: "choose a shorter name",
    errno.ENOTDIR: "a file stands where a folder is needed: choose another path",
}


def _sibling(path: Path, tag: str) -> Path:
    """A hidden, unused name beside ``path`` (same file system, so ``os.replace`` is atomic)."""
    return path.with_name(f".{path.name}.{tag}-{uuid.uuid4().hex[:12]}")


def _failed(error: OSError) -> Path | None:
    """The file an OS error (or an :class:`OutputWriteError` made of one) names, if any."""
    named = getattr(error, "target", None) or error.filename
    return Path(named) if named else None


def _write_error(
    error: OSError, path: Path, tmp: Path | None = None, verb: str = "could not write"
) -> OutputWriteError:
    """``error`` as one line naming the final file under ``path`` that failed and the fix.

    A file inside the temporary ``tmp`` is named by its place in ``path``, where it was going.
    The result keeps ``errno``, and the file and reason as ``target`` and ``reason``.
    """
    failed = _failed(error) or path
    if tmp is not None and failed.is_relative_to(tmp):
        failed = path / failed.relative_to(tmp)
    reason = getattr(error, "reason", None) or error.strerror or str(error)
    fix = _FIXES.get(error.errno, "fix the output location or choose another, then run again")
    converted = OutputWriteError(f"{verb} {failed}: {reason or type(error).__name__}; {fix}")
    converted.errno, converted.target, converted.reason = error.errno, failed, reason
    return converted


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temporary file in the same folder and ``os.replace``."""
    path = Path(path)
    tmp = _sibling(path, "tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # os.open applies the umask (mkstemp would make every output private, mode 0600).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    except OSError as e:
        if isinstance(e, HeadsurgeonError):
            raise
        raise _write_error(e, path, tmp) from e
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def _existing_ancestor(path: Path) -> Path:
    ancestor = path.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    return ancestor


def _check_location(path: Path) -> None:
    """Refuse a ``path`` that cannot be created: a file among its parents, a parent that is not
    writable, a name too long once the hidden temporary suffix is added."""
    ancestor = _existing_ancestor(path)
    if not ancestor.is_dir():
        raise OutputExistsError(f"cannot create {path}: {ancestor} is a file; choose a folder path")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputWriteError(
            f"cannot create {path}: {ancestor} is not writable (permissions or a read-only file "
            "system); choose a folder you can write to"
        )
    try:
        longest = os.pathconf(ancestor, "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    missing = path.absolute().relative_to(ancestor).parts
    hidden = len(path.name) + 18  # its temporary twin, .NAME.tmp-<12 hex digits>, is longest
    if any(len(part) > longest for part in missing) or hidden > longest:
        raise OutputWriteError(
            f"cannot create {path}: a name in it is too long for the file system (at most "
            f"{longest - 18} characters here); choose a shorter name"
        )


def check_output_dir(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Raise unless ``path`` can become a new output folder; return it as a ``Path``.

    :class:`OutputExistsError` for a file at ``path`` or among its parents, or a non-empty folder
    (unless ``overwrite``); :class:`~headsurgeon.errors.OutputWriteError` for a location that
    cannot be created or written (a parent without write permission, a read-only file system, a
    name too long). Nothing is created.
    """
    path = Path(path)
    try:
        if path.exists() and not path.is_dir():
            raise OutputExistsError(f"output path {path} is a file; choose a folder name")
        if path.is_dir() and any(path.iterdir()) and not overwrite:
            raise OutputExistsError(
                f"output folder {path} already holds files; choose another folder or pass "
                "overwrite=True (--overwrite on the command line)"
            )
        _check_location(path)
    except OSError as e:
        if isinstance(e, HeadsurgeonError):
            raise
        raise _write_error(e, path, verb="cannot create") from e
    return path


def _move_into_place(tmp: Path, path: Path, overwrite: bool) -> None:
    """Rename the finished ``tmp`` to ``path``; the old folder is replaced only if ``overwrite``."""
    if not overwrite:
        try:  # rename replaces nothing but an empty folder: a folder that appeared is kept
            os.replace(tmp, path)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
            raise OutputExistsError(
                f"{path} appeared while this run wrote it (another run?) and was kept; choose "
                "another folder or pass overwrite=True (--overwrite)"
            ) from e
        return
    old = None
    if path.exists():
        old = _sibling(path, "old")
        os.replace(path, old)
    try:
        os.replace(tmp, path)
    except BaseException:
        if old is not None:
            os.replace(old, path)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``path``; on success it is renamed to ``path``.

    On an exception the temporary folder is removed and ``path`` is left as it was. An
    ``OSError`` of the writes (one with no file name, or naming a file in the temporary folder or
    at ``path``) is raised as :class:`~headsurgeon.errors.OutputWriteError` naming the file
    where it was going.
    """
    path = check_output_dir(path, overwrite)
    tmp = _sibling(path, "tmp")
    try:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()  # unlike mkdtemp (mode 0700), respects the umask
            yield tmp
            _move_into_place(tmp, path, overwrite)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except OSError as e:
        named = _failed(e)
        checked = isinstance(e, HeadsurgeonError) and not isinstance(e, OutputWriteError)
        if checked or not (named is None or named.is_relative_to(tmp) or named == path):
            raise
        raise _write_error(e, path, tmp) from e


# --- claims --------------------------------------------------------------------------------------


def _lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


def _owner(lock: Path) -> str:
    """Who holds ``lock``, as its holder wrote it: ``pid N on HOST since TIME``."""
    with contextlib.suppress(OSError, ValueError):
        pid, host, since = lock.read_text().split(maxsplit=2)
        return f"pid {int(pid)} on {host}, since {since.strip()}"
    return "a process that has not written its name yet"


def _acquire(lock: Path, path: Path) -> int | None:
    """An open, exclusively locked ``lock`` file; ``None`` where the file system has no locks.

    ``flock`` locks die with their process, so a lock file left by a killed run is taken over
    here, and a lock that is held belongs to a live process.
    """
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputBusyError(
                f"{path} is being written by another run that is still going ({_owner(lock)}); "
                "wait for it to finish, or choose another output folder"
            ) from None
        except OSError as e:  # e.g. ENOLCK: a network file system without locks
            os.close(fd)
            logger.warning("note: cannot lock %s (%s): a second run into it is not detected",
                           lock, e.strerror)  # fmt: skip
            return None
        # The holder we waited for may have removed the file: then our lock is on a stale inode.
        with contextlib.suppress(FileNotFoundError):
            same = os.stat(lock)
            mine = os.fstat(fd)
            if (same.st_dev, same.st_ino) == (mine.st_dev, mine.st_ino):
                break
        os.close(fd)
    since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {socket.gethostname()} {since}\n".encode())
    return fd


def _remove_leftovers(path: Path) -> None:
    """Remove the hidden temporaries a killed run of ``path`` left (``.NAME.tmp-*``, ``.old-*``).

    A killed replacement may have left the previous output only as ``.NAME.old-*``: that one is
    put back first, so no finished output is lost.
    """
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(tmp|old)-[0-9a-f]{{12}}")
    leftovers = [p for p in path.parent.iterdir() if pattern.fullmatch(p.name)]
    olds = sorted((p for p in leftovers if ".old-" in p.name), key=lambda p: p.stat().st_mtime)
    if olds and not path.exists():
        os.replace(olds[-1], path)
        leftovers.remove(olds[-1])
        logger.warning("restored %s from %s, left by a run killed while replacing it",
                       path, olds[-1].name)  # fmt: skip
    if not leftovers:
        return
    size = 0
    for p in leftovers:
        if p.is_dir() and not p.is_symlink():
            size += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            shutil.rmtree(p, ignore_errors=True)
        else:
            size += p.lstat().st_size
            p.unlink(missing_ok=True)
    logger.info("removed %d temporary file(s) of %s left by a killed run (%.1f MB)",
                len(leftovers), path, size / 1e6)  # fmt: skip


@contextlib.contextmanager
def claim_output(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Hold the output location ``path`` for the duration of the ``with`` block; yield it.

    Before any work: :func:`check_output_dir` (a file in the way, a folder holding files
    without ``overwrite``, a location that cannot be created or written), then the parent
    folders are created and ``.NAME.lock`` beside ``path`` is locked, recording this process.
    A second claim of ``path`` while this one is held raises
    :class:`~headsurgeon.errors.OutputBusyError` naming the holder; the lock dies with its
    process, so a killed run's lock is simply taken over, together with the hidden temporaries it
    left (removed; a previous output it was replacing is restored). Related names a run keeps
    beside ``path`` (the repair tool's ``NAME.partial``) are covered by the same claim. On exit
    the lock file is removed, and the parent folders created here too if nothing was written.
    """
    path = check_output_dir(path, overwrite)
    created = [p for p in reversed(path.absolute().parents) if not p.exists()]
    lock = _lock_path(path)
    fd = None
    try:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = _acquire(lock, path)
        except OSError as e:
            if isinstance(e, HeadsurgeonError):
                raise
            if e.filename == str(lock):
                e.filename = None  # name the output, not its hidden lock file
            raise _write_error(e, path, verb="cannot create") from e
        _remove_leftovers(path)  # may put back an output a killed run was replacing
        check_output_dir(path, overwrite)  # again: a run that held the claim may have finished
        yield path
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(lock)
            os.close(fd)
        if not path.exists():
            for folder in reversed(created):
                with contextlib.suppress(OSError):
                    folder.rmdir()
