"""Benchmark of the exact and heuristic FlashCP planners.

Five sweeps, each a list of result rows (written to CSV, then printed as a table):

* ILP time to a proven gap (the Table 2 setup: Pile, N = 4, 128K, 1K-token blocks, imbalance cap
  1.02, warm start ``best``): per sequence, per solver and formulation, the wall time until the
  solver proves a relative gap <= ``gap`` (1%), or the time limit; with the final gap, bound and
  whether the warm start was accepted and improved on. Goal: <= 60 s for >= 9 of 10 sequences.

* ILP at CP 8 (the Table 2 runs on WLB-LLM at N = 8: 64K, 96K and 128K, 5 sequences each,
  flashcp-table2's defaults): per sequence whether the ILP proved a 1% gap within the limit,
  the gap at the limit, the time to the proof, HiGHS's nodes and simplex iterations (a measure
  of the work that does not depend on the load) and the load average; per value of
  ``lns_max_size`` (2: the pair-only neighbourhood search, for comparison). Goal at 128K: a
  proven 1% gap within 60 s on >= 4 of 5 sequences.

* ILP solve time vs granularity (N = 4): one Pile 128K sequence (warm start ``flashcp``) and one
  8K sequence of 12 random documents (from scratch), over block sizes; model size (pieces,
  binaries), wall time, status, gap, comm saving.
* ILP solve time vs number of documents: 4K-token sequences cut into n random documents
  (Dirichlet lengths), from scratch, 256-token blocks.
* Heuristic time per sequence: ``flashcp`` and ``flashcp_refined`` on ``num_sequences`` Pile
  sequences at 128K with N = 4 and 8; per sequence the median of ``repeats`` runs, then the median
  and p90 over sequences.

Run: ``python -m experiments.benchmarks.bench_ilp`` (the time-to-gap sweep: up to ``sequences x
solvers x formulations x time_limit_s`` seconds); ``--sweeps cp8`` runs the CP 8 sweep alone (up
to ``3 x 5 x time_limit_s`` seconds per ``--lns-max-size`` value); ``--sweeps all`` adds the
others. Times are wall
clock with one solver thread; on a shared machine they depend on the load, so say so with them.
"""

from __future__ import annotations

import itertools
import os
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

__all__ = [
    "bench_heuristics",
    "bench_ilp_docs",
    "bench_ilp_granularity",
    "bench_time_to_gap",
    "bench_wlb_cp8",
    "main",
]


def _ilp_row(sweep: str, doc_lens: np.ndarray, cp_size: int, **opts) -> dict:
    from flashcp.planners.ilp import plan_ilp

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        plan = plan_ilp(doc_lens, cp_size, **opts)
    wall = time.perf_counter() - t0
    info = plan.info
    return {
        "sweep": sweep,
        "cp_size": cp_size,
        "context_len": plan.context_len,
        "num_docs": plan.num_docs,
        "block_size": info["block_size"],
        "num_grid_pieces": info["num_grid_pieces"],
        "num_binaries": info["num_binaries"],
        "time_limit_s": info["time_limit_s"],
        "build_s": info["build_time_s"],
        "solve_s": info["solve_time_s"],
        "solve_cpu_s": info.get("solve_cpu_s"),
        "total_cpu_s": info.get("total_cpu_s"),
        "wall_s": wall,
        "status": plan.status,
        "solver_status": info["solver_status"],
        "gap": info["gap"],
        "comm_saving": plan.comm_saving,
        "imbalance_ratio": plan.imbalance_ratio,
        "solver": info["solver"],
        "formulation": info["formulation"],
        "num_integers": info.get("num_integers"),
        "objective": info["objective"],
        "best_bound": info["best_bound"],
        "seed_objective": info["seed_objective"],
        "improved_on_seed": info["objective"] < (info["seed_objective"] or np.inf) - 1e-9,
        "warm_start_accepted": info["warm_start_accepted"],
        "warm_start_source": info.get("warm_start_source"),
        "lp_rounding": info.get("lp_rounding"),
        "lp_bound": info.get("lp_bound"),
        "lp_rounded_objective": info.get("lp_rounded_objective"),
        "saving_upper_bound": info.get("saving_upper_bound"),
        "lns": info.get("lns"),
        "lns_start_objective": info.get("lns_start_objective"),
        "lns_objective": info.get("lns_objective"),
        "lns_time_s": info.get("lns_time_s"),
        "lns_max_size": info.get("lns_max_size"),
        "mip_nodes": info.get("mip_nodes"),
        "lp_iterations": info.get("lp_iterations"),
    }


