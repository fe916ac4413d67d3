"""Benchmark: ``flashcp_refined`` against ``flashcp`` (Algorithm 1) and the ILP, per context length.

    python experiments/benchmarks/bench_refined.py                        # 3 datasets x CP 4/8 x 32K-128K
    python experiments/benchmarks/bench_refined.py --sequences 20 --ilp-seconds 20 --ilp-sequences 2

Prints one row per dataset x CP x context: the mean communication saving (1 - Eq. 5 / Eq. 4) and
mean imbalance ratio of ``flashcp`` and ``flashcp_refined`` at the same target R on the same
sampled sequences (the samplers and seeds of ``experiments/table2.py``), how many sequences
``flashcp_refined`` saves less than ``flashcp`` at an equal or lower imbalance (``worse``), how
many miss R (``miss``), and the median planning time per sequence of both with their ratio
(measured in the same process, median of 3 runs per sequence; on a shared machine say so).

ILP columns, two sources:

* committed Table 2 runs (``--ilp-rows``, default every ``results/table2*/table2_rows.csv``):
  where one holds the same dataset, CP, context, R and seed, its ILP rows for the first sequences
  are printed beside the heuristics on those sequences (``ilp`` saving/imbalance, ``opt``: how many
  of them the solver proved optimal at its granularity, and the mean gap to the ILP plan on the
  proven ones);
* ``--ilp-seconds S --ilp-sequences K``: a short HiGHS solve (1K-token blocks, cap R, warm start
  from the best heuristic) of the first K sequences of every other setting, one solve at a time.
  These are *short* solves: a ``time_limit`` status means the ILP plan is only a good plan, not an
  optimum.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import time
from pathlib import Path

import numpy as np
import pandas as pd

from flashcp.data import load_distribution, sample_sequences
from flashcp.planners.flashcp import plan_flashcp
from flashcp.planners.flashcp_refined import plan_flashcp_refined
from flashcp.registry import get_planner

DATASETS = ("wlb_llm", "pile", "redpajama")
REPO = Path(__file__).resolve().parents[2]


def _timed(fn, d) -> tuple[object, float]:
    """The plan of ``fn(d)`` and the median of 3 wall times, milliseconds."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        plan = fn(d)
        times.append(time.perf_counter() - t0)
    return plan, 1e3 * float(np.median(times))


def load_ilp_rows(patterns: list[str]) -> pd.DataFrame:
    """The ILP rows of committed Table 2 runs (``table2_rows.csv`` files matching ``patterns``)."""
    files = sorted({f for p in patterns for f in glob.glob(p)})
    frames = [pd.read_csv(f) for f in files]
    if not frames:
        return pd.DataFrame()
    rows = pd.concat(frames, ignore_index=True)
    return rows[rows["method"] == "ilp"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=10, help="sequences per setting")
    ap.add_argument("--datasets", default=",".join(DATASETS))
    ap.add_argument("--cp-sizes", default="4,8")
    ap.add_argument("--contexts", default="32768,65536,98304,131072", help="C, tokens")
    ap.add_argument("--target-imbalance", type=float, default=1.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--ilp-rows",
        default=str(REPO / "results" / "table2*" / "table2_rows.csv"),
        help="glob(s) of committed Table 2 rows, comma-separated",
    )
    ap.add_argument("--ilp-seconds", type=float, default=0.0, help="short ILP solves: limit, s")
    ap.add_argument("--ilp-sequences", type=int, default=0, help="short ILP solves per setting")
    args = ap.parse_args()
    r_cap = args.target_imbalance
    ilp_rows = load_ilp_rows(args.ilp_rows.split(","))
    print(
        f"target imbalance {r_cap}, {args.sequences} sequences per setting (seed {args.seed}); "
        f"saving / imbalance are means; times: median ms per sequence (median of 3 runs)"
    )
    head = (
        f"{'dataset':<10} {'cp':>2} {'ctx':>5} | {'flashcp':>13} | {'refined':>13} | "
        f"{'worse':>5} {'miss':>4} | {'ms fcp':>7} {'ms ref':>7} {'x':>5} | ilp (n, opt, src)"
    )
    print(head)
    print("-" * len(head))
    settings = itertools.product(
        args.datasets.split(","),
        [int(x) for x in args.cp_sizes.split(",")],
        [int(x) for x in args.contexts.split(",")],
    )
    for ds, cp, ctx in settings:
        seqs = sample_sequences(
            load_distribution(ds, context_len=ctx), args.sequences, ctx, seed=args.seed
        )
        fc, rf, t_fc, t_rf = [], [], [], []
        for d in seqs:
            p, t = _timed(lambda d, n=cp: plan_flashcp(d, n, target_imbalance=r_cap), d)
            q, u = _timed(lambda d, n=cp: plan_flashcp_refined(d, n, target_imbalance=r_cap), d)
            fc.append((p.comm_saving, p.imbalance_ratio))
            rf.append((q.comm_saving, q.imbalance_ratio))
            t_fc.append(t)
            t_rf.append(u)
        fc_a, rf_a = np.array(fc), np.array(rf)
        worse = int(((rf_a[:, 0] < fc_a[:, 0] - 1e-12) & (rf_a[:, 1] <= fc_a[:, 1] + 1e-12)).sum())
        miss = int((rf_a[:, 1] > r_cap).sum())
        ilp = _ilp_summary(ilp_rows, ds, cp, ctx, r_cap, args.seed, rf_a, seqs, args)
        print(
            f"{ds:<10} {cp:>2} {ctx // 1024:>4}K | {fc_a[:, 0].mean():.3f} / {fc_a[:, 1].mean():.3f}"
            f" | {rf_a[:, 0].mean():.3f} / {rf_a[:, 1].mean():.3f} | {worse:>5} {miss:>4} | "
            f"{np.median(t_fc):>7.2f} {np.median(t_rf):>7.2f} "
            f"{np.median(np.array(t_rf) / np.array(t_fc)):>5.1f} | {ilp}",
            flush=True,
        )


