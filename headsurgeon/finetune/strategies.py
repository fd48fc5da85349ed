"""The slices and masks machinery: how a fine-tuning step trains the chosen heads only.

Both strategies keep frozen weights frozen under any AdamW setting, weight decay included; see
:mod:`headsurgeon.finetune` for when to use which.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pandas as pd
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from headsurgeon.backend import Model, without_kv_cache
from headsurgeon.backend.weights import head_tensors
from headsurgeon.data import check_token_ids
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.finetune.config import STRATEGIES, FinetuneConfig
from headsurgeon.finetune.objectives import Objective, next_token_loss
from headsurgeon.heads import Heads, HeadSet
from headsurgeon.loading import model_info
from headsurgeon.surgery import (
    TRAINED_TENSORS,
    HeadMask,
    HeadParameters,
    frozen_parameters,
    head_slices,
    load_head_slices,
)

__all__ = [
    "MaskTrainer",
    "checkpointed_blocks",
    "make_trainer",
    "unmovable_heads",
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


# Why a head with zero value and output slices is an exact saddle of fine-tuning (rule
# "structural"): its values v = x W_V + b_V are 0, so z = pattern @ v = 0 and the head writes
# z W_O = 0. Backward: dL/dW_O = z^T dL/dout = 0 (z = 0); dL/dz = dL/dout W_O^T = 0 (W_O = 0),
# so dL/dv = pattern^T dL/dz = 0 (hence dL/dW_V = x^T dL/dv = 0 and dL/db_V = 0) and
# dL/dpattern = dL/dz v^T = 0, whose softmax backward p * (g - sum(p g)) is 0 (hence dL/dW_Q,
# dL/db_Q, dL/dW_K = 0). Each is a product with an exactly zero factor or a sum of exact zeros:
# 0.0 in floating point too, whatever the data. AdamW's moments then stay 0 and its update is
# 0 / (sqrt(0) + eps) = 0; decoupled weight decay scales zeros to zeros (it may shrink W_Q and
# W_K, moving the pattern, never z). Every step keeps the saddle: only new W_V / W_O values,
# i.e. re-initialisation, can move the head. A zero W_O alone or a zero W_V alone is no saddle
# (the other slice's gradient is not 0).
_VALUE_OUTPUT = ("W_V", "b_V", "W_O")
_STRUCTURAL = "value and output weights all zero: every gradient exactly 0"
_MEASURED = "every gradient of its slices exactly 0 in a backward pass on a training batch"


def unmovable_heads(
    model: Model, heads: Heads, tokens: Tensor, config: FinetuneConfig | None = None
) -> pd.DataFrame:
    """Which of ``heads`` fine-tuning (of the default objective) cannot move from the weights
    they have: one row per head, ``name``, ``layer``, ``head``, ``structural`` (its ``W_V``,
    ``b_V`` where the model has it, and ``W_O`` slices all exactly 0: every gradient is exactly 0
    by construction, see the comment above), ``zero_gradient`` (one backward pass of the
    next-token loss on ``tokens``, only the heads' trained slices requiring gradient, gave
    exactly 0.0 for every element of its slices), ``movable`` (neither) and ``why_unmovable``
    (None, or the rule that caught it; the structural one first).

    ``model``: checked for surgery by the caller; ``heads``: the targets; ``tokens``: one
    training batch ``[batch, seq]``; ``config``: its ``loss_chunk``, ``gradient_checkpointing``
    and ``autocast`` as training uses them (default: none of them).
    """
    heads = HeadSet.of(heads, model)
    tokens = check_token_ids(model_info(model, "unmovable_heads"), tokens)  # before any forward
    cfg = config or FinetuneConfig()
    structural = {}
    for layer, head in heads:
        tensors = head_tensors(model, layer)
        structural[layer, head] = all(
            not tensors[name].heads(tensors[name].param.detach())[head].any()
            for name in _VALUE_OUTPUT
            if name in tensors
        )
    objective = (
        next_token_loss
        if cfg.loss_chunk is None
        else functools.partial(next_token_loss, chunk=cfg.loss_chunk)
    )
    device = torch.device(model.cfg.device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast == "bfloat16")
    recompute = checkpointed_blocks(model) if cfg.gradient_checkpointing else None
    with frozen_parameters(model), recompute or contextlib.nullcontext(), torch.enable_grad():
        params = HeadParameters(model, heads)
        with autocast:
            loss = params.call(model, objective, tokens.to(device)).float()
        names = [(layer, name) for layer, group in params.slices.items() for name in group]
        grads = torch.autograd.grad(loss, list(params.parameters()), allow_unused=True)
    by_slice = dict(zip(names, grads, strict=True))
    rows = []
    for layer, chosen in heads.by_layer().items():
        for i, head in enumerate(chosen):
            zero = all(
                grad is None or not grad[i].any()
                for (key, _), grad in by_slice.items()
                if key == f"L{layer}"
            )
            caught = structural[layer, head]
            rows.append(
                {
                    "name": f"L{layer}H{head}",
                    "layer": layer,
                    "head": head,
                    "structural": caught,
                    "zero_gradient": zero,
                    "movable": not (caught or zero),
                    "why_unmovable": _STRUCTURAL if caught else _MEASURED if zero else None,
                }
            )
    return pd.DataFrame(rows)
