"""The same numbers on TransformerLens 3.x and 4.x: this file runs under whichever major is
installed (CI runs the suite on both) and compares with numbers recorded on 3.x.

The golden file is written by ``python tests/backend/test_backend_parity.py`` under 3.x; it holds
the census of ``organism-injured`` (16 sequences of 64 held-out tokens), its labels, and held-out
perplexities with standard ALiBi and under two mitigations, from the library's public API.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import headsurgeon as hs
from headsurgeon import backend

GOLDEN = Path(__file__).parents[1] / "golden" / "organism_injured_tl3.json"
ORGANISM = "organism-injured"
CENSUS = {"seq_len": 64, "n_seqs": 16}
PERPLEXITY = {"window": 64, "max_windows": 8}
MITIGATIONS = {"standard": {}, "log": {}, "softcap": {"c": 5.0}}


def measure() -> dict:
    """Everything the golden file holds, measured on the installed major."""
    torch.manual_seed(0)
    model = hs.load_model(ORGANISM)
    heads = hs.classify_heads(hs.run_census(model, progress=False, **CENSUS))
    ppl = {}
    for kind, params in MITIGATIONS.items():
        with hs.mitigation(model, kind, **params):
            ppl[kind] = hs.perplexity(model, progress=False, **PERPLEXITY)
    return {
        "census": heads.drop(columns=["reason"], errors="ignore").to_dict(orient="list"),
        "perplexity": ppl,
    }


@pytest.fixture(scope="module")
def measured() -> dict:
    return measure()


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def test_labels_are_identical(measured, golden):
    assert measured["census"]["label"] == golden["census"]["label"]


def test_census_metrics_agree_within_1e_5(measured, golden):
    ours, theirs = pd.DataFrame(measured["census"]), pd.DataFrame(golden["census"])
    numeric = [c for c in theirs.columns if theirs[c].dtype.kind == "f"]
    assert "bos_mass" in numeric and "output_share" in numeric
    pd.testing.assert_frame_equal(ours[numeric], theirs[numeric], rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", sorted(MITIGATIONS))
def test_perplexity_agrees_under_each_bias(measured, golden, kind):
    assert measured["perplexity"][kind] == pytest.approx(golden["perplexity"][kind], rel=1e-5)


def test_the_mitigations_change_the_numbers(measured):
    """Else the perplexity comparison above could not tell a hook that is never applied."""
    ppl = measured["perplexity"]
    assert len({round(v, 3) for v in ppl.values()}) == len(ppl)


if __name__ == "__main__":
    if backend.MAJOR != 3:
        sys.exit("record the golden numbers under TransformerLens 3.x")
    numbers = measure()
    columns = ",\n".join(
        f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in numbers["census"].items()
    )
    perplexity = json.dumps(numbers["perplexity"])
    GOLDEN.write_text(f'{{\n "census": {{\n{columns}\n }},\n "perplexity": {perplexity}\n}}\n')
    print(f"wrote {GOLDEN}")
