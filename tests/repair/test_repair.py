"""The repair pipeline and its CLI on a tiny model with a planted BOS sink and a dead head."""

from __future__ import annotations

import json
import logging
import math
import shutil

import pandas as pd
import pytest
import torch
from conftest import DEAD, SINK, TEXT
from safetensors.torch import load_file
from test_finetune import outside, snapshot

import headsurgeon.finetune.trainer as finetune_module
import headsurgeon.repair.pipeline as repair_module
from headsurgeon import load_model, plots
from headsurgeon.classify import Thresholds
from headsurgeon.cli import run
from headsurgeon.cli.repair import EXIT_DAMAGED, EXIT_WORSE, main
from headsurgeon.data import to_sequences
from headsurgeon.evals import perplexity
from headsurgeon.finetune import FinetuneConfig
from headsurgeon.repair import PassResult, RepairResult, repair
from headsurgeon.repair.policy import head_failures
from headsurgeon.reports import write_classification, write_report
from headsurgeon.surgery import HeadSet


def label(census, pair):
    return census.set_index(["layer", "head"]).loc[pair, "label"]


def test_repair_recovers_planted_heads_and_writes_report(injured, tmp_path, caplog):
    model = load_model(injured)
    before = snapshot(model)
    with caplog.at_level(logging.INFO, logger="headsurgeon"):
        result = repair(
            model,
            TEXT,
            eval_corpus=TEXT,
            eval_on_train=True,
            census_data=TEXT,
            census_seq_len=32,
            census_n_seqs=16,
            prepend_bos=True,
            train_seq_len=32,
            passes=2,
            progress=False,
            finetune_config=FinetuneConfig(steps=20, lr=3e-3, batch_size=4),
        )
    assert label(result.census_before, SINK) == "BOS-sink"
    assert label(result.census_before, DEAD) == "dead"
    first = result.passes[0]
    assert first.targeted == HeadSet([DEAD, SINK])  # the census's choice
    assert first.recovered == HeadSet([DEAD, SINK]) and result.recovery_rate == 1.0
    # No collateral damage, held-out perplexity down: the verdict is ok and pass 1 is kept.
    assert result.ok and result.failure_reason is None and result.best_pass == 1
    assert not result.collateral and first.perplexity_change["heldout"] < 0
    # The first evaluation has no loss yet: the log says what it measured, not "loss nan".
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert steps[0].startswith("step 0: perplexity") and not any("nan" in m for m in steps)
    # Two perplexities of held-out text, each named where it prints (issue 52): the step lines'
    # on the fine-tuning's check windows, the census and pass lines' on the verdict's.
    n_eval = result.settings["eval_sequences"][0]
    check = f"on the fine-tuning's check windows (16 training, first 16 of {n_eval} held-out)"
    assert all(check in m and "targets' mean BOS mass" in m for m in steps)
    verdict = f"on the verdict's windows ({n_eval} training, all {n_eval} held-out, 32 tokens each)"
    judged = [m for m in caplog.messages if m.startswith(("census: ", "pass 1: 2/2 recovered"))]
    assert len(judged) == 2 and all(f"perplexity {verdict}: train " in m for m in judged)
    assert label(result.census_after, SINK) == "healthy"
    # Only the targeted heads' Q/K/V/O slices changed; every other parameter is bit-identical.
    assert outside(model, before, result.targeted) == []

    report = result.to_dict()
    assert set(report) >= {"targeted", "recovered", "recovery_rate", "perplexity", "drift"}
    assert len(report["perplexity"]["train"]) == len(result.passes) + 1
    assert report["passes"][0]["heads"][0]["label_before"] == "dead"
    out = write_report(result, tmp_path / "out", formats=("html",))
    files = {p.name for p in out.iterdir()}
    assert {
        "report.md",
        "report.json",
        "census_before.csv",
        "census_after.csv",
        "model",
        "bos_mass_diff.html",
        "pass1_bos_mass_diff.html",
        "training.html",
    } <= files
    written = json.loads((out / "report.json").read_text())
    assert written["recovery_rate"] == 1.0 and written["verdict"] == "ok"
    assert written["best_pass"] == 1 and written["collateral"]["count"] == 0
    assert "**Verdict: ok**" in (out / "report.md").read_text()
    assert "scored whole (the log's \"verdict's windows\"; " in (out / "report.md").read_text()
    # Prune versus repair: the same heads zero-ablated through plain TransformerLens hooks on a
    # fresh copy of the injured model give the report's pruned held-out perplexity.
    comparison = written["prune_vs_repair"]
    assert comparison["heads"] == ["L1H1", "L1H3"]
    assert comparison["injured"] == result.passes[0].perplexity_before
    assert comparison["repaired"] == result.passes[0].perplexity_after
    fresh = load_model(injured)
    held_out = to_sequences(
        fresh, TEXT, seq_len=32, n_seqs=32, prepend_bos=True
    ).tokens  # the run's

    def zero_targets(z, hook):
        z[:, :, [DEAD[1], SINK[1]]] = 0
        return z

    def ppl():
        return perplexity(
            fresh,
            held_out,
            window=32,
            batch_size=8,
            prepend_bos=False,
            max_windows=None,
            progress=False,
        )

    with fresh.hooks(fwd_hooks=[("blocks.1.attn.hook_z", zero_targets)]):
        brute = ppl()
    assert comparison["pruned_zero"]["heldout"] == pytest.approx(brute, rel=1e-6)
    assert brute != pytest.approx(comparison["injured"]["heldout"], rel=1e-6)
    markdown = (out / "report.md").read_text()
    assert "Prune versus repair versus control of L1H1,L1H3 (pass 1's targets)" in markdown
    assert "| pruned: targets mean-ablated |" in markdown
    classified = write_classification(result.census_before, tmp_path / "cls", formats=())
    header = (classified / "heads.csv").read_text().splitlines()[0]
    assert (out / "census_before.csv").read_text().splitlines()[0] == header
    assert (out / "census_after.csv").read_text().splitlines()[0] == header

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out / "model")
    tokens = to_sequences(model, TEXT, seq_len=16, n_seqs=2).tokens
    torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-4, atol=1e-4)


