"""A tool's run inside a host process, and the library's refusals in the tool's terms.

A tool's ``main`` runs inside :func:`tool_session`: a program that calls it (a notebook, another
tool) gets back, when it returns or raises, the signal handlers, torch's thread count, the
logging configuration and the allocator setting the run changed; and the argument and data
errors the library raises inside name the tool's options (``--sink-head-seq-len``), not the
library's parameters (``head_seq_len``), by one table per tool (:func:`option_names`, plus the
names a tool gives) and an inner one where one call's parameter is another option.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import signal
import sys
import threading
from collections.abc import Iterator, Mapping

from headsurgeon.allocator import allocator_setting, restore_setting
from headsurgeon.errors import DataError, InvalidArgumentError

__all__: list[str] = []

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _HostState:
    """What a tool's run changes in its process, taken before it and put back after (see
    :func:`tool_session`): signal handlers, torch's thread count, logging, the allocator."""

    def __init__(self) -> None:
        self.handlers = {signum: signal.getsignal(signum) for signum in _SIGNALS}
        torch = sys.modules.get("torch")
        self.threads = torch.get_num_threads() if torch else None  # else at work_begins
        manager = logging.Logger.manager
        self.disable = manager.disable
        loggers = [logging.getLogger(), *manager.loggerDict.values()]
        self.loggers = [
            (log, log.level, list(log.handlers), log.propagate, log.disabled, list(log.filters))
            for log in loggers
            if isinstance(log, logging.Logger)
        ]
        self.allocator = allocator_setting()

    def restore(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self.handlers.items():
                if handler is not None and signal.getsignal(signum) is not handler:
                    signal.signal(signum, handler)
        torch = sys.modules.get("torch")
        if torch and self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        logging.disable(self.disable)
        for log, level, handlers, propagate, disabled, filters in self.loggers:
            log.setLevel(level)
            log.handlers[:] = handlers
            log.propagate, log.disabled = propagate, disabled
            log.filters[:] = filters
        restore_setting(self.allocator)


_SESSIONS: list[_HostState] = []  # the tool runs under way in this process, innermost last


@contextlib.contextmanager
def tool_session(
    parser: argparse.ArgumentParser, names: Mapping[str, str] | None = None
) -> Iterator[None]:
    """A tool's ``main`` runs inside: a host process that calls it (a notebook, another
    program) gets back its signal handlers, torch's thread count, its logging configuration and
    the allocator setting when it returns or raises; and the library's refusals inside name the
    tool's options (:func:`in_option_terms` with :func:`option_names` and ``names``)."""
    state = _HostState()
    _SESSIONS.append(state)
    try:
        with in_option_terms({**option_names(parser), **(names or {})}):
            yield
    finally:
        _SESSIONS.remove(state)
        state.restore()


def option_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """The library's names of ``parser``'s options, each to its option: a parameter of the same
    name with underscores (``head_seq_len``: ``--head-seq-len``) anywhere, and a one-word one
    where a check names it (``passes must be``), not where the word is plain English."""
    given = {o for action in parser._actions for o in action.option_strings}
    names = {phrase: option for phrase, option in _PHRASES.items() if option in given}
    for action in parser._actions:
        options = [o for o in action.option_strings if o.startswith("--")]
        if not options or action.dest == "help":
            continue
        if "_" in action.dest:
            names[action.dest] = options[0]
        else:
            names[f"{action.dest} must be"] = f"{options[0]} must be"
    return names


# How the library names options that are not parameters of the same name (Thresholds' fields,
# keywords written with their "=").
_PHRASES = {
    "threshold sink": "--sink-threshold",
    "threshold dead": "--dead-threshold",
    "threshold min_output_share": "--min-output-share",
    "the sink threshold": "--sink-threshold",
    "the dead threshold": "--dead-threshold",
    # load_dataset_texts' keywords, as its one-line refusals name them.
    "split=": "--split",
    "column=": "--column",
    "n_seqs=": "--n-seqs",
    "text files are texts: pass their paths, not load_dataset_texts": "text files go to --texts",
}


@contextlib.contextmanager
def in_option_terms(names: Mapping[str, str]) -> Iterator[None]:
    """Argument and data errors raised inside, reworded in the command line's terms: each
    library name of ``names`` (a parameter, or a phrase) becomes its option or phrase, where it
    stands as a word and is not already followed by its option (``seq_len (--seq-len)``).

    One table per tool (:func:`tool_session`), and an inner one where a call's parameter is
    another option (``seq_len`` of the sink-cache test is ``--sink-seq-len``)."""
    try:
        yield
    except (InvalidArgumentError, DataError) as e:
        if len(e.args) == 1 and isinstance(e.args[0], str):
            e.args = (_in_option_terms(e.args[0], names),)
        raise


def _in_option_terms(message: str, names: Mapping[str, str]) -> str:
    if not names:
        return message
    # Longest first: "threshold min_output_share" before "min_output_share".
    keys = sorted(names, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, keys)) + r")(?![\w])(?! \(--)")
    return pattern.sub(lambda m: names[m.group(1)], message)


def record_threads() -> None:
    """For each run under way that started before torch was imported: torch's thread count now,
    its own default, which the run's end puts back (--threads may change it next)."""
    torch = sys.modules.get("torch")
    for state in _SESSIONS:
        if state.threads is None and torch:
            state.threads = torch.get_num_threads()
