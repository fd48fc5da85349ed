"""Repair results on the injured organism: recovery, perplexity, drift, bit-identity, corpora.

1. ``headsurgeon.repair.repair`` with the settings ``python -m headsurgeon repair organism-injured``
   uses (census on the bundled held-out corpora, up to two passes of masked fine-tuning on both
   bundled training corpora, with the steps and learning rate the organism recommends in its
   ``headsurgeon.json``) on ``organism-injured``: heads
   recovered of those targeted, frozen heads that drifted, and held-out perplexity against the
   uninjured ``organism`` (acceptance: within 2%). The repaired model is exported with
   ``headsurgeon.save_hf`` (to ``runs/``, not into ``figures/``) and every tensor of the export
   is compared with the input checkpoint: all but the repaired heads' Q/K/V/O slices must be
   bit-identical.
2. The surgery paper's domain-specialisation finding (repairing on one domain lowers its training
   perplexity and raises held-out perplexity elsewhere), checked on the organism: a shorter repair
   (one pass of ``--corpus-steps``, to fit the time budget) with each bundled corpus alone
   (Shakespeare or the Python docs, train split), each evaluated on both corpora.

    python analyses/repair_organism.py
    python analyses/repair_organism.py --injured DIR --reference DIR --save-model runs/x

Writes ``figures/repair/``: ``report/`` (``headsurgeon.reports.write_report`` of the default
repair, without the model: labels before/after, BOS-mass change, training curves, census CSVs),
``perplexity.png``/``.csv`` (every model on every evaluation set), ``bos_mass_by_corpus.png``
(before/after grids of the three repairs), ``bit_identity.csv`` and ``summary.md``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import torch
from _common import ROOT, acceptance, fmt_heads, markdown, parser, start, style, write_topic

from headsurgeon import load_model, model_info, perplexity, save_hf
from headsurgeon.checkpoint_diff import weight_changes
from headsurgeon.data import CORPORA, bundled_text, to_sequences
from headsurgeon.plots import OKABE_ITO, models_grid
from headsurgeon.repair import RepairResult, recommended_config, repair
from headsurgeon.reports import write_report

MODEL_COLOURS = {
    "organism": OKABE_ITO["black"],
    "injured": OKABE_ITO["vermillion"],
    "repaired (both corpora)": OKABE_ITO["blue"],
    "repaired (shakespeare)": OKABE_ITO["orange"],
    "repaired (python-docs)": OKABE_ITO["green"],
}


def eval_sets(model, n_seqs: int, seq_len: int) -> dict[str, torch.Tensor]:
    """The evaluation token sets: repair's own held-out mix, then each corpus's splits."""
    sets = {"held-out mix": to_sequences(model, seq_len=seq_len, n_seqs=n_seqs).tokens}
    for corpus in CORPORA:
        for split in ("heldout", "train"):
            text = bundled_text(corpus, split)
            sets[f"{corpus} {split}"] = to_sequences(
                model, text, seq_len=seq_len, n_seqs=n_seqs
            ).tokens
    return sets


def perplexities(model, sets: dict[str, torch.Tensor], window: int) -> dict[str, float]:
    return {
        name: perplexity(model, tokens, window=window, prepend_bos=False, max_windows=None)
        for name, tokens in sets.items()
    }


def ppl_figure(table: pd.DataFrame) -> go.Figure:
    """Grouped bars: perplexity of every model on every evaluation set, relative to organism."""
    fig = go.Figure()
    reference = table[table["model"] == "organism"].set_index("set")["perplexity"]
    for model, sub in table.groupby("model", sort=False):
        ratio = sub["perplexity"].to_numpy() / reference.loc[sub["set"]].to_numpy()
        fig.add_trace(
            go.Bar(
                x=sub["set"],
                y=(ratio - 1) * 100,
                name=model,
                marker={"color": MODEL_COLOURS.get(model, "#999999")},
                customdata=sub["perplexity"],
                hovertemplate=f"{model}, %{{x}}: %{{y:+.1f}}% (PPL %{{customdata:.2f}})"
                "<extra></extra>",
            )
        )
    fig.add_hline(y=2, line={"dash": "dot", "color": "#555555"})
    fig.add_hline(y=-2, line={"dash": "dot", "color": "#555555"})
    fig.update_yaxes(title_text="perplexity vs organism (%)", zeroline=True, zerolinecolor="#999")
    style(
        fig,
        "Perplexity after injury and repair, relative to the uninjured organism",
        "dotted: ±2% (the acceptance band); train sets: the corpus the single-corpus repairs "
        "trained on",
        1200,
        520,
    )
    fig.update_layout(barmode="group")
    return fig


def describe(result: RepairResult) -> dict[str, object]:
    return {
        "targeted": len(result.targeted),
        "recovered": len(result.recovered),
        "rate": f"{result.recovery_rate:.1%}",
        "still sick": fmt_heads(result.still_sick.names()),
        "drifted": len(result.drifted),
        "passes": len(result.passes),
        "steps": sum(p.training.steps_done for p in result.passes),
    }


# What the summary's numbers test and what they do not (its opening section).
SCOPE = (
    (
        "the CLI's default repair of organism-injured's 6 planted sick heads: whether the targets"
        " end healthy, whether untouched weights stay bit-identical and frozen heads stay put, "
        "the held-out perplexity against organism and the injured model, and repairs on one "
        "corpus."
    ),
    (
        "repair of heads that fell sick by themselves (`figures/sinks/control_natural/`), whether"
        " re-initialisation beats retraining alone (`figures/sinks/control/`), large models, or "
        "the spread over seeds (one run; perplexities without intervals)."
    ),
)


def main() -> None:
    p = parser(__doc__, "repair")
    p.add_argument("--injured", default="organism-injured", help="model to repair")
    p.add_argument("--reference", default="organism", help="the uninjured model")
    p.add_argument(
        "--save-model",
        type=Path,
        default=ROOT / "runs" / "organism-repaired",
        help="where the repaired model (default repair) is exported; replaced",
    )
    p.add_argument("--eval-seqs", type=int, default=64, help="sequences per evaluation set")
    p.add_argument(
        "--corpus-steps",
        type=int,
        default=60,
        help="fine-tuning steps of the single-corpus repairs (one pass each)",
    )
    args = p.parse_args()
    started = start(args)

    injured = load_model(args.injured)
    source = model_info(injured).source
    truth_file = source / "truth.json"
    truth = json.loads(truth_file.read_text())["labels"] if truth_file.exists() else None
    seq_len = min(512, model_info(injured).train_ctx or injured.cfg.n_ctx)
    # Every model is scored on the same windows, in the injured organism's position-0 convention
    # (what repair itself evaluates).
    sets = eval_sets(injured, args.eval_seqs, seq_len)
    ppl = {"organism": perplexities(load_model(args.reference), sets, seq_len)}
    ppl["injured"] = perplexities(injured, sets, seq_len)

    config = recommended_config(injured)
    result = repair(injured, finetune_config=config, progress=False)
    ppl["repaired (both corpora)"] = perplexities(result.model, sets, seq_len)
    save_hf(result.model, args.save_model, overwrite=True)
    identity = weight_changes(source, args.save_model, result.targeted)

    results = {"both corpora": result}
    corpus_config = dataclasses.replace(config, steps=args.corpus_steps, warmup_steps=None)
    for corpus in CORPORA:
        model = load_model(args.injured)
        results[corpus] = repair(
            model,
            bundled_text(corpus, "train"),
            eval_corpus=bundled_text(corpus, "heldout"),
            passes=1,
            finetune_config=corpus_config,
            control=False,  # these test domain specialisation; the default repair has a control
            progress=False,
        )
        ppl[f"repaired ({corpus})"] = perplexities(model, sets, seq_len)

    table = pd.DataFrame(
        [{"model": m, "set": s, "perplexity": v} for m, d in ppl.items() for s, v in d.items()]
    )
    wide = table.pivot_table(index="model", columns="set", values="perplexity", sort=False)
    figures = {
        "perplexity": ppl_figure(table[table["model"].isin(list(MODEL_COLOURS))]),
        "bos_mass_by_corpus": models_grid(
            {"injured": result.census_before}
            | {f"→ {name}": r.census_after for name, r in results.items()},
            "bos_mass",
            title="BOS mass before and after repair (→ repair corpus)",
        ),
    }
    tables = {
        "perplexity.csv": table,
        "bit_identity.csv": identity,
        "repairs.csv": pd.DataFrame([{"corpus": n} | describe(r) for n, r in results.items()]),
    }

    # summary.md
    report = result.to_dict()
    mix = wide["held-out mix"]
    held_out = {"uninjured": mix["organism"], "repaired": mix["repaired (both corpora)"]}
    checked = acceptance(report, held_out, identity)
    ratio, frozen_bad = checked["ppl_gap"], checked["untouched_changed"]
    planted = {h for h, label in (truth or {}).items() if label != "healthy"}
    targeted = set(result.targeted.names())
    settings = report["settings"]
    ft, train_shape, census_shape = (
        settings["finetune"],
        settings["train_sequences"],
        settings["census_sequences"],
    )
    lines = [
        f"# Repair of {model_info(result.model).name}",
        "",
        "## Default repair (both bundled training corpora)",
        "",
        "Settings: the repair CLI's defaults (the library defaults, with the steps and learning "
        "rate the model recommends in its headsurgeon.json, if any): "
        f"{settings['passes']} passes at most, {ft['steps']} steps "
        f"of lr {ft['lr']:g} per pass, batch {ft['batch_size']} x {train_shape[1]} tokens, init "
        f"{settings['init']}; census {census_shape[0]} x {census_shape[1]} tokens of the "
        "held-out corpora.",
        "",
        f"- Targeted {len(result.targeted)} heads ({result.targeted}); recovered "
        f"{len(result.recovered)}/{len(result.targeted)} = {result.recovery_rate:.1%}; still "
        f"sick: {fmt_heads(result.still_sick.names())}.",
        f"- Healthy heads {report['healthy_before']} -> {report['healthy_after']} of "
        f"{report['n_heads']}; frozen heads that drifted (|Δ BOS mass| > "
        f"{report['drift']['threshold']}): {report['drift']['count']} "
        f"({fmt_heads(report['drift']['heads'])}).",
    ]
    if truth is not None:
        lines.append(
            f"- Planted heads (truth.json): {len(planted)}; targeted {len(planted & targeted)} of "
            f"them; targeted but not planted: {fmt_heads(sorted(targeted - planted))}."
        )
    lines += [
        f"- Held-out perplexity (repair's held-out mix, {len(sets['held-out mix'])} x {seq_len} "
        f"tokens): organism {mix['organism']:.3f}, injured {mix['injured']:.3f}, repaired "
        f"{mix['repaired (both corpora)']:.3f} ({ratio:+.2%} vs organism; acceptance <= 2%: "
        f"{'met' if checked['ppl_met'] else 'NOT met'}).",
        f"- Bit-identity: exported {identity['dtype_after'].iloc[0]} model vs the "
        f"{identity['dtype_before'].iloc[0]} input, {len(identity)} tensors, "
        f"{int(identity['elements'].sum()):,} elements, of which "
        f"{int(identity['head_elements'].sum()):,} in the repaired heads' Q/K/V/O slices: "
        f"{frozen_bad} untouched element(s) differ"
        + (" (all untouched weights identical)." if frozen_bad == 0 else "."),
        "",
        "Per pass (from `report/report.md`):",
        "",
        markdown(
            pd.DataFrame(
                [
                    {
                        "pass": q["pass"],
                        "targeted": len(q["targeted"]),
                        "recovered": len(q["recovered"]),
                        "drifted": q["drift"]["count"],
                        "steps": q["training"]["steps"],
                        "train PPL": q["perplexity_after"]["train"],
                        "held-out PPL": q["perplexity_after"]["heldout"],
                        "healthy after": q["healthy_after"],
                    }
                    for q in report["passes"]
                ]
            ),
            digits=5,
        ),
        "",
        "## Repair corpus: both, Shakespeare only, Python docs only",
        "",
        f"The single-corpus repairs fine-tune one pass of {args.corpus_steps} steps (otherwise the "
        "settings above) on one bundled training split and evaluate on its held-out split.",
        "",
        markdown(pd.DataFrame([{"corpus": n} | describe(r) for n, r in results.items()])),
        "",
        f"Perplexity on each evaluation set ({args.eval_seqs} x {seq_len} tokens each, every "
        f"model on the same windows in {model_info(result.model).name}'s position-0 convention; "
        "`train`: the training splits):",
        "",
        markdown(wide.reset_index().rename_axis(None, axis=1), digits=5),
        "",
        "Domain specialisation (the surgery paper: repairing on one domain lowers its training "
        "perplexity and raises held-out perplexity elsewhere), repaired on one corpus against the "
        "other:",
        "",
    ]
    for corpus in CORPORA:
        other = next(c for c in CORPORA if c != corpus)
        for split in ("train", "heldout"):
            own_ppl = wide.loc[f"repaired ({corpus})", f"{corpus} {split}"]
            other_ppl = wide.loc[f"repaired ({other})", f"{corpus} {split}"]
            lines.append(
                f"- {corpus} {split}: repaired on {corpus} {own_ppl:.3f}, on {other} "
                f"{other_ppl:.3f} ({other_ppl / own_ppl - 1:+.2%}); injured "
                f"{wide.loc['injured', f'{corpus} {split}']:.3f}, organism "
                f"{wide.loc['organism', f'{corpus} {split}']:.3f}."
            )

    def extra(folder: Path) -> None:
        write_report(result, folder / "report", formats=("png",), save_model=False)

    write_topic(args.out, figures, tables, lines, started, extra, scope=SCOPE)


if __name__ == "__main__":
    main()
