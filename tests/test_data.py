"""Corpora and batching: sequences, BOS convention, bad input."""

from __future__ import annotations

import pytest
import torch

from headsurgeon.data import batches, bundled_text, read_texts, to_sequences
from headsurgeon.errors import DataError, InvalidArgumentError


def test_bundled_corpora_are_real_text():
    for name in ("shakespeare", "python-docs"):
        assert len(bundled_text(name, "heldout")) > 100_000
    with pytest.raises(InvalidArgumentError, match="unknown corpus"):
        bundled_text("c4")


def test_sequences_follow_the_bos_convention_without_doubling(tiny_model):
    bos = tiny_model.tokenizer.bos_token_id
    with_bos = to_sequences(tiny_model, None, seq_len=16, n_seqs=4, prepend_bos=True)
    assert with_bos.shape == (4, 16) and bool((with_bos[:, 0] == bos).all())
    assert not bool((with_bos[:, 1] == bos).any())
    # Sequences made here pass through unchanged, whatever the convention says.
    again = to_sequences(tiny_model, with_bos, seq_len=16, prepend_bos=True)
    assert torch.equal(again, with_bos)
    plain = to_sequences(tiny_model, None, seq_len=16, n_seqs=4, prepend_bos=False)
    assert not bool((plain[:, 0] == bos).all())
    assert torch.equal(to_sequences(tiny_model, plain, seq_len=16, prepend_bos=True)[:, 1:], plain)


def test_bad_data_is_refused(tiny_model, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DataError, match="empty"):
        read_texts([empty])
    with pytest.raises(DataError, match="does not exist"):
        read_texts([tmp_path / "missing.txt"])
    with pytest.raises(DataError, match="shorter than one sequence"):
        to_sequences(tiny_model, "too short", seq_len=64)
    with pytest.raises(DataError, match="beyond the model's context"):
        to_sequences(tiny_model, None, seq_len=tiny_model.cfg.n_ctx + 1)
    with pytest.raises(InvalidArgumentError):
        list(batches(torch.zeros(2, 2, dtype=torch.long), 0))
