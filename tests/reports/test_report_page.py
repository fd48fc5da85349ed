"""index.html: one self-contained, offline page per classify, repair and blindness run, listed in
the folder's mark, small, its patterns the census hook's weights; opened in a real browser where
one is found, clicking a head shows its attention."""

from __future__ import annotations

import base64
import html
import json
import re
import shutil

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
    PAGE_TEMPLATE,
    open_page,
    write_blindness,
    write_classification,
    write_page,
    write_report,
)

needs_browser = pytest.mark.skipif(not plots.has_browser(), reason=NO_CHROMIUM)


def page_data(folder) -> dict:
    """The page's embedded data, after checking that it needs nothing from outside."""
    bundle = (PAGE_TEMPLATE.parent / "plotly-cartesian.min.js").read_text()
    page = (folder / PAGE).read_text()
    assert page.count(bundle) == 1  # plotly.js (its cartesian bundle) inlined once
    rest = page.replace(bundle, "")  # (the bundle itself names its CDN for map data)
    assert not re.search(r"<script[^>]+src=", rest) and "cdn.plot.ly" not in rest
    found = re.search(r'<script type="application/json" id="data">(.*?)</script>', rest, re.S)
    return json.loads(found[1])


def unpack(b64: str, n: int) -> np.ndarray:
    """What the page's ``unpack`` does, in numpy: float16 lower triangle -> n x n."""
    values = np.frombuffer(base64.b64decode(b64), dtype="<f2").astype(np.float32)
    out = np.zeros((n, n), dtype=np.float32)
    out[np.tril_indices(n)] = values
    return out


def typed_array(value) -> np.ndarray:
    """A figure JSON's array: a list, or plotly's typed array (``dtype``, base64 ``bdata``)."""
    if not isinstance(value, dict):
        return np.array(value, dtype=float)
    flat = np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"])
    return flat.reshape([int(n) for n in str(value.get("shape", len(flat))).split(",")])


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
    assert bare["patterns"] == [] and "no attention patterns" in bare["note"]
    page = (tmp_path / "bare" / PAGE).read_text()
    assert "see its metrics." in page and "its attention" not in page  # no promise of patterns


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
        eval_on_train=True,
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
    assert "report.md" in data["files"]
    # report.md rendered as HTML: headings and tables, not Markdown source in a <pre>.
    page = (out / PAGE).read_text()
    summary = page[page.index('<div id="summary">') : page.index('<div id="figures">')]
    assert "<h1>Repair of" in summary and "<table>" in summary and "**" not in summary
    assert "its attention on the run's own sequences" in page
    # The caption above the grid describes a panel shown on a click, and says so.
    assert data["note"].startswith("Click a head in the grid to see its attention in each stage:")
    # The difference grids, one after the other, share one symmetric colour scale: the largest
    # change of any (the control's small change once got its own, as loud, scale).
    figures = {f["name"]: f["figure"] for f in data["figures"]} | {"bos_mass_diff": data["grid"]}
    diffs = [figures[n] for n in ("bos_mass_diff", "pass1_bos_mass_diff", "control_bos_mass_diff")]
    heatmaps = [fig["data"][0] for fig in diffs]
    largest = max(np.nanmax(np.abs(typed_array(h["z"]))) for h in heatmaps)
    assert {(h["zmin"], h["zmax"]) for h in heatmaps} == {(-largest, largest)}
    assert all(
        f"colour scale ±{largest:.3g}" in fig["layout"]["title"]["subtitle"]["text"]
        for fig in diffs
    )
    # The training figure's legend in rows under its panels, within a 1280-pixel window's page
    # (its body's margins 24 pixels a side), not beside them past the page's edge.
    layout = figures["training"]["layout"]
    assert layout["width"] <= 1280 - 2 * 24
    legend = layout["legend"]
    assert (legend["orientation"], legend["x"], legend["xanchor"]) == ("h", 0, "left")
    assert (legend["yref"], legend["y"], legend["yanchor"]) == ("container", 0, "bottom")
    assert layout["margin"]["b"] >= 80 + 26  # the axis titles, then one row of legend


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
    assert "blind distance float32 zero (tokens)" in data["metrics"]["blindness"][0]


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


# Hostile text: a model folder or corpus so named once blanked the page (the browser's parser left
# inside the data block), and a template field's name was once replaced by the field.
HOSTILE = "<!--<script>"
FIELDS = "{{data}} {{plotly}} {{title}}"
# A column name or value that runs if the page builds its table with innerHTML.
SCRIPTED = "<img src=x onerror=alert(1)>"


def small_census():
    model = random_model(ModelShape(n_layers=1, n_heads=2, d_model=16, d_vocab=64, n_ctx=16))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return model, tokens, classify_heads(run_census(model, tokens, progress=False))


def test_the_template_is_filled_once_so_field_names_in_user_text_stay_text(tmp_path):
    model, tokens, census = small_census()
    pages = {}
    for name in ("plain", FIELDS):
        (tmp_path / name).mkdir()
        write_page(
            tmp_path / name,
            title=name,
            summary=f"{name}\u2028{name}\u2029",
            grid=plots.label_grid(census),
            shape=(1, 2),
            stages={"census": census},
        )
        pages[name] = (tmp_path / name / PAGE).read_text(encoding="utf-8")
    page = pages[FIELDS]
    assert f"<title>{FIELDS}</title>" in page  # as typed, not the data or plotly.js
    assert len(page) - len(pages["plain"]) < 200  # the four fields, filled once each
    assert f"<pre>{FIELDS}\u2028{FIELDS}\u2029</pre>" in page
    data = page_data(tmp_path / FIELDS)
    assert data["title"] == FIELDS
    block = page[page.index('id="data">') :]
    assert "\u2028" not in block and "\u2029" not in block  # line ends to older JavaScript


