"""A model spread over CPU memory and disk with Accelerate gives the single-device numbers."""

from __future__ import annotations

import gc
from pathlib import Path

import pandas as pd
import pytest
import torch

import headsurgeon as hs
from headsurgeon.backend import MAJOR
from headsurgeon.cli.classify import main as classify_main
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.finetune import finetune
from headsurgeon.placement import check_placement
from tests.conftest import error_line


def split_map(n_layers: int) -> dict[str, str]:
    """Every other block on disk, the rest in memory, in the installed major's module names."""
    if MAJOR >= 4:
        ends = {
            "transformer.word_embeddings": "cpu",
            "transformer.ln_f": "cpu",
            "lm_head": "cpu",
            "transformer.word_embeddings_layernorm": "cpu",
        }
        block = "transformer.h.{}"
    else:
        ends = {"embed": "cpu", "pos_embed": "cpu", "ln_final": "cpu", "unembed": "cpu"}
        block = "blocks.{}"
    return ends | {block.format(i): "disk" if i % 2 else "cpu" for i in range(n_layers)}


@pytest.fixture(scope="module")
def whole(bloom_dir):
    return hs.load_model(bloom_dir)


def numbers(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.select_dtypes("number")


@pytest.mark.parametrize("how", ["split", "all on disk"])
def test_census_blindness_importance_identical(bloom_dir, whole, tmp_path, how):
    placement = (
        {"device_map": split_map(whole.cfg.n_layers)}
        if how == "split"
        else {"max_memory": {"cpu": 1000}}  # nothing fits: every weight goes to disk
    )
    model = hs.load_model(bloom_dir, offload_folder=tmp_path, **placement)
    assert hs.backend.offloaded(model), "nothing was offloaded: the test would prove nothing"
    tokens = torch.randint(
        0, whole.cfg.d_vocab, (3, 40), generator=torch.Generator().manual_seed(0)
    )
    split = hs.run_census(model, tokens, progress=False)
    pd.testing.assert_frame_equal(
        numbers(split), numbers(hs.run_census(whole, tokens, progress=False))
    )
    measured = hs.measure_blindness(model, tokens, dtypes=["float16"], progress=False).by_head
    reference = hs.measure_blindness(whole, tokens, dtypes=["float16"], progress=False).by_head
    pd.testing.assert_frame_equal(numbers(measured), numbers(reference))
    importance = [
        numbers(hs.head_importance(m, tokens, n_seqs=3, seq_len=40, progress=False))
        for m in (model, whole)
    ]
    pd.testing.assert_frame_equal(*importance)
    assert hs.perplexity(model, tokens, progress=False) == hs.perplexity(
        whole, tokens, progress=False
    )


def test_a_budget_the_whole_model_fits_gives_the_same_census(bloom_dir, whole):
    model = hs.load_model(bloom_dir, max_memory={"cpu": "1GiB"})
    assert not hs.backend.offloaded(model)
    tokens = torch.randint(
        0, whole.cfg.d_vocab, (2, 24), generator=torch.Generator().manual_seed(2)
    )
    census = [numbers(hs.run_census(m, tokens, progress=False)) for m in (model, whole)]
    pd.testing.assert_frame_equal(*census)


def test_offload_folder_keeps_the_users_files(bloom_dir, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    model = hs.load_model(bloom_dir, device_map=split_map(2), offload_folder=tmp_path)
    private = [p for p in tmp_path.iterdir() if p.name != "notes.txt"]
    assert len(private) == 1 and private[0].name.startswith("headsurgeon-offload-")
    del model
    gc.collect()
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_tools_that_change_weights_refuse_offloaded_models(bloom_dir, tmp_path):
    model = hs.load_model(bloom_dir, device_map=split_map(2), offload_folder=tmp_path)
    for call in (
        lambda: hs.reinit_heads(model, "L1H0"),
        lambda: hs.save_hf(model, tmp_path / "export"),
        lambda: finetune(model, "L1H0", torch.zeros(2, 16, dtype=torch.long)),
    ):
        with pytest.raises(
            InvalidArgumentError, match="offloaded to CPU or disk by its device_map"
        ):
            call()
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("auto", None, None, "cpu"), "pass device or device_map, not both"),
        (("fast", None, None, None), "device_map='fast': use one of auto"),
        (({}, None, None, None), "non-empty"),
        (({"blocks.0": "gpu"}, None, None, None), "unknown device 'gpu'"),
        ((None, {"cpu": "lots"}, None, None), "not a memory size"),
        ((None, {"cpu": -1}, None, None), "not a memory size"),
        ((None, {"disk": "1GiB"}, None, None), "disk takes what is left"),
        ((None, None, "/tmp", None), "offload_folder is used only with"),
    ],
)
def test_bad_placement_is_one_line(args, message):
    with pytest.raises(InvalidArgumentError, match=message):
        check_placement(*args)


