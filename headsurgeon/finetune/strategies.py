"""The slices and masks machinery: how a fine-tuning step trains the chosen heads only.

Exports:
    SliceTrainer                        the ``"slices"`` strategy: float32 copies of the chosen
                                        slices (:class:`headsurgeon.surgery.HeadParameters`)
    MaskTrainer                         the ``"mask"`` strategy: gradient masks on whole tensors
                                        (:class:`headsurgeon.surgery.HeadMask`), frozen elements
                                        restored after every step
    make_trainer(model, heads, ...)     the module a step trains (SliceTrainer or MaskTrainer)
    checkpointed_blocks(model)          context manager: blocks recomputed in the backward pass

Both strategies keep frozen weights frozen under any AdamW setting, weight decay included; see
:mod:`headsurgeon.finetune` for when to use which.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from headsurgeon.backend import Model, without_kv_cache
from headsurgeon.backend.weights import head_tensors
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.finetune.config import STRATEGIES
from headsurgeon.finetune.objectives import Objective, next_token_loss
from headsurgeon.heads import HeadSet
from headsurgeon.surgery import (
    TRAINED_TENSORS,
    HeadMask,
    HeadParameters,
    head_slices,
    load_head_slices,
)

__all__ = [
    "MaskTrainer",
    "SliceTrainer",
    "checkpointed_blocks",
    "make_trainer",
]


class SliceTrainer(nn.Module):
    """The ``"slices"`` strategy: trains :class:`HeadParameters`; the model is held outside the
    module tree, so DistributedDataParallel sees (and synchronises) only the slices."""

    def __init__(self, model: Model, heads: HeadSet, objective: Objective) -> None:
        super().__init__()
        self.params = HeadParameters(model, heads)
        self._model = [model]  # not a submodule: DDP must not see (or broadcast) frozen weights
        self.objective = objective

    def forward(self, tokens: Tensor) -> Tensor:
        return self.params.call(self._model[0], self.objective, tokens)

    def trainable(self) -> list[nn.Parameter]:
        return list(self.params.parameters())

    def after_step(self) -> None:
        self.params.write_to(self._model[0])

    def slices(self) -> dict[str, Tensor]:
        return {k: v.detach().clone() for k, v in self.params.state_dict().items()}

    def load_slices(self, slices: dict[str, Tensor]) -> None:
        self.params.load_state_dict(slices)
        self.params.write_to(self._model[0])

    def close(self) -> None:
        """Nothing to undo: the slices never touched the model's hooks or flags."""


class MaskTrainer(nn.Module):
    """The ``"mask"`` strategy: whole attention tensors of the chosen layers behind gradient
    masks (:class:`HeadMask`), frozen elements restored from a copy after every step."""

    def __init__(self, model: Model, heads: HeadSet, objective: Objective) -> None:
        super().__init__()
        self.model = model
        self.objective = objective
        self.heads = heads
        self.mask = HeadMask(model, heads).apply()
        # The parameters behind the trained tensors (on 4.x the bridge's q/k/v/o weights).
        self.named = {
            tensor.path: tensor.param
            for layer in heads.layers
            for name, tensor in head_tensors(model, layer).items()
            if name in TRAINED_TENSORS
        }
        self.frozen = {name: p.detach().clone() for name, p in self.named.items()}

    def forward(self, tokens: Tensor) -> Tensor:
        return self.objective(self.model, tokens)

    def trainable(self) -> list[nn.Parameter]:
        return list(self.named.values())

    @torch.no_grad()
    def after_step(self) -> None:
        for name, p in self.named.items():
            p.copy_(torch.where(self.mask.masks[name], p, self.frozen[name]))

    def slices(self) -> dict[str, Tensor]:
        return head_slices(self.model, self.heads, TRAINED_TENSORS)

    def load_slices(self, slices: dict[str, Tensor]) -> None:
        load_head_slices(self.model, self.heads, slices)

    def close(self) -> None:
        self.mask.remove()


def make_trainer(
    model: Model,
    heads: HeadSet,
    objective: Objective | None = None,
    *,
    strategy: str = "slices",
) -> SliceTrainer | MaskTrainer:
    """The module :func:`finetune` trains: ``trainer(tokens)`` is the objective's loss,
    ``trainer.trainable()`` the tensors to hand to the optimiser, ``trainer.after_step()`` runs
    after each optimiser step (writes the slices into the model, or restores frozen elements),
    ``trainer.close()`` removes its hooks. Every model parameter should have
    ``requires_grad=False`` first (the mask strategy re-enables its own).
    """
    if strategy not in STRATEGIES:
        raise InvalidArgumentError(
            f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}"
        )
    trainer = SliceTrainer if strategy == "slices" else MaskTrainer
    return trainer(model, heads, objective or next_token_loss)


@contextlib.contextmanager
def checkpointed_blocks(model: Model) -> Iterator[Model]:
    """``model`` whose blocks keep only their inputs for the backward pass and run again there
    (activation checkpointing), for the ``with`` block.

    The backward pass of a repair step runs through every block above the lowest trained layer;
    their attention patterns and MLP activations (``O(layers x batch x pos x (heads x pos +
    4 d_model))``) are what a step holds at long sequences and large batches. Recomputation
    costs one more forward of those blocks. The tensors a block computes with (including the
    trainable slices :class:`headsurgeon.surgery.HeadParameters` splices in with
    ``functional_call``) are captured at the forward and used again in the recomputation.
    """
    inside = threading.local()

    def checkpointed(block: nn.Module) -> Callable[..., Any]:
        forward = block.forward

        def run(*args: Any, **kwargs: Any) -> Any:
            if getattr(inside, "block", False) or not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            tensors = dict(block.named_parameters()) | dict(block.named_buffers())

            def again() -> Any:
                inside.block = True
                try:
                    return torch.func.functional_call(block, tensors, args, kwargs)
                finally:
                    inside.block = False

            return checkpoint(again, use_reentrant=False)

        return run

    blocks = list(model.blocks)
    stack = contextlib.ExitStack()
    stack.enter_context(without_kv_cache(model))  # a recomputed block would append twice
    # On the instance itself: a 4.x bridge component forwards attribute writes to the Hugging
    # Face module it wraps, whose forward it calls.
    for block in blocks:
        object.__setattr__(block, "forward", checkpointed(block))
    with stack:
        try:
            yield model
        finally:
            for block in blocks:
                object.__delattr__(block, "forward")  # the class's forward again