def _random_docs(rng: np.random.Generator, num_docs: int, context_len: int) -> np.ndarray:
    """``num_docs`` document lengths (Dirichlet shares, alpha 0.7) summing to ``context_len``."""
    share = rng.dirichlet(np.full(num_docs, 0.7))
    d = np.maximum(1, np.floor(share * context_len).astype(np.int64))
    d[np.argmax(d)] += context_len - int(d.sum())
    return d


def bench_ilp_granularity(
    block_sizes=(4096, 2048, 1024, 512),
    small_block_sizes=(1024, 512, 256, 128),
    time_limit_s: float = 20.0,
    seed: int = 0,
    solver: str = "cbc",
) -> list[dict]:
    """ILP at N = 4 for each block size (tokens): on one Pile 128K sequence (warm-started from
    ``flashcp``, imbalance cap 1.02), and on a small 8K sequence of 12 random documents (from
    scratch, no cap: objective imbalance + communication)."""
    from flashcp.data import load_distribution, sample_sequences

    d = sample_sequences(load_distribution("pile"), 1, 131072, seed=seed)[0]
    opts = dict(time_limit_s=time_limit_s, solver=solver, threads=1)
    rows = [
        _ilp_row(
            "granularity_128k", d, 4, block_size=b, warm_start="flashcp", max_imbalance=1.02, **opts
        )
        for b in block_sizes
    ]
    small = _random_docs(np.random.default_rng(seed), 12, 8192)
    rows += [
        _ilp_row("granularity_8k", small, 4, block_size=b, warm_start=None, **opts)
        for b in small_block_sizes
    ]
    return rows


def bench_ilp_docs(
    num_docs=(2, 4, 8, 16, 32),
    context_len: int = 4096,
    block_size: int = 256,
    time_limit_s: float = 20.0,
    seed: int = 0,
    solver: str = "cbc",
) -> list[dict]:
    """ILP, N = 4, from scratch and without an imbalance cap, on sequences of ``context_len``
    tokens cut into n random documents (about ``context_len / block_size + n`` pieces)."""
    rng = np.random.default_rng(seed)
    return [
        _ilp_row(
            "num_docs",
            _random_docs(rng, n, context_len),
            4,
            block_size=block_size,
            time_limit_s=time_limit_s,
            solver=solver,
            max_imbalance=None,
            warm_start=None,
            threads=1,
        )
        for n in num_docs
    ]


def bench_time_to_gap(
    num_sequences: int = 10,
    solvers=("highs", "cbc"),
    formulations=("patterns",),
    time_limit_s: float = 60.0,
    gap: float = 0.01,
    block_size: int = 1024,
    seed: int = 0,
    lp_rounding=(True,),
    heuristic_efforts=(1.0,),
) -> list[dict]:
    """Per sequence of the Table 2 setup (Pile, N = 4, 128K, cap 1.02, warm start ``best``): the
    ILP's wall time until its relative gap is proven <= ``gap`` (status ``ok``), or the limit;
    per value of ``lp_rounding`` (:func:`flashcp.planners.ilp.plan_ilp`: the LP-rounded MIP start) and,
    for HiGHS, of ``heuristic_efforts`` (its ``mip_heuristic_effort``; None: HiGHS's default 0.05).
    ``saving_gap`` is the honest distance on communication alone: the saving that the best bound
    proves for any plan on the grid (:func:`flashcp.planners.ilp.saving_bound`) minus the plan's saving."""
    from flashcp.data import load_distribution, sample_sequences

    seqs = sample_sequences(load_distribution("pile"), num_sequences, 131072, seed=seed)
    rows = []
    for i, d in enumerate(seqs):
        for formulation in formulations:
            for solver in solvers:
                efforts = heuristic_efforts if solver == "highs" else (None,)
                for rounding, effort in itertools.product(lp_rounding, efforts):
                    row = _ilp_row(
                        "time_to_gap", d, 4, block_size=block_size, time_limit_s=time_limit_s,
                        gap=gap, solver=solver, formulation=formulation, max_imbalance=1.02,
                        warm_start="best", threads=1, lp_rounding=rounding,
                        highs_options=None if effort is None else {"mip_heuristic_effort": effort},
                    )  # fmt: skip
                    row["seq"] = i
                    row["heuristic_effort"] = effort
                    row["proven"] = row["status"] == "ok"
                    bound = row["saving_upper_bound"]
                    row["saving_gap"] = None if bound is None else bound - row["comm_saving"]
                    rows.append(row)
                    print(
                        f"seq {i} {formulation:<8} {solver:<5} rounding={rounding!s:<5} "
                        f"effort={effort!s:<5} {row['status']:<10} wall {row['wall_s']:6.1f} s  "
                        f"cpu {row['total_cpu_s'] or 0:6.1f} s  gap {row['gap']}  "
                        f"saving {row['comm_saving']:.4f} <= {bound}",
                        flush=True,
                    )
    return rows


