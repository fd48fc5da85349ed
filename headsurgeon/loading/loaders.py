"""Loading a model: from a name, a bundled organism or a folder, from memory, or random.

The folder is validated first (:func:`headsurgeon.loading.checks.check_checkpoint`), then read by
transformers (safetensors; ``torch.load(weights_only=True)`` for legacy ``.bin``; remote code never
trusted) and converted by the installed TransformerLens with its weights unprocessed.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import Tensor

from headsurgeon import backend, families
from headsurgeon.allocator import return_freed_memory
from headsurgeon.backend import Model, bounded
from headsurgeon.backend.bounded import BOUNDED_ARCHITECTURES
from headsurgeon.dtypes import parse_device, parse_dtype
from headsurgeon.errors import CheckpointError, first_line
from headsurgeon.exact_alibi import install_exact_alibi, trained_bias
from headsurgeon.loading.checks import checked_folder
from headsurgeon.loading.facts import ModelInfo, ModelShape, model_shape
from headsurgeon.loading.files import (
    METADATA_FILE,
    TOKENIZER_FILES,
    corrupt_bin,
    read_json,
    some_names,
    weight_files,
)
from headsurgeon.loading.metadata import check_metadata
from headsurgeon.loading.sources import resolve_model
from headsurgeon.model_names import DEFAULT_MODEL
from headsurgeon.placement import (
    Placement,
    adopt,
    check_offload_folder,
    check_placement,
    dispatch,
    from_pretrained_args,
    placing,
    release_offload,
)
from headsurgeon.validation import MAX_SEED, check_bool, check_int

logger = logging.getLogger(__name__)

__all__ = [
    "from_hf_model",
    "load_model",
    "random_hf_bloom",
    "random_model",
]


def load_model(
    model: str | os.PathLike = DEFAULT_MODEL,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device | None = None,
    device_map: str | dict[str, int | str] | None = None,
    max_memory: dict[int | str, int | str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    allow_nonfinite: bool = False,
) -> Model:
    """Load a model with unprocessed weights and exact ALiBi.

    A ``HookedTransformer`` on TransformerLens 3.x, a ``TransformerBridge`` on 4.x.

    ``model`` is a bundled organism (``organism``, ``organism-injured``), a TransformerLens
    name or alias (``bloom-560m``, ``bigscience/bloom-560m``; from the Hugging Face cache, else
    downloaded; ``HF_HUB_OFFLINE=1`` respected), or a local Hugging Face checkpoint folder (never
    touches the network). Files are read as safetensors (``torch.load(weights_only=True)`` for
    legacy ``.bin``); remote code is never trusted.

    The folder is checked first (:func:`check_checkpoint`: regular files, config against the
    weights' shapes and dtypes, ``headsurgeon.json``). Weights that hold NaN or infinity are
    refused in one :class:`CheckpointError` line naming a few of the tensors (a census would
    report their heads as dead); ``allow_nonfinite=True`` loads them with a warning instead,
    to inspect a broken model.

    ``device`` (default cpu) puts the whole model on one device; ``device_map``, ``max_memory``
    and ``offload_folder`` spread it over GPUs, CPU memory and disk with Hugging Face Accelerate,
    as :mod:`headsurgeon.placement` describes: a model larger than the memory given to it never
    passes through memory whole (TransformerLens 4.x; on 3.x, a BLOOM in safetensors); an
    ``offload_folder`` that is or lies inside the model's folder is one line.
    """
    torch_dtype = parse_dtype(dtype)
    placement = check_placement(device_map, max_memory, offload_folder, device)
    torch_device = parse_device(device if device is not None else "cpu")
    allow_nonfinite = check_bool(allow_nonfinite, "allow_nonfinite")
    name, directory = resolve_model(model)
    if placement is not None:  # its offload copy must not be written into the model's folder
        check_offload_folder(placement.offload_folder, [("the model folder", directory)])
        return_freed_memory()  # a memory budget: freed buffers must not pile up on the heap
    metadata = checked_folder(directory)
    if placement and _by_part(directory):
        return _load_by_part(directory, name, metadata, torch_dtype, allow_nonfinite, placement)
    # 4.x reads the checkpoint straight into the map; 3.x dispatches the model it built.
    if placement and backend.loads_into_device_map():
        streamed, folder = from_pretrained_args(placement, directory)
    else:
        streamed, folder = {}, None
    try:
        loaded = _load_folder(directory, name, metadata, torch_dtype, allow_nonfinite, streamed)
    except BaseException:
        if folder is not None:  # ours, made above; the model it was for never came
            release_offload(folder)
        raise
    if folder is not None:
        return adopt(loaded, folder)
    if placement is not None:
        return dispatch(loaded, placement)
    return backend.move(loaded, torch_device)


def _by_part(directory: Path) -> bool:
    """Whether a placed 3.x load builds the model part by part (:mod:`headsurgeon.backend.bounded`:
    a BLOOM in safetensors); else says, before loading, that it needs the model's size."""
    if backend.loads_into_device_map():
        return False
    architecture = (read_json(directory / "config.json").get("architectures") or ["?"])[0]
    files = weight_files(directory)
    if architecture in BOUNDED_ARCHITECTURES and all(f.suffix == ".safetensors" for f in files):
        return True
    logger.warning(
        "%s builds %s from %s whole before placing it: loading needs the model's full size in "
        "memory once; TransformerLens 4.x (pip install 'transformer-lens>=4') reads it straight "
        "into the placement%s",
        backend.TRANSFORMER_LENS,
        architecture,
        "legacy .bin weights" if architecture in BOUNDED_ARCHITECTURES else "its checkpoint",
        ", as does 3.x for a BLOOM in safetensors" if architecture != "BloomForCausalLM" else "",
    )
    return False


def _load_by_part(
    directory: Path,
    name: str,
    metadata: dict[str, Any],
    torch_dtype: torch.dtype,
    allow_nonfinite: bool,
    placement: Placement,
) -> Model:
    """A checked BLOOM folder as a 3.x model built on the meta device, each part read, converted
    and placed in turn: peak memory is what the placement keeps plus one part. The same weights,
    bit for bit, as :func:`_load_folder` then :func:`dispatch`."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    tokenizer = _tokenizer(directory)
    prepend_bos = metadata.get("prepend_bos")
    model = bounded.empty_model(
        config, tokenizer, name=name, prepend_bos=prepend_bos, dtype=torch_dtype
    )
    bad: list[str] = []
    with placing(model, placement) as (place, device_map, folder):
        bounded.fill(model, config, _reader(directory, bad), place)
        _report_nonfinite(bad, directory, allow_nonfinite)
    # Dispatched first: its offloaded weights are on meta until Accelerate's hooks hold them.
    model = dispatch(model, placement, device_map=device_map, folder=folder)
    return _finish(
        model, config.to_dict(), tokenizer, name, directory, _train_ctx(metadata), metadata
    )


def _reader(directory: Path, bad: list[str]) -> Callable[[tuple[str, ...]], dict[str, Tensor]]:
    """``read(names)`` for :func:`headsurgeon.backend.bounded.fill`: the folder's tensors by
    BloomForCausalLM's names (a name ending in ``.``: all under it), each read alone from its
    safetensors file; those holding NaN or infinity are added to ``bad``."""
    from safetensors import safe_open

    where = {}
    for file in weight_files(directory):
        with safe_open(file, framework="pt") as f:
            for stored in f.keys():  # noqa: SIM118  (a safe_open handle is no dict)
                # BloomModel's files (bigscience's) name them without "transformer.".
                own = stored.startswith(("transformer.", "lm_head."))
                where[stored if own else "transformer." + stored] = (file, stored)

    def read(names: tuple[str, ...]) -> dict[str, Tensor]:
        tensors = {}
        for name in names:
            for key in [
                k for k in where if k == name or (name.endswith(".") and k.startswith(name))
            ]:
                file, stored = where[key]
                try:
                    with safe_open(file, framework="pt") as f:
                        tensors[key] = f.get_tensor(stored)
                except (OSError, RuntimeError, MemoryError, SafetensorError) as e:
                    raise _load_failure(file, e) from e
                if tensors[key].is_floating_point() and not _finite(tensors[key]):
                    bad.append(key)
        return tensors

    return read


def _load_folder(
    directory: Path,
    name: str,
    metadata: dict[str, Any],
    torch_dtype: torch.dtype,
    allow_nonfinite: bool,
    streamed: dict[str, Any],
) -> Model:
    """The checked folder's model (``streamed``: from_pretrained's placement arguments)."""
    from transformers import AutoModelForCausalLM
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
            **streamed,
        )
    except (EOFError, pickle.UnpicklingError) as e:  # legacy .bin: torch's unpickler
        raise CheckpointError(corrupt_bin(directory)) from e
    except (OSError, ValueError, RuntimeError, MemoryError, SafetensorError) as e:
        raise _load_failure(directory, e) from e
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    # transformers fills missing or misshapen tensors with random values and ignores unused ones,
    # and only logs it. check_checkpoint has compared a BLOOM's tensors already; this covers the
    # other architectures.
    bad = sorted(loading["missing_keys"]) + sorted(str(k) for k in loading["mismatched_keys"])
    if bad:
        raise CheckpointError(
            f"{directory} lacks or misshapes {some_names(bad)}; "
            "re-download or re-export the checkpoint"
        )
    if unused := sorted(loading["unexpected_keys"]):
        raise CheckpointError(
            f"{directory} holds {some_names(unused)} that its config.json leaves unused; "
            "correct config.json or re-export the checkpoint"
        )
    _check_finite(hf_model, directory, allow_nonfinite)
    tokenizer = _tokenizer(directory)
    return from_hf_model(
        hf_model,
        tokenizer,
        name=name,
        source=directory,
        prepend_bos=metadata.get("prepend_bos"),
        train_ctx=_train_ctx(metadata),
        metadata=metadata,
    )


# What an error's message shows of its cause (lower case). A thread that could not start, memory
# or the disk is no fault of the checkpoint: only a format error asks for its files again.
_MEMORY_SIGNS = ("not enough memory", "defaultcpuallocator", "out of memory", "bad_alloc")
_THREAD_SIGNS = ("pthread_create", "can't start new thread", "thread creation failed")
_FORMAT_SIGNS = (
    "header",
    "deserializ",
    "invalid load key",
    "pytorchstreamreader",
    "zip archive",
    "corrupt",
    "truncated",
    "unexpected end",
    "incomplete metadata",
)


def _load_failure(where: Path, error: BaseException) -> CheckpointError:
    """One line for ``error``, raised reading the checkpoint at ``where``, naming the cause it
    shows and that cause's fix: memory, a thread that could not start, a full or failing disk,
    permissions; only a damaged file (a bad header, a truncated archive) asks for the checkpoint
    to be downloaded or exported again.

    >>> print(_load_failure(Path("m"), RuntimeError("pthread_create failed: Resource temporarily "
    ...     "unavailable")))  # doctest: +ELLIPSIS
    loading m could not start a thread (pthread_create failed: ...); the machine is at its ...
    """
    seen = first_line(error)
    text = seen.lower()
    code = getattr(error, "errno", None)
    if code is None and (found := re.search(r"os error (\d+)", text)):  # Rust's io::Error
        code = int(found[1])
    if (
        isinstance(error, MemoryError)
        or code == errno.ENOMEM
        or any(sign in text for sign in _MEMORY_SIGNS)
    ):
        fix = (
            "free memory, load a smaller dtype (dtype='bfloat16'), or spread the model with "
            "device_map and max_memory"
        )
        return CheckpointError(f"loading {where} ran out of memory ({seen}); {fix}")
    if code == errno.EAGAIN or any(sign in text for sign in _THREAD_SIGNS):
        return CheckpointError(
            f"loading {where} could not start a thread ({seen}); the machine is at its thread "
            "or process limit: use fewer threads (OMP_NUM_THREADS=1, --threads 1) or end other "
            "processes, then try again"
        )
    if code in (errno.ENOSPC, errno.EDQUOT):
        return CheckpointError(
            f"loading {where} found the disk full ({seen}); free space (an offload folder takes "
            "up to the model's size) and try again"
        )
    if code == errno.EIO:
        return CheckpointError(
            f"reading {where} failed in the disk or file system ({seen}), not in the file's "
            "format; check the disk (dmesg) or copy the folder to another disk"
        )
    if code in (errno.EACCES, errno.EPERM):
        return CheckpointError(f"{where} is not readable ({seen}); make it readable")
    if isinstance(error, SafetensorError) or any(sign in text for sign in _FORMAT_SIGNS):
        return CheckpointError(
            f"{where} is damaged ({seen}); re-download or re-export the checkpoint"
        )
    return CheckpointError(
        f"transformers could not load {where} ({seen}); fix what it names (the files passed "
        "headsurgeon's checks of their format)"
    )


def _train_ctx(metadata: dict[str, Any]) -> int | None:
    training = metadata.get("training", {})
    # analyses/train_organism.py records it under training.config.seq_len
    return training.get("seq_len", training.get("config", {}).get("seq_len"))


def _tokenizer(directory: Path) -> Any:
    """The folder's tokenizer, checked; None without tokenizer files."""
    from transformers import AutoTokenizer

    if not any((directory / f).exists() for f in TOKENIZER_FILES):
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as e:  # JSON, tokenizers (Rust) and sentencepiece errors alike
        raise CheckpointError(
            f"the tokenizer files in {directory} are unreadable ({first_line(e)}); "
            "re-export the tokenizer, or remove its files to load the weights alone"
        ) from e
    _check_unknown_token(tokenizer, directory)
    return tokenizer


