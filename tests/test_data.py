"""Corpora and batching: sequences, BOS convention, bad input."""

from __future__ import annotations

import pytest
import torch

from headsurgeon.data import batches, bundled_text, read_texts, to_sequences
from headsurgeon.errors import DataError, InvalidArgumentError
from headsurgeon.loading import model_info


def test_bundled_corpora_are_real_text():
    for name in ("shakespeare", "python-docs"):
        assert len(bundled_text(name, "heldout")) > 100_000
    with pytest.raises(InvalidArgumentError, match="unknown corpus"):
        bundled_text("c4")


def test_sequences_follow_the_bos_convention_without_doubling(tiny_model):
    bos = tiny_model.tokenizer.bos_token_id
    with_bos = to_sequences(tiny_model, None, seq_len=16, n_seqs=4, prepend_bos=True).tokens
    assert with_bos.shape == (4, 16) and bool((with_bos[:, 0] == bos).all())
    assert not bool((with_bos[:, 1] == bos).any())
    # A token tensor is used exactly as given, whatever the convention says.
    again = to_sequences(tiny_model, with_bos, seq_len=16, prepend_bos=True).tokens
    assert torch.equal(again, with_bos)
    plain = to_sequences(tiny_model, None, seq_len=16, n_seqs=4, prepend_bos=False).tokens
    assert not bool((plain[:, 0] == bos).all())
    tiny_model.cfg.default_prepend_bos = True
    assert torch.equal(to_sequences(tiny_model, plain, seq_len=16).tokens, plain)
    assert torch.equal(to_sequences(tiny_model, plain, prepend_bos=False).tokens, plain)
    with pytest.raises(DataError, match="do not all start with the BOS token"):
        to_sequences(tiny_model, plain, seq_len=16, prepend_bos=True)


def test_bad_data_is_refused(tiny_model, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DataError, match="empty"):
        read_texts([empty])
    with pytest.raises(DataError, match="does not exist"):
        read_texts([tmp_path / "missing.txt"])
    with pytest.raises(DataError, match="shorter than one sequence"):
        to_sequences(tiny_model, "too short", seq_len=64)
    with pytest.raises(InvalidArgumentError):
        list(batches(torch.zeros(2, 2, dtype=torch.long), 0))


def test_a_str_is_always_text_and_a_path_always_a_file(tiny_model, tmp_path):
    """One rule: ``str`` is text even when it names a file; ``os.PathLike`` is a file."""
    from pathlib import Path

    from headsurgeon.data import describe, tokenize

    file = tmp_path / "corpus.txt"
    file.write_text("file contents " * 40)
    as_text = to_sequences(tiny_model, str(file), seq_len=4).tokens
    expected = tokenize(model_info(tiny_model), str(file))
    assert as_text.flatten().tolist() == expected[: as_text.numel()]  # the path's own tokens
    as_file = to_sequences(tiny_model, file, seq_len=4).tokens
    assert as_file.flatten().tolist()[:8] == tokenize(model_info(tiny_model), file.read_text())[:8]
    mixed = to_sequences(tiny_model, [str(file), file], seq_len=4).tokens
    assert len(mixed) == len(as_text) + len(as_file)
    assert describe(str(file)) == "1 text(s) given in memory"
    assert describe([file, "/etc/passwd", "more"]) == f"{file.name} and 2 text(s) given in memory"
    assert describe(Path("a.txt")) == "a.txt"
    with pytest.raises(DataError, match="text file nope.txt does not exist"):
        to_sequences(tiny_model, Path("nope.txt"), seq_len=4)


def test_seq_len_and_token_tensors_are_checked_in_one_line(tiny_model):
    tokens = torch.zeros(2, 8, dtype=torch.long)
    for data in ("some text " * 20, tokens):
        with pytest.raises(InvalidArgumentError, match="seq_len must be an integer >= 1, got True"):
            to_sequences(tiny_model, data, seq_len=True)
    with pytest.raises(DataError) as error:
        to_sequences(tiny_model, torch.zeros(2, 8, dtype=torch.long, device="meta"), seq_len=4)
    message = str(error.value)
    assert "\n" not in message and message.startswith("a token tensor on the meta device")
    with pytest.raises(DataError, match="layout torch.sparse_coo"):
        to_sequences(tiny_model, tokens.to_sparse(), seq_len=4)


def test_read_texts_takes_one_path_as_a_path(tmp_path):
    file = tmp_path / "t.txt"
    file.write_text("hello")
    assert read_texts(file) == ["hello"] == read_texts(str(file))
