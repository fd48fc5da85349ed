"""The report page (index.html) of a classify run, as a reader sees it: headless Chromium opens
it, clicks a head in the grid, and the screenshot goes to figures/report/ (shown in
docs/tools/classify.md).

Runs ``python -m headsurgeon classify MODEL`` (its defaults: 64 held-out sequences of 128 tokens)
into a temporary folder, opens its ``index.html`` with :func:`headsurgeon.reports.open_page`,
clicks ``--head`` and writes ``index_<HEAD>.png`` and ``summary.md`` (page size, console errors,
the clicked head's share of attention on position 0 as drawn). Needs a Chromium browser.

    python analyses/report_page.py                     # organism-injured, L1H7
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
from _common import parser, start, write_topic

from headsurgeon.cli.classify import main as classify
from headsurgeon.reports import PAGE, open_page

# What the summary's numbers test and what they do not (its opening section).
SCOPE = (
    (
        "that the page `python -m headsurgeon classify organism-injured` writes is one file that "
        "opens offline in Chromium without console errors, and that clicking a head shows that "
        "head."
    ),
    (
        "any number about the model beyond what the page draws, other browsers, or how the page "
        "reads to a person."
    ),
)


def main() -> None:
    p = parser(__doc__, "report")
    p.add_argument("--model", default="organism-injured")
    p.add_argument("--head", default="L1H7", help="the head clicked in the grid")
    args = p.parse_args()
    started = start(args)
    run = Path(tempfile.mkdtemp()) / "run"
    try:
        classify([args.model, "--out", str(run)])
        shot = run.parent / f"index_{args.head}.png"
        view = open_page(run / PAGE, args.head, screenshot=shot, size=(1400, 900))
        rows = np.array([[np.nan if w is None else w for w in row] for row in view.pattern or []])
        column0 = float(np.nanmean(rows[1:, 0])) if rows.size else float("nan")
        summary = [
            f"# Report page of `python -m headsurgeon classify {args.model}`",
            "",
            f"- `index.html`: {(run / PAGE).stat().st_size / 2**20:.2f} MiB, one file, works "
            "offline (plotly.js inlined once)",
            f"- console errors after loading and clicking {args.head}: {len(view.errors)}"
            + (f" ({'; '.join(view.errors)})" if view.errors else ""),
            f"- head shown after the click: {view.shown}",
            f"- its mean weight on position 0 (rows 1-, first sequence, as drawn): {column0:.3f}",
        ]
        write_topic(
            args.out,
            {},
            {},
            summary,
            started,
            extra=lambda folder: shutil.copy(shot, folder / shot.name),
            scope=SCOPE,
        )
    finally:
        shutil.rmtree(run.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
