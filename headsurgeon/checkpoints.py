"""BLOOM checkpoints in Hugging Face's layout: export and its checks (diffing two checkpoints:
:mod:`headsurgeon.checkpoint_diff`).

The layout knowledge lives here: the fused ``query_key_value`` in BLOOM's (and Falcon's) per-head
(q, k, v) order, MPT's ``Wqkv`` as [Q; K; V], ``dense``'s per-head columns, tied embeddings, and
which TransformerLens settings BLOOM's format can express.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import einops
import torch
from torch import Tensor

from headsurgeon import backend, families
from headsurgeon.backend import Model, check_model
from headsurgeon.backend.weights import check_unprocessed, tl_state_dict
from headsurgeon.dtypes import DTYPES, parse_dtype
from headsurgeon.errors import (
    CheckpointError,
    HeadsurgeonError,
    InvalidArgumentError,
    UnsupportedArchitectureError,
)
from headsurgeon.exact_alibi import install_hf_bias, trained_bias
from headsurgeon.inuse import holds_model
from headsurgeon.loading import ModelInfo, model_info, read_json
from headsurgeon.loading.checks import tl_config
from headsurgeon.loading.files import METADATA_FILE, TOKENIZER_FILES, stored_tensors
from headsurgeon.loading.slopes import inexact_slopes
from headsurgeon.markup import markdown_text
from headsurgeon.outputs import (
    atomic_directory,
    atomic_write_text,
    check_output_dir,
    claim_output,
    headsurgeon_version,
)

__all__ = [
    "checkpoint_dtype",
    "hf_model",
    "hf_state_dict",
    "save_hf",
]

logger = logging.getLogger(__name__)


def _bloom_config(model: Model, info: ModelInfo) -> dict[str, Any]:
    """The ``config.json`` of the export: BLOOM's from TransformerLens's config, or an MPT's or a
    Falcon's own (a 4.x bridge computes with the Hugging Face model, config included)."""
    architecture = backend.hf_architecture(model)
    # transformers records the folder a model was loaded from: the export names the model instead
    # (an absolute source path would carry the user's home into a checkpoint meant to be shared).
    config = dict(info.hf_config) | {"_name_or_path": info.name}
    family = families.ARCHITECTURES.get(architecture)
    if family is not None and family.writes_own_config:
        return config | {"architectures": [architecture]}
    cfg = model.cfg
    config.update(
        architectures=[families.BLOOM.architecture],
        model_type=families.BLOOM.name,
        vocab_size=cfg.d_vocab,
        hidden_size=cfg.d_model,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        layer_norm_epsilon=cfg.eps,
    )
    config.setdefault("seq_length", cfg.n_ctx)  # BLOOM computes any length; read by model_shape
    return config


@holds_model("hf_state_dict")
def hf_state_dict(model: Model) -> dict[str, torch.Tensor]:
    """The weights in the Hugging Face layout of the model's family (BLOOM, MPT, Falcon).

    3.x (BLOOM): the inverse of TransformerLens's loader, the fused ``query_key_value`` rebuilt
    from the per-head tensors. 4.x: the tensors of the Hugging Face model the bridge wraps, under
    that family's names, with each layer's fused QKV (``query_key_value``, MPT's ``Wqkv``) rebuilt
    from the bridge's ``q``/``k``/``v`` layers, the ones its forward pass reads (the fused copy
    it keeps is stale once heads are edited).

    Tensors are contiguous and on the CPU; those that already were may share memory with the
    model, so clone before editing them.
    """
    check_model(model, "hf_state_dict", writes=True)
    out = _bridge_state(model) if backend.wraps_hf_model(model) else _bloom_state(model)
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


