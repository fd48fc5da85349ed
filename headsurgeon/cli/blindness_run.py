"""The work of ``python -m headsurgeon blindness`` once its options are checked and its output
folder claimed (:mod:`headsurgeon.cli.blindness`): the analytic blind distances, the
measurements, print and write (imports torch, TransformerLens, pandas and plotly). The
analytic tables (blind distances, the bias's rounding per dtype) need no weights.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from pathlib import Path
from typing import Any

from headsurgeon.backend import Model
from headsurgeon.blindness import (
    analytic_blindness,
    analytic_rounding,
    measure_blindness,
    mitigation,
)
from headsurgeon.blindness.analysis import dtype_name
from headsurgeon.census import run_census
from headsurgeon.cli import loads
from headsurgeon.cli.options import data_source, placement_args
from headsurgeon.cli.session import in_option_terms
from headsurgeon.data import to_sequences
from headsurgeon.errors import UnsupportedArchitectureError
from headsurgeon.loading import load_model, model_info, model_shape
from headsurgeon.loading.facts import model_metadata
from headsurgeon.loading.numerics import training_numerics
from headsurgeon.precision import PARTS, PRECISION_DTYPES, precision_effect
from headsurgeon.reports import write_blindness
from headsurgeon.reports.blindness import blindness_summary, training_numerics_line
from headsurgeon.sink_cache import SINK_CACHE_CUT, SinkCacheEffect, sink_cache_effect

__all__ = ["blindness"]

logger = logging.getLogger(__name__)


def _shown_name(model: str) -> str:
    """The model as the outputs name it: a local folder by its own name (a path as typed would
    carry the user's home into the page, summary.txt and figures), else the name as typed; what
    load_model names it (resolve_model's display name), without resolving a hub name (an
    analytic run downloads nothing)."""
    path = Path(model).expanduser()
    return path.resolve().name or model if path.is_dir() else model


# The per-head test's cache, which the tool sets from --sinks and --windows, and its skipping,
# which the tool has no option for.
_HEAD_CACHE = {
    "a smaller head_cache (or heads=[] to skip the per-head test)": "smaller --sinks or --windows",
    "head_cache's sinks": "the largest --sinks",
    "head_cache's window": "the smallest --windows",
}


def _sink_cache(args: argparse.Namespace, model: Model | None) -> tuple[Model, SinkCacheEffect]:
    """``--sink-cache``: the model (loaded here unless --measure did) and its sink-cache test."""
    if model is None:
        model = load_model(args.model, dtype="float32", **placement_args(args))
        loads.require_tokenizer(model, args)
    # This call's lengths are the --sink-* options.
    lengths = {"seq_len": "--sink-seq-len", "head_seq_len": "--sink-head-seq-len"}
    with in_option_terms(lengths | _HEAD_CACHE):
        seqs = to_sequences(
            model,
            data_source(args),
            seq_len=args.sink_seq_len,
            n_seqs=SINK_CACHE_CUT.n_seqs,
            prepend_bos=args.prepend_bos,
        )
        effect = sink_cache_effect(
            model,
            seqs,
            sinks=args.sinks,
            windows=args.windows,
            positions=args.sink_positions,
            head_seq_len=args.sink_head_seq_len,
            batch_size=args.batch_size,
        )
    return model, effect


def blindness(
    args: argparse.Namespace, out: Path, params: dict[str, Any], formats: list[str] | None
) -> None:
    """The run of checked options ``args`` into the claimed folder ``out`` (``params``: the
    mitigation's, from the options)."""
    dtypes = [dtype_name(d) for d in args.dtypes]
    shape = model_shape(args.model)
    if args.max_distance is None:
        # The analytic curve reaches at least as far as what is measured (ALiBi takes any length;
        # other models refuse a --seq-len beyond their context when the data are made).
        args.max_distance = max(shape.n_ctx, args.seq_len) if args.measure else shape.n_ctx
    if args.mitigation == "robust":
        params = {**params, "dtype": dtypes[0], "limit": args.limit[0]}
    analytic = rounding = None
    try:
        analytic_params = {k: v for k, v in params.items() if k not in ("dtype", "limit")}
        analytic = analytic_blindness(
            args.model,
            dtypes=dtypes,
            limits=args.limit,
            bias=args.mitigation,
            context_length=args.max_distance,
            **analytic_params,
        )
        analytic.attrs["model"] = _shown_name(args.model)
        # How finely the family stores the bias in each dtype: from the slopes, like the above.
        rounding = analytic_rounding(args.model, dtypes=dtypes)
        for table in (rounding.by_head, rounding.by_position):
            table.attrs["model"] = analytic.attrs["model"]
    except UnsupportedArchitectureError as e:
        if not args.measure:
            raise
        logger.warning("note: %s", e)
    measured = model = seqs = precision = census = None
    against = {}
    if args.reference == "training":  # both bias forms, the attention as trained among them
        against = {"reference": "training", "parts": (*PARTS, "attention")}
    if args.measure:
        model = load_model(args.model, dtype="float32", **placement_args(args))
        loads.require_tokenizer(model, args)
        seqs = loads.load_data(model, args)
        applied = mitigation(model, args.mitigation, **params) if args.mitigation else None
        with applied or contextlib.nullcontext():
            if args.counterfactual == "precision":  # first: what it refuses, it refuses at once
                precision = precision_effect(
                    model, seqs, dtypes=[d for d in dtypes if d in PRECISION_DTYPES], **against
                )
            measured = measure_blindness(
                model,
                seqs,
                dtypes=dtypes,
                convention=args.convention,
                batch_size=args.batch_size,
            )
            census = run_census(model, seqs, batch_size=args.batch_size, reach_eps=args.reach_eps)
    model, sinks = _sink_cache(args, model) if args.sink_cache else (model, None)
    name = _shown_name(args.model)
    training = training_numerics_line(
        model_info(model).training_numerics
        if model is not None
        else training_numerics(name, model_metadata(args.model)),
        name,
    )
    print(blindness_summary(analytic, measured, precision, census, sinks, training, rounding))
    write_blindness(
        out,
        analytic,
        measured,
        formats=formats,
        overwrite=args.overwrite,
        model=model,
        tokens=None if seqs is None else seqs.tokens,
        precision=precision,
        census=census,
        sink_cache=sinks,
        training=training,
        rounding=rounding,
    )
