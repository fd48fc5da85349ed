"""One head's attention on a text: exact against transformers' eager attention, any head form,
one-line errors, max-pooling that keeps exact weights, long sequences through the block path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import head_weight

from headsurgeon import load_model, plots
from headsurgeon.data import encode
from headsurgeon.errors import HeadsurgeonError, InvalidArgumentError
from headsurgeon.loading import ModelShape, model_info, organism_names, random_model
from headsurgeon.model_names import ORGANISM_DIR
from headsurgeon.pattern_samples import attention_weights

needs_organisms = pytest.mark.skipif(
    "organism" not in organism_names(), reason="the bundled organisms are not installed"
)
TEXT = "To be, or not to be"


@pytest.fixture(scope="module")
def organism():
    return load_model("organism")


@pytest.fixture(scope="module")
def eager_attentions(organism):
    """transformers' own eager attention weights of the organism on TEXT, every layer."""
    from transformers import BloomForCausalLM

    hf = BloomForCausalLM.from_pretrained(
        ORGANISM_DIR / "organism", attn_implementation="eager", dtype=torch.float32
    ).eval()
    tokens = encode(model_info(organism), TEXT)
    with torch.no_grad():
        return tokens, [a[0] for a in hf(tokens, output_attentions=True).attentions]


@needs_organisms
def test_weights_equal_transformers_eager_attention(organism, eager_attentions):
    tokens, attentions = eager_attentions
    w = attention_weights(organism, tokens, "L0-3H0-15")
    assert w.step == 1 and w.weights.shape == (64, tokens.shape[1], tokens.shape[1])
    for i, (layer, head) in enumerate(w.heads):
        np.testing.assert_allclose(w.weights[i], attentions[layer][head].numpy(), atol=1e-6, rtol=0)


@needs_organisms
def test_the_figure_shows_those_weights_for_every_head_form(organism, eager_attentions):
    tokens, attentions = eager_attentions
    expected = attentions[1][7].numpy()
    for heads in ("L1H7", (1, 7), [(1, 7)], {1: [7]}):
        fig = plots.attention_pattern(organism, TEXT, heads)
        z = np.asarray(fig.data[0].z, dtype=float)
        lower = np.tril(np.ones_like(expected, dtype=bool))
        np.testing.assert_allclose(z[lower], expected[lower], atol=1e-6, rtol=0)
        assert np.isnan(z[~lower]).all()  # future keys left blank
        assert "L1H7" in fig.layout.annotations[0].text
    assert list(fig.data[0].x[:2]) == ["0 To", "1 ·be"]  # tokens label the axes
    assert "query %{y} → key %{x}" in fig.data[0].hovertemplate  # hover: the token pair


@needs_organisms
def test_several_heads_facets_and_the_census_label(organism):
    census = __import__("pandas").DataFrame({"layer": [1], "head": [7], "label": ["BOS-sink"]})
    fig = plots.attention_pattern(organism, TEXT, "L1H7,L2H3", census=census)
    titles = [a.text for a in fig.layout.annotations]
    assert titles[0].startswith("L1H7 · BOS-sink · slope") and titles[1].startswith("L2H3 · slope")
    assert len([t for t in fig.data if t.type == "heatmap"]) == 2


@needs_organisms
def test_a_bos_token_in_the_title_is_text_not_markup():
    model = load_model("organism-injured")  # its BOS token "<s>" stands at position 0
    fig = plots.attention_pattern(model, "To be", "L1H7")
    assert fig.layout.title.text.startswith("Attention on “&lt;s&gt;To be")  # "<s>" struck it out