@holds_model("hf_model")
def hf_model(model: Model, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The ``transformers`` model of ``model``'s family (``BloomForCausalLM``, ``MptForCausalLM``,
    ``FalconForCausalLM``) that computes what ``model`` computes, built in memory from
    :func:`hf_state_dict` and the config :func:`save_hf` would write, in ``dtype`` (a
    ``torch.dtype``, float64 included), eager
    attention, in eval mode, on the CPU. The same checks as :func:`save_hf` refuse, in one
    line, a model the family's format cannot express (inexact slopes, an ALiBi variant, ...).
    Nothing is written and the model is not changed: the copy owns its weights.
    """
    import transformers

    info = model_info(model, "hf_model", writes=True)
    check_unprocessed(model)
    config = _bloom_config(model, info)
    architecture = config["architectures"][0]
    differences = _bloom_differences(model, info, config)
    if differences:
        raise UnsupportedArchitectureError(
            f"{info.name!r} is not a {architecture} as transformers computes it: "
            + "; ".join(differences)
        )
    config.pop("torch_dtype", None)
    hf_class = getattr(transformers, architecture)
    state = {name: t.clone() for name, t in hf_state_dict(model).items()}
    hf_config = hf_class.config_class.from_dict(config)
    embeddings = state[families.ARCHITECTURES[architecture].embeddings]
    hf_config.tie_word_embeddings = bool(
        hf_config.tie_word_embeddings and torch.equal(state["lm_head.weight"], embeddings)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MPT's ignored alibi_bias_max: the slopes say it
        hf = hf_class._from_config(hf_config, attn_implementation="eager", dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [
        name for name in missing if not (name == "lm_head.weight" and hf_config.tie_word_embeddings)
    ]
    if missing or unexpected:
        raise UnsupportedArchitectureError(
            f"the {architecture} built for {info.name!r} does not take its weights (missing "
            f"{missing[:1]}, unexpected {unexpected[:1]})"
        )
    return hf.to(dtype).eval()


def _bloom_state(model: Model) -> dict[str, Tensor]:
    """A TransformerLens 3.x BLOOM's weights under BloomForCausalLM's names."""
    cfg = model.cfg
    sd = tl_state_dict(model)
    out = {
        "transformer.word_embeddings.weight": sd["embed.W_E"],
        "transformer.word_embeddings_layernorm.weight": sd["embed.ln.w"],
        "transformer.word_embeddings_layernorm.bias": sd["embed.ln.b"],
        "transformer.ln_f.weight": sd["ln_final.w"],
        "transformer.ln_f.bias": sd["ln_final.b"],
        "lm_head.weight": sd["unembed.W_U"].T,
    }
    for layer in range(cfg.n_layers):
        p, h = f"blocks.{layer}.", f"transformer.h.{layer}."
        qkv = torch.stack([sd[p + f"attn.W_{x}"] for x in "QKV"], dim=2)  # [n d_model 3 d_head]
        out[h + "self_attention.query_key_value.weight"] = einops.rearrange(
            qkv, "n m three h -> (n three h) m"
        )
        out[h + "self_attention.query_key_value.bias"] = torch.stack(
            [sd[p + f"attn.b_{x}"] for x in "QKV"], dim=1
        ).reshape(-1)
        out[h + "self_attention.dense.weight"] = einops.rearrange(
            sd[p + "attn.W_O"], "n h m -> m (n h)"
        )
        out[h + "self_attention.dense.bias"] = sd[p + "attn.b_O"]
        out[h + "input_layernorm.weight"] = sd[p + "ln1.w"]
        out[h + "input_layernorm.bias"] = sd[p + "ln1.b"]
        out[h + "post_attention_layernorm.weight"] = sd[p + "ln2.w"]
        out[h + "post_attention_layernorm.bias"] = sd[p + "ln2.b"]
        out[h + "mlp.dense_h_to_4h.weight"] = sd[p + "mlp.W_in"].T
        out[h + "mlp.dense_h_to_4h.bias"] = sd[p + "mlp.b_in"]
        out[h + "mlp.dense_4h_to_h.weight"] = sd[p + "mlp.W_out"].T
        out[h + "mlp.dense_4h_to_h.bias"] = sd[p + "mlp.b_out"]
    return out


def _bridge_state(model: Model) -> dict[str, Tensor]:
    """A 4.x bridge's weights under its Hugging Face class's own names (see hf_state_dict)."""
    check_unprocessed(model)
    hf = model.original_model
    family = families.ARCHITECTURES.get(type(hf).__name__)
    if family is None:
        raise UnsupportedArchitectureError(
            f"hf_state_dict writes BLOOM, MPT and Falcon models, not {type(hf).__name__}"
        )
    # The family's names, from an empty model of the same class and config (no memory).
    with torch.device("meta"):
        names = list(type(hf)(copy.deepcopy(hf.config)).state_dict())
    found: dict[str, Tensor] = {}
    for name, tensor in hf.state_dict(keep_vars=True).items():
        # The bridge wraps each module as "<name>._original_component"; its own aliases (q, k,
        # v, ln1, ...) are not among the family's names.
        found.setdefault(name.replace("._original_component", ""), tensor)
    missing = [name for name in names if name not in found]
    if missing:
        raise UnsupportedArchitectureError(
            f"the bridge has no tensor for {len(missing)} {type(hf).__name__} weight(s), e.g. "
            f"{missing[0]}; hf_state_dict cannot write it"
        )
    out = {name: found[name] for name in names}
    interleaved = family.interleaved and not hf.config.to_dict().get("multi_query")
    for layer, block in enumerate(model.blocks):
        linears = [getattr(block.attn, x).original_component for x in "qkv"]
        fused = family.qkv_path.format(layer)
        out[fused + ".weight"] = _fused([m.weight for m in linears], model.cfg.n_heads, interleaved)
        if linears[0].bias is not None:
            biases = [m.bias for m in linears]
            out[fused + ".bias"] = _fused(biases, model.cfg.n_heads, interleaved)
    return out


def _fused(parts: list[Tensor], n_heads: int, interleaved: bool) -> Tensor:
    """Q, K, V projections (rows ``[head * d_head]``) as one fused tensor: per head (q, k, v)
    rows when ``interleaved``, else Q's rows, then K's, then V's."""
    if not interleaved:
        return torch.cat(parts)
    return torch.stack([p.unflatten(0, (n_heads, -1)) for p in parts], dim=1).flatten(0, 2)


