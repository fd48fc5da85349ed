"""index.html: one self-contained, offline page per classify, repair and blindness run, listed in
the folder's mark, small, its patterns the census hook's weights; opened in a real browser where
one is found, clicking a head shows its attention."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest
import torch
from conftest import NO_CHROMIUM, TEXT

from headsurgeon import classify_heads, plots, run_census
from headsurgeon.blindness import analytic_blindness, measure_blindness
from headsurgeon.cli.classify import main as classify_main
from headsurgeon.data import to_sequences
from headsurgeon.errors import FigureExportError
from headsurgeon.finetune import FinetuneConfig
from headsurgeon.loading import ModelShape, organism_names, random_model
from headsurgeon.outputs import read_mark
from headsurgeon.pattern_samples import attention_weights, sample_patterns
from headsurgeon.repair import repair
from headsurgeon.reports import (
    PAGE,
    PAGE_POSITIONS,
    open_page,
    write_blindness,
    write_classification,
    write_page,
    write_report,
)

needs_browser = pytest.mark.skipif(not plots.has_browser(), reason=NO_CHROMIUM)


def page_data(folder) -> dict:
    """The page's embedded data, after checking that it needs nothing from outside."""
    from plotly.offline import get_plotlyjs

    page = (folder / PAGE).read_text()
    assert page.count(get_plotlyjs()) == 1  # plotly.js inlined once
    rest = page.replace(get_plotlyjs(), "")  # (the bundle itself names its CDN for map data)
    assert not re.search(r"<script[^>]+src=", rest) and "cdn.plot.ly" not in rest
    found = re.search(r'<script type="application/json" id="data">(.*?)</script>', rest, re.S)
    return json.loads(found[1])


def unpack(b64: str, n: int) -> np.ndarray:
    """What the page's ``unpack`` does, in numpy: float16 lower triangle -> n x n."""
    values = np.frombuffer(base64.b64decode(b64), dtype="<f2").astype(np.float32)
    out = np.zeros((n, n), dtype=np.float32)
    out[np.tril_indices(n)] = values
    return out


def test_classification_page_holds_every_head_and_its_exact_weights(tiny_model, tmp_path):
    tokens = to_sequences(tiny_model, TEXT, seq_len=64, n_seqs=3).tokens
    census = classify_heads(run_census(tiny_model, tokens, progress=False))
    out = write_classification(
        census, tmp_path / "out", formats=(), model=tiny_model, tokens=tokens
    )
    assert PAGE in read_mark(out).files  # --overwrite may replace it: it is ours
    data = page_data(out)
    assert data["names"] == [f"L{layer}H{head}" for layer in range(2) for head in range(4)]
    assert data["metrics"]["census"][5]["bos_mass"] == pytest.approx(census.bos_mass[5], rel=1e-4)
    assert len(data["sequences"]) == 2 and data["sequences"][0]["n_pos"] == PAGE_POSITIONS
    assert data["sequences"][0]["tokens"][0] == "The"
    exact = attention_weights(tiny_model, tokens[1, :PAGE_POSITIONS], "L1H2").weights[0]
    shown = unpack(data["patterns"][0][1][6], PAGE_POSITIONS)  # stage 0, sequence 2, L1H2
    np.testing.assert_allclose(shown, exact, atol=5e-4, rtol=1e-3)  # float16
    assert "threshold_sweep" in [f["name"] for f in data["figures"]]
    # Without a model: the page still comes, with metrics and a line saying why no patterns.
    bare = page_data(write_classification(census, tmp_path / "bare", formats=()))
    assert bare["patterns"] == [] and "No model" in bare["note"]


def test_a_bloom_560m_sized_page_stays_under_10_mb(tmp_path):
    shape = ModelShape(n_layers=24, n_heads=16, d_model=64, d_vocab=64, n_ctx=128)
    model = random_model(shape)
    tokens = torch.randint(0, 64, (2, 128), generator=torch.Generator().manual_seed(0))
    census = classify_heads(run_census(model, tokens, progress=False))
    out = write_classification(census, tmp_path / "out", formats=(), model=model, tokens=tokens)
    size = (out / PAGE).stat().st_size
    assert len(page_data(out)["patterns"][0][0]) == 384
    assert size < 10 * 2**20, f"{size / 2**20:.1f} MiB"
    # A repair's page: three stages (before, two passes) of one sequence each, as repair keeps.
    sample = sample_patterns(model, tokens, n_seqs=1)
    (tmp_path / "repair").mkdir()
    stages = {"before": census, "pass 1": census, "pass 2": census}
    write_page(
        tmp_path / "repair",
        title="repair",
        summary="",
        grid=plots.label_grid(census),
        shape=(24, 16),
        stages=stages,
        samples=[sample] * 3,
        model=model,
    )
    size = (tmp_path / "repair" / PAGE).stat().st_size
    assert size < 10 * 2**20, f"{size / 2**20:.1f} MiB"


