"""Ring-family CP attention (``ring``, ``zigzag``) against the float64 single-device reference.

Each CP size runs in one launch of forked gloo ranks (``tests/mp_utils.py``) that executes every
case for both methods; the parent compares the gathered outputs and gradients with
:func:`flashcp.ops.reference.reference_attention` and the counted P2P bytes with
:func:`flashcp.comm.comm_volume`. float32: relative (Frobenius) error <= 1e-5 for outputs and 1e-4
for gradients; bfloat16: max error at most twice that of a plain single-device bfloat16
computation (PyTorch math in bfloat16, as flash-attention's tests do) when the dK/dV partial sums
travel in float32 (the default), and at most three times for gradients when they travel in
bfloat16 (``grad_comm_dtype=torch.bfloat16``, which rounds the sum at each of the N-1 hops).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mp_utils import run_ranks

from flashcp.comm import AttnShape, comm_volume
from flashcp.data import load_distribution, sample_sequences
from flashcp.ops import get_attn_op
from flashcp.ops.collectives import CommCounter
from flashcp.ops.lse import merge_lse_, merge_lse_rows_, new_accumulator
from flashcp.ops.reference import document_mask, reference_attention
from flashcp.ops.sharding import shard_tensor, unshard
from flashcp.registry import make_plan_for

OPS = {m: get_attn_op(m) for m in ("ring", "zigzag")}  # the ring op family with each layout
prepare_ring, ring_attn = OPS["ring"]
prepare_zigzag, zigzag_attn = OPS["zigzag"]
DTYPE_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


# ---- cases -----------------------------------------------------------------------------------------


def _tiny_docs(c: int, rng) -> list[int]:
    lens = []
    while sum(lens) < c:
        lens.append(int(rng.integers(1, 4)))
    lens[-1] -= sum(lens) - c
    return [x for x in lens if x > 0]


def _cases(n: int) -> list[tuple]:
    """(name, doc_lens, num_heads, num_kv_heads, head_dim, dtype, grad_comm_dtype) for CP size
    ``n``."""
    c = 128 if n == 2 else 256
    rng = np.random.default_rng(n)
    pile = sample_sequences(load_distribution("pile"), 2, c, seed=n)
    stress = sample_sequences(load_distribution("stress", context_len=c), 2, c, seed=n)
    short = [int(x) for x in rng.integers(1, 2 * n, size=3 * n)]
    cuts = np.sort(rng.choice(np.arange(1, c), size=5, replace=False))
    uniform = np.diff(np.concatenate([[0], cuts, [c]])).tolist()
    f32, bf16 = torch.float32, torch.bfloat16
    cases = [
        ("pile", pile[0].tolist(), 2, 2, 8, f32, None),
        ("pile-b", pile[1].tolist(), 4, 2, 16, f32, None),
        ("stress", stress[0].tolist(), 2, 1, 8, f32, None),
        ("stress-gqa", stress[1].tolist(), 8, 2, 8, f32, None),
        ("uniform-cuts", uniform, 4, 4, 8, f32, None),
        ("shorter-than-2N", [*short, c - sum(short)], 2, 2, 8, f32, None),
        ("length-1", [1, 1, c // 2 - 3, 1, c // 2], 2, 2, 8, f32, None),
        ("one-doc", [c], 4, 2, 8, f32, None),
        ("one-doc-gqa", [c], 8, 2, 16, f32, None),
        ("spans-every-rank", [3, c - 6, 3], 2, 2, 8, f32, None),
        ("tiny-docs", _tiny_docs(c, rng), 2, 2, 8, f32, None),
        ("bf16-stress", stress[0].tolist(), 4, 2, 16, bf16, None),
        ("bf16-stress-bf16grads", stress[0].tolist(), 4, 2, 16, bf16, bf16),
        ("bf16-one-doc-gqa", [c], 8, 2, 16, bf16, None),
        ("bf16-one-doc-gqa-bf16grads", [c], 8, 2, 16, bf16, bf16),
    ]
    for name, lens, *_ in cases:
        assert sum(lens) == c and min(lens) >= 1, name
    return cases


def _inputs(doc_lens, h, hkv, d, dtype, seed):
    """q, k, v, dout of the whole packed sequence, rounded to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    c = sum(doc_lens)
    shapes = ((c, h, d), (c, hkv, d), (c, hkv, d), (c, h, d))
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _plain(q, k, v, doc_lens, dout):
    """Single-device attention in the inputs' dtype (no upcast) with autograd: out and grads."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kk, vv = (x.repeat_interleave(g, 1).permute(1, 0, 2) for x in (k, v))
    s = torch.matmul(q.permute(1, 0, 2), kk.transpose(1, 2)) / math.sqrt(q.shape[2])
    s = s.masked_fill(~document_mask(doc_lens), float("-inf"))
    out = torch.matmul(torch.softmax(s, -1), vv).permute(1, 0, 2)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _reference(q, k, v, doc_lens, dout):
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = reference_attention(q, k, v, doc_lens)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


# ---- the multi-rank run ------------------------------------------------------------------------------


def _run_cases(rank, n, cases):
    """On every rank: each case, both methods, forward and backward; returns local results."""
    results = []
    for i, (_, doc_lens, h, hkv, d, dtype, gdt) in enumerate(cases):
        q, k, v, dout = _inputs(doc_lens, h, hkv, d, dtype, seed=i)
        for method, (prepare, attn) in OPS.items():
            plan = make_plan_for(method, doc_lens, n)
            meta = prepare(plan, rank)
            ql, kl, vl = (shard_tensor(x, plan, rank).requires_grad_() for x in (q, k, v))
            counter = CommCounter()
            out = attn(ql, kl, vl, meta, counter=counter, grad_comm_dtype=gdt)
            fwd_bytes = counter.as_dict()["p2p_bytes"]
            out.backward(shard_tensor(dout, plan, rank))
            total = counter.as_dict()
            results.append(
                (out.detach(), ql.grad, kl.grad, vl.grad, fwd_bytes, total["p2p_bytes"], total)
            )
    return results


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _maxerr(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


@pytest.mark.parametrize("cp_size", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_ring_family_matches_reference(cp_size):
    cases = _cases(cp_size)
    per_rank = run_ranks(_run_cases, cp_size, cases, timeout_s=120)
    failures = []
    for i, (name, doc_lens, h, hkv, d, dtype, gdt) in enumerate(cases):
        q, k, v, dout = _inputs(doc_lens, h, hkv, d, dtype, seed=i)
        ref = _reference(q, k, v, doc_lens, dout)
        plain = _plain(q, k, v, doc_lens, dout) if dtype == torch.bfloat16 else None
        shape = AttnShape(h, hkv, d, DTYPE_NAME[dtype])
        grad_factor = 3 if gdt == torch.bfloat16 else 2  # bf16 dK/dV rounded at each hop
        for j, method in enumerate(OPS):
            plan = make_plan_for(method, doc_lens, cp_size)
            idx = i * len(OPS) + j
            got = [unshard([per_rank[r][idx][t] for r in range(cp_size)], plan) for t in range(4)]
            for t, what in enumerate(("out", "dq", "dk", "dv")):
                if dtype == torch.float32:
                    err, tol = _rel(got[t], ref[t]), (1e-5 if t == 0 else 1e-4)
                else:
                    factor = 2 if t == 0 else grad_factor
                    err, tol = _maxerr(got[t], ref[t]), factor * _maxerr(plain[t], ref[t]) + 1e-6
                if not err <= tol:
                    failures.append(
                        f"{method} {name} N={cp_size} {what}: error {err:.3g} > {tol:.3g}"
                    )
            want_fwd = comm_volume(plan, "p2p_ring", shape, "infer")["p2p_bytes"]
            want = comm_volume(
                plan, "p2p_ring", shape, "train", grad_comm_dtype=DTYPE_NAME.get(gdt)
            )
            for r in range(cp_size):
                fwd, total, counted = per_rank[r][idx][4:]
                if (fwd, total) != (want_fwd, want["p2p_bytes"]) or counted["comm_bytes"] != total:
                    failures.append(
                        f"{method} {name} N={cp_size} rank {r}: counted p2p {fwd} fwd / {total} "
                        f"train bytes, plan predicts {want_fwd} / {want['p2p_bytes']}"
                    )
    assert not failures, "\n".join(failures)


# ---- safety ------------------------------------------------------------------------------------------


def _bad_calls(rank, n):
    """Rank 0 makes bad calls alone: any communication would block it (and time out)."""
    if rank != 0:
        dist.barrier()
        return []
    plan = make_plan_for("zigzag", [40, 24], n)
    meta = prepare_zigzag(plan, 0)
    ring_meta = prepare_ring(make_plan_for("ring", [40, 24], n), 0)
    t = plan.context_len // n
    q, k = torch.randn(t, 4, 8), torch.randn(t, 2, 8)
    bad = {
        "short q": (torch.randn(t - 1, 4, 8), k, k, meta),
        "short k": (q, torch.randn(t - 1, 2, 8), torch.randn(t - 1, 2, 8), meta),
        "k/v shapes": (q, k, torch.randn(t, 1, 8), meta),
        "heads": (torch.randn(t, 3, 8), k, k, meta),
        "head_dim": (torch.randn(t, 4, 16), k, k, meta),
        "dtype": (q.double(), k, k, meta),
        "not 3-D": (q.flatten(1), k, k, meta),
        "ring meta": (q, k, k, ring_meta),
        "other rank": (q, k, k, prepare_zigzag(plan, 1)),
        "not meta": (q, k, k, plan),
    }
    bad_options = {"grad_comm_dtype int8": {"grad_comm_dtype": "int8"},
                   "grad_comm_dtype int": {"grad_comm_dtype": torch.int64}}  # fmt: skip
    raised = []
    counter = CommCounter()
    for name, (a, b, c, m) in bad.items():
        try:
            zigzag_attn(a, b, c, m, counter=counter)
        except ValueError as e:
            raised.append((name, str(e)))
    for name, opts in bad_options.items():
        try:
            zigzag_attn(q, k, k, meta, counter=counter, **opts)
        except ValueError as e:
            raised.append((name, str(e)))
    dist.barrier()
    return [raised, len(bad) + len(bad_options), counter.as_dict()["comm_bytes"]]


def test_bad_inputs_raise_before_any_communication():
    raised, expected, counted = run_ranks(_bad_calls, 2, timeout_s=30)[0]
    assert len(raised) == expected, raised
    assert counted == 0
    msgs = dict(raised)
    assert "not a multiple of num_kv_heads" in msgs["heads"]
    assert "holds 32 tokens" in msgs["short q"]
    assert "prepared for 'ring'" in msgs["ring meta"]
    assert "grad_comm_dtype must be" in msgs["grad_comm_dtype int8"]


def _mismatched_plans(rank, n):
    doc_lens = [32, 32] if rank == 0 else [16, 48]
    plan = make_plan_for("ring", doc_lens, n)
    x = torch.randn(32, 2, 8)
    try:
        ring_attn(x, x, x, prepare_ring(plan, rank))
    except ValueError as e:
        return str(e)
    return None


def test_ranks_with_different_plans_fail_fast():
    for msg in run_ranks(_mismatched_plans, 2, timeout_s=30):
        assert msg is not None and "different plans" in msg


def test_prepare_validates_plan_and_rank():
    plan = make_plan_for("zigzag", [10, 6], 2)
    with pytest.raises(ValueError, match="needs a 'ring' plan"):
        prepare_ring(plan, 0)
    with pytest.raises(ValueError, match="needs a 'zigzag' plan"):
        prepare_zigzag(make_plan_for("per_doc", [10, 6], 2), 0)
    for rank in (-1, 2, 0.5, True):
        with pytest.raises(ValueError, match="rank must be"):
            prepare_zigzag(plan, rank)
    with pytest.raises(ValueError, match="Plan"):
        prepare_zigzag({"method": "zigzag"}, 0)


def test_single_rank_runs_without_a_process_group():
    doc_lens = [5, 1, 10]
    q, k, v, dout = _inputs(doc_lens, 4, 2, 8, torch.float32, seed=0)
    ref = _reference(q, k, v, doc_lens, dout)
    for method, (prepare, attn) in OPS.items():
        plan = make_plan_for(method, doc_lens, 1)
        ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
        out = attn(ql, kl, vl, prepare(plan, 0), backend="cpu")
        out.backward(dout)
        for got, want in zip((out, ql.grad, kl.grad, vl.grad), ref, strict=True):
            assert _rel(got, want) < 1e-5


# ---- metadata (pure) -------------------------------------------------------------------------------


@pytest.mark.parametrize("method", list(OPS))
def test_metadata_computes_exactly_the_visible_pairs(method):
    """Summed over steps, a rank's kernel calls cover exactly its Eq. 3 workload (nothing masked
    is computed, nothing visible is missed); ``ring`` never touches a later rank's block."""
    rng = np.random.default_rng(7)
    prepare = OPS[method][0]
    for n in (2, 3, 4, 8):
        for _ in range(6):
            c = n * int(rng.integers(4, 40))
            doc_lens = _tiny_docs(c, rng) if rng.random() < 0.3 else None
            if doc_lens is None:
                cuts = np.sort(
                    rng.choice(np.arange(1, c), size=int(rng.integers(0, 6)), replace=False)
                )
                doc_lens = np.diff(np.concatenate([[0], cuts, [c]])).tolist()
            plan = make_plan_for(method, doc_lens, n)
            for r in range(n):
                meta = prepare(plan, r)
                assert meta.pairs == int(plan.workload_per_rank[r])
                if method == "ring":
                    for s in range(n):
                        if (r - s) % n > r:
                            assert meta.steps[s] == ()


