"""Loading, exact ALiBi, Hugging Face export and bad input.

Modules: headsurgeon.loading, headsurgeon.dtypes, headsurgeon.exact_alibi, headsurgeon.checkpoints.
"""

from __future__ import annotations

import http.server
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from headsurgeon import alibi, backend, load_model, model_info, model_shape, save_hf
from headsurgeon.backend.weights import head_tensors, tl_state_dict
from headsurgeon.dtypes import parse_device, parse_dtype
from headsurgeon.errors import (
    CheckpointError,
    InvalidArgumentError,
    ModelNotFoundError,
    OutputExistsError,
    UnknownModelError,
    UnsupportedArchitectureError,
)
from headsurgeon.loading import BLOOM_SHAPES
from headsurgeon.loading.sources import download_command
from headsurgeon.outputs import MARK_FILE, mark_folder

ATOL = 1e-4


@pytest.fixture()
def no_network(monkeypatch):
    """Fail any attempt to open a network connection."""

    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


def hf_model(directory):
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def tokens(n_seqs: int, n_pos: int, d_vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, d_vocab, (n_seqs, n_pos), generator=torch.Generator().manual_seed(seed))


def max_logit_gap(model, hf, toks) -> float:
    with torch.no_grad():
        return (model(toks) - hf(toks).logits).abs().max().item()


