"""Loading models (by name, bundled organism or local folder) and exporting them to Hugging Face.

Exports:
    load_model(name_or_path, dtype, device)  HookedTransformer, unprocessed weights, exact ALiBi
    save_hf(model, out_dir, overwrite, dtype, verify)  BLOOM checkpoint, checked by reloading it
    checkpoint_dtype(model)                  the dtype of the checkpoint a model was loaded from
    from_hf_model(hf_model, tokenizer, ...)  wrap an in-memory transformers model
    random_model(shape, seed)                random-weight BLOOM of a given or named shape
    random_hf_bloom(shape, seed)             the same, as a transformers model
    model_shape(name_or_model)               ModelShape without loading weights
    model_info(model)                        ModelInfo: where a model came from, its conventions
    parse_dtype(dtype), parse_device(device) validated torch dtype / device
    hf_state_dict(model)                     BLOOM weights in Hugging Face layout
    weight_changes(before, after, heads)     per tensor: changes inside / outside heads' slices
    use_exact_alibi(model)                   Hugging Face's ALiBi slopes for any head count
    alibi_slopes(model)                      the ALiBi slopes a model applies, read from it
    bias_pre_hook(build), shared_bias(...)   the attention pre-hook protocol for ALiBi biases
    organism_names(), DEFAULT_MODEL, BLOOM_SHAPES, ModelShape, ModelInfo

Weights stay exactly as in the checkpoint (no LayerNorm folding, no centring), so every per-head
slice of ``W_Q``/``W_K``/``W_V``/``W_O`` maps 1:1 back to the checkpoint and ``save_hf`` round
trips bit for bit. TransformerLens 3.x computes ALiBi slopes with the power-of-two formula for every
head count; models loaded here get Hugging Face's exact slopes for any head count.

>>> model = random_model(ModelShape(n_layers=1, n_heads=6, d_model=48, d_vocab=64, n_ctx=32))
>>> model.cfg.n_heads, model_info(model).prepend_bos
(6, False)
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import os
import pickle
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import einops
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformer_lens import loading_from_pretrained as tl_loading

from headsurgeon import alibi
from headsurgeon.errors import (
    CheckpointError,
    InvalidArgumentError,
    ModelNotFoundError,
    OutputExistsError,
    UnknownModelError,
    UnsupportedArchitectureError,
)
from headsurgeon.outputs import atomic_directory, atomic_write_text, check_output_dir

logger = logging.getLogger(__name__)

ORGANISM_DIR = Path(__file__).parent / "organisms"
DEFAULT_MODEL = "organism-injured"
METADATA_FILE = "headsurgeon.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes that weight-free analyses need."""

    n_layers: int
    n_heads: int
    d_model: int
    d_vocab: int
    n_ctx: int
    positional: str = "alibi"


# Published BLOOM configurations (Hugging Face config.json of each bigscience checkpoint).
BLOOM_SHAPES: dict[str, ModelShape] = {
    "bloom-560m": ModelShape(24, 16, 1024, 250880, 2048),
    "bloom-1b1": ModelShape(24, 16, 1536, 250880, 2048),
    "bloom-1b7": ModelShape(24, 16, 2048, 250880, 2048),
    "bloom-3b": ModelShape(30, 32, 2560, 250880, 2048),
    "bloom-7b1": ModelShape(30, 32, 4096, 250880, 2048),
    "bloom-176b": ModelShape(70, 112, 14336, 250880, 2048),
}
_BLOOM_OFFICIAL = {f"bigscience/{k}": k for k in BLOOM_SHAPES} | {"bigscience/bloom": "bloom-176b"}


@dataclasses.dataclass
class ModelInfo:
    """Where a loaded model came from and the conventions the tools apply to it.

    ``prepend_bos`` is the model's own position-0 convention (BLOOM: no BOS token, so position 0
    is the first text token). ``train_ctx`` is the sequence length the model was trained on, when
    known (bundled organisms record it).
    """

    name: str
    source: Path | None
    prepend_bos: bool
    train_ctx: int | None
    hf_config: dict[str, Any]
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    tokenizer: Any = None  # the checkpoint's own tokenizer (TransformerLens may wrap it)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Return the torch dtype for a name such as ``"float32"``, ``"bf16"`` or ``torch.float16``."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise InvalidArgumentError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16")


