"""Reports: the text summaries, tables and figures the command-line tools write.

Every writer fills a new folder atomically (:func:`headsurgeon.outputs.atomic_directory`),
marked as headsurgeon's (``.headsurgeon-output.json``: ``overwrite`` replaces only such a folder)
and takes ``formats`` by one rule (:func:`headsurgeon.plots.split_formats`). The library modules
(:mod:`headsurgeon.classify`, :mod:`headsurgeon.repair`, :mod:`headsurgeon.blindness`) compute;
this package turns their results into files, and is the one place besides
:mod:`headsurgeon.plots` that imports plotly.

The package, one module per concern (each imports only those above it):

    records     what the JSON files record: JSON-safe values, the versions of the packages used
    folders     default output folder names, ``<out>.partial``
    page        ``index.html``, the one offline page every writer adds
    classify    the classify CLI's summary and files (one model, or several across scales)
    corpora     the classify CLI's files for one model on several corpora
    repair      a repair's report folder (report.md, report.json, ``model/``)
    blindness   the blindness CLI's summary and files
    page_view   a report page opened in headless Chromium (tests, screenshots)
"""

from headsurgeon.reports.blindness import write_blindness
from headsurgeon.reports.classify import (
    FIGURES as FIGURES,
    IMPORTANCE_FIGURES as IMPORTANCE_FIGURES,
    write_classification,
    write_cross_scale,
)
from headsurgeon.reports.corpora import CORPORA_FILES as CORPORA_FILES, write_corpora
from headsurgeon.reports.page import (
    PAGE,
    PAGE_CELLS as PAGE_CELLS,
    PAGE_POSITIONS as PAGE_POSITIONS,
    PAGE_SEQS as PAGE_SEQS,
    PAGE_SKIP as PAGE_SKIP,
    PAGE_TEMPLATE as PAGE_TEMPLATE,
    write_page as write_page,
)
from headsurgeon.reports.page_view import PageView, open_page, open_pages
from headsurgeon.reports.records import VERSIONED as VERSIONED
from headsurgeon.reports.repair import write_report

__all__ = [
    "PAGE",
    "PageView",
    "open_page",
    "open_pages",
    "write_blindness",
    "write_classification",
    "write_corpora",
    "write_cross_scale",
    "write_report",
]
