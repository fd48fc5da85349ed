"""Figure files: html, and png, svg and pdf through kaleido and a Chromium browser.

>>> split_formats(["html"])
(['html'], [])

:func:`save_figure` writes one figure, its format given by the path's suffix, atomically.
Static formats (png, svg, pdf) go through kaleido and a Chromium browser (the system one, or
``BROWSER_PATH``); html needs nothing. Writers that take ``formats`` (:func:`save_figures`,
``reports.write_classification``, ``reports.write_report``) follow one rule
(:func:`split_formats`): ``formats=None`` (the default) writes png when a browser is found and
no HTML figure (the folder's ``index.html`` holds every figure interactively); without a
browser the PNGs are skipped and one warning names them and the fix (:func:`warn_skipped`).
Formats given explicitly are all required: a static one without a browser raises
:class:`~headsurgeon.errors.FigureExportError` before anything is written. A browser that does
not start within ``HEADSURGEON_BROWSER_TIMEOUT`` seconds (30 by default; under an address-space
limit, or a ``BROWSER_PATH`` that is no browser) counts as none, for the rest of the process.

HTML carries plotly.js, 4.8 MB in full; :func:`plotly_bundle` picks plotly.js's official
cartesian bundle (1.5 MB, vendored as ``headsurgeon/templates/plotly-cartesian.min.js``) when it
draws every trace, which it does for every figure of this package.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import math
import os
import signal
import subprocess
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from headsurgeon.errors import FigureExportError, InvalidArgumentError
from headsurgeon.outputs import atomic_write_bytes, atomic_write_text

logger = logging.getLogger(__name__)

__all__ = [
    "save_figure",
    "save_figures",
]

FORMATS = ("html", "png", "svg", "pdf")
STATIC_FORMATS = ("png", "svg", "pdf")  # written through kaleido and a Chromium browser
# Written by default: png when a browser is found (see split_formats); the writers' index.html
# holds every figure interactively, so a second HTML copy of each figure is asked for.
DEFAULT_FORMATS = ("png",)
# plotly.js's cartesian partial bundle (npm plotly.js-cartesian-dist-min, MIT, licence header
# kept), the version of the plotly.js inside plotly.py (tests/plots/test_bundle.py holds them
# equal and says how to refresh it), and the trace types it draws.
CARTESIAN_BUNDLE = Path(__file__).parents[1] / "templates" / "plotly-cartesian.min.js"
CARTESIAN_TRACES = frozenset(
    {
        "bar",
        "box",
        "contour",
        "heatmap",
        "histogram",
        "histogram2d",
        "histogram2dcontour",
        "image",
        "pie",
        "scatter",
        "scatterternary",
        "violin",
    }
)
FULL_BUNDLE = "plotly.min.js"
# The fix named wherever a static figure cannot be written.
INSTALL_BROWSER = "install Chromium (apt-get install -y chromium) or set BROWSER_PATH"


def _browser() -> tuple[str | None, str]:
    """``(path, "")`` of the Chromium kaleido will use, or ``(None, "none found")`` (or why
    ``BROWSER_PATH`` cannot be used, or why that browser did not start in this process).

    ``BROWSER_PATH`` wins (as in choreographer); else choreographer's search: a browser it
    downloaded, the Chrome/Chromium/Edge/Brave/Vivaldi names on ``PATH``, their usual paths.
    """
    found = os.environ.get("BROWSER_PATH")
    if found:
        if not os.access(found, os.X_OK):
            return None, f"BROWSER_PATH={found} is not an executable"
    else:
        from choreographer.browsers.chromium import Chromium

        found = Chromium.find_browser(skip_local=False)
        if found is None:
            return None, "none found"
    if found in _failed:
        return None, _failed[found]
    return found, ""


def has_browser() -> bool:
    """Whether static figures (png, svg, pdf) can be written here: a Chromium was found (and
    did not fail to start in this process; :func:`start_browser` starts it)."""
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


# How long a Chromium may take to start before it counts as none, in seconds (the environment
# variable sets it). A healthy one starts in a second or two; one that cannot start (under an
# address-space limit, or a BROWSER_PATH that is no browser) would otherwise hold the tool.
START_TIMEOUT_VAR = "HEADSURGEON_BROWSER_TIMEOUT"
START_TIMEOUT = 30.0
# The longest wait for one image once the browser runs: kaleido's own limit (90 s) and a margin.
RENDER_TIMEOUT = 120.0
# The Chromium kaleido renders with: started once a process, kept for later exports (~0.3 s an
# image after the first), closed at exit. A start that failed is remembered by browser path, so
# that a run's later figures do not wait for it again.
_chromium: dict[str, Any] = {"kaleido": None, "loop": None, "thread": None}
_failed: dict[str, str] = {}
_starting = threading.Lock()


def start_timeout() -> float:
    """Seconds a browser start may take: ``HEADSURGEON_BROWSER_TIMEOUT``, else
    :data:`START_TIMEOUT` (30); a value that is no number of seconds above 0 raises
    :class:`InvalidArgumentError` in one line."""
    raw = os.environ.get(START_TIMEOUT_VAR, "").strip()
    if not raw:
        return START_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise InvalidArgumentError(
            f"{START_TIMEOUT_VAR}={raw!r} is not a number of seconds above 0; unset it for "
            f"{START_TIMEOUT:g} s"
        )
    return seconds


def start_browser(what: str = "static figure export", *, instead: str = "save as .html") -> None:
    """Start the Chromium kaleido renders with, once a process and in bounded time.

    A browser that is not found, or does not start within ``HEADSURGEON_BROWSER_TIMEOUT``
    seconds (30 by default), raises :class:`FigureExportError` in one line (``what`` and
    ``instead`` as in :func:`require_browser`); a failed start is remembered, so
    :func:`has_browser` is then False and later calls fail at once.
    """
    path = require_browser(what, instead=instead)
    with _starting:
        if _chromium["kaleido"] is None and path not in _failed:
            why = _start(path)
            if why is not None:
                logger.debug("Chromium: %s", why)
                _failed[path] = why
    require_browser(what, instead=instead)  # the failure just remembered, if any


def _start(path: str) -> str | None:
    """Open kaleido's browser at ``path`` on a loop of its own: None, or why it did not start
    (whatever it left running then stopped)."""
    import kaleido

    seconds = start_timeout()
    quiet_browser_exit()
    _quiet_start()
    _starting_now.set()
    try:
        return _open(kaleido, path, seconds)
    finally:
        _starting_now.clear()


def _open(kaleido: Any, path: str, seconds: float) -> str | None:
    """:func:`_start`'s work; choreographer is kept quiet meanwhile (:class:`_StartFilter`)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="headsurgeon-chromium", daemon=True)
    thread.start()
    opening: list = []

    async def open_browser() -> BaseException | None:
        try:
            opening.append(kaleido.Kaleido(path=path))
            await opening[0].open()
        except BaseException as e:  # returned: raised after a timeout, asyncio would log it
            return e
        return None

    future = asyncio.run_coroutine_threadsafe(open_browser(), loop)
    who = f"BROWSER_PATH={path}" if os.environ.get("BROWSER_PATH") == path else path
    try:
        error = future.result(timeout=seconds)
    except concurrent.futures.TimeoutError:
        why = f"{who} did not start within {seconds:g} s (a limit {START_TIMEOUT_VAR} sets)"
    else:
        if error is None:
            _chromium.update(kaleido=opening[0], loop=loop, thread=thread)
            atexit.register(_stop)
            return None
        why = f"{who} did not start ({_start_error(error)})"
    future.cancel()
    why += _address_space_note()
    _close(opening[0] if opening else None, loop, thread, gently=False)
    return why


