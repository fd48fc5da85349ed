"""The evaluations read text files bounded and streamed (issue 41): only the tokens or
characters they need, with the same one-line errors as every other reader of text files."""

from __future__ import annotations

import pytest

import headsurgeon.data as data_module
import headsurgeon.evals.loss as loss_module
import headsurgeon.evals.retrieval as retrieval_module
from headsurgeon.errors import DataError
from headsurgeon.evals import needle, perplexity, retrieval_by_distance

SENTENCE = "the quick brown fox jumps over the lazy dog. "


@pytest.fixture
def reads(monkeypatch):
    """The pieces of text files read so far."""
    read = []
    real = data_module.text_file_chunks
    monkeypatch.setattr(
        data_module,
        "text_file_chunks",
        lambda *a, **k: (read.append(c) or c for c in real(*a, **k)),
    )
    return read


@pytest.fixture
def long_file(tmp_path):
    path = tmp_path / "long.txt"
    path.write_text(SENTENCE * 200_000)  # 9 MB
    return path


def test_perplexity_reads_only_its_budget_of_a_huge_file(tiny_model, long_file, reads, monkeypatch):
    monkeypatch.setattr(loss_module, "MIN_SAMPLE_TOKENS", 1000)
    ppl = perplexity(tiny_model, long_file, window=16, max_windows=4, progress=False)
    assert ppl > 1 and reads and sum(map(len, reads)) <= 3 << 20  # pieces of 1 MiB, not 9 MB


def test_perplexity_of_a_file_is_that_of_its_text(tiny_model, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text(SENTENCE * 40)
    kwargs = {"window": 16, "max_windows": 8, "progress": False}
    assert perplexity(tiny_model, path, **kwargs) == perplexity(tiny_model, SENTENCE * 40, **kwargs)


def test_needle_reads_only_its_budget_of_a_huge_file(tiny_model, long_file, reads, monkeypatch):
    monkeypatch.setattr(retrieval_module, "MIN_SAMPLE_TOKENS", 1000)
    result = needle(tiny_model, long_file, lengths=[128], depths=[0.5], n_trials=1, n_candidates=2)
    assert len(result.trials) == 1 and reads and sum(map(len, reads)) <= 3 << 20


@pytest.mark.parametrize(
    "content, message",
    [
        (b"text\x00more", "is not text"),
        (b"caf\xe9 au lait", r"is not UTF-8 \(byte 0xe9 at offset 3\)"),
        (b" \n", "is empty"),
    ],
)
def test_a_bad_file_is_one_line_for_every_evaluation(tiny_model, tmp_path, content, message):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    for evaluate in (
        lambda: perplexity(tiny_model, path, window=16, progress=False),
        lambda: needle(tiny_model, path, lengths=[128], n_trials=1, n_candidates=2),
        lambda: retrieval_by_distance(
            tiny_model, haystack=[path], distances=[0, 8], n_trials=1, progress=False
        ),
    ):
        with pytest.raises(DataError, match=message) as raised:
            evaluate()
        assert "\n" not in str(raised.value) and str(path) in str(raised.value)


def test_a_file_over_the_size_limit_is_refused_before_it_is_read(tiny_model, tmp_path, reads):
    path = tmp_path / "huge.txt"
    with path.open("wb") as f:
        f.truncate((1 << 30) + 1)  # sparse: no disk used, 1 GiB and a byte by its size
    with pytest.raises(DataError, match="more than the 1.0 GiB") as raised:
        perplexity(tiny_model, path, window=16, progress=False)
    assert "\n" not in str(raised.value) and reads == []
