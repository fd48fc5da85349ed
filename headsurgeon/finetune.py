"""Masked fine-tuning: train only the chosen heads' slices; everything else stays bit-identical.

Exports:
    FinetuneConfig                      optimiser, schedule, precision, evaluation, checkpoints
    FinetuneResult                      history of a run (per-step losses, per-evaluation metrics)
    finetune(model, heads, train, ...)  AdamW + warm-up/cosine on the chosen heads; resumable, DDP
    make_trainer(model, heads, ...)     the module a step trains (SliceTrainer or MaskTrainer)
    next_token_loss(model, tokens)      the default objective: mean next-token cross-entropy
                                        (``chunk=``: over that many positions at a time)
    checkpointed_blocks(model)          context manager: blocks recomputed in the backward pass
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

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import logging
import math
import os
import pickle
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
from jaxtyping import Float, Int
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from headsurgeon.backend import (
    Model,
    check_model,
    head_tensors,
    run_to_layer,
    without_kv_cache,
)
from headsurgeon.data import check_token_ids
from headsurgeon.dtypes import check_trainable
from headsurgeon.errors import (
    CheckpointError,
    DataError,
    HeadsurgeonError,
    InvalidArgumentError,
    OutputExistsError,
    first_line,
)
from headsurgeon.inputs import check_regular_file
from headsurgeon.outputs import atomic_write_bytes
from headsurgeon.progress import tqdm
from headsurgeon.surgery import (
    TRAINED_TENSORS,
    HeadMask,
    HeadParameters,
    Heads,
    HeadSet,
    check_surgery,
    head_masks,
    head_slices,
    load_head_slices,
    restored_on_failure,
)
from headsurgeon.validation import check_bool, check_choice, check_int, check_number

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
    "warmup_cosine",
    "weights_digest",
]

logger = logging.getLogger(__name__)

Objective = Callable[[Model, Tensor], Tensor]
CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_FORMAT = 1
STRATEGIES = ("slices", "mask")
# Settings that may change between an interrupted run and its resumption.
_RESUME_FREE = ("checkpoint_every",)
# What a checkpoint holds besides its identity (see _Loop.save).
_STATE_KEYS = ("step", "slices", "optimizer", "scheduler", "rng", "progress")
_IDENTITY_KEYS = ("model", "heads", "fingerprint", "world_size", "config")
_CHECKPOINT_FIX = "delete it to train from step 0, or start over in a new output folder"


class TrainingDivergedError(HeadsurgeonError, FloatingPointError):
    """The loss or the gradient norm became NaN or infinite; the last good checkpoint is kept."""


@dataclasses.dataclass
class FinetuneConfig:
    """Settings of a masked fine-tuning run (defaults: the surgery paper's, without bfloat16).

    ``warmup_steps=None`` means ``min(100, steps // 4)``. ``batch_size`` is per process: with
    ``N`` data-parallel processes a step sees ``N * batch_size * grad_accum`` sequences.
    ``eval_every=None`` evaluates ten times per run; ``patience`` stops after that many
    evaluations without a lower held-out loss (and ``restore_best`` goes back to the best one).
    ``checkpoint_every=None`` checkpoints at every evaluation.

    Memory (the defaults are the fastest; see the README's sizes section for measurements):
    ``gradient_checkpointing`` keeps only each block's input for the backward pass and
    recomputes the block there (:func:`checkpointed_blocks`); ``loss_chunk`` computes the default
    next-token loss over that many positions at a time, so the float32 logits of the whole batch
    (``batch x pos x vocabulary``: 0.5 GB per 512-token sequence of BLOOM's 250,880 tokens) are
    never held at once (:func:`next_token_loss`).
    """

    steps: int = 200
    lr: float = 5e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int | None = None
    batch_size: int = 8
    grad_accum: int = 1
    max_grad_norm: float | None = 1.0
    autocast: str | None = None
    eval_every: int | None = None
    eval_seqs: int = 16
    patience: int | None = None
    restore_best: bool = True
    checkpoint_every: int | None = None
    min_query_pos: int = 1
    strategy: str = "slices"
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
        self.seed = check_int(self.seed, "seed")
        return self

    @property
    def warmup(self) -> int:
        return min(100, self.steps // 4) if self.warmup_steps is None else self.warmup_steps

    @property
    def eval_interval(self) -> int:
        return self.eval_every or max(1, self.steps // 10)

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


def warmup_cosine(warmup: int, steps: int) -> Callable[[int], float]:
    """Learning-rate factor of step ``i`` (0-based): linear warm-up to 1, then cosine towards 0.

    >>> f = warmup_cosine(warmup=0, steps=4)
    >>> [round(f(i), 3) for i in range(4)]
    [1.0, 0.854, 0.5, 0.146]
    """

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (i - warmup) / max(1, steps - warmup)))

    return factor


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


@dataclasses.dataclass
class DistInfo:
    rank: int
    world_size: int
    device: torch.device


def setup_distributed(device: str | torch.device = "cpu") -> DistInfo:
    """Join the process group when launched by ``torchrun`` (``WORLD_SIZE`` > 1).

    Uses NCCL and ``cuda:LOCAL_RANK`` for CUDA devices, gloo on CPU. Without torchrun it returns
    rank 0 of 1 and changes nothing.
    """
    device = torch.device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend)
    rank, world = _dist_rank_world()
    return DistInfo(rank=rank, world_size=world, device=device)


def _dist_rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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


def weights_digest(model: Model, excluding: HeadSet | None = None) -> str:
    """A short digest of every weight bit, except the slices of the heads in ``excluding``.

    Resuming checks it: a run can only continue on the same frozen weights.
    """
    masks = head_masks(model, excluding) if excluding else {}
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        values = p.detach()
        if name in masks:
            values = values.masked_fill(masks[name], 0)
        digest.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        digest.update(values.contiguous().cpu().view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def _global_rows(
    n: int, step: int, micro: int, cfg: FinetuneConfig, global_batch: int, cache: dict
) -> Tensor:
    """Rows of one global micro-batch: consecutive positions in a stream of seeded epoch shuffles,
    so the data order depends only on the step (resume needs no data-loader state)."""
    start = (step * cfg.grad_accum + micro) * global_batch
    rows = []
    for position in range(start, start + global_batch):
        epoch = position // n
        if epoch not in cache:
            generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
            cache.clear()  # epochs are visited in order: keep one permutation
            cache[epoch] = torch.randperm(n, generator=generator)
        rows.append(int(cache[epoch][position % n]))
    return torch.tensor(rows)


def _evaluate(
    model: Model,
    heads: HeadSet,
    cfg: FinetuneConfig,
    train_eval: Tensor,
    heldout: Tensor | None,
) -> dict[str, float]:
    from headsurgeon.evals import perplexity

    window = train_eval.shape[1]
    row: dict[str, float] = {
        "train_ppl": perplexity(
            model, train_eval, window=window, prepend_bos=False, max_windows=None, progress=False
        )
    }
    row["heldout_ppl"] = (
        perplexity(
            model,
            heldout,
            window=heldout.shape[1],
            prepend_bos=False,
            max_windows=None,
            progress=False,
        )
        if heldout is not None
        else float("nan")
    )
    with torch.no_grad():
        mass = head_bos_mass(
            model,
            (heldout if heldout is not None else train_eval).to(model.cfg.device),
            heads,
            min_query_pos=cfg.min_query_pos,
        )
    row["bos_mass"] = mass.mean().item()
    row["bos_mass_max"] = mass.max().item()
    return row


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def load_torch_file(path: str | os.PathLike, what: str, *, fix: str) -> Any:
    """What headsurgeon's ``torch.save`` wrote to ``path`` (tensors in dicts and lists, on the
    CPU); one :class:`CheckpointError` line (``what`` names the file's role, ``fix`` says what to
    do) for anything else.

    Every resume file goes through here. Only ``torch.load(weights_only=True)`` reads: a file
    holding any other Python object (a planted pickle could run code when loaded) is refused
    unread, and never loaded in a less careful mode.
    """
    path = check_regular_file(path, what, error=CheckpointError)
    try:
        with warnings.catch_warnings():  # a raw pickle's protocol warning: it fails next anyway
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # torch's own message suggests weights_only=False, i.e. running the file's code: not here.
        raise CheckpointError(
            f"{what} {path} is not a trusted file written by headsurgeon (it holds Python "
            f"objects headsurgeon never saves), so it was not loaded; {fix}"
        ) from None
    except Exception as e:  # torch raises several types for a truncated or corrupt file
        detail = first_line(e)
        detail = "" if "weights_only" in detail else f" ({detail[:200]})"
        raise CheckpointError(f"{what} {path} is not readable{detail}; {fix}") from None


def load_checkpoint(checkpoint_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The checkpoint in ``checkpoint_dir`` as a dict, or None when there is none.

    Its format and the types of its parts are checked (one :class:`CheckpointError` line
    otherwise); whether it fits a run is checked when a run resumes from it.
    """
    path = Path(checkpoint_dir) / CHECKPOINT_FILE
    if not (path.exists() or path.is_symlink()):
        return None
    state = load_torch_file(path, "checkpoint", fix=_CHECKPOINT_FIX)
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise _bad_checkpoint(path, "has an unknown format")
    missing = [key for key in (*_IDENTITY_KEYS, *_STATE_KEYS) if key not in state]
    if missing:
        raise _bad_checkpoint(path, f"lacks {', '.join(missing)}")
    types = {"step": int, "slices": dict, "optimizer": dict, "scheduler": dict, "rng": dict,
             "progress": dict}  # fmt: skip
    for key, kind in types.items():
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            raise _bad_checkpoint(path, f"holds a {type(state[key]).__name__} as its {key}")
    return state


def _bad_checkpoint(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} {problem}: training cannot resume from it; {_CHECKPOINT_FIX}"
    )


def _tensors_like(
    given: object, expected: dict[str, Tensor], path: Path, what: str
) -> dict[str, Tensor]:
    """``given`` if it maps exactly the names of ``expected`` to floating-point tensors of the
    same shapes; else one line naming the first difference."""
    if not isinstance(given, dict) or set(given) != set(expected):
        names = sorted(given) if isinstance(given, dict) else type(given).__name__
        raise _bad_checkpoint(path, f"holds {what} {str(names)[:120]}, not {sorted(expected)}")
    for name, tensor in expected.items():
        value = given[name]
        if not (isinstance(value, Tensor) and value.is_floating_point()):
            raise _bad_checkpoint(path, f"holds no floating-point tensor as {what} {name}")
        if value.shape != tensor.shape:
            raise _bad_checkpoint(
                path, f"holds {what} {name} of shape {tuple(value.shape)}, not "
                f"{tuple(tensor.shape)}",
            )  # fmt: skip
    return given


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _config_dict(cfg: FinetuneConfig) -> dict[str, Any]:
    out = dataclasses.asdict(cfg)
    out["betas"] = list(out["betas"])
    for key in _RESUME_FREE:
        out.pop(key)
    return out


def _check_resume(state: dict, path: Path, expected: dict[str, Any]) -> None:
    for key, value in expected.items():
        if state[key] != value:
            what = "model" if key in ("model", "fingerprint") else key.replace("_", " ")
            stored = str(state[key])
            stored = stored if len(stored) <= 200 else stored[:197] + "..."
            raise CheckpointError(
                f"checkpoint {path} is from a run with a different {what} "
                f"({stored} vs {value}); resume with the same model and settings or start "
                "a new output folder"
            )


def finetune(
    model: Model,
    heads: Heads,
    train: Int[Tensor, "batch pos"],
    *,
    eval_data: Int[Tensor, "batch pos"] | None = None,
    config: FinetuneConfig | None = None,
    objective: Objective | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    resume: bool = False,
    progress: bool = True,
) -> FinetuneResult:
    """Train the chosen heads' slices in place; every other weight stays bit-identical.

    ``train`` and ``eval_data`` are token sequences (e.g. from
    :func:`headsurgeon.data.to_sequences`; position 0 already follows the model's convention).
    Batches come from seeded shuffles of ``train``, so a run is reproducible on CPU. Evaluation
    (every ``config.eval_interval`` steps, at step 0 and at the end) reports training and
    held-out perplexity on up to ``eval_seqs`` sequences and the trained heads' BOS mass.

    With ``checkpoint_dir``, ``checkpoint.pt`` (trained slices, optimiser, scheduler, RNG state,
    history) is written atomically every ``config.checkpoint_interval`` steps and at the end, by
    rank 0 only. ``resume=True`` continues from it (the result is bit-identical to an
    uninterrupted run); without it an existing checkpoint is an error, never overwritten. Under
    ``torchrun`` (an initialised process group) the trainable tensors are wrapped in
    ``DistributedDataParallel`` and each process takes its share of every batch.

    If the call fails (any exception, :class:`TrainingDivergedError` on a NaN or infinite loss or
    gradient, ``KeyboardInterrupt`` included), the model gets back the weights it had before the
    call, bit for bit, and one warning says so; the last checkpoint is untouched, so
    ``resume=True`` continues from it.
    """
    check_model(model, "finetune", writes=True)
    check_surgery(model)  # heads sharing keys and values: one line, before the data is read
    job = _make_job(model, heads, train, eval_data, config, checkpoint_dir, resume, progress)
    with restored_on_failure(model, "fine-tuning") as snapshot:
        if job.cfg.strategy == "mask":  # the optimiser moves whole tensors before after_step
            snapshot.add_layers(job.heads.layers, TRAINED_TENSORS)
        else:
            snapshot.add_heads(job.heads)
        model_grad = {name: p.requires_grad for name, p in model.named_parameters()}
        model.requires_grad_(False)  # the mask strategy re-enables its own tensors
        try:
            if objective is None and job.cfg.loss_chunk is not None:
                objective = functools.partial(next_token_loss, chunk=job.cfg.loss_chunk)
            objective = objective or next_token_loss
            trainer = make_trainer(model, job.heads, objective, strategy=job.cfg.strategy)
            try:
                return _Loop(job, trainer).run()
            finally:
                trainer.close()
        finally:
            for name, p in model.named_parameters():
                p.requires_grad_(model_grad[name])


@dataclasses.dataclass
class _Job:
    """A fine-tuning run's validated inputs (made by :func:`_make_job`)."""

    model: Model
    heads: HeadSet
    cfg: FinetuneConfig
    train: Tensor
    train_eval: Tensor  # up to eval_seqs training rows, spread evenly
    heldout: Tensor | None  # up to eval_seqs held-out rows
    identity: dict[str, Any]  # what a resumed checkpoint must match
    device: torch.device
    rank: int
    world: int
    checkpoint_dir: Path | None
    resume: bool
    progress: bool

    @property
    def checkpoint_path(self) -> Path | None:
        return self.checkpoint_dir / CHECKPOINT_FILE if self.checkpoint_dir is not None else None


def _make_job(
    model: Model,
    heads: Heads,
    train: Any,
    eval_data: Any,
    config: FinetuneConfig | None,
    checkpoint_dir: str | os.PathLike | None,
    resume: bool,
    progress: bool,
) -> _Job:
    """Check :func:`finetune`'s inputs once; the evaluation rows and the run's identity."""
    cfg = (config or FinetuneConfig()).validate()
    heads = HeadSet.of(heads, model)
    if not heads:
        raise InvalidArgumentError("nothing to fine-tune: the head set is empty")
    check_trainable(model.cfg.dtype)
    rank, world = _dist_rank_world()
    train = _check_tokens(model, train, "training")
    if eval_data is not None:
        eval_data = _check_tokens(model, eval_data, "evaluation")
    global_batch = cfg.batch_size * world
    if len(train) < global_batch:
        raise DataError(
            f"the training data has {len(train)} sequences, fewer than one batch of "
            f"{global_batch}; give more text or a smaller batch size"
        )
    if cfg.patience is not None and eval_data is None:
        raise InvalidArgumentError("early stopping (patience) needs held-out evaluation data")
    spread = torch.linspace(0, len(train) - 1, min(cfg.eval_seqs, len(train))).round().long()
    identity = {
        "model": model.cfg.model_name,
        "heads": str(heads),
        "fingerprint": weights_digest(model, excluding=heads),
        "world_size": world,
        "config": _config_dict(cfg),
    }
    return _Job(
        model=model,
        heads=heads,
        cfg=cfg,
        train=train,
        train_eval=train[spread],
        heldout=eval_data[: cfg.eval_seqs] if eval_data is not None else None,
        identity=identity,
        device=torch.device(model.cfg.device),
        rank=rank,
        world=world,
        checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir is not None else None,
        resume=resume,
        progress=progress,
    )


def _check_tokens(model: Model, tokens: Any, what: str) -> Tensor:
    """:func:`headsurgeon.data.check_token_ids`, its message saying which data it was."""
    try:
        return check_token_ids(model, tokens)
    except DataError as e:
        raise DataError(f"{what} data: {e}") from None


@dataclasses.dataclass
class _Progress:
    """What a run has done so far; a checkpoint holds it as a plain dict (:meth:`to_dict`)."""

    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    since_eval: list[float] = dataclasses.field(default_factory=list)  # losses since evaluation
    best_loss: float = math.inf
    best_step: int | None = None
    best_slices: dict[str, Tensor] | None = None
    bad_evals: int = 0
    stopped_early: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


def _check_progress(
    progress: dict[str, Any], step: int, slices: dict[str, Tensor], path: Path
) -> None:
    """One line unless ``progress`` is a :meth:`_Progress.to_dict` of a run at ``step``."""
    fields = [field.name for field in dataclasses.fields(_Progress)]
    if sorted(progress) != sorted(fields):
        raise _bad_checkpoint(path, "holds a progress record of another shape")
    lists = [progress[name] for name in ("losses", "since_eval", "history")]
    if not all(isinstance(items, list) for items in lists):
        raise _bad_checkpoint(path, "holds a progress record of another shape")
    numbers = progress["losses"] + progress["since_eval"] + [progress["best_loss"]]
    rows = progress["history"]
    problems = [
        (not all(map(_is_number, numbers)), "losses that are not numbers"),
        (len(progress["losses"]) != step, f"{len(progress['losses'])} losses for {step} steps"),
        (not all(isinstance(r, dict) and all(map(_is_number, r.values())) for r in rows),
         "an evaluation history that is not rows of numbers"),
        (not isinstance(progress["bad_evals"], int), "a count of evaluations that is no integer"),
        (not isinstance(progress["stopped_early"], bool), "no early-stopping flag"),
        (not (progress["best_step"] is None or isinstance(progress["best_step"], int)),
         "a best step that is no integer"),
    ]  # fmt: skip
    for failed, problem in problems:
        if failed:
            raise _bad_checkpoint(path, f"holds {problem}")
    if progress["best_slices"] is not None:
        _tensors_like(progress["best_slices"], slices, path, "best slices")


class _Loop:
    """The training loop of one :class:`_Job`: optimiser, schedule, checkpoints, evaluations."""

    def __init__(self, job: _Job, trainer: SliceTrainer | MaskTrainer) -> None:
        self.job, self.trainer = job, trainer
        cfg, device = job.cfg, job.device
        self.params = trainer.trainable()
        self.module: nn.Module = trainer
        if job.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.module = DistributedDataParallel(
                trainer, device_ids=[device.index] if device.type == "cuda" else None,
                broadcast_buffers=False,
            )  # fmt: skip
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(cfg.warmup, cfg.steps)
        )
        self.state = _Progress()
        self.step = 0
        self.resumed_from: int | None = None
        self.saved_step: int | None = None  # of the checkpoint on disk, if any
        self.rows_cache: dict[int, Tensor] = {}

    def restore(self) -> None:
        """Continue from the checkpoint in the job's folder, if there is one (and it may)."""
        job = self.job
        checkpoint = load_checkpoint(job.checkpoint_dir) if job.checkpoint_dir is not None else None
        if checkpoint is None:
            return
        path = job.checkpoint_path
        if not job.resume:
            raise OutputExistsError(
                f"{path} holds a checkpoint; continue it (resume=True, --resume) or use another "
                "folder"
            )
        _check_resume(checkpoint, path, job.identity)
        self.check_state(checkpoint, path)
        self.trainer.load_slices(checkpoint["slices"])
        try:  # the parts are checked; torch checks the rest of what it reads
            self.optimizer.load_state_dict(checkpoint["optimizer"])
            self.scheduler.load_state_dict(checkpoint["scheduler"])
            _set_rng_state(checkpoint["rng"])
        except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as e:
            raise _bad_checkpoint(
                path, f"holds an unusable optimiser, schedule or random state ({first_line(e)})"
            ) from None
        self.state = _Progress(**checkpoint["progress"])
        self.step = self.resumed_from = self.saved_step = checkpoint["step"]
        logger.info("resuming %s from step %d", job.heads, self.step)

    def check_state(self, checkpoint: dict[str, Any], path: Path) -> None:
        """One line unless the checkpoint's training state fits this run: its step, the names
        and shapes of its slices and optimiser moments, its schedule, random and progress
        state (a truncated, hand-edited or foreign file is refused before any of it is used)."""
        step = checkpoint["step"]
        if not 0 <= step <= self.job.cfg.steps:
            raise _bad_checkpoint(path, f"is at step {step}, outside 0-{self.job.cfg.steps}")
        expected = self.trainer.slices()
        _tensors_like(checkpoint["slices"], expected, path, "slices")
        optimizer = checkpoint["optimizer"]
        groups, moments = optimizer.get("param_groups"), optimizer.get("state")
        if not (isinstance(groups, list) and len(groups) == 1 and isinstance(moments, dict)):
            raise _bad_checkpoint(path, "holds an optimiser state of another shape")
        for index, entry in moments.items():
            if not (isinstance(index, int) and 0 <= index < len(self.params)):
                raise _bad_checkpoint(path, f"holds optimiser state for a tensor {index!r}")
            shape = self.params[index].shape
            for name in ("exp_avg", "exp_avg_sq"):
                moment = entry.get(name) if isinstance(entry, dict) else None
                if not (isinstance(moment, Tensor) and moment.shape == shape):
                    raise _bad_checkpoint(path, f"holds no {name} of shape {tuple(shape)}")
        scheduler = checkpoint["scheduler"]
        if set(scheduler) != set(self.scheduler.state_dict()) or scheduler["last_epoch"] != step:
            raise _bad_checkpoint(path, f"holds a schedule that is not at step {step}")
        rng = checkpoint["rng"].get("torch")
        if not (isinstance(rng, Tensor) and rng.dtype == torch.uint8
                and rng.shape == torch.get_rng_state().shape):  # fmt: skip
            raise _bad_checkpoint(path, "holds no usable random state")
        _check_progress(checkpoint["progress"], step, expected, path)

    def save(self) -> None:
        path = self.job.checkpoint_path
        if path is None:
            return
        if self.job.rank == 0:
            _save_checkpoint(
                path,
                {
                    "format": CHECKPOINT_FORMAT, **self.job.identity, "step": self.step,
                    "slices": self.trainer.slices(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "rng": _rng_state(),
                    "progress": self.state.to_dict(),
                },
            )  # fmt: skip
        self.saved_step = self.step  # every rank: its divergence message names the checkpoint

    def evaluate(self) -> None:
        job, state = self.job, self.state
        losses = state.since_eval
        row = {
            "step": self.step,
            "lr": self.optimizer.param_groups[0]["lr"],
            "train_loss": sum(losses) / len(losses) if losses else math.nan,
        }
        row.update(_evaluate(job.model, job.heads, job.cfg, job.train_eval, job.heldout))
        state.history.append(row)
        state.since_eval = []
        # Only what was measured: no loss before the first step, no held-out ppl without data.
        known = [f"loss {row['train_loss']:.4f}"] if losses else []
        known.append(f"train ppl {row['train_ppl']:.3f}")
        if job.heldout is not None:
            known.append(f"held-out ppl {row['heldout_ppl']:.3f}")
        logger.info("step %d: %s, BOS mass %.3f", self.step, ", ".join(known), row["bos_mass"])
        heldout_loss = math.log(row["heldout_ppl"]) if job.heldout is not None else math.nan
        if heldout_loss < state.best_loss:
            state.best_loss, state.best_step = heldout_loss, self.step
            state.best_slices, state.bad_evals = self.trainer.slices(), 0
        elif job.cfg.patience is not None:
            state.bad_evals += 1
            state.stopped_early = state.bad_evals >= job.cfg.patience

    def train_step(self, autocast: torch.autocast) -> float:
        """One optimiser step over ``grad_accum`` micro-batches; its mean loss."""
        job, cfg, step = self.job, self.job.cfg, self.step
        total = torch.zeros((), device=job.device)
        for micro in range(cfg.grad_accum):
            rows = _global_rows(
                len(job.train), step, micro, cfg, cfg.batch_size * job.world, self.rows_cache
            )
            mine = rows[job.rank * cfg.batch_size : (job.rank + 1) * cfg.batch_size]
            batch = job.train[mine].to(job.device)
            sync = micro == cfg.grad_accum - 1 or job.world == 1
            with contextlib.nullcontext() if sync else self.module.no_sync(), autocast:
                loss = self.module(batch).float() / cfg.grad_accum
            loss.backward()
            total += loss.detach()
        if job.world > 1:
            dist.all_reduce(total)
            total /= job.world
        loss_value = total.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm or math.inf)
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm.item())):
            self.optimizer.zero_grad(set_to_none=True)
            path = job.checkpoint_path
            kept = (
                f"checkpoint {path} (step {self.saved_step}) is kept"
                if self.saved_step is not None
                else "no checkpoint was written"
            )
            raise TrainingDivergedError(
                f"loss {loss_value} (gradient norm {grad_norm.item()}) at step {step + 1}: "
                f"training stopped, the model keeps its weights from before fine-tuning and "
                f"{kept}; lower the learning rate or train in float32"
            )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.trainer.after_step()
        self.step += 1
        self.state.losses.append(loss_value)
        self.state.since_eval.append(loss_value)
        return loss_value

    def run(self) -> FinetuneResult:
        job, cfg = self.job, self.job.cfg
        self.restore()
        state = self.state
        if not state.history:
            self.evaluate()
        enabled = cfg.autocast == "bfloat16"
        autocast = torch.autocast(job.device.type, dtype=torch.bfloat16, enabled=enabled)
        bar = tqdm(
            total=cfg.steps, initial=self.step, desc=f"fine-tune {len(job.heads)} heads",
            disable=not job.progress or job.rank != 0, dynamic_ncols=True,
        )  # fmt: skip
        recompute = checkpointed_blocks(job.model) if cfg.gradient_checkpointing else None
        with recompute or contextlib.nullcontext():  # evaluations (no gradient) pass through
            while self.step < cfg.steps and not state.stopped_early:
                loss_value = self.train_step(autocast)
                bar.update()
                lr = self.optimizer.param_groups[0]["lr"]
                bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}")
                if self.step % cfg.eval_interval == 0 or self.step == cfg.steps:
                    self.evaluate()
                if self.step % cfg.checkpoint_interval == 0 and self.step < cfg.steps:
                    self.save()
        bar.close()
        if state.stopped_early:
            logger.info("early stop at step %d: no better held-out loss in %d evaluations",
                        self.step, cfg.patience)  # fmt: skip
            if cfg.restore_best and state.best_slices is not None:
                self.trainer.load_slices(state.best_slices)
                self.trainer.after_step()
        self.save()
        return FinetuneResult(
            heads=job.heads,
            config=cfg,
            steps_done=self.step,
            stopped_early=state.stopped_early,
            best_step=state.best_step,
            history=pd.DataFrame(state.history),
            losses=list(state.losses),
            resumed_from=self.resumed_from,
        )
