"""What the tools write by default inside a clone stays out of ``git status``: every default
output folder name, its unfinished ``.partial`` and its lock file are in ``.gitignore``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from headsurgeon.reports.folders import default_out_dir, partial_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git clone"
)
def test_the_default_output_names_are_ignored_in_the_clone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default_out_dir numbers names taken in the working directory
    names = [str(default_out_dir("organism-injured", s)) for s in ("heads", "corpora", "repaired")]
    for name in names[:]:
        Path(name).mkdir()
        names += [str(default_out_dir("organism-injured", name.rsplit("-", 1)[1]))]
    names += ["blindness-organism", "repaired", str(partial_dir("repaired")), ".repaired.lock"]
    names += ["labels.html", "cross-scale-heads"]  # the README's Python block; several models
    paths = [f"{name}/" if not name.endswith((".lock", ".html")) else name for name in names]
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", "--verbose", "--non-matching", *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    not_ignored = [
        line.split("\t")[1] for line in done.stdout.splitlines() if line.startswith("::")
    ]
    assert not not_ignored, not_ignored
    # A folder of the user's own is not hidden.
    own = subprocess.run(["git", "check-ignore", "-q", "--no-index", "notes/"], cwd=ROOT)
    assert own.returncode == 1
