"""save_hf checks its exports: refusals before writing, a transformers reload after, dtypes."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from conftest import tl3_only
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import BloomForCausalLM

import headsurgeon.checkpoints as checkpoints
from headsurgeon import load_model, save_hf
from headsurgeon.checkpoints import checkpoint_dtype
from headsurgeon.errors import (
    CheckpointError,
    InvalidArgumentError,
    OutputExistsError,
    UnsupportedArchitectureError,
)
from headsurgeon.loading import ModelShape, random_model, use_exact_alibi
from headsurgeon.model_names import ORGANISM_DIR
from headsurgeon.outputs import MARK_FILE, mark_folder

ATOL = 1e-4


def tl_model(**changes):
    """A user's own HookedTransformer: TransformerLens config, random weights, no tokenizer.

    TransformerLens 3.x only: 4.x has no HookedTransformer (nor a config to build a model from).
    """
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    args = dict(
        n_layers=2,
        d_model=48,
        n_heads=6,
        d_head=8,
        n_ctx=32,
        d_vocab=64,
        act_fn="gelu_new",
        positional_embedding_type="alibi",
        normalization_type="LN",
        post_embedding_ln=True,
        seed=0,
    )
    args.update(changes)
    model = HookedTransformer(HookedTransformerConfig(**args))
    with torch.no_grad():  # TransformerLens initialises LayerNorms and biases to constants
        for name, p in model.named_parameters():
            if name.endswith((".w", ".b")) or ".b_" in name:
                p.add_(0.1 * torch.randn_like(p))
        model.unembed.b_U.zero_()  # BLOOM has no unembedding bias
    return model


def tokens(d_vocab: int, n_seqs: int = 3, n_pos: int = 30) -> torch.Tensor:
    return torch.randint(0, d_vocab, (n_seqs, n_pos), generator=torch.Generator().manual_seed(1))


def transformers_logits(folder, toks) -> torch.Tensor:
    hf = BloomForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        return hf.eval()(toks).logits


def refusal(model, out) -> str:
    with pytest.raises(UnsupportedArchitectureError) as caught:
        save_hf(model, out)
    message = str(caught.value)
    assert "\n" not in message
    assert not out.exists() and not any(out.parent.iterdir())  # nothing written, no temp folder
    return message


# --- refusals before writing ----------------------------------------------------------------


@tl3_only
def test_transformer_lens_slopes_refused_then_exported_after_use_exact_alibi(tmp_path):
    model = tl_model()
    message = refusal(model, tmp_path / "out")
    assert "ALiBi slopes [0.397, 0.157, 0.0625" in message
    assert "not BLOOM's for 6 heads [0.25, 0.0625, 0.0156, 0.00391, 0.5, 0.125]" in message
    assert "use_exact_alibi(model)" in message

    with pytest.warns(UserWarning, match="outputs change"):
        use_exact_alibi(model)
    out = save_hf(model, tmp_path / "out")
    toks = tokens(model.cfg.d_vocab)
    with torch.no_grad():
        expected = model(toks)
    assert (transformers_logits(out, toks) - expected).abs().max() < ATOL
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and config["seq_length"] == 32
    assert load_model(out).cfg.n_heads == 6


@tl3_only
@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"act_fn": "gelu"}, "activation gelu"),
        ({"post_embedding_ln": False}, "no embedding LayerNorm (post_embedding_ln=False"),
        ({"normalization_type": "RMS"}, "normalization RMS"),
        ({"d_mlp": 100}, "d_mlp 100 (BLOOM: 4 x d_model = 192)"),
        ({"parallel_attn_mlp": True}, "parallel_attn_mlp=True (BLOOM: False)"),
        ({"n_key_value_heads": 2}, "n_key_value_heads=2 (BLOOM: None)"),
        ({"attn_only": True}, "attn_only=True"),
        ({"d_head": 10}, "d_head 10 x 4 heads"),
        ({"original_architecture": "GPT2LMHeadModel"}, "architecture GPT2LMHeadModel"),
        # A GPT-2-like config: learned positions, no embedding LayerNorm.
        (
            {"positional_embedding_type": "standard", "post_embedding_ln": False},
            "standard positions (BLOOM uses ALiBi); no embedding LayerNorm",
        ),
    ],
)
def test_what_bloom_cannot_express_is_refused_by_name(changes, named, tmp_path):
    # 4 heads: TransformerLens's slopes are BLOOM's, so only the change is named.
    model = tl_model(**({"n_heads": 4, "d_head": 12} | changes))
    message = refusal(model, tmp_path / "out")
    assert message.startswith("save_hf cannot write 'custom' as a BLOOM checkpoint: ")
    assert named in message
    assert "ALiBi slopes" not in message


@tl3_only
def test_every_difference_is_listed_in_one_line(tmp_path):
    message = refusal(tl_model(act_fn="gelu", post_embedding_ln=False), tmp_path / "out")
    assert "activation gelu" in message
    assert "no embedding LayerNorm" in message
    assert "ALiBi slopes" in message


def test_another_architecture_is_refused_by_name(tmp_path):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from headsurgeon.loading import from_hf_model

    config = GPTNeoXConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=128,
    )
    torch.manual_seed(0)
    model = from_hf_model(GPTNeoXForCausalLM(config).eval())
    assert "architecture GPTNeoXForCausalLM" in refusal(model, tmp_path / "out")


def test_bad_folder_is_refused_before_any_work(tiny_model, tmp_path, monkeypatch):
    def no_work(model):
        raise AssertionError("weights were gathered")

    monkeypatch.setattr(checkpoints, "hf_state_dict", no_work)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputExistsError, match="is a file"):
        save_hf(tiny_model, tmp_path / "file" / "out")
    with pytest.raises(OutputExistsError, match="is a file"):
        save_hf(tiny_model, tmp_path / "file")


# --- verification after writing -------------------------------------------------------------


def test_failed_verification_leaves_nothing_and_replaces_nothing(tiny_model, tmp_path, monkeypatch):
    original = checkpoints.hf_state_dict

    def corrupted(model):
        state = original(model)
        name = "transformer.h.1.mlp.dense_4h_to_h.bias"  # not uniform: LayerNorm would undo it
        state[name] = state[name] + 0.01 * torch.linspace(-1, 1, state[name].numel())
        return state

    monkeypatch.setattr(checkpoints, "hf_state_dict", corrupted)
    with pytest.raises(CheckpointError, match=r"differ from the model's by up to 0\.0\d+ ") as e:
        save_hf(tiny_model, tmp_path / "new")
    assert "tolerance 1e-4 + 1e-5 x |logit|" in str(e.value) and "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []

    old = tmp_path / "old"
    old.mkdir()
    (old / "keep.txt").write_text("old")
    mark_folder(old, "test")  # an earlier output of ours, which overwrite may replace
    with pytest.raises(CheckpointError, match="nothing written"):
        save_hf(tiny_model, old, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["old"]
    assert sorted(p.name for p in old.iterdir()) == [MARK_FILE, "keep.txt"]


def test_verification_catches_hooks_that_change_the_model(tiny_model, tmp_path):
    tiny_model.blocks[0].hook_resid_post.add_hook(lambda x, hook: 2 * x)
    with pytest.raises(CheckpointError, match="Hooks that change"):
        save_hf(tiny_model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_verify_false_skips_the_reload(tiny_model, tmp_path, monkeypatch):
    loads = []
    original = BloomForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        loads.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(BloomForCausalLM, "from_pretrained", spy)
    save_hf(tiny_model, tmp_path / "unchecked", verify=False)
    assert loads == []
    save_hf(tiny_model, tmp_path / "checked")
    assert len(loads) == 1
    assert (tmp_path / "unchecked" / "model.safetensors").read_bytes() == (
        tmp_path / "checked" / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_narrow_model_is_checked_in_float32_and_left_as_it_was(bloom_dir, tmp_path, dtype):
    model = load_model(bloom_dir, dtype=dtype)
    assert model.cfg.dtype == dtype and model.embed.W_E.dtype == dtype
    before = {name: t.clone() for name, t in model.state_dict().items()}
    view = model.blocks[0].attn.W_Q[0]
    out = save_hf(model, tmp_path / "out")  # the checkpoint's float32: widening is exact
    assert model.cfg.dtype == dtype
    assert view.data_ptr() == model.blocks[0].attn.W_Q.data_ptr()  # views still see the model
    for name, t in model.state_dict().items():
        assert t.dtype == before[name].dtype and torch.equal(t, before[name]), name
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("transformer.ln_f.weight").dtype == torch.float32


# --- dtypes ---------------------------------------------------------------------------------


def test_float16_checkpoint_is_written_back_bit_identical_by_default(tmp_path):
    model = load_model("organism")  # float16 on disk, float32 in memory
    assert model.cfg.dtype == torch.float32
    assert checkpoint_dtype(model) == torch.float16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing rounds, so nothing to warn about
        out = save_hf(model, tmp_path / "f16")
    source = load_file(ORGANISM_DIR / "organism" / "model.safetensors")
    written = load_file(out / "model.safetensors")
    assert written.keys() == source.keys()
    for name, tensor in source.items():
        assert written[name].dtype == torch.float16 and torch.equal(written[name], tensor), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    assert checkpoint_dtype(load_model(out)) == torch.float16

    wide = save_hf(model, tmp_path / "f32", dtype="float32")
    for name, tensor in load_file(wide / "model.safetensors").items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, source[name].float()), name
    assert json.loads((wide / "config.json").read_text())["dtype"] == "float32"
    sizes = [(folder / "model.safetensors").stat().st_size for folder in (out, wide)]
    assert sizes[1] > 1.9 * sizes[0]


def test_rounding_to_the_default_dtype_is_reported(tmp_path):
    model = load_model("organism")
    with torch.no_grad():
        model.blocks[0].attn.W_Q[0, 0, 0] += 1e-6  # a float32 change float16 cannot hold
    with pytest.warns(UserWarning, match=r"rounding changed 1 weight\(s\).*dtype='float32'"):
        save_hf(model, tmp_path / "default")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_hf(model, tmp_path / "asked", dtype="float16")  # asked for: no warning
    with torch.no_grad():
        model.blocks[0].attn.W_Q[0, 0, 0] = 1e6
    with pytest.raises(InvalidArgumentError, match="beyond float16's range"):
        save_hf(model, tmp_path / "overflow")
    assert not (tmp_path / "overflow").exists()


def test_checkpoint_dtype(bloom_dir, tmp_path):
    assert checkpoint_dtype(load_model(bloom_dir)) == torch.float32
    assert checkpoint_dtype(load_model(bloom_dir, dtype="bfloat16")) == torch.float32
    assert checkpoint_dtype(random_model(ModelShape(1, 2, 8, 16, 8))) is None  # built in memory


def test_exported_files_follow_the_umask_like_any_other_file(tiny_model, tmp_path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        out = save_hf(tiny_model, tmp_path / "out")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644, modes


def test_the_export_names_its_source_model_not_the_folder_it_was_read_from(bloom_dir, tmp_path):
    """transformers records the source folder as ``_name_or_path``: a shared checkpoint would
    carry the user's home folder."""
    source = shutil.copytree(bloom_dir, tmp_path / "home" / "my-model")
    out = save_hf(load_model(source), tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["_name_or_path"] == "my-model"
    leaks = [p.name for p in out.iterdir() if str(tmp_path / "home").encode() in p.read_bytes()]
    assert leaks == []