def data_args(injured, text_file):
    """The checkpoint and one small text for the census, training and evaluation."""
    return [
        str(injured),
        "--texts",
        str(text_file),
        "--corpus",
        str(text_file),
        "--eval-corpus",
        str(text_file),
        "--allow-eval-on-train",
        "--prepend-bos",
        "--seq-len",
        "32",
        "--n-seqs",
        "16",
        "--train-seq-len",
        "32",
        "--batch-size",
        "4",
    ]


def cli_args(injured, text_file, out, *extra):
    # --min-output-share 0.2 leaves heads sick after pass 1; it also labels the two healthy heads
    # beside the loud repaired ones in layer 1 dead (collateral), which --max-collateral allows.
    return [
        *data_args(injured, text_file),
        "--steps",
        "4",
        "--lr",
        "1e-2",
        "--min-output-share",
        "0.2",
        "--max-collateral",
        "2",
        "--quiet",
        "--out",
        str(out),
        *extra,
    ]


def test_cli_interrupted_run_resumes_to_the_same_result(
    injured, text_file, tmp_path, monkeypatch, capsys
):
    straight = tmp_path / "straight"
    assert main(cli_args(injured, text_file, straight)) == 0
    report = json.loads((straight / "report.json").read_text())
    assert len(report["passes"]) == 2  # output shares < 0.2 leave heads sick after pass 1
    if plots.has_browser():  # else skipped with a warning (tests/plots/test_no_browser.py)
        assert (straight / "labels_after.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "straight.partial").exists()

    save = finetune_module.save_checkpoint

    def killed_in_pass_2(path, state):
        save(path, state)
        if "pass2" in str(path):
            raise KeyboardInterrupt  # like Ctrl-C right after the first checkpoint of pass 2

    out = tmp_path / "resumed"
    monkeypatch.setattr(finetune_module, "save_checkpoint", killed_in_pass_2)
    with pytest.raises(KeyboardInterrupt):
        main(cli_args(injured, text_file, out))
    monkeypatch.undo()
    assert not out.exists() and (tmp_path / "resumed.partial" / "pass1" / "done.json").exists()

    with pytest.raises(SystemExit) as exit_info:  # the same run with other heads cannot resume
        run("repair", cli_args(injured, text_file, out, "--heads", "L0H0", "--resume", str(out)))
    assert exit_info.value.code == 2
    assert "differs (settings.heads: None vs 'L0H0')" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # starting over without --resume or --overwrite is refused
        run("repair", cli_args(injured, text_file, out))

    # The damage limits judge the run but do not change its training: they may change on resume.
    resume = ("--resume", str(out), "--max-ppl-increase", "0.5")
    assert main(cli_args(injured, text_file, out, *resume)) == 0
    for name, value in load_file(straight / "model" / "model.safetensors").items():
        assert torch.equal(load_file(out / "model" / "model.safetensors")[name], value), name
    resumed = json.loads((out / "report.json").read_text())
    for key in ("targeted", "recovered", "recovery_rate", "perplexity", "drift"):
        assert resumed[key] == report[key], key


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--heads", "L2H0"], "L2H0 is out of range"),
        (["--heads", "L1H1,L1H0-2"], "listed twice"),
        (["--lr", "0"], "lr must be"),
        (["--steps", "0"], "steps"),
        (["--batch-size", "64"], "fewer than one batch"),
        (["--resume", "{out}"], "no interrupted run to resume"),
        (["--max-ppl-increase", "-0.5"], "--max-ppl-increase must be a number >= 0, got"),
        (["--max-ppl-increase", "nan"], "--max-ppl-increase must be a number >= 0, got"),
        (["--max-collateral", "-1"], "--max-collateral: expected an integer >= 0"),
    ],
)
def test_cli_bad_input_is_one_line_and_leaves_no_output(
    injured, text_file, tmp_path, capsys, extra, message
):
    out = tmp_path / "out"
    args = cli_args(injured, text_file, out, *[e.format(out=out) for e in extra])
    with pytest.raises(SystemExit) as exit_info:
        run("repair", args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1]
    assert not out.exists()


