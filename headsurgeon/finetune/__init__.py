"""Masked fine-tuning: train only the chosen heads' slices; everything else stays bit-identical.

The package's modules, each importable on its own: :mod:`~headsurgeon.finetune.config` (the
settings and the result), :mod:`~headsurgeon.finetune.objectives` (what is minimised),
:mod:`~headsurgeon.finetune.strategies` (the slices and masks machinery),
:mod:`~headsurgeon.finetune.checkpoint` (checkpoint state) and
:mod:`~headsurgeon.finetune.trainer` (the loop); the ``torchrun`` setup is
:mod:`headsurgeon.distributed`'s.

Two strategies keep frozen weights frozen under any AdamW setting, weight decay included:

* ``"slices"`` (default): the optimiser sees only float32 copies of the chosen slices
  (:class:`headsurgeon.surgery.HeadParameters`), spliced into the forward pass. Optimiser memory
  grows with the number of heads, not the model, and backward work stops at the lowest chosen
  layer because nothing below it requires gradient.
* ``"mask"``: the surgery paper's gradient masks (:class:`headsurgeon.surgery.HeadMask`) on the
  whole attention tensors of the chosen layers, with frozen elements restored from a saved copy
  after every step (decoupled weight decay moves them otherwise). Optimiser state covers the
  chosen layers' whole attention tensors.

The objective is any ``objective(model, tokens) -> scalar loss``: next-token cross-entropy by
default, :func:`bos_mass_objective` to plant BOS-sink heads (the repair procedure run in reverse).
"""

from headsurgeon.finetune.config import STRATEGIES, FinetuneConfig, FinetuneResult
from headsurgeon.finetune.objectives import Objective, bos_mass_objective, next_token_loss
from headsurgeon.finetune.strategies import (
    MaskTrainer,
    checkpointed_blocks,
    make_trainer,
    unmovable_heads,
)
from headsurgeon.finetune.trainer import TrainingDivergedError, finetune

__all__ = [
    "STRATEGIES",
    "FinetuneConfig",
    "FinetuneResult",
    "MaskTrainer",
    "Objective",
    "TrainingDivergedError",
    "bos_mass_objective",
    "checkpointed_blocks",
    "finetune",
    "make_trainer",
    "next_token_loss",
    "unmovable_heads",
]
