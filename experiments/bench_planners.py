"""Benchmark: planner and simulator speed, and the wall time of the paper-scale sweep.

    python experiments/bench_planners.py                       # quick: ~1 minute
    python experiments/bench_planners.py --sweep-sequences 100000 --workers 2   # the paper's scale

Prints, per method (and ``flashcp_refined``), the median / p90 planning time per 128K sequence at
CP 4 and 8 (plans per second = 1000 / median ms) and the simulator's time per (plan, shape, mode); then times the sweep
of Fig. 5 (3 datasets x 5 methods x CP 4/8 x 16/32 heads x train/infer) through the same code path
as ``flashcp-run`` (``experiments.run.plan_rows``) with ``--sweep-sequences`` sequences per dataset,
and extrapolates linearly to 100K sequences per dataset when fewer were run.
"""

from __future__ import annotations

import argparse
import itertools
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from experiments.run import plan_rows
from flashcp.comm import AttnShape
from flashcp.data import load_distribution, sample_sequences
from flashcp.registry import get_planner, method_names
from flashcp.sim import load_hardware, simulate_many

DATASETS = ("wlb_llm", "pile", "redpajama")
#: the methods of the paper's Fig. 5 comparison, simulated in the timed sweep
METHODS = method_names(paper=True)
#: planners timed per sequence: every fast one, i.e. the Fig. 5 methods and flashcp_refined (speed
#: goal: <= 2 ms median per 128K sequence at CP 8)
PLANNERS = method_names(fast=True)
C = 131072


def _job(args):
    seqs, method, cp, shape, hw = args
    t0 = time.perf_counter()
    plan_rows(seqs, 0, method, cp, {}, shape, ["train", "infer"], hw)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sequences", type=int, default=200, help="sequences per dataset for timing planners"
    )
    ap.add_argument(
        "--sweep-sequences", type=int, default=500, help="sequences per dataset in the timed sweep"
    )
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    hw = load_hardware("h100_sxm")
    shapes = [AttnShape(16, 16, 128, "bfloat16"), AttnShape(32, 32, 128, "bfloat16")]

    print(
        f"planning time per {C // 1024}K sequence ({args.sequences} sequences x {len(DATASETS)} datasets)"
    )
    print(
        f"{'method':<10} {'cp':>3} {'median_ms':>10} {'p90_ms':>8} {'plans/s':>9} {'sim_us/call':>12}"
    )
    seqs = {
        ds: sample_sequences(
            load_distribution(ds, context_len=C), args.sequences, C, seed=args.seed
        )
        for ds in DATASETS
    }
    for method, cp in itertools.product(PLANNERS, (4, 8)):
        planner = get_planner(method)
        times, sim_times = [], []
        for ds in DATASETS:
            for d in seqs[ds]:
                t0 = time.perf_counter()
                plan = planner(d, cp)
                t1 = time.perf_counter()
                simulate_many(plan, shapes, ["train", "infer"], hw)
                t2 = time.perf_counter()
                times.append((t1 - t0) * 1e3)
                sim_times.append((t2 - t1) * 1e6 / (len(shapes) * 2))
        med = float(np.median(times))
        print(f"{method:<10} {cp:>3} {med:>10.3f} {np.percentile(times, 90):>8.3f} "
              f"{1e3 / med:>9.0f} {np.median(sim_times):>12.1f}")  # fmt: skip

    n = args.sweep_sequences
    print(f"\nFig. 5 sweep, {n} sequences per dataset, {args.workers} worker(s):")
    t0 = time.perf_counter()
    sweep = {
        ds: sample_sequences(load_distribution(ds, context_len=C), n, C, seed=args.seed)
        for ds in DATASETS
    }
    t_sample = time.perf_counter() - t0
    jobs = []
    for ds, method, cp, shape in itertools.product(DATASETS, METHODS, (4, 8), shapes):
        s = sweep[ds]
        jobs.extend((s[i : i + 250], method, cp, shape, hw) for i in range(0, n, 250))
    t0 = time.perf_counter()
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers) as pool:
            busy = sum(pool.map(_job, jobs))
    else:
        busy = sum(map(_job, jobs))
    wall = time.perf_counter() - t0 + t_sample
    runs = len(DATASETS) * len(METHODS) * 2 * len(shapes)
    print(f"  {runs} runs x {n} sequences x 2 modes = {runs * n * 2:,} rows in {wall:.1f} s "
          f"(sampling {t_sample:.1f} s, {busy:.1f} CPU-s in workers)")  # fmt: skip
    if n < 100_000:
        print(f"  extrapolated to 100,000 sequences per dataset: {wall * 100_000 / n / 60:.1f} min")


if __name__ == "__main__":
    main()
