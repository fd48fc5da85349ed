"""A fine-tuning batch far too large for memory is refused in one line before anything is
allocated (issue 41), by finetune and by repair before its first census."""

from __future__ import annotations

import pytest
import torch
from conftest import TEXT

import headsurgeon.finetune.trainer as finetune_module
import headsurgeon.probes as probes_module
import headsurgeon.repair.pipeline as repair_module
from headsurgeon import load_model
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.finetune import FinetuneConfig, finetune
from headsurgeon.heads import HeadSet
from headsurgeon.probes import check_training_memory
from headsurgeon.repair import repair


def test_a_huge_batch_is_refused_from_its_size_alone(tiny_model):
    """10^9 sequences: refused by arithmetic on the real free memory, nothing allocated."""
    with pytest.raises(InvalidArgumentError, match="--batch-size") as raised:
        check_training_memory(tiny_model, 10**9, 32)
    assert "\n" not in str(raised.value)
    assert check_training_memory(tiny_model, 4, 32) > 0  # a small batch fits


def test_the_estimate_follows_what_the_backward_pass_keeps(tiny_model):
    full = check_training_memory(tiny_model, 8, 64, available=2**40)
    assert check_training_memory(tiny_model, 16, 64, available=2**40) == 2 * full  # per row
    assert check_training_memory(tiny_model, 8, 64, gradient_checkpointing=True) < full
    assert check_training_memory(tiny_model, 8, 64, loss_chunk=8) < full
    assert check_training_memory(tiny_model, 8, 64, logits=False) < full


@pytest.fixture
def little_free_memory(monkeypatch):
    """16 KiB free, as /proc/meminfo would say it; no step, no census may start."""
    monkeypatch.setattr(probes_module, "_free_memory", lambda device: 16 << 10)

    def never(*args, **kwargs):
        raise AssertionError("ran before the memory check")

    monkeypatch.setattr(finetune_module._Loop, "train_step", never)
    monkeypatch.setattr(repair_module, "run_census", never)


def test_finetune_refuses_before_its_first_step(tiny_model, little_free_memory):
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    tokens = torch.randint(0, 300, (8, 32))
    with pytest.raises(InvalidArgumentError, match=r"fine-tuning a batch of 4 sequences of 32"):
        finetune(tiny_model, HeadSet([(0, 0)]), tokens, config=FinetuneConfig(batch_size=4))
    assert all(torch.equal(v, tiny_model.state_dict()[k]) for k, v in before.items())


def test_repair_refuses_before_its_first_census(injured, little_free_memory):
    with pytest.raises(InvalidArgumentError, match="fine-tuning a batch of 4 sequences of 32"):
        repair(
            load_model(injured),
            TEXT,
            eval_corpus=TEXT,
            census_data=TEXT,
            train_seq_len=32,
            finetune_config=FinetuneConfig(batch_size=4),
            progress=False,
        )
