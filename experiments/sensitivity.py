"""How robust is each conclusion of the simulator? ``flashcp-sensitivity`` (or ``python -m
experiments.sensitivity``; conf/sensitivity.yaml, :class:`SensitivityConfig`).

Every overhead constant of the hardware profile (:data:`VARIED`) is varied over a plausible range,
a factor of ``1/2`` to ``2`` of its calibrated value (``factor``; for
``nccl_slowdown`` the factor applies to its excess over 1, for ``overlap_fraction`` to the part
not overlapped; values stay within what the profile accepts):

* one at a time (low and high end; the tornado plot);
* jointly: a Latin hypercube (``scipy.stats.qmc.LatinHypercube``) of ``num_draws``
  draws of log-uniform factors.

For each draw the same sampled sequences (``num_sequences`` per dataset, sampled as
``flashcp-run`` samples them by default, :func:`flashcp.data.sample_dataset`, so they are the
sequences of Fig. 5 / 7; CP ``cp_size``, the run's model) are priced for every method; the statistic is the method's speedup
over ``llama3`` (ratio of mean ``total_ms``, as in ``summary.csv``). Plans and tile counts are
computed once; only the profile changes between draws.

Writes ``<results_dir>/<name>/``: ``sensitivity.csv`` (one row per draw, dataset, method, mode),
``speedup_range.csv`` / ``.md`` (per dataset and method: calibrated speedup, one-at-a-time and
joint ranges), ``ordering.csv`` / ``.md`` (share of joint draws in which method A is faster than
method B, per dataset) and ``tornado.png``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
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
    at_least,
    check_experiment_config,
    register_experiment,
    run_experiment,
)
from experiments.common.launch import launch
from flashcp.comm import AttnShape
from flashcp.config import HardwareConfig, ModelConfig
from flashcp.data.datasets import DatasetName
from flashcp.results import markdown_table
from flashcp.sim.hardware import HardwareProfile

__all__ = [
    "OPTIONAL_VARIED",
    "VARIED",
    "SensitivityConfig",
    "check_sensitivity_config",
    "cli",
    "main",
    "perturb",
    "plot_tornado",
    "run_sensitivity",
]

#: the command (conf/sensitivity.yaml names it in hydra.callbacks.folder.prog; pyproject.toml's script)
PROG = "flashcp-sensitivity"


@dataclass
class SensitivityConfig(ExperimentConfig):
    """``flashcp-sensitivity`` (conf/sensitivity.yaml, :func:`experiments.sensitivity.run_sensitivity`):
    vary every overhead constant of the ``hardware`` profile and report the range of each method's
    speedup over llama3 and the share of draws in which each pairwise ordering holds."""

    name: str = "sensitivity"
    model: ModelConfig = field(default_factory=ModelConfig)
    #: the profile whose constants are varied (conf/hardware/*.yaml)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    #: N, number of CP ranks
    cp_size: int = 8
    #: C, tokens per packed sequence
    context_len: int = 131072
    #: train (forward + backward) and/or infer (forward only); the tornado plot shows the first
    modes: list[str] = field(default_factory=lambda: ["train"])
    #: seed of the sampler and of the Latin hypercube
    seed: int = 0
    #: sampled sequences per dataset (the same for every draw)
    num_sequences: int = 24
    #: Latin-hypercube draws of the joint study (>= 2)
    num_draws: int = 256
    #: each constant from value / factor to value * factor (> 1)
    factor: float = 2.0
    #: datasets studied
    datasets: list[DatasetName] = field(
        default_factory=lambda: [DatasetName.wlb_llm, DatasetName.pile, DatasetName.redpajama]
    )
    #: methods compared (llama3, the reference of every speedup, among them)
    methods: list[str] = field(
        default_factory=lambda: ["llama3", "per_doc", "ring", "zigzag", "flashcp"]
    )
    #: the constants varied (null: VARIED); may add alltoall_busbw_gbps (OPTIONAL_VARIED), which
    #: otherwise follows allgather_busbw_gbps (conf/study/peers*.yaml vary it)
    constants: list[str] | None = None


def check_sensitivity_config(cfg: Any) -> None:
    """Check a :class:`SensitivityConfig` before any work: the checks every experiment gets
    (:func:`experiments.common.entry.check_experiment_config`), then the draws, the factor, the
    methods (registered, llama3 among them) and the datasets (at least one, not ``file``).

    Raises:
        ValueError: naming the bad value.
    """
    from flashcp.registry import get_method

    check_experiment_config(cfg)
    at_least(cfg, "num_draws", 2)
    at_least(cfg, "factor", 1.0, strict=True)
    for method in cfg.methods:
        get_method(method)  # ValueError naming the known methods
    if "llama3" not in cfg.methods:
        raise ValueError(
            f"methods = {list(cfg.methods)} must include llama3, the reference of every speedup"
        )
    for k in cfg.get("constants") or ():
        if k not in (*VARIED, *OPTIONAL_VARIED):
            raise ValueError(
                f"constants: {k!r} is not a varied constant; choose from "
                f"{', '.join((*VARIED, *OPTIONAL_VARIED))}"
            )
    if not cfg.datasets or DatasetName.file in cfg.datasets:
        raise ValueError(
            f"datasets = {[str(d) for d in cfg.datasets]}: list at least one, and not file "
            "(it needs a path, which this experiment does not take)"
        )


#: the overhead constants varied (the kernel tile rates, fixed by the FA2 table, are not)
VARIED = (
    "launch_us",
    "copy_bw_gbps",
    "fwd_cta_overhead_us",
    "bwd_cta_overhead_us",
    "collective_latency_us",
    "allgather_busbw_gbps",
    "p2p_latency_us",
    "p2p_bw_gbps",
    "host_op_us",
    "collective_host_us",
    "ring_step_fwd_us",
    "ring_step_bwd_us",
    "doc_host_us",
    "merge_bytes_scripted",
    "merge_bytes_eager",
    "accum_bytes_eager",
    "nccl_slowdown",
    "overlap_fraction",
)
#: constants a study may add to VARIED (``constants``): the all-to-all bus bandwidth, which follows
#: ``allgather_busbw_gbps`` when not varied itself (its profile value is derived from it)
OPTIONAL_VARIED = ("alltoall_busbw_gbps",)


def perturb(hw: HardwareProfile, factors: dict[str, float]) -> HardwareProfile:
    """``hw`` with each named constant scaled by its factor (module docstring for the special
    cases); ``reducescatter_busbw_gbps`` follows ``allgather_busbw_gbps``, and so does
    ``alltoall_busbw_gbps`` unless it is among ``factors`` itself.

    Raises:
        ValueError: an unknown constant.
    """
    vals: dict[str, float] = {}
    for k, f in factors.items():
        if k not in (*VARIED, *OPTIONAL_VARIED):
            known = ", ".join((*VARIED, *OPTIONAL_VARIED))
            raise ValueError(f"{k!r} is not a varied constant; choose from {known}")
        v = float(getattr(hw, k))
        if k == "nccl_slowdown":
            vals[k] = 1.0 + (v - 1.0) * f
        elif k == "overlap_fraction":
            vals[k] = min(1.0, 1.0 - (1.0 - v) * f)
        elif k == "collective_latency_us":  # stays below the published curve's smallest time
            cap = min(hw._curve_seconds()) * 1e6 * 0.99
            vals[k] = min(v * f, cap)
        else:
            vals[k] = v * f
        if k == "allgather_busbw_gbps":
            vals["reducescatter_busbw_gbps"] = hw.reducescatter_busbw_gbps * f
            if "alltoall_busbw_gbps" not in factors:
                vals["alltoall_busbw_gbps"] = hw.alltoall_busbw_gbps * f
    return dataclasses.replace(hw, **vals)


def _speedups(costs, hw: HardwareProfile, shape: AttnShape, modes) -> list[dict]:
    """Per (dataset, method, mode): mean total_ms over the sequences, and speedup over llama3."""
    out = []
    for (dataset, mode), by_method in _group(costs, hw, shape, modes).items():
        ref = by_method["llama3"]
        for method, mean_ms in by_method.items():
            out.append({"dataset": dataset, "method": method, "mode": mode, "total_ms_mean": mean_ms,
                        "speedup_vs_llama3": ref / mean_ms})  # fmt: skip
    return out


def _group(costs, hw, shape, modes) -> dict:
    res: dict = {}
    for (dataset, method), plan_costs in costs.items():
        for mode in modes:
            tot = [c.with_hardware(hw).step(shape, mode)["total_ms"] for c in plan_costs]
            res.setdefault((dataset, mode), {})[method] = float(np.mean(tot))
    return res


def run_sensitivity(cfg: DictConfig, out_dir: str | Path) -> pd.DataFrame:
    """Run the study described in the module docstring; return the per-draw table.

    Args:
        cfg: the fields of :class:`SensitivityConfig` (``hardware``, ``model``,
            ``cp_size``, ``context_len``, ``modes``, ``seed``, ``num_sequences``, ``num_draws``,
            ``factor``, ``datasets``, ``methods``).
        out_dir: folder of the outputs (created).
    Raises:
        ValueError: a bad option (factor <= 1, num_draws < 2, no llama3 among the methods).
    """
    from scipy.stats import qmc

    from experiments.common.overrides import load_job_hardware
    from flashcp.data import sample_dataset
    from flashcp.registry import COMM_KIND, get_planner
    from flashcp.sim.cost_model import PlanCost

    factor, draws = float(cfg.factor), int(cfg.num_draws)
    methods, datasets, modes = list(cfg.methods), [str(d) for d in cfg.datasets], list(cfg.modes)
    if factor <= 1 or draws < 2 or "llama3" not in methods:
        raise ValueError(
            f"sensitivity needs factor > 1 (got {factor}), num_draws >= 2 (got {draws}) and llama3 "
            f"among the methods (got {methods})"
        )
    # explicit constants win over the fitted ones
    hw, hw_columns = load_job_hardware(OmegaConf.to_container(cfg.hardware, resolve=True))
    m = cfg.model
    shape = AttnShape(int(m.num_heads), int(m.num_kv_heads), int(m.head_dim), str(m.dtype))
    n, c = int(cfg.cp_size), int(cfg.context_len)
    costs = {}
    for dataset in datasets:
        # flashcp-run's sampler and defaults: the sequences of Fig. 5 / 7 (overlong split)
        seqs, _ = sample_dataset(dataset, int(cfg.num_sequences), c, seed=int(cfg.seed))
        for method in methods:
            planner = get_planner(method)
            costs[(dataset, method)] = [
                PlanCost(planner(d, n), hw, COMM_KIND[method]) for d in seqs
            ]

    rows = [{**r, "kind": "calibrated", "draw": 0, "constant": "", "factor": 1.0}
            for r in _speedups(costs, hw, shape, modes)]  # fmt: skip
    varied = tuple(cfg.get("constants") or VARIED)
    for k in varied:
        for f in (1.0 / factor, factor):
            rows += [{**r, "kind": "one_at_a_time", "draw": 0, "constant": k, "factor": f}
                     for r in _speedups(costs, perturb(hw, {k: f}), shape, modes)]  # fmt: skip
    lhs = qmc.LatinHypercube(d=len(varied), seed=int(cfg.seed)).random(draws)
    logf = (2.0 * lhs - 1.0) * math.log(factor)
    for i, row in enumerate(np.exp(logf)):
        fac = dict(zip(varied, row.tolist(), strict=True))
        rows += [{**r, "kind": "joint", "draw": i + 1, "constant": "", "factor": float("nan"), **{f"f_{k}": v for k, v in fac.items()}}
                 for r in _speedups(costs, perturb(hw, fac), shape, modes)]  # fmt: skip
    df = pd.DataFrame(rows)
    for k, v in hw_columns.items():  # the profile varied, as flashcp-run records it
        df[k] = v
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "sensitivity.csv", index=False)

    keys = ["dataset", "mode", "method"]
    base = df[df.kind == "calibrated"].set_index(keys)["speedup_vs_llama3"]
    oat = df[df.kind == "one_at_a_time"].groupby(keys)["speedup_vs_llama3"]
    joint = df[df.kind == "joint"].groupby(keys)["speedup_vs_llama3"]
    rng = pd.DataFrame({
        "calibrated": base, "one_at_a_time_min": oat.min(), "one_at_a_time_max": oat.max(),
        "joint_min": joint.min(), "joint_p5": joint.quantile(0.05), "joint_median": joint.median(),
        "joint_p95": joint.quantile(0.95), "joint_max": joint.max(),
    }).reset_index()  # fmt: skip
    rng = rng[rng.method != "llama3"]
    rng.to_csv(out / "speedup_range.csv", index=False)
    (out / "speedup_range.md").write_text(markdown_table(rng, ".3f"))

    jt = df[df.kind == "joint"].pivot_table(
        index=["dataset", "mode", "draw"], columns="method", values="speedup_vs_llama3"
    )
    order = []
    for (dataset, mode), g in jt.groupby(level=[0, 1]):
        for a, b in itertools.combinations(methods, 2):
            share = float((g[a] > g[b]).mean())
            base_a, base_b = base[(dataset, mode, a)], base[(dataset, mode, b)]
            order.append({"dataset": dataset, "mode": mode, "faster": a if base_a >= base_b else b,
                          "slower": b if base_a >= base_b else a,
                          "share_of_draws": share if base_a >= base_b else 1.0 - share})  # fmt: skip
    order_df = pd.DataFrame(order)
    order_df.to_csv(out / "ordering.csv", index=False)
    (out / "ordering.md").write_text(markdown_table(order_df, ".3f"))
    plot_tornado(df, methods, datasets, modes[0], out / "tornado.png")
    return df


def plot_tornado(df: pd.DataFrame, methods, datasets, mode: str, path: Path) -> Path:
    """Draw ``path`` (a PNG) from ``df`` (the rows of ``sensitivity.csv``): one panel per (method
    other than llama3, dataset), the speedup over llama3 at each constant's low and high end of the
    one-at-a-time sweep, sorted by range, with the calibrated speedup marked. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [m for m in methods if m != "llama3"]
    fig, axes = plt.subplots(len(shown), len(datasets), figsize=(4.2 * len(datasets), 3.6 * len(shown)),
                             squeeze=False)  # fmt: skip
    for i, method in enumerate(shown):
        for j, dataset in enumerate(datasets):
            ax = axes[i][j]
            sel = (df.method == method) & (df.dataset == dataset) & (df["mode"] == mode)
            base = float(df[sel & (df.kind == "calibrated")]["speedup_vs_llama3"].iloc[0])
            oat = df[sel & (df.kind == "one_at_a_time")]
            lo = oat.groupby("constant")["speedup_vs_llama3"].min()
            hi = oat.groupby("constant")["speedup_vs_llama3"].max()
            order = (hi - lo).sort_values().index
            y = np.arange(len(order))
            ax.barh(y, hi[order] - lo[order], left=lo[order], color="tab:blue", alpha=0.7)
            ax.axvline(base, color="k", lw=1)
            ax.axvline(1.0, color="tab:red", lw=0.8, ls="--")
            ax.set_yticks(y, order, fontsize=7)
            ax.set_title(f"{method} / {dataset} ({mode})", fontsize=9)
            ax.set_xlabel("speedup over llama3", fontsize=8)
    fig.suptitle(
        "One-at-a-time sensitivity (each constant x1/2 .. x2; black: calibrated)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _study(cfg: DictConfig) -> Path:
    out_dir = Path(str(cfg.results_dir)) / str(cfg.name)
    run_sensitivity(cfg, out_dir)
    return out_dir / "speedup_range.csv"


register_experiment("sensitivity", SensitivityConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="sensitivity")
def main(cfg: DictConfig) -> dict[str, Any]:
    """Hydra app of ``flashcp-sensitivity`` (conf/sensitivity.yaml, :class:`SensitivityConfig`): the sensitivity study into
    ``<results_dir>/<name>/``; returns the job's record
    (:func:`experiments.common.entry.run_experiment`)."""
    return run_experiment(cfg, _study, check_sensitivity_config)


def cli(argv: list[str] | None = None) -> None:
    """Console entry point ``flashcp-sensitivity``: :func:`main` with readable errors and clean
    Ctrl-C (:func:`experiments.common.launch.launch`)."""
    launch(main, PROG, argv)


if __name__ == "__main__":
    cli()
