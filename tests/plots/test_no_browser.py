"""Static figures on a machine without a browser; notebook outputs; the browser's exit noise.

Without Chromium the writers still write tables, JSON, the page (every figure on it), the model
and the report, skip the PNGs with one warning line, and succeed; a static format asked for
explicitly is a one-line error before any model is loaded. The browser is hidden from kaleido by
making choreographer's search find nothing (in process) or by a ``BROWSER_PATH`` that is not an
executable (in a subprocess: the same rule, and it works where /usr/bin/chromium is installed).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
import pytest
from conftest import NO_CHROMIUM, TEXT

from headsurgeon import classify_heads, load_model, plots
from headsurgeon.cli import run
from headsurgeon.errors import FigureExportError, InvalidArgumentError
from headsurgeon.finetune import FinetuneConfig
from headsurgeon.outputs import MARK_FILE
from headsurgeon.repair import repair
from headsurgeon.reports import write_classification, write_report
from headsurgeon.surgery import HeadSet

FIGURES = ("bos_mass", "labels", "entropy", "output_share", "threshold_sweep")


def classified() -> pd.DataFrame:
    rng = np.random.default_rng(0)
    census = pd.DataFrame(
        {
            "layer": np.repeat([0, 1], 4),
            "head": np.tile(range(4), 2),
            "bos_mass": [0.1, 0.7, 0.97, 0.3, 0.2, 0.6, 0.1, 0.99],
            "bos_mass_std": rng.random(8) / 10,
            "entropy": rng.random(8),
            "output_share": [0.3, 0.2, 0.2, 0.3, 0.25, 0.25, 0.25, 0.25],
        }
    )
    return classify_heads(census)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_split_formats_skips_default_png_and_refuses_asked_static_formats(no_browser):
    assert plots.split_formats(None) == ([], ["png"])
    assert plots.split_formats(None, default=("html", "png")) == (["html"], ["png"])
    assert plots.split_formats(["html"]) == (["html"], [])
    assert plots.split_formats(()) == ([], [])
    with pytest.raises(
        FigureExportError, match=r"pdf needs a Chromium.*apt-get install -y chromium"
    ):
        plots.split_formats(["html", "pdf"])
    with pytest.raises(InvalidArgumentError, match="unknown figure format"):
        plots.split_formats(["gif"])


def test_save_figures_returns_what_it_skipped(no_browser, tmp_path):
    figures = {"a": plots.label_grid(classified()), "b": plots.head_grid(classified())}
    assert plots.save_figures(figures, tmp_path) == ["a.png", "b.png"]
    assert not list(tmp_path.iterdir())  # the default: png only
    assert plots.save_figures(figures, tmp_path, default=("html", "png")) == ["a.png", "b.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a.html",
        "b.html",
        "plotly-cartesian.min.js",
    ]
    with pytest.raises(FigureExportError, match="svg needs a Chromium"):
        plots.save_figures(figures, tmp_path / "x", ["html", "svg"])
    assert not (tmp_path / "x").exists()


def test_warning_line_names_few_files_and_patterns_for_many(no_browser, caplog):
    assert plots.warn_skipped([], "out") is None
    one = plots.warn_skipped(["a.png"], "out")
    many = plots.warn_skipped([f"f{i}.png" for i in range(9)], "out")
    assert warnings_of(caplog) == [one, many]
    assert one.startswith("warning: skipped 1 static figure in out/ (a.png): ")
    assert many.startswith("warning: skipped 9 static figures in out/ (*.png): ")
    for line in (one, many):
        assert "\n" not in line and "none found" in line
        assert "apt-get install -y chromium" in line and "BROWSER_PATH" in line


def test_write_classification_without_browser_writes_all_but_pngs(no_browser, tmp_path, caplog):
    out = write_classification(classified(), tmp_path / "out")
    written = sorted(p.name for p in out.iterdir())
    assert written == sorted(
        ["heads.csv", "heads.json", "summary.txt", "threshold_sweep.csv"]
        + ["index.html"]  # the report page needs no browser to be written; it holds the figures
        + [MARK_FILE]
    )
    [line] = warnings_of(caplog)
    assert line.startswith(f"warning: skipped 5 static figures in {out}/ (bos_mass.png, ")
    assert "threshold_sweep.png" in line


def test_write_classification_asked_static_format_without_browser_writes_nothing(
    no_browser, tmp_path
):
    with pytest.raises(FigureExportError, match="png needs a Chromium"):
        write_classification(classified(), tmp_path / "out", formats=("html", "png"))
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_write_report_without_browser_writes_model_and_report_skips_pngs(
    no_browser, bloom_dir, tmp_path, caplog
):
    model = load_model(bloom_dir)
    result = repair(
        model,
        TEXT,
        eval_corpus=TEXT,
        census_data=TEXT,
        census_seq_len=32,
        census_n_seqs=4,
        prepend_bos=True,
        train_seq_len=32,
        n_eval_seqs=2,
        passes=1,
        heads=HeadSet([(1, 1)]),
        progress=False,
        finetune_config=FinetuneConfig(steps=2, batch_size=2, eval_every=2),
        eval_on_train=True,  # one text for everything: no warning about it, only the figures'
    )
    out = write_report(result, tmp_path / "out")
    files = {p.name for p in out.iterdir()}
    assert {"report.md", "report.json", "model", "index.html"} <= files
    assert not [name for name in files if name.endswith((".png", ".html")) and name != "index.html"]
    assert (out / "model" / "config.json").exists()
    report = (out / "report.md").read_text()
    assert "- training\n" in report and ".png" not in report and "![" not in report
    assert "Every figure is on index.html" in report
    [line] = warnings_of(caplog)
    assert "labels_before.png" in line or "*.png" in line


@pytest.mark.parametrize(
    ("module", "argv"),
    [
        ("headsurgeon.cli.classify", ["MODEL", "--format", "pdf"]),
        ("headsurgeon.cli.blindness", ["MODEL", "--measure", "--format", "svg"]),
        ("headsurgeon.cli.repair", ["MODEL", "--format", "pdf", "svg"]),
    ],
)
def test_cli_asked_static_format_without_browser_fails_before_loading(
    no_browser, monkeypatch, tmp_path, capsys, module, argv
):
    import importlib

    cli_module = importlib.import_module(module)

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the browser was checked")

    for name in ("load_model", "load_model_from_args", "model_shape"):
        if hasattr(cli_module, name):
            monkeypatch.setattr(cli_module, name, refuse)
    argv = [str(tmp_path / "no-such-model") if a == "MODEL" else a for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        run(cli_module.__name__.split(".")[-1], [*argv, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --format ")
    assert "needs a Chromium browser, none found" in err[0] and "apt-get install" in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a subprocess
def test_classify_cli_without_browser_exits_0_with_one_warning(bloom_dir, tmp_path):
    """The classify command on a machine whose browser kaleido cannot use (a subprocess)."""
    (tmp_path / "text.txt").write_text(TEXT)
    out = tmp_path / "out"
    argv = [
        str(bloom_dir),
        "--texts",
        str(tmp_path / "text.txt"),
        "--seq-len",
        "32",
        "--n-seqs",
        "4",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    env = dict(os.environ, BROWSER_PATH=str(tmp_path / "no-chromium"))
    result = subprocess.run(
        [sys.executable, "-m", "headsurgeon", "classify", *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    files = sorted(p.name for p in out.iterdir())
    assert {"heads.csv", "heads.json", "summary.txt", "threshold_sweep.csv"} <= set(files)
    assert "index.html" in files and not [n for n in files if n.endswith((".png", ".js"))]
    [line] = [line for line in result.stderr.splitlines() if "skipped" in line]
    assert line.startswith(f"warning: skipped 5 static figures in {out}/ (bos_mass.png, ")
    assert f"BROWSER_PATH={tmp_path / 'no-chromium'} is not an executable" in line
    assert "index.html" in result.stdout


@pytest.mark.skipif(not plots.has_browser(), reason=NO_CHROMIUM)
def test_default_formats_with_a_browser_write_pngs(tmp_path, caplog):
    out = write_classification(classified(), tmp_path / "out")
    for name in FIGURES:
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not warnings_of(caplog)


# --- notebook outputs ---


@pytest.fixture()
def in_notebook(monkeypatch):
    """Plotly's default renderer inside a Jupyter kernel: its JSON mime type only."""
    monkeypatch.setattr(pio.renderers, "default", "plotly_mimetype")


