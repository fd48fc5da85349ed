"""The surgery paper's questions on a naturally collapsed organism (issue 29).

The recipe of ``analyses/train_organism.py --span-share`` (natural text with synthetic
context-free spans, BOS first) is meant to grow sick heads from the training objective alone,
nothing planted; a run that crosses the sink threshold is bundled as ``organism-collapsed``.
None has yet (the runs shipped in ``analyses/collapse_alibi`` and ``analyses/collapse_control``
peaked below 0.5). This script asks of such models what the surgery paper asks of BLOOM:

1. Which heads are sick, and where: the census (``headsurgeon.run_census``, the classify CLI's
   default 64 x 128 held-out tokens) with each head's layer and ALiBi slope, and every head's
   BOS mass over training from the organism's ``training_log.csv``.
2. Are the sick heads dormant: ``headsurgeon.head_importance`` by mean and by zero ablation
   (dormant: |delta loss| <= 2 standard errors).
3. Prune versus repair: ``headsurgeon.repair`` with the settings of
   ``python -m headsurgeon.repair MODEL --steps S --lr LR`` (its report is written to
   ``repair-<model>/``, the same files the CLI writes, without the model), held-out perplexity
   of the model, the model with its sick heads pruned (mean- and zero-ablated) and the
   repaired model; recovery per pass; how the frozen heads' BOS masses moved (the paper's global
   redistribution). The same repair trained on the organism's own mixture (text with spans)
   instead of text only (the paper's curated-versus-noisy data question).
4. The causal control: the same recipe with no positional bias (``--control``: a model trained
   with ``--bias clamped --bias-c 1e-6``, i.e. every ALiBi logit within 1e-6 of 0), its census
   and trajectories beside the organism's.

    python analyses/natural_collapse.py
    python analyses/natural_collapse.py --model analyses/collapse_alibi \\
        --control analyses/collapse_control --steps 300 --lr 2e-3

Writes ``figures/natural_collapse/``: ``summary.md``, ``heads.csv`` (census, slopes, importance
of every head of both models), ``trajectories.csv``/``.png`` (BOS mass per head over training),
``prune_vs_repair.csv``, ``redistribution.csv`` (every head's BOS mass before and after each
repair; ``frozen``: not targeted), ``repair-<model>/`` (the report of each text-only repair).
Models with no sick head are not repaired (``headsurgeon.repair`` has nothing to do).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import torch
import train_organism
from _common import ROOT, fmt_heads, markdown, parser, start, style, write_topic
from plotly.subplots import make_subplots
from transformers import AutoTokenizer

from headsurgeon import classify_heads, head_importance, load_model, model_info, run_census
from headsurgeon.backend import Model
from headsurgeon.finetune import FinetuneConfig
from headsurgeon.plots import OKABE_ITO
from headsurgeon.repair import RepairResult, repair
from headsurgeon.reports import write_report

SINK = train_organism.SINK_THRESHOLD
MIXTURE_WINDOWS = 2048  # training windows of the organism's own mixture for the mixture repair


def census_table(model, name: str) -> pd.DataFrame:
    """Census, labels and importance (mean and zero ablation) of every head, one row each."""
    census = classify_heads(run_census(model, progress=False))
    table = census[["layer", "head", "slope", "bos_mass", "output_share", "entropy", "label"]]
    table = table.assign(model=name)
    for method in ("mean", "zero"):
        imp = head_importance(model, method=method, progress=False)
        table = table.merge(
            imp[["layer", "head", "delta_loss", "delta_loss_se"]].rename(
                columns={"delta_loss": f"dloss_{method}", "delta_loss_se": f"dloss_{method}_se"}
            ),
            on=["layer", "head"],
        )
        table[f"dormant_{method}"] = (
            table[f"dloss_{method}"].abs() <= 2 * table[f"dloss_{method}_se"]
        )
    return table


def trajectories(source: Path, name: str) -> pd.DataFrame:
    """Every head's held-out BOS mass at each evaluation of a training log (long format)."""
    log = pd.read_csv(source / "training_log.csv")
    heads = [c for c in log.columns if c.startswith("bos_L")]
    long = log.melt(id_vars=["step", "minutes"], value_vars=heads, value_name="bos_mass")
    return long.assign(head=long["variable"].str.removeprefix("bos_"), model=name).drop(
        columns="variable"
    )


