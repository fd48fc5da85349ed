"""The vendored plotly.js cartesian bundle: the version of plotly.py's own plotly.js, and the
fallback to the full bundle for a trace it does not draw."""

from __future__ import annotations

import logging
import re

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from headsurgeon import plots
from headsurgeon.plots.export import CARTESIAN_BUNDLE

VERSION = re.compile(r"^\* plotly\.js (?:\(cartesian - minified\) )?v(\d+)\.(\d+)\.(\d+)$", re.M)


def test_the_vendored_bundle_is_plotly_pys_own_plotly_js_version():
    """On failure, refresh the bundle to the version this prints for plotly.py's plotly.js:
    ``npm pack plotly.js-cartesian-dist-min@X.Y.Z``, then copy ``package/plotly-cartesian.min.js``
    (licence header included) over ``headsurgeon/templates/plotly-cartesian.min.js``."""
    ours = VERSION.search(CARTESIAN_BUNDLE.read_text(encoding="utf-8")[:500])
    theirs = VERSION.search(get_plotlyjs()[:500])
    assert ours and theirs
    assert ours.groups()[:2] == theirs.groups()[:2], (
        f"vendored cartesian bundle v{'.'.join(ours.groups())}, plotly.py's plotly.js "
        f"v{'.'.join(theirs.groups())}"
    )
    assert "Licensed under the MIT license" in CARTESIAN_BUNDLE.read_text(encoding="utf-8")[:500]


def test_a_trace_beyond_the_cartesian_bundle_gets_the_full_plotly_js(caplog):
    grid = go.Figure(go.Heatmap(z=[[1, 2]]))
    assert plots.plotly_bundle([grid])[0] == "plotly-cartesian.min.js"
    with caplog.at_level(logging.INFO, logger="headsurgeon.plots.export"):
        name, script = plots.plotly_bundle([grid, go.Figure(go.Scatter3d(x=[1], y=[1], z=[1]))])
    assert name == "plotly.min.js" and script == get_plotlyjs()
    [line] = [r.getMessage() for r in caplog.records]
    assert "scatter3d" in line and "full plotly.js" in line
    assert plots.plotly_bundle([grid], traces=["parcoords"])[0] == "plotly.min.js"
    assert set(plots.CARTESIAN_TRACES) >= {"heatmap", "scatter", "bar"}