def test_figures_are_plotly_figures_with_an_html_output(no_browser, in_notebook):
    fig = plots.label_grid(classified())
    assert isinstance(fig, go.Figure) and isinstance(fig, plots.Figure)
    bundle = fig._repr_mimebundle_()
    assert "application/vnd.plotly.v1+json" in bundle and "image/png" not in bundle
    html = bundle["text/html"]
    assert "Plotly.newPlot" in html and "cdn.plot.ly" in html and "<img" not in html
    assert pio.renderers.default == "plotly_mimetype"  # the user's setting is left alone


@pytest.mark.skipif(not plots.has_browser(), reason=NO_CHROMIUM)
def test_notebook_output_carries_a_png_with_a_browser(in_notebook):
    bundle = plots.head_grid(classified())._repr_mimebundle_()
    import base64

    png = base64.b64decode(bundle["image/png"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert bundle["text/html"].count(bundle["image/png"]) == 1  # the fallback inside the HTML


def test_no_extra_outputs_outside_jupyter_or_when_turned_off(in_notebook, monkeypatch):
    monkeypatch.setattr(plots.notebook, "NOTEBOOK_OUTPUTS", ())
    bundle = plots.head_grid(classified())._repr_mimebundle_()
    assert list(bundle) == ["application/vnd.plotly.v1+json"]
    assert (
        not plots.notebook.mimetype_renderers_in_ipython()
    )  # pytest is no IPython: plotly's show()


# --- the browser's exit noise ---


def _unread(fd: int) -> int:
    """Bytes waiting in a pipe."""
    import array
    import fcntl
    import termios

    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return count[0]


def _read_through_close(payload: bytes):
    """Choreographer's reader when the browser's last bytes arrive in one read, then the channel
    closes under it (as when Browser.close is answered): the race behind the exit traceback."""
    from choreographer.channels.pipe import Pipe

    pipe = Pipe()
    pipe.open()
    os.write(pipe._write_from_browser, payload)
    box = []
    reader = threading.Thread(target=lambda: box.append(pipe.read_jsons(blocking=True)))
    reader.start()
    deadline = time.monotonic() + 10
    while _unread(pipe._read_from_browser) and time.monotonic() < deadline:
        time.sleep(0.01)  # until the reader has taken the bytes (even on a busy machine)
    time.sleep(0.1)  # ... and waits for the end of a message that never comes
    pipe.close()
    reader.join(5)
    return box[0][0]


def test_the_wrappers_bye_marker_is_not_logged_as_a_json_error(caplog):
    plots.export.quiet_browser_exit()
    event = b'{"method":"Inspector.detached","params":{}}\x00'
    assert _read_through_close(event + b"{bye}\n") == [
        {"method": "Inspector.detached", "params": {}}
    ]
    assert not [r for r in caplog.records if "JSONError" in r.getMessage()]
    # A message that really is broken is still reported.
    _read_through_close(event + b'{"id": 1, "res\x00{bye}\n')
    assert [r for r in caplog.records if "JSONError decoding message" in r.getMessage()]


@pytest.mark.slow  # a subprocess
def test_a_png_export_exits_without_a_traceback(tmp_path):
    if not plots.has_browser():
        pytest.skip(NO_CHROMIUM)
    script = (
        "import logging, pandas as pd\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from headsurgeon import plots\n"
        "df = pd.DataFrame({'layer': [0, 0], 'head': [0, 1], 'bos_mass': [0.1, 0.7]})\n"
        f"plots.save_figure(plots.head_grid(df), {str(tmp_path / 'x.png')!r})\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert (tmp_path / "x.png").stat().st_size > 1000
