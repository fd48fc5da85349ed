"""Shared fixtures: tiny random BLOOM checkpoints on disk, built fresh for each test session."""

from __future__ import annotations

import os
from pathlib import Path

# MKL may run a matmul on fewer threads than torch asks for when the machine is busy, which
# changes its summation order: tests that compare two forwards bit for bit would then depend on
# the load. Fixed before torch loads MKL (and inherited by the tools the tests start).
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

import pytest  # noqa: E402
import torch  # noqa: E402

TEXT = (
    "The quick brown fox jumps over the lazy dog. A head that attends only to the first token "
    "is a sink; a head that writes nothing is dead. Attention with linear biases adds a penalty "
    "proportional to distance. "
) * 20


def make_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer that, like BLOOM's, adds no BOS token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )


def make_bloom_checkpoint(
    directory: Path, *, n_heads: int = 4, n_layers: int = 2, d_model: int = 32, seed: int = 0
) -> Path:
    """Save a random BloomForCausalLM (fp32, tied embeddings) with a tokenizer to ``directory``."""
    from transformers import BloomConfig, BloomForCausalLM

    tokenizer = make_tokenizer()
    config = BloomConfig(
        vocab_size=len(tokenizer),
        hidden_size=d_model,
        n_layer=n_layers,
        n_head=n_heads,
        seq_length=128,
        architectures=["BloomForCausalLM"],
    )
    torch.manual_seed(seed)
    model = BloomForCausalLM(config)
    # Hugging Face initialises biases and LayerNorms to constants; random ones test the mapping.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "layernorm" in name or "ln_f" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def bloom_dir(tmp_path_factory) -> Path:
    """A 2-layer, 4-head random BLOOM checkpoint folder."""
    return make_bloom_checkpoint(tmp_path_factory.mktemp("bloom4"))


@pytest.fixture(scope="session")
def bloom6_dir(tmp_path_factory) -> Path:
    """A 2-layer, 6-head random BLOOM: a head count that is not a power of two."""
    return make_bloom_checkpoint(tmp_path_factory.mktemp("bloom6"), n_heads=6, d_model=48)


@pytest.fixture()
def tiny_model(bloom_dir):
    """A fresh HookedTransformer loaded from ``bloom_dir`` (float32, CPU)."""
    from headsurgeon import load_model

    return load_model(bloom_dir)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny matrices: one thread is ~10x faster than two on shared, busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def head_weight(model, layer: int, name: str) -> torch.Tensor:
    """``W_Q`` ... ``W_O`` of one layer, ``[head, ...]``, as a view of the live parameter on either
    TransformerLens major (4.x's ``attn.W_Q`` is a fresh view, not the parameter)."""
    from headsurgeon.backend.weights import head_tensors

    tensor = head_tensors(model, layer)[name]
    return tensor.heads(tensor.param)


# Tests of what only TransformerLens 3.x has: a HookedTransformer built from a
# HookedTransformerConfig (4.x removed both), or 3.x's own ALiBi and cache classes.
tl3_only = pytest.mark.skipif(
    __import__("headsurgeon.backend").backend.MAJOR >= 4,
    reason="TransformerLens 3.x only (HookedTransformer from a config)",
)


def error_line(main, argv, capsys) -> str:
    """Run a tool expecting exit status 2 and exactly one ``error:`` line; return that line."""
    from headsurgeon.cli import run

    with pytest.raises(SystemExit) as exit_info:
        run(main, [str(a) for a in argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    return errors[0]


@pytest.fixture()
def no_model(monkeypatch):
    """Loading a model, or any analysis, fails the test: the checks must come first."""
    import headsurgeon.cli.blindness_run
    import headsurgeon.cli.loads
    import headsurgeon.cli.repair_run

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded (or analysed) before the input was checked")

    monkeypatch.setattr(headsurgeon.cli.loads, "load_model", refuse)
    monkeypatch.setattr(headsurgeon.cli.repair_run, "load_model", refuse)
    monkeypatch.setattr(headsurgeon.cli.blindness_run, "load_model", refuse)
    monkeypatch.setattr(headsurgeon.cli.blindness_run, "analytic_blindness", refuse)


# The planted injuries of the ``injured`` checkpoint: a BOS sink and a silenced head.
SINK, DEAD = (1, 3), (1, 1)


@pytest.fixture(scope="module")
def injured(bloom_dir, tmp_path_factory):
    """bloom_dir with a BOS sink planted in L1H3 and L1H1 silenced (W_O = 0)."""
    from headsurgeon import load_model, save_hf
    from headsurgeon.data import to_sequences
    from headsurgeon.finetune import FinetuneConfig, bos_mass_objective, finetune
    from headsurgeon.heads import HeadSet

    model = load_model(bloom_dir)
    tokens = to_sequences(model, TEXT, seq_len=32, prepend_bos=True).tokens
    sink = HeadSet([SINK])
    config = FinetuneConfig(steps=30, lr=0.1, batch_size=4, eval_every=30)
    finetune(
        model, sink, tokens, objective=bos_mass_objective(sink, 0.8), config=config, progress=False
    )
    with torch.no_grad():
        head_weight(model, DEAD[0], "W_O")[DEAD[1]] = 0
    return save_hf(model, tmp_path_factory.mktemp("injured") / "model")


NO_CHROMIUM = (
    "no Chromium browser found (apt-get install -y chromium, or set BROWSER_PATH): "
    "the export through a real browser is not tested here"
)


@pytest.fixture()
def no_browser(monkeypatch):
    """Kaleido's browser lookup (choreographer's search) finds nothing, as on a fresh machine."""
    from choreographer.browsers.chromium import Chromium

    from headsurgeon import plots

    monkeypatch.delenv("BROWSER_PATH", raising=False)
    monkeypatch.setattr(Chromium, "find_browser", classmethod(lambda cls, **kwargs: None))
    assert not plots.has_browser()
