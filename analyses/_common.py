"""Shared pieces of the reproduction scripts in ``analyses/``.

Exports:
    ROOT, FIGURES                       the repository root and its ``figures/`` folder
    parser(doc, topic)                  argparse parser with --out (figures/<topic>) and --threads
    start(args)                         refuse an --out it could not replace; set the CPU threads
                                        and logging; return the start time
    write_topic(out, figures, tables, summary, started, extra, scope=)
                                        figures (PNG), tables (CSV/JSON/MD), anything ``extra``
                                        writes, and summary.md, as one folder written atomically;
                                        the summary opens with its scope and ends with the run time
    SCOPE_HEADING, with_scope(text, scope)
                                        a summary's "what this tests, and what it does not"
                                        section, put (or put back) right under its title
    scoped_summaries()                  (script, summary.md, SCOPE) of every script that has one,
                                        read from the source without running it; run this file
                                        to put each SCOPE into its committed summary
    fmt_heads(names)                    "L1H7, L2H10" or "none"
    acceptance(report, ppl, changes)    the repair acceptance numbers (check_repair.py and
                                        repair_organism.py): recovery, perplexity gap, bit-identity
    markdown(df, digits)                a DataFrame as a Markdown table (no extra dependency)
    gu_census(model)                    the census by Gu et al.'s protocol (``GU_PROTOCOL``)
"""

from __future__ import annotations

import argparse
import ast
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import torch

from headsurgeon import plots, run_census, to_sequences
from headsurgeon.allocator import keep_freed_memory
from headsurgeon.census import GU_PROTOCOL
from headsurgeon.errors import HeadsurgeonError
from headsurgeon.outputs import atomic_directory, atomic_write_text, check_output_dir
from headsurgeon.plots import save_figure

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "figures"
# Every summary opens with what its numbers test and what they do not, so that a reader who
# quotes one line knows its reach (each script's SCOPE: a pair of sentences).
SCOPE_HEADING = "## What this tests, and what it does not"


