"""Corpora and batching: sequences, BOS convention, bad input."""

from __future__ import annotations

import re
import warnings

import pandas as pd
import pytest
import torch

import headsurgeon as hs
from headsurgeon.data import (
    Sequences,
    as_sequences,
    batches,
    bundled_text,
    read_texts,
    to_sequences,
    tokenize,
)
from headsurgeon.errors import DataError, InvalidArgumentError
from headsurgeon.inputs import check_texts
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


# Issue 41: bounded reads, token tensors of any integer dtype and layout, text as text.


@pytest.fixture(scope="module")
def organism_info():
    from headsurgeon import load_model

    return model_info(load_model("organism"))


def test_pieces_give_the_tokens_of_the_whole_text(organism_info, monkeypatch):
    """Tokenising piece by piece (cut where whitespace follows a word) gives the ids of the
    whole text: prose, code with long whitespace runs, and a stretch without any whitespace
    longer than a piece (cut there, documented) only at that cut."""
    from headsurgeon import data

    tokenizer = organism_info.tokenizer
    text = bundled_text("shakespeare", "heldout")[:60_000] + bundled_text("python-docs")[:60_000]
    text += "  :bcc:" + " " * 120 + "Header\n\n\t x"
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    monkeypatch.setattr(data, "PIECE_CHARS", 300)
    data._token_ids.cache_clear()
    assert data.tokenize(organism_info, text) == whole
    assert all(len(p) <= 300 for p in data._pieces(data._slices(text)))
    unbroken = "x" * 1000
    assert [len(p) for p in data._pieces(data._slices(unbroken))] == [300, 300, 300, 100]


def test_literal_special_tokens_are_text(organism_info, tiny_model):
    """``<s>``, ``</s>``, ``<pad>`` in a corpus are characters, never the BOS/EOS/PAD ids."""
    for info in (organism_info, model_info(tiny_model)):
        tokenizer = info.tokenizer
        specials = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
        text = "a <s> b </s> c <pad> d<s></s>" * 20
        assert not specials & set(tokenize(info, text))
        seqs = as_sequences(info, text, seq_len=8, prepend_bos=False)
        assert not specials & set(seqs.tokens.flatten().tolist())


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_token_tensors_of_any_integer_dtype_and_layout(tiny_model, dtype):
    """Compared in int64: uint8 ids 5..236 are valid for a vocabulary of 320 (the old check
    wrapped in uint8 and refused them); a transposed, non-contiguous view works."""
    ids = torch.arange(5, 237).reshape(8, 29)
    seqs = to_sequences(tiny_model, ids.to(dtype))
    assert seqs.tokens.dtype == torch.long and torch.equal(seqs.tokens, ids)
    view = ids.to(dtype).T  # [29, 8], non-contiguous
    got = to_sequences(tiny_model, view).tokens
    assert got.is_contiguous() and torch.equal(got, ids.T)
    tiny_model(got)  # TransformerLens takes it
    if dtype != torch.uint8:
        with pytest.raises(DataError, match=r"must lie in 0\.\.319, got 5\.\.400;"):
            to_sequences(tiny_model, torch.tensor([[5, 400]], dtype=dtype))


def test_check_texts_keeps_nothing_and_finds_what_read_texts_finds(tmp_path):
    good, binary = tmp_path / "a.txt", tmp_path / "b.txt"
    good.write_text("some text\n")
    binary.write_bytes(b"text\x00")
    assert check_texts([good]) is None
    with pytest.raises(DataError, match="is not text"):
        check_texts([good, binary])
    with pytest.raises(DataError, match="is empty"):
        (tmp_path / "c.txt").write_text(" \n")
        check_texts(tmp_path / "c.txt")


