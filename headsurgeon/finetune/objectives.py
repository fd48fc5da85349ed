"""What fine-tuning minimises: next-token loss by default, or the BOS mass of chosen heads."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from headsurgeon.backend import Model
from headsurgeon.backend.forward import run_to_layer
from headsurgeon.errors import (
    DataError,
    InvalidArgumentError,
)
from headsurgeon.heads import Heads, HeadSet

__all__ = [
    "Objective",
    "bos_mass_objective",
    "next_token_loss",
]

Objective = Callable[[Model, Tensor], Tensor]


def next_token_loss(
    model: Model, tokens: Int[Tensor, "batch pos"], *, chunk: int | None = None
) -> Tensor:
    """Mean next-token cross-entropy over the batch (the default objective).

    With ``chunk``, the final LayerNorm, unembedding and cross-entropy run over ``chunk``
    positions at a time, each recomputed in the backward pass (activation checkpointing): the
    same loss (to float rounding) without ever holding the whole batch's logits.
    """
    if chunk is None:
        return model(tokens, return_type="loss")
    resid = run_to_layer(model, tokens, model.cfg.n_layers)[:, :-1]
    flat = resid.reshape(-1, 1, resid.shape[-1])  # LayerNorm and unembedding are per position
    targets = tokens[:, 1:].reshape(-1).to(resid.device)

    def nll_sum(x: Tensor, target: Tensor) -> Tensor:
        logits = model.unembed(model.ln_final(x))[:, 0].float()
        return torch.nn.functional.cross_entropy(logits, target, reduction="sum")

    total = sum(
        checkpoint(nll_sum, flat[lo : lo + chunk], targets[lo : lo + chunk], use_reentrant=False)
        for lo in range(0, len(targets), chunk)
    )
    return total / len(targets)


def head_bos_mass(
    model: Model,
    tokens: Int[Tensor, "batch pos"],
    heads: Heads,
    *,
    min_query_pos: int = 1,
) -> Float[Tensor, " n_heads"]:
    """Mean attention weight on position 0 of each chosen head, over query rows from
    ``min_query_pos`` on (the census's BOS mass); differentiable. Runs only up to the last
    chosen layer. Heads come in ``HeadSet`` order."""
    if tokens.shape[1] <= min_query_pos:
        raise DataError(f"sequences of {tokens.shape[1]} tokens have no query row {min_query_pos}")
    by_layer = HeadSet.of(heads).by_layer()
    masses: dict[int, Tensor] = {}

    def keep(pattern: Float[Tensor, "batch head_index query_pos key_pos"], hook: Any) -> None:
        chosen = pattern[:, by_layer[hook.layer()], min_query_pos:, 0]
        masses[hook.layer()] = chosen.float().mean(dim=(0, 2))

    with model.hooks(fwd_hooks=[(f"blocks.{layer}.attn.hook_pattern", keep) for layer in by_layer]):
        run_to_layer(model, tokens, max(by_layer) + 1)
    return torch.cat([masses[layer] for layer in by_layer])


def bos_mass_objective(
    heads: Heads,
    target: float | None = None,
    *,
    min_query_pos: int = 1,
    lm_weight: float = 0.0,
) -> Objective:
    """An objective that makes the chosen heads attend to position 0: repair in reverse.

    ``target=None`` maximises the BOS mass (``-log`` of each head's mass). A number in (0, 1)
    pulls each head's mass to it by squared error in log-odds, ``(logit(mass) - logit(target))^2``:
    unlike squared error on the mass itself, its gradient does not vanish near 0 or 1, so targets
    such as 0.99 are reached in tens of steps. ``lm_weight`` adds that multiple of the next-token
    loss, so the heads' value and output slices learn to do as little harm as they can (as
    natural sinks do) instead of copying position 0 into every token. Train it with
    :func:`finetune` on the same heads; all other weights stay bit-identical.
    """
    if target is not None and not 0 < target < 1:
        raise InvalidArgumentError(f"target BOS mass must be in (0, 1), got {target}")
    if not (math.isfinite(lm_weight) and lm_weight >= 0):
        raise InvalidArgumentError(f"lm_weight must be >= 0, got {lm_weight}")
    goal = None if target is None else math.log(target / (1 - target))
    heads = HeadSet.of(heads)

    def objective(model: Model, tokens: Tensor) -> Tensor:
        mass = head_bos_mass(model, tokens, heads, min_query_pos=min_query_pos)
        if goal is None:
            loss = -mass.clamp_min(1e-10).log().mean()
        else:
            loss = (torch.logit(mass.clamp(1e-6, 1 - 1e-6)) - goal).pow(2).mean()
        if lm_weight:
            loss = loss + lm_weight * next_token_loss(model, tokens)
        return loss

    return objective
