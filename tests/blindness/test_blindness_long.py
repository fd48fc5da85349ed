"""measure_blindness on long sequences: in query blocks, skipping what is 0 in every dtype."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import make_bloom_checkpoint

import headsurgeon.blindness.analysis as blindness
from headsurgeon import load_model
from headsurgeon.blindness import ANALYSED_DTYPES, measure_blindness, mitigation
from headsurgeon.cli.blindness import main
from headsurgeon.data import as_sequences
from headsurgeon.dtypes import parse_dtype
from headsurgeon.errors import DataError, InvalidArgumentError, UnsupportedArchitectureError
from headsurgeon.loading import ModelShape, model_shape, random_model

TRAINED_LOG = Path(__file__).parents[2] / "analyses" / "mitigation_models" / "log"
COUNTS = ["layer", "head", "dtype", "distance_lo", "zero_entries"]


@pytest.fixture(scope="module")
def steep_model():
    """Two layers of 8 heads (slopes 0.5 ... 0.0039): its steepest heads are 0 in every dtype
    ~110 nats back, so whole tiles of keys are skipped."""
    return random_model(ModelShape(n_layers=2, n_heads=8, d_model=32, d_vocab=64, n_ctx=2048))


def _tokens(n_pos: int, vocab: int = 64, n_seqs: int = 1, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n_seqs, n_pos), generator=generator)


def _measure(model, tokens, **kwargs):
    n_pos = tokens.shape[1]
    return measure_blindness(model, tokens, n_buckets=n_pos, progress=False, **kwargs)


def _assert_same(blocked, dense):
    """Identical zero counts per head, dtype and distance, and per length; the same lost mass
    and largest lost weight up to the float32 rounding of the blocks' logits."""
    pd.testing.assert_frame_equal(blocked.by_distance[COUNTS], dense.by_distance[COUNTS])
    pd.testing.assert_frame_equal(blocked.by_length, dense.by_length)
    for column in ("first_zero_distance", "zero_fraction", "label"):
        pd.testing.assert_series_equal(blocked.by_head[column], dense.by_head[column])
    for table in ("by_head", "by_distance"):
        for column in ("lost_mass", "max_lost_weight"):
            got = torch.tensor(getattr(blocked, table)[column].to_numpy())
            want = torch.tensor(getattr(dense, table)[column].to_numpy())
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-30)


def _reference(model, tokens, convention: str) -> torch.Tensor:
    """Zero counts ``[dtype, layer, head, distance]`` from the dense scores and the plain
    definition: each dtype's softmax of every causal entry, nothing skipped."""
    n_pos = tokens.shape[1]
    names = [f"blocks.{layer}.attn.hook_attn_scores" for layer in range(model.cfg.n_layers)]
    _, cache = model.run_with_cache(tokens, names_filter=names)
    pos = torch.arange(n_pos)
    causal = pos[:, None] >= pos[None, :]
    distance = (pos[:, None] - pos[None, :])[causal]
    counts = torch.zeros(len(ANALYSED_DTYPES), model.cfg.n_layers, model.cfg.n_heads, n_pos)
    for layer, name in enumerate(names):
        logits = cache[name].float()
        for i, dtype in enumerate(map(parse_dtype, ANALYSED_DTYPES)):
            if convention == "hf":
                weights = torch.softmax(logits, dim=-1).to(dtype)
            else:
                weights = torch.softmax(logits.to(dtype), dim=-1)
            zeros = ((weights == 0) & causal).float().sum(0)  # [head, query, key]
            for head in range(model.cfg.n_heads):
                counts[i, layer, head].index_add_(0, distance, zeros[head][causal])
    return counts


@pytest.mark.parametrize("convention", ["hf", "tl"])
def test_counts_equal_the_plain_definition_with_tiles_skipped(steep_model, convention, monkeypatch):
    n_pos = 400
    tokens = _tokens(n_pos, n_seqs=2)
    skipped = []
    original = blindness._UnderflowCounter._skippable

    def spy(self, logits, pos):
        skipped.append(original(self, logits, pos))
        return skipped[-1]

    monkeypatch.setattr(blindness._UnderflowCounter, "_skippable", spy)
    result = _measure(steep_model, tokens, convention=convention, block_size=96)
    assert sum(skipped) > 0  # the skipped tiles are part of what is compared
    counts = torch.tensor(
        result.by_distance.sort_values(
            ["dtype", "layer", "head", "distance_lo"]
        ).zero_entries.to_numpy()
    ).reshape(3, 2, 8, n_pos)  # dtypes sorted: bfloat16, float16, float32
    reference = _reference(steep_model, tokens, convention)[[1, 2, 0]]
    assert torch.equal(counts.float(), reference)
    assert reference[:, :, 0].sum() > 0 and reference[:, :, -1].sum() < reference[:, :, 0].sum()


@pytest.mark.parametrize("convention", ["hf", "tl"])
@pytest.mark.parametrize(("kind", "params"), [(None, {}), ("log", {}), ("softcap", {"c": 30.0})])
def test_blocks_count_exactly_what_one_dense_pass_counts(steep_model, convention, kind, params):
    tokens = _tokens(320)
    with mitigation(steep_model, kind, **params) if kind else contextlib.nullcontext():
        dense = _measure(steep_model, tokens, convention=convention, block_size=320)
        blocked = _measure(steep_model, tokens, convention=convention, block_size=64)
        uneven = _measure(steep_model, tokens, convention=convention, block_size=100)
    _assert_same(blocked, dense)
    _assert_same(uneven, dense)
    assert (dense.by_head.zero_fraction.sum() > 0) == (kind != "log")  # log ALiBi: sighted here


