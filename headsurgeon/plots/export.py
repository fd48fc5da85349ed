"""Figure files: html, and png, svg and pdf through kaleido and a Chromium browser.

Exports:
    save_figure(fig, path)             .html, .png, .svg or .pdf, written atomically
    save_figures(figs, folder, fmts)   every figure in every format; static ones skipped
                                       without a browser (see split_formats)
    split_formats(formats)             the formats to write and the static ones to skip
    require_browser(what)              FigureExportError (one line, the fix) without Chromium
    has_browser()                      whether static figures can be written here
    warn_skipped(names, folder)        the one warning line about skipped static figures
    FORMATS, STATIC_FORMATS            the formats save_figure writes; those needing Chromium
    image_bytes(fig, fmt, scale)       static image bytes through kaleido (one Chromium kept)
    quiet_browser_exit()               silence choreographer's exit noise (once)

>>> split_formats(["html"])
(['html'], [])

:func:`save_figure` writes one figure, its format given by the path's suffix, atomically.
Static formats (png, svg, pdf) go through kaleido and a Chromium browser (the system one, or
``BROWSER_PATH``); html needs nothing. Writers that take ``formats`` (:func:`save_figures`,
``reports.write_classification``, ``reports.write_report``) follow one rule
(:func:`split_formats`): ``formats=None`` (the default) writes html, and png when a browser is
found; without one the PNGs are skipped and one warning names them and the fix
(:func:`warn_skipped`). Formats given explicitly are all required: a static one without a
browser raises :class:`~headsurgeon.errors.FigureExportError` before anything is written.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import plotly.graph_objects as go

from headsurgeon.errors import FigureExportError, InvalidArgumentError
from headsurgeon.outputs import atomic_write_bytes, atomic_write_text

logger = logging.getLogger(__name__)

__all__ = [
    "FORMATS",
    "STATIC_FORMATS",
    "has_browser",
    "require_browser",
    "save_figure",
    "save_figures",
    "split_formats",
    "warn_skipped",
    "image_bytes",
    "quiet_browser_exit",
]

FORMATS = ("html", "png", "svg", "pdf")
STATIC_FORMATS = ("png", "svg", "pdf")  # written through kaleido and a Chromium browser
# Written by default: html always, png when a browser is found (see split_formats).
DEFAULT_FORMATS = ("html", "png")
# The fix named wherever a static figure cannot be written.
INSTALL_BROWSER = "install Chromium (apt-get install -y chromium) or set BROWSER_PATH"


def _browser() -> tuple[str | None, str]:
    """``(path, "")`` of the Chromium kaleido will use, or ``(None, "none found")`` (or why
    ``BROWSER_PATH`` cannot be used).

    ``BROWSER_PATH`` wins (as in choreographer); else choreographer's search: a browser it
    downloaded, the Chrome/Chromium/Edge/Brave/Vivaldi names on ``PATH``, their usual paths.
    """
    configured = os.environ.get("BROWSER_PATH")
    if configured:
        if not os.access(configured, os.X_OK):
            return None, f"BROWSER_PATH={configured} is not an executable"
        return configured, ""
    from choreographer.browsers.chromium import Chromium

    found = Chromium.find_browser(skip_local=False)
    if found is None:
        return None, "none found"
    return found, ""


def has_browser() -> bool:
    """Whether static figures (png, svg, pdf) can be written here: a Chromium was found."""
    return _browser()[0] is not None


def require_browser(what: str = "static figure export", *, instead: str = "save as .html") -> str:
    """The browser's path; without one, :class:`FigureExportError` in one line with the fix.

    ``what`` names what needs it (``"--format pdf"``); ``instead`` is the way around it.
    """
    path, why = _browser()
    if path is None:
        raise FigureExportError(
            f"{what} needs a Chromium browser, {why}; {INSTALL_BROWSER}, or {instead}"
        )
    return path


_server = {"running": False}


class _ByeFilter(logging.Filter):
    """Drop choreographer's traceback about the ``{bye}`` its Chromium wrapper sends on exit.

    When a browser closes, choreographer's wrapper process writes ``{bye}`` to the pipe as an
    end marker. If Chromium's last event and that marker arrive in one read (the reader thread
    lagging a little, as on a busy machine), the reader waits for a message end that never
    comes until the channel is closed, then parses the marker as JSON and logs
    ``JSONError decoding message. Ignoring`` with a ``simplejson`` traceback, at interpreter
    exit. The events are delivered; only the marker is misread. Every other record, and every
    other JSON error, passes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if isinstance(record.exc_info, tuple) else None
        document = getattr(getattr(error, "__cause__", None), "doc", None)
        return not (
            record.getMessage().startswith("JSONError decoding message")
            and isinstance(document, str)
            and document.strip() == "{bye}"
        )


def quiet_browser_exit() -> None:
    """Install :class:`_ByeFilter` on choreographer's pipe logger (once)."""
    pipe_logger = logging.getLogger("choreographer.channels.pipe")
    if not any(isinstance(f, _ByeFilter) for f in pipe_logger.filters):
        pipe_logger.addFilter(_ByeFilter())


