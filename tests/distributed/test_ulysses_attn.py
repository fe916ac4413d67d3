"""Ulysses (head-parallel all-to-all) CP attention on gloo ranks vs the float64 reference.

One launch of forked gloo ranks per CP size runs every case (``tests/mp_utils.py``, a timeout on
every collective); the parent unshards outputs and gradients and compares them with
:func:`flashcp.ops.reference.reference_attention`: float64 with the float64 reference backend to
1e-12, bfloat16 within 2x the error of a plain single-device bfloat16 computation. Counted
all-to-all bytes must equal :func:`flashcp.comm.comm_volume`, and bad degrees fail on one line
before any collective.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mp_utils import run_ranks

from baselines.ulysses import plan_ulysses
from flashcp.comm import AttnShape, alltoall_bytes, comm_volume
from flashcp.ops.collectives import CommCounter
from flashcp.ops.reference import document_mask, reference_attention
from flashcp.ops.sharding import shard_tensor, unshard
from flashcp.ops.ulysses_attn import prepare_ulysses, ulysses_attn
from flashcp.plan.head_parallel import ulysses_heads, valid_ulysses_degrees
from flashcp.registry import COMM_KIND, make_plan_for

F64, BF16 = torch.float64, torch.bfloat16
DTYPE_NAME = {F64: "float64", BF16: "bfloat16"}


def _cases(n: int) -> list[tuple]:
    """(name, doc_lens, num_pad, H, Hkv, D, dtype) at CP size ``n``."""
    c = 16 * n
    rng = np.random.default_rng(n)
    cuts = np.sort(rng.choice(np.arange(1, c), size=4, replace=False))
    mix = np.diff(np.concatenate([[0], cuts, [c]])).tolist()
    return [
        ("mix", mix, 0, 2 * n, 2 * n, 8, F64),
        ("gqa", mix, 0, 2 * n, n, 8, F64),
        ("gqa-replicated", mix, 0, 2 * n, max(n // 2, 1), 8, F64),
        ("mqa", [c // 2, c // 2], 0, n, 1, 8, F64),
        ("zero-length-and-pad", [0, 5, 0, c - 5 - 3, 0], 3, n, n, 8, F64),
        ("one-doc", [c], 0, n, n, 4, F64),
        ("bf16-mix", mix, 0, 2 * n, n, 16, BF16),
        ("bf16-replicated", [3, c - 3], 0, 2 * n, 1, 16, BF16),
    ]


def _inputs(c, h, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = ((c, h, d), (c, hkv, d), (c, hkv, d), (c, h, d))
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _doc_rows(doc_lens) -> list[int]:
    return [x for x in doc_lens if x > 0]


def _reference(q, k, v, doc_lens, dout, pad):
    """float64 out and grads; pad rows (the last ``pad``) have output and gradient 0."""
    r = q.shape[0] - pad
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = reference_attention(q[:r], k[:r], v[:r], _doc_rows(doc_lens))
    out.backward(dout[:r].double())
    out = torch.nn.functional.pad(out.detach(), (0, 0, 0, 0, 0, pad))
    return out, q.grad, k.grad, v.grad


def _plain(q, k, v, doc_lens, dout):
    """Single-device attention in the inputs' dtype (no upcast): out and grads."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kk, vv = (x.repeat_interleave(g, 1).permute(1, 0, 2) for x in (k, v))
    s = torch.matmul(q.permute(1, 0, 2), kk.transpose(1, 2)) / math.sqrt(q.shape[2])
    s = s.masked_fill(~document_mask(_doc_rows(doc_lens)), float("-inf"))
    out = torch.matmul(torch.softmax(s, -1), vv).permute(1, 0, 2)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _run_cases(rank, n, cases):
    results = []
    for i, (_, doc_lens, pad, h, hkv, d, dtype) in enumerate(cases):
        plan = make_plan_for("ulysses", doc_lens, n, num_pad=pad)
        q, k, v, dout = _inputs(plan.context_len, h, hkv, d, dtype, seed=i)
        meta = prepare_ulysses(plan, rank)
        ql, kl, vl = (shard_tensor(x, plan, rank).requires_grad_() for x in (q, k, v))
        counter = CommCounter()
        backend = "reference" if dtype == F64 else "auto"
        out = ulysses_attn(ql, kl, vl, meta, counter=counter, backend=backend)
        fwd = counter.as_dict()
        out.backward(shard_tensor(dout, plan, rank))
        results.append((out.detach(), ql.grad, kl.grad, vl.grad, fwd, counter.as_dict()))
    return results


