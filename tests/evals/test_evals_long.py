"""headsurgeon.evals on long sequences: perplexity, loss by position and continuation
log-probabilities in blocks of query rows equal the dense pass (1e-5), under a mitigation too;
ALiBi models go beyond their nominal context, models with positions keep theirs."""

from __future__ import annotations

import contextlib
import math
from itertools import pairwise

import pytest
import torch
from conftest import tl3_only
from test_evals import full_sequence_logprobs
from test_user_models import tokens, user_model

from headsurgeon import long_context
from headsurgeon.backend import MAJOR
from headsurgeon.blindness import mitigation
from headsurgeon.errors import DataError, InvalidArgumentError, UnsupportedArchitectureError
from headsurgeon.evals import loss_by_position, passkey, perplexity
from headsurgeon.evals.loss import position_edges
from headsurgeon.long_context import continuation_logprobs

MITIGATIONS = [(None, {}), ("log", {}), ("softcap", {"c": 2.0})]


def ids(n: int, length: int, seed: int = 0) -> torch.Tensor:
    """Token ids of the tiny BLOOM's vocabulary, past its special tokens."""
    return torch.randint(4, 300, (n, length), generator=torch.Generator().manual_seed(seed))


def applied(model, kind, params):
    return mitigation(model, kind, **params) if kind else contextlib.nullcontext()


def dense_nll(model, rows: torch.Tensor) -> torch.Tensor:
    """``[batch, pos - 1]`` next-token losses from one dense forward pass."""
    with torch.no_grad():
        logprobs = model(rows).float().log_softmax(-1)[:, :-1]
    return -logprobs.gather(-1, rows[:, 1:, None])[..., 0].double()


@pytest.mark.parametrize(("kind", "params"), MITIGATIONS)
def test_perplexity_in_blocks_equals_the_dense_pass(tiny_model, kind, params):
    stream = ids(1, 400, seed=1)[0]
    # Sliding windows with a BOS token: scored rows start inside a block, not at its edge.
    kwargs = dict(window=150, stride=50, prepend_bos=True, progress=False)
    with applied(tiny_model, kind, params):
        dense = perplexity(tiny_model, stream, block_size=150, **kwargs)
        blocked = perplexity(tiny_model, stream, block_size=16, **kwargs)
        rows = ids(3, 120, seed=2)
        loss = dense_nll(tiny_model, rows).mean().item()
        assert math.log(
            perplexity(tiny_model, rows, window=120, block_size=32, progress=False)
        ) == pytest.approx(loss, abs=1e-5)
    assert math.log(blocked) == pytest.approx(math.log(dense), abs=1e-5)


def test_perplexity_takes_windows_beyond_the_nominal_context_of_an_alibi_model(tiny_model):
    rows = ids(1, tiny_model.cfg.n_ctx + 100, seed=3)
    expected = dense_nll(tiny_model, rows).mean().item()
    # Default block (64 rows) against the whole window at once.
    got = perplexity(tiny_model, rows, window=rows.shape[1], progress=False)
    assert math.log(got) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize(("kind", "params"), MITIGATIONS)