def exact_scores(model, toks, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hook_attn_scores, and q.k/sqrt(d) - m_h (i - j) with Hugging Face slopes, masked."""
    names = [f"blocks.{layer}.attn.hook_{x}" for x in ("q", "k", "attn_scores")]
    _, cache = model.run_with_cache(toks, names_filter=names)
    q, k = cache[f"blocks.{layer}.attn.hook_q"], cache[f"blocks.{layer}.attn.hook_k"]
    n_pos = toks.shape[1]
    expected = torch.einsum("bqhd,bkhd->bhqk", q, k) / model.cfg.d_head**0.5
    expected = expected + alibi.alibi_bias(alibi.slopes(model.cfg.n_heads), n_pos)
    # Masked scores are -inf on TransformerLens 3.x, the float minimum on 4.x: compare the rest.
    causal = alibi.causal_rows(n_pos, n_pos)
    scores = cache[f"blocks.{layer}.attn.hook_attn_scores"]
    assert (scores[..., ~causal] < -1e30).all()
    return scores[..., causal], expected[..., causal]


# --- loading and exact ALiBi ---------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["bloom_dir", "bloom6_dir"])
def test_logits_equal_transformers(fixture, request, no_network):
    directory = request.getfixturevalue(fixture)
    model = load_model(directory)
    assert model_info(model).source == directory
    assert model_info(model).prepend_bos is False
    hf = hf_model(directory)
    assert max_logit_gap(model, hf, tokens(2, 40, model.cfg.d_vocab)) < ATOL
    # The weights are the checkpoint's own: no folding or centring.
    assert torch.equal(model.blocks[0].ln1.w, hf.transformer.h[0].input_layernorm.weight)
    assert torch.equal(model.embed.W_E, hf.transformer.word_embeddings.weight)


def test_six_heads_need_the_exact_bias(bloom6_dir):
    model = load_model(bloom6_dir)
    hf = hf_model(bloom6_dir)
    toks = tokens(2, 40, model.cfg.d_vocab)
    scores, expected = exact_scores(model, toks, layer=1)
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-5)
    model.reset_hooks()  # TransformerLens's hook reset must not remove the exact bias
    assert max_logit_gap(model, hf, toks) < ATOL

    # Without the pre-hook the attention's own bias is used: TransformerLens 3.x's power-of-two
    # slopes, wrong for 6 heads; 4.x's is Hugging Face's (absolute key positions, -m j: each
    # score row moves by a constant, which softmax ignores).
    for block in model.blocks:
        block.attn.headsurgeon_alibi_hook.remove()
    scores, expected = exact_scores(model, toks, layer=1)
    assert (scores - expected).abs().max() > 0.1
    if backend.MAJOR >= 4:
        assert max_logit_gap(model, hf, toks) < ATOL
    else:
        assert max_logit_gap(model, hf, toks) > 10 * ATOL


def test_exact_bias_follows_every_sequence_length(bloom6_dir):
    model = load_model(bloom6_dir)
    hf = hf_model(bloom6_dir)
    for n_pos in (8, 150, 30, 70):  # longer, then shorter, than an earlier call
        toks = tokens(1, n_pos, model.cfg.d_vocab, seed=n_pos)
        assert max_logit_gap(model, hf, toks) < ATOL, n_pos
        scores, expected = exact_scores(model, toks, layer=0)
        torch.testing.assert_close(scores, expected, rtol=0, atol=1e-5)
    # Split per-head inputs give the attention [batch, pos, head, d_model] tensors.
    model.set_use_split_qkv_input(True)
    assert max_logit_gap(model, hf, tokens(1, 90, model.cfg.d_vocab)) < ATOL


def test_kv_cache_generation_matches_transformers(bloom6_dir):
    model = load_model(bloom6_dir)
    hf = hf_model(bloom6_dir)
    prompt = tokens(1, 12, model.cfg.d_vocab)
    ours = model.generate(
        prompt,
        max_new_tokens=24,
        do_sample=False,
        use_past_kv_cache=True,
        stop_at_eos=False,
        verbose=False,
    )
    theirs = hf.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=24,
        min_new_tokens=24,
        do_sample=False,
        pad_token_id=0,
    )
    assert torch.equal(ours, theirs)
    assert max_logit_gap(model, hf, ours) < ATOL  # no stale bias left behind by the cache


# --- export --------------------------------------------------------------------------------


def test_round_trip_is_bit_exact(bloom6_dir, tmp_path, no_network):
    model = load_model(bloom6_dir)
    out = save_hf(model, tmp_path / "export")
    assert sorted(p.name for p in out.glob("*.bin")) == []
    # The exported tensors are the original checkpoint's, bit for bit.
    original, exported = (
        load_file(bloom6_dir / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    assert original.keys() == exported.keys()
    for key, value in original.items():
        assert torch.equal(value, exported[key]), key
    again = load_model(out)
    assert again.state_dict().keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
    assert model_info(again).prepend_bos is False
    assert (out / "tokenizer.json").read_bytes() == (bloom6_dir / "tokenizer.json").read_bytes()


def test_edited_heads_export_to_transformers(bloom6_dir, tmp_path):
    model = load_model(bloom6_dir)
    toks = tokens(2, 30, model.cfg.d_vocab)
    before = model(toks)
    with torch.no_grad():
        model.blocks[0].attn.W_O[2] = 0
        model.blocks[1].attn.W_Q[4] *= 3.0
        model.blocks[1].attn.b_V[1] += 0.5
    after = model(toks)
    assert (after - before).abs().max() > 1e-3  # the edit matters
    out = save_hf(model, tmp_path / "edited")
    hf = hf_model(out)
    with torch.no_grad():
        assert (hf(toks).logits - after).abs().max() < ATOL
    d_head = model.cfg.d_head
    dense = hf.transformer.h[0].self_attention.dense.weight
    assert torch.equal(dense[:, 2 * d_head : 3 * d_head], torch.zeros(model.cfg.d_model, d_head))
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True


def test_head_edits_export_bit_exact(bloom6_dir, tmp_path):
    model = load_model(bloom6_dir)
    toks = tokens(2, 30, model.cfg.d_vocab)
    with torch.no_grad():
        for layer in range(model.cfg.n_layers):
            for tensor in head_tensors(model, layer).values():
                heads = tensor.heads(tensor.param)
                heads[layer + 1].mul_(-1.5).add_(0.25)  # every per-head tensor, one head a layer
        edited = model(toks)
    out = save_hf(model, tmp_path / "edited", dtype="float32")
    with torch.no_grad():
        assert (hf_model(out)(toks).logits - edited).abs().max() < ATOL
    again = load_model(out)
    ours, theirs = tl_state_dict(model), tl_state_dict(again)
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    with torch.no_grad():
        assert torch.equal(again(toks), edited)


def test_untied_unembedding_exports_lm_head(bloom_dir, tmp_path):
    folder = shutil.copytree(bloom_dir, tmp_path / "untied")
    weights = load_file(folder / "model.safetensors")
    embed = weights["transformer.word_embeddings.weight"]
    weights["lm_head.weight"] = embed + 0.01 * torch.randn(embed.shape)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    model = load_model(folder)
    toks = tokens(2, 20, model.cfg.d_vocab)
    assert max_logit_gap(model, hf_model(folder), toks) < ATOL
    out = save_hf(model, tmp_path / "out")
    exported = load_file(out / "model.safetensors")  # bit for bit, lm_head included
    assert exported.keys() == weights.keys()
    assert all(torch.equal(t, weights[k]) for k, t in exported.items())
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert max_logit_gap(load_model(out), hf_model(out), toks) < ATOL


def test_editing_the_unembedding_of_a_tied_model(bloom_dir, tmp_path):
    model = load_model(bloom_dir)
    with torch.no_grad():
        model.unembed.W_U.add_(0.01 * torch.randn_like(model.unembed.W_U))
    out = save_hf(model, tmp_path / "edited")
    # TransformerLens 3.x copies W_U out of the tied embedding: the edit unties them. 4.x keeps
    # Hugging Face's tying (W_U is a view of W_E's memory): the edit changes both, still tied.
    untied = backend.MAJOR < 4
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is not untied
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert ("lm_head.weight" in f.keys()) is untied
        assert torch.equal(
            f.get_tensor("lm_head.weight" if untied else "transformer.word_embeddings.weight"),
            model.unembed.W_U.T,
        )
    toks = tokens(2, 20, model.cfg.d_vocab)
    assert max_logit_gap(model, hf_model(out), toks) < ATOL


def test_save_hf_refuses_replaces_and_never_half_writes(tiny_model, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(OutputExistsError, match="overwrite"):
        save_hf(tiny_model, out)
    with pytest.raises(OutputExistsError, match="did not write: keep.txt"):
        save_hf(tiny_model, out, overwrite=True)  # not ours to replace
    mark_folder(out, "test")  # an earlier output of ours, which overwrite may replace
    assert sorted(p.name for p in out.iterdir()) == [MARK_FILE, "keep.txt"]

    def broken_writer(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", broken_writer)
    with pytest.raises(OSError, match="disk full"):
        save_hf(tiny_model, out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left
    assert (out / "keep.txt").read_text() == "old"
    with pytest.raises(OSError, match="disk full"):
        save_hf(tiny_model, tmp_path / "new")
    assert not (tmp_path / "new").exists()

    monkeypatch.undo()
    save_hf(tiny_model, out, overwrite=True)
    assert not (out / "keep.txt").exists()
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_save_hf_refuses_processed_weights(bloom_dir, tmp_path):
    model = load_model(bloom_dir)
    # TransformerLens 3.x's name; 4.x's bridge calls it process_weights.
    process = getattr(model, "process_weights_", None) or model.process_weights
    process(fold_ln=True, center_writing_weights=False, center_unembed=False)
    with pytest.raises(UnsupportedArchitectureError, match="load_model"):
        save_hf(model, tmp_path / "folded")
    assert not (tmp_path / "folded").exists()


# --- shapes without weights ----------------------------------------------------------------


def test_bloom_shapes_by_name_without_network(no_network, bloom6_dir, tiny_model):
    assert set(BLOOM_SHAPES) == {
        "bloom-560m",
        "bloom-1b1",
        "bloom-1b7",
        "bloom-3b",
        "bloom-7b1",
        "bloom-176b",
    }
    heads = {name: model_shape(name).n_heads for name in BLOOM_SHAPES}
    assert heads == {
        "bloom-560m": 16,
        "bloom-1b1": 16,
        "bloom-1b7": 16,
        "bloom-3b": 32,
        "bloom-7b1": 32,
        "bloom-176b": 112,
    }
    assert model_shape("bloom-560m").n_layers == 24 and model_shape("bloom-560m").d_model == 1024
    assert model_shape("bloom-7b1").d_model == 4096 and model_shape("bloom-3b").n_layers == 30
    assert model_shape("bigscience/bloom-1b7") == BLOOM_SHAPES["bloom-1b7"]
    assert model_shape("bigscience/bloom") == model_shape("BLOOM-176B")
    assert model_shape("bloom-176b").n_layers == 70 and model_shape("bloom-176b").d_model == 14336
    assert model_shape(bloom6_dir).n_heads == 6
    assert model_shape(tiny_model) == model_shape(model_info(tiny_model).source)
    with pytest.raises(UnknownModelError, match="bloom-560m"):
        model_shape("bloom-560")


# --- bad input -----------------------------------------------------------------------------


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and message
    return message


def test_unknown_model_name_suggests_close_names():
    with pytest.raises(UnknownModelError) as error:
        load_model("blom-560m")
    assert "bloom-560m" in one_line(error)


@pytest.mark.parametrize("name", ["./no-such-folder", "/no/such/folder"])
def test_missing_folder(name):
    with pytest.raises(ModelNotFoundError) as error:
        load_model(name)
    assert "does not exist" in one_line(error)


def test_missing_folder_as_path(tmp_path):
    with pytest.raises(ModelNotFoundError):
        load_model(tmp_path / "gone")


@pytest.fixture()
def broken_copy(bloom_dir, tmp_path):
    """A fresh copy of the 4-head checkpoint to damage."""
    return shutil.copytree(bloom_dir, tmp_path / "ckpt")


def test_folder_without_config(broken_copy):
    (broken_copy / "config.json").unlink()
    with pytest.raises(CheckpointError) as error:
        load_model(broken_copy)
    assert "config.json" in one_line(error)


def test_folder_without_weights(broken_copy):
    (broken_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as error:
        load_model(broken_copy)
    assert "no weights" in one_line(error)


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: raw[: len(raw) // 2],  # truncated
        lambda raw: b"\xff" * 8 + raw[8:],  # header length garbage
        lambda raw: raw[:8] + b"{not json" + raw[17:],  # header garbage
        lambda raw: b"",
    ],
    ids=["truncated", "length", "header", "empty"],
)
def test_corrupt_safetensors(broken_copy, damage):
    weights = broken_copy / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(CheckpointError) as error:
        load_model(broken_copy)
    assert "model.safetensors is not a valid safetensors file" in one_line(error)


def test_missing_tensor_is_not_silently_reinitialised(broken_copy):
    weights = load_file(broken_copy / "model.safetensors")
    del weights["transformer.h.1.self_attention.dense.weight"]
    save_file(weights, str(broken_copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as error:
        load_model(broken_copy)
    assert "transformer.h.1.self_attention.dense.weight" in one_line(error)


@pytest.fixture()
def legacy_copy(broken_copy):
    """The checkpoint with its weights as a legacy ``pytorch_model.bin`` instead of safetensors."""
    weights = load_file(broken_copy / "model.safetensors")
    (broken_copy / "model.safetensors").unlink()
    torch.save(weights, broken_copy / "pytorch_model.bin")
    return broken_copy


def test_legacy_bin_weights_load(legacy_copy, bloom_dir):
    reference = load_model(bloom_dir)
    model = load_model(legacy_copy)
    assert torch.equal(model.W_Q, reference.W_Q)


@pytest.mark.parametrize(
    "damage",
    [lambda raw: raw[: len(raw) // 2], lambda raw: b"garbage", lambda raw: b""],
    ids=["truncated", "garbage", "empty"],
)
def test_corrupt_legacy_bin(legacy_copy, damage):
    weights = legacy_copy / "pytorch_model.bin"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(CheckpointError) as error:
        load_model(legacy_copy)
    assert str(legacy_copy) in one_line(error)


@pytest.mark.parametrize(
    ("file", "text"),
    [
        ("tokenizer.json", "{not json"),
        ("tokenizer.json", ""),
        ("tokenizer.json", '{"model": {"type": "NoSuchModel"}}'),
        ("tokenizer_config.json", "{oops"),
    ],
    ids=["garbage", "empty", "bad-model", "config-garbage"],
)
def test_unreadable_tokenizer(broken_copy, file, text):
    (broken_copy / file).write_text(text)
    with pytest.raises(CheckpointError) as error:
        load_model(broken_copy)
    assert f"the tokenizer files in {broken_copy} are unreadable" in one_line(error)


def test_unreadable_config_names_the_users_file(broken_copy):
    (broken_copy / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError) as error:
        load_model(broken_copy)
    assert one_line(error).startswith(f"{broken_copy / 'config.json'} is not readable JSON")


@pytest.mark.parametrize(
    "changes",
    [
        # transformers knows it, TransformerLens 3.x and 4.x do not
        {"architectures": ["CTRLLMHeadModel"], "model_type": "ctrl"},
        {"architectures": ["FooForCausalLM"], "model_type": "foo"},  # nobody knows it
        {"architectures": None},
    ],
    ids=["ctrl", "unknown", "none"],
)
def test_architecture_transformer_lens_cannot_load(broken_copy, changes):
    config = json.loads((broken_copy / "config.json").read_text())
    (broken_copy / "config.json").write_text(json.dumps(config | changes))
    with pytest.raises(UnsupportedArchitectureError) as error:
        load_model(broken_copy)
    assert "not supported by TransformerLens" in one_line(error)
    assert "headsurgeon loads BLOOM" in one_line(error)
    assert f"TransformerLens {backend.MAJOR}.x" in one_line(error)


def test_folder_name_does_not_decide_the_architecture(bloom_dir, tmp_path):
    # TransformerLens takes any path containing "llama" for a Llama checkpoint.
    folder = shutil.copytree(bloom_dir, tmp_path / "llama-runs" / "bloom")
    model = load_model(folder)
    assert max_logit_gap(model, hf_model(folder), tokens(2, 20, model.cfg.d_vocab)) < ATOL


@pytest.mark.parametrize("dtype", ["float8", "int8", torch.int64, "fp64"])
def test_unknown_dtype(dtype, bloom_dir):
    with pytest.raises(InvalidArgumentError) as error:
        load_model(bloom_dir, dtype=dtype)
    assert "dtype" in one_line(error)


@pytest.mark.parametrize("device", ["gpu0", "cuda:x", "tpu", "meta"])
def test_unknown_device(device, bloom_dir):
    with pytest.raises(InvalidArgumentError) as error:
        load_model(bloom_dir, device=device)
    assert "device" in one_line(error)


def test_valid_dtype_and_device_names():
    assert parse_dtype("bf16") is parse_dtype(torch.bfloat16) is torch.bfloat16
    assert parse_dtype("FLOAT32") is torch.float32
    assert parse_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgumentError, match="CUDA is not available"):
            parse_device("cuda")


# --- the hub path --------------------------------------------------------------------------


@pytest.fixture()
def empty_hub(monkeypatch, tmp_path):
    """An empty Hugging Face cache; the hub constants are read at import, so patch them."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return constants


def test_offline_and_not_cached_fails_at_once(empty_hub, monkeypatch, no_network):
    monkeypatch.setattr(empty_hub, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError) as error:  # no_network: no download tried
        load_model("bloom-560m")
    message = one_line(error)
    assert "bigscience/bloom-560m" in message and "HF_HUB_OFFLINE" in message
    assert "local checkpoint folder" in message
    assert download_command("bigscience/bloom-560m") in message


@pytest.mark.slow  # subprocesses
def test_the_suggested_download_command_runs_in_this_environment(tmp_path):
    """The advice names a program the installed huggingface_hub provides, with options it takes:
    its --help works, and the command itself (dry run, offline) fails on the network, not on
    its usage."""
    command = shlex.split(download_command("bigscience/bloom-560m"))
    program = Path(sys.executable).parent / command[0]
    assert program.is_file(), f"{command[0]} is not installed beside {sys.executable}"
    helped = subprocess.run([program, command[1], "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "--include" in helped.stdout
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    dry = subprocess.run(
        [program, *command[1:], "--dry-run"], capture_output=True, text=True, env=env, timeout=60
    )
    assert "No such option" not in dry.stderr and "Usage:" not in dry.stderr, dry.stderr


def test_cached_model_loads_offline(empty_hub, monkeypatch, no_network, bloom_dir):
    monkeypatch.setattr(empty_hub, "HF_HUB_OFFLINE", True)
    # The cache layout: refs/main names the commit whose snapshot folder holds the files.
    repo = Path(empty_hub.HF_HUB_CACHE) / "models--bigscience--bloom-560m"
    commit = "0" * 40
    shutil.copytree(bloom_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    model = load_model("bigscience/bloom-560m")
    assert model.cfg.n_heads == 4
    assert model_info(model).source.name == commit


def test_unreachable_hub_fails_fast(empty_hub, monkeypatch):
    monkeypatch.setattr(empty_hub, "ENDPOINT", "http://127.0.0.1:9")  # closed port
    start = time.perf_counter()
    with pytest.raises(ModelNotFoundError) as error:
        load_model("bloom-560m")
    assert time.perf_counter() - start < 3
    assert "cannot be reached" in one_line(error)


def test_silent_hub_fails_within_seconds(empty_hub, monkeypatch):
    listener = socket.create_server(("127.0.0.1", 0))  # accepts connections, never answers
    try:
        monkeypatch.setattr(empty_hub, "ENDPOINT", f"http://127.0.0.1:{listener.getsockname()[1]}")
        start = time.perf_counter()
        with pytest.raises(ModelNotFoundError, match="cannot be reached"):
            load_model("bloom-560m")
        assert time.perf_counter() - start < 3.5
    finally:
        listener.close()


def test_failed_download_is_one_clear_error(empty_hub, monkeypatch):
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802 (http.server's naming)
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_HEAD  # noqa: N815

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(empty_hub, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        with pytest.raises(ModelNotFoundError) as error:
            load_model("bloom-560m")
        assert "downloading bigscience/bloom-560m failed" in one_line(error)
    finally:
        server.shutdown()


def test_weight_changes_finds_every_change_and_only_attributes_head_slices(tiny_model, tmp_path):
    from headsurgeon import HeadSet, reinit_heads
    from headsurgeon.checkpoint_diff import weight_changes

    heads = HeadSet.parse("L1H2")
    reinit_heads(tiny_model, heads, seed=3)
    edited = save_hf(tiny_model, tmp_path / "edited")
    with torch.no_grad():
        tiny_model.blocks[0].attn.b_O[5] += 1.0  # shared by all heads: outside any head's slices
    stray = save_hf(tiny_model, tmp_path / "stray")

    table = weight_changes(edited, edited, heads)
    assert table.head_changed.sum() == table.other_changed.sum() == 0
    d_head = tiny_model.cfg.d_head
    table = weight_changes(tmp_path / "edited", stray, heads).set_index("tensor")
    assert table.other_changed.sum() == 1
    assert table.loc["transformer.h.0.self_attention.dense.bias", "other_changed"] == 1
    # The checkpoint the model came from against the re-initialised head: changes stay inside
    # L1H2's q/k/v rows (3 x d_head) and its d_head output columns.
    from headsurgeon.loading import model_info

    table = weight_changes(model_info(tiny_model).source, edited, heads).set_index("tensor")
    assert table.other_changed.sum() == 0
    qkv = table.loc["transformer.h.1.self_attention.query_key_value.weight"]
    assert qkv.head_elements == 3 * d_head * tiny_model.cfg.d_model and qkv.head_changed > 0
    assert table.loc["transformer.h.1.self_attention.dense.weight"].head_changed > 0
    assert table.head_elements.sum() == 4 * d_head * tiny_model.cfg.d_model + 3 * d_head
    # Without the head set every change counts as "other".
    assert weight_changes(model_info(tiny_model).source, edited).other_changed.sum() > 0


def test_weight_changes_compares_dtypes_exactly_and_rejects_bad_input(tmp_path):
    from headsurgeon.checkpoint_diff import weight_changes
    from headsurgeon.errors import InvalidArgumentError

    name = "transformer.h.0.self_attention.query_key_value.weight"
    half = {name: torch.randn(12, 4).half()}
    half[name][0, 0] = 1.0
    table = weight_changes(half, {name: half[name].float()}, [(0, 1)], d_head=2)
    assert table.head_changed.sum() == table.other_changed.sum() == 0
    nudged = half[name].float()
    nudged[0, 0] += 1e-4  # below float16's resolution at 1.0: a float16 comparison misses it
    assert weight_changes(half, {name: nudged}, [(0, 1)], d_head=2).other_changed.sum() == 1
    with pytest.raises(InvalidArgumentError, match="d_head"):
        weight_changes(half, half, [(0, 0)])
    with pytest.raises(InvalidArgumentError, match="must be an integer >= 0 and <= 65535, got -1"):
        weight_changes(half, half, [(0, -1)], d_head=2)
    for layer, head in [(1, 0), (0, 2)]:  # 12 rows = 2 heads of (q, k, v) x 2
        with pytest.raises(InvalidArgumentError, match=f"L{layer}H{head} is not in"):
            weight_changes(half, half, [(layer, head)], d_head=2)
    with pytest.raises(CheckpointError, match="lacks 1 tensor"):
        weight_changes(half, {})
    with pytest.raises(CheckpointError, match="shape"):
        weight_changes(half, {name: torch.zeros(3, 4)})
    with pytest.raises(ModelNotFoundError, match="nowhere does not exist"):
        weight_changes(tmp_path / "nowhere", half)


def test_weight_changes_reads_folders_like_load_model(bloom_dir, tmp_path):
    from headsurgeon.checkpoint_diff import weight_changes

    table = weight_changes(bloom_dir, str(bloom_dir), [(1, 3)])  # d_head from config.json
    assert table.head_elements.sum() > 0 and table.head_changed.sum() == 0
    corrupt = Path(shutil.copytree(bloom_dir, tmp_path / "corrupt"))
    (corrupt / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors is not a valid safetensors"):
        weight_changes(bloom_dir, corrupt)
    pickled = Path(shutil.copytree(bloom_dir, tmp_path / "pickled"))
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    assert weight_changes(pickled, bloom_dir).other_changed.sum() == 0  # pickles compare too


def test_weight_changes_counts_a_nan_left_in_place_as_unchanged():
    from headsurgeon.checkpoint_diff import weight_changes

    name = "transformer.h.0.self_attention.dense.weight"
    before = {name: torch.tensor([[float("nan"), 1.0], [2.0, 3.0]])}
    after = {name: torch.tensor([[float("nan"), 1.0], [2.0, float("nan")]])}
    table = weight_changes(before, after, d_head=1)
    assert table.other_changed.tolist() == [1]  # the new NaN only


def test_checkpoint_dtype_never_opens_a_fifo(bloom_dir, tmp_path):
    import os

    from headsurgeon.checkpoints import checkpoint_dtype

    folder = Path(shutil.copytree(bloom_dir, tmp_path / "ckpt"))
    model = load_model(folder)
    for name in ("model.safetensors", "config.json"):
        (folder / name).unlink()
        os.mkfifo(folder / name)
    done = []
    reader = threading.Thread(target=lambda: done.append(checkpoint_dtype(model)), daemon=True)
    reader.start()
    reader.join(30)
    try:
        assert done == [None]  # nothing to read the dtype from: unknown, not a hang
    finally:
        for name in ("model.safetensors", "config.json"):  # release a blocked reader, if any
            os.close(os.open(folder / name, os.O_RDWR | os.O_NONBLOCK))
