"""The exact attention path in query blocks (``headsurgeon.long_context``) and the census on it:
the same numbers as the dense pass, any length for ALiBi, hooks that see one block at a time."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import tl3_only
from test_user_models import own_model, tokens, user_model

from headsurgeon import load_model, run_census
from headsurgeon.backend.forward import run_to_layer
from headsurgeon.blindness import mitigation
from headsurgeon.data import check_length, to_sequences
from headsurgeon.errors import DataError, InvalidArgumentError, UnsupportedArchitectureError
from headsurgeon.loading import model_info
from headsurgeon.long_context import block_size, query_offset, run_in_blocks
from headsurgeon.probes import HeadStats, pattern_stats, stream

NUMERIC = [
    "bos_mass",
    "bos_mass_std",
    "sink_score",
    "entropy",
    "max_weight",
    "mean_distance",
    "self_mass",
    "prev_mass",
    "output_norm",
    "output_share",
    "reach",
]


def assert_same_census(blocked: pd.DataFrame, dense: pd.DataFrame) -> None:
    """Census columns within 1e-6 (relative for the large ones, such as distances in tokens)."""
    for column in NUMERIC:
        np.testing.assert_allclose(
            blocked[column], dense[column], rtol=1e-6, atol=1e-6, err_msg=column
        )


def test_blocks_give_the_dense_residual_stream(tiny_model):
    ids = tokens(2, 70)
    with torch.no_grad():
        dense = run_to_layer(tiny_model, ids, tiny_model.cfg.n_layers)
        parts = list(run_in_blocks(tiny_model, ids, block_size=32))
    assert [offset for offset, _ in parts] == [0, 32, 64]
    torch.testing.assert_close(torch.cat([r for _, r in parts], 1), dense, rtol=0, atol=1e-5)


def test_a_pass_from_a_later_layer_needs_chosen_keys_and_its_inputs(tiny_model):
    with pytest.raises(InvalidArgumentError, match="start_at_layer > 0 needs keys and resid_pre"):
        next(run_in_blocks(tiny_model, tokens(1, 20), block_size=8, start_at_layer=1))


@pytest.mark.parametrize("min_query_pos", [0, 1, 40])
def test_the_census_in_blocks_equals_the_dense_census(tiny_model, min_query_pos):
    ids = tokens(5, 100)
    # Blocks of 32 rows: min_query_pos 40 starts inside the second block.
    kwargs = dict(batch_size=2, min_query_pos=min_query_pos, progress=False)
    dense = run_census(tiny_model, ids, block_size=100, **kwargs)
    blocked = run_census(tiny_model, ids, block_size=32, **kwargs)
    assert_same_census(blocked, dense)


@pytest.mark.parametrize(
    "kind, params", [("log", {}), ("clamped", {"c": 1.0}), ("softcap", {"c": 5.0})]
)
def test_the_census_in_blocks_equals_the_dense_census_under_a_mitigation(tiny_model, kind, params):
    ids = tokens(3, 90)
    with mitigation(tiny_model, kind, **params):
        dense = run_census(tiny_model, ids, block_size=90, progress=False)
        blocked = run_census(tiny_model, ids, block_size=32, progress=False)
    assert_same_census(blocked, dense)
    plain = run_census(tiny_model, ids, block_size=32, progress=False)
    assert not np.allclose(plain["entropy"], blocked["entropy"])  # the mitigation was in force


def test_the_census_in_blocks_equals_the_dense_census_on_a_trained_variant():
    model = load_model("analyses/mitigation_models/log")  # trained with log-scaled distances
    ids = tokens(1, 300)
    dense = run_census(model, ids, block_size=300, progress=False)
    blocked = run_census(model, ids, block_size=64, progress=False)
    assert_same_census(blocked, dense)


def test_a_users_own_model_without_our_bias_hook_gives_the_same_census_in_blocks():
    model = own_model()  # TransformerLens's or Hugging Face's own ALiBi, not our pre-hook
    ids = tokens(2, 80)
    dense = run_census(model, ids, block_size=80, progress=False)
    blocked = run_census(model, ids, block_size=32, progress=False)
    assert_same_census(blocked, dense)


def test_alibi_models_take_sequences_beyond_their_nominal_context(tiny_model, caplog):
    n_pos = tiny_model.cfg.n_ctx + 50
    census = run_census(tiny_model, tokens(1, n_pos), progress=False)
    assert census.attrs["seq_len"] == n_pos
    assert check_length(model_info(tiny_model), 10**6) == 10**6
    # The automatic block: the whole of a short sequence, 64 rows, fewer when memory is short.
    assert block_size(tiny_model, 40) == 40
    assert block_size(tiny_model, 512) == 64
    assert block_size(tiny_model, 65_536, budget=2**24) == 16


@tl3_only
def test_models_with_learned_positions_keep_their_context():
    model = user_model(positional_embedding_type="standard", n_ctx=64)
    with pytest.raises(DataError, match="beyond the model's context of 64"):
        run_census(model, tokens(1, 65), progress=False)
    with pytest.raises(DataError, match="seq_len 65 is beyond the model's context of 64"):
        to_sequences(model, "some text", seq_len=65)
    with pytest.raises(InvalidArgumentError, match="beyond the model's context of 64"):
        check_length(model_info(model), 65)
    # Within the context, blocks give the dense numbers on learned positions too.
    ids = tokens(2, 64)
    assert_same_census(
        run_census(model, ids, block_size=16, progress=False),
        run_census(model, ids, block_size=64, progress=False),
    )


def test_a_users_hook_sees_one_block_of_rows_at_a_time(tiny_model):
    ids = tokens(1, 70)
    dense, blocks = [], []

    def keep(into):
        return lambda pattern, hook: into.append(pattern.detach().clone())

    name = "blocks.1.attn.hook_pattern"
    stream(tiny_model, ids, [(name, keep(dense))], block_size=70, progress=False)
    stream(tiny_model, ids, [(name, keep(blocks))], block_size=32, progress=False)
    assert [tuple(b.shape[-2:]) for b in blocks] == [(32, 32), (32, 64), (6, 70)]
    assert [query_offset(b) for b in blocks] == [0, 32, 64]
    for block in blocks:
        offset, n_rows, n_keys = query_offset(block), *block.shape[-2:]
        expected = dense[0][..., offset : offset + n_rows, :n_keys]
        torch.testing.assert_close(block, expected, rtol=0, atol=1e-6)
        # pattern_stats of a block are the means over its own rows.
        torch.testing.assert_close(pattern_stats(block, 0), pattern_stats(expected, 0))


def test_head_stats_refuses_blocks_out_of_order(tiny_model):
    stats = HeadStats(tiny_model)
    pattern, z, out = (f for _, f in stats.hooks()[:3])  # layer 0's, in HEAD_HOOKS order

    class Point:
        def layer(self):
            return 0

    def block(weights):  # all three hooks of layer 0 for one block of 8 rows
        pattern(weights, Point())
        z(torch.ones(1, 8, 4, 8), Point())
        out(torch.ones(1, 8, 32), Point())

    block(torch.full((1, 4, 8, 8), 1 / 8).tril())
    with pytest.raises(RuntimeError, match="got query rows from 16, expected 8"):
        block(torch.full((1, 4, 8, 24), 1 / 24))


def test_a_census_hook_without_its_pattern_hook_is_an_error_not_zeros(tiny_model):
    stats = HeadStats(tiny_model)
    no_pattern = [(n, f) for n, f in stats.hooks() if not n.endswith("hook_pattern")]
    stream(tiny_model, tokens(1, 8), no_pattern, progress=False)
    with pytest.raises(UnsupportedArchitectureError, match="blocks.0.attn.hook_pattern never"):
        stats.check_fired(1)
    # A second batch shows it at once: the z of the first still waits for its pattern.
    with pytest.raises(UnsupportedArchitectureError, match="hook_pattern never fired in layer 0"):
        stream(tiny_model, tokens(2, 8), no_pattern, batch_size=1, progress=False)
