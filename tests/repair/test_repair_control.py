"""The repair's control arm: the same heads retrained without re-initialisation, beside the
repair, with the redistribution over the frozen heads; its report files and its resume."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import DEAD, TEXT, head_weight
from safetensors.torch import load_file
from test_finetune import outside, snapshot
from test_repair import cli_args

import headsurgeon.finetune.trainer as finetune_module
import headsurgeon.repair.pipeline as repair_module
from headsurgeon import load_model
from headsurgeon.census import run_census
from headsurgeon.cli import run
from headsurgeon.cli.repair import main
from headsurgeon.data import to_sequences
from headsurgeon.evals import perplexity
from headsurgeon.finetune import FinetuneConfig, finetune
from headsurgeon.repair import repair
from headsurgeon.repair.resume import RUN_FILE
from headsurgeon.reports import write_report
from headsurgeon.surgery import head_slices

SETTINGS = dict(
    eval_corpus=TEXT,
    eval_on_train=True,
    census_data=TEXT,
    census_seq_len=32,
    census_n_seqs=16,
    prepend_bos=True,
    train_seq_len=32,
    passes=1,
    progress=False,
    finetune_config=FinetuneConfig(steps=20, lr=3e-3, batch_size=4),
)


def recording(monkeypatch):
    """Wrap the pipeline's fine-tuning: record each call's heads, data, options and starting
    slices, and check that it changed nothing outside the heads' slices."""
    calls = []
    train = repair_module.finetune

    def recorded(model, heads, tokens, **options):
        before = snapshot(model)
        start = {k: v.clone() for k, v in head_slices(model, heads).items()}
        result = train(model, heads, tokens, **options)
        assert outside(model, before, heads) == []  # only the chosen slices changed
        calls.append({"heads": heads, "train": tokens, "options": options, "start": start})
        return result

    monkeypatch.setattr(repair_module, "finetune", recorded)
    return calls


def test_the_control_retrains_the_same_heads_from_their_own_weights(injured, monkeypatch):  # noqa: F811
    calls = recording(monkeypatch)
    model = load_model(injured)
    result = repair(model, TEXT, **SETTINGS)
    repaired = snapshot(model)
    targets = result.passes[0].targeted
    assert [c["heads"] for c in calls] == [targets, targets]  # the repair pass, then the control
    fix, control = calls
    # The same data, steps, seed and schedule: the same tokens and the same options.
    assert (
        torch.equal(fix["train"].tokens, control["train"].tokens)
        and fix["options"] == control["options"]
    )
    # The repair starts from re-initialised heads (W_O zeroed), the control from the injured
    # model's own weights, bit for bit.
    assert not fix["start"]["blocks.1.attn.W_O"].any()
    given = head_slices(load_model(injured), targets)
    assert all(torch.equal(control["start"][k], v) for k, v in given.items())
    assert not torch.equal(control["start"]["blocks.1.attn.W_O"], fix["start"]["blocks.1.attn.W_O"])

    # The control arm is one pass on pass 1's targets, measured like a pass.
    assert [p.targeted for p in result.control] == [targets]
    summary = result.control_summary()
    assert summary["targeted"] == targets.names() and summary["passes"] == 1
    assert result.to_dict()["prune_vs_repair"]["control"] == result.control[0].perplexity_after

    # Brute force: the injured model fine-tuned with the same call, rounded as a repair rounds,
    # gives the control's perplexity and census.
    brute = load_model(injured)
    finetune(brute, targets, control["train"], **control["options"])
    held_out = to_sequences(brute, TEXT, seq_len=32, n_seqs=32, prepend_bos=True).tokens
    ppl = perplexity(
        brute,
        held_out,
        window=32,
        batch_size=4,
        prepend_bos=False,
        max_windows=None,
        progress=False,
    )
    assert result.control[0].perplexity_after["heldout"] == pytest.approx(ppl, rel=1e-6)
    census = run_census(
        brute,
        to_sequences(brute, TEXT, seq_len=32, n_seqs=16, prepend_bos=True).tokens,
        batch_size=4,
        progress=False,
    )
    measured = result.control_census.set_index(["layer", "head"])
    expected = census.set_index(["layer", "head"])
    for column in ("bos_mass", "output_share"):
        torch.testing.assert_close(
            torch.tensor(measured[column].to_numpy()), torch.tensor(expected[column].to_numpy())
        )
    # The redistribution: every frozen head's change, control model minus the model as given.
    moved = result.redistribution()
    assert not set(zip(moved["layer"], moved["head"], strict=True)) & set(result.targeted)
    assert len(moved) == len(result.census_before) - len(result.targeted)
    first = result.census_before.set_index(["layer", "head"])
    for row in moved.itertuples():
        key = (row.layer, row.head)
        want = expected.loc[key, "bos_mass"] - first.loc[key, "bos_mass"]
        assert row.d_bos_mass_control == pytest.approx(want, abs=1e-6)
        assert row.d_bos_mass_repaired == pytest.approx(
            result.census_after.set_index(["layer", "head"]).loc[key, "bos_mass"]
            - first.loc[key, "bos_mass"]
        )
    summary = moved.attrs["summary"]
    assert set(summary) == {"repaired", "control"}
    assert summary["control"]["bos_mass"]["mean_abs"] == pytest.approx(
        moved["d_bos_mass_control"].abs().mean()
    )

    # Without the control: one fine-tuning, no control, and the same kept model bit for bit
    # (the control arm leaves the repaired model as it was).
    calls.clear()
    alone = load_model(injured)
    skipped = repair(alone, TEXT, control=False, **SETTINGS)
    assert len(calls) == 1 and skipped.control is None and skipped.control_summary() is None
    assert skipped.to_dict()["control"] is None
    assert set(skipped.redistribution().attrs["summary"]) == {"repaired"}
    assert all(torch.equal(v, repaired[k]) for k, v in snapshot(alone).items())


