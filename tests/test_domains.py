"""Heads across corpora: each corpus equals a single-corpus run; the change rule; the CLI."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from conftest import error_line

from headsurgeon import classify_heads, compare_corpora, head_importance, plots, run_census
from headsurgeon.cli.classify import main
from headsurgeon.cli.classify_run import corpus_names
from headsurgeon.domains import corpus_changes, split_corpora, stack_corpora
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.importance import with_importance
from headsurgeon.reports import PAGE, open_page, write_corpora

PROSE = (
    "Now is the winter of our discontent made glorious summer by this sun of York; and all the "
    "clouds that lour'd upon our house in the deep bosom of the ocean buried. "
) * 12
CODE = (
    "def head(x):\n    return x[0] if x else None\n\nfor i in range(10):\n    print(head([i]))\n"
) * 20
OPTIONS = ["--seq-len", "16", "--n-seqs", "4", "--batch-size", "2"]


@pytest.fixture()
def html_only(monkeypatch):
    """No browser: the tools write html figures only (PNGs take most of a tiny run's time)."""
    from choreographer.browsers.chromium import Chromium

    monkeypatch.setattr(Chromium, "find_browser", classmethod(lambda cls, **kwargs: None))


def test_two_corpora_give_the_censuses_of_two_single_corpus_runs(tiny_model):
    compared = compare_corpora(
        tiny_model,
        {"prose": PROSE, "code": CODE},
        importance="zero",
        seq_len=16,
        n_seqs=4,
        batch_size=3,  # not the single runs' batch: sums over batches must not depend on it
        progress=False,
    )
    assert list(dict.fromkeys(compared["corpus"])) == ["prose", "code"]
    assert compared.columns[0] == "corpus"
    for name, text in (("prose", PROSE), ("code", CODE)):
        census = run_census(tiny_model, text, seq_len=16, n_seqs=4, progress=False)
        alone = classify_heads(census)
        importance = head_importance(
            tiny_model, text, method="zero", seq_len=16, n_seqs=4, progress=False
        )
        alone = with_importance(alone, importance)
        mine = split_corpora(compared)[name]
        pd.testing.assert_frame_equal(mine, alone, check_exact=False, rtol=1e-6, atol=1e-9)
        assert mine.attrs["n_seqs"] == 4 and mine.attrs["importance_method"] == "zero"
    # The corpora really differ: the comparison is not of one census with itself.
    tables = split_corpora(compared)
    assert not np.allclose(tables["prose"]["bos_mass"], tables["code"]["bos_mass"])


def table(corpus, label, bos_mass, delta_loss=None, se=None):
    rows = {"layer": [0, 0, 1, 1, 1], "head": [0, 1, 0, 1, 2], "label": label, "bos_mass": bos_mass}
    if delta_loss is not None:
        rows |= {"delta_loss": delta_loss, "delta_loss_se": se}
    return pd.DataFrame(rows).assign(corpus=corpus)


def test_the_change_table_on_a_constructed_case():
    # L0H0 label changes; L0H1 dormant -> active, significantly; L1H0 dormant (1.9 SE) on one
    # and not (2.1 SE) on the other: no significant difference, no change; L1H1 active both
    # (negative delta_loss counts: removing it lowers the loss); L1H2 active -> dormant.
    a = table(
        "a",
        ["healthy", "healthy", "BOS-sink", "healthy", "healthy"],
        [0.1, 0.2, 0.7, 0.1, 0.3],
        [0.5, 0.001, 0.019, -0.3, 0.2],
        [0.01, 0.001, 0.01, 0.01, 0.01],
    )
    b = table(
        "b",
        ["BOS-sink", "healthy", "BOS-sink", "healthy", "healthy"],
        [0.6, 0.2, 0.72, 0.1, 0.3],
        [0.5, 0.1, 0.021, -0.2, 0.01],
        [0.01, 0.01, 0.01, 0.01, 0.01],
    )
    changes = corpus_changes(pd.concat([a, b], ignore_index=True))
    assert list(changes["corpus_a"].unique()) == ["a"] and list(changes["corpus_b"]) == ["b"] * 5
    assert changes["label_changed"].tolist() == [True, False, False, False, False]
    assert changes["dormant_a"].tolist() == [False, True, True, False, False]
    assert changes["dormant_b"].tolist() == [False, False, False, False, True]
    assert changes["importance_changed"].tolist() == [False, True, False, False, True]
    assert changes["changed"].tolist() == [True, True, False, False, True]
    assert changes["change"].tolist() == [
        "healthy -> BOS-sink",
        "dormant -> active",
        "",
        "",
        "active -> dormant",
    ]
    np.testing.assert_allclose(changes["d_bos_mass"], [0.5, 0, 0.02, 0, 0], atol=1e-12)
    np.testing.assert_allclose(changes["d_delta_loss_se"].iloc[1], np.hypot(0.001, 0.01))
    # A third corpus is compared with the first too; another reference can be named.
    c = a.assign(corpus="c")
    three = pd.concat([a, b, c], ignore_index=True)
    changes = corpus_changes(three)
    assert changes.groupby("corpus_b")["changed"].sum().to_dict() == {"b": 3, "c": 0}
    assert set(corpus_changes(three, reference="b")["corpus_b"]) == {"a", "c"}
    # Without importance columns only labels count.
    plain = corpus_changes(pd.concat([a, b]).drop(columns=["delta_loss", "delta_loss_se"]))
    assert "importance_changed" not in plain and plain["changed"].tolist()[:2] == [True, False]
    with pytest.raises(InvalidArgumentError, match="at least two corpora"):
        corpus_changes(a)


def test_stacking_refuses_duplicate_names_and_different_heads():
    a = table("x", ["healthy"] * 5, [0.1] * 5).drop(columns="corpus")
    with pytest.raises(InvalidArgumentError, match="different heads"):
        stack_corpora({"a": a, "b": a.iloc[:3]})
    with pytest.raises(InvalidArgumentError, match="non-empty strings"):
        stack_corpora({"a": a, "": a})


def test_corpus_names_from_files_are_folder_names_and_distinct(tmp_path):
    names = corpus_names(
        [
            [tmp_path / "x" / "a.txt"],
            [tmp_path / "y" / "a.txt.gz"],
            [tmp_path / "<b>&c.txt", tmp_path / "d.md"],
            [tmp_path / "..txt"],
        ]
    )
    assert names == ["a", "a-2", "-b-c-d.md", "corpus"]


def write_texts(tmp_path):
    (tmp_path / "prose.txt").write_text(PROSE)
    (tmp_path / "code.txt").write_text(CODE)
    return str(tmp_path / "prose.txt"), str(tmp_path / "code.txt")


def test_cli_two_corpora_end_to_end(bloom_dir, tmp_path, capsys, html_only):
    prose, code = write_texts(tmp_path)
    alone = tmp_path / "alone"
    assert main([str(bloom_dir), "--texts", prose, *OPTIONS, "--out", str(alone)]) == 0
    out = tmp_path / "both"
    argv = [str(bloom_dir), "--texts", prose, "--texts", code, *OPTIONS, "--importance", "zero"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "=== corpus prose ===" in printed and "=== code against prose ===" in printed
    # Each corpus's folder is what a single-corpus run writes (importance columns besides).
    mine = pd.read_csv(out / "prose" / "heads.csv")
    single = pd.read_csv(alone / "heads.csv")
    pd.testing.assert_frame_equal(mine[single.columns], single)
    heads = pd.read_csv(out / "heads.csv")
    assert heads["corpus"].tolist() == ["prose"] * 8 + ["code"] * 8
    differences = pd.read_csv(out / "differences.csv")
    assert len(differences) == 8 and "importance_changed" in differences
    changes = pd.read_csv(out / "changes.csv", keep_default_na=False)
    assert len(changes) == differences["changed"].sum() and (changes["change"] != "").all()
    meta = json.loads((out / "corpora.json").read_text())
    assert meta["corpora"]["code"]["data"] == "code.txt" and meta["reference"] == "prose"
    assert len(meta["changes"]) == len(changes) and "2 SE" in meta["rule"]
    page = (out / PAGE).read_text()
    for figure in ("bos_mass_corpora", "delta_loss_diff", "delta_loss_corpora"):  # + the grid
        assert f'"name":"{figure}"' in page
    assert "prose/index.html" in page and (out / "code" / PAGE).is_file()


def test_cli_corpora_errors_are_one_line(bloom_dir, tmp_path, capsys):
    prose, code = write_texts(tmp_path)
    out = tmp_path / "out"
    line = error_line(main, [bloom_dir, "--texts", prose, "--texts", tmp_path / "no.txt"], capsys)
    assert "--texts" in line and "no.txt" in line
    line = error_line(
        main,
        ["organism", "organism-injured", "--texts", prose, "--texts", code, "--out", out],
        capsys,
    )
    assert "one model at a time" in line
    assert not out.exists()


def test_cli_same_file_name_twice_gets_two_folders(bloom_dir, tmp_path, html_only):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    (tmp_path / "x" / "a.txt").write_text(PROSE)
    (tmp_path / "y" / "a.txt").write_text(CODE)
    out = tmp_path / "out"
    texts = ["--texts", str(tmp_path / "x" / "a.txt"), "--texts", str(tmp_path / "y" / "a.txt")]
    assert main([str(bloom_dir), *texts, *OPTIONS, "--out", str(out)]) == 0
    assert (out / "a" / "heads.csv").is_file() and (out / "a-2" / "heads.csv").is_file()
    assert pd.read_csv(out / "heads.csv")["corpus"].unique().tolist() == ["a", "a-2"]


def test_corpus_names_reach_the_page_and_figures_only_escaped(tiny_model, tmp_path):
    name = "<!--<script>"
    compared = compare_corpora(
        tiny_model, {name: PROSE, "code": CODE}, seq_len=16, n_seqs=2, progress=False
    )
    fig = plots.corpus_diff_grid(compared, a="code", b=name)
    assert name not in fig.layout.title.text and "&lt;!--&lt;script&gt;" in fig.layout.title.text
    out = write_corpora(compared, tmp_path / "out", formats=())
    text = (out / PAGE).read_text(encoding="utf-8")
    assert name not in text
    assert (out / "----script-" / "heads.csv").is_file()  # letters, digits, ".", "_", "-"
    if plots.has_browser():  # the page works: a click shows the head (its corpora's metrics)
        view = open_page(out / PAGE, "L1H2", screenshot=tmp_path / "page.png")
        assert view.errors == [] and view.shown == "L1H2"