def _start_error(error: BaseException) -> str:
    """What a failed start says, in a few words."""
    from choreographer.errors import BrowserClosedError, BrowserFailedError

    if isinstance(error, (BrowserFailedError, BrowserClosedError)):
        return "it exited as it started"
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _address_space_note() -> str:
    """The address-space limit (``ulimit -v``) a Chromium may have failed under, if one is set."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return ""
    return (
        f"; an address-space limit of {limit / 2**30:.1f} GiB is set (ulimit -v), and Chromium "
        "reserves far more: lift it for this run to have static figures"
    )


class _StartFilter(logging.Filter):
    """Drop choreographer's and kaleido's warnings while a browser starts (and while a failed
    start is cleaned up): a browser that does not start is one line of ours (the
    :class:`FigureExportError`, or :func:`warn_skipped`), not their watchdog notices and the
    tracebacks of what a broken ``BROWSER_PATH`` printed."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING or not _starting_now.is_set()


_starting_now = threading.Event()


def _quiet_start() -> None:
    """Install :class:`_StartFilter` on choreographer's and kaleido's loggers (once each)."""
    for name, found in list(logging.root.manager.loggerDict.items()):
        if name.split(".")[0] not in ("choreographer", "kaleido"):
            continue
        if isinstance(found, logging.Logger) and not any(
            isinstance(f, _StartFilter) for f in found.filters
        ):
            found.addFilter(_StartFilter())


