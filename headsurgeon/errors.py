"""Exceptions raised by headsurgeon.

Every error a user can cause derives from :class:`HeadsurgeonError`; its message is one line that
names the problem and the fix. The command-line tools print that line and exit with status 2.
"""

from __future__ import annotations

import unicodedata

__all__ = [
    "HeadsurgeonError",
    "UnknownModelError",
    "ModelNotFoundError",
    "CheckpointError",
    "UnsupportedArchitectureError",
    "InvalidArgumentError",
    "DataError",
    "OutputExistsError",
    "OutputWriteError",
    "OutputBusyError",
    "FigureExportError",
    "ModelInUseError",
    "shown",
]


class HeadsurgeonError(Exception):
    """Base class: a problem with the user's input, with a one-line message saying how to fix it."""


class UnknownModelError(HeadsurgeonError, ValueError):
    """A model name that is neither a known model, an alias, a bundled organism nor a directory."""


class ModelNotFoundError(HeadsurgeonError, FileNotFoundError):
    """A known model whose weights are not available here (not cached, hub unreachable)."""


class CheckpointError(HeadsurgeonError, ValueError):
    """A checkpoint directory or file that is missing parts or is corrupt."""


class UnsupportedArchitectureError(HeadsurgeonError, ValueError):
    """A checkpoint whose architecture TransformerLens (or headsurgeon) cannot handle."""


class InvalidArgumentError(HeadsurgeonError, ValueError):
    """An argument outside its valid range or set (dtype, device, threshold, length, ...)."""


class DataError(HeadsurgeonError, ValueError):
    """Input text or tokens that cannot be used (empty, too short, too long for the model)."""


class OutputExistsError(HeadsurgeonError, FileExistsError):
    """An output location that already holds other files (pass overwrite=True / --overwrite)."""


class OutputWriteError(HeadsurgeonError, OSError):
    """An output location that cannot be created or written (read-only, full, a bad name)."""


class OutputBusyError(HeadsurgeonError, BlockingIOError):
    """An output location that another running process has claimed (see outputs.claim_output)."""


class FigureExportError(HeadsurgeonError, RuntimeError):
    """A static figure that cannot be written (no Chromium browser for kaleido, unknown format)."""


class ModelInUseError(HeadsurgeonError, RuntimeError):
    """A model that a call in another thread or asyncio task is using (hooks act on every thread
    and task; see :mod:`headsurgeon.inuse`): give each its own ``copy.deepcopy(model)``."""


def first_line(error: BaseException) -> str:
    r"""The first line of ``error``'s message (its type's name when it has none).

    >>> first_line(ValueError("bad value\nmore detail")), first_line(KeyError())
    ('bad value', 'KeyError')
    """
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


# Control (Cc: ESC, BEL, CSI...), format (Cf: bidirectional overrides) and line/paragraph
# separators: what can move a terminal's cursor, recolour it or reorder what it shows.
_HIDDEN = ("Cc", "Cf", "Zl", "Zp")


def shown(text: object, *, keep: str = "\n\t") -> str:
    r"""``text`` as a terminal may show it: every control character but those in ``keep`` written
    as its Python escape (``\x1b``, ``\x07``, ``\u202e``), so a folder or corpus named with
    escape codes prints its name, never recolours or rewrites the terminal. Everything the tools
    print that may hold a name (error lines, summaries, log lines, paths) goes through it;
    ``keep=""`` for a line that must stay one line.

    >>> print(shown("model\x1b[31m red\x07\u202eevil\nnext"))
    model\x1b[31m red\x07\u202eevil
    next
    >>> shown("a\nb", keep="")
    'a\\nb'
    """
    return "".join(
        c.encode("unicode_escape").decode("ascii")
        if c not in keep and unicodedata.category(c) in _HIDDEN
        else c
        for c in str(text)
    )
