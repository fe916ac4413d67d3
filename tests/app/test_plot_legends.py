"""No figure's legend hides its data: every committed figure, redrawn from its CSV, has no data
point (line marker) or bar under a legend (Fig. 7's legend hid FlashCP refined at 64K)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import experiments.plot as plot

REPO = Path(__file__).resolve().parents[2]
FIGURES = [
    (fig, REPO / "results" / fig / ("fig3.csv" if fig == "fig3" else "summary.csv"))
    for fig in ("fig3", "fig5", "fig6", "fig7", "fig5_peers")
]


def _hidden(fig) -> list[str]:
    """What of ``fig``'s data lies under one of its legends (display coordinates)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes)]
    boxes = [leg.get_window_extent(renderer) for leg in legends if leg is not None]
    out = []
    for ax in fig.axes:
        for line in ax.get_lines():
            xy = line.get_xydata()
            if line.get_marker() in (None, "None", "", " ") or not len(xy):
                continue
            pts = ax.transData.transform(xy[np.isfinite(xy).all(axis=1)])
            for box in boxes:
                inside = (pts[:, 0] >= box.x0) & (pts[:, 0] <= box.x1)
                inside &= (pts[:, 1] >= box.y0) & (pts[:, 1] <= box.y1)
                if inside.any():
                    out.append(f"{ax.get_title()}: {line.get_label()} at {xy[inside][0]}")
        for patch in ax.patches:
            ext = patch.get_window_extent(renderer)
            if ext.width * ext.height > 0 and any(ext.overlaps(box) for box in boxes):
                out.append(f"{ax.get_title()}: bar {patch.get_label()}")
    return out


@pytest.mark.parametrize(("fig", "csv"), FIGURES, ids=[f for f, _ in FIGURES])
def test_no_legend_hides_data(tmp_path, monkeypatch, fig, csv):
    if not csv.is_file():
        pytest.skip(f"{csv.relative_to(REPO)} is not committed")
    shutil.copy(csv, tmp_path / csv.name)
    drawn, close = [], plot.plt.close
    monkeypatch.setattr(plot.plt, "close", drawn.append)  # keep the figure to inspect it
    plot.draw(fig, tmp_path)
    assert len(drawn) == 1
    try:
        assert _hidden(drawn[0]) == []
    finally:
        close(drawn[0])
