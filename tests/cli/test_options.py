"""The defaults the tools' parsers show (headsurgeon.cli.options, importable without torch) are
the library's own: each copy equal to its original."""

from __future__ import annotations

import dataclasses

from headsurgeon import (
    alibi,
    census,
    defaults as options,
    importance,
    received,
    sink_cache,
    surgery,
)
from headsurgeon.blindness import ANALYSED_DTYPES, CONVENTIONS
from headsurgeon.classify import Thresholds
from headsurgeon.dtypes import DTYPES
from headsurgeon.finetune import FinetuneConfig
from headsurgeon.loading import ALIBI_SHAPES, BLOOM_SHAPES, model_shape
from headsurgeon.repair import DRIFT_THRESHOLD, MAX_PPL_INCREASE


def test_every_copy_is_the_library_value():
    assert dict(options.GU_PROTOCOL) == dict(census.GU_PROTOCOL)
    thresholds = (options.SINK_THRESHOLD, options.DEAD_THRESHOLD, options.MIN_OUTPUT_SHARE)
    assert thresholds == tuple(dataclasses.asdict(Thresholds()).values())
    assert options.IMPORTANCE_METHODS == importance.METHODS
    assert options.RECEIVED_THRESHOLD == received.THRESHOLD
    assert (options.ANALYSED_DTYPES, options.CONVENTIONS) == (ANALYSED_DTYPES, CONVENTIONS)
    assert options.LIMITS == alibi.LIMITS
    assert options.BIAS_KINDS == alibi.BIAS_KINDS
    assert options.ROBUST_MODES == alibi.ROBUST_MODES
    assert options.SINK_POSITIONS == sink_cache.POSITIONS
    assert options.INITS == surgery.INITS
    assert (options.DRIFT_THRESHOLD, options.MAX_PPL_INCREASE) == (
        DRIFT_THRESHOLD,
        MAX_PPL_INCREASE,
    )
    assert {name: str(dtype).removeprefix("torch.") for name, dtype in DTYPES.items()} == dict(
        options.DTYPE_NAMES
    )
    finetune = FinetuneConfig()
    assert options.FINETUNE == {name: getattr(finetune, name) for name in options.FINETUNE}


def test_the_shape_names_are_those_model_shape_knows_without_a_folder():
    official = {f"bigscience/{name}" for name in BLOOM_SHAPES} | {"bigscience/bloom"}
    others = {"mosaicml/mpt-7b", "tiiuae/falcon-rw-1b", "tiiuae/falcon-rw-7b"}
    assert options.SHAPE_NAMES == set(BLOOM_SHAPES) | official | set(ALIBI_SHAPES) | others
    for name in options.SHAPE_NAMES:  # each one known by model_shape, without files
        assert model_shape(name).positional == "alibi"
