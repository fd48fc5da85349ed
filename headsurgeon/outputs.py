"""Atomic writes: outputs and checkpoints appear whole or not at all.

Exports:
    atomic_write_bytes(path, data)      write a file through a temporary file and a rename
    atomic_write_text(path, text)       the same for text
    atomic_directory(path, overwrite)   context manager: fill a temporary folder, then rename it
    check_output_dir(path, overwrite)   refuse a file or a non-empty folder unless overwrite

A folder that already holds files is never written into unless ``overwrite=True``: the old
folder is replaced only after the new one is complete.

>>> import tempfile, pathlib
>>> root = pathlib.Path(tempfile.mkdtemp())
>>> with atomic_directory(root / "out") as tmp:
...     _ = atomic_write_text(tmp / "a.txt", "hello")
>>> sorted(p.name for p in (root / "out").iterdir())
['a.txt']
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from headsurgeon.errors import OutputExistsError

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "check_output_dir",
    "atomic_directory",
]


def _sibling(path: Path, tag: str) -> Path:
    """A hidden, unused name beside ``path`` (same file system, so ``os.replace`` is atomic)."""
    return path.with_name(f".{path.name}.{tag}-{uuid.uuid4().hex[:12]}")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temporary file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(path, "tmp")
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
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def check_output_dir(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Raise :class:`OutputExistsError` if ``path`` is a non-empty folder (or a file)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputExistsError(f"output path {path} is a file; choose a folder name")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise OutputExistsError(
            f"output folder {path} already holds files; choose another folder or pass "
            "overwrite=True (--overwrite on the command line)"
        )
    return path


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``path``; on success it is renamed to ``path``.

    On an exception the temporary folder is removed and ``path`` is left as it was.
    """
    path = check_output_dir(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(path, "tmp")
    tmp.mkdir()  # unlike mkdtemp (mode 0700), respects the umask
    try:
        yield tmp
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
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
