"""The repair pipeline: census, choose heads, re-initialise, masked fine-tune, census again.

One run: resolve the settings once (:func:`headsurgeon.repair.config.resolve_config`), cut the
token sequences once (checked once, however many passes train on them), measure the first
census and perplexities, then pass by pass re-initialise the targets
(:func:`headsurgeon.surgery.reinit_heads`), train only their slices
(:func:`headsurgeon.finetune.finetune`, on sequences checked once), round them through the save
dtype and measure again. Then the control arm: the kept passes' targets trained again from the
weights they had, without re-initialisation (:meth:`_Run.control`), after marking the targets
it cannot move at all (:func:`headsurgeon.finetune.unmovable_heads`). Every decision (targets,
damage, the pass kept) is :mod:`headsurgeon.repair.policy`'s, taken on rank 0
(:func:`headsurgeon.distributed.from_rank0`); the work folder is
:mod:`headsurgeon.repair.resume`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd
import torch

import headsurgeon.repair.policy as policy
from headsurgeon.backend import Model
from headsurgeon.census import run_census
from headsurgeon.classify import classify_heads
from headsurgeon.data import (
    CORPORA,
    Data,
    Sequences,
    as_sequences,
    bundled_text,
    check_data,
    resolve_bos,
)
from headsurgeon.distributed import from_rank0, rank_and_world
from headsurgeon.errors import DataError, InvalidArgumentError
from headsurgeon.evals import perplexity
from headsurgeon.finetune import FinetuneConfig, FinetuneResult, finetune, unmovable_heads
from headsurgeon.finetune.trainer import (
    check_grad_mode,
    duration_range,
    timed_steps,
    warn_busy_threads,
)
from headsurgeon.heads import Heads, HeadSet
from headsurgeon.importance import ablate_heads
from headsurgeon.inuse import holds_model
from headsurgeon.loading import ModelInfo, model_info
from headsurgeon.pattern_samples import PatternSample, sample_patterns
from headsurgeon.probes import check_training_memory
from headsurgeon.progress import RunBar, show_progress_lines
from headsurgeon.repair.config import RepairConfig, resolve_config
from headsurgeon.repair.results import PassResult, RepairResult
from headsurgeon.repair.resume import WorkDir, cpu_head_slices, has_numbers
from headsurgeon.surgery import (
    WeightSnapshot,
    check_surgery,
    head_slices,
    load_head_slices,
    reinit_heads,
    restored_on_failure,
)

__all__ = ["repair"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _agree(heads: HeadSet) -> HeadSet:
    """Rank 0's head set on every rank."""
    text = from_rank0(str(heads))
    return HeadSet.parse(text) if text else HeadSet()


def _default_train_data() -> list[str]:
    return [bundled_text(name, "train") for name in CORPORA]


