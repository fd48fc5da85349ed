"""The files and summary of a blindness analysis: what the blindness CLI prints and writes."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from torch import Tensor

from headsurgeon import alibi, plots
from headsurgeon.backend import Model
from headsurgeon.errors import shown
from headsurgeon.outputs import atomic_directory, atomic_write_text
from headsurgeon.pattern_samples import sample_patterns
from headsurgeon.plots.distance import reach_figure
from headsurgeon.plots.evaluation import precision_figure
from headsurgeon.plots.sink_cache import sink_cache_figure
from headsurgeon.reports.page import PAGE_CELLS, samples_note, write_page

if TYPE_CHECKING:
    from headsurgeon.blindness import BlindnessMeasurement, RoundingAnalysis
    from headsurgeon.loading import TrainingNumerics
    from headsurgeon.precision import PrecisionEffect
    from headsurgeon.sink_cache import SinkCacheEffect

__all__ = [
    "recommendation",
    "write_blindness",
]

# Mean |ΔNLL| (nats) over a position bucket from which rounding counts as changing the outputs,
# and mean ΔNLL from which it costs or saves (what a recommendation rests on).
CHANGE_NATS = 0.01
# Attention lost to exact zeros per query row below which underflow cannot move a logit
# measurably (a weight of 1e-4 scales one value vector by 1e-4).
NEGLIGIBLE_MASS = 1e-4


def precision_verdict(precision: PrecisionEffect) -> list[str]:
    """Three lines: whether underflow to exact 0 changes the outputs (the attention it loses);
    whether rounding does against float64, per dtype, from which position and through which
    part; and what to do, which follows the model's training numerics (:func:`recommendation`).

    A dtype changes the outputs from the first position bucket from which the whole model's
    mean ``|ΔNLL|`` exceeds :data:`CHANGE_NATS` in every bucket; the part named is the one of
    ``scores`` and ``softmax`` alone that changes the loss most from there, when it accounts for
    at least half of the whole model's change (else the rest of the model; ``model`` when
    neither part was run). Read on the family's own bias form against float64.
    """
    pos, heads = _own_rows(precision.by_position), precision.by_head
    whole = "model" if "model" in set(pos["part"]) else pos["part"].iloc[0]
    lost = pd.Series(dtype=float)
    if not heads.empty:
        per_row = heads.groupby(["dtype", "part", "layer", "head"], sort=False)["lost_mass"].sum()
        lost = per_row.groupby(level="dtype", sort=False).max()
    if lost.empty:
        underflow = "underflow to exact 0: not measured (no head table)"
    elif lost.max() < NEGLIGIBLE_MASS:
        underflow = (
            f"underflow to exact 0 changes no output: it takes at most {lost.max():.1e} of a "
            f"query row's attention ({lost.idxmax()}; a weight that small moves nothing "
            "measurable)"
        )
    else:
        underflow = (
            f"underflow to exact 0 takes up to {lost.max():.1e} of a query row's attention "
            f"({lost.idxmax()}): see the softmax part below"
        )
    changes, costly, quiet = [], [], []
    for dtype, rows in pos.groupby("dtype", sort=False):
        model_rows = rows[rows["part"] == whole]
        # The first bucket from which every later one changes the loss: a lasting change.
        over = (model_rows["mean_abs_dnll"] > CHANGE_NATS).to_numpy()
        lasting = np.flip(np.cumprod(np.flip(over))).astype(bool)
        if not lasting.any():
            quiet.append(
                f"{dtype} (largest |ΔNLL| {model_rows['max_abs_dnll'].max():.1g} nats a token)"
            )
            continue
        start = int(model_rows["position_lo"].to_numpy()[lasting.argmax()])
        late = model_rows[model_rows["position_lo"] >= start]
        mean, size = (
            (late[c] * late["tokens"]).sum() / late["tokens"].sum()
            for c in ("mean_dnll", "mean_abs_dnll")
        )
        alone = {
            part: rows[(rows["part"] == part) & (rows["position_lo"] >= start)][
                "mean_abs_dnll"
            ].mean()
            for part in ("scores", "softmax")
            if part in set(rows["part"])
        }
        cause = max(alone, key=alone.get) if alone else whole
        # Neither the scores nor the weights alone account for it: the rest of the model does.
        if alone and alone[cause] < late["mean_abs_dnll"].mean() / 2:
            cause = "rest"
        changes.append(
            f"{dtype} from query position {start} on (|ΔNLL| {size:.3f}, ΔNLL {mean:+.3f} "
            "nats a token there), " + _CAUSE_WORDS[cause]
        )
        if mean > CHANGE_NATS:
            costly.append((dtype, cause))
    if changes:
        rounding = (
            "rounding changes the outputs against float64 (from a query position on: in every "
            "later bucket of positions, 0, 1, 2-3, 4-7, ..., the mean |ΔNLL| exceeds "
            f"{CHANGE_NATS:g} nats a token): " + "; ".join(changes)
        )
        rounding += "; not in " + ", ".join(quiet) if quiet else ""
    else:
        rounding = "rounding changes no output measurably (against float64): " + ", ".join(quiet)
    return [
        f"precision: {underflow}",
        f"precision: {rounding}",
        f"precision: {recommendation(precision, costly)}",
    ]


# The verdict's words for the part of the computation a dtype's change comes from.
_CAUSE_WORDS = {
    "scores": "half or more of it from rounding the attention scores (q·k + ALiBi bias) alone",
    "softmax": "half or more of it from rounding the softmax weights alone",
    "rest": "from the rest of the model, not the attention scores or weights",
    "model": "with the whole model in it (its parts not measured apart)",
    "attention": "with the attention in it (scores and weights; parts not measured apart)",
}


def _own_rows(table: pd.DataFrame) -> pd.DataFrame:
    """The rows against float64 with the run's first bias form (the family's own, or relative
    in a mitigation block): what the first two verdict lines read."""
    if "reference" in table:
        table = table[table["reference"] == "float64"]
    if "bias" in table:
        table = table[table["bias"] == table["bias"].iloc[0]]
    return table


def recommendation(precision: PrecisionEffect, costly: list[tuple[str, str]]) -> str:
    """What to do about rounding, from the measurement that fits the model's training numerics.

    Unknown numerics: nothing is recommended, and the measurement that decides is named. A model
    trained with the relative bias: the relative form where rounding costs (``costly``: the
    dtypes and parts that cost more than :data:`CHANGE_NATS` against float64). A model trained
    with another form (BLOOM: absolute, bfloat16): only numerics that, against its training
    numerics, lower the loss by more than two standard errors in some region of the training
    length and raise it by more than :data:`CHANGE_NATS` (beyond two standard errors) in none.
    """
    attrs = precision.by_position.attrs
    trained = attrs.get("training_numerics")
    if trained is None:
        return (
            "no recommendation: this model's training numerics are unknown, and a dtype or bias "
            "form that differs from float64 may be what it learnt under; what decides is the "
            "loss against them (record training_numerics in its headsurgeon.json, then "
            "--reference training, or precision_effect(..., reference='training'))"
        )
    said = _numerics_words(trained)
    if trained["bias"] == "relative":
        if costly and attrs.get("bias") != "relative":
            return (
                f"trained with {said}: recommend its relative form (--mitigation relative, "
                "hs.mitigation(model, 'relative')): ALiBi formed from distances keeps each row's "
                "scores small near the diagonal, where "
                + ", ".join(d for d, _ in costly)
                + " rounds"
            )
        if costly:
            return (
                f"trained with {said}; the relative bias is already in use and rounding still "
                "costs in "
                + ", ".join(f"{d} ({c})" for d, c in costly)
                + ": compute what is named there in float32"
            )
        return f"trained with {said}: no mitigation needed for precision ({attrs.get('bias')} bias)"
    region = precision.by_region
    if region.empty or "training" not in set(region.get("reference", ())):
        return (
            f"no recommendation from this run: the model was trained with {said}, so float64 is "
            "not the numerics it learnt under; what decides is the loss against them "
            "(--reference training, or precision_effect(..., reference='training', "
            "bias_forms=[the family's, 'relative']))"
        )
    return _against_training(region, trained, said)


def _numerics_words(trained: dict[str, Any]) -> str:
    return (
        f"the {trained['bias']} ALiBi bias, scores in {trained['scores_dtype'] or '?'}, softmax "
        f"in {trained['softmax_dtype'] or '?'}"
    )


def _against_training(region: pd.DataFrame, trained: dict[str, Any], said: str) -> str:
    """The recommendation of :func:`recommendation` from ``by_region`` against training: the
    cheapest numerics that qualify (the relative bias in the training dtype first, then the
    higher precisions), with every region's ΔNLL and standard error."""
    rows = region[(region["reference"] == "training") & (region["part"] == "attention")]
    if rows.empty:
        rows = region[region["reference"] == "training"]
    own = (rows["bias"] == trained["bias"]) & (rows["dtype"] == trained["scores_dtype"])
    good, bad = [], []
    for (bias, dtype), sub in rows[~own].groupby(["bias", "dtype"], sort=False):
        helps = (sub["mean_dnll"] + 2 * sub["dnll_se"] < -CHANGE_NATS).any()
        hurts = (sub["mean_dnll"] - 2 * sub["dnll_se"] > CHANGE_NATS).any()
        where = ", ".join(
            f"{r.region} {r.mean_dnll:+.3f} ± {r.dnll_se:.3f}" for r in sub.itertuples()
        )
        cost = (dtype != trained["scores_dtype"], _PRECISION_COST.get(dtype, 9))
        (good if helps and not hurts else bad).append(
            (cost, f"the {bias} bias in {dtype} ({where})")
        )
    if good:
        good.sort()
        others = (
            "; also " + ", ".join(text.split(" (")[0] for _, text in good[1:]) if good[1:] else ""
        )
        return (
            f"trained with {said}; against those numerics (ΔNLL, nats ± one standard error) "
            f"recommend {good[0][1]}: it lowers the loss in some region and raises it in none"
            + others
        )
    return (
        f"trained with {said}: keep them; against those numerics nothing measured lowers the "
        "loss without raising it elsewhere: " + "; ".join(text for _, text in bad)
    )


