"""The two records every verb reads at its door: ModelInfo (the model) and Sequences (the data).

What they promise: made once per public call (a ``Sequences`` passed on is used as it is, not
made or checked again), fields that follow the model's settings read fresh, provenance carried
by the record rather than patched into results afterwards.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

import headsurgeon as hs
import headsurgeon.backend as backend
from headsurgeon import alibi
from headsurgeon.data import Sequences, as_sequences, to_sequences
from headsurgeon.errors import DataError, UnsupportedArchitectureError
from headsurgeon.loading import ModelShape, model_info, random_model

from .conftest import TEXT

PACKAGE = Path(hs.__file__).parent


def test_model_info_is_the_one_record_of_the_model(tiny_model):
    info = model_info(tiny_model)
    assert info.shape == hs.model_shape(tiny_model)
    assert info.shape.n_heads == tiny_model.cfg.n_heads
    assert torch.equal(info.slopes, alibi.slopes(tiny_model.cfg.n_heads))
    assert info.max_length is None  # ALiBi: no position table
    assert info.prepend_bos is False and info.bos_token_id == 1  # BLOOM: no BOS prepended
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.name = "other"  # type: ignore[misc]


def test_model_info_reads_the_fields_that_follow_the_model_fresh(tiny_model):
    # (The slopes after use_exact_alibi: tests/loading/test_user_models.py.)
    assert model_info(tiny_model).prepend_bos is False
    tiny_model.cfg.default_prepend_bos = True
    try:
        assert model_info(tiny_model).prepend_bos is True
        seqs = to_sequences(tiny_model, TEXT, seq_len=8, n_seqs=2)
        assert seqs.holds_bos and (seqs.tokens[:, 0] == 1).all()
    finally:
        tiny_model.cfg.default_prepend_bos = False


def test_a_model_without_alibi_has_no_slopes_and_keeps_its_context():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        num_hidden_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=50,
        max_position_embeddings=12,
        architectures=["GPTNeoXForCausalLM"],
    )
    model = hs.loading.from_hf_model(GPTNeoXForCausalLM(config).eval(), name="neox")
    info = model_info(model)
    assert info.slopes is None and not info.is_alibi and info.max_length == 12
    with pytest.raises(UnsupportedArchitectureError, match="not ALiBi"):
        hs.alibi_slopes(model)
    with pytest.raises(DataError, match="beyond the model's context of 12"):
        to_sequences(model, torch.zeros(2, 13, dtype=torch.long))


def test_sequences_record_where_they_came_from_and_pass_through(tiny_model, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    seqs = to_sequences(tiny_model, corpus, seq_len=16, n_seqs=4)
    assert isinstance(seqs, Sequences) and seqs.tokens.shape == (4, 16)
    assert seqs.source == corpus.name and not seqs.from_tensor
    assert seqs.holds_bos is False and "first text token" in seqs.bos_rule
    info = model_info(tiny_model)
    assert as_sequences(info, seqs) is seqs  # used as it is, not made or checked again
    assert as_sequences(info, seqs, n_seqs=2).tokens.shape == (2, 16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        seqs.source = "elsewhere"  # type: ignore[misc]


def test_a_verb_reports_the_source_of_its_sequences_without_patching(tiny_model, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    seqs = to_sequences(tiny_model, corpus, seq_len=16, n_seqs=4, prepend_bos=True)
    census = hs.run_census(tiny_model, seqs, progress=False)
    assert census.attrs["data"] == corpus.name
    assert census.attrs["prepend_bos"] is True and census.attrs["bos_rule"] == seqs.bos_rule
    assert census.attrs["n_seqs"] == 4  # not n_seqs=64: a Sequences is used as given


def test_sequences_of_another_model_are_checked_again(tiny_model):
    small = random_model(ModelShape(n_layers=1, n_heads=2, d_model=8, d_vocab=16, n_ctx=8))
    seqs = to_sequences(tiny_model, torch.full((2, 8), 100, dtype=torch.long))
    with pytest.raises(DataError, match="must lie in 0..15"):
        hs.run_census(small, seqs, progress=False)


def test_texts_whose_ids_exceed_the_vocabulary_are_refused_when_cut(tiny_model):
    small = random_model(ModelShape(n_layers=1, n_heads=2, d_model=8, d_vocab=16, n_ctx=8))
    small.headsurgeon_info = dataclasses.replace(
        small.headsurgeon_info, tokenizer=model_info(tiny_model).tokenizer
    )
    with pytest.raises(DataError, match="beyond the model's vocabulary of 16"):
        to_sequences(small, TEXT, seq_len=8)


def test_run_census_checks_its_model_once(tiny_model, monkeypatch):
    calls = []
    check = backend.check_model
    monkeypatch.setattr(
        backend, "check_model", lambda *a, **k: calls.append(a[1]) or check(*a, **k)
    )
    hs.run_census(tiny_model, torch.randint(0, 100, (2, 8)), progress=False)
    assert calls == ["run_census"]


def _door_calls() -> dict[str, list[str]]:
    """Module -> the functions that call check_model( or model_info(."""
    found: dict[str, list[str]] = {}
    for file in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(file.read_text(encoding="utf-8"))
        module = file.relative_to(PACKAGE).with_suffix("").as_posix()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for call in ast.walk(node):
                if isinstance(call, ast.Call):
                    name = getattr(call.func, "id", None) or getattr(call.func, "attr", None)
                    if name in ("check_model", "model_info"):
                        found.setdefault(module, []).append(node.name)
                        break
    return found


# Where a check_model( or model_info( call stands other than at a public verb's door, and why.
NOT_AT_A_DOOR = {
    ("loading/facts", "model_info"): "the door itself: checks the model, then builds the record",
}


def test_the_model_is_checked_and_described_at_a_verbs_door_only():
    strays = [
        f"{module}.{function}"
        for module, functions in _door_calls().items()
        for function in functions
        if function.startswith("_") and (module, function) not in NOT_AT_A_DOOR
    ]
    assert strays == [], "helpers below a door re-read the model; pass info down instead"


def test_the_slopes_are_decided_in_one_place():
    text = "\n".join(f.read_text(encoding="utf-8") for f in PACKAGE.rglob("*.py"))
    for gone in ("exact_slopes", "builtin_slopes", "position_zero", "finetune_checked"):
        assert re.search(rf"\b{gone}\(", text) is None, gone
