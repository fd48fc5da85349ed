"""Reading a user's files safely: regular files only, bounded reads, one-line errors.

Every file the tools read (text corpora, a model folder's ``config.json``, weights, tokenizer
files and ``headsurgeon.json``, a repair's resume state) comes through here first, so that a
FIFO never hangs a run, ``/dev/zero`` never fills memory and a 2 GB binary file is recognised
from its first megabyte, not after reading it whole.

``what`` names the file's role in messages ("text file", "config file"; empty: messages begin
with the path itself, as a model folder's do); ``error`` is the
:class:`~headsurgeon.errors.HeadsurgeonError` subclass to raise (``DataError`` by default;
model folders use ``CheckpointError``).

>>> import tempfile, pathlib
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> _ = (folder / "a.json").write_text('{"n_head": 4}')
>>> read_json(folder / "a.json", "config file")
{'n_head': 4}
>>> read_json(folder, "config file")
Traceback (most recent call last):
...
headsurgeon.errors.DataError: config file ... is a folder, not a file; give the file itself
"""

from __future__ import annotations

import codecs
import errno
import gzip
import json
import os
import stat
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from headsurgeon.errors import DataError, HeadsurgeonError

__all__ = [
    "read_text",
    "iter_text",
    "read_json",
]

MAX_TEXT_BYTES = 1 << 30
MAX_JSON_BYTES = 64 << 20
_CHUNK = 1 << 20

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def describe_kind(path: str | os.PathLike) -> str | None:
    """What stands at ``path`` if it is not a regular file (symlinks followed), else ``None``.

    >>> describe_kind("/dev/null"), describe_kind("/")
    ('a character device', 'a folder')
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken symbolic link" if os.path.islink(path) else "missing"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symbolic link loop"
        return f"unreadable ({e.strerror})"
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def _label(what: str, path: Path) -> str:
    """``"text file /a/b"``, or the path alone when ``what`` is empty."""
    return f"{what} {path}" if what else str(path)


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} bytes"  # pragma: no cover


def check_regular_file(
    path: str | os.PathLike,
    what: str,
    *,
    max_bytes: int | None = None,
    error: type[HeadsurgeonError] = DataError,
) -> Path:
    """``path`` as a ``Path``, after checking it is a readable regular file of at most
    ``max_bytes``; else one ``error`` line naming the file, what it is, and the fix.

    Nothing is opened, so a FIFO or a device cannot block or flood the caller.
    """
    path = Path(path)
    name = _label(what, path)
    kind = describe_kind(path)
    if kind == "missing":
        raise error(f"{name} does not exist; check the path")
    if kind == "a folder":
        raise error(f"{name} is a folder, not a file; give the file itself")
    if kind is not None:
        raise error(f"{name} is {kind}, not a regular file; give a regular file")
    if not os.access(path, os.R_OK):
        raise error(f"{name} is not readable (permissions); make it readable")
    try:
        size = path.stat().st_size
    except OSError as e:  # gone or changed since describe_kind looked
        raise _open_error(path, what, e, error) from e
    if max_bytes is not None and size > max_bytes:
        raise error(
            f"{name} is {_size(size)}, more than the {_size(max_bytes)} such a file can "
            "plausibly be; check that it is the right file"
        )
    return path


def _open_error(path: Path, what: str, e: OSError, error: type[HeadsurgeonError]):
    return error(f"cannot read {_label(what, path)} ({e.strerror or e}); make it readable")


def read_bytes(
    path: str | os.PathLike,
    what: str,
    *,
    max_bytes: int = MAX_TEXT_BYTES,
    error: type[HeadsurgeonError] = DataError,
) -> bytes:
    """The bytes of a checked regular file, reading at most ``max_bytes`` (+1 to notice more:
    the file may grow after it was checked)."""
    path = check_regular_file(path, what, max_bytes=max_bytes, error=error)
    try:
        # O_NONBLOCK: should the path have become a FIFO since the check, open does not wait.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise _open_error(path, what, e, error) from e
    if len(data) > max_bytes:
        raise error(f"{_label(what, path)} grew past {_size(max_bytes)} while it was read")
    return data


def _not_text(path: Path, what: str, error: type[HeadsurgeonError]) -> HeadsurgeonError:
    return error(
        f"{_label(what, path)} is not text (it holds NUL bytes: binary, or UTF-16); give UTF-8 "
        "text, e.g. iconv -f utf-16 -t utf-8"
    )


def _chunks(path: Path, what: str, max_bytes: int, error: type[HeadsurgeonError]):
    """The file's bytes in chunks (decompressed for ``.gz``), at most ``max_bytes`` in all."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        raw = os.fdopen(fd, "rb")
    except OSError as e:
        raise _open_error(path, what, e, error) from e
    with raw:
        stream = gzip.GzipFile(fileobj=raw) if path.suffix == ".gz" else raw
        total = 0
        try:
            while chunk := stream.read(_CHUNK):
                total += len(chunk)
                if total > max_bytes:
                    raise error(
                        f"{_label(what, path)} holds more than {_size(max_bytes)} of text; "
                        "split it or give a part of it"
                    )
                yield chunk
        except (OSError, EOFError, zlib.error) as e:
            if isinstance(e, HeadsurgeonError):
                raise
            raise error(
                f"cannot read {_label(what, path)} ({e}); give a readable .txt or .txt.gz file"
            ) from e


