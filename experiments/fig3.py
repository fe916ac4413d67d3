"""Kernel efficiency by layout (the paper's Fig. 3), simulated: ``flashcp-fig3`` (or ``python -m
experiments.fig3``; conf/fig3.yaml, :class:`Fig3Config`).

Two packed sequences of ``context_len`` tokens — one document filling it, and 16 equal documents —
laid out ``whole`` (one device), ``per_doc`` (2N chunks per document, one varlen call per rank) and
``zigzag`` (the same layout run as ring-flash-attn's zigzag ring, with its merges and gradient
accumulations). The compute of each layout comes from the step model itself
(:mod:`flashcp.sim.fig3`, :meth:`flashcp.sim.cost.PlanCost.attention_us`), so Fig. 3, the
calibration and the CP step model use one model of each layout's work.

Rows per (case, layout, pass): ``kernel_ms`` (summed over ranks and steps), ``flops`` (useful:
4 · head_dim · num_heads · query-key pairs of Eq. 3; backward 2.5x forward; docs/design.md §8),
``tflops`` = flops / kernel time, and ``latency_vs_whole`` (forward + backward over ``whole``, the
quantity the paper's Fig. 3 plots).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from experiments.common.entry import (
    CONF_DIR,
    ExperimentConfig,
    register_experiment,
    run_experiment,
)
from experiments.common.launch import launch
from flashcp.comm import AttnShape
from flashcp.config import HardwareConfig, ModelConfig
from flashcp.plan import doc_workload
from flashcp.results import provenance, write_csv_atomic

__all__ = ["Fig3Config", "cli", "main", "run_fig3"]

#: the command (conf/fig3.yaml names it in hydra.callbacks.folder.prog; pyproject.toml's script)
PROG = "flashcp-fig3"


@dataclass
class Fig3Config(ExperimentConfig):
    """``flashcp-fig3`` (conf/fig3.yaml, :func:`experiments.fig3.run_fig3`): the paper's Fig. 3,
    kernel efficiency of one document filling the context vs 16 equal documents, per layout,
    simulated on the ``hardware`` profile."""

    name: str = "fig3"
    model: ModelConfig = field(default_factory=ModelConfig)
    #: the simulator's profile (conf/hardware/*.yaml)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    #: N, number of CP ranks
    cp_size: int = 8
    #: C, tokens per packed sequence (a multiple of 16)
    context_len: int = 131072


def run_fig3(cfg: DictConfig) -> Path:
    """Write ``fig3.csv`` (case, layout, pass, tflops, kernel_ms, flops, latency_vs_whole, the
    profile's ``hardware_changes`` and ``hardware_sha256`` as in flashcp-run's rows) and
    ``fig3.png`` into ``<results_dir>/<name>/``; return the path of ``fig3.csv``.

    Args:
        cfg: the fields of :class:`Fig3Config` (``hardware``, ``model``,
            ``cp_size``, ``context_len``, ``results_dir``, ``name``).

    Raises:
        ValueError: ``context_len`` not divisible by 16, or a bad hardware profile.
    """
    from experiments.common.overrides import load_job_hardware
    from experiments.plot import draw
    from flashcp.sim.fig3 import FIG3_LAYOUTS, fig3_compute_us

    # explicit constants win over the fitted ones
    hw, hw_columns = load_job_hardware(OmegaConf.to_container(cfg.hardware, resolve=True))
    m = cfg.model
    shape = AttnShape(int(m.num_heads), int(m.num_kv_heads), int(m.head_dim), str(m.dtype))
    c, n = int(cfg.context_len), int(cfg.cp_size)
    if c % 16:
        raise ValueError(f"context_len = {c} must divide by 16 for the 16-document case")
    cases = {f"1x{c // 1024}K": np.array([c]), f"16x{c // 16 // 1024}K": np.full(16, c // 16)}
    rows = []
    for case, lens in cases.items():
        pairs = float(doc_workload(lens).sum())
        flops_fwd = 4.0 * shape.head_dim * shape.num_heads * pairs
        per_layout = {
            layout: fig3_compute_us(hw, lens, layout, n, shape) for layout in FIG3_LAYOUTS
        }
        whole = sum(per_layout["whole"][:2])
        for layout, (f_us, b_us, calls) in per_layout.items():
            for pass_name, us, flops in (
                ("forward", f_us, flops_fwd),
                ("backward", b_us, 2.5 * flops_fwd),
            ):
                rows.append({
                    "case": case, "layout": layout, "pass": pass_name, "cp_size": n,
                    "num_calls": calls, "flops": flops, "kernel_ms": us / 1e3,
                    "tflops": flops / (us * 1e-6) / 1e12, "latency_vs_whole": (f_us + b_us) / whole,
                    "hardware": hw.name, "num_heads": shape.num_heads, "head_dim": shape.head_dim,
                    "executor": "sim",
                })  # fmt: skip
    df = pd.DataFrame(rows)
    for k, v in {**hw_columns, **provenance()}.items():
        df[k] = v
    out_dir = Path(cfg.results_dir) / cfg.name
    write_csv_atomic(df, out_dir / "fig3.csv")
    draw("fig3", out_dir)
    return out_dir / "fig3.csv"


register_experiment("fig3", Fig3Config)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="fig3")
def main(cfg: DictConfig) -> dict[str, Any]:
    """Hydra app of ``flashcp-fig3`` (conf/fig3.yaml, :class:`Fig3Config`): the paper's Fig. 3 into
    ``<results_dir>/<name>/``; returns the job's record
    (:func:`experiments.common.entry.run_experiment`)."""
    return run_experiment(cfg, run_fig3)


def cli(argv: list[str] | None = None) -> None:
    """Console entry point ``flashcp-fig3``: :func:`main` with readable errors and clean
    Ctrl-C (:func:`experiments.common.launch.launch`)."""
    launch(main, PROG, argv)


if __name__ == "__main__":
    cli()
