"""Atomic writes and claimed, owned output folders: outputs appear whole or not at all, one run
each, and never at the cost of a file headsurgeon did not write.

**Ownership.** Every folder headsurgeon writes (the tools' report folders, the repair tool's
``NAME.partial`` work folder, :func:`headsurgeon.save_hf` exports) carries ``MARK_FILE``: a small
JSON manifest with the writer, the headsurgeon version, the time and the relative path of every
file written. :func:`atomic_directory` writes it first, with an empty list, into its temporary
folder (so the temporary of a killed run is provably ours) and rewrites it last with the full
list. A folder is *ours* when it is empty, or carries a valid mark listing everything in it;
``overwrite=True`` (``--overwrite``) replaces nothing else: a folder where the user added a file
after the run, a home folder, a git work tree, a model folder are refused in one
:class:`~headsurgeon.errors.OutputExistsError` line naming a few of the files headsurgeon did not
write. Hidden leftovers beside an output (``.NAME.tmp-*``, ``.NAME.old-*``) are removed, or put
back, only when they carry the mark; a lock file ``.NAME.lock`` is taken over or removed only when
it holds a lock line in our format (``PID HOST TIME``).

**Paths an output may not take**, refused in one line before any work, even with ``overwrite``:
the root folder, the home folder and its parents, the working directory and its parents (so
``--out .`` and ``--out ..`` are refused: name a new folder inside, e.g. ``--out results``), a
dangling symlink or a symlink loop, and, given ``inputs`` (the model folder, text files, ...): a
path that is an input, holds one, or lies inside an input folder. A symlink to a folder is
followed: the output is written at (and replaces) its target, and the link is left as it was.
Messages and the hidden siblings use the resolved path.

A folder that already holds files is never written into unless ``overwrite=True``: the old
folder is replaced only after the new one is complete, and without ``overwrite`` the final rename
fails rather than replace a folder that appeared meanwhile. An ``OSError`` while writing (a full
disk, a read-only folder) becomes one :class:`~headsurgeon.errors.OutputWriteError` line naming
the final path (never the hidden temporary one) and what to do.

>>> import tempfile, pathlib
>>> root = pathlib.Path(tempfile.mkdtemp())
>>> with claim_output(root / "out") as out, atomic_directory(out) as tmp:
...     _ = atomic_write_text(tmp / "a.txt", "hello")
>>> sorted(p.name for p in out.iterdir()), sorted(p.name for p in root.iterdir())
(['.headsurgeon-output.json', 'a.txt'], ['out'])
>>> read_mark(out).files, foreign_files(out)
(('a.txt',), [])
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import importlib.metadata
import json
import logging
import os
import re
import shutil
import socket
import stat
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from headsurgeon.errors import (
    HeadsurgeonError,
    OutputBusyError,
    OutputExistsError,
    OutputWriteError,
)

__all__ = [
    "atomic_write_text",
    "check_output_dir",
    "atomic_directory",
    "headsurgeon_version",
]

logger = logging.getLogger(__name__)

MARK_FILE = ".headsurgeon-output.json"
PARTIAL_SUFFIX = ".partial"  # NAME.partial: the live work folder of a run writing NAME
_MARK_MAX = 16 << 20  # bytes: a mark lists file names; anything larger is not one of ours
_SHOWN = 3  # foreign names quoted in a refusal

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


# --- the ownership mark ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OutputMark:
    """A folder's ownership mark (:data:`MARK_FILE`), as :func:`read_mark` reads it.

    ``writer``: what wrote the folder (``write_classification``, ``save_hf``, ...);
    ``version``: headsurgeon's; ``created``: when (ISO 8601); ``files``: every file written, as
    paths relative to the folder with ``/`` (an empty folder written as ``name/``).
    """

    writer: str
    version: str
    created: str
    files: tuple[str, ...]


def headsurgeon_version() -> str:
    """The installed headsurgeon's version: its package metadata (``headsurgeon.__version__``)."""
    return importlib.metadata.version("headsurgeon")


