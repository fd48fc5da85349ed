"""Head-level parameter surgery: choose heads, re-initialise them, train only their slices.

Every per-head attention tensor is seen in TransformerLens 3.x's layout, head on the first axis
(``W_Q``, ``W_K``, ``W_V``: ``[head, d_model, d_head]``; ``b_Q``, ``b_K``, ``b_V``:
``[head, d_head]``; ``W_O``: ``[head, d_head, d_model]``), so "a head's slice" is one index of
each. On 4.x these are views (:func:`headsurgeon.backend.weights.head_tensors`) of the bridge's
``q``/``k``/``v``/``o`` weights, the ones its forward pass reads, never of its unused fused
``qkv`` copy. The output bias ``b_O`` is shared by all heads and is never touched.

Gradient masks alone do not freeze anything under AdamW: decoupled weight decay shrinks every
element it is given, gradient or not. ``HeadParameters`` is what :mod:`headsurgeon.finetune` trains
by default: the optimiser only ever sees the chosen slices, so everything else stays bit-identical
and optimiser memory grows with the number of heads, not the size of the model.

>>> heads = HeadSet.parse("L5H9-11,L6H10")
>>> len(heads), str(heads), heads.layers
(4, 'L5H9-11,L6H10', (5, 6))
>>> str(HeadSet.parse("L1-2H0,L1H3"))
'L1H0,L1H3,L2H0'
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Bool
from torch import Tensor, nn

from headsurgeon.backend import Model, check_model
from headsurgeon.backend.shared import HEAD_TENSORS
from headsurgeon.backend.weights import check_head_tensors, head_tensors
from headsurgeon.checkpoints import save_hf
from headsurgeon.defaults import INITS
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.heads import SICK_LABELS, Heads, HeadSet
from headsurgeon.inuse import holds_model
from headsurgeon.loading import model_info
from headsurgeon.markup import markdown_text
from headsurgeon.validation import check_choice, check_int

__all__ = [
    "save_pruned",
    "HeadSet",
    "Heads",
    "reinit_heads",
    "head_masks",
    "head_slices",
    "load_head_slices",
    "HeadMask",
    "mask_gradients",
    "HeadParameters",
    "SICK_LABELS",
]

logger = logging.getLogger(__name__)

# b_K has no gradient in exact arithmetic (q·b_K shifts every logit of a query row equally, and
# softmax ignores that), so training it would only let Adam amplify rounding noise: it stays 0.
TRAINED_TENSORS = ("W_Q", "W_K", "W_V", "b_Q", "b_V", "W_O")


def check_surgery(model: Model) -> None:
    """Raise :class:`UnsupportedArchitectureError` unless every head has its own Q/K/V/O slices."""
    check_head_tensors(model)


def _head_seed(seed: int, layer: int, head: int) -> int:
    """A seed per head, so a head's new weights do not depend on which other heads are chosen."""
    digest = hashlib.sha256(f"{seed}/{layer}/{head}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@torch.no_grad()
@holds_model("reinit_heads")
def reinit_heads(
    model: Model,
    heads: Heads,
    *,
    init: str = "xavier_normal",
    seed: int = 0,
) -> None:
    """Re-initialise the chosen heads in place, as the surgery paper does.

    Each head's ``W_Q``, ``W_K``, ``W_V`` slice (``[d_model, d_head]``: Xavier fans of one head)
    is drawn afresh in float32 and cast to the model's dtype; its ``b_Q``, ``b_K``, ``b_V`` (in
    models that have them: MPT has none) and ``W_O`` slice are zeroed, so the head writes nothing
    until it is trained. ``b_O`` and every other head stay untouched. Heads draw from their own
    seeded generator: the same ``seed`` gives the same weights for a head whichever other heads
    are in ``heads``.
    """
    check_model(model, "reinit_heads", writes=True)
    check_choice(init, "init", INITS)
    seed = check_int(seed, "seed")  # "1" and 1 would hash to the same weights
    check_surgery(model)
    heads = HeadSet.of(heads, model)
    fill = getattr(nn.init, f"{init}_")
    for layer, head in heads:
        tensors = head_tensors(model, layer)
        generator = torch.Generator().manual_seed(_head_seed(seed, layer, head))
        for name in ("W_Q", "W_K", "W_V"):
            weight = tensors[name].heads(tensors[name].param)
            fresh = fill(torch.empty(weight.shape[1:], dtype=torch.float32), generator=generator)
            weight[head] = fresh.to(weight.dtype)
        for name in ("b_Q", "b_K", "b_V", "W_O"):
            if name in tensors:
                tensors[name].heads(tensors[name].param)[head] = 0


def head_masks(model: Model, heads: Heads) -> dict[str, Bool[Tensor, "..."]]:
    """``{parameter name: boolean mask}`` of the chosen heads' elements, per attention tensor.

    Names are those of ``model.named_parameters()`` (``blocks.1.attn.W_Q`` on TransformerLens
    3.x; the bridge's ``q``/``k``/``v``/``o`` weights on 4.x). Only tensors that hold a chosen
    head appear; each mask has the parameter's shape.
    """
    check_surgery(model)
    heads = HeadSet.of(heads, model)
    masks = {}
    for layer, chosen in heads.by_layer().items():
        for tensor in head_tensors(model, layer).values():
            mask = torch.zeros_like(tensor.param, dtype=torch.bool)
            tensor.heads(mask)[chosen] = True
            masks[tensor.path] = mask
    return masks


def head_slices(
    model: Model, heads: Heads, names: Iterable[str] = HEAD_TENSORS
) -> dict[str, Tensor]:
    """Copies of the chosen heads' slices of the tensors ``names`` that the model has (no
    ``b_Q``, ``b_K``, ``b_V`` without attention biases), by TransformerLens 3.x name and layout
    on either major (``blocks.1.attn.W_Q``: ``[n_chosen_in_layer1, d_model, d_head]``),
    in the parameters' dtype and device. :func:`load_head_slices` writes them back.

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(2, 4, 32, 64, 16))
    >>> saved = head_slices(model, "L1H0,L1H3", ["W_O"])
    >>> reinit_heads(model, "L1H0,L1H3")
    >>> load_head_slices(model, "L1H0,L1H3", saved)
    >>> list(saved), tuple(saved["blocks.1.attn.W_O"].shape)
    (['blocks.1.attn.W_O'], (2, 8, 32))
    >>> torch.equal(head_slices(model, "L1H0,L1H3", ["W_O"])["blocks.1.attn.W_O"],
    ...             saved["blocks.1.attn.W_O"])
    True
    """
    heads = HeadSet.of(heads, model)
    out = {}
    for layer, chosen in heads.by_layer().items():
        tensors = head_tensors(model, layer)
        for name in [name for name in names if name in tensors]:
            view = tensors[name].heads(tensors[name].param.detach())
            out[f"blocks.{layer}.attn.{name}"] = view[torch.tensor(chosen)].clone()
    return out


@torch.no_grad()
def load_head_slices(model: Model, heads: Heads, slices: Mapping[str, Tensor]) -> None:
    """Write slices taken by :func:`head_slices` for ``heads`` into the model's parameters."""
    by_layer = HeadSet.of(heads, model).by_layer()
    for key, values in slices.items():
        _, layer, _, name = key.split(".")
        tensor = head_tensors(model, int(layer))[name]
        weight = tensor.heads(tensor.param)
        weight[torch.tensor(by_layer[int(layer)])] = values.to(weight.device, weight.dtype)


class WeightSnapshot:
    """Copies of the weights a function is about to change, to put back bit for bit.

    :meth:`add_heads` copies chosen heads' slices of every per-head tensor (what
    :func:`reinit_heads` and :class:`HeadParameters` change); :meth:`add_layers` copies whole
    per-head tensors of layers (what an optimiser over whole tensors moves, the ``"mask"``
    strategy's). Add weights before changing them. A head or tensor already copied is not
    copied again, and :meth:`restore` writes the copies back latest first, so the weights come
    back as they were when each was first added. It holds only the copies, on the model's
    device: a few heads' slices cost a few heads' memory.

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(2, 4, 32, 64, 16))
    >>> before = {k: v.clone() for k, v in model.state_dict().items()}
    >>> snapshot = WeightSnapshot(model)
    >>> snapshot.add_heads("L1H0,L1H3")
    >>> reinit_heads(model, "L1H0,L1H3", seed=5)
    >>> snapshot.restore()  # True: weights had changed
    True
    >>> all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    True
    """

    def __init__(self, model: Model) -> None:
        check_surgery(model)
        self.model = model
        self._heads = HeadSet()
        self._paths: set[str] = set()
        # In the order taken: (heads, their slices) or (parameter, its whole copy).
        self._copies: list[tuple[HeadSet, dict[str, Tensor]] | tuple[nn.Parameter, Tensor]] = []

    def add_heads(self, heads: Heads) -> None:
        """Copy the slices of ``heads`` not copied yet, of every per-head tensor."""
        new = HeadSet.of(heads, self.model) - self._heads
        if new:
            self._copies.append((new, head_slices(self.model, new)))
            self._heads = self._heads | new

    def add_layers(self, layers: Iterable[int], names: Iterable[str] = HEAD_TENSORS) -> None:
        """Copy the whole tensors ``names`` (``W_Q`` ...) of ``layers`` not copied yet."""
        names = list(names)
        for layer in layers:
            for name, tensor in head_tensors(self.model, layer).items():
                if name in names and tensor.path not in self._paths:
                    self._copies.append((tensor.param, tensor.param.detach().clone()))
                    self._paths.add(tensor.path)

    @torch.no_grad()
    def restore(self) -> bool:
        """Write every copy back into the model, latest first; whether any weight had changed."""
        changed = False
        for kept, copy in reversed(self._copies):
            if isinstance(kept, HeadSet):
                now = head_slices(self.model, kept)
                changed |= any(not torch.equal(now[k], v) for k, v in copy.items())
                load_head_slices(self.model, kept, copy)
            else:
                changed |= not torch.equal(kept, copy)
                kept.copy_(copy)
        return changed


@dataclasses.dataclass
class _Guard:
    depth: int = 0  # restored_on_failure blocks open on the model
    changed: bool = False  # whether one of them, failing, found weights changed


# Per model (by id): fine-tuning inside a repair has a block inside a block. Each restores its
# own copies; only the outermost says so, and only if some block had something to put back.
_GUARDS: dict[int, _Guard] = {}


@contextlib.contextmanager
def restored_on_failure(model: Model, what: str) -> Iterator[WeightSnapshot]:
    """Context manager for a function that changes ``model``'s weights in place: on any
    exception, ``KeyboardInterrupt`` included, the weights added to the yielded
    :class:`WeightSnapshot` are put back bit for bit before the exception goes on, and one
    warning says so when any had changed (``what`` names the work: "repair", "fine-tuning").

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(2, 4, 32, 64, 16))
    >>> w_o = model.blocks[1].attn.W_O.clone()
    >>> with restored_on_failure(model, "an example") as snapshot:
    ...     snapshot.add_heads("L1H2")
    ...     reinit_heads(model, "L1H2")
    ...     raise RuntimeError("stopped halfway")
    Traceback (most recent call last):
    RuntimeError: stopped halfway
    >>> torch.equal(model.blocks[1].attn.W_O, w_o)
    True
    """
    snapshot = WeightSnapshot(model)
    guard = _GUARDS.setdefault(id(model), _Guard())
    guard.depth += 1
    try:
        yield snapshot
    except BaseException as e:
        guard.changed |= snapshot.restore()
        if guard.changed and guard.depth == 1:
            logger.warning(
                "%s stopped (%s): the model's weights are back as they were before it",
                what,
                type(e).__name__,
            )
        raise
    finally:
        guard.depth -= 1
        if not guard.depth:
            del _GUARDS[id(model)]


class HeadMask:
    """Gradient masks on the attention tensors, so only the chosen heads' slices get gradient.

    Applying it gives every tensor that holds a chosen head a hook multiplying its gradient by
    the head mask, and sets ``requires_grad=False`` on every other parameter of the model, so
    autograd builds no graph below the lowest chosen layer. :meth:`remove` (or leaving the
    ``with`` block) removes the hooks and restores each parameter's ``requires_grad``.

    A gradient mask is not a freeze: AdamW's decoupled weight decay still moves masked elements.
    Train with weight decay 0, restore frozen values after each step, or train
    :class:`HeadParameters` instead (what :func:`headsurgeon.finetune.finetune` does by default).

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(2, 4, 32, 64, 16))
    >>> with mask_gradients(model, HeadSet.parse("L1H2")) as mask:
    ...     model(torch.tensor([[1, 2, 3]]), return_type="loss").backward()
    >>> w_q = head_tensors(model, 1)["W_Q"]
    >>> grad = w_q.heads(w_q.param.grad)
    >>> bool(grad[2].abs().sum() > 0), bool(grad[[0, 1, 3]].abs().sum() == 0)
    (True, True)
    >>> w_q = head_tensors(model, 0)["W_Q"]
    >>> w_q.param.grad is None, w_q.param.requires_grad
    (True, True)
    """

    def __init__(self, model: Model, heads: Heads) -> None:
        self.model = model
        self.heads = HeadSet.of(heads, model)
        self.masks = head_masks(model, self.heads)
        self._handles: list[Any] = []
        self._requires_grad: dict[str, bool] = {}

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def apply(self) -> HeadMask:
        """Register the hooks and freeze every other parameter; returns ``self``."""
        if self.active:
            return self
        for name, param in self.model.named_parameters():
            self._requires_grad[name] = param.requires_grad
            mask = self.masks.get(name)
            param.requires_grad_(mask is not None)
            if mask is not None:
                self._handles.append(param.register_hook(_multiply_by(mask)))
        return self

    def remove(self) -> None:
        """Remove the hooks and restore ``requires_grad`` as it was before :meth:`apply`."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for name, param in self.model.named_parameters():
            if name in self._requires_grad:
                param.requires_grad_(self._requires_grad[name])
        self._requires_grad.clear()

    def __enter__(self) -> HeadMask:
        return self.apply()

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _multiply_by(mask: Tensor) -> Callable[[Tensor], Tensor]:
    def hook(grad: Tensor) -> Tensor:
        return grad * mask.to(grad.dtype)

    return hook


def mask_gradients(model: Model, heads: Heads) -> HeadMask:
    """Apply a :class:`HeadMask` and return it (call ``.remove()``, or use it in ``with``)."""
    check_model(model, "mask_gradients", writes=True)
    return HeadMask(model, heads).apply()


class HeadParameters(nn.Module):
    """Trainable float32 copies of the chosen heads' slices, spliced into the model's forward.

    The slices are those of ``TRAINED_TENSORS`` the model has: all per-head tensors but ``b_K``,
    which has no gradient (it shifts a whole row of logits) and keeps its value.

    Holds one parameter per (layer, tensor name) with the chosen heads stacked on the first
    axis, e.g. ``L5.W_Q`` of shape ``[n_chosen_in_layer5, d_model, d_head]``. :meth:`call` runs a
    function of the model with each chosen slice replaced by its trainable copy (through
    ``torch.func.functional_call``, so autograd reaches only the copies); the model's own
    parameters are never handed to an optimiser. :meth:`write_to` copies the trained values
    back into the model. Float32 copies double as master weights for bfloat16 models.

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(2, 4, 32, 64, 16))
    >>> params = HeadParameters(model, HeadSet.parse("L1H0,L1H3"))
    >>> tuple(params.slices["L1"]["W_O"].shape), params.numel()
    ((2, 8, 32), 2080)
    """

    def __init__(self, model: Model, heads: Heads) -> None:
        super().__init__()
        check_surgery(model)
        self.heads = HeadSet.of(heads, model)
        self.slices = nn.ModuleDict()
        self._index: dict[int, Tensor] = {}
        for layer, chosen in self.heads.by_layer().items():
            tensors = head_tensors(model, layer)
            index = torch.tensor(chosen, device=tensors["W_Q"].param.device)
            self._index[layer] = index
            self.slices[f"L{layer}"] = nn.ParameterDict(
                {
                    name: nn.Parameter(
                        tensors[name].heads(tensors[name].param.detach())[index].float().clone()
                    )
                    for name in TRAINED_TENSORS
                    if name in tensors
                }
            )

    def numel(self) -> int:
        """Number of trainable elements."""
        return sum(p.numel() for p in self.parameters())

    def overrides(self, model: Model) -> dict[str, Tensor]:
        """Full attention parameters (by ``named_parameters`` name) with the chosen slices taken
        from the trainable copies."""
        out = {}
        for layer, index in self._index.items():
            tensors = head_tensors(model, layer)
            for name, trained in self.slices[f"L{layer}"].items():
                full = tensors[name].param.detach().clone()
                # An in-place write through the head view: autograd reaches ``trained``.
                tensors[name].heads(full)[index] = trained.to(full.dtype)
                out[tensors[name].path] = full
        return out

    def call(self, model: Model, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(model, *args)`` with the chosen slices replaced by the trainable copies."""
        return torch.func.functional_call(
            _Apply(model, fn), {f"model.{k}": v for k, v in self.overrides(model).items()}, args
        )

    @torch.no_grad()
    def write_to(self, model: Model) -> None:
        """Copy the current trainable values into the model's own parameters."""
        for layer, index in self._index.items():
            tensors = head_tensors(model, layer)
            for name, trained in self.slices[f"L{layer}"].items():
                weight = tensors[name].heads(tensors[name].param)
                weight[index] = trained.to(weight.dtype)


