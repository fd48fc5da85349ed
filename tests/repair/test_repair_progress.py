"""A repair run's one bar and its duration told up front (issue 42, item 7)."""

from __future__ import annotations

import logging

import pytest
from conftest import TEXT

import headsurgeon.finetune.trainer as finetune_module
import headsurgeon.repair.pipeline as repair_module
from headsurgeon import load_model
from headsurgeon.finetune import FinetuneConfig
from headsurgeon.progress import RunBar
from headsurgeon.repair import repair

STEPS = 4


def cheap_repair(model, **settings):
    """One pass (unless told) of STEPS steps on the tiny injured model, with the control arm."""
    settings = {"passes": 1, **settings}
    return repair(
        model,
        TEXT,
        eval_corpus=TEXT,
        eval_on_train=True,
        census_data=TEXT,
        census_seq_len=32,
        census_n_seqs=8,
        prepend_bos=True,
        train_seq_len=32,
        n_eval_seqs=8,
        finetune_config=FinetuneConfig(
            steps=STEPS, lr=1e-3, batch_size=4, eval_every=2, checkpoint_every=2
        ),
        **settings,
    )


@pytest.fixture
def bars(monkeypatch):
    """The RunBars the pipeline makes, each with the count it had at every training step."""
    made = []

    class Recorded(RunBar):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.at_steps = []
            made.append(self)

        def done(self, kind, units=1, *, seconds=None):
            if kind == "step" and seconds is not None:  # a step trained, not one loaded
                self.at_steps.append(self.n)
            super().done(kind, units, seconds=seconds)

    monkeypatch.setattr(repair_module, "RunBar", Recorded)
    return made


def test_one_bar_counts_every_step_of_the_run_and_the_estimate_comes_first(injured, bars, caplog):
    with caplog.at_level(logging.INFO, logger="headsurgeon"):
        result = cheap_repair(load_model(injured), progress=True)
    assert len(result.passes) == 1 and result.control is not None
    (bar,) = bars
    # Both arms' steps on one bar, and every planned unit done.
    assert bar.total == bar.n == 2 * STEPS
    assert bar.at_steps == list(range(2 * STEPS))
    assert bar.plan == {"census": 3, "perplexity": 5, "step": 8, "evaluation": 6}
    assert all(left == 0 for left in bar.left.values())
    assert bar.desc.startswith("repair: control 1/1")  # the arm's own count of passes
    messages = [r.getMessage() for r in caplog.records]
    estimate = next(i for i, m in enumerate(messages) if m.startswith("repair: about "))
    assert "for 1 pass x 4 steps and as many in the control arm" in messages[estimate]
    assert "from 5 timed steps (median to 90th percentile) (1 census of " in messages[estimate]
    assert ", 3 steps of " in messages[estimate]  # the 8 planned, less the 5 timed
    # Logged once the fifth step was timed (the control arm's first), before any other: the
    # control arm's first evaluation after step 0 (at step 2) comes later, and no fine-tuning
    # estimate of its own is logged.
    control = next(i for i, m in enumerate(messages) if m.startswith("control 1: fine-tuning"))
    step_2 = [i for i, m in enumerate(messages) if m.startswith("step 2:")][-1]
    assert control < estimate < step_2
    assert not any(m.startswith("fine-tuning ") for m in messages)


def test_a_run_that_stops_early_ends_its_bar_at_the_steps_it_ran(injured, bars):
    cheap_repair(load_model(injured), passes=3, control=False, progress=False)
    (bar,) = bars
    assert bar.total == bar.n < 3 * STEPS and bar.n % STEPS == 0


def test_a_resumed_run_starts_its_bar_at_the_steps_done(injured, bars, tmp_path, monkeypatch):
    step = finetune_module._Loop.train_step
    calls = []

    def killed_in_the_control_arm(loop, autocast):
        calls.append(1)
        if len(calls) == STEPS + 3:  # the control arm checkpointed at its step 2
            raise KeyboardInterrupt
        return step(loop, autocast)

    monkeypatch.setattr(finetune_module._Loop, "train_step", killed_in_the_control_arm)
    with pytest.raises(KeyboardInterrupt):
        cheap_repair(load_model(injured), work_dir=tmp_path / "work", progress=False)
    monkeypatch.setattr(finetune_module._Loop, "train_step", step)
    cheap_repair(load_model(injured), work_dir=tmp_path / "work", resume=True, progress=False)
    interrupted, resumed = bars
    assert interrupted.at_steps == list(range(STEPS + 2))  # the third control step never ran
    # Pass 1 loaded, the control arm continued from its checkpoint: the bar goes on from there.
    assert resumed.at_steps == [STEPS + 2, STEPS + 3] and resumed.n == resumed.total == 2 * STEPS
