"""Reports: the text summaries, tables and figures the command-line tools write.

Exports:
    format_summary(classified)                the classification summary the classify CLI prints
                                              (with an importance section when it has one)
    write_classification(df, out_dir, ...)    heads.csv, heads.json, sweep, summary and figures
                                              (importance columns and figures when present)
    write_cross_scale({model: df}, out_dir)   several models: each one's classification in a
                                              subfolder, the cross-scale table and figures
    write_report(result, out_dir, ...)        a repair's report.md, report.json, censuses,
                                              figures and model/
    training_plot(result)                     objective, perplexities and BOS mass over the steps
    blindness_summary(analytic, measured)     the blindness CLI's text summary
    write_blindness(out_dir, analytic, ...)   the blindness CLI's tables, summary and figures
    PAGE                                      ``index.html``: every writer's one-page report
                                              (summary, clickable head grid, each head's metrics
                                              and attention on the run's own sequences)
    open_page(page, click, screenshot=)       open such a page in headless Chromium, click a
                                              head, report console errors (PageView)
    default_out_dir(model, suffix)            ``<model>-<suffix>[-N]`` in the working directory
    model_folder_name(model)                  a model's name as a folder name
    partial_dir(out)                          ``<out>.partial``, where an unfinished repair lives
    IMPORTANCE_NAMES                          head_importance's columns as classified tables
                                              name them (``method`` -> ``importance_method``)

Every writer fills a new folder atomically (:func:`headsurgeon.outputs.atomic_directory`),
marked as headsurgeon's (``.headsurgeon-output.json``: ``overwrite`` replaces only such a folder)
and takes ``formats`` by one rule (:func:`headsurgeon.plots.split_formats`). The library modules
(:mod:`headsurgeon.classify`, :mod:`headsurgeon.repair`, :mod:`headsurgeon.blindness`) compute;
this module turns their results into files, and is the one place besides
:mod:`headsurgeon.plots` that imports plotly.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime
import html
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots
from torch import Tensor

from headsurgeon import alibi, plots
from headsurgeon.backend import Model
from headsurgeon.census import COLUMNS
from headsurgeon.checkpoints import save_hf
from headsurgeon.classify import (
    LABELS,
    NEAR,
    label_heads,
    require_columns,
    sick_shares,
    threshold_sweep,
    thresholds_of,
)
from headsurgeon.data import describe, to_sequences, token_strings
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.exact_alibi import alibi_slopes
from headsurgeon.importance import COLUMNS as IMPORTANCE_COLUMNS, DORMANT_SE, is_dormant
from headsurgeon.loading import model_info
from headsurgeon.outputs import atomic_directory, atomic_write_bytes, atomic_write_text
from headsurgeon.probes import PatternSample, sample_patterns
from headsurgeon.surgery import HeadSet

if TYPE_CHECKING:
    from headsurgeon.blindness import BlindnessMeasurement
    from headsurgeon.repair import RepairResult

__all__ = [
    "IMPORTANCE_NAMES",
    "PAGE",
    "PageView",
    "open_page",
    "blindness_summary",
    "default_out_dir",
    "model_folder_name",
    "format_summary",
    "partial_dir",
    "training_plot",
    "write_blindness",
    "write_classification",
    "write_cross_scale",
    "write_report",
]

# Recorded in heads.json and report.json.
VERSIONED = ("headsurgeon", "torch", "transformer-lens", "transformers", "plotly")


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    result = {}
    for package in VERSIONED:
        try:
            result[package] = version(package)
        except PackageNotFoundError:
            result[package] = "not installed"
    return result


def _json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities as ``None`` and numpy scalars as Python ones, in depth.

    >>> _json_safe({"a": [1.0, float("nan")], "b": np.int64(3)})
    {'a': [1.0, None], 'b': 3}
    """
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, np.generic):
        return _json_safe(value.item())
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def partial_dir(out: str | os.PathLike) -> Path:
    """Where the repair CLI keeps an unfinished run of ``out``: ``<out>.partial`` beside it."""
    out = Path(out)
    return out.with_name(out.name + ".partial")


def model_folder_name(model: str | os.PathLike) -> str:
    """A model's name as a folder name (``bigscience/bloom-560m`` -> ``bloom-560m``)."""
    name = Path(str(model).rstrip("/\\")).name or str(model)
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)


def default_out_dir(model: str | os.PathLike, suffix: str) -> Path:
    """A new folder in the working directory named after the model (``<name>-<suffix>[-N]``).

    A name is taken when the folder exists or an unfinished run of it (:func:`partial_dir`) does.
    """
    name = model_folder_name(model)
    candidate, n = Path(f"{name}-{suffix}"), 2
    while any(os.path.lexists(p) for p in (candidate, partial_dir(candidate))):  # dangling too
        candidate, n = Path(f"{name}-{suffix}-{n}"), n + 1
    return candidate


# --- classification ---------------------------------------------------------------------------


