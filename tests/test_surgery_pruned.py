"""A pruned checkpoint (hs.save_pruned) and the model card every export carries."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import headsurgeon as hs
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.importance import ablate_heads

HEADS = "L0H1,L1H3"


def test_a_pruned_checkpoint_computes_the_zero_ablated_model(tiny_model, tmp_path):
    """Reloaded by transformers, the checkpoint computes what the model computes with the heads
    zero-ablated (the brute force: TransformerLens hooks on hook_z); the model is unchanged."""
    before = {name: p.clone() for name, p in tiny_model.named_parameters()}
    folder = hs.save_pruned(tiny_model, HEADS, tmp_path / "pruned")
    for name, p in tiny_model.named_parameters():
        assert torch.equal(p, before[name]), name
    tokens = torch.randint(
        0, tiny_model.cfg.d_vocab, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad(), ablate_heads(tiny_model, HEADS, "zero"):
        expected = tiny_model(tokens)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(tokens).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    card = (folder / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert "2 head(s) pruned: L0H1, L1H3" in card and "Checked by reload" in card


def test_every_export_carries_a_card_that_says_what_it_is(tiny_model, tmp_path):
    folder = hs.save_hf(tiny_model, tmp_path / "plain", verify=False)
    card = (folder / "README.md").read_text()
    assert "exported by headsurgeon" in card and "Not checked by reload" in card
    assert str(tmp_path) not in card  # no machine path


def test_an_empty_head_set_is_one_line(tiny_model, tmp_path):
    with pytest.raises(InvalidArgumentError, match="nothing to prune"):
        hs.save_pruned(tiny_model, [], tmp_path / "none")
    assert not (tmp_path / "none").exists()
