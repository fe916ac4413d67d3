"""``executor=sim``: plan every sequence and price the plans with the analytic cost model
(:mod:`flashcp.sim`; docs/design.md §4).

Plans are made once per (sequence, method, impl, cp_size, options) (:attr:`RunSpec.plan_key`) and
their shape- and mode-independent statistics once per (chunk of plans, hardware tile shape)
(:class:`flashcp.sim.cost_model.PlanBatch`); every run sharing the plans (another model, another
hardware profile) and every mode is then priced from them. A worker process takes a chunk of
:data:`CHUNK` sequences, plans them, and prices each run of the chunk, all its modes, in one call
of :func:`flashcp.sim.cost_model.price_plans` (numpy operations over the chunk's plans and ranks;
equal to :func:`flashcp.sim.simulate` per plan, tested to 1e-12). Rows are built as columns.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import pandas as pd

from flashcp.executors import RunSpec
from flashcp.plan import Plan
from flashcp.results import COMM_COLUMNS, ILP_INFO_COLUMNS, PHASE_COLUMNS

__all__ = ["PLAN_COLUMNS", "execute", "plan_metrics", "price_sequences"]

log = logging.getLogger(__name__)

#: plan columns of a row (:func:`plan_metrics` plus the planner's status, time and padding)
PLAN_COLUMNS: tuple[str, ...] = (
    "plan_status", "plan_ms", "pad_tokens", "imbalance_ratio", "comm_tokens", "comm_tokens_full",
    "comm_saving", "comm_tokens_sharded", "num_split_docs", "num_pieces", "max_shards_per_rank",
)  # fmt: skip

#: sequences per unit of work handed to a worker process (larger: less per-call overhead)
CHUNK = 128


def plan_metrics(plan: Plan) -> dict[str, Any]:
    """Plan columns of a row (from :meth:`flashcp.plan.Plan.summary`).

    ``comm_tokens`` is what the method really moves: KV tokens one rank receives per pass, per K or
    V, per KV head — Eq. 4 of the paper for full all-gather and for the ring, Eq. 5 for
    sharding-aware all-gather — and ``comm_saving`` = 1 - comm_tokens / comm_tokens_full.
    ``comm_tokens_sharded`` is Eq. 5 on the method's layout: what sharding-aware communication
    would move for it. ILP plans add the solve's outcome, ``ilp_<key>`` for every key of
    :data:`flashcp.results.ILP_INFO_COLUMNS` (status, gap, objective, best bound, threads,
    warm-start flags, fallback heuristic).
    """
    s = plan.summary()
    out = {k: s[k] for k in PLAN_COLUMNS[3:]}
    if plan.method == "ilp":  # the solver's outcome (flashcp.ilp.plan_ilp's info)
        for k in ILP_INFO_COLUMNS:
            out[f"ilp_{k}"] = plan.info.get(k)
    return out


def error_status(exc: BaseException) -> str:
    """``status`` of a failed row: ``"error: <type>: <message>"``."""
    return f"error: {type(exc).__name__}: {exc}"


def _run_rows(
    run: RunSpec, per_seq: dict[str, np.ndarray], steps: dict[str, dict[str, np.ndarray]]
) -> pd.DataFrame:
    """Rows of one run's priced sequences in (sequence, mode) order, built column by column.

    Args:
        per_seq: (S,) arrays per column that does not depend on the mode (``seq_idx``, plan
            columns).
        steps: per mode, (S,) arrays per phase and communication column.
    """
    m = len(run.modes)
    n = len(per_seq["seq_idx"])
    cols = {k: np.repeat(v, m) for k, v in per_seq.items()}
    cols["mode"] = np.tile(np.array(run.modes, dtype=object), n)
    cols["status"] = np.full(n * m, "ok", dtype=object)
    for col in (*PHASE_COLUMNS, *COMM_COLUMNS):
        cols[col] = np.stack([steps[mode][col] for mode in run.modes], axis=1).ravel()
    return pd.DataFrame(cols)


def _price(batch: Any, run: RunSpec) -> dict[str, dict[str, np.ndarray]]:
    """Price every plan of ``batch`` (a :class:`flashcp.sim.cost_model.PlanBatch`) for the run's
    shape, hardware profile and each of its modes in one call of
    :func:`flashcp.sim.cost_model.price_plans`; raises what the first failing plan raises.

    Returns:
        per mode, (S,) arrays per phase and communication column.
    """
    from flashcp.registry import COMM_KIND
    from flashcp.sim.cost_model import price_plans

    out = price_plans(
        batch, [run.shape], run.modes, [run.hardware], COMM_KIND[run.method], run.impl
    )
    return {mode: {c: v[0, 0, m] for c, v in out.items()} for m, mode in enumerate(run.modes)}


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
    from flashcp.sim.cost_model import PlanBatch
    from flashcp.sim.impl import impl_plan

    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(runs):
        groups.setdefault(r.plan_key, []).append(i)
    parts: list[list[pd.DataFrame]] = [[] for _ in runs]
    errors: list[list[dict[str, Any]]] = [[] for _ in runs]
    plan_s = price_s = 0.0
    base = {
        "seq_idx": np.arange(first_idx, first_idx + len(seqs), dtype=np.int64),
        "num_docs": np.array([d.size for d in seqs], dtype=np.int64),
        "max_doc_len": np.array([d.max() for d in seqs], dtype=np.int64),
    }
    for members in groups.values():
        spec = runs[members[0]]
        plans, metrics, ok = [], [], []
        c0 = time.process_time()
        for k, d in enumerate(seqs):
            t0 = time.perf_counter()
            try:
                plan, pad_tokens = impl_plan(
                    spec.method, spec.impl, d, spec.cp_size, **dict(spec.options)
                )
            except Exception as exc:  # a failure is a row, not a crash (docs/design.md §7)
                log.warning("sequence %d failed (%s): %s", first_idx + k, spec.method, exc)
                for j in members:
                    errors[j].extend(
                        {**{c: v[k] for c, v in base.items()}, "mode": mode,
                         "status": error_status(exc)}
                        for mode in runs[j].modes
                    )  # fmt: skip
                continue
            plan_ms = (time.perf_counter() - t0) * 1e3
            plans.append(plan)
            ok.append(k)
            metrics.append({
                "plan_status": plan.status, "plan_ms": plan_ms, "pad_tokens": pad_tokens,
                **plan_metrics(plan),
            })  # fmt: skip
        c1 = time.process_time()
        plan_s += c1 - c0
        if ok:
            per_seq = {k: v[ok] for k, v in base.items()}
            per_seq.update({k: np.array(v) for k, v in pd.DataFrame(metrics).items()})
            batch = PlanBatch(plans)  # shared by the runs of this plan key
            for j in members:
                run = runs[j]
                try:
                    steps = _price(batch, run)
                except Exception:  # find the plans the cost model rejects: price one at a time
                    parts[j].extend(_price_one_by_one(run, plans, per_seq, errors[j]))
                    continue
                parts[j].append(_run_rows(run, per_seq, steps))
        price_s += time.process_time() - c1
    frames = []
    for j in range(len(runs)):
        pieces = [*parts[j], pd.DataFrame(errors[j])] if errors[j] else parts[j]
        df = pd.concat(pieces, ignore_index=True) if pieces else pd.DataFrame()
        if errors[j] and len(df):
            df = df.sort_values("seq_idx", kind="stable", ignore_index=True)
        frames.append(df.assign(run_idx=j))
    return pd.concat(frames, ignore_index=True), {"plan_s": plan_s, "price_s": price_s}


def _price_one_by_one(
    run: RunSpec, plans: list[Any], per_seq: dict[str, np.ndarray], errors: list[dict[str, Any]]
) -> list[pd.DataFrame]:
    """Price each plan alone; a plan the cost model rejects becomes error rows in ``errors``."""
    from flashcp.sim.cost_model import PlanBatch

    out = []
    for k, plan in enumerate(plans):
        one = {c: v[k : k + 1] for c, v in per_seq.items()}
        try:
            steps = _price(PlanBatch([plan]), run)
        except Exception as exc:
            log.warning("sequence %d failed (%s): %s", one["seq_idx"][0], run.method, exc)
            errors.extend(
                {**{c: one[c][0] for c in ("seq_idx", "num_docs", "max_doc_len")},
                 "mode": mode, "status": error_status(exc)}
                for mode in run.modes
            )  # fmt: skip
            continue
        out.append(_run_rows(run, one, steps))
    return out


def _worker_init() -> None:
    """Initializer of the pool's workers: leave Ctrl-C to the parent (it stops the pool and says
    so in one line, :mod:`experiments.launch`; a worker that took it would print a traceback) and
    let SIGTERM end a worker at once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


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
        if id(r.hardware) not in loaded:
            loaded[id(r.hardware)] = load_hardware(r.hardware)
        specs.append(_replace_hw(r, loaded[id(r.hardware)]))
    jobs = [(specs, seqs[i : i + CHUNK], i) for i in range(0, len(seqs), CHUNK)]
    parts: list[pd.DataFrame] = []
    seconds = {"plan_s": 0.0, "price_s": 0.0}
    bar = tqdm(
        total=len(seqs), desc=progress, unit="seq", leave=False,
        disable=progress is None or not sys.stderr.isatty(),
    )  # fmt: skip
    with bar:
        pool = ProcessPoolExecutor(workers, initializer=_worker_init) if workers > 1 else None
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
