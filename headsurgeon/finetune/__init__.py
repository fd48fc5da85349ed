"""Masked fine-tuning: train only the chosen heads' slices; everything else stays bit-identical.

Exports:
    FinetuneConfig                      optimiser, schedule, precision, evaluation, checkpoints
    FinetuneResult                      history of a run (per-step losses, per-evaluation metrics)
    finetune(model, heads, train, ...)  AdamW + warm-up/cosine on the chosen heads; resumable, DDP
                                        (also ``headsurgeon.finetune_heads``)
    make_trainer(model, heads, ...)     the module a step trains (SliceTrainer or MaskTrainer)
    next_token_loss(model, tokens)      the default objective: mean next-token cross-entropy
                                        (``chunk=``: over that many positions at a time)
    checkpointed_blocks(model)          context manager: blocks recomputed in the backward pass
    unmovable_heads(model, heads, ...)  the heads fine-tuning cannot move from their weights
    head_bos_mass(model, tokens, heads) differentiable BOS mass of chosen heads
    bos_mass_objective(heads, target)   objective that pushes heads' attention to position 0
    warmup_cosine(warmup, steps)        the learning-rate factor of a step
    setup_distributed(device)           join a torchrun process group (gloo on CPU, NCCL on GPU),
                                        returning its DistInfo (rank, world size, device)
    load_checkpoint(dir)                the checkpoint a run left in ``dir`` (or None), checked
    load_torch_file(path, what, fix)    what a headsurgeon ``torch.save`` wrote, read safely
                                        (``weights_only``; any other object: refused, one line)
    weights_digest(model, excluding)    digest of the weights: a resume must see the same model
    TrainingDivergedError               a NaN or infinite loss stopped the run
    Objective, STRATEGIES, CHECKPOINT_FILE  objective type; the strategies; the checkpoint's name

The package's modules, each importable on its own: :mod:`~headsurgeon.finetune.config` (the
settings and the result), :mod:`~headsurgeon.finetune.objectives` (what is minimised),
:mod:`~headsurgeon.finetune.strategies` (the slices and masks machinery),
:mod:`~headsurgeon.finetune.checkpoint` (checkpoint state) and
:mod:`~headsurgeon.finetune.trainer` (the loop); ``setup_distributed`` and ``DistInfo`` are
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

>>> warmup_cosine(warmup=2, steps=6)(0), warmup_cosine(warmup=2, steps=6)(2)
(0.5, 1.0)
"""

from headsurgeon.distributed import DistInfo, setup_distributed
from headsurgeon.finetune.checkpoint import (
    CHECKPOINT_FILE,
    load_checkpoint,
    load_torch_file,
    weights_digest,
)
from headsurgeon.finetune.config import STRATEGIES, FinetuneConfig, FinetuneResult
from headsurgeon.finetune.objectives import (
    Objective,
    bos_mass_objective,
    head_bos_mass,
    next_token_loss,
)
from headsurgeon.finetune.strategies import (
    MaskTrainer,
    SliceTrainer,
    checkpointed_blocks,
    make_trainer,
    unmovable_heads,
)
from headsurgeon.finetune.trainer import TrainingDivergedError, finetune, warmup_cosine

__all__ = [
    "CHECKPOINT_FILE",
    "STRATEGIES",
    "DistInfo",
    "FinetuneConfig",
    "FinetuneResult",
    "MaskTrainer",
    "Objective",
    "SliceTrainer",
    "TrainingDivergedError",
    "bos_mass_objective",
    "checkpointed_blocks",
    "finetune",
    "head_bos_mass",
    "load_checkpoint",
    "load_torch_file",
    "make_trainer",
    "next_token_loss",
    "setup_distributed",
    "unmovable_heads",
    "warmup_cosine",
    "weights_digest",
]
