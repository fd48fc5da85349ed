"""Every door checks its data (issue 51, class 5): each public verb that takes data refuses
float, bool and complex tensors, float numpy arrays, ids outside the vocabulary (negative or
too large), empty and wrongly shaped tensors, and Sequences changed after they were made
(tokens edited in place, a field set, or rebuilt with dataclasses.replace around bad tokens), in
one headsurgeon.errors line, before any forward pass."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import headsurgeon as hs
from headsurgeon import domains, pattern_samples
from headsurgeon.data import Sequences, to_sequences
from headsurgeon.errors import HeadsurgeonError
from headsurgeon.finetune import unmovable_heads
from headsurgeon.loading import model_info

VOCAB = 320  # conftest's tiny BLOOM
SHAPE = (2, 16)


def _ablate(model, data):
    with hs.ablate_heads(model, "L0H0", "mean", data, seq_len=16, n_seqs=2, progress=False):
        pass


def _ablate_zero(model, data):
    with hs.ablate_heads(model, "L0H0", "zero", data):
        pass


def _repair(where: str):
    def call(model, data):
        return hs.repair_heads(model, heads="L1H0", progress=False, **{where: data})

    return call


# Every public verb that takes data, called with tiny settings: (name, call(model, data)).
VERBS = [
    ("to_sequences", lambda m, d: to_sequences(m, d, seq_len=16)),
    ("perplexity", lambda m, d: hs.perplexity(m, d, progress=False)),
    ("loss_by_position", lambda m, d: hs.evals.loss_by_position(m, d, length=16, n_seqs=2)),
    ("run_census", lambda m, d: hs.run_census(m, d, seq_len=16, n_seqs=2, progress=False)),
    ("head_importance", lambda m, d: hs.head_importance(m, d, seq_len=16, progress=False)),
    ("ablate_heads", _ablate),
    ("ablate_heads zero", _ablate_zero),
    ("measure_blindness", lambda m, d: hs.measure_blindness(m, d, seq_len=16, progress=False)),
    ("precision_effect", lambda m, d: hs.precision_effect(m, d, seq_len=16, progress=False)),
    ("window_effect", lambda m, d: hs.window_effect(m, d, seq_len=16, progress=False)),
    ("sink_cache_effect", lambda m, d: hs.sink_cache_effect(m, d, seq_len=16, progress=False)),
    ("secondary_sinks", lambda m, d: hs.secondary_sinks(m, d, seq_len=16, progress=False)),
    ("compare_corpora", lambda m, d: hs.compare_corpora(m, {"a": d}, seq_len=16, progress=False)),
    ("classify_sequences", lambda m, d: domains.classify_sequences(m, d, progress=False)),
    ("finetune_heads train", lambda m, d: hs.finetune_heads(m, "L1H0", d, progress=False)),
    (
        "finetune_heads eval_data",
        lambda m, d: hs.finetune_heads(m, "L1H0", d, eval_data=d, progress=False),
    ),
    ("repair_heads corpus", _repair("corpus")),
    ("repair_heads eval_corpus", _repair("eval_corpus")),
    ("repair_heads census_data", _repair("census_data")),
    ("sample_patterns", lambda m, d: pattern_samples.sample_patterns(m, d)),
    ("attention_weights", lambda m, d: pattern_samples.attention_weights(m, d, "L0H0")),
    ("unmovable_heads", lambda m, d: unmovable_heads(m, "L1H0", d)),
    ("attention_pattern", lambda m, d: hs.plots.attention_pattern(m, d, "L0H0")),
    ("pattern_diff", lambda m, d: hs.plots.pattern_diff(m, m, d, "L0H0")),
]


# Verbs whose data is text only (a haystack): token ids of any kind are refused as not text.
TEXT_VERBS = [
    ("needle", lambda m, d: hs.needle(m, d, lengths=[32], depths=[0.5], n_trials=1)),
    ("retrieval_by_distance", lambda m, d: hs.retrieval_by_distance(m, "needle", d)),
    ("passkey", lambda m, d: hs.passkey(m, filler=d, lengths=[32], depths=[0.5], n_trials=1)),
]


def _sequences(model) -> Sequences:
    return to_sequences(model, torch.randint(0, VOCAB, SHAPE, generator=torch.Generator()))


def _one_bad_id():
    tokens = torch.zeros(SHAPE, dtype=torch.long)
    tokens[1, 5] = 10**6
    return tokens


def _edited_in_place(model, value):
    seqs = _sequences(model)
    seqs.tokens[1, 3] = value
    return seqs


def _field_set(model):
    seqs = _sequences(model)
    object.__setattr__(seqs, "source", "the bundled held-out corpora")
    return seqs


# Each bad input (name, make(model)), its message must name what is wrong.
BAD = [
    ("float tensor", lambda m: torch.rand(SHAPE), "dtype torch.float32"),
    ("float64 tensor", lambda m: torch.rand(SHAPE, dtype=torch.float64), "dtype torch.float64"),
    ("bool tensor", lambda m: torch.ones(SHAPE, dtype=torch.bool), "dtype torch.bool"),
    ("complex tensor", lambda m: torch.zeros(SHAPE, dtype=torch.complex64), "complex64"),
    ("numpy float", lambda m: np.random.rand(*SHAPE), "dtype float64"),
    ("id = d_vocab", lambda m: torch.full(SHAPE, VOCAB), f"id {VOCAB} "),
    ("negative id", lambda m: torch.full(SHAPE, -1), "id -1 "),
    ("one bad id", lambda m: _one_bad_id(), "id 1000000 (row 1, position 5)"),
    ("empty", lambda m: torch.zeros(0, 16, dtype=torch.long), "non-empty"),
    ("3-D", lambda m: torch.zeros(2, 2, 16, dtype=torch.long), "[n_seqs, seq_len]"),
    (
        "replaced: float",
        lambda m: dataclasses.replace(_sequences(m), tokens=torch.rand(SHAPE)),
        "dtype torch.float32",
    ),
    (
        "replaced: out of range",
        lambda m: dataclasses.replace(_sequences(m), tokens=torch.full(SHAPE, 10**6)),
        "id 1000000 ",
    ),
    (
        "replaced: negative",
        lambda m: dataclasses.replace(_sequences(m), tokens=-torch.ones(SHAPE, dtype=torch.long)),
        "id -1 ",
    ),
    ("edited in place: out of range", lambda m: _edited_in_place(m, VOCAB + 7), f"id {VOCAB + 7} "),
    ("edited in place: negative", lambda m: _edited_in_place(m, -5), "id -5 "),
    ("edited in place: valid id", lambda m: _edited_in_place(m, 3), "changed after they were made"),
    ("field set", _field_set, "changed after they were made"),
    (
        "replaced: a false BOS claim",
        lambda m: dataclasses.replace(_sequences(m), holds_bos=True),
        "holds_bos=True",
    ),
]


@pytest.fixture(scope="module")
def model(bloom_dir):
    model = hs.load_model(bloom_dir)

    def no_forward(*args):  # the door must refuse before any forward pass
        raise AssertionError("a forward pass ran on unchecked data")

    model.embed.register_forward_pre_hook(no_forward)
    return model


def _refusals(model, verb, expected_of) -> list[str]:
    """What went wrong when ``verb`` was fed each bad input: nothing when each was refused."""
    failures = []
    for name, make, expected in BAD:
        expected = expected_of(expected)
        try:
            verb(model, make(model))
        except HeadsurgeonError as error:
            message = str(error)
            if "\n" in message or expected not in message:
                failures.append(f"{name}: {message!r} (expected {expected!r})")
        except Exception as error:  # noqa: BLE001 (the test lists what got past the door)
            failures.append(f"{name}: {type(error).__name__}: {error}")
        else:
            failures.append(f"{name}: accepted")
    return failures


@pytest.mark.parametrize("verb", [v for _, v in VERBS], ids=[n for n, _ in VERBS])
def test_every_verb_refuses_bad_data_at_its_door_in_one_line(model, verb):
    failures = _refusals(model, verb, lambda expected: expected)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("verb", [v for _, v in TEXT_VERBS], ids=[n for n, _ in TEXT_VERBS])
def test_a_haystack_is_text_and_token_ids_are_refused_as_such(model, verb):
    failures = _refusals(model, verb, lambda expected: "a haystack is text")
    assert not failures, "\n".join(failures)


def test_good_data_still_passes_the_door(tiny_model):
    from headsurgeon.data import check_data

    info = model_info(tiny_model)
    tokens = torch.randint(0, VOCAB, SHAPE)
    assert check_data(info, tokens.int()).dtype == torch.long
    assert torch.equal(check_data(info, tokens.numpy().astype(np.int32)), tokens)
    seqs = to_sequences(tiny_model, tokens)
    assert check_data(info, seqs) is seqs
    assert hs.perplexity(tiny_model, seqs, progress=False) == pytest.approx(
        hs.perplexity(tiny_model, tokens.numpy(), progress=False)
    )
    head = seqs[:1]  # made with dataclasses.replace: still good
    assert check_data(info, head) is head
    # The edited tokens as new Sequences: the fix the refusal names.
    seqs.tokens[0, 0] = 7
    with pytest.raises(HeadsurgeonError, match="changed after they were made"):
        hs.perplexity(tiny_model, seqs, progress=False)
    assert check_data(info, to_sequences(tiny_model, seqs.tokens)).tokens[0, 0] == 7


def test_text_whose_ids_exceed_the_vocabulary_is_refused_by_every_text_verb(tiny_model):
    """A tokenizer larger than the model: every verb that tokenises text says so in one line."""
    from headsurgeon.loading import ModelShape, random_model

    small = random_model(ModelShape(n_layers=1, n_heads=2, d_model=8, d_vocab=16, n_ctx=64))
    small.headsurgeon_info = dataclasses.replace(
        small.headsurgeon_info, tokenizer=model_info(tiny_model).tokenizer
    )
    text = "Some text that the tokenizer cuts into ids far beyond sixteen. " * 8
    for verb in (
        lambda: hs.perplexity(small, text, progress=False),
        lambda: hs.evals.loss_by_position(small, text, length=16, n_seqs=1, progress=False),
        lambda: hs.needle(small, text, lengths=[32], depths=[0.5], n_trials=1),
        lambda: hs.retrieval_by_distance(small, "needle", text, distances=[0, 4], n_trials=1),
        lambda: hs.run_census(small, text, seq_len=16, progress=False),
    ):
        with pytest.raises(HeadsurgeonError, match="beyond the model's vocabulary of 16"):
            verb()
