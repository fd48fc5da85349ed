"""Placing a model over several devices, CPU memory and disk, with Hugging Face Accelerate.

    load_model("bloom-1b7", dtype="float16", device_map="auto", max_memory={"cpu": "1GiB"})
    load_model("bloom-7b1", device_map="auto", max_memory={0: "14GiB", 1: "14GiB", "cpu": "60GiB"})

:func:`headsurgeon.load_model` takes the arguments Hugging Face users know, and the tools take
them as ``--device-map``, ``--max-memory`` and ``--offload-folder``:

- ``device_map``: ``"auto"`` (fill the GPUs in order, then CPU memory, then disk), ``"balanced"``,
  ``"balanced_low_0"``, ``"sequential"``, or ``{module name: device}`` with devices ``0``,
  ``"cuda:1"``, ``"cpu"``, ``"disk"``. The names are those of the model as the installed
  TransformerLens holds it: ``embed``, ``blocks.0``, ..., ``ln_final``, ``unembed`` on 3.x; the
  Hugging Face module names (``transformer.word_embeddings``, ``transformer.h.0``, ...) on 4.x,
  whose bridge wraps the Hugging Face model itself.
- ``max_memory``: ``{device: size}``, sizes in bytes or as ``"1GiB"``, ``"500MB"``; alone it
  means ``device_map="auto"``.
- ``offload_folder``: where weights placed on ``"disk"`` are written. headsurgeon makes a private
  folder inside it for each model (removed when the model is garbage collected, or at exit after
  Ctrl-C or SIGTERM; one a killed run left, known by its owner file whose lock died with it, is
  removed by the next run placing a model there) and never touches anything else there; without
  it, the system's temporary folder.

Where the weights go, and how they are run, is Accelerate's: on 4.x ``from_pretrained`` reads the
checkpoint straight into the map, so a model larger than the memory given to it never passes
through memory whole (TransformerLens 4.x materialises offloaded weights for its own reads); on
3.x a BLOOM in safetensors is built on the meta device and each part converted and placed in
turn (:mod:`headsurgeon.backend.bounded`, :func:`placing`), then dispatched with
``accelerate.dispatch_model``: neither passes through memory whole. Any other 3.x model is built
in memory first (loading needs its size once; a warning says so before it starts). Weights placed
on ``"cpu"`` beside GPUs, or on ``"disk"``, stay on the meta device and are loaded by the
module's own forward; the census reads them through :func:`headsurgeon.backend.resident`.

Reading tools (census, classify, blindness, importance, perplexity, retrieval) give the same
numbers as on one device. Tools that change weights (surgery, fine-tuning, repair, export)
refuse a model with offloaded weights in one line: a weight Accelerate reloads from its offload
copy at every forward cannot keep an update.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from headsurgeon.backend import TRANSFORMER_LENS, Model
from headsurgeon.errors import InvalidArgumentError

__all__ = [
    "STRATEGIES",
    "check_placement",
    "placing",
]

logger = logging.getLogger(__name__)

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
# The TransformerLens 3.x module that must stay on one device: a block's residual stream.
_TL3_BLOCK = "TransformerBlock"


@dataclasses.dataclass(frozen=True)
class Placement:
    """A checked ``device_map`` / ``max_memory`` / ``offload_folder``."""

    device_map: str | dict[str, int | str]
    max_memory: dict[int | str, int] | None = None
    offload_folder: Path | None = None


def _device(value: Any, where: str) -> int | str:
    """A device_map or max_memory device: a GPU index, ``cuda:N``, ``mps``, ``cpu`` or ``disk``."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("cpu", "disk", "mps") or (text.startswith("cuda:") and text[5:].isdigit()):
            return int(text[5:]) if text.startswith("cuda:") else text
        if text.isdigit():
            return int(text)
    raise InvalidArgumentError(
        f"{where}: unknown device {value!r}; use a GPU index (0), cuda:N, mps, cpu or disk"
    )


def _size(value: Any, where: str) -> int:
    from accelerate.utils import convert_file_size_to_int

    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        try:  # a plain number is bytes (Accelerate's parser takes only sizes with a unit)
            text = value.strip()
            size = int(text) if text.isdigit() else convert_file_size_to_int(text)
        except ValueError:
            size = 0
        if size > 0:
            return size
    raise InvalidArgumentError(
        f"{where}: {value!r} is not a memory size; use bytes or a size such as 1GiB or 500MB"
    )


