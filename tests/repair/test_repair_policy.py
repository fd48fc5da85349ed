"""The repair's decisions as pure functions: targets, damage, the pass kept; and its settings
keywords. No model is trained here (the last test builds a tiny random one and stops at once)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pandas as pd
import pytest

from headsurgeon.errors import InvalidArgumentError
from headsurgeon.heads import HeadSet
from headsurgeon.loading import ModelShape, random_model
from headsurgeon.repair import RepairConfig, repair
from headsurgeon.repair.policy import (
    best_pass,
    collateral_damage,
    damage,
    drifted,
    label_counts,
    perplexity_change,
    targets,
    worsened,
)


def census(labels: str, bos_mass: list[float] | None = None) -> pd.DataFrame:
    """One layer of heads, labelled by letter: h(ealthy), s(ink), d(ead)."""
    names = {"h": "healthy", "s": "BOS-sink", "d": "dead"}
    return pd.DataFrame(
        {
            "layer": [0] * len(labels),
            "head": list(range(len(labels))),
            "label": [names[c] for c in labels],
            "bos_mass": bos_mass or [0.1] * len(labels),
        }
    )


def heads(text: str) -> HeadSet:
    return HeadSet.parse(text) if text else HeadSet()


@pytest.mark.parametrize(
    "index, chosen, include, expected",
    [
        (1, None, "", "L0H1-2"),  # the sick heads
        (1, None, "L0H0", "L0H0-2"),  # and include
        (1, "L0H3", "", "L0H3"),  # explicit heads replace the census's choice
        (2, None, "L0H0", "L0H1-2"),  # later passes: the heads still sick
        (2, "L0H1", "L0H0", "L0H1"),  # ... within heads | include
    ],
)
def test_targets(index, chosen, include, expected):
    sick = census("hsdh")
    assert targets(index, sick, None if chosen is None else heads(chosen), heads(include)) == heads(
        expected
    )


def test_the_perplexity_change_is_relative_to_the_first_census():
    change = perplexity_change({"train": 10.0, "heldout": 20.0}, {"train": 9.0, "heldout": 22.0})
    assert change == pytest.approx({"train": -0.1, "heldout": 0.1})


def test_damage_is_perplexity_beyond_the_limit_or_too_many_collateral_heads():
    config = RepairConfig(max_ppl_increase=0.1, max_collateral=1)
    first = {"train": 10.0, "heldout": 20.0}
    ok = {"train": 10.0, "heldout": 21.0}
    assert damage(first, ok, perplexity_change(first, ok), heads("L0H0"), config) is None
    worse = {"train": 10.0, "heldout": 30.0}
    said = damage(first, worse, perplexity_change(first, worse), heads("L0H0-1"), config)
    assert said == (
        "held-out perplexity 20.00 -> 30.00 (+50.0%, at most +10% allowed); 2 healthy frozen "
        "head(s) turned sick (L0H0-1; at most 1 allowed)"
    )
    diverged = {"train": math.nan, "heldout": math.nan}
    assert damage(first, diverged, perplexity_change(first, diverged), HeadSet(), config)
    unlimited = RepairConfig(max_ppl_increase=math.inf)
    assert damage(first, worse, perplexity_change(first, worse), HeadSet(), unlimited) is None


def test_collateral_damage_is_frozen_heads_that_turned_sick():
    first, after = census("hhhh"), census("sshd")
    # L0H0 was targeted earlier, L0H3 now: neither is collateral
    assert collateral_damage(first, after, heads("L0H0"), heads("L0H3")) == heads("L0H1")


def passes(*specs) -> list[SimpleNamespace]:
    """PassResult stand-ins: (targets, labels after, held-out perplexity, damaged)."""
    return [
        SimpleNamespace(
            index=i,
            targeted=heads(t),
            census_after=census(labels),
            damaged=hurt,
            perplexity_after={"train": ppl, "heldout": ppl},
        )
        for i, (t, labels, ppl, hurt) in enumerate(specs, start=1)
    ]


def test_the_best_pass_has_most_targets_healthy_then_the_lowest_perplexity():
    # pass 2 heals one more target; pass 3 as many, at a lower perplexity
    runs = passes(
        ("L0H1-2", "hshh", 20.0, False),
        ("L0H1", "hhhh", 21.0, False),
        ("L0H1", "hhhh", 19.0, False),
    )
    assert best_pass(runs) == 3
    assert best_pass(runs[:2]) == 2
    runs[2].damaged = True
    assert best_pass(runs) == 2


def test_no_best_pass_when_every_pass_did_damage():
    assert best_pass(passes(("L0H1", "hhhh", 20.0, True))) is None
    assert best_pass([]) is None


def test_worsened_and_drifted():
    before = census("hsh", bos_mass=[0.1, 0.6, 0.1])
    after = census("shh", bos_mass=[0.6, 0.1, 0.2])
    assert worsened(before, after, heads("L0H0-1")) == heads("L0H0")
    assert drifted(before, after, heads("L0H0"), threshold=0.05) == heads("L0H1-2")
    assert label_counts(after) == {"healthy": 2, "BOS-sink": 1, "dead": 0}


def test_repair_refuses_an_unknown_setting_in_one_line():
    model = random_model(ModelShape(n_layers=2, n_heads=4, d_model=32, d_vocab=64, n_ctx=16))
    with pytest.raises(InvalidArgumentError, match="repair\\(\\) has no setting pases;") as caught:
        repair(model, pases=1)
    assert "\n" not in str(caught.value)
    with pytest.raises(InvalidArgumentError, match="not both \\(passes\\)"):
        repair(model, config=RepairConfig(), passes=1)
    default = RepairConfig().passes  # written beside config=, even at its default, it is refused:
    with pytest.raises(InvalidArgumentError, match="not both \\(passes\\)"):  # never ignored
        repair(model, config=RepairConfig(passes=1), passes=default)


def test_repair_takes_the_command_lines_threshold_names():
    from headsurgeon.classify import Thresholds
    from headsurgeon.loading import model_info
    from headsurgeon.repair.config import resolve_config

    model = random_model(ModelShape(n_layers=2, n_heads=4, d_model=32, d_vocab=64, n_ctx=16))
    info = model_info(model)
    config = resolve_config(model, info, None, {"sink_threshold": 0.4, "dead_threshold": 0.9})
    assert config.thresholds == Thresholds(sink=0.4, dead=0.9)
    both = {"thresholds": Thresholds(dead=0.9), "min_output_share": 0.02}
    assert resolve_config(model, info, None, both).thresholds == Thresholds(
        dead=0.9, min_output_share=0.02
    )
    with pytest.raises(InvalidArgumentError, match="not both \\(sink_threshold\\)"):
        repair(model, config=RepairConfig(), sink_threshold=0.4)
