"""Ctrl-C at any moment of a tool's run: "interrupted", exit status 130, no traceback, and nothing
half-written left behind (the output folder is either absent or complete, with no hidden
temporaries beside it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

SCRIPTS = Path(sys.executable).parent
CLASSIFY_ARGS = ["organism-injured"]
REPAIR_ARGS = ["organism-injured", "--steps", "40", "--passes", "1", "--n-seqs", "8"]
REPAIR_ARGS += ["--seq-len", "64"]
# Every entry runs its tool through headsurgeon.cli.run (which installs the Ctrl-C handler)
# before torch: each tool imports torch only after parsing.
TOOLS = {
    "python -m headsurgeon classify": [
        sys.executable,
        "-m",
        "headsurgeon",
        "classify",
        *CLASSIFY_ARGS,
    ],
    "console script": [str(SCRIPTS / "headsurgeon-classify"), *CLASSIFY_ARGS],
    "python -m headsurgeon repair": [sys.executable, "-m", "headsurgeon", "repair", *REPAIR_ARGS],
}


def interrupt(
    command: list[str], delay: float, cwd: Path, signum: int = signal.SIGINT
) -> subprocess.CompletedProcess:
    """Run ``command`` in ``cwd``, send ``signum`` after ``delay`` seconds, wait for it to end."""
    if not Path(command[0]).exists():
        pytest.skip(f"{command[0]} is not installed")
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HOME": str(cwd)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell's background job (CI under some runners) inherits SIGINT ignored, and Python
        # then keeps ignoring it: give the tool the terminal's default, as a user's shell does.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(delay)
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=180)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def assert_whole_or_absent(out: Path, complete_file: str, stderr: str) -> None:
    """``out`` is absent or holds ``complete_file``; nothing hidden or partial lies beside it,
    but a repair's resumable ``out.partial`` that the tool names."""
    beside = sorted(p.name for p in out.parent.iterdir() if p.name != out.name)
    if beside == [f"{out.name}.partial"]:
        assert (out.parent / beside[0] / "run.json").is_file()
        assert f"--resume {out}" in stderr, stderr
        beside = []
    assert beside == [], beside
    assert not out.exists() or (out / complete_file).is_file(), sorted(os.listdir(out))


@pytest.mark.slow  # subprocesses
@pytest.mark.parametrize(
    "tool, delay, complete_file",
    [
        ("python -m headsurgeon classify", 0.3, "summary.txt"),  # importing torch
        ("python -m headsurgeon classify", 1.5, "summary.txt"),  # importing TransformerLens
        ("python -m headsurgeon classify", 4.0, "summary.txt"),  # loading, census or writing
        ("console script", 0.3, "summary.txt"),
        ("console script", 1.5, "summary.txt"),
        ("python -m headsurgeon repair", 0.3, "report.md"),
        ("python -m headsurgeon repair", 12.0, "report.md"),  # the first census
        ("python -m headsurgeon repair", 20.0, "report.md"),  # training
    ],
)
def test_ctrl_c_is_one_line_status_130_and_leaves_nothing_half_written(
    tmp_path, tool, delay, complete_file
):
    run = tmp_path / "run"
    run.mkdir()
    out = run / "out"
    result = interrupt([*TOOLS[tool], "--out", str(out)], delay, run)
    if result.returncode == 0:  # this machine finished first: then the output must be whole
        assert (out / complete_file).is_file()
        return
    assert result.returncode == 130, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    # Its own line (a progress bar closed while unwinding may redraw itself after it).
    assert "interrupted\n" in result.stderr, result.stderr
    assert_whole_or_absent(out, complete_file, result.stderr)


@pytest.mark.slow  # subprocesses
@pytest.mark.parametrize(
    "tool, delay, complete_file",
    [
        ("python -m headsurgeon classify", 0.3, "summary.txt"),  # importing torch
        # Loading, census or writing (run() has the handlers before the heavy imports, so a
        # slow machine still importing gets 143 too).
        ("python -m headsurgeon classify", 4.0, "summary.txt"),
    ],
)
def test_sigterm_is_handled_as_ctrl_c_with_status_143(tmp_path, tool, delay, complete_file):
    """``kill`` (a scheduler's stop) gets Ctrl-C's cleanup and hint, with its own status."""
    run = tmp_path / "run"
    run.mkdir()
    out = run / "out"
    result = interrupt([*TOOLS[tool], "--out", str(out)], delay, run, signal.SIGTERM)
    if result.returncode == 0:
        assert (out / complete_file).is_file()
        return
    assert result.returncode == 143, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "terminated\n" in result.stderr, result.stderr
    assert_whole_or_absent(out, complete_file, result.stderr)


def signal_when(
    command: list[str], cwd: Path, ready: Callable[[], bool], signum: int = signal.SIGTERM
) -> subprocess.CompletedProcess:
    """Run ``command`` in ``cwd``, send ``signum`` once ``ready()`` holds, wait for it to end."""
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HOME": str(cwd)},
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not ready() and process.poll() is None:
        assert time.monotonic() < deadline, "the run never reached the moment to signal"
        time.sleep(0.05)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=180)
    return subprocess.CompletedProcess(command, process.returncode, "", stderr)


@pytest.mark.slow
def test_sigterm_during_training_keeps_it_and_gives_the_resume_hint(tmp_path):
    """SIGTERM once the first pass has written its first file: the work folder is kept, and the
    tool says how to continue it, as after Ctrl-C. A file counts once its atomic write is done
    (its hidden ``.NAME.tmp-*`` twin does not: a signal then removes it, and with it the only
    training there was to keep)."""
    out = tmp_path / "out"
    pass1 = tmp_path / "out.partial" / "pass1"
    command = [*TOOLS["python -m headsurgeon repair"], "--out", str(out)]

    def written() -> bool:
        entries = list(pass1.iterdir()) if pass1.is_dir() else []
        return any(p.is_file() and not p.name.startswith(".") for p in entries)

    result = signal_when(command, tmp_path, written)
    assert result.returncode == 143, result.stderr
    assert "Traceback" not in result.stderr and "terminated\n" in result.stderr, result.stderr
    assert f"continue it with --resume {out}" in result.stderr, result.stderr
    assert_whole_or_absent(out, "report.md", result.stderr)


@pytest.mark.slow
def test_sigterm_removes_the_private_offload_copy(tmp_path):
    """A SIGTERM'd run's weights placed on disk do not outlive it: signalled once its private
    offload folder exists, it removes that folder on its way out, and nothing else there."""
    offload = tmp_path / "offload"
    offload.mkdir()
    (offload / "notes.txt").write_text("mine")
    placement = ["--max-memory", "cpu=1000", "--offload-folder", str(offload)]  # all on disk
    command = [*TOOLS["python -m headsurgeon classify"], *placement, "--out", str(tmp_path / "out")]
    result = signal_when(command, tmp_path, lambda: any(offload.glob("headsurgeon-offload-*")))
    assert result.returncode == 143, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert [p.name for p in offload.iterdir()] == ["notes.txt"]


@pytest.mark.slow
def test_an_ignored_sigint_stays_ignored(tmp_path):
    """A tool started with SIGINT ignored (``nohup``, a background job) runs to its end."""
    out = tmp_path / "out"
    process = subprocess.Popen(
        [*TOOLS["python -m headsurgeon classify"], "--out", str(out)],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)},
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    for delay in (0.3, 3.0):
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=180)
    assert process.returncode == 0, stderr
    assert (out / "summary.txt").is_file()
