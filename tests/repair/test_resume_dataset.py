"""A repair trained on a dataset resumes only on that dataset: its revision is in the run's
settings and its tokens in the run's content digests, so an edited dataset is refused."""

from __future__ import annotations

import json

import pytest
from conftest import TEXT
from test_resume_state import SETTINGS

from headsurgeon import load_model
from headsurgeon.corpus_sources import load_dataset_texts
from headsurgeon.errors import CheckpointError
from headsurgeon.repair import repair

ONE_PASS = SETTINGS | {"passes": 1}


def write_rows(folder, rows):
    folder.mkdir(exist_ok=True)
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))


def test_a_resume_on_an_edited_dataset_is_refused(injured, tmp_path):  # noqa: F811
    rows = [s.strip() for s in TEXT.split(".") if s.strip()]
    folder, work = tmp_path / "ds", tmp_path / "run.partial"
    write_rows(folder, rows)
    first = repair(
        load_model(injured),
        load_dataset_texts(folder),
        eval_corpus=TEXT,
        eval_on_train=True,
        work_dir=work,
        **ONE_PASS,
    )
    assert first.settings["train_data"].startswith("dataset ds, split train, column text, ")
    again = repair(  # the same dataset: the finished run comes back from its files
        load_model(injured),
        load_dataset_texts(folder),
        eval_corpus=TEXT,
        eval_on_train=True,
        work_dir=work,
        resume=True,
        **ONE_PASS,
    )
    assert again.census_after["bos_mass"].tolist() == first.census_after["bos_mass"].tolist()
    write_rows(folder, rows[::-1])
    with pytest.raises(CheckpointError) as info:
        repair(
            load_model(injured),
            load_dataset_texts(folder),
            eval_corpus=TEXT,
            eval_on_train=True,
            work_dir=work,
            resume=True,
            **ONE_PASS,
        )
    message = str(info.value)
    assert len(message.splitlines()) == 1 and "train" in message, message