# HookedTransformerConfig fields that do not change what a model computes (names, devices,
# initialisation, hook points, tokenizer conventions), that config.json states (n_ctx as
# seq_length, dtype) or that only apply to positional schemes other than ALiBi (whose own field,
# positional_embedding_type, is compared).
_NOT_COMPUTED = frozenset(
    {
        "model_name",
        "tokenizer_name",
        "tokenizer_prepends_bos",
        "default_prepend_bos",
        "original_architecture",
        "n_ctx",
        "dtype",
        "device",
        "n_devices",
        "seed",
        "init_mode",
        "init_weights",
        "initializer_range",
        "n_params",
        "from_checkpoint",
        "trust_remote_code",
        "use_attn_result",
        "use_split_qkv_input",
        "use_hook_mlp_in",
        "use_attn_in",
        "use_hook_tokens",
        "tie_word_embeddings",
        "decoder_start_token_id",
        "train_seq_length",
        "window_size",
        "attn_types",
        "experts_per_token",
        "norm_topk_prob",
        "use_dynamic_ntk_rope",
        "use_NTK_by_parts_rope",
        "use_yarn_rope",
    }
)
_NOT_COMPUTED_PREFIXES = ("checkpoint_", "rotary_", "NTK_", "yarn_", "relative_attention_")
# TransformerLens's names for BLOOM's activation, the tanh approximation of GELU.
_TANH_GELU = frozenset({"gelu_new", "gelu_fast", "gelu_pytorch_tanh"})
# The export check: random tokens (fixed seed), compared in float32.
_PROBE_SEQS, _PROBE_LEN, _PROBE_SEED = 4, 32, 0
EXPORT_ATOL = 1e-4
EXPORT_RTOL = 1e-5
_TOLERANCE = "1e-4 + 1e-5"