def test_bad_heads_and_inputs_are_one_line_errors():
    model = random_model(ModelShape(n_layers=2, n_heads=4, d_model=32, d_vocab=64, n_ctx=16))
    cases = {
        "L9H0": "out of range",
        (1, 9): "out of range",
        "L1X7": "cannot read head",
        5: "heads must be",
        "": "no heads",
    }
    for heads, message in cases.items():
        with pytest.raises(InvalidArgumentError, match=message) as info:
            plots.attention_pattern(model, [1, 2, 3], heads)
        assert "\n" not in str(info.value)
    with pytest.raises(InvalidArgumentError, match="model"):
        plots.attention_pattern(None, [1, 2, 3], "L0H0")
    with pytest.raises(InvalidArgumentError, match="text"):
        plots.attention_pattern(model, 3.5, "L0H0")
    with pytest.raises(HeadsurgeonError):
        plots.attention_pattern(model, torch.zeros(2, 5, dtype=torch.long), "L0H0")


def test_pooling_keeps_exact_weights_and_where_they_are():
    model = random_model(ModelShape(n_layers=2, n_heads=4, d_model=32, d_vocab=64, n_ctx=16))
    tokens = torch.randint(0, 64, (1, 300), generator=torch.Generator().manual_seed(0))
    full = attention_weights(model, tokens, "L1H0-1", block_size=64)
    pooled = attention_weights(model, tokens, "L1H0-1", max_cells=37, block_size=64)
    step = pooled.step
    assert step == 9 and pooled.weights.shape == (2, 34, 34)
    for i in range(2):
        for r, c in np.ndindex(pooled.weights.shape[1:]):
            cell = full.weights[i, r * step : (r + 1) * step, c * step : (c + 1) * step]
            assert pooled.weights[i, r, c] == cell.max()
            q, k = pooled.query[i, r, c], pooled.key[i, r, c]
            assert full.weights[i, q, k] == pooled.weights[i, r, c]  # the exact weight, located
    fig = plots.attention_pattern(model, tokens, "L1H0", max_cells=37, block_size=64)
    assert "largest weight of a 9×9 cell" in fig.data[0].hovertemplate
    assert "max-pooled" in fig.layout.title.subtitle.text
    custom = np.asarray(fig.data[0].customdata)
    assert np.asarray(fig.data[0].z)[3, 1] == pooled.weights[0, 3, 1]  # hover: the exact weight
    assert tuple(custom[3, 1]) == (pooled.query[0, 3, 1], pooled.key[0, 3, 1])  # and where


def test_blocks_agree_with_the_dense_pass_and_nothing_stays_on_the_model():
    model = random_model(ModelShape(n_layers=2, n_heads=4, d_model=32, d_vocab=64, n_ctx=16))
    tokens = torch.randint(0, 64, (1, 200), generator=torch.Generator().manual_seed(1))
    dense = attention_weights(model, tokens, "L0H0,L1H3", block_size=200)
    blocked = attention_weights(model, tokens, "L0H0,L1H3", block_size=32)
    np.testing.assert_allclose(blocked.weights, dense.weights, atol=1e-5, rtol=0)
    hooks = [h for _, point in model.hook_dict.items() for h in point._forward_hooks.values()]
    assert not hooks


def test_pattern_diff_shows_before_after_and_the_change():
    import copy

    model = random_model(ModelShape(n_layers=2, n_heads=4, d_model=32, d_vocab=64, n_ctx=16))
    after = copy.deepcopy(model)
    with torch.no_grad():
        head_weight(after, 1, "W_Q")[2] *= 3  # a changed head (the live weights on either major)
    fig = plots.pattern_diff(model, after, [3, 1, 4, 1, 5, 9], "L1H2")
    z = [np.nan_to_num(np.asarray(t.z, dtype=float)) for t in fig.data]
    assert len(z) == 3
    np.testing.assert_allclose(z[2], z[1] - z[0], atol=1e-7)
    both = np.asarray(fig.data[2].customdata)  # hover on the change: both weights
    np.testing.assert_allclose(np.tril(both[..., 0]), z[0], atol=1e-7)
    assert [a.text for a in fig.layout.annotations][:3] == [
        "L1H2 before",
        "L1H2 after",
        "L1H2 after − before",
    ]
