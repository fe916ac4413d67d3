"""Hybrid head-parallel CP (``usp``: Ulysses x zigzag ring; ``flashcp_ulysses``: Ulysses x
FlashCP's sharding-aware all-gather) on gloo ranks vs the float64 reference.

One launch of forked gloo ranks per CP size runs every (case, method, degree)
(``tests/mp_utils.py``, a timeout on every collective); float64 with the float64 reference backend
to 1e-12, bfloat16 within 2x a plain single-device bfloat16 computation; counted bytes equal
:func:`flashcp.comm.comm_volume`; bad degrees fail on one line before any collective.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mp_utils import run_ranks
from test_ulysses_attn import _inputs, _maxerr, _plain, _reference

from flashcp.comm import AttnShape, comm_volume
from flashcp.ops import get_attn_op
from flashcp.ops.collectives import CommCounter
from flashcp.ops.hybrid_attn import hybrid_groups
from flashcp.ops.sharding import shard_tensor, unshard
from flashcp.registry import COMM_KIND, make_plan_for

F64, BF16 = torch.float64, torch.bfloat16
DTYPE_NAME = {F64: "float64", BF16: "bfloat16"}
METHODS = ("usp", "flashcp_ulysses")


def _cases(n: int) -> list[tuple]:
    """(name, doc_lens, num_pad, H, Hkv, D, dtype, degree) at CP size ``n``: at CP 4 every degree
    (1, 2, 4: the plain ends and one hybrid); at CP 8 the two hybrid degrees (u = 2: a ring of 4
    groups, 3 steps; u = 4: 2 groups), KV heads replicated in float64 and in bfloat16."""
    c = 16 * n
    rng = np.random.default_rng(n)
    cuts = np.sort(rng.choice(np.arange(1, c), size=5, replace=False))
    mix = np.diff(np.concatenate([[0], cuts, [c]])).tolist()
    long = [c // 2 + 3, 2, c // 2 - 5]
    if n == 8:
        return [
            ("mix-u2", mix, 0, 4, 4, 8, F64, 2),
            ("mix-u4", mix, 0, 4, 4, 8, F64, 4),
            ("zero-length-and-pad-u2", [0, 9, 0, c - 9 - 7, 0], 7, 4, 2, 8, F64, 2),
            ("gqa-replicated-u4", long, 0, 4, 1, 8, F64, 4),
            ("bf16-gqa-replicated-u2", mix, 0, 4, 1, 16, BF16, 2),
            ("bf16-gqa-replicated-u4", long, 0, 8, 2, 16, BF16, 4),
        ]
    cases = []
    for u in sorted({1, 2, n}):
        cases += [
            (f"mix-u{u}", mix, 0, 4, 4, 8, F64, u),
            (f"gqa-replicated-u{u}", long, 0, 4, 1, 8, F64, u),
            (f"zero-length-and-pad-u{u}", [0, 7, 0, c - 7 - 5, 0], 5, 4, 2, 8, F64, u),
        ]
    cases.append(("bf16-gqa-u2", mix, 0, 4, 2, 16, BF16, 2))
    return cases


def _run_cases(rank, n, cases):
    results = []
    made = {}
    for i, (_, doc_lens, pad, h, hkv, d, dtype, u) in enumerate(cases):
        if u not in made:  # the 2-D groups, once per degree (a collective of every rank)
            made[u] = hybrid_groups(u)
        for method in METHODS:
            plan = make_plan_for(method, doc_lens, n, num_pad=pad, ulysses_degree=u)
            q, k, v, dout = _inputs(plan.context_len, h, hkv, d, dtype, seed=i)
            prepare, attn = get_attn_op(method)
            ql, kl, vl = (shard_tensor(x, plan, rank).requires_grad_() for x in (q, k, v))
            counter = CommCounter()
            backend = "reference" if dtype == F64 else "auto"
            group = made[u] if i % 2 else None  # both: groups given, and made by the op
            out = attn(ql, kl, vl, prepare(plan, rank), group, counter=counter, backend=backend)
            fwd = counter.as_dict()
            out.backward(shard_tensor(dout, plan, rank))
            results.append((out.detach(), ql.grad, kl.grad, vl.grad, fwd, counter.as_dict()))
    return results


@pytest.mark.parametrize("cp_size", [4, 8])
def test_hybrids_match_reference_and_count_predicted_bytes(cp_size):
    cases = _cases(cp_size)
    per_rank = run_ranks(_run_cases, cp_size, cases, timeout_s=180)
    failures = []
    for i, (name, doc_lens, pad, h, hkv, d, dtype, u) in enumerate(cases):
        for j, method in enumerate(METHODS):
            idx = i * len(METHODS) + j
            plan = make_plan_for(method, doc_lens, cp_size, num_pad=pad, ulysses_degree=u)
            q, k, v, dout = _inputs(plan.context_len, h, hkv, d, dtype, seed=i)
            ref = _reference(q, k, v, doc_lens, dout, pad)
            plain = _plain(q, k, v, doc_lens, dout) if dtype == BF16 else None
            got = [unshard([per_rank[r][idx][t] for r in range(cp_size)], plan) for t in range(4)]
            for t, what in enumerate(("out", "dq", "dk", "dv")):
                err = _maxerr(got[t], ref[t])
                tol = 1e-12 if dtype == F64 else 2 * _maxerr(plain[t], ref[t]) + 1e-6
                if not err <= tol:
                    failures.append(f"{method} {name}: {what} error {err:.3g} > {tol:.3g}")
            shape = AttnShape(h, hkv, d, DTYPE_NAME[dtype])
            want_fwd = comm_volume(plan, COMM_KIND[method], shape, "infer")
            want = comm_volume(plan, COMM_KIND[method], shape, "train")
            for r in range(cp_size):
                fwd, total = per_rank[r][idx][4:]
                if fwd != want_fwd or total != want:
                    failures.append(f"{method} {name} rank {r}: counted {fwd} / {total}, "
                                    f"predicted {want_fwd} / {want}")  # fmt: skip
    assert not failures, "\n".join(failures)


def test_plans_report_their_groups():
    doc_lens = [300, 1, 1, 77, 1200, 5, 464]  # C = 2048
    usp = make_plan_for("usp", doc_lens, 8, ulysses_degree=2)
    zz = make_plan_for("zigzag", doc_lens, 4)
    g = usp.group_plan()
    assert (g.rank == zz.rank).all() and (g.start == zz.start).all()  # zigzag over the groups
    assert usp.workload_per_rank.tolist() == np.repeat(zz.workload_per_rank / 2, 2).tolist()
    assert usp.imbalance_ratio == pytest.approx(zz.imbalance_ratio)
    fu = make_plan_for("flashcp_ulysses", doc_lens, 8, ulysses_degree=4)
    fc = make_plan_for("flashcp", doc_lens, 2)
    s, t = fu.summary(), fc.summary()
    for key in ("imbalance_ratio", "comm_tokens", "comm_tokens_full", "comm_saving", "num_pieces"):
        assert s[key] == pytest.approx(t[key]), key
    # a 2-rank KV exchange of Eq. 5 for 1/4 of the KV heads, and the all-to-alls inside groups
    shape = AttnShape(32, 8, 128, "bfloat16")
    vol = comm_volume(fu, "allgather_sharded", shape, "infer")
    assert vol["allgather_bytes"] == fc.comm_tokens * 2 * 2 * 128 * 2
    assert vol["alltoall_bytes"] == 3 * 256 * (8 + 2 + 2 + 8) * 128 * 2


def test_bad_degrees_are_one_line_errors():
    with pytest.raises(ValueError, match="ulysses_degree = 3 does not divide cp_size = 8; choose"):
        make_plan_for("usp", [16] * 8, 8, ulysses_degree=3)
    with pytest.raises(ValueError, match="ulysses_degree must be a positive integer, got 0"):
        make_plan_for("flashcp_ulysses", [16] * 8, 8, ulysses_degree=0)
    plan = make_plan_for("usp", [16] * 8, 8, ulysses_degree=4)
    msg = "ulysses degree 4 does not divide num_heads = 6"
    with pytest.raises(ValueError, match=msg):
        comm_volume(plan, "p2p_ring", AttnShape(6, 2, 8), "train")


def _bad_calls(rank, n):
    """Rank 0 makes bad calls alone: any collective would block it (and time out)."""
    if rank != 0:
        dist.barrier()
        return []
    raised, counter = [], CommCounter()
    for method in METHODS:
        prepare, attn = get_attn_op(method)
        plan = make_plan_for(method, [20, 12], n, ulysses_degree=2)
        t = plan.context_len // n
        bad = {
            "heads": (torch.randn(t, 3, 8), torch.randn(t, 3, 8), torch.randn(t, 3, 8)),
            "short q": (torch.randn(t - 1, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)),
        }
        for name, (a, b, c) in bad.items():
            try:
                attn(a, b, c, prepare(plan, 0), counter=counter)
            except ValueError as e:
                raised.append((method, name, str(e)))
    dist.barrier()
    return [raised, counter.as_dict()["comm_bytes"]]


def test_bad_inputs_raise_before_any_communication():
    raised, counted = run_ranks(_bad_calls, 4, timeout_s=30)[0]
    assert len(raised) == 4 and counted == 0, raised
    assert all("\n" not in msg for *_, msg in raised)
    assert "ulysses degree 2 does not divide num_heads = 3" in raised[0][2]


def _dist_rows(rank, n):
    from flashcp.executors.dist import init_from_env, measure_step

    group = init_from_env(30)
    shape = AttnShape(4, 2, 8, "float32")
    return {
        (m, mode): measure_step(
            make_plan_for(m, [5, 40, 3, 60, 1, 19], n, ulysses_degree=2), shape, mode,
            group=group, backend="cpu", iters=1, seed=3,
        )
        for m in METHODS
        for mode in ("train", "infer")
    }  # fmt: skip


def test_dist_and_sim_agree_on_bytes():
    from flashcp.sim import simulate

    n, shape = 4, AttnShape(4, 2, 8, "float32")
    rows = run_ranks(_dist_rows, n, timeout_s=120)[0]
    for m in METHODS:
        plan = make_plan_for(m, [5, 40, 3, 60, 1, 19], n, ulysses_degree=2)
        for mode in ("train", "infer"):
            sim = simulate(plan, shape, "h100_sxm", mode)
            want = comm_volume(plan, COMM_KIND[m], shape, mode)
            got = {k: rows[m, mode][k] for k in want}
            assert got == {k: sim[k] for k in want} == want
            assert want["alltoall_bytes"] > 0 and rows[m, mode]["alltoall_ms"] > 0


def test_sim_hybrid_is_the_inner_method_for_h_over_u_heads_plus_the_alltoalls():
    """USP at u = 2 on 8 ranks: the zigzag ring of the 4 groups priced for 16 of 32 heads (and 4
    of 8 KV heads), plus the 2-rank all-to-alls; the bytes are those of comm_volume."""
    from dataclasses import replace

    from flashcp.sim import load_hardware, simulate

    hw = load_hardware("h100_sxm")
    doc_lens = [9000, 300, 20000, 3468]  # C = 32768
    plan = make_plan_for("usp", doc_lens, 8, ulysses_degree=2)
    shape = AttnShape(32, 8, 128, "bfloat16")
    for mode in ("infer", "train"):
        got = simulate(plan, shape, hw, mode)
        ring = simulate(replace(plan.group_plan(), method="zigzag"), AttnShape(16, 4, 128),
                        hw, mode)  # fmt: skip
        assert got["p2p_ms"] == pytest.approx(ring["p2p_ms"], rel=1e-12)
        assert got["attn_fwd_ms"] == pytest.approx(ring["attn_fwd_ms"], rel=1e-12)
        assert got["p2p_bytes"] == ring["p2p_bytes"]
        assert got["alltoall_bytes"] == comm_volume(plan, "p2p_ring", shape, mode)["alltoall_bytes"]
        # forward: q, k, v of 4096 rows in one all-to-all (32 + 8 + 8 heads), the output back
        first = [4096 * 48 * 128 * 2, 4096 * 32 * 128 * 2]
        fwd = sum(hw.alltoall_us(b / 2, b) for b in first) / 1e3
        if mode == "infer":
            assert got["alltoall_ms"] == pytest.approx(fwd, rel=1e-12)
        else:
            assert got["alltoall_ms"] > 2 * fwd


@pytest.mark.parametrize("method, inner", [("usp", "zigzag"), ("flashcp_ulysses", "flashcp")])
def test_group_plans_are_the_inner_planners_plans(method, inner):
    """Loop over random inputs (zero-length documents, pad): the hybrid's group plan is the inner
    planner's plan of the N/u groups, shard for shard and pad for pad; every rank holds C/N rows,
    a group's ranks its super-rank's rows in order, and the workload is the group's / u."""
    from flashcp.ops.sharding import global_rows

    rng = np.random.default_rng(3)
    for _ in range(12):
        n, u = [(4, 2), (8, 2), (8, 4), (16, 4), (6, 3)][int(rng.integers(5))]
        lens = [int(x) for x in rng.integers(0, 90, size=int(rng.integers(1, 9)))]
        pad = int(rng.integers(0, 2 * n))
        plan = make_plan_for(method, lens, n, ulysses_degree=u, num_pad=pad, pad_to_multiple=True)
        ref = make_plan_for(inner, lens, n // u, num_pad=plan.num_pad)
        g = plan.group_plan()
        for col in ("rank", "doc", "start", "length", "pad"):
            assert (getattr(g, col) == getattr(ref, col)).all(), col
        assert (plan.tokens_per_rank == plan.context_len // n).all()
        for s in range(n // u):
            rows = np.concatenate([global_rows(plan, s * u + j) for j in range(u)])
            assert (rows == global_rows(ref, s)).all()
        assert np.allclose(plan.workload_per_rank, np.repeat(ref.workload_per_rank / u, u))
        assert plan.summary()["imbalance_ratio"] == pytest.approx(ref.imbalance_ratio)