def format_summary(classified: pd.DataFrame, *, top: int = 10) -> str:
    """The compact text summary: counts per label, sensitivity, a per-layer table, top sinks.

    A table with :func:`headsurgeon.head_importance` columns (``delta_loss``, ``delta_loss_se``,
    merged on ``layer`` and ``head``) adds an importance section: per label, how many heads are
    dormant (``|delta_loss| <= 2 SE``: removing them changes nothing measurable) and how many
    work, the working sick heads, and the ``top`` heads by ``delta_loss``.
    """
    require_columns(
        classified,
        ["layer", "head", "bos_mass", "bos_mass_std", "entropy", "output_share", "label"],
    )
    t = thresholds_of(classified)
    attrs = classified.attrs
    counts = classified["label"].value_counts()
    lines = []
    if attrs:
        position0 = "BOS token" if attrs.get("prepend_bos") else "first text token"
        lines.append(
            f"{attrs.get('model', 'model')}: {attrs.get('n_layers')} layers x "
            f"{attrs.get('n_heads')} heads, {attrs.get('n_seqs')} sequences x "
            f"{attrs.get('seq_len')} tokens, position 0 = {position0}, query rows t >= "
            f"{attrs.get('min_query_pos')}"
        )
    total = len(classified)
    lines.append(
        "labels: "
        + ", ".join(f"{label} {counts.get(label, 0)}" for label in LABELS)
        + f"  (sick {total - counts.get('healthy', 0)}/{total} = "
        f"{(total - counts.get('healthy', 0)) / max(total, 1):.1%})"
    )
    lines.append(
        f"rule: dead if BOS mass > {t.dead:g} or output share < {t.min_output_share:g}; "
        f"BOS-sink if BOS mass > {t.sink:g}"
    )
    bos, share = classified["bos_mass"].to_numpy(), classified["output_share"].to_numpy()
    low, high = max(t.sink - NEAR, 0.0), min(t.sink + NEAR, t.dead - 1e-9)
    most, fewest = (
        int(np.sum(label_heads(bos, share, dataclasses.replace(t, sink=s)) != "healthy"))
        for s in (low, high)
    )
    near = int(np.sum(np.abs(bos - t.sink) <= NEAR))
    lines.append(
        f"sensitivity: {near} head(s) have BOS mass within {NEAR} of the sink threshold; "
        f"sick count {fewest}-{most} for sink thresholds {low:.2f}-{high:.2f}"
    )
    per_layer = pd.crosstab(classified["layer"], classified["label"])
    per_layer = per_layer.reindex(columns=list(LABELS), fill_value=0).join(
        classified.groupby("layer").agg(
            bos_mean=("bos_mass", "mean"), bos_max=("bos_mass", "max"), entropy=("entropy", "mean")
        )
    )
    per_layer.columns.name = None
    lines += ["", "per layer:", per_layer.to_string(float_format="{:.3f}".format)]
    strongest = classified.nlargest(top, "bos_mass")
    shown = ["layer", "head", "slope", "bos_mass", "bos_mass_std", "entropy", "output_share"]
    shown = [c for c in shown if c in classified.columns] + ["label"]
    lines += [
        "",
        f"strongest sinks (top {len(strongest)} by BOS mass):",
        strongest[shown].to_string(index=False, float_format="{:.4f}".format),
    ]
    if _has_importance(classified):
        lines += ["", *_importance_lines(classified, top)]
    return "\n".join(lines)


def _has_importance(df: pd.DataFrame) -> bool:
    """Whether a classified table carries :func:`headsurgeon.head_importance` columns."""
    return {"delta_loss", "delta_loss_se"} <= set(df.columns)


def _importance_setting(df: pd.DataFrame, name: str) -> Any:
    """``importance_<name>`` from the attrs, else from the column of that name, else None."""
    key = f"importance_{name}"
    if key in df.attrs:
        return df.attrs[key]
    return df[key].iloc[0] if key in df.columns and len(df) else None


def _importance_how(df: pd.DataFrame) -> str:
    """How delta_loss was found, for the summary: ``mean ablation``, ``attribution estimate of
    mean ablation``, or ``""`` when the table does not record it."""
    method, ablation = _importance_setting(df, "method"), _importance_setting(df, "ablation")
    if method == "attribution":
        return f"attribution estimate of {ablation} ablation"
    return "" if method is None else f"{method} ablation"


def _importance_lines(classified: pd.DataFrame, top: int) -> list[str]:
    """The summary's importance section: dormant and working heads per label, the working sick
    heads and the most important heads."""
    how = _importance_how(classified)
    clean = ""
    if "clean_loss" in classified.columns and len(classified):
        clean = f"; clean loss {float(classified['clean_loss'].iloc[0]):.4f} nats"
    dormant = is_dormant(classified["delta_loss"], classified["delta_loss_se"])
    labels = classified["label"]
    split = ", ".join(
        f"{label} {int((rows & dormant).sum())}/{int((rows & ~dormant).sum())}"
        for label, rows in ((label, labels == label) for label in LABELS)
    )
    working = classified[(labels != "healthy") & ~dormant]
    working = working.loc[working["delta_loss"].abs().sort_values(ascending=False).index]
    names = [
        f"L{r.layer}H{r.head} ({r.label}) {r.delta_loss:+.4g} ± {r.delta_loss_se:.2g}"
        for r in working.head(top).itertuples()
    ]
    more = f", ... ({len(working) - top} more)" if len(working) > top else ""
    important = classified.nlargest(top, "delta_loss")
    shown = ["layer", "head", "bos_mass", "output_share", "delta_loss", "delta_loss_se", "label"]
    return [
        f"importance{f' ({how})' if how else ''}: delta_loss = rise of the loss (nats) when a "
        f"head's output is replaced{clean}",
        f"dormant (|delta_loss| <= {DORMANT_SE:g} SE) / working: {split}",
        f"working sick heads: {', '.join(names) or 'none'}{more}",
        "",
        f"most important heads (top {len(important)} by delta_loss):",
        important[shown].to_string(
            index=False,
            float_format="{:.4f}".format,
            formatters={"delta_loss": "{:.4g}".format, "delta_loss_se": "{:.2g}".format},
        ),
    ]