def _inside(name: object) -> bool:
    """Whether a mark's entry is a plain relative path that stays inside the folder."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name:
        return False
    return all(part not in ("", ".", "..") for part in name.removesuffix("/").split("/"))


def read_mark(folder: str | os.PathLike) -> OutputMark | None:
    """The mark of ``folder`` when it carries a valid one, else ``None``.

    Not valid (the folder then does not count as headsurgeon's): a mark that is not a regular
    file (a symlink, a FIFO), larger than 16 MB, not JSON, not written by headsurgeon, or
    listing a path that leaves the folder.
    """
    file = Path(folder) / MARK_FILE
    try:
        info = os.lstat(file)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MARK_MAX:
            return None
        document = json.loads(file.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict) or document.get("written_by") != "headsurgeon":
        return None
    fields = [document.get(key) for key in ("writer", "version", "created")]
    files = document.get("files")
    if not all(isinstance(field, str) for field in fields) or not isinstance(files, list):
        return None
    if not all(_inside(name) for name in files):
        return None
    return OutputMark(*fields, files=tuple(files))


def _listing(folder: Path, prefix: str = "") -> list[str]:
    """Every entry under ``folder`` but folders (a symlink is an entry, never followed), and each
    empty folder as ``name/``: relative, with ``/``."""
    with os.scandir(folder) as scan:
        entries = sorted(scan, key=lambda entry: entry.name)
    found = []
    for entry in entries:
        name = prefix + entry.name
        if entry.is_dir(follow_symlinks=False):
            found.extend(_listing(Path(entry.path), name + "/") or [name + "/"])
        else:
            found.append(name)
    return found


def mark_folder(folder: str | os.PathLike, writer: str, files: Iterable[str] | None = None) -> Path:
    """Write ``folder``'s mark, atomically; return the mark file.

    It records ``writer``, this headsurgeon version, the time and ``files`` (relative paths;
    by default every file now in ``folder``, found by walking it: call it last, once everything
    is written). :func:`atomic_directory` calls it twice; call it yourself only for a folder
    headsurgeon creates and fills by other means (the repair tool's work folder).
    """
    folder = Path(folder)
    if files is None:
        files = [name for name in _listing(folder) if name != MARK_FILE]
    document = {
        "written_by": "headsurgeon",
        "writer": writer,
        "version": headsurgeon_version(),
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "files": sorted(files),
    }
    return atomic_write_text(folder / MARK_FILE, json.dumps(document, indent=1) + "\n")


def _marked_parents(files: Iterable[str]) -> set[str]:
    """The folders a mark's ``files`` lie in (each a relative path without the trailing ``/``)."""
    parents = set()
    for name in files:
        parts = name.removesuffix("/").split("/")
        parents.update("/".join(parts[:end]) for end in range(1, len(parts)))
        if name.endswith("/"):
            parents.add(name.removesuffix("/"))
    return parents


def _unlisted(folder: Path, prefix: str, listed: set[str], parents: set[str]) -> list[str]:
    with os.scandir(folder) as scan:
        entries = sorted(scan, key=lambda entry: entry.name)
    found = []
    for entry in entries:
        name = prefix + entry.name
        if entry.is_dir(follow_symlinks=False) and name in parents:
            found.extend(_unlisted(Path(entry.path), name + "/", listed, parents))
        elif entry.is_dir(follow_symlinks=False) or name not in listed:
            found.append(name)  # a folder the mark never mentions is foreign as a whole
    return found


def foreign_files(folder: str | os.PathLike) -> list[str]:
    """What in ``folder`` headsurgeon did not write, by the folder's mark; ``[]`` when nothing.

    Relative paths with ``/``, sorted; a folder the mark does not mention counts as one entry
    (it is not walked). Without a valid mark (:func:`read_mark`), every entry of ``folder``; an
    empty folder has none. The mark file itself is never foreign.
    """
    folder = Path(folder)
    mark = read_mark(folder)
    if mark is None:
        return sorted(os.listdir(folder))
    listed = {*mark.files, MARK_FILE}
    return _unlisted(folder, "", listed, _marked_parents(mark.files))


def _foreign_line(path: Path, foreign: list[str]) -> str:
    shown = ", ".join(foreign[:_SHOWN])
    if len(foreign) > _SHOWN:
        shown += f", … ({len(foreign)} in all)"
    return (
        f"output folder {path} already holds files headsurgeon did not write: {shown}; choose "
        "another folder (overwrite=True / --overwrite replaces only a folder headsurgeon wrote)"
    )


# --- where an output may go --------------------------------------------------------------------


def _broken_link(given: Path) -> str:
    try:
        os.stat(given)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"output path {given} is a symlink loop; fix the link or choose another folder"
    return (
        f"output path {given} is a symlink to {os.readlink(given)}, which does not exist; "
        "create that folder or choose another"
    )


def _protected(resolved: Path) -> str | None:
    """What ``resolved`` is, when no output may be written there or replace it."""
    if resolved == Path(resolved.anchor):
        return "the root folder"
    with contextlib.suppress(RuntimeError, KeyError, OSError):  # no home: nothing to protect
        home = Path.home().resolve()
        if resolved == home:
            return "the home folder"
        if resolved in home.parents:
            return f"a parent of the home folder {home}"
    with contextlib.suppress(OSError):  # a working directory that was removed
        cwd = Path.cwd().resolve()
        if resolved == cwd:
            return "the working directory"
        if resolved in cwd.parents:
            return f"a parent of the working directory {cwd}"
    return None


def resolve_output(path: str | os.PathLike) -> Path:
    """``path`` as an absolute path with every symlink resolved: where an output of it goes.

    One :class:`OutputExistsError` line, even for ``overwrite``, for a path no output may take:
    a dangling symlink or a symlink loop (in ``path`` or a folder above it), the root folder,
    the home folder or one of its parents, the working directory or one of its parents (``.``,
    ``..``: name a new folder inside instead). A symlink to a folder resolves to its target.
    """
    given = Path(path)
    if os.path.islink(given) and not os.path.exists(given):
        raise OutputExistsError(_broken_link(given))
    try:
        resolved = given.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop in a folder above
        raise OutputExistsError(
            f"cannot resolve output path {given} ({e}); fix the symlink or choose another folder"
        ) from None
    what = _protected(resolved)
    if what is not None:
        named = f"{given} ({resolved})" if str(given) != str(resolved) else str(given)
        raise OutputExistsError(
            f"output folder {named} is {what}, which headsurgeon never writes into or replaces; "
            "choose a new folder for the output, e.g. one inside it"
        )
    return resolved


def _check_inputs(path: Path, inputs: Iterable[str | os.PathLike]) -> None:
    """Refuse an output ``path`` that is an input, holds one or lies inside an input folder."""
    for given in inputs:
        try:
            source = Path(given).expanduser().resolve()  # as the reader resolves it
        except (OSError, RuntimeError):
            continue  # an input that cannot be resolved cannot be reached through path either
        if source == path:
            relation = "is"
        elif path in source.parents:
            relation = "holds"
        elif source.is_dir() and source in path.parents:
            relation = "is inside"
        else:
            continue
        raise OutputExistsError(
            f"output folder {path} {relation} the input {source}; an output never touches the "
            "files it reads: choose a folder outside them"
        )


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


def _check_replaceable(path: Path, overwrite: bool) -> None:
    """Refuse a folder at ``path`` holding files headsurgeon did not write, or (without
    ``overwrite``) any files."""
    foreign = foreign_files(path)
    if foreign:
        raise OutputExistsError(_foreign_line(path, foreign))
    mark = read_mark(path)
    if overwrite or mark is None:  # no mark and nothing foreign: an empty folder
        return
    raise OutputExistsError(
        f"output folder {path} already holds files (a headsurgeon output, by {mark.writer}); "
        "choose another folder or pass overwrite=True (--overwrite on the command line) to "
        "replace it"
    )


def check_output_dir(
    path: str | os.PathLike, overwrite: bool = False, *, inputs: Iterable[str | os.PathLike] = ()
) -> Path:
    """Raise unless ``path`` can become a new output folder; return it resolved
    (:func:`resolve_output`: absolute, symlinks followed), the path to write.

    :class:`OutputExistsError` for a path no output may take (:func:`resolve_output`), one that
    is, holds or lies inside one of ``inputs`` (the files and folders the run reads), a file at
    ``path`` or among its parents, a folder holding files headsurgeon did not write (by its
    mark, :func:`foreign_files`; even with ``overwrite``) or, without ``overwrite``, any files;
    :class:`~headsurgeon.errors.OutputWriteError` for a location that cannot be created or
    written (a parent without write permission, a read-only file system, a name too long).
    Nothing is created.
    """
    given = Path(path)
    try:
        path = resolve_output(given)
        _check_inputs(path, inputs)
        if path.exists() and not path.is_dir():
            raise OutputExistsError(f"output path {path} is a file; choose a folder name")
        if path.is_dir():
            _check_replaceable(path, overwrite)
        _check_location(path)
    except OSError as e:
        if isinstance(e, HeadsurgeonError):
            raise
        raise _write_error(e, Path(os.path.abspath(given)), verb="cannot create") from e
    return path


def _discard(old: Path, path: Path) -> None:
    """Remove ``old``, the folder ``path`` replaced, unless files appeared in it meanwhile."""
    foreign = foreign_files(old)
    if foreign:
        logger.warning(
            "kept %s, the previous %s: files appeared in it while it was replaced (%s)",
            old,
            path.name,
            ", ".join(foreign[:_SHOWN]),
        )
        return
    shutil.rmtree(old, ignore_errors=True)


def _move_into_place(tmp: Path, path: Path, overwrite: bool) -> None:
    """Rename the finished ``tmp`` to ``path``; a folder holding files is replaced only if
    ``overwrite`` and it is still headsurgeon's."""
    occupied = path.is_dir() and any(path.iterdir())
    if not overwrite or not occupied:
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
    foreign = foreign_files(path)  # again: the user may have added files during the run
    if foreign:
        raise OutputExistsError(_foreign_line(path, foreign) + "; it was kept as it was")
    old = _sibling(path, "old")
    os.replace(path, old)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.replace(old, path)
        raise
    _discard(old, path)


@contextlib.contextmanager
def atomic_directory(
    path: str | os.PathLike,
    overwrite: bool = False,
    *,
    inputs: Iterable[str | os.PathLike] = (),
    writer: str = "headsurgeon",
) -> Iterator[Path]:
    """Yield a temporary folder beside ``path``; on success it is renamed to ``path``.

    ``path`` is first checked (:func:`check_output_dir`, with ``overwrite`` and ``inputs``) and
    resolved: the temporary lies beside the resolved path. The temporary carries the mark
    (:func:`mark_folder`, as ``writer``) from its creation, and is marked again with every file
    in it just before the rename. On an exception the temporary folder is removed and ``path``
    is left as it was. An ``OSError`` of the writes (one with no file name, or naming a file in
    the temporary folder or at ``path``) is raised as
    :class:`~headsurgeon.errors.OutputWriteError` naming the file where it was going.
    """
    path = check_output_dir(path, overwrite, inputs=inputs)
    tmp = _sibling(path, "tmp")
    made = False
    try:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()  # unlike mkdtemp (mode 0700), respects the umask
            made = True
            mark_folder(tmp, writer, files=())  # first: a killed run's temporary is provably ours
            yield tmp
            mark_folder(tmp, writer)  # last: every file written
            _move_into_place(tmp, path, overwrite)
        except BaseException:
            if made:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
    except OSError as e:
        named = _failed(e)
        checked = isinstance(e, HeadsurgeonError) and not isinstance(e, OutputWriteError)
        if checked or not (named is None or named.is_relative_to(tmp) or named == path):
            raise
        raise _write_error(e, path, tmp) from e


# --- claims --------------------------------------------------------------------------------------


_LOCK_LINE = re.compile(r"[0-9]+ \S+ \S+\n?")  # what _acquire writes: PID HOST TIME


def _lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


def _owner(lock: Path) -> str:
    """Who holds ``lock``, as its holder wrote it: ``pid N on HOST since TIME``."""
    with contextlib.suppress(OSError, ValueError):
        pid, host, since = lock.read_text().split(maxsplit=2)
        return f"pid {int(pid)} on {host}, since {since.strip()}"
    return "a process that has not written its name yet"


def _not_a_lock(lock: Path, path: Path, what: str) -> OutputExistsError:
    return OutputExistsError(
        f"{lock} stands where headsurgeon keeps the lock of {path}, and it is not a headsurgeon "
        f"lock file ({what}); move it away, or choose another output folder"
    )


def _open_lock(lock: Path, path: Path) -> tuple[int, bool]:
    """``lock`` opened: created now (``True``), or an existing regular file (``False``)."""
    while True:
        with contextlib.suppress(FileExistsError):
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            return os.open(lock, flags, 0o666), True
        try:
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            continue  # its holder removed it meanwhile
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EISDIR):
                raise _not_a_lock(lock, path, "a symlink or a folder") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise _not_a_lock(lock, path, "not a regular file")
        return fd, False


def _same_file(lock: Path, fd: int) -> bool:
    """Whether ``lock`` is still the file open as ``fd`` (a holder may have removed it)."""
    try:
        named = os.stat(lock, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)


def _lock(fd: int, lock: Path, path: Path) -> None:
    """Lock ``fd`` exclusively, or raise :class:`OutputBusyError`; only warn where the file
    system has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OutputBusyError(
            f"{path} is being written by another run that is still going ({_owner(lock)}); "
            "wait for it to finish, or choose another output folder"
        ) from None
    except OSError as e:  # e.g. ENOLCK: a network file system without locks
        logger.warning(
            "note: cannot lock %s (%s): a second run into it is not detected", lock, e.strerror
        )


def _acquire(lock: Path, path: Path) -> int:
    """An open ``lock`` file, exclusively locked where the file system has locks, holding this
    process's ``PID HOST TIME`` line.

    ``flock`` locks die with their process, so a lock file left by a killed run is taken over
    here, and a lock that is held belongs to a live process. An existing file that does not hold
    a lock line of ours (or is not a regular file) is refused, never taken over.
    """
    while True:
        fd, created = _open_lock(lock, path)
        _lock(fd, lock, path)
        if not created and not _LOCK_LINE.fullmatch(os.pread(fd, 4096, 0).decode("latin-1")):
            os.close(fd)
            raise _not_a_lock(lock, path, "it holds no PID HOST TIME line")
        # The holder we waited for may have removed the file: then our lock is on a stale inode.
        if _same_file(lock, fd):
            break
        os.close(fd)
    since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {since}\n".encode(), 0)
    return fd


def _leftovers(path: Path) -> tuple[list[Path], list[Path]]:
    """The hidden temporaries beside ``path`` (``.NAME.tmp-*``, ``.NAME.old-*``): those that
    are ours, and those that are not (which are never touched).

    A temporary is ours when it carries our mark (written first, before any file), or holds
    only the temporary of that first mark; a previous output being replaced, when its mark also
    lists everything in it (a user may have added files to it before it was replaced).
    """
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(tmp|old)-[0-9a-f]{{12}}")
    ours, others = [], []
    for p in sorted(path.parent.iterdir()):
        if match := pattern.fullmatch(p.name):
            folder = p.is_dir() and not p.is_symlink()
            if match[1] == "tmp":  # marked, or killed while its first mark was being written
                mine = folder and (read_mark(p) is not None or _unmarked_start(p))
            else:
                mine = folder and read_mark(p) is not None and not foreign_files(p)
            (ours if mine else others).append(p)
    return ours, others


def _unmarked_start(tmp: Path) -> bool:
    """Whether the temporary ``tmp`` holds nothing but the temporary of its first mark (or
    nothing): :func:`atomic_directory` was killed before that mark was in place."""
    mark_tmp = re.compile(rf"\.{re.escape(MARK_FILE)}\.tmp-[0-9a-f]{{12}}")
    with os.scandir(tmp) as scan:
        return all(e.is_file(follow_symlinks=False) and mark_tmp.fullmatch(e.name) for e in scan)


def _remove_leftovers(path: Path) -> None:
    """Remove the hidden temporaries a killed run of ``path`` left, if they carry our mark.

    A killed replacement may have left the previous output only as ``.NAME.old-*``: that one is
    put back first, so no finished output is lost. Any other name of that form (no mark, or an
    old copy holding files its mark does not list) is left as it is, with a warning.
    """
    ours, others = _leftovers(path)
    for p in others:
        logger.warning(
            "left %s as it is: it is named like a leftover of %s, but nothing proves "
            "headsurgeon wrote all of it (no %s listing it)",
            p,
            path.name,
            MARK_FILE,
        )
    olds = sorted((p for p in ours if ".old-" in p.name), key=lambda p: p.stat().st_mtime)
    if olds and not os.path.lexists(path):
        os.replace(olds[-1], path)
        ours.remove(olds[-1])
        logger.warning(
            "restored %s from %s, left by a run killed while replacing it", path, olds[-1].name
        )
    if not ours:
        return
    size = 0
    for p in ours:
        size += sum(f.lstat().st_size for f in p.rglob("*") if not f.is_dir())
        shutil.rmtree(p, ignore_errors=True)
    logger.info(
        "removed %d temporary folder(s) of %s left by a killed run (%.1f MB)",
        len(ours),
        path,
        size / 1e6,
    )


@contextlib.contextmanager
def _holding(path: Path, lock: Path, busy: str | None = None) -> Iterator[None]:
    """Hold ``lock`` (:func:`_acquire`, ``path`` named in its messages) for the ``with`` block;
    then remove it if it is still the file we locked. ``busy``: what a lock held by another run
    means, instead of "``path`` is being written"."""
    try:
        fd = _acquire(lock, path)
    except OutputBusyError:
        if busy is None:
            raise
        raise OutputBusyError(
            f"{busy} ({_owner(lock)}); wait for it to finish, or choose another output folder"
        ) from None
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if _same_file(lock, fd):
                os.unlink(lock)
        os.close(fd)


@contextlib.contextmanager
def claim_output(
    path: str | os.PathLike, overwrite: bool = False, *, inputs: Iterable[str | os.PathLike] = ()
) -> Iterator[Path]:
    """Hold the output location ``path`` for the duration of the ``with`` block; yield it,
    resolved (:func:`resolve_output`).

    Before any work: :func:`check_output_dir` (with ``overwrite`` and ``inputs``: a path no
    output may take, an input in the way, a file in the way, a folder holding files headsurgeon
    did not write, or any files without ``overwrite``, a location that cannot be created or
    written), then the parent folders are created and ``.NAME.lock`` beside ``path`` is locked,
    recording this process. A second claim of ``path`` while this one is held raises
    :class:`~headsurgeon.errors.OutputBusyError` naming the holder; the lock dies with its
    process, so a killed run's lock is simply taken over, together with the hidden temporaries it
    left (removed when they carry our mark; a previous output it was replacing is restored). A
    ``.NAME.lock`` that is not a lock file of ours is refused in one line. Related names a run
    keeps beside ``path`` (the repair tool's ``NAME.partial``) are covered by the same claim: a
    claim of ``NAME.partial`` also takes ``NAME``'s lock, so no other tool's output replaces a
    live work folder. On exit the lock file is removed (if it is still ours), and the parent
    folders created here too if nothing was written.
    """
    path = check_output_dir(path, overwrite, inputs=inputs)
    created = [p for p in reversed(path.parents) if not p.exists()]
    try:
        with contextlib.ExitStack() as held:
            lock = _lock_path(path)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                held.enter_context(_holding(path, lock))
                if path.name.endswith(PARTIAL_SUFFIX) and path.name != PARTIAL_SUFFIX:
                    owner = path.with_name(path.name.removesuffix(PARTIAL_SUFFIX))
                    busy = f"{path} is the live work folder of a run writing {owner} now"
                    held.enter_context(_holding(owner, _lock_path(owner), busy))
            except OSError as e:
                if isinstance(e, HeadsurgeonError):
                    raise
                if e.filename is not None and Path(e.filename).name.endswith(".lock"):
                    e.filename = None  # name the output, not its hidden lock file
                raise _write_error(e, path, verb="cannot create") from e
            _remove_leftovers(path)  # may put back an output a killed run was replacing
            check_output_dir(path, overwrite, inputs=inputs)  # again: a run may have finished
            yield path
    finally:
        if not path.exists():
            for folder in reversed(created):
                with contextlib.suppress(OSError):
                    folder.rmdir()
