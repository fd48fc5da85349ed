"""The report folder of a repair: report.md, report.json, censuses, figures and ``model/``.

report.md opens with the verdict (which pass is kept and what it cost) and prune versus repair
versus control, then the passes in a table and one section each, head by head, the control arm,
the redistribution over the frozen heads, the figures and the settings.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from headsurgeon import plots
from headsurgeon.checkpoints import save_hf
from headsurgeon.heads import HeadSet
from headsurgeon.loading import model_info
from headsurgeon.markup import markdown_text
from headsurgeon.outputs import atomic_directory, atomic_write_text
from headsurgeon.reports.page import samples_note, write_page
from headsurgeon.reports.records import json_safe, package_versions

if TYPE_CHECKING:
    from headsurgeon.repair import RepairResult

__all__ = [
    "write_report",
]


# The training figure's width in pixels (the page's body is at most 1500 wide, less its margins)
# and the legend entries ("control 12 (3 heads)") one row of it holds.
TRAINING_WIDTH = 1200
LEGEND_PER_ROW = 5


def training_plot(result: RepairResult) -> go.Figure:
    """Objective, training and held-out perplexity and the targets' BOS mass over the steps,
    one line per pass (dashed: the control arm's passes). The perplexities are the fine-tuning's
    own evaluation: its first ``eval_seqs`` held-out (and spread training) sequences, fewer than
    the report's perplexities, which use all ``n_eval_seqs``: the panel titles say how many."""
    k = result.passes[0].training.config.eval_seqs if result.passes else None
    n_eval = (result.settings.get("eval_sequences") or [None])[0]
    heldout = f" ({min(k, n_eval)} of the {n_eval} sequences)" if k and n_eval else ""
    panels = [
        ("train_loss", "objective (nats)"),
        ("train_ppl", f"training perplexity ({k} sequences)" if k else "training perplexity"),
        ("heldout_ppl", f"held-out perplexity{heldout}"),
        ("bos_mass", "BOS mass of targets"),
    ]
    fig = plots.Figure(  # the package's figure class: it also shows in saved notebooks
        make_subplots(rows=1, cols=len(panels), subplot_titles=[t for _, t in panels])
    )
    colours = list(plots.OKABE_ITO.values())
    arms = [("pass", p, "solid") for p in result.passes]
    arms += [("control", p, "dash") for p in result.control or []]
    for arm, p, dash in arms:
        history = p.training.history
        colour = colours[(p.index - 1) % len(colours)]
        for col, (column, _) in enumerate(panels, start=1):
            fig.add_trace(
                go.Scatter(
                    x=history["step"],
                    y=history[column],
                    mode="lines+markers",
                    name=f"{arm} {p.index} ({len(p.targeted)} heads)",
                    legendgroup=f"{arm}{p.index}",
                    showlegend=col == 1,
                    line={"color": colour, "dash": dash},
                ),
                row=1,
                col=col,
            )
            fig.update_xaxes(title_text=plots.column_label("step"), row=1, col=col)
    title = f"Masked fine-tuning of {model_info(result.model).name}"
    # The legend in rows under the step axes, the margin grown for them: beside the panels it
    # ran past the page's width. TRAINING_WIDTH fits the page in a 1280-pixel-wide window.
    rows = -(-len(arms) // LEGEND_PER_ROW)
    plots.style(
        fig,
        title=title,
        width=TRAINING_WIDTH,
        height=380 + 26 * rows,
        margin={"l": 60, "r": 20, "t": 100, "b": 80 + 26 * rows},
        template="simple_white",
    )
    legend = {"orientation": "h", "x": 0, "xanchor": "left", "y": 0, "yanchor": "bottom"}
    return fig.update_layout(legend=legend | {"yref": "container"})


def _heads(names: list[str]) -> str:
    return str(HeadSet(_pairs(names))) if names else "none"


def _verdict(report: dict[str, Any], model_dir: bool) -> list[str]:
    """The verdict paragraph of report.md: the verdict, which model is kept, its damage, and
    the targets that failed."""
    limit = report["max_ppl_increase"]
    on_train = report["settings"].get("eval_on_train")
    judged = (
        [
            f"**Judged on the training text**: {on_train[0]} of the {on_train[1]} held-out "
            "sequences are training sequences (allowed: --allow-eval-on-train, or repair()'s "
            "eval_on_train=True), so the held-out perplexity and its damage limit measure "
            "text the repair trained on, not held-out text."
        ]
        if on_train
        else []
    )
    limits = (
        f"Damage limits: held-out perplexity at most "
        f"{'unlimited' if limit is None else f'+{limit:.0%}'} over the model before repair, at "
        f"most {report['max_collateral']} healthy frozen head(s) turning sick."
    )
    failed = report["failed_heads"]
    failures = (
        [
            "Failed heads (targets sick at the end): "
            f"{'; '.join(f'{name} ({why})' for name, why in failed.items())}."
        ]
        if failed
        else []
    )
    best = report["best_pass"]
    if best is None:
        kept = "No pass is acceptable: the report has no repaired model" + (
            "." if not model_dir else " and no `model/` is written."
        )
        return [
            f"**Verdict: {report['verdict']}**: {report['failure_reason']}.",
            kept,
            *judged,
            limits,
            *failures,
        ]
    ppl, change = report["perplexity"], report["perplexity_change"]
    after = {split: report["passes"][best - 1]["perplexity_after"][split] for split in ppl}
    costs = ", ".join(
        f"{name} perplexity {ppl[split][0]:.3f} → {after[split]:.3f} ({change[split]:+.1%})"
        for name, split in (("held-out", "heldout"), ("training", "train"))
    )
    headline = {
        "ok": "no pass damaged the model and every target is healthy.",
        "incomplete": f"no pass damaged the model, but {len(failed)} target(s) are still sick.",
    }.get(report["verdict"], f"{report['failure_reason']}.")
    return [
        f"**Verdict: {report['verdict']}**: {headline}",
        f"Kept model{' (`model/`)' if model_dir else ''}: pass {best}; {costs}; healthy frozen "
        f"heads turned sick: {_heads(report['collateral']['heads'])}.",
        *judged,
        limits,
        *failures,
    ]


def _prune_vs_repair(report: dict[str, Any]) -> list[str]:
    """The summary line and table: the model before repair, pruned instead, repaired, and
    retrained without re-initialisation (the control), with what the comparison tests."""
    comparison = report.get("prune_vs_repair")
    if comparison is None:
        return []
    control = report.get("control")
    rows = [
        ("before repair", comparison["injured"], report["healthy_before"]),
        ("pruned: targets mean-ablated", comparison["pruned_mean"], None),
        ("pruned: targets zero-ablated", comparison["pruned_zero"], None),
        ("repaired (kept model)", comparison["repaired"], report["healthy_after"]),
        (
            "control: retrained without re-initialisation",
            comparison.get("control"),
            None if control is None else control["healthy_after"],
        ),
    ]
    shown = [(name, ppl, healthy) for name, ppl, healthy in rows if ppl is not None]
    summary = ", ".join(f"{name} {ppl['heldout']:.3f}" for name, ppl, _ in shown)
    tests = (
        "Pruning tests whether the targets are needed at all; the control (the same heads "
        "trained with the same data, steps, seed and schedule from their weights as they were) "
        "tests whether re-initialisation is what helped: a control as good as the repair says "
        "retraining the slices alone does it."
        if control is not None
        else "No control arm was run (--no-control): the report cannot say whether "
        "re-initialisation is what helped."
    )
    return [
        "",
        f"Prune versus repair versus control of {_heads(comparison['heads'])} (pass 1's "
        f"targets), held-out perplexity: {summary}. {tests}",
        "",
        "| model | train PPL | held-out PPL | healthy heads |",
        "|---|---|---|---|",
        *(
            f"| {name} | {ppl['train']:.3f} | {ppl['heldout']:.3f} | "
            f"{'' if healthy is None else healthy} |"
            for name, ppl, healthy in shown
        ),
    ]


def _control(report: dict[str, Any]) -> list[str]:
    """The control arm's section: recoveries and labels beside the repair's, its damage, and
    each target's label after the repair and after the control."""
    control = report.get("control")
    if control is None:
        return []
    n = len(control["targeted"])
    change = control["perplexity_change"]
    lines = [
        "## Control: retrained without re-initialisation",
        "",
        f"The kept model's {control['passes']} pass(es) again, from the model as given: the "
        f"same {n} heads, data, steps, seed and schedule, without re-initialising Q/K/V or "
        "zeroing W_O. Only their slices changed.",
        "",
        f"- healthy after: repair {len(control['repair_recovered'])}/{n}, "
        f"{_control_count(control)}; still sick after the control: "
        f"{_heads(control['still_sick'])}",
        f"- labels after the control: "
        f"{', '.join(f'{k} {v}' for k, v in control['labels_after'].items())} (repair: "
        f"{', '.join(f'{k} {v}' for k, v in report['labels_after'].items())})",
        f"- perplexity after the control: training {control['perplexity_after']['train']:.3f} "
        f"({change['train']:+.1%}), held-out {control['perplexity_after']['heldout']:.3f} "
        f"({change['heldout']:+.1%}) against the model before repair",
        f"- frozen heads that drifted: {_heads(control['drift']['heads'])}; healthy frozen "
        f"heads turned sick: {_heads(control['collateral']['heads'])}",
        f"- damage by the repair's limits: {control['failure'] or 'none'} (the control is a "
        "comparison, never the model kept)",
        "",
        "| head | label before | BOS mass | label repaired | BOS mass | label control | "
        "BOS mass | output share control | movable by the control |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {h['name']} | {h['label_before']} | {h['bos_mass_before']:.3f} | "
        f"{h['label_repaired']} | {h['bos_mass_repaired']:.3f} | {h['label_control']} | "
        f"{h['bos_mass_control']:.3f} | {h['output_share_control']:.3f} | "
        f"{'yes' if h['movable'] else _unmovable_cell(h)} |"
        for h in control["heads"]
    ]
    return [*lines, ""]


def _unmovable_cell(head: dict[str, Any]) -> str:
    """Why the control cannot move ``head``, and the rules that caught it."""
    return f"no: {head['why_unmovable']} (caught by: {', '.join(head['caught_by'])})"


def _control_count(control: dict[str, Any]) -> str:
    """The control's healed targets, counted over those it can move, and the others apart."""
    unmovable = control["unmovable"]
    if not unmovable:
        return (
            f"control {len(control['recovered'])}/{len(control['targeted'])} "
            f"({control['recovery_rate']:.1%}; every target movable: no zero value-and-output "
            "slice, no all-zero gradient in a backward pass)"
        )
    movable = len(control["movable"])
    rate = control["movable_recovery_rate"]
    healed = (
        f"control {len(control['movable_recovered'])} of {movable} movable targets healed "
        f"({rate:.1%})"
        if rate is not None
        else "control: no movable target"
    )
    reasons = "; ".join(f"{name}: {why}" for name, why in unmovable.items())
    return (
        f"{healed}; {len(unmovable)} ({_heads(list(unmovable))}) cannot be moved without "
        f"re-initialisation ({reasons})"
    )


def _redistribution(report: dict[str, Any]) -> list[str]:
    """The redistribution section: how the frozen heads' BOS mass and output share moved."""
    moved = report["redistribution"]
    n = len(moved["heads"])
    lines = [
        "## Redistribution over the frozen heads",
        "",
        f"The {n} heads no pass targeted, against the model before repair: mean and largest "
        f"|change| of each metric, the heads moving by more than {report['drift']['threshold']} "
        "(the drift threshold) and the largest movers. Per head: `redistribution.csv`.",
        "",
        "| model | metric | mean abs change | largest abs change | beyond threshold | "
        "largest movers |",
        "|---|---|---|---|---|---|",
    ]
    names = {"repaired": "repaired (kept model)", "control": "control"}
    for arm, metrics in moved["summary"].items():
        for metric, summary in metrics.items():
            movers = ", ".join(f"{k} {v:+.3f}" for k, v in summary["largest"].items())
            lines.append(
                f"| {names[arm]} | {metric} | {summary['mean_abs']:.4f} | "
                f"{summary['max_abs']:.4f} | {summary['beyond']} | {movers or 'none'} |"
            )
    return [*lines, ""]


def _markdown(
    report: dict[str, Any], figures: Sequence[str], formats: Sequence[str], model_dir: bool
) -> str:
    ppl = report["perplexity"]
    lines = [
        f"# Repair of {markdown_text(report['model'])}",
        "",
        *_verdict(report, model_dir),
        "",
        f"Heads targeted: **{len(report['targeted'])}**, recovered (healthy after): "
        f"**{len(report['recovered'])}** ({report['recovery_rate']:.1%}); still sick: "
        f"{_heads(report['still_sick'])}.",
        f"Healthy heads: {report['healthy_before']} → {report['healthy_after']} of "
        f"{report['n_heads']} ({'the kept model' if report['best_pass'] else 'no pass kept'}). "
        "Frozen heads that drifted (|Δ BOS mass| > "
        f"{report['drift']['threshold']}): {report['drift']['count']}.",
        *_prune_vs_repair(report),
        "",
        "| stage | targeted | recovered | rate | still sick | drifted | turned sick | "
        "train PPL | held-out PPL | healthy | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| before | | | | | | | {ppl['train'][0]:.3f} | {ppl['heldout'][0]:.3f} | "
        f"{report['healthy_before']} | |",
    ]
    for p in report["passes"]:
        lines.append(
            f"| pass {p['pass']} | {len(p['targeted'])} | {len(p['recovered'])} | "
            f"{p['recovery_rate']:.1%} | {len(p['still_sick'])} | {p['drift']['count']} | "
            f"{p['collateral']['count']} | {p['perplexity_after']['train']:.3f} | "
            f"{p['perplexity_after']['heldout']:.3f} | {p['healthy_after']} | {p['verdict']} |"
        )
    n_eval, length = (report["settings"].get("eval_sequences") or [None, None])[:2]
    if n_eval:
        lines += [
            "",
            f"Perplexities: train and held-out, each on {n_eval} sequences of {length} tokens "
            "scored whole (the log's \"verdict's windows\"; the training figure's curves and the "
            "log's step lines use the fine-tuning's own check windows, its first `eval_seqs` of "
            "them, so their values differ).",
        ]
    lines += [""]
    for p in report["passes"]:
        training = p["training"]
        lines += [
            f"## Pass {p['pass']}",
            "",
            f"- targeted: {_heads(p['targeted'])}",
            f"- recovered: {_heads(p['recovered'])}",
            f"- still sick: {_heads(p['still_sick'])}",
            f"- drifted frozen heads: {_heads(p['drift']['heads'])}",
            f"- healthy frozen heads turned sick: {_heads(p['collateral']['heads'])}",
            f"- verdict: {p['verdict']}"
            + (
                f" ({p['failure_reason']}; it counts no head recovered)"
                if p["failure_reason"]
                else ""
            ),
            f"- fine-tuning: {training['steps']} steps"
            + (
                f", stopped early (best step {training['best_step']})"
                if training["stopped_early"]
                else ""
            )
            + f", final objective {training['final_loss']:.4f}, final BOS mass of targets "
            f"{training['final_bos_mass']:.3f}",
            "",
            "| head | label before | BOS mass | output share | label after | BOS mass | "
            "output share |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {h['name']} | {h['label_before']} | {h['bos_mass_before']:.3f} | "
            f"{h['output_share_before']:.3f} | {h['label_after']} | {h['bos_mass_after']:.3f} | "
            f"{h['output_share_after']:.3f} |"
            for h in p["heads"]
        ]
        lines += [""]
    lines += [*_control(report), *_redistribution(report)]
    if figures:  # (none on the page, which shows the figures themselves)
        lines += ["## Figures", "", "Every figure is on index.html, interactive.", ""]
    for name in figures:
        links = ", ".join(f"[{fmt}]({name}.{fmt})" for fmt in formats)
        lines.append(f"- {name}" + (f": {links}" if links else ""))
        if "png" in formats:
            lines += ["", f"![{name}]({name}.png)", ""]
    settings = report["settings"]
    lines += ["", "## Settings", "", "```json", json.dumps(settings, indent=2), "```", ""]
    return "\n".join(lines)


def _pairs(names: Sequence[str]) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in re.findall(r"\d+", name)) for name in names]