FIGURES = {
    "bos_mass": lambda df: plots.head_grid(df, "bos_mass"),
    "labels": plots.label_grid,
    "entropy": lambda df: plots.head_grid(df, "entropy"),
    "output_share": lambda df: plots.head_grid(df, "output_share"),
}
# head_importance's columns as a classified table names them (method alone would be ambiguous).
IMPORTANCE_NAMES = {
    "delta_loss": "delta_loss",
    "delta_loss_se": "delta_loss_se",
    "clean_loss": "clean_loss",
    "method": "importance_method",
    "ablation": "importance_ablation",
}
# Added when the table carries importance columns (_has_importance).
IMPORTANCE_FIGURES = {
    "importance": plots.importance_grid,
    "bos_vs_importance": plots.bos_vs_importance,
}


def write_classification(
    classified: pd.DataFrame,
    out_dir: str | os.PathLike,
    *,
    sweep: pd.DataFrame | None = None,
    metadata: dict[str, Any] | None = None,
    formats: Sequence[str] | None = None,
    overwrite: bool = False,
    model: Model | None = None,
    tokens: Tensor | None = None,
) -> Path:
    """Write a classification to a new folder, atomically; return the folder.

    Files: ``heads.csv`` (one row per head), ``heads.json`` (``metadata``: the census and
    classification ``attrs``, ``metadata``, versions and time; ``columns``: what each column
    means; ``heads``: the rows), ``summary.txt``, ``threshold_sweep.csv`` and the figures
    ``bos_mass``, ``labels``, ``entropy``, ``output_share`` and ``threshold_sweep`` in each of
    ``formats`` (html, png, svg, pdf; none for ``formats=()``). A table carrying importance
    columns (``delta_loss``, ``delta_loss_se``, ``clean_loss``, ``importance_method``,
    ``importance_ablation``: :func:`headsurgeon.head_importance` merged on ``layer`` and ``head``)
    keeps them in both tables, describes them in ``columns`` and adds the figures
    ``importance`` (:func:`headsurgeon.plots.importance_grid`) and ``bos_vs_importance``
    (:func:`headsurgeon.plots.bos_vs_importance`). The HTML figures share one
    ``plotly.min.js`` in the folder and work offline. ``formats=None`` writes html, and png when
    a Chromium browser is found (else one warning names the skipped PNGs); static formats given
    explicitly need a browser (:func:`headsurgeon.plots.split_formats`), checked before anything
    is written. A folder holding files is refused unless ``overwrite``, and even then unless
    headsurgeon wrote it (:func:`headsurgeon.outputs.check_output_dir`).

    ``index.html`` puts it on one offline page: the summary, the BOS-mass grid where clicking a
    head shows its metrics (importance included) and, given the ``model``, its attention on the
    first positions of the first sequences of ``tokens`` (the census's; default: the bundled
    held-out text), and the other figures.
    """
    needed = ["layer", "head", "bos_mass", "bos_mass_std", "entropy", "output_share"]
    require_columns(classified, [*needed, "label", "reason"])
    plots.split_formats(formats)  # an unknown format, or no browser for one asked for: fail now
    sweep = threshold_sweep(classified, thresholds_of(classified)) if sweep is None else sweep
    info = dict(classified.attrs) | (metadata or {})
    info |= {"versions": _versions(), "created": datetime.datetime.now().astimezone().isoformat()}
    records = [
        {k: _json_safe(v) for k, v in row.items()} for row in classified.to_dict(orient="records")
    ]
    columns = COLUMNS | {
        "label": f"one of {', '.join(LABELS)} (see reason)",
        "reason": "why the head got its label",
    }
    makers = dict(FIGURES)
    if _has_importance(classified):
        columns |= _importance_columns(classified)
        makers |= IMPORTANCE_FIGURES
    document = {"metadata": info, "columns": columns, "heads": records}
    summary = format_summary(classified)
    figures = {name: make(classified) for name, make in makers.items()}
    figures["threshold_sweep"] = plots.sweep_plot(sweep)
    samples = _census_samples(model, tokens)
    with atomic_directory(out_dir, overwrite=overwrite, writer="write_classification") as tmp:
        atomic_write_text(tmp / "heads.csv", classified.to_csv(index=False))
        atomic_write_text(tmp / "heads.json", json.dumps(document, indent=2, default=str) + "\n")
        atomic_write_text(tmp / "threshold_sweep.csv", sweep.to_csv(index=False))
        atomic_write_text(tmp / "summary.txt", summary + "\n")
        skipped = plots.save_figures(figures, tmp, formats)
        _write_page(
            tmp,
            title=f"Heads of {info.get('model', 'the model')}",
            summary=summary,
            grid=figures["bos_mass"],
            shape=(int(classified["layer"].max()) + 1, int(classified["head"].max()) + 1),
            stages={"census": classified},
            samples=samples,
            model=model,
            figures={name: fig for name, fig in figures.items() if name not in FIGURES},
            note=_samples_note(samples, info.get("data")),
        )
    plots.warn_skipped(skipped, out_dir)
    return Path(out_dir)


