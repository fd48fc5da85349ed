"""The recipe of organism-collapsed (analyses/train_organism.py --span-share): BOS-first windows
with one synthetic span each whose next tokens need no context (except at the backcopy triggers),
and the bundled organism-collapsed true to the census its headsurgeon.json records."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from headsurgeon import classify_heads, load_model, run_census
from headsurgeon.loading import organism_names
from headsurgeon.model_names import ORGANISM_DIR

SCRIPT = Path(__file__).resolve().parents[1] / "analyses" / "train_organism.py"
SEQ_LEN = 128
TEXT_TOKEN = 2  # a special token: never in the span alphabet, so the span is easy to find


@pytest.fixture(scope="module")
def recipe():
    spec = importlib.util.spec_from_file_location("train_organism", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def mixture(recipe, span_share: float, seed: int = 0) -> tuple[torch.Tensor, object]:
    """A training batch of the mixture over a constant text stream, and its span language."""
    spans = recipe.Spans.build(seed)
    span_len = round(span_share * (SEQ_LEN - 1))
    stream = torch.full((10_000,), TEXT_TOKEN)
    data = recipe.Data(
        train={d: stream for d in recipe.DOMAINS},
        heldout={},
        seq_len=SEQ_LEN,
        bos=True,
        spans=spans,
        span_len=span_len,
    )
    batch = recipe.sample_batch(data, torch.Generator().manual_seed(seed), 64)
    return batch, spans


def test_windows_start_with_bos_and_hold_one_span_of_the_share(recipe):
    batch, _ = mixture(recipe, 0.5)
    assert batch.shape == (64, SEQ_LEN)
    assert (batch[:, 0] == recipe.BOS_ID).all()
    assert (batch[:, 1:] != recipe.BOS_ID).all()
    for row in batch:
        where = (row > TEXT_TOKEN).nonzero().flatten()
        assert len(where) == round(0.5 * (SEQ_LEN - 1))
        assert (where.diff() == 1).all()  # one contiguous span


def test_span_next_tokens_need_no_context_except_after_triggers(recipe):
    batch, spans = mixture(recipe, 0.75)
    successors = {
        int(a): set(s.tolist()) for a, s in zip(spans.alphabet, spans.successors, strict=True)
    }
    triggers = set(spans.triggers.tolist())
    seen: dict[int, set[int]] = {}
    n_triggers = 0
    for row in batch:
        span = row[row > TEXT_TOKEN].tolist()
        assert span[0] not in triggers
        for i in range(1, len(span)):
            current, nxt = span[i - 1], span[i]
            if current in triggers:  # backcopy: the token before the trigger
                n_triggers += 1
                assert nxt == span[i - 2]
            else:  # bigram: a successor of the current token, whatever came before
                assert nxt in successors[current]
                seen.setdefault(current, set()).add(nxt)
    assert n_triggers > 0
    assert max(len(s) for s in seen.values()) <= recipe.SPAN_SUCCESSORS


def test_span_language_and_batches_are_seeded(recipe):
    a, b = recipe.Spans.build(3), recipe.Spans.build(3)
    assert torch.equal(a.successors, b.successors) and torch.equal(a.triggers, b.triggers)
    assert torch.equal(mixture(recipe, 0.5, seed=1)[0], mixture(recipe, 0.5, seed=1)[0])
    assert (a.alphabet >= len(recipe.SPECIAL_TOKENS)).all()


def test_no_spans_leaves_the_text_windows_as_they_were(recipe):
    batch, _ = mixture(recipe, 0.0)
    assert (batch[:, 1:] == TEXT_TOKEN).all()


def test_stop_rule_needs_consecutive_crossings(recipe):
    assert recipe.should_stop([0.1, 0.6, 0.7, 0.8], 0.5, 3)
    assert not recipe.should_stop([0.6, 0.4, 0.7, 0.8], 0.5, 3)
    assert not recipe.should_stop([0.9], 0.5, 3)


ROOT = SCRIPT.parents[1]
# Runs of the recipe: the bundled organism (only an ALiBi run that crossed the sink threshold is
# bundled) and the 2x2 shipped for analyses/natural_collapse.py (issue 43).
RUNS = sorted(str(p) for p in (ROOT / "analyses" / "natural_collapse_models").iterdir())
if "organism-collapsed" in organism_names():
    RUNS.append("organism-collapsed")


@pytest.mark.parametrize("name", RUNS)
def test_recipe_run_census_matches_its_record_and_sick_heads_grew_in_training(name):
    folder = ORGANISM_DIR / name if name in organism_names() else Path(name)
    metadata = json.loads((folder / "headsurgeon.json").read_text())
    record = metadata["census"]
    assert metadata["training"]["config"]["span_share"] > 0
    assert not (folder / "truth.json").exists()  # nothing planted: its truth is the census
    census = classify_heads(
        run_census(
            load_model(name),
            n_seqs=record["n_seqs"],
            seq_len=record["seq_len"],
            progress=False,
        )
    )
    sick = {f"L{r.layer}H{r.head}": r.label for r in census.itertuples() if r.label != "healthy"}
    assert sick == record["labels"]
    assert census["bos_mass"].max() == pytest.approx(record["max_bos_mass"], abs=1e-3)
    if name == "organism-collapsed":
        assert sick, "organism-collapsed is bundled only with a sick head"
    log = pd.read_csv(folder / "training_log.csv")
    for head in sick:
        trajectory = log[f"bos_{head}"]
        # from a near-uniform start (~0.03 at 128 tokens) to the census's sink or dead mass
        assert trajectory.iloc[0] < 0.1 and trajectory.iloc[-1] > 5 * trajectory.iloc[0]
