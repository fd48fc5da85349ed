"""The defaults and choices the tools' options show, importable without torch or pandas.

The tools build their parsers from these, so that ``--help``, a usage error or a bad path
answers before torch and TransformerLens are imported. Each is a copy of the library's own
value (named beside it); ``tests/cli/test_options.py`` holds every copy equal to the original,
so neither can change alone.

Exports:
    GU_PROTOCOL            headsurgeon.census.GU_PROTOCOL: Gu et al.'s sink-rate census settings
    THRESHOLDS             headsurgeon.classify.Thresholds()'s fields: sink, dead,
                           min_output_share
    IMPORTANCE_METHODS     headsurgeon.importance.METHODS
    RECEIVED_THRESHOLD     headsurgeon.received.THRESHOLD
    ANALYSED_DTYPES, CONVENTIONS   headsurgeon.blindness's
    DTYPE_NAMES            headsurgeon.dtypes.DTYPES's names, each to its canonical name
    LIMITS, BIAS_KINDS, ROBUST_MODES   headsurgeon.alibi's
    SINK_POSITIONS         headsurgeon.sink_cache.POSITIONS
    SHAPE_NAMES            the names headsurgeon.loading.model_shape knows without a folder
                           (headsurgeon.loading.BLOOM_SHAPES, ALIBI_SHAPES and their hub
                           names)
    INITS                  headsurgeon.surgery.INITS
    DRIFT_THRESHOLD, MAX_PPL_INCREASE   headsurgeon.repair's
    FINETUNE               headsurgeon.finetune.FinetuneConfig()'s defaults the repair tool shows

And the repair tool's own, which its parser and its run (:mod:`headsurgeon.cli.repair_run`)
share: EXIT_DAMAGED (3), EXIT_WORSE (4) (its exit statuses beside 0 and 2) and WORK_WRITER (the
mark of its ``<out>.partial`` work folder).
"""

from __future__ import annotations

from types import MappingProxyType

__all__ = [
    "ANALYSED_DTYPES",
    "BIAS_KINDS",
    "CONVENTIONS",
    "DTYPE_NAMES",
    "DRIFT_THRESHOLD",
    "EXIT_DAMAGED",
    "EXIT_WORSE",
    "FINETUNE",
    "GU_PROTOCOL",
    "IMPORTANCE_METHODS",
    "INITS",
    "LIMITS",
    "MAX_PPL_INCREASE",
    "RECEIVED_THRESHOLD",
    "ROBUST_MODES",
    "SHAPE_NAMES",
    "SINK_POSITIONS",
    "THRESHOLDS",
    "WORK_WRITER",
]

GU_PROTOCOL = MappingProxyType({"n_seqs": 100, "seq_len": 64, "sink_eps": 0.3})
THRESHOLDS = MappingProxyType({"sink": 0.5, "dead": 0.95, "min_output_share": 0.01})
IMPORTANCE_METHODS = ("zero", "mean", "resample", "attribution")
RECEIVED_THRESHOLD = 0.3
ANALYSED_DTYPES = ("float32", "bfloat16", "float16")
CONVENTIONS = ("hf", "tl")
DTYPE_NAMES = MappingProxyType(
    {
        **dict.fromkeys(("float32", "fp32", "float"), "float32"),
        **dict.fromkeys(("float16", "fp16", "half"), "float16"),
        **dict.fromkeys(("bfloat16", "bf16"), "bfloat16"),
    }
)
LIMITS = ("normal", "subnormal", "zero")
BIAS_KINDS = ("standard", "relative", "clamped", "log", "softcap", "robust")
ROBUST_MODES = ("scale", "clip")
SINK_POSITIONS = ("cache", "true")
_BLOOMS = ("bloom-560m", "bloom-1b1", "bloom-1b7", "bloom-3b", "bloom-7b1", "bloom-176b")
_OTHER_ALIBI = ("mosaicml/mpt-7b", "tiiuae/falcon-rw-1b", "tiiuae/falcon-rw-7b")
SHAPE_NAMES = frozenset(
    [
        *_BLOOMS,
        *(f"bigscience/{name}" for name in _BLOOMS),
        "bigscience/bloom",
        *_OTHER_ALIBI,
        *(name.split("/")[1] for name in _OTHER_ALIBI),
    ]
)
INITS = ("xavier_normal", "xavier_uniform")
DRIFT_THRESHOLD = 0.05
MAX_PPL_INCREASE = 0.10
FINETUNE = MappingProxyType(
    {
        "steps": 200,
        "lr": 5e-5,
        "weight_decay": 0.0,
        "batch_size": 8,
        "grad_accum": 1,
        "max_grad_norm": 1.0,
        "strategy": "slices",
    }
)

EXIT_DAMAGED = 3  # 2 is bad input (headsurgeon.cli.run)
EXIT_WORSE = 4
WORK_WRITER = "repair work folder"  # the writer in the mark of <out>.partial
