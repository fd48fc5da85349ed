"""Progress bars that suit where they run: ``from headsurgeon.progress import tqdm``.

``tqdm.auto`` picks Jupyter widgets inside a kernel, but without ``ipywidgets`` installed it
falls back to text bars after a "IProgress not found" warning. This module gives
``tqdm.auto.tqdm`` when ``ipywidgets`` is installed (widgets in Jupyter, text elsewhere) and
plain text ``tqdm.std.tqdm`` otherwise. In the second case it also imports ``tqdm.auto`` once,
with that one warning ignored, so that TransformerLens's own ``tqdm.auto`` bars fall back to text
silently too; ``headsurgeon.backend``, the one module that imports TransformerLens, imports this
module first for that reason. Install
``ipywidgets`` for widget bars.

:class:`RunBar` is one bar for a run made of several kinds of work (training steps, censuses,
evaluations): it counts one kind and shows the time left for all of them, from the measured
duration of each kind.

:func:`show_progress_lines` shows the library's progress lines (the run's estimated duration,
each pass's result) where a notebook or script that never set up ``logging`` sees them: on
stderr, above the bar, during the call, and only while nothing else handles them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

if importlib.util.find_spec("ipywidgets") is not None:
    from tqdm.auto import tqdm
else:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        import tqdm.auto  # noqa: F401  (imported quietly once; later imports reuse it)
    from tqdm.std import tqdm

__all__ = [
    "tqdm",
]

PACKAGE = "headsurgeon"  # the logger whose lines show_progress_lines shows


class RunBar(tqdm):
    """A bar over a run's ``counted`` units (training steps) whose time left covers the run's
    other planned work too (censuses, evaluations).

    ``plan`` is how many units of each kind the whole run does. The worker reports each unit
    with :meth:`done`, and the seconds it took where measured; the time left is then
    every kind's units left times its mean measured duration, and the bar shows it (its rate is
    the counted units left over that time). :meth:`range_left` gives the spread: the counted
    units at their median and 90th-percentile durations. ``tell``, if given, is called once,
    when ``tell_after`` counted units are timed (all of them, if fewer are planned): the moment
    to announce the run's duration.
    ``done_already`` starts the bar at the units a resumed run finished before.

    >>> bar = RunBar({"step": 10, "census": 2}, disable=True)
    >>> for seconds in (1.0, 0.5, 0.5, 0.5): bar.done("step", seconds=seconds)
    >>> bar.done("census", seconds=3.0)
    >>> bar.n, bar.seconds_left(), bar.range_left(), bar.describe()
    (4, 6.75, (6.0, 8.1), '6 steps of 0.50-0.85 s, 1 census of 3.00 s')
    """

    def __init__(
        self,
        plan: dict[str, int],
        *,
        counted: str = "step",
        done_already: dict[str, int] | None = None,
        tell: Callable[[RunBar], None] | None = None,
        tell_after: int = 5,
        **kwargs: Any,
    ) -> None:
        done_already = done_already or {}
        self.plan = dict(plan)
        self.left = {kind: n - done_already.get(kind, 0) for kind, n in plan.items()}
        self.counted, self.tell = counted, tell
        self.tell_after = max(1, min(tell_after, self.left[counted]))
        self.timings: dict[str, tuple[float, int]] = {}  # kind: (seconds, units measured)
        self.unit_seconds: list[float] = []  # each timed counted unit's seconds
        self.finish_at: float | None = None
        done = plan[counted] - self.left[counted]
        super().__init__(total=plan[counted], initial=done, unit=counted, **kwargs)

    def done(self, kind: str, units: int = 1, *, seconds: float | None = None) -> None:
        """``units`` of ``kind`` finished, taking ``seconds`` if measured; the bar moves for
        the counted kind."""
        self.left[kind] -= units
        if seconds is not None:
            total, count = self.timings.get(kind, (0.0, 0))
            self.timings[kind] = (total + seconds, count + units)
            if kind == self.counted:
                self.unit_seconds.extend([seconds / units] * units)
        told = kind == self.counted and len(self.unit_seconds) == self.tell_after
        self._estimate()
        if kind != self.counted:
            self.refresh()
        elif self.disable:  # tqdm counts nothing then; the count still tells how far the run is
            self.n += units
        else:
            self.update(units)
        if told and seconds is not None and self.tell is not None:
            self.tell(self)

    def drop(self, kind: str, units: int) -> None:
        """``units`` of ``kind`` planned will not run (the run stopped early)."""
        self.plan[kind] -= units
        self.left[kind] -= units
        if kind == self.counted:
            self.total -= units
        self._estimate()
        self.refresh()

    def seconds_left(self) -> float | None:
        """Seconds the run's units left take at their kinds' mean measured durations (kinds
        not measured yet left out); None before the counted kind is measured."""
        if self.counted not in self.timings:
            return None
        return sum(self.left[k] * seconds / n for k, (seconds, n) in self.timings.items())

    def unit_range(self) -> tuple[float, float] | None:
        """The counted units' median and 90th-percentile measured durations (None before one
        is measured)."""
        if not self.unit_seconds:
            return None
        ordered = sorted(self.unit_seconds)
        if len(ordered) == 1:
            return ordered[0], ordered[0]
        return statistics.median(ordered), statistics.quantiles(ordered, n=10, method="inclusive")[
            -1
        ]

    def range_left(self) -> tuple[float, float] | None:
        """Seconds the run's units left take: the counted units at :meth:`unit_range`'s low and
        high, the other kinds at their means (kinds not measured yet left out), rounded to
        0.1 s; None before the counted kind is measured."""
        spread = self.unit_range()
        if spread is None:
            return None
        others = sum(
            self.left[k] * seconds / n
            for k, (seconds, n) in self.timings.items()
            if k != self.counted
        )
        low, high = (others + self.left[self.counted] * unit for unit in spread)
        return round(low, 1), round(high, 1)

    def describe(self) -> str:
        """The units left and their measured durations, e.g. ``"8 steps of 0.50-0.61 s, 1
        census of 3.00 s"`` (the counted kind: median-90th percentile); kinds not measured yet
        are named as such."""
        parts = []
        for kind, left in self.left.items():
            if left <= 0:
                continue
            name = kind if left == 1 else _plural(kind)
            spread = self.unit_range() if kind == self.counted else None
            if spread is not None:
                parts.append(f"{left} {name} of {spread[0]:.2f}-{spread[1]:.2f} s")
            elif kind in self.timings:
                seconds, n = self.timings[kind]
                parts.append(f"{left} {name} of {seconds / n:.2f} s")
            else:
                parts.append(f"{left} {name} not timed yet")
        return ", ".join(parts)

    def _estimate(self) -> None:
        left = self.seconds_left()
        self.finish_at = None if left is None else time.monotonic() + left

    @property
    def format_dict(self) -> dict[str, Any]:
        """tqdm's, its rate such that the time shown left is the whole run's."""
        shown = super().format_dict
        total, n = shown.get("total"), shown.get("n")
        if self.finish_at is not None and total and n is not None and total > n:
            shown["rate"] = (total - n) / max(self.finish_at - time.monotonic(), 1e-3)
        return shown


class _AboveTheBar(logging.Handler):
    """Log lines on stderr, written above a progress bar rather than into its line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging's rule: a failing handler reports, never raises
            self.handleError(record)


