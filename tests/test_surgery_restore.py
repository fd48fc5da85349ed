"""A repair or a fine-tuning run that fails halfway (an error, Ctrl-C) gives the caller's model
back bit for bit, and says so in one line."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import TEXT
from test_finetune import config, setup

import headsurgeon.finetune.trainer as finetune_module
import headsurgeon.repair.pipeline as repair_module
from headsurgeon import load_model
from headsurgeon.classify import Thresholds
from headsurgeon.finetune import MaskTrainer, finetune
from headsurgeon.repair import repair

# Two passes: output shares < 0.2 leave heads sick after pass 1 (see tests/repair/test_repair.py).
SETTINGS = dict(
    census_data=TEXT,
    census_seq_len=32,
    census_n_seqs=16,
    prepend_bos=True,
    train_seq_len=32,
    progress=False,
    thresholds=Thresholds(min_output_share=0.2),
    max_collateral=2,
    passes=2,
    finetune_config=config(steps=4, eval_every=4, lr=1e-2, weight_decay=0.0),
)


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same(model, before) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name


def restored_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "are back as they were" in r.getMessage()]


@pytest.mark.parametrize("error", [RuntimeError("injected"), KeyboardInterrupt()])
def test_a_failure_in_pass_2_gives_the_model_back(injured, monkeypatch, caplog, error):  # noqa: F811
    calls = []
    loss = finetune_module.next_token_loss

    def fails_in_pass_2(model, tokens):
        calls.append(None)
        if len(calls) == 6:  # pass 1 took 4 steps; pass 2 has trained one
            raise error
        return loss(model, tokens)

    monkeypatch.setattr(finetune_module, "next_token_loss", fails_in_pass_2)
    model = load_model(injured)
    before = state(model)
    with pytest.raises(type(error)), caplog.at_level(logging.INFO, logger="headsurgeon"):
        repair(model, TEXT, eval_corpus=TEXT, eval_on_train=True, **SETTINGS)
    assert len(calls) == 6 and any("pass 2: re-initialising" in m for m in caplog.messages)
    assert_same(model, before)
    # One line, from the outermost work only (fine-tuning inside the repair stays quiet).
    assert restored_lines(caplog) == [
        f"repair stopped ({type(error).__name__}): the model's weights are back as they were "
        "before it"
    ]


def test_a_failure_after_training_gives_the_model_back(injured, monkeypatch, caplog):  # noqa: F811
    # The census after pass 1: the heads are trained and rounded, nothing fine-tunes any more.
    census = repair_module.run_census
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(None)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return census(*args, **kwargs)

    monkeypatch.setattr(repair_module, "run_census", interrupted)
    model = load_model(injured)
    before = state(model)
    with pytest.raises(KeyboardInterrupt):
        repair(model, TEXT, eval_corpus=TEXT, eval_on_train=True, **SETTINGS)
    assert_same(model, before)
    assert len(restored_lines(caplog)) == 1


def test_a_failure_before_any_change_says_nothing(injured, caplog):  # noqa: F811
    model = load_model(injured)
    before = state(model)
    with pytest.raises(ValueError, match="out of range"):
        repair(model, TEXT, eval_corpus=TEXT, eval_on_train=True, heads="L5H0", **SETTINGS)
    assert_same(model, before)
    assert not restored_lines(caplog)


@pytest.mark.parametrize("strategy", ["slices", "mask"])
def test_ctrl_c_inside_an_optimiser_step_gives_the_model_back(monkeypatch, caplog, strategy):
    # The mask strategy's optimiser moves whole tensors (weight decay), after_step puts the
    # frozen heads back: a Ctrl-C in between must not leave them moved.
    model, heads, tokens = setup()
    before = state(model)
    grads = {name: p.requires_grad for name, p in model.named_parameters()}
    calls = []
    after_step = MaskTrainer.after_step if strategy == "mask" else None

    def interrupted(trainer):
        calls.append(None)
        if len(calls) == 3:
            raise KeyboardInterrupt
        if after_step is not None:
            after_step(trainer)
        else:
            trainer.params.write_to(trainer._model[0])

    target = MaskTrainer if strategy == "mask" else finetune_module.SliceTrainer
    monkeypatch.setattr(target, "after_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        finetune(model, heads, tokens, config=config(strategy=strategy), progress=False)
    assert_same(model, before)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == grads
    assert not any(p._backward_hooks for p in model.parameters())  # the masks' hooks are gone
    assert restored_lines(caplog) == [
        "fine-tuning stopped (KeyboardInterrupt): the model's weights are back as they were "
        "before it"
    ]