def parser(doc: str, topic: str) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of ``doc``, writing to ``figures/<topic>``."""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", type=Path, default=FIGURES / topic, help="output folder (replaced)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for torch")
    return p


def start(args: argparse.Namespace) -> float:
    """Set threads and logging; refuse an ``--out`` that the final write could not replace.

    The check comes first so that a long study never computes for hours and then fails on
    its output folder.
    """
    try:
        check_output_dir(args.out, overwrite=True)
    except HeadsurgeonError as e:
        raise SystemExit(f"error: {e}") from None
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("headsurgeon").setLevel(logging.INFO)
    return time.perf_counter()


def write_topic(
    out: str | os.PathLike,
    figures: Mapping[str, go.Figure],
    tables: Mapping[str, pd.DataFrame | str],
    summary: Sequence[str],
    started: float,
    extra: Callable[[Path], object] | None = None,
    *,
    scope: tuple[str, str],
) -> Path:
    """Replace ``out`` with ``<name>.png`` per figure, ``<name>`` per table and ``summary.md``.

    A DataFrame table is written as CSV; a string as is; ``extra(folder)`` may add more files.
    ``scope`` (what the numbers test, what they do not) opens the summary under its title
    (:func:`with_scope`). The summary is written last, so its final line, the run time,
    includes the figure export.
    """
    with atomic_directory(out, overwrite=True) as tmp:
        if extra is not None:
            extra(tmp)
        for name, fig in figures.items():
            save_figure(fig, tmp / f"{name}.png", scale=1.5)
        for name, table in tables.items():
            text = (
                table.to_csv(index=False, float_format="%.6g")
                if isinstance(table, pd.DataFrame)
                else table
            )
            atomic_write_text(tmp / name, text)
        wall, cpu = (time.perf_counter() - started) / 60, time.process_time() / 60
        threads = torch.get_num_threads()
        # The CPU time says what the script costs when the shared machine is busy.
        lines = [
            *summary,
            "",
            f"Run time: {wall:.1f} min wall clock, {cpu:.1f} min CPU "
            f"({threads} torch thread(s); {os.cpu_count()} CPU cores shared with other "
            "jobs).",
        ]
        text = with_scope("\n".join(lines) + "\n", scope)
        atomic_write_text(tmp / "summary.md", text)
    print(text, end="")
    return Path(out)


def with_scope(text: str, scope: tuple[str, str]) -> str:
    r"""``text`` (a summary: a ``# title`` line first) with its scope section right under the
    title, replacing the one already there.

    >>> print(with_scope("# T\n\nbody\n", ("a", "b")), end="")
    # T
    <BLANKLINE>
    ## What this tests, and what it does not
    <BLANKLINE>
    - **Tests**: a
    - **Does not test**: b
    <BLANKLINE>
    body
    >>> with_scope(with_scope("# T\n\nbody\n", ("a", "b")), ("c", "d")).count("Tests")
    1
    """
    title, _, rest = text.partition("\n")
    rest = rest.lstrip("\n")
    if rest.startswith(SCOPE_HEADING):  # the block ends at its first blank line after bullets
        rest = rest.split("\n\n", 2)[2] if rest.count("\n\n") >= 2 else ""
    tests, not_tested = scope
    block = f"{SCOPE_HEADING}\n\n- **Tests**: {tests}\n- **Does not test**: {not_tested}\n\n"
    return f"{title}\n\n{block}{rest}"


def fmt_heads(names: Sequence[str]) -> str:
    return ", ".join(names) if len(names) else "none"


# The acceptance: the repaired model's held-out perplexity within 2% of the uninjured model's.
PPL_TOLERANCE = 0.02


def acceptance(
    report: Mapping[str, Any], ppl: Mapping[str, float], changes: pd.DataFrame
) -> dict[str, Any]:
    """The repair acceptance numbers, computed one way for every script that reports them.

    ``report``: a repair's ``report.json`` (``RepairResult.to_dict()``); ``ppl``: held-out
    perplexities of ``"uninjured"`` and ``"repaired"`` on the same windows; ``changes``:
    ``weight_changes(input, repaired, targeted heads)``.

    >>> changes = pd.DataFrame({"elements": [10, 6], "head_elements": [4, 0],
    ...                         "other_changed": [0, 0]})
    >>> report = {"targeted": ["L1H1", "L1H3"], "recovered": ["L1H1"], "recovery_rate": 0.5,
    ...           "drift": {"count": 0}}
    >>> a = acceptance(report, {"uninjured": 10.0, "repaired": 10.1}, changes)
    >>> a["recovered"], round(a["ppl_gap"], 3), a["ppl_met"], a["untouched"], a["bit_identical"]
    (1, 0.01, True, 12, True)
    """
    gap = ppl["repaired"] / ppl["uninjured"] - 1
    changed = int(changes["other_changed"].sum())
    return {
        "targeted": len(report["targeted"]),
        "recovered": len(report["recovered"]),
        "recovery_rate": report["recovery_rate"],
        "drifted": report["drift"]["count"],
        "ppl_gap": gap,
        "ppl_met": abs(gap) <= PPL_TOLERANCE,
        "untouched": int(changes["elements"].sum() - changes["head_elements"].sum()),
        "untouched_changed": changed,
        "head_elements": int(changes["head_elements"].sum()),
        "bit_identical": changed == 0,
    }


def markdown(df: pd.DataFrame, digits: int = 3) -> str:
    """``df`` as a GitHub Markdown table; floats with ``digits`` significant digits.

    >>> print(markdown(pd.DataFrame({"a": [1], "b": [0.12345]})))
    | a | b |
    |---|---|
    | 1 | 0.123 |
    """

    def cell(x: object) -> str:
        return f"{x:.{digits}g}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def gu_census(model: Any) -> pd.DataFrame:
    """The census by Gu et al.'s protocol (``GU_PROTOCOL``: its cut, then its ``sink_eps``)."""
    seqs = to_sequences(model, seq_len=GU_PROTOCOL["seq_len"], n_seqs=GU_PROTOCOL["n_seqs"])
    return run_census(model, seqs, sink_eps=GU_PROTOCOL["sink_eps"], progress=False)


def style(
    fig: go.Figure, title: str, subtitle: str, width: int, height: int, *, left: int = 80
) -> None:
    """The house style (:func:`headsurgeon.plots.style`) with the analyses' margins."""
    margin = {"l": left, "r": 30, "t": 105, "b": 70}
    plots.style(
        fig,
        title=title,
        subtitle=subtitle,
        width=width,
        height=height,
        margin=margin,
        title_xref="container",
    )


def scoped_summaries() -> list[tuple[Path, Path, tuple[str, str]]]:
    """Each script of ``analyses/`` with a ``SCOPE``, its committed summary(ies) and that scope,
    read from the source (``SCOPE`` is a literal; the topic is ``parser(__doc__, topic)``'s, a
    topic per TransformerLens major where it is an f-string)."""
    found = []
    for script in sorted(Path(__file__).parent.glob("*.py")):
        tree = ast.parse(script.read_text())
        scope = next(
            (
                ast.literal_eval(node.value)
                for node in tree.body
                if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "SCOPE" for t in node.targets)
            ),
            None,
        )
        calls = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "parser"
        ]
        if scope is None or not calls:
            continue
        topic = calls[0].args[1]
        if isinstance(topic, ast.JoinedStr):  # f"families/tl{MAJOR}"
            prefix = topic.values[0].value
            topics = [f"{prefix}{major}" for major in (3, 4)]
        else:
            topics = [topic.value]
        found += [(script, FIGURES / t / "summary.md", scope) for t in topics]
    return found


if __name__ == "__main__":  # put each script's SCOPE into its committed summary, without a run
    for _, summary, scope in scoped_summaries():
        if summary.exists():
            atomic_write_text(summary, with_scope(summary.read_text(), scope))
            print(f"scoped {summary.relative_to(ROOT)}")