def test_the_control_counts_apart_a_target_it_cannot_move(injured, tmp_path):  # noqa: F811
    # The dead head L1H1 silenced wholly (W_V, b_V and W_O zero, as organism-injured's L3H4):
    # every gradient on its slices is exactly 0, so the control cannot move it.
    model = load_model(injured)
    with torch.no_grad():
        for name in ("W_V", "b_V"):
            head_weight(model, DEAD[0], name)[DEAD[1]] = 0
    config = FinetuneConfig(steps=4, lr=3e-3, batch_size=4, eval_every=4)
    result = repair(model, TEXT, **(SETTINGS | {"finetune_config": config}))
    table = result.control_movability.set_index("name")
    assert list(table.index) == result.control[0].targeted.names() == ["L1H1", "L1H3"]
    assert not table.loc["L1H1", "movable"] and table.loc["L1H3", "movable"]
    assert table.loc["L1H1", "structural"] and table.loc["L1H1", "zero_gradient"]
    # The control left it writing nothing at all.
    after = result.control_census.set_index(["layer", "head"])
    assert after.loc[DEAD, "output_share"] == 0 and after.loc[DEAD, "label"] == "dead"

    summary = json.loads(json.dumps(result.to_dict()))["control"]
    why = "value and output weights all zero: every gradient exactly 0"
    assert summary["unmovable"] == {"L1H1": why} and summary["movable"] == ["L1H3"]
    assert summary["movable_recovery_rate"] == len(summary["movable_recovered"]) / 1
    assert set(summary["movable_recovered"]) <= {"L1H3"} <= set(summary["targeted"])
    heads = {h["name"]: h for h in summary["heads"]}
    assert heads["L1H1"]["movable"] is False and heads["L1H1"]["why_unmovable"] == why
    assert heads["L1H1"]["caught_by"] == ["structural", "measured"]
    assert heads["L1H3"]["caught_by"] == []
    assert heads["L1H3"]["movable"] is True and heads["L1H3"]["why_unmovable"] is None

    out = write_report(result, tmp_path / "report", formats=(), save_model=False)
    healed = len(summary["movable_recovered"])
    line = (
        f"control {healed} of 1 movable targets healed ({healed:.1%}); 1 (L1H1) cannot be moved "
        f"without re-initialisation (L1H1: {why})"
    )
    assert line in (out / "report.md").read_text()
    assert f"| no: {why} (caught by: structural, measured) |" in (out / "report.md").read_text()
    assert "cannot be moved without re-initialisation" in (out / "index.html").read_text()


