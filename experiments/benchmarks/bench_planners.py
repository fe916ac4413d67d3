"""Benchmark: planner and simulator speed, and the wall time of the Fig. 5 sweep.

    python experiments/benchmarks/bench_planners.py                       # ~3 minutes
    python experiments/benchmarks/bench_planners.py --sweep-sequences 100000   # the paper's scale
    python experiments/benchmarks/bench_planners.py --planners-only --methods llama3 ring  # first table
    python experiments/benchmarks/bench_planners.py --scale-only          # pricing at CP 8 and CP 64

Prints, per method (and ``flashcp_refined``) and CP 4 / 8 / 64 (``--cp-sizes``), the median / p90 time to plan a 128K
sequence and read the plan's metrics (``imbalance_ratio``, ``comm_tokens``, workload per rank,
``digest``) with the reference implementation (pure Python / NumPy: ``flashcp.compiled`` off, as
without numba) and with the compiled one, measured in the same run on the same sequences, with
their ratio and the speed goals at CP 8 met or missed; at CP 64, the compiled time's ratio to CP 8's
in the same run and FlashCP's goal there (<= 0.5 ms: a CP group over 8 nodes, docs/scale.md). Then the median / p90 planning time with
the default implementation (plans per second = 1000 / median ms) and the simulator's time per
(plan, shape, mode).
Then the pricing time per plan for both modes and both head counts, the per-plan step model
against one batched call over all the sampled plans (:func:`flashcp.sim.cost.price_plans`;
goal <= 20 µs per plan), its tile statistics in NumPy and compiled (``--pricing-only`` times only
this).
Then runs the Fig. 5 sweep exactly as a user does (``flashcp-run -m experiment=fig5
num_sequences=<n>`` in a subprocess, into a temporary folder: 3 datasets x 5 methods x CP 4/8 x
16/32 heads x train/infer) and prints its wall time with the breakdown the jobs log: sampling,
planning and pricing (CPU-seconds summed over worker processes), the executor's wall time,
writing, and the end-of-sweep merge; with fewer than 100,000 sequences it runs a second sweep
(``--extrapolate-from``, 4000 sequences by default) and extrapolates linearly through the two to
the paper's 100,000 (so what a sweep pays once, start-up, loading the kernels, the fixed costs
of writing and merging, is not multiplied). The load average before and after is printed:
on a shared machine every wall time is inflated by the other processes, CPU-seconds the least, so
it also prints the time on idle cores the CPU-seconds imply (planning + pricing over the workers,
plus sampling, writing, merge and startup as measured), the pricing CPU-µs per plan, and whether
the goals are met (<= 15 s for the default 1000 sequences, <= 5 minutes at 100,000).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np

from flashcp import compiled
from flashcp.comm import AttnShape
from flashcp.data import load_distribution, sample_sequences
from flashcp.registry import get_planner, method_names
from flashcp.sim import load_hardware, simulate_many
from flashcp.sim.cost import price_plans

DATASETS = ("wlb_llm", "pile", "redpajama")
#: the methods of the paper's Fig. 5 comparison, simulated in the timed sweep
METHODS = method_names(paper=True)
#: planners timed per sequence: every fast one, i.e. the Fig. 5 methods and flashcp_refined (speed
#: goals: GOALS_MS)
PLANNERS = method_names(fast=True)
C = 131072
#: goals: pricing per plan (both modes, both head counts), the paper-scale and the default Fig. 5
PRICE_GOAL_US = 20.0
#: goal of the pricing per plan (train and infer) at CP 64 over 8 nodes, µs (--scale)
SCALE_GOAL_US = 1000.0
#: methods priced at CP 8 and CP 64 by --scale: the Fig. 5 methods and the hybrids
SCALE_METHODS = (*method_names(paper=True), "usp", "flashcp_ulysses")
SWEEP_GOAL_S = 300.0
DEFAULT_SWEEP_GOAL_S = 15.0
#: speed goals, ms median per 128K sequence at CP 8, plan and its metrics included
GOALS_MS = {
    "flashcp": 0.1, "flashcp_refined": 1.0, "llama3": 0.05, "per_doc": 0.05, "ring": 0.05,
    "zigzag": 0.05,
}  # fmt: skip
#: speed goals at CP 64 (8 nodes of 8 GPUs, docs/scale.md), ms median per 128K sequence
GOALS_MS_CP64 = {"flashcp": 0.5}
REPO = Path(__file__).resolve().parents[2]
#: what a job of ``experiments.run`` logs when it finishes, and what the merge logs
_JOB = re.compile(
    r"(\d+) runs, (\d+) rows .* in ([\d.]+) s -> .*seconds: sampling ([\d.]+), planning ([\d.]+), "
    r"pricing ([\d.]+) \(CPU-s in workers\), executor ([\d.]+), writing ([\d.]+)"
)
_MERGE = re.compile(r"(\d+) rows, (\d+) summary rows -> .* in ([\d.]+) s \(merge\)")


def time_sweep(num_sequences: int, workers: int, timeout_s: float) -> dict[str, float]:
    """Run ``flashcp-run -m experiment=fig5`` with ``num_sequences`` in a temporary results folder;
    return its wall time and the summed breakdown of its jobs' log lines (seconds).

    Raises:
        RuntimeError: the sweep failed (its last output lines in the message).
    """
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "experiments.run", "-m", "experiment=fig5",
            f"num_sequences={num_sequences}", f"workers={workers}", f"results_dir={tmp}",
            "progress=false", "plots=[]",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        t0 = time.perf_counter()
        proc = subprocess.run(
            cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout_s
        )
        wall = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(
            f"the sweep failed ({proc.returncode}):\n" + "\n".join(out.splitlines()[-15:])
        )
    parts = dict.fromkeys(
        ("runs", "rows", "jobs_s", "sampling", "planning_cpu", "pricing_cpu", "executor",
         "writing", "merge"), 0.0,
    )  # fmt: skip
    for m in _JOB.finditer(out):
        for k, v in zip(list(parts)[:8], m.groups(), strict=True):
            parts[k] += float(v)
    merge = _MERGE.search(out)
    parts["merge"] = float(merge.group(3)) if merge else float("nan")
    parts["wall"] = wall
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sequences", type=int, default=200, help="sequences per dataset for timing planners"
    )
    ap.add_argument(
        "--sweep-sequences", type=int, default=1000, help="sequences per dataset in the timed sweep"
    )
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--extrapolate-from", type=int, default=4000,
        help="a second, larger sweep (sequences per dataset) for the extrapolation to 100,000 "
        "(0: none)",
    )  # fmt: skip
    ap.add_argument("--timeout", type=float, default=3600, help="limit of the sweep, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--sweep-only", action="store_true", help="time only the Fig. 5 sweep, not the planners"
    )
    ap.add_argument("--pricing-only", action="store_true", help="time only the pricing per plan")
    ap.add_argument(
        "--scale-only",
        action="store_true",
        help="time only the pricing per plan at CP 8 (one node) and CP 64 (8 nodes of 8)",
    )
    ap.add_argument(
        "--pricing-repeats", type=int, default=5, help="batched pricing runs (the median is shown)"
    )
    ap.add_argument(
        "--planners-only",
        action="store_true",
        help="time only the planners, reference vs compiled (the first table), nothing else",
    )
    ap.add_argument(
        "--methods", nargs="+", choices=PLANNERS, default=PLANNERS, help="planners to time"
    )
    ap.add_argument(
        "--cp-sizes", nargs="+", type=int, default=[4, 8, 64],
        help="CP sizes of the first table (64: the ratio to CP 8 and the CP 64 goals)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.scale_only:
        time_pricing_scale(args)
        return
    if args.pricing_only:
        time_pricing(args)
        return
    if args.planners_only:
        compare_planners(args)
        return
    if not args.sweep_only:
        compare_planners(args)
        time_planners(args)
        time_pricing(args)
        time_pricing_scale(args)
    time_fig5(args)


def plan_and_read(planner, d: np.ndarray, cp: int) -> float:
    """Seconds to plan ``d`` at ``cp`` (validated) and read the metrics a sweep reads."""
    t0 = time.perf_counter()
    plan = planner(d, cp)
    _ = plan.imbalance_ratio, plan.comm_tokens, plan.workload_per_rank, plan.digest()
    return time.perf_counter() - t0


def compare_planners(args: argparse.Namespace) -> None:
    """Reference vs compiled planning time per sequence, side by side (module docstring)."""
    os.environ["FLASHCP_COMPILED"] = "1"  # the kernels from the first call, no warm-up
    print(f"planning + metrics per {C // 1024}K sequence, reference (NumPy / pure Python) vs "
          f"compiled (numba: {'on' if compiled.enabled() else 'NOT AVAILABLE'}), "
          f"{args.sequences} sequences x {len(DATASETS)} datasets")  # fmt: skip
    seqs = [
        d
        for ds in DATASETS
        for d in sample_sequences(
            load_distribution(ds, context_len=C), args.sequences, C, seed=args.seed
        )
    ]
    t0 = time.perf_counter()
    for method in args.methods:  # compile (first process on this machine) or load the kernels
        get_planner(method)(seqs[0], 8)
    print(f"kernels compiled or loaded in {time.perf_counter() - t0:.1f} s")
    print(f"{'method':<16} {'cp':>3} {'ref_median_ms':>13} {'ref_p90_ms':>10} "
          f"{'fast_median_ms':>14} {'fast_p90_ms':>11} {'speedup':>8}  goal (CP 8, CP 64)")  # fmt: skip
    at_cp8: dict[str, float] = {}
    for method, cp in itertools.product(args.methods, args.cp_sizes):
        planner = get_planner(method)
        # one implementation over all sequences, then the other (as a sweep plans: one planner
        # many times, warm), both within seconds of each other
        fast = [plan_and_read(planner, d, cp) * 1e3 for d in seqs]
        with mock.patch.dict(os.environ, {"FLASHCP_COMPILED": "0"}):
            ref = [plan_and_read(planner, d, cp) * 1e3 for d in seqs]
        rm, fm = float(np.median(ref)), float(np.median(fast))
        goal = GOALS_MS.get(method) if cp == 8 else GOALS_MS_CP64.get(method) if cp == 64 else None
        verdict = f"<= {goal:g} ms: {'met' if fm <= goal else 'MISSED'}" if goal else ""
        if cp == 8:
            at_cp8[method] = fm
        elif cp == 64 and method in at_cp8:
            verdict += f" ({fm / at_cp8[method]:.1f}x CP 8's)"
        print(f"{method:<16} {cp:>3} {rm:>13.3f} {np.percentile(ref, 90):>10.3f} {fm:>14.3f} "
              f"{np.percentile(fast, 90):>11.3f} {rm / fm:>7.1f}x  {verdict}")  # fmt: skip
    print()


def time_planners(args: argparse.Namespace) -> None:
    """Median / p90 planning time per sequence and simulator time per (plan, shape, mode)."""
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


def _goal(value: float, goal: float) -> str:
    return "met" if value <= goal else "missed"


def time_pricing(args: argparse.Namespace) -> None:
    """Pricing time per plan, both modes x both head counts (the Fig. 5 runs of one plan):
    the per-plan step model (:func:`flashcp.sim.simulate_many`, one plan at a time) against
    one batched call over all sampled plans (:func:`flashcp.sim.cost.price_plans`), with
    the tile statistics in NumPy (``FLASHCP_COMPILED=0``, as without numba) and compiled
    (:mod:`flashcp.sim.cost.kernels`), the two alternating in the same process; CPU µs
    (process time: the least inflated by other processes on a shared machine), the median of
    ``--pricing-repeats`` batched runs."""
    hw = load_hardware("h100_sxm")
    shapes = [AttnShape(16, 16, 128, "bfloat16"), AttnShape(32, 32, 128, "bfloat16")]
    modes = ["train", "infer"]
    print(f"\npricing per plan, 2 modes x 2 head counts ({args.sequences} sequences x "
          f"{len(DATASETS)} datasets; goal <= {PRICE_GOAL_US:g} us batched; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; compiled statistics: "
          f"{'on' if compiled.enabled() else 'NOT AVAILABLE'})")  # fmt: skip
    print(f"{'method':<10} {'cp':>3} {'per_plan_us':>12} {'numpy_us':>9} {'compiled_us':>12} "
          f"{'speedup':>8} goal")  # fmt: skip
    seqs = [
        d
        for ds in DATASETS
        for d in sample_sequences(
            load_distribution(ds, context_len=C), args.sequences, C, seed=args.seed
        )
    ]
    batched_all = []
    with mock.patch.dict(os.environ, {"FLASHCP_COMPILED": "1"}):
        price_plans([get_planner("zigzag")(seqs[0], 4)], shapes, modes, [hw])  # load the kernels
    for method, cp in itertools.product(METHODS, (4, 8)):
        planner = get_planner(method)
        plans = [planner(d, cp) for d in seqs]
        t0 = time.process_time()
        for p in plans:
            simulate_many(p, shapes, modes, hw)
        ref = (time.process_time() - t0) * 1e6 / len(plans)
        runs: dict[str, list[float]] = {"0": [], "1": []}
        for _ in range(max(args.pricing_repeats, 1)):
            for mode in runs:
                with mock.patch.dict(os.environ, {"FLASHCP_COMPILED": mode}):
                    t0 = time.process_time()
                    price_plans(plans, shapes, modes, [hw])
                    runs[mode].append((time.process_time() - t0) * 1e6 / len(plans))
        numpy_us, fast = float(np.median(runs["0"])), float(np.median(runs["1"]))
        batched_all.append(fast)
        print(f"{method:<10} {cp:>3} {ref:>12.1f} {numpy_us:>9.1f} {fast:>12.1f} "
              f"{ref / fast:>7.1f}x {_goal(fast, PRICE_GOAL_US)}")  # fmt: skip
    mean = float(np.mean(batched_all))
    print(f"mean batched pricing over the Fig. 5 methods: {mean:.1f} us per plan "
          f"(goal <= {PRICE_GOAL_US:g}: {_goal(mean, PRICE_GOAL_US)}; load average after "
          f"{os.getloadavg()[0]:.1f})")  # fmt: skip


def time_pricing_scale(args: argparse.Namespace) -> None:
    """Pricing time per plan (train and infer, 32 heads) at CP 8 on one node and at CP 64 over 8
    nodes of 8 GPUs (consecutive; the two-level network, docs/multinode.md), per plan
    (:func:`flashcp.sim.simulate_many`) and batched (:func:`flashcp.sim.cost.price_plans`,
    compiled statistics), in the same run on the same WLB-LLM sequences; CPU µs (process time),
    the ratio CP 64 / CP 8 and the goal (<= :data:`SCALE_GOAL_US` at CP 64, both paths)."""
    hw = load_hardware("h100_sxm")
    shapes, modes = [AttnShape(32, 32, 128, "bfloat16")], ["train", "infer"]
    n_seq = max(args.sequences // 4, 10)
    seqs = sample_sequences(load_distribution("wlb_llm", context_len=C), n_seq, C, seed=args.seed)
    print(f"\npricing per plan at CP 8 (1 node) and CP 64 (8 nodes x 8), train + infer, 32 heads "
          f"({n_seq} WLB-LLM sequences; goal <= {SCALE_GOAL_US:g} us at CP 64; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")  # fmt: skip
    print(f"{'method':<16} {'cp8_plan_us':>11} {'cp8_batch_us':>12} {'cp64_plan_us':>12} "
          f"{'cp64_batch_us':>13} {'ratio':>6} goal")  # fmt: skip
    with mock.patch.dict(os.environ, {"FLASHCP_COMPILED": "1"}):
        price_plans([get_planner("zigzag")(seqs[0], 4)], shapes, modes, [hw])  # load the kernels
        for method in SCALE_METHODS:
            planner = get_planner(method)
            row = {}
            for cp in (8, 64):
                plans = [planner(d, cp) for d in seqs]
                t0 = time.process_time()
                for p in plans:
                    simulate_many(p, shapes, modes, hw)
                row[cp, "plan"] = (time.process_time() - t0) * 1e6 / len(plans)
                runs = []
                for _ in range(max(args.pricing_repeats, 1)):
                    t0 = time.process_time()
                    price_plans(plans, shapes, modes, [hw])
                    runs.append((time.process_time() - t0) * 1e6 / len(plans))
                row[cp, "batch"] = float(np.median(runs))
            worst = max(row[64, "plan"], row[64, "batch"])
            print(f"{method:<16} {row[8, 'plan']:>11.1f} {row[8, 'batch']:>12.1f} "
                  f"{row[64, 'plan']:>12.1f} {row[64, 'batch']:>13.1f} "
                  f"{row[64, 'batch'] / row[8, 'batch']:>5.1f}x {_goal(worst, SCALE_GOAL_US)}")  # fmt: skip


def time_fig5(args: argparse.Namespace) -> None:
    """Wall time and breakdown of ``flashcp-run -m experiment=fig5`` (module docstring)."""
    n = args.sweep_sequences
    t = _report_sweep(n, args)
    if n == 1000:
        print(f"  default Fig. 5 (1000 sequences): {t['wall']:.1f} s wall, {t['idle']:.1f} s on "
              f"idle cores (goal <= {DEFAULT_SWEEP_GOAL_S:g} s: "
              f"{_goal(t['idle'], DEFAULT_SWEEP_GOAL_S)})")  # fmt: skip
    if n < 100_000 and args.extrapolate_from > n:
        # two sizes: what grows with the sequences (the slope) apart from what a sweep pays once
        # (start-up, loading the kernels, the merge's and the writing's fixed costs)
        m = args.extrapolate_from
        u = _report_sweep(m, args)
        slope = (u["idle"] - t["idle"]) / (m - n)
        est = u["idle"] + slope * (100_000 - m)
        print(f"  extrapolated to 100,000 sequences per dataset on idle cores: {est / 60:.1f} min "
              f"(linear through the sweeps of {n} and {m} sequences: {slope * 1e3:.2f} ms per "
              f"sequence; goal <= {SWEEP_GOAL_S / 60:g} min: {_goal(est, SWEEP_GOAL_S)})")  # fmt: skip


def _report_sweep(n: int, args: argparse.Namespace) -> dict[str, float]:
    """Run and print one timed Fig. 5 sweep of ``n`` sequences per dataset; return its
    :func:`time_sweep` breakdown plus ``idle``, the seconds it implies on idle cores."""
    load0 = os.getloadavg()[0]
    print(f"\nFig. 5 sweep (flashcp-run -m experiment=fig5), {n} sequences per dataset, "
          f"{args.workers} worker(s), load average {load0:.1f} on {os.cpu_count()} cores:")  # fmt: skip
    t = time_sweep(n, args.workers, args.timeout)
    other = t["wall"] - t["jobs_s"] - t["merge"]
    print(f"  {int(t['runs'])} runs, {int(t['rows']):,} rows in {t['wall']:.1f} s wall "
          f"(load average after: {os.getloadavg()[0]:.1f})")  # fmt: skip
    print(f"  sampling {t['sampling']:.1f} s | planning {t['planning_cpu']:.1f} CPU-s | "
          f"pricing {t['pricing_cpu']:.1f} CPU-s | executor {t['executor']:.1f} s wall | "
          f"writing {t['writing']:.1f} s | merge {t['merge']:.1f} s | "
          f"startup, composition and figures {other:.1f} s")  # fmt: skip
    # on idle cores the executor's wall time is its CPU time over the workers: the estimate a
    # loaded machine cannot measure directly
    cpu_wall = (t["planning_cpu"] + t["pricing_cpu"]) / args.workers
    serial = t["sampling"] + t["writing"] + t["merge"]
    t["idle"] = cpu_wall + serial + other
    print(f"  on {args.workers} idle cores (planning + pricing CPU-s / workers, plus the rest): "
          f"{t['idle']:.1f} s")  # fmt: skip
    # every plan is priced for 2 head counts x 2 modes: 4 rows per plan
    plans = t["rows"] / 4
    if plans:
        per_plan = t["pricing_cpu"] * 1e6 / plans
        print(f"  pricing: {per_plan:.1f} CPU-us per plan (2 modes x 2 head counts; goal <= "
              f"{PRICE_GOAL_US:g}: {_goal(per_plan, PRICE_GOAL_US)}); planning: "
              f"{t['planning_cpu'] * 1e3 / plans:.3f} CPU-ms per plan")  # fmt: skip
    return t


if __name__ == "__main__":
    main()
