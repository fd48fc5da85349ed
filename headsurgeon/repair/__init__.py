"""Multi-pass surgical repair: census, choose heads, re-initialise, masked fine-tune, census again.

The package's modules, each importable on its own: :mod:`~headsurgeon.repair.config` (the
settings, and ``resolve_config``, the one place they meet the model's recommendations),
:mod:`~headsurgeon.repair.policy` (which heads to target, what counts as damage, which pass is
best: pure functions of censuses and perplexities), :mod:`~headsurgeon.repair.results` (the
results and their JSON), :mod:`~headsurgeon.repair.resume` (the work folder and its checks) and
:mod:`~headsurgeon.repair.pipeline` (the run). Rank 0's decisions under ``torchrun`` go through
:mod:`headsurgeon.distributed`, as fine-tuning's do.

The report folder (``report.md``, figures, ``model/``) is :func:`headsurgeon.reports.write_report`;
the command line, ``python -m headsurgeon repair`` (``--help`` lists options), is
:mod:`headsurgeon.cli.repair`.

A pass re-initialises its target heads (:func:`headsurgeon.surgery.reinit_heads`), trains only
their slices (:func:`headsurgeon.finetune.finetune`: every other weight stays bit-identical) and
measures the census again. Pass 1 targets the dead and BOS-sink heads of the census, or an
explicit head set, plus any ``include`` heads (the paper's "extended surgery" of healthy heads);
later passes target the heads still sick (within the explicit set and ``include``, if given),
until none is left or ``passes`` is reached. A frozen head "drifts" when its BOS mass moves by
more than ``drift_threshold`` (0.05, the paper's criterion) during a pass.

A pass *damages* the model when, against the model before the first pass, held-out perplexity
rose by more than ``max_ppl_increase`` (relative; default 10%) or more than ``max_collateral``
(default 0) frozen heads that were healthy turned sick (collateral damage); a non-finite
perplexity is damage. A damaged pass recovers nothing and ends the run, which then fails
(:attr:`RepairResult.ok`). The model left in place is that of the best pass that did no damage
(most targets healthy, then the lowest held-out perplexity); with none, the model gets its
original weights back.

Every target that is sick in the model left in place is a failure of that head
(:func:`headsurgeon.repair.policy.head_failures`): one still sick, and one that was healthy and
turned sick by being targeted (an ``include`` or explicit head). The latter makes the model
worse: the run is not ``ok`` either (verdict ``worse``). Heads merely still sick leave it ``ok``
(verdict ``incomplete``): the model is no worse than it was.

With ``work_dir`` every finished pass and every fine-tuning checkpoint is kept there, so
``resume=True`` continues an interrupted run where it stopped, bit-identical on CPU. The CLI keeps
them in ``<out>.partial/`` beside the output folder, which appears whole only at the end.
"""

from __future__ import annotations

from headsurgeon.repair.config import (
    DRIFT_THRESHOLD,
    MAX_PPL_INCREASE,
    RepairConfig,
    recommended_config,
)
from headsurgeon.repair.pipeline import repair
from headsurgeon.repair.results import PassResult, RepairResult

__all__ = [
    "DRIFT_THRESHOLD",
    "MAX_PPL_INCREASE",
    "PassResult",
    "RepairConfig",
    "RepairResult",
    "recommended_config",
    "repair",
]