def trajectory_figure(traj: pd.DataFrame, sick: dict[str, set[str]]) -> go.Figure:
    """One panel per model: BOS mass of every head over training; sick heads coloured."""
    models = list(traj["model"].unique())
    fig = make_subplots(rows=1, cols=len(models), subplot_titles=models, shared_yaxes=True)
    colours = [OKABE_ITO[c] for c in ("vermillion", "blue", "green", "orange", "purple")]
    for col, name in enumerate(models, start=1):
        sub = traj[traj["model"] == name]
        ordered = sorted(sub["head"].unique(), key=lambda h: h in sick[name])  # sick drawn last
        for head in ordered:
            rows = sub[sub["head"] == head]
            is_sick = head in sick[name]
            colour = colours[sorted(sick[name]).index(head) % len(colours)] if is_sick else "#bbb"
            fig.add_trace(
                go.Scatter(
                    x=rows["minutes"],
                    y=rows["bos_mass"],
                    mode="lines",
                    name=f"{name} {head}",
                    showlegend=is_sick,
                    line={"color": colour, "width": 2.5 if is_sick else 1},
                ),
                row=1,
                col=col,
            )
        fig.add_hline(y=SINK, line={"dash": "dot", "color": "#555"}, row=1, col=col)
        fig.update_xaxes(title_text="training minutes (one CPU thread)", row=1, col=col)
    fig.update_yaxes(title_text="BOS mass (held-out text)", range=[0, 1], row=1, col=1)
    style(
        fig,
        "BOS mass of every head during training",
        "coloured: heads the final census labels sick; dotted: the sink threshold 0.5",
        1200,
        520,
    )
    return fig


def mixture_windows(model, n: int) -> torch.Tensor:
    """``n`` training windows of the organism's own recipe (text with spans, BOS first), cut
    with the same code and seed it was trained with (train_organism.load_data/sample_batch)."""
    meta = model_info(model).metadata["training"]
    config = meta["config"]
    tokenizer = AutoTokenizer.from_pretrained(model_info(model).source)
    data = train_organism.load_data(
        tokenizer, config["seq_len"], True, config["span_share"], meta["seed"]
    )
    gen = torch.Generator().manual_seed(meta["seed"] + 3)  # not the training batches' stream
    return train_organism.sample_batch(data, gen, n)


def moved(result: RepairResult, key: tuple[str, str]) -> pd.DataFrame:
    """BOS mass of every head before and after a repair; ``frozen``: not targeted."""
    before = result.census_before.set_index(["layer", "head"])["bos_mass"]
    after = result.census_after.set_index(["layer", "head"])["bos_mass"]
    table = pd.DataFrame({"bos_before": before, "bos_after": after}).reset_index()
    targeted = set(result.targeted.names())
    names = [f"L{r.layer}H{r.head}" for r in table.itertuples()]
    return table.assign(
        head_name=names,
        frozen=[n not in targeted for n in names],
        change=table["bos_after"] - table["bos_before"],
        model=key[0],
        repair_data=key[1],
    )


