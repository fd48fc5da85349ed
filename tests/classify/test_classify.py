"""Classification: planted sinks and a silenced head get the right labels; thresholds; the CLI."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import error_line, head_weight

from headsurgeon import (
    Thresholds,
    classify_heads,
    head_importance,
    load_model,
    plots,
    run_census,
    save_hf,
    threshold_sweep,
)
from headsurgeon.alibi import alibi_bias, slopes
from headsurgeon.backend.weights import tl_state_dict
from headsurgeon.cli import run
from headsurgeon.cli.classify import main
from headsurgeon.data import to_sequences
from headsurgeon.errors import InvalidArgumentError, OutputExistsError
from headsurgeon.model_names import ORGANISM_DIR
from headsurgeon.outputs import MARK_FILE
from headsurgeon.reports import PAGE, write_classification
from headsurgeon.reports.classify import format_summary

TEXT = (
    "Now is the winter of our discontent made glorious summer by this sun of York; and all the "
    "clouds that lour'd upon our house in the deep bosom of the ocean buried. "
) * 12
DEAD, SINK, SILENT = (0, 3), (1, 2), (1, 0)  # (layer, head); sinks on the shallow slopes


@torch.no_grad()
def plant_sink(model, tokens, layer, head, target):
    """Set one head's Q/K so that its mean weight on position 0 (rows t >= 1) is ``target``.

    Every sequence starts with the same token, so position 0 has the same residual everywhere:
    the key reads the direction that separates it from the other positions, the query is a
    constant, and the key's scale is found by bisection on the exact pattern of that head.
    """
    name = f"blocks.{layer}.ln1.hook_normalized"
    _, cache = model.run_with_cache(tokens, names_filter=name, stop_at_layer=layer + 1)
    weights = tl_state_dict(model)
    x = cache[name] * weights[f"blocks.{layer}.ln1.w"] + weights[f"blocks.{layer}.ln1.b"]
    direction = x[:, 0].mean(0) - x[:, 1:].mean((0, 1))
    direction /= direction.norm()
    n_pos = tokens.shape[1]
    bias = alibi_bias(slopes(model.cfg.n_heads)[head : head + 1], n_pos)[0]
    future = torch.triu(torch.ones(n_pos, n_pos, dtype=torch.bool), 1)
    projection = x @ direction  # [seq, pos]

    def bos_mass(scale):
        scores = scale * projection[:, None, :] / model.cfg.d_head**0.5 + bias
        return scores.masked_fill(future, -torch.inf).softmax(-1)[:, 1:, 0].mean()

    low, high = 0.0, 1e4
    for _ in range(60):
        middle = (low + high) / 2
        if bos_mass(middle) < target:
            low = middle
        else:
            high = middle
    W_Q, b_Q, W_K, b_K = (head_weight(model, layer, n) for n in ("W_Q", "b_Q", "W_K", "b_K"))
    W_Q[head] = 0
    b_Q[head] = 0
    b_Q[head, 0] = 1.0
    W_K[head] = 0
    b_K[head] = 0
    W_K[head, :, 0] = high * direction


@pytest.fixture()
def planted(tiny_model):
    """tiny_model with a dead sink, a BOS-sink and a silenced head, plus its census tokens."""
    tokens = to_sequences(tiny_model, TEXT, seq_len=32, n_seqs=8, prepend_bos=True).tokens
    plant_sink(tiny_model, tokens, *DEAD, target=0.99)
    plant_sink(tiny_model, tokens, *SINK, target=0.75)
    with torch.no_grad():
        for name in ("W_V", "b_V", "W_O"):
            head_weight(tiny_model, SILENT[0], name)[SILENT[1]] = 0
    return tiny_model, tokens


def test_planted_heads_get_their_labels_and_the_rest_are_healthy(planted):
    model, tokens = planted
    census = run_census(model, tokens, progress=False)
    df = classify_heads(census).set_index(["layer", "head"])
    assert df.loc[DEAD, "label"] == "dead" and "BOS mass" in df.loc[DEAD, "reason"]
    assert df.loc[SINK, "label"] == "BOS-sink"
    assert df.loc[SINK, "bos_mass"] == pytest.approx(0.75, abs=1e-3)
    assert df.loc[SILENT, "label"] == "dead" and "writes 0.00%" in df.loc[SILENT, "reason"]
    assert df.loc[SILENT, "output_share"] == 0
    untouched = df.drop(index=[DEAD, SINK, SILENT])
    assert (untouched["label"] == "healthy").all(), untouched[["bos_mass", "output_share"]]
    assert df.attrs["thresholds"] == {"sink": 0.5, "dead": 0.95, "min_output_share": 0.01}
    # Moving the thresholds past the planted masses moves the labels.
    strict = classify_heads(census, Thresholds(sink=0.8, dead=0.995)).set_index(["layer", "head"])
    assert strict.loc[DEAD, "label"] == "BOS-sink" and strict.loc[SINK, "label"] == "healthy"


def census_frame(bos, share=None):
    n = len(bos)
    share = [0.3] * n if share is None else share
    return pd.DataFrame(
        {
            "layer": np.arange(n) // 4,
            "head": np.arange(n) % 4,
            "bos_mass": bos,
            "bos_mass_std": [0.01] * n,
            "entropy": [1.0] * n,
            "output_share": share,
        }
    )


def test_label_boundaries_are_strict_inequalities():
    df = classify_heads(census_frame([0.5, 0.5001, 0.95, 0.9501], [0.3, 0.3, 0.3, 0.3]))
    assert df["label"].tolist() == ["healthy", "BOS-sink", "BOS-sink", "dead"]
    df = classify_heads(census_frame([0.1, 0.1], [0.01, 0.0099]))
    assert df["label"].tolist() == ["healthy", "dead"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sink": 0.9, "dead": 0.8},
        {"sink": 0.5, "dead": 0.5},
        {"sink": -0.1},
        {"dead": 1.5},
        {"min_output_share": 1.0},
        {"sink": float("nan")},
        {"dead": "0.9"},
    ],
)
def test_invalid_thresholds_are_refused(kwargs):
    with pytest.raises(InvalidArgumentError):
        Thresholds(**kwargs)


def test_the_command_lines_threshold_names_are_keywords_too():
    """classify_heads(sink_threshold=0.4) is Thresholds(sink=0.4), as --sink-threshold 0.4 is
    (it was a TypeError); a wrong thresholds= is one line saying what to write."""
    census = census_frame([0.45, 0.9, 0.1], [0.3, 0.3, 0.005])
    by_name = classify_heads(census, sink_threshold=0.4, dead_threshold=0.85, min_output_share=0)
    assert by_name["label"].tolist() == ["BOS-sink", "dead", "healthy"]
    assert by_name.attrs["thresholds"] == {"sink": 0.4, "dead": 0.85, "min_output_share": 0.0}
    assert by_name.equals(
        classify_heads(census, Thresholds(sink=0.4, dead=0.85, min_output_share=0))
    )
    sweep = threshold_sweep(census, sink_threshold=0.4)
    assert sweep.attrs["thresholds"]["sink"] == 0.4
    with pytest.raises(
        InvalidArgumentError, match=r"such as Thresholds\(sink=0.4\).*sink_threshold="
    ):
        classify_heads(census, {"sink": 0.4})


def test_threshold_sweep_counts_match_classification():
    rng = np.random.default_rng(0)
    census = census_frame(rng.random(40), rng.random(40) * 0.05)
    sweep = threshold_sweep(census)
    assert set(sweep["threshold"]) == {"sink", "dead", "min_output_share"}
    assert (sweep[["healthy", "BOS-sink", "dead"]].sum(axis=1) == 40).all()
    for name, value in [("sink", 0.3), ("dead", 0.8), ("min_output_share", 0.01)]:
        row = sweep[(sweep["threshold"] == name) & np.isclose(sweep["value"], value)].iloc[0]
        labels = classify_heads(census, Thresholds(**{name: value}))["label"]
        assert row["sick"] == (labels != "healthy").sum()
        assert row["dead"] == (labels == "dead").sum()
    sink_rows = sweep[sweep["threshold"] == "sink"]
    assert sink_rows["sick"].is_monotonic_decreasing and sink_rows["value"].max() < 0.95


def test_summary_reports_counts_and_sensitivity():
    census = census_frame([0.1, 0.48, 0.52, 0.97, 0.2, 0.1, 0.3, 0.49])
    census.attrs = {
        "model": "m",
        "n_layers": 2,
        "n_heads": 4,
        "n_seqs": 5,
        "seq_len": 9,
        "prepend_bos": False,
        "min_query_pos": 1,
    }
    text = format_summary(classify_heads(census), top=3)
    assert "healthy 6, BOS-sink 1, dead 1" in text
    assert "3 head(s) have BOS mass within 0.05" in text
    assert "sick count 1-4 for sink thresholds 0.45-0.55" in text
    assert "position 0 = first text token" in text


def test_write_classification_refuses_existing_folder(tmp_path):
    df = classify_heads(census_frame([0.1, 0.7]))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(OutputExistsError):
        write_classification(df, tmp_path / "out", formats=())
    with pytest.raises(OutputExistsError, match="did not write: keep.txt"):
        write_classification(df, tmp_path / "out", formats=(), overwrite=True)
    (tmp_path / "out" / "keep.txt").unlink()  # an empty folder may be written
    write_classification(df, tmp_path / "out", formats=(), overwrite=True)
    write_classification(df, tmp_path / "out", formats=("html",), overwrite=True)  # ours now
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        ["heads.csv", "heads.json", "summary.txt", "threshold_sweep.csv"]
        + ["plotly-cartesian.min.js", MARK_FILE, "index.html"]
        + [
            f"{n}.html"
            for n in ("bos_mass", "labels", "entropy", "output_share", "threshold_sweep")
        ]
    )
    with pytest.raises(InvalidArgumentError, match="format"):
        write_classification(df, tmp_path / "bad", formats=("gif",))
    assert not (tmp_path / "bad").exists()


def test_cli_end_to_end(planted, tmp_path, capsys):
    model, tokens = planted
    checkpoint = save_hf(model, tmp_path / "planted")
    texts = tmp_path / "text.txt"
    texts.write_text(TEXT)
    out = tmp_path / "result"
    static = ["svg", "pdf"] if plots.has_browser() else []  # else: html only
    argv = [
        str(checkpoint),
        "--texts",
        str(texts),
        "--seq-len",
        "32",
        "--n-seqs",
        "8",
        "--prepend-bos",
        "--out",
        str(out),
        "--format",
        "html",
        *static,
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert (
        "healthy 5, BOS-sink 1, dead 2" in printed
        and "the sick ones first, then by BOS mass" in printed
    )
    heads = pd.read_csv(out / "heads.csv")
    assert len(heads) == 8 and {"label", "reason", "bos_mass_std"} <= set(heads.columns)
    meta = json.loads((out / "heads.json").read_text())
    assert meta["metadata"]["prepend_bos"] is True
    assert "prepended to each text window (prepend_bos=True)" in meta["metadata"]["bos_rule"]
    assert meta["metadata"]["thresholds"]["sink"] == 0.5
    assert meta["metadata"]["data"] == texts.name and "torch" in meta["metadata"]["versions"]
    assert len(meta["heads"]) == 8 and "output_share" in meta["columns"]
    assert "plotly-cartesian.min.js" in (out / "bos_mass.html").read_text()  # the shared copy
    assert (out / "plotly-cartesian.min.js").is_file()
    if static:  # the browser-free case: tests/plots/test_no_browser.py
        assert (out / "bos_mass.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (out / "labels.svg").read_text().lstrip().startswith("<svg")
        assert (out / "labels.pdf").read_bytes()[:4] == b"%PDF"
    # The same folder again is refused before any work: one line, exit code 2.
    with pytest.raises(SystemExit) as exit_info:
        run("classify", argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: output folder")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--seq-len", "4", "--min-query-pos", "4"], "--min-query-pos"),
        (["--seq-len", "100000"], "shorter than one sequence of 100000 tokens"),
        (["--texts", "EMPTY"], "empty"),
        (["--sink-threshold", "0.99"], "below --dead-threshold"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(bloom_dir, tmp_path, capsys, extra, message):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "text.txt").write_text(TEXT)
    extra = [str(tmp_path / "empty.txt") if x == "EMPTY" else x for x in extra]
    argv = [str(bloom_dir), "--out", str(tmp_path / "out"), "--texts", str(tmp_path / "text.txt")]
    with pytest.raises(SystemExit) as exit_info:
        run("classify", argv + extra)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith("error: ") and message in err.splitlines()[-1]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a subprocess
def test_module_entry_point_reports_errors_without_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "headsurgeon", "classify", "--dead-threshold", "2"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: --dead-threshold must be a finite number >= 0 and <= 1, got 2.0"
    )
    assert "Traceback" not in result.stderr


# --- --importance: causal importance beside the labels ------------------------------------------


def importance_frame():
    """A classified table with importance columns: sinks and dead heads dormant or working."""
    df = classify_heads(census_frame([0.1, 0.2, 0.7, 0.8, 0.99, 0.97, 0.3, 0.1]))
    df["delta_loss"] = [0.5, 0.001, 0.0, 0.3, 0.0, -0.2, 0.02, 0.01]
    df["delta_loss_se"] = [0.01, 0.001, 0.0, 0.02, 0.0, 0.01, 0.011, 0.001]
    df["clean_loss"] = 3.25
    df["importance_method"], df["importance_ablation"] = "attribution", "mean"
    return df


def test_summary_splits_heads_into_dormant_and_working():
    df = importance_frame()
    text = format_summary(df, top=2)
    lines = text.splitlines()
    i = lines.index(
        "importance (attribution estimate of mean ablation): delta_loss = rise of the loss "
        "(nats) when a head's output is replaced; clean loss 3.2500 nats"
    )
    # Dormant: |delta| <= 2 SE (0.001 <= 0.002, the exact zeros, 0.02 <= 0.022); -0.2 works
    assert (
        lines[i + 1]
        == "dormant (|delta_loss| <= 2 SE) / working: healthy 2/2, BOS-sink 1/1, dead 1/1"
    )
    assert lines[i + 2] == (
        "working sick heads: L0H3 (BOS-sink) +0.3 ± 0.02, L1H1 (dead) -0.2 ± 0.01"
    )
    assert lines[i + 4] == "most important heads (top 2 by delta_loss):"
    assert [int(row.split()[1]) for row in lines[i + 6 : i + 8]] == [0, 3]  # L0H0, then L0H3
    assert "importance" not in format_summary(df.drop(columns=["delta_loss", "delta_loss_se"]))


def test_write_classification_carries_importance_columns_and_figures(tmp_path):
    df = importance_frame()
    df.attrs |= {"importance_method": "attribution", "importance_ablation": "mean"}
    out = write_classification(df, tmp_path / "out", formats=("html",))
    figures = sorted(p.stem for p in out.glob("*.html") if p.name != "index.html")
    assert figures == sorted(
        [
            "bos_mass",
            "labels",
            "entropy",
            "output_share",
            "threshold_sweep",
            "importance",
            "bos_vs_importance",
        ]
    )
    heads = pd.read_csv(out / "heads.csv")
    np.testing.assert_array_equal(heads["delta_loss"], df["delta_loss"])
    assert (heads["importance_method"] == "attribution").all()
    meta = json.loads((out / "heads.json").read_text())
    assert meta["metadata"]["importance_method"] == "attribution"
    assert meta["metadata"]["importance_ablation"] == "mean"
    assert {
        "delta_loss",
        "delta_loss_se",
        "clean_loss",
        "importance_method",
        "importance_ablation",
    } <= set(meta["columns"])
    assert meta["heads"][5]["delta_loss"] == -0.2
    assert "working sick heads: L0H3" in (out / "summary.txt").read_text()


def test_write_classification_without_browser_skips_importance_pngs_too(
    tmp_path, monkeypatch, caplog
):
    from choreographer.browsers.chromium import Chromium

    monkeypatch.delenv("BROWSER_PATH", raising=False)
    monkeypatch.setattr(Chromium, "find_browser", classmethod(lambda cls, **kwargs: None))
    out = write_classification(importance_frame(), tmp_path / "out")
    assert not list(out.glob("*.png")) and '"name":"bos_vs_importance"' in (out / PAGE).read_text()
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert line.startswith(f"warning: skipped 7 static figures in {out}/ (*.png)")


def test_cli_importance_adds_columns_and_figures_and_keeps_labels(planted, tmp_path, capsys):
    model, _ = planted
    checkpoint = save_hf(model, tmp_path / "planted")
    texts = tmp_path / "text.txt"
    texts.write_text(TEXT)
    argv = [
        str(checkpoint),
        "--texts",
        str(texts),
        "--seq-len",
        "32",
        "--n-seqs",
        "8",
        "--prepend-bos",
        "--batch-size",
        "3",
    ]
    assert main([*argv, "--out", str(tmp_path / "plain")]) == 0
    plain_summary = capsys.readouterr().out
    assert "delta_loss" not in plain_summary
    assert main([*argv, "--out", str(tmp_path / "imp"), "--importance"]) == 0  # bare: mean
    summary = capsys.readouterr().out

    plain = pd.read_csv(tmp_path / "plain" / "heads.csv")
    heads = pd.read_csv(tmp_path / "imp" / "heads.csv")
    # The census and its labels are the run without --importance's, number for number.
    pd.testing.assert_frame_equal(heads[plain.columns], plain)
    assert plain_summary.split("\nwrote")[0] in summary
    # The columns are head_importance's on the same sequences.
    reloaded = load_model(checkpoint)
    tokens = to_sequences(reloaded, [texts], seq_len=32, n_seqs=8, prepend_bos=True).tokens
    direct = head_importance(reloaded, tokens, method="mean", batch_size=3, progress=False)
    for column in ("delta_loss", "delta_loss_se", "clean_loss"):
        np.testing.assert_allclose(heads[column], direct[column], rtol=1e-12, atol=0)
    assert (heads["importance_method"] == "mean").all()
    assert (heads["importance_ablation"] == "mean").all()
    # The silenced head writes z = 0 everywhere, so its mean is 0 too: removing it costs nothing.
    silent = heads.set_index(["layer", "head"]).loc[SILENT]
    assert silent["delta_loss"] == 0 and silent["delta_loss_se"] == 0
    assert (heads["delta_loss"].abs() > 1e-6).sum() >= 4  # the other heads do matter
    dormant = heads["delta_loss"].abs() <= 2 * heads["delta_loss_se"]
    split = ", ".join(
        f"{label} {(dormant & (heads['label'] == label)).sum()}/"
        f"{(~dormant & (heads['label'] == label)).sum()}"
        for label in ("healthy", "BOS-sink", "dead")
    )
    assert f"dormant (|delta_loss| <= 2 SE) / working: {split}" in summary
    assert "importance (mean ablation)" in summary and "most important heads" in summary

    meta = json.loads((tmp_path / "imp" / "heads.json").read_text())["metadata"]
    assert meta["importance_method"] == meta["importance_ablation"] == "mean"
    assert meta["importance_n_tokens"] == 8 * 31 and meta["data"] == texts.name
    assert meta["importance_clean_loss"] == pytest.approx(direct.attrs["clean_loss"], rel=1e-12)
    for name in ("importance", "bos_vs_importance"):  # on the page, which holds every figure
        assert f'"name":"{name}"' in (tmp_path / "imp" / PAGE).read_text()
        assert f'"name":"{name}"' not in (tmp_path / "plain" / PAGE).read_text()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--importance", "gradient"], "argument --importance: invalid choice: 'gradient'"),
        (["--importance", "--seq-len", "1"], "--importance needs --seq-len 2 or more"),
        (["--importance", "resample", "--n-seqs", "1"], "use --n-seqs 2 or more"),
    ],
)
def test_cli_bad_importance_is_one_line_before_any_model_loads(tmp_path, capsys, extra, message):
    # A model that does not exist: an error about it would mean the model was loaded first.
    argv = [str(tmp_path / "no-such-model"), "--out", str(tmp_path / "out"), *extra]
    with pytest.raises(SystemExit) as exit_info:
        run("classify", argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and message in err
    assert not (tmp_path / "out").exists()


def test_cli_census_and_importance_take_every_sequence_asked_for(bloom_dir, tmp_path, monkeypatch):
    # More than the library's default of 64 sequences: the shared token tensor is used whole.
    from choreographer.browsers.chromium import Chromium

    monkeypatch.setattr(Chromium, "find_browser", classmethod(lambda cls, **kwargs: None))
    (tmp_path / "text.txt").write_text(TEXT)
    out = tmp_path / "out"
    argv = [
        str(bloom_dir),
        "--texts",
        str(tmp_path / "text.txt"),
        "--n-seqs",
        "70",
        "--seq-len",
        "4",
        "--batch-size",
        "70",
        "--importance",
        "zero",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    meta = json.loads((out / "heads.json").read_text())["metadata"]
    assert meta["n_seqs"] == 70 and meta["importance_n_tokens"] == 70 * 3


def test_cli_several_models_one_folder_each_and_the_cross_scale_table(
    planted, bloom6_dir, tmp_path, capsys
):
    model, _ = planted
    checkpoint = save_hf(model, tmp_path / "planted")
    out = tmp_path / "scales"
    texts = tmp_path / "text.txt"
    texts.write_text(TEXT)
    common = ["--texts", str(texts), "--seq-len", "32", "--n-seqs", "8", "--prepend-bos"]
    assert main([str(checkpoint), str(bloom6_dir), *common, "--out", str(out)]) == 0
    assert {"planted", bloom6_dir.name, "cross_scale.csv", "summary.txt"} <= {
        p.name for p in out.iterdir()
    }
    shares = pd.read_csv(out / "cross_scale.csv")
    for name in ("planted", bloom6_dir.name):
        heads = pd.read_csv(out / name / "heads.csv")
        mine = shares[shares["model"].map(lambda m, n=name: Path(m).name == n)]
        whole = mine[mine["band"] == "all"].iloc[0]
        assert whole["n_heads"] == len(heads)
        assert whole["sick"] == heads["label"].isin(["BOS-sink", "dead"]).sum()
        assert mine[mine["band"] != "all"]["n_heads"].sum() == len(heads)
    planted_all = shares[(shares["band"] == "all") & shares["model"].str.endswith("planted")]
    assert planted_all["sick"].iloc[0] == 3  # the planted model's BOS-sink and 2 dead heads


def test_cli_several_models_refused_before_loading(planted, tmp_path, capsys):
    line = error_line(main, ["organism", "organism", "--out", tmp_path / "x"], capsys)
    assert "names organism more than once" in line
    # Another folder of the same name: a symlink, so nothing is loaded or copied.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "organism").symlink_to(ORGANISM_DIR / "organism")
    mine = str(tmp_path / "mine" / "organism")
    line = error_line(main, ["organism", mine, "--out", tmp_path / "x"], capsys)
    assert "share an output folder name" in line
    assert not (tmp_path / "x").exists()