DIVERGING = ("--steps", "20", "--lr", "1", "--max-grad-norm", "1e30", "--warmup", "0")


def diverging_args(injured, text_file, out, *extra):
    """lr 1 without clipping: the repaired heads drown their two healthy layer-mates (dead)."""
    return [*data_args(injured, text_file), *DIVERGING, "--quiet", "--out", str(out), *extra]


def test_a_damaging_repair_fails_and_gives_the_model_back(injured, text_file, tmp_path, capsys):
    model = load_model(injured)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = repair(
        model,
        TEXT,
        eval_corpus=TEXT,
        eval_on_train=True,
        census_data=TEXT,
        census_seq_len=32,
        census_n_seqs=16,
        prepend_bos=True,
        train_seq_len=32,
        passes=2,
        progress=False,
        finetune_config=FinetuneConfig(
            steps=20, lr=1.0, batch_size=4, warmup_steps=0, max_grad_norm=1e30
        ),
    )
    assert len(result.passes) == 1  # the run stops at the damaging pass
    damaged = result.passes[0]
    assert damaged.collateral == HeadSet([(1, 0), (1, 2)]) and "turned sick" in damaged.failure
    assert not damaged.recovered and damaged.still_sick == damaged.targeted
    assert (
        not result.ok
        and result.best_pass is None
        and result.failure_reason.startswith(
            "pass 1 damaged the model (2 healthy frozen head(s) turned sick (L1H0,L1H2"
        )
    )
    assert not result.recovered and result.recovery_rate == 0.0 and not result.collateral
    for name, value in model.state_dict().items():  # the original weights, bit for bit
        assert torch.equal(value, before[name]), name
    out = write_report(result, tmp_path / "report", formats=())
    assert not (out / "model").exists()
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == "failed" and report["best_pass"] is None
    assert report["recovery_rate"] == 0.0 and report["passes"][0]["verdict"] == "damaged"
    assert report["passes"][0]["collateral"]["heads"] == ["L1H0", "L1H2"]
    assert "**Verdict: failed**" in (out / "report.md").read_text()

    out = tmp_path / "cli"
    assert main(diverging_args(injured, text_file, out)) == EXIT_DAMAGED
    captured = capsys.readouterr()
    assert "repair failed: pass 1 damaged the model" in captured.err
    assert "Verdict: failed" in captured.out and "(no model/)" in captured.out
    assert (out / "report.md").exists() and not (out / "model").exists()
    assert not (tmp_path / "cli.partial").exists()
    # Allowing the collateral makes the same run a success, with a model.
    allowed = tmp_path / "allowed"
    assert main(diverging_args(injured, text_file, allowed, "--max-collateral", "2")) == 0
    assert (allowed / "model").is_dir()


