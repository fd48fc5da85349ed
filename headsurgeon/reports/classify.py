"""The files and summary of a classification: what the classify CLI prints and writes."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from torch import Tensor

from headsurgeon import plots
from headsurgeon.backend import Model
from headsurgeon.census import COLUMNS, GU_PROTOCOL, sink_rate
from headsurgeon.classify import Thresholds, sick_shares, threshold_sweep
from headsurgeon.classify.labels import NEAR, label_heads, require_columns
from headsurgeon.data import to_sequences
from headsurgeon.errors import shown
from headsurgeon.heads import LABELS
from headsurgeon.importance import (
    COLUMNS as IMPORTANCE_COLUMNS,
    DORMANT_SE,
    IMPORTANCE_NAMES,
    is_dormant,
)
from headsurgeon.outputs import MARK_FILE, atomic_directory, atomic_write_text
from headsurgeon.pattern_samples import PatternSample, sample_patterns
from headsurgeon.received import SecondarySinks
from headsurgeon.reports.folders import named_folders
from headsurgeon.reports.page import PAGE_POSITIONS, PAGE_SEQS, samples_note, write_page
from headsurgeon.reports.records import json_safe, package_versions

__all__ = [
    "FIGURES",
    "write_classification",
    "write_cross_scale",
]


# The top folder of several models has no page of its own: its figures are HTML pages too.
CROSS_SCALE_FORMATS = ("html", "png")
# The cross-scale folder's figures, by file name.
CROSS_SCALE_FIGURES = ("sick_share", "bos_mass")


def _thresholds_of(df: pd.DataFrame) -> Thresholds:
    """The thresholds recorded in ``df.attrs`` by :func:`classify_heads` (default ones if none)."""
    return Thresholds(**df.attrs["thresholds"]) if "thresholds" in df.attrs else Thresholds()


def format_summary(
    classified: pd.DataFrame, *, top: int = 10, sinks: SecondarySinks | None = None
) -> str:
    """The compact text summary: counts per label, sensitivity, a per-layer table, top sinks.

    ``sinks`` (:func:`headsurgeon.secondary_sinks` on the same sequences) adds a section: how
    many positions after 0 act as sinks, by first layer and token, and the ``top`` strongest.

    A table with :func:`headsurgeon.head_importance` columns (``delta_loss``, ``delta_loss_se``,
    merged on ``layer`` and ``head``) adds an importance section: per label, how many heads are
    dormant (``|delta_loss| <= 2 SE``: removing them changes nothing measurable) and how many
    work, the working sick heads, and the ``top`` heads by ``delta_loss``.
    """
    require_columns(
        classified,
        ["layer", "head", "bos_mass", "bos_mass_std", "entropy", "output_share", "label"],
    )
    t = _thresholds_of(classified)
    attrs = classified.attrs
    counts = classified["label"].value_counts()
    lines = []
    if attrs:
        position0 = "BOS token" if attrs.get("prepend_bos") else "first text token"
        lines.append(
            f"{attrs.get('model', 'model')}: {attrs.get('n_layers')} layers x "
            f"{attrs.get('n_heads')} heads, {attrs.get('n_seqs')} sequences x "
            f"{attrs.get('seq_len')} tokens"
            + (f" of {attrs['data']}" if attrs.get("data") else "")
            + f", position 0 = {position0}, query rows t >= {attrs.get('min_query_pos')}"
        )
    total = len(classified)
    lines.append(
        "labels: "
        + ", ".join(f"{label} {counts.get(label, 0)}" for label in LABELS)
        + f"  (sick {total - counts.get('healthy', 0)}/{total} = "
        f"{(total - counts.get('healthy', 0)) / max(total, 1):.1%})"
    )
    lines.append(_sick_line(classified, t.dead))
    lines.append(
        f"rule: dead if BOS mass > {t.dead:g} or output share < {t.min_output_share:g} (its "
        f"share of its layer's attention output); BOS-sink if BOS mass > {t.sink:g} (BOS mass: "
        "mean attention weight on position 0)"
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
    lines += _standard_score_lines(classified)
    per_layer = pd.crosstab(classified["layer"], classified["label"])
    per_layer = per_layer.reindex(columns=list(LABELS), fill_value=0).join(
        classified.groupby("layer").agg(
            bos_mean=("bos_mass", "mean"), bos_max=("bos_mass", "max"), entropy=("entropy", "mean")
        )
    )
    per_layer.columns.name = None
    lines += [
        "",
        "per layer: heads per label; BOS mass mean and max; mean attention entropy (nats):",
        per_layer.to_string(float_format="{:.3f}".format),
    ]
    # The sick heads first: a head dead by its output share has a low BOS mass, and a table by
    # BOS mass alone left it out.
    ranked = classified.assign(_healthy=classified["label"] == "healthy")
    ranked = ranked.sort_values(["_healthy", "bos_mass"], ascending=[True, False], kind="stable")
    strongest = ranked.head(top)
    listed = ["layer", "head", "slope", "bos_mass", "bos_mass_std", "entropy", "output_share"]
    listed = [c for c in listed if c in classified.columns] + ["label"]
    lines += [
        "",
        f"top {len(strongest)} heads: the sick ones first, then by BOS mass (bos_mass_std: "
        "across sequences):",
        strongest[listed].to_string(index=False, float_format="{:.4f}".format),
    ]
    if sinks is not None:
        lines += ["", *_sinks_lines(sinks.sinks, top)]
    if _has_importance(classified):
        lines += ["", *_importance_lines(classified, top)]
    return shown("\n".join(lines))


# Sick heads the summary names one by one; the rest are counted (heads.csv lists them all).
NAMED_SICK = 24


def _sick_line(classified: pd.DataFrame, dead: float) -> str:
    """Every sick head by name and label, in layer order (the first :data:`NAMED_SICK`), with
    "output share" beside a head dead by its output share rather than its BOS mass."""
    sick = classified[classified["label"] != "healthy"].sort_values(["layer", "head"])
    if sick.empty:
        return "sick heads: none"
    named = [
        f"L{r.layer}H{r.head} {r.label}"
        + (
            f" (output share {r.output_share:.3f})"
            if r.label == "dead" and r.bos_mass <= dead
            else ""
        )
        for r in sick.head(NAMED_SICK).itertuples()
    ]
    more = f" and {len(sick) - NAMED_SICK} more (heads.csv)" if len(sick) > NAMED_SICK else ""
    return f"sick heads ({len(sick)}): {', '.join(named)}{more}"


def _standard_score_lines(classified: pd.DataFrame, lowest: int = 5) -> list[str]:
    """The summary's lines on the literature's scores: Gu et al.'s sink rate with its threshold
    and protocol, and the heads of lowest AHON-LN (none for a table without the columns)."""
    lines = []
    attrs = classified.attrs
    if "sink_share" in classified.columns and "sink_eps" in attrs:
        eps, n_seqs, seq_len = attrs["sink_eps"], attrs.get("n_seqs"), attrs.get("seq_len")
        gu = GU_PROTOCOL
        ours = {"n_seqs": n_seqs, "seq_len": seq_len, "sink_eps": eps}
        protocol = (
            "Gu et al.'s protocol"
            if ours == dict(gu)
            else f"Gu et al.'s protocol is {gu['n_seqs']} x {gu['seq_len']} tokens, eps "
            f"{gu['sink_eps']:g}: --preset gu"
        )
        lines.append(
            f"sink rate (Gu et al.): {sink_rate(classified):.2%} of (sequence, head) pairs have "
            f"sink_score alpha_0 (mean attention on position 0) > {eps:g}, over {n_seqs} "
            f"sequences x {seq_len} tokens ({protocol})"
        )
    if "ahon_ln" in classified.columns:
        quiet = classified.nsmallest(lowest, "ahon_ln")
        names = ", ".join(f"L{r.layer}H{r.head} {r.ahon_ln:.3f}" for r in quiet.itertuples())
        lines.append(
            "AHON-LN (Sandoval-Segura et al.: mean |z| of a head over its layer's mean, per "
            f"sequence; low = inactive): lowest {names}"
        )
    return lines


def _sinks_lines(sinks: pd.DataFrame, top: int) -> list[str]:
    """The summary's secondary-sinks section."""
    a = sinks.attrs
    kept = f" ({len(sinks)} kept: max_sinks)" if a["truncated"] else ""
    lines = [
        f"secondary sinks: {a['n_found']}{kept} (sequence, position) pairs after position 0 whose "
        f"received mass (mean weight from later queries) exceeds {a['threshold']:g} in some "
        f"head, positions with >= {a['min_queries']} later queries, in {a['n_seqs']} sequences "
        f"x {a['seq_len']} tokens"
    ]
    if not len(sinks):
        return lines
    first = sinks["first_layer"].value_counts().sort_index()
    tokens = sinks["token"].value_counts().head(top)
    lines += [
        "by first layer: " + ", ".join(f"L{layer} {n}" for layer, n in first.items()),
        "most frequent tokens: " + ", ".join(f"{token!r} {n}" for token, n in tokens.items()),
        f"strongest (top {min(top, len(sinks))} by peak received mass):",
        sinks.nlargest(top, "peak_received").to_string(index=False, float_format="{:.4f}".format),
    ]
    return lines


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
    listed = ["layer", "head", "bos_mass", "output_share", "delta_loss", "delta_loss_se", "label"]
    return [
        f"importance{f' ({how})' if how else ''}: delta_loss = rise of the loss (nats) when a "
        f"head's output is replaced{clean}",
        f"dormant (|delta_loss| <= {DORMANT_SE:g} SE) / working: {split}",
        f"working sick heads: {', '.join(names) or 'none'}{more}",
        "",
        f"most important heads (top {len(important)} by delta_loss):",
        important[listed].to_string(
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
# Added when the table carries importance columns (_has_importance).
IMPORTANCE_FIGURES = {
    "importance": plots.importance_grid,
    "bos_vs_importance": plots.bos_vs_importance,
}


def _makers(classified: pd.DataFrame) -> dict[str, Any]:
    """The figures of a classification but its threshold sweep, by name: their makers."""
    return FIGURES | (IMPORTANCE_FIGURES if _has_importance(classified) else {})


def classification_figures(classified: pd.DataFrame) -> list[str]:
    """The names of the figures :func:`write_classification` writes for ``classified``."""
    return [*_makers(classified), "threshold_sweep"]


def subfolder_figures(
    tables: Mapping[str, pd.DataFrame], formats: Sequence[str] | None
) -> tuple[Sequence[str] | None, list[str]]:
    """For a writer that puts a classification in each of its subfolders (``{folder: table}``):
    the ``formats`` to give :func:`write_classification`, and the static figures it then skips
    for want of a browser (``folder/name.png``), for the writer's one warning line rather than
    one a subfolder."""
    write, skipped = plots.split_formats(formats)
    names = [
        f"{folder}/{figure}.{fmt}"
        for folder, table in tables.items()
        for figure in classification_figures(table)
        for fmt in skipped
    ]
    return (write if skipped else formats), names


def _census_samples(model: Model | None, tokens: Tensor | None) -> list[PatternSample]:
    """Every head's attention on the page's share of ``tokens`` (default: the bundled held-out
    text, cut as the census cuts it); none without a model."""
    if model is None:
        return []
    if tokens is None:
        tokens = to_sequences(model, None, seq_len=PAGE_POSITIONS, n_seqs=PAGE_SEQS).tokens
    return [sample_patterns(model, tokens, n_seqs=PAGE_SEQS, n_pos=PAGE_POSITIONS)]


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
    sinks: SecondarySinks | None = None,
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
    (:func:`headsurgeon.plots.bos_vs_importance`). ``formats=None`` writes the figures as png
    when a Chromium browser is found (else one warning names the skipped PNGs) and no HTML
    figure: ``index.html`` holds them all; ``html`` given explicitly writes each as HTML, all
    sharing one plotly.js in the folder (the one case of a second copy). Static formats given
    explicitly need a browser (:func:`headsurgeon.plots.split_formats`), checked before anything
    is written. A folder holding files is refused unless ``overwrite``, and even then unless
    headsurgeon wrote it (:func:`headsurgeon.outputs.check_output_dir`).

    ``index.html`` puts it on one offline page: the summary, the BOS-mass grid where clicking a
    head shows its metrics (importance included) and, given the ``model``, its attention on the
    first positions of the first sequences of ``tokens`` (the census's; default: the bundled
    held-out text), and every other figure, with plotly.js inlined once (its 1.5 MB cartesian
    bundle): on organism-injured the folder holds 2.9 MB (the page 2.1 MB).

    ``sinks`` (:func:`headsurgeon.secondary_sinks` on the same ``tokens``) adds
    ``secondary_sinks.csv`` (one row per sequence and position found), ``received.csv`` (one
    row per layer, head and position: the mean over sequences), its section of the summary, and
    under each head's pattern on the page a strip of the received mass of that sequence's key
    positions.
    """
    needed = ["layer", "head", "bos_mass", "bos_mass_std", "entropy", "output_share"]
    require_columns(classified, [*needed, "label", "reason"])
    plots.split_formats(formats)  # an unknown format, or no browser for one asked for: fail now
    sweep = threshold_sweep(classified, _thresholds_of(classified)) if sweep is None else sweep
    info = dict(classified.attrs) | (metadata or {})
    info |= {
        "versions": package_versions(),
        "created": datetime.datetime.now().astimezone().isoformat(),
    }
    records = [
        {k: json_safe(v) for k, v in row.items()} for row in classified.to_dict(orient="records")
    ]
    columns = COLUMNS | {
        "label": f"one of {', '.join(LABELS)} (see reason)",
        "reason": "why the head got its label",
    }
    makers = _makers(classified)
    if _has_importance(classified):
        columns |= _importance_columns(classified)
    document = {"metadata": info, "columns": columns, "heads": records}
    summary = format_summary(classified, sinks=sinks)
    figures = {name: make(classified) for name, make in makers.items()}
    figures["threshold_sweep"] = plots.sweep_plot(sweep)
    samples = _census_samples(model, tokens)
    with atomic_directory(out_dir, overwrite=overwrite, writer="write_classification") as tmp:
        atomic_write_text(tmp / "heads.csv", classified.to_csv(index=False))
        atomic_write_text(tmp / "heads.json", json.dumps(document, indent=2, default=str) + "\n")
        atomic_write_text(tmp / "threshold_sweep.csv", sweep.to_csv(index=False))
        atomic_write_text(tmp / "summary.txt", summary + "\n")
        if sinks is not None:
            atomic_write_text(tmp / "secondary_sinks.csv", sinks.sinks.to_csv(index=False))
            atomic_write_text(tmp / "received.csv", sinks.received.to_csv(index=False))
        skipped = plots.save_figures(figures, tmp, formats)
        write_page(
            tmp,
            title=f"Heads of {info.get('model', 'the model')}",
            summary=summary,
            grid=figures["bos_mass"],
            shape=(int(classified["layer"].max()) + 1, int(classified["head"].max()) + 1),
            stages={"census": classified},
            samples=samples,
            model=model,
            figures={name: fig for name, fig in figures.items() if name != "bos_mass"},
            note=samples_note(samples, info.get("data"), received=sinks is not None),
            received=[None if sinks is None else sinks.examples],
        )
    plots.warn_skipped(skipped, out_dir)
    return Path(out_dir)


def cross_scale_folders(models: Sequence[str]) -> dict[str, str]:
    """``{folder: model}`` of :func:`write_cross_scale`'s folder, checked before any work: each
    model's folder of its own, none hidden, none named as a file of the folder, else one-line
    :class:`InvalidArgumentError` (:func:`headsurgeon.reports.folders.named_folders`)."""
    files = {"cross_scale.csv", "summary.txt", MARK_FILE}
    files |= {plots.export.CARTESIAN_BUNDLE.name, plots.export.FULL_BUNDLE}
    files |= {f"{figure}.{fmt}" for figure in CROSS_SCALE_FIGURES for fmt in plots.FORMATS}
    return named_folders(models, "model", files)


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
    side by side, :func:`headsurgeon.plots.models_grid`). This folder has no ``index.html`` of its
    own (each model's folder has one), so ``formats=None`` writes these two figures as HTML too,
    sharing one plotly.js, and as png when a browser is found.
    """
    folders = cross_scale_folders(list(classified))
    plots.split_formats(formats)  # checked before anything is written
    shares = sick_shares(classified)
    made = [plots.sick_share_plot(shares), plots.models_grid(dict(classified), "bos_mass")]
    figures = dict(zip(CROSS_SCALE_FIGURES, made, strict=True))
    table = shares[shares["band"] == "all"].drop(columns=["band", "layers"])
    inner, skipped_inside = subfolder_figures(
        {folder: classified[name] for folder, name in folders.items()}, formats
    )
    with atomic_directory(out_dir, overwrite=overwrite, writer="write_cross_scale") as tmp:
        for folder, name in folders.items():
            write_classification(classified[name], tmp / folder, formats=inner)
        atomic_write_text(tmp / "cross_scale.csv", shares.to_csv(index=False))
        text = "Sick heads (BOS-sink + dead) per model:\n" + table.to_string(index=False)
        text += "\n\nBy layer band:\n" + shares.to_string(index=False)
        atomic_write_text(tmp / "summary.txt", text + "\n")
        skipped = plots.save_figures(figures, tmp, formats, default=CROSS_SCALE_FORMATS)
    plots.warn_skipped(skipped_inside + skipped, out_dir)
    return Path(out_dir)


def _importance_columns(classified: pd.DataFrame) -> dict[str, str]:
    """What each importance column of ``classified`` means."""
    return {
        ours: IMPORTANCE_COLUMNS[theirs]
        for theirs, ours in IMPORTANCE_NAMES.items()
        if ours in classified.columns
    }
