"""The built documentation works from disk and offline: ``site/index.html`` opened as a file,
every link a file that exists, and pages that ask nothing of the network.

Needs the built site (``mkdocs build``: the docs extra), which ``.ci/run`` builds before the
suite; without it (or without Chromium for the browser test) the tests are skipped and say why.
``HEADSURGEON_SITE`` points at a site built elsewhere.
"""

from __future__ import annotations

import asyncio
import os
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from conftest import NO_CHROMIUM

from headsurgeon import plots
from headsurgeon.reports.page_view import (
    _BLANK_JS,
    _LOADED_JS,
    WAIT_S,
    _first_tab,
    _open,
    _wait,
)

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("HEADSURGEON_SITE", ROOT / "site"))
needs_site = pytest.mark.skipif(
    not (SITE / "index.html").is_file(),
    reason=f"no built site at {SITE}: build it first (mkdocs build, the docs extra)",
)
# The pages a reader meets first, and the one with plotly figures (the tour).
PAGES = (
    "index.html",
    "getting-started.html",
    "tour.html",
    "tools/classify.html",
    "api/census.html",
)

# Every figure a page holds drawn by plotly (the still image shown until then removed).
_DRAWN_JS = """[...document.querySelectorAll("div.plotly-graph-div")].every(
  div => div._fullLayout && !div.querySelector("img[id$='-png']"))"""

LINKING = {("a", "href"), ("link", "href"), ("script", "src"), ("img", "src")}


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value and (tag, name) in (
                ("a", "href"),
                ("link", "href"),
                ("script", "src"),
                ("img", "src"),
            ):
                self.links.append(value)


@needs_site
def test_every_link_of_the_site_is_a_file_on_disk():
    """Without a server a link to a folder shows a directory listing: every relative link of
    every page names a file that exists."""
    broken = []
    for page in SITE.rglob("*.html"):
        if page.name == "404.html":  # a server's page: its links start at the server's root
            continue
        parser = _Links()
        parser.feed(page.read_text(encoding="utf-8"))
        for link in parser.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or not parts.path:  # external, or an anchor only
                continue
            target = (page.parent / unquote(parts.path)).resolve()
            if not target.is_file():
                broken.append(f"{page.relative_to(SITE)} -> {link}")
    assert not broken, broken[:10]


@needs_site
def test_no_page_loads_anything_from_the_network():
    """Fonts, scripts and styles are the site's own: no page names an http(s) resource to load
    (links a reader may follow are fine)."""
    loads = re.compile(r'<(?:script|link|img)[^>]+(?:src|href)="https?://[^"]+"')
    found = {
        str(page.relative_to(SITE)): loads.findall(page.read_text(encoding="utf-8"))[:2]
        for page in SITE.rglob("*.html")
        if page.name != "404.html"  # a server's page, never opened from disk
    }
    assert not {page: hits for page, hits in found.items() if hits}


@needs_site
def test_the_api_summary_tables_show_whole_sentences():
    """A summary table shows a docstring's first line; the docs' griffe extension puts the first
    sentence there whole, so no row stops mid-sentence (the source wraps at 100 columns)."""
    cut = []
    for page in (SITE / "api").glob("*.html"):
        rows = re.findall(r'<tr class="doc-section-item">(.*?)</tr>', page.read_text(), re.S)
        for row in rows:
            cells = re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
            text = re.sub(r"<[^>]+>", "", cells[-1]).strip() if len(cells) > 1 else ""
            if text and not text.endswith((".", ":", "?", "!", ")")):
                cut.append(f"{page.name}: {text[-60:]}")
    assert not cut, cut[:10]


@needs_site
@pytest.mark.slow  # a browser
def test_pages_opened_from_disk_in_chromium_request_nothing_outside_and_log_no_error():
    if not plots.has_browser():
        pytest.skip(NO_CHROMIUM)
    seen = asyncio.run(_visit([(SITE / page).as_uri() for page in PAGES]))
    for page, (outside, failed, errors) in zip(PAGES, seen, strict=True):
        assert not outside, f"{page} requested {outside[:3]}"
        assert not failed, f"{page}: failed requests {failed[:3]}"
        assert not errors, f"{page}: console errors {errors[:3]}"


async def _visit(urls: list[str]) -> list[tuple[list[str], list[str], list[str]]]:
    import choreographer

    browser = plots.require_browser("opening the documentation")
    results = []
    async with choreographer.Browser(browser, headless=True) as chromium:
        tab = await _first_tab(chromium, WAIT_S)
        outside: list[str] = []
        failed: list[str] = []
        errors: list[str] = []

        async def request(event: dict) -> None:
            url = event["params"]["request"]["url"]
            if not url.startswith(("file:", "data:", "blob:", "about:", "chrome:")):
                outside.append(url)

        async def failure(event: dict) -> None:
            failed.append(event["params"].get("errorText", "failed"))

        async def thrown(event: dict) -> None:
            errors.append(event["params"]["exceptionDetails"]["text"])

        async def console(event: dict) -> None:
            if event["params"]["type"] in ("error", "assert"):
                errors.append(str(event["params"]["args"])[:200])

        async def logged(event: dict) -> None:
            if event["params"]["entry"]["level"] == "error":
                errors.append(event["params"]["entry"]["text"])

        tab.subscribe("Network.requestWillBeSent", request)
        tab.subscribe("Network.loadingFailed", failure)
        tab.subscribe("Runtime.exceptionThrown", thrown)
        tab.subscribe("Runtime.consoleAPICalled", console)
        tab.subscribe("Log.entryAdded", logged)
        for domain in ("Network", "Runtime", "Log", "Page"):
            await tab.send_command(f"{domain}.enable")
        for url in urls:
            # A blank page first, waited for: Chromium's start-up tab (or the previous page) is
            # done with, so this load cancels nothing of it (net::ERR_ABORTED).
            await _open(tab, "about:blank", "a blank page to load", _BLANK_JS, WAIT_S)
            for seen in (outside, failed, errors):
                seen.clear()
            await _open(tab, url, "the page to load", _LOADED_JS, WAIT_S)
            await _wait(tab, _DRAWN_JS, "the page's plotly figures", WAIT_S, lambda: bool(errors))
            results.append((list(outside), list(failed), list(errors)))
    return results
