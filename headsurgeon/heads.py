"""The vocabulary of heads: which heads (``HeadSet``, ``Heads``) and what a census calls them.

A leaf: every layer may use it, the models layer included (``checkpoints`` names the heads a save
changed). :mod:`headsurgeon.surgery` and :mod:`headsurgeon.classify` re-export these names.

A head set is checked against a model (its ``cfg``) or a :class:`headsurgeon.loading.ModelShape`
by their layer and head counts only.

>>> heads = HeadSet.parse("L5H9-11,L6H10")
>>> len(heads), str(heads), heads.layers
(4, 'L5H9-11,L6H10', (5, 6))
>>> str(HeadSet.parse("L1-2H0,L1H3"))
'L1H0,L1H3,L2H0'
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, NamedTuple

import pandas as pd

from headsurgeon.errors import InvalidArgumentError
from headsurgeon.validation import check_int

if TYPE_CHECKING:  # annotations only: a leaf imports no model code
    from headsurgeon.backend import Model
    from headsurgeon.loading import ModelShape

__all__ = [
    "HeadSet",
    "Heads",
    "LABELS",
    "SICK_LABELS",
]

LABELS = ("healthy", "BOS-sink", "dead")
SICK_LABELS = ("dead", "BOS-sink")
# More heads than any real model has (BLOOM-176B: 70 layers x 112 heads = 7,840), so a head set,
# and every layer or head number in one, is bounded before anything is expanded or allocated:
# "L0-100000H0-100000" is refused at once instead of filling memory.
MAX_HEADS = 65_536

_TOKEN = re.compile(r"^L(\d+)(?:-(\d+))?H(\d+)(?:-(\d+))?$", re.IGNORECASE)


def _name(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


_HEADS_FORMS = (
    "heads must be a HeadSet, text such as 'L5H9-11,L6H0', (layer, head) pairs or "
    "{{layer: [heads]}}; got {heads}"
)


def _clip(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def _short(value: object) -> str:
    return _clip(repr(value))


def _pair(item: object) -> tuple[int, int]:
    """One ``(layer, head)`` pair of non-negative integers (numpy ints and rows count)."""
    if isinstance(item, (str, bytes)) or not hasattr(item, "__len__") or len(item) != 2:
        hint = " (text goes through HeadSet.of or HeadSet.parse)" if isinstance(item, str) else ""
        raise InvalidArgumentError(
            f"cannot read head {_short(item)}: give (layer, head) pairs of integers{hint}"
        )
    layer, head = item
    return (
        check_int(layer, f"the layer of head {_short(item)}", minimum=0, maximum=MAX_HEADS - 1),
        check_int(head, f"the head index of head {_short(item)}", minimum=0, maximum=MAX_HEADS - 1),
    )


def _ints(heads: object) -> Iterator[object]:
    """A layer's heads in a ``{layer: heads}`` mapping: one int or an iterable of ints (read
    lazily, so that :class:`HeadSet` can stop a huge one at :data:`MAX_HEADS`)."""
    items = [heads] if isinstance(heads, int) else heads
    if not isinstance(items, Iterable) or isinstance(items, str):
        raise InvalidArgumentError(_HEADS_FORMS.format(heads=_short(heads)))
    return iter(items)


def _too_many(spec: object, count: int | None = None) -> InvalidArgumentError:
    names = "more than" if count is None else f"{count:,} heads, more than"
    return InvalidArgumentError(
        f"{_short(spec)} names {names} the {MAX_HEADS:,} heads a head set may hold (no model "
        "has as many); name the heads of the model, e.g. L5H9-11"
    )


class HeadSet:
    """An immutable set of attention heads, kept sorted by (layer, head).

    Build it from pairs, from text (``HeadSet.parse("L5H9,L6H10-15,L7-9H3")``: ranges are
    inclusive) or from a classified census (``HeadSet.from_labels(df)``). Duplicates are an error,
    never silently merged; :meth:`validate` checks the pairs against a model's shape. Set algebra
    (``|``, ``&``, ``-``) returns new sets.

    >>> a = HeadSet([(0, 1), (0, 2)])
    >>> str(a | HeadSet([(1, 0)])), str(a - HeadSet([(0, 2)])), (0, 1) in a
    ('L0H1-2,L1H0', 'L0H1', True)
    >>> HeadSet([(0, 1), (0, 1)])
    Traceback (most recent call last):
    headsurgeon.errors.InvalidArgumentError: head L0H1 is listed twice; list each head once
    """

    def __init__(self, heads: Iterable[tuple[int, int]] = ()) -> None:
        if isinstance(heads, (str, bytes, Mapping)) or not isinstance(heads, Iterable):
            raise InvalidArgumentError(
                f"HeadSet() takes (layer, head) pairs, got {_short(heads)}; for text such as "
                "'L5H9-11' or {layer: [heads]} use HeadSet.of"
            )
        seen: set[tuple[int, int]] = set()
        for pair in map(_pair, heads):
            if len(seen) >= MAX_HEADS:  # before a generator or range runs on for ever
                raise _too_many(heads)
            if pair in seen:
                raise InvalidArgumentError(
                    f"head {_name(*pair)} is listed twice; list each head once"
                )
            seen.add(pair)
        self._heads: tuple[tuple[int, int], ...] = tuple(sorted(seen))

    @classmethod
    def of(cls, heads: Heads, model: Model | ModelShape | None = None) -> HeadSet:
        """Heads in any usual form, as a :class:`HeadSet`; validated against ``model`` if given.

        Takes a ``HeadSet``, text (``"L5H9-11,L6H0"``), ``(layer, head)`` pairs, one pair
        ``(layer, head)`` or ``{layer: [heads]}`` (TransformerLens's ``detect_head`` style). Every
        public function that takes heads goes through here.

        >>> [str(HeadSet.of(x)) for x in ("L1H0-1", [(1, 0), (1, 1)], {1: [0, 1]}, (1, 0))]
        ['L1H0-1', 'L1H0-1', 'L1H0-1', 'L1H0']
        >>> HeadSet.of(5)
        Traceback (most recent call last):
        headsurgeon.errors.InvalidArgumentError: heads must be a HeadSet, text such as ...
        """
        if isinstance(heads, HeadSet):
            chosen = heads
        elif isinstance(heads, str):
            chosen = cls.parse(heads, model)
        elif isinstance(heads, Mapping):
            chosen = cls((layer, head) for layer, hs in heads.items() for head in _ints(hs))
        elif (
            isinstance(heads, tuple)
            and len(heads) == 2
            and all(isinstance(x, numbers.Integral) for x in heads)
        ):  # one (layer, head) pair: integers cannot be pairs, so this reads only one way
            chosen = cls([heads])
        elif isinstance(heads, Iterable):
            chosen = cls(heads)
        else:
            raise InvalidArgumentError(_HEADS_FORMS.format(heads=_short(heads)))
        return chosen.validate(model) if model is not None else chosen

    @classmethod
    def parse(cls, text: str, model: Model | ModelShape | None = None) -> HeadSet:
        """Parse ``"L5H9,L6H10-15,L7-9H3"``; validate against ``model`` when given.

        Every range is checked (against ``model``'s shape when given, and against
        :data:`MAX_HEADS`) before it is expanded, so a huge one fails at once.

        >>> HeadSet.parse("L0-100000H0-100000")
        Traceback (most recent call last):
        headsurgeon.errors.InvalidArgumentError: layer and head numbers stop at 65535 ...
        """
        shape = None if model is None else _shape(model)
        tokens = [t.strip() for t in str(text).replace(" ", "").split(",") if t.strip()]
        if not tokens:
            raise InvalidArgumentError(f"no heads in {text!r}; write heads as L5H9,L6H10-15")
        ranges = [_range(token, shape) for token in tokens]
        total = sum(len(layers) * len(heads) for layers, heads in ranges)
        if total > MAX_HEADS:
            raise _too_many(text, total)
        return cls((layer, head) for layers, heads in ranges for layer in layers for head in heads)

    @classmethod
    def from_labels(cls, census: pd.DataFrame, labels: Iterable[str] = SICK_LABELS) -> HeadSet:
        """The heads of a classified census (columns ``layer``, ``head``, ``label``) with a label
        in ``labels`` (default: dead and BOS-sink heads).

        >>> df = pd.DataFrame({"layer": [0, 0, 1], "head": [0, 1, 0],
        ...                    "label": ["healthy", "BOS-sink", "dead"]})
        >>> str(HeadSet.from_labels(df)), str(HeadSet.from_labels(df, ["dead"]))
        ('L0H1,L1H0', 'L1H0')
        """
        missing = {"layer", "head", "label"} - set(census.columns)
        if missing:
            raise InvalidArgumentError(
                f"census has no {', '.join(sorted(missing))} column; classify it first "
                "(headsurgeon.classify.classify_heads)"
            )
        chosen = census[census["label"].isin(list(labels))]
        return cls(zip(chosen["layer"].tolist(), chosen["head"].tolist(), strict=True))

    def validate(self, model: Model | ModelShape) -> HeadSet:
        """Return ``self`` if every head exists in ``model``; otherwise raise saying which."""
        shape = _shape(model)
        for layer, head in self._heads:
            if layer >= shape.n_layers or head >= shape.n_heads:
                raise _out_of_range(f"head {_name(layer, head)}", shape)
        return self

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers that hold at least one chosen head, ascending."""
        return tuple(sorted({layer for layer, _ in self._heads}))

    def by_layer(self) -> dict[int, list[int]]:
        """``{layer: [head, ...]}`` in ascending order.

        >>> HeadSet.parse("L2H3,L0H1,L2H0").by_layer()
        {0: [1], 2: [0, 3]}
        """
        out: dict[int, list[int]] = {}
        for layer, head in self._heads:
            out.setdefault(layer, []).append(head)
        return out

    def names(self) -> list[str]:
        """One ``L<layer>H<head>`` name per head."""
        return [_name(*pair) for pair in self._heads]

    def __str__(self) -> str:
        parts = []
        for layer, heads in self.by_layer().items():
            start = prev = heads[0]
            for head in [*heads[1:], None]:
                if head is not None and head == prev + 1:
                    prev = head
                    continue
                parts.append(f"L{layer}H{start}" + (f"-{prev}" if prev > start else ""))
                if head is not None:
                    start = prev = head
        return ",".join(parts)

    def __repr__(self) -> str:
        return f"HeadSet({str(self)!r})"

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self._heads)

    def __len__(self) -> int:
        return len(self._heads)

    def __contains__(self, pair: object) -> bool:
        return pair in self._heads

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HeadSet) and self._heads == other._heads

    def __hash__(self) -> int:
        return hash(self._heads)

    def __or__(self, other: HeadSet) -> HeadSet:
        return HeadSet(set(self._heads) | set(other))

    def __and__(self, other: HeadSet) -> HeadSet:
        return HeadSet(set(self._heads) & set(other))

    def __sub__(self, other: HeadSet) -> HeadSet:
        return HeadSet(set(self._heads) - set(other))