def _logging_set_up(package: logging.Logger) -> bool:
    """Whether anything decides where ``package``'s lines go: a root handler, a handler on it or
    one of its child loggers, or a level set on it."""
    if logging.root.handlers or package.level != logging.NOTSET:
        return True
    prefix = package.name + "."
    return any(
        isinstance(log, logging.Logger)
        and log.handlers
        and (log is package or name.startswith(prefix))
        for name, log in [(package.name, package), *logging.Logger.manager.loggerDict.items()]
    )


@contextlib.contextmanager
def show_progress_lines() -> Iterator[None]:
    """Inside: the library's INFO lines (progress, the estimated duration, each pass's
    result) and warnings on stderr, above any bar, when ``logging`` is not set up at all (no
    root handler, no handler or level on the ``headsurgeon`` loggers), as in a notebook; Python
    alone would show only warnings, and those without their context. Where the program (or the
    command line) set up logging, nothing changes. Nothing stays after; nested uses show each
    line once. Usable as a decorator: ``@show_progress_lines()``.
    """
    package = logging.getLogger(PACKAGE)
    if _logging_set_up(package):
        yield
        return
    handler = _AboveTheBar(logging.INFO)
    handler.setFormatter(logging.Formatter("%(message)s"))
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    try:
        yield
    finally:
        package.removeHandler(handler)
        package.setLevel(logging.NOTSET)


def _plural(kind: str) -> str:
    """``"censuses"``, ``"perplexities"``, ``"steps"``."""
    if kind.endswith("s"):
        return kind + "es"
    return kind[:-1] + "ies" if kind.endswith("y") else kind + "s"
