"""Benchmark of the exact and heuristic FlashCP planners (issue 4, "Performance").

Three sweeps, each a list of result rows (written to CSV, then printed as a table):

* ILP solve time vs granularity: one Pile sequence (C = 128K, N = 4), ``block_size`` in
  ``block_sizes``; model size (pieces, binaries), wall time, status, gap, comm saving.
* ILP solve time vs number of documents: sequences of C = ``docs_context_len`` tokens cut into
  ``n`` random documents (Dirichlet lengths) for ``n`` in ``num_docs``.
* Heuristic time per sequence: ``flashcp`` and ``flashcp_refined`` on ``num_sequences`` Pile
  sequences at 128K with N = 4 and 8; per sequence the median of ``repeats`` runs, then the median
  and p90 over sequences.

Run: ``python -m experiments.bench_ilp`` (about ``(len(block_sizes) + len(num_docs)) *
time_limit_s`` seconds plus a few for the heuristics).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

__all__ = ["bench_heuristics", "bench_ilp_docs", "bench_ilp_granularity", "main"]


def _ilp_row(sweep: str, doc_lens: np.ndarray, cp_size: int, **opts) -> dict:
    from flashcp.ilp import plan_ilp

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
        "num_pieces": info["num_pieces"],
        "num_binaries": info["num_binaries"],
        "time_limit_s": info["time_limit_s"],
        "build_s": info["build_time_s"],
        "solve_s": info["solve_time_s"],
        "wall_s": wall,
        "status": plan.status,
        "solver_status": info["solver_status"],
        "gap": info["gap"],
        "comm_saving": plan.comm_saving,
        "imbalance_ratio": plan.imbalance_ratio,
    }


def bench_ilp_granularity(
    block_sizes=(4096, 2048, 1024, 512),
    time_limit_s: float = 20.0,
    seed: int = 0,
    solver: str = "cbc",
) -> list[dict]:
    """ILP on one Pile 128K sequence, N = 4, for each block size (tokens)."""
    from flashcp.data import load_distribution, sample_sequences

    d = sample_sequences(load_distribution("pile"), 1, 131072, seed=seed)[0]
    return [
        _ilp_row(
            "granularity",
            d,
            4,
            block_size=b,
            time_limit_s=time_limit_s,
            solver=solver,
            max_imbalance=1.02,
            warm_start="flashcp",
            threads=1,
        )
        for b in block_sizes
    ]


def bench_ilp_docs(
    num_docs=(4, 8, 16, 32, 64),
    context_len: int = 32768,
    block_size: int = 512,
    time_limit_s: float = 20.0,
    seed: int = 0,
    solver: str = "cbc",
) -> list[dict]:
    """ILP, N = 4, on sequences of ``context_len`` tokens cut into n random documents."""
    rng = np.random.default_rng(seed)
    rows = []
    for n in num_docs:
        share = rng.dirichlet(np.full(n, 0.7))
        d = np.maximum(1, np.floor(share * context_len).astype(np.int64))
        d[np.argmax(d)] += context_len - int(d.sum())
        rows.append(
            _ilp_row(
                "num_docs",
                d,
                4,
                block_size=block_size,
                time_limit_s=time_limit_s,
                solver=solver,
                max_imbalance=1.02,
                warm_start="flashcp",
                threads=1,
            )
        )
    return rows


def bench_heuristics(num_sequences: int = 20, repeats: int = 5, seed: int = 0) -> list[dict]:
    """Per-sequence planning time of ``flashcp`` and ``flashcp_refined`` at 128K, N = 4 and 8."""
    from flashcp.data import load_distribution, sample_sequences
    from flashcp.heuristic import plan_flashcp
    from flashcp.refined import plan_flashcp_refined

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


def main(out_dir: str = "results/bench_ilp", time_limit_s: float = 20.0) -> pd.DataFrame:
    """Run the three sweeps, write ``bench_ilp.csv`` into ``out_dir`` and print the tables."""
    from flashcp.results import provenance, write_csv_atomic

    rows = bench_heuristics()
    rows += bench_ilp_granularity(time_limit_s=time_limit_s)
    rows += bench_ilp_docs(time_limit_s=time_limit_s)
    df = pd.DataFrame(rows)
    for k, v in provenance().items():
        df[k] = v
    write_csv_atomic(df, Path(out_dir) / "bench_ilp.csv")
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
