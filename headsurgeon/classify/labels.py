"""The code of :mod:`headsurgeon.classify` (head classification: healthy, BOS-sink or dead,
with the reason; and how the counts move), which serves these names lazily; its docstring is the
manual, with the labelling rule.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from headsurgeon.defaults import DEAD_THRESHOLD, MIN_OUTPUT_SHARE, SINK_THRESHOLD
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.heads import LABELS
from headsurgeon.validation import check_int, check_number

__all__ = [
    "LABELS",
    "Thresholds",
    "classify_heads",
    "threshold_sweep",
    "sick_shares",
]

logger = logging.getLogger(__name__)

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

    sink: float = SINK_THRESHOLD
    dead: float = DEAD_THRESHOLD
    min_output_share: float = MIN_OUTPUT_SHARE

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = check_number(
                getattr(self, field.name), f"threshold {field.name}", low=0, high=1
            )
            object.__setattr__(self, field.name, value)  # frozen: store the plain float
        if self.sink >= self.dead:
            raise InvalidArgumentError(
                f"the sink threshold {self.sink} must be below the dead threshold {self.dead}"
            )
        if self.min_output_share >= 1:
            raise InvalidArgumentError("min_output_share must be below 1 (a share of the layer)")


def with_thresholds(
    thresholds: Thresholds | None = None,
    sink_threshold: float | None = None,
    dead_threshold: float | None = None,
    min_output_share: float | None = None,
) -> Thresholds:
    """``thresholds`` (default ``Thresholds()``) with the fields given by the names the command
    line uses: ``sink_threshold`` (``sink``), ``dead_threshold`` (``dead``) and
    ``min_output_share``; every verb that takes ``thresholds`` takes these keywords too.

    >>> with_thresholds(sink_threshold=0.4)
    Thresholds(sink=0.4, dead=0.95, min_output_share=0.01)
    """
    base = Thresholds() if thresholds is None else thresholds
    if not isinstance(base, Thresholds):
        raise InvalidArgumentError(
            f"thresholds must be a headsurgeon.Thresholds such as Thresholds(sink=0.4), got "
            f"{type(base).__name__}; or give sink_threshold=, dead_threshold=, min_output_share="
        )
    given = {"sink": sink_threshold, "dead": dead_threshold, "min_output_share": min_output_share}
    return dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})


def label_heads(
    bos_mass: np.ndarray, output_share: np.ndarray, thresholds: Thresholds = Thresholds()
) -> np.ndarray:
    """Labels for arrays of BOS masses and output shares (the rule of :func:`classify_heads`).

    >>> label_heads(np.array([0.2, 0.6, 0.99, 0.2]), np.array([0.3, 0.3, 0.3, 0.001])).tolist()
    ['healthy', 'BOS-sink', 'dead', 'dead']
    >>> label_heads(np.array([np.nan, 0.2]), np.array([0.3, np.inf])).tolist()
    ['dead', 'dead']
    """
    bos_mass, output_share = np.asarray(bos_mass), np.asarray(output_share)
    # A head whose metrics are not finite (NaN attention, an overflowed output) is never healthy.
    broken = ~(np.isfinite(bos_mass) & np.isfinite(output_share))
    dead = broken | (bos_mass > thresholds.dead) | (output_share < thresholds.min_output_share)
    sink = bos_mass > thresholds.sink
    return np.where(dead, "dead", np.where(sink, "BOS-sink", "healthy")).astype(object)


def _reason(bos_mass: float, output_share: float, t: Thresholds) -> str:
    if not (math.isfinite(bos_mass) and math.isfinite(output_share)):
        return f"metrics not finite (BOS mass {bos_mass}, output share {output_share})"
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


def require_columns(census: pd.DataFrame, columns: Sequence[str]) -> None:
    """Raise :class:`InvalidArgumentError` unless ``census`` is a DataFrame with ``columns``."""
    if not isinstance(census, pd.DataFrame):
        raise InvalidArgumentError(f"expected a census DataFrame, got {type(census).__name__}")
    missing = [c for c in columns if c not in census.columns]
    if missing:
        raise InvalidArgumentError(
            f"the census lacks column(s) {', '.join(missing)}; pass what run_census returns"
        )


def classify_heads(
    census: pd.DataFrame,
    thresholds: Thresholds = Thresholds(),
    *,
    sink_threshold: float | None = None,
    dead_threshold: float | None = None,
    min_output_share: float | None = None,
) -> pd.DataFrame:
    """A copy of ``census`` with ``label`` (one of :data:`LABELS`) and ``reason`` columns.

    ``thresholds``: :class:`Thresholds`; ``sink_threshold``, ``dead_threshold`` and
    ``min_output_share`` (the command line's names) replace its fields
    (:func:`with_thresholds`). The thresholds are recorded in ``attrs["thresholds"]``.

    >>> census = pd.DataFrame({"layer": [0, 0], "head": [0, 1], "bos_mass": [0.1, 0.7],
    ...                        "output_share": [0.4, 0.3]})
    >>> classify_heads(census)[["label", "reason"]]
          label                 reason
    0   healthy  BOS mass 0.100 <= 0.5
    1  BOS-sink   BOS mass 0.700 > 0.5
    """
    require_columns(census, ["layer", "head", "bos_mass", "output_share"])
    thresholds = with_thresholds(thresholds, sink_threshold, dead_threshold, min_output_share)
    for column in ("bos_mass", "output_share"):
        if not pd.api.types.is_numeric_dtype(census[column]):
            raise InvalidArgumentError(
                f"the census column {column} holds {census[column].dtype} values, not numbers; "
                "pass what run_census returns"
            )
    df = census.copy()
    df["label"] = label_heads(df["bos_mass"].to_numpy(), df["output_share"].to_numpy(), thresholds)
    df["reason"] = [
        _reason(b, s, thresholds) for b, s in zip(df["bos_mass"], df["output_share"], strict=True)
    ]
    df.attrs = dict(census.attrs) | {"thresholds": dataclasses.asdict(thresholds)}
    broken = df["reason"].str.startswith("metrics not finite")
    if broken.any():
        names = ", ".join(f"L{r.layer}H{r.head}" for r in df[broken].head(5).itertuples())
        logger.warning(
            "%d head(s) have non-finite metrics (%s%s) and are labelled dead; the model or its "
            "data produced NaN or inf",
            int(broken.sum()),
            names,
            ", ..." if broken.sum() > 5 else "",
        )
    return df


def _grid(default: float, values: np.ndarray) -> np.ndarray:
    return np.unique(np.round(np.append(values, default), 6))


def threshold_sweep(
    census: pd.DataFrame,
    thresholds: Thresholds = Thresholds(),
    *,
    sink_threshold: float | None = None,
    dead_threshold: float | None = None,
    min_output_share: float | None = None,
) -> pd.DataFrame:
    """Label counts as each threshold moves while the other two stay at ``thresholds`` (its
    fields replaced by ``sink_threshold``, ``dead_threshold``, ``min_output_share`` when given:
    :func:`with_thresholds`).

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
    require_columns(census, ["bos_mass", "output_share"])
    thresholds = with_thresholds(thresholds, sink_threshold, dead_threshold, min_output_share)
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


def sick_shares(classified: Mapping[str, pd.DataFrame], bands: int = 3) -> pd.DataFrame:
    """The surgery paper's cross-scale table: per model, its heads in ``bands`` equal bands of
    layers (lower, middle, upper for 3) and all together, with the count of each label, ``sick``
    (BOS-sink + dead) and ``sick_share``.

    >>> df = pd.DataFrame({"layer": [0, 0, 1, 1, 2, 2], "head": [0, 1] * 3,
    ...                    "label": ["dead", "healthy", "healthy", "healthy", "BOS-sink", "dead"]})
    >>> sick_shares({"tiny": df})[["band", "layers", "n_heads", "sick", "sick_share"]]
         band layers  n_heads  sick  sick_share
    0   lower    0-0        2     1         0.5
    1  middle    1-1        2     0         0.0
    2   upper    2-2        2     2         1.0
    3     all    0-2        6     3         0.5
    """
    bands = check_int(bands, "bands", minimum=1)
    names = ("lower", "middle", "upper") if bands == 3 else [f"band {i + 1}" for i in range(bands)]
    rows = []
    for model, df in classified.items():
        require_columns(df, ["layer", "label"])
        n_layers = int(df["layer"].max()) + 1
        edges = np.linspace(0, n_layers, min(bands, n_layers) + 1).round().astype(int)
        spans = [
            (names[i], lo, hi) for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:], strict=True))
        ]
        for band, lo, hi in [*spans, ("all", 0, n_layers)]:
            heads = df[(df["layer"] >= lo) & (df["layer"] < hi)]
            counts = {label: int((heads["label"] == label).sum()) for label in LABELS}
            sick = counts["BOS-sink"] + counts["dead"]
            rows.append(
                {
                    "model": model,
                    "band": band,
                    "layers": f"{lo}-{hi - 1}",
                    "n_heads": len(heads),
                    **counts,
                    "sick": sick,
                    "sick_share": sick / max(len(heads), 1),
                }
            )
    return pd.DataFrame(rows)
