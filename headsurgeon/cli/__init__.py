"""The command-line tools: one way in, and how a tool runs.

Tools (each a module with ``main(argv)``, run by :func:`run`):
    headsurgeon.cli.classify    ``python -m headsurgeon classify``, ``headsurgeon-classify``
    headsurgeon.cli.blindness   ``python -m headsurgeon blindness``, ``headsurgeon-blindness``
    headsurgeon.cli.repair      ``python -m headsurgeon repair``, ``headsurgeon-repair``

(``python -m headsurgeon.TOOL`` still runs the tool, for one release, after one line saying
so: :func:`deprecated_entry`.) The library modules never import this package.

This package imports nothing heavy, so :func:`run` installs the Ctrl-C and SIGTERM handlers of a
starting tool at once, before it imports the tool; the tool's module parses and checks with
light imports only (:mod:`headsurgeon.cli.options`, :mod:`headsurgeon.defaults`,
:mod:`headsurgeon.model_names`), then imports its work module (``cli/classify_run.py``...: load,
measure, write) and :mod:`headsurgeon.cli.loads` (the model and the data), which import torch and
TransformerLens, and calls :func:`work_begins` (from then on Ctrl-C and SIGTERM unwind).

A tool's ``main`` runs inside :func:`headsurgeon.cli.session.tool_session`: the library's
refusals in its options' names, and a host process that calls it gets back what the run changed.

Every tool is a thin layer over the library: parse, claim its output folder, call library
functions, print, and write through :mod:`headsurgeon.reports` (tables, JSON with versions,
figures by one export policy) inside the claim.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any, NoReturn

from headsurgeon.errors import HeadsurgeonError, shown

__all__ = [
    "run",
    "work_begins",
]


def _interrupted_while_starting(signum: int, frame: object) -> None:
    """Ctrl-C (or SIGTERM) while a tool imports torch and TransformerLens: one line and status
    130 (143), at once.

    A ``KeyboardInterrupt`` raised in the middle of an import leaves half-initialised modules
    behind (numpy then fails with a ``RecursionError``, not the interrupt), so nothing can be
    unwound cleanly; and nothing has been written yet, so there is nothing to clean up either.
    :func:`run` installs it; :func:`work_begins` installs the unwinding handlers before the tool
    starts work, so that from then on an interrupt or a SIGTERM unwinds and removes what the run
    was writing.
    """
    os.write(2, b"interrupted\n" if signum == signal.SIGINT else b"terminated\n")
    os._exit(128 + signum)


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler's stop), raised where Ctrl-C raises ``KeyboardInterrupt``:
    a subclass, so every cleanup that Ctrl-C gets (temporaries removed, a repair's ``--resume``
    hint, offload copies removed at exit) runs for it too; :func:`run` exits with 143."""


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM during a tool's work: unwind as Ctrl-C does. Later ones are ignored, so that the
    cleanup itself is not cut short (SIGKILL still ends the process)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated


class _ShownFormatter(logging.Formatter):
    """Log lines with their control characters escaped (:func:`headsurgeon.errors.shown`)."""

    def format(self, record: logging.LogRecord) -> str:
        return shown(super().format(record))


def work_begins() -> None:
    """Called by a tool once its heavy imports are done (see
    :func:`_interrupted_while_starting`): from here Ctrl-C and SIGTERM unwind, so the run removes
    what it was writing on its way out (an ignored signal stays ignored). Outside the main
    thread (a host's worker thread) handlers cannot be set: the host's stay."""
    from headsurgeon.cli.session import record_threads

    record_threads()
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, _interrupted_while_starting):
        signal.signal(signal.SIGTERM, _terminate)


def _catch_signals_while_starting() -> dict[int, Any]:
    """Install :func:`_interrupted_while_starting` for Ctrl-C and SIGTERM where each keeps
    Python's default (a background job's ignored SIGINT, nohup's, stays ignored; a host's own
    handler stays), in the main thread only; return the handlers it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    return {
        signum: signal.signal(signum, _interrupted_while_starting)
        for signum, default in defaults.items()
        if signal.getsignal(signum) is default
    }


def run(tool: str, argv: Sequence[str] | None = None) -> NoReturn:
    """Run the tool ``tool`` (classify, blindness, repair) with ``argv`` (default: the command
    line's arguments): user errors become ``error: <one line>`` on stderr and exit code 2; Ctrl-C
    and SIGTERM end a starting tool at once (:func:`_interrupted_while_starting`), and after
    :func:`work_begins` unwind, then exit 130 and 143."""
    # Before anything else is imported (the tool's options, then torch and TransformerLens).
    replaced = _catch_signals_while_starting()
    from tqdm.contrib.logging import logging_redirect_tqdm

    from headsurgeon.allocator import keep_freed_memory

    main = importlib.import_module(f"headsurgeon.cli.{tool}").main
    argv = sys.argv[1:] if argv is None else argv
    # Our progress messages at INFO; other libraries' (kaleido, choreographer) only when they warn.
    # Log lines quote names (folders, corpus files): escape codes in them are shown, not obeyed.
    handler = logging.StreamHandler()
    handler.setFormatter(_ShownFormatter("%(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.getLogger("headsurgeon").setLevel(logging.INFO)
    if os.environ.get("HEADSURGEON_KEEP_FREED_MEMORY", "1") != "0":
        keep_freed_memory()
    try:
        # Log lines above the progress bar, not written into its line.
        with logging_redirect_tqdm():
            code = main(argv)
    except HeadsurgeonError as e:
        print(f"error: {shown(e, keep='')}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Terminated)
        print("terminated" if terminated else "interrupted", file=sys.stderr)
        sys.exit(128 + (signal.SIGTERM if terminated else signal.SIGINT))
    finally:
        # A run that ended before its work began (--help, a refusal) gives a host calling it
        # its handlers back; once work began, work_begins's stay, as they always did.
        for signum, previous in replaced.items():
            if signal.getsignal(signum) is _interrupted_while_starting:
                signal.signal(signum, previous)
    sys.exit(code or 0)


def deprecated_entry(tool: str) -> None:
    """``python -m headsurgeon.TOOL``, deprecated: one line on stderr naming ``python -m
    headsurgeon TOOL``, then the tool as before (same output, same exit statuses)."""
    print(
        f"warning: python -m headsurgeon.{tool} is deprecated and goes in the next release: "
        f"use python -m headsurgeon {tool} (or headsurgeon-{tool})",
        file=sys.stderr,
    )
    run(tool)
