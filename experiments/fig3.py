"""Kernel efficiency by layout (the paper's Fig. 3), simulated: ``flashcp-run experiment=fig3``.

Two packed sequences of ``context_len`` tokens — one document filling it, and 16 equal documents —
laid out three ways over ``cp_size`` ranks:

* ``whole``: documents kept whole. One 128K document is then one segment on one device (the
  ceiling: the best a kernel can do with this work); 16 documents go two per rank (CP 8).
* ``per_doc``: every document in 2N chunks (``baselines.per_doc``); each rank runs one varlen call
  over its chunks (q_len = s, kv_len = p + s).
* ``zigzag``: the same layout run as a ring: at step t rank r attends its chunks to the KV block of
  rank r - t; each non-empty step is one causal or non-causal varlen call on short blocks.

Efficiency is useful FLOPs / kernel time summed over all ranks and calls, in TFLOP/s, with FLOPs =
4 · head_dim · num_heads · (query-key pairs) (FlashAttention convention, DESIGN.md §8; pairs from
Eq. 3 for causal segments, s_q · s_k for non-causal ones); backward = 2.5 x forward FLOPs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from flashcp.comm import AttnShape
from flashcp.plan import Plan, shard_workload
from flashcp.registry import make_plan_for
from flashcp.results import provenance, write_csv_atomic


def _segments_whole(plan_lens: np.ndarray, cp_size: int) -> list[list[tuple[np.ndarray, np.ndarray, bool]]]:
    """Kernel calls of the whole-document layout: per device, one causal call over its documents."""
    if plan_lens.size == 1:  # one document: the whole sequence on one device
        return [[(plan_lens, plan_lens, True)]]
    groups = np.array_split(plan_lens, cp_size)
    return [[(g, g, True)] for g in groups if g.size]


def _segments_varlen(plan: Plan) -> list[list[tuple[np.ndarray, np.ndarray, bool]]]:
    """Kernel calls of an all-gather layout: per rank, one causal call (q = s, kv = p + s)."""
    calls = []
    for r in range(plan.cp_size):
        _, start, length = plan.rank_shards(r)
        calls.append([(length, start + length, True)])
    return calls


def _segments_ring(plan: Plan) -> list[list[tuple[np.ndarray, np.ndarray, bool]]]:
    """Kernel calls of a ring over the plan's layout: per rank and step, the causal pairs (a shard
    with itself) and the non-causal pairs (a shard with an earlier shard of its document)."""
    n = plan.cp_size
    shards = [plan.rank_shards(r) for r in range(n)]
    calls: list[list[tuple[np.ndarray, np.ndarray, bool]]] = []
    for r in range(n):
        qd, qs, ql = shards[r]
        rank_calls = []
        for t in range(n):
            kd, ks, kl = shards[(r - t) % n]
            same = (qd[:, None] == kd[None, :]) & (ks[None, :] + kl[None, :] <= qs[:, None])
            qi, ki = np.nonzero(same)
            if qi.size:
                rank_calls.append((ql[qi], kl[ki], False))
            if t == 0:
                rank_calls.append((ql, ql, True))
        calls.append(rank_calls)
    return calls


def _pairs(q: np.ndarray, k: np.ndarray, causal: bool) -> float:
    """Query-key pairs of segments (q_len, kv_len): Eq. 3 with prefix kv_len - q_len when causal
    (bottom-right aligned), q_len * kv_len otherwise."""
    if causal:
        return float(shard_workload(k - q, q).sum())
    return float((q * k).sum())


def run_fig3(cfg: DictConfig) -> Path:
    """Write ``fig3.csv`` (case, layout, pass, tflops, kernel_ms, flops) and ``fig3.png``."""
    from experiments.plot import draw
    from flashcp.sim import attention_kernel_ms, load_hardware

    hw = load_hardware(OmegaConf.to_container(cfg.hardware, resolve=True))
    m = cfg.model
    shape = AttnShape(int(m.num_heads), int(m.num_kv_heads), int(m.head_dim), str(m.dtype))
    c, n = int(cfg.context_len), int(cfg.cp_size)
    if c % 16:
        raise ValueError(f"context_len = {c} must divide by 16 for the 16-document case")
    cases = {f"1x{c // 1024}K": np.array([c]), f"16x{c // 16 // 1024}K": np.full(16, c // 16)}
    rows = []
    for case, lens in cases.items():
        layouts = {
            "whole": _segments_whole(lens, n),
            "per_doc": _segments_varlen(make_plan_for("per_doc", lens, n)),
            "zigzag": _segments_ring(make_plan_for("zigzag", lens, n)),
        }
        for layout, calls in layouts.items():
            for backward, pass_name in ((False, "forward"), (True, "backward")):
                flops = ms = 0.0
                for rank_calls in calls:
                    for q, k, causal in rank_calls:
                        pairs = _pairs(np.asarray(q), np.asarray(k), causal)
                        flops += 4.0 * shape.head_dim * shape.num_heads * pairs * (2.5 if backward else 1.0)
                        ms += attention_kernel_ms(q, k, causal, shape, hw, backward=backward)
                rows.append({
                    "case": case, "layout": layout, "pass": pass_name, "cp_size": n,
                    "num_calls": sum(len(rc) for rc in calls), "flops": flops, "kernel_ms": ms,
                    "tflops": flops / (ms * 1e-3) / 1e12, "hardware": hw.name,
                    "num_heads": shape.num_heads, "head_dim": shape.head_dim, "executor": "sim",
                })  # fmt: skip
    df = pd.DataFrame(rows)
    for k, v in provenance().items():
        df[k] = v
    out_dir = Path(cfg.results_dir) / cfg.name
    write_csv_atomic(df, out_dir / "fig3.csv")
    draw("fig3", out_dir)
    return out_dir / "fig3.csv"