def test_cli_report_holds_the_control_and_no_control_skips_it(injured, text_file, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    assert main(cli_args(injured, text_file, out, "--passes", "1")) == 0
    files = {p.name for p in out.iterdir()}
    assert {
        "census_control.csv",
        "training_control1.csv",
        "redistribution.csv",
    } <= files
    assert '"name":"control_bos_mass_diff"' in (out / "index.html").read_text()
    report = json.loads((out / "report.json").read_text())
    control = report["control"]
    assert control["targeted"] == report["targeted"] and len(report["control_passes"]) == 1
    assert report["prune_vs_repair"]["control"] == control["perplexity_after"]
    assert set(report["redistribution"]["summary"]) == {"repaired", "control"}
    assert report["settings"]["control"] is True
    markdown = (out / "report.md").read_text()
    mean_abs = report["redistribution"]["summary"]["control"]["bos_mass"]["mean_abs"]
    for needle in (
        "## Control: retrained without re-initialisation",
        "| control: retrained without re-initialisation |",
        "tests whether re-initialisation is what helped",
        "## Redistribution over the frozen heads",
        f"| control | bos_mass | {mean_abs:.4f} |",
    ):
        assert needle in markdown, needle
    page = (out / "index.html").read_text()
    assert "Control: retrained without re-initialisation" in page and '"control"' in page

    skipped = tmp_path / "skipped"
    args = cli_args(injured, text_file, skipped, "--passes", "1")
    assert main([*args, "--no-control"]) == 0
    assert not (skipped / "census_control.csv").exists()
    report = json.loads((skipped / "report.json").read_text())
    assert report["control"] is None and report["settings"]["control"] is False
    markdown = (skipped / "report.md").read_text()
    assert "No control arm was run (--no-control)" in markdown and "## Control" not in markdown
    # The repaired model does not depend on the control arm.
    for name, value in load_file(out / "model" / "model.safetensors").items():
        assert torch.equal(load_file(skipped / "model" / "model.safetensors")[name], value), name


def test_cli_resumes_inside_the_control_arm_and_refuses_old_work_folders(
    injured,  # noqa: F811
    text_file,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
):
    straight = tmp_path / "straight"
    assert main(cli_args(injured, text_file, straight, "--passes", "1")) == 0
    save = finetune_module.save_checkpoint

    def killed_in_control(path, state):
        save(path, state)
        if "control1" in str(path):
            raise KeyboardInterrupt  # Ctrl-C right after the control's first checkpoint

    out = tmp_path / "resumed"
    monkeypatch.setattr(finetune_module, "save_checkpoint", killed_in_control)
    with pytest.raises(KeyboardInterrupt):
        main(cli_args(injured, text_file, out, "--passes", "1"))
    monkeypatch.undo()
    partial = tmp_path / "resumed.partial"
    assert (partial / "pass1" / "done.json").exists() and (partial / "control1").is_dir()
    assert not (partial / "control1" / "done.json").exists()
    run_record = json.loads((partial / RUN_FILE).read_text())
    assert run_record["settings"]["control"] is True  # the run record states the arm

    # A work folder from before the control arm (no settings.control) is one line.
    old = tmp_path / "old.partial"
    shutil.copytree(partial, old)
    settings = {k: v for k, v in run_record["settings"].items() if k != "control"}
    (old / RUN_FILE).write_text(json.dumps({**run_record, "settings": settings}))
    resume_old = ("--passes", "1", "--resume", str(tmp_path / "old"))
    with pytest.raises(SystemExit) as exit_info:
        run("repair", cli_args(injured, text_file, tmp_path / "old", *resume_old))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "before the control arm (no settings.control)" in err[0], err

    args = cli_args(injured, text_file, out, "--passes", "1")
    assert main([*args, "--resume", str(out)]) == 0
    for name, value in load_file(straight / "model" / "model.safetensors").items():
        assert torch.equal(load_file(out / "model" / "model.safetensors")[name], value), name
    resumed = json.loads((out / "report.json").read_text())
    report = json.loads((straight / "report.json").read_text())
    for key in ("control", "control_passes", "redistribution", "prune_vs_repair"):
        assert resumed[key] == report[key], key
