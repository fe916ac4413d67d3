"""Benchmark: what a training step adds before its first layer, per rank: planning the packed
batch and cutting it into a rank's share (tokens, labels, positions, the op's metadata).

    python experiments/benchmarks/bench_training.py                       # 128K Pile, CP 8
    python experiments/benchmarks/bench_training.py --dataset stress --context-len 32768 --cp-size 4

For each method and sampled sequence (seeded): ``plan`` is the planner's time (once per CP group,
on its rank 0: :func:`flashcp.training.plan_and_shard`), ``shard`` the time of
:func:`flashcp.training.shard_batch` for one rank (median over the ranks), split into ``labels``
(the rank's next-token labels, shifted on its own rows only), ``meta`` (the op's ``prepare``) and
the index gathers of tokens, labels and positions (``gather``). Milliseconds, median over
``--repeats`` runs and the sequences; no process group (the broadcast of the plan is not timed).
CPU wall clock on the machine it runs on (a shared machine inflates it: say so); ``--clock thread``
times the calling thread's CPU time instead, which other jobs on the machine inflate far less
(one intra-op thread: all of the work is on it). ``--compiled 1``
(default) plans with the numba kernels from the first call (:mod:`flashcp.compiled`), as a
training job does once it has planned a few hundred batches.
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial

import numpy as np
import torch

from flashcp.data import load_distribution, sample_sequences
from flashcp.ops import get_attn_op
from flashcp.ops.sharding import position_ids, shard_tensor
from flashcp.registry import make_plan_for
from flashcp.training import IGNORE_INDEX, shard_batch, shift_labels
from flashcp.training.batch import _rank_labels

METHODS = ("llama3", "zigzag", "flashcp", "flashcp_refined", "ulysses", "usp", "flashcp_ulysses")


#: the clock of :func:`_ms` (``--clock``): wall time, or the calling thread's CPU time
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
_CLOCK = {"now": time.perf_counter}


def _ms(fn, repeats: int) -> tuple[object, float]:
    """``fn()``'s value and the median of ``repeats`` times (``--clock``), milliseconds."""
    times, value, now = [], None, _CLOCK["now"]
    for _ in range(repeats):
        t0 = now()
        value = fn()
        times.append(now() - t0)
    return value, 1e3 * float(np.median(times))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="pile")
    ap.add_argument("--context-len", type=int, default=131072)
    ap.add_argument("--cp-size", type=int, default=8)
    ap.add_argument("--sequences", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument(
        "--compiled",
        choices=("0", "1"),
        default="1",
        help="FLASHCP_COMPILED: 1 = the planners' numba kernels from the first call (a training "
        "job's steady state), 0 = the NumPy references",
    )
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: wall clock; thread: the calling thread's CPU time (less inflated by other jobs)",
    )
    args = ap.parse_args(argv)
    _CLOCK["now"] = CLOCKS[args.clock]
    os.environ["FLASHCP_COMPILED"] = args.compiled
    torch.set_num_threads(1)
    c, n = args.context_len, args.cp_size
    seqs = sample_sequences(
        load_distribution(args.dataset, context_len=c), args.sequences, c, seed=0
    )
    print(
        f"{args.dataset}, C = {c}, CP {n}, {args.sequences} sequences, median of {args.repeats} runs (ms), "
        f"FLASHCP_COMPILED={args.compiled}, {args.clock} clock"
    )
    print(
        f"{'method':16s} {'docs':>5s} {'plan':>8s} {'shard':>8s} {'labels':>8s} {'meta':>8s} {'gather':>8s}"
    )
    for m in args.methods:
        rows = [
            _one(m, [int(x) for x in lens], si, n, args.repeats) for si, lens in enumerate(seqs)
        ]
        cols = " ".join(f"{float(np.median([r[k] for r in rows])):8.2f}" for k in rows[0])
        print(f"{m:16s} {int(np.median([len(x) for x in seqs])):5d} {cols}", flush=True)


def _one(method: str, lens: list[int], seed: int, n: int, repeats: int) -> dict[str, float]:
    """Times of one sequence (ms): plan, then per rank (median over ranks) shard and its parts."""
    prepare = get_attn_op(method)[0]
    ids = torch.randint(0, 32000, (sum(lens),), generator=torch.Generator().manual_seed(seed))
    plan, t_plan = _ms(partial(make_plan_for, method, lens, n), repeats)
    labels = shift_labels(ids, lens)  # the whole batch's, for the gathers (untimed)
    per_rank = {"shard": [], "labels": [], "meta": [], "gather": []}
    for r in range(n):
        per_rank["shard"].append(_ms(partial(shard_batch, ids, lens, plan, r), repeats)[1])
        labels_r = partial(_rank_labels, ids, plan, r, IGNORE_INDEX)
        per_rank["labels"].append(_ms(labels_r, repeats)[1])
        per_rank["meta"].append(_ms(partial(prepare, plan, r), repeats)[1])
        per_rank["gather"].append(_ms(partial(_gather, ids, labels, plan, r), repeats)[1])
    out = {"plan": t_plan}
    out |= {k: float(np.median(per_rank[k])) for k in ("shard", "labels", "meta", "gather")}
    return out


def _gather(ids, labels, plan, r):
    return [shard_tensor(ids, plan, r), shard_tensor(labels, plan, r), position_ids(plan, r)]


if __name__ == "__main__":
    main()