def _loadavg() -> float | None:
    """The 1-minute load average (None where the OS does not say)."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def bench_wlb_cp8(
    context_lens=(65536, 98304, 131072),
    num_sequences: int = 5,
    time_limit_s: float = 60.0,
    gap: float = 0.01,
    lns_max_sizes=(2, 4),
    seed: int = 0,
) -> list[dict]:
    """The ILP on the CP 8 Table 2 runs (WLB-LLM, N = 8, sampled as flashcp-table2 samples them),
    with flashcp-table2's ILP options (HiGHS, 1K blocks, cap 1.02, warm start ``best``, LP
    rounding and neighbourhood search, one thread). Per sequence and ``lns_max_size``: proven
    within ``gap`` (status ``ok``), the gap at the limit, the solve's time (the time to the proof
    when proven), nodes, simplex iterations and the load average before and after."""
    from experiments.table2 import DEFAULT_HIGHS_OPTIONS
    from flashcp.data import sample_dataset

    rows = []
    for context_len in context_lens:
        seqs, _ = sample_dataset("wlb_llm", num_sequences, context_len, seed=seed)
        for i, d in enumerate(seqs):
            for size in lns_max_sizes:
                load0 = _loadavg()
                row = _ilp_row(
                    "wlb_cp8", np.asarray(d), 8, block_size=1024, time_limit_s=time_limit_s,
                    gap=gap, solver="highs", max_imbalance=1.02, warm_start="best", threads=1,
                    highs_options=dict(DEFAULT_HIGHS_OPTIONS), lns_max_size=size,
                    heuristic_target_imbalance=1.02,
                )  # fmt: skip
                row.update(seq=i, lns_max_size_option=size, proven=row["status"] == "ok")
                row.update(loadavg_start=load0, loadavg_end=_loadavg())
                rows.append(row)
                print(
                    f"{context_len // 1024}K seq {i} lns_max_size={size} {row['status']:<10} "
                    f"gap {row['gap']} wall {row['wall_s']:5.1f} s cpu {row['total_cpu_s'] or 0:5.1f}"
                    f" s nodes {row['mip_nodes']} lp_iter {row['lp_iterations']} "
                    f"objective {row['objective']:.5f} bound {row['best_bound']} "
                    f"load {load0}->{row['loadavg_end']}",
                    flush=True,
                )
    return rows


def bench_heuristics(num_sequences: int = 20, repeats: int = 5, seed: int = 0) -> list[dict]:
    """Per-sequence planning time of ``flashcp`` and ``flashcp_refined`` at 128K, N = 4 and 8."""
    from flashcp.data import load_distribution, sample_sequences
    from flashcp.planners.flashcp import plan_flashcp
    from flashcp.planners.flashcp_refined import plan_flashcp_refined

    seqs = sample_sequences(load_distribution("pile"), num_sequences, 131072, seed=seed)
    planners = {"flashcp": plan_flashcp, "flashcp_refined": plan_flashcp_refined}
    rows = []
    for n in (4, 8):
        for name, fn in planners.items():
            per_seq, saving, ok = [], [], []
            for d in seqs:
                fn(d, n, target_imbalance=1.02)  # warm-up
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    plan = fn(d, n, target_imbalance=1.02)
                    times.append(time.perf_counter() - t0)
                per_seq.append(float(np.median(times)))
                saving.append(plan.comm_saving)
                ok.append(plan.status == "ok")
            rows.append(
                {
                    "sweep": "heuristic",
                    "method": name,
                    "cp_size": n,
                    "num_sequences": len(seqs),
                    "median_ms": 1000 * float(np.median(per_seq)),
                    "p90_ms": 1000 * float(np.percentile(per_seq, 90)),
                    "max_ms": 1000 * float(np.max(per_seq)),
                    "mean_comm_saving": float(np.mean(saving)),
                    "frac_ok": float(np.mean(ok)),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> pd.DataFrame:
    """Run the sweeps, write ``bench_ilp.csv`` into ``--out-dir`` and print the tables."""
    import argparse

    from flashcp.results import provenance, write_csv_atomic

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweeps", default="time_to_gap", help="time_to_gap | cp8 | all")
    ap.add_argument(
        "--contexts", default="65536,98304,131072", help="cp8 sweep: context lengths, tokens"
    )
    ap.add_argument(
        "--lns-max-size",
        default="2,4",
        help="cp8 sweep: plan_ilp's lns_max_size values, comma-separated (2: pairs only)",
    )
    ap.add_argument("--sequences", type=int, default=10)
    ap.add_argument("--solvers", default="highs,cbc")
    ap.add_argument("--formulations", default="patterns", help="patterns,pieces")
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per solve")
    ap.add_argument("--cpu-goal", type=float, default=60.0, help="CPU seconds, for the summary")
    ap.add_argument(
        "--lp-rounding", default="on", help="on | off | both: the LP-rounded MIP start (plan_ilp)"
    )
    ap.add_argument(
        "--heuristic-efforts",
        default="1.0",
        help="HiGHS mip_heuristic_effort values, comma-separated ('default': HiGHS's own 0.05)",
    )
    ap.add_argument("--out-dir", default="results/bench_ilp")
    args = ap.parse_args(argv)
    rows = (
        []
        if args.sweeps == "cp8"
        else bench_time_to_gap(
            args.sequences,
            tuple(args.solvers.split(",")),
            tuple(args.formulations.split(",")),
            time_limit_s=args.time_limit,
            lp_rounding={"on": (True,), "off": (False,), "both": (False, True)}[args.lp_rounding],
            heuristic_efforts=tuple(
                None if e == "default" else float(e) for e in args.heuristic_efforts.split(",")
            ),
        )
    )
    if args.sweeps in ("cp8", "all"):
        sizes = tuple(int(v) for v in args.lns_max_size.split(","))
        contexts = tuple(int(v) for v in args.contexts.split(","))
        rows += bench_wlb_cp8(contexts, time_limit_s=args.time_limit, lns_max_sizes=sizes)
    if args.sweeps == "all":
        rows += bench_heuristics()
        rows += bench_ilp_granularity(time_limit_s=args.time_limit)
        rows += bench_ilp_docs(time_limit_s=args.time_limit)
    df = pd.DataFrame(rows)
    for k, v in provenance().items():
        df[k] = v
    write_csv_atomic(df, Path(args.out_dir) / "bench_ilp.csv")
    cp8 = df[df["sweep"] == "wlb_cp8"] if "sweep" in df else df.iloc[:0]
    if len(cp8):
        print("\n== ILP at CP 8 (WLB-LLM, Table 2 setup): proven within 1% ==")
        for (ctx, size), g in cp8.groupby(["context_len", "lns_max_size_option"], sort=False):
            ok = g[g["proven"]]
            print(
                f"{ctx // 1024}K lns_max_size={size}: proven {len(ok)}/{len(g)} within "
                f"{args.time_limit:g} s; gaps {' '.join(f'{v:.4f}' for v in g['gap'])} "
                f"(mean {pd.to_numeric(g['gap'], errors='coerce').mean():.4f}); time to proof "
                f"{' '.join(f'{v:.1f}' for v in ok['wall_s'])} s; nodes "
                f"{' '.join(str(v) for v in g['mip_nodes'])}; load "
                f"{g['loadavg_start'].min()}-{g['loadavg_end'].max()}"
            )
    ttg = df[df["sweep"] == "time_to_gap"] if "sweep" in df else df.iloc[:0]
    if len(ttg):
        print("\n== time to a proven gap <= 1% (Table 2 setup) ==")
        keys = ["formulation", "solver", "lp_rounding", "heuristic_effort"]
        for (form, solver, rounding, effort), g in ttg.groupby(keys, sort=False, dropna=False):
            ok = g[g["proven"]]
            in_cpu = int((ok["total_cpu_s"] <= args.cpu_goal).sum())
            print(
                f"{form:<8} {solver:<5} lp_rounding={rounding!s:<5} effort={effort!s:<5}: "
                f"proven {len(ok)}/{len(g)} within {args.time_limit:g} s wall, "
                f"{in_cpu} within {args.cpu_goal:g} CPU-s; median wall / CPU of proven "
                f"{ok['wall_s'].median():.1f} / {ok['total_cpu_s'].median():.1f} s; "
                f"mean final gap {pd.to_numeric(g['gap'], errors='coerce').mean():.4f}; "
                f"mean saving {g['comm_saving'].mean():.4f} <= proven bound "
                f"{pd.to_numeric(g['saving_upper_bound'], errors='coerce').mean():.4f} "
                f"(mean saving gap {pd.to_numeric(g['saving_gap'], errors='coerce').mean():.4f}); "
                f"improved on seed {int(g['improved_on_seed'].sum())}; "
                f"warm start accepted {int((g['warm_start_accepted'] == True).sum())}"  # noqa: E712
            )
    for sweep, g in df.groupby("sweep", sort=False):
        print(f"\n== {sweep} ==")
        print(
            g.dropna(axis=1, how="all")
            .drop(columns=["sweep", *provenance()])
            .to_string(index=False, float_format=lambda v: f"{v:.4g}")
        )
    return df


if __name__ == "__main__":
    main()
