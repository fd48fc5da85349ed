"""Head classification: healthy, BOS-sink or dead, with the reason; and how the counts move.

Exports:
    LABELS                                   ("healthy", "BOS-sink", "dead")
    Thresholds                               the classification thresholds (validated dataclass)
    label_heads(bos_mass, output_share, t)   the label rule on arrays
    classify_heads(census, thresholds)       census + ``label`` and ``reason`` columns
    threshold_sweep(census, thresholds)      label counts as each threshold moves
    format_summary(classified)               the text summary the CLI prints
    write_classification(df, out_dir, ...)   heads.csv, heads.json, sweep, summary and figures
    default_out_dir(model)                   a new folder named after the model

Command line: ``python -m headsurgeon.classify [MODEL] [options]`` (``--help`` lists them).

The rule follows the surgery paper: a head is ``dead`` when its BOS mass exceeds ``dead`` (0.95),
a ``BOS-sink`` when it exceeds ``sink`` (0.5). A head whose write into the residual stream is
(almost) nothing, ``output_share < min_output_share`` (1% of its layer's attention write), is
also ``dead``, whatever its pattern. The paper calls the count threshold-insensitive;
:func:`threshold_sweep` shows how it really moves for the model at hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from headsurgeon import plots
from headsurgeon.census import COLUMNS, run_census
from headsurgeon.cli import (
    add_data_args,
    add_model_args,
    add_output_args,
    figure_formats,
    load_model_from_args,
)
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.outputs import atomic_directory, atomic_write_text, check_output_dir

logger = logging.getLogger(__name__)

LABELS = ("healthy", "BOS-sink", "dead")
# Number of heads whose BOS mass lies this close to the sink threshold: the count's sensitivity.
NEAR = 0.05


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """Classification thresholds; validated on creation.

    ``sink`` and ``dead`` bound the BOS mass (``0 <= sink < dead <= 1``; a head is labelled by
    ``bos_mass > threshold``); ``min_output_share`` is the smallest share of its layer's attention
    write a head may have and still count as alive (``0 <= min_output_share < 1``).

    >>> Thresholds()
    Thresholds(sink=0.5, dead=0.95, min_output_share=0.01)
    >>> Thresholds(sink=0.9, dead=0.8)
    Traceback (most recent call last):
    headsurgeon.errors.InvalidArgumentError: the sink threshold 0.9 must be below the dead ...
    """

    sink: float = 0.5
    dead: float = 0.95
    min_output_share: float = 0.01

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidArgumentError(
                    f"threshold {field.name} must be a number, got {value!r}"
                )
            if not (math.isfinite(value) and 0 <= value <= 1):
                raise InvalidArgumentError(f"threshold {field.name}={value} must lie in [0, 1]")
        if self.sink >= self.dead:
            raise InvalidArgumentError(
                f"the sink threshold {self.sink} must be below the dead threshold {self.dead}"
            )
        if self.min_output_share >= 1:
            raise InvalidArgumentError("min_output_share must be below 1 (a share of the layer)")


def label_heads(
    bos_mass: np.ndarray, output_share: np.ndarray, thresholds: Thresholds = Thresholds()
) -> np.ndarray:
    """Labels for arrays of BOS masses and output shares (the rule of :func:`classify_heads`).

    >>> label_heads(np.array([0.2, 0.6, 0.99, 0.2]), np.array([0.3, 0.3, 0.3, 0.001])).tolist()
    ['healthy', 'BOS-sink', 'dead', 'dead']
    """
    bos_mass, output_share = np.asarray(bos_mass), np.asarray(output_share)
    dead = (bos_mass > thresholds.dead) | (output_share < thresholds.min_output_share)
    sink = bos_mass > thresholds.sink
    return np.where(dead, "dead", np.where(sink, "BOS-sink", "healthy")).astype(object)


def _reason(bos_mass: float, output_share: float, t: Thresholds) -> str:
    reasons = []
    if bos_mass > t.dead:
        reasons.append(f"BOS mass {bos_mass:.3f} > {t.dead:g}")
    if output_share < t.min_output_share:
        share, limit = f"{output_share:.2%}", f"{t.min_output_share * 100:g}%"
        reasons.append(f"writes {share} of its layer's attention output (< {limit})")
    if reasons:
        return "; ".join(reasons)
    if bos_mass > t.sink:
        return f"BOS mass {bos_mass:.3f} > {t.sink:g}"
    return f"BOS mass {bos_mass:.3f} <= {t.sink:g}"


def _require(census: pd.DataFrame, columns: Sequence[str]) -> None:
    if not isinstance(census, pd.DataFrame):
        raise InvalidArgumentError(f"expected a census DataFrame, got {type(census).__name__}")
    missing = [c for c in columns if c not in census.columns]
    if missing:
        raise InvalidArgumentError(
            f"the census lacks column(s) {', '.join(missing)}; pass what run_census returns"
        )


def classify_heads(census: pd.DataFrame, thresholds: Thresholds = Thresholds()) -> pd.DataFrame:
    """A copy of ``census`` with ``label`` (one of :data:`LABELS`) and ``reason`` columns.

    The thresholds are recorded in ``attrs["thresholds"]``.

    >>> census = pd.DataFrame({"layer": [0, 0], "head": [0, 1], "bos_mass": [0.1, 0.7],
    ...                        "output_share": [0.4, 0.3]})
    >>> classify_heads(census)[["label", "reason"]]
          label                 reason
    0   healthy  BOS mass 0.100 <= 0.5
    1  BOS-sink   BOS mass 0.700 > 0.5
    """
    _require(census, ["layer", "head", "bos_mass", "output_share"])
    if not isinstance(thresholds, Thresholds):
        raise InvalidArgumentError("thresholds must be a headsurgeon.Thresholds")
    df = census.copy()
    df["label"] = label_heads(df["bos_mass"].to_numpy(), df["output_share"].to_numpy(), thresholds)
    df["reason"] = [
        _reason(b, s, thresholds) for b, s in zip(df["bos_mass"], df["output_share"], strict=True)
    ]
    df.attrs = dict(census.attrs) | {"thresholds": dataclasses.asdict(thresholds)}
    return df


def _grid(default: float, values: np.ndarray) -> np.ndarray:
    return np.unique(np.round(np.append(values, default), 6))


def threshold_sweep(census: pd.DataFrame, thresholds: Thresholds = Thresholds()) -> pd.DataFrame:
    """Label counts as each threshold moves while the other two stay at ``thresholds``.

    One row per (``threshold``, ``value``): ``threshold`` is ``sink``, ``dead`` or
    ``min_output_share``; then the count of each label and ``sick`` (BOS-sink + dead). ``sink``
    and ``dead`` move in steps of 0.01 over their valid range, ``min_output_share`` over a log grid
    from 1e-4 to 0.5 (and 0). ``attrs`` holds the thresholds and the census metadata.

    >>> census = pd.DataFrame({"layer": [0, 0, 1], "head": [0, 1, 0],
    ...                        "bos_mass": [0.1, 0.48, 0.97], "output_share": [0.3] * 3})
    >>> sweep = threshold_sweep(census)
    >>> sweep[(sweep.threshold == "sink") & sweep.value.isin([0.45, 0.5])]
       threshold  value  healthy  BOS-sink  dead  sick
    45      sink   0.45        1         1     1     2
    50      sink   0.50        2         0     1     1
    """
    _require(census, ["bos_mass", "output_share"])
    bos, share = census["bos_mass"].to_numpy(), census["output_share"].to_numpy()
    steps = np.linspace(0, 1, 101)
    grids = {
        "sink": _grid(thresholds.sink, steps[steps < thresholds.dead]),
        "dead": _grid(thresholds.dead, steps[steps > thresholds.sink]),
        "min_output_share": _grid(thresholds.min_output_share, np.r_[0, np.logspace(-4, -0.3, 38)]),
    }
    rows = []
    for name, values in grids.items():
        for value in values:
            varied = dataclasses.replace(thresholds, **{name: float(value)})
            labels = label_heads(bos, share, varied)
            counts = {label: int(np.sum(labels == label)) for label in LABELS}
            rows.append({"threshold": name, "value": float(value), **counts})
    sweep = pd.DataFrame(rows)
    sweep["sick"] = sweep["BOS-sink"] + sweep["dead"]
    sweep.attrs = dict(census.attrs) | {"thresholds": dataclasses.asdict(thresholds)}
    return sweep


def _thresholds_of(df: pd.DataFrame) -> Thresholds:
    return Thresholds(**df.attrs["thresholds"]) if "thresholds" in df.attrs else Thresholds()


def format_summary(classified: pd.DataFrame, *, top: int = 10) -> str:
    """The compact text summary: counts per label, sensitivity, a per-layer table, top sinks."""
    _require(
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
    return "\n".join(lines)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    result = {}
    for package in ("headsurgeon", "torch", "transformer-lens", "transformers", "plotly"):
        try:
            result[package] = version(package)
        except PackageNotFoundError:
            result[package] = "not installed"
    return result


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, np.generic):
        return _json_value(value.item())
    return value


FIGURES = {
    "bos_mass": lambda df: plots.head_grid(df, "bos_mass"),
    "labels": plots.label_grid,
    "entropy": lambda df: plots.head_grid(df, "entropy"),
    "output_share": lambda df: plots.head_grid(df, "output_share"),
}


def write_classification(
    classified: pd.DataFrame,
    out_dir: str | os.PathLike,
    *,
    sweep: pd.DataFrame | None = None,
    metadata: dict[str, Any] | None = None,
    formats: Sequence[str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a classification to a new folder, atomically; return the folder.

    Files: ``heads.csv`` (one row per head), ``heads.json`` (``metadata``: the census and
    classification ``attrs``, ``metadata``, versions and time; ``columns``: what each column
    means; ``heads``: the rows), ``summary.txt``, ``threshold_sweep.csv`` and the figures
    ``bos_mass``, ``labels``, ``entropy``, ``output_share`` and ``threshold_sweep`` in each of
    ``formats`` (html, png, svg, pdf; none for ``formats=()``); the HTML figures share one
    ``plotly.min.js`` in the folder and work offline. ``formats=None`` writes html, and png when
    a Chromium browser is found (else one warning names the skipped PNGs); static formats given
    explicitly need a browser (:func:`headsurgeon.plots.split_formats`), checked before anything
    is written. A folder holding files is refused unless ``overwrite``.
    """
    needed = ["layer", "head", "bos_mass", "bos_mass_std", "entropy", "output_share"]
    _require(classified, [*needed, "label", "reason"])
    plots.split_formats(formats)  # an unknown format, or no browser for one asked for: fail now
    sweep = threshold_sweep(classified, _thresholds_of(classified)) if sweep is None else sweep
    info = dict(classified.attrs) | (metadata or {})
    info |= {"versions": _versions(), "created": datetime.datetime.now().astimezone().isoformat()}
    records = [
        {k: _json_value(v) for k, v in row.items()} for row in classified.to_dict(orient="records")
    ]
    columns = COLUMNS | {
        "label": f"one of {', '.join(LABELS)} (see reason)",
        "reason": "why the head got its label",
    }
    document = {"metadata": info, "columns": columns, "heads": records}
    summary = format_summary(classified)
    figures = {name: make(classified) for name, make in FIGURES.items()}
    figures["threshold_sweep"] = plots.sweep_plot(sweep)
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        atomic_write_text(tmp / "heads.csv", classified.to_csv(index=False))
        atomic_write_text(tmp / "heads.json", json.dumps(document, indent=2, default=str) + "\n")
        atomic_write_text(tmp / "threshold_sweep.csv", sweep.to_csv(index=False))
        atomic_write_text(tmp / "summary.txt", summary + "\n")
        skipped = plots.save_figures(figures, tmp, formats)
    plots.warn_skipped(skipped, out_dir)
    return Path(out_dir)


