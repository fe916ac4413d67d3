"""``executor=sim``: plan every sequence and price the plans with the analytic cost model
(:mod:`flashcp.sim`; docs/design.md §4).

Plans are made once per (sequence, method, impl, cp_size, options) (:attr:`RunSpec.plan_key`) and
their shape- and mode-independent statistics once per (chunk of plans, hardware tile shape)
(:class:`flashcp.sim.cost.PlanBatch`); every run sharing the plans (another model, another
hardware profile) and every mode is then priced from them. A worker process takes a chunk of
at most :data:`CHUNK` sequences (at least one chunk per worker; one sequence when a run's planner
is slow, the ILP, so the progress bar moves per sequence), plans them, and prices each run
of the chunk, all its modes, in one call of :func:`flashcp.sim.cost.price_plans` (numpy
operations over the chunk's plans and ranks; equal to :func:`flashcp.sim.simulate` per plan,
tested to 1e-12). Rows are built as columns. A job of at least
:data:`flashcp.compiled.warm.PRELOAD_PLANS` plans loads the compiled kernels once, before its
workers fork (:func:`flashcp.compiled.warm.preload`).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import pandas as pd

from flashcp.executors.progress import progress_bar
from flashcp.executors.rows import (
    PLAN_COLUMNS,
    error_status,
    finish_rows,
    measure_rows,
    plan_metrics,
    plan_sequences,
)
from flashcp.executors.spec import RunSpec

__all__ = [
    "PLAN_COLUMNS",
    "check_workers",
    "error_status",
    "execute",
    "max_workers",
    "plan_metrics",
    "price_sequences",
]

log = logging.getLogger(__name__)

#: most sequences per unit of work handed to a worker process (larger: less per-call overhead;
#: the batched pricing's NumPy calls cost about as much at 128 plans as at 512)
CHUNK = 512


def _price(batch: Any, run: RunSpec) -> dict[str, dict[str, np.ndarray]]:
    """Price every plan of ``batch`` (a :class:`flashcp.sim.cost.PlanBatch`) for the run's
    shape, hardware profile and each of its modes in one call of
    :func:`flashcp.sim.cost.price_plans`; raises what the first failing plan raises.

    Returns:
        per mode, (S,) arrays per phase and communication column.
    """
    from flashcp.registry import COMM_KIND, split_options
    from flashcp.sim.cost import price_plans

    op_opts = split_options(run.method, run.options)[1]  # e.g. keep_gathered_kv
    from flashcp.sim.node_scoped import price_node_scoped, spans_nodes

    if spans_nodes(batch.plans):  # flashcp_node across nodes: its two-scope gather
        out = price_node_scoped(
            batch.plans, run.shape, run.modes, run.hardware, run.placement, run.nodes
        )
        priced = {mode: {c: v[0, m] for c, v in out.items()} for m, mode in enumerate(run.modes)}
        return _with_step(priced, batch, run)
    out = price_plans(
        batch, [run.shape], run.modes, [run.hardware], COMM_KIND[run.method], run.impl, **op_opts,
        placement=run.placement, nodes=run.nodes,
    )  # fmt: skip
    priced = {mode: {c: v[0, 0, m] for c, v in out.items()} for m, mode in enumerate(run.modes)}
    return _with_step(priced, batch, run)


def _with_step(priced: dict, batch: Any, run: RunSpec) -> dict[str, dict[str, np.ndarray]]:
    """``priced`` with the whole model's ``step_ms`` added where the run's model has one."""
    if run.shape.num_layers is not None:  # the whole model's step (flashcp.sim.step)
        from flashcp.sim.step import step_ms

        tokens = np.array([p.tokens_per_rank.max() for p in batch.plans], dtype=np.int64)
        for mode, cols in priced.items():
            cols["step_ms"] = step_ms(run.shape, run.hardware, cols["total_ms"], tokens, mode)
    return priced


def price_sequences(
    runs: Sequence[RunSpec], seqs: Sequence[np.ndarray], first_idx: int = 0
) -> tuple[pd.DataFrame, dict[str, float]]:
    """Plan and price sequences ``first_idx, first_idx + 1, ...`` for every run, through the
    executors' row loop (:mod:`flashcp.executors.rows`): each plan key's sequences planned once
    (:func:`~flashcp.executors.rows.plan_sequences`), every run sharing it priced from those plans
    (:func:`_price`, all of a run's plans per call).

    Args:
        runs: runs whose ``hardware`` is a :class:`flashcp.sim.HardwareProfile`.
        seqs: (n_docs,) int64 document lengths per sequence.
        first_idx: ``seq_idx`` of ``seqs[0]``.
    Returns:
        ``(rows, seconds)``: rows in (run, sequence, mode) order
        (:func:`flashcp.executors.rows.finish_rows`) and ``{"plan_s", "price_s"}``, the CPU time
        spent planning and pricing (process time: not inflated when other processes share the
        cores). ``plan_ms`` in a row is the planner's wall time.
    """
    from flashcp.sim.cost import PlanBatch

    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(runs):
        groups.setdefault(r.plan_key, []).append(i)
    parts: list[pd.DataFrame] = []
    plan_s = price_s = 0.0
    for members in groups.values():
        spec = runs[members[0]]
        c0 = time.process_time()
        planned = plan_sequences(spec, seqs, first_idx=first_idx)
        c1 = time.process_time()
        plan_s += c1 - c0
        batch = PlanBatch(planned.plans) if planned.plans else None  # shared by the key's runs
        for j in members:
            run = runs[j]
            priced: dict[str, Any] = {}  # the whole batch, every mode, priced once per run

            def measure(plans, mode, run=run, priced=priced, planned=planned, batch=batch):
                if len(plans) == len(planned.plans):  # the whole batch (a retry is one plan)
                    if "all" not in priced:
                        priced["all"] = _price(batch, run)
                    return priced["all"][mode]
                return _price(PlanBatch(plans), run)[mode]  # a retry on a subset

            parts.append(measure_rows(run, planned, measure, run_idx=j))
        price_s += time.process_time() - c1
    return finish_rows(parts), {"plan_s": plan_s, "price_s": price_s}


def _worker_init() -> None:
    """Initializer of the pool's workers: leave Ctrl-C to the parent (it stops the pool and says
    so in one line, :mod:`experiments.common.launch`; a worker that took it would print a traceback) and
    let SIGTERM end a worker at once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def max_workers() -> int:
    """The most worker processes :func:`execute` starts: 4 per CPU, and at least 32 (a pool of
    forked processes, all started at once; past that they only contend for the cores)."""
    return max(32, 4 * (os.cpu_count() or 1))