def test_zigzag_uses_few_kernel_calls():
    """With the zigzag layout every step needs one kernel call (rank N-1's merged middle chunk
    and the causal step fuse into single segments per document)."""
    plan = make_plan_for("zigzag", [96, 64, 32, 64], 4)
    for r in range(4):
        meta = prepare_zigzag(plan, r)
        assert [len(calls) for calls in meta.steps] == [1, 1, 1, 1]


# ---- LSE merge -------------------------------------------------------------------------------------


def test_lse_merge_equals_softmax_over_the_union():
    g = torch.Generator().manual_seed(0)
    t, h, d = 6, 2, 4
    s = torch.randn(h, t, 10, generator=g)
    v = torch.randn(10, d, generator=g)
    s[:, 0, :] = float("-inf")  # row 0 sees nothing at all
    s[:, 1, :5] = float("-inf")  # row 1 sees only the second half
    out, lse = new_accumulator(t, h, d)
    for part in (slice(0, 5), slice(5, 10)):
        sp = s[:, :, part]
        m = torch.logsumexp(sp, -1)  # (H, T)
        p = torch.exp(sp - torch.where(torch.isinf(m), 0.0, m)[..., None])
        merge_lse_(out, lse, torch.einsum("htk,kd->thd", p, v[part]), m)
    want = torch.einsum("htk,kd->thd", torch.softmax(s, -1).nan_to_num(0.0), v)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    assert (out[0] == 0).all() and torch.isneginf(lse[:, 0]).all()


