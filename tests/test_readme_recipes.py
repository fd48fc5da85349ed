"""The docs' TransformerLens 4 recipe runs as written, and headsurgeon measures its model.

The recipe lives on the TransformerLens 3 vs 4 page of the documentation site.
"""

from __future__ import annotations

import copy
import re
import textwrap
from pathlib import Path

import pytest
import torch

import headsurgeon as hs
from headsurgeon.backend import MAJOR

PAGE = Path(__file__).resolve().parents[1] / "docs" / "transformerlens.md"


def recipe(marker: str) -> str:
    """The page's one python block that mentions ``marker``, dedented as a list item's."""
    blocks = re.findall(r"^( *)```python\n(.*?)^\1```", PAGE.read_text(), re.S | re.M)
    found = [textwrap.dedent(body) for _, body in blocks if marker in body]
    assert len(found) == 1, f"{len(found)} python blocks mention {marker}"
    return found[0]


@pytest.mark.skipif(MAJOR < 4, reason="a TransformerLens 4 recipe (bridges)")
def test_the_docs_bridge_recipe_runs_and_its_census_is_exact():
    from transformers import BloomConfig, BloomForCausalLM

    block = recipe("build_bridge_from_module")
    torch.manual_seed(0)
    config = BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4, seq_length=32)
    hf_model = BloomForCausalLM(config).eval()
    reference = copy.deepcopy(hf_model)  # the bridge takes over hf_model's modules
    namespace = {"hf_model": hf_model}
    exec(compile(block, "docs/transformerlens.md", "exec"), namespace)
    model = namespace["model"]

    tokens = torch.randint(0, 64, (3, 24), generator=torch.Generator().manual_seed(1))
    census = hs.run_census(model, tokens, progress=False)
    assert len(census) == 2 * 4 and census.attrs["seq_len"] == 24
    # Brute force: transformers' eager attention weights, BOS mass over query rows t >= 1.
    reference.config._attn_implementation = "eager"
    with torch.no_grad():
        attentions = reference(tokens, output_attentions=True).attentions
    bos_mass = torch.stack([a[:, :, 1:, 0].mean(dim=(0, 2)) for a in attentions])
    measured = torch.tensor(census.sort_values(["layer", "head"]).bos_mass.to_numpy())
    torch.testing.assert_close(measured, bos_mass.flatten().double(), atol=1e-6, rtol=0)