@contextlib.contextmanager
def frozen_parameters(model: Model) -> Iterator[Model]:
    """Context manager: ``requires_grad=False`` on every model parameter, restored after.

    With nothing in the model requiring gradient, autograd starts at the first layer that uses a
    trainable copy (:class:`HeadParameters`): no backward work below the lowest chosen layer.

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(2, 4, 32, 64, 16))
    >>> with frozen_parameters(model):
    ...     any(p.requires_grad for p in model.parameters())
    False
    >>> all(p.requires_grad for p in model.parameters())
    True
    """
    before = {name: p.requires_grad for name, p in model.named_parameters()}
    model.requires_grad_(False)
    try:
        yield model
    finally:
        for name, p in model.named_parameters():
            p.requires_grad_(before[name])


class _Apply(nn.Module):
    """A module whose forward is ``fn(model, *args)``, for ``functional_call``."""

    def __init__(self, model: Model, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(self.model, *args)


@holds_model("save_pruned")
def save_pruned(
    model: Model,
    heads: Heads,
    out_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    dtype: str | torch.dtype | None = None,
    verify: bool = True,
) -> Path:
    """Write ``model`` with ``heads`` pruned as a Hugging Face checkpoint of its family: each
    pruned head's output slice (``W_O``) is zero, so it writes nothing to the residual stream
    (zero ablation, as :func:`headsurgeon.ablate_heads` with ``"zero"`` computes it), and every
    other weight is the model's. Transformers 5 removed ``prune_heads`` and ``head_mask``, so a
    checkpoint is where a pruning lives now; the heads' Q/K/V weights stay (the layout keeps
    every head), and ``b_O`` is the layer's, untouched.

    Written by :func:`headsurgeon.save_hf` (checked by reload unless ``verify=False``; its
    ``overwrite`` and ``dtype``), with a model card (``README.md``) that names the pruned heads.
    ``model`` itself is not changed: its ``W_O`` slices are restored after the write, also when
    the write fails.

    >>> import tempfile, torch
    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(2, 4, 32, 64, 16))
    >>> w_o = model.blocks[1].attn.W_O.clone()
    >>> folder = save_pruned(model, "L1H0,L1H3", tempfile.mkdtemp() + "/pruned")
    >>> "L1H0, L1H3" in (folder / "README.md").read_text()
    True
    >>> torch.equal(model.blocks[1].attn.W_O, w_o)  # the model as it was
    True
    """
    info = model_info(model, "save_pruned", writes=True)
    check_surgery(model)
    chosen = HeadSet.of(heads, info.shape)
    if not chosen:
        raise InvalidArgumentError("nothing to prune: the head set is empty")
    kept = head_slices(model, chosen, ["W_O"])
    card = (
        f"## Pruned heads\n\n{len(chosen)} head(s) pruned: {', '.join(chosen.names())}. Their "
        "output projection slices (`W_O`) are zero, so they write nothing to the residual "
        f"stream; every other weight is {markdown_text(info.name)}'s, unchanged (their query, "
        "key and value weights stay in place: the layout keeps every head)."
    )
    try:
        with torch.no_grad():
            for layer, head in chosen:
                w_o = head_tensors(model, layer)["W_O"]
                w_o.heads(w_o.param)[head] = 0
        return save_hf(model, out_dir, overwrite=overwrite, dtype=dtype, verify=verify, card=card)
    finally:
        load_head_slices(model, chosen, kept)
