"""Names in figure text (issue 41, figure titles): a model or corpus named like markup, or with
control characters, shows as written in titles, subtitles, panel titles and hover labels, and
a static export still works."""

from __future__ import annotations

import pytest
from test_plots import classified

from headsurgeon import plots

HOSTILE = "<img src=x> <b>x</b> <!--\x1b[31m\x07"
ESCAPED = "&lt;img src=x&gt; &lt;b&gt;x&lt;/b&gt; &lt;!--\\x1b[31m\\x07"


def hostile_census():
    census = classified()
    census.attrs["model"] = HOSTILE
    return census


def test_a_model_named_like_markup_shows_literally_in_a_grid():
    census = hostile_census()
    fig = plots.head_grid(census)
    assert (
        ESCAPED in fig.layout.title.subtitle.text and "<img" not in fig.layout.title.subtitle.text
    )
    titled = plots.head_grid(census, title=f"BOS mass of {HOSTILE}")
    assert titled.layout.title.text == f"BOS mass of {ESCAPED}"


def test_a_model_named_like_markup_shows_literally_across_models():
    fig = plots.models_grid({HOSTILE: hostile_census(), "plain": classified()})
    panel_titles = [a.text for a in fig.layout.annotations]
    assert panel_titles[0].startswith(ESCAPED) and not any("<img" in t for t in panel_titles)
    assert all("<img" not in (t.hovertemplate or "") for t in fig.data)


def test_subtitle_lines_stay_lines_and_names_stay_text():
    fig = plots.style(plots.head_grid(classified()), title="t", subtitle=["a <br> b", "c & d"])
    assert fig.layout.title.subtitle.text == "a &lt;br&gt; b<br>c &amp; d"


@pytest.mark.skipif(not plots.has_browser(), reason="a static export needs Chromium")
def test_control_characters_in_a_name_do_not_stop_a_static_export(tmp_path):
    path = plots.save_figure(plots.head_grid(hostile_census()), tmp_path / "grid.png")
    assert path.stat().st_size > 0
