"""How a model's attention was computed while it was trained: its training numerics.

A bias form and a dtype the model never saw is a mismatch, not a property of the model, so
every precision measurement can be read against the numerics the model learnt under.

>>> training_numerics("bigscience/bloom-560m", {}).describe()
'absolute ALiBi bias (slope x key position), scores in bfloat16, softmax in float32'
>>> training_numerics("my-model", {}) is None
True
"""

from __future__ import annotations

import dataclasses
from typing import Any

from headsurgeon.errors import CheckpointError

__all__ = [
    "BIAS_FORMS",
    "TrainingNumerics",
    "training_numerics",
]

# absolute: slope x key position (BLOOM's and Falcon's ports; softmax is shift-invariant);
# relative: -slope x (query - key), small near the diagonal; last-key: slope x (key - last key),
# MPT's own form.
BIAS_FORMS = ("absolute", "relative", "last-key")
BIAS_MEANINGS = {
    "absolute": "slope x key position",
    "relative": "-slope x (query - key)",
    "last-key": "slope x (key - last key)",
}
_DTYPES = ("float64", "float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class TrainingNumerics:
    """How the attention scores were formed in training (``None`` fields: not published).

    ``bias``: one of :data:`BIAS_FORMS`; ``scores_dtype``: the dtype the bias and the scores
    ``q.k / sqrt(d) + bias`` were rounded to; ``softmax_dtype``: the dtype the softmax ran in
    (its weights then rounded to ``scores_dtype``); ``source``: where this is known from.
    """

    bias: str
    scores_dtype: str | None
    softmax_dtype: str | None
    source: str

    def describe(self) -> str:
        """One line, the fields in words (the source left out)."""
        parts = [f"{self.bias} ALiBi bias ({BIAS_MEANINGS[self.bias]})"]
        parts.append(f"scores in {self.scores_dtype or 'an unpublished dtype'}")
        parts.append(f"softmax in {self.softmax_dtype or 'an unpublished dtype'}")
        return ", ".join(parts)

    @property
    def unknown(self) -> list[str]:
        """The fields not published."""
        return [f for f in ("scores_dtype", "softmax_dtype") if getattr(self, f) is None]


_MEGATRON = (
    "bigscience-workshop/Megatron-DeepSpeed, megatron/model/transformer.py (ParallelAttention): "
    "the ALiBi tensor is slopes x arange(key position), cast to the bfloat16 parameters' dtype "
    "and added as baddbmm's input in bfloat16; the fused scale-mask softmax computes in float32 "
    "and writes bfloat16"
)
_FALCON = (
    "transformers' port of Falcon-RW (modeling_falcon.build_alibi_tensor): slopes.bfloat16() x "
    "arange(key position) in bfloat16, kept on purpose (an NVIDIA TensorRT port, issue "
    "667 / PR 674, reproduces this rounding for parity on long greedy generations); the softmax "
    "dtype of the original training is not published"
)
_MPT = (
    "mosaicml/llm-foundry PR 329: MPT's ALiBi bias is built and kept in float32, relative to "
    "the last key; the dtype of the scores in training (a fused kernel) is not published"
)
# Published models by the name's last part (``bigscience/bloom-560m`` -> ``bloom-560m``).
PUBLISHED_NUMERICS: dict[str, TrainingNumerics] = {
    **{
        name: TrainingNumerics("absolute", "bfloat16", "float32", _MEGATRON)
        for name in ("bloom-560m", "bloom-1b1", "bloom-1b7", "bloom-3b", "bloom-7b1", "bloom")
    },
    "bloom-176b": TrainingNumerics("absolute", "bfloat16", "float32", _MEGATRON),
    "falcon-rw-1b": TrainingNumerics("absolute", "bfloat16", None, _FALCON),
    "falcon-rw-7b": TrainingNumerics("absolute", "bfloat16", None, _FALCON),
    "mpt-7b": TrainingNumerics("last-key", None, None, _MPT),
}


def training_numerics(name: str, metadata: dict[str, Any]) -> TrainingNumerics | None:
    """A model's training numerics: its ``headsurgeon.json``'s ``training_numerics``, else the
    published ones of its name (:data:`PUBLISHED_NUMERICS`), else ``None`` (unknown).

    ``name``: the model's name or hub id; ``metadata``: its checked ``headsurgeon.json``.
    """
    recorded = metadata.get("training_numerics")
    if recorded is not None:
        return from_record(recorded, "headsurgeon.json: training_numerics")
    return PUBLISHED_NUMERICS.get(str(name).rstrip("/").rsplit("/", 1)[-1].lower())


def from_record(record: Any, where: str) -> TrainingNumerics:
    """A :class:`TrainingNumerics` from its JSON form, checked (one line naming ``where``)."""
    if not isinstance(record, dict) or record.get("bias") not in BIAS_FORMS:
        raise CheckpointError(
            f"{where}: bias must be one of {', '.join(BIAS_FORMS)}; correct the file or remove "
            "the field"
        )
    for field in ("scores_dtype", "softmax_dtype"):
        if record.get(field) not in (*_DTYPES, None):
            raise CheckpointError(
                f"{where}: {field} is {record.get(field)!r}; it must be one of "
                f"{', '.join(_DTYPES)} or null; correct the file or remove the field"
            )
    return TrainingNumerics(
        bias=record["bias"],
        scores_dtype=record.get("scores_dtype"),
        softmax_dtype=record.get("softmax_dtype"),
        source=str(record.get("source", "headsurgeon.json")),
    )
