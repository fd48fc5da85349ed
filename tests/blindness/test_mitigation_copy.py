"""A copy of a model made inside a mitigation block is refused (issue 41): it would keep the
block's hooks and compute mitigated numbers forever."""

from __future__ import annotations

import copy

import pytest
import torch

from headsurgeon.blindness import mitigation
from headsurgeon.blindness.analysis import active_mitigations
from headsurgeon.errors import InvalidArgumentError


@torch.no_grad()  # 4.x: a bridge that ran with gradients holds a non-leaf tensor deepcopy refuses
def test_a_copy_inside_a_mitigation_block_is_refused_and_one_after_it_is_clean(tiny_model):
    tokens = torch.arange(5, 53).reshape(2, 24)
    plain = tiny_model(tokens)
    with mitigation(tiny_model, "log"):
        with mitigation(tiny_model, "softcap", c=1.0):
            mitigated = tiny_model(tokens)
            with pytest.raises(InvalidArgumentError, match="copy the model before the block"):
                copy.deepcopy(tiny_model)
        with pytest.raises(InvalidArgumentError) as raised:  # the outer block still holds hooks
            copy.deepcopy(tiny_model)
        assert "\n" not in str(raised.value)
    assert not torch.equal(mitigated, plain)
    copied = copy.deepcopy(tiny_model)
    assert active_mitigations(copied) == []
    torch.testing.assert_close(copied(tokens), plain, rtol=0, atol=0)


@torch.no_grad()
def test_a_copy_inside_an_ablation_block_is_refused_too(tiny_model):
    from headsurgeon.importance import ablate_heads

    tokens = torch.arange(5, 53).reshape(2, 24)
    plain = tiny_model(tokens)
    with ablate_heads(tiny_model, "L0H0", "zero"):
        with mitigation(tiny_model, "log"):  # the refusal names the innermost block
            with pytest.raises(InvalidArgumentError, match="inside the mitigation block"):
                copy.deepcopy(tiny_model)
        with pytest.raises(InvalidArgumentError, match="inside the ablate_heads block"):
            copy.deepcopy(tiny_model)
    torch.testing.assert_close(copy.deepcopy(tiny_model)(tokens), plain, rtol=0, atol=0)
