"""The bundled model organisms: loadable by name, small, self-describing, and true to truth.json."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from headsurgeon import HeadSet, classify_heads, load_model, model_info, run_census
from headsurgeon.checkpoint_diff import weight_changes
from headsurgeon.loading import organism_names
from headsurgeon.model_names import ORGANISM_DIR

pytestmark = pytest.mark.skipif(
    "organism-injured" not in organism_names(),
    reason="the bundled organisms are not installed (headsurgeon/organisms/)",
)


@pytest.mark.parametrize("name", organism_names())
def test_organism_loads_by_name_and_records_its_convention(name):
    folder = ORGANISM_DIR / name
    assert (folder / "model.safetensors").stat().st_size <= 10 * 2**20
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float16"
    metadata = json.loads((folder / "headsurgeon.json").read_text())
    model = load_model(name)
    info = model_info(model)
    assert info.name == name == metadata["name"]
    assert info.prepend_bos is metadata["prepend_bos"]
    assert model.cfg.positional_embedding_type == "alibi"
    if "exported_from" not in metadata:  # trained from scratch (not derived): ships its log
        log = pd.read_csv(folder / "training_log.csv")
        assert log.step.iloc[-1] == metadata["training"]["steps"]
        assert log.max_bos_mass.iloc[-1] == pytest.approx(metadata["training"]["max_bos_mass"])


def test_injured_organism_labels_match_truth():
    truth = json.loads((ORGANISM_DIR / "organism-injured" / "truth.json").read_text())
    labels = classify_heads(run_census(load_model("organism-injured"), n_seqs=32, progress=False))
    predicted = {f"L{r.layer}H{r.head}": r.label for r in labels.itertuples()}
    assert predicted == truth["labels"]
    assert sum(label != "healthy" for label in predicted.values()) == len(truth["injuries"])


def test_planting_left_every_other_weight_identical():
    truth = json.loads((ORGANISM_DIR / "organism-injured" / "truth.json").read_text())
    planted = HeadSet.parse(",".join(i["head"] for i in truth["injuries"]))
    changes = weight_changes(truth["source"], "organism-injured", planted)
    assert changes.other_changed.sum() == 0
    assert changes.head_changed.sum() > 0