def test_a_later_damaging_pass_is_undone_and_the_best_pass_kept(injured, monkeypatch):
    settings = dict(
        census_data=TEXT,
        census_seq_len=32,
        census_n_seqs=16,
        prepend_bos=True,
        train_seq_len=32,
        progress=False,
        thresholds=Thresholds(min_output_share=0.2),
        max_collateral=2,
        finetune_config=FinetuneConfig(steps=4, lr=1e-2, batch_size=4),
    )
    one_pass = load_model(injured)
    repair(one_pass, TEXT, eval_corpus=TEXT, eval_on_train=True, passes=1, **settings)
    measure = repair_module._Run.perplexities
    calls = []

    def pass_2_diverges(run):
        # before the repair, pruned instead (mean, zero), after pass 1, after pass 2
        calls.append(None)
        ppl = measure(run)
        return ppl | {"heldout": math.nan} if len(calls) == 5 else ppl

    monkeypatch.setattr(repair_module._Run, "perplexities", pass_2_diverges)
    model = load_model(injured)
    result = repair(model, TEXT, eval_corpus=TEXT, eval_on_train=True, passes=2, **settings)
    assert [p.damaged for p in result.passes] == [False, True]
    assert "held-out perplexity" in result.passes[1].failure  # NaN is damage
    assert not result.ok and result.best_pass == 1
    assert result.failure_reason.endswith("the model of pass 1 is kept")
    assert result.census_after is result.passes[0].census_after
    assert result.recovered == result.passes[0].recovered
    kept = model.state_dict()
    for name, value in one_pass.state_dict().items():  # pass 2's training undone exactly
        assert torch.equal(kept[name], value), name


def labelled(*labels):
    """A classified census of one layer whose head i has ``labels[i]``."""
    return pd.DataFrame({"layer": 0, "head": range(len(labels)), "label": list(labels)})


def judged(before, after, targeted, failure=None):
    """The verdict of a one-pass run from its censuses alone (no model is needed to judge)."""
    targeted = HeadSet.parse(targeted)
    one = PassResult(
        index=1,
        targeted=targeted,
        recovered=HeadSet(),
        still_sick=HeadSet(),
        drifted=HeadSet(),
        census_before=before,
        census_after=after,
        perplexity_before={},
        perplexity_after={},
        training=None,
        failure=failure,
    )
    return RepairResult(
        model=None,
        passes=[one],
        census_before=before,
        census_after=after,
        settings={},
        best_pass=None if failure else 1,
    )


