"""The first sink table for ALiBi models: Gu et al.'s sink rate, Sandoval-Segura et al.'s AHON-LN
and the StreamingLLM sink-cache test, on every bundled organism and the Table 3 models.

Protocol, so the numbers can be set beside the papers' tables:

* **Sink rate** (Gu et al., ICLR 2025): the census under ``GU_PROTOCOL`` (100 windows of 64
  tokens of the bundled held-out corpora, eps = 0.3, thresholded per sequence as their code
  does) and ``sink_rate``. ``heads_mean>0.3``: heads whose mean sink score over the 100 windows
  exceeds 0.3 (the other reading of "share of heads"); ``bos_sink_labels``: the census's
  BOS-sink / dead labels (bos_mass > 0.5 at the classify tool's default 64 x 128 tokens).
* **AHON-LN** (Sandoval-Segura et al., ICLR 2026): the census column ``ahon_ln`` under the same
  protocol; ``ahon<0.1``: heads below a tenth of their layer's average (their docstring's example
  threshold), and the lowest head.
* **Sink cache** (Xiao et al., ICLR 2024): ``sink_cache_effect`` on one ``--seq-len``-token
  sequence of the held-out text, caches of {0, 1, 4} initial tokens plus the most recent
  y in {L/4, L} (L: the model's training length), ALiBi distances counted in cache slots as
  StreamingLLM / MPT do, against the full-context perplexity.

    python analyses/sink_table.py            # ~10 min of one CPU thread at --seq-len 4096

Writes ``figures/sinks/table/``: ``table.csv`` (one row per model), ``sink_cache.csv`` (one row per
model and cache), ``sink_cache.png`` and ``summary.md``.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from _common import ROOT, gu_census, markdown, parser, start, style, write_topic

from headsurgeon import (
    classify_heads,
    load_model,
    model_info,
    run_census,
    sink_cache_effect,
    to_sequences,
)
from headsurgeon.census import GU_PROTOCOL, sink_rate
from headsurgeon.plots import OKABE_ITO
from headsurgeon.sink_cache import SINK_CACHE_CUT

MODELS = {
    "organism": "organism",
    "organism-deep": "organism-deep",
    "organism-injured": "organism-injured",
    **{
        f"table3/{name}": str(ROOT / "analyses" / "mitigation_models" / name)
        for name in (
            "standard",
            "standard-s1",
            "log",
            "log-s1",
            "L512-standard",
            "L512-log",
            "L512-log-match",
        )
    },
}
SINKS = (0, 1, 4)
AHON_INACTIVE = 0.1


def measure(name: str, source: str, seq_len: int) -> tuple[dict, pd.DataFrame]:
    """One model's row of the table and its sink-cache rows."""
    model = load_model(source)
    info = model_info(model)
    gu = gu_census(model)
    labels = classify_heads(run_census(model, progress=False))["label"]
    lowest = gu.loc[gu["ahon_ln"].idxmin()]
    one = to_sequences(model, seq_len=seq_len, n_seqs=SINK_CACHE_CUT.n_seqs)
    effect = sink_cache_effect(model, one, sinks=SINKS, heads=[], progress=False)
    cache = effect.by_cache.assign(model=name)
    no_sink = cache[cache["sinks"] == 0].set_index("window")["ppl"]
    one_sink = cache[cache["sinks"] == 1].set_index("window")["ppl"]
    four_sinks = cache[cache["sinks"] == 4].set_index("window")["ppl"]
    shortest = int(cache["window"].min())
    row = {
        "model": name,
        "shape": f"{model.cfg.n_layers} x {model.cfg.n_heads} x {model.cfg.d_model}",
        "train_len": info.train_ctx,
        "bias": (info.metadata.get("alibi") or {}).get("kind", "standard"),
        "sink_rate": sink_rate(gu),
        "heads_mean>0.3": int((gu["sink_score"] > GU_PROTOCOL["sink_eps"]).sum()),
        "bos_sink_labels": int((labels != "healthy").sum()),
        f"ahon<{AHON_INACTIVE}": int((gu["ahon_ln"] < AHON_INACTIVE).sum()),
        "lowest_ahon": f"L{int(lowest['layer'])}H{int(lowest['head'])} {lowest['ahon_ln']:.3f}",
        "full_ppl": effect.by_cache.attrs["full_ppl"],
        "short_window": shortest,
        "ppl_0+short": no_sink[shortest],
        "ppl_1+short": one_sink[shortest],
        "ppl_4+short": four_sinks[shortest],
    }
    return row, cache


