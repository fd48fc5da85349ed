"""Checkpoint layouts weight_changes compares: bigscience's published BLOOM layout (BloomModel's
names, no lm_head), pickled and sharded folders, against headsurgeon's own exports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from headsurgeon import HeadSet, load_model, reinit_heads, save_hf
from headsurgeon.checkpoint_diff import weight_changes
from headsurgeon.errors import CheckpointError

HEADS = HeadSet([(0, 1), (1, 2)])
LAYOUTS = ("safetensors", "safetensors-sharded", "bin", "bin-sharded")
N_SHARDS = 3


def published(source: Path, folder: Path, layout: str) -> Path:
    """``source``'s weights as bigscience publishes BLOOM: BloomModel's names, no lm_head."""
    folder.mkdir()
    for file in source.iterdir():  # config.json (BloomForCausalLM) and the tokenizer
        if file.suffix != ".safetensors":
            shutil.copy(file, folder / file.name)
    if layout == "safetensors-sharded":  # what transformers itself writes for a large BloomModel
        from transformers import BloomForCausalLM

        BloomForCausalLM.from_pretrained(source).transformer.save_pretrained(
            folder, max_shard_size="40KB"
        )
        shutil.copy(source / "config.json", folder / "config.json")
        assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1
        return folder
    state = {
        name.removeprefix("transformer."): tensor
        for name, tensor in load_file(source / "model.safetensors").items()
        if name != "lm_head.weight"
    }
    if layout == "safetensors":
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    elif layout == "bin":
        torch.save(state, folder / "pytorch_model.bin")
    else:  # transformers 5 writes no pickles: shards as transformers 4 named them
        names = sorted(state)
        weight_map = {}
        for i in range(N_SHARDS):
            shard = f"pytorch_model-{i + 1:05d}-of-{N_SHARDS:05d}.bin"
            torch.save({name: state[name] for name in names[i::N_SHARDS]}, folder / shard)
            weight_map |= dict.fromkeys(names[i::N_SHARDS], shard)
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return folder


@pytest.fixture(scope="module")
def layouts(bloom_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    return {layout: published(bloom_dir, root / layout, layout) for layout in LAYOUTS}


def changed(table) -> set[str]:
    return set(table.loc[table.head_changed + table.other_changed > 0, "tensor"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_published_checkpoint_compares_with_its_repairs_export(
    layout, layouts, bloom_dir, tmp_path
):
    folder = layouts[layout]
    # The same weights under either key scheme and in any file layout: nothing changed.
    same = weight_changes(bloom_dir, folder, HEADS)
    assert len(same) == 29 and changed(same) == set()
    assert same.tensor.str.startswith("transformer.").all()

    model = load_model(folder)
    reinit_heads(model, HEADS, seed=1)
    export = save_hf(model, tmp_path / "export")  # BloomForCausalLM's names, transformer.-prefixed
    assert next(iter(load_file(export / "model.safetensors"))).startswith("transformer.")
    touched = {
        f"transformer.h.{layer}.self_attention.{name}"
        for layer in (0, 1)
        for name in ("query_key_value.weight", "query_key_value.bias", "dense.weight")
    }
    for table in (weight_changes(folder, export, HEADS), weight_changes(export, folder, HEADS)):
        assert len(table) == 29 and table.other_changed.sum() == 0
        assert changed(table) == touched  # every other tensor bit-identical
    # Without the heads the same changes count as "other".
    table = weight_changes(folder, export)
    assert changed(table) == touched and table.head_changed.sum() == 0


def test_a_tied_lm_head_reads_as_the_embeddings_and_names_are_one_scheme():
    embeddings = torch.randn(8, 4)
    prefixed = {"transformer.word_embeddings.weight": embeddings, "lm_head.weight": embeddings}
    bare = {"word_embeddings.weight": embeddings.clone()}  # bigscience's: no lm_head (tied)
    table = weight_changes(bare, prefixed).set_index("tensor")
    assert list(table.index) == ["transformer.word_embeddings.weight", "lm_head.weight"]
    assert table.other_changed.sum() == 0
    untied = dict(prefixed, **{"lm_head.weight": embeddings + 1})
    table = weight_changes(untied, bare).set_index("tensor")
    assert table.other_changed.to_dict() == {
        "transformer.word_embeddings.weight": 0,
        "lm_head.weight": 32,
    }


def test_layouts_that_cannot_be_compared_are_refused_in_one_line(layouts, bloom_dir, tmp_path):
    bare = {"h.0.self_attention.dense.bias": torch.zeros(4)}
    both = dict(bare, **{"transformer.h.0.self_attention.dense.bias": torch.zeros(4)})
    with pytest.raises(CheckpointError, match="first checkpoint holds both .* two layouts"):
        weight_changes(both, bare)
    extra = dict(bare, **{"h.0.self_attention.dense.weight": torch.zeros(4, 4)})
    with pytest.raises(CheckpointError, match="the first checkpoint lacks 1 tensor.*dense.weight"):
        weight_changes(bare, extra)

    shards = Path(shutil.copytree(layouts["bin-sharded"], tmp_path / "shards"))
    (shards / f"pytorch_model-00002-of-{N_SHARDS:05d}.bin").unlink()
    with pytest.raises(CheckpointError, match="lacks the shard pytorch_model-00002-of-00003.bin"):
        weight_changes(shards, bloom_dir)
    stale = Path(shutil.copytree(layouts["safetensors"], tmp_path / "stale"))
    shutil.copy(stale / "model.safetensors", stale / "model.old.safetensors")
    with pytest.raises(CheckpointError, match="is stored in model.safetensors and in another"):
        weight_changes(bloom_dir, stale)
    moved = Path(shutil.copytree(layouts["safetensors-sharded"], tmp_path / "moved"))
    index = json.loads((moved / "model.safetensors.index.json").read_text())
    index["weight_map"]["ln_f.weight_renamed"] = index["weight_map"].pop("ln_f.weight")
    (moved / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="and its shards disagree on 2 weight"):
        weight_changes(moved, bloom_dir)
