"""Calibration of the simulator as an experiment: ``flashcp-calibration`` (or ``python -m
experiments.calibration``; conf/calibration.yaml, :class:`CalibrationConfig`).

Fits the free constants of the hardware profiles to every public target of docs/design.md §8
(:func:`flashcp.sim.calibration.public_targets`) with SciPy's bounded least squares, within each
constant's published range (:data:`FREE_H100`, :data:`FREE_A100`), in two stages:

1. the H100 die and the shared software constants that the targets identify, against the FlashAttention-2 H100 table,
   MagiAttention's packed-document ratios, nccl-tests points, the paper's Fig. 3 and
   ring-flash-attn's 8x H800 benchmark (the H800 is the H100 die);
2. the A100 kernel constants, the shared ones fixed, against ring-flash-attn's 8x A100 numbers.

Writes ``<results_dir>/<name>/`` (``results/calibration/`` with ``results_dir=results``): ``targets.csv`` (name, unit, measured, predicted, error, band,
within_band, fitted, source; before and after the fit; ``fitted`` False: reported, not fitted), ``targets.md``, ``fitted_constants.yaml`` (by
section, loaded by the profiles' ``calibration`` key) and ``versions.yaml``. Never fitted: any
method's end-to-end speedup over another.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import pandas as pd
from omegaconf import DictConfig

from experiments.common.entry import (
    CONF_DIR,
    ExperimentConfig,
    register_experiment,
    run_experiment,
)
from experiments.common.launch import launch
from flashcp.results import markdown_table
from flashcp.sim.calibration import (
    KERNEL_FIELDS,
    SHARED_FIELDS,
    FitResult,
    fit_constants,
    public_targets,
)
from flashcp.sim.hardware import load_hardware

__all__ = ["FREE_A100", "FREE_H100", "CalibrationConfig", "cli", "main", "run_calibration"]

log = logging.getLogger(__name__)
#: the command (conf/calibration.yaml names it in hydra.callbacks.folder.prog; pyproject.toml's script)
PROG = "flashcp-calibration"


@dataclass
class CalibrationConfig(ExperimentConfig):
    """``flashcp-calibration`` (conf/calibration.yaml, :func:`experiments.calibration.run_calibration`):
    fit the simulator's free constants to the public targets of docs/design.md §8; writes
    targets.csv/.md, fitted_constants.yaml and versions.yaml."""

    name: str = "calibration"


#: free constants of stage 1 and their published ranges (conf/hardware/h100_sxm.yaml cites each)
FREE_H100 = {
    "fwd_tile_tflops": (250.0, 500.0),
    "fwd_cta_overhead_us": (0.0, 10.0),
    "bwd_tile_tflops": (250.0, 500.0),
    "bwd_cta_overhead_us": (0.0, 10.0),
    "host_op_us": (5.0, 25.0),
    "ring_step_fwd_us": (10.0, 60.0),
    "ring_step_bwd_us": (20.0, 120.0),
    "merge_bytes_scripted": (10.0, 38.0),
    "nccl_slowdown": (1.0, 1.8),
    "overlap_fraction": (0.5, 1.0),
    "p2p_latency_us": (12.0, 25.0),
    "collective_latency_us": (12.0, 19.0),
}
#: evaluations per stage (each also costs one Jacobian): bounds the experiment to minutes
MAX_NFEV = 80
#: stage 2: A100 kernel constants (A100 peak 312 TFLOP/s bounds the tile rates)
FREE_A100 = {
    "fwd_tile_tflops": (120.0, 312.0),
    "fwd_cta_overhead_us": (0.0, 10.0),
    "bwd_tile_tflops": (120.0, 312.0),
    "bwd_cta_overhead_us": (0.0, 10.0),
}
NET_FIELDS = ("p2p_latency_us", "collective_latency_us")


def _versions() -> dict[str, str]:
    import numpy
    import scipy

    from flashcp.results import provenance

    out = {k: str(v) for k, v in provenance().items()}
    out.update(numpy=numpy.__version__, scipy=scipy.__version__, pandas=pd.__version__)
    return out


def _markdown(table: pd.DataFrame) -> str:
    """The target table as a Markdown table (4 significant digits)."""
    cols = [
        "name",
        "unit",
        "measured",
        "predicted_unfitted",
        "predicted",
        "error",
        "band_kind",
        "band",
        "within_band",
        "fitted",
    ]
    return markdown_table(table[cols])


def _stage(gpu: str, hw, free) -> tuple[FitResult, pd.DataFrame]:
    targets = public_targets(gpu)
    before = fit_constants(targets, hw, {}).table
    return fit_constants(targets, hw, free, max_nfev=MAX_NFEV), before


def run_calibration(
    out_dir: str | Path = "results/calibration", write_profile: bool = True
) -> pd.DataFrame:
    """Fit both stages, write ``out_dir`` and (``write_profile``) ``out_dir/fitted_constants.yaml``.

    The profiles load :func:`flashcp.sim.hardware.fitted_path`: in a checkout run from its root with
    ``results_dir=results``, that is the file written here; an installed wheel keeps loading
    its packaged copy (copy the new file over it, or rebuild, to use a new fit).

    Returns:
        The target table after the fit (one row per target, both stages).
    """
    import yaml

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    h100 = load_hardware("h100_sxm", calibrated=False)
    fit1, before1 = _stage("h100", h100, FREE_H100)
    fitted = dataclasses.replace(h100, **fit1.constants)
    a100 = dataclasses.replace(
        load_hardware("a100_sxm", calibrated=False),
        **{k: getattr(fitted, k) for k in SHARED_FIELDS},
    )
    fit2, before2 = _stage("a100", a100, FREE_A100)
    table = pd.concat([fit1.table.assign(stage=1), fit2.table.assign(stage=2)], ignore_index=True)
    before = pd.concat([before1, before2], ignore_index=True)
    table.insert(4, "predicted_unfitted", before["predicted"].to_numpy())
    table.to_csv(out / "targets.csv", index=False)
    (out / "targets.md").write_text(_markdown(table))
    c1, c2 = fit1.constants, fit2.constants
    doc = {
        "fit": {
            "stage1": {
                "success": fit1.success,
                "message": fit1.message,
                "bounds": {k: list(v) for k, v in FREE_H100.items()},
            },
            "stage2": {
                "success": fit2.success,
                "message": fit2.message,
                "bounds": {k: list(v) for k, v in FREE_A100.items()},
            },
        },
        "sections": {
            "h100_gpu": {k: round(c1[k], 6) for k in KERNEL_FIELDS},
            "shared": {k: round(float(getattr(fitted, k)), 6) for k in SHARED_FIELDS},
            "h100_sxm_net": {k: round(c1[k], 6) for k in NET_FIELDS},
            "a100_gpu": {k: round(c2[k], 6) for k in KERNEL_FIELDS},
        },
    }
    if write_profile:
        with (out / "fitted_constants.yaml").open("w") as fh:
            fh.write(
                "# Written by experiments/calibration.py (flashcp-calibration); do not edit.\n"
            )
            yaml.safe_dump(doc, fh, sort_keys=False)
    with (out / "versions.yaml").open("w") as fh:
        yaml.safe_dump(_versions(), fh, sort_keys=False)
    return table


def _calibrate(cfg: DictConfig) -> Path:
    out_dir = Path(str(cfg.results_dir)) / str(cfg.name)
    table = run_calibration(out_dir)
    log.info("%d/%d targets within band", int(table["within_band"].sum()), len(table))
    return out_dir / "targets.csv"


register_experiment("calibration", CalibrationConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="calibration")
def main(cfg: DictConfig) -> dict[str, Any]:
    """Hydra app of ``flashcp-calibration`` (conf/calibration.yaml, :class:`CalibrationConfig`): the simulator's constants fitted into
    ``<results_dir>/<name>/``; returns the job's record
    (:func:`experiments.common.entry.run_experiment`)."""
    return run_experiment(cfg, _calibrate)


def cli(argv: list[str] | None = None) -> None:
    """Console entry point ``flashcp-calibration``: :func:`main` with readable errors and clean
    Ctrl-C (:func:`experiments.common.launch.launch`)."""
    launch(main, PROG, argv)


if __name__ == "__main__":
    cli()
