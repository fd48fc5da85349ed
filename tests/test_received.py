"""Received mass and secondary sinks: against transformers' eager attention (a tiny BLOOM and the
organism), planted sinks with a known first layer and lifetime, streaming and blocks, the cap."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from test_attention_pattern import needs_organisms

from headsurgeon import load_model, run_census, secondary_sinks
from headsurgeon.data import to_sequences, token_strings
from headsurgeon.errors import DataError, InvalidArgumentError, UnsupportedArchitectureError
from headsurgeon.loading import ModelShape, model_info, random_model
from headsurgeon.model_names import ORGANISM_DIR
from headsurgeon.probes import stream
from headsurgeon.received import SINK_COLUMNS, ReceivedMass, received_sums

TEXT = (
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the "
    "slings and arrows of outrageous fortune, or to take arms against a sea of troubles. "
) * 12


def eager_attentions(folder, tokens) -> np.ndarray:
    """``[layer, seq, head, query, key]`` float64: transformers' own eager attention weights."""
    from transformers import BloomForCausalLM

    hf = BloomForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        attentions = hf.eval()(tokens, output_attentions=True).attentions
    return np.stack([a.double().numpy() for a in attentions])


def reference_received(A: np.ndarray) -> np.ndarray:
    """``[layer, seq, head, key]``: the mean of A[t, k] over t > k, position by position."""
    n_pos = A.shape[-1]
    received = np.full(A.shape[:-1], np.nan)
    for k in range(n_pos - 1):
        received[..., k] = A[..., k + 1 :, k].mean(-1)
    return received


def reference_sinks(model, tokens, A, threshold, min_queries) -> pd.DataFrame:
    """The sink list by its definition, one position and layer at a time."""
    received = reference_received(A)
    n_layers, n_seqs, _, n_pos = received.shape
    rows = []
    for seq in range(n_seqs):
        for k in range(1, n_pos):
            if n_pos - 1 - k < min_queries:
                continue
            best = [received[layer, seq, :, k].max() for layer in range(n_layers)]
            above = [b > threshold for b in best]
            if not any(above):
                continue
            first = above.index(True)
            end = first
            while end < n_layers and above[end]:
                end += 1
            peak = max(range(first, end), key=lambda layer: best[layer])
            rows.append(
                {
                    "seq": seq,
                    "position": k,
                    "token": token_strings(model_info(model), tokens[seq])[k],
                    "first_layer": first,
                    "last_layer": end - 1,
                    "n_layers": end - first,
                    "layers_above": sum(above),
                    "peak_received": best[peak],
                    "peak_layer": peak,
                    "peak_head": int(received[peak, seq, :, k].argmax()),
                }
            )
    return pd.DataFrame(rows, columns=list(SINK_COLUMNS))


def assert_same_sinks(got: pd.DataFrame, expected: pd.DataFrame) -> None:
    assert list(got.columns) == list(SINK_COLUMNS)
    pd.testing.assert_frame_equal(
        got.drop(columns="peak_received"),
        expected.drop(columns="peak_received"),
        check_dtype=False,
    )
    np.testing.assert_allclose(got["peak_received"], expected["peak_received"], rtol=1e-5)


def assert_matches(found, model, tokens, A, threshold, min_queries) -> None:
    received = reference_received(A)
    expected = received.mean(1).ravel()  # [layer, head, key], mean over sequences
    np.testing.assert_allclose(found.received["received"], expected, rtol=1e-5, atol=1e-7)
    examples = received.transpose(1, 0, 2, 3)[: len(found.examples)]
    np.testing.assert_allclose(found.examples, examples, rtol=1e-5, atol=1e-7)
    assert_same_sinks(found.sinks, reference_sinks(model, tokens, A, threshold, min_queries))


def test_received_mass_and_sinks_equal_transformers_eager_attention(bloom_dir, tiny_model):
    tokens = to_sequences(tiny_model, TEXT, seq_len=40, n_seqs=5).tokens
    # A random BLOOM's heads are diffuse (largest received mass ~0.08): a low threshold gives
    # the list something to hold.
    found = secondary_sinks(
        tiny_model, tokens, threshold=0.06, min_queries=8, batch_size=2, progress=False
    )
    A = eager_attentions(bloom_dir, tokens)
    assert_matches(found, tiny_model, tokens, A, 0.06, 8)
    assert len(found.sinks) > 3
    # Position 0's received mass is the census's BOS mass; the layer table sums the heads.
    census = run_census(tiny_model, tokens, progress=False)
    at_zero = found.received[found.received["position"] == 0]
    np.testing.assert_allclose(at_zero["received"], census["bos_mass"], rtol=1e-6)
    summed = found.received.groupby(["layer", "position"])["received"].sum(min_count=1)
    np.testing.assert_allclose(found.by_layer["received"], summed.to_numpy(), rtol=1e-12)
    assert found.received.attrs["threshold"] == 0.06 and found.sinks.attrs["n_found"] == len(
        found.sinks
    )


