"""A report page opened in headless Chromium, as a reader would: for tests and screenshots."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from headsurgeon import plots
from headsurgeon.errors import FigureExportError
from headsurgeon.heads import HeadSet
from headsurgeon.outputs import atomic_write_bytes

__all__ = [
    "PageView",
    "open_page",
    "open_pages",
]


@dataclasses.dataclass(frozen=True)
class PageView:
    """What :func:`open_page` saw: the page's console errors and uncaught exceptions, the head
    shown after the click (``None``: none), that head's first attention pattern as drawn
    (``[query][key]`` weights, ``None`` above the diagonal) and the received-mass strip under it
    (``[key]``; ``None`` without one); the page's heading and its ``<title>`` as shown, the
    head's metric table as text (``[row][cell]``, header first; ``[]`` without a head) and the
    messages of the dialogs (``alert``, ``confirm``, ``prompt``) the page opened, which a page
    never does: one means it ran what its data said; the grid and each figure below it as
    ``(title, drawn)``, ``drawn`` false when the page's plotly.js lacks one of its trace types;
    the summary's text as shown; every URL the page asked the network stack for and Chromium
    sent (its own ``file:`` URL and ``data:`` images included; an ``http:`` one means it reached
    off the machine) and those Chromium refused to send (``blocked``: by the page's
    Content-Security-Policy)."""

    errors: list[str]
    shown: str | None
    pattern: list[list[float | None]] | None
    received: list[float | None] | None = None
    title: str | None = None
    document_title: str | None = None
    table: list[list[str]] = dataclasses.field(default_factory=list)
    dialogs: list[str] = dataclasses.field(default_factory=list)
    figures: list[tuple[str, bool]] = dataclasses.field(default_factory=list)
    summary: str | None = None
    requests: list[str] = dataclasses.field(default_factory=list)
    blocked: list[str] = dataclasses.field(default_factory=list)


# How long each step waits for what it needs (the page loaded, the grid drawn, the head shown):
# ample on a machine shared with busy jobs, and a bound, so a page that never draws is one line.
WAIT_S = 30.0
# How often a wait asks the page again.
_POLL_S = 0.05

# Conditions a step waits for, evaluated in the page. The document a navigation opened, loaded
# (the blank page in between tells one navigation's document from the previous one's).
_BLANK_JS = 'location.href === "about:blank" && document.readyState === "complete"'
_LOADED_JS = 'location.href !== "about:blank" && document.readyState === "complete"'
# Every plot of the page (the grid, each figure) laid out by plotly.
_PLOTS_JS = '[...document.querySelectorAll("#grid, #figures > div")].every(d => d._fullLayout)'
# The grid drawn: its layout, its heatmap and the drag layer that takes the mouse.
_GRID_JS = """(() => {
  const g = document.getElementById("grid");
  return Boolean(g && g._fullLayout && g._fullData && g.querySelector(".nsewdrag")
                 && g._fullData.some(trace => trace.type === "heatmap"));
})()"""
# The pointer over the grid, as plotly saw it (a click reads the head from what it hovers).
_HOVER_JS = 'Boolean((document.getElementById("grid")._hoverdata || []).length)'
# The clicked head's panel shown.
_HEAD_JS = 'Boolean(document.getElementById("head-name"))'
# Runs in the page: the grid cell of a head, in CSS pixels of the viewport.
_CELL_JS = """(() => {
  const g = document.getElementById("grid"), xa = g._fullLayout.xaxis, ya = g._fullLayout.yaxis;
  const box = g.querySelector(".nsewdrag").getBoundingClientRect();
  return [box.left + xa.l2p(%d), box.top + ya.l2p(%d)];
})()"""
_SHOWN_JS = """(() => {
  const name = document.getElementById("head-name"), plot = document.querySelector("div.pattern");
  const strip = document.querySelector("div.received"), heading = document.getElementById("title");
  const table = [...document.querySelectorAll("#head table tr")].map(
    tr => [...tr.cells].map(cell => cell.textContent));
  return [name ? name.textContent : null, plot && plot.data ? plot.data[0].z : null,
          strip && strip.data ? strip.data[0].z[0] : null, heading ? heading.textContent : null,
          document.title, table,
          [...document.querySelectorAll("#grid, #figures > div")].map(div => [
            div.layout && div.layout.title ? div.layout.title.text : "",
            Boolean(div._fullData) && div._fullData.every(trace => Boolean(trace._module))]),
          (document.getElementById("summary") || {}).textContent ?? null];
})()"""


def open_page(
    page: str | os.PathLike,
    click: str | None = None,
    *,
    screenshot: str | os.PathLike | None = None,
    size: tuple[int, int] = (1400, 1000),
    timeout: float = WAIT_S,
) -> PageView:
    """Open a report page (``index.html``) in headless Chromium, click the head ``click``
    (``"L1H7"``) in its grid with the mouse, and say what happened (:class:`PageView`);
    ``screenshot`` saves the viewport (``size`` pixels) as PNG. Each step waits at most
    ``timeout`` seconds for what it needs (the page loaded, its plots laid out, the grid drawn,
    the head shown), then raises one :class:`~headsurgeon.errors.FigureExportError` line naming it.

    Needs the Chromium the static figures use (:func:`headsurgeon.plots.require_browser`: one
    :class:`~headsurgeon.errors.FigureExportError` line without one). For tests and documentation
    screenshots: a page that renders with no console error and shows the clicked head works.
    """
    browser = plots.require_browser("opening a report page")
    url = Path(page).resolve().as_uri()
    pair = None if click is None else next(iter(HeadSet.parse(click)))
    return asyncio.run(_visit(browser, [url], pair, screenshot, size, timeout))[0]


def open_pages(
    pages: Sequence[str | os.PathLike],
    click: str | None = None,
    *,
    size: tuple[int, int] = (1400, 1000),
    timeout: float = WAIT_S,
) -> list[PageView]:
    """:func:`open_page` for each of ``pages`` in turn, in one Chromium (a start is a second or
    more): one :class:`PageView` each."""
    browser = plots.require_browser("opening a report page")
    urls = [Path(page).resolve().as_uri() for page in pages]
    pair = None if click is None else next(iter(HeadSet.parse(click)))
    return asyncio.run(_visit(browser, urls, pair, None, size, timeout))


class _ConsoleErrors:
    """Collects a page's uncaught exceptions, ``console.error`` calls and error log entries, the
    dialogs it opens and the URLs it requests."""

    def __init__(self, tab: Any) -> None:
        self.tab = tab
        self.clear()

    def clear(self) -> None:
        """Forget what the previous page did."""
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.asked: dict[str, str] = {}  # request id -> URL
        self.blocked: set[str] = set()  # request ids refused before sending

    async def thrown(self, event: dict) -> None:
        details = event["params"]["exceptionDetails"]
        self.errors.append(details.get("exception", {}).get("description") or details["text"])

    async def console(self, event: dict) -> None:
        if event["params"]["type"] in ("error", "assert"):
            self.errors.append(" ".join(str(a.get("value", a)) for a in event["params"]["args"]))

    async def logged(self, event: dict) -> None:
        if event["params"]["entry"]["level"] == "error":
            self.errors.append(event["params"]["entry"]["text"])

    async def request(self, event: dict) -> None:
        """A URL asked for: by the page, not by the browser's own new-tab page it replaced."""
        if not event["params"].get("documentURL", "").startswith("chrome:"):
            self.asked[event["params"]["requestId"]] = event["params"]["request"]["url"]

    async def failed(self, event: dict) -> None:
        """A request that failed; one with a ``blockedReason`` was never sent."""
        if event["params"].get("blockedReason"):
            self.blocked.add(event["params"]["requestId"])

    def requests(self, blocked: bool) -> list[str]:
        """The URLs asked for that were sent (``blocked=False``) or refused (``True``)."""
        return [url for key, url in self.asked.items() if (key in self.blocked) == blocked]

    async def dialog(self, event: dict) -> None:
        """A dialog blocks the page until answered: note its message, then dismiss it."""
        self.dialogs.append(event["params"]["message"])
        await _command(self.tab, "Page.handleJavaScriptDialog", accept=False)

    def listen(self) -> None:
        self.tab.subscribe("Runtime.exceptionThrown", self.thrown)
        self.tab.subscribe("Runtime.consoleAPICalled", self.console)
        self.tab.subscribe("Log.entryAdded", self.logged)
        self.tab.subscribe("Page.javascriptDialogOpening", self.dialog)
        self.tab.subscribe("Network.requestWillBeSent", self.request)
        self.tab.subscribe("Network.loadingFailed", self.failed)