# Cheapest first: what a recommendation prefers among numerics that qualify.
_PRECISION_COST = {"bfloat16": 0, "float16": 1, "float32": 2, "float64": 3}


def _precision_details(precision: PrecisionEffect) -> list[str]:
    """Per reference, bias form, dtype and part: mean ΔNLL by position bucket and top-1."""
    pos = precision.by_position
    attrs = pos.attrs
    trained = attrs.get("training_numerics")
    lines = [
        f"precision counterfactual ({attrs.get('n_seqs')} × {attrs.get('seq_len')} tokens, "
        f"{attrs.get('bias')} ALiBi bias; trained on {attrs.get('train_ctx') or '?'} tokens "
        f"with {_numerics_words(trained) if trained else 'unknown numerics'}); each row: "
        "reference, bias form, dtype, what is rounded (scores: the attention scores alone; "
        "softmax: the attention weights alone; attention: both; model: the whole forward), "
        "then first query position of a bucket: its mean ΔNLL in nats (buckets from 0 and from "
        "64 on; all in precision.csv), and top-1 agreement with the reference"
    ]
    keys = [k for k in ("reference", "bias") if k in pos]
    for group, rows in pos.groupby([*keys, "dtype", "part"], sort=False):
        *named, dtype, part = group
        cells = ", ".join(
            f"{lo}: {d:+.3g}"
            for lo, d in zip(rows["position_lo"], rows["mean_dnll"], strict=True)
            if lo >= 64 or lo == 0
        )
        top1 = (rows["top1_agreement"] * rows["tokens"]).sum() / rows["tokens"].sum()
        against = " ".join([f"vs {named[0]:8s}", *(f"{n:9s}" for n in named[1:])]) if named else ""
        lines.append(f"  {against} {dtype:9s} {part:9s} {cells} | top-1 {top1:.3f}")
    return lines