def read_text(
    path: str | os.PathLike,
    what: str,
    *,
    max_bytes: int = MAX_TEXT_BYTES,
    error: type[HeadsurgeonError] = DataError,
) -> str:
    """UTF-8 text of a checked regular file (``.gz`` decompressed), read in chunks so that a
    NUL byte or an invalid UTF-8 sequence stops the read where it is found."""
    return "".join(iter_text(path, what, max_bytes=max_bytes, error=error))


def iter_text(
    path: str | os.PathLike,
    what: str,
    *,
    max_bytes: int = MAX_TEXT_BYTES,
    error: type[HeadsurgeonError] = DataError,
) -> Iterator[str]:
    """The text :func:`read_text` returns, as consecutive pieces of at most about 1 MiB, read
    (and decompressed) only as far as the caller consumes them: a caller that needs the first
    megabytes of a 900 MB ``.gz`` never holds the rest. The file is checked on the first piece."""
    path = check_regular_file(path, what, max_bytes=max_bytes, error=error)
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # of the first byte the decoder has not yet consumed (its buffer included)
    for chunk in _chunks(path, what, max_bytes, error):
        if b"\x00" in chunk:  # UTF-8 text never holds NUL; binary files and UTF-16 do
            raise _not_text(path, what, error)
        yield _decode(decoder, chunk, offset, path, what, error)
        offset += len(chunk)
    yield _decode(decoder, b"", offset, path, what, error, final=True)


def _decode(
    decoder: codecs.IncrementalDecoder,
    chunk: bytes,
    offset: int,
    path: Path,
    what: str,
    error: type[HeadsurgeonError],
    final: bool = False,
) -> str:
    """One chunk decoded; a bad byte is named by its offset in the file, even when its sequence
    began in the bytes the decoder held back from the previous chunk."""
    held = decoder.getstate()[0]
    try:
        return decoder.decode(chunk, final=final)
    except UnicodeDecodeError as e:
        data = held + chunk
        raise error(
            f"{_label(what, path)} is not UTF-8 (byte 0x{data[e.start]:02x} at offset "
            f"{offset - len(held) + e.start}); convert it, e.g. iconv -f latin1 -t utf-8"
        ) from None


def read_json(
    path: str | os.PathLike,
    what: str,
    *,
    max_bytes: int = MAX_JSON_BYTES,
    error: type[HeadsurgeonError] = DataError,
    fix: str = "fix or replace the file",
) -> dict[str, Any]:
    """The JSON object in a checked regular file; one ``error`` line for anything else (not
    UTF-8, not JSON, nested too deeply for the parser, a list or a value instead of an object).

    ``what`` may be empty: messages then begin with the path itself.
    """
    path = Path(path)
    raw = read_bytes(path, what, max_bytes=max_bytes, error=error)
    name = _label(what, path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(
            f"{name} is not readable JSON (not UTF-8: byte 0x{raw[e.start]:02x} at offset "
            f"{e.start}); {fix}"
        ) from None
    try:
        data = json.loads(text)
    except RecursionError:  # thousands of nested brackets: no config is built like that
        raise error(f"{name} is not readable JSON (nested too deeply); {fix}") from None
    except ValueError as e:  # JSONDecodeError, and integers of more than 4300 digits
        raise error(f"{name} is not readable JSON ({e}); {fix}") from None
    if not isinstance(data, dict):
        raise error(f"{name} holds a JSON {type(data).__name__}, not an object; {fix}")
    return data


def text_file_chunks(path: Path) -> Iterator[str]:
    """A text file's text in pieces (:func:`iter_text`), one line for a folder or a file without
    text."""
    if path.is_dir():
        raise DataError(f"text file {path} is a folder; give the text files in it ({path}/*.txt)")
    blank = True
    for chunk in iter_text(path, "text file"):
        blank = blank and not chunk.strip()
        yield chunk
    if blank:
        raise DataError(f"text file {path} is empty; give a file with text in it")


def check_texts(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> None:
    """The checks of :func:`headsurgeon.data.read_texts` (one :class:`DataError` line per
    problem), reading each file piece by piece and keeping none of it: a 900 MB ``.gz`` is
    checked in bounded memory."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise DataError("no text files given; pass at least one file")
    for path in paths:
        for _ in text_file_chunks(Path(path)):
            pass
