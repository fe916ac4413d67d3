"""Paper Table 2: the FlashCP heuristic against the ILP's optimum (and the refined heuristic, the baselines).

For ``num_sequences`` Pile sequences (C = 128K, N = 4 by default) every planner plans every
sequence. Per planner the table reports mean communication saving (1 - Eq. 5 / Eq. 4) and mean
imbalance ratio (max / mean of Eq. 3 per rank) *next to the ILP's*: ``ilp_opt_comm_saving`` is
the ILP's mean saving over the sequences where it proved its optimum (status ``ok``, within
``gap``), ``saving_minus_ilp_opt`` the planner's mean saving minus the ILP's on those sequences,
``saving_minus_ilp`` the same against the ILP's returned plan on every sequence (proven or
not), and ``saving_bound_minus_saving`` the mean distance from the planner's saving to the upper bound
that the ILP's best bound proves for any plan on its pieces at the imbalance cap
(:func:`flashcp.planners.ilp.saving_bound`), over every sequence with a bound. The ILP row adds how many
solves were proven optimal, stopped on the time limit with an incumbent, or fell back to the
heuristic; its mean gap; how many improved on their warm start, how many warm starts the
solver accepted, how many started from the rounded LP relaxation (:func:`flashcp.planners.ilp.plan_ilp`,
``lp_rounding``) and how many starts the neighbourhood search improved (``lns``). Times: mean and p90 per sequence (heuristics: median of 3 runs).

Outputs in ``out_dir``: ``table2_rows.csv`` (one row per planner x sequence, with a ``status``
column), ``table2.csv`` (the summary), ``table2.md`` and ``table2.tex``. Command:
``flashcp-table2 [field=value ...]`` (or ``python -m experiments.table2``; conf/table2.yaml,
fields :class:`Table2Config`), writing ``<results_dir>/<name>/``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
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
from flashcp.config import DatasetConfig
from flashcp.executors.progress import progress_bar
from flashcp.results import markdown_table

__all__ = [
    "DEFAULT_HIGHS_OPTIONS",
    "Table2Config",
    "check_table2_config",
    "cli",
    "main",
    "run_table2",
    "table2_from_config",
]

log = logging.getLogger(__name__)

#: the command (conf/table2.yaml names it in hydra.callbacks.folder.prog; pyproject.toml's script)
PROG = "flashcp-table2"
_BASELINES = ("llama3", "per_doc", "ring", "zigzag")

#: ``flashcp-table2``'s HiGHS options unless given (HiGHS's own mip_heuristic_effort: 0.05)
DEFAULT_HIGHS_OPTIONS: MappingProxyType[str, Any] = MappingProxyType({"mip_heuristic_effort": 1.0})


@dataclass
class Table2Config(ExperimentConfig):
    """``flashcp-table2`` (conf/table2.yaml, :func:`experiments.table2.run_table2`): the paper's
    Table 2, every heuristic and baseline against the ILP on the same sampled sequences.
    CI-sized by default (about 10 minutes on 2 cores); paper-sized: ``num_sequences=100``."""

    name: str = "table2"
    #: the dataset sequences are sampled from (conf/dataset/; the paper's table: dataset=pile),
    #: sampled as flashcp-run samples it (flashcp.data.sample_dataset, every field of the group:
    #: dataset=file dataset.path=lengths.txt, dataset.weighting, dataset.cap, dataset.overlong);
    #: the defaults give the sequences of Fig. 5 / 7
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    #: N, number of CP ranks
    cp_size: int = 4
    #: C, tokens per packed sequence
    context_len: int = 131072
    #: sequences sampled (the same for every planner)
    num_sequences: int = 10
    #: seed of the sampler
    seed: int = 0
    #: ILP wall-clock limit per sequence, seconds
    time_limit_s: float = 60.0
    #: ILP granularity, tokens
    block_size: int = 1024
    #: R for flashcp / flashcp_refined, and the ILP's imbalance cap
    target_imbalance: float = 1.02
    #: ILP solver: highs (highspy, a dependency) | cbc (bundled with PuLP)
    solver: str = "highs"
    #: ILP formulation: patterns | pieces (the original formulation)
    formulation: str = "patterns"
    #: relative gap at which an ILP solve counts as proven optimal
    gap: float = 0.01
    #: weight of communication in the ILP objective (flashcp.planners.ilp.plan_ilp)
    comm_weight: float = 1.0
    #: the ILP's MIP start: best | flashcp | flashcp_refined | null (none)
    warm_start: str | None = "best"
    #: also try a MIP start cut from the LP relaxation (needs a warm_start)
    lp_rounding: bool = True
    #: improve the MIP start by a neighbourhood search over pairs of ranks (null: on when highspy
    #: is installed; flashcp.planners.ilp.plan_ilp)
    lns: bool | None = None
    #: HiGHS options by name, passed to the solver (checked before any solve). The default
    #: mip_heuristic_effort 1.0 (HiGHS's own: 0.05) is the setting experiments/benchmarks/bench_ilp.py
    #: measures; solver=cbc drops it (other HiGHS options with cbc are refused). null passes none
    #: (HiGHS's own values); highs_options={k: v} adds to the default, as Hydra merges mappings
    highs_options: dict[str, Any] | None = field(
        default_factory=lambda: dict(DEFAULT_HIGHS_OPTIONS)
    )
    #: processes solving ILPs in parallel
    workers: int = 1


def check_table2_config(cfg: Any) -> None:
    """Check a :class:`Table2Config` before any work: the checks every experiment gets
    (:func:`experiments.common.entry.check_experiment_config`), then the ILP's settings, the
    HiGHS options against the solver, and that ``dataset=file`` has a path.

    Raises:
        ValueError: naming the bad value.
    """
    check_experiment_config(cfg, chunks_per_rank=2)  # llama3 among the methods: 2N chunks
    at_least(cfg, "block_size", 1)
    at_least(cfg, "target_imbalance", 1.0)
    at_least(cfg, "time_limit_s", 0.0, strict=True)
    at_least(cfg, "gap", 0.0)
    if cfg.get("gap") is not None and not cfg.gap < 1:
        raise ValueError(f"gap (relative) must be < 1, got {cfg.gap}")
    highs = cfg.get("highs_options")
    if highs and cfg.get("solver") != "highs" and dict(highs) != DEFAULT_HIGHS_OPTIONS:
        raise ValueError(
            f"highs_options={dict(highs)} are HiGHS options and solver={cfg.solver}; drop them "
            "(highs_options=null) or use solver=highs"
        )
    from flashcp.plan import check_context_len

    check_context_len(cfg.context_len, int(cfg.cp_size), 2)  # llama3, a baseline: 2N chunks
    if cfg.dataset.name == "file" and cfg.dataset.path is None:
        raise ValueError(
            "dataset=file needs dataset.path=<a file of lengths: text, CSV, Parquet, JSON or .npy>"
        )


def _ilp_row(args: tuple) -> dict:
    """Solve one sequence with the ILP (top-level so a process pool can run it)."""
    import warnings

    from flashcp.planners.ilp import plan_ilp

    seq, doc_lens, cp_size, opts = args
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the fallback is recorded in the row
        plan = plan_ilp(doc_lens, cp_size, **opts)
    return _row("ilp", seq, plan, time.perf_counter() - t0)


def _row(method: str, seq: int, plan, seconds: float) -> dict:
    """One result row of a planner on a sequence."""
    from flashcp.registry import COMM_KIND

    info = plan.info
    # only sharding-aware all-gather saves anything (Eq. 5); the baselines move the full KV
    sharded = COMM_KIND.get(method) == "allgather_sharded"
    return {
        "method": method,
        "seq": seq,
        "num_docs": plan.num_docs,
        "status": plan.status,
        "comm_saving": plan.comm_saving if sharded else 0.0,
        "comm_tokens": plan.comm_tokens if sharded else plan.comm_tokens_full,
        "imbalance_ratio": plan.imbalance_ratio,
        "solve_ms": 1000.0 * seconds,
        "solver_status": info.get("solver_status"),
        "ilp_gap": info.get("gap"),
        "ilp_objective": info.get("objective"),
        "ilp_best_bound": info.get("best_bound"),
        "ilp_seed_objective": info.get("seed_objective"),
        "ilp_saving_upper_bound": info.get("saving_upper_bound"),
        "ilp_formulation": info.get("formulation"),
        "ilp_solver": info.get("solver"),
        "ilp_warm_start_accepted": info.get("warm_start_accepted"),
        "ilp_cpu_s": info.get("total_cpu_s"),
        "ilp_lp_bound": info.get("lp_bound"),
        "ilp_warm_start_source": info.get("warm_start_source"),
        "ilp_lns_start_objective": info.get("lns_start_objective"),
        "ilp_lns_objective": info.get("lns_objective"),
        "ilp_threads": info.get("threads"),
        "ilp_fallback_method": info.get("fallback_method"),
        "num_split_docs": int(plan.split_docs.size),
    }


def _summary(rows: pd.DataFrame, target: float) -> pd.DataFrame:
    """Per-planner summary of the rows (see the module docstring)."""
    ilp = rows[rows["method"] == "ilp"].set_index("seq")
    proven = ilp.index[ilp["status"] == "ok"]
    ilp_saving = ilp["comm_saving"]
    bound = pd.to_numeric(ilp["ilp_saving_upper_bound"], errors="coerce").dropna()
    out = []
    for method, g in rows.groupby("method", sort=False):
        g = g.set_index("seq")
        on_proven = g["comm_saving"].reindex(proven)
        on_bound = g["comm_saving"].reindex(bound.index)
        rec = {
            "method": method,
            "num_sequences": len(g),
            "mean_comm_saving": g["comm_saving"].mean(),
            "mean_imbalance_ratio": g["imbalance_ratio"].mean(),
            "max_imbalance_ratio": g["imbalance_ratio"].max(),
            "frac_imbalance_le_target": float((g["imbalance_ratio"] <= target + 1e-12).mean()),
            "ilp_proven_sequences": len(proven),
            "ilp_opt_comm_saving": ilp_saving.reindex(proven).mean(),
            "saving_minus_ilp_opt": (on_proven - ilp_saving.reindex(proven)).mean(),
            "saving_minus_ilp": (g["comm_saving"] - ilp_saving.reindex(g.index)).mean(),
            "ilp_mean_saving_upper_bound": bound.mean(),
            "saving_bound_minus_saving": (bound - on_bound).mean(),
            "mean_solve_ms": g["solve_ms"].mean(),
            "p90_solve_ms": float(np.percentile(g["solve_ms"], 90)),
            "ilp_mean_gap": np.nan,
            "ilp_optimal": np.nan,
            "ilp_time_limit": np.nan,
            "ilp_fallback": np.nan,
            "ilp_improved_on_seed": np.nan,
            "ilp_warm_start_accepted": np.nan,
            "ilp_mean_cpu_s": np.nan,
            "ilp_lp_rounded_starts": np.nan,
            "ilp_lns_improved": np.nan,
        }
        if method == "ilp":
            rec["ilp_mean_gap"] = pd.to_numeric(g["ilp_gap"], errors="coerce").mean()
            rec["ilp_optimal"] = int((g["solver_status"] == "optimal").sum())
            rec["ilp_time_limit"] = int((g["status"] == "time_limit").sum())
            rec["ilp_fallback"] = int((g["status"] == "fallback").sum())
            obj = pd.to_numeric(g["ilp_objective"], errors="coerce")
            seed_obj = pd.to_numeric(g["ilp_seed_objective"], errors="coerce")
            rec["ilp_improved_on_seed"] = int((obj < seed_obj - 1e-9).sum())
            rec["ilp_mean_cpu_s"] = pd.to_numeric(g["ilp_cpu_s"], errors="coerce").mean()
            rec["ilp_warm_start_accepted"] = int((g["ilp_warm_start_accepted"] == True).sum())  # noqa: E712
            rec["ilp_lp_rounded_starts"] = int((g["ilp_warm_start_source"] == "lp_rounding").sum())
            lns_start = pd.to_numeric(g["ilp_lns_start_objective"], errors="coerce")
            lns_obj = pd.to_numeric(g["ilp_lns_objective"], errors="coerce")
            rec["ilp_lns_improved"] = int((lns_obj < lns_start - 1e-9).sum())
        out.append(rec)
    return pd.DataFrame(out)


def run_table2(
    num_sequences: int = 10,
    context_len: int = 131072,
    cp_size: int = 4,
    time_limit_s: float = 20.0,
    block_size: int = 1024,
    seed: int = 0,
    out_dir: str = "results/table2",
    dataset: str = "pile",
    target_imbalance: float = 1.02,
    solver: str = "cbc",
    gap: float = 0.01,
    comm_weight: float = 1.0,
    warm_start: str | None = "best",
    formulation: str = "patterns",
    workers: int = 1,
    lp_rounding: bool = True,
    lns: bool | None = None,
    highs_options: dict | None = None,
    dataset_path: str | None = None,
    weighting: str = "documents",
    cap: int | None = None,
    overlong: str = "split",
) -> pd.DataFrame:
    """Run the Table 2 comparison and write its files.

    Args:
        num_sequences: sequences sampled from ``dataset``.
        context_len: C in tokens.
        cp_size: N.
        time_limit_s: ILP wall-clock limit per sequence, seconds.
        block_size: ILP granularity in tokens (:func:`flashcp.planners.ilp.block_pieces`).
        seed: sampling seed. Sequences are sampled as ``flashcp-run`` samples them
            (:func:`flashcp.data.sample_dataset` with its defaults: documents weighting, cap
            4 x C, documents longer than C split), so they are the ones of Fig. 5 / 7.
        out_dir: folder for the outputs (created).
        dataset: a :func:`flashcp.data.load_distribution` name (``pile`` for the paper's table).
        dataset_path, weighting, cap, overlong: the rest of the dataset group
            (:func:`flashcp.data.sample_dataset`'s ``path``, ``weighting``, ``cap``,
            ``overlong``): ``dataset_path`` for ``dataset="file"``; the defaults are flashcp-run's.
            Each row counts its sequence's ``overlong_docs`` and ``overlong_tokens_cut``.
        target_imbalance: R for ``flashcp`` and ``flashcp_refined``, and the ILP's imbalance cap.
        solver, gap, comm_weight, warm_start, formulation, lp_rounding, lns, highs_options: passed to
            :func:`flashcp.planners.ilp.plan_ilp` (``highs_options`` equal to flashcp-table2's default,
            :data:`DEFAULT_HIGHS_OPTIONS`, is dropped under ``solver="cbc"``). The default warm start is the better heuristic, so the
            ILP row is never worse than the best plan known; ``gap`` is the relative gap at which
            a solve counts as proven optimal.
        workers: processes solving ILPs in parallel (heuristics and baselines run inline).
    Returns:
        The summary DataFrame (also written as ``table2.csv``).
    Raises:
        ValueError: bad dataset or planner options (from the sampler and the planners), workers
            outside [1, :func:`flashcp.executors.sim.max_workers`].
    """
    from flashcp.data import overlong_note, sample_dataset
    from flashcp.executors.sim import check_workers

    workers = check_workers(workers)
    if solver != "highs" and dict(highs_options or {}) == DEFAULT_HIGHS_OPTIONS:
        highs_options = None  # flashcp-table2's default is for HiGHS only
    from flashcp.planners.flashcp_refined import plan_flashcp_refined
    from flashcp.registry import get_planner
    from flashcp.results import provenance, write_csv_atomic

    # flashcp-run's sampler and defaults (documents longer than C split): the same sequences as
    # Fig. 5 / 7 for the same dataset, seed and context
    seqs, counts = sample_dataset(
        dataset, num_sequences, context_len, seed=seed, weighting=weighting, cap=cap,
        overlong=overlong, path=dataset_path,
    )  # fmt: skip
    note = overlong_note(counts, overlong, context_len, str(dataset))
    if note:
        (log.warning if overlong == "cut" else log.info)(note)
    heuristics = {
        "flashcp": lambda d: get_planner("flashcp")(d, cp_size, target_imbalance=target_imbalance),
        "flashcp_refined": lambda d: plan_flashcp_refined(
            d, cp_size, target_imbalance=target_imbalance
        ),
    }
    for b in _BASELINES:
        heuristics[b] = (lambda name: lambda d: get_planner(name)(d, cp_size))(b)
    rows = []
    for i, d in enumerate(seqs):
        for method, fn in heuristics.items():
            fn(d)  # warm-up (imports, caches)
            times = []
            for _ in range(3):  # median of 3 for millisecond planners
                t0 = time.perf_counter()
                plan = fn(d)
                times.append(time.perf_counter() - t0)
            rows.append(_row(method, i, plan, float(np.median(times))))
    opts = {
        "block_size": block_size,
        "time_limit_s": time_limit_s,
        "gap": gap,
        "solver": solver,
        "comm_weight": comm_weight,
        "max_imbalance": target_imbalance,
        "warm_start": warm_start,
        "formulation": formulation,
        "lp_rounding": lp_rounding,
        "lns": lns,
        "highs_options": None if highs_options is None else dict(highs_options),
        "heuristic_target_imbalance": target_imbalance,
        "threads": 1,
    }
    jobs = [(i, d, cp_size, opts) for i, d in enumerate(seqs)]
    # the ILP solves take seconds to minutes each: a bar per sequence on a terminal
    bar = progress_bar(len(jobs), f"table2 {dataset} ILP solves")
    with bar, contextlib.ExitStack() as stack:
        if workers > 1:
            pool = stack.enter_context(ProcessPoolExecutor(max_workers=workers))
            solved = pool.map(_ilp_row, jobs)
        else:
            solved = map(_ilp_row, jobs)
        for row in solved:
            rows.append(row)
            bar.update(1)

    df = pd.DataFrame(rows)
    over = pd.DataFrame(counts, columns=["overlong_docs", "overlong_tokens_cut"])
    df = df.join(over, on="seq")
    setup = {
        "dataset": dataset,
        "dataset_path": "-" if dataset_path is None else str(dataset_path),
        "weighting": weighting,
        "dataset_cap": 4 * int(context_len) if cap is None else int(cap),
        "overlong": overlong,
        "context_len": context_len,
        "cp_size": cp_size,
        "seed": seed,
        "target_imbalance": target_imbalance,
        "ilp_block_size": block_size,
        "ilp_time_limit_s": time_limit_s,
        "ilp_solver": solver,
        "ilp_formulation": formulation,
        "ilp_gap_tolerance": gap,
        "ilp_warm_start": warm_start,
        "ilp_lp_rounding": lp_rounding,
        "ilp_lns": lns,
        # JSON (sorted keys), readable by any CSV consumer: json.loads gives the options back
        "ilp_highs_options": None
        if not highs_options
        else json.dumps(dict(highs_options), sort_keys=True),
    }
    prov = provenance()
    for k, v in {**setup, **prov}.items():
        df[k] = v
    summary = _summary(df, target_imbalance)
    for k, v in setup.items():
        summary[k] = v
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_csv_atomic(df, out / "table2_rows.csv")
    write_csv_atomic(summary, out / "table2.csv")
    shown = summary[
        [
            "method",
            "mean_comm_saving",
            "mean_imbalance_ratio",
            "ilp_opt_comm_saving",
            "saving_minus_ilp_opt",
            "saving_minus_ilp",
            "ilp_mean_saving_upper_bound",
            "saving_bound_minus_saving",
            "mean_solve_ms",
            "p90_solve_ms",
            "ilp_mean_gap",
            "ilp_optimal",
            "ilp_time_limit",
            "ilp_fallback",
            "ilp_improved_on_seed",
            "ilp_warm_start_accepted",
            "ilp_lp_rounded_starts",
            "ilp_lns_improved",
        ]
    ]
    (out / "table2.md").write_text(markdown_table(shown))
    (out / "table2.tex").write_text(shown.to_latex(index=False, float_format="%.4g"))
    return summary


def table2_from_config(cfg: DictConfig) -> Path:
    """:func:`run_table2` with the fields of a :class:`Table2Config`, writing
    ``<results_dir>/<name>/``; returns the path of ``table2.csv``."""
    opts = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    out_dir = Path(str(opts.pop("results_dir"))) / str(opts.pop("name"))
    opts.pop("run_key")
    ds = opts.pop("dataset")
    run_table2(
        out_dir=str(out_dir), dataset=ds["name"], dataset_path=ds["path"],
        weighting=ds["weighting"], cap=ds["cap"], overlong=ds["overlong"], **opts,
    )  # fmt: skip
    return out_dir / "table2.csv"


register_experiment("table2", Table2Config)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="table2")
def main(cfg: DictConfig) -> dict[str, Any]:
    """Hydra app of ``flashcp-table2`` (conf/table2.yaml, :class:`Table2Config`): the paper's
    Table 2 into ``<results_dir>/<name>/``; returns the job's record
    (:func:`experiments.common.entry.run_experiment`)."""
    return run_experiment(cfg, table2_from_config, check_table2_config)


def cli(argv: list[str] | None = None) -> None:
    """Console entry point ``flashcp-table2``: :func:`main` with readable errors and clean
    Ctrl-C (:func:`experiments.common.launch.launch`)."""
    launch(main, PROG, argv)


if __name__ == "__main__":
    cli()