def test_markup_in_names_and_values_reaches_the_page_only_escaped(tmp_path):
    model, tokens, census = small_census()
    census[SCRIPTED] = SCRIPTED
    census.attrs["model"] = HOSTILE
    out = write_classification(census, tmp_path / "out", formats=(), model=model, tokens=tokens)
    page = (out / PAGE).read_text(encoding="utf-8")
    start = page.index('id="data">') + len('id="data">')
    block = page[start : page.index("</script>", start)]
    assert not set("<>&") & set(block)  # nothing in the data can end or comment the block
    assert "<title>Heads of &lt;!--&lt;script&gt;</title>" in page
    data = page_data(out)
    assert data["title"] == f"Heads of {HOSTILE}"
    assert data["metrics"]["census"][0][SCRIPTED] == SCRIPTED
    assert "innerHTML" not in PAGE_TEMPLATE.read_text()  # the table is built with textContent


@pytest.fixture(scope="module")
def hostile_runs(bloom_dir, tmp_path_factory):
    """Every tool, from the command line, on a copy of ``bloom_dir`` in ``<home>/<!--<script>`` and
    on corpora so named: ``(home, {tool: output folder})``. No png figures (a second each)."""
    from choreographer.browsers.chromium import Chromium

    from headsurgeon.cli.blindness import main as blindness_main
    from headsurgeon.cli.repair import main as repair_main

    root = tmp_path_factory.mktemp("hostile")
    home = root / "home"
    model = str(shutil.copytree(bloom_dir, home / HOSTILE))
    (root / "texts").mkdir()
    first, second = root / "texts" / f"{HOSTILE}.txt", root / "texts" / f"{FIELDS}.txt"
    first.write_text(TEXT)
    second.write_text(TEXT[::-1])
    data = ["--texts", str(first), "--seq-len", "32", "--n-seqs", "8", "--prepend-bos"]
    both = [*data, "--texts", str(second)]
    repair = ["--corpus", str(first), "--eval-corpus", str(first), "--allow-eval-on-train"]
    repair += ["--train-seq-len", "32"]
    repair += ["--batch-size", "4", "--steps", "4", "--lr", "1e-2", "--passes", "1"]
    repair += ["--heads", "L1H3", "--no-control", "--max-collateral", "8", "--quiet", *data]
    runs = {
        "classify": (classify_main, data),
        "corpora": (classify_main, both),
        "blindness": (blindness_main, ["--measure", *data]),
        "repair": (repair_main, repair),
    }
    outs = {tool: root / tool for tool in runs}
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("BROWSER_PATH", raising=False)
        patch.setattr(Chromium, "find_browser", classmethod(lambda cls, **kwargs: None))
        for tool, (main, args) in runs.items():
            assert main([model, *args, "--out", str(outs[tool])]) == 0
    return home, outs


def test_no_output_names_the_folder_the_model_was_read_from(hostile_runs):
    """Reports and checkpoints are sent to others: a model given as a path is named by its folder
    (the tool prints where it wrote, on the terminal only)."""
    home, outs = hostile_runs
    written = [p for out in outs.values() for p in sorted(out.rglob("*")) if p.is_file()]
    assert {"heads.json", "summary.txt", "report.json", "config.json"} <= {p.name for p in written}
    leaks = [str(p) for p in written if str(home).encode() in p.read_bytes()]
    assert leaks == []
    config = json.loads((outs["repair"] / "model" / "config.json").read_text())
    assert config["_name_or_path"] == HOSTILE
    blindness = (outs["blindness"] / "summary.txt").read_text(encoding="utf-8")
    assert f"{HOSTILE}: blind distance" in blindness


@needs_browser
@pytest.mark.slow
def test_every_page_of_a_model_and_corpora_named_like_markup_works_in_chromium(hostile_runs):
    """Each tool's page renders, clicks and titles itself with the names as typed."""
    _, outs = hostile_runs
    pages = [out / PAGE for out in outs.values()] + sorted(outs["corpora"].glob(f"*/{PAGE}"))
    assert len(pages) == 6
    for page in pages:
        view = open_page(page, "L1H3")
        assert (view.errors, view.dialogs, view.shown) == ([], [], "L1H3"), page
        assert HOSTILE in view.title and view.document_title == view.title, page
        assert len(view.table) > 1 and (view.pattern is None) == (page.parent == outs["corpora"])


@needs_browser
@pytest.mark.slow
def test_a_column_named_or_valued_like_a_script_shows_as_text_and_runs_nothing(tmp_path):
    """Through the API: the metric table once ran a column's name or value (innerHTML)."""
    model, tokens, census = small_census()
    census[SCRIPTED] = SCRIPTED
    census.attrs["model"] = SCRIPTED  # in the title and the figures' (plotly reads tags there)
    out = write_classification(census, tmp_path / "out", formats=(), model=model, tokens=tokens)
    # The figure holds the name as text plotly shows literally (plots.layout.literal).
    assert html.escape(SCRIPTED, quote=False) in json.dumps(page_data(out)["grid"])
    view = open_page(out / PAGE, "L0H1")
    assert (view.errors, view.dialogs, view.shown) == ([], [], "L0H1")
    assert [SCRIPTED, SCRIPTED] in view.table and view.title == f"Heads of {SCRIPTED}"