@pytest.mark.parametrize("width", [0, 1, 4])
def test_continuation_logprobs_in_blocks_equal_the_dense_pass(tiny_model, kind, params, width):
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(4, 300, (150,), generator=gen)
    continuations = torch.randint(4, 300, (3, width), generator=gen)
    continuations[0, width // 2 :] = 0  # right padding
    with applied(tiny_model, kind, params):
        got = continuation_logprobs(tiny_model, prompt, continuations, block_size=16)
        expected = full_sequence_logprobs(tiny_model, prompt, continuations)
    assert got.shape == (3, width + 1, tiny_model.cfg.d_vocab)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_continuations_run_a_few_rows_at_a_time_on_one_prompt_cache(tiny_model, monkeypatch):
    prompt, continuations = ids(1, 100, seed=4)[0], ids(5, 3, seed=5)
    expected = full_sequence_logprobs(tiny_model, prompt, continuations)
    monkeypatch.setattr(long_context, "DEFAULT_BLOCK_BYTES", 1)  # one row per call
    got = continuation_logprobs(tiny_model, prompt, continuations)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_continuations_after_a_prompt_beyond_the_nominal_context(tiny_model):
    prompt, continuations = ids(1, tiny_model.cfg.n_ctx + 60, seed=6)[0], ids(2, 3, seed=7)
    with mitigation(tiny_model, "log"):
        got = continuation_logprobs(tiny_model, prompt, continuations)
        expected = full_sequence_logprobs(tiny_model, prompt, continuations)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    result = passkey(
        tiny_model,
        lengths=[tiny_model.cfg.n_ctx + 64],
        depths=[0.5],
        n_trials=1,
        n_candidates=2,
        train_ctx=128,
    )
    assert result.table.in_context.tolist() == [False]
    assert result.trials.context_length.tolist() == [tiny_model.cfg.n_ctx + 64]


def bucket_means(nll: torch.Tensor, edges: list[int]) -> list[float]:
    return [nll[:, lo:hi].mean().item() for lo, hi in pairwise(edges)]


@pytest.mark.parametrize(("kind", "params"), MITIGATIONS)
def test_loss_by_position_in_blocks_equals_the_dense_pass(tiny_model, kind, params):
    rows = ids(3, 200, seed=8)
    with applied(tiny_model, kind, params):
        curve = loss_by_position(
            tiny_model, rows, length=200, n_seqs=3, block_size=16, progress=False
        )
        nll = dense_nll(tiny_model, rows)
    if kind:  # in force: some token losses move by 10x the tolerance and more
        assert (nll - dense_nll(tiny_model, rows)).abs().max() > 1e-4
    edges = position_edges(200)
    assert curve.position_lo.tolist() == edges[:-1] and curve.position_hi.tolist() == edges[1:]
    assert curve.tokens.tolist() == [3 * (hi - lo) for lo, hi in pairwise(edges)]
    assert curve.mean_nll.tolist() == pytest.approx(bucket_means(nll, edges), abs=1e-5)
    assert curve["std"].tolist() == pytest.approx(
        [nll[:, lo:hi].std().item() for lo, hi in pairwise(edges)], abs=1e-5
    )
    per_seq = torch.stack([nll[:, lo:hi].mean(1) for lo, hi in pairwise(edges)])
    assert curve.ci95.tolist() == pytest.approx((1.96 * per_seq.std(1) / 3**0.5).tolist(), abs=1e-5)
    assert curve.perplexity.tolist() == pytest.approx(curve.mean_nll.map(math.exp).tolist())
    assert curve.attrs["n_seqs"] == 3 and curve.attrs["length"] == 200


def test_loss_by_position_beyond_the_nominal_context_with_given_buckets(tiny_model):
    length = tiny_model.cfg.n_ctx + 100
    rows = ids(1, length, seed=9)
    edges = [10, 1000, 2100, length - 1]
    curve = loss_by_position(tiny_model, rows, length=length, edges=edges, progress=False)
    assert curve.mean_nll.tolist() == pytest.approx(
        bucket_means(dense_nll(tiny_model, rows), edges), abs=1e-5
    )
    assert curve.ci95.isna().all()  # one sequence: no spread to measure
    assert curve.in_context.tolist() == [True, False, False]  # the tiny model's 2048 positions


def test_loss_by_position_cuts_texts_like_to_sequences(tiny_model):
    tiny_model.cfg.default_prepend_bos = True
    curve = loss_by_position(tiny_model, length=300, n_seqs=2, progress=False)
    assert curve.attrs["n_seqs"] == 2 and curve.attrs["prepend_bos"] is True
    assert curve.tokens.sum() == 2 * 299 and curve.position_hi.iloc[-1] == 299
    with pytest.raises(DataError, match="shorter than one sequence of 5000"):
        loss_by_position(tiny_model, "a short text " * 50, length=5000, progress=False)
    with pytest.raises(DataError, match="fewer than length 300"):
        loss_by_position(tiny_model, ids(2, 100), length=300, progress=False)


@pytest.mark.parametrize(
    ("edges", "message"), [([5], "at least two"), ([4, 2, 8], "increasing"), ([0, 400], "edges")]
)
def test_bad_buckets_are_one_line(tiny_model, edges, message):
    with pytest.raises(InvalidArgumentError, match=message):
        loss_by_position(tiny_model, ids(1, 300), length=300, edges=edges, progress=False)


def learned_position_model():
    """A model with 64 learned positions of the installed major, without a tokenizer."""
    if MAJOR < 4:
        return user_model(positional_embedding_type="standard", n_ctx=64)
    from transformer_lens.model_bridge.sources import build_bridge_from_module
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(config).eval()
    return build_bridge_from_module(hf, "GPT2LMHeadModel", hf_config=config, model_name="gpt2")


def test_models_with_learned_positions_keep_their_context():
    model = learned_position_model()
    data = tokens(2, 64)
    for call in (
        lambda: perplexity(model, data, window=65),
        lambda: loss_by_position(model, tokens(1, 80), length=65),
        lambda: passkey(model, lengths=[65]),
    ):
        with pytest.raises(InvalidArgumentError, match="beyond the model's context of 64") as e:
            call()
        assert "\n" not in str(e.value)
    # Within it, by default one dense pass (TransformerLens 4.3's GPT-2 bridge keeps no cache).
    with torch.no_grad():
        loss = model(data, return_type="loss").item()
    assert math.log(perplexity(model, data, window=64, progress=False)) == pytest.approx(loss)
    curve = loss_by_position(model, data, length=64, progress=False)
    expected = bucket_means(dense_nll(model, data), position_edges(64))
    assert curve.mean_nll.tolist() == pytest.approx(expected, abs=1e-5)
    prompt, continuations = tokens(1, 40)[0], tokens(3, 4, seed=1)
    torch.testing.assert_close(
        continuation_logprobs(model, prompt, continuations),
        full_sequence_logprobs(model, prompt, continuations),
        rtol=0,
        atol=1e-5,
    )
    if MAJOR >= 4:  # asked for blocks the bridge cannot run: one line, never a wrong number
        with pytest.raises(UnsupportedArchitectureError, match="does not keep a key-value cache"):
            continuation_logprobs(model, prompt, continuations, block_size=16)
        with pytest.raises(UnsupportedArchitectureError, match="block_size=64"):
            list(long_context.run_in_blocks(model, data, block_size=16))


@tl3_only
def test_blocks_give_the_dense_numbers_on_learned_positions():
    model = learned_position_model()
    data = tokens(2, 64)
    curve = loss_by_position(model, data, length=64, block_size=16, progress=False)
    expected = bucket_means(dense_nll(model, data), position_edges(64))
    assert curve.mean_nll.tolist() == pytest.approx(expected, abs=1e-5)
    with torch.no_grad():
        loss = model(data, return_type="loss").item()
    ppl = perplexity(model, data, window=64, block_size=16, progress=False)
    assert math.log(ppl) == pytest.approx(loss, abs=1e-5)
