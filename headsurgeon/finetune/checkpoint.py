"""Checkpoint state: what a fine-tuning checkpoint holds, and reading one back safely.

A checkpoint is one ``torch.save`` dict, written atomically by rank 0: its identity (model,
heads, weights fingerprint, world size, settings) and its state (step, trained slices, optimiser,
schedule, random state, progress). Everything read back is checked before it is used, and a file
that is not as written is one :class:`~headsurgeon.errors.CheckpointError` line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from headsurgeon.backend import Model
from headsurgeon.errors import (
    CheckpointError,
    first_line,
)
from headsurgeon.finetune.config import FinetuneConfig
from headsurgeon.heads import HeadSet
from headsurgeon.inputs import check_regular_file
from headsurgeon.outputs import atomic_write_bytes
from headsurgeon.surgery import head_masks

__all__ = [
    "Progress",
]

CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_FORMAT = 1
# Settings that may change between an interrupted run and its resumption.
_RESUME_FREE = ("checkpoint_every",)
# What a checkpoint holds besides its identity (see headsurgeon.finetune.trainer._Loop.save).
_STATE_KEYS = ("step", "slices", "optimizer", "scheduler", "rng", "progress")
_IDENTITY_KEYS = ("model", "heads", "fingerprint", "world_size", "config")
_CHECKPOINT_FIX = "delete it to train from step 0, or start over in a new output folder"


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


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
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
        raise bad_checkpoint(path, "has an unknown format")
    missing = [key for key in (*_IDENTITY_KEYS, *_STATE_KEYS) if key not in state]
    if missing:
        raise bad_checkpoint(path, f"lacks {', '.join(missing)}")
    types = {
        "step": int,
        "slices": dict,
        "optimizer": dict,
        "scheduler": dict,
        "rng": dict,
        "progress": dict,
    }
    for key, kind in types.items():
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            raise bad_checkpoint(path, f"holds a {type(state[key]).__name__} as its {key}")
    return state


def bad_checkpoint(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} {problem}: training cannot resume from it; {_CHECKPOINT_FIX}"
    )


def tensors_like(
    given: object, expected: dict[str, Tensor], path: Path, what: str
) -> dict[str, Tensor]:
    """``given`` if it maps exactly the names of ``expected`` to floating-point tensors of the
    same shapes; else one line naming the first difference."""
    if not isinstance(given, dict) or set(given) != set(expected):
        names = sorted(given) if isinstance(given, dict) else type(given).__name__
        raise bad_checkpoint(path, f"holds {what} {str(names)[:120]}, not {sorted(expected)}")
    for name, tensor in expected.items():
        value = given[name]
        if not (isinstance(value, Tensor) and value.is_floating_point()):
            raise bad_checkpoint(path, f"holds no floating-point tensor as {what} {name}")
        if value.shape != tensor.shape:
            raise bad_checkpoint(
                path,
                f"holds {what} {name} of shape {tuple(value.shape)}, not {tuple(tensor.shape)}",
            )
    return given


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def config_dict(cfg: FinetuneConfig) -> dict[str, Any]:
    out = dataclasses.asdict(cfg)
    out["betas"] = list(out["betas"])
    for key in _RESUME_FREE:
        out.pop(key)
    return out


def check_resume(state: dict, path: Path, expected: dict[str, Any]) -> None:
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


@dataclasses.dataclass
class Progress:
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


def check_progress(
    progress: dict[str, Any], step: int, slices: dict[str, Tensor], path: Path
) -> None:
    """One line unless ``progress`` is a :meth:`Progress.to_dict` of a run at ``step``."""
    fields = [field.name for field in dataclasses.fields(Progress)]
    if sorted(progress) != sorted(fields):
        raise bad_checkpoint(path, "holds a progress record of another shape")
    lists = [progress[name] for name in ("losses", "since_eval", "history")]
    if not all(isinstance(items, list) for items in lists):
        raise bad_checkpoint(path, "holds a progress record of another shape")
    numbers = progress["losses"] + progress["since_eval"] + [progress["best_loss"]]
    rows = progress["history"]
    problems = [
        (not all(map(_is_number, numbers)), "losses that are not numbers"),
        (len(progress["losses"]) != step, f"{len(progress['losses'])} losses for {step} steps"),
        (
            not all(isinstance(r, dict) and all(map(_is_number, r.values())) for r in rows),
            "an evaluation history that is not rows of numbers",
        ),
        (not isinstance(progress["bad_evals"], int), "a count of evaluations that is no integer"),
        (not isinstance(progress["stopped_early"], bool), "no early-stopping flag"),
        (
            not (progress["best_step"] is None or isinstance(progress["best_step"], int)),
            "a best step that is no integer",
        ),
    ]
    for failed, problem in problems:
        if failed:
            raise bad_checkpoint(path, f"holds {problem}")
    if progress["best_slices"] is not None:
        tensors_like(progress["best_slices"], slices, path, "best slices")