def check_placement(
    device_map: str | dict[str, Any] | None,
    max_memory: dict[Any, Any] | None,
    offload_folder: str | os.PathLike | None,
    device: str | torch.device | None,
) -> Placement | None:
    """The placement these arguments ask for, or ``None`` for one device; one
    :class:`~headsurgeon.errors.InvalidArgumentError` line for a bad one.

    >>> check_placement(None, {"cpu": "1GiB"}, None, None)
    Placement(device_map='auto', max_memory={'cpu': 1073741824}, offload_folder=None)
    >>> check_placement("auto", None, None, "cuda")
    Traceback (most recent call last):
    ...
    headsurgeon.errors.InvalidArgumentError: pass device or device_map, not both: ...
    """
    if device_map is None and max_memory is None:
        if offload_folder is not None:
            raise InvalidArgumentError(
                "offload_folder is used only with device_map or max_memory; pass one of them"
            )
        return None
    if device is not None:
        raise InvalidArgumentError(
            "pass device or device_map, not both: a device_map places every module itself"
        )
    device_map = _check_device_map("auto" if device_map is None else device_map)
    if max_memory is not None:
        max_memory = _check_max_memory(max_memory)
    folder = None
    if offload_folder is not None:
        folder = Path(offload_folder)
        if folder.exists() and not folder.is_dir():
            raise InvalidArgumentError(f"offload_folder {folder} is a file; give a folder")
    return Placement(device_map, max_memory, folder)


def _check_device_map(device_map: Any) -> str | dict[str, int | str]:
    if isinstance(device_map, str):
        if device_map not in STRATEGIES:
            raise InvalidArgumentError(
                f"device_map={device_map!r}: use one of {', '.join(STRATEGIES)} or a "
                "{module name: device} dict"
            )
        return device_map
    if isinstance(device_map, dict) and device_map:
        return {str(k): _device(v, f"device_map[{k!r}]") for k, v in device_map.items()}
    raise InvalidArgumentError(
        f"device_map must be a strategy ({', '.join(STRATEGIES)}) or a non-empty "
        f"{{module name: device}} dict, got {device_map!r}"
    )


def _check_max_memory(max_memory: Any) -> dict[int | str, int]:
    if not isinstance(max_memory, dict) or not max_memory:
        raise InvalidArgumentError(
            f"max_memory must be a non-empty {{device: size}} dict, got {max_memory!r}"
        )
    checked = {
        _device(k, "max_memory"): _size(v, f"max_memory[{k!r}]") for k, v in max_memory.items()
    }
    if "disk" in checked:
        raise InvalidArgumentError("max_memory limits memory; disk takes what is left over")
    return checked


# A model's private offload folder, and the file whose lock says its run is alive.
_PRIVATE_PREFIX = "headsurgeon-offload-"
_OWNER_FILE = ".headsurgeon-offload.lock"
_OWNED: dict[Path, int] = {}  # private folder -> its locked owner file, while this run holds it


