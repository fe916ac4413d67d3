"""``executor=sim``: plan every sequence and price the plans with the analytic cost model
(:mod:`flashcp.sim`; docs/design.md §4).

Plans are made once per (sequence, method, impl, cp_size, options) (:attr:`RunSpec.plan_key`) and
their shape- and mode-independent statistics once per (plan, hardware tile shape)
(:class:`flashcp.sim.PlanCost`); every run sharing the plan (another model, another hardware
profile) and every mode is then priced from them with :meth:`flashcp.sim.PlanCost.step`, the
same code :func:`flashcp.sim.simulate` runs, so a row holds exactly the numbers ``simulate`` gives
for its plan. Rows are built as columns, per (run, chunk of sequences), in ``workers`` processes.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import pandas as pd

from flashcp.executors import RunSpec
from flashcp.plan import Plan
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS

__all__ = ["PLAN_COLUMNS", "execute", "plan_metrics", "price_sequences"]

log = logging.getLogger(__name__)

#: plan columns of a row (:func:`plan_metrics` plus the planner's status, time and padding)
PLAN_COLUMNS: tuple[str, ...] = (
    "plan_status", "plan_ms", "pad_tokens", "imbalance_ratio", "comm_tokens", "comm_tokens_full",
    "comm_saving", "comm_tokens_sharded", "num_split_docs", "num_pieces", "max_shards_per_rank",
)  # fmt: skip

#: sequences per unit of work handed to a worker process
CHUNK = 64


def plan_metrics(plan: Plan) -> dict[str, Any]:
    """Plan columns of a row (from :meth:`flashcp.plan.Plan.summary`).

    ``comm_tokens`` is what the method really moves: KV tokens one rank receives per pass, per K or
    V, per KV head — Eq. 4 of the paper for full all-gather and for the ring, Eq. 5 for
    sharding-aware all-gather — and ``comm_saving`` = 1 - comm_tokens / comm_tokens_full.
    ``comm_tokens_sharded`` is Eq. 5 on the method's layout: what sharding-aware communication
    would move for it. ILP plans add ``ilp_solver_status``, ``ilp_gap``,
    ``ilp_warm_start_given`` and ``ilp_warm_start_accepted``.
    """
    s = plan.summary()
    out = {k: s[k] for k in PLAN_COLUMNS[3:]}
    if plan.method == "ilp":  # the solver's outcome (flashcp.ilp.plan_ilp's info)
        for k in ("solver_status", "gap", "warm_start_given", "warm_start_accepted"):
            out[f"ilp_{k}"] = plan.info.get(k)
    return out


def error_status(exc: BaseException) -> str:
    """``status`` of a failed row: ``"error: <type>: <message>"``."""
    return f"error: {type(exc).__name__}: {exc}"


class _Columns:
    """Rows of one run as growing columns (a column missing from a row is NaN)."""

    def __init__(self) -> None:
        self.cols: dict[str, list[Any]] = {}
        self.n = 0

    def add(self, values: dict[str, Any], repeat: int = 1) -> None:
        for k, v in values.items():
            col = self.cols.get(k)
            if col is None:
                col = self.cols[k] = [math.nan] * self.n
            col.extend([v] * repeat)
        self.n += repeat
        for col in self.cols.values():
            if len(col) < self.n:
                col.extend([math.nan] * (self.n - len(col)))

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.cols)


def price_sequences(
    runs: Sequence[RunSpec], seqs: Sequence[np.ndarray], first_idx: int = 0
) -> tuple[pd.DataFrame, dict[str, float]]:
    """Plan and price sequences ``first_idx, first_idx + 1, ...`` for every run.

    Args:
        runs: runs whose ``hardware`` is a :class:`flashcp.sim.HardwareProfile`.
        seqs: (n_docs,) int64 document lengths per sequence.
        first_idx: ``seq_idx`` of ``seqs[0]``.
    Returns:
        ``(rows, seconds)``: rows in (run, sequence, mode) order (module docstring of
        :mod:`flashcp.executors`) and ``{"plan_s", "price_s"}``, the CPU time spent planning and
        pricing (process time: not inflated when other processes share the cores). ``plan_ms``
        in a row is the planner's wall time.
    """
    from flashcp.registry import COMM_KIND
    from flashcp.sim import PlanCost
    from flashcp.sim.impl import impl_plan

    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(runs):
        groups.setdefault(r.plan_key, []).append(i)
    cols = [_Columns() for _ in runs]
    plan_s = price_s = 0.0
    for members in groups.values():
        spec = runs[members[0]]
        comm_kind = COMM_KIND[spec.method]
        for i, d in enumerate(seqs, start=first_idx):
            base = {"seq_idx": i, "num_docs": int(d.size), "max_doc_len": int(d.max())}
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                plan, pad_tokens = impl_plan(
                    spec.method, spec.impl, d, spec.cp_size, **dict(spec.options)
                )
            except Exception as exc:  # a failure is a row, not a crash (docs/design.md §7)
                log.warning("sequence %d failed (%s): %s", i, spec.method, exc)
                for j in members:
                    for mode in runs[j].modes:
                        cols[j].add({**base, "mode": mode, "status": error_status(exc)})
                continue
            t1, c1 = time.perf_counter(), time.process_time()
            plan_s += c1 - c0
            metrics = {"plan_status": plan.status, "plan_ms": (t1 - t0) * 1e3}
            metrics.update({"pad_tokens": pad_tokens, **plan_metrics(plan)})
            costs: dict[int, PlanCost] = {}  # one per hardware profile object
            for j in members:
                run = runs[j]
                try:
                    cost = costs.get(id(run.hardware))
                    if cost is None:
                        first = next(iter(costs.values()), None)
                        cost = (
                            PlanCost(plan, run.hardware, comm_kind, run.impl)
                            if first is None
                            else first.with_hardware(run.hardware)
                        )
                        costs[id(run.hardware)] = cost
                    steps = [cost.step(run.shape, mode) for mode in run.modes]
                except Exception as exc:  # the cost model rejected this plan
                    log.warning("sequence %d failed (%s): %s", i, run.method, exc)
                    for mode in run.modes:
                        cols[j].add({**base, "mode": mode, "status": error_status(exc)})
                    continue
                for mode, step in zip(run.modes, steps, strict=True):
                    cols[j].add({**base, **metrics, "mode": mode, "status": "ok", **step})
            price_s += time.process_time() - c1
    frames = [c.frame().assign(run_idx=j) for j, c in enumerate(cols)]
    return pd.concat(frames, ignore_index=True), {"plan_s": plan_s, "price_s": price_s}


def _price_star(args: tuple) -> tuple[pd.DataFrame, dict[str, float]]:
    return price_sequences(*args)


def execute(
    runs: Sequence[RunSpec],
    seqs: Sequence[np.ndarray],
    *,
    workers: int = 1,
    progress: str | None = None,
) -> pd.DataFrame:
    """Plan and price every sequence for every run (module docstring).

    Args:
        runs: the job's runs; ``hardware`` a profile name, mapping or
            :class:`flashcp.sim.HardwareProfile` (loaded once per distinct object).
        seqs: (n_docs,) int64 document lengths per sequence.
        workers: processes (1: in this process).
        progress: label of a progress bar on a terminal (None: no bar).
    Returns:
        Rows ordered by (``run_idx``, ``seq_idx``, mode), with every phase and communication column;
        ``rows.attrs["seconds"]`` = ``{"plan_s", "price_s"}`` summed over workers.
    Raises:
        ValueError: ``workers`` < 1, an unknown mode, hardware profile or impl of a run.
    """
    from tqdm import tqdm

    from flashcp.comm import check_mode
    from flashcp.sim import load_hardware
    from flashcp.sim.impl import check_impl

    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    loaded: dict[int, Any] = {}
    specs = []
    for r in runs:
        for mode in r.modes:
            check_mode(mode)
        check_impl(r.method, r.impl)
        hw = loaded.setdefault(id(r.hardware), load_hardware(r.hardware))
        specs.append(_replace_hw(r, hw))
    jobs = [(specs, seqs[i : i + CHUNK], i) for i in range(0, len(seqs), CHUNK)]
    parts: list[pd.DataFrame] = []
    seconds = {"plan_s": 0.0, "price_s": 0.0}
    bar = tqdm(
        total=len(seqs), desc=progress, unit="seq", leave=False,
        disable=progress is None or not sys.stderr.isatty(),
    )  # fmt: skip
    with bar:
        pool = ProcessPoolExecutor(max_workers=workers) if workers > 1 else None
        try:
            results = pool.map(_price_star, jobs) if pool else map(_price_star, jobs)
            for job, (part, sec) in zip(jobs, results, strict=True):
                parts.append(part)
                for k in seconds:
                    seconds[k] += sec[k]
                bar.update(len(job[1]))
        finally:
            if pool:
                pool.shutdown(cancel_futures=True)
    rows = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    rows = rows.sort_values(["run_idx", "seq_idx"], kind="stable", ignore_index=True)
    for col in (*PHASE_COLUMNS, *COMM_COLUMNS):
        if col not in rows:
            rows[col] = np.nan
    rows.attrs["seconds"] = seconds
    return rows


def _replace_hw(run: RunSpec, hw: Any) -> RunSpec:
    from dataclasses import replace

    return replace(run, hardware=hw)
