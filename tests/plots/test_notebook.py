"""The tour notebook (analyses/tour.ipynb) runs headless, top to bottom, in a Jupyter kernel."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from headsurgeon import plots
from headsurgeon.loading import organism_names

NOTEBOOK = Path(__file__).resolve().parents[2] / "analyses" / "tour.ipynb"
NEEDED = ("organism-injured",)
PLOTLY = "application/vnd.plotly.v1+json"

needs_organisms = pytest.mark.skipif(
    not set(NEEDED) <= set(organism_names()),
    reason=f"the bundled organisms {', '.join(NEEDED)} are not installed (headsurgeon/organisms/); "
    "train them with analyses/train_organism.py and analyses/plant_injuries.py",
)


def check_outputs(nb, *, png: bool = True) -> None:
    """Figures show where the notebook is read as a file; no errors, no tqdm widget warnings.

    ``png``: a browser was there to render the figures' PNGs (without one they carry HTML only).
    """
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    if png:
        images = [o for o in outputs if "image/png" in o.get("data", {})]
        assert len(images) >= 5, "every figure cell should render a PNG"
    figures = [o for o in outputs if PLOTLY in o.get("data", {})]
    assert len(figures) >= 5
    for figure in figures:  # interactive in Jupyter; HTML and PNG for GitHub, nbviewer, exports
        assert {"text/html", "image/png"} <= set(figure.data) if png else "text/html" in figure.data
        assert "Plotly.newPlot" in figure.data["text/html"]
    text = "".join(
        str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", "")) for o in outputs
    )
    assert "IProgress not found" not in text


def test_committed_tour_notebook_shows_its_figures():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    check_outputs(nb)
    assert NOTEBOOK.stat().st_size < 3_000_000  # PNGs at 1x keep the committed notebook small


@needs_organisms
@pytest.mark.slow  # a subprocess
def test_tour_notebook_executes():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from jupyter_client.manager import KernelManager

    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel must be this interpreter (the one with headsurgeon installed), not whatever
    # "python" the kernelspec's argv finds first on PATH.
    km = KernelManager(kernel_name="python3")
    km.kernel_spec.argv[0] = sys.executable
    client = nbclient.NotebookClient(
        nb, km=km, timeout=300, resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    check_outputs(nb, png=plots.has_browser())  # runs without a browser too, HTML figures only
