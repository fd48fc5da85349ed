"""Any number of corpora or models, and names that clash in the output folder.

plotly refuses a row of more than 21 panels at the old spacing (``horizontal_spacing`` above
``1 / (cols - 1)``), so 22 corpora crashed the writer after every census: models_grid now wraps
its panels onto rows. Corpus or model names that would be the same folder, a hidden one, or a file
of the output folder are refused in one line before anything is written, and by the classify tool
before any model is loaded.
"""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
import pytest
from conftest import TEXT, error_line

from headsurgeon import classify_heads, plots
from headsurgeon.cli.classify import main
from headsurgeon.domains import stack_corpora
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.reports import (
    classify as classify_report,
    corpora as corpora_report,
    write_corpora,
    write_cross_scale,
)


def classified(n_layers: int = 2, n_heads: int = 4, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    n = n_layers * n_heads
    census = pd.DataFrame(
        {
            "layer": np.repeat(range(n_layers), n_heads),
            "head": np.tile(range(n_heads), n_layers),
            "bos_mass": rng.random(n),
            "bos_mass_std": rng.random(n) / 10,
            "entropy": rng.random(n),
            "output_share": np.full(n, 1 / n_heads),
        }
    )
    return classify_heads(census)


def panels(fig) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """Each heatmap's (x domain, y domain)."""
    found = []
    for trace in fig.data:
        if trace.type == "heatmap":
            x = fig.layout["xaxis" + trace.xaxis[1:]].domain
            y = fig.layout["yaxis" + trace.yaxis[1:]].domain
            found.append((tuple(x), tuple(y)))
    return found


@pytest.mark.parametrize("n", [2, 6, 7, 22, 25, 61])
def test_corpora_grid_lays_out_any_number_of_corpora(n):
    compared = stack_corpora({f"corpus-{i}": classified(seed=i) for i in range(n)})
    fig = plots.corpora_grid(compared)
    boxes = panels(fig)
    assert len(boxes) == n
    rows = sorted({y for _, y in boxes}, reverse=True)
    assert len(rows) == -(-n // plots.grids.PANELS_PER_ROW)
    for row in rows:  # the panels of a row do not overlap, nor do the rows
        xs = sorted(x for x, y in boxes if y == row)
        assert all(a[1] <= b[0] for a, b in zip(xs, xs[1:], strict=False))
    assert all(a[0] >= b[1] for a, b in zip(rows, rows[1:], strict=False))
    assert all(0 <= lo < hi <= 1 for box in boxes for lo, hi in box)


def test_models_grid_keeps_cells_equal_across_rows_and_shapes():
    shapes = [(2, 4), (4, 8), (6, 4), (2, 8), (4, 4), (6, 8), (2, 4), (4, 8), (6, 4)]
    dfs = {f"m{i}": classified(*shape, seed=i) for i, shape in enumerate(shapes)}
    fig = plots.models_grid(dfs)
    widths, heights = set(), set()
    for ((x0, x1), (y0, y1)), (n_layers, n_heads) in zip(panels(fig), shapes, strict=True):
        widths.add(round((x1 - x0) * fig.layout.width / n_heads, 6))
        heights.add(round((y1 - y0) * fig.layout.height / n_layers, 6))
    assert len(widths) == 1 and len(heights) == 1


def test_zero_fraction_plot_takes_many_dtypes():
    rows = [
        {"head": 0, "dtype": f"d{i}", "distance_lo": 1, "distance_hi": 2, "entries": 10}
        | {"zero_entries": 1}
        for i in range(30)
    ]
    assert len(plots.zero_fraction_plot(pd.DataFrame(rows)).data) == 30


@pytest.mark.parametrize(
    ("names", "words"),
    [
        (["a", "heads.csv"], "'heads.csv' gives the folder name 'heads.csv', which is the name"),
        (["a", "Index.HTML"], "a file the output folder holds (index.html)"),
        (["a", "bos_mass_corpora.png"], "(bos_mass_corpora.png)"),
        (["a", "b", "bos_mass_diff_b.svg"], "(bos_mass_diff_b.svg)"),
        (["a", "delta_loss_diff.pdf"], "(delta_loss_diff.pdf)"),
        (["a", "plotly-cartesian.min.js"], "(plotly-cartesian.min.js)"),
        (["a", "A"], "'a' and 'A' would share an output folder name, 'A'"),
        (["x/a", "y/a"], "'x/a' and 'y/a' would share an output folder name"),
        (["a", ".."], "'..', which would be hidden or no folder"),
        (["a", "."], "hidden or no folder"),
        (["a", ".hidden"], "hidden or no folder"),
    ],
)
def test_corpus_names_that_clash_are_refused_before_anything_is_written(names, words, tmp_path):
    compared = stack_corpora({name: classified() for name in names})
    with pytest.raises(InvalidArgumentError) as caught:
        write_corpora(compared, tmp_path / "out", formats=())
    assert words in str(caught.value) and "\n" not in str(caught.value)
    assert not list(tmp_path.iterdir())
    with pytest.raises(InvalidArgumentError, match="rename"):
        corpora_report.corpus_folders(names)


def test_model_names_that_clash_in_the_cross_scale_folder_are_refused(tmp_path):
    for names in (["m", "x/summary.txt"], ["m", "sick_share.html"], ["a/M", "b/m"], ["m", ".."]):
        with pytest.raises(InvalidArgumentError, match="rename"):
            write_cross_scale({name: classified() for name in names}, tmp_path / "out")
        assert not list(tmp_path.iterdir())
    folders = classify_report.cross_scale_folders(["org/m-1", "m 2"])
    assert folders == {"m-1": "org/m-1", "m-2": "m 2"}


@pytest.mark.parametrize("clash", ["heads.csv", "index.html", "bos_mass_corpora.png"])
def test_cli_corpus_named_as_a_file_of_the_folder_is_refused_before_loading(
    clash, no_model, tmp_path, capsys
):
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / f"{clash}.txt").write_text(TEXT)
    argv = ["organism", "--texts", tmp_path / "a.txt", "--texts", tmp_path / f"{clash}.txt"]
    line = error_line(main, [*argv, "--out", tmp_path / "out"], capsys)
    assert f"the corpus {clash!r} gives the folder name {clash!r}" in line
    assert not (tmp_path / "out").exists()


def test_write_corpora_without_a_browser_warns_once_for_the_whole_folder(
    no_browser, tmp_path, caplog
):
    compared = stack_corpora({"a": classified(), "b": classified(seed=1)})
    out = write_corpora(compared, tmp_path / "out")
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    # 5 figures in each corpus's folder, the difference and the corpora side by side
    assert lines[0].startswith(f"warning: skipped 12 static figures in {out}/ (*.png): ")
    assert ".tmp-" not in lines[0]
    assert not list(out.rglob("*.png")) and (out / "a" / "heads.csv").exists()
