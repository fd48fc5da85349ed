"""TransformerLens 3.x: a ``HookedTransformer`` built one part at a time from its checkpoint.

TransformerLens 3.x converts a whole Hugging Face model into a whole ``HookedTransformer``; a
model placed with a ``device_map`` (:mod:`headsurgeon.placement`) would need its full size in
memory, twice over, before Accelerate could spread it. Here the ``HookedTransformer`` is built on
the meta device (no weights), then each part (``embed``, ``blocks.0``, ..., ``ln_final``,
``unembed``) is read from the checkpoint, converted by TransformerLens's own BLOOM conversion and
handed to ``place`` (its device, or the disk), one part at a time: peak memory is what the
placement keeps plus one part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from headsurgeon.backend import BACKEND, Model
from headsurgeon.backend.tl3 import tl3_config, unused_positions

__all__ = [
    "fill",
    "parts",
]

BOUNDED_ARCHITECTURES = BACKEND.bounded_architectures

# The Hugging Face tensors (BloomForCausalLM's names) each TransformerLens part is made from.
_NORM = ("weight", "bias")
_EMBED = ("transformer.word_embeddings.weight",) + tuple(
    f"transformer.word_embeddings_layernorm.{n}" for n in _NORM
)


def _sources(part: str, config: Any) -> tuple[str, ...]:
    if part == "embed":
        return _EMBED
    if part == "unembed":
        tied = config.tie_word_embeddings
        return ("transformer.word_embeddings.weight",) if tied else ("lm_head.weight",)
    if part == "ln_final":
        return tuple(f"transformer.ln_f.{n}" for n in _NORM)
    if part.startswith("blocks."):
        layer = int(part.split(".")[1])
        return ("transformer.h." + str(layer) + ".",)  # a prefix: every tensor of the layer
    return ()  # pos_embed: ALiBi has no position table


def empty_model(
    config: Any, tokenizer: Any, *, name: str, prepend_bos: bool | None, dtype: torch.dtype
) -> Model:
    """The ``HookedTransformer`` of the Hugging Face ``config``, its weights on the meta device
    (its buffers, the causal masks, built as usual)."""
    from accelerate import init_empty_weights

    architecture = config.architectures[0]
    with tl3_config(config, architecture, dtype, name, prepend_bos) as (_, cfg):
        with init_empty_weights():
            return Model(cfg, tokenizer=tokenizer, move_to_device=False)


def parts(model: Model) -> list[str]:
    """The model's parts, each converted and placed whole: ``embed``, ``pos_embed``,
    ``blocks.0`` ..., ``ln_final``, ``unembed``."""
    blocks = [f"blocks.{i}" for i in range(model.cfg.n_layers)]
    return ["embed", "pos_embed", *blocks, "ln_final", "unembed"]


def fill(
    model: Model,
    config: Any,
    read: Callable[[tuple[str, ...]], dict[str, Tensor]],
    place: Callable[[str, dict[str, Tensor]], dict[str, Tensor]],
) -> None:
    """Convert and place every part of ``model`` (from :func:`empty_model`), one at a time.

    ``read(names)``: the checkpoint's tensors by BloomForCausalLM's names (a name ending in
    ``.`` asks for every tensor under it), in the model's dtype. ``place(part, tensors)``: the
    converted tensors (TransformerLens names, contiguous) put where the part goes; it returns
    those that stay in the model (none for a part offloaded to disk), assigned to it here.
    """
    from accelerate import init_empty_weights
    from transformer_lens.pretrained.weight_conversions import convert_bloom_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        hf_model = AutoModelForCausalLM.from_config(config, dtype=model.cfg.dtype)
    for part in parts(model):
        if part == "pos_embed":
            tensors = {"pos_embed.W_pos": unused_positions(model.cfg)}
        else:
            tensors = _convert(part, hf_model, config, model.cfg, read, convert_bloom_weights)
        for name, default in model.get_submodule(part).named_parameters(part):
            # The conversion leaves out the biases BLOOM has not (b_U); TransformerLens keeps
            # their zero initialisation. A weight left out is the conversion's error.
            if name not in tensors:
                if not name.rsplit(".", 1)[-1].startswith("b_"):
                    raise RuntimeError(f"TransformerLens's BLOOM conversion gives no {name}")
                tensors[name] = torch.zeros(default.shape, dtype=default.dtype)
        kept = place(part, tensors)
        del tensors
        if kept:
            model.load_state_dict(kept, strict=False, assign=True)


def _convert(
    part: str,
    hf_model: torch.nn.Module,
    config: Any,
    cfg: Any,
    read: Callable[[tuple[str, ...]], dict[str, Tensor]],
    convert: Callable[[Any, Any], dict[str, Tensor]],
) -> dict[str, Tensor]:
    """One part's tensors: its Hugging Face tensors put into the (meta) ``hf_model`` for the
    conversion, which runs over the whole model (the rest stays on meta: no memory, no work)."""
    from accelerate.utils import set_module_tensor_to_device

    loaded = read(_sources(part, config))
    if part == "unembed" and config.tie_word_embeddings:
        loaded = {"lm_head.weight": loaded.pop("transformer.word_embeddings.weight")}
    with _holding(hf_model, loaded, set_module_tensor_to_device), torch.no_grad():
        converted = convert(hf_model, cfg)
        # Contiguous, as TransformerLens's own load copies them: the same kernels, the same numbers.
        mine = {k: v for k, v in converted.items() if k.startswith(part + ".")}
        return {k: v.detach().contiguous() for k, v in mine.items()}


@contextlib.contextmanager
def _holding(hf_model: torch.nn.Module, tensors: dict[str, Tensor], put: Any) -> Any:
    """``hf_model`` holding ``tensors`` for the block, back on meta after it (freed)."""
    for name, tensor in tensors.items():
        put(hf_model, name, "cpu", value=tensor)
    try:
        yield hf_model
    finally:
        for name in tensors:
            put(hf_model, name, "meta")
