"""What a run's folder weighs: one copy of plotly.js (inlined in ``index.html``, which holds every
figure), no per-figure HTML unless asked for, and under 6 MB on organism-injured; the page's
cartesian bundle draws every figure in Chromium with no console error."""

from __future__ import annotations

import re

import plotly.graph_objects as go
import pytest
from conftest import NO_CHROMIUM, TEXT

from headsurgeon import classify_heads, plots
from headsurgeon.cli.blindness import main as blindness_main
from headsurgeon.cli.classify import main as classify_main
from headsurgeon.cli.repair import EXIT_DAMAGED, EXIT_WORSE, main as repair_main
from headsurgeon.loading import organism_names
from headsurgeon.reports import PAGE, open_page, write_classification, write_page

# The banner each plotly.js bundle opens with ("* plotly.js v4.1.1", "* plotly.js (cartesian -
# minified) v4.1.1"): one per copy.
BANNER = re.compile(rb"^\* plotly\.js (?:\([\w -]+\) )?v\d+\.\d+\.\d+$", re.M)
MB = 2**20
needs_organisms = pytest.mark.skipif(
    "organism-injured" not in organism_names(), reason="no bundled organisms"
)
needs_browser = pytest.mark.skipif(not plots.has_browser(), reason=NO_CHROMIUM)


def plotly_copies(folder) -> dict[str, int]:
    """Per file under ``folder`` holding plotly.js, how many copies."""
    found = {p: len(BANNER.findall(p.read_bytes())) for p in folder.rglob("*") if p.is_file()}
    return {str(p.relative_to(folder)): n for p, n in found.items() if n}


def weight(folder, skip: str | None = None) -> int:
    """Bytes under ``folder``, leaving out the subfolder ``skip``."""
    return sum(
        p.stat().st_size
        for p in folder.rglob("*")
        if p.is_file() and not (skip and p.relative_to(folder).parts[0] == skip)
    )


def figure_htmls(folder) -> list[str]:
    return sorted(p.name for p in folder.glob("*.html") if p.name != PAGE)


def check_page_in_chromium(page) -> None:
    """The page draws its grid and every figure with its cartesian bundle, no console error,
    and names a head's metrics in words."""
    view = open_page(page, "L1H7")
    assert view.errors == [] and view.shown == "L1H7"
    assert len(view.figures) >= 4 and all(drawn for _, drawn in view.figures), view.figures
    rows = [row[0] for row in view.table[1:]]
    assert "BOS mass (fraction of attention)" in rows and "bos_mass" not in rows


@needs_organisms
@pytest.mark.slow
def test_classify_folder_holds_one_plotly_js_and_weighs_under_6_mb(tmp_path):
    out = tmp_path / "cl"
    argv = ["organism-injured", "--n-seqs", "8", "--seq-len", "64", "--threads", "1"]
    assert classify_main([*argv, "--out", str(out)]) == 0
    assert plotly_copies(out) == {PAGE: 1}
    assert figure_htmls(out) == []  # every figure is on the page
    assert weight(out) < 6 * MB, f"{weight(out) / MB:.2f} MB"
    if plots.has_browser():
        check_page_in_chromium(out / PAGE)


@needs_organisms
@pytest.mark.slow
def test_repair_folder_holds_one_plotly_js_and_its_report_weighs_under_6_mb(tmp_path):
    (tmp_path / "text.txt").write_text(TEXT)
    out = tmp_path / "r"
    text = str(tmp_path / "text.txt")
    argv = ["organism-injured", "--texts", text, "--corpus", text, "--eval-corpus", text]
    argv += ["--allow-eval-on-train"]
    argv += ["--seq-len", "32", "--n-seqs", "8", "--train-seq-len", "32", "--n-eval-seqs", "4"]
    argv += ["--steps", "2", "--batch-size", "4", "--threads", "1", "--quiet"]
    assert repair_main([*argv, "--out", str(out)]) in (0, EXIT_DAMAGED, EXIT_WORSE)  # any verdict
    assert plotly_copies(out) == {PAGE: 1}
    assert figure_htmls(out) == []
    # The report; model/ holds the repaired weights, whose size is the model's.
    assert weight(out, skip="model") < 6 * MB, f"{weight(out, skip='model') / MB:.2f} MB"
    if plots.has_browser():
        check_page_in_chromium(out / PAGE)


@needs_organisms
@pytest.mark.slow
def test_blindness_folder_holds_one_plotly_js_and_weighs_under_6_mb(tmp_path):
    out = tmp_path / "b"
    argv = ["organism-injured", "--measure", "--seq-len", "64", "--n-seqs", "1"]
    argv += ["--dtypes", "float32", "--limit", "zero", "--threads", "1"]
    assert blindness_main([*argv, "--out", str(out)]) == 0
    assert plotly_copies(out) == {PAGE: 1}
    assert figure_htmls(out) == []
    assert weight(out) < 6 * MB, f"{weight(out) / MB:.2f} MB"


def classified():
    import pandas as pd

    census = pd.DataFrame(
        {
            "layer": [0, 0, 1, 1],
            "head": [0, 1, 0, 1],
            "bos_mass": [0.1, 0.7, 0.97, 0.3],
            "bos_mass_std": 0.01,
            "entropy": [2.0, 0.4, 0.1, 1.5],
            "output_share": 0.25,
        }
    )
    return classify_heads(census)


def test_html_asked_for_writes_each_figure_sharing_one_plotly_js(tmp_path):
    out = write_classification(classified(), tmp_path / "out", formats=("html",))
    # The one case of a second copy: the page's own, and the file the figures share.
    assert plotly_copies(out) == {PAGE: 1, "plotly-cartesian.min.js": 1}
    names = figure_htmls(out)
    assert names == sorted(
        f"{n}.html" for n in ("bos_mass", "labels", "entropy", "output_share", "threshold_sweep")
    )
    for name in names:
        assert '<script charset="utf-8" src="plotly-cartesian.min.js">' in (out / name).read_text()


@needs_browser
def test_a_figure_beyond_the_cartesian_bundle_makes_the_page_carry_the_full_one(tmp_path):
    df = classified()
    globe = go.Figure(go.Scatter3d(x=[0, 1], y=[0, 1], z=[0, 1]), layout={"title": "in 3D"})
    write_page(
        tmp_path,
        title="t",
        summary="",
        grid=plots.head_grid(df),
        shape=(2, 2),
        stages={"census": df},
        figures={"globe": globe},
    )
    assert plotly_copies(tmp_path) == {PAGE: 1}
    assert b"* plotly.js v" in (tmp_path / PAGE).read_bytes()[:200_000]  # the full bundle
    view = open_page(tmp_path / PAGE)
    assert view.errors == [] and view.figures[-1] == ("in 3D", True)
