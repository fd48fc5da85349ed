"""The notebook output of a figure: plotly's own, plus HTML and a PNG that show without plotly.js.

>>> @notebook_figure
... def empty() -> go.Figure:
...     return go.Figure()
>>> type(empty()).__name__, isinstance(empty(), go.Figure)
('Figure', True)

Every figure function of :mod:`headsurgeon.plots` returns a :class:`Figure` (through
:func:`notebook_figure`). In Jupyter it shows through the user's plotly renderer as usual
(interactive, ``application/vnd.plotly.v1+json``) and its output also carries ``text/html``
(plotly.js from the CDN, with the PNG inside as a fallback) and ``image/png`` (when a browser is
found, rendered by :mod:`headsurgeon.plots.export`), so it still shows where the notebook is
viewed as a file: GitHub, nbviewer, an HTML export. ``NOTEBOOK_OUTPUTS`` chooses these extra
representations (``()`` for plotly's own output only: ``from headsurgeon.plots import notebook;
notebook.NOTEBOOK_OUTPUTS = ()``); plotly's settings (``plotly.io.renderers``) are never changed.
"""

from __future__ import annotations

import base64
import functools
import logging
import re
import uuid
from collections.abc import Callable
from html import escape, unescape

import plotly.graph_objects as go

from headsurgeon.errors import FigureExportError
from headsurgeon.plots.export import has_browser, image_bytes

logger = logging.getLogger(__name__)

__all__ = [
    "NOTEBOOK_OUTPUTS",
    "Figure",
]

# What a Figure's notebook output carries besides the plotly renderer's own representation.
NOTEBOOK_OUTPUTS = ("text/html", "image/png")
NOTEBOOK_SCALE = 1.0  # pixel scale of the notebook PNG (1: the figure's own size, small files)


class Figure(go.Figure):
    """A plotly figure whose notebook output also shows where no plotly.js runs.

    Plotly's Jupyter output is its JSON mime type only, which GitHub, nbviewer and HTML exports
    do not draw. Shown in Jupyter (as a cell's value or with :meth:`show`), this figure's output
    keeps whatever the user's plotly renderer produces and adds the representations named in
    :data:`NOTEBOOK_OUTPUTS`: ``text/html`` (the interactive figure, plotly.js from the CDN, with
    the PNG inside until it draws) and ``image/png`` (when a Chromium browser is found; rendered
    through kaleido, ~0.3 s a figure). An explicit ``show(renderer=...)``, an external renderer
    (a browser window) and code outside Jupyter get plotly's behaviour unchanged.
    """

    def _repr_mimebundle_(self, include=None, exclude=None, validate=True, **kwargs):
        bundle = super()._repr_mimebundle_(include, exclude, validate, **kwargs)
        return _with_static_outputs(self, bundle) if bundle else bundle

    def _ipython_display_(self):
        import plotly.io as pio

        if pio.renderers.render_on_display and pio.renderers.default:
            self.show()
        else:
            print(repr(self))

    def show(self, *args, **kwargs):
        """Display the figure (see :meth:`plotly.graph_objects.Figure.show`)."""
        bundle = None
        if not args and kwargs.get("renderer") is None and mimetype_renderers_in_ipython():
            kwargs.pop("renderer", None)
            bundle = self._repr_mimebundle_(**kwargs)
        if not bundle:
            return super().show(*args, **kwargs)
        from IPython.display import display

        display(bundle, raw=True)
        return None


def mimetype_renderers_in_ipython() -> bool:
    """Whether plotly's default renderers all produce notebook output, inside IPython."""
    import plotly.io as pio
    from plotly.io.base_renderers import MimetypeRenderer

    try:
        from IPython import get_ipython
    except ImportError:
        return False
    names = [name for name in (pio.renderers.default or "").split("+") if name]
    return (
        get_ipython() is not None
        and bool(names)
        and all(isinstance(pio.renderers[name], MimetypeRenderer) for name in names)
    )


def _with_static_outputs(fig: go.Figure, bundle: dict) -> dict:
    """``bundle`` plus the ``text/html`` and ``image/png`` of :data:`NOTEBOOK_OUTPUTS`."""
    bundle = dict(bundle)
    png = bundle.get("image/png")
    if png is None and "image/png" in NOTEBOOK_OUTPUTS and has_browser():
        try:
            png = base64.b64encode(image_bytes(fig, "png", NOTEBOOK_SCALE)).decode("ascii")
        except FigureExportError as e:
            logger.debug("no notebook PNG: %s", e)
        else:
            bundle["image/png"] = png
    if "text/html" not in bundle and "text/html" in NOTEBOOK_OUTPUTS:
        bundle["text/html"] = _notebook_html(fig, png)
    return bundle


def _notebook_html(fig: go.Figure, png: str | None) -> str:
    """The interactive figure (plotly.js from the CDN) as an HTML fragment.

    Where scripts do not run (GitHub) or the CDN cannot be reached, ``png`` (base64) shows in
    the figure's place; plotly.js removes it once the figure is drawn.
    """
    div_id = f"headsurgeon-{uuid.uuid4().hex[:16]}"
    drawn = "var i = document.getElementById('{plot_id}-png'); if (i) { i.remove(); }"
    html = fig.to_html(
        full_html=False,
        include_plotlyjs="cdn",
        div_id=div_id,
        config={"displaylogo": False},
        post_script=drawn,
    )
    if png is not None:
        width, height = fig.layout.width, fig.layout.height
        size = f' width="{width}" height="{height}"' if width and height else ""
        alt = escape(unescape(re.sub(r"<[^>]+>", "", fig.layout.title.text or "figure")))
        image = f'<img id="{div_id}-png" src="data:image/png;base64,{png}" alt="{alt}"{size}>'
        empty_div = re.compile(rf'(<div id="{div_id}"[^>]*>)(</div>)')
        html = empty_div.sub(lambda m: m[1] + image + m[2], html, count=1)
    return html


def notebook_figure(make: Callable[..., go.Figure]) -> Callable[..., Figure]:
    """Decorator: the figure ``make`` returns, as a :class:`Figure`."""

    @functools.wraps(make)
    def wrapper(*args, **kwargs) -> Figure:
        fig = make(*args, **kwargs)
        if type(fig) is go.Figure:
            # A fresh figure of ours: retype it in place (Figure adds methods, no state), which
            # costs nothing, where Figure(fig) would copy and validate every trace again.
            fig.__class__ = Figure
        return fig

    return wrapper