def test_a_trained_log_alibi_model_in_blocks():
    model = load_model(TRAINED_LOG)
    assert model.cfg.n_layers * model.cfg.n_heads <= 32  # small enough for this test
    tokens = _tokens(288, vocab=model.cfg.d_vocab, seed=1)
    dense = _measure(model, tokens, block_size=288)
    _assert_same(_measure(model, tokens, block_size=64), dense)
    assert (dense.by_head.query("dtype == 'float16'").label == "blind").any()


def test_alibi_takes_sequences_past_its_nominal_context(steep_model, monkeypatch):
    n_pos = steep_model.cfg.n_ctx + 100
    result = measure_blindness(steep_model, _tokens(n_pos), dtypes=["float16"], progress=False)
    assert result.seq_len == n_pos and result.by_length.context_length.max() == n_pos
    head0 = result.by_distance.query("head == 0 and distance_lo >= 1000")
    assert (head0.zero_fraction == 1).all()  # far keys are 0 (skipped, and counted)
    asked = []

    def sequences(info, data, verb, cut, *deprecated):
        asked.append(cut.seq_len)
        return as_sequences(info, _tokens(cut.seq_len))

    monkeypatch.setattr(blindness, "verb_sequences", sequences)
    measure_blindness(steep_model, dtypes=["float16"], progress=False)
    assert asked == [1024]  # the default length, whatever the nominal context


def test_learned_positions_keep_their_context():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from headsurgeon.loading import from_hf_model

    config = GPTNeoXConfig(
        num_hidden_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=50,
        max_position_embeddings=32,
        architectures=["GPTNeoXForCausalLM"],
    )
    torch.manual_seed(0)
    model = from_hf_model(GPTNeoXForCausalLM(config).eval(), name="neox")
    with pytest.raises(DataError, match="beyond the model's context of 32"):
        measure_blindness(model, _tokens(40, vocab=50), progress=False)


def test_a_hook_that_never_fired_is_an_error_not_zeros(steep_model, monkeypatch):
    monkeypatch.setattr(blindness, "stream", lambda *args, **kwargs: None)
    with pytest.raises(UnsupportedArchitectureError, match="hook_attn_scores"):
        measure_blindness(steep_model, _tokens(64), progress=False)


@pytest.mark.parametrize(("n", "width"), [(1, 1), (1, 7), (3, 3), (4, 9), (5, 40)])
def test_shifted_rows_sum_by_distance(n, width):
    values = torch.rand(n, width, dtype=torch.float64)
    values[:, width - n :] *= blindness.alibi.causal_rows(n, n)  # 0 past each diagonal
    buffer = torch.full((n * (width + 1),), torch.nan, dtype=torch.float64)
    rows, shifted = blindness._shifted(buffer, n, width)
    rows.copy_(values)
    offset = width - n
    distance = (torch.arange(n)[:, None] + offset - torch.arange(width)[None, :]).clamp(min=0)
    expected = torch.zeros(width, dtype=torch.float64).index_add_(
        0, distance.flatten(), values.flatten()
    )
    torch.testing.assert_close(shifted.sum(0).flip(0), expected, rtol=1e-12, atol=0)


def test_cli_measures_past_the_nominal_context(tmp_path, capsys):
    folder = make_bloom_checkpoint(tmp_path / "bloom", n_heads=8, n_layers=1)
    n_pos = model_shape(folder).n_ctx + 52
    out = tmp_path / "out"
    argv = [
        folder,
        "--measure",
        "--seq-len",
        n_pos,
        "--n-seqs",
        1,
        "--dtypes",
        "float16",
        "--limit",
        "zero",
        "--out",
        out,
    ]
    assert main([str(arg) for arg in argv]) == 0
    capsys.readouterr()
    analytic = pd.read_csv(out / "blindness.csv")
    assert set(analytic.context_length) == {n_pos}  # the analytic shares reach what is measured
    assert pd.read_csv(out / "measured_by_length.csv").context_length.max() == n_pos


@pytest.mark.parametrize(("seq_len", "n_seqs"), [(None, 8), (2048, 4), (16384, 1), (100_000, 1)])
def test_cli_measures_a_fixed_budget_of_tokens_by_default(tmp_path, monkeypatch, seq_len, n_seqs):
    import headsurgeon.cli.loads as loads

    asked = []

    def load_data(model, args):
        asked.append((args.seq_len, args.n_seqs))
        raise InvalidArgumentError("stop here")

    monkeypatch.setattr(loads, "load_data", load_data)
    folder = make_bloom_checkpoint(tmp_path / "bloom", n_heads=8, n_layers=1)
    argv = [folder, "--measure", "--out", tmp_path / "out"]
    argv += [] if seq_len is None else ["--seq-len", seq_len]
    with pytest.raises(InvalidArgumentError, match="stop here"):
        main([str(arg) for arg in argv])
    assert asked == [(seq_len or 1024, n_seqs)]
