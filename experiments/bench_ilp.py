"""Benchmark of the exact and heuristic FlashCP planners (issue 4, "Performance").

Three sweeps, each a list of result rows (written to CSV, then printed as a table):

* ILP solve time vs granularity (N = 4): one Pile 128K sequence (warm start ``flashcp``) and one
  8K sequence of 12 random documents (from scratch), over block sizes; model size (pieces,
  binaries), wall time, status, gap, comm saving.
* ILP solve time vs number of documents: 4K-token sequences cut into n random documents
  (Dirichlet lengths), from scratch, 256-token blocks.
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