def check_workers(workers: object) -> int:
    """``workers`` as an int in [1, :func:`max_workers`].

    Raises:
        ValueError: not an integer, < 1, or above :func:`max_workers` (naming the value).
    """
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)):
        raise ValueError(f"workers must be an integer, got {workers!r}")
    workers = int(workers)
    if not 1 <= workers <= max_workers():
        raise ValueError(
            f"workers must be in [1, {max_workers()}] (4 processes per CPU on this machine's "
            f"{os.cpu_count()}, at least 32), got {workers}"
        )
    return workers


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
        ValueError: ``workers`` outside [1, :func:`max_workers`], an unknown mode, hardware profile or impl of a run.
    """
    from flashcp.comm import check_mode
    from flashcp.compiled.warm import PRELOAD_PLANS, preload
    from flashcp.registry import get_method
    from flashcp.sim import load_hardware
    from flashcp.sim.impl import check_impl

    workers = check_workers(workers)
    loaded: dict[int, Any] = {}
    specs = []
    for r in runs:
        for mode in r.modes:
            check_mode(mode)
        check_impl(r.method, r.impl)
        if id(r.hardware) not in loaded:
            loaded[id(r.hardware)] = load_hardware(r.hardware)
        specs.append(_replace_hw(r, loaded[id(r.hardware)]))
    if len(seqs) * len({r.plan_key for r in runs}) >= PRELOAD_PLANS:
        preload()  # once, before the workers fork (Linux): they inherit the loaded kernels
    size = max(1, min(CHUNK, -(-len(seqs) // workers)))  # every worker a chunk at least
    if any(not get_method(r.method).fast for r in runs):
        size = 1  # a slow planner (the ILP: seconds to minutes a sequence): progress per sequence
    jobs = [(specs, seqs[i : i + size], i) for i in range(0, len(seqs), size)]
    parts: list[pd.DataFrame] = []
    seconds = {"plan_s": 0.0, "price_s": 0.0}
    bar = progress_bar(len(seqs), progress)
    with bar:
        procs = min(workers, len(jobs))  # a process per chunk at most
        pool = ProcessPoolExecutor(procs, initializer=_worker_init) if procs > 1 else None
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
    rows = finish_rows(parts)
    rows.attrs["seconds"] = seconds
    return rows


def _replace_hw(run: RunSpec, hw: Any) -> RunSpec:
    from dataclasses import replace

    return replace(run, hardware=hw)