def write_report(
    result: RepairResult,
    out_dir: str | os.PathLike,
    *,
    formats: Sequence[str] | None = None,
    overwrite: bool = False,
    save_model: bool = True,
) -> Path:
    """Write a repair's report folder atomically; return it.

    Files: ``report.md``, ``report.json`` (:meth:`RepairResult.to_dict` plus versions and time),
    ``census_before.csv`` and ``census_after.csv`` (the classify CLI's ``heads.csv`` columns),
    ``census_pass<N>.csv`` after each earlier pass, ``training_pass<N>.csv`` (evaluation
    history), with a control arm ``census_control.csv`` and ``training_control<N>.csv``,
    ``redistribution.csv`` (:meth:`RepairResult.redistribution`), the figures
    ``labels_before``, ``labels_after``, ``bos_mass_diff`` (whole run),
    ``pass<N>_bos_mass_diff``, ``control_bos_mass_diff`` (with a control arm; the difference
    grids on one colour scale) and ``training`` in each of ``formats``, and ``model/``, the repaired
    model (the best pass that did not damage it) as a Hugging Face checkpoint (unless
    ``save_model=False``, or no pass is acceptable: report.md then says so). ``formats=None`` writes
    the figures as png when a Chromium browser is found (else one warning names the skipped PNGs
    and report.md links only what was written) and no HTML figure: ``index.html`` holds them all
    (``html`` given explicitly writes each, sharing one plotly.js in the folder); static formats
    given explicitly need a browser
    (:func:`headsurgeon.plots.split_formats`), checked before anything is written. A folder
    holding files is refused unless ``overwrite``, and even then unless headsurgeon wrote it.

    ``index.html`` puts it on one offline page: report.md, the grid of BOS-mass changes where
    clicking a head shows its metrics before and after each pass and in the control model, and
    its attention in each stage side by side (``result.patterns``), and every other figure, with
    plotly.js inlined once (its 1.5 MB cartesian bundle).
    """
    written = plots.split_formats(formats)[0]  # unknown format / no browser for one asked: now
    report = json_safe(result.to_dict())
    report["versions"] = package_versions()
    report["created"] = datetime.datetime.now().astimezone().isoformat()
    figures = {
        "labels_before": plots.label_grid(result.census_before, title="Labels before repair"),
        "labels_after": plots.label_grid(result.census_after, title="Labels after repair"),
    }
    # The difference grids, titled, with what they compare.
    title = "BOS mass, after repair − before"
    diffs = {"bos_mass_diff": (title, result.census_before, result.census_after)}
    for p in result.passes:
        title = f"Pass {p.index}: BOS mass, after − before"
        diffs[f"pass{p.index}_bos_mass_diff"] = (title, p.census_before, p.census_after)
    if result.control:
        title = "BOS mass, control (retrained without re-initialisation) − before"
        diffs["control_bos_mass_diff"] = (title, result.census_before, result.control_census)
    # Shown one after the other, they share one symmetric colour scale (the largest change of
    # any): the control arm's small change then looks as small as it is.
    bound = plots.diff_bound([(before, after) for _, before, after in diffs.values()])
    for name, (title, before, after) in diffs.items():
        figures[name] = plots.diff_grid(before, after, "bos_mass", title=title, bound=bound)
    figures["training"] = training_plot(result)
    with atomic_directory(out_dir, overwrite=overwrite, writer="write_report") as tmp:
        atomic_write_text(tmp / "report.json", json.dumps(report, indent=2) + "\n")
        markdown = _markdown(report, list(figures), written, model_dir=save_model)
        atomic_write_text(tmp / "report.md", markdown)
        atomic_write_text(tmp / "census_before.csv", result.census_before.to_csv(index=False))
        atomic_write_text(tmp / "census_after.csv", result.census_after.to_csv(index=False))
        for p in result.passes:
            if p is not result.passes[-1]:
                census_csv = p.census_after.to_csv(index=False)
                atomic_write_text(tmp / f"census_pass{p.index}.csv", census_csv)
            atomic_write_text(
                tmp / f"training_pass{p.index}.csv", p.training.history.to_csv(index=False)
            )
        for p in result.control or []:
            atomic_write_text(
                tmp / f"training_control{p.index}.csv", p.training.history.to_csv(index=False)
            )
        if result.control:
            census_csv = result.control_census.to_csv(index=False)
            atomic_write_text(tmp / "census_control.csv", census_csv)
        moved = result.redistribution()
        atomic_write_text(tmp / "redistribution.csv", moved.to_csv(index=False))
        skipped = plots.save_figures(figures, tmp, formats)
        stages = {"before": result.census_before}
        stages |= {f"pass {p.index}": p.census_after for p in result.passes}
        if result.control:
            stages["control"] = result.control_census
        samples = [result.patterns[stage] for stage in stages if stage in result.patterns]
        write_page(
            tmp,
            title=f"Repair of {report['model']}",
            summary=_markdown(report, [], written, model_dir=save_model),  # figures: below
            summary_format="markdown",
            grid=figures["bos_mass_diff"],
            shape=(
                int(result.census_before["layer"].max()) + 1,
                int(result.census_before["head"].max()) + 1,
            ),
            stages=stages,
            samples=samples if len(samples) == len(stages) else [],
            model=result.model,
            figures={"training": figures["training"]}  # the run's story first
            | {name: fig for name, fig in figures.items() if name != "bos_mass_diff"},
            note=samples_note(samples, report["settings"].get("census_data"), "each stage"),
        )
        if save_model and result.best_pass is not None:  # no acceptable pass: no model
            # The card: report.md's summary (verdict, heads, the table), without its figure links.
            card = markdown.split("\n## ", 1)[0].replace("# Repair of", "## Repair of", 1)
            save_hf(result.model, tmp / "model", dtype=result.settings["save_dtype"], card=card)
    plots.warn_skipped(skipped, out_dir)
    return Path(out_dir)