def _ilp_summary(
    ilp_rows: pd.DataFrame,
    ds: str,
    cp: int,
    ctx: int,
    r_cap: float,
    seed: int,
    refined: np.ndarray,
    seqs: list[np.ndarray],
    args: argparse.Namespace,
) -> str:
    """The ILP column of one setting: committed rows if any, else short solves if asked."""
    src, ilp = "", []
    if not ilp_rows.empty:
        sel = ilp_rows[
            (ilp_rows["dataset"] == ds)
            & (ilp_rows["cp_size"] == cp)
            & (ilp_rows["context_len"] == ctx)
            & np.isclose(ilp_rows["target_imbalance"], r_cap)
            & (ilp_rows["seed"] == seed)
            & (ilp_rows["seq"] < len(seqs))
        ]
        for _, row in sel.sort_values("seq").iterrows():
            if int(row["num_docs"]) != len(seqs[int(row["seq"])]):
                continue  # not the same sequence
            ilp.append(
                (
                    int(row["seq"]),
                    row["comm_saving"],
                    row["imbalance_ratio"],
                    row["solver_status"] == "optimal",
                )
            )
        src = "committed"
    if not ilp and args.ilp_sequences and args.ilp_seconds > 0:
        planner = get_planner("ilp")
        for i, d in enumerate(seqs[: args.ilp_sequences]):
            plan = planner(
                d,
                cp,
                solver="highs",
                time_limit_s=args.ilp_seconds,
                max_imbalance=r_cap,
                heuristic_target_imbalance=r_cap,
                threads=1,
            )
            ilp.append(
                (
                    i,
                    plan.comm_saving,
                    plan.imbalance_ratio,
                    plan.info.get("solver_status") == "optimal",
                )
            )
        src = f"short {args.ilp_seconds:g} s solves"
    if not ilp:
        return "-"
    idx = [x[0] for x in ilp]
    sav = np.array([x[1] for x in ilp], dtype=float)
    imb = np.array([x[2] for x in ilp], dtype=float)
    opt = np.array([x[3] for x in ilp])
    ref = refined[idx, 0]
    gap = f", refined - ilp on proven: {np.mean(ref[opt] - sav[opt]):+.3f}" if opt.any() else ""
    return (
        f"{sav.mean():.3f} / {imb.mean():.3f} on {len(ilp)} (refined on them "
        f"{ref.mean():.3f}), optimal {int(opt.sum())}{gap}; {src}"
    )


if __name__ == "__main__":
    main()