def test_lse_merge_rows_and_bad_shapes():
    out, lse = new_accumulator(5, 2, 3)
    rows = torch.tensor([4, 1])
    blk, blk_lse = torch.ones(2, 2, 3), torch.zeros(2, 2)
    merge_lse_rows_(out, lse, rows, blk, blk_lse)
    merge_lse_rows_(out, lse, slice(1, 3), blk, blk_lse)
    assert (out[[1, 2, 4]] == 1).all() and (out[[0, 3]] == 0).all()
    torch.testing.assert_close(lse[:, 1], torch.full((2,), math.log(2)))
    assert torch.isneginf(lse[:, [0, 3]]).all()
    with pytest.raises(ValueError, match="one dtype of float32 or wider"):
        merge_lse_(out.double(), lse, out, lse)
    with pytest.raises(ValueError, match="one dtype of float32 or wider"):
        merge_lse_(out.bfloat16(), lse.bfloat16(), out, lse)
    with pytest.raises(ValueError, match=r"block lse must be torch\.float32"):
        merge_lse_(out, lse, out, lse.double())


def test_lse_merge_in_float64_is_exact():
    """A float64 accumulator merges float64 blocks without passing through float32."""
    g = torch.Generator().manual_seed(3)
    s = torch.randn(2, 5, 12, generator=g, dtype=torch.float64)  # (H, T, keys)
    v = torch.randn(12, 4, generator=g, dtype=torch.float64)
    out, lse = new_accumulator(5, 2, 4, dtype=torch.float64)
    assert out.dtype == lse.dtype == torch.float64
    for part in (slice(0, 7), slice(7, 12)):
        m = torch.logsumexp(s[:, :, part], -1)
        p = torch.exp(s[:, :, part] - m[..., None])
        merge_lse_(out, lse, torch.einsum("htk,kd->thd", p, v[part]), m)
    want = torch.einsum("htk,kd->thd", torch.softmax(s, -1), v)
    assert float((out - want).abs().max()) < 1e-14
    assert float((lse - torch.logsumexp(s, -1)).abs().max()) < 1e-14
    with pytest.raises(ValueError, match="do not match"):
        merge_lse_(out, lse, out[:2], lse[:, :2])


@pytest.mark.parametrize("method", ["ring", "zigzag"])
def test_bad_softmax_scale_raises(method):
    prepare, attn = OPS[method]
    plan = make_plan_for(method, [10, 6], 1)
    x = torch.randn(16, 2, 8)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="softmax_scale"):
            attn(x, x, x, prepare(plan, 0), softmax_scale=bad)
    out = attn(x, x, x, prepare(plan, 0), softmax_scale=0.5, backend="reference")
    assert out.shape == x.shape