def _bloom_differences(model: Model, info: ModelInfo, config: dict[str, Any]) -> list[str]:
    """What ``model`` computes that the BLOOM ``config`` (and BLOOM's weights) cannot express;
    for an MPT or a Falcon on 4.x, what its own family's ``config`` cannot.

    The reference is the TransformerLens config that ``config`` itself converts to, so every
    field TransformerLens knows is compared, not a hand-kept list of BLOOM's settings.
    """
    family = families.ARCHITECTURES.get(backend.hf_architecture(model))
    if family is not None and family.writes_own_config:
        return _family_differences(model, info, family.title)
    cfg = model.cfg
    with tempfile.TemporaryDirectory(prefix="headsurgeon-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        bloom = tl_config(Path(tmp), dtype=cfg.dtype)
    found = []
    # 3.x: original_architecture (None in a config built by hand); 4.x's bridge: architecture.
    architecture = getattr(cfg, "original_architecture", None) or getattr(cfg, "architecture", None)
    if architecture not in (None, "BloomForCausalLM"):
        found.append(f"architecture {architecture}")
    # A 4.x bridge computes with the Hugging Face model itself: only its class can differ.
    for field in dataclasses.fields(bloom) if bloom is not None else ():
        name = field.name
        if name in _NOT_COMPUTED or name.startswith(_NOT_COMPUTED_PREFIXES):
            continue
        ours, theirs = getattr(cfg, name, None), getattr(bloom, name)
        if name == "act_fn" and ours in _TANH_GELU:
            continue
        if name == "attn_scale" and cfg.d_head != bloom.d_head:
            continue  # sqrt(d_head): a consequence of d_head, reported as such
        if ours != theirs:
            found.append(_difference(name, ours, theirs, cfg))
    slopes = inexact_slopes(info)
    if slopes is not None:
        found.append(slopes)
    if torch.any(model.unembed.b_U != 0):
        found.append("a non-zero unembedding bias b_U (BLOOM has none)")
    return found


def _family_differences(model: Model, info: ModelInfo, family: str) -> list[str]:
    """What an MPT's or a Falcon's own format cannot express. The 4.x bridge computes with the
    Hugging Face model itself: only what headsurgeon adds can differ (and the reload check
    compares the logits: a bridge that computes something else, e.g. one built by hand on a
    Falcon with new_decoder_architecture, fails it)."""
    found = []
    kind, _ = trained_bias(info.metadata)
    if kind != "standard":
        found.append(f"{kind} ALiBi ({family} in transformers computes standard ALiBi only)")
    if torch.any(model.unembed.b_U != 0):
        found.append(f"a non-zero unembedding bias b_U ({family} has none)")
    return found


def _difference(name: str, ours: Any, theirs: Any, cfg: Any) -> str:
    """One difference between a model's config and BLOOM's, in words."""
    if name == "positional_embedding_type":
        return f"{ours} positions (BLOOM uses ALiBi)"
    if name == "act_fn":
        return f"activation {ours} (BLOOM's is the tanh approximation of GELU, gelu_new)"
    if name == "normalization_type" and ours in ("LNPre", "RMSPre"):
        return (
            f"processed weights (normalization_type {ours}: LayerNorm folded into the next "
            "layer); load it with headsurgeon.load_model, which keeps weights unprocessed"
        )
    if name == "normalization_type" and ours is None:
        return "no LayerNorms (normalization_type None; BLOOM: LN, LayerNorm with weights)"
    if name == "normalization_type":
        return f"normalization {ours} (BLOOM: LN, LayerNorm with weights)"
    if name == "post_embedding_ln":
        return "no embedding LayerNorm (post_embedding_ln=False; BLOOM normalises the embeddings)"
    if name == "d_mlp":
        return f"d_mlp {ours} (BLOOM: 4 x d_model = {theirs})"
    if name == "d_head":
        return f"d_head {ours} x {cfg.n_heads} heads (BLOOM: d_head = d_model / n_heads = {theirs})"
    if isinstance(ours, float) and isinstance(theirs, float):
        return f"{name}={ours:g} (BLOOM: {theirs:g})"
    return f"{name}={ours!r} (BLOOM: {theirs!r})"


# The dtypes a checkpoint is exported in, by the names stored_tensors gives them.
_SAFETENSORS_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


def checkpoint_dtype(model: Model) -> torch.dtype | None:
    """The dtype of the checkpoint ``model`` was loaded from, None when that is unknown.

    Read from the source folder of a model from :func:`~headsurgeon.loading.load_model`: the
    dtype its safetensors hold (every floating tensor), else ``config.json``'s
    ``dtype``/``torch_dtype``. The bundled organisms are float16 on disk and load as float32.
    None for a model built in memory (a TransformerLens config,
    :func:`~headsurgeon.loading.from_hf_model` without a folder) or whose folder is gone.

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> print(checkpoint_dtype(random_model(ModelShape(1, 2, 8, 16, 8))))
    None
    """
    return _source_dtype(model_info(model, "checkpoint_dtype").source)


def _source_dtype(source: Path | None) -> torch.dtype | None:
    """:func:`checkpoint_dtype` of the model loaded from ``source``."""
    if source is None or not source.is_dir():
        return None
    # Headers and config read bounded, regular files only (the folder may have changed since
    # the model was loaded: a FIFO in its place must not block an export).
    try:
        found = {t.dtype for t in stored_tensors(source).values()}
    except HeadsurgeonError:  # unreadable weights: fall back to the config
        found = set()
    floating = found & set(_SAFETENSORS_DTYPES)
    if len(floating) == 1:
        return _SAFETENSORS_DTYPES[floating.pop()]
    try:
        config = read_json(source / "config.json")
    except HeadsurgeonError:
        return None
    named = config.get("dtype") or config.get("torch_dtype")
    return DTYPES.get(named) if isinstance(named, str) else None


def _probe_tokens(model: Model, device: torch.device) -> Tensor:
    """The export check's probe batch: a few random sequences within the vocabulary and context."""
    generator = torch.Generator().manual_seed(_PROBE_SEED)
    shape = (_PROBE_SEQS, min(_PROBE_LEN, model.cfg.n_ctx))
    return torch.randint(0, model.cfg.d_vocab, shape, generator=generator).to(device)


def _float32_logits(model: Model, tokens: Tensor) -> Tensor:
    """``model``'s logits computed in float32 (its hooks included), the model left as it was.

    A float16 or bfloat16 model runs this one forward pass on float32 copies of its tensors;
    then each tensor gets its own storage back (the same memory, so views stay views).
    """
    narrow = [
        t
        for t in (*model.parameters(), *model.buffers())
        if t.is_floating_point() and t.dtype != torch.float32
    ]
    storages, cfg_dtype = [t.data for t in narrow], model.cfg.dtype
    try:
        for t in narrow:
            t.data = t.data.to(torch.float32)
        model.cfg.dtype = torch.float32
        with torch.no_grad():
            return model(tokens, return_type="logits").to(torch.float32)
    finally:
        for t, storage in zip(narrow, storages, strict=True):
            t.data = storage
        model.cfg.dtype = cfg_dtype


def _verify_export(
    model: Model, info: ModelInfo, folder: Path, unrounded: dict[str, Tensor] | None
) -> float | None:
    """Reload ``folder`` with ``transformers`` (float32, the class its ``config.json`` names) and
    compare logits with ``model``'s.

    ``unrounded``: the weights before rounding to the written dtype, when rounding changed any;
    the export is then checked with them, and how far rounding moves the logits is returned.
    """
    import transformers
    from transformers.utils import logging as hf_logging

    architecture = read_json(folder / "config.json")["architectures"][0]
    device = model.embed.W_E.device
    # MPT builds its ALiBi for max_seq_len positions and computes no more.
    tokens = _probe_tokens(model, device)[:, : info.hf_config.get("max_seq_len")]
    tf32 = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # TF32 would exceed the tolerance by itself
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        expected = _float32_logits(model, tokens)
        hf, loading = getattr(transformers, architecture).from_pretrained(
            folder, dtype=torch.float32, local_files_only=True, output_loading_info=True
        )
        bad = sorted(loading["missing_keys"]) + sorted(str(k) for k in loading["mismatched_keys"])
        if bad:
            raise CheckpointError(
                f"transformers could not read {len(bad)} exported weight(s) (first: {bad[0]}); "
                "nothing written"
            )
        hf = hf.to(device).eval()
        # A model trained with an ALiBi variant is checked as headsurgeon loads it back.
        kind, params = trained_bias(info.metadata)
        if kind != "standard":
            install_hf_bias(hf, kind, **params)
        with torch.no_grad():
            written = hf(tokens).logits
            computed = written
            if unrounded is not None:
                hf.load_state_dict(unrounded, strict=False)
                computed = hf(tokens).logits
        del hf
    finally:
        torch.set_float32_matmul_precision(tf32)
        if bar_was_on:
            hf_logging.enable_progress_bar()
    gap = (computed - expected).abs()
    allowed = EXPORT_ATOL + EXPORT_RTOL * expected.abs()
    if bool((gap > allowed).any()):
        raise CheckpointError(
            f"the export does not compute this model: transformers' logits on {tokens.shape[0]} "
            f"random sequences of {tokens.shape[1]} tokens differ from the model's by up to "
            f"{gap.max().item():.3g} (tolerance {_TOLERANCE} x |logit|, float32); nothing "
            "written. Hooks that change the model's computation (a mitigation?) cannot be exported"
        )
    return None if unrounded is None else (written - expected).abs().max().item()


@holds_model("save_hf")
def save_hf(
    model: Model,
    out_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    dtype: str | torch.dtype | None = None,
    verify: bool = True,
    card: str | None = None,
) -> Path:
    """Export a model as a Hugging Face checkpoint folder of its own family: BLOOM (3.x
    HookedTransformer, 4.x bridge), MPT and Falcon (4.x bridge: ``MptForCausalLM``,
    ``FalconForCausalLM``, its ``config.json`` as loaded).

    ``save_hf(model, "repaired/")`` writes weights (safetensors), config, tokenizer and a model
    card (``README.md``, :func:`model_card`) through a hidden partial folder and a rename; a model
    the family's format cannot represent is refused in one
    :class:`UnsupportedArchitectureError` line naming every difference, before anything is written.

    - ``model``: the model to export.
    - ``out_dir``: the folder to write (a non-empty one only with ``overwrite``, never the source).
    - ``overwrite``: replace a folder headsurgeon wrote (never one holding files it did not write).
    - ``dtype``: the written dtype (default: that of the checkpoint the model came from).
    - ``verify``: reload the folder and compare its logits first (holds a float32 copy).
    - ``card``: Markdown for the model card: what was done to the model.

    The fused layouts, the refusals, the reload check and the output folder's rules: [Models and
    checkpoints: saving](../models.md#saving-save_hf).
    """
    info = model_info(model, "save_hf", writes=True)
    # Where the model was loaded from (headsurgeon.loading records it): never written over.
    inputs = [info.source] if info.source is not None else []
    check_output_dir(out_dir, overwrite, inputs=inputs)  # before any work
    check_unprocessed(model)
    config = _bloom_config(model, info)
    family = families.ARCHITECTURES.get(config["architectures"][0], families.BLOOM)
    differences = _bloom_differences(model, info, config)
    if differences:
        why = "; ".join(differences)
        raise UnsupportedArchitectureError(
            f"save_hf cannot write {info.name!r} as {family.article} {family.title} checkpoint: "
            f"{why}"
        )
    save_dtype = parse_dtype(dtype) if dtype is not None else None
    save_dtype = save_dtype or _source_dtype(info.source) or model.embed.W_E.dtype
    dtype_name = str(save_dtype).removeprefix("torch.")
    written, unrounded, rounded = _cast_state(model, config, save_dtype)
    unrounded = unrounded if verify and rounded else None
    config.pop("torch_dtype", None)  # transformers 5 calls it dtype; the old key would conflict
    config["dtype"] = dtype_name
    # The claim removes what a killed save to out_dir left (its marked .NAME.tmp-*), in one line.
    with (
        claim_output(out_dir, overwrite, inputs=inputs) as out,
        atomic_directory(out, overwrite=overwrite, inputs=inputs, writer="save_hf") as tmp,
    ):
        _write_folder(tmp, written, config, info)
        del written
        moved = _verify_export(model, info, tmp, unrounded) if verify else None
        atomic_write_text(tmp / "README.md", model_card(info, config, verified=verify, body=card))
    if rounded:
        message = f"save_hf wrote {dtype_name}: rounding changed {rounded} weight(s) of {info.name}"
        if moved is not None:
            message += f" and its logits by up to {moved:.3g}"
        if dtype is None:  # a default the user may not know about
            warnings.warn(
                f"{message}; pass dtype={str(model.embed.W_E.dtype).removeprefix('torch.')!r} "
                "to write the model exactly",
                stacklevel=2,
            )
        else:
            logger.info(message)
    kind, _ = trained_bias(info.metadata)
    if kind != "standard":
        logger.info(
            "%s records its %s ALiBi in %s: headsurgeon.load_model applies it; transformers on "
            "its own computes standard ALiBi",
            out_dir,
            kind,
            METADATA_FILE,
        )
    logger.debug("saved %s to %s", info.name, out_dir)  # callers name their own folders
    return Path(out_dir)


def _cast_state(
    model: Model, config: dict[str, Any], save_dtype: torch.dtype
) -> tuple[dict[str, Tensor], dict[str, Tensor], int]:
    """The Hugging Face state in ``save_dtype`` (``lm_head`` dropped, and ``config`` marked, when
    tied), the state before the cast, and how many weights the cast rounded."""
    state = hf_state_dict(model)
    embeddings = families.ARCHITECTURES[config["architectures"][0]].embeddings
    tied = config.get("tie_word_embeddings", True) and torch.equal(
        state["lm_head.weight"], state[embeddings]
    )
    config["tie_word_embeddings"] = bool(tied)
    if tied:
        del state["lm_head.weight"]
    written = {name: tensor.to(save_dtype) for name, tensor in state.items()}
    rounded = 0  # weights that the written dtype does not hold exactly
    for name, tensor in state.items():
        if tensor.dtype == save_dtype:
            continue
        if not torch.isfinite(written[name]).all() and torch.isfinite(tensor).all():
            raise InvalidArgumentError(
                f"{name} has weights beyond {str(save_dtype).removeprefix('torch.')}'s range "
                f"(largest |w| {tensor.abs().max().item():.3g}); pass dtype='float32'"
            )
        rounded += int((written[name].to(tensor.dtype) != tensor).count_nonzero())
    return written, state, rounded


def model_card(
    info: ModelInfo, config: dict[str, Any], *, verified: bool, body: str | None = None
) -> str:
    """The ``README.md`` that :func:`save_hf` writes beside the weights: a Hugging Face model
    card (YAML front matter: ``library_name``, ``tags``, ``base_model`` for a hub model) that
    says what the folder holds, where it came from, whether the export was checked by reload,
    and ``body`` (what was done to the model: a repair's summary, the heads pruned). The card is
    shown by Hugging Face as Markdown with HTML: the model's name enters it only escaped
    (:func:`headsurgeon.markup.markdown_text`), and a caller's ``body`` escapes its names the
    same way.

    >>> from headsurgeon.loading import ModelShape, model_info, random_model
    >>> card = model_card(model_info(random_model(ModelShape(1, 2, 8, 16, 8))),
    ...                   {"model_type": "bloom", "dtype": "float32"}, verified=True)
    >>> card.splitlines()[:3]
    ['---', 'library_name: transformers', 'tags: ["headsurgeon", "alibi", "bloom"]']
    """
    family = str(config.get("model_type", families.BLOOM.name))
    tags = ["headsurgeon", "alibi" if info.is_alibi else "transformer", family]
    front = ["---", "library_name: transformers", f"tags: {json.dumps(tags)}"]
    if info.source is not None and info.name.count("/") == 1 and not os.path.isabs(info.name):
        front.append(f"base_model: {json.dumps(info.name)}")  # a hub name (JSON is YAML)
    shape = info.shape
    name = markdown_text(info.name)  # a folder's name: user text, never Markdown or HTML
    check = (
        "Checked by reload: transformers reads this folder and computes the exported model's "
        f"logits within {_TOLERANCE} x |logit| (float32) on random token sequences."
        if verified
        else "Not checked by reload (save_hf was called with verify=False)."
    )
    lines = [
        *front,
        "---",
        "",
        f"# {name}, exported by headsurgeon",
        "",
        f"A {markdown_text(family)} checkpoint ({shape.n_layers} layers x {shape.n_heads} heads, "
        f"width {shape.d_model}, {markdown_text(config.get('dtype', 'float32'))}) written by "
        f"headsurgeon {headsurgeon_version()}'s `save_hf` from {name}: the weights the model "
        "computed with when it was exported, in the family's own Hugging Face layout. "
        f"`{METADATA_FILE}` records how it was trained and exported.",
        "",
        check,
    ]
    if body:
        lines += ["", body.strip()]
    return "\n".join(lines) + "\n"


def _write_folder(
    folder: Path, state: dict[str, Tensor], config: dict[str, Any], info: ModelInfo
) -> None:
    """Weights, ``config.json``, our metadata and the tokenizer files into ``folder``."""
    from safetensors.torch import save_file

    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    atomic_write_text(folder / "config.json", json.dumps(config, indent=2, sort_keys=True))
    # safetensors creates its file private (0600); give it the umask's mode, as config.json.
    shutil.copymode(folder / "config.json", folder / "model.safetensors")
    metadata = dict(info.metadata)
    metadata.update(prepend_bos=info.prepend_bos, exported_from=info.name)
    atomic_write_text(folder / METADATA_FILE, json.dumps(metadata, indent=2, default=str))
    if info.source is not None and (info.source / "tokenizer_config.json").exists():
        for file in TOKENIZER_FILES:
            if (info.source / file).exists():
                shutil.copyfile(info.source / file, folder / file)
    elif info.tokenizer is not None:
        info.tokenizer.save_pretrained(folder)