async def _command(tab: Any, method: str, **params: Any) -> dict:
    """One DevTools command's result."""
    return (await tab.send_command(method, params=params or None)).get("result", {})


async def _evaluate(tab: Any, expression: str) -> Any:
    found = await _command(tab, "Runtime.evaluate", expression=expression, returnByValue=True)
    return found.get("result", {}).get("value")


async def _wait(
    tab: Any, condition: str, what: str, timeout: float, done: Callable[[], bool] = lambda: False
) -> None:
    """Ask the page ``condition`` until it holds (or ``done()`` does), at most ``timeout`` seconds;
    then one :class:`FigureExportError` line naming ``what`` was awaited."""
    end = time.monotonic() + timeout
    while not (await _evaluate(tab, condition) or done()):
        if time.monotonic() > end:
            address = await _evaluate(tab, "location.href")
            raise FigureExportError(
                f"waited {timeout:g} s for {what} in headless Chromium ({address}), in vain: "
                "open the page in a browser and look at its console"
            )
        await asyncio.sleep(_POLL_S)


async def _open(tab: Any, url: str, what: str, condition: str, timeout: float) -> None:
    """Navigate to ``url``, then wait until ``condition`` says its document has loaded."""
    navigated = await _command(tab, "Page.navigate", url=url)
    if navigated.get("errorText"):
        raise FigureExportError(f"headless Chromium could not open {url}: {navigated['errorText']}")
    await _wait(tab, condition, what, timeout)