def _private_folder(placement: Placement) -> Path:
    """A new folder for one model's offloaded weights (inside ``offload_folder`` when given),
    holding a locked owner file, after removing those that killed runs left there."""
    parent = placement.offload_folder
    if parent is not None:
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InvalidArgumentError(
                f"cannot create offload_folder {parent} ({e.strerror}); give a writable folder"
            ) from e
    _remove_stale(Path(tempfile.gettempdir()) if parent is None else parent)
    # Made under a hidden name and renamed once its owner file is locked: another run's
    # _remove_stale never sees it unlocked.
    staging = Path(tempfile.mkdtemp(prefix="." + _PRIVATE_PREFIX, dir=parent))
    fd = os.open(staging / _OWNER_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with contextlib.suppress(OSError):  # a file system without locks: never taken as stale
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    folder = staging.with_name(staging.name.removeprefix("."))
    os.rename(staging, folder)
    _OWNED[folder] = fd
    return folder


def _stale(folder: Path) -> bool:
    """Whether ``folder`` is a private offload folder whose run is gone: its owner file (ours by
    name and place) can be locked, and locks die with their process."""
    if folder.is_symlink() or not folder.is_dir() or folder in _OWNED:
        return False
    try:
        fd = os.open(folder / _OWNER_FILE, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # no owner file: nothing proves it is ours
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False  # held by a live run (or no locks here: never guess)
    finally:
        os.close(fd)


def _remove_stale(parent: Path) -> None:
    """Remove the private offload folders in ``parent`` that killed runs left, in one line."""
    with contextlib.suppress(OSError):
        stale = [p for p in parent.glob(_PRIVATE_PREFIX + "*") if _stale(p)]
        if stale:
            size = sum(f.lstat().st_size for p in stale for f in p.rglob("*") if f.is_file())
            for p in stale:
                shutil.rmtree(p, ignore_errors=True)
            logger.info(
                "removed %d offload folder(s) in %s left by killed runs (%.1f MB)",
                len(stale),
                parent,
                size / 1e6,
            )


def release_offload(folder: Path) -> None:
    """Remove a private offload folder made here, and let go of its owner file."""
    fd = _OWNED.pop(folder, None)
    if fd is not None:
        os.close(fd)
    shutil.rmtree(folder, ignore_errors=True)


def _forget_with(model: Any, folder: Path) -> None:
    """Remove ``folder`` (ours: made by :func:`_private_folder`) when ``model`` is collected, or
    at the interpreter's exit (after a Ctrl-C or SIGTERM too)."""
    weakref.finalize(model, release_offload, folder)


def check_offload_folder(
    offload_folder: str | os.PathLike | None, taken: Iterable[tuple[str, str | os.PathLike]]
) -> None:
    """One line for an ``offload_folder`` that is, or lies inside, one of ``taken`` (``(what,
    path)`` pairs: the output folder, the model folder, a text file), checked before any model
    is loaded: a run must not write its offload copy into its own output or its inputs.

    >>> check_offload_folder("/tmp/out/offload", [("the output folder", "/tmp/out")])
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    headsurgeon.errors.InvalidArgumentError: offload_folder /tmp/out/offload lies inside the ...
    """
    if offload_folder is None:
        return
    folder = Path(offload_folder).expanduser().resolve()
    for what, path in taken:
        other = Path(path).expanduser().resolve()
        if folder == other or folder.is_relative_to(other):
            where = "is" if folder == other else "lies inside"
            raise InvalidArgumentError(
                f"offload_folder {offload_folder} {where} {what} {path}; give a folder of its "
                "own (or leave it out: the system's temporary folder)"
            )


def from_pretrained_args(placement: Placement, directory: Path) -> tuple[dict[str, Any], Path]:
    """``from_pretrained`` keyword arguments for 4.x, and the private offload folder made.

    A ``{module: device}`` map is checked against the Hugging Face model of ``directory``'s
    config, built without weights: transformers ignores a name it does not know.
    """
    if isinstance(placement.device_map, dict):
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        with init_empty_weights():
            skeleton = AutoModelForCausalLM.from_config(config)
        hint = "the Hugging Face module names (transformer.h.0, lm_head, ...)"
        _check_names(skeleton, placement.device_map, hint)
    folder = _private_folder(placement)
    args = {"device_map": placement.device_map, "offload_folder": str(folder)}
    if placement.max_memory is not None:
        args["max_memory"] = placement.max_memory
    return args, folder


def adopt(model: Model, folder: Path) -> Model:
    """A 4.x bridge over a Hugging Face model loaded with :func:`from_pretrained_args`: its
    input device recorded, its offload folder removed with it."""
    # transformers sets no hf_device_map when the whole model landed on one device.
    placed = getattr(model.original_model, "hf_device_map", None) or {"": "one device"}
    model.cfg.device = str(_execution_device(model.embed))
    model.cfg.n_devices = max(1, len({str(v) for v in placed.values()} - {"disk"}))
    _forget_with(model, folder)
    return model


def device_map_for(model: Model, placement: Placement) -> dict[str, int | str]:
    """The ``{module name: device}`` map a TransformerLens 3.x model gets from ``placement``
    (blocks kept whole); its weights may be on the meta device (sizes are all it reads)."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    device_map = placement.device_map
    if isinstance(device_map, str):
        max_memory = placement.max_memory
        if device_map.startswith("balanced"):
            max_memory = get_balanced_memory(
                model,
                max_memory=max_memory,
                no_split_module_classes=[_TL3_BLOCK],
                low_zero=device_map == "balanced_low_0",
            )
        device_map = infer_auto_device_map(
            model, max_memory=max_memory, no_split_module_classes=[_TL3_BLOCK]
        )
        if "" in device_map:  # all on one device: Accelerate offloads nothing for the name ""
            device_map = {
                name: device_map[""]
                for name, child in model.named_children()
                if next(child.parameters(), None) is not None
            }
    else:
        hint = f"embed, blocks.0 ... blocks.{model.cfg.n_layers - 1}, ln_final, unembed"
        _check_names(model, device_map, hint)
    return device_map


@contextlib.contextmanager
def placing(
    model: Model, placement: Placement
) -> Iterator[tuple[Callable[[str, dict[str, Tensor]], dict[str, Tensor]], dict, Path]]:
    """For a 3.x model built on the meta device part by part: ``place(part, tensors)``, which
    writes the tensors of a part mapped to ``"disk"`` to a private offload folder (returning
    none) and returns the others moved to their device; the map and the folder. The folder's
    offload index is written when the block ends; the folder is removed if it raises."""
    from accelerate.utils import offload_weight, save_offload_index

    device_map = device_map_for(model, placement)
    folder = _private_folder(placement)
    index: dict[str, Any] = {}

    def place(part: str, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        kept = {}
        for name, tensor in tensors.items():
            device = _mapped_device(device_map, name)
            if device == "disk":
                offload_weight(tensor, name, str(folder), index)
            else:
                where = f"cuda:{device}" if isinstance(device, int) else device
                kept[name] = tensor.to(where)
        return kept

    try:
        yield place, device_map, folder
        save_offload_index(index, str(folder))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)  # ours, made above
        raise


def _mapped_device(device_map: dict[str, int | str], name: str) -> int | str:
    """The device of weight ``name``: its longest enclosing module's in ``device_map``."""
    owners = [k for k in device_map if not k or name == k or name.startswith(k + ".")]
    return device_map[max(owners, key=len)]


def dispatch(
    model: Model,
    placement: Placement,
    *,
    device_map: dict[str, int | str] | None = None,
    folder: Path | None = None,
) -> Model:
    """Dispatch a TransformerLens 3.x model over ``placement`` with ``accelerate.dispatch_model``
    (blocks kept whole); its offload folder is removed with it. ``device_map`` and ``folder``:
    those :func:`placing` used (the disk weights already written there)."""
    from accelerate import dispatch_model

    if device_map is None:
        device_map = device_map_for(model, placement)
    if folder is None:
        folder = _private_folder(placement)
    logger.info("device map: %s", device_map)
    try:
        model = dispatch_model(model, device_map=device_map, offload_dir=folder)
    except BaseException:
        release_offload(folder)  # ours, made above
        raise
    model.cfg.device = str(_execution_device(model.embed))
    _forget_with(model, folder)
    return model


def _check_names(model: torch.nn.Module, device_map: dict[str, int | str], hint: str) -> None:
    """Every weight of ``model`` placed by a ``{module name: device}`` map naming its modules."""
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    unknown = [k for k in device_map if k and not any(n.startswith(k + ".") for n in names)]
    if unknown:
        raise InvalidArgumentError(
            f"device_map names {unknown[0]!r}, not a module of this model; "
            f"{TRANSFORMER_LENS} names them {hint}"
        )
    unplaced = [
        n
        for n in names
        if "" not in device_map and not any(n.startswith(k + ".") for k in device_map)
    ]
    if unplaced:
        raise InvalidArgumentError(
            f"device_map places no device for {unplaced[0]}; name its module (or a parent) too"
        )


def _execution_device(module: torch.nn.Module) -> torch.device:
    """Where ``module`` computes: its Accelerate hook's execution device, else its weights'."""
    for sub in (getattr(module, "original_component", None), module):
        hook = getattr(sub, "_hf_hook", None)
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    first = next(module.parameters())
    return first.device if first.device.type != "meta" else torch.device("cpu")
