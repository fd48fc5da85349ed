"""open_page waits for what each step needs (the page loaded, the grid drawn, the head shown), as
long as a busy machine takes and no longer than its bound: a grid drawn late is still clicked, a
grid never drawn is one FigureExportError line naming what was awaited, never a TypeError."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import NO_CHROMIUM

from headsurgeon import classify_heads, plots, run_census
from headsurgeon.errors import FigureExportError
from headsurgeon.loading import ModelShape, random_model
from headsurgeon.reports import PAGE, open_page, write_classification

pytestmark = [pytest.mark.skipif(not plots.has_browser(), reason=NO_CHROMIUM), pytest.mark.slow]

# The page's own lines that draw the grid and make its cells clickable.
DRAW = """Plotly.newPlot(grid, D.grid.data, D.grid.layout, CONFIG);
grid.on("plotly_click", e => { const p = e.points[0]; show(Math.round(p.y), Math.round(p.x)); });"""


def page_drawing_its_grid(tmp_path, how: str):
    """A classify page whose grid is drawn by ``how`` (``{draw}``: the page's own lines)."""
    model = random_model(ModelShape(n_layers=2, n_heads=2, d_model=16, d_vocab=64, n_ctx=16))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    census = classify_heads(run_census(model, tokens, progress=False))
    out = write_classification(census, tmp_path / "out", formats=(), model=model, tokens=tokens)
    page = out / PAGE
    text = page.read_text(encoding="utf-8")
    assert text.count(DRAW) == 1
    page.write_text(text.replace(DRAW, how.format(draw=DRAW)), encoding="utf-8")
    return page


def test_a_grid_drawn_two_seconds_late_is_waited_for_and_clicked(tmp_path):
    page = page_drawing_its_grid(tmp_path, "setTimeout(() => {{ {draw} }}, 2000);")
    view = open_page(page, "L1H0")
    assert (view.errors, view.shown) == ([], "L1H0")
    assert view.pattern is not None and view.figures[0][1]  # the grid, drawn


def test_a_grid_never_drawn_is_one_line_naming_what_was_awaited(tmp_path):
    """10 s, not 1: on a busy machine the page itself (plotly.js inlined, 1.5 MB) may take more
    than a second to load, and that wait has the same bound."""
    page = page_drawing_its_grid(tmp_path, "")
    start = time.monotonic()
    with pytest.raises(
        FigureExportError, match="waited 10 s for the page.s plots to be drawn"
    ) as e:
        open_page(page, "L1H0", timeout=10)
    assert "\n" not in str(e.value) and page.as_uri() in str(e.value)
    assert time.monotonic() - start < 40  # the bound, plus a browser start and a page load
