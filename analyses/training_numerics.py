"""Does low precision hurt a model trained the way BLOOM was, and what cures it? (issue 49)

Every arm is a model whose training numerics are recorded (``headsurgeon.json``:
``training_numerics``): how its attention scores were formed while it learnt. Each arm is run
through ``transformers``' own attention (:func:`headsurgeon.precision_effect`, part
``attention``) under every inference numerics, {bfloat16, float16, float32, float64} x bias form
{absolute, relative}, on 8,192 held-out tokens in sequences of 8L (L: its training length), and each
token's loss is compared with the same token's loss under float64 and under the arm's own
training numerics: paired differences, averaged per region of L (inside L, L-2L, 2L-4L, 4L-8L)
with batch-means standard errors over 64-token blocks (neighbouring tokens are correlated).

The arms (trained by ``analyses/train_organism.py``; identical but for the named numerics: 16
heads so BLOOM's slopes, 4 layers x 128 wide (1.3M parameters), L = 1,024, same seed, data
order, initialisation, 720 steps of 4 x 1,024 tokens, schedule)::

    COMMON="--steps 720 --warmup-steps 60 --minutes 80 --eval-every 120 --n-layer 4 \\
        --n-head 16 --hidden 128 --seq-len 1024 --batch 4 --lr 2e-3"
    python analyses/train_organism.py $COMMON --bias-form absolute --precision bfloat16 \\
        --name organism-1024-absolute-bfloat16 --out runs/tn-absolute-bfloat16 \\
        --export analyses/training_numerics_models/absolute-bfloat16
    # the same with --bias-form relative, and with --precision float32

and the bundled ``organism`` (trained on 256 tokens by the same script before it had a bias
hook: transformers' absolute bias under bfloat16 autocast, 4.2M parameters, 12M tokens).

Measure each arm (separate processes can run side by side; each writes its own cache), then
write ``figures/training_numerics/`` (``matrix.csv``, ``by_position.csv``, ``arms.csv``, the
figures and ``summary.md``)::

    python analyses/training_numerics.py --measure organism \\
        --measure analyses/training_numerics_models/absolute-bfloat16
    python analyses/training_numerics.py --summarise
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from _common import ROOT, markdown, parser, start, style, write_topic
from plotly.subplots import make_subplots

import headsurgeon as hs
from headsurgeon.loading import model_info
from headsurgeon.precision import INFERENCE_DTYPES

log = logging.getLogger("training_numerics")

CACHE = ROOT / "runs" / "training_numerics"
REGIONS = ["inside L", "L-2L", "2L-4L", "4L-8L"]
Z95 = 1.96
COLOURS = {"bfloat16": "#d62728", "float16": "#ff7f0e", "float32": "#1f77b4", "float64": "#2ca02c"}


def arm_name(model: str) -> str:
    return Path(model).name


def measure(model_name: str, max_len: int, cache: Path) -> None:
    """One arm's matrix into the cache: by region and by position, with its cost."""
    started = time.perf_counter()
    model = hs.load_model(model_name)
    info = model_info(model)
    length = min(8 * info.train_ctx, max_len)
    n_seqs = max(1, max_len // length)  # the same number of tokens for every arm
    effect = hs.precision_effect(
        model,
        hs.to_sequences(model, seq_len=length, n_seqs=n_seqs),
        dtypes=INFERENCE_DTYPES,
        parts=["attention"],
        bias_forms=["absolute", "relative"],
        reference="training",
        head_table=False,
    )
    numerics = info.training_numerics
    meta = {
        "arm": arm_name(model_name),
        "trained_bias": numerics.bias,
        "trained_scores_dtype": numerics.scores_dtype,
        "train_ctx": info.train_ctx,
        "parameters": info.metadata["training"]["config"]["parameters"],  # embeddings tied
        "tokens_seen": info.metadata["training"]["tokens_seen"],
        "trained_in_minutes": info.metadata["training"]["minutes"],
        "heldout_loss": info.metadata.get("training", {}).get("final_heldout_loss"),
        "seq_len": length,
        "n_seqs": n_seqs,
        "minutes": (time.perf_counter() - started) / 60,
    }
    cache.mkdir(parents=True, exist_ok=True)
    for name, table in (("region", effect.by_region), ("position", effect.by_position)):
        table.assign(**{k: v for k, v in meta.items() if k in ("arm", "train_ctx")}).to_csv(
            cache / f"{meta['arm']}_{name}.csv", index=False
        )
    pd.DataFrame([meta]).to_csv(cache / f"{meta['arm']}_meta.csv", index=False)
    log.info("%s: %d tokens in %.1f min", meta["arm"], length, meta["minutes"])


def interval(row: pd.Series) -> str:
    """``mean [lo, hi]``: the 95% interval from the batch-means standard error."""
    lo, hi = row.mean_dnll - Z95 * row.dnll_se, row.mean_dnll + Z95 * row.dnll_se
    return f"{row.mean_dnll:+.4f} [{lo:+.4f}, {hi:+.4f}]"


def verdict(row: pd.Series, better: str, worse: str) -> str:
    """In words, whether the interval excludes 0 and which way."""
    lo, hi = row.mean_dnll - Z95 * row.dnll_se, row.mean_dnll + Z95 * row.dnll_se
    return better if hi < 0 else worse if lo > 0 else "no difference resolved"


def figure(matrix: pd.DataFrame, reference: str) -> go.Figure:
    """One panel per arm: ΔNLL against ``reference`` per region, one line per inference
    numerics (colour: dtype; solid: absolute bias, dashed: relative), 95% intervals."""
    arms = list(dict.fromkeys(matrix.arm))
    fig = make_subplots(rows=1, cols=len(arms), subplot_titles=arms, shared_yaxes=False)
    rows = matrix[matrix.reference == reference]
    for col, arm in enumerate(arms, start=1):
        for (bias, dtype), sub in rows[rows.arm == arm].groupby(["bias", "dtype"], sort=False):
            fig.add_trace(
                go.Scatter(
                    x=sub.region,
                    y=sub.mean_dnll,
                    error_y={"type": "data", "array": Z95 * sub.dnll_se.fillna(0)},
                    mode="lines+markers",
                    name=f"{bias} · {dtype}",
                    legendgroup=f"{bias} · {dtype}",
                    showlegend=col == 1,
                    line={
                        "color": COLOURS[dtype],
                        "dash": "solid" if bias == "absolute" else "dash",
                    },
                ),
                row=1,
                col=col,
            )
        fig.add_hline(y=0, line={"color": "#999999", "width": 1}, row=1, col=col)
    fig.update_yaxes(title_text=f"ΔNLL vs {reference} (nats)", row=1, col=1)
    against = "the arm's own training numerics" if reference == "training" else "float64"
    style(
        fig,
        f"Loss change of each inference numerics against {against}",
        "per region of the training length L · 8,192 held-out tokens in sequences of 8L · "
        "bars: 95% interval (batch means, 64-token blocks) · solid: absolute bias, dashed: "
        "relative",
        width=360 * len(arms) + 200,
        height=480,
    )
    return fig


def summarise(out: Path, cache: Path, started: float) -> None:
    metas = pd.concat([pd.read_csv(f) for f in sorted(cache.glob("*_meta.csv"))])
    matrix = pd.concat([pd.read_csv(cache / f"{a}_region.csv") for a in metas.arm])
    positions = pd.concat([pd.read_csv(cache / f"{a}_position.csv") for a in metas.arm])
    matrix = matrix.merge(metas[["arm", "trained_bias", "trained_scores_dtype"]], on="arm")
    keep = [
        "arm", "trained_bias", "trained_scores_dtype", "train_ctx", "reference", "bias", "dtype",
        "region", "position_lo", "position_hi", "tokens", "mean_dnll", "dnll_se", "top1_agreement",
        "top1_se", "nll_reference", "nll_float64",
    ]  # fmt: skip
    matrix = matrix[keep]
    lines = [
        "# Training numerics: does rounding hurt a model trained as BLOOM was?",
        "",
        "Lines that coincide in "
        "the figures overlap: float32, float64 and the relative form in every dtype land within "
        "1e-4 nats of one another in every arm. Held-out losses in the arms table are each "
        "arm's own, in its training precision, from one seed: not a comparison of the arms.",
        "",
        "The bundled `organism` is one of the absolute-bfloat16 arms: it was trained (commit "
        "d42a5bb) before `analyses/train_organism.py` had its bias hook, through `transformers`' "
        "own bias under bfloat16 autocast; the relative-trained models are "
        "`analyses/mitigation_models/` and `relative-bfloat16` here.",
        "",
        "## The arms",
        "",
        markdown(metas.rename(columns={"minutes": "measured_in_minutes"}), 4),
        "",
    ]
    lines.append(
        f"Measuring took {metas.minutes.sum():.1f} min in all (one torch thread); training "
        f"the arms of this issue {metas.trained_in_minutes[metas.arm != 'organism'].sum():.0f} "
        "min (one thread each, two at once, on a shared 2-core machine)."
    )
    lines.append("")
    lines += answers(matrix)
    lines += [
        "",
        "## Every cell (ΔNLL in nats, 95% interval)",
        "",
    ]
    table = matrix.assign(dnll=matrix.apply(interval, axis=1))
    wide = table.pivot_table(
        index=["arm", "reference", "bias", "dtype"],
        columns="region",
        values="dnll",
        aggfunc="first",
    )
    wide = wide[[r for r in REGIONS if r in wide.columns]].reset_index()
    lines.append(markdown(wide))
    write_topic(
        out,
        {"vs_training": figure(matrix, "training"), "vs_float64": figure(matrix, "float64")},
        {"matrix.csv": matrix, "by_position.csv": positions, "arms.csv": metas},
        lines,
        started,
        scope=SCOPE,
    )


def _cell(matrix: pd.DataFrame, arm: str, reference: str, bias: str, dtype: str) -> pd.DataFrame:
    rows = matrix[
        (matrix.arm == arm)
        & (matrix.reference == reference)
        & (matrix.bias == bias)
        & (matrix.dtype == dtype)
    ]
    return rows.set_index("region")


def _against_training(
    matrix: pd.DataFrame, arm: str, numerics: tuple, words: tuple[str, str]
) -> list[str]:
    """Per (bias, dtype) of ``numerics``: its ΔNLL against the arm's training numerics in each
    region, with its interval and ``words`` (better, worse) where the interval excludes 0."""
    return [
        f"{bias} bias in {dtype}: "
        + "; ".join(
            f"{r} {interval(row)} ({verdict(row, *words)})"
            for r, row in _cell(matrix, arm, "training", bias, dtype).iterrows()
        )
        for bias, dtype in numerics
    ]


def answers(matrix: pd.DataFrame) -> list[str]:
    """The issue's four questions, answered from the matrix with intervals."""
    lines = ["## Answers", ""]
    absolute = sorted(
        set(
            matrix[
                (matrix.trained_bias == "absolute") & (matrix.trained_scores_dtype == "bfloat16")
            ].arm
        )
    )
    relative = sorted(set(matrix[matrix.trained_bias == "relative"].arm))
    for arm in absolute:
        own = _cell(matrix, arm, "float64", "absolute", "bfloat16")
        lines.append(
            f"**1. Does {arm} (trained absolute, bfloat16) lose anything in its own numerics?** "
            "Its own numerics against float64, per region: "
            + "; ".join(
                f"{r} {interval(row)} ({verdict(row, 'float64 worse', 'its own numerics cost')})"
                for r, row in own.iterrows()
            )
            + "."
        )
        lines.append("")
        numerics = (("absolute", "float32"), ("relative", "bfloat16"), ("relative", "float32"))
        cures = _against_training(matrix, arm, numerics, ("helps", "hurts"))
        lines.append(
            f"**2. Does float32 or the relative bias help {arm} or hurt it?** Against its "
            "training numerics: " + ". ".join(cures) + "."
        )
        lines.append("")
    others = sorted(set(matrix.arm) - set(absolute) - set(relative))
    for arm in others:
        row = matrix[matrix.arm == arm].iloc[0]
        numerics = (("absolute", "bfloat16"), ("relative", "bfloat16"))
        cells = _against_training(matrix, arm, numerics, ("lower loss", "costs"))
        lines.append(
            f"**{arm}, trained {row.trained_bias} in {row.trained_scores_dtype}.** Run in "
            "bfloat16, against its training numerics: " + ". ".join(cells) + "."
        )
        lines.append("")
    for arm in relative:
        mismatch = _cell(matrix, arm, "float64", "absolute", "bfloat16")
        own = _cell(matrix, arm, "training", "absolute", "bfloat16")
        lines.append(
            f"**3. The relative-trained {arm}.** Run with transformers' absolute bias in "
            "bfloat16 (a bias form it never saw), against float64: "
            + "; ".join(f"{r} {interval(row)}" for r, row in mismatch.iterrows())
            + "; against its own numerics (relative, bfloat16): "
            + "; ".join(f"{r} {interval(row)}" for r, row in own.iterrows())
            + "."
        )
        lines.append("")
    return lines


# What the summary's numbers test and what they do not (its opening section).
SCOPE = (
    (
        "models whose training numerics are known, each run through transformers' attention under"
        " every inference numerics (scores dtype x bias form; softmax in float32, weights cast to"
        " the dtype, everything else float64), each token's loss compared, *on the same tokens*, "
        "with float64 and with the arm's own training numerics (a paired difference; mean over a "
        "region of the training length L with a batch-means standard error over 64-token blocks; "
        "intervals are 95%, ±1.96 SE). ΔNLL > 0: the numerics cost loss."
    ),
    (
        "BLOOM itself (these are 1.3M- and 4.2M-parameter organisms trained for minutes on CPU; "
        "their content logits are smaller and their attention simpler than BLOOM's), other text "
        "than the bundled held-out corpora (8,192 tokens per arm), more than one training seed, "
        "nor kernels other than transformers' eager ops (fused attention, TF32)."
    ),
)


def main() -> None:
    p = parser(__doc__, "training_numerics")
    p.add_argument("--measure", action="append", default=[], help="an arm's model (repeatable)")
    p.add_argument("--summarise", action="store_true", help="write --out from the cache")
    p.add_argument("--max-len", type=int, default=8192, help="longest sequence measured")
    p.add_argument("--cache", type=Path, default=CACHE, help="per-arm results")
    args = p.parse_args()
    started = start(args)
    logging.getLogger("training_numerics").setLevel(logging.INFO)
    for model in args.measure:
        measure(model, args.max_len, args.cache)
    if args.summarise:
        summarise(args.out, args.cache, started)
    elif not args.measure:
        p.error("give --measure MODEL and/or --summarise")


if __name__ == "__main__":
    main()