def test_placement_parses_sizes_and_devices():
    placement = check_placement(
        {"a": "cuda:1", "b": "1", "c": "Disk"}, {0: "1KiB", 1: "1000", "cpu": 5}, None, None
    )
    assert placement.device_map == {"a": 1, "b": 1, "c": "disk"}
    assert placement.max_memory == {0: 1024, 1: 1000, "cpu": 5}  # "1000" as --max-memory gives it


def test_offload_folder_that_is_a_file(bloom_dir, tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(InvalidArgumentError, match="is a file"):
        hs.load_model(bloom_dir, device_map="auto", offload_folder=tmp_path / "f")
    assert (tmp_path / "f").read_text() == "x"


def test_unknown_or_missing_module_names_leave_nothing_behind(bloom_dir, tmp_path):
    other, ours = ("blocks.0", "transformer.h.0") if MAJOR >= 4 else ("transformer.h.0", "blocks.0")
    with pytest.raises(InvalidArgumentError, match=f"names '{other}', not a module"):
        hs.load_model(bloom_dir, device_map={other: "cpu"}, offload_folder=tmp_path)
    with pytest.raises(InvalidArgumentError, match="places no device for"):
        hs.load_model(bloom_dir, device_map={ours: "cpu"}, offload_folder=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_cli_flags(bloom_dir, tmp_path, capsys):
    out = tmp_path / "out"
    common = [bloom_dir, "--n-seqs", 2, "--seq-len", 32, "--out", out]
    line = error_line(classify_main, [*common, "--max-memory", "cpu"], capsys)
    assert "--max-memory" in line and "DEVICE=SIZE" in line
    line = error_line(classify_main, [*common, "--max-memory", "cpu=lots"], capsys)
    assert "not a memory size" in line
    line = error_line(classify_main, [*common, "--device", "cpu", "--device-map", "auto"], capsys)
    assert "not both" in line
    assert not out.exists()
    spread = ",".join(f"{k}={v}" for k, v in split_map(2).items())
    argv = [*common, "--device-map", spread, "--offload-folder", tmp_path / "off"]
    assert classify_main([str(a) for a in argv]) == 0
    assert classify_main([str(a) for a in [*common[:-2], "--out", tmp_path / "one"]]) == 0
    split, one = (pd.read_csv(p / "heads.csv") for p in (out, tmp_path / "one"))
    pd.testing.assert_frame_equal(numbers(split), numbers(one))
    gc.collect()  # the run's model, whose private offload folder goes with it
    assert list((tmp_path / "off").iterdir()) == []


def test_an_offload_folder_in_the_output_or_an_input_is_refused_before_loading(
    bloom_dir, tmp_path, no_model, capsys
):
    """The offload copy would be written into the report folder, or into the model folder or
    beside a text file the run reads: one line before any model is loaded."""
    from headsurgeon.cli.repair import main as repair_main

    out = tmp_path / "out"
    cases = [
        (out, "is the output folder"),
        (out / "offload", "lies inside the output folder"),
        (bloom_dir, "is the input"),
        (bloom_dir / "offload", "lies inside the input"),
    ]
    for main in (classify_main, repair_main):
        for folder, message in cases:
            argv = [bloom_dir, "--out", out, "--device-map", "auto", "--offload-folder", folder]
            line = error_line(main, argv, capsys)
            assert message in line and "give a folder of its own" in line, line
    assert list(tmp_path.iterdir()) == [] and not (bloom_dir / "offload").exists()


def test_load_model_refuses_an_offload_folder_in_the_model_folder(bloom_dir):
    for folder in (bloom_dir, bloom_dir / "offload"):
        with pytest.raises(InvalidArgumentError, match="the model folder"):
            hs.load_model(bloom_dir, device_map="auto", offload_folder=folder)
    assert not (bloom_dir / "offload").exists()


def test_offload_folders_killed_runs_left_are_removed_by_the_next_run(bloom_dir, tmp_path, caplog):
    """A private folder whose owner file is unlocked (its run was killed: locks die with their
    process) is removed, in one line; a live run's, and anything without the owner file, stay."""
    import fcntl
    import os

    owner_file = ".headsurgeon-offload.lock"  # the owner file a private folder holds

    def private(name: str, owner: bool) -> Path:
        folder = tmp_path / f"headsurgeon-offload-{name}"
        folder.mkdir()
        (folder / "blocks.1.attn.W_Q.dat").write_bytes(b"\0" * 1000)
        if owner:
            (folder / owner_file).write_bytes(b"")
        return folder

    killed, live, users = private("killed", True), private("live", True), private("mine", False)
    held = os.open(live / owner_file, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running tool holds it
    try:
        with caplog.at_level("INFO", logger="headsurgeon.placement"):
            model = hs.load_model(bloom_dir, device_map=split_map(2), offload_folder=tmp_path)
    finally:
        os.close(held)
    assert not killed.exists() and live.exists() and users.exists()
    lines = [r.getMessage() for r in caplog.records if "left by killed runs" in r.getMessage()]
    assert lines == [f"removed 1 offload folder(s) in {tmp_path} left by killed runs (0.0 MB)"]
    del model
    gc.collect()
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, users.name]


def placed_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of a placed model, offloaded ones read back, on the CPU."""
    weights = {}
    for prefix, module in model.named_modules():
        with hs.backend.resident(module, recurse=False):
            for name, weight in module.named_parameters(prefix, recurse=False):
                weights[name] = weight.detach().cpu().clone()
    return weights


@pytest.mark.skipif(MAJOR >= 4, reason="4.x reads the checkpoint into the placement itself")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_placed_3x_bloom_is_built_part_by_part_with_the_same_weights(
    bloom_dir, tmp_path, monkeypatch, dtype
):
    import transformers
    from transformer_lens import HookedTransformer

    reference = hs.load_model(bloom_dir, dtype=dtype)
    expected = reference.state_dict()

    def whole(*args, **kwargs):
        raise AssertionError("the whole model was built")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", whole)
    monkeypatch.setattr(HookedTransformer, "load_and_process_state_dict", whole)
    model = hs.load_model(bloom_dir, dtype=dtype, device_map=split_map(2), offload_folder=tmp_path)
    assert hs.backend.offloaded(model)
    weights = placed_weights(model)
    assert weights.keys() == {k for k, _ in reference.named_parameters()}
    for name, weight in weights.items():
        assert weight.dtype == expected[name].dtype, name
        assert weight.stride() == expected[name].stride(), name
        assert torch.equal(weight, expected[name]), name
    tokens = torch.randint(
        0, model.cfg.d_vocab, (2, 24), generator=torch.Generator().manual_seed(3)
    )
    assert torch.equal(model(tokens), reference(tokens))


@pytest.mark.skipif(MAJOR >= 4, reason="4.x reads the checkpoint into the placement itself")
def test_a_placed_3x_load_that_cannot_be_bounded_says_so_first(bloom_dir, tmp_path, caplog):
    import shutil

    from safetensors.torch import load_file

    folder = shutil.copytree(bloom_dir, tmp_path / "legacy")
    weights = load_file(folder / "model.safetensors")
    torch.save(weights, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    with caplog.at_level("WARNING", logger="headsurgeon.loading.loaders"):
        model = hs.load_model(folder, max_memory={"cpu": 1000}, offload_folder=tmp_path / "off")
    said = [r.getMessage() for r in caplog.records if "TransformerLens 4.x" in r.getMessage()]
    assert said and "legacy .bin weights whole" in said[0] and "full size" in said[0]
    assert hs.backend.offloaded(model)