def _close(
    browser: Any, loop: asyncio.AbstractEventLoop, thread: threading.Thread, *, gently: bool
) -> None:
    """Close ``browser`` (``gently``: asking it first, else at once) with its process group,
    then stop its loop; each step bounded in time."""
    process = getattr(browser, "subprocess", None)
    if browser is not None and gently:
        try:
            asyncio.run_coroutine_threadsafe(browser.close(), loop).result(timeout=15)
        except Exception as e:  # a browser that will not close: killed below
            logger.debug("Chromium did not close (%r)", e)
    if process is not None:
        # choreographer starts it in a session of its own: the group holds Chromium's children.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(5)
    if browser is not None and not gently:  # its pipes, temporary folders and threads
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(browser.close(), loop).result(timeout=10)
    with contextlib.suppress(Exception):  # choreographer's watchdogs, left pending by a failure
        asyncio.run_coroutine_threadsafe(_cancel_pending(), loop).result(timeout=5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    if not thread.is_alive():  # else, collected at exit, it may close a self-pipe already gone
        loop.close()


async def _cancel_pending() -> None:
    """Cancel every other task on the running loop and wait for them to end."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _stop() -> None:
    """Close the running browser (at exit)."""
    browser, loop, thread = (_chromium[k] for k in ("kaleido", "loop", "thread"))
    if browser is not None:
        _chromium.update(kaleido=None, loop=None, thread=None)
        _close(browser, loop, thread, gently=True)


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
    """Static image bytes through kaleido; its one Chromium is started on the first call
    (:func:`start_browser`) and kept for later ones."""
    start_browser(f"saving a figure as {fmt}")  # fail with the fix, not deep inside kaleido
    layout = fig.layout
    opts = {"format": fmt, "width": layout.width or 700, "height": layout.height or 500}
    rendering = asyncio.run_coroutine_threadsafe(
        _chromium["kaleido"].calc_fig(fig, opts=opts | {"scale": scale}), _chromium["loop"]
    )
    try:
        return rendering.result(timeout=RENDER_TIMEOUT)
    except concurrent.futures.TimeoutError as e:
        rendering.cancel()
        raise FigureExportError(
            f"kaleido did not export the figure as {fmt} within {RENDER_TIMEOUT:g} s"
        ) from e
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

    ``.html`` is interactive: self-contained by default (plotly.js inlined, its cartesian
    bundle where that draws the figure: :func:`plotly_bundle`); ``include_plotlyjs="directory"``
    writes that bundle beside it instead (``plotly-cartesian.min.js``, kept if there), to share
    among figures; other values are plotly's (``"cdn"``, a script's URL, ``False``). ``.png``
    (at ``scale`` times the figure's pixel size), ``.svg`` and ``.pdf`` go through kaleido and a
    Chromium browser (the system one, or ``BROWSER_PATH``). The file appears whole or not at all.
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
        atomic_write_text(path, _html(fig, include_plotlyjs, path.parent))
    else:
        atomic_write_bytes(path, image_bytes(fig, fmt, scale))
    logger.debug("wrote %s", path)
    return path


def _html(fig: go.Figure, include_plotlyjs: bool | str, folder: Path) -> str:
    """The figure as a full HTML document, plotly.js as :func:`save_figure` says."""
    config = {"displaylogo": False}
    if include_plotlyjs is not True and include_plotlyjs != "directory":
        return fig.to_html(include_plotlyjs=include_plotlyjs, full_html=True, config=config)
    name, script = plotly_bundle([fig])
    html = fig.to_html(include_plotlyjs=name, full_html=True, config=config)
    if include_plotlyjs == "directory":
        if not (folder / name).exists():
            atomic_write_text(folder / name, script)
        return html
    tag = f'<script charset="utf-8" src="{name}"></script>'
    if tag not in html:  # plotly changed its markup: its own self-contained page instead
        return fig.to_html(include_plotlyjs=True, full_html=True, config=config)
    return html.replace(tag, f'<script charset="utf-8">{script}</script>', 1)


def plotly_bundle(figures: Iterable[go.Figure], *, traces: Iterable[str] = ()) -> tuple[str, str]:
    """The smallest plotly.js that draws every trace of ``figures`` and the trace types
    ``traces``: ``(file name, script)``.

    plotly.js's cartesian bundle (``plotly-cartesian.min.js``, 1.5 MB: the types in
    :data:`CARTESIAN_TRACES`) when it draws them all, else the full plotly.js of plotly.py
    (``plotly.min.js``, 4.8 MB), with one log line naming the types that need it.

    >>> import plotly.graph_objects as go
    >>> plotly_bundle([go.Figure(go.Heatmap(z=[[1]]))])[0]
    'plotly-cartesian.min.js'
    """
    kinds = {trace.type for fig in figures for trace in fig.data} | set(traces)
    beyond = sorted(kinds - CARTESIAN_TRACES)
    if not beyond:
        return CARTESIAN_BUNDLE.name, CARTESIAN_BUNDLE.read_text(encoding="utf-8")
    logger.info(
        "the figures hold %s traces, which plotly.js's cartesian bundle does not draw: "
        "writing the full plotly.js (4.8 MB) instead",
        ", ".join(beyond),
    )
    from plotly.offline import get_plotlyjs

    return FULL_BUNDLE, get_plotlyjs()


def split_formats(
    formats: Sequence[str] | None = None, *, default: Sequence[str] = DEFAULT_FORMATS
) -> tuple[list[str], list[str]]:
    """The figure formats to write and the static ones to skip: ``(write, skipped)``.

    ``None`` asks for ``default`` (:data:`DEFAULT_FORMATS`: png, and no HTML figure besides
    the writers' ``index.html``), the static ones only when a Chromium browser is found and
    starts (:func:`start_browser`), else they are skipped. Formats given explicitly are all
    written: an unknown one raises :class:`InvalidArgumentError`, a static one without a
    browser :class:`FigureExportError` (one line with the fix). Call it before writing
    anything, so that either fails first.

    >>> split_formats(["html"])
    (['html'], [])
    """
    if formats is None:
        static = [f for f in default if f in STATIC_FORMATS]
        try:
            if static:
                start_browser()
        except FigureExportError:  # none found, or it did not start: skipped, not refused
            return [f for f in default if f not in STATIC_FORMATS], static
        return list(default), []
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
        start_browser(
            f"figure format(s) {', '.join(static)}",
            instead="leave formats at their default (png when a browser is found; every "
            "figure is on index.html)",
        )
    return write, []


def save_figures(
    figures: Mapping[str, go.Figure],
    folder: str | os.PathLike,
    formats: Sequence[str] | None = None,
    *,
    default: Sequence[str] = DEFAULT_FORMATS,
    scale: float = 2.0,
    include_plotlyjs: bool | str = "directory",
) -> list[str]:
    """Write each figure as ``folder/<name>.<format>``; return the file names skipped.

    ``formats`` follows :func:`split_formats` (``None``: ``default``, by default png when a
    browser is found; the PNGs are skipped, and returned, when none is). The writers of this
    package then log :func:`warn_skipped` once the folder is complete. HTML figures share one
    plotly.js in ``folder`` (:func:`plotly_bundle` of them all), unless ``include_plotlyjs``
    says otherwise (:func:`save_figure`).
    """
    write, skipped = split_formats(formats, default=default)
    folder = Path(folder)
    if "html" in write and include_plotlyjs == "directory":
        bundle, script = plotly_bundle(figures.values())
        atomic_write_text(folder / bundle, script)
        include_plotlyjs = bundle  # each figure's <script src>
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
        f"({_file_list(names)}): no usable Chromium browser for kaleido ({why}); to write {them}, "
        f"{INSTALL_BROWSER} and run again, or export {them} from the figure{plural} on "
        "index.html (camera button)"
    )
    logger.warning(message)
    return message
