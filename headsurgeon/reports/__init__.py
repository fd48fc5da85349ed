"""Reports: the text summaries, tables and figures the command-line tools write.

Exports:
    format_summary(classified)                the classification summary the classify CLI prints
                                              (with an importance section when it has one)
    write_classification(df, out_dir, ...)    heads.csv, heads.json, sweep, summary and figures
                                              (importance columns and figures when present)
    write_cross_scale({model: df}, out_dir)   several models: each one's classification in a
                                              subfolder, the cross-scale table and figures
    format_corpora_summary(compared, changes) one model on several corpora: each corpus's
                                              summary and the heads that change between them
    write_corpora(compared, out_dir, ...)     a folder per corpus, the long and change tables,
                                              difference grids and one page
    write_report(result, out_dir, ...)        a repair's report.md, report.json, censuses,
                                              figures and model/
    training_plot(result)                     objective, perplexities and BOS mass over the steps
    blindness_summary(analytic, measured)     the blindness CLI's text summary
    write_blindness(out_dir, analytic, ...)   the blindness CLI's tables, summary and figures
    PAGE                                      ``index.html``: every writer's one-page report
                                              (summary, clickable head grid, each head's metrics
                                              and attention on the run's own sequences)
    open_page(page, click, screenshot=)       open such a page in headless Chromium, click a
                                              head, report console errors (PageView)
    open_pages(pages, click)                  the same for several pages, in one browser
    default_out_dir(model, suffix)            ``<model>-<suffix>[-N]`` in the working directory
    model_folder_name(model)                  a model's name as a folder name
    partial_dir(out)                          ``<out>.partial``, where an unfinished repair lives
    IMPORTANCE_NAMES                          head_importance's columns as classified tables
                                              name them (``method`` -> ``importance_method``)

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

from headsurgeon.reports.blindness import blindness_summary, write_blindness
from headsurgeon.reports.classify import (
    FIGURES as FIGURES,
    IMPORTANCE_FIGURES as IMPORTANCE_FIGURES,
    IMPORTANCE_NAMES,
    format_summary,
    write_classification,
    write_cross_scale,
)
from headsurgeon.reports.corpora import (
    CORPORA_FILES as CORPORA_FILES,
    format_corpora_summary,
    write_corpora,
)
from headsurgeon.reports.folders import default_out_dir, model_folder_name, partial_dir
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
from headsurgeon.reports.repair import training_plot, write_report

__all__ = [
    "IMPORTANCE_NAMES",
    "PAGE",
    "PageView",
    "open_page",
    "open_pages",
    "blindness_summary",
    "default_out_dir",
    "model_folder_name",
    "format_summary",
    "format_corpora_summary",
    "partial_dir",
    "training_plot",
    "write_blindness",
    "write_classification",
    "write_corpora",
    "write_cross_scale",
    "write_report",
]
