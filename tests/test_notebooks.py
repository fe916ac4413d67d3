"""Notebooks are valid JSON whose code cells compile (they are run against results/ by hand)."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_code_cells_compile(path):
    nb = json.loads(path.read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert cells
    for i, cell in enumerate(cells):
        compile("".join(cell["source"]), f"{path.name}[{i}]", "exec")