Heads = HeadSet | str | Iterable[tuple[int, int]] | Mapping[int, Iterable[int]]


class _Shape(NamedTuple):
    n_layers: int
    n_heads: int


def _shape(model: Model | ModelShape) -> _Shape:
    """The layer and head counts of a model (its ``cfg``) or of a :class:`ModelShape`: all a head
    set is checked against, read without importing the models layer (this module is a leaf)."""
    shape = getattr(model, "cfg", model)
    n_layers, n_heads = getattr(shape, "n_layers", None), getattr(shape, "n_heads", None)
    if not (isinstance(n_layers, numbers.Integral) and isinstance(n_heads, numbers.Integral)):
        raise InvalidArgumentError(
            f"cannot check heads against {_short(model)}: give a model or a ModelShape"
        )
    return _Shape(int(n_layers), int(n_heads))


def _out_of_range(what: str, shape: _Shape) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{what} is out of range: the model has layers 0-{shape.n_layers - 1} and heads "
        f"0-{shape.n_heads - 1}"
    )


def _range(token: str, shape: _Shape | None) -> tuple[range, range]:
    """The layers and heads of one ``L<layers>H<heads>`` token, checked but not expanded."""
    match = _TOKEN.match(token)
    if match is None:
        raise InvalidArgumentError(
            f"cannot read head {_short(token)}; write heads as L<layer>H<head> with optional "
            "ranges, e.g. L5H9,L6H10-15,L7-9H3"
        )
    # A number of more than nine digits is beyond every bound below; int() of thousands of
    # digits would be slow, or refused.
    l0, l1, h0, h1 = (
        None if g is None else int(g) if len(g) <= 9 else 10**9 for g in match.groups()
    )
    l1 = l0 if l1 is None else l1
    h1 = h0 if h1 is None else h1
    if l1 < l0 or h1 < h0:
        raise InvalidArgumentError(f"range in {_short(token)} runs backwards; write low-high")
    if shape is not None and (l1 >= shape.n_layers or h1 >= shape.n_heads):
        what = "head" if (l0, h0) == (l1, h1) else "range"
        raise _out_of_range(f"{what} {_clip(token.upper())}", shape)
    if max(l1, h1) >= MAX_HEADS:
        raise InvalidArgumentError(
            f"layer and head numbers stop at {MAX_HEADS - 1} (no model has more), but "
            f"{_short(token)} goes beyond; name the heads of the model, e.g. L5H9-11"
        )
    return range(l0, l1 + 1), range(h0, h1 + 1)
