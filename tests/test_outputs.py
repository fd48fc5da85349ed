"""Atomic files and folders: outputs appear whole or not at all."""

from __future__ import annotations

import os
import stat

import pytest

from headsurgeon.errors import OutputExistsError
from headsurgeon.outputs import (
    MARK_FILE,
    atomic_directory,
    atomic_write_bytes,
    atomic_write_text,
    check_output_dir,
    foreign_files,
    read_mark,
)


def names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def previous_output(out, name="old.txt", text="old"):
    """``out`` as an earlier run left it: written, and marked, by atomic_directory."""
    with atomic_directory(out) as tmp:
        atomic_write_text(tmp / name, text)
    return out


def test_atomic_write_replaces_whole_files(tmp_path):
    target = tmp_path / "sub" / "a.txt"
    assert atomic_write_text(target, "first") == target
    atomic_write_bytes(target, b"second")
    assert target.read_bytes() == b"second"
    assert names(target.parent) == ["a.txt"]


def test_atomic_write_failure_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "a.txt"
    target.write_text("old")

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert names(tmp_path) == ["a.txt"]


def test_outputs_get_normal_permissions(tmp_path):
    # Temporary-file helpers create private (0600/0700) entries; outputs follow the umask.
    umask = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
        with atomic_directory(tmp_path / "out") as tmp:
            atomic_write_text(tmp / "b.txt", "y")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755


def test_atomic_directory_appears_only_when_complete(tmp_path):
    out = tmp_path / "out"
    with atomic_directory(out) as tmp:
        atomic_write_text(tmp / "a.txt", "a")
        assert not out.exists()
        assert tmp.parent == tmp_path
        assert read_mark(tmp).files == ()  # marked from the start: a killed run's is provably ours
    assert names(out) == [MARK_FILE, "a.txt"]
    assert read_mark(out).files == ("a.txt",) and foreign_files(out) == []
    assert names(tmp_path) == ["out"]


def test_atomic_directory_exception_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), atomic_directory(tmp_path / "out") as tmp:
        atomic_write_text(tmp / "a.txt", "a")
        raise RuntimeError("boom")
    assert names(tmp_path) == []


def test_atomic_directory_refuses_non_empty_folders_and_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with atomic_directory(out):  # an empty folder is fine
        pass
    (out / "old.txt").write_text("old")
    with pytest.raises(OutputExistsError, match="overwrite"), atomic_directory(out):
        pytest.fail("the body must not run")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputExistsError, match="is a file"):
        check_output_dir(tmp_path / "file", overwrite=True)
    assert names(tmp_path) == ["file", "out"]
    assert names(out) == [MARK_FILE, "old.txt"]
    assert foreign_files(out) == ["old.txt"]  # added after the run: no longer all headsurgeon's


def test_overwrite_replaces_only_after_success(tmp_path):
    out = previous_output(tmp_path / "out")
    with pytest.raises(KeyboardInterrupt), atomic_directory(out, overwrite=True) as tmp:
        atomic_write_text(tmp / "new.txt", "new")
        raise KeyboardInterrupt
    assert names(out) == [MARK_FILE, "old.txt"]
    with atomic_directory(out, overwrite=True) as tmp:
        atomic_write_text(tmp / "new.txt", "new")
    assert names(out) == [MARK_FILE, "new.txt"]
    assert names(tmp_path) == ["out"]


def test_overwrite_refuses_a_folder_headsurgeon_did_not_write(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(OutputExistsError, match="did not write: old.txt; choose another"):
        with atomic_directory(out, overwrite=True):
            pytest.fail("the body must not run")
    assert names(out) == ["old.txt"] and names(tmp_path) == ["out"]


def test_failed_rename_restores_the_old_folder(tmp_path, monkeypatch):
    out = previous_output(tmp_path / "out")
    real_replace = os.replace

    def replace(src, dst):
        if os.path.basename(src).startswith(".out.tmp-"):  # the final rename of the folder
            raise OSError("rename failed")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="rename failed"), atomic_directory(out, True) as tmp:
        atomic_write_text(tmp / "new.txt", "new")
    assert names(out) == [MARK_FILE, "old.txt"]
    assert names(tmp_path) == ["out"]