def write_cross_scale(
    classified: Mapping[str, pd.DataFrame],
    out_dir: str | os.PathLike,
    *,
    formats: Sequence[str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write several models' classifications and their comparison to a new folder, atomically.

    ``<model>/`` per model (:func:`write_classification`'s files), ``cross_scale.csv``
    (:func:`headsurgeon.classify.sick_shares`: label counts and sick share per model and layer
    band), ``summary.txt`` (that table as text) and the figures ``sick_share``
    (:func:`headsurgeon.plots.sick_share_plot`) and ``bos_mass`` (the models' BOS-mass grids
    side by side, :func:`headsurgeon.plots.models_grid`).
    """
    folders = {model_folder_name(name): name for name in classified}
    if len(folders) < len(classified):
        raise InvalidArgumentError(
            f"two models share a folder name among {', '.join(map(str, classified))}; "
            "give them distinct names"
        )
    plots.split_formats(formats)  # checked before anything is written
    shares = sick_shares(classified)
    figures = {
        "sick_share": plots.sick_share_plot(shares),
        "bos_mass": plots.models_grid(dict(classified), "bos_mass"),
    }
    table = shares[shares["band"] == "all"].drop(columns=["band", "layers"])
    with atomic_directory(out_dir, overwrite=overwrite, writer="write_cross_scale") as tmp:
        for folder, name in folders.items():
            write_classification(classified[name], tmp / folder, formats=formats)
        atomic_write_text(tmp / "cross_scale.csv", shares.to_csv(index=False))
        text = "Sick heads (BOS-sink + dead) per model:\n" + table.to_string(index=False)
        text += "\n\nBy layer band:\n" + shares.to_string(index=False)
        atomic_write_text(tmp / "summary.txt", text + "\n")
        skipped = plots.save_figures(figures, tmp, formats)
    plots.warn_skipped(skipped, out_dir)
    return Path(out_dir)


def _importance_columns(classified: pd.DataFrame) -> dict[str, str]:
    """What each importance column of ``classified`` means."""
    return {
        ours: IMPORTANCE_COLUMNS[theirs]
        for theirs, ours in IMPORTANCE_NAMES.items()
        if ours in classified.columns
    }


# --- repair -------------------------------------------------------------------------------------


def training_plot(result: RepairResult) -> go.Figure:
    """Objective, training and held-out perplexity and the targets' BOS mass over the steps,
    one line per pass."""
    panels = [
        ("train_loss", "objective"),
        ("train_ppl", "training perplexity"),
        ("heldout_ppl", "held-out perplexity"),
        ("bos_mass", "BOS mass of targets"),
    ]
    fig = plots.Figure(  # the package's figure class: it also shows in saved notebooks
        make_subplots(rows=1, cols=len(panels), subplot_titles=[t for _, t in panels])
    )
    colours = list(plots.OKABE_ITO.values())
    for p in result.passes:
        history = p.training.history
        colour = colours[(p.index - 1) % len(colours)]
        for col, (column, _) in enumerate(panels, start=1):
            fig.add_trace(
                go.Scatter(
                    x=history["step"],
                    y=history[column],
                    mode="lines+markers",
                    name=f"pass {p.index} ({len(p.targeted)} heads)",
                    legendgroup=f"pass{p.index}",
                    showlegend=col == 1,
                    line={"color": colour},
                ),
                row=1,
                col=col,
            )
            fig.update_xaxes(title_text="step", row=1, col=col)
    title = f"Masked fine-tuning of {model_info(result.model).name}"
    return plots.style(fig, title=title, width=1400, height=380, template="simple_white")


def _heads(names: list[str]) -> str:
    return str(HeadSet(_pairs(names))) if names else "none"


def _verdict(report: dict[str, Any], model_dir: bool) -> list[str]:
    """The verdict paragraph of report.md: the verdict, which model is kept, its damage, and
    the targets that failed."""
    limit = report["max_ppl_increase"]
    limits = (
        f"Damage limits: held-out perplexity at most "
        f"{'unlimited' if limit is None else f'+{limit:.0%}'} over the model before repair, at "
        f"most {report['max_collateral']} healthy frozen head(s) turning sick."
    )
    failed = report["failed_heads"]
    failures = (
        ["Failed heads (targets sick at the end): "
         f"{'; '.join(f'{name} ({why})' for name, why in failed.items())}."]
        if failed else []
    )  # fmt: skip
    best = report["best_pass"]
    if best is None:
        kept = "No pass is acceptable: the report has no repaired model" + (
            "." if not model_dir else " and no `model/` is written."
        )
        return [f"**Verdict: {report['verdict']}**: {report['failure_reason']}.", kept, limits,
                *failures]  # fmt: skip
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
        limits,
        *failures,
    ]


def _prune_vs_repair(report: dict[str, Any]) -> list[str]:
    """The summary line and table: the model before repair, pruned instead, and repaired."""
    comparison = report.get("prune_vs_repair")
    if comparison is None:
        return []
    rows = [("before repair", comparison["injured"]),
            ("pruned: targets mean-ablated", comparison["pruned_mean"]),
            ("pruned: targets zero-ablated", comparison["pruned_zero"]),
            ("repaired (kept model)", comparison["repaired"])]  # fmt: skip
    shown = [(name, ppl) for name, ppl in rows if ppl is not None]
    summary = ", ".join(f"{name} {ppl['heldout']:.3f}" for name, ppl in shown)
    return [
        "",
        f"Prune versus repair of {_heads(comparison['heads'])} (pass 1's targets), held-out "
        f"perplexity: {summary}.",
        "",
        "| model | train PPL | held-out PPL |",
        "|---|---|---|",
        *(f"| {name} | {ppl['train']:.3f} | {ppl['heldout']:.3f} |" for name, ppl in shown),
    ]


def _markdown(
    report: dict[str, Any], figures: Sequence[str], formats: Sequence[str], model_dir: bool
) -> str:
    ppl = report["perplexity"]
    lines = [
        f"# Repair of {report['model']}",
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
            + (f" ({p['failure_reason']}; it counts no head recovered)" if p["failure_reason"]
               else ""),
            f"- fine-tuning: {training['steps']} steps"
            + (f", stopped early (best step {training['best_step']})"
               if training["stopped_early"] else "")
            + f", final objective {training['final_loss']:.4f}, final BOS mass of targets "
            f"{training['final_bos_mass']:.3f}",
            "",
            "| head | label before | BOS mass | output share | label after | BOS mass | "
            "output share |",
            "|---|---|---|---|---|---|---|",
        ]  # fmt: skip
        lines += [
            f"| {h['name']} | {h['label_before']} | {h['bos_mass_before']:.3f} | "
            f"{h['output_share_before']:.3f} | {h['label_after']} | {h['bos_mass_after']:.3f} | "
            f"{h['output_share_after']:.3f} |"
            for h in p["heads"]
        ]
        lines += [""]
    lines += ["## Figures", ""]
    for name in figures:
        links = ", ".join(f"[{fmt}]({name}.{fmt})" for fmt in formats)
        lines.append(f"- {name}: {links}")
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
    history), the figures ``labels_before``, ``labels_after``, ``bos_mass_diff`` (whole run),
    ``pass<N>_bos_mass_diff`` and ``training`` in each of ``formats``, and ``model/``, the repaired
    model (the best pass that did not damage it) as a Hugging Face checkpoint (unless
    ``save_model=False``, or no pass is acceptable: report.md then says so). ``formats=None`` writes
    html, and png when a Chromium browser is found (else one warning names the skipped PNGs and
    report.md links only what was written); static formats given explicitly need a browser
    (:func:`headsurgeon.plots.split_formats`), checked before anything is written. A folder
    holding files is refused unless ``overwrite``, and even then unless headsurgeon wrote it.

    ``index.html`` puts it on one offline page: report.md, the grid of BOS-mass changes where
    clicking a head shows its metrics before and after each pass and its attention in each
    stage side by side (``result.patterns``), the training and label figures.
    """
    written = plots.split_formats(formats)[0]  # unknown format / no browser for one asked: now
    report = _json_safe(result.to_dict())
    report["versions"] = _versions()
    report["created"] = datetime.datetime.now().astimezone().isoformat()
    figures = {
        "labels_before": plots.label_grid(result.census_before, title="Labels before repair"),
        "labels_after": plots.label_grid(result.census_after, title="Labels after repair"),
        "bos_mass_diff": plots.diff_grid(
            result.census_before, result.census_after, "bos_mass",
            title="BOS mass, after repair − before",
        ),
    }  # fmt: skip
    for p in result.passes:
        figures[f"pass{p.index}_bos_mass_diff"] = plots.diff_grid(
            p.census_before, p.census_after, "bos_mass",
            title=f"Pass {p.index}: BOS mass, after − before",
        )  # fmt: skip
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
        skipped = plots.save_figures(figures, tmp, formats)
        stages = {"before": result.census_before}
        stages |= {f"pass {p.index}": p.census_after for p in result.passes}
        samples = [result.patterns[stage] for stage in stages if stage in result.patterns]
        _write_page(
            tmp,
            title=f"Repair of {report['model']}",
            summary=markdown,
            grid=figures["bos_mass_diff"],
            shape=(int(result.census_before["layer"].max()) + 1,
                   int(result.census_before["head"].max()) + 1),
            stages=stages,
            samples=samples if len(samples) == len(stages) else [],
            model=result.model,
            figures={name: figures[name] for name in ("training", "labels_before", "labels_after")},
            note=_samples_note(samples, report["settings"].get("census_data"), "each stage"),
        )  # fmt: skip
        if save_model and result.best_pass is not None:  # no acceptable pass: no model
            save_hf(result.model, tmp / "model", dtype=result.settings["save_dtype"])
    plots.warn_skipped(skipped, out_dir)
    return Path(out_dir)


# --- blindness ---------------------------------------------------------------------------------


def blindness_summary(analytic: pd.DataFrame | None, measured: BlindnessMeasurement | None) -> str:
    """The blindness CLI's summary: blind distances of the steepest heads, measured shares."""
    lines = []
    if analytic is not None:
        context_length = analytic.attrs["context_length"]
        lines.append(
            f"{analytic.attrs['model']}: blind distance (tokens) of the steepest heads, "
            f"{analytic.attrs['bias']} ALiBi; share of a {context_length}-token context blind"
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
    if measured is not None:
        lines.append(
            f"measured ({measured.convention} convention, {measured.n_seqs} × {measured.seq_len} "
            "tokens): share of attention entries that underflow to exactly 0"
        )
        for dtype, rows in measured.by_length.groupby("dtype", sort=False):
            shares = ", ".join(
                f"{n}: {s:.2%}" for n, s in zip(rows["context_length"], rows["share"], strict=True)
            )
            lines.append(f"  {dtype:9s} {shares}")
    return "\n".join(lines)


def write_blindness(
    out_dir: str | os.PathLike,
    analytic: pd.DataFrame | None,
    measured: BlindnessMeasurement | None,
    *,
    formats: Sequence[str] | None = None,
    overwrite: bool = False,
    model: Model | None = None,
    tokens: Tensor | None = None,
) -> Path:
    """Write a blindness analysis to a new folder, atomically; return the folder.

    Files: ``blindness.csv`` (``analytic``), ``measured_by_head.csv``, ``measured_by_distance.csv``
    and ``measured_by_length.csv`` (``measured``), ``summary.txt`` (:func:`blindness_summary`)
    and the figures ``blind_distance``, ``zero_fraction`` and ``analytic_vs_measured`` (those the
    results allow), each HTML self-contained. A folder holding files is refused unless
    ``overwrite``, and even then unless headsurgeon wrote it.

    ``index.html`` puts it on one offline page: the summary, a grid of blind distances where
    clicking a head shows its distances per dtype, its measured share of exact zeros by distance
    against them and, given the ``model``, its attention on the first measured sequence of
    ``tokens`` (max-pooled to 64 cells a side), with the blind distance drawn in.
    """
    summary = blindness_summary(analytic, measured)
    figures = {}
    if analytic is not None:
        figures["blind_distance"] = plots.blind_distance_grid(analytic)
    if measured is not None:
        figures["zero_fraction"] = plots.zero_fraction_plot(measured.by_distance)
        if analytic is not None:
            figures["analytic_vs_measured"] = plots.analytic_vs_measured(measured.by_head)
    with atomic_directory(out_dir, overwrite=overwrite, writer="write_blindness") as tmp:
        if analytic is not None:
            atomic_write_text(tmp / "blindness.csv", analytic.to_csv(index=False))
        if measured is not None:
            for table in ("by_head", "by_distance", "by_length"):
                frame = getattr(measured, table)
                atomic_write_text(tmp / f"measured_{table}.csv", frame.to_csv(index=False))
        atomic_write_text(tmp / "summary.txt", summary + "\n")
        skipped = plots.save_figures(figures, tmp, formats, include_plotlyjs=True)
        if analytic is not None or measured is not None:
            _write_blindness_page(tmp, summary, analytic, measured, figures, model, tokens)
    plots.warn_skipped(skipped, out_dir)
    return Path(out_dir)


# --- the report page: index.html ------------------------------------------------------------------

PAGE = "index.html"
# Each head's attention on the page: the first positions of a few of the run's own sequences,
# stored as float16 (3 significant digits) lower triangles: 384 heads x 2 x 48 positions ~2.4 MB.
PAGE_SEQS = 2
PAGE_POSITIONS = 48
# A long sequence (blindness) is max-pooled to this many cells a side on the page.
PAGE_CELLS = 64
PAGE_SKIP = ("layer", "head")
# The page: markup, style and the small script that draws the grid, a head and its patterns.
PAGE_TEMPLATE = Path(__file__).parents[1] / "templates" / "index.html"


def _packed(weights: np.ndarray) -> str:
    """The lower triangle (diagonal included) of a ``[n, n]`` matrix, row by row, as base64 of
    little-endian float16: what the page's ``unpack`` reads."""
    rows, cols = np.tril_indices(weights.shape[-1])
    return base64.b64encode(weights[rows, cols].astype("<f2").tobytes()).decode("ascii")


def _page_patterns(
    model: Model | None, samples: Sequence[PatternSample]
) -> tuple[list[dict[str, Any]], list[list[list[str]]]]:
    """The page's sequences (tokens as text, cell size) and, per stage and sequence, every head's
    packed weights (layer-major)."""
    if not samples:
        return [], []
    first = samples[0]
    sequences = [
        {
            "label": f"sequence {i + 1}: positions 0-{w.n_pos - 1}",
            "tokens": token_strings(model, tokens) if model is not None else [],
            "step": w.step,
            "n_pos": w.n_pos,
        }
        for i, (tokens, w) in enumerate(zip(first.tokens, first.weights, strict=True))
    ]
    packed = [[[_packed(m) for m in w.weights] for w in sample.weights] for sample in samples]
    return sequences, packed


def _metrics(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Per head (layer-major), its row of ``df`` as ``{column: value}`` (numbers rounded)."""
    rows = df.sort_values(["layer", "head"]).to_dict(orient="records")
    return [
        {
            k: (float(f"{v:.5g}") if isinstance(v, float) and math.isfinite(v) else _json_safe(v))
            for k, v in row.items()
            if k not in PAGE_SKIP
        }
        for row in rows
    ]


def _blind(model: Model | None, n_layers: int, n_heads: int) -> list[float | None]:
    """Each head's distance from which its weights are exactly 0 (float32; None: never or no
    ALiBi), for the dashed line of the page's patterns."""
    if model is None or model.cfg.positional_embedding_type != "alibi":
        return [None] * (n_layers * n_heads)
    slopes = alibi_slopes(model).tolist()
    distances = [alibi.blind_distance(m, model.cfg.dtype, "zero") for m in slopes]
    return [_json_safe(float(distances[h])) for _ in range(n_layers) for h in range(n_heads)]


def _figure_data(fig: go.Figure) -> dict[str, Any]:
    return json.loads(fig.to_json())


def _write_page(
    folder: Path,
    *,
    title: str,
    summary: str,
    grid: go.Figure,
    shape: tuple[int, int],
    stages: dict[str, pd.DataFrame],
    samples: Sequence[PatternSample] = (),
    model: Model | None = None,
    figures: dict[str, go.Figure] | None = None,
    curves: dict[str, Any] | None = None,
    note: str = "",
) -> None:
    """Write ``folder/index.html``: one offline page (plotly.js inlined once) with the run's
    summary, ``grid`` (click a head), and per head its metrics in each of ``stages`` (name ->
    one row per head), its attention in each stage of ``samples`` (same order) and its
    ``curves``; ``figures`` below, and links to the folder's other files."""
    n_layers, n_heads = shape
    sequences, packed = _page_patterns(model, samples)
    names = [f"L{layer}H{head}" for layer in range(n_layers) for head in range(n_heads)]
    metrics = {stage: _metrics(df) for stage, df in stages.items()}
    data = {
        "title": title,
        "summary": summary,
        "note": note,
        "grid": _figure_data(grid),
        "n_heads": n_heads,
        "names": names,
        "stages": list(stages),
        "metrics": metrics,
        "blind": _blind(model, n_layers, n_heads),
        "sequences": sequences,
        "patterns": packed,
        "curves": curves or {},
        "figures": [
            {"name": name, "figure": _figure_data(fig)} for name, fig in (figures or {}).items()
        ],
        "files": sorted(
            p.name
            for p in folder.iterdir()
            if p.name != PAGE and p.is_file() and not p.name.startswith(".")
        ),  # fmt: skip
    }
    from plotly.offline import get_plotlyjs

    payload = json.dumps(_json_safe(data), separators=(",", ":")).replace("</", "<\\/")
    page = (
        PAGE_TEMPLATE.read_text(encoding="utf-8")
        .replace("{{title}}", html.escape(title))
        .replace("{{plotly}}", get_plotlyjs())
        .replace("{{data}}", payload)
    )
    atomic_write_text(folder / PAGE, page)


def _census_samples(model: Model | None, tokens: Tensor | None) -> list[PatternSample]:
    """Every head's attention on the page's share of ``tokens`` (default: the bundled held-out
    text, cut as the census cuts it); none without a model."""
    if model is None:
        return []
    if tokens is None:
        tokens = to_sequences(model, None, seq_len=PAGE_POSITIONS, n_seqs=PAGE_SEQS)
    return [sample_patterns(model, tokens, n_seqs=PAGE_SEQS, n_pos=PAGE_POSITIONS)]


def _samples_note(samples: Sequence[PatternSample], data: object, where: str = "") -> str:
    """The page's line saying what its attention patterns show."""
    if not samples:
        return "No model was given to the writer: the page shows metrics, not attention patterns."
    weights = samples[0].weights[0]
    shown = (f"the first {weights.n_pos} positions of the first {len(samples[0].weights)}"
             if weights.step == 1 else f"{weights.n_pos} positions (max-pooled: each cell the "
             f"largest weight of {weights.step} x {weights.step}) of the first")  # fmt: skip
    return (
        f"Attention{f' in {where}' if where else ''}: {shown} of the run's sequences "
        f"({data or describe(None)}), from hook_pattern as the census reads it; weights rounded "
        "to float16 (3 significant digits: headsurgeon.plots.attention_pattern gives them "
        "exactly). Red box: position 0; dashed line: the blind distance (weights exactly 0 "
        "to its left)."
    )


def _blindness_table(
    analytic: pd.DataFrame | None, measured: BlindnessMeasurement | None
) -> pd.DataFrame:
    """One row per head: blind distance per dtype and limit, measured first zero and share of
    zeros per dtype."""
    keys = ["layer", "head"]
    parts = []
    if analytic is not None:
        wide = analytic.pivot_table(index=keys, columns=["dtype", "limit"],
                                    values="blind_distance", sort=False)  # fmt: skip
        wide.columns = [f"blind distance {d} {limit}" for d, limit in wide.columns]
        parts.append(wide)
        parts.append(analytic.groupby(keys)[["slope"]].first())
    if measured is not None:
        by_head = measured.by_head
        for column, name in (("first_zero_distance", "first zero"), ("zero_fraction", "zeros")):
            wide = by_head.pivot_table(index=keys, columns="dtype", values=column, sort=False,
                                       dropna=False)  # fmt: skip
            wide.columns = [f"measured {name} {d}" for d in wide.columns]
            parts.append(wide)
        if analytic is None:
            parts.append(by_head.groupby(keys)[["slope"]].first())
    table = pd.concat(parts, axis=1).reset_index()
    return table.loc[:, ~table.columns.duplicated()]


def _zero_curves(measured: BlindnessMeasurement, table: pd.DataFrame) -> dict[str, Any]:
    """Per head name, the measured share of exact zeros by distance (one line per dtype) and
    the analytic blind distances (zero limit) as vertical lines, for the page."""
    colours = dict(zip(plots.DTYPE_MARKERS, (c for _, c in plots.DTYPE_MARKERS.values()),
                       strict=True))  # fmt: skip
    curves: dict[str, Any] = {}
    rows = measured.by_distance
    for (layer, head), sub in rows.groupby(["layer", "head"], sort=True):
        traces, shapes = [], []
        for dtype, part in sub.groupby("dtype", sort=False):
            middle = (part["distance_lo"] + part["distance_hi"] - 1) / 2
            colour = colours.get(dtype, "#000000")
            share = part["zero_fraction"].round(4).tolist()
            traces.append({"x": middle.round(1).tolist(), "y": share, "mode": "lines",
                           "name": dtype, "line": {"color": colour}})  # fmt: skip
            column = f"blind distance {dtype} zero"
            row = table[(table["layer"] == layer) & (table["head"] == head)]
            if column in row and math.isfinite(float(row[column].iloc[0])):
                x = float(row[column].iloc[0])
                shapes.append({"type": "line", "x0": x, "x1": x, "y0": 0, "y1": 1,
                               "line": {"color": colour, "dash": "dot"}})  # fmt: skip
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
) -> None:
    """The blindness run's ``index.html`` (see :func:`write_blindness`)."""
    table = _blindness_table(analytic, measured)
    metric = next(c for c in table.columns if c.startswith(("blind distance", "measured first")))
    grid_table = table.assign(log10_distance=np.log10(table[metric].astype(float)))
    grid = plots.head_grid(grid_table, "log10_distance", title=f"log₁₀ {metric} (tokens)")
    samples = []
    if model is not None and tokens is not None:
        samples = [sample_patterns(model, tokens, n_seqs=1, n_pos=None, max_cells=PAGE_CELLS)]
    source = (analytic if analytic is not None else measured.by_head).attrs
    _write_page(
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
        note=_samples_note(samples, "the measured text"),
    )


@dataclasses.dataclass(frozen=True)
class PageView:
    """What :func:`open_page` saw: the page's console errors and uncaught exceptions, the head
    shown after the click (``None``: none), and that head's first attention pattern as drawn
    (``[query][key]`` weights, ``None`` above the diagonal)."""

    errors: list[str]
    shown: str | None
    pattern: list[list[float | None]] | None


# Runs in the page: the grid cell of a head, in CSS pixels of the viewport.
_CELL_JS = """(() => {
  const g = document.getElementById("grid"), xa = g._fullLayout.xaxis, ya = g._fullLayout.yaxis;
  const box = g.querySelector(".nsewdrag").getBoundingClientRect();
  return [box.left + xa.l2p(%d), box.top + ya.l2p(%d)];
})()"""
_SHOWN_JS = """(() => {
  const name = document.getElementById("head-name"), plot = document.querySelector("div.pattern");
  return [name ? name.textContent : null, plot && plot.data ? plot.data[0].z : null];
})()"""


def open_page(
    page: str | os.PathLike,
    click: str | None = None,
    *,
    screenshot: str | os.PathLike | None = None,
    size: tuple[int, int] = (1400, 1000),
) -> PageView:
    """Open a report page (``index.html``) in headless Chromium, click the head ``click``
    (``"L1H7"``) in its grid with the mouse, and say what happened (:class:`PageView`);
    ``screenshot`` saves the viewport (``size`` pixels) as PNG.

    Needs the Chromium the static figures use (:func:`headsurgeon.plots.require_browser`: one
    :class:`~headsurgeon.errors.FigureExportError` line without one). For tests and README
    screenshots: a page that renders with no console error and shows the clicked head works.
    """
    browser = plots.require_browser("opening a report page")
    url = Path(page).resolve().as_uri()
    pair = None if click is None else next(iter(HeadSet.parse(click)))
    return asyncio.run(_visit(browser, url, pair, screenshot, size))


class _ConsoleErrors:
    """Collects a page's uncaught exceptions, ``console.error`` calls and error log entries."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    async def thrown(self, event: dict) -> None:
        details = event["params"]["exceptionDetails"]
        self.errors.append(details.get("exception", {}).get("description") or details["text"])

    async def console(self, event: dict) -> None:
        if event["params"]["type"] in ("error", "assert"):
            self.errors.append(" ".join(str(a.get("value", a)) for a in event["params"]["args"]))

    async def logged(self, event: dict) -> None:
        if event["params"]["entry"]["level"] == "error":
            self.errors.append(event["params"]["entry"]["text"])

    def listen(self, tab: Any) -> None:
        tab.subscribe("Runtime.exceptionThrown", self.thrown)
        tab.subscribe("Runtime.consoleAPICalled", self.console)
        tab.subscribe("Log.entryAdded", self.logged)


async def _command(tab: Any, method: str, **params: Any) -> dict:
    """One DevTools command's result."""
    return (await tab.send_command(method, params=params or None)).get("result", {})


async def _evaluate(tab: Any, expression: str) -> Any:
    found = await _command(tab, "Runtime.evaluate", expression=expression, returnByValue=True)
    return found.get("result", {}).get("value")


async def _click(tab: Any, pair: tuple[int, int]) -> None:
    """Click a head's cell of the grid as plotly sees a click: the pointer moves onto it, then
    presses; then give the head's plots time to draw."""
    x, y = await _evaluate(tab, _CELL_JS % (pair[1], pair[0]))
    for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
        await _command(tab, "Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left",
                       clickCount=1)  # fmt: skip
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)


async def _visit(
    browser: str, url: str, pair: tuple[int, int] | None, screenshot: Any, size: tuple[int, int]
) -> PageView:
    import choreographer

    errors = _ConsoleErrors()
    async with choreographer.Browser(browser, headless=True) as chromium:
        tab = chromium.get_tab()
        errors.listen(tab)
        for domain in ("Runtime", "Log", "Page"):
            await _command(tab, f"{domain}.enable")
        await _command(tab, "Emulation.setDeviceMetricsOverride", width=size[0], height=size[1],
                       deviceScaleFactor=1, mobile=False)  # fmt: skip
        loaded = tab.subscribe_once("Page.loadEventFired")
        await _command(tab, "Page.navigate", url=url)
        await loaded
        if pair is not None:
            await _click(tab, pair)
        shown, pattern = await _evaluate(tab, _SHOWN_JS)
        if screenshot is not None:
            image = await _command(tab, "Page.captureScreenshot", format="png")
            atomic_write_bytes(screenshot, base64.b64decode(image["data"]))
    return PageView(errors=errors.errors, shown=shown, pattern=pattern)
