"""Every notebook under notebooks/ executes top to bottom on the committed results/ and draws every
figure it promises (cells tagged ``figure`` must show an image); the committed copies carry their
outputs, so they render with figures on GitHub."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 120


def _figure_cells(nb) -> list:
    """Code cells tagged ``figure`` (works on nbformat nodes and on plain JSON dicts)."""
    return [
        c for c in nb["cells"]
        if c["cell_type"] == "code" and "figure" in c.get("metadata", {}).get("tags", [])
    ]  # fmt: skip


def _first_line(cell) -> str:
    src = cell["source"]
    return ("".join(src) if isinstance(src, list) else src).splitlines()[0]


def _has_image(cell) -> bool:
    return any("image/png" in out.get("data", {}) for out in cell.get("outputs", []))


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no .ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_and_draws_every_figure(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason="needs the notebook extra (.[notebook])")
    nbclient = pytest.importorskip("nbclient", reason="needs the notebook extra (.[notebook])")
    nb = nbformat.read(path, as_version=4)
    assert _figure_cells(nb), f"{path.name} has no cell tagged 'figure'"
    # the kernel inherits the environment: import the harness from this checkout
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    missing = [_first_line(c) for c in _figure_cells(nb) if not _has_image(c)]
    assert not missing, f"{path.name}: figure cells without an image: {missing}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_has_its_figures(path):
    """The committed file was executed (its figures render where the notebook is viewed)."""
    nb = json.loads(path.read_text())
    missing = [_first_line(c) for c in _figure_cells(nb) if not _has_image(c)]
    assert not missing, (
        f"{path.name} is committed without the figures of {missing}; execute it: jupyter nbconvert "
        "--to notebook --execute --inplace " + str(path.relative_to(REPO))
    )
    errors = [
        o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"
    ]
    assert not errors, f"{path.name} is committed with an error output: {errors[0].get('ename')}"