def main() -> None:
    p = parser(__doc__, "natural_collapse")
    p.add_argument(
        "--model",
        type=Path,
        default=ROOT / "analyses" / "collapse_alibi",
        help="the recipe's ALiBi model (organism-collapsed, were it bundled: no run of the "
        "recipe reached the sink threshold, so the exported run lives here)",
    )
    p.add_argument(
        "--control",
        type=Path,
        default=ROOT / "analyses" / "collapse_control",
        help="the same recipe trained without positional bias (exported folder)",
    )
    p.add_argument("--steps", type=int, default=300, help="repair steps per pass")
    p.add_argument("--lr", type=float, default=2e-3, help="repair learning rate")
    args = p.parse_args()
    started = start(args)

    names = {"ALiBi": str(args.model), "control": str(args.control)}
    models = {label: load_model(name) for label, name in names.items()}
    heads = pd.concat([census_table(m, label) for label, m in models.items()])
    sick = {
        label: {f"L{r.layer}H{r.head}" for r in sub.itertuples() if r.label != "healthy"}
        for label, sub in heads.groupby("model")
    }
    traj = pd.concat([trajectories(model_info(m).source, label) for label, m in models.items()])

    config = FinetuneConfig(steps=args.steps, lr=args.lr)
    repairs: dict[tuple[str, str], RepairResult] = {}
    for label, name in names.items():
        if not sick[label]:  # repair refuses a model with nothing to repair
            continue
        repairs[label, "text only"] = repair(
            load_model(name), finetune_config=config, progress=False
        )
        repairs[label, "training mixture"] = repair(
            load_model(name),
            mixture_windows(models[label], MIXTURE_WINDOWS),
            finetune_config=config,
            progress=False,
        )
    tables = {"heads.csv": heads, "trajectories.csv": traj}
    if repairs:
        tables["prune_vs_repair.csv"] = pd.DataFrame(
            [repair_row(key, result) for key, result in repairs.items()]
        )
        tables["redistribution.csv"] = pd.concat(
            [moved(result, key) for key, result in repairs.items()]
        )

    def reports(folder: Path) -> None:
        """Each text-only repair's report: what ``python -m headsurgeon.repair`` writes."""
        for (label, data), result in repairs.items():
            if data == "text only":
                write_report(result, folder / f"repair-{label}", save_model=False)

    summary = summarise(args, models, heads, sick, traj, tables)
    write_topic(
        args.out,
        {"trajectories": trajectory_figure(traj, sick)},
        tables,
        summary,
        started,
        extra=reports,
    )


def repair_row(key: tuple[str, str], result: RepairResult) -> dict[str, object]:
    """One repair's recovery and the held-out perplexity of model, pruned and repaired."""
    pvr = result.prune_vs_repair() or {}
    return {
        "model": key[0],
        "repair data": key[1],
        "targeted": ", ".join(result.targeted.names()),
        "recovered": len(result.recovered),
        "recovery_rate": result.recovery_rate,
        "recovered_per_pass": "; ".join(
            f"pass {i}: {len(q.recovered)}/{len(q.targeted)}"
            for i, q in enumerate(result.passes, start=1)
        ),
        "verdict": result.verdict,
        "ppl_model": (pvr.get("injured") or {}).get("heldout"),
        "ppl_pruned_mean": (pvr.get("pruned_mean") or {}).get("heldout"),
        "ppl_pruned_zero": (pvr.get("pruned_zero") or {}).get("heldout"),
        "ppl_repaired": (pvr.get("repaired") or {}).get("heldout"),
        "drifted": ", ".join(result.drifted.names()),
        "max_frozen_bos_change": moved(result, key).query("frozen")["change"].abs().max(),
    }


