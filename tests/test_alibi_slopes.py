"""headsurgeon.alibi.slopes against Hugging Face BLOOM and the published values."""

from __future__ import annotations

import pytest
import torch
from transformers.models.bloom.modeling_bloom import _get_alibi_slopes, build_alibi_tensor

from headsurgeon.alibi import slopes


@pytest.mark.parametrize("n_heads", range(1, 131))
def test_slopes_equal_hugging_face_bit_for_bit(n_heads):
    ours = slopes(n_heads)
    theirs = _get_alibi_slopes(n_heads, torch.device("cpu"))
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("n_heads", [6, 12, 16, 112])
def test_slopes_are_the_bias_per_position_of_build_alibi_tensor(n_heads):
    # BLOOM's bias for key position j is slope * j; at j = 1 it is the slope itself.
    bias = build_alibi_tensor(torch.ones(1, 3), n_heads, torch.float32)
    assert torch.equal(bias[:, 0, 1], slopes(n_heads))


def test_power_of_two_slopes_match_the_published_formula():
    # 16 heads: 2^(-(h+1)/2) = 0.7071, 0.5, ..., 0.0039 (REFERENCE.md); 32 heads: 2^(-(h+1)/4).
    for n_heads, step in ((16, 0.5), (32, 0.25)):
        expected = torch.tensor([2 ** (-step * (h + 1)) for h in range(n_heads)])
        torch.testing.assert_close(slopes(n_heads), expected, rtol=1e-6, atol=0)
    assert [round(x, 4) for x in slopes(16)[:3].tolist()] == [0.7071, 0.5, 0.3536]
    assert round(slopes(16)[-1].item(), 4) == 0.0039


def test_non_power_of_two_interleaves_the_finer_series():
    # BLOOM-176B: 64 heads of the 64-head series, then the odd terms of the 128-head series.
    s = slopes(112)
    torch.testing.assert_close(s[:64], slopes(64), rtol=0, atol=0)
    torch.testing.assert_close(s[64:], slopes(128)[0:96:2], rtol=1e-6, atol=0)
    assert len(set(s.tolist())) == 112


@pytest.mark.parametrize("bad", [0, -3, 2.0, "8"])
def test_slopes_reject_bad_head_counts(bad):
    with pytest.raises(ValueError, match="integer >= 1"):
        slopes(bad)
