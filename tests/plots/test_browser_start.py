"""A Chromium that cannot start: one line, never a hang, nothing left running.

kaleido's own server waited forever for a browser that did not start (its thread died, the
export waited on its queue). Here a fake ``BROWSER_PATH`` (a script that sleeps, exits at once,
or writes garbage where Chromium's DevTools messages go) and a real Chromium under an
address-space limit (``RLIMIT_AS``, in a subprocess) must give one
:class:`~headsurgeon.errors.FigureExportError` line within ``HEADSURGEON_BROWSER_TIMEOUT``
(1 s here), remembered for the process, and leave no process and no temporary folder behind; a
tool treats it as having no browser (one warning, everything else written, exit 0).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import plotly.graph_objects as go
import pytest
from conftest import NO_CHROMIUM, TEXT, error_line

import headsurgeon
from headsurgeon import plots
from headsurgeon.cli import run
from headsurgeon.errors import FigureExportError, InvalidArgumentError
from headsurgeon.plots import export

ROOT = Path(headsurgeon.__file__).parents[1]  # the package under test, for subprocesses too
FAKES = {
    "sleeps": "exec sleep 1000",
    "exits": "exit 1",
    "garbage": "echo garbage; printf '{not json\\000' >&4; echo garbage >&2; exec sleep 1000",
}


def fake_browser(folder: Path, behaviour: str) -> tuple[Path, Path]:
    """A script posing as Chromium: records its arguments, then ``FAKES[behaviour]``."""
    script, argv = folder / f"fake-chromium-{behaviour}", folder / "argv.txt"
    script.write_text(f'#!/bin/sh\necho "$@" > {argv}\n{FAKES[behaviour]}\n')
    script.chmod(0o755)
    return script, argv


def marked(mark: str) -> list[int]:
    """The processes whose environment holds ``mark`` (this machine's /proc)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and mark.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:  # gone, or not ours
            continue
    return found


def without_leftovers(mark: str, seconds: float = 10) -> list[int]:
    """The marked processes still there after ``seconds`` (a killed one takes a moment)."""
    deadline = time.monotonic() + seconds
    while (left := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def in_time(call, seconds: float = 30):
    """``call()``'s result or exception, or a test failure when it hangs (no test runner
    timeout here: the export runs in a daemon thread that is left behind)."""
    box: list = []

    def target():
        try:
            box.append(("value", call()))
        except BaseException as e:  # handed to the test
            box.append(("error", e))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert box, f"hung: no answer in {seconds} s"
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


@pytest.fixture()
def fresh_browser(monkeypatch):
    """No browser started or failed in this process yet; starts time out after 1 s; the
    processes started are marked through their environment."""
    fresh = {"kaleido": None, "loop": None, "thread": None}
    monkeypatch.setattr(export, "_chromium", fresh, raising=False)
    monkeypatch.setattr(export, "_failed", {}, raising=False)
    monkeypatch.setenv("HEADSURGEON_BROWSER_TIMEOUT", "1")
    mark = f"HS_TEST_{uuid.uuid4().hex}"
    monkeypatch.setenv(mark, "1")
    return mark


@pytest.mark.parametrize("behaviour", sorted(FAKES))
def test_a_browser_that_does_not_start_is_one_line_and_leaves_nothing(
    behaviour, fresh_browser, monkeypatch, tmp_path
):
    script, argv = fake_browser(tmp_path, behaviour)
    monkeypatch.setenv("BROWSER_PATH", str(script))
    figure = go.Figure(go.Heatmap(z=[[1]]))
    with pytest.raises(FigureExportError) as caught:  # in_time: no hang (a bounded wait)
        in_time(lambda: plots.save_figure(figure, tmp_path / "x.png"))
    line = str(caught.value)
    assert "\n" not in line and f"BROWSER_PATH={script} did not start" in line
    if behaviour != "exits":  # one that exits may be seen exiting, or not within the second
        assert "within 1 s" in line
    assert not (tmp_path / "x.png").exists()
    assert not without_leftovers(fresh_browser)
    profile = next(a for a in argv.read_text().split() if a.startswith("--user-data-dir="))
    assert not Path(profile.partition("=")[2]).exists()  # Chromium's temporary profile
    # Remembered: no second wait, no browser found, and the skip names why.
    assert not plots.has_browser()
    monkeypatch.setattr(export, "_start", lambda path: pytest.fail("a second start"))
    with pytest.raises(FigureExportError, match="did not start"):
        plots.save_figure(figure, tmp_path / "y.png")
    assert plots.split_formats(None) == ([], ["png"])
    assert "did not start" in plots.warn_skipped(["a.png"], tmp_path)
    plots.save_figure(figure, tmp_path / "x.html")  # html needs no browser


def test_a_bad_start_timeout_is_one_line(fresh_browser, monkeypatch):
    for bad in ("soon", "0", "-1", "nan", "inf"):
        monkeypatch.setenv("HEADSURGEON_BROWSER_TIMEOUT", bad)
        with pytest.raises(InvalidArgumentError, match="HEADSURGEON_BROWSER_TIMEOUT=.* seconds"):
            plots.start_browser()


@pytest.mark.parametrize("argv", [[], ["--format", "html"]])
def test_cli_bad_start_timeout_is_refused_before_loading(
    argv, fresh_browser, no_model, monkeypatch, tmp_path, capsys
):
    from headsurgeon.cli import classify

    monkeypatch.setenv("HEADSURGEON_BROWSER_TIMEOUT", "30s")
    line = error_line(classify.main, ["organism", *argv, "--out", tmp_path / "o"], capsys)
    assert "HEADSURGEON_BROWSER_TIMEOUT='30s' is not a number of seconds" in line
    assert not (tmp_path / "o").exists()


def test_cli_asked_pdf_with_a_browser_that_does_not_start_fails_before_loading(
    fresh_browser, monkeypatch, tmp_path, capsys
):
    from headsurgeon.cli import classify

    script, _ = fake_browser(tmp_path, "sleeps")
    monkeypatch.setenv("BROWSER_PATH", str(script))

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the browser was checked")

    monkeypatch.setattr(classify, "check_models", refuse)
    with pytest.raises(SystemExit) as exit_info:
        in_time(lambda: run("classify", ["organism", "--format", "pdf", "--out", "o"]))
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: --format pdf needs a Chromium browser, BROWSER_PATH=")
    assert "did not start within 1 s" in line
    assert not without_leftovers(fresh_browser)


def _subprocess_env(mark: str, **extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **{mark: "1"}, **extra)


@pytest.mark.slow  # a subprocess
def test_a_real_chromium_under_an_address_space_limit_is_one_line(tmp_path):
    if not plots.has_browser():
        pytest.skip(NO_CHROMIUM)
    mark = f"HS_TEST_{uuid.uuid4().hex}"
    script = (
        "import resource\n"
        "import plotly.graph_objects as go\n"
        "from headsurgeon import plots\n"
        "from headsurgeon.errors import FigureExportError\n"
        "import kaleido, choreographer.errors\n"  # imported before the cap, as a tool would
        "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
        "try:\n"
        f"    plots.save_figure(go.Figure(go.Heatmap(z=[[1]])), {str(tmp_path / 'x.png')!r})\n"
        "except FigureExportError as e:\n"
        "    print(e)\n"
        "print(plots.split_formats(None))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=_subprocess_env(mark, HEADSURGEON_BROWSER_TIMEOUT="5"),
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr
    line, formats = result.stdout.strip().splitlines()
    assert "did not start" in line and "address-space limit of 4.0 GiB" in line
    assert formats == "([], ['png'])"
    assert not (tmp_path / "x.png").exists()
    assert not without_leftovers(mark)


@pytest.mark.slow  # a subprocess
def test_classify_cli_with_a_browser_that_does_not_start_warns_once_and_writes_the_rest(
    bloom_dir, tmp_path
):
    script, _ = fake_browser(tmp_path, "sleeps")
    (tmp_path / "text.txt").write_text(TEXT)
    out = tmp_path / "out"
    mark = f"HS_TEST_{uuid.uuid4().hex}"
    argv = [str(bloom_dir), "--texts", str(tmp_path / "text.txt"), "--seq-len", "16"]
    argv += ["--n-seqs", "2", "--threads", "1", "--no-secondary-sinks", "--out", str(out)]
    env = _subprocess_env(mark, BROWSER_PATH=str(script), HEADSURGEON_BROWSER_TIMEOUT="1")
    result = subprocess.run(
        [sys.executable, "-m", "headsurgeon", "classify", *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,  # ~15 s on a busy 2-core machine; kaleido's own server hung here
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "watchdog" not in result.stderr
    files = {p.name for p in out.iterdir()}
    assert {"heads.csv", "heads.json", "summary.txt", "threshold_sweep.csv", "index.html"} <= files
    assert not [n for n in files if n.endswith(".png")]
    [line] = [line for line in result.stderr.splitlines() if "warning" in line]
    assert line.startswith(f"warning: skipped 5 static figures in {out}/ (bos_mass.png, ")
    assert f"BROWSER_PATH={script} did not start within 1 s" in line
    assert not without_leftovers(mark)
