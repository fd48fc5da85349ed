"""Figures: the right cells, markers and hover data; export errors that name the fix."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from headsurgeon import classify_heads, plots, threshold_sweep
from headsurgeon.errors import FigureExportError, InvalidArgumentError


def classified(n_layers=3, n_heads=4, seed=0, sinks=((1, 3),), dead=((2, 2),)):
    rng = np.random.default_rng(seed)
    layer, head = np.divmod(np.arange(n_layers * n_heads), n_heads)
    df = pd.DataFrame(
        {
            "layer": layer,
            "head": head,
            "bos_mass": rng.random(layer.size) * 0.4,
            "bos_mass_std": 0.01,
            "entropy": rng.random(layer.size) * 3,
            "output_share": 0.2 + rng.random(layer.size) * 0.1,
        }
    )
    for heads, mass in ((sinks, 0.8), (dead, 0.99)):
        for layer_index, head_index in heads:
            df.loc[(df["layer"] == layer_index) & (df["head"] == head_index), "bos_mass"] = mass
    df.attrs = {
        "model": "toy",
        "n_seqs": 4,
        "seq_len": 16,
        "prepend_bos": False,
        "min_query_pos": 1,
    }
    return classify_heads(df)


def markers(fig):
    return {t.legendgroup: set(zip(t.y, t.x, strict=True)) for t in fig.data if t.type == "scatter"}


def test_head_grid_places_cells_markers_and_hover():
    df = classified()
    fig = plots.head_grid(df, "entropy")
    assert isinstance(fig, go.Figure)
    heat = fig.data[0]
    z = np.asarray(heat.z)
    assert z.shape == (3, 4)
    assert z[1, 2] == df.query("layer == 1 and head == 2")["entropy"].item()
    assert markers(fig) == {"BOS-sink": {(1, 3)}, "dead": {(2, 2)}}
    for field in ("bos_mass", "entropy", "output_share", "bos_mass_std"):
        assert plots.column_label(field) in heat.hovertemplate
    assert heat.customdata[1][3][0] == "BOS-sink"  # label first in every cell's hover data
    bos = plots.head_grid(df)
    assert (bos.data[0].zmin, bos.data[0].zmax) == (0.0, 1.0)
    assert bos.layout.yaxis.range == (2.5, -0.5)  # layer 0 on top
    assert bos.layout.width < 800 and bos.layout.font.size >= 14


def test_label_grid_encodes_every_label():
    df = classified()
    fig = plots.label_grid(df)
    z = np.asarray(fig.data[0].z)
    assert z[1, 3] == 1 and z[2, 2] == 2 and z[0, 0] == 0
    names = [t.name for t in fig.data if t.showlegend is not False and t.type == "scatter"]
    assert names == ["healthy (10)", "BOS-sink ○ (1)", "dead × (1)"]
    with pytest.raises(InvalidArgumentError, match="labels"):
        plots.label_grid(df.assign(label="zombie"))


def test_diff_grid_shows_change_and_outlines_relabelled_heads():
    before = classified()
    after = classify_heads(before.drop(columns=["label", "reason"]).assign(bos_mass=0.1))
    fig = plots.diff_grid(before, after.sample(frac=1, random_state=0))  # row order must not matter
    z = np.asarray(fig.data[0].z)
    expected = 0.1 - before.set_index(["layer", "head"])["bos_mass"].unstack().to_numpy()
    np.testing.assert_allclose(z, expected)
    assert fig.data[0].zmid == 0 and fig.data[0].zmin == -fig.data[0].zmax
    assert set(zip(fig.data[1].y, fig.data[1].x, strict=True)) == {(1, 3), (2, 2)}
    with pytest.raises(InvalidArgumentError, match="different heads"):
        plots.diff_grid(before, after.iloc[1:])


def test_diff_grids_shown_together_share_one_stated_colour_scale():
    before = classified()
    large = before.assign(bos_mass=before["bos_mass"] + 0.5)
    small = before.assign(bos_mass=before["bos_mass"] - 0.05)
    assert plots.diff_bound([(before, large), (before, small)]) == pytest.approx(0.5)
    alone = plots.diff_grid(before, small)
    assert alone.data[0].zmax == pytest.approx(0.05)
    assert "colour scale ±0.05 (the largest change)" in alone.layout.title.subtitle.text
    fig = plots.diff_grid(before, small, bound=0.5)
    assert (fig.data[0].zmin, fig.data[0].zmax) == (-0.5, 0.5)
    assert "colour scale ±0.5 (fixed" in fig.layout.title.subtitle.text
    for bad in (0, -1, float("nan")):
        with pytest.raises(InvalidArgumentError, match="bound must be a change above 0"):
            plots.diff_grid(before, small, bound=bad)


def test_sweep_plot_has_a_panel_per_threshold():
    sweep = threshold_sweep(classified())
    fig = plots.sweep_plot(sweep)
    panels = {t.xaxis for t in fig.data}
    assert panels == {"x", "x2", "x3"}
    assert fig.layout.xaxis3.type == "log"
    assert [s.x0 for s in fig.layout.shapes] == [0.5, 0.95, 0.01]


def test_models_grid_shares_one_colour_scale():
    fig = plots.models_grid({"small": classified(), "large": classified(4, 8, sinks=((3, 7),))})
    heatmaps = [t for t in fig.data if t.type == "heatmap"]
    assert [np.asarray(h.z).shape for h in heatmaps] == [(3, 4), (4, 8)]
    assert {h.coloraxis for h in heatmaps} == {"coloraxis"}
    assert (fig.layout.coloraxis.cmin, fig.layout.coloraxis.cmax) == (0.0, 1.0)
    assert fig.layout.yaxis.domain == (0.25, 1.0)  # 3 of 4 layers tall: equal cell heights
    with pytest.raises(InvalidArgumentError):
        plots.models_grid({})


def test_models_grid_legend_once_per_label_from_the_first_labelled_panel():
    census_only = classified().drop(columns="label")
    fig = plots.models_grid({"census": census_only, "a": classified(), "b": classified()})
    shown = [t.name for t in fig.data if t.type == "scatter" and t.showlegend]
    assert sorted(shown) == sorted(plots.LABEL_MARKERS)


def test_figures_refuse_frames_without_the_metric():
    with pytest.raises(InvalidArgumentError, match="lacks column"):
        plots.head_grid(classified(), "no_such_metric")


def test_save_figure_formats_and_errors(tmp_path, monkeypatch):
    fig = plots.head_grid(classified())
    path = plots.save_figure(fig, tmp_path / "grid.html")
    # Self-contained, with plotly.js's cartesian bundle (1.5 MB), not the full one (4.8 MB).
    assert "plotly.js (cartesian" in path.read_text()[:5000]
    assert 1_000_000 < path.stat().st_size < 2_000_000
    plots.save_figure(fig, tmp_path / "small.html", include_plotlyjs="directory")
    assert 'src="plotly-cartesian.min.js"' in (tmp_path / "small.html").read_text()
    with pytest.raises(InvalidArgumentError, match="suffix"):
        plots.save_figure(fig, tmp_path / "grid.gif")
    monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "no-browser"))
    with pytest.raises(FigureExportError, match="apt-get install -y chromium"):
        plots.save_figure(fig, tmp_path / "grid.png")
    monkeypatch.delenv("BROWSER_PATH")
    from choreographer.browsers.chromium import Chromium

    monkeypatch.setattr(Chromium, "find_browser", classmethod(lambda cls, **kwargs: None))
    with pytest.raises(FigureExportError, match="none found.*apt-get install -y chromium"):
        plots.save_figure(fig, tmp_path / "grid.pdf")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "grid.html",
        "plotly-cartesian.min.js",
        "small.html",
    ]
