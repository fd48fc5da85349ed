"""Argument checks at the public boundary: one function per kind of value.

Public functions check their arguments once, with these, and pass validated values down. Each
raises :class:`~headsurgeon.errors.InvalidArgumentError` with one line naming the argument, what
it must be and what it got, and returns the value in its plain Python type (``numpy.int64(3)``
becomes ``3``), so callers can use the result directly.

>>> check_int(3, "passes", minimum=1)
3
>>> check_int(0, "passes", minimum=1)
Traceback (most recent call last):
headsurgeon.errors.InvalidArgumentError: passes must be an integer >= 1, got 0
>>> check_number(0.5, "sink", low=0, high=1)
0.5
>>> check_number(float("nan"), "lr", low=0, low_open=True)
Traceback (most recent call last):
headsurgeon.errors.InvalidArgumentError: lr must be a finite number > 0, got nan
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable

import numpy as np

from headsurgeon.errors import InvalidArgumentError

__all__: list[str] = []


def _bounds(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    """`` >= 0 and < 1``-style text for an error message (empty without bounds)."""
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {_limit(low)}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {_limit(high)}")
    text = " and ".join(parts)
    return f" {text}" if text else ""


def _limit(bound: float) -> str:
    """A bound as written: an integer in full (2**63 - 1 is not 9.22337e+18), a float by ``g``."""
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def _shown(value: object, longest: int = 80) -> str:
    """``repr(value)`` for an error message, shortened: a huge integer by its size (Python
    refuses to print one of over 4,300 digits), any other long repr cut at ``longest``.

    >>> _shown(10**5000), _shown("x" * 100)[-6:]
    ('an integer of about 5001 digits', "xx...'")
    """
    if isinstance(value, int) and value.bit_length() > 256:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= longest else f"{text[: longest - 4]}...{text[-1]}"


MAX_SEED = 2**63 - 1  # seeds are 64-bit signed integers in torch and the run records
# Every count reaches torch or numpy as int64: beyond it, an OverflowError deep inside.
_MAX_INT = 2**63 - 1


def check_int(
    value: object, name: str, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """``value`` as an ``int`` if it is an integer within ``[minimum, maximum]``.

    Integers of numpy and 0-d integer tensors count (they have ``__index__``); bools do not.
    ``maximum`` defaults to 2**63 - 1, the largest int64 (``10**30`` is one line, not an
    ``OverflowError`` in torch).
    """
    number = None
    if not isinstance(value, (bool, np.bool_)):
        try:
            number = operator.index(value)
        except TypeError:
            pass
        if number is not None and (minimum is None or number >= minimum):
            if number <= (_MAX_INT if maximum is None else maximum):
                return number
    if maximum is None and number is not None and number > _MAX_INT:
        maximum = _MAX_INT  # named only where it is what the value broke
    bounds = _bounds(minimum, maximum, False, False)
    raise InvalidArgumentError(f"{name} must be an integer{bounds}, got {_shown(value)}")


def check_number(
    value: object,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    finite: bool = True,
) -> float:
    """``value`` as a ``float`` if it is a real number within the bounds (open or closed).

    NaN is never accepted; infinities only with ``finite=False`` (and then bounds still apply).
    """
    ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    if ok:
        try:
            x = float(value)
        except OverflowError:  # an integer beyond float's range: infinite for the bounds
            x = math.inf if value > 0 else -math.inf
        ok = not math.isnan(x) and (math.isfinite(x) or not finite)
        ok = ok and (low is None or (x > low if low_open else x >= low))
        ok = ok and (high is None or (x < high if high_open else x <= high))
        if ok:
            return x
    bounds = _bounds(low, high, low_open, high_open)
    kind = "a finite number" if finite else "a number"
    raise InvalidArgumentError(f"{name} must be {kind}{bounds}, got {_shown(value)}")


def check_choice(value: object, name: str, choices: Iterable[str]) -> str:
    """``value`` if it is one of ``choices`` (compared as given: no case folding)."""
    choices = list(choices)
    if isinstance(value, str) and value in choices:
        return value
    raise InvalidArgumentError(f"unknown {name} {_shown(value)}; use one of {', '.join(choices)}")


def check_bool(value: object, name: str) -> bool:
    """``value`` if it is ``True`` or ``False`` (numpy bools too)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise InvalidArgumentError(f"{name} must be True or False, got {_shown(value)}")
