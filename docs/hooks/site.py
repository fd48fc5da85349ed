"""MkDocs hooks: the parts of the pages that the code produces, filled in at build time.

Markers a page may hold, each on a line of its own:
    <!-- cli-help: TOOL -->   the output of ``python -m headsurgeon.TOOL --help`` (classify,
                              blindness, repair), so a tool page's options are the parser's
    <!-- public-names -->     the table of ``headsurgeon``'s public names and the module each
                              comes from, read from the ``TYPE_CHECKING`` block of
                              ``headsurgeon/__init__.py``
    <!-- moved-names -->      the table of the specialist names the root used to serve
                              (its ``_MOVED``) and the module to import each from
    --8<-- "figures/....md"   a markdown file an analysis script wrote under figures/, included
                              (at the line's indent) with its headings moved three levels down,
                              so its title nests under the page's section instead of becoming a
                              second page title; other --8<-- lines are pymdownx.snippets'

Offline: the site is read from disk (``site/index.html``, no server) and asks nothing of the
network. Material's ``offline`` plugin makes the links and the search work from ``file://``,
``theme.font: false`` keeps web fonts out, and the tour notebook's figures, whose saved HTML
loads plotly.js from its CDN, get the copy of plotly.js that the installed plotly package ships
(``assets/javascripts/plotly.min.js``, written once per build; ``tests/test_docs_site.py`` opens
every page from disk in headless Chromium and fails on a request that leaves the machine).

And a check: every module of ``headsurgeon`` (``headsurgeon/X.py``, or a package
``headsurgeon/X/``) has a ``::: headsurgeon.X`` section on a page under ``docs/api/``, else a
warning, which fails ``mkdocs build --strict``: a new or renamed module gets its place in the
reference when it is made.

The help runs the installed package in a subprocess (the docs extra installs it); a tool that
fails to print its help fails the build with its error.
"""

from __future__ import annotations

import ast
import logging
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger(f"mkdocs.plugins.{__name__}")  # counted by --strict
CLI_HELP = re.compile(r"^<!-- cli-help: (\w+) -->$", re.M)
PUBLIC_NAMES = re.compile(r"^<!-- public-names -->$", re.M)
MOVED_NAMES = re.compile(r"^<!-- moved-names -->$", re.M)
FIGURES_MARKDOWN = re.compile(r'^( *)--8<-- "(figures/[^"]+\.md)"$', re.M)
HEADING = re.compile(r"^(#{1,3}) ", re.M)


@cache
def cli_help(tool: str) -> str:
    """``python -m headsurgeon.<tool> --help``, 80 columns wide (a page's width), fenced."""
    env = dict(os.environ, COLUMNS="80")
    command = [sys.executable, "-m", f"headsurgeon.{tool}", "--help"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    if done.returncode != 0:
        raise PluginError(f"python -m headsurgeon.{tool} --help failed:\n{done.stderr}")
    return f"```text\n{done.stdout.rstrip()}\n```"


def public_names() -> str:
    """A table of the package root's names (the imports of ``headsurgeon/__init__.py``'s
    ``TYPE_CHECKING`` block, the one list of the API): each linked to its reference entry."""
    tree = ast.parse((ROOT / "headsurgeon" / "__init__.py").read_text())
    [block] = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    ]
    exports = [
        (alias.asname or alias.name, node.module, alias.name)
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    ]
    rows = []
    for name, where, original in sorted(exports, key=lambda item: (item[1], item[0])):
        rows.append(f"| [`{name}`][{where}.{original}] | [`{where}`][{where}] |")
    return "\n".join(["| name | defined in |", "|---|---|", *rows])


def moved_names() -> str:
    """A table of the names the root still serves for one release, with a DeprecationWarning
    (``headsurgeon/__init__.py``'s ``_MOVED``): each linked to its reference entry."""
    tree = ast.parse((ROOT / "headsurgeon" / "__init__.py").read_text())
    [moved] = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["_MOVED"]
    ]
    rows = [
        f"| [`{name}`][{where}.{name}] | `from {where} import {name}` |"
        for name, where in sorted(moved.items(), key=lambda item: (item[1], item[0]))
    ]
    return "\n".join(["| name | import it with |", "|---|---|", *rows])


def figures_markdown(match: re.Match) -> str:
    """The file a ``--8<--`` line names, headings three levels down, indented as the line."""
    indent, name = match.groups()
    path = ROOT / name
    if not path.is_file():
        raise PluginError(f"{name} is included by a page but does not exist")
    text = HEADING.sub(lambda heading: f"###{heading.group(1)} ", path.read_text())
    return "\n".join(indent + line if line else "" for line in text.splitlines())


def modules() -> list[str]:
    """The dotted names of headsurgeon's top-level modules and packages."""
    package = ROOT / "headsurgeon"
    files = [p.stem for p in package.glob("*.py") if p.stem != "__init__"]
    folders = [p.parent.name for p in package.glob("*/__init__.py")]
    return sorted(f"headsurgeon.{name}" for name in files + folders if not name.startswith("_"))


def on_pre_build(config: MkDocsConfig, **kwargs) -> None:
    pages = Path(config["docs_dir"]) / "api"
    text = "\n".join(page.read_text() for page in pages.glob("*.md"))
    documented = set(re.findall(r"^::: (headsurgeon[\w.]*)$", text, re.M))
    for module in modules():
        if module not in documented:
            log.warning(f"{module} is on no API page: add '::: {module}' to a page in docs/api/")


def on_page_markdown(markdown: str, **kwargs) -> str:
    markdown = FIGURES_MARKDOWN.sub(figures_markdown, markdown)
    markdown = CLI_HELP.sub(lambda match: cli_help(match.group(1)), markdown)
    markdown = MOVED_NAMES.sub(lambda match: moved_names(), markdown)
    return PUBLIC_NAMES.sub(lambda match: public_names(), markdown)


PLOTLY_JS = "assets/javascripts/plotly.min.js"
# Scripts the pages would load from the network, and the site's own copy of each: plotly.js
# (the tour's saved figure HTML, headsurgeon.plots.notebook, pins a CDN copy by an integrity
# hash that a local copy need not match) and the WebWorker shim Material's offline search loads
# from unpkg under file:// (vendored in docs/javascripts/).
LOCAL_SCRIPTS = {
    re.compile(r'<script[^>]*src="https://cdn\.plot\.ly/[^"]+"[^>]*>'): PLOTLY_JS,
    re.compile(r'<script[^>]*src="https://unpkg\.com/iframe-worker/shim"[^>]*>'): (
        "javascripts/iframe-worker-shim.js"
    ),
}


def on_post_page(output: str, page, config: MkDocsConfig, **kwargs) -> str:
    """Scripts that pages would load from the network load the site's own copy instead."""
    up = "../" * page.file.dest_uri.count("/")
    for remote, local in LOCAL_SCRIPTS.items():
        output = remote.sub(f'<script charset="utf-8" src="{up}{local}">', output)
    return output


def on_post_build(config: MkDocsConfig, **kwargs) -> None:
    """The copy of plotly.js the pages load: the installed plotly package's own bundle."""
    from plotly.offline import get_plotlyjs

    target = Path(config["site_dir"]) / PLOTLY_JS
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(get_plotlyjs(), encoding="utf-8")