def parse_device(device: str | torch.device) -> torch.device:
    """Return a usable torch device, or raise :class:`InvalidArgumentError` saying why not."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgumentError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from e
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError(f"device {device!r} requested but CUDA is not available")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise InvalidArgumentError(
                f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA device(s)"
            )
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidArgumentError(f"device {device!r} requested but MPS is not available")
    elif parsed.type not in ("cpu", "cuda", "mps"):
        raise InvalidArgumentError(f"unsupported device {device!r}; use cpu, cuda or mps")
    return parsed


def organism_names() -> list[str]:
    """Short names of the model organisms bundled with the package."""
    if not ORGANISM_DIR.is_dir():
        return []
    return sorted(p.name for p in ORGANISM_DIR.iterdir() if (p / "config.json").exists())


def _hub_names() -> dict[str, str]:
    """Map every TransformerLens name and alias (lower case) to its official hub name."""
    return tl_loading.make_model_alias_map()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not readable JSON ({e}); re-export the checkpoint") from e


def _local_shape(directory: Path) -> ModelShape:
    cfg = _read_json(directory / "config.json")
    try:
        return ModelShape(
            n_layers=cfg["n_layer"],
            n_heads=cfg["n_head"],
            d_model=cfg["hidden_size"],
            d_vocab=cfg["vocab_size"],
            n_ctx=cfg.get("seq_length", 2048),
        )
    except KeyError as e:
        raise UnsupportedArchitectureError(
            f"{directory}/config.json lacks {e}; shapes by folder are known for BLOOM only"
        ) from e


def model_shape(name_or_model: str | os.PathLike | HookedTransformer) -> ModelShape:
    """Shape of a model, a BLOOM name (no weights needed), a bundled organism or a folder.

    >>> model_shape("bloom-176b").n_heads
    112
    """
    if isinstance(name_or_model, HookedTransformer):
        cfg = name_or_model.cfg
        # TransformerLens sets n_ctx = 2048 for every BLOOM; the checkpoint's own value wins.
        n_ctx = model_info(name_or_model).hf_config.get("seq_length", cfg.n_ctx)
        return ModelShape(
            cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_vocab, n_ctx,
            cfg.positional_embedding_type,
        )  # fmt: skip
    name = str(name_or_model)
    key = name.lower()
    if key in BLOOM_SHAPES:
        return BLOOM_SHAPES[key]
    if key in _BLOOM_OFFICIAL:
        return BLOOM_SHAPES[_BLOOM_OFFICIAL[key]]
    if name in organism_names():
        return _local_shape(ORGANISM_DIR / name)
    if Path(name).is_dir() and (Path(name) / "config.json").exists():
        return _local_shape(Path(name))
    raise UnknownModelError(_unknown_message(name, list(BLOOM_SHAPES) + organism_names()))


def _unknown_message(name: str, candidates: list[str]) -> str:
    by_lower = {c.lower(): c for c in candidates}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(by_lower[c] for c in close)}? " if close else ""
    return (
        f"unknown model {name!r}: {hint}pass a TransformerLens model name, a bundled organism "
        f"({', '.join(organism_names()) or 'none installed'}) or a local checkpoint folder"
    )


def _hub_reachable(timeout: float = 2.0) -> bool:
    """One request to the hub, no retries, answered within ``timeout`` seconds.

    Uses the hub client's own session (its proxies and certificates). The request runs in a daemon
    thread because socket timeouts do not cover a name server that never answers.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    done = threading.Event()
    answered: list[bool] = []

    def probe() -> None:
        try:
            get_session().head(constants.ENDPOINT, timeout=timeout)
            answered.append(True)  # any status code: the server is there
        except Exception:  # any failure to get an HTTP answer means "unreachable"
            pass
        done.set()

    threading.Thread(target=probe, daemon=True).start()
    done.wait(timeout)
    return bool(answered)


def _has_weights(directory: Path) -> bool:
    return any(directory.glob("*.safetensors")) or any(directory.glob("pytorch_model*.bin"))


def _hub_snapshot(official: str) -> Path:
    """The local folder of a hub model: from the cache, else downloaded (with progress bars)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = ["config.json", "*.safetensors", "*.safetensors.index.json", *TOKENIZER_FILES]
    try:
        cached = Path(snapshot_download(official, allow_patterns=patterns, local_files_only=True))
        if _has_weights(cached):
            return cached
    except LocalEntryNotFoundError:
        pass
    how = (
        f"download it on a connected machine (huggingface-cli download {official}) and copy the "
        "Hugging Face cache here, or pass a local checkpoint folder"
    )
    missing = f"{official} is not in the local Hugging Face cache"
    if constants.is_offline_mode():
        raise ModelNotFoundError(f"{missing} and HF_HUB_OFFLINE=1; {how}")
    # One bounded probe rather than the hub client's own timeouts and retries.
    if not _hub_reachable():
        raise ModelNotFoundError(f"{missing} and {constants.ENDPOINT} cannot be reached; {how}")
    logger.info("downloading %s", official)
    try:
        folder = Path(snapshot_download(official, allow_patterns=patterns))
        if not _has_weights(folder):  # older repositories ship only pickled weights
            folder = Path(snapshot_download(official, allow_patterns=["pytorch_model*.bin*"]))
    except Exception as e:  # the hub client raises many types (HTTP, connection, disk)
        raise ModelNotFoundError(f"downloading {official} failed ({_first_line(e)}); {how}") from e
    return folder


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _resolve(name_or_path: str | os.PathLike) -> tuple[str, Path]:
    """Turn a user's model argument into (display name, local checkpoint folder)."""
    name = str(name_or_path)
    if name in organism_names():
        return name, ORGANISM_DIR / name
    path = Path(name).expanduser()
    looks_like_path = isinstance(name_or_path, os.PathLike) or "/" in name or os.sep in name
    looks_like_path = looks_like_path or name.startswith((".", "~"))
    if path.exists():
        return path.name or name, path
    official = _hub_names().get(name.lower())
    if official is not None:
        return name, _hub_snapshot(official)
    if looks_like_path:
        raise ModelNotFoundError(f"model folder {name} does not exist; check the path")
    raise UnknownModelError(_unknown_message(name, list(_hub_names()) + organism_names()))


