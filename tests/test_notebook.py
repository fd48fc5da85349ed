"""The tour notebook (analyses/tour.ipynb) runs headless, top to bottom, in a Jupyter kernel."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from headsurgeon.models import organism_names

NOTEBOOK = Path(__file__).resolve().parents[1] / "analyses" / "tour.ipynb"
NEEDED = ("organism-injured",)

pytestmark = pytest.mark.skipif(
    not set(NEEDED) <= set(organism_names()),
    reason=f"the bundled organisms {', '.join(NEEDED)} are not installed (headsurgeon/organisms/); "
    "train them with analyses/train_organism.py and analyses/plant_injuries.py",
)


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

    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 5, "every figure cell should render a PNG"