def training_numerics_line(numerics: TrainingNumerics | None, name: str) -> str:
    """What the summary says of how the model was trained, with the source."""
    if numerics is None:
        return (
            f"training numerics of {name}: unknown (not recorded in its headsurgeon.json, not a "
            "published model): a precision verdict cannot say what it learnt under"
        )
    return f"training numerics of {name}: {numerics.describe()} (source: {numerics.source})"


# The measured lines' words for a softmax convention (blindness.CONVENTIONS).
_CONVENTION_WORDS = {
    "hf": "softmax in float32, weights cast to the dtype, as Hugging Face",
    "tl": "softmax in the dtype, as TransformerLens 3.x",
}

# What the summary says first when no precision counterfactual was run.
UNMEASURED_PRECISION = [
    "precision: not measured here (add --measure --counterfactual precision, or call "
    "hs.precision_effect): whether rounding in bfloat16 or float16 changes this model's outputs, "
    "and from which position, is what the counterfactual answers",
    "precision: exact zeros alone change no output measurably: a weight that underflows was "
    "below the dtype's smallest positive number, so a query row of T keys loses less than T "
    "times that (float32 1.4e-45, bfloat16 9.2e-41, float16 6.0e-8 per key)",
]


# A head whose reach is within this factor of its slope's content-free reach (either way) only
# follows its slope, as far as reach can tell.
FOLLOWS_SLOPE = 1.5
# Heads far from their slope's reach named in the summary, farthest first.
NAMED_HEADS = 8