@needs_organisms
def test_the_organism_equals_transformers_eager_attention():
    model = load_model("organism")
    tokens = to_sequences(model, None, seq_len=128, n_seqs=6).tokens
    found = secondary_sinks(model, tokens, progress=False)
    A = eager_attentions(ORGANISM_DIR / "organism", tokens)
    assert_matches(found, model, tokens, A, 0.3, 16)
    assert len(found.sinks) >= 5  # line breaks, in layer 3 mostly
    assert found.sinks.attrs["truncated"] is False


def plant(positions_by_layer: dict[int, list[int]]):
    """Forward hooks that make every head of a layer attend to given key positions: +40 on their
    attention scores (masked cells stay -inf, so only later queries see it)."""

    def hook(scores, hook):
        for position in positions_by_layer[hook.layer()]:
            if position < scores.shape[-1]:  # a block of the first rows has fewer keys
                scores[..., position] += 40.0
        return scores

    return [(f"blocks.{layer}.attn.hook_attn_scores", hook) for layer in positions_by_layer]


@pytest.mark.parametrize("block_size", [None, 9])
def test_planted_sinks_are_found_with_their_first_layer_and_lifetime(block_size):
    model = random_model(ModelShape(n_layers=5, n_heads=4, d_model=32, d_vocab=64, n_ctx=64))
    tokens = torch.randint(0, 64, (3, 48), generator=torch.Generator().manual_seed(0))
    # Position 10: layers 1-2. Position 20: layer 0, gone in 1, back in 3-4.
    planted = plant({0: [20], 1: [10], 2: [10], 3: [20], 4: [20]})
    with model.hooks(fwd_hooks=planted):
        found = secondary_sinks(model, tokens, block_size=block_size, progress=False)
    sinks = found.sinks.set_index(["seq", "position"])
    assert sorted(sinks.index) == [(s, p) for s in range(3) for p in (10, 20)]
    ten, twenty = sinks.xs(10, level="position"), sinks.xs(20, level="position")
    assert (ten["first_layer"] == 1).all() and (ten["last_layer"] == 2).all()
    assert (ten["n_layers"] == 2).all() and (ten["layers_above"] == 2).all()
    assert (twenty["first_layer"] == 0).all() and (twenty["n_layers"] == 1).all()
    assert (twenty["layers_above"] == 3).all() and (twenty["peak_layer"] == 0).all()
    assert (sinks["peak_received"] > 0.99).all()
    received = found.received.set_index(["layer", "head", "position"])["received"]
    assert (received.xs((1, 10), level=("layer", "position")) > 0.99).all()
    assert (received.xs((1, 20), level=("layer", "position")) < 0.5).all()
    assert not model.hook_dict["blocks.0.attn.hook_pattern"].fwd_hooks  # nothing left behind


def test_batches_and_blocks_give_the_same_numbers(tiny_model):
    tokens = to_sequences(tiny_model, TEXT, seq_len=40, n_seqs=9).tokens
    kwargs = {"threshold": 0.06, "min_queries": 8, "progress": False}
    one = secondary_sinks(tiny_model, tokens, batch_size=1, **kwargs)
    eight = secondary_sinks(tiny_model, tokens, batch_size=8, **kwargs)
    blocks = secondary_sinks(tiny_model, tokens, batch_size=4, block_size=7, **kwargs)
    for other, rtol in ((eight, 1e-12), (blocks, 1e-6)):
        np.testing.assert_allclose(other.received["received"], one.received["received"], rtol=rtol)
        np.testing.assert_allclose(other.examples, one.examples, rtol=rtol)
        assert_same_sinks(other.sinks, one.sinks)


def test_the_list_is_capped_at_the_largest_peaks(tiny_model):
    tokens = to_sequences(tiny_model, TEXT, seq_len=40, n_seqs=6).tokens
    kwargs = {"threshold": 0.06, "min_queries": 8, "batch_size": 2, "progress": False}
    everything = secondary_sinks(tiny_model, tokens, **kwargs).sinks
    capped = secondary_sinks(tiny_model, tokens, max_sinks=3, **kwargs).sinks
    assert len(everything) > 3 and len(capped) == 3
    largest = everything.nlargest(3, "peak_received").sort_values(["seq", "position"])
    assert_same_sinks(capped.reset_index(drop=True), largest.reset_index(drop=True))
    assert capped.attrs["n_found"] == len(everything) and capped.attrs["truncated"] is True