def _check_unknown_token(tokenizer: Any, directory: Path) -> None:
    """Refuse a tokenizer whose model names an unknown token its vocabulary lacks: the Rust
    tokenizer loads it, then raises at the first text it cannot cover."""
    backend_tokenizer = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend_tokenizer, "model", None)
    unknown = getattr(model, "unk_token", None)
    # The model's own vocabulary: transformers adds a special token it lacks as an added token,
    # which the model's fallback does not read.
    if unknown and model.token_to_id(unknown) is None:
        raise CheckpointError(
            f"the tokenizer in {directory} names the unknown token {unknown!r} but its vocabulary "
            "lacks it, so text it cannot cover would fail; re-export the tokenizer, or remove its "
            "files to load the weights alone"
        )


def _check_finite(hf_model: Any, directory: Path, allow: bool) -> None:
    """Refuse (or, with ``allow``, warn about) weights holding NaN or infinity: one pass over the
    weights, module by module (offloaded ones loaded one module at a time), in slices so that no
    temporary is larger than 16 M elements."""
    bad = []
    weights = {name for name, _ in hf_model.named_parameters()}  # a tied weight once
    weights |= {name for name, _ in hf_model.named_buffers()}
    for prefix, module in hf_model.named_modules():
        with backend.resident(module, recurse=False):
            own = [*module.named_parameters(prefix, recurse=False)]
            own += module.named_buffers(prefix, recurse=False)
            for name, tensor in own:
                if name not in weights or not tensor.is_floating_point():
                    continue
                if not _finite(tensor):
                    bad.append(name)
    _report_nonfinite(bad, directory, allow)