def cache_figure(cache: pd.DataFrame) -> go.Figure:
    """Perplexity over full context, per model and cache: one panel per window share."""
    fig = go.Figure()
    colours = [OKABE_ITO[c] for c in ("vermillion", "orange", "blue")]
    for (sinks, colour), symbol in zip(
        zip(SINKS, colours, strict=True), ("x", "circle", "square"), strict=True
    ):
        for share, dash in (("short", "dot"), ("train", "solid")):
            rows = cache[(cache["sinks"] == sinks) & (cache["share"] == share)]
            fig.add_trace(
                go.Scatter(
                    x=rows["model"],
                    y=rows["ppl"] / rows["full_ppl"],
                    mode="markers+lines",
                    marker={"symbol": symbol, "size": 9, "color": colour},
                    line={"dash": dash, "color": colour, "width": 1},
                    name=f"{sinks} sink(s) + {'L/4' if share == 'short' else 'L'} recent",
                )
            )
    fig.add_hline(y=1, line={"color": "#555", "dash": "dot"})
    fig.update_yaxes(title_text="perplexity / full-context perplexity", type="log")
    fig.update_xaxes(title_text="model")
    style(
        fig,
        "StreamingLLM's test on ALiBi organisms: a cache of initial plus recent tokens",
        "one held-out sequence; L: the model's training length; ALiBi distances in cache slots",
        1200,
        560,
    )
    return fig


# What the summary's numbers test and what they do not (its opening section).
SCOPE = (
    (
        "Gu et al.'s sink rate (100 x 64 tokens), AHON-LN and the sink-cache perplexity (x first "
        "+ y recent tokens against the full context, one 2,048-token held-out sequence, standard "
        "errors by batch means over its 64-token blocks) of every organism and Table 3 model."
    ),
    (
        "sinks in large models (these have 0.4-4.2M parameters and saw 5-25M tokens), which head "
        "needs the sinks (`figures/sinks/sink_cache_injured.md`), or more than one "
        "sequence for the cache."
    ),
)


def main() -> None:
    p = parser(__doc__, "sinks/table")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens of the sink-cache sequence")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = p.parse_args()
    started = start(args)
    rows, caches = [], []
    for name in args.models:
        row, cache = measure(name, MODELS[name], args.seq_len)
        rows.append(row)
        # the two windows: a quarter of the training length (short) and the training length
        share = cache["window"].rank(method="dense").map({1.0: "short", 2.0: "train"})
        caches.append(cache.assign(share=share))
        print(row)
    table = pd.DataFrame(rows)
    cache = pd.concat(caches, ignore_index=True)
    summary = [
        "# Sinks in ALiBi models: the standard scores and the sink-cache test",
        "",
        "Protocol (`analyses/sink_table.py`; definitions in docs/tools/classify.md, "
        "docs/long-contexts.md): sink rate = Gu et al.'s Sink_1^eps, eps = 0.3, per sequence, "
        f"over {GU_PROTOCOL['n_seqs']} windows of {GU_PROTOCOL['seq_len']} tokens of the bundled "
        "held-out text (the organisms prepend no BOS token unless their record says so, like Gu's "
        "own pretrained models); `heads_mean>0.3`: heads whose mean sink score exceeds 0.3; "
        "AHON-LN: Sandoval-Segura et al.'s mean |z| over the layer's mean, same windows; "
        f"sink cache: one {args.seq_len}-token held-out sequence, x initial + y recent tokens, "
        "perplexity against full context.",
        "",
        "For scale (Gu et al., Table 1 and Sec. 4): Llama-2-7B 92.47%, Mistral-7B 97.49%, their "
        "60M ALiBi model trained on 5B tokens 20.78%. The models here are 0.4-3M parameters "
        "trained on 10-25M tokens: a row here is not a claim about large models.",
        "",
        markdown(table, 4),
        "",
        "Sink cache, every configuration (`sink_cache.csv`):",
        "",
        markdown(cache[["model", "sinks", "window", "ppl", "full_ppl", "dnll", "dnll_se"]], 4),
        "",
        "`short_window`: a quarter of the training length L; `ppl_x+short`: x initial tokens plus "
        "that many recent ones. The sequence is longer than every model's training length, so "
        "the full-context reference is itself an extrapolation (the log-distance models do "
        "better with a short cache than with full context).",
        "",
        "What this does not say: the rates are per (sequence, head) on 64-token windows; a head "
        "can pass 0.3 on short windows and not on long ones (ALiBi penalises position 0 by its "
        "distance). The sink-cache rows are one sequence each; `dnll_se` is the paired "
        "batch-means standard error over 64-prediction blocks of it (headsurgeon.stats).",
    ]
    write_topic(
        args.out,
        {"sink_cache": cache_figure(cache)},
        {"table.csv": table, "sink_cache.csv": cache},
        summary,
        started,
        scope=SCOPE,
    )


if __name__ == "__main__":
    main()