async def _click(tab: Any, errors: _ConsoleErrors, pair: tuple[int, int], timeout: float) -> None:
    """Click a head's cell of the grid as plotly sees a click: the pointer moves onto it (and
    plotly sees it there), then presses; then wait for the head's panel (or a new error)."""
    name = f"L{pair[0]}H{pair[1]}"
    await _wait(tab, _GRID_JS, "the head grid to be drawn", timeout)
    x, y = await _evaluate(tab, _CELL_JS % (pair[1], pair[0]))
    mouse = {"x": x, "y": y, "button": "left", "clickCount": 1}
    await _command(tab, "Input.dispatchMouseEvent", type="mouseMoved", **mouse)
    await _wait(tab, _HOVER_JS, f"the pointer to reach {name} in the grid", timeout)
    before = len(errors.errors)
    for kind in ("mousePressed", "mouseReleased"):
        await _command(tab, "Input.dispatchMouseEvent", type=kind, **mouse)
    await _wait(
        tab,
        _HEAD_JS,
        f"{name} to be shown after its click",
        timeout,
        done=lambda: len(errors.errors) > before,
    )


async def _first_tab(chromium: Any, timeout: float) -> Any:
    """The browser's start-up tab: choreographer looks for it a second or two, which a busy
    machine may need more than."""
    end = time.monotonic() + timeout
    while (tab := chromium.get_tab()) is None:
        if time.monotonic() > end:
            raise FigureExportError(
                f"waited {timeout:g} s for headless Chromium's first tab, in vain: "
                "try again on a less busy machine"
            )
        await chromium.populate_targets()
        await asyncio.sleep(_POLL_S)
    return tab


async def _visit(
    browser: str,
    urls: Sequence[str],
    pair: tuple[int, int] | None,
    screenshot: Any,
    size: tuple[int, int],
    timeout: float,
) -> list[PageView]:
    import choreographer

    async with choreographer.Browser(browser, headless=True) as chromium:
        tab = await _first_tab(chromium, timeout)
        errors = _ConsoleErrors(tab)
        errors.listen()
        for domain in ("Runtime", "Log", "Page", "Network"):
            await _command(tab, f"{domain}.enable")
        await _command(
            tab,
            "Emulation.setDeviceMetricsOverride",
            width=size[0],
            height=size[1],
            deviceScaleFactor=1,
            mobile=False,
        )
        return [await _view(tab, errors, url, pair, screenshot, timeout) for url in urls]


async def _view(
    tab: Any,
    errors: _ConsoleErrors,
    url: str,
    pair: tuple[int, int] | None,
    screenshot: Any,
    timeout: float,
) -> PageView:
    """Open ``url`` in ``tab``, click ``pair``'s cell, and say what the page did."""
    # A blank page first: the browser's own start-up tab (or the previous page) is done with, so
    # nothing of it is cancelled by this load or taken for it.
    await _open(tab, "about:blank", "a blank page to load", _BLANK_JS, timeout)
    errors.clear()
    await _open(tab, url, "the page to load", _LOADED_JS, timeout)
    # The plots laid out, or the page reported why not (a test reads the error).
    await _wait(
        tab, _PLOTS_JS, "the page's plots to be drawn", timeout, done=lambda: bool(errors.errors)
    )
    if pair is not None:
        await _click(tab, errors, pair, timeout)
    seen = await _evaluate(tab, _SHOWN_JS)
    shown, pattern, received, title, document_title, table, figures, summary = seen
    if screenshot is not None:
        image = await _command(tab, "Page.captureScreenshot", format="png")
        atomic_write_bytes(screenshot, base64.b64decode(image["data"]))
    return PageView(
        errors=errors.errors,
        shown=shown,
        pattern=pattern,
        received=received,
        title=title,
        document_title=document_title,
        table=table,
        dialogs=errors.dialogs,
        figures=[(title, drawn) for title, drawn in figures],
        summary=summary,
        requests=errors.requests(blocked=False),
        blocked=errors.requests(blocked=True),
    )
