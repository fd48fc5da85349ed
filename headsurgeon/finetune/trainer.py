"""The trainer: AdamW with warm-up and cosine decay on the chosen heads' slices, resumable, DDP.

:func:`finetune` checks its inputs once (its sequences by
:func:`headsurgeon.data.as_sequences`, the rest in :class:`_Job`), then runs the loop
(:class:`_Loop`): seeded batches, gradient accumulation, clipping, evaluations, checkpoints
(:mod:`headsurgeon.finetune.checkpoint`) and early stopping. The strategies that keep frozen
weights frozen are :mod:`headsurgeon.finetune.strategies`.

>>> warmup_cosine(warmup=2, steps=6)(0), warmup_cosine(warmup=2, steps=6)(2)
(0.5, 1.0)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
from torch import Tensor, nn

from headsurgeon.allocator import too_many_threads
from headsurgeon.backend import (
    Model,
)
from headsurgeon.data import Data, Sequences, as_sequences
from headsurgeon.distributed import rank_and_world
from headsurgeon.dtypes import check_trainable
from headsurgeon.errors import (
    DataError,
    HeadsurgeonError,
    InvalidArgumentError,
    OutputExistsError,
    first_line,
)
from headsurgeon.finetune.checkpoint import (
    CHECKPOINT_FILE,
    CHECKPOINT_FORMAT,
    Progress,
    bad_checkpoint,
    check_progress,
    check_resume,
    config_dict,
    load_checkpoint,
    restore_rng_state,
    rng_state,
    save_checkpoint,
    tensors_like,
    weights_digest,
)
from headsurgeon.finetune.config import FinetuneConfig, FinetuneResult
from headsurgeon.finetune.objectives import Objective, head_bos_mass, next_token_loss
from headsurgeon.finetune.strategies import (
    MaskTrainer,
    SliceTrainer,
    checkpointed_blocks,
    make_trainer,
)
from headsurgeon.heads import Heads, HeadSet
from headsurgeon.inuse import holds_model
from headsurgeon.loading import ModelInfo, model_info
from headsurgeon.probes import check_training_memory
from headsurgeon.progress import RunBar, show_progress_lines
from headsurgeon.surgery import (
    TRAINED_TENSORS,
    check_surgery,
    frozen_parameters,
    restored_on_failure,
)
from headsurgeon.validation import MAX_SEED

__all__ = [
    "TrainingDivergedError",
    "duration",
    "finetune",
]

logger = logging.getLogger(__name__)


class TrainingDivergedError(HeadsurgeonError, FloatingPointError):
    """The loss or the gradient norm became NaN or infinite; the last good checkpoint is kept."""


def check_grad_mode(model: Model, what: str) -> None:
    """One line if ``what`` cannot train ``model`` here: inside ``torch.inference_mode()``, or
    with weights made there (inference tensors never take gradients). ``torch.no_grad()`` is
    fine: the training verbs enable gradients themselves."""
    if torch.is_inference_mode_enabled():
        raise InvalidArgumentError(
            f"{what} trains weights, which torch.inference_mode() forbids; call it outside the "
            "inference_mode block"
        )
    if any(p.is_inference() for p in model.parameters()):
        raise InvalidArgumentError(
            f"{what} trains weights, but the model's weights were made under "
            "torch.inference_mode() and cannot take gradients; load the model outside it"
        )


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
            generator = torch.Generator().manual_seed((cfg.seed * 1_000_003 + epoch) % MAX_SEED)
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


@holds_model("finetune")
@torch.enable_grad()  # under torch.no_grad() too: training needs gradients
@show_progress_lines()  # its estimate and steps seen where logging is not set up (a notebook)
def finetune(
    model: Model,
    heads: Heads,
    train: Data | Sequences,
    *,
    eval_data: Data | Sequences | None = None,
    config: FinetuneConfig | None = None,
    objective: Objective | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    resume: bool = False,
    progress: bool | RunBar = True,
) -> FinetuneResult:
    """Train the chosen heads' slices in place; every other weight stays bit-identical.

    ``result = finetune(model, "L2H14", hs.to_sequences(model, n_seqs=64))``: AdamW on float32
    copies of the heads' slices, batches from seeded shuffles (reproducible on CPU), evaluation
    every ``config.eval_interval`` steps. A call that fails (any exception,
    :class:`TrainingDivergedError` on a non-finite loss, ``KeyboardInterrupt``) gives the model its
    weights back, bit for bit, and the last checkpoint is untouched.

    - ``model``: the model, changed in place.
    - ``heads``: the heads to train, any head form.
    - ``train``: texts (cut into 128-token sequences), a token tensor or :class:`Sequences`.
    - ``eval_data``: held-out sequences for the held-out perplexity, in the same forms.
    - ``config``: steps, learning rate, batches, evaluation (default: :class:`FinetuneConfig`).
    - ``objective``: ``loss(model, tokens)`` (default: :func:`next_token_loss`).
    - ``checkpoint_dir``: a folder for ``checkpoint.pt``, written atomically by rank 0.
    - ``resume``: continue from that checkpoint, bit-identical to an uninterrupted run.
    - ``progress``: ``False`` (no bar), ``True``, or a longer run's :class:`RunBar` to advance.

    Checkpoints, ``torchrun``, the log lines and memory checks: [Surgery and fine-tuning:
    finetune](surgery.md#fine-tuning-finetune).
    """
    info = model_info(model, "finetune", writes=True)
    check_grad_mode(model, "finetune")
    check_surgery(model)  # heads sharing keys and values: one line, before the data is read
    train = _sequences(info, train, "training")
    eval_data = None if eval_data is None else _sequences(info, eval_data, "evaluation")
    job = _make_job(model, heads, train, eval_data, config, checkpoint_dir, resume, progress)
    if job.device.type == "cpu" and job.rank == 0:
        warn_busy_threads()
    check_training_memory(  # a batch far too large: one line now, not the kernel's kill later
        model,
        job.cfg.batch_size,
        job.train.shape[1],
        gradient_checkpointing=job.cfg.gradient_checkpointing,
        loss_chunk=job.cfg.loss_chunk,
        logits=objective is None,
    )
    with restored_on_failure(model, "fine-tuning") as snapshot:
        if job.cfg.strategy == "mask":  # the optimiser moves whole tensors before after_step
            snapshot.add_layers(job.heads.layers, TRAINED_TENSORS)
        else:
            snapshot.add_heads(job.heads)
        # Nothing of the model's own trains: the mask strategy re-enables its own tensors.
        with frozen_parameters(model):
            if objective is None and job.cfg.loss_chunk is not None:
                objective = functools.partial(next_token_loss, chunk=job.cfg.loss_chunk)
            objective = objective or next_token_loss
            trainer = make_trainer(model, job.heads, objective, strategy=job.cfg.strategy)
            try:
                return _Loop(job, trainer).run()
            finally:
                trainer.close()


def _sequences(info: ModelInfo, data: Data | Sequences, what: str) -> Sequences:
    """:func:`headsurgeon.data.as_sequences`, its message saying which data it was."""
    try:
        return as_sequences(info, data)
    except DataError as e:
        raise DataError(f"{what} data: {e}") from None


@dataclasses.dataclass
class _Job:
    """A fine-tuning run's validated inputs (made by :func:`_make_job`)."""

    model: Model
    heads: HeadSet
    cfg: FinetuneConfig
    train: Tensor
    train_eval: Tensor  # up to eval_seqs training rows, spread evenly
    heldout: Tensor | None  # up to eval_seqs held-out rows
    n_heldout: int  # the held-out rows given, of which heldout is the first
    identity: dict[str, Any]  # what a resumed checkpoint must match
    device: torch.device
    rank: int
    world: int
    checkpoint_dir: Path | None
    resume: bool
    progress: bool | RunBar

    @property
    def checkpoint_path(self) -> Path | None:
        return self.checkpoint_dir / CHECKPOINT_FILE if self.checkpoint_dir is not None else None


def _make_job(
    model: Model,
    heads: Heads,
    train_seqs: Sequences,
    eval_seqs: Sequences | None,
    config: FinetuneConfig | None,
    checkpoint_dir: str | os.PathLike | None,
    resume: bool,
    progress: bool | RunBar,
) -> _Job:
    """Check :func:`finetune`'s other inputs once; the evaluation rows and the run's identity."""
    cfg = (config or FinetuneConfig()).validate()
    heads = HeadSet.of(heads, model)
    if not heads:
        raise InvalidArgumentError("nothing to fine-tune: the head set is empty")
    check_trainable(model.cfg.dtype)
    rank, world = rank_and_world()
    train = train_seqs.tokens
    eval_data = None if eval_seqs is None else eval_seqs.tokens
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
        "config": config_dict(cfg),
    }
    return _Job(
        model=model,
        heads=heads,
        cfg=cfg,
        train=train,
        train_eval=train[spread],
        heldout=eval_data[: cfg.eval_seqs] if eval_data is not None else None,
        n_heldout=0 if eval_data is None else len(eval_data),
        identity=identity,
        device=torch.device(model.cfg.device),
        rank=rank,
        world=world,
        checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir is not None else None,
        resume=resume,
        progress=progress,
    )


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
                trainer,
                device_ids=[device.index] if device.type == "cuda" else None,
                broadcast_buffers=False,
            )
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(cfg.warmup, cfg.steps)
        )
        self.state = Progress()
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
        check_resume(checkpoint, path, job.identity)
        self.check_state(checkpoint, path)
        self.trainer.load_slices(checkpoint["slices"])
        try:  # the parts are checked; torch checks the rest of what it reads
            self.optimizer.load_state_dict(checkpoint["optimizer"])
            self.scheduler.load_state_dict(checkpoint["scheduler"])
            restore_rng_state(checkpoint["rng"])
        except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as e:
            raise bad_checkpoint(
                path, f"holds an unusable optimiser, schedule or random state ({first_line(e)})"
            ) from None
        self.state = Progress(**checkpoint["progress"])
        self.step = self.resumed_from = self.saved_step = checkpoint["step"]
        logger.info("resuming %s from step %d", job.heads, self.step)

    def check_state(self, checkpoint: dict[str, Any], path: Path) -> None:
        """One line unless the checkpoint's training state fits this run: its step, the names
        and shapes of its slices and optimiser moments, its schedule, random and progress
        state (a truncated, hand-edited or foreign file is refused before any of it is used)."""
        step = checkpoint["step"]
        if not 0 <= step <= self.job.cfg.steps:
            raise bad_checkpoint(path, f"is at step {step}, outside 0-{self.job.cfg.steps}")
        expected = self.trainer.slices()
        tensors_like(checkpoint["slices"], expected, path, "slices")
        optimizer = checkpoint["optimizer"]
        groups, moments = optimizer.get("param_groups"), optimizer.get("state")
        if not (isinstance(groups, list) and len(groups) == 1 and isinstance(moments, dict)):
            raise bad_checkpoint(path, "holds an optimiser state of another shape")
        for index, entry in moments.items():
            if not (isinstance(index, int) and 0 <= index < len(self.params)):
                raise bad_checkpoint(path, f"holds optimiser state for a tensor {index!r}")
            shape = self.params[index].shape
            for name in ("exp_avg", "exp_avg_sq"):
                moment = entry.get(name) if isinstance(entry, dict) else None
                if not (isinstance(moment, Tensor) and moment.shape == shape):
                    raise bad_checkpoint(path, f"holds no {name} of shape {tuple(shape)}")
        scheduler = checkpoint["scheduler"]
        if set(scheduler) != set(self.scheduler.state_dict()) or scheduler["last_epoch"] != step:
            raise bad_checkpoint(path, f"holds a schedule that is not at step {step}")
        rng = checkpoint["rng"].get("torch")
        if not (
            isinstance(rng, Tensor)
            and rng.dtype == torch.uint8
            and rng.shape == torch.get_rng_state().shape
        ):
            raise bad_checkpoint(path, "holds no usable random state")
        check_progress(checkpoint["progress"], step, expected, path)

    def save(self) -> None:
        path = self.job.checkpoint_path
        if path is None:
            return
        if self.job.rank == 0:
            save_checkpoint(
                path,
                {
                    "format": CHECKPOINT_FORMAT,
                    **self.job.identity,
                    "step": self.step,
                    "slices": self.trainer.slices(),
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "rng": rng_state(),
                    "progress": self.state.to_dict(),
                },
            )
        self.saved_step = self.step  # every rank: its divergence message names the checkpoint

    def tell_duration(self, bar: RunBar) -> None:
        """The run's estimated duration, a range from its first steps' durations (median to
        90th percentile) and its first evaluation, in one log line before the rest run."""
        if self.job.rank == 0 and bar.left["step"]:
            logger.info(
                "fine-tuning %d heads: about %s more, from %s (%s)",
                len(self.job.heads),
                duration_range(bar),
                timed_steps(bar),
                bar.describe(),
            )

    def make_bar(self) -> RunBar:
        """The job's bar, at the step and evaluation it resumes from: its own, or the caller's
        :class:`RunBar` moved on to there."""
        job, done = self.job, {"step": self.step, "evaluation": len(self.state.history)}
        if isinstance(job.progress, RunBar):
            for kind, units in done.items():
                job.progress.done(kind, units)
            return job.progress
        return RunBar(
            {"step": job.cfg.steps, "evaluation": job.cfg.evaluations},
            done_already=done,
            tell=self.tell_duration,
            desc=f"fine-tune {len(job.heads)} heads",
            disable=not job.progress or job.rank != 0,
            dynamic_ncols=True,
        )

    def evaluate(self, bar: RunBar) -> None:
        job, state = self.job, self.state
        started = time.perf_counter()
        losses = state.since_eval
        row = {
            "step": self.step,
            "lr": self.optimizer.param_groups[0]["lr"],
            "train_loss": sum(losses) / len(losses) if losses else math.nan,
        }
        row.update(_evaluate(job.model, job.heads, job.cfg, job.train_eval, job.heldout))
        bar.done("evaluation", seconds=time.perf_counter() - started)
        state.history.append(row)
        state.since_eval = []
        # Only what was measured: no loss before the first step, no held-out ppl without data.
        known = [f"training loss {row['train_loss']:.4f}; "] if losses else []
        windows, ppl = f"{len(job.train_eval)} training", f"train {row['train_ppl']:.3f}"
        if job.heldout is not None:
            windows += f", first {len(job.heldout)} of {job.n_heldout} held-out"
            ppl += f", held-out {row['heldout_ppl']:.3f}"
        # The check windows are a few of the rows a caller may judge on (repair's verdict uses
        # them all): the line says which, so the two perplexities are never read as one.
        known.append(f"perplexity on the fine-tuning's check windows ({windows}): {ppl}")
        logger.info(
            "step %d: %s; targets' mean BOS mass %.3f", self.step, "".join(known), row["bos_mass"]
        )
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
        self.restore()
        bar = self.make_bar()
        try:
            self.train(bar)
        finally:
            if bar is not self.job.progress:
                bar.close()
        return self.finish()

    def train(self, bar: RunBar) -> None:
        """The steps left, each timed and counted on ``bar``, with their evaluations and
        checkpoints; the steps and evaluations an early stop skips are dropped from it."""
        cfg, state = self.job.cfg, self.state
        if not state.history:
            self.evaluate(bar)
        enabled = cfg.autocast == "bfloat16"
        autocast = torch.autocast(self.job.device.type, dtype=torch.bfloat16, enabled=enabled)
        recompute = checkpointed_blocks(self.job.model) if cfg.gradient_checkpointing else None
        with recompute or contextlib.nullcontext():  # evaluations (no gradient) pass through
            while self.step < cfg.steps and not state.stopped_early:
                started = time.perf_counter()
                loss_value = self.train_step(autocast)
                bar.done("step", seconds=time.perf_counter() - started)
                lr = self.optimizer.param_groups[0]["lr"]
                bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}")
                if self.step % cfg.eval_interval == 0 or self.step == cfg.steps:
                    self.evaluate(bar)
                if self.step % cfg.checkpoint_interval == 0 and self.step < cfg.steps:
                    self.save()
        bar.drop("step", cfg.steps - self.step)
        bar.drop("evaluation", cfg.evaluations - len(state.history))

    def finish(self) -> FinetuneResult:
        """After the steps: back to the best slices after an early stop, the last checkpoint,
        the result."""
        job, cfg, state = self.job, self.job.cfg, self.state
        if state.stopped_early:
            logger.info(
                "early stop at step %d: no better held-out loss in %d evaluations",
                self.step,
                cfg.patience,
            )
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


