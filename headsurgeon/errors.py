"""Exceptions raised by headsurgeon.

Every error a user can cause derives from :class:`HeadsurgeonError`; its message is one line that
names the problem and the fix. The command-line tools print that line and exit with status 2.

Exports: HeadsurgeonError, UnknownModelError, ModelNotFoundError, CheckpointError,
UnsupportedArchitectureError, InvalidArgumentError, DataError, OutputExistsError,
OutputWriteError, OutputBusyError, FigureExportError, ModelInUseError; first_line(error), the
first line of an error's message for quoting inside one of ours.
"""

from __future__ import annotations

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
    "first_line",
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
    """A model that a call in another thread is using (hooks act on every thread; see
    :mod:`headsurgeon.inuse`): give each thread its own ``copy.deepcopy(model)``."""


def first_line(error: BaseException) -> str:
    r"""The first line of ``error``'s message (its type's name when it has none).

    >>> first_line(ValueError("bad value\nmore detail")), first_line(KeyError())
    ('bad value', 'KeyError')
    """
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
