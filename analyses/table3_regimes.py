"""Table 3 where the paper's claim lives: which heads were blind in training, how far each head
looks, which distances the loss uses, and what rounding does, per model trained with a variant.

The blindness paper's Table 3 compares models *trained* with standard and log-distance ALiBi.
Its claim concerns heads that are blind inside the training window; the bundled Table 3 models
(``analyses/mitigation_models/{standard,log}*``) were trained at L = 128, below every head's
first exact zero. The ``L512-*`` models were trained at L = 512 with 16 heads, where standard
ALiBi's four steepest heads have exact zeros inside the window (``train_organism.py``: the three
arms standard, log, and log with slopes matched to standard's penalty at L, ``--log-match 512``,
the same steps, data order and initialisation, bfloat16 autocast). For every model given:

* **Blind in training**: its heads' measured first exact zero (float32 and bfloat16, ``hf``
  convention, one ``--blind-len`` sequence), against its training length L.
* **Reach** (census column ``reach``, ``reach_eps`` 0.01): the distance beyond which a head puts
  at most 1% of its attention (position 0 left out), on ``--reach-seqs`` sequences of
  ``--reach-len`` tokens: how far each head actually looks, beside its first exact zero.
* **Window counterfactual** (:func:`headsurgeon.window_effect`): the loss with every head cut to
  keys within d (position 0 kept), by d: which distances the model's loss depends on.
* **Precision counterfactual** (:func:`headsurgeon.precision_effect`): the loss change when the
  attention scores, or the whole model, are computed in bfloat16 as transformers' BLOOM does
  (bias as slope x key position), against float64, and the same under the ``relative`` bias.

Writes ``heads.csv`` (per model and head: slope, reach, first zeros, analytic distance),
``window.csv``, ``precision.csv``, ``models.csv``, one reach figure per model, the window and
precision figures, and ``summary.md``.

The L = 512 arms were trained with (budget: 3 x ~25 min of one CPU thread, two at a time; a
first attempt with 2,400 steps was stopped after 20 minutes, when the shared machine's load made
it too slow to finish in the session, and restarted with 1,500)::

    python analyses/train_organism.py --steps 1500 --minutes 300 --n-layer 4 --n-head 16 \\
        --hidden 128 --seq-len 512 --batch 8 --eval-every 300 --retrieval-share 0.25 \\
        --bias standard --name organism-512-standard --out runs/L512-standard \\
        --export analyses/mitigation_models/L512-standard
    # the same with --bias log (L512-log) and --bias log --log-match 512 (L512-log-match)

    python analyses/table3_regimes.py \\
        --model standard=analyses/mitigation_models/standard \\
        --model log=analyses/mitigation_models/log \\
        --model standard-s1=analyses/mitigation_models/standard-s1 \\
        --model log-s1=analyses/mitigation_models/log-s1 \\
        --model L512-standard=analyses/mitigation_models/L512-standard \\
        --model L512-log=analyses/mitigation_models/L512-log \\
        --model L512-log-match=analyses/mitigation_models/L512-log-match
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from _common import ROOT, markdown, parser, start, write_topic

import headsurgeon as hs
from headsurgeon.exact_alibi import trained_bias
from headsurgeon.loading import model_info
from headsurgeon.plots.distance import reach_figure
from headsurgeon.plots.evaluation import precision_figure
from headsurgeon.plots.layout import style
from headsurgeon.precision import PRECISION_CUT, precision_effect
from headsurgeon.progress import tqdm
from headsurgeon.window import window_effect

WINDOWS = (16, 32, 64, 128, 256, 512, 1024)
# The loss change the summary calls "used": a window costing more than this, pooled over positions.
USED_NATS = 0.01


# What the summary's numbers test and what they do not (its opening section).
SCOPE = (
    (
        "whether a model's steep heads had exact zeros inside its training window (they did only "
        "where `zero within L` > 0), how far each head looks (reach), and which distances its "
        "loss depends on (windows), for the Table 3 "
        "arms (one seed each except standard and log at L = 128, which have two)."
    ),
    (
        "retrieval (`figures/retrieval_distance/`) or a model of the paper's size (148M; these "
        "have 1.3M parameters and 5-12M training tokens); windows and precision come from 1-2 "
        "sequences without intervals."
    ),
)


def main() -> None:
    p = parser(__doc__, "table3_regimes")
    p.add_argument("--model", action="append", required=True, help="LABEL=FOLDER (repeat)")
    p.add_argument("--reach-len", type=int, default=2048)
    p.add_argument("--reach-seqs", type=int, default=4)
    p.add_argument("--blind-len", type=int, default=4096)
    p.add_argument("--window-len", type=int, default=2048)
    p.add_argument("--window-seqs", type=int, default=2)
    p.add_argument("--precision-len", type=int, default=2048)
    p.add_argument(
        "--cache", type=Path, default=ROOT / "runs" / "table3_regimes", help="per-model tables"
    )
    args = p.parse_args()
    folders = dict(spec.split("=", 1) for spec in args.model)
    started = start(args)

    heads, windows, precision, models, figures = [], [], [], {}, {}
    for label, folder in tqdm(folders.items(), desc="models"):
        model = hs.load_model(folder)
        info = model_info(model)
        models[label] = {
            "variant": trained_bias(info.metadata)[0],
            "params": trained_bias(info.metadata)[1],
            "seed": info.metadata["training"]["seed"],
            "train_ctx": info.train_ctx,
            "tokens": info.metadata["training"]["tokens_seen"],
            "folder": folder,
        }
        measured = measure(model, models[label]["variant"], args.cache / label, args)
        census, zeros, cut, effect = measured
        heads.append(head_table(census, zeros).assign(model=label))
        figures[f"reach_{label}"] = reach_figure(
            census, zeros, dtype="bfloat16", title=f"{label}: reach against exact zeros"
        )
        windows.append(cut.assign(model=label))
        if len(effect):
            precision.append(effect.assign(model=label))
    heads, windows = pd.concat(heads, ignore_index=True), pd.concat(windows, ignore_index=True)
    precision = pd.concat(precision, ignore_index=True) if precision else pd.DataFrame()
    figures["window"] = window_lines(windows)
    for label in precision.get("model", pd.Series(dtype=str)).unique():
        shown = precision[precision["model"] == label]
        for form, frame in shown.groupby("bias_form"):
            figures[f"precision_{label}_{form}"] = precision_figure(
                frame, title=f"{label}: loss change by position, bias {form}"
            )
    models_table = pd.DataFrame(models).T.rename_axis("model").reset_index()
    tables = {
        "heads.csv": heads,
        "window.csv": windows,
        "precision.csv": precision,
        "models.csv": models_table,
    }
    write_topic(
        args.out,
        figures,
        tables,
        summary_lines(models, heads, windows, precision, args),
        started,
        scope=SCOPE,
    )


def measure(model, variant: str, cache: Path, args) -> list[pd.DataFrame]:
    """The census, exact zeros, window and precision tables of one model, read from ``cache``
    when a run with the same settings wrote them there (each model takes minutes)."""
    names = ("census", "zeros", "window", "precision")
    settings = json.dumps({k: v for k, v in vars(args).items() if k.endswith(("_len", "_seqs"))})
    if (cache / "settings.json").exists() and (cache / "settings.json").read_text() == settings:
        return [  # an empty table (no precision: not standard ALiBi) is an empty file
            pd.read_csv(f) if (f := cache / f"{name}.csv").stat().st_size > 1 else pd.DataFrame()
            for name in names
        ]
    reach = hs.to_sequences(model, seq_len=args.reach_len, n_seqs=args.reach_seqs)
    census = hs.run_census(model, reach, progress=False)
    blind = hs.to_sequences(model, seq_len=args.blind_len, n_seqs=1)
    zeros = hs.measure_blindness(
        model, blind, dtypes=["float32", "bfloat16"], progress=False
    ).by_head
    cut = window_effect(
        model,
        hs.to_sequences(model, seq_len=args.window_len, n_seqs=args.window_seqs),
        distances=[d for d in WINDOWS if d < args.window_len],
        progress=False,
    ).by_distance
    effect = pd.DataFrame()
    if variant == "standard":  # the counterfactual follows transformers: standard ALiBi only
        effect = pd.concat(
            [
                run_precision(model, form, args.precision_len).assign(bias_form=form)
                for form in ("absolute", "relative")
            ],
            ignore_index=True,
        )
    frames = [census, zeros, cut, effect]
    cache.mkdir(parents=True, exist_ok=True)
    for name, frame in zip(names, frames, strict=True):
        frame.to_csv(cache / f"{name}.csv", index=False)
    (cache / "settings.json").write_text(settings)
    return frames


def run_precision(model, form: str, seq_len: int) -> pd.DataFrame:
    """bfloat16 scores and the whole model in bfloat16 against float64, one sequence."""
    one = hs.to_sequences(model, seq_len=seq_len, n_seqs=PRECISION_CUT.n_seqs)
    kwargs = {"dtypes": ["float32", "bfloat16"], "parts": ["scores", "model"], "progress": False}
    if form == "relative":
        with hs.mitigation(model, "relative"):
            return precision_effect(model, one, **kwargs).by_position
    return precision_effect(model, one, **kwargs).by_position


def head_table(census: pd.DataFrame, zeros: pd.DataFrame) -> pd.DataFrame:
    """Per head: slope, reach, first exact zero per dtype, analytic distance (float32, zero)."""
    wide = zeros.pivot_table(
        index=["layer", "head"],
        columns="dtype",
        values=["first_zero_distance", "analytic_distance"],
        dropna=False,
    )
    wide.columns = [f"{metric}_{dtype}" for metric, dtype in wide.columns]
    return census[["layer", "head", "slope", "reach"]].merge(
        wide.reset_index(), on=["layer", "head"]
    )


def window_lines(windows: pd.DataFrame) -> go.Figure:
    """Pooled dNLL against the window d, one line per model."""
    fig = go.Figure()
    for label, frame in windows.groupby("model", sort=False):
        pooled = frame.groupby("distance").apply(
            lambda g: np.average(g["dnll"], weights=g["tokens"]), include_groups=False
        )
        fig.add_trace(
            go.Scatter(x=pooled.index, y=pooled.to_numpy(), name=label, mode="lines+markers")
        )
    fig.update_xaxes(
        type="log", title="window d (tokens): keys farther than d cut, position 0 kept"
    )
    fig.update_yaxes(title="ΔNLL (nats), pooled over positions")
    style(fig, title="Which distances the loss uses", width=800, height=480)
    return fig


def summary_lines(models: dict, heads: pd.DataFrame, windows, precision, args) -> list[str]:
    lines = [
        "# Table 3 where the paper's claim lives: blind in training, reach, windows, precision",
        "",
        f"Reach: census on {args.reach_seqs} held-out sequences of {args.reach_len} tokens "
        "(`reach_eps` 0.01; `inf`: more than 1% of attention beyond every measured distance). "
        f"First exact zeros: `measure_blindness` on one {args.blind_len}-token sequence "
        "(`hf` convention). Window counterfactual: "
        f"{args.window_seqs} sequences of {args.window_len} tokens. Precision counterfactual: one "
        f"sequence of {args.precision_len} tokens, standard-ALiBi models only (the counterfactual "
        "follows transformers' BLOOM, which computes standard ALiBi).",
        "",
        "## Per model",
        "",
    ]
    rows = []
    for label, m in models.items():
        h = heads[heads["model"] == label]
        train_ctx = m["train_ctx"]
        f32, bf16 = h["first_zero_distance_float32"], h["first_zero_distance_bfloat16"]
        reach = h["reach"].replace(np.inf, np.nan)
        w = windows[windows["model"] == label]
        pooled = w.groupby("distance").apply(
            lambda g: np.average(g["dnll"], weights=g["tokens"]), include_groups=False
        )
        unused = [int(d) for d, v in pooled.items() if v <= USED_NATS]
        rows.append(
            {
                "model": label,
                "variant": m["variant"] + (f" match={m['params']['match']}" if m["params"] else ""),
                "L": train_ctx,
                "heads": len(h),
                "zero within L (float32)": int((f32 < train_ctx).sum()),
                "zero within L (bfloat16)": int((bf16 < train_ctx).sum()),
                "nearest zero (float32)": f32.min(),
                "reach > L": int((h["reach"] > train_ctx).sum()),
                "reach inf": int(np.isinf(h["reach"]).sum()),
                "median reach": reach.median(),
                "max finite reach": reach.max(),
                "smallest window costing <= 0.01 nats": min(unused) if unused else "none",
                "dNLL at window 64": pooled.get(64, np.nan),
                "dNLL at window 128": pooled.get(128, np.nan),
            }
        )
    lines += [markdown(pd.DataFrame(rows), 3), ""]
    lines += [
        "A negative ΔNLL at a window means the model does better without the farther keys: on "
        "text longer than it was trained on, those keys hurt it.",
        "",
    ]
    if len(precision):
        far = precision[precision["position_lo"] >= 1024]
        shown = (
            far.groupby(["model", "bias_form", "dtype", "part"], sort=False)
            .apply(
                lambda g: pd.Series(
                    {
                        "mean_dnll": np.average(g["mean_dnll"], weights=g["tokens"]),
                        "top1_agreement": np.average(g["top1_agreement"], weights=g["tokens"]),
                    }
                ),
                include_groups=False,
            )
            .reset_index()
        )
        lines += [
            "## Precision: the loss change at positions >= 1,024 against float64",
            "",
            "`absolute`: the bias as transformers' BLOOM forms it (slope x key position, in the "
            "dtype); `relative`: formed from distances, -m (i - j) (`hs.mitigation(model, "
            "'relative')`). `scores`: only the attention scores rounded; `model`: everything.",
            "",
            markdown(shown, 4),
            "",
        ]
    return lines


if __name__ == "__main__":
    main()