def reach_lines(census: pd.DataFrame, measured: BlindnessMeasurement | None = None) -> list[str]:
    """How far the heads look (the census's ``reach``), beside the reach of their slope alone
    (``reach_baseline``) and, given ``measured``, their first exact zero.

    A head within :data:`FOLLOWS_SLOPE` of its slope's reach only follows its slope; the heads
    far from it are named. Against the first exact zero the slope decides both distances
    (standard ALiBi: reach about ``ln(1/reach_eps) / m``, zero about ``87 / m`` in float32), so
    that line gives the ratio the slopes alone give beside the measured one.

    >>> census = pd.DataFrame({"layer": [0, 0, 1], "head": [0, 1, 0], "slope": [0.5, 0.01, 0.5],
    ...     "reach": [12.0, float("inf"), 25.0], "reach_baseline": [10.0, float("inf"), 10.0]})
    >>> census.attrs.update(reach_eps=0.01, n_seqs=2, seq_len=64)
    >>> reach_lines(census)[0]  # doctest: +ELLIPSIS
    'reach (the distance beyond which a head puts at most 1% of its attention, position 0 ...'
    >>> print(reach_lines(census)[1])  # doctest: +NORMALIZE_WHITESPACE
    reach beside its slope's (the reach of a head with no preference for content, whose logits
    are its ALiBi bias alone; standard ALiBi: about ln(1/0.01)/m = 4.6/m on long sequences): 1 of
    2 heads with a bounded one look within 1.5x of it (they only follow their slope); far from
    it: L1H0 2.5x; 1 head's slope alone looks beyond the sequence
    """
    attrs = census.attrs
    eps = attrs.get("reach_eps", 0.01)
    reach = census["reach"].to_numpy(dtype=float)
    finite = reach[np.isfinite(reach)]
    lines = [
        f"reach (the distance beyond which a head puts at most {eps:.0%}"
        f" of its attention, position 0 left out; {attrs.get('n_seqs')} × "
        f"{attrs.get('seq_len')} tokens): "
        + (
            f"median {np.median(finite):.0f} tokens, farthest {finite.max():.0f}"
            if len(finite)
            else "no head's"
        )
        + (
            f"; {int((~np.isfinite(reach)).sum())} of {len(reach)} heads look beyond every "
            "measured distance"
            if not np.isfinite(reach).all()
            else ""
        )
    ]
    if "reach_baseline" in census and census["reach_baseline"].notna().any():
        lines.append(_slope_line(census, eps))
    if measured is not None:
        lines.extend(_zero_line(census, measured, eps))
    return lines


