"""Traffic, memory and kernel calls per method: the paper's configuration against the project's ops.

    python -m experiments.paper_config                       # Pile, CP 8, 32 heads, 128K, training
    python -m experiments.paper_config --dataset wlb_llm --cp-size 4 --num-sequences 100

``experiment=fig5`` runs every method as the FlashCP paper ran it (``conf/method/*_paper.yaml``):
the all-gather methods (``llama3``, ``per_doc``, ``flashcp``) keep the forward's gathered KV for the
backward and reduce-scatter dK/dV in the model dtype (Eq. 4 / Eq. 5 traffic), ``ring`` and
``zigzag`` are ring-flash-attention's varlen functions (``method.impl=ring_flash_attn``: every
document in N / 2N chunks, padded). ``experiment=fig5_ours`` runs the project's own ops with their
defaults (the all-gather op gathers the KV again in the backward and reduces in float32; the ring
op runs each layout as planned). This command samples sequences as ``flashcp-run`` does and, per
method and configuration, prints the means over them of what one rank moves and holds and the
kernels it launches in one attention layer's training step (the largest rank):

* traffic: :func:`flashcp.comm.comm_volume` (bytes received, MiB);
* kept KV: the all-gather op's gathered KV held from the forward to the backward with
  ``keep_gathered_kv`` (``2 Hkv D (T + N M)`` elements, docs/memory.md), MiB per layer; 0 otherwise;
* pad: tokens ring-flash-attn's layouts add to make every document a multiple of N / 2N;
* kernel calls: varlen attention launches, forward + backward
  (:func:`flashcp.sim.work.work_account`; ring-flash-attn's llama3 is not in these columns).

Writes the Markdown table to stdout (docs/paper_config.md quotes it).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np

from flashcp.comm import AttnShape, comm_volume
from flashcp.config import method_option
from flashcp.data import sample_dataset
from flashcp.registry import COMM_KIND
from flashcp.sim.impl import impl_plan
from flashcp.sim.work import work_account

#: the paper's five methods: each one's paper configuration is conf/method/<method>_paper.yaml,
#: the project's conf/method/<method>.yaml
METHODS = ("llama3", "per_doc", "ring", "zigzag", "flashcp")
MIB = 2**20


def method_row(method, impl, planner_opts, op_opts, seqs, cp_size, shape) -> dict[str, float]:
    """Means over ``seqs`` of one method under one configuration (see the module docstring):
    ``impl``, its planner and op options as :func:`flashcp.config.method_option` gives them.

    Raises:
        ValueError: what :func:`impl_plan`, :func:`comm_volume` or :func:`work_account` raise.
    """
    kind = COMM_KIND[method]
    traffic, kept, pad, calls = [], [], [], []
    for d in seqs:
        opts = planner_opts if impl == "ours" else {}
        plan, pad_tokens = impl_plan(method, impl, d, cp_size, **opts)
        vol = comm_volume(plan, kind, shape, "train", impl=impl, **op_opts)
        traffic.append(vol["comm_bytes"] / MIB)
        rows = 0
        if op_opts.get("keep_gathered_kv"):
            local = plan.doc_tokens_per_rank.max()
            send = plan.send_tokens_per_rank.max() if kind == "allgather_sharded" else local
            rows = local + cp_size * send
        kept.append(2 * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes * rows / MIB)
        pad.append(pad_tokens)
        acc = work_account(plan, shape, "train", impl=impl)
        n = 0.0
        for phase in ("fwd", "bwd"):
            if (phase, "kernel_calls") in acc.rank_max:
                n += acc.rank_max[(phase, "kernel_calls")]
            else:
                n += acc.total(phase, "kernel_calls").max()
        calls.append(n)
    return {
        "traffic_mib": float(np.mean(traffic)),
        "kept_mib": float(np.mean(kept)),
        "pad_tokens": float(np.mean(pad)),
        "kernel_calls": float(np.mean(calls)),
    }


def table(dataset: str, cp_size: int, num_sequences: int, context_len: int, seed: int) -> str:
    """The Markdown table of every method of :data:`CONFIGS` (paper, then ours) on ``dataset``.

    Raises:
        ValueError: a bad dataset or argument (:func:`flashcp.data.sample_dataset`).
    """
    seqs = sample_dataset(dataset, num_sequences, context_len, seed=seed)[0]
    shape = AttnShape(num_heads=32, num_kv_heads=32, head_dim=128, dtype="bfloat16")
    out = [
        f"{dataset}, CP {cp_size}, 32 heads (MHA), head_dim 128, bf16, {context_len} tokens, "
        f"training, mean of {num_sequences} sequences (seed {seed}), largest rank, one layer:\n",
        "| method | paper: traffic MiB | kept KV MiB | pad tokens | kernel calls "
        "| ours: traffic MiB | kept KV MiB | kernel calls |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method in METHODS:
        rows = []
        for option in (f"{method}_paper", method):
            m = method_option(option)
            rows.append(method_row(m.method, m.impl, m.planner_options, m.op_options, seqs,
                                   cp_size, shape))  # fmt: skip
        p, o = rows
        out.append(
            f"| {method} | {p['traffic_mib']:.0f} | {p['kept_mib']:.0f} | {p['pad_tokens']:.0f} "
            f"| {p['kernel_calls']:.1f} | {o['traffic_mib']:.0f} | {o['kept_mib']:.0f} "
            f"| {o['kernel_calls']:.1f} |"
        )
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.paper_config",
        description="Traffic, kept KV and kernel calls per method: the paper's configuration "
        "(experiment=fig5) against the project's ops (experiment=fig5_ours).",
    )
    ap.add_argument("--dataset", default="pile", help="a named dataset (flashcp-run's)")
    ap.add_argument("--cp-size", type=int, default=8, help="N")
    ap.add_argument("--num-sequences", type=int, default=50, help="sequences sampled")
    ap.add_argument("--context-len", type=int, default=131072, help="C, tokens per sequence")
    ap.add_argument("--seed", type=int, default=0, help="the sampler's seed (flashcp-run's)")
    args = ap.parse_args(argv)
    try:
        print(
            table(args.dataset, args.cp_size, args.num_sequences, args.context_len, args.seed),
            end="",
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
