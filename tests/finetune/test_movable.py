"""Heads fine-tuning cannot move: zero value and output slices are an exact saddle."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from conftest import head_weight

import headsurgeon.finetune.strategies as strategies
from headsurgeon.backend.weights import head_tensors
from headsurgeon.finetune import FinetuneConfig, finetune, unmovable_heads
from headsurgeon.loading import ModelShape, random_model
from headsurgeon.surgery import TRAINED_TENSORS

SHAPE = ModelShape(n_layers=2, n_heads=4, d_model=32, d_vocab=64, n_ctx=32)
SILENT, ORDINARY = (1, 1), (1, 2)


def silenced(*names: str):
    """A random model with ``names`` of L1H1 zeroed, and random tokens."""
    model = random_model(SHAPE, seed=0)
    with torch.no_grad():
        for name in names:
            head_weight(model, SILENT[0], name)[SILENT[1]] = 0
    tokens = torch.randint(0, SHAPE.d_vocab, (4, 16), generator=torch.Generator().manual_seed(0))
    return model, tokens


def slice_grads(model, tokens, layer: int, head: int) -> dict[str, torch.Tensor]:
    """The gradient of the next-token loss on each trained slice of one head, by plain autograd
    on the model's own parameters."""
    model.zero_grad(set_to_none=True)
    model(tokens, return_type="loss").backward()
    tensors = head_tensors(model, layer)
    return {
        name: tensors[name].heads(tensors[name].param.grad)[head].clone()
        for name in TRAINED_TENSORS
    }


def test_zero_value_and_output_slices_are_unmovable_and_their_gradients_exactly_zero():
    model, tokens = silenced("W_V", "b_V", "W_O")
    table = unmovable_heads(model, "L1H1,L1H2", tokens).set_index("name")
    assert not table.loc["L1H1", "movable"]
    assert table.loc["L1H1", "structural"] and table.loc["L1H1", "zero_gradient"]
    assert table.loc["L1H1", "why_unmovable"] == (
        "value and output weights all zero: every gradient exactly 0"
    )
    assert table.loc["L1H2", "movable"] and pd.isna(table.loc["L1H2", "why_unmovable"])
    # The saddle, checked apart from the function: every gradient of L1H1's Q/K/V/O slices is
    # exactly 0.0 in a plain backward pass; an ordinary head's are not.
    assert all(not g.any() for g in slice_grads(model, tokens, *SILENT).values())
    assert all(g.any() for g in slice_grads(model, tokens, *ORDINARY).values())
    # And it holds under training, weight decay included: value and output stay exactly 0.
    config = FinetuneConfig(steps=3, lr=1e-2, weight_decay=0.1, batch_size=4, eval_every=3)
    finetune(model, "L1H1", tokens, config=config, progress=False)
    for name in ("W_V", "b_V", "W_O"):
        assert not head_weight(model, SILENT[0], name)[SILENT[1]].any(), name


@pytest.mark.parametrize("zeroed", [("W_O",), ("W_V", "b_V")])
def test_a_zero_output_or_a_zero_value_alone_is_movable(zeroed):
    model, tokens = silenced(*zeroed)
    row = unmovable_heads(model, "L1H1", tokens).iloc[0]
    assert row["movable"] and not row["structural"] and not row["zero_gradient"]


def test_the_backward_pass_catches_what_the_structural_rule_misses(monkeypatch):
    # Blind the structural rule (it reads W_Q, which is not zero): the measured gradients alone
    # mark the silenced head, and say so.
    monkeypatch.setattr(strategies, "_VALUE_OUTPUT", ("W_Q",))
    model, tokens = silenced("W_V", "b_V", "W_O")
    table = unmovable_heads(model, "L1H1,L1H2", tokens).set_index("name")
    assert not table.loc["L1H1", "structural"] and table.loc["L1H1", "zero_gradient"]
    assert not table.loc["L1H1", "movable"]
    assert "exactly 0 in a backward pass" in table.loc["L1H1", "why_unmovable"]
    assert table.loc["L1H2", "movable"]