def _maxerr(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


@pytest.mark.parametrize("cp_size", [2, 4])
def test_ulysses_matches_reference_and_counts_predicted_bytes(cp_size):
    cases = _cases(cp_size)
    per_rank = run_ranks(_run_cases, cp_size, cases, timeout_s=120)
    failures = []
    for i, (name, doc_lens, pad, h, hkv, d, dtype) in enumerate(cases):
        plan = make_plan_for("ulysses", doc_lens, cp_size, num_pad=pad)
        q, k, v, dout = _inputs(plan.context_len, h, hkv, d, dtype, seed=i)
        ref = _reference(q, k, v, doc_lens, dout, pad)
        plain = _plain(q, k, v, doc_lens, dout) if dtype == BF16 else None
        got = [unshard([per_rank[r][i][t] for r in range(cp_size)], plan) for t in range(4)]
        for t, what in enumerate(("out", "dq", "dk", "dv")):
            err = _maxerr(got[t], ref[t])
            tol = 1e-12 if dtype == F64 else 2 * _maxerr(plain[t], ref[t]) + 1e-6
            if not err <= tol:
                failures.append(f"{name} N={cp_size} {what}: error {err:.3g} > {tol:.3g}")
        shape = AttnShape(h, hkv, d, DTYPE_NAME[dtype])
        want_fwd = comm_volume(plan, COMM_KIND["ulysses"], shape, "infer")
        want = comm_volume(plan, COMM_KIND["ulysses"], shape, "train")
        for r in range(cp_size):
            fwd, total = per_rank[r][i][4:]
            if fwd != want_fwd or total != want:
                failures.append(f"{name} N={cp_size} rank {r}: counted {fwd} / {total}, "
                                f"predicted {want_fwd} / {want}")  # fmt: skip
    assert not failures, "\n".join(failures)


def test_bytes_formula_by_hand():
    """C = 32, N = 4, H = 8, Hkv = 2 (< N: each KV head sent twice), D = 8, bfloat16: one
    all-to-all of a (8, h, 8) tensor receives 3/4 * 8 * h * 8 * 2 bytes."""
    plan = make_plan_for("ulysses", [20, 12], 4)
    shape = AttnShape(8, 2, 8, "bfloat16")
    q_or_o, kv = 3 * 8 * 2 * 8 * 2, 3 * 8 * 1 * 8 * 2  # 768 and 384 bytes
    assert alltoall_bytes(8, 8, 8, 2, 4) == q_or_o and alltoall_bytes(8, 4, 8, 2, 4) == kv
    infer = comm_volume(plan, "alltoall", shape, "infer")
    assert infer["alltoall_bytes"] == infer["comm_bytes"] == 2 * q_or_o + 2 * kv
    # backward: dO in, dQ back (bf16), dK / dV back as float32 partial sums (replicated heads)
    train = comm_volume(plan, "alltoall", shape, "train")
    assert train["alltoall_bytes"] == (2 * q_or_o + 2 * kv) + 2 * q_or_o + 2 * 2 * kv
    assert train["allgather_bytes"] == train["p2p_bytes"] == train["reducescatter_bytes"] == 0


def test_plan_is_balanced_by_construction():
    """Ring's contiguous layout is far out of balance; Ulysses' ranks all compute total / N."""
    doc_lens = [60, 4]
    ring, uly = make_plan_for("ring", doc_lens, 4), make_plan_for("ulysses", doc_lens, 4)
    assert (uly.rank == ring.rank).all() and (uly.length == ring.length).all()  # same layout
    total = (60 * 61 + 4 * 5) / 2
    assert ring.imbalance_ratio > 1.4
    assert uly.imbalance_ratio == 1.0
    assert uly.workload_per_rank.tolist() == [total / 4] * 4
    s = uly.summary()
    assert s["comm_tokens"] is s["comm_tokens_full"] is None  # no KV exchange: all-to-alls only
    assert s["num_pieces"] == 2 and s["num_split_docs"] == 0  # the kernel sees whole documents
    assert plan_ulysses(doc_lens, 4).info == {"ulysses_degree": 4}


def test_degrees():
    assert valid_ulysses_degrees(32, 8) == [1, 2, 4, 8, 16, 32]
    assert valid_ulysses_degrees(12, 6) == [1, 2, 3, 6, 12]
    assert ulysses_heads(32, 8, 16).kv_replication == 2
    assert ulysses_heads(32, 8, 4)[3:] == (1, 8, 2)
    msg = "ulysses degree 4 does not divide num_heads = 6 "
    msg += r"\(with 6 query and 2 KV heads the valid degrees are 1, 2, 6; nearest: 2, 6\)"
    with pytest.raises(ValueError, match=msg):
        ulysses_heads(6, 2, 4)
    with pytest.raises(ValueError, match="neither divides nor is a multiple of num_kv_heads = 6"):
        ulysses_heads(12, 6, 4)
    with pytest.raises(ValueError, match="ulysses degree must be a positive integer"):
        ulysses_heads(8, 8, 0)
    with pytest.raises(ValueError, match="does not divide num_heads = 6"):
        comm_volume(make_plan_for("ulysses", [16], 4), "alltoall", AttnShape(6, 2, 8), "train")


def _bad_calls(rank, n):
    """Rank 0 makes bad calls alone: any collective would block it (and time out)."""
    if rank != 0:
        dist.barrier()
        return []
    plan = make_plan_for("ulysses", [20, 12], n)
    meta = prepare_ulysses(plan, 0)
    t = plan.context_len // n
    q, k = torch.randn(t, 8, 8), torch.randn(t, 4, 8)
    bad = {
        "heads": (torch.randn(t, 6, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8), meta),
        "kv heads": (torch.randn(t, 12, 8), torch.randn(t, 6, 8), torch.randn(t, 6, 8), meta),
        "short q": (torch.randn(t - 1, 8, 8), k, k, meta),
        "k/v shapes": (q, k, torch.randn(t, 2, 8), meta),
        "dtype": (q.double(), k, k, meta),
        "other rank": (q, k, k, prepare_ulysses(plan, 1)),
        "not meta": (q, k, k, plan),
    }
    raised, counter = [], CommCounter()
    for name, (a, b, c, m) in bad.items():
        try:
            ulysses_attn(a, b, c, m, counter=counter)
        except ValueError as e:
            raised.append((name, str(e)))
    dist.barrier()
    return [raised, len(bad), counter.as_dict()["comm_bytes"]]


def test_bad_inputs_raise_before_any_communication():
    raised, expected, counted = run_ranks(_bad_calls, 4, timeout_s=30)[0]
    assert len(raised) == expected, raised
    assert counted == 0
    msgs = dict(raised)
    assert "valid degrees are 1, 2, 6; nearest: 2, 6" in msgs["heads"]
    assert all("\n" not in m for m in msgs.values())
    assert "holds 8 tokens" in msgs["short q"]


def test_prepare_validates_plan_and_rank():
    plan = make_plan_for("ulysses", [10, 6], 2)
    with pytest.raises(ValueError, match="needs a 'ulysses' plan"):
        prepare_ulysses(make_plan_for("ring", [10, 6], 2), 0)
    for rank in (-1, 2, 0.5, True):
        with pytest.raises(ValueError, match="rank must be"):
            prepare_ulysses(plan, rank)


def test_single_rank_without_a_process_group():
    doc_lens = [5, 0, 11]
    q, k, v, dout = _inputs(16, 4, 2, 8, F64, seed=0)
    ref = _reference(q, k, v, doc_lens, dout, 0)
    ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
    meta = prepare_ulysses(make_plan_for("ulysses", doc_lens, 1), 0)
    out = ulysses_attn(ql, kl, vl, meta, backend="reference")
    out.backward(dout)
    for got, want in zip((out, ql.grad, kl.grad, vl.grad), ref, strict=True):
        assert _maxerr(got, want) < 1e-12