def _split_off_eval_rows(train: Sequences, n_eval_seqs: int) -> tuple[Sequences, Sequences]:
    """(training rows, held-out rows): the last ``min(n_eval_seqs, n // 8)`` rows held out."""
    n_eval = min(n_eval_seqs, train.n_seqs // 8)
    if n_eval < 1:
        raise DataError(
            f"a model without a tokenizer needs held-out tokens: pass eval_corpus= and "
            f"census_data= as token tensors, or at least 8 training rows (got {train.n_seqs})"
        )
    held_out = f"the last {n_eval} rows of the training tensor (held out of training)"
    return (
        dataclasses.replace(train, tokens=train.tokens[:-n_eval]),
        dataclasses.replace(train, tokens=train.tokens[-n_eval:], source=held_out),
    )


def _round_heads(model: Model, heads: HeadSet, dtype: torch.dtype) -> None:
    """Round the heads' slices through ``dtype``, so the model is exactly what a save writes."""
    rounded = {name: t.to(dtype) for name, t in head_slices(model, heads).items()}
    load_head_slices(model, heads, rounded)


@dataclasses.dataclass
class _Data:
    """The sequences of a run: training, evaluation and census."""

    train: Sequences
    train_eval: torch.Tensor  # up to n_eval_seqs training rows, spread evenly
    eval: Sequences
    census: Sequences


TRAINING_CORPORA = "bundled training corpora (shakespeare, python-docs)"


def _prepare_data(
    info: ModelInfo,
    config: RepairConfig,
    corpus: Data | Sequences,
    eval_corpus: Data | Sequences,
    census_data: Data | Sequences,
) -> _Data:
    """Cut the training, evaluation and census sequences (see :func:`repair`), each checked
    once for every pass to train and measure on."""
    # Messages name the option the user set: --train-seq-len, not --seq-len.
    cut = {"seq_len": config.train_seq_len, "seq_len_name": "train_seq_len"}
    prepend_bos, n_eval_seqs = config.prepend_bos, config.n_eval_seqs
    # Every door first: bad evaluation tokens are one line before the training text is cut.
    corpus, eval_corpus, census_data = (
        check_data(info, d) for d in (corpus, eval_corpus, census_data)
    )
    if corpus is None:
        train = as_sequences(info, _default_train_data(), prepend_bos=prepend_bos, **cut)
        train = dataclasses.replace(train, source=TRAINING_CORPORA)
    else:
        train = as_sequences(info, corpus, prepend_bos=prepend_bos, **cut)
    if (eval_corpus is None or census_data is None) and info.tokenizer is None:
        train, rows = _split_off_eval_rows(train, n_eval_seqs)
        logger.info("no tokenizer: evaluating and measuring on %s", rows.source)
        eval_corpus = rows if eval_corpus is None else eval_corpus
        census_data = rows if census_data is None else census_data
    eval_seqs = as_sequences(info, eval_corpus, n_seqs=n_eval_seqs, prepend_bos=prepend_bos, **cut)
    census = as_sequences(
        info,
        census_data,
        seq_len=config.census_seq_len,
        n_seqs=config.census_n_seqs,
        prepend_bos=prepend_bos,
    )
    shared = _shared_rows(train.tokens, eval_seqs.tokens)
    if shared and not config.eval_on_train:
        raise InvalidArgumentError(
            f"{shared} of the {eval_seqs.n_seqs} held-out sequences are training sequences "
            f"({eval_seqs.source}): the verdict would judge the repair on the text it trained "
            "on; give eval_corpus text apart from the training text, or eval_on_train=True to "
            "judge on it anyway"
        )
    spread = torch.linspace(0, train.n_seqs - 1, min(n_eval_seqs, train.n_seqs))
    return _Data(
        train=train,
        train_eval=train.tokens[spread.round().long()],
        eval=eval_seqs,
        census=census,
    )


def _shared_rows(train: torch.Tensor, held_out: torch.Tensor) -> int:
    """How many rows of ``held_out`` are also rows of ``train``: the same text, however named
    (one split twice, a file and its copy), cuts into the same sequences."""
    if train.shape[1:] != held_out.shape[1:]:
        return 0
    seen = {row.numpy().tobytes() for row in train.cpu()}
    return sum(row.numpy().tobytes() in seen for row in held_out.cpu())


def _settings(
    info: ModelInfo, config: RepairConfig, heads: HeadSet | None, include: HeadSet, data: _Data
) -> dict[str, Any]:
    """The run's settings, as ``report.json`` and the resume identity hold them."""
    return {
        "heads": None if heads is None else str(heads),
        "include": str(include) or None,
        "passes": config.passes,
        "init": config.init,
        "seed": config.seed,
        "thresholds": dataclasses.asdict(config.thresholds),
        "drift_threshold": config.drift_threshold,
        "max_ppl_increase": config.max_ppl_increase,
        "max_collateral": config.max_collateral,
        "control": config.control,
        "finetune": dataclasses.asdict(config.finetune),
        "train_data": data.train.source,
        "train_sequences": list(data.train.tokens.shape),
        "eval_data": data.eval.source,
        "eval_sequences": list(data.eval.tokens.shape),
        "census_data": data.census.source,
        "census_sequences": list(data.census.tokens.shape),
        "min_query_pos": config.min_query_pos,
        "prepend_bos": resolve_bos(info, config.prepend_bos),
        "save_dtype": str(config.save_dtype).removeprefix("torch."),
    } | _eval_on_train(data)


def _eval_on_train(data: _Data) -> dict[str, Any]:
    """``eval_on_train``: the held-out sequences that are training sequences, when some are
    (allowed by ``eval_on_train=True``); absent otherwise, so a run started before it resumes."""
    shared = _shared_rows(data.train.tokens, data.eval.tokens)
    return {"eval_on_train": [shared, data.eval.n_seqs]} if shared else {}


class _Run:
    """One repair run's steps: a census, the perplexities, choosing targets, a pass, its verdict,
    and going back to the best pass."""

    def __init__(
        self,
        model: Model,
        config: RepairConfig,
        data: _Data,
        settings: dict[str, Any],
        work: WorkDir | None,
        resume: bool,
        progress: bool,
        snapshot: WeightSnapshot,
    ) -> None:
        self.model, self.config, self.data, self.settings = model, config, data, settings
        self.finetune_config: FinetuneConfig = config.finetune  # resolved by resolve_config
        self.work, self.resume = work, resume
        self.undo: list[tuple[HeadSet, dict[str, torch.Tensor]]] = []  # targets' slices, per pass
        self.movability: pd.DataFrame | None = None  # the control's targets it can move
        self.snapshot = snapshot  # the weights before the run, should it fail
        # Every head's attention at each stage, read while the model is in that stage (a short
        # forward of one census row; passes are undone in place, so it cannot be read later).
        # One row: a report page of bloom-560m's 384 heads at three stages stays under 10 MB.
        self.patterns: dict[str, PatternSample] = {}
        self.arm_passes = config.passes  # at most, in the bar's description; the control's exact
        arms = 2 if config.control else 1
        plan = {"census": 1, "perplexity": 3}  # before any pass; with the pruned heads' two
        for kind, units in self.pass_units().items():
            plan[kind] = plan.get(kind, 0) + arms * config.passes * units
        # One bar for the whole run, counting training steps; censuses and perplexities run
        # without bars of their own and only show in its time left.
        self.bar = RunBar(
            plan,
            tell=self.tell_duration,
            desc="repair",
            disable=not progress or rank_and_world()[0] != 0,
            dynamic_ncols=True,
        )

    def pass_units(self) -> dict[str, int]:
        """The work of one pass: its training steps and evaluations, a census, perplexities."""
        cfg = self.finetune_config
        return {"step": cfg.steps, "evaluation": cfg.evaluations, "census": 1, "perplexity": 1}

    def drop_passes(self, n: int) -> None:
        """``n`` planned passes will not run (the run stopped early, or the control arm
        mirrors fewer passes)."""
        for kind, units in self.pass_units().items():
            self.bar.drop(kind, n * units)

    def timed(self, kind: str, measure: Callable[[], T]) -> T:
        """``measure()``, timed as one unit of ``kind`` of the run's bar."""
        started = time.perf_counter()
        measured = measure()
        self.bar.done(kind, seconds=time.perf_counter() - started)
        return measured

    def sample(self, stage: str) -> None:
        self.patterns[stage] = sample_patterns(self.model, self.data.census.tokens, n_seqs=1)

    def census(self) -> pd.DataFrame:
        measured = self.timed(
            "census",
            lambda: run_census(
                self.model,
                self.data.census,
                batch_size=self.finetune_config.batch_size,
                min_query_pos=self.config.min_query_pos,
                progress=False,
            ),
        )
        return classify_heads(measured, self.config.thresholds)

    def perplexities(self) -> dict[str, float]:
        def ppl(tokens: torch.Tensor) -> float:
            return perplexity(
                self.model,
                tokens,
                window=self.config.train_seq_len,
                batch_size=self.finetune_config.batch_size,
                prepend_bos=False,
                max_windows=None,
                progress=False,
            )

        return self.timed(
            "perplexity",
            lambda: {"train": ppl(self.data.train_eval), "heldout": ppl(self.data.eval.tokens)},
        )

    @property
    def verdict_windows(self) -> str:
        """What the perplexities of the census, pass and pruned lines are measured on, in words:
        not the fine-tuning's check windows of its step lines (a few of the same rows)."""
        return (
            f"on the verdict's windows ({len(self.data.train_eval)} training, all "
            f"{self.data.eval.n_seqs} held-out, {self.data.eval.seq_len} tokens each)"
        )

    def pruned_perplexities(self, heads: HeadSet) -> dict[str, dict[str, float]]:
        """The perplexities with ``heads`` pruned instead of repaired: mean- and zero-ablated
        (the mean over the census sequences)."""
        pruned = {}
        batch_size = self.finetune_config.batch_size
        for ablation in ("mean", "zero"):
            data = self.data.census
            with ablate_heads(
                self.model, heads, ablation, data, batch_size=batch_size, progress=False
            ):
                pruned[ablation] = self.perplexities()
        described = (f"{k} ablation {_format_ppl(v)}" for k, v in pruned.items())
        logger.info(
            "pruned instead (the targets ablated, not repaired), perplexity %s: %s",
            self.verdict_windows,
            "; ".join(described),
        )
        return pruned

    def first_census(self) -> tuple[pd.DataFrame, dict[str, float]]:
        """The census and perplexities before any pass (stored in the work folder, if any)."""
        work = self.work
        if work is not None:
            sets = {"train": self.data.train, "eval": self.data.eval, "census": self.data.census}
            tokens = {name: seqs.tokens for name, seqs in sets.items()}
            work.begin(self.model, self.settings, self.resume, tokens)
        stored = work.load_census("census_0", {"perplexity": (dict,)}) if work is not None else None
        if stored is not None:
            current, extra = stored
            ppl = extra["perplexity"]
            if not has_numbers(ppl, ("train", "heldout")):
                raise work.unusable(work.path / "census_0.json", "holds no valid perplexities")
            self.bar.done("census")
            self.bar.done("perplexity")
        else:
            current, ppl = self.census(), self.perplexities()
            if work is not None:
                work.save_census("census_0", current, {"perplexity": ppl})
        logger.info(
            "census: %s; perplexity %s: %s",
            policy.label_counts(current),
            self.verdict_windows,
            _format_ppl(ppl),
        )
        self.sample("before")
        return current, ppl

    def run_pass(
        self,
        index: int,
        targets: HeadSet,
        current: pd.DataFrame,
        ppl: dict[str, float],
        start: tuple[pd.DataFrame, dict[str, float], HeadSet],
        arm: str = "pass",
    ) -> PassResult:
        """Pass ``index`` of ``arm`` on ``targets`` (loaded from the work folder when it
        finished there), judged against ``start``: the first census, its perplexities and the
        earlier targets. Arm ``"pass"`` re-initialises the targets first (a repair pass, undone
        by :meth:`go_back_to`); ``"control"`` trains them as they are."""
        work, model = self.work, self.model
        loaded = (
            work.load_pass(index, targets, model, self.finetune_config, arm)
            if work is not None
            else None
        )  # read and checked before the model changes
        if arm == "pass":
            self.undo.append((targets, cpu_head_slices(model, targets)))
        self.snapshot.add_heads(targets)
        if loaded is not None:
            after, record, training, slices = loaded
            load_head_slices(model, targets, slices)
            self.count_loaded(training)
            ppl_after = record["perplexity_after"]
            logger.info("%s %d: loaded from %s", arm, index, work.pass_dir(index, arm))
        else:
            after, ppl_after, training = self._train_pass(index, targets, arm)
        if arm == "pass":
            self.sample(f"pass {index}")
        first, first_ppl, earlier = start
        collateral = policy.collateral_damage(first, after, earlier, targets)
        change = policy.perplexity_change(first_ppl, ppl_after)
        failure = from_rank0(policy.damage(first_ppl, ppl_after, change, collateral, self.config))
        healthy = HeadSet() if failure is not None else policy.healthy_set(after)
        result = PassResult(
            index=index,
            targeted=targets,
            recovered=targets & healthy,
            still_sick=targets - healthy,
            drifted=policy.drifted(current, after, targets, self.config.drift_threshold),
            census_before=current,
            census_after=after,
            perplexity_before=ppl,
            perplexity_after=ppl_after,
            training=training,
            collateral=collateral,
            perplexity_change=change,
            failure=failure,
        )
        if work is not None and loaded is None:
            work.save_pass(result, model, arm)
        logger.info(
            "%s %d: %d/%d recovered, %d frozen heads drifted (|Δ BOS mass| > %g), %d turned sick; "
            "perplexity %s: %s",
            arm,
            index,
            len(result.recovered),
            len(targets),
            len(result.drifted),
            self.config.drift_threshold,
            len(collateral),
            self.verdict_windows,
            _format_ppl(ppl_after),
        )
        if failure is not None:
            logger.warning("%s %d damaged the model: %s", arm, index, failure)
        return result

    def control(
        self, passes: list[PassResult], start: tuple[pd.DataFrame, dict[str, float]]
    ) -> list[PassResult]:
        """The control arm of ``passes`` (the kept model's), from the model as given
        (``start``: its census and perplexities): pass by pass the same targets, data, steps,
        seed and schedule, without re-initialisation. The model holds the kept model again
        afterwards; ``patterns["control"]`` is the control model's attention."""
        model = self.model
        trained = HeadSet()
        for p in passes:
            trained = trained | p.targeted
        kept = cpu_head_slices(model, trained)
        for heads, slices in reversed(self.undo):  # every target's weights as given
            load_head_slices(model, heads, slices)
        self.movability = self.movable(trained)
        first, first_ppl = start
        current, ppl, earlier = first, first_ppl, HeadSet()
        results = []
        self.arm_passes = len(passes)
        for p in passes:
            result = self.run_pass(
                p.index, p.targeted, current, ppl, (first, first_ppl, earlier), arm="control"
            )
            results.append(result)
            current, ppl = result.census_after, result.perplexity_after
            earlier = earlier | p.targeted
        self.sample("control")
        load_head_slices(model, trained, kept)
        return results

    def movable(self, targets: HeadSet) -> pd.DataFrame:
        """Which ``targets`` the control can move from the weights the model holds (one backward
        pass on the first training batch; :func:`unmovable_heads`), the unmovable logged."""
        cfg = self.finetune_config
        table = unmovable_heads(self.model, targets, self.data.train.tokens[: cfg.batch_size], cfg)
        for row in table[~table["movable"]].itertuples():
            logger.info(
                "control: %s cannot be moved without re-initialisation (%s)",
                row.name,
                row.why_unmovable,
            )
        return table

    def count_loaded(self, training: FinetuneResult) -> None:
        """A pass loaded from the work folder: its units done on the bar, those its early stop
        skipped dropped."""
        units, done = self.pass_units(), {"step": training.steps_done}
        done["evaluation"] = len(training.history)
        for kind, planned in units.items():
            self.bar.done(kind, done.get(kind, planned))
            self.bar.drop(kind, planned - done.get(kind, planned))

    def go_back_to(self, index: int | None) -> None:
        """Undo the passes after pass ``index`` (all of them for None), latest first."""
        kept = 0 if index is None else index
        while len(self.undo) > kept:
            heads, slices = self.undo.pop()
            load_head_slices(self.model, heads, slices)

    def _train_pass(
        self, index: int, targets: HeadSet, arm: str
    ) -> tuple[pd.DataFrame, dict[str, float], FinetuneResult]:
        """Re-initialise (arm ``"pass"`` only), fine-tune and round ``targets``; the census and
        perplexities after."""
        reinit = arm == "pass"
        what = "re-initialising and fine-tuning" if reinit else "fine-tuning (no re-initialisation)"
        logger.info("%s %d: %s %d heads: %s", arm, index, what, len(targets), targets)
        self.bar.set_description(f"repair: {arm} {index}/{self.arm_passes}")
        if reinit:
            seed = self.config.seed + index - 1
            reinit_heads(self.model, targets, init=self.config.init, seed=seed)
        training = finetune(  # Sequences: checked once, by _prepare_data
            self.model,
            targets,
            self.data.train,
            eval_data=self.data.eval,
            config=self.finetune_config,
            checkpoint_dir=self.work.pass_dir(index, arm) if self.work is not None else None,
            resume=self.resume,
            progress=self.bar,  # counted and timed on the run's bar, with no bar of its own
        )
        _round_heads(self.model, targets, self.config.save_dtype)
        return self.census(), self.perplexities(), training

    def tell_duration(self, bar: RunBar) -> None:
        """After the run's first training steps: how long the whole run takes, as a range (its
        steps at their median and 90th-percentile durations), in one log line (shown by the
        command line) before the other steps run."""
        if rank_and_world()[0] != 0:
            return
        control = " and as many in the control arm" if self.config.control else ""
        passes = self.config.passes
        logger.info(
            "repair: about %s more (less if it stops early) for %d pass%s x %d steps%s, with "
            "their censuses and perplexities, from %s (%s)",
            duration_range(bar),
            passes,
            "" if passes == 1 else "es",
            self.finetune_config.steps,
            control,
            timed_steps(bar),
            bar.describe(),
        )


@holds_model("repair")
@torch.enable_grad()  # under torch.no_grad() too: fine-tuning needs gradients
@show_progress_lines()  # its estimate and passes seen where logging is not set up (a notebook)
def repair(
    model: Model,
    corpus: Data | Sequences = None,
    *,
    config: RepairConfig | None = None,
    heads: Heads | None = None,
    include: Heads | None = None,
    eval_corpus: Data | Sequences = None,
    census_data: Data | Sequences = None,
    work_dir: str | os.PathLike | None = None,
    resume: bool = False,
    progress: bool = True,
    **settings: Any,
) -> RepairResult:
    """Repair ``model`` in place, pass by pass; return what each pass did.

    ``result = repair(model, passes=1)`` is ``repair(model, config=RepairConfig(passes=1))``:
    settings come as a :class:`~headsurgeon.repair.RepairConfig` or as keywords named by its fields
    (and ``sink_threshold``, ``dead_threshold``, ``min_output_share``), not both. A damaging pass
    stops the run (``ok`` False) and leaves ``model`` at the best harmless pass; a call that raises
    gives ``model`` its original weights back, bit for bit.

    - ``model``: the model to repair, changed in place.
    - ``corpus``: fine-tuning text or tokens (default: the bundled training corpora).
    - ``config``: every setting at once (default: :func:`recommended_config`'s, as the CLI).
    - ``heads``: the pass-1 targets, instead of the census's choice.
    - ``include``: heads added to the census's choice.
    - ``eval_corpus``: held-out text or tokens for perplexity (default: bundled held-out corpora).
    - ``census_data``: the census's text or tokens (default: the bundled held-out corpora).
    - ``work_dir``: a folder that keeps each finished pass and fine-tuning checkpoint.
    - ``resume``: continue the run ``work_dir`` holds (:func:`finished_run` says if it finished).
    - ``progress``: show one progress bar for the whole run.
    - ``**settings``: :class:`RepairConfig` fields by name; any other keyword is one error line.

    What a pass does, the damage limits, the control arm and the defaults: [Repair: the same run
    from Python](../tools/repair.md#the-same-run-from-python).
    """
    info = model_info(model, "repair", writes=True)
    check_grad_mode(model, "repair")
    check_surgery(model)  # before any census or training
    config = resolve_config(model, info, config, settings)
    heads = None if heads is None else HeadSet.of(heads, info.shape)
    include = None if include is None else HeadSet.of(include, info.shape)
    if heads is not None and not heads:
        raise InvalidArgumentError("nothing to repair: the head set is empty")
    include = include or HeadSet()
    data = _prepare_data(info, config, corpus, eval_corpus, census_data)
    ft = config.finetune
    check_training_memory(  # before the first census: a batch far too large fails at once
        model,
        ft.batch_size,
        data.train.seq_len,
        gradient_checkpointing=ft.gradient_checkpointing,
        loss_chunk=ft.loss_chunk,
    )
    run_settings = _settings(info, config, heads, include, data)
    rank, _ = rank_and_world()
    if rank == 0 and torch.device(model.cfg.device).type == "cpu":
        warn_busy_threads()  # before the first census, not after it
    work = WorkDir(Path(work_dir), rank, info.shape) if work_dir is not None else None
    with restored_on_failure(model, "repair") as snapshot:
        run = _Run(model, config, data, run_settings, work, resume, progress, snapshot)
        try:
            result = _run(run, heads, include)
        finally:
            run.bar.close()
        if work is not None:
            work.finish()
    return result


def _run(run: _Run, heads: HeadSet | None, include: HeadSet) -> RepairResult:
    """The passes of :func:`repair`, and its result."""
    model, config, settings = run.model, run.config, run.settings
    current, ppl = run.first_census()
    first, first_ppl = current, ppl
    results: list[PassResult] = []
    targeted = HeadSet()
    first_targets = _agree(policy.targets(1, current, heads, include))
    pruned = run.pruned_perplexities(first_targets) if first_targets else None
    for index in range(1, config.passes + 1):
        targets = (
            first_targets if index == 1 else _agree(policy.targets(index, current, heads, include))
        )
        if not targets:
            if index == 1:
                raise InvalidArgumentError(
                    "nothing to repair: the census labels no head dead or BOS-sink; pass heads "
                    "(--heads) or include (--include) to operate on chosen heads"
                )
            logger.info("pass %d: no sick heads left, stopping", index)
            break
        result = run.run_pass(index, targets, current, ppl, (first, first_ppl, targeted))
        results.append(result)
        if result.damaged:
            break  # the next targets would come from a damaged model
        current, ppl, targeted = result.census_after, result.perplexity_after, targeted | targets
    run.drop_passes(config.passes - len(results))
    best = from_rank0(policy.best_pass(results))
    if best != results[-1].index:
        logger.info("keeping the model of %s", f"pass {best}" if best else "no pass (original)")
    run.go_back_to(best)
    # The control mirrors the kept model's passes; with none kept, every pass that ran.
    mirrored = results[: best or len(results)]
    if config.control:
        run.drop_passes(config.passes - len(mirrored))
    control = run.control(mirrored, (first, first_ppl)) if config.control else None
    return RepairResult(
        model=model,
        passes=results,
        census_before=first,
        census_after=first if best is None else results[best - 1].census_after,
        settings=settings,
        drift_threshold=config.drift_threshold,
        best_pass=best,
        pruned=pruned,
        patterns=run.patterns,
        control=control,
        control_movability=run.movability,
    )


def _format_ppl(ppl: dict[str, float]) -> str:
    return f"train {ppl['train']:.3f}, held-out {ppl['heldout']:.3f}"
