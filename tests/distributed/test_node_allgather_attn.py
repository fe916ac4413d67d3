"""``flashcp_node``'s two-scope all-gather (:mod:`flashcp.ops.node_allgather_attn`) on gloo ranks
vs the float64 reference, over 2 and 4 "nodes" of a CP group of 4 or 8, both placements.

Forked gloo ranks (``tests/mp_utils.py``); float64 with the reference backend to 1e-12; counted
bytes equal :func:`flashcp.comm.node_scoped_comm_volume` (and, summed over link classes,
:func:`flashcp.comm.node_scoped_volume_by_link`); one node runs FlashCP's
one-scope op, whose bytes are :func:`flashcp.comm.comm_volume`'s.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mp_utils import run_ranks
from test_ulysses_attn import _reference

from flashcp.comm import (
    AttnShape,
    comm_volume,
    node_scoped_volume_by_link,
    uses_node_scope,
)
from flashcp.comm import node_scoped_comm_volume as node_comm_volume
from flashcp.ops import get_attn_op
from flashcp.ops.collectives import CommCounter
from flashcp.ops.node_allgather_attn import NodeGatherMeta
from flashcp.ops.sharding import shard_tensor, unshard
from flashcp.registry import make_plan_for

F64 = torch.float64


def _cases(n: int) -> list[tuple]:
    """(name, doc_lens, num_pad, H, Hkv, D, nodes, placement) at CP size ``n``."""
    c = 32 * n
    rng = np.random.default_rng(n)
    cuts = np.sort(rng.choice(np.arange(1, c), size=7, replace=False))
    mix = np.diff(np.concatenate([[0], cuts, [c]])).tolist()
    long = [c // 2 + 3, 2, c // 4 - 5, c // 4]
    out = []
    for nodes in (1, 2, n // 2) if n == 8 else (1, 2):
        for placement in ("consecutive", "strided"):
            out += [
                (f"mix-{nodes}-{placement}", mix, 0, 4, 2, 8, nodes, placement),
                (f"long-{nodes}-{placement}", long, 0, 2, 1, 8, nodes, placement),
            ]
    out.append(("pad-2-strided", [0, 9, 0, c - 9 - 7, 0], 7, 4, 2, 8, 2, "strided"))
    return out


def _inputs(c, h, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(c, x, d, generator=g, dtype=F64) for x in (h, hkv, hkv, h)]


def _run(rank, n, cases):
    prepare, attn = get_attn_op("flashcp_node")
    results = []
    for i, (_, lens, pad, h, hkv, d, nodes, placement) in enumerate(cases):
        plan = make_plan_for("flashcp_node", lens, n, num_pad=pad, num_nodes=nodes,
                             placement=placement)  # fmt: skip
        q, k, v, dout = _inputs(plan.context_len, h, hkv, d, seed=i)
        ql, kl, vl = (shard_tensor(x, plan, rank).requires_grad_() for x in (q, k, v))
        counter = CommCounter()
        meta = prepare(plan, rank)
        out = attn(ql, kl, vl, meta, counter=counter, backend="reference",
                   heads_per_group=1 if i % 2 else None)  # fmt: skip
        fwd = counter.as_dict()
        out.backward(shard_tensor(dout, plan, rank))
        results.append((out.detach(), ql.grad, kl.grad, vl.grad, fwd, counter.as_dict(),
                        isinstance(meta, NodeGatherMeta)))  # fmt: skip
    return results


@pytest.mark.slow
@pytest.mark.parametrize("n", [4, 8])
def test_two_scope_gather_is_exact_and_counted(n):
    cases = _cases(n)
    per_rank = run_ranks(_run, n, cases, timeout_s=240)
    for i, (name, lens, pad, h, hkv, d, nodes, placement) in enumerate(cases):
        plan = make_plan_for("flashcp_node", lens, n, num_pad=pad, num_nodes=nodes,
                             placement=placement)  # fmt: skip
        q, k, v, dout = _inputs(plan.context_len, h, hkv, d, seed=i)
        expect = _reference(q, k, v, lens, dout, pad)
        got = [unshard([per_rank[r][i][j] for r in range(n)], plan) for j in range(4)]
        for j, want in enumerate(expect):
            assert torch.allclose(got[j], want, atol=1e-12, rtol=0), (name, j)
        shape = AttnShape(h, hkv, d, "float64")
        fwd = node_comm_volume(plan, shape, "infer")
        train = node_comm_volume(plan, shape, "train")
        keys = ("allgather_bytes", "reducescatter_bytes", "comm_bytes")
        assert max(per_rank[r][i][4]["comm_bytes"] for r in range(n)) == fwd["comm_bytes"], name
        assert max(per_rank[r][i][5]["comm_bytes"] for r in range(n)) == train["comm_bytes"], name
        for r in range(n):
            assert per_rank[r][i][6] == uses_node_scope(plan), name
            for key in keys:  # every rank issues the same collectives
                assert per_rank[r][i][5][key] == train[key], (name, r, key)
        if not uses_node_scope(plan):
            assert {k_: train[k_] for k_ in keys} == {
                k_: comm_volume(plan, "allgather_sharded", shape, "train")[k_] for k_ in keys
            }, name
        else:
            assert train["node_scope_bytes"] + train["group_scope_bytes"] == train["comm_bytes"]
        links = node_scoped_volume_by_link(plan, shape, "train")
        for kind in ("allgather", "reducescatter"):
            both = links["intra"][kind] + links["inter"][kind]
            assert (both == train[f"{kind}_bytes"]).all(), (name, kind)
        if nodes > 1 and train["group_scope_bytes"]:
            assert links["inter"]["allgather"].any(), name