def test_blocks_of_rows_add_up_to_the_dense_sums():
    pattern = torch.rand(2, 3, 30, 30).tril()
    pattern /= pattern.sum(-1, keepdim=True)
    dense = received_sums(pattern)
    pad = torch.nn.functional.pad
    blocks = sum(
        pad(received_sums(pattern[..., r : r + 8, : r + 8]), (0, max(22 - r, 0)))
        for r in range(0, 30, 8)
    )
    torch.testing.assert_close(blocks, dense, rtol=0, atol=1e-6)
    expected = torch.stack([pattern[..., k + 1 :, k].double().sum(-1) for k in range(30)], -1)
    torch.testing.assert_close(dense, expected, rtol=0, atol=1e-6)


def test_a_silent_layer_and_bad_arguments_are_refused(tiny_model):
    mass = ReceivedMass(tiny_model, 12)
    stream(tiny_model, torch.randint(0, 300, (2, 12)), mass.hooks()[:1], progress=False)
    with pytest.raises(UnsupportedArchitectureError, match="hook_pattern never fired in layer 1"):
        mass.check_fired()
    tokens = torch.randint(0, 300, (2, 12))
    with pytest.raises(InvalidArgumentError, match="threshold"):
        secondary_sinks(tiny_model, tokens, threshold=1.5, progress=False)
    with pytest.raises(InvalidArgumentError, match="max_sinks"):
        secondary_sinks(tiny_model, tokens, max_sinks=-1, progress=False)
    with pytest.raises(DataError, match="no later queries"):
        secondary_sinks(tiny_model, tokens[:, :1], progress=False)


def test_the_classify_tool_writes_the_sinks_and_a_strip_under_each_pattern(
    bloom_dir, tmp_path, capsys
):
    from test_report_page import page_data

    from headsurgeon.cli.classify import main
    from headsurgeon.reports import PAGE_POSITIONS

    texts = tmp_path / "text.txt"
    texts.write_text(TEXT)
    argv = [*map(str, [bloom_dir, "--texts", texts, "--seq-len", "64", "--n-seqs", "4"])]
    assert main([*argv, "--received-threshold", "0.05", "--out", str(tmp_path / "a")]) == 0
    summary = capsys.readouterr().out
    model = load_model(bloom_dir)
    tokens = to_sequences(model, [texts], seq_len=64, n_seqs=4).tokens
    direct = secondary_sinks(model, tokens, threshold=0.05, progress=False)
    written = pd.read_csv(tmp_path / "a" / "secondary_sinks.csv", keep_default_na=False)
    assert len(written) > 0 and "secondary sinks: " in summary
    assert_same_sinks(written, direct.sinks)
    received = pd.read_csv(tmp_path / "a" / "received.csv")
    np.testing.assert_allclose(received["received"], direct.received["received"], rtol=1e-9)
    # The page: per stage, sequence and head (layer-major), the first positions' received mass.
    strips = page_data(tmp_path / "a")["received"]
    assert len(strips) == 1 and len(strips[0]) == 2 and len(strips[0][1]) == 8
    shown = np.array(strips[0][1][6], dtype=float)  # sequence 2, L1H2
    np.testing.assert_allclose(shown, direct.examples[1, 1, 2, :PAGE_POSITIONS], rtol=5e-3)
    # Skipped on request: no files, no strips.
    assert main([*argv, "--no-secondary-sinks", "--out", str(tmp_path / "b")]) == 0
    assert "secondary sinks" not in capsys.readouterr().out
    assert not (tmp_path / "b" / "secondary_sinks.csv").exists()
    assert page_data(tmp_path / "b")["received"] == [[]]


@pytest.mark.slow
@needs_organisms
@pytest.mark.skipif("not __import__('headsurgeon').plots.has_browser()")
def test_the_strip_is_drawn_under_the_clicked_heads_pattern(tmp_path):
    from headsurgeon.cli.classify import main
    from headsurgeon.reports import PAGE, open_page

    assert main(["organism", "--n-seqs", "4", "--out", str(tmp_path / "out")]) == 0
    view = open_page(tmp_path / "out" / PAGE, "L3H1")
    assert view.errors == [] and view.shown == "L3H1"
    model = load_model("organism")
    direct = secondary_sinks(model, to_sequences(model, None, seq_len=128, n_seqs=4).tokens)
    np.testing.assert_allclose(
        np.array(view.received, dtype=float), direct.examples[0, 3, 1, :48], rtol=5e-3
    )


def test_the_tool_refuses_what_it_cannot_measure_before_loading(no_model, tmp_path, capsys):
    from conftest import error_line

    from headsurgeon.cli.classify import main

    out = ["--out", tmp_path / "x"]
    line = error_line(main, ["organism", "--seq-len", "1", "--min-query-pos", "0", *out], capsys)
    assert "secondary sinks need --seq-len 2 or more" in line
    line = error_line(main, ["organism", "--received-threshold", "2", *out], capsys)
    assert "--received-threshold" in line
