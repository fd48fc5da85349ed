"""A repair's resume state (its work folder) and a fine-tuning checkpoint, damaged every way a
crash, an editor or an attacker can: each is one line naming the file, and nothing in it runs."""

from __future__ import annotations

import builtins
import json
import pickle
import shutil

import pytest
import torch
from conftest import TEXT
from test_finetune import config, setup

from headsurgeon import load_model
from headsurgeon.classify import Thresholds
from headsurgeon.errors import CheckpointError
from headsurgeon.finetune import finetune
from headsurgeon.finetune.checkpoint import CHECKPOINT_FILE, load_checkpoint
from headsurgeon.repair import repair
from headsurgeon.repair.resume import FINISHED_FILE, RUN_FILE, finished_run

SETTINGS = dict(
    census_data=TEXT,
    census_seq_len=32,
    census_n_seqs=16,
    prepend_bos=True,
    train_seq_len=32,
    progress=False,
    thresholds=Thresholds(min_output_share=0.2),
    max_collateral=2,
    passes=2,
    finetune_config=config(steps=2, eval_every=2, lr=1e-2),
)


class Planted:
    """Unpickled, it would create ``marker``: proof that a file's code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


@pytest.fixture(scope="module")
def finished(injured, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    """The work folder of a finished two-pass repair of the injured model."""
    work = tmp_path_factory.mktemp("work") / "run.partial"
    result = repair(
        load_model(injured), TEXT, eval_corpus=TEXT, eval_on_train=True, work_dir=work, **SETTINGS
    )
    assert len(result.passes) == 2 and (work / "pass2" / "done.json").exists()
    return work


def resume_fails(injured, work, *needles):  # noqa: F811
    """Resume ``work``: the error is one line holding each of ``needles``, never a hint to load
    a file less carefully, and the model comes back as it was given."""
    model = load_model(injured)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        repair(
            model,
            TEXT,
            eval_corpus=TEXT,
            eval_on_train=True,
            work_dir=work,
            resume=True,
            **SETTINGS,
        )
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    assert "weights_only" not in message and "Traceback" not in message
    for needle in needles:
        assert needle in message, message
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    return message


def copy(finished, tmp_path):
    work = tmp_path / "run.partial"
    shutil.copytree(finished, work)
    return work


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_finished_run_is_marked_and_resumes_from_its_files(injured, finished, tmp_path):  # noqa: F811
    assert finished_run(finished) and (finished / FINISHED_FILE).is_file()
    assert not finished_run(tmp_path)
    work = copy(finished, tmp_path)
    (work / "pass2" / "heads.pt").unlink()  # pass 2 is loaded, not trained again: needed
    resume_fails(injured, work, "pass2/heads.pt is missing", f"remove {work / 'pass2'}")


@pytest.mark.parametrize(
    "name, damage, needles",
    [
        (RUN_FILE, truncate, ["run.json is not readable JSON", "cannot be resumed from it"]),
        (RUN_FILE, lambda p: p.write_text("[1, 2]"), ["holds a JSON list, not an object"]),
        (
            RUN_FILE,
            lambda p: p.write_text('{"model": 5, "settings": {}}'),
            ["run.json is not a run record"],
        ),
        ("census_0.json", truncate, ["census_0.json is not readable JSON"]),
        (
            "census_0.json",
            lambda p: p.write_text('{"attrs": {}, "perplexity": {"train": "x"}}'),
            ["census_0.json holds no valid perplexities"],
        ),
        (
            "census_0.csv",
            truncate,
            ["census_0.csv does not hold one row per head", "2 layers x 4 heads"],
        ),
        ("census_0.csv", lambda p: p.unlink(), ["census_0.csv is missing"]),
        ("pass1/census.json", truncate, ["pass1/census.json is not readable JSON"]),
        (
            "pass1/census.json",
            lambda p: p.write_text(p.read_text().replace('"steps_done": 2', '"steps_done": "2"')),
            ["holds no valid 'steps_done'"],
        ),
        (
            "pass1/census.json",
            lambda p: p.write_text(p.read_text().replace('"losses": [', '"losses": ["x", ')),
            ["holds losses that are not numbers"],
        ),
        ("pass1/census.csv", truncate, ["pass1/census.csv does not hold one row per head"]),
        (
            "pass1/census.csv",
            lambda p: p.write_text(p.read_text().replace("healthy", "fine")),
            ["holds labels other than"],
        ),
        ("pass1/heads.pt", truncate, ["pass1/heads.pt is not readable"]),
        (  # the control arm's passes are checked as the repair's are
            "control1/heads.pt",
            truncate,
            ["control1/heads.pt is not readable", "control1 to redo that pass"],
        ),
        (
            "pass1/heads.pt",
            lambda p: torch.save({"blocks.1.attn.W_Q": torch.zeros(2)}, p),
            ["does not hold the slices of"],
        ),
        (
            "pass2/heads.pt",
            lambda p: torch.save(
                {k: v[..., :1] for k, v in torch.load(p, weights_only=True).items()}, p
            ),
            ["pass2/heads.pt holds blocks.", "of shape"],
        ),
        (
            "pass1/done.json",
            lambda p: p.unlink(),
            ["pass2 is there although pass 1 is not finished"],
        ),
    ],
)
def test_damaged_resume_files_are_one_line(injured, finished, tmp_path, name, damage, needles):  # noqa: F811
    work = copy(finished, tmp_path)
    damage(work / name)
    message = resume_fails(injured, work, *needles)
    assert str(work) in message


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_a_planted_pickle_in_heads_pt_never_runs(injured, finished, tmp_path, how):  # noqa: F811
    work = copy(finished, tmp_path)
    marker = tmp_path / "marker"
    planted = {"blocks.1.attn.W_Q": Planted(marker)}
    if how == "torch.save":
        torch.save(planted, work / "pass2" / "heads.pt")
    else:
        (work / "pass2" / "heads.pt").write_bytes(pickle.dumps(planted))
    message = resume_fails(
        injured,
        work,
        "pass2/heads.pt is not a trusted file written by headsurgeon",
        "it was not loaded",
    )
    assert not marker.exists()
    assert "remove" in message and "pass2" in message


def trained_checkpoint(tmp_path):
    """The checkpoint of a finished fine-tuning run (step 6), and how to resume it."""
    model, heads, tokens = setup()
    finetune(
        model,
        heads,
        tokens,
        config=config(steps=6, checkpoint_every=2),
        progress=False,
        checkpoint_dir=tmp_path,
    )
    path = tmp_path / CHECKPOINT_FILE

    def resume():
        model, heads, tokens = setup()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(CheckpointError) as info:
            finetune(
                model,
                heads,
                tokens,
                config=config(steps=6, checkpoint_every=2),
                checkpoint_dir=tmp_path,
                resume=True,
                progress=False,
            )
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        message = str(info.value)
        assert len(message.splitlines()) == 1 and "weights_only" not in message, message
        assert str(path) in message and "delete it" in message
        return message

    return path, resume


def edited(path, change):
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)


@pytest.mark.parametrize(
    "damage, needle",
    [
        (truncate, "is not readable"),
        (lambda p: torch.save([1, 2], p), "has an unknown format"),
        (lambda p: edited(p, lambda s: s.pop("optimizer")), "lacks optimizer"),
        (lambda p: edited(p, lambda s: s.update(step="4")), "holds a str as its step"),
        (lambda p: edited(p, lambda s: s.update(step=60)), "is at step 60, outside 0-6"),
        (
            lambda p: edited(
                p, lambda s: s["slices"].update({k: v[:1] for k, v in s["slices"].items()})
            ),
            "of shape",
        ),
        (lambda p: edited(p, lambda s: s["slices"].popitem()), "holds slices"),
        (lambda p: edited(p, lambda s: s["progress"]["losses"].pop()), "5 losses for 6 steps"),
        (lambda p: edited(p, lambda s: s["progress"].pop("history")), "progress record"),
        (
            lambda p: edited(p, lambda s: s["scheduler"].update(last_epoch=2)),
            "schedule that is not at step 6",
        ),
        (
            lambda p: edited(
                p, lambda s: s["optimizer"]["state"][0].update(exp_avg=torch.zeros(3))
            ),
            "holds no exp_avg of shape",
        ),
        (
            lambda p: edited(p, lambda s: s["rng"].update(torch=torch.zeros(3))),
            "no usable random state",
        ),
    ],
)
def test_damaged_checkpoints_are_one_line(tmp_path, damage, needle):
    path, resume = trained_checkpoint(tmp_path)
    assert load_checkpoint(tmp_path)["step"] == 6
    damage(path)
    assert needle in resume()


def test_a_planted_pickle_in_a_checkpoint_never_runs(tmp_path):
    path, resume = trained_checkpoint(tmp_path)
    marker = tmp_path / "marker"
    state = torch.load(path, weights_only=True)
    state["progress"]["best_slices"] = Planted(marker)
    torch.save(state, path)
    message = resume()
    assert "is not a trusted file written by headsurgeon" in message
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="not a trusted file"):
        load_checkpoint(tmp_path)
    assert not marker.exists()


def test_a_hand_edited_run_identity_is_one_line(injured, finished, tmp_path):  # noqa: F811
    work = copy(finished, tmp_path)
    run = json.loads((work / RUN_FILE).read_text())
    run["settings"]["passes"] = "x" * 10_000
    (work / RUN_FILE).write_text(json.dumps(run))
    message = resume_fails(injured, work, "differs (settings.passes: 'xxx")
    assert len(message) < 600


def test_a_resume_on_changed_content_of_the_same_shape_is_refused(injured, finished, tmp_path):  # noqa: F811
    """A corpus rotated (the same tokens, in another order) or weights changed in place keep
    every shape: the run record's content digests name what changed."""
    work = copy(finished, tmp_path)
    words = TEXT.split(" ")
    rotated = " ".join(words[7:] + words[:7])
    model = load_model(injured)
    with pytest.raises(CheckpointError) as info:
        repair(
            model,
            rotated,
            eval_corpus=TEXT,
            eval_on_train=True,
            work_dir=work,
            resume=True,
            **SETTINGS,
        )
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    assert "the train tokens changed" in message and "eval" not in message, message
    with torch.no_grad():
        model.blocks[0].attn.W_O[0, 0, 0] += 1
    with pytest.raises(CheckpointError, match="the model's weights changed"):
        repair(
            model,
            TEXT,
            eval_corpus=TEXT,
            eval_on_train=True,
            work_dir=work,
            resume=True,
            **SETTINGS,
        )


def test_a_run_record_without_content_digests_is_one_line(injured, finished, tmp_path):  # noqa: F811
    work = copy(finished, tmp_path)
    run = json.loads((work / RUN_FILE).read_text())
    del run["tokens"]
    (work / RUN_FILE).write_text(json.dumps(run))
    resume_fails(injured, work, "before content checks")
