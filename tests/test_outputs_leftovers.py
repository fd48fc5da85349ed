"""Concurrency on disk (issue 41): a live work folder is covered by its run's claim, and every
leftover of a killed write is removed by the next run owning the same name, in one line, when
it is provably headsurgeon's, and only then."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from conftest import error_line

import headsurgeon.cli.classify
from headsurgeon import load_model, save_hf
from headsurgeon.cli.repair_run import WORK_WRITER
from headsurgeon.errors import OutputBusyError
from headsurgeon.outputs import MARK_FILE, atomic_directory, claim_output, read_mark


def hidden(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))


def test_a_live_work_folder_is_never_claimed_by_another_output(tmp_path):
    """A repair writing ``out`` keeps its work in ``out.partial`` (marked, maybe still empty):
    while that run holds ``out``, no other claim of ``out.partial`` succeeds, even with
    overwrite; once it ends, the name is free."""
    out, partial = tmp_path / "out", tmp_path / "out.partial"
    with claim_output(out):
        with atomic_directory(partial, writer=WORK_WRITER):
            pass
        with pytest.raises(OutputBusyError) as info:
            with claim_output(partial, overwrite=True):
                pytest.fail("claimed a live work folder")
        message = str(info.value)
        assert len(message.splitlines()) == 1
        assert f"{partial} is the live work folder of a run writing {out} now (pid " in message
        assert read_mark(partial).writer == WORK_WRITER
    with claim_output(partial, overwrite=True):
        pass
    assert hidden(tmp_path) == []


def test_classify_out_onto_a_running_repairs_work_folder_is_one_line(
    bloom_dir, tmp_path, no_model, capsys
):
    out, partial = tmp_path / "out", tmp_path / "out.partial"
    with claim_output(out):  # a repair of out, running
        with atomic_directory(partial, writer=WORK_WRITER):
            pass
        argv = [bloom_dir, "--out", partial, "--overwrite"]
        line = error_line(headsurgeon.cli.classify.main, argv, capsys)
    assert "is the live work folder of a run writing" in line, line
    assert sorted(os.listdir(partial)) == [MARK_FILE]


def test_a_temporary_killed_while_its_first_mark_was_written_is_removed(tmp_path, caplog):
    """SIGKILL inside the first mark write leaves ``.out.tmp-*`` holding only that mark's own
    temporary: ours by both names. A look-alike holding anything else stays."""
    out = tmp_path / "out"
    killed = tmp_path / ".out.tmp-0123456789ab"
    killed.mkdir()
    (killed / f".{MARK_FILE}.tmp-abcdef012345").write_text('{"written_by": "headsu')
    users = tmp_path / ".out.tmp-ba9876543210"
    users.mkdir()
    (users / f".{MARK_FILE}.tmp-abcdef012345").write_text("")
    (users / "notes.txt").write_text("mine")
    with caplog.at_level(logging.INFO, logger="headsurgeon.outputs"):
        with claim_output(out):
            pass
    assert hidden(tmp_path) == [users.name] and (users / "notes.txt").read_text() == "mine"
    removed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("removed")]
    assert removed == [f"removed 1 temporary folder(s) of {out} left by a killed run (0.0 MB)"]


KILLED_SAVE = """
import os, signal, sys
import headsurgeon.checkpoints as checkpoints
from headsurgeon import load_model, save_hf
def killed(*args, **kwargs):  # the folder is written: die before it is renamed into place
    os.kill(os.getpid(), signal.SIGKILL)
checkpoints._verify_export = killed
save_hf(load_model(sys.argv[1]), sys.argv[2])
"""


def test_a_killed_save_hf_is_cleaned_by_the_next_save_to_the_same_path(bloom_dir, tmp_path, caplog):
    export = tmp_path / "export"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", KILLED_SAVE, str(bloom_dir), str(export)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == -9, result.stderr
    (left,) = [p for p in tmp_path.iterdir() if p.name != ".export.lock"]  # a lock: taken over
    assert left.name.startswith(".export.tmp-") and (left / "model.safetensors").exists()
    with caplog.at_level(logging.INFO, logger="headsurgeon.outputs"):
        save_hf(load_model(bloom_dir), export)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert any(
        r.getMessage().startswith(f"removed 1 temporary folder(s) of {export}")
        for r in caplog.records
    )