@pytest.mark.parametrize(
    ("after", "verdict", "failed"),
    [
        (("healthy", "healthy", "healthy"), "ok", {}),
        (("healthy", "BOS-sink", "healthy"), "incomplete", {"L0H1": "still BOS-sink"}),
        (
            ("healthy", "dead", "BOS-sink"),
            "incomplete",
            {"L0H1": "BOS-sink before, dead after", "L0H2": "still BOS-sink"},
        ),
        (
            ("dead", "healthy", "healthy"),
            "worse",
            {"L0H0": "healthy before, dead after being targeted"},
        ),
    ],
)
def test_a_target_that_ends_sick_is_a_failure_of_that_head(after, verdict, failed):
    before = labelled("healthy", "BOS-sink", "BOS-sink")  # L0H0 forced: --heads L0H0-2
    result = judged(before, labelled(*after), "L0H0-2")
    assert head_failures(before, labelled(*after), "L0H0-2") == failed
    assert result.failed_heads == failed and result.verdict == verdict
    assert result.ok == (verdict != "worse") and (result.failure_reason is None) == result.ok
    assert result.worsened == (HeadSet([(0, 0)]) if verdict == "worse" else HeadSet())
    assert result.passes[0].worsened == result.worsened
    if verdict == "worse":
        assert result.failure_reason == (
            "1 targeted head(s) turned sick (L0H0: healthy before, dead after being targeted); "
            "the model of pass 1 is kept"
        )
    # A frozen head turning sick is collateral damage, not a failure of a target.
    assert judged(before, labelled(*after), "L0H1-2").worsened == HeadSet()
    # A damaging pass outranks everything: its reason is given, the failed heads still listed.
    damaged = judged(before, labelled(*after), "L0H0-2", failure="held-out perplexity up")
    assert damaged.verdict == "failed" and damaged.failure_reason.startswith("pass 1 damaged")


@pytest.mark.parametrize(
    ("before", "after", "code", "verdict", "why"),
    [
        ("healthy", "dead", EXIT_WORSE, "worse", "healthy before, dead after being targeted"),
        ("BOS-sink", "BOS-sink", 0, "incomplete", "still BOS-sink"),
    ],
)
def test_cli_exit_status_says_a_forced_head_ended_sick(
    bloom_dir, text_file, tmp_path, capsys, monkeypatch, before, after, code, verdict, why
):
    # Training cannot be relied on to make a healthy head sick: the censuses say L0H0 is
    # `before` before the pass and `after` after it, whatever the training did.
    measure = repair_module._Run.census
    calls = []

    def l0h0_labelled(run):
        census = measure(run)
        census.loc[(census.layer == 0) & (census["head"] == 0), "label"] = (before, after)[
            bool(calls)
        ]
        calls.append(None)
        return census

    monkeypatch.setattr(repair_module._Run, "census", l0h0_labelled)
    out = tmp_path / "out"
    args = [
        str(bloom_dir),
        "--texts",
        str(text_file),
        "--corpus",
        str(text_file),
        "--eval-corpus",
        str(text_file),
        "--allow-eval-on-train",
        "--seq-len",
        "32",
        "--n-seqs",
        "8",
        "--train-seq-len",
        "32",
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--passes",
        "1",
        "--heads",
        "L0H0",
        "--no-control",  # two censuses: before and after the pass
        "--quiet",
        "--out",
        str(out),
    ]
    assert main(args) == code and len(calls) == 2
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == verdict and report["failed_heads"] == {"L0H0": why}
    assert report["recovered"] == [] and (out / "model").is_dir()
    assert report["passes"][0]["verdict"] == ("worse" if code else "ok")
    captured = capsys.readouterr()
    assert f"**Verdict: {verdict}**" in captured.out
    assert f"Failed heads (targets sick at the end): L0H0 ({why})." in captured.out
    if code:
        assert captured.err.strip().endswith(
            f"repair failed: 1 targeted head(s) turned sick (L0H0: {why}); "
            "the model of pass 1 is kept"
        )
    else:
        assert "repair failed" not in captured.err