def default_out_dir(model: str) -> Path:
    """A new folder in the working directory named after the model (``<name>-heads[-N]``)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(model).rstrip("/\\")).name or str(model))
    candidate = Path(f"{name}-heads")
    n = 2
    while candidate.exists():
        candidate = Path(f"{name}-heads-{n}")
        n += 1
    return candidate


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m headsurgeon.classify",
        description="Census of every attention head, a label per head (healthy, BOS-sink, dead), "
        "tables and head-grid figures.",
    )
    add_model_args(parser)
    add_data_args(parser)
    census_args = parser.add_argument_group("census")
    census_args.add_argument(
        "--min-query-pos",
        type=int,
        default=1,
        help="first query row averaged (0 = the surgery paper's metric; default 1)",
    )
    census_args.add_argument("--batch-size", type=int, default=8, help="sequences per forward")
    limits = parser.add_argument_group("thresholds")
    defaults = Thresholds()
    limits.add_argument("--sink-threshold", type=float, default=defaults.sink, help="BOS mass")
    limits.add_argument("--dead-threshold", type=float, default=defaults.dead, help="BOS mass")
    limits.add_argument(
        "--min-output-share",
        type=float,
        default=defaults.min_output_share,
        help="heads writing less than this share of their layer's attention output are dead",
    )
    add_output_args(parser)
    parser.add_argument("--top", type=int, default=10, help="sinks listed in the summary")
    args = parser.parse_args(argv)

    thresholds = Thresholds(args.sink_threshold, args.dead_threshold, args.min_output_share)
    formats = figure_formats(args)  # --format svg/pdf without a browser: fail before the census
    out = Path(args.out) if args.out else default_out_dir(args.model)
    check_output_dir(out, args.overwrite)  # fail before the (long) census
    model = load_model_from_args(args)
    census = run_census(
        model,
        args.texts,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        n_seqs=args.n_seqs,
        min_query_pos=args.min_query_pos,
        prepend_bos=args.prepend_bos,
    )
    classified = classify_heads(census, thresholds)
    print(format_summary(classified, top=args.top))
    written = plots.split_formats(formats)[0]
    write_classification(classified, out, formats=formats, overwrite=args.overwrite)
    print(
        f"\nwrote {out}/: heads.csv, heads.json, summary.txt, threshold_sweep.csv, figures "
        f"({', '.join(written)})"
    )
    return 0


if __name__ == "__main__":
    from headsurgeon.cli import run

    run(main)
