"""cp_size 1 does no CP work: every method's op is one plain document-masked varlen call on the
local tensors (no collective, no gather buffer; flashcp.ops.single_device), exact against the
float64 reference, and the step model prices every method the same there with no
communication."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashcp.comm import AttnShape
from flashcp.executors.work_trace import trace_work
from flashcp.ops import get_attn_op
from flashcp.ops.collectives import CommCounter
from flashcp.ops.reference import reference_attention
from flashcp.registry import make_plan_for, method_names
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS
from flashcp.sim import load_hardware, simulate
from flashcp.sim.cost import price_plans

METHODS = method_names(fast=True)
#: a 1-token and a zero-length document among others
LENS = [7, 1, 0, 12, 4]


def _inputs(c: int, h: int, hkv: int, d: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(c, nh, d, generator=g, dtype=dtype) for nh in (h, hkv, hkv, h)]


@pytest.mark.parametrize("num_pad", [0, 4])
def test_every_method_at_cp_size_1_is_plain_attention(num_pad):
    """float64 on the reference backend: out, dq, dk, dv within 1e-12 of the float64 reference
    for every method (pad rows: output and gradient 0), nothing counted."""
    c = sum(LENS)
    q, k, v, dout = _inputs(c + num_pad, 4, 2, 8, torch.float64)
    leaves = [x[:c].clone().requires_grad_() for x in (q, k, v)]
    ref = reference_attention(*leaves, [d for d in LENS if d])
    ref.backward(dout[:c])
    want = [ref.detach(), *(x.grad for x in leaves)]
    for m in METHODS:
        plan = make_plan_for(m, LENS, 1, num_pad=num_pad)
        prepare, attn = get_attn_op(m)
        ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
        counter = CommCounter()
        out = attn(ql, kl, vl, prepare(plan, 0), backend="reference", counter=counter)
        out.backward(dout)
        for what, got, w in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad),
                                want, strict=True):  # fmt: skip
            assert got.dtype == torch.float64
            torch.testing.assert_close(got[:c], w, rtol=1e-12, atol=1e-12, msg=f"{m} {what}")
            assert not got[c:].any(), (m, what)  # pad rows
        assert counter.as_dict()["comm_bytes"] == 0, m


@pytest.mark.parametrize("num_pad", [0, 2])
def test_every_method_at_cp_size_1_issues_one_call_and_no_collective(num_pad):
    """The recorded work of every method at cp_size 1: one varlen call per pass over the whole
    documents, no collective or ring exchange, and no memory-bound op but the pad copies."""
    shape = AttnShape(4, 2, 8, "float32")
    for m in METHODS:
        plan = make_plan_for(m, LENS, 1, num_pad=num_pad)
        trace = trace_work(plan, shape, "train")[0]
        assert not trace.select("comm"), m
        for phase, pad_copies in (("fwd", 1), ("bwd", 4)):
            calls = trace.select("kernel", phase)
            assert len(calls) == 1, (m, phase)
            assert list(calls[0].q_lens) == list(calls[0].k_lens) == [7, 1, 12, 4], m
            launches = trace.select("op", phase, category="launch")
            assert len(launches) == (pad_copies if num_pad else 0), (m, phase, launches)


def test_every_method_at_cp_size_1_is_priced_the_same():
    """Simulated at cp_size 1, every method's step is the same single-device attention (every
    phase column equal, no communication phase) with 0 bytes moved, per plan and batched."""
    hw = load_hardware("h100_sxm")
    shapes = [AttnShape(32, 8, 128, "bfloat16"), AttnShape(16, 16, 64, "float32")]
    for num_pad in (0, 6):
        plans = [make_plan_for(m, [6000, 3000, 1, 0, 1999], 1, num_pad=num_pad) for m in METHODS]
        got = price_plans(plans, shapes, ["train", "infer"], [hw])
        for b, shape in enumerate(shapes):
            for i, mode in enumerate(("train", "infer")):
                steps = [simulate(p, shape, hw, mode) for p in plans]
                for col in PHASE_COLUMNS:
                    per_plan = np.array([s[col] for s in steps])
                    assert (per_plan == per_plan[0]).all(), (col, mode, per_plan)
                    np.testing.assert_allclose(got[col][0, b, i], per_plan, rtol=1e-12, atol=0)
                for col in ("allgather_ms", "reducescatter_ms", "p2p_ms", "alltoall_ms"):
                    assert steps[0][col] == 0.0
                for col in COMM_COLUMNS:
                    assert all(s[col] == 0 for s in steps) and not got[col].any()
                assert steps[0]["attn_fwd_ms"] > 0


def test_advise_says_the_methods_are_identical_at_cp_size_1():
    """``flashcp advise`` at cp_size 1: every method's step time and speedup range is llama3's
    (1.0), and the report says why in one line; at cp_size 2 it does not."""
    from flashcp.cli.advise import advise, format_report

    kw = dict(dataset="pile", context_len=4096, num_sequences=4, num_draws=2, draw_sequences=2)
    one = advise(cp_size=1, **kw)
    assert (one["step_ms_p50"] == one["step_ms_p50"].iloc[0]).all()
    for col in ("speedup_vs_llama3", "speedup_min", "speedup_max"):
        assert (one[col] == 1.0).all(), one[["method", col]]
    assert (one["comm_mib_per_rank"] == 0).all()
    note = [line for line in format_report(one).splitlines() if line.startswith("cp_size 1:")]
    assert len(note) == 1 and "identical" in note[0]
    assert "cp_size 1:" not in format_report(advise(cp_size=2, methods=["flashcp"], **kw))