def _tl_config(
    config_dir: Path, *, dtype: torch.dtype = torch.float32, prepend_bos: bool | None = None
) -> HookedTransformerConfig:
    """TransformerLens's config for the ``config.json`` in ``config_dir`` (a folder of ours).

    TransformerLens guesses the architecture of any path that contains "llama" or "gemma" from the
    path alone, so it is only ever shown a private temporary folder, never the user's.
    """
    hf_config = _read_json(config_dir / "config.json")
    try:
        return tl_loading.get_pretrained_model_config(
            str(config_dir),
            hf_cfg=hf_config,
            fold_ln=False,
            dtype=dtype,
            device="cpu",
            default_prepend_bos=prepend_bos,
        )
    except (NotImplementedError, ValueError, KeyError, TypeError) as e:
        architecture = (hf_config.get("architectures") or ["<none>"])[0]
        raise UnsupportedArchitectureError(
            f"architecture {architecture} (model_type {hf_config.get('model_type')}) is not "
            "supported by TransformerLens 3.x; use a BLOOM or another TransformerLens model"
        ) from e


def _check_checkpoint(directory: Path) -> None:
    """Validate a checkpoint folder before its weights are read (they may be many GB)."""
    if not directory.is_dir():
        raise ModelNotFoundError(f"{directory} is not a folder; pass a checkpoint folder")
    if not (directory / "config.json").exists():
        raise CheckpointError(
            f"{directory} has no config.json; pass a Hugging Face checkpoint folder "
            "(config.json, *.safetensors, tokenizer files)"
        )
    if not _has_weights(directory):
        raise CheckpointError(
            f"{directory} has no weights (*.safetensors); re-export or re-download"
        )
    from safetensors import safe_open

    for file in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    f.get_slice(key)
        except Exception as e:  # safetensors raises its own error types and OSError
            raise CheckpointError(
                f"{file} is not a valid safetensors file ({_first_line(e)}); "
                "re-download or re-export it"
            ) from e
    config = _read_json(directory / "config.json")  # errors name the user's file, not a copy
    with tempfile.TemporaryDirectory(prefix="headsurgeon-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        _tl_config(Path(tmp))


def load_model(
    name_or_path: str | os.PathLike = DEFAULT_MODEL,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> HookedTransformer:
    """Load a model as a HookedTransformer with unprocessed weights and exact ALiBi.

    ``name_or_path`` is a bundled organism (``organism``, ``organism-injured``), a TransformerLens
    name or alias (``bloom-560m``, ``bigscience/bloom-560m``; from the Hugging Face cache, else
    downloaded; ``HF_HUB_OFFLINE=1`` respected), or a local Hugging Face checkpoint folder (never
    touches the network). Files are read as safetensors (``torch.load(weights_only=True)`` for
    legacy ``.bin``); remote code is never trusted.
    """
    torch_dtype = parse_dtype(dtype)
    torch_device = parse_device(device)
    name, directory = _resolve(name_or_path)
    _check_checkpoint(directory)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # Reading local weights takes well under a second; its progress bar is only noise.
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        hf_model, loading = AutoModelForCausalLM.from_pretrained(
            directory,
            dtype=torch_dtype,
            local_files_only=True,
            trust_remote_code=False,
            output_loading_info=True,
        )
    except (OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"transformers could not load {directory} ({_first_line(e)}); "
            "re-download or re-export the checkpoint"
        ) from e
    except (EOFError, pickle.UnpicklingError) as e:  # legacy .bin: torch's unpickler
        raise CheckpointError(
            f"the PyTorch weights (*.bin) in {directory} are truncated or corrupt; "
            "re-download the checkpoint or re-export it as safetensors"
        ) from e
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    # transformers fills missing or misshapen tensors with random values and only logs it.
    bad = sorted(loading["missing_keys"]) + sorted(str(k) for k in loading["mismatched_keys"])
    if bad:
        raise CheckpointError(
            f"{directory} lacks or misshapes {len(bad)} weight(s) (first: {bad[0]}); "
            "re-download or re-export the checkpoint"
        )
    tokenizer = None
    if any((directory / f).exists() for f in TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except Exception as e:  # JSON, tokenizers (Rust) and sentencepiece errors alike
            raise CheckpointError(
                f"the tokenizer files in {directory} are unreadable ({_first_line(e)}); "
                "re-export the tokenizer, or remove its files to load the weights alone"
            ) from e
    metadata = _read_json(directory / METADATA_FILE) if (directory / METADATA_FILE).exists() else {}
    model = from_hf_model(
        hf_model,
        tokenizer,
        name=name,
        source=directory,
        prepend_bos=metadata.get("prepend_bos"),
        # analyses/train_organism.py records it under training.config.seq_len
        train_ctx=metadata.get("training", {}).get(
            "seq_len", metadata.get("training", {}).get("config", {}).get("seq_len")
        ),
        metadata=metadata,
    )
    return model.to(torch_device, print_details=False)


def from_hf_model(
    hf_model: Any,
    tokenizer: Any = None,
    *,
    name: str = "model",
    source: Path | None = None,
    prepend_bos: bool | None = None,
    train_ctx: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> HookedTransformer:
    """Convert an in-memory ``transformers`` causal LM into an unprocessed HookedTransformer."""
    hf_config = hf_model.config.to_dict()
    torch_dtype = next(hf_model.parameters()).dtype
    # TransformerLens reads configs from a name or folder; give it the model's own config.
    with tempfile.TemporaryDirectory(prefix="headsurgeon-") as tmp:
        hf_model.config.save_pretrained(tmp)
        cfg = _tl_config(Path(tmp), dtype=torch_dtype, prepend_bos=prepend_bos)
        state_dict = tl_loading.get_pretrained_state_dict(tmp, cfg, hf_model=hf_model)
    if cfg.positional_embedding_type == "alibi":
        # Unused by ALiBi models; TransformerLens would otherwise fill it with uninitialised memory.
        state_dict["pos_embed.W_pos"] = torch.zeros(cfg.n_ctx, cfg.d_model, dtype=torch_dtype)
    cfg.model_name = name
    # The config folder is gone: without this TransformerLens would look the tokenizer up by
    # that path on the hub.
    cfg.tokenizer_name = None
    model = HookedTransformer(cfg, tokenizer=tokenizer, move_to_device=False)
    model.load_and_process_state_dict(
        state_dict,
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
        refactor_factored_attn_matrices=False,
    )
    model.headsurgeon_info = ModelInfo(
        name=name,
        source=source,
        prepend_bos=bool(model.cfg.default_prepend_bos),
        train_ctx=train_ctx,
        hf_config=hf_config,
        metadata=metadata or {},
        tokenizer=tokenizer,
    )
    if model.cfg.positional_embedding_type == "alibi":
        _install_exact_alibi(model)
    model.eval()
    return model


def model_info(model: HookedTransformer) -> ModelInfo:
    """The :class:`ModelInfo` of a model: where it came from and its conventions.

    Models loaded here carry theirs; for any other HookedTransformer one is made from its config
    and tokenizer at each call, and nothing is stored on the model. ``prepend_bos`` is always read
    from ``model.cfg.default_prepend_bos``, so changing that setting takes effect at once.
    """
    info = getattr(model, "headsurgeon_info", None)
    prepend_bos = bool(model.cfg.default_prepend_bos)
    if info is None:
        return ModelInfo(
            name=model.cfg.model_name,
            source=None,
            prepend_bos=prepend_bos,
            train_ctx=None,
            hf_config={},
            tokenizer=model.tokenizer,
        )
    return dataclasses.replace(info, prepend_bos=prepend_bos)


_ATTENTION_ARGS = ("query_input", "key_input", "value_input", "past_kv_cache_entry")

# Builds the [head, query, key] bias for the last n_queries of n_keys positions on a device.
BiasBuilder = Callable[[int, int, torch.device], Float[Tensor, "head query key"]]


def bias_pre_hook(build: BiasBuilder) -> Callable[[torch.nn.Module, tuple, dict], None]:
    """A forward pre-hook for an attention module that puts ``build``'s bias in place.

    TransformerLens adds ``module.alibi[:, -query_ctx:, :key_ctx]`` and rebuilds the tensor with
    its power-of-two slopes only when ``key_ctx`` outgrows it. A tensor holding exactly this call's
    rows is used as is, and keeps ``hook_attn_scores`` equal to ``q.k/sqrt(d) + bias``: a longer
    cached one would shift every row by a constant (harmless to the softmax, wrong logits).
    Hooks run in registration order, so the last one registered decides the bias.
    """

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = dict(zip(_ATTENTION_ARGS, args, strict=False)) | kwargs
        cache_entry = inputs.get("past_kv_cache_entry")
        # Position is dim 1 with or without split per-head inputs ([batch, pos, (head,) d_model]).
        n_queries = inputs["query_input"].shape[1]
        n_keys = inputs["key_input"].shape[1]
        if cache_entry is not None:
            n_keys += cache_entry.past_keys.shape[1]
        module.alibi = build(n_queries, n_keys, inputs["query_input"].device)

    return hook


@functools.lru_cache(maxsize=8)
def shared_bias(
    kind: str,
    params: tuple[tuple[str, Any], ...],
    head_slopes: tuple[float, ...],
    n_queries: int,
    n_keys: int,
    device: torch.device,
) -> Float[Tensor, "head query key"]:
    """One bias tensor per kind and shape, shared by all layers (TransformerLens only reads it).

    ``params`` and ``head_slopes`` are tuples so that the call can be cached.
    """
    distance = alibi.distance_rows(n_queries, n_keys, device)
    return alibi.bias_from_distance(kind, torch.tensor(head_slopes), distance, **dict(params))


def _install_exact_alibi(model: HookedTransformer) -> None:
    """The exact-slope pre-hook on every attention layer, silently (idempotent)."""
    head_slopes = tuple(alibi.slopes(model.cfg.n_heads).tolist())
    build = functools.partial(shared_bias, "standard", (), head_slopes)
    for block in model.blocks:
        attn = block.attn
        if getattr(attn, "headsurgeon_alibi_hook", None) is None:
            attn.headsurgeon_alibi_hook = attn.register_forward_pre_hook(
                bias_pre_hook(build), with_kwargs=True
            )
        attn.alibi = None


def use_exact_alibi(model: HookedTransformer) -> None:
    """Give every attention layer Hugging Face's exact ALiBi slopes (idempotent).

    **This changes the model's outputs** whenever its head count is not a power of two:
    TransformerLens 3.x uses ``2^(-8(h+1)/H)`` for every ``H``, Hugging Face BLOOM interleaves a
    second series (a random 6-head model's logits moved by ~1 here). Call it to make a model built
    from a TransformerLens config compute what the BLOOM checkpoint it stands for computes
    (models from :func:`load_model` have it already); a warning says when the slopes change.
    Nothing in headsurgeon needs it: every tool reads the slopes the model uses
    (:func:`alibi_slopes`).

    A forward pre-hook on each attention module, so ``model.reset_hooks()`` keeps it; its handle
    is ``block.attn.headsurgeon_alibi_hook``.
    """
    if model.cfg.positional_embedding_type != "alibi":
        raise UnsupportedArchitectureError(
            f"use_exact_alibi applies to ALiBi models; this one uses "
            f"{model.cfg.positional_embedding_type} positions"
        )
    before, exact = alibi_slopes(model), alibi.slopes(model.cfg.n_heads)
    if not torch.equal(before, exact):
        warnings.warn(
            "use_exact_alibi changes this model's ALiBi slopes from "
            f"{_rounded(before)} to Hugging Face's {_rounded(exact)}: its outputs change",
            stacklevel=2,
        )
    _install_exact_alibi(model)


def _rounded(values: Tensor) -> list[float]:
    return [float(f"{x:.3g}") for x in values.tolist()]


def alibi_slopes(model: HookedTransformer) -> Float[Tensor, " head"]:
    """The ALiBi slopes ``model`` applies (float32), read from the model, never assumed.

    Models from :func:`load_model` (and after :func:`use_exact_alibi`) use Hugging Face's exact
    slopes; any other HookedTransformer uses what its attention class builds (TransformerLens
    3.x: ``2^(-8(h+1)/H)`` for every head count ``H``, exact only for powers of two). Mitigations
    (:func:`headsurgeon.blindness.mitigation`) change the bias, not these slopes.

    >>> from transformer_lens import HookedTransformerConfig
    >>> cfg = HookedTransformerConfig(n_layers=1, d_model=24, n_heads=6, d_head=4, n_ctx=8,
    ...                               d_vocab=9, act_fn="gelu_new",
    ...                               positional_embedding_type="alibi")
    >>> [round(x, 4) for x in alibi_slopes(HookedTransformer(cfg)).tolist()]
    [0.3969, 0.1575, 0.0625, 0.0248, 0.0098, 0.0039]
    """
    if model.cfg.positional_embedding_type != "alibi":
        raise UnsupportedArchitectureError(
            f"the model uses {model.cfg.positional_embedding_type} positions, not ALiBi; "
            "it has no ALiBi slopes"
        )
    attn = model.blocks[0].attn
    if getattr(attn, "headsurgeon_alibi_hook", None) is not None:
        return alibi.slopes(model.cfg.n_heads)
    # The bias the attention class itself builds for two positions: row 1 is [-m_h, 0].
    bias = type(attn).create_alibi_bias(model.cfg.n_heads, 2, "cpu")
    return -bias[:, 1, 0].to(torch.float32)


def random_hf_bloom(shape: ModelShape | str, *, seed: int = 0, dtype: str = "float32") -> Any:
    """A ``transformers`` BLOOM with random weights (its own initialisation) of a given shape."""
    from transformers import BloomConfig, BloomForCausalLM

    if isinstance(shape, str):
        shape = model_shape(shape)
    config = BloomConfig(
        vocab_size=shape.d_vocab,
        hidden_size=shape.d_model,
        n_layer=shape.n_layers,
        n_head=shape.n_heads,
        seq_length=shape.n_ctx,
        architectures=["BloomForCausalLM"],
    )
    torch.manual_seed(seed)
    return BloomForCausalLM(config).to(parse_dtype(dtype)).eval()


def random_model(
    shape: ModelShape | str, *, seed: int = 0, dtype: str = "float32"
) -> HookedTransformer:
    """A HookedTransformer BLOOM with random weights of a given or named shape."""
    hf_model = random_hf_bloom(shape, seed=seed, dtype=dtype)
    cfg = hf_model.config
    return from_hf_model(hf_model, name=f"random-{cfg.n_layer}x{cfg.n_head}x{cfg.hidden_size}")


def _bloom_config(model: HookedTransformer, info: ModelInfo) -> dict[str, Any]:
    cfg = model.cfg
    config = dict(info.hf_config)
    config.update(
        architectures=["BloomForCausalLM"],
        model_type="bloom",
        vocab_size=cfg.d_vocab,
        hidden_size=cfg.d_model,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        layer_norm_epsilon=cfg.eps,
    )
    config.setdefault("seq_length", cfg.n_ctx)  # BLOOM computes any length; read by model_shape
    return config


def hf_state_dict(model: HookedTransformer) -> dict[str, torch.Tensor]:
    """BLOOM state dict in Hugging Face layout (fused query_key_value), inverse of TL's loader.

    Tensors are contiguous and on the CPU; those that already were may share memory with the
    model, so clone before editing them.
    """
    cfg = model.cfg
    sd = model.state_dict()
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
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


# HookedTransformerConfig fields that do not change what a model computes (names, devices,
# initialisation, hook points, tokenizer conventions), that config.json states (n_ctx as
# seq_length, dtype) or that only apply to positional schemes other than ALiBi (whose own field,
# positional_embedding_type, is compared).
_NOT_COMPUTED = frozenset({
    "model_name", "tokenizer_name", "tokenizer_prepends_bos", "default_prepend_bos",
    "original_architecture", "n_ctx", "dtype", "device", "n_devices", "seed", "init_mode",
    "init_weights", "initializer_range", "n_params", "from_checkpoint", "trust_remote_code",
    "use_attn_result", "use_split_qkv_input", "use_hook_mlp_in", "use_attn_in", "use_hook_tokens",
    "tie_word_embeddings", "decoder_start_token_id", "train_seq_length", "window_size",
    "attn_types", "experts_per_token", "norm_topk_prob", "use_dynamic_ntk_rope",
    "use_NTK_by_parts_rope", "use_yarn_rope",
})  # fmt: skip
_NOT_COMPUTED_PREFIXES = ("checkpoint_", "rotary_", "NTK_", "yarn_", "relative_attention_")
# TransformerLens's names for BLOOM's activation, the tanh approximation of GELU.
_TANH_GELU = frozenset({"gelu_new", "gelu_fast", "gelu_pytorch_tanh"})
# The export check: random tokens (fixed seed), compared in float32.
_PROBE_SEQS, _PROBE_LEN, _PROBE_SEED = 4, 32, 0
EXPORT_ATOL = 1e-4
EXPORT_RTOL = 1e-5
_TOLERANCE = "1e-4 + 1e-5"


def _bloom_differences(model: HookedTransformer, config: dict[str, Any]) -> list[str]:
    """What ``model`` computes that the BLOOM ``config`` (and BLOOM's weights) cannot express.

    The reference is the TransformerLens config that ``config`` itself converts to, so every
    field TransformerLens knows is compared, not a hand-kept list of BLOOM's settings.
    """
    cfg = model.cfg
    with tempfile.TemporaryDirectory(prefix="headsurgeon-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        bloom = _tl_config(Path(tmp), dtype=cfg.dtype)
    found = []
    if cfg.original_architecture not in (None, "BloomForCausalLM"):
        found.append(f"architecture {cfg.original_architecture}")
    for field in dataclasses.fields(bloom):
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
    if cfg.positional_embedding_type == "alibi":
        applied, exact = alibi_slopes(model), alibi.slopes(cfg.n_heads)
        if not torch.allclose(applied, exact, rtol=1e-6, atol=0.0):
            found.append(
                f"ALiBi slopes {_rounded(applied)} are not BLOOM's for {cfg.n_heads} heads "
                f"{_rounded(exact)} (TransformerLens's power-of-two formula): "
                "headsurgeon.models.use_exact_alibi(model) switches them, changing its outputs"
            )
    if torch.any(model.unembed.b_U != 0):
        found.append("a non-zero unembedding bias b_U (BLOOM has none)")
    return found


def _difference(name: str, ours: Any, theirs: Any, cfg: HookedTransformerConfig) -> str:
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


_SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


def checkpoint_dtype(model: HookedTransformer) -> torch.dtype | None:
    """The dtype of the checkpoint ``model`` was loaded from, None when that is unknown.

    Read from the source folder of a model from :func:`load_model`: the dtype its safetensors
    hold (every floating tensor), else ``config.json``'s ``dtype``/``torch_dtype``. The bundled
    organisms are float16 on disk and load as float32. None for a model built in memory (a
    TransformerLens config, :func:`from_hf_model` without a folder) or whose folder is gone.

    >>> print(checkpoint_dtype(random_model(ModelShape(1, 2, 8, 16, 8))))
    None
    """
    source = model_info(model).source
    if source is None or not source.is_dir():
        return None
    from safetensors import safe_open

    found: set[str] = set()
    try:
        for file in sorted(source.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                found.update(f.get_slice(key).get_dtype() for key in f.keys())  # noqa: SIM118
    except Exception:  # unreadable weights: fall back to the config
        found = set()
    floating = found & {"F16", "BF16", "F32", "F64"}
    if len(floating) == 1:
        return _SAFETENSORS_DTYPES.get(floating.pop())
    try:
        config = json.loads((source / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    named = config.get("dtype") or config.get("torch_dtype")
    return DTYPES.get(named) if isinstance(named, str) else None


def _probe_tokens(model: HookedTransformer, device: torch.device) -> Tensor:
    """The export check's probe batch: a few random sequences within the vocabulary and context."""
    generator = torch.Generator().manual_seed(_PROBE_SEED)
    shape = (_PROBE_SEQS, min(_PROBE_LEN, model.cfg.n_ctx))
    return torch.randint(0, model.cfg.d_vocab, shape, generator=generator).to(device)


def _float32_logits(model: HookedTransformer, tokens: Tensor) -> Tensor:
    """``model``'s logits computed in float32 (its hooks included), the model left as it was.

    A float16 or bfloat16 model runs this one forward pass on float32 copies of its tensors;
    then each tensor gets its own storage back (the same memory, so views stay views).
    """
    narrow = [t for t in (*model.parameters(), *model.buffers())
              if t.is_floating_point() and t.dtype != torch.float32]  # fmt: skip
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
    model: HookedTransformer, folder: Path, unrounded: dict[str, Tensor] | None
) -> float | None:
    """Reload ``folder`` with ``transformers`` (float32) and compare logits with ``model``'s.

    ``unrounded``: the weights before rounding to the written dtype, when rounding changed any;
    the export is then checked with them, and how far rounding moves the logits is returned.
    """
    from transformers import BloomForCausalLM
    from transformers.utils import logging as hf_logging

    device = model.embed.W_E.device
    tokens = _probe_tokens(model, device)
    tf32 = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # TF32 would exceed the tolerance by itself
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        expected = _float32_logits(model, tokens)
        hf, loading = BloomForCausalLM.from_pretrained(
            folder, dtype=torch.float32, local_files_only=True, output_loading_info=True
        )
        bad = sorted(loading["missing_keys"]) + sorted(str(k) for k in loading["mismatched_keys"])
        if bad:
            raise CheckpointError(
                f"transformers could not read {len(bad)} exported weight(s) (first: {bad[0]}); "
                "nothing written"
            )
        hf = hf.to(device).eval()
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


def _check_export_dir(out_dir: str | os.PathLike, overwrite: bool) -> None:
    """Refuse, before any work, an ``out_dir`` that cannot become a new checkpoint folder."""
    path = check_output_dir(out_dir, overwrite)  # a file, or a folder holding files
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputExistsError(f"cannot create {path}: {ancestor} is a file; choose a folder path")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise InvalidArgumentError(f"cannot create {path}: {ancestor} is not writable")


def save_hf(
    model: HookedTransformer,
    out_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    dtype: str | torch.dtype | None = None,
    verify: bool = True,
) -> Path:
    """Export a BLOOM HookedTransformer as a Hugging Face checkpoint folder (safetensors).

    The fused ``query_key_value`` is rebuilt in BLOOM's per-head (q, k, v) layout; embeddings stay
    tied where the source tied them and ``W_U`` still equals ``W_E.T`` (otherwise ``lm_head`` is
    written separately and the config unties them). Tokenizer files are copied from the source
    folder verbatim when there is one. The folder appears atomically; a non-empty ``out_dir`` is
    refused unless ``overwrite=True``.

    Before anything is written, a model that BLOOM's format cannot represent is refused with one
    :class:`UnsupportedArchitectureError` naming every difference (slopes that are not BLOOM's,
    another activation, positional scheme or normalisation, no embedding LayerNorm, folded
    weights, ...). ``dtype``: the written dtype (recorded in ``config.json``); by default the
    dtype of the checkpoint the model came from (:func:`checkpoint_dtype`; the organisms'
    float16), else the model's own. ``verify`` (default): before the folder is renamed into
    place, it is reloaded with ``transformers`` in float32 and its logits on a few random token
    sequences are compared with the model's own (computed in float32); a gap above
    ``1e-4 + 1e-5 x |logit|`` removes it and raises :class:`CheckpointError`. This holds a
    float32 copy of the model; pass ``verify=False`` for models too large to hold twice.
    """
    from safetensors.torch import save_file

    _check_export_dir(out_dir, overwrite)
    info = model_info(model)
    config = _bloom_config(model, info)
    differences = _bloom_differences(model, config)
    if differences:
        raise UnsupportedArchitectureError(
            f"save_hf cannot write {info.name!r} as a BLOOM checkpoint: {'; '.join(differences)}"
        )
    source_dtype = checkpoint_dtype(model)
    if dtype is not None:
        save_dtype = parse_dtype(dtype)
    else:
        save_dtype = source_dtype or model.embed.W_E.dtype
    dtype_name = str(save_dtype).removeprefix("torch.")
    state = hf_state_dict(model)
    tied = config.get("tie_word_embeddings", True) and torch.equal(
        state["lm_head.weight"], state["transformer.word_embeddings.weight"]
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
                f"{name} has weights beyond {dtype_name}'s range (largest "
                f"|w| {tensor.abs().max().item():.3g}); pass dtype='float32'"
            )
        rounded += int((written[name].to(tensor.dtype) != tensor).count_nonzero())
    unrounded = state if verify and rounded else None
    del state
    config.pop("torch_dtype", None)  # transformers 5 calls it dtype; the old key would conflict
    config["dtype"] = dtype_name
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        save_file(written, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del written
        atomic_write_text(tmp / "config.json", json.dumps(config, indent=2, sort_keys=True))
        # safetensors creates its file private (0600); give it the umask's mode, as config.json.
        shutil.copymode(tmp / "config.json", tmp / "model.safetensors")
        metadata = dict(info.metadata)
        metadata.update(prepend_bos=info.prepend_bos, exported_from=info.name)
        atomic_write_text(tmp / METADATA_FILE, json.dumps(metadata, indent=2, default=str))
        if info.source is not None and (info.source / "tokenizer_config.json").exists():
            for file in TOKENIZER_FILES:
                if (info.source / file).exists():
                    shutil.copyfile(info.source / file, tmp / file)
        elif info.tokenizer is not None:
            info.tokenizer.save_pretrained(tmp)
        moved = _verify_export(model, tmp, unrounded) if verify else None
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
    logger.info("saved %s to %s", info.name, out_dir)
    return Path(out_dir)


StateDict = Mapping[str, Tensor]


class _SafetensorsState(Mapping[str, Tensor]):
    """A checkpoint folder's tensors (every shard), read one at a time when asked for."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self._files: dict[str, Path] = {}
        for file in sorted(directory.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                self._files.update(dict.fromkeys(f.keys(), file))

    def __getitem__(self, name: str) -> Tensor:
        from safetensors import safe_open

        with safe_open(str(self._files[name]), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self):
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def _checkpoint_state(checkpoint: StateDict | str | os.PathLike) -> tuple[StateDict, int | None]:
    """A checkpoint's Hugging Face state dict (lazy for folders) and head width (when known)."""
    if isinstance(checkpoint, Mapping):
        return checkpoint, None
    _, directory = _resolve(checkpoint)
    _check_checkpoint(directory)
    if not any(directory.glob("*.safetensors")):
        raise CheckpointError(
            f"{directory} has only pickled .bin weights; re-export it as safetensors "
            "(load_model, then save_hf)"
        )
    config = _read_json(directory / "config.json")
    n_heads, width = config.get("n_head"), config.get("hidden_size")
    return _SafetensorsState(directory), width // n_heads if n_heads and width else None


def weight_changes(
    before: StateDict | str | os.PathLike,
    after: StateDict | str | os.PathLike,
    heads: Iterable[tuple[int, int]] = (),
    *,
    d_head: int | None = None,
) -> pd.DataFrame:
    """Which weights changed between two BLOOM checkpoints, inside and outside ``heads``' slices.

    ``before``/``after``: Hugging Face state dicts, or anything :func:`load_model` takes
    (checkpoint folders, bundled organisms' names), whose tensors are then read one at a time so
    two large checkpoints need not fit in memory together. A head's slices are its rows of the
    fused ``query_key_value`` weight and bias (per head ``(q, k, v) x d_head``, BLOOM's layout)
    and its ``d_head`` columns of the output projection ``dense.weight``; everything else
    (``dense.bias`` included) is shared by all heads.
    Values are compared exactly in the wider of the two dtypes (float16 -> float32 is exact), so a
    repair or a planting that must leave every other weight bit-identical can be checked: the
    ``other_changed`` column must sum to 0. ``d_head`` is read from a folder's ``config.json``
    unless given. One row per tensor of ``before``: ``tensor``, ``dtype_before``, ``dtype_after``,
    ``elements``, ``head_elements``, ``head_changed``, ``other_changed``.

    >>> qkv = "transformer.h.0.self_attention.query_key_value.weight"
    >>> dense = "transformer.h.0.self_attention.dense.weight"
    >>> before = {qkv: torch.zeros(12, 4), dense: torch.zeros(4, 4)}  # 2 heads of width 2
    >>> after = {name: weight.clone() for name, weight in before.items()}
    >>> after[qkv][0, 0] = 1.0  # head 0's query
    >>> after[dense][0, 3] = 1.0  # head 1's output column
    >>> changes = weight_changes(before, after, [(0, 1)], d_head=2)
    >>> changes[["head_changed", "other_changed"]].values.tolist()
    [[0, 1], [1, 0]]
    """
    before_state, before_width = _checkpoint_state(before)
    after_state, after_width = _checkpoint_state(after)
    d_head = d_head or before_width or after_width
    heads = list(heads)
    if heads and d_head is None:
        raise InvalidArgumentError("d_head is unknown for state dicts; pass d_head=")
    qkv_rows = {}  # per layer of the heads: read once, not once per head
    for layer in {layer for layer, _ in heads}:
        qkv = before_state.get(f"transformer.h.{layer}.self_attention.query_key_value.weight")
        qkv_rows[layer] = 0 if qkv is None else qkv.shape[0]
    for layer, head in heads:
        if not 0 <= head < qkv_rows[layer] // (3 * d_head):
            raise InvalidArgumentError(
                f"head L{layer}H{head} is not in the first checkpoint; pass heads of its model"
            )
    missing = sorted(set(before_state) - set(after_state))
    if missing:
        raise CheckpointError(
            f"the second checkpoint lacks {len(missing)} tensor(s) of the first, e.g. "
            f"{missing[0]}; compare checkpoints of the same model"
        )
    # One tensor pair at a time, inside a call, so none outlives its row (a lazy folder then
    # holds at most the largest tensor of each checkpoint).
    rows = [_tensor_changes(name, before_state[name], after_state[name], heads, d_head)
            for name in before_state]  # fmt: skip
    return pd.DataFrame(rows)


def _tensor_changes(
    name: str, old: Tensor, new: Tensor, heads: list[tuple[int, int]], d_head: int | None
) -> dict[str, Any]:
    """One row of :func:`weight_changes`: ``name``'s changed elements inside / outside heads."""
    if old.shape != new.shape:
        raise CheckpointError(
            f"{name} has shape {tuple(old.shape)} before and {tuple(new.shape)} after; "
            "compare checkpoints of the same model"
        )
    common = torch.promote_types(old.dtype, new.dtype)
    changed = old.to(common) != new.to(common)
    in_heads = torch.zeros(old.shape, dtype=torch.bool)
    for layer, head in heads:
        prefix = f"transformer.h.{layer}.self_attention."
        if name in (prefix + "query_key_value.weight", prefix + "query_key_value.bias"):
            in_heads[head * 3 * d_head : (head + 1) * 3 * d_head] = True
        elif name == prefix + "dense.weight":
            in_heads[:, head * d_head : (head + 1) * d_head] = True
    # count_nonzero, not sum: summing a bool tensor first copies it to int64 (8x its size).
    head_changed = int((changed & in_heads).count_nonzero())
    return {
        "tensor": name,
        "dtype_before": str(old.dtype).removeprefix("torch."),
        "dtype_after": str(new.dtype).removeprefix("torch."),
        "elements": old.numel(),
        "head_elements": int(in_heads.count_nonzero()),
        "head_changed": head_changed,
        "other_changed": int(changed.count_nonzero()) - head_changed,
    }