def _finite(tensor: torch.Tensor) -> bool:
    """Whether a weight holds no NaN or infinity, in slices of at most 16 M elements."""
    flat = tensor.detach().reshape(-1)
    return all(bool(torch.isfinite(part).all()) for part in flat.split(1 << 24))


def _report_nonfinite(bad: list[str], directory: Path, allow: bool) -> None:
    if not bad:
        return
    message = f"{directory} holds NaN or infinite values in {some_names(bad)}"
    if not allow:
        raise CheckpointError(
            f"{message}; re-export or re-train the checkpoint, or pass allow_nonfinite=True to "
            "load_model to inspect it"
        )
    warnings.warn(f"{message}; the tools' numbers for it are NaN or meaningless", stacklevel=3)


def from_hf_model(
    hf_model: Any,
    tokenizer: Any = None,
    *,
    name: str = "model",
    source: Path | None = None,
    prepend_bos: bool | None = None,
    train_ctx: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> Model:
    """An in-memory ``transformers`` causal LM as the installed TransformerLens's model.

    Weights unprocessed; on TransformerLens 4.x the bridge wraps ``hf_model`` itself.
    ``metadata`` (a ``headsurgeon.json``'s contents) is checked by :func:`check_metadata`.
    """
    label = source / METADATA_FILE if source is not None else "metadata="
    metadata = check_metadata(metadata, label) if metadata else {}
    hf_config = hf_model.config.to_dict()
    model = backend.convert_hf(hf_model, tokenizer, name=name, prepend_bos=prepend_bos)
    return _finish(model, hf_config, tokenizer, name, source, train_ctx, metadata)


def _finish(
    model: Model,
    hf_config: dict[str, Any],
    tokenizer: Any,
    name: str,
    source: Path | None,
    train_ctx: int | None,
    metadata: dict[str, Any],
) -> Model:
    """A converted model with its record and exact ALiBi, in eval mode."""
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
        kind, params = trained_bias(metadata or {})
        install_exact_alibi(model, kind, **params)
        _warn_ignored_settings(hf_config)
    model.eval()
    return model


def _warn_ignored_settings(hf_config: dict[str, Any]) -> None:
    """Warn when the config asks for what its family's transformers model does not apply
    (MPT's ``alibi_bias_max``)."""
    family = families.FAMILIES.get(hf_config.get("model_type"))
    ignored = None if family is None else family.ignored(hf_config)
    if ignored is not None:
        warnings.warn(ignored, stacklevel=3)


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
    torch.manual_seed(check_int(seed, "seed", minimum=0, maximum=MAX_SEED))
    return BloomForCausalLM(config).to(parse_dtype(dtype)).eval()


def random_model(shape: ModelShape | str, *, seed: int = 0, dtype: str = "float32") -> Model:
    """A BLOOM TransformerLens model with random weights of a given or named shape."""
    hf_model = random_hf_bloom(shape, seed=seed, dtype=dtype)
    cfg = hf_model.config
    return from_hf_model(hf_model, name=f"random-{cfg.n_layer}x{cfg.n_head}x{cfg.hidden_size}")