def summarise(
    args: argparse.Namespace,
    models: dict[str, Model],
    heads: pd.DataFrame,
    sick: dict[str, set[str]],
    traj: pd.DataFrame,
    tables: dict[str, pd.DataFrame],
) -> list[str]:
    """summary.md: the numbers of both models (the claims are stated in docs/organisms.md)."""
    peak = traj.groupby(["model", "head"])["bos_mass"].max()
    lines = [
        "# Natural collapse: the recipe with ALiBi and without positional bias",
        "",
        "The control's `slope` column is its configuration's nominal slope; it trained and runs "
        "with every bias clamped to within 1e-6 of 0 (`--bias clamped --bias-c 1e-6`).",
        "",
        f"ALiBi model: `{args.model.relative_to(ROOT)}`; control: "
        f"`{args.control.relative_to(ROOT)}`. Census: the "
        "classify CLI's default, 64 x 128 held-out tokens; importance: mean and zero ablation "
        "on the same kind of data (dormant: |delta loss| <= 2 SE).",
        "",
    ]
    for label, model in models.items():
        training = model_info(model).metadata["training"]
        mine = heads[heads["model"] == label]
        sick_rows = mine[mine["label"] != "healthy"]
        healthy = mine[mine["label"] == "healthy"]
        lines += [
            f"## {label}",
            "",
            f"{model_info(model).metadata['description']} Trained {training['minutes']} min "
            f"({training['steps']} steps, {training['tokens_seen']:,} tokens); stopped: "
            f"{training.get('stopped', 'n/a')}.",
            "",
            f"- Sick heads: {len(sick_rows)} of {len(mine)} ({fmt_heads(sorted(sick[label]))}); "
            f"largest census BOS mass {mine['bos_mass'].max():.3f} "
            f"({mine_head(mine)}); largest BOS mass in training (8 held-out windows per "
            f"evaluation): {peak[label].max():.3f} ({peak[label].idxmax()}).",
            f"- Slopes of the sick heads: {fmt_values(sick_rows['slope'], '.4g')} (the model's "
            f"run {mine['slope'].max():.4g} ... {mine['slope'].min():.4g}).",
            f"- Dormancy of the sick heads: mean ablation {fmt_values(sick_rows['dloss_mean'])}, "
            f"zero ablation {fmt_values(sick_rows['dloss_zero'])} nats; dormant by mean / zero "
            f"ablation: {int(sick_rows['dormant_mean'].sum())} / "
            f"{int(sick_rows['dormant_zero'].sum())} of {len(sick_rows)}.",
            f"- Healthy heads: median cost {healthy['dloss_mean'].median():.4f} (mean ablation), "
            f"{healthy['dloss_zero'].median():.4f} (zero ablation) nats; dormant by mean "
            f"ablation: {int(healthy['dormant_mean'].sum())} of {len(healthy)}.",
            "",
        ]
        # The heads nearest the threshold, sick or not: where collapse would come from.
        columns = ["layer", "head", "slope", "bos_mass", "label", "dloss_mean", "dloss_zero"]
        lines += [
            "Largest BOS masses (census) and what ablating those heads costs (nats):",
            "",
            markdown(mine.nlargest(3, "bos_mass")[columns], 4),
            "",
        ]
    lines += ["## Prune versus repair", ""]
    if "prune_vs_repair.csv" in tables:
        lines += [
            f"Repair: {args.steps} steps at lr {args.lr:g} per pass, up to 2 passes (as "
            f"`python -m headsurgeon.repair MODEL --steps {args.steps} --lr {args.lr:g}`; "
            "reports in `repair-<model>/`), on the bundled training text and on "
            f"{MIXTURE_WINDOWS} windows of the model's own training mixture. Perplexity: the "
            "repair's held-out windows of the bundled held-out text (ppl_model: as trained; "
            "pruned: the targets' z mean- or zero-ablated).",
            "",
            markdown(tables["prune_vs_repair.csv"], 4),
            "",
        ]
    else:
        lines += ["No model has a sick head: nothing to prune or repair.", ""]
    return lines


def mine_head(table: pd.DataFrame) -> str:
    """``L{layer}H{head}`` of the head with the largest BOS mass."""
    row = table.loc[table["bos_mass"].idxmax()]
    return f"L{row['layer']}H{row['head']}"


def fmt_values(values: pd.Series, spec: str = "+.4f") -> str:
    """Numbers as a comma-separated list, or ``none``."""
    return ", ".join(f"{v:{spec}}" for v in values) or "none"


if __name__ == "__main__":
    main()