_WARNED_THREADS: set[tuple[int, int]] = set()  # (threads, free cores) warned about


def warn_busy_threads() -> None:
    """One warning line when torch's thread count exceeds the cores other jobs leave free
    (:func:`headsurgeon.allocator.too_many_threads`): each step then waits on busy cores, ~5x
    slower on a loaded 2-core machine. The count is the caller's, not changed here; the line
    names the fix. Once per process for each (threads, free cores)."""
    threads = torch.get_num_threads()
    crowded = too_many_threads(threads)
    if crowded is None or (threads, crowded[0]) in _WARNED_THREADS:
        return
    free, why = crowded
    _WARNED_THREADS.add((threads, free))
    logger.warning(
        "%s, and torch uses %d threads: each step waits on the busy cores (several times "
        "slower); call torch.set_num_threads(%d) before training (the tools: --threads)",
        why,
        threads,
        free,
    )


def duration_range(bar: RunBar) -> str:
    """``bar``'s time left as a range: ``"3.1 min to 4.0 min"`` (one value when both round
    alike)."""
    low, high = (duration(seconds) for seconds in bar.range_left())
    return low if low == high else f"{low} to {high}"


def timed_steps(bar: RunBar) -> str:
    """What ``bar``'s range comes from: ``"5 timed steps (median to 90th percentile)"``."""
    n = len(bar.unit_seconds)
    return f"{n} timed step{'' if n == 1 else 's'} (median to 90th percentile)"


def duration(seconds: float) -> str:
    """``"40 s"``, ``"3.4 min"``, ``"1.2 h"``.

    >>> duration(40.2), duration(204), duration(7200)
    ('40 s', '3.4 min', '2.0 h')
    """
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