def test_repair_page_shows_every_stage_side_by_side(tiny_model, tmp_path):
    result = repair(
        tiny_model,
        TEXT,
        eval_corpus=TEXT,
        census_data=TEXT,
        census_seq_len=32,
        census_n_seqs=4,
        train_seq_len=32,
        heads="L1H2",
        passes=1,
        progress=False,
        finetune_config=FinetuneConfig(steps=2, lr=1e-3, batch_size=2),
        max_ppl_increase=float("inf"),
    )
    assert set(result.patterns) == {"before", "pass 1", "control"}
    out = write_report(result, tmp_path / "out", formats=("html",), save_model=False)
    data = page_data(out)
    assert data["stages"] == ["before", "pass 1", "control"] and len(data["patterns"]) == 3
    before, after, control = (unpack(stage[0][6], 32) for stage in data["patterns"])
    assert np.abs(after - before).max() > 0  # the targeted head changed, in both arms
    assert np.abs(control - before).max() > 0 and np.abs(control - after).max() > 0
    untouched = [unpack(stage[0][0], 32) for stage in data["patterns"]]  # L0H0 did not change
    assert all(np.array_equal(untouched[0], u) for u in untouched[1:])
    assert "report.md" in data["files"] and "# Repair of" in data["summary"]


def test_blindness_page_has_curves_per_head(tiny_model, tmp_path):
    tokens = to_sequences(tiny_model, TEXT, seq_len=256, n_seqs=1).tokens
    analytic = analytic_blindness(tiny_model, context_length=256)
    measured = measure_blindness(tiny_model, tokens)
    out = write_blindness(
        tmp_path / "out", analytic, measured, formats=("html",), model=tiny_model, tokens=tokens
    )
    data = page_data(out)
    curve = data["curves"]["L1H0"]
    assert [t["name"] for t in curve["traces"]] == list(dict.fromkeys(measured.by_head.dtype))
    assert data["sequences"][0]["step"] == 4  # 256 positions pooled to 64 cells a side
    assert "blind distance float32 zero" in data["metrics"]["blindness"][0]


@needs_browser
@pytest.mark.slow
@pytest.mark.skipif("organism-injured" not in organism_names(), reason="no bundled organisms")
def test_clicking_a_sink_in_chromium_shows_its_attention_on_column_0(tmp_path, capsys):
    """The issue's acceptance: classify organism-injured, open index.html, click L1H7."""
    assert classify_main(["organism-injured", "--n-seqs", "8", "--out", str(tmp_path / "out")]) == 0
    view = open_page(tmp_path / "out" / PAGE, "L1H7", screenshot=tmp_path / "page.png")
    assert view.errors == []
    assert view.shown == "L1H7"
    rows = np.array([[np.nan if w is None else w for w in row] for row in view.pattern])
    assert np.nanmean(rows[1:, 0]) > 0.5  # most of each row's weight on position 0
    assert (rows[1:, 0] == np.nanmax(rows[1:], axis=1)).mean() > 0.5
    assert (tmp_path / "page.png").read_bytes()[:4] == b"\x89PNG"


def test_without_a_browser_the_page_is_written_and_opening_it_is_one_line(
    no_browser,  # noqa: F811
    tmp_path,
):
    model = random_model(ModelShape(n_layers=1, n_heads=2, d_model=16, d_vocab=64, n_ctx=16))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    census = classify_heads(run_census(model, tokens, progress=False))
    out = write_classification(census, tmp_path / "out", model=model, tokens=tokens)
    assert (out / PAGE).is_file()
    with pytest.raises(FigureExportError, match="needs a Chromium browser") as info:
        open_page(out / PAGE, "L0H0")
    assert "\n" not in str(info.value)


def test_a_model_named_like_markup_reaches_the_page_only_escaped(tmp_path):
    """A folder named '<!--<script>' once left the browser's parser inside the data block."""
    from headsurgeon.blindness import analytic_blindness
    from headsurgeon.reports import write_blindness

    table = analytic_blindness("bloom-560m", dtypes=["float32"], limits=["zero"])
    table.attrs["model"] = "<!--<script>"
    page = write_blindness(tmp_path / "out", table, None, formats=["html"]) / "index.html"
    text = page.read_text(encoding="utf-8")
    assert "<!--<script>" not in text and "\\u003c!--\\u003cscript\\u003e" in text
