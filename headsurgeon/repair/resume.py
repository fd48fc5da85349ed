"""A repair run's work folder: finished passes and checkpoints kept for ``resume``.

Only rank 0 writes (:func:`headsurgeon.distributed.rank_and_world`); a file that is not as a run
writes it is one :class:`~headsurgeon.errors.CheckpointError` line naming it and what to do.
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from headsurgeon.backend import Model
from headsurgeon.census import COLUMNS
from headsurgeon.data import tokens_digest
from headsurgeon.errors import (
    CheckpointError,
    OutputExistsError,
    first_line,
)
from headsurgeon.finetune import FinetuneConfig, FinetuneResult
from headsurgeon.finetune.checkpoint import load_torch_file, weights_digest
from headsurgeon.heads import LABELS, HeadSet
from headsurgeon.inputs import MAX_JSON_BYTES, describe_kind, read_json, read_text
from headsurgeon.loading import ModelShape
from headsurgeon.outputs import atomic_write_bytes, atomic_write_text
from headsurgeon.repair.results import PassResult
from headsurgeon.surgery import (
    head_slices,
    head_tensors,
)

__all__: list[str] = []


RUN_FILE = "run.json"
FINISHED_FILE = "finished.json"
# Settings that judge a run but do not change its training: a resume may change them.
_VERDICT_SETTINGS = ("max_ppl_increase", "max_collateral")


def finished_run(work_dir: str | os.PathLike) -> bool:
    """Whether ``work_dir`` holds a repair run that finished: :func:`repair` writes
    :data:`FINISHED_FILE` there last, after every pass (a resume of it loads them all again)."""
    return (Path(work_dir) / FINISHED_FILE).is_file()


# A folder of one pass of either arm: the repair's (pass<N>) or the control's (control<N>).
_ARM_DIR = re.compile(r"(?:pass|control)(\d{1,9})")


_CENSUS_COLUMNS = [*COLUMNS, "label", "reason"]


_RECORD_TYPES: dict[str, tuple[type, ...]] = {
    "targeted": (str,),
    "perplexity_after": (dict,),
    "steps_done": (int,),
    "stopped_early": (bool,),
    "best_step": (int, type(None)),
    "history": (dict,),
    "losses": (list,),
    "resumed_from": (int, type(None)),
}


_HISTORY_COLUMNS = ("step", "lr", "train_loss", "train_ppl", "heldout_ppl", "bos_mass")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def has_numbers(value: object, keys: tuple[str, ...]) -> bool:
    """Whether ``value`` is a dict holding a number under each of ``keys``."""
    return isinstance(value, dict) and all(_is_number(value.get(key)) for key in keys)


class WorkDir:
    """Finished passes and fine-tuning checkpoints of one run, for ``resume``.

    ``run.json`` identifies the run (model digest, heads, settings); ``census_0.*`` is the first
    census; ``pass<N>/`` holds the fine-tuning checkpoint and, once the pass is over,
    ``heads.pt`` (the trained slices), ``census.csv`` and ``census.json``, and ``done.json``
    (written last); ``control<N>/`` holds the same for pass ``N`` of the control arm (arm
    ``"control"``); ``finished.json`` marks a run that finished. Only rank 0 writes. Everything
    read back is checked first (:meth:`unusable` names the file that is not as written).
    """

    def __init__(self, path: Path, rank: int, shape: ModelShape) -> None:
        self.path = path
        self.rank = rank
        self.shape = shape

    def unusable(self, path: Path, problem: str) -> CheckpointError:
        """The one line for a resume file that is not as a run writes it."""
        return CheckpointError(f"resume file {path} {problem}; {self.fix(path)}")

    def fix(self, path: Path) -> str:
        """What to do about a resume file that cannot be used."""
        folder = path.parent if _ARM_DIR.fullmatch(path.parent.name) else None
        redo = f"remove {folder} to redo that pass, or " if folder is not None else ""
        return (
            f"the run cannot be resumed from it: {redo}start over with --overwrite (or delete "
            "the work folder)"
        )

    def require(self, path: Path) -> Path:
        """``path``, after checking that it is a regular file."""
        kind = describe_kind(path)
        if kind is not None:
            raise self.unusable(path, "is missing" if kind == "missing" else f"is {kind}")
        return path

    def begin(
        self,
        model: Model,
        settings: dict[str, Any],
        resume: bool,
        tokens: dict[str, torch.Tensor],
    ) -> None:
        """Start a run of ``model`` with ``settings`` on ``tokens`` (``{"train": ..., "eval":
        ..., "census": ...}``) here, or (``resume``) check that the run this folder holds is
        that run: the same weights, the same token sequences (by content: a corpus whose lines
        were rotated has the same shape but other tokens) and the same settings, apart from
        those that only judge it (:data:`_VERDICT_SETTINGS`)."""
        training = {k: v for k, v in settings.items() if k not in _VERDICT_SETTINGS}
        identity = {
            "model": weights_digest(model),
            "tokens": {name: tokens_digest(t) for name, t in tokens.items()},
            "settings": json.loads(json.dumps(training)),
        }
        self.start(identity, resume)

    def start(self, identity: dict[str, Any], resume: bool) -> None:
        run_file = self.path / RUN_FILE
        if os.path.lexists(run_file):
            if not resume:
                state = "a finished" if finished_run(self.path) else "an interrupted"
                raise OutputExistsError(
                    f"{self.path} holds {state} run; resume it (--resume) or delete it"
                )
            stored = read_json(
                self.require(run_file), "resume file", error=CheckpointError, fix=self.fix(run_file)
            )
            if not (
                isinstance(stored.get("model"), str) and isinstance(stored.get("settings"), dict)
            ):
                raise self.unusable(run_file, "is not a run record (model and settings)")
            if "control" not in stored["settings"]:  # its passes would lack their control arm
                raise self.unusable(
                    run_file, "is from a headsurgeon before the control arm (no settings.control)"
                )
            if not isinstance(stored.get("tokens"), dict):  # its data cannot be checked
                raise self.unusable(
                    run_file, "is from a headsurgeon before content checks (no tokens digest)"
                )
            stored, current = _flatten(stored), _flatten(identity)
            changed = [
                f"{key}: {stored.get(key)!r} vs {current.get(key)!r}"
                for key in sorted(set(stored) | set(current))
                # eval_on_train counts shared sequences: the content check names what changed
                if key.startswith("settings.")
                and not key.startswith("settings.eval_on_train")
                and stored.get(key) != current.get(key)
            ]
            if changed:
                raise CheckpointError(
                    f"the run in {self.path} differs ({'; '.join(changed[:3])[:300]}); resume "
                    "with the same model, heads and options, or start a new output folder"
                )
            self.check_content(stored, current)  # after the settings: a new shape says more
            self.check_passes()
        else:
            others = [p.name for p in self.pass_dirs() + self.pass_dirs("control")] + [
                name for name in ("census_0.json", "census_0.csv") if (self.path / name).exists()
            ]
            if others:  # a run record does not go missing by itself: these are not this run's
                raise self.unusable(run_file, f"is missing beside {', '.join(sorted(others))}")
            if self.rank == 0:
                atomic_write_text(run_file, json.dumps(identity, indent=2, default=str))

    def check_content(self, stored: dict[str, Any], current: dict[str, Any]) -> None:
        """One line naming the inputs whose content changed since the run began: the model's
        weights or a token sequence (a changed corpus of the same shape passes every other
        check)."""
        content = sorted(k for k in set(stored) | set(current) if not k.startswith("settings."))
        changed = [
            "the model's weights" if key == "model" else f"the {key.removeprefix('tokens.')} tokens"
            for key in content
            if stored.get(key) != current.get(key)
        ]
        if changed:
            raise CheckpointError(
                f"the run in {self.path} was on other content: {', '.join(changed)} changed "
                "since it began (a corpus file edited, reordered or replaced?); resume with the "
                "same model and text files, or start a new output folder"
            )

    def pass_dir(self, index: int, arm: str = "pass") -> Path:
        """The folder of pass ``index`` of ``arm`` (``"pass"``: the repair's; ``"control"``)."""
        return self.path / f"{arm}{index}"

    def pass_dirs(self, arm: str = "pass") -> list[Path]:
        if not self.path.is_dir():
            return []
        pattern = re.compile(rf"{arm}(\d{{1,9}})")
        return [p for p in self.path.iterdir() if pattern.fullmatch(p.name)]

    def check_passes(self) -> None:
        """In each arm the finished passes are 1, 2, ... without a gap, and no pass was started
        beyond the first unfinished one: each pass starts from the model the one before left."""
        for arm in ("pass", "control"):
            folders = self.pass_dirs(arm)
            numbers = sorted(int(p.name.removeprefix(arm)) for p in folders)
            done = {n for n in numbers if os.path.lexists(self.pass_dir(n, arm) / "done.json")}
            unfinished = next(n for n in range(1, len(done) + 2) if n not in done)
            for n in numbers:
                if n == 0:
                    raise self.unusable(
                        self.pass_dir(0, arm), f"is no {arm} of a run (passes count from 1)"
                    )
                if n > unfinished:
                    raise self.unusable(
                        self.pass_dir(n, arm),
                        f"is there although {arm} {unfinished} is not finished",
                    )

    def save_census(self, name: str, census: pd.DataFrame, extra: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        atomic_write_text(self.path / f"{name}.csv", census.to_csv(index=False))
        document = {"attrs": census.attrs, **extra}
        atomic_write_text(self.path / f"{name}.json", json.dumps(document, default=str))

    def load_census(
        self, name: str, fields: dict[str, tuple[type, ...]]
    ) -> tuple[pd.DataFrame, dict[str, Any]] | None:
        """The census ``name`` and its record, whose ``fields`` must have those types; None
        when it was never written (its JSON is written last)."""
        json_file, csv_file = self.path / f"{name}.json", self.path / f"{name}.csv"
        if not os.path.lexists(json_file):
            return None
        document = read_json(
            self.require(json_file), "resume file", error=CheckpointError, fix=self.fix(json_file)
        )
        for field, types in {"attrs": (dict,), **fields}.items():
            value = document.get(field)
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                raise self.unusable(json_file, f"holds no valid {field!r}")
        text = read_text(
            self.require(csv_file), "resume file", max_bytes=MAX_JSON_BYTES, error=CheckpointError
        )
        try:
            census = pd.read_csv(io.StringIO(text), keep_default_na=False, na_values=[""])
        except ValueError as e:  # pandas' parser errors, an empty file
            raise self.unusable(csv_file, f"is not a readable table ({first_line(e)})") from None
        self.check_census(census, csv_file)
        census.attrs = document.pop("attrs")
        return census, document

    def check_census(self, census: pd.DataFrame, path: Path) -> None:
        """One line unless ``census`` is a classified census of every head of the model."""
        if list(census.columns) != _CENSUS_COLUMNS:
            raise self.unusable(path, "does not have the columns of a classified census")
        n_layers, n_heads = self.shape.n_layers, self.shape.n_heads
        index = census[["layer", "head"]]
        whole = (
            len(census) == n_layers * n_heads
            and all(pd.api.types.is_integer_dtype(index[c]) for c in index)
            and sorted(zip(index["layer"], index["head"], strict=True))
            == [(layer, head) for layer in range(n_layers) for head in range(n_heads)]
        )
        if not whole:
            raise self.unusable(
                path,
                f"does not hold one row per head of the model ({len(census)} rows for "
                f"{n_layers} layers x {n_heads} heads)",
            )
        metrics = [c for c in COLUMNS if c not in ("layer", "head")]
        wrong = [c for c in metrics if not pd.api.types.is_numeric_dtype(census[c])]
        if wrong:
            raise self.unusable(path, f"holds values that are not numbers in column {wrong[0]}")
        if not census["label"].isin(LABELS).all():
            raise self.unusable(path, f"holds labels other than {', '.join(LABELS)}")

    def save_pass(self, result: PassResult, model: Model, arm: str = "pass") -> None:
        if self.rank != 0:
            return
        folder = self.pass_dir(result.index, arm)
        buffer = io.BytesIO()
        torch.save(cpu_head_slices(model, result.targeted), buffer)
        atomic_write_bytes(folder / "heads.pt", buffer.getvalue())
        training = result.training
        self.save_census(
            f"{folder.name}/census",
            result.census_after,
            {
                "targeted": str(result.targeted),
                "perplexity_after": result.perplexity_after,
                "steps_done": training.steps_done,
                "stopped_early": training.stopped_early,
                "best_step": training.best_step,
                "history": training.history.to_dict(orient="list"),
                "losses": training.losses,
                "resumed_from": training.resumed_from,
            },
        )
        atomic_write_text(folder / "done.json", "{}")

    def finish(self) -> None:
        if self.rank == 0:
            atomic_write_text(self.path / FINISHED_FILE, "{}")

    def load_pass(
        self, index: int, targets: HeadSet, model: Model, config: FinetuneConfig, arm: str = "pass"
    ) -> tuple[pd.DataFrame, dict[str, Any], FinetuneResult, dict[str, torch.Tensor]] | None:
        """A finished pass of ``arm``, checked: its census, training record and result, and the
        trained slices (for ``model``'s ``targets``; the model is not changed). None if
        unfinished."""
        folder = self.pass_dir(index, arm)
        if not os.path.lexists(folder / "done.json"):
            return None
        self.require(folder / "done.json")
        loaded = self.load_census(f"{folder.name}/census", _RECORD_TYPES)
        if loaded is None:
            raise self.unusable(folder / "census.json", "is missing (the pass is marked done)")
        census, record = loaded
        self.check_record(record, folder / "census.json")
        if record["targeted"] != str(targets):
            raise CheckpointError(
                f"{arm} {index} in {self.path} targeted {record['targeted'][:100]}, not "
                f"{targets}; resume with the same options or start a new output folder"
            )
        slices = self.load_slices(folder / "heads.pt", targets, model)
        training = FinetuneResult(
            heads=targets,
            config=config,
            steps_done=record["steps_done"],
            stopped_early=record["stopped_early"],
            best_step=record["best_step"],
            history=pd.DataFrame(record["history"]),
            losses=record["losses"],
            resumed_from=record["resumed_from"],
        )
        return census, record, training, slices

    def check_record(self, record: dict[str, Any], path: Path) -> None:
        """One line unless a pass's training record holds what :meth:`save_pass` writes."""
        history = record["history"]
        columns = [history.get(c) for c in _HISTORY_COLUMNS]
        lengths = {len(c) for c in columns if isinstance(c, list)}
        problems = [
            (
                not has_numbers(record["perplexity_after"], ("train", "heldout")),
                "no perplexities after the pass",
            ),
            (not all(map(_is_number, record["losses"])), "losses that are not numbers"),
            (
                not (
                    all(isinstance(c, list) and all(map(_is_number, c)) for c in columns)
                    and len(lengths) == 1
                    and 0 not in lengths
                ),
                "no evaluation history",
            ),
        ]
        for failed, problem in problems:
            if failed:
                raise self.unusable(path, f"holds {problem}")

    def load_slices(self, path: Path, targets: HeadSet, model: Model) -> dict[str, torch.Tensor]:
        """``heads.pt``, checked to hold every per-head tensor of ``targets`` in its shape."""
        slices = load_torch_file(self.require(path), "resume file", fix=self.fix(path))
        expected = {}
        for layer, chosen in targets.by_layer().items():
            for name, tensor in head_tensors(model, layer).items():
                shape = (len(chosen), *tensor.heads(tensor.param).shape[1:])
                expected[f"blocks.{layer}.attn.{name}"] = shape
        if not isinstance(slices, dict) or set(slices) != set(expected):
            raise self.unusable(path, f"does not hold the slices of {targets}")
        for key, shape in expected.items():
            value = slices[key]
            if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
                raise self.unusable(path, f"holds no floating-point tensor as {key}")
            if tuple(value.shape) != shape:
                raise self.unusable(path, f"holds {key} of shape {tuple(value.shape)}, not {shape}")
        return slices


def cpu_head_slices(model: Model, heads: HeadSet) -> dict[str, torch.Tensor]:
    """Copies (on the CPU) of the heads' slices of every per-head tensor, by TransformerLens 3.x
    name on either major (``heads.pt`` files read the same on both)."""
    return {name: t.cpu() for name, t in head_slices(model, heads).items()}


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``.

    >>> _flatten({"model": "x", "settings": {"passes": 2, "thresholds": {"sink": 0.5}}})
    {'model': 'x', 'settings.passes': 2, 'settings.thresholds.sink': 0.5}
    """
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out
