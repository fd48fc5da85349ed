"""One model, one user at a time: the guard every verb that hooks or runs a model takes.

TransformerLens's hooks belong to the model, not to a thread: a :func:`~headsurgeon.mitigation`
block or a census's probes in one thread act on every other thread's forward passes of the same
model. So a verb that installs hooks, runs forward passes or changes weights holds its model for
its whole call (a context manager such as ``mitigation`` or ``ablate_heads`` for its block); the
same holder may nest verbs (a census inside ``with mitigation(model, ...)``), another is refused
at once with :class:`~headsurgeon.errors.ModelInUseError`, never left to read a number the first
one's hooks changed. A holder is a thread, or an asyncio task in it: tasks share their thread, so
a task's verb while another task's block is open (awaiting inside it) is refused the same way.
Threads or tasks that each hold their own ``copy.deepcopy(model)`` run freely; a copy made inside
a ``mitigation`` or ``ablate_heads`` block would keep that block's hooks (and compute its numbers
forever), so it is refused in one line, as pickling the model there is (``torch.save(model)``,
``pickle.dumps``): copy or save before entering a block, or after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from headsurgeon.errors import InvalidArgumentError, ModelInUseError

__all__ = [
    "holding",
    "holder",
    "hooked",
]

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass
class _Hold:
    thread: int  # threading.get_ident() of the holder
    name: str  # the holder thread's name, for the message
    task: asyncio.Task | None  # the holder's asyncio task in that thread, if it runs in one
    verb: str  # the outermost verb it runs
    depth: int  # nested holds by that holder

    def where(self) -> str:
        """The holder in words: ``thread MainThread``, ``asyncio task Task-2 in thread ...``."""
        task = "" if self.task is None else f"asyncio task {self.task.get_name()} in "
        return f"{task}thread {self.name}"

    def is_mine(self, thread: int, task: asyncio.Task | None) -> bool:
        """Whether the caller (``thread``, ``task``) is this holder. A hold whose task has
        finished (a block entered by hand in a notebook cell, each cell its own task) belongs to
        its thread."""
        if thread != self.thread:
            return False
        return self.task is None or self.task is task or self.task.done()


def _current_task() -> asyncio.Task | None:
    """The asyncio task running in this thread, or None outside one."""
    try:
        return asyncio.current_task()
    except RuntimeError:  # no event loop running in this thread
        return None


# Held models, keyed weakly so a model dropped while held (a thread killed mid-call) is
# forgotten; not stored on the model itself, so copy.deepcopy(model) starts free.
_holds: weakref.WeakKeyDictionary[Any, _Hold] = weakref.WeakKeyDictionary()
_table_lock = threading.Lock()


def holder(model: Any) -> str | None:
    """Who holds ``model`` now (``"run_census in thread MainThread"``), or None when free.

    >>> import torch
    >>> model = torch.nn.Linear(1, 1)
    >>> with holding(model, "run_census"):
    ...     holder(model)
    'run_census in thread MainThread'
    >>> holder(model) is None
    True
    """
    with _table_lock:
        hold = _holds.get(model)
        return None if hold is None else f"{hold.verb} in {hold.where()}"


@contextlib.contextmanager
def holding(model: Any, verb: str) -> Iterator[None]:
    """Hold ``model`` for ``verb`` in this thread (and asyncio task, inside one) until the block
    ends (re-entrant).

    Raises :class:`~headsurgeon.errors.ModelInUseError` at once, without waiting, when another
    thread or task holds it: waiting could deadlock two threads that each hold one model and
    want the other's, and a verb that ran after a wait would still race a user's own forward
    passes.

    >>> import threading, torch
    >>> model, refused = torch.nn.Linear(1, 1), []
    >>> def census():
    ...     try:
    ...         with holding(model, "run_census"):
    ...             pass
    ...     except Exception as error:
    ...         refused.append(str(error))
    >>> with holding(model, "mitigation"), holding(model, "perplexity"):  # nesting: one thread
    ...     worker = threading.Thread(target=census, name="worker")
    ...     worker.start(); worker.join()
    >>> print(refused[0])  # doctest: +ELLIPSIS
    run_census: the model is in use by mitigation in thread MainThread; ...
    """
    try:
        weakref.ref(model)
        hash(model)
    except TypeError:  # not a model at all: the verb's door refuses it in its own words
        yield
        return
    me, task = threading.get_ident(), _current_task()
    with _table_lock:
        hold = _holds.get(model)
        if hold is None:
            hold = _holds[model] = _Hold(me, threading.current_thread().name, task, verb, 0)
        elif not hold.is_mine(me, task):
            raise ModelInUseError(
                f"{verb}: the model is in use by {hold.verb} in {hold.where()}; a model's "
                "hooks act on every thread and task, so give each its own copy "
                "(copy.deepcopy(model), made outside any mitigation or ablate_heads block: a copy "
                "keeps the hooks of the block it was made in) or wait for that call to end"
            )
        hold.depth += 1
    try:
        yield
    finally:
        with _table_lock:
            hold.depth -= 1
            if hold.depth == 0:
                _holds.pop(model, None)


def holds_model(verb: str, *, argument: str = "model") -> Callable[[F], F]:
    """Decorator: the call holds its ``argument`` (the model) for ``verb`` (see :func:`holding`).

    For plain functions; a context manager (a generator) holds the model inside its body, with
    :func:`holding` around its ``yield``, so the hold lasts for the user's block.
    """

    def decorate(function: F) -> F:
        position = list(inspect.signature(function).parameters).index(argument)

        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            if argument in kwargs:
                model = kwargs[argument]
            elif position < len(args):
                model = args[position]
            else:  # missing: Python's own TypeError says so
                return function(*args, **kwargs)
            with holding(model, verb):
                return function(*args, **kwargs)

        return call  # type: ignore[return-value]

    return decorate


# The blocks whose hooks are on a model, innermost last (in the model's __dict__, so that the
# refusal below goes with the model, whichever thread holds it).
_BLOCKS = "headsurgeon_hook_blocks"


@contextlib.contextmanager
def hooked(model: Any, block: str) -> Iterator[None]:
    """Hold ``model`` for ``block`` (:func:`holding`) while the block's hooks are on it, and
    refuse ``copy.deepcopy(model)`` and pickling it (``torch.save(model)``, ``pickle.dumps``,
    ``copy.copy``) inside it in one :class:`~headsurgeon.errors.InvalidArgumentError` line: a
    copy would keep the hooks and compute the block's numbers forever (and the block's hooks
    are closures, which pickle cannot save). Nested blocks lift the refusal when the outermost
    ends.

    >>> import copy, torch
    >>> model = torch.nn.Linear(1, 1)
    >>> with hooked(model, "mitigation"):
    ...     copy.deepcopy(model)
    Traceback (most recent call last):
    ...
    headsurgeon.errors.InvalidArgumentError: copy.deepcopy(model) inside the mitigation block ...
    >>> copied = copy.deepcopy(model)  # after the block: a clean copy
    """
    with holding(model, block):
        blocks = model.__dict__.setdefault(_BLOCKS, [])
        blocks.append(block)
        # copy.deepcopy looks __deepcopy__ up on the instance first, pickle (torch.save too)
        # and copy.copy __reduce_ex__.
        model.__dict__["__deepcopy__"] = _refuse_copy(blocks)
        model.__dict__["__reduce_ex__"] = _refuse_pickle(blocks)
        try:
            yield
        finally:
            blocks.pop()
            if not blocks:
                for name in ("__deepcopy__", "__reduce_ex__", _BLOCKS):
                    del model.__dict__[name]


def _refuse_copy(blocks: list[str]) -> Callable[[dict], None]:
    def refuse(memo: dict) -> None:
        raise InvalidArgumentError(
            f"copy.deepcopy(model) inside the {blocks[-1]} block would copy the block's hooks, "
            "and the copy would compute the block's numbers forever; copy the model before "
            "the block (and enter a block of its own with the copy)"
        )

    return refuse


def _refuse_pickle(blocks: list[str]) -> Callable[[int], None]:
    def refuse(protocol: int) -> None:
        raise InvalidArgumentError(
            f"saving or pickling the model (torch.save(model), pickle.dumps, copy.copy) inside "
            f"the {blocks[-1]} block would take the block's hooks along; save the model after "
            "the block ends, or torch.save(model.state_dict()) (weights only, no hooks)"
        )

    return refuse