def image_bytes(fig: go.Figure, fmt: str, scale: float) -> bytes:
    """Static image bytes through kaleido; one Chromium is kept running for later exports."""
    import kaleido

    require_browser(f"saving a figure as {fmt}")  # fail with the fix, not deep inside kaleido
    if not _server["running"]:
        quiet_browser_exit()
        kaleido.start_sync_server(silence_warnings=True)  # ~0.3 s per image after the first
        _server["running"] = True
    layout = fig.layout
    opts = {"format": fmt, "width": layout.width or 700, "height": layout.height or 500}
    try:
        return kaleido.calc_fig_sync(fig, opts=opts | {"scale": scale})
    except Exception as e:  # kaleido and choreographer raise many types
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise FigureExportError(f"kaleido could not export the figure as {fmt} ({first})") from e


def save_figure(
    fig: go.Figure,
    path: str | os.PathLike,
    *,
    scale: float = 2.0,
    include_plotlyjs: bool | str = True,
) -> Path:
    """Write ``fig`` to ``path``, the format given by its suffix; return the path.

    ``.html`` is interactive (self-contained by default; ``include_plotlyjs="directory"`` writes
    one shared ``plotly.min.js`` beside it instead). ``.png`` (at ``scale`` times the figure's
    pixel size), ``.svg`` and ``.pdf`` go through kaleido and a Chromium browser (the system one,
    or ``BROWSER_PATH``). The file appears whole or not at all.
    """
    if not isinstance(fig, go.Figure):
        raise InvalidArgumentError(
            f"save_figure takes a plotly Figure (what the plot functions return), got "
            f"{type(fig).__name__}"
        )
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(f"save_figure needs a file path, got {type(path).__name__}")
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise InvalidArgumentError(
            f"cannot save a figure as {path.name!r}; use a suffix of {', '.join(FORMATS)}"
        )
    if fmt == "html":
        html = fig.to_html(
            include_plotlyjs=include_plotlyjs, full_html=True, config={"displaylogo": False}
        )
        if include_plotlyjs == "directory" and not (path.parent / "plotly.min.js").exists():
            from plotly.offline import get_plotlyjs

            atomic_write_text(path.parent / "plotly.min.js", get_plotlyjs())
        atomic_write_text(path, html)
    else:
        atomic_write_bytes(path, image_bytes(fig, fmt, scale))
    logger.debug("wrote %s", path)
    return path


def split_formats(formats: Sequence[str] | None = None) -> tuple[list[str], list[str]]:
    """The figure formats to write and the static ones to skip: ``(write, skipped)``.

    ``None`` asks for :data:`DEFAULT_FORMATS`: html always, png when a Chromium browser is
    found, else png is skipped. Formats given explicitly are all written: an unknown one raises
    :class:`InvalidArgumentError`, a static one without a browser :class:`FigureExportError`
    (one line with the fix). Call it before writing anything, so that either fails first.

    >>> split_formats(["html"])
    (['html'], [])
    """
    if formats is None:
        if has_browser():
            return list(DEFAULT_FORMATS), []
        return [f for f in DEFAULT_FORMATS if f not in STATIC_FORMATS], ["png"]
    if isinstance(formats, str):
        formats = [formats]
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise InvalidArgumentError(
            f"unknown figure format(s) {', '.join(unknown)}; use {', '.join(FORMATS)}"
        )
    write = list(dict.fromkeys(formats))
    static = [f for f in write if f in STATIC_FORMATS]
    if static:
        require_browser(
            f"figure format(s) {', '.join(static)}",
            instead="leave formats at their default (html, and png when a browser is found)",
        )
    return write, []


def save_figures(
    figures: Mapping[str, go.Figure],
    folder: str | os.PathLike,
    formats: Sequence[str] | None = None,
    *,
    scale: float = 2.0,
    include_plotlyjs: bool | str = "directory",
) -> list[str]:
    """Write each figure as ``folder/<name>.<format>``; return the file names skipped.

    ``formats`` follows :func:`split_formats`: by default html, and png when a browser is found
    (the PNGs are skipped, and returned, when none is). The writers of this package then log
    :func:`warn_skipped` once the folder is complete.
    """
    write, skipped = split_formats(formats)
    folder = Path(folder)
    for name, figure in figures.items():
        for fmt in write:
            save_figure(
                figure, folder / f"{name}.{fmt}", scale=scale, include_plotlyjs=include_plotlyjs
            )
    return [f"{name}.{fmt}" for fmt in skipped for name in figures]


def _file_list(names: Sequence[str], most: int = 6) -> str:
    """``a.png, b.png`` for a few names, ``*.png`` patterns with counts for many.

    >>> _file_list(["a.png", "b.png"]), _file_list([f"{i}.png" for i in range(9)])
    ('a.png, b.png', '*.png')
    """
    if len(names) <= most:
        return ", ".join(names)
    suffixes = dict.fromkeys(Path(n).suffix for n in names)
    return ", ".join(f"*{suffix}" for suffix in suffixes)


def warn_skipped(names: Sequence[str], folder: str | os.PathLike) -> str | None:
    """Log one warning line naming the static figures skipped in ``folder``, and the fix.

    Returns the line (``None`` when nothing was skipped).
    """
    if not names:
        return None
    why = _browser()[1] or "the browser could not be used"
    plural, them = ("s", "them") if len(names) > 1 else ("", "it")
    message = (
        f"warning: skipped {len(names)} static figure{plural} in {Path(folder)}/ "
        f"({_file_list(names)}): no Chromium browser for kaleido ({why}); to write {them}, "
        f"{INSTALL_BROWSER} and run again, or export {them} from the .html figure{plural} "
        "(camera button)"
    )
    logger.warning(message)
    return message
