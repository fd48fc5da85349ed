"""Loading models (by name, bundled organism or local folder) and the facts the tools need.

Exports:
    load_model(model, dtype, device)  HookedTransformer, unprocessed weights, exact ALiBi
    from_hf_model(hf_model, tokenizer, ...)  wrap an in-memory transformers model
    random_model(shape, seed)                random-weight BLOOM of a given or named shape
    random_hf_bloom(shape, seed)             the same, as a transformers model
    model_shape(model)               ModelShape without loading weights
    model_info(model)                        ModelInfo: where a model came from, its conventions
    organism_names(), DEFAULT_MODEL, ORGANISM_DIR, BLOOM_SHAPES, ModelShape, ModelInfo
    resolve_model(model)              (display name, local checkpoint folder)
    check_checkpoint(directory)              a checkpoint folder validated before reading weights
    read_json(path), tl_config(config_dir)   a checkpoint's JSON; TransformerLens's config for it
    METADATA_FILE, TOKENIZER_FILES           the files of a checkpoint folder besides weights

Weights stay exactly as in the checkpoint (no LayerNorm folding, no centring), so every per-head
slice of ``W_Q``/``W_K``/``W_V``/``W_O`` maps 1:1 back to the checkpoint and
:func:`headsurgeon.checkpoints.save_hf` round trips bit for bit. Models loaded here get Hugging
Face's exact ALiBi slopes for any head count (:mod:`headsurgeon.exact_alibi`).

>>> model = random_model(ModelShape(n_layers=1, n_heads=6, d_model=48, d_vocab=64, n_ctx=32))
>>> model.cfg.n_heads, model_info(model).prepend_bos
(6, False)
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import pickle
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from transformer_lens import (
    HookedTransformer,
    HookedTransformerConfig,
    loading_from_pretrained as tl_loading,
)

from headsurgeon.dtypes import parse_device, parse_dtype
from headsurgeon.errors import (
    CheckpointError,
    ModelNotFoundError,
    UnknownModelError,
    UnsupportedArchitectureError,
)
from headsurgeon.exact_alibi import install_exact_alibi

__all__ = [
    "BLOOM_SHAPES",
    "DEFAULT_MODEL",
    "METADATA_FILE",
    "ORGANISM_DIR",
    "TOKENIZER_FILES",
    "ModelInfo",
    "ModelShape",
    "check_checkpoint",
    "from_hf_model",
    "load_model",
    "model_info",
    "model_shape",
    "organism_names",
    "random_hf_bloom",
    "random_model",
    "read_json",
    "resolve_model",
    "tl_config",
]

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


def organism_names() -> list[str]:
    """Short names of the model organisms bundled with the package."""
    if not ORGANISM_DIR.is_dir():
        return []
    return sorted(p.name for p in ORGANISM_DIR.iterdir() if (p / "config.json").exists())


def _hub_names() -> dict[str, str]:
    """Map every TransformerLens name and alias (lower case) to its official hub name."""
    return tl_loading.make_model_alias_map()


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not readable JSON ({e}); re-export the checkpoint") from e


def _local_shape(directory: Path) -> ModelShape:
    cfg = read_json(directory / "config.json")
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


def model_shape(model: str | os.PathLike | HookedTransformer) -> ModelShape:
    """Shape of a model, a BLOOM name (no weights needed), a bundled organism or a folder.

    >>> model_shape("bloom-176b").n_heads
    112
    """
    if isinstance(model, HookedTransformer):
        cfg = model.cfg
        # TransformerLens sets n_ctx = 2048 for every BLOOM; the checkpoint's own value wins.
        n_ctx = model_info(model).hf_config.get("seq_length", cfg.n_ctx)
        return ModelShape(
            cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_vocab, n_ctx,
            cfg.positional_embedding_type,
        )  # fmt: skip
    name = str(model)
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


def resolve_model(model: str | os.PathLike) -> tuple[str, Path]:
    """Turn a user's model argument into (display name, local checkpoint folder)."""
    name = str(model)
    if name in organism_names():
        return name, ORGANISM_DIR / name
    path = Path(name).expanduser()
    looks_like_path = isinstance(model, os.PathLike) or "/" in name or os.sep in name
    looks_like_path = looks_like_path or name.startswith((".", "~"))
    if path.exists():
        return path.name or name, path
    official = _hub_names().get(name.lower())
    if official is not None:
        return name, _hub_snapshot(official)
    if looks_like_path:
        raise ModelNotFoundError(f"model folder {name} does not exist; check the path")
    raise UnknownModelError(_unknown_message(name, list(_hub_names()) + organism_names()))


def tl_config(
    config_dir: Path, *, dtype: torch.dtype = torch.float32, prepend_bos: bool | None = None
) -> HookedTransformerConfig:
    """TransformerLens's config for the ``config.json`` in ``config_dir`` (a folder of ours).

    TransformerLens guesses the architecture of any path that contains "llama" or "gemma" from the
    path alone, so it is only ever shown a private temporary folder, never the user's.
    """
    hf_config = read_json(config_dir / "config.json")
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


def check_checkpoint(directory: Path) -> None:
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
    config = read_json(directory / "config.json")  # errors name the user's file, not a copy
    with tempfile.TemporaryDirectory(prefix="headsurgeon-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        tl_config(Path(tmp))


def load_model(
    model: str | os.PathLike = DEFAULT_MODEL,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> HookedTransformer:
    """Load a model as a HookedTransformer with unprocessed weights and exact ALiBi.

    ``model`` is a bundled organism (``organism``, ``organism-injured``), a TransformerLens
    name or alias (``bloom-560m``, ``bigscience/bloom-560m``; from the Hugging Face cache, else
    downloaded; ``HF_HUB_OFFLINE=1`` respected), or a local Hugging Face checkpoint folder (never
    touches the network). Files are read as safetensors (``torch.load(weights_only=True)`` for
    legacy ``.bin``); remote code is never trusted.
    """
    torch_dtype = parse_dtype(dtype)
    torch_device = parse_device(device)
    name, directory = resolve_model(model)
    check_checkpoint(directory)
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
    metadata = read_json(directory / METADATA_FILE) if (directory / METADATA_FILE).exists() else {}
    loaded = from_hf_model(
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
    return loaded.to(torch_device, print_details=False)


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
        cfg = tl_config(Path(tmp), dtype=torch_dtype, prepend_bos=prepend_bos)
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
        install_exact_alibi(model)
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