def test_cli_help_names_the_damage_limits_and_exit_status(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-ppl-increase FRACTION" in text and "default 0.1, i.e. +10%" in text
    assert "--max-collateral N" in text and f"{EXIT_DAMAGED} a pass damaged the model" in text
    assert f"{EXIT_WORSE} a targeted head that was healthy ended sick" in text


def test_cli_refuses_nothing_to_repair_and_occupied_output(bloom_dir, text_file, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit):
        run(
            "repair",
            [
                str(bloom_dir),
                "--texts",
                str(text_file),
                "--corpus",
                str(text_file),
                "--eval-corpus",
                str(text_file),
                "--allow-eval-on-train",
                "--seq-len",
                "32",
                "--n-seqs",
                "8",
                "--train-seq-len",
                "32",
                "--quiet",
                "--out",
                str(out),
            ],
        )
    assert "nothing to repair" in capsys.readouterr().err
    assert not out.exists()
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        run("repair", [str(bloom_dir), "--out", str(out)])
    assert "already holds files" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


@pytest.fixture(scope="module")
def recommending(injured, tmp_path_factory):
    """The injured checkpoint with repair settings recommended in its headsurgeon.json, and
    the training numerics organism-injured records (the README's model)."""
    from headsurgeon.loading.facts import model_metadata

    folder = tmp_path_factory.mktemp("recommending") / "model"
    shutil.copytree(injured, folder)
    metadata = json.loads((folder / "headsurgeon.json").read_text())
    metadata["repair"] = {"steps": 6, "lr": 1e-2}
    metadata["training_numerics"] = model_metadata("organism-injured")["training_numerics"]
    (folder / "headsurgeon.json").write_text(json.dumps(metadata))
    return folder


def test_python_repair_gives_the_clis_report(recommending, text_file, tmp_path):
    out = tmp_path / "cli"
    args = [
        str(recommending),
        "--texts",
        str(text_file),
        "--corpus",
        str(text_file),
        "--eval-corpus",
        str(text_file),
        "--allow-eval-on-train",
        "--prepend-bos",
        "--seq-len",
        "32",
        "--n-seqs",
        "16",
        "--train-seq-len",
        "32",
        "--quiet",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    cli = json.loads((out / "report.json").read_text())
    api = repair(
        load_model(recommending),
        [text_file],
        eval_corpus=[text_file],
        eval_on_train=True,
        census_data=[text_file],
        census_seq_len=32,
        census_n_seqs=16,
        prepend_bos=True,
        train_seq_len=32,
        progress=False,
    ).to_dict()
    api = json.loads(json.dumps(api))  # as report.json holds it (tuples become lists)
    assert api["settings"]["finetune"]["steps"] == 6 and api["settings"]["finetune"]["lr"] == 1e-2
    described = ("train_data", "eval_data", "census_data")  # the CLI reads files, then passes text
    settings = {k: v for k, v in api["settings"].items() if k not in described}
    assert settings == {k: v for k, v in cli["settings"].items() if k not in described}
    for key in ("targeted", "recovered", "still_sick", "labels_after", "perplexity", "drift"):
        assert api[key] == cli[key], key


def test_the_readmes_python_block_runs(recommending, tmp_path, monkeypatch):
    import re
    from pathlib import Path

    import headsurgeon as hs

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## In Python", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert 'hs.load_model("organism-injured")' in block
    # The same code on a tiny model: every call, argument and default as written.
    monkeypatch.setattr(hs, "load_model", lambda name, **kw: load_model(recommending, **kw))
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["result"].settings["finetune"]["steps"] == 6  # the recommended settings
    assert (tmp_path / "labels.html").exists()
    assert (tmp_path / "repaired" / "model.safetensors").exists()


@pytest.mark.slow  # a subprocess
def test_python_m_repair_shows_its_progress_messages(injured, text_file, tmp_path):
    import subprocess
    import sys

    # --no-control: the messages are the point, not a second arm's training (a busy machine's
    # subprocess ran into the timeout with it)
    args = cli_args(injured, text_file, tmp_path / "out", "--passes", "1", "--no-control")
    done = subprocess.run(
        [sys.executable, "-m", "headsurgeon", "repair", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    # Under -m the library module runs as __main__ and hands over to headsurgeon.cli.repair;
    # the pipeline's messages must still reach the user.
    assert "census: " in done.stderr and "pass 1: " in done.stderr
    # The run's duration, told after its first training step (issue 42 item 7).
    told = done.stderr.index("repair: about ")
    assert done.stderr.index("pass 1: re-initialising") < told < done.stderr.index(" recovered, ")
