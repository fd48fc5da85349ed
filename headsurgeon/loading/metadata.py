"""``headsurgeon.json``: the one schema of what headsurgeon records beside a checkpoint.

>>> check_metadata({"prepend_bos": None, "notes": "kept as they are"}, "headsurgeon.json")
{'prepend_bos': None, 'notes': 'kept as they are'}

The tools read ``prepend_bos``, the training run's sizes and ``seq_len``, ``repair`` (the settings
a model recommends) and ``alibi``; analyses/train_organism.py, plant_injuries.py and
:func:`headsurgeon.checkpoints.save_hf` write them. Other fields are kept for people and tools.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from headsurgeon.errors import CheckpointError, first_line
from headsurgeon.exact_alibi import trained_bias
from headsurgeon.loading.files import METADATA_FILE, is_int, read_json
from headsurgeon.loading.numerics import from_record

__all__ = [
    "check_metadata",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Value:
    """What one ``headsurgeon.json`` field may hold. ``fields``: a dict's known fields;
    ``closed``: other fields refused (settings that would be ignored); ``each``: every value."""

    kind: str  # "int", "number", "bool", "str", "list" or "dict"
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    nullable: bool = False
    fields: dict[str, _Value] | None = None
    closed: bool = False
    each: _Value | None = None

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if self.kind in ("int", "number"):
            number = is_int(value) or (self.kind == "number" and isinstance(value, float))
            return number and math.isfinite(value) and self._in_range(value)
        types = {"bool": bool, "str": str, "list": list, "dict": dict}
        return isinstance(value, types[self.kind])

    def _in_range(self, value: float) -> bool:
        low_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
        return low_ok and (self.high is None or value <= self.high)

    def describe(self) -> str:
        what = {
            "int": "an integer",
            "number": "a finite number",
            "bool": "true or false",
            "str": "a string",
            "list": "a list",
            "dict": "an object",
        }[self.kind]
        bounds = []
        if self.low is not None:
            bounds.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            bounds.append(f"<= {self.high:g}")
        what += f" {' and '.join(bounds)}" if bounds else ""
        if self.kind == "dict" and self.closed and self.fields:
            what += f" with only {', '.join(self.fields)}"
        return what + (" or null" if self.nullable else "")


_COUNT = _Value("int", low=1)
_STEPS = _Value("int", low=0)
# What the tools read (prepend_bos, training's sizes and seq_len, repair, alibi), and what
# analyses/train_organism.py, plant_injuries.py and save_hf write.
_METADATA = _Value(
    "dict",
    fields={
        "name": _Value("str"),
        "description": _Value("str"),
        "exported_from": _Value("str"),
        "prepend_bos": _Value("bool", nullable=True),
        "alibi": _Value("dict"),  # checked by exact_alibi.trained_bias
        "training_numerics": _Value("dict"),  # checked by numerics.from_record
        "training": _Value(
            "dict",
            fields={
                "seq_len": _COUNT,
                "config": _Value(
                    "dict",
                    fields={
                        "n_layer": _COUNT,
                        "n_head": _COUNT,
                        "hidden_size": _COUNT,
                        "vocab_size": _COUNT,
                        "seq_len": _COUNT,
                        "batch": _COUNT,
                        "parameters": _COUNT,
                        "warmup_steps": _STEPS,
                        "peak_lr": _Value("number", low=0, low_open=True),
                        "weight_decay": _Value("number", low=0),
                        "retrieval_share": _Value("number", low=0, high=1),
                    },
                ),
                "steps": _STEPS,
                "planned_steps": _STEPS,
                "tokens_seen": _STEPS,
                "seed": _Value("int"),
                "minutes": _Value("number", low=0),
                "max_bos_mass": _Value("number", low=0, high=1),
                "final_heldout_loss": _Value("dict", each=_Value("number")),
            },
        ),
        # recommended_config applies these two; any other setting would be silently ignored.
        "repair": _Value(
            "dict",
            closed=True,
            fields={"steps": _COUNT, "lr": _Value("number", low=0, high=1, low_open=True)},
        ),
        "corpus": _Value("list"),
        "injuries": _Value("list"),
    },
)


def check_metadata(data: Any, path: str | os.PathLike) -> dict[str, Any]:
    """``data`` (a ``headsurgeon.json``'s contents) if every known field has its type and range.

    Known fields: ``name``, ``description``, ``exported_from`` (strings); ``prepend_bos``
    (true, false or null); ``alibi`` (the trained ALiBi variant, see
    :func:`~headsurgeon.exact_alibi.trained_bias`); ``training_numerics`` (how its attention
    was computed in training, :class:`~headsurgeon.loading.numerics.TrainingNumerics`);
    ``training`` (``seq_len``, ``steps``,
    ``seed``, ... and ``config`` with the sizes trained, ``n_layer``, ``n_head``, ...);
    ``repair`` (``steps`` >= 1 and ``lr`` in (0, 1], the only settings a model recommends);
    ``corpus`` and ``injuries`` (lists). Other fields are accepted and kept, as a record for
    people and other tools; one that looks like a misspelt known field is logged as a warning.
    A bad value is one :class:`CheckpointError` naming ``path`` and the field, e.g.
    ``…/headsurgeon.json: repair.steps is -5; it must be an integer >= 1``.

    >>> check_metadata({"repair": {"steps": 300, "lr": 2e-3}}, "headsurgeon.json")
    {'repair': {'steps': 300, 'lr': 0.002}}
    >>> check_metadata({"prepend_bos": "yes"}, "m/headsurgeon.json")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    headsurgeon.errors.CheckpointError: m/headsurgeon.json: prepend_bos is "yes"; it must be ...
    """
    _check_value(data, _METADATA, "", str(path))
    if data.get("training_numerics") is not None:
        from_record(data["training_numerics"], f"{path}: training_numerics")
    if data.get("alibi") is not None:
        try:
            trained_bias(data)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: alibi: {first_line(e)}") from None
    return data


def _check_value(value: Any, spec: _Value, field: str, path: str) -> None:
    shown = field or "the file"
    if not spec.accepts(value):
        try:
            text = json.dumps(value, allow_nan=True)
        except (TypeError, ValueError):
            text = repr(value)
        text = text if len(text) <= 60 else text[:57] + "..."
        raise CheckpointError(
            f"{path}: {shown} is {text}; it must be {spec.describe()}; correct the file or "
            "remove the field"
        )
    if not isinstance(value, dict):
        return
    known = spec.fields or {}
    for key, item in value.items():
        name = f"{field}.{key}" if field else str(key)
        if key in known:
            _check_value(item, known[key], name, path)
        elif spec.each is not None:
            _check_value(item, spec.each, name, path)
        elif spec.closed:
            raise CheckpointError(
                f"{path}: {name} is not a setting a model recommends (only "
                f"{', '.join(known)}), so it would be ignored; remove it"
            )
        elif close := difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.8):
            logger.warning(
                "%s: unknown field %s is kept but not used; did you mean %s?", path, name, close[0]
            )


def folder_metadata(directory: Path) -> dict[str, Any]:
    """The folder's ``headsurgeon.json``, read bounded and checked; ``{}`` without one."""
    file = directory / METADATA_FILE
    if not os.path.lexists(file):
        return {}
    return check_metadata(read_json(file), file)
