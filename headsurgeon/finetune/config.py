"""The settings and the result of a masked fine-tuning run.

>>> FinetuneConfig(steps=8).warmup, FinetuneConfig(steps=8).eval_interval
(2, 1)
"""

from __future__ import annotations

import dataclasses

import pandas as pd

from headsurgeon.defaults import FINETUNE
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.heads import HeadSet
from headsurgeon.validation import MAX_SEED, check_bool, check_choice, check_int, check_number

__all__ = [
    "STRATEGIES",
    "FinetuneConfig",
    "FinetuneResult",
]

STRATEGIES = ("slices", "mask")


@dataclasses.dataclass
class FinetuneConfig:
    """Settings of a masked fine-tuning run (defaults: the surgery paper's, without bfloat16).

    ``warmup_steps=None`` means ``min(100, steps // 4)``. ``batch_size`` is per process: with
    ``N`` data-parallel processes a step sees ``N * batch_size * grad_accum`` sequences.
    ``eval_every=None`` evaluates ten times per run; ``patience`` stops after that many
    evaluations without a lower held-out loss (and ``restore_best`` goes back to the best one).
    ``checkpoint_every=None`` checkpoints at every evaluation.

    Memory (the defaults are the fastest; see the docs' sizes and memory page for measurements):
    ``gradient_checkpointing`` keeps only each block's input for the backward pass and
    recomputes the block there (:func:`checkpointed_blocks`); ``loss_chunk`` computes the default
    next-token loss over that many positions at a time, so the float32 logits of the whole batch
    (``batch x pos x vocabulary``: 0.5 GB per 512-token sequence of BLOOM's 250,880 tokens) are
    never held at once (:func:`next_token_loss`).
    """

    steps: int = FINETUNE["steps"]
    lr: float = FINETUNE["lr"]
    weight_decay: float = FINETUNE["weight_decay"]
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int | None = None
    batch_size: int = FINETUNE["batch_size"]
    grad_accum: int = FINETUNE["grad_accum"]
    max_grad_norm: float | None = FINETUNE["max_grad_norm"]
    autocast: str | None = None
    eval_every: int | None = None
    eval_seqs: int = 16
    patience: int | None = None
    restore_best: bool = True
    checkpoint_every: int | None = None
    min_query_pos: int = 1
    strategy: str = FINETUNE["strategy"]
    seed: int = 0
    gradient_checkpointing: bool = False
    loss_chunk: int | None = None

    def __post_init__(self) -> None:
        self.validate()  # at the boundary: a bad setting fails where it is written

    def validate(self) -> FinetuneConfig:
        """Return ``self`` if every setting makes sense; otherwise raise saying which does not.

        Runs on creation; call it again after changing fields in place.
        """

        for name in ("steps", "batch_size", "grad_accum", "eval_seqs"):
            setattr(self, name, check_int(getattr(self, name), name, minimum=1))
        for name in ("eval_every", "patience", "checkpoint_every"):
            if getattr(self, name) is not None:
                setattr(self, name, check_int(getattr(self, name), name, minimum=1))
        self.lr = check_number(self.lr, "lr", low=0, high=1, low_open=True)
        self.weight_decay = check_number(self.weight_decay, "weight_decay", low=0)
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise InvalidArgumentError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        self.betas = tuple(
            check_number(b, "each of betas", low=0, high=1, high_open=True) for b in self.betas
        )
        if self.warmup_steps is not None:
            self.warmup_steps = check_int(
                self.warmup_steps, "warmup_steps", minimum=0, maximum=self.steps - 1
            )
        if self.max_grad_norm is not None:
            self.max_grad_norm = check_number(
                self.max_grad_norm, "max_grad_norm", low=0, low_open=True
            )
        if self.autocast is not None:
            check_choice(self.autocast, "autocast", ("float32", "bfloat16"))
        check_choice(self.strategy, "strategy", STRATEGIES)
        self.min_query_pos = check_int(self.min_query_pos, "min_query_pos", minimum=0)
        self.restore_best = check_bool(self.restore_best, "restore_best")
        self.gradient_checkpointing = check_bool(
            self.gradient_checkpointing, "gradient_checkpointing"
        )
        if self.loss_chunk is not None:
            self.loss_chunk = check_int(self.loss_chunk, "loss_chunk", minimum=1)
        self.seed = check_int(self.seed, "seed", minimum=0, maximum=MAX_SEED)
        return self

    @property
    def warmup(self) -> int:
        return min(100, self.steps // 4) if self.warmup_steps is None else self.warmup_steps

    @property
    def eval_interval(self) -> int:
        return self.eval_every or max(1, self.steps // 10)

    @property
    def evaluations(self) -> int:
        """How many evaluations a whole run makes: at step 0, every ``eval_interval`` steps
        and at the end.

        >>> FinetuneConfig(steps=25, eval_every=10).evaluations
        4
        """
        interval = self.eval_interval
        return 1 + self.steps // interval + (self.steps % interval != 0)

    @property
    def checkpoint_interval(self) -> int:
        return self.checkpoint_every or self.eval_interval


@dataclasses.dataclass
class FinetuneResult:
    """What a run did. ``history``: one row per evaluation (``step``, ``lr``, ``train_loss`` (mean
    objective since the previous evaluation; NaN at step 0), ``train_ppl``, ``heldout_ppl``,
    ``bos_mass`` (mean over the trained heads), ``bos_mass_max``); ``losses``: the objective of
    every step."""

    heads: HeadSet
    config: FinetuneConfig
    steps_done: int
    stopped_early: bool
    best_step: int | None
    history: pd.DataFrame
    losses: list[float]
    resumed_from: int | None = None
