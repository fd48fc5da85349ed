"""The ALiBi families as classes: the same members side by side, chosen once from a model's facts,
and the slopes each applies (the formulas of :mod:`headsurgeon.alibi`, for its config)."""

from __future__ import annotations

import pytest
import torch

from headsurgeon import alibi, families
from headsurgeon.errors import InvalidArgumentError, UnsupportedArchitectureError
from headsurgeon.families import BLOOM, FALCON, MPT
from headsurgeon.loading import model_shape


def test_each_family_overrides_only_what_the_base_declares():
    base = families.AlibiFamily
    declared = {n for n in [*vars(base), *base.__annotations__] if not n.startswith("_")}
    for family in families.FAMILIES.values():
        own = {name for name in vars(type(family)) if not name.startswith("_")}
        assert own <= declared, (family, own - declared)


def test_the_name_tables_name_each_family_once():
    assert families.FAMILIES == {"bloom": BLOOM, "mpt": MPT, "falcon": FALCON}
    assert families.ARCHITECTURES["MptForCausalLM"] is MPT
    assert families.ALIBI_ATTENTION["FalconAttention"] is FALCON
    with pytest.raises(InvalidArgumentError, match="unknown ALiBi family 'gpt2'; use one of"):
        families.family_named("gpt2")


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"model_type": "bloom", "n_head": 6, "hidden_size": 48}, alibi.slopes(6)),
        ({"model_type": "mpt", "n_heads": 4, "d_model": 32}, alibi.mpt_slopes(4)),
        (
            {"model_type": "falcon", "alibi": True, "num_attention_heads": 4, "hidden_size": 64},
            alibi.falcon_slopes(4, 16),
        ),
    ],
    ids=["bloom", "mpt", "falcon"],
)
def test_config_slopes_are_the_familys_formula(config, expected):
    assert torch.equal(families.config_slopes(config), expected)


def test_a_config_without_alibi_is_refused_in_one_line():
    with pytest.raises(UnsupportedArchitectureError, match="model_type falcon without alibi"):
        families.config_family({"model_type": "falcon", "num_attention_heads": 4})
    with pytest.raises(UnsupportedArchitectureError, match="model_type gpt2 has no ALiBi"):
        families.config_family({"model_type": "gpt2"})


@pytest.mark.parametrize("n_heads", [1, 4, 12, 71])
@pytest.mark.parametrize("d_head", [16, 64, 72])
def test_falcon_multiplies_positions_by_blooms_slopes_from_its_own(n_heads, d_head):
    """The precision counterfactual takes the slopes the model applies and asks the family what
    it multiplies positions by: for Falcon, BLOOM's slopes in bfloat16, exactly."""
    factors = FALCON.factors(alibi.falcon_slopes(n_heads, d_head), d_head)
    assert torch.equal(factors.bfloat16(), alibi.slopes(n_heads).bfloat16())


def test_a_shape_names_its_family():
    assert model_shape("mpt-7b").alibi_family is MPT
    assert model_shape("falcon-rw-1b").alibi_family is FALCON
    assert model_shape("bloom-560m").alibi_family is BLOOM


def test_a_transformerlens_attention_is_blooms(tiny_model):
    assert families.attention_family(tiny_model.blocks[0].attn) is BLOOM