def _slope_line(census: pd.DataFrame, eps: float) -> str:
    """How many heads only follow their slope (reach within FOLLOWS_SLOPE of reach_baseline),
    and which do not."""
    baseline = census["reach_baseline"].to_numpy(dtype=float)
    bounded = np.isfinite(baseline) & (baseline > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = census["reach"].to_numpy(dtype=float) / baseline
    near = bounded & (ratio <= FOLLOWS_SLOPE) & (ratio >= 1 / FOLLOWS_SLOPE)
    far = np.flatnonzero(bounded & ~near)
    far = far[np.argsort(-np.abs(np.log(np.maximum(ratio[far], 1e-300))), kind="stable")]
    names = [
        f"L{census['layer'].iat[i]}H{census['head'].iat[i]} {ratio[i]:.2g}x"
        if np.isfinite(ratio[i])
        else f"L{census['layer'].iat[i]}H{census['head'].iat[i]} (beyond the sequence)"
        for i in far[:NAMED_HEADS]
    ]
    more = f" and {len(far) - NAMED_HEADS} more" if len(far) > NAMED_HEADS else ""
    unbounded = int(np.isinf(baseline).sum())
    return (
        "reach beside its slope's (the reach of a head with no preference for content, whose "
        f"logits are its ALiBi bias alone; standard ALiBi: about ln(1/{eps:g})/m = "
        f"{math.log(1 / eps):.2g}/m on long sequences): {int(near.sum())} of "
        f"{int(bounded.sum())} heads with a bounded one look within {FOLLOWS_SLOPE:g}x of it "
        "(they only follow their slope); "
        + (f"far from it: {', '.join(names)}{more}" if len(far) else "none is far from it")
        + (
            f"; {unbounded} head{'s' if unbounded > 1 else ''}'s slope alone looks beyond the "
            "sequence"
            if unbounded
            else ""
        )
    )


def _zero_line(census: pd.DataFrame, measured: BlindnessMeasurement, eps: float) -> list[str]:
    """Reach against the first exact zero, with the ratio the slopes alone give."""
    by_head = measured.by_head
    dtype = "float32" if "float32" in set(by_head["dtype"]) else by_head["dtype"].iloc[0]
    zeros = by_head[by_head["dtype"] == dtype].merge(census, on=["layer", "head"])
    zeros = zeros[zeros["first_zero_distance"].notna()]
    if not len(zeros):
        return []
    closer = int((zeros["reach"] < zeros["first_zero_distance"]).sum())
    ratio = np.median(zeros["first_zero_distance"] / zeros["reach"].clip(lower=1))
    if "reach_baseline" in zeros and np.isfinite(zeros["reach_baseline"]).all():
        alone = np.median(zeros["first_zero_distance"] / zeros["reach_baseline"].clip(lower=1))
        why = (
            f" (median ratio {ratio:.1f}x; their slopes alone give {alone:.1f}x: both distances "
            "scale as 1/slope, so this is arithmetic of the slope, not a finding about the heads)"
        )
    else:
        why = f" (median ratio {ratio:.1f}x)"
    if closer == len(zeros):
        return [
            f"reach: {closer} of {len(zeros)} heads with an exact zero in {dtype} look less far "
            f"than their first exact zero{why}"
        ]
    return [
        f"reach: {closer} of {len(zeros)} heads with an exact zero in {dtype} look less far "
        f"than their first exact zero{why}; {len(zeros) - closer} still put more than "
        f"{eps:.0%} of their attention beyond it"
    ]


def _position(x: float) -> str:
    """A first position as the rounding lines show it: NaN (none within the search) as never."""
    if math.isnan(x):
        return "never"
    return f"{x:.0f}" if x < 1e6 else f"{x:.3g}"


def rounding_lines(rounding: RoundingAnalysis) -> list[str]:
    """Per head (slope), the first key positions from which the absolute ALiBi bias's rounding
    step exceeds each threshold, one column per dtype (float16: also where it overflows).

    >>> from headsurgeon.blindness import analytic_rounding
    >>> lines = rounding_lines(analytic_rounding("bloom-560m", dtypes=["bf16"]))
    >>> lines[2], lines[-1]
    ('  h0   0.7071    23 / 362', '  h15  0.003906  4089 / 65409')
    """
    by_head, attrs = rounding.by_head, rounding.by_head.attrs
    columns = [f"first_position_step_over_{t:g}" for t in attrs["thresholds"]]
    steps = " / ".join(f"{t:g}" for t in attrs["thresholds"])
    dtypes = list(dict.fromkeys(by_head["dtype"]))
    cells: dict[str, list[str]] = {}
    for dtype in dtypes:
        rows = by_head[by_head["dtype"] == dtype]
        cells[dtype] = [
            " / ".join(_position(row[c]) for c in columns)
            + (f" (inf {_position(row.first_position_overflow)})" if dtype == "float16" else "")
            for _, row in rows.iterrows()
        ]
    widths = {d: max(len(d), *map(len, cells[d])) for d in dtypes}
    first = by_head[by_head["dtype"] == dtypes[0]]
    names = [f"h{h}" for h in first["head"]]
    slopes = [f"{m:.4g}" for m in first["slope"]]
    name_width, slope_width = max(4, *map(len, names)), max(5, *map(len, slopes))
    lines = [
        f"{attrs['model']}: rounding of the ALiBi bias as the family stores it "
        f"({attrs['absolute']}): the first key position from which its rounding step exceeds "
        f'{steps} logit, per dtype (from the slopes; float16\'s "inf": where the bias '
        "overflows; by position, and for the relative form by distance: "
        "rounding_by_position.csv)",
        f"  {'head':{name_width}s} {'slope':{slope_width}s}  "
        + "  ".join(f"{d:{widths[d]}s}" for d in dtypes).rstrip(),
    ]
    for i, (name, slope) in enumerate(zip(names, slopes, strict=True)):
        row = "  ".join(f"{cells[d][i]:{widths[d]}s}" for d in dtypes)
        lines.append(f"  {name:{name_width}s} {slope:{slope_width}s}  {row}".rstrip())
    return lines


def sink_cache_lines(effect: SinkCacheEffect, n_heads: int = 5) -> list[str]:
    """The sink-cache test (:func:`headsurgeon.sink_cache_effect`) in a few lines: perplexity
    per cache against the full context, then the ``n_heads`` heads whose loss of the sinks
    costs most."""
    table, a = effect.by_cache, effect.by_cache.attrs
    path = f"{a.get('attention', 'blocked')} attention"
    if a.get("blocked_because"):
        path += f": {a['blocked_because']}"
    lines = [
        f"sink cache (StreamingLLM: x sinks + y recent tokens; {a['n_seqs']} × {a['seq_len']} "
        f"tokens, {a['positions']} ALiBi distances, trained on {a.get('train_ctx') or '?'} "
        f"tokens; {path}): full-context perplexity {a['full_ppl']:.4g}"
    ]
    for row in table.itertuples():
        lines.append(
            f"  {row.sinks} + {row.window}: perplexity {row.ppl:.4g}, ΔNLL {row.dnll:+.4f} ± "
            f"{row.dnll_se:.4f} ({row.dnll_evicted:+.4f} where the cache has dropped tokens)"
        )
    heads = effect.by_head
    if not heads.empty:
        top = ", ".join(
            f"L{r.layer}H{r.head} {r.dnll:+.4f}" for r in heads.head(n_heads).itertuples()
        )
        x, y = int(heads["sinks"].iloc[0]), int(heads["window"].iloc[0])
        lines.append(
            f"  heads that need their sinks most (each alone at 0 + {y}, the others {x} + {y}, "
            f"{heads.attrs['head_seq_len']} tokens): {top}"
        )
    return lines


def blindness_summary(
    analytic: pd.DataFrame | None,
    measured: BlindnessMeasurement | None,
    precision: PrecisionEffect | None = None,
    census: pd.DataFrame | None = None,
    sink_cache: SinkCacheEffect | None = None,
    training: str | None = None,
    rounding: RoundingAnalysis | None = None,
) -> str:
    """The blindness CLI's summary, in the order that matters: how the model was trained
    (``training``: :func:`training_numerics_line`); whether rounding and underflow change the
    outputs (:func:`precision_verdict` with a precision counterfactual, else
    :data:`UNMEASURED_PRECISION`: where to learn it and why exact zeros alone cannot); how far
    the heads look (:func:`reach_lines`, given the ``census``); then blind distances of the
    steepest heads, the bias's rounding per head (:func:`rounding_lines`, given ``rounding``),
    measured shares of exact zeros, and the counterfactual's numbers."""
    lines = [training] if training else []
    lines += precision_verdict(precision) if precision is not None else UNMEASURED_PRECISION
    if census is not None:
        lines.extend(reach_lines(census, measured))
    if analytic is not None:
        context_length = analytic.attrs["context_length"]
        lines.append(
            f"{analytic.attrs['model']}: blind distance (tokens) of the steepest heads, "
            f"{analytic.attrs['bias']} ALiBi, per dtype and limit (where a weight falls below "
            "the dtype's smallest normal number, its smallest subnormal, or rounds to zero); "
            f"share of a {context_length}-token context blind"
        )
        layer0 = analytic[analytic["layer"] == 0]
        for (dtype, limit), rows in layer0.groupby(["dtype", "limit"], sort=False):
            steep = rows.sort_values("slope", ascending=False).head(4)
            heads = ", ".join(
                f"h{h}={d:.4g}" for h, d in zip(steep["head"], steep["blind_distance"], strict=True)
            )
            share = alibi.blind_share(
                torch.tensor(rows["blind_distance"].to_numpy()), context_length
            )
            lines.append(f"  {dtype:9s} {limit:9s} {heads}  | share {share:.1%}")
    if rounding is not None:
        lines.extend(rounding_lines(rounding))
    if measured is not None:
        data = measured.by_length.attrs.get("data")
        lines.append(
            f"measured ({measured.convention} convention: "
            f"{_CONVENTION_WORDS.get(measured.convention, '?')}; {measured.n_seqs} × "
            f"{measured.seq_len} tokens{f' of {data}' if data else ''}): share of attention "
            "entries that underflow to exactly 0, by context length"
        )
        for dtype, rows in measured.by_length.groupby("dtype", sort=False):
            shares = ", ".join(
                f"{n}: {s:.2%}" for n, s in zip(rows["context_length"], rows["share"], strict=True)
            )
            lines.append(f"  {dtype:9s} {shares}")
    if precision is not None:
        lines.extend(_precision_details(precision))
    if sink_cache is not None:
        lines.extend(sink_cache_lines(sink_cache))
    return shown("\n".join(lines))


def write_blindness(
    out_dir: str | os.PathLike,
    analytic: pd.DataFrame | None,
    measured: BlindnessMeasurement | None,
    *,
    formats: Sequence[str] | None = None,
    overwrite: bool = False,
    model: Model | None = None,
    tokens: Tensor | None = None,
    precision: PrecisionEffect | None = None,
    census: pd.DataFrame | None = None,
    sink_cache: SinkCacheEffect | None = None,
    training: str | None = None,
    rounding: RoundingAnalysis | None = None,
) -> Path:
    """Write a blindness analysis to a new folder, atomically; return the folder.

    Files: ``blindness.csv`` (``analytic``), ``measured_by_head.csv``, ``measured_by_distance.csv``
    and ``measured_by_length.csv`` (``measured``), ``summary.txt`` (:func:`blindness_summary`) and
    the figures ``blind_distance``, ``zero_fraction`` and ``analytic_vs_measured`` (those the
    results allow) in each of ``formats`` (as in :func:`headsurgeon.reports.write_classification`:
    by default png when a browser is found, and all of them on ``index.html``); with a ``precision``
    counterfactual (:func:`headsurgeon.precision.precision_effect`) also ``precision.csv`` (its
    ``by_position``), ``precision_regions.csv`` (``by_region``), ``precision_heads.csv``
    (``by_head``) and the figure ``precision``, and the
    summary (and page) lead with its verdict; with a ``census`` (:func:`headsurgeon.run_census` on
    the measured text) also ``census.csv`` and the figure ``reach`` (each head's reach beside its
    slope's, its first exact zero and analytic distance), and the page's head table has its
    ``reach``, ``reach_baseline`` and ``reach_ratio`` columns; with
    a ``sink_cache`` test (:func:`headsurgeon.sink_cache_effect`) also ``sink_cache.csv``
    (``by_cache``), ``sink_cache_heads.csv`` (``by_head``), the figure ``sink_cache`` and its
    summary lines (:func:`sink_cache_lines`); with a ``rounding`` analysis
    (:func:`headsurgeon.blindness.analytic_rounding`) also ``rounding.csv`` (``by_head``),
    ``rounding_by_position.csv`` (``by_position``) and its summary lines
    (:func:`rounding_lines`). A folder holding files is refused unless
    ``overwrite``, and even then unless headsurgeon wrote it.

    ``index.html`` puts it on one offline page: the summary, a grid of blind distances where
    clicking a head shows its distances per dtype, its measured share of exact zeros by distance
    against them and, given the ``model``, its attention on the first measured sequence of
    ``tokens`` (max-pooled to 64 cells a side), with the blind distance drawn in.
    """
    summary = blindness_summary(
        analytic, measured, precision, census, sink_cache, training, rounding
    )
    figures = _figures(analytic, measured, precision, census)
    if sink_cache is not None:
        figures["sink_cache"] = sink_cache_figure(sink_cache.by_cache)
    tables = {"blindness.csv": analytic, "census.csv": census}
    if measured is not None:
        tables |= {f"measured_{t}.csv": getattr(measured, t) for t in ("by_head", "by_distance")}
        tables["measured_by_length.csv"] = measured.by_length
    if precision is not None:
        tables |= {"precision.csv": precision.by_position, "precision_heads.csv": precision.by_head}
        tables["precision_regions.csv"] = precision.by_region
    if sink_cache is not None:
        tables["sink_cache.csv"] = sink_cache.by_cache
        tables["sink_cache_heads.csv"] = sink_cache.by_head
    if rounding is not None:
        tables["rounding.csv"] = rounding.by_head
        tables["rounding_by_position.csv"] = rounding.by_position
    with atomic_directory(out_dir, overwrite=overwrite, writer="write_blindness") as tmp:
        for name, frame in tables.items():
            if frame is not None:
                atomic_write_text(tmp / name, frame.to_csv(index=False))
        atomic_write_text(tmp / "summary.txt", summary + "\n")
        skipped = plots.save_figures(figures, tmp, formats)
        if analytic is not None or measured is not None:
            _write_blindness_page(tmp, summary, analytic, measured, figures, model, tokens, census)
    plots.warn_skipped(skipped, out_dir)
    return Path(out_dir)


def _figures(
    analytic: pd.DataFrame | None,
    measured: BlindnessMeasurement | None,
    precision: PrecisionEffect | None,
    census: pd.DataFrame | None,
) -> dict[str, go.Figure]:
    """The figures the results allow, in the summary's order."""
    figures = {}
    if precision is not None:
        figures["precision"] = precision_figure(precision.by_position)
    if census is not None and measured is not None:
        figures["reach"] = reach_figure(census, measured.by_head)
    if analytic is not None:
        figures["blind_distance"] = plots.blind_distance_grid(analytic)
    if measured is not None:
        figures["zero_fraction"] = plots.zero_fraction_plot(measured.by_distance)
        if analytic is not None:
            figures["analytic_vs_measured"] = plots.analytic_vs_measured(measured.by_head)
    return figures


def _blindness_table(
    analytic: pd.DataFrame | None,
    measured: BlindnessMeasurement | None,
    census: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """One row per head: reach (given the census), blind distance per dtype and limit, measured
    first zero and share of zeros per dtype."""
    keys = ["layer", "head"]
    parts = []
    if analytic is not None:
        wide = analytic.pivot_table(
            index=keys, columns=["dtype", "limit"], values="blind_distance", sort=False
        )
        wide.columns = [f"blind distance {d} {limit} (tokens)" for d, limit in wide.columns]
        parts.append(wide)
        parts.append(analytic.groupby(keys)[["slope"]].first())
    if measured is not None:
        by_head = measured.by_head
        for column, name, unit in (
            ("first_zero_distance", "first zero", "tokens"),
            ("zero_fraction", "zeros", "fraction of weights"),
        ):
            wide = by_head.pivot_table(
                index=keys, columns="dtype", values=column, sort=False, dropna=False
            )
            wide.columns = [f"measured {name} {d} ({unit})" for d in wide.columns]
            parts.append(wide)
        if analytic is None:
            parts.append(by_head.groupby(keys)[["slope"]].first())
    if census is not None:
        reach = [c for c in ("reach", "reach_baseline", "reach_ratio") if c in census]
        parts.append(census.set_index(keys)[reach])
    table = pd.concat(parts, axis=1).reset_index()
    return table.loc[:, ~table.columns.duplicated()]


def _zero_curves(measured: BlindnessMeasurement, table: pd.DataFrame) -> dict[str, Any]:
    """Per head name, the measured share of exact zeros by distance (one line per dtype) and
    the analytic blind distances (zero limit) as vertical lines, for the page."""
    colours = dict(
        zip(plots.DTYPE_MARKERS, (c for _, c in plots.DTYPE_MARKERS.values()), strict=True)
    )
    curves: dict[str, Any] = {}
    rows = measured.by_distance
    for (layer, head), sub in rows.groupby(["layer", "head"], sort=True):
        traces, shapes = [], []
        for dtype, part in sub.groupby("dtype", sort=False):
            middle = (part["distance_lo"] + part["distance_hi"] - 1) / 2
            colour = colours.get(dtype, "#000000")
            share = part["zero_fraction"].round(4).tolist()
            traces.append(
                {
                    "x": middle.round(1).tolist(),
                    "y": share,
                    "mode": "lines",
                    "name": dtype,
                    "line": {"color": colour},
                }
            )
            column = f"blind distance {dtype} zero (tokens)"
            row = table[(table["layer"] == layer) & (table["head"] == head)]
            if column in row and math.isfinite(float(row[column].iloc[0])):
                x = float(row[column].iloc[0])
                shapes.append(
                    {
                        "type": "line",
                        "x0": x,
                        "x1": x,
                        "y0": 0,
                        "y1": 1,
                        "line": {"color": colour, "dash": "dot"},
                    }
                )
        curves[f"L{layer}H{head}"] = {"traces": traces, "shapes": shapes}
    return curves


def _write_blindness_page(
    folder: Path,
    summary: str,
    analytic: pd.DataFrame | None,
    measured: BlindnessMeasurement | None,
    figures: dict[str, go.Figure],
    model: Model | None,
    tokens: Tensor | None,
    census: pd.DataFrame | None,
) -> None:
    """The blindness run's ``index.html`` (see :func:`write_blindness`)."""
    table = _blindness_table(analytic, measured, census)
    metric = next(c for c in table.columns if c.startswith(("blind distance", "measured first")))
    grid_table = table.assign(log10_distance=np.log10(table[metric].astype(float)))
    grid = plots.head_grid(grid_table, "log10_distance", title=f"log₁₀ {metric}")
    samples = []
    if model is not None and tokens is not None:
        samples = [sample_patterns(model, tokens, n_seqs=1, n_pos=None, max_cells=PAGE_CELLS)]
    source = (analytic if analytic is not None else measured.by_head).attrs
    write_page(
        folder,
        title=f"Blindness of {source.get('model', 'the model')}",
        summary=summary,
        grid=grid,
        shape=(int(table["layer"].max()) + 1, int(table["head"].max()) + 1),
        stages={"blindness": table},
        samples=samples,
        model=model,
        figures=figures,
        curves=_zero_curves(measured, table) if measured is not None else None,
        note=samples_note(samples, "the measured text"),
    )
