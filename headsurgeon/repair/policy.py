"""Repair policy: which heads to target, what counts as damage, which pass is best.

Pure functions of classified censuses (``layer``, ``head``, ``label``, ``bos_mass``) and
perplexities (``{"train": ..., "heldout": ...}``): no model, no files, no processes.
:mod:`headsurgeon.repair.pipeline` takes each decision on rank 0 and hands it to every rank.

>>> census = pd.DataFrame({"layer": [0, 0, 1], "head": [0, 1, 0],
...                        "label": ["healthy", "BOS-sink", "dead"]})
>>> str(targets(1, census, None, HeadSet.parse("L0H0"))), str(targets(2, census, None, HeadSet()))
('L0H0-1,L1H0', 'L0H1,L1H0')
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pandas as pd

from headsurgeon.heads import LABELS, Heads, HeadSet
from headsurgeon.repair.config import RepairConfig

if TYPE_CHECKING:  # an annotation: results build on this module
    from headsurgeon.repair.results import PassResult


__all__ = [
    "best_pass",
    "damage",
    "drifted",
    "perplexity_change",
    "redistribution",
    "targets",
    "worsened",
]


def targets(index: int, census: pd.DataFrame, heads: HeadSet | None, include: HeadSet) -> HeadSet:
    """Pass ``index``'s targets: pass 1 the sick heads (or ``heads``) and ``include``; later
    passes the heads still sick (within ``heads | include``, if ``heads`` is given)."""
    sick = HeadSet.from_labels(census)
    if index == 1:
        return (sick if heads is None else heads) | include
    return sick if heads is None else sick & (heads | include)


def healthy_set(census: pd.DataFrame) -> HeadSet:
    """The heads a classified census labels healthy."""
    return HeadSet.from_labels(census, labels=["healthy"])


def label_counts(census: pd.DataFrame) -> dict[str, int]:
    """How many heads a classified census gives each label (every label, zeros included)."""
    return {label: int((census["label"] == label).sum()) for label in LABELS}


def worsened(before: pd.DataFrame, after: pd.DataFrame, targeted: HeadSet) -> HeadSet:
    """The ``targeted`` heads healthy in ``before`` and sick in ``after``."""
    return (targeted & healthy_set(before)) - healthy_set(after)


def drifted(
    before: pd.DataFrame, after: pd.DataFrame, trained: HeadSet, threshold: float
) -> HeadSet:
    """The heads not in ``trained`` whose BOS mass moved by more than ``threshold``."""
    merged = before.merge(after, on=["layer", "head"], suffixes=("_before", "_after"))
    moved = (merged["bos_mass_after"] - merged["bos_mass_before"]).abs() > threshold
    pairs = zip(merged.loc[moved, "layer"], merged.loc[moved, "head"], strict=True)
    return HeadSet(pairs) - trained


def head_failures(before: pd.DataFrame, after: pd.DataFrame, targeted: Heads) -> dict[str, str]:
    """The ``targeted`` heads that are sick in ``after``, by name, each with why.

    ``before``, ``after``: classified censuses (``layer``, ``head``, ``label``) of the model
    before the first pass and of the model kept. A target sick in both is ``still <label>`` (or
    ``<label> before, <label> after``); one healthy before and sick after turned sick by being
    targeted. Targets healthy in ``after`` are no failures.

    >>> before = pd.DataFrame({"layer": [0, 0, 0], "head": [0, 1, 2],
    ...                        "label": ["healthy", "BOS-sink", "dead"]})
    >>> after = before.assign(label=["dead", "BOS-sink", "healthy"])
    >>> head_failures(before, after, "L0H0-2")
    {'L0H0': 'healthy before, dead after being targeted', 'L0H1': 'still BOS-sink'}
    """
    was = before.set_index(["layer", "head"])["label"]
    now = after.set_index(["layer", "head"])["label"]
    heads = HeadSet.of(targeted)
    failures = {}
    for pair, name in zip(heads, heads.names(), strict=True):
        if now[pair] == "healthy":
            continue
        if was[pair] == "healthy":
            failures[name] = f"healthy before, {now[pair]} after being targeted"
        elif was[pair] == now[pair]:
            failures[name] = f"still {now[pair]}"
        else:
            failures[name] = f"{was[pair]} before, {now[pair]} after"
    return failures


def perplexity_change(first_ppl: dict[str, float], ppl_after: dict[str, float]) -> dict[str, float]:
    """The relative change of each perplexity against the model before the first pass."""
    return {split: ppl_after[split] / first_ppl[split] - 1 for split in ("train", "heldout")}


def damage(
    first_ppl: dict[str, float],
    ppl_after: dict[str, float],
    change: dict[str, float],
    collateral: HeadSet,
    config: RepairConfig,
) -> str | None:
    """Why a pass with these perplexities (``change``: :func:`perplexity_change`) and
    ``collateral`` heads (:func:`collateral_damage`) counts as damage; None if not."""
    problems = []
    if not change["heldout"] <= config.max_ppl_increase:  # NaN included
        problems.append(
            f"held-out perplexity {first_ppl['heldout']:.2f} -> {ppl_after['heldout']:.2f} "
            f"({change['heldout']:+.1%}, at most +{config.max_ppl_increase:.0%} allowed)"
        )
    if len(collateral) > config.max_collateral:
        problems.append(
            f"{len(collateral)} healthy frozen head(s) turned sick ({collateral}; at most "
            f"{config.max_collateral} allowed)"
        )
    return "; ".join(problems) or None


def best_pass(results: Sequence[PassResult]) -> int | None:
    """The pass with the most targets healthy after it, then the lowest held-out perplexity,
    among those that did no damage; None if every pass did."""
    targeted = HeadSet()
    ranked = []
    for p in results:
        targeted = targeted | p.targeted
        if not p.damaged:
            healthy = len(targeted & healthy_set(p.census_after))
            ranked.append((-healthy, p.perplexity_after["heldout"], p.index))
    return min(ranked)[2] if ranked else None


def collateral_damage(
    first: pd.DataFrame, after: pd.DataFrame, earlier: HeadSet, targeted: HeadSet
) -> HeadSet:
    """The heads healthy in ``first`` (the census before the first pass), targeted neither by an
    earlier pass nor by this one, and sick in ``after``: the collateral damage of a pass."""
    return healthy_set(first) - healthy_set(after) - earlier - targeted


# The two census columns whose redistribution a repair reports: where a head looks (its weight on
# position 0) and how much it writes (its share of the layer's attention output).
MOVED = ("bos_mass", "output_share")


def redistribution(
    before: pd.DataFrame, arms: dict[str, pd.DataFrame], trained: HeadSet
) -> pd.DataFrame:
    """How the heads outside ``trained`` moved: one row per such head (``layer``, ``head``,
    ``name``, ``label_before``), for each metric of :data:`MOVED` its value before, and for each
    arm (``arms``: name -> classified census after, e.g. ``repaired``, ``control``) its value
    there (``bos_mass_repaired``) and the change (``d_bos_mass_repaired`` = after - before).

    >>> before = pd.DataFrame({"layer": [0, 0], "head": [0, 1], "label": ["healthy"] * 2,
    ...                        "bos_mass": [0.1, 0.2], "output_share": [0.5, 0.5]})
    >>> after = before.assign(bos_mass=[0.9, 0.25], output_share=[0.1, 0.4])
    >>> table = redistribution(before, {"repaired": after}, HeadSet.parse("L0H0"))
    >>> table[["name", "d_bos_mass_repaired", "d_output_share_repaired"]].round(3).values.tolist()
    [['L0H1', 0.05, -0.1]]
    """
    keys = ["layer", "head"]
    table = before[[*keys, "label", *MOVED]].rename(
        columns={"label": "label_before", **{m: f"{m}_before" for m in MOVED}}
    )
    for arm, after in arms.items():
        table = table.merge(
            after[[*keys, *MOVED]].rename(columns={m: f"{m}_{arm}" for m in MOVED}), on=keys
        )
        for m in MOVED:
            table[f"d_{m}_{arm}"] = table[f"{m}_{arm}"] - table[f"{m}_before"]
    pairs = zip(table["layer"].tolist(), table["head"].tolist(), strict=True)
    frozen = [pair not in trained for pair in pairs]
    table = table[frozen].sort_values(keys).reset_index(drop=True)
    table.insert(2, "name", [f"L{r.layer}H{r.head}" for r in table.itertuples()])
    return table


def redistribution_summary(
    table: pd.DataFrame, arms: Sequence[str], threshold: float, top: int = 3
) -> dict[str, dict[str, dict[str, object]]]:
    """Per arm and metric of a :func:`redistribution` table: ``mean_abs`` (mean |delta| over
    the heads), ``max_abs``, ``beyond`` (heads whose |delta| exceeds ``threshold``, the drift
    criterion, applied to both metrics) and ``largest`` (the ``top`` heads by |delta|, those that
    moved at all, ``{name: delta}``).

    >>> table = pd.DataFrame({"name": ["L0H1", "L0H2"], "d_bos_mass_repaired": [0.1, -0.3],
    ...                       "d_output_share_repaired": [0.0, 0.02]})
    >>> summary = redistribution_summary(table, ["repaired"], 0.05, top=1)
    >>> summary["repaired"]["bos_mass"]
    {'mean_abs': 0.2, 'max_abs': 0.3, 'beyond': 2, 'largest': {'L0H2': -0.3}}
    """
    summary: dict[str, dict[str, dict[str, object]]] = {}
    for arm in arms:
        summary[arm] = {}
        for m in MOVED:
            delta = table.set_index("name")[f"d_{m}_{arm}"].astype(float)
            ranked = delta.abs().sort_values(ascending=False, kind="stable")
            largest = ranked[ranked > 0].index[:top]  # a head that did not move is no mover
            summary[arm][m] = {
                "mean_abs": float(delta.abs().mean()) if len(delta) else 0.0,
                "max_abs": float(delta.abs().max()) if len(delta) else 0.0,
                "beyond": int((delta.abs() > threshold).sum()),
                "largest": {name: float(delta[name]) for name in largest},
            }
    return summary
