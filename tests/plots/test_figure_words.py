"""Every figure the tools make names its axes and colour bars in words with units, never by a raw
column name: each such title is a label of ``plots.layout.COLUMN_LABELS`` (or its change, Δ)."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from conftest import TEXT

from headsurgeon import classify_heads, plots, run_census
from headsurgeon.blindness import analytic_blindness, measure_blindness
from headsurgeon.classify import sick_shares
from headsurgeon.data import to_sequences
from headsurgeon.domains import compare_corpora
from headsurgeon.finetune import FinetuneConfig
from headsurgeon.plots.layout import COLUMN_LABELS, column_label
from headsurgeon.precision import precision_effect
from headsurgeon.repair import repair
from headsurgeon.reports import (
    PAGE,
    PAGE_TEMPLATE,
    write_blindness,
    write_classification,
    write_corpora,
    write_report,
)
from headsurgeon.reports.page import PAGE_AXES
from headsurgeon.sink_cache import sink_cache_effect

CODE = "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i))\n" * 20
WORDED = {column_label(c) for c in COLUMN_LABELS}
WORDED |= {f"Δ {label}" for label in WORDED} | {""}


def page_figures(folder) -> list[dict]:
    """The grid and every figure on a folder's page (the writers put every figure there)."""
    page = (folder / PAGE).read_text()
    data = json.loads(re.search(r'id="data">(.*?)</script>', page, re.S)[1])
    return [data["grid"]] + [f["figure"] for f in data["figures"]]


def titles(figure: dict) -> list[str]:
    """The figure's axis and colour-bar titles, as a reader sees them (lines joined)."""
    layout, found = figure["layout"], []
    for key, axis in layout.items():
        if re.fullmatch(r"[xy]axis\d*", key):
            found.append(axis.get("title", {}).get("text"))
    bars = [t.get("colorbar") for t in figure["data"] if t.get("showscale", True) is not False]
    bars += [layout.get("coloraxis", {}).get("colorbar")]
    found += [(bar or {}).get("title", {}).get("text") for bar in bars if bar]
    return [re.sub(r"<br>", " ", t).replace("&lt;", "<").replace("&gt;", ">") for t in found if t]


@pytest.fixture(scope="module")
def figures(bloom_dir, tmp_path_factory) -> list[dict]:
    from headsurgeon import load_model

    model = load_model(bloom_dir)
    tmp = tmp_path_factory.mktemp("words")
    tokens = to_sequences(model, TEXT, seq_len=48, n_seqs=2).tokens
    compared = compare_corpora(
        model,
        {"prose": TEXT, "code": CODE},
        importance="zero",
        seq_len=32,
        n_seqs=2,
        progress=False,
    )
    found = page_figures(write_corpora(compared, tmp / "corpora", formats=(), model=model))
    found += page_figures(tmp / "corpora" / "prose")  # a classification with importance
    census = classify_heads(run_census(model, tokens, progress=False))
    found += page_figures(write_classification(census, tmp / "classify", formats=()))
    tables = {"a": census, "b": census}
    found += [
        json.loads(f.to_json())
        for f in (plots.sick_share_plot(sick_shares(tables)), plots.models_grid(tables))
    ]
    result = repair(
        model,
        TEXT,
        eval_corpus=TEXT,
        eval_on_train=True,
        census_data=TEXT,
        census_seq_len=32,
        census_n_seqs=2,
        train_seq_len=32,
        heads="L1H2",
        passes=1,
        progress=False,
        max_ppl_increase=float("inf"),
        finetune_config=FinetuneConfig(steps=2, lr=1e-3, batch_size=2),
    )
    found += page_figures(write_report(result, tmp / "repair", formats=(), save_model=False))
    long = to_sequences(model, TEXT, seq_len=48, n_seqs=1).tokens
    out = write_blindness(
        tmp / "blindness",
        analytic_blindness(model, context_length=48),
        measure_blindness(model, long),
        formats=(),
        precision=precision_effect(model, long, progress=False),
        census=run_census(model, long, progress=False),
        sink_cache=sink_cache_effect(
            model, sinks=[0, 2], windows=[6], seq_len=48, head_seq_len=24, progress=False
        ),
    )
    return found + page_figures(out)


def test_every_axis_and_colour_bar_of_every_tool_figure_is_in_words(figures):
    assert len(figures) >= 20
    seen = {title for figure in figures for title in titles(figure)}
    raw = sorted(t for t in seen if "_" in t or t in COLUMN_LABELS and column_label(t) != t)
    print("UNKNOWN", sorted(seen - WORDED))
    assert not raw, f"raw column names as titles: {raw}"
    unknown = sorted(seen - WORDED)
    assert not unknown, f"titles not from plots.layout.COLUMN_LABELS: {unknown}"


def test_hover_labels_name_no_raw_column(figures):
    templates = [t.get("hovertemplate", "") for figure in figures for t in figure["data"]]
    named = {m for t in templates for m in re.findall(r"([A-Za-z_]+\w*) = %\{", t)}
    assert not [n for n in named if "_" in n], named


def test_the_page_names_its_own_axes_and_table_rows_in_words(tmp_path):
    """The page's script draws the attention patterns and curves and the head table: their axis
    titles and row names come from the page's labels (plots.layout.COLUMN_LABELS)."""
    script = PAGE_TEMPLATE.read_text()
    assert not re.findall(r"[xy]axis: [^;]*?title: \{text: \"", script)  # none written in
    axes = re.findall(r"title: \{text: D\.labels\.(\w+)", script)
    assert sorted(axes) == sorted(PAGE_AXES)
    census = pd.DataFrame({"layer": [0, 0], "head": [0, 1], "bos_mass": [0.9, 0.1]})
    census["my_score"] = 1.0  # a user's own column: shown as named
    out = write_classification(
        classify_heads(census.assign(bos_mass_std=0.0, entropy=1.0, output_share=0.5)),
        tmp_path / "out",
        formats=(),
    )
    page = (out / PAGE).read_text()
    labels = json.loads(re.search(r'id="data">(.*?)</script>', page, re.S)[1])["labels"]
    assert labels["bos_mass"] == "BOS mass (fraction of attention)"
    assert labels["entropy"] == "entropy (nats)" and "my_score" not in labels
    assert {labels[a] for a in PAGE_AXES} <= WORDED
