"""What a repair run did: each pass, and the whole run with its verdict, and their JSON.

The rules behind the verdicts (damage, the best pass, each head's failure) are
:mod:`headsurgeon.repair.policy`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pandas as pd

import headsurgeon.repair.policy as policy
from headsurgeon.backend import Model
from headsurgeon.finetune import FinetuneResult
from headsurgeon.heads import HeadSet
from headsurgeon.loading import model_info
from headsurgeon.pattern_samples import PatternSample
from headsurgeon.repair.config import DRIFT_THRESHOLD

__all__ = [
    "PassResult",
    "RepairResult",
]


def _healthy_count(census: pd.DataFrame) -> int:
    """How many heads a classified census labels healthy."""
    return int((census["label"] == "healthy").sum())


@dataclasses.dataclass
class PassResult:
    """One pass: what it targeted, what recovered, what drifted, and the model before and after.

    ``recovered``: targets labelled healthy after the pass, none if the pass damaged the model;
    ``still_sick``: the other targets; ``drifted``: heads frozen in this pass whose BOS mass moved
    by more than the drift threshold. Against the model before the first pass: ``collateral``,
    the heads healthy there, targeted by no pass so far and sick after this one;
    ``perplexity_change``, the relative change of each perplexity; ``failure``, why the pass
    counts as damage (None: it does not). Perplexities are ``{"train": ..., "heldout": ...}``.
    ``worsened``: targets healthy before the pass and sick after it (its verdict is ``worse``).
    """

    index: int
    targeted: HeadSet
    recovered: HeadSet
    still_sick: HeadSet
    drifted: HeadSet
    census_before: pd.DataFrame
    census_after: pd.DataFrame
    perplexity_before: dict[str, float]
    perplexity_after: dict[str, float]
    training: FinetuneResult
    collateral: HeadSet = dataclasses.field(default_factory=HeadSet)
    perplexity_change: dict[str, float] = dataclasses.field(default_factory=dict)
    failure: str | None = None

    @property
    def damaged(self) -> bool:
        return self.failure is not None

    @property
    def recovery_rate(self) -> float:
        return len(self.recovered) / len(self.targeted)

    @property
    def worsened(self) -> HeadSet:
        return policy.worsened(self.census_before, self.census_after, self.targeted)

    def head_table(self) -> pd.DataFrame:
        """One row per target: label, BOS mass and output share before and after the pass."""
        columns = ["layer", "head", "label", "bos_mass", "output_share"]
        merged = self.census_before[columns].merge(
            self.census_after[columns], on=["layer", "head"], suffixes=("_before", "_after")
        )
        pairs = zip(merged["layer"].tolist(), merged["head"].tolist(), strict=True)
        chosen = [pair in self.targeted for pair in pairs]
        table = merged[chosen].reset_index(drop=True)
        table.insert(0, "name", [f"L{r.layer}H{r.head}" for r in table.itertuples()])
        return table.drop(columns=["layer", "head"])

    def to_dict(self) -> dict[str, Any]:
        history = self.training.history
        return {
            "pass": self.index,
            "targeted": self.targeted.names(),
            "recovered": self.recovered.names(),
            "still_sick": self.still_sick.names(),
            "recovery_rate": self.recovery_rate,
            "verdict": "damaged" if self.damaged else "worse" if self.worsened else "ok",
            "failure_reason": self.failure,
            "collateral": {"count": len(self.collateral), "heads": self.collateral.names()},
            "perplexity_before": self.perplexity_before,
            "perplexity_after": self.perplexity_after,
            "perplexity_change": self.perplexity_change,
            "drift": {"count": len(self.drifted), "heads": self.drifted.names()},
            "healthy_before": _healthy_count(self.census_before),
            "healthy_after": _healthy_count(self.census_after),
            "heads": self.head_table().to_dict(orient="records"),
            "training": {
                "steps": self.training.steps_done,
                "stopped_early": self.training.stopped_early,
                "best_step": self.training.best_step,
                "final_loss": self.training.losses[-1] if self.training.losses else None,
                "final_bos_mass": float(history["bos_mass"].iloc[-1]),
            },
        }


@dataclasses.dataclass
class RepairResult:
    """A whole repair run: what each pass did, the model kept and the control arm beside it.

    ``result = repair(model)``; ``result.verdict`` is ``failed`` (a pass damaged the model),
    ``worse`` (a target turned sick), ``incomplete`` (targets still sick) or ``ok``, and
    ``result.ok`` is False for the first two (``failure_reason`` says which pass or heads, and why).
    ``model`` holds the model of ``best_pass``, the best pass that did no damage (none: its
    original weights). :meth:`prune_vs_repair`, :meth:`control_summary` and
    :meth:`redistribution` set the repair beside pruning, the control and the frozen heads.

    - ``model``: the model repaired in place.
    - ``passes``: one :class:`PassResult` per pass run.
    - ``census_before``, ``census_after``: the first census and that of the kept model.
    - ``settings``: the run's settings, as ``report.json`` records them.
    - ``drift_threshold``: the BOS-mass change that counts a head no pass targeted as drifted.
    - ``best_pass``: the pass kept (None: no pass did no damage).
    - ``pruned``: training and held-out perplexity with pass 1's targets mean- or zero-ablated.
    - ``patterns``: every head's attention on the first positions, before, per pass and control.
    - ``control``: the control arm, one :class:`PassResult` per pass (None: skipped).
    - ``control_movability``: per control target whether training can move it at all.

    ``targeted``, ``recovered``, ``drifted``, ``failed_heads``, ``worsened`` and the control arm:
    [Repair: the same run from Python](../tools/repair.md#the-same-run-from-python).
    """

    model: Model
    passes: list[PassResult]
    census_before: pd.DataFrame
    census_after: pd.DataFrame
    settings: dict[str, Any]
    drift_threshold: float = DRIFT_THRESHOLD
    best_pass: int | None = None
    pruned: dict[str, dict[str, float]] | None = None
    patterns: dict[str, PatternSample] = dataclasses.field(default_factory=dict)
    control: list[PassResult] | None = None
    control_movability: pd.DataFrame | None = None

    @property
    def verdict(self) -> str:
        """``failed``, ``worse``, ``incomplete`` or ``ok`` (see the class's description)."""
        if any(p.damaged for p in self.passes):
            return "failed"
        if self.worsened:
            return "worse"
        return "incomplete" if self.failed_heads else "ok"

    @property
    def ok(self) -> bool:
        """No pass damaged the model and no target turned sick: it is no worse than it was."""
        return self.verdict in ("ok", "incomplete")

    @property
    def failed_heads(self) -> dict[str, str]:
        """Each target sick in ``census_after`` (by name) and why (:func:`head_failures`)."""
        return policy.head_failures(self.census_before, self.census_after, self.targeted)

    @property
    def worsened(self) -> HeadSet:
        """Targets healthy before the first pass and sick in ``census_after``."""
        return policy.worsened(self.census_before, self.census_after, self.targeted)

    @property
    def failure_reason(self) -> str | None:
        """Which pass damaged the model, or which targets turned sick, and why, and which model
        ``model`` holds; None if ok."""
        damaged = [p for p in self.passes if p.damaged]
        if not damaged and not self.worsened:
            return None
        kept = (
            f"the model of pass {self.best_pass} is kept"
            if self.best_pass is not None
            else "no pass is acceptable, so no repaired model is kept"
        )
        if damaged:
            return f"pass {damaged[0].index} damaged the model ({damaged[0].failure}); {kept}"
        failures = self.failed_heads
        turned = "; ".join(f"{name}: {failures[name]}" for name in self.worsened.names())
        return f"{len(self.worsened)} targeted head(s) turned sick ({turned}); {kept}"

    @property
    def best(self) -> PassResult | None:
        return None if self.best_pass is None else self.passes[self.best_pass - 1]

    @property
    def targeted(self) -> HeadSet:
        out = HeadSet()
        for p in self.passes:
            out = out | p.targeted
        return out

    @property
    def recovered(self) -> HeadSet:
        if self.best_pass is None:
            return HeadSet()
        healthy = HeadSet.from_labels(self.census_after, labels=["healthy"])
        return self.targeted & healthy

    @property
    def collateral(self) -> HeadSet:
        """Frozen heads healthy before the first pass and sick in ``model``."""
        return HeadSet() if self.best is None else self.best.collateral

    @property
    def still_sick(self) -> HeadSet:
        return self.targeted - self.recovered

    @property
    def recovery_rate(self) -> float:
        return len(self.recovered) / len(self.targeted)

    @property
    def drifted(self) -> HeadSet:
        return policy.drifted(
            self.census_before, self.census_after, self.targeted, self.drift_threshold
        )

    def perplexities(self) -> dict[str, list[float]]:
        """Training and held-out perplexity before the first pass and after each pass."""
        stages = [self.passes[0].perplexity_before] + [p.perplexity_after for p in self.passes]
        return {split: [s[split] for s in stages] for split in ("train", "heldout")}

    def prune_vs_repair(self) -> dict[str, Any] | None:
        """Perplexities of the model before repair, with pass 1's targets pruned (mean- and
        zero-ablated), of the kept repaired model (None without one) and of the control model
        (None without a control arm)."""
        if self.pruned is None:
            return None
        return {
            "heads": self.passes[0].targeted.names(),
            "injured": self.passes[0].perplexity_before,
            "pruned_mean": self.pruned["mean"],
            "pruned_zero": self.pruned["zero"],
            "repaired": None if self.best is None else self.best.perplexity_after,
            "control": None if not self.control else self.control[-1].perplexity_after,
        }

    @property
    def control_census(self) -> pd.DataFrame | None:
        """The classified census of the control model (None without a control arm)."""
        return self.control[-1].census_after if self.control else None

    def control_summary(self) -> dict[str, Any] | None:
        """The control arm against the kept repair (None without a control arm): the heads it
        retrained, how many are healthy after it (``recovered``, ``recovery_rate``) beside the
        repair's, those it can move at all (``movable``; ``unmovable``: name -> why) and the
        healthy among them (``movable_recovered``, ``movable_recovery_rate``: None without a
        movable target), its labels, perplexities and their change against the model as given,
        the frozen heads that drifted or turned sick, and why a control pass would count as
        damage (``failure``: None if none)."""
        if not self.control:
            return None
        census = self.control[-1].census_after
        trained = HeadSet()
        for p in self.control:
            trained = trained | p.targeted
        recovered = trained & policy.healthy_set(census)
        damaged = [p for p in self.control if p.damaged]
        failure = f"control pass {damaged[0].index}: {damaged[0].failure}" if damaged else None
        drifted = policy.drifted(self.census_before, census, trained, self.drift_threshold)
        unmovable = self._unmovable()
        movable = HeadSet([pair for pair in trained if f"L{pair[0]}H{pair[1]}" not in unmovable])
        return {
            "passes": len(self.control),
            "targeted": trained.names(),
            "recovered": recovered.names(),
            "still_sick": (trained - recovered).names(),
            "recovery_rate": len(recovered) / len(trained),
            "movable": movable.names(),
            "unmovable": unmovable,
            "movable_recovered": (movable & recovered).names(),
            "movable_recovery_rate": len(movable & recovered) / len(movable) if movable else None,
            "repair_recovered": (trained & self.recovered).names(),
            "healthy_after": _healthy_count(census),
            "labels_after": policy.label_counts(census),
            "perplexity_after": self.control[-1].perplexity_after,
            "perplexity_change": self.control[-1].perplexity_change,
            "drift": {"count": len(drifted), "heads": drifted.names()},
            "collateral": {
                "count": len(self.control[-1].collateral),
                "heads": self.control[-1].collateral.names(),
            },
            "failure": failure,
            "heads": self._control_heads(trained, census),
        }

    def _unmovable(self) -> dict[str, str]:
        """The control targets it cannot move, by name, with why (none without the check)."""
        table = self.control_movability
        if table is None:
            return {}
        stuck = table[~table["movable"]]
        return dict(zip(stuck["name"], stuck["why_unmovable"], strict=True))

    def _control_heads(self, trained: HeadSet, control: pd.DataFrame) -> list[dict[str, Any]]:
        """Per head the control retrained: label, BOS mass and output share before the first
        pass, in the kept model (``repaired``) and in the control model; whether the control
        can move it (``movable``), if not why (``why_unmovable``), and the rules that caught
        it (``caught_by``: ``structural``, zero value and output slices; ``measured``, all-zero
        gradients in the backward pass)."""
        stages = {"before": self.census_before, "repaired": self.census_after, "control": control}
        columns = ["label", "bos_mass", "output_share"]
        table = None
        for stage, census in stages.items():
            part = census[["layer", "head", *columns]].rename(
                columns={c: f"{c}_{stage}" for c in columns}
            )
            table = part if table is None else table.merge(part, on=["layer", "head"])
        pairs = zip(table["layer"].tolist(), table["head"].tolist(), strict=True)
        table = table[[pair in trained for pair in pairs]].sort_values(["layer", "head"])
        table.insert(0, "name", [f"L{r.layer}H{r.head}" for r in table.itertuples()])
        unmovable = self._unmovable()
        records = table.drop(columns=["layer", "head"]).to_dict(orient="records")
        checked = (
            {} if self.control_movability is None else self.control_movability.set_index("name")
        )
        for record in records:  # on the records: a str column would hold NaN for None
            name = record["name"]
            record["movable"] = name not in unmovable
            record["why_unmovable"] = unmovable.get(name)
            rules = {"structural": "structural", "measured": "zero_gradient"}
            record["caught_by"] = (
                [rule for rule, column in rules.items() if checked.loc[name, column]]
                if name in unmovable
                else []
            )
        return records

    def redistribution(self) -> pd.DataFrame:
        """How the heads no pass targeted moved between the model as given and the kept model
        (``repaired``) and the control model (``control``, with a control arm): one row per
        such head, its BOS mass and output share before, in each arm, and the change
        (``d_bos_mass_repaired``...; see :func:`headsurgeon.repair.policy.redistribution`).
        ``attrs["summary"]``: per arm and metric the mean and largest |change|, the heads
        beyond the drift threshold and the largest movers."""
        arms = {"repaired": self.census_after}
        if self.control:
            arms["control"] = self.control[-1].census_after
        table = policy.redistribution(self.census_before, arms, self.targeted)
        table.attrs["summary"] = policy.redistribution_summary(
            table, list(arms), self.drift_threshold
        )
        table.attrs["drift_threshold"] = self.drift_threshold
        return table

    def to_dict(self) -> dict[str, Any]:
        """The content of ``report.json``."""
        best = self.best
        moved = self.redistribution()
        return {
            "model": model_info(self.model).name,
            "verdict": self.verdict,
            "failure_reason": self.failure_reason,
            "failed_heads": self.failed_heads,
            "worsened": self.worsened.names(),
            "best_pass": self.best_pass,
            "max_ppl_increase": self.settings["max_ppl_increase"],
            "max_collateral": self.settings["max_collateral"],
            "collateral": {"count": len(self.collateral), "heads": self.collateral.names()},
            "perplexity_change": None if best is None else best.perplexity_change,
            "n_heads": len(self.census_before),
            "targeted": self.targeted.names(),
            "recovered": self.recovered.names(),
            "still_sick": self.still_sick.names(),
            "recovery_rate": self.recovery_rate,
            "healthy_before": _healthy_count(self.census_before),
            "healthy_after": _healthy_count(self.census_after),
            "labels_before": policy.label_counts(self.census_before),
            "labels_after": policy.label_counts(self.census_after),
            "perplexity": self.perplexities(),
            "prune_vs_repair": self.prune_vs_repair(),
            "control": self.control_summary(),
            "control_passes": None if self.control is None else [p.to_dict() for p in self.control],
            "redistribution": {
                "summary": moved.attrs["summary"],
                "heads": moved.to_dict(orient="records"),
            },
            "drift": {
                "threshold": self.drift_threshold,
                "count": len(self.drifted),
                "heads": self.drifted.names(),
            },
            "passes": [p.to_dict() for p in self.passes],
            "settings": self.settings,
        }