def test_n_seqs_reads_only_a_budget_of_tokens(organism_info, tmp_path, monkeypatch):
    """With n_seqs, windows are spread over the first max(SAMPLE_FACTOR x n_seqs x seq_len,
    MIN_SAMPLE_TOKENS) tokens; beyond that the file is not read."""
    from headsurgeon import data, inputs

    read = []
    real = inputs.iter_text
    monkeypatch.setattr(
        inputs, "iter_text", lambda *a, **k: (read.append(c) or c for c in real(*a, **k))
    )
    monkeypatch.setattr(data, "MIN_SAMPLE_TOKENS", 1000)
    path = tmp_path / "long.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 200_000)  # 9 MB
    seqs = as_sequences(organism_info, path, seq_len=16, n_seqs=4)
    assert seqs.tokens.shape == (4, 16)
    assert sum(map(len, read)) <= 3 << 20  # a few chunks of 1 MiB, not 9 MB


_CAPPED = """
import gzip, resource, sys, zlib
from pathlib import Path
import headsurgeon as hs
from headsurgeon import data
from headsurgeon.errors import HeadsurgeonError
info = hs.model_info(hs.load_model("organism"))
data.MIN_SAMPLE_TOKENS = 1 << 20  # one or two pieces: seconds, not minutes, on a busy machine
size = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + (1536 << 20),) * 2)
try:
    seqs = data.as_sequences(info, Path(sys.argv[1]), seq_len=64, n_seqs=4)
    print("shape", list(seqs.tokens.shape))
except HeadsurgeonError as e:
    print("error", e)
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["line", "bomb"])
def test_a_huge_line_and_a_gzip_bomb_under_a_memory_cap(tmp_path, kind):
    """A 50 MB one-line corpus and 0.9 MB of gzip holding 900 MB of one letter, under a
    1.5 GiB address-space cap: sequences (or one line), never a crash. Whole, the line took
    10 GB in the tokenizer; the bomb aborted it."""
    import subprocess
    import sys
    import zlib

    if kind == "line":
        path = tmp_path / "line.txt"
        path.write_text("word " * 10_000_000)
    else:
        path = tmp_path / "bomb.txt.gz"
        compressor = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip: concatenated members read on
        member = compressor.compress(b"a" * (1 << 20)) + compressor.flush()
        path.write_bytes(member * 900)
        assert path.stat().st_size < 2 << 20
    out = subprocess.run(
        [sys.executable, "-c", _CAPPED, str(path)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "shape [4, 64]", out.stdout


# Issue 53: Sequences slice like the rows they hold; verbs take data, cutting is to_sequences'.


def test_sequences_have_a_length_and_slice_into_sequences(tiny_model):
    tokens = torch.randint(0, 320, (10, 6), generator=torch.Generator().manual_seed(0))
    seqs = to_sequences(tiny_model, tokens)
    assert len(seqs) == 10
    for rows, expected in [
        (slice(None, 8), tokens[:8]),
        (slice(2, 5), tokens[2:5]),
        (3, tokens[3:4]),  # an int: the one-row Sequences of that row
        (-1, tokens[-1:]),
        ([0, 3], tokens[[0, 3]]),
        (torch.tensor([4, 1]), tokens[[4, 1]]),
    ]:
        part = seqs[rows]
        assert isinstance(part, Sequences) and torch.equal(part.tokens, expected), rows
        assert (part.source, part.bos_rule, part.checked_for) == (
            seqs.source,
            seqs.bos_rule,
            seqs.checked_for,
        )
        assert as_sequences(model_info(tiny_model), part) is part  # checked, used as they are
    assert [s.tokens[0, 0] for s in seqs] == list(tokens[:, 0])
    with pytest.raises(IndexError):
        seqs[10]
    for bad in [(0, slice(None)), 1.5, slice(4, 4)]:
        with pytest.raises(InvalidArgumentError):
            seqs[bad]


def _effect_table(result):
    for name in ("by_head", "by_cache", "by_distance", "received"):
        if hasattr(result, name):
            return getattr(result, name)
    return result


# Each public verb that kept seq_len / n_seqs / prepend_bos for one release.
CUT_VERBS = {
    "run_census": lambda m, d, **kw: hs.run_census(m, d, progress=False, **kw),
    "head_importance": lambda m, d, **kw: hs.head_importance(m, d, progress=False, **kw),
    "secondary_sinks": lambda m, d, **kw: hs.secondary_sinks(m, d, progress=False, **kw),
    "measure_blindness": lambda m, d, **kw: hs.measure_blindness(m, d, progress=False, **kw),
    "window_effect": lambda m, d, **kw: hs.window_effect(m, d, progress=False, **kw),
    "sink_cache_effect": lambda m, d, **kw: hs.sink_cache_effect(
        m, d, sinks=[1], windows=[2], heads=[], progress=False, **kw
    ),
    "precision_effect": lambda m, d, **kw: hs.precision_effect(
        m, d, dtypes=["float16"], parts=["scores"], head_table=False, progress=False, **kw
    ),
    "compare_corpora": lambda m, d, **kw: hs.compare_corpora(
        m, {"a": d, "b": d}, progress=False, **kw
    ),
    "ablate_heads": lambda m, d, **kw: _mean_z_logits(m, d, **kw),
}


def _mean_z_logits(model, data, **cut):
    with hs.ablate_heads(model, "L0H0", "mean", data, progress=False, **cut):
        return pd.DataFrame(model(torch.arange(6)[None])[0].detach().numpy())


@pytest.mark.parametrize("verb", sorted(CUT_VERBS))
def test_a_verbs_own_cut_warns_once_and_acts_as_to_sequences(tiny_model, verb):
    """``verb(model, texts, seq_len=..., n_seqs=...)`` still works, with one FutureWarning that
    names the hs.to_sequences call, and gives what ``verb(model, hs.to_sequences(...))`` does."""
    text = "the quick brown fox jumps over the lazy dog " * 30
    cut = {"seq_len": 8, "n_seqs": 3, "prepend_bos": False}
    with pytest.warns(FutureWarning) as caught:
        old = CUT_VERBS[verb](tiny_model, text, **cut)
    futures = [w for w in caught if w.category is FutureWarning]
    assert len(futures) == 1, [str(w.message) for w in futures]
    said = str(futures[0].message)
    assert "hs.to_sequences(model, data, seq_len=8, n_seqs=3, prepend_bos=False)" in said
    assert futures[0].filename == __file__  # the caller's line, not the library's
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        new = CUT_VERBS[verb](tiny_model, to_sequences(tiny_model, text, **cut))
    pd.testing.assert_frame_equal(_effect_table(old), _effect_table(new))


def test_tokens_given_are_used_whole_and_texts_cut_by_the_verbs_constant(tiny_model, caplog):
    """No verb cuts what it is given (a 70-row tensor is 70 sequences, not the census's 64);
    texts are cut by the verb's constant, and a short text says once that it holds fewer."""
    from headsurgeon.census import CENSUS_CUT

    tokens = torch.randint(0, 320, (70, 4), generator=torch.Generator().manual_seed(1))
    assert hs.run_census(tiny_model, tokens, progress=False).attrs["n_seqs"] == 70
    text = "the quick brown fox jumps over the lazy dog " * 30
    with caplog.at_level("WARNING"):
        census = hs.run_census(tiny_model, text, progress=False)
    assert census.attrs["seq_len"] == CENSUS_CUT.seq_len
    held = [r.getMessage() for r in caplog.records if "holds only" in r.getMessage()]
    assert held == [
        "asked for 64 sequences of 128 tokens, but the text (1 text(s) given in memory) holds "
        "only 5: using those 5"
    ], held


def test_the_warning_names_the_cut_the_verb_made(tiny_model):
    """The replacement the warning names cuts as the verb did: its own constant fills what was
    not given (texts), and tokens keep only what was given."""
    short = "too short for a window"
    call = re.escape("window_effect(model, hs.to_sequences(model, data, seq_len=1024, n_seqs=2))")
    with pytest.warns(FutureWarning, match=call), pytest.raises(DataError, match="shorter"):
        hs.window_effect(tiny_model, short, n_seqs=2, progress=False)
    tokens = torch.randint(0, 320, (3, 8), generator=torch.Generator().manual_seed(2))
    with pytest.warns(FutureWarning, match=re.escape("to_sequences(model, data, seq_len=4))")):
        assert hs.run_census(tiny_model, tokens, seq_len=4, progress=False).attrs["n_seqs"] == 3
