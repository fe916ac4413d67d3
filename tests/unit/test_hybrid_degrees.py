"""The two ends of a hybrid's Ulysses degree run (and are priced as) their plain method.

u = N: one group holding every document whole is plain Ulysses: the op runs Ulysses' forward and
backward over the group (no one-rank ring or all-gather, with their merges and buffers), and the
simulator prices it as ``ulysses`` on the same tokens, per plan and batched. u = 1: groups of one
rank are the inner method alone: no all-to-all and no packing copies in the op, and the same price
as the inner method's plan.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import flashcp.ops.hybrid_attn as hybrid_attn
from flashcp.comm import AttnShape, comm_volume
from flashcp.executors.emulate import emulate_ranks
from flashcp.registry import COMM_KIND, make_plan_for
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS
from flashcp.sim import load_hardware, simulate
from flashcp.sim.cost import price_plans

METHODS = ("usp", "flashcp_ulysses")
INNER = {"usp": "zigzag", "flashcp_ulysses": "flashcp"}
HW = load_hardware("h100_sxm")
LENS = [30000, 2000, 50000, 49072]  # C = 131072
# MHA, GQA, and one KV head replicated over the group
SHAPES = [AttnShape(32, 32, 128, "bfloat16"), AttnShape(32, 8, 128, "bfloat16"),
          AttnShape(16, 1, 128, "bfloat16")]  # fmt: skip


def _close(got, want, what):
    for col in PHASE_COLUMNS:
        assert got[col] == pytest.approx(want[col], rel=1e-12, abs=0), f"{what}: {col}"
    for col in COMM_COLUMNS:
        assert got[col] == want[col], f"{what}: {col}"


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cp_size", [4, 8])
def test_one_group_is_priced_as_ulysses(method, cp_size):
    """u = N: every phase of the step equals ``ulysses``' on the same documents (the one-rank
    ring's merges and the one-rank all-gather's copies are not paid), per plan and batched."""
    ulysses = make_plan_for("ulysses", LENS, cp_size)
    plan = make_plan_for(method, LENS, cp_size, ulysses_degree=cp_size)
    for shape in SHAPES:
        for mode in ("train", "infer"):
            want = simulate(ulysses, shape, HW, mode)
            _close(simulate(plan, shape, HW, mode), want, f"{method} {shape} {mode}")
    got = price_plans([plan, ulysses], SHAPES, ["train", "infer"], HW)
    for col in (*PHASE_COLUMNS, *COMM_COLUMNS):
        np.testing.assert_allclose(got[col][..., 0], got[col][..., 1], rtol=1e-12, atol=0)


@pytest.mark.parametrize("method", METHODS)
def test_degree_one_is_priced_as_the_inner_method(method):
    """u = 1: no all-to-all is priced; the step is the inner method's on the same layout."""
    plan = make_plan_for(method, LENS, 4, ulysses_degree=1)
    inner = replace(plan, method=INNER[method])
    for shape in SHAPES:
        for mode in ("train", "infer"):
            got = simulate(plan, shape, HW, mode)
            assert got["alltoall_ms"] == 0 and got["alltoall_bytes"] == 0
            _close(got, simulate(inner, shape, HW, mode), f"{method} {shape} {mode}")


def _spy(monkeypatch, *names):
    """Count calls of hybrid_attn's module-level functions ``names`` (still running them)."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        fn = getattr(hybrid_attn, name)

        def counted(*a, _fn=fn, _name=name, **kw):
            calls[_name] += 1
            return _fn(*a, **kw)

        monkeypatch.setattr(hybrid_attn, name, counted)
    return calls


def _replay(plan, shape, seed=5):
    reps = emulate_ranks(plan, shape, "train", HW, backend="reference", warmup=0, iters=1,
                         seed=seed)  # fmt: skip
    want = comm_volume(plan, COMM_KIND[plan.method], shape, "train")
    assert all(rep.comm == want for rep in reps)
    return reps


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("hkv", [4, 1])  # KV heads whole, and replicated (1 KV head over 4)
def test_one_group_runs_plain_ulysses(method, hkv, monkeypatch):
    """u = N: the op calls Ulysses' forward and backward, never the inner op; its outputs and
    gradients are Ulysses' bit for bit (float64) and its bytes those of the plan."""
    lens, n = [40, 0, 7, 30, 51], 4  # C = 128
    shape = AttnShape(4, hkv, 8, "float64")
    want = _replay(make_plan_for("ulysses", lens, n), shape)
    calls = _spy(monkeypatch, "ulysses_forward", "ulysses_backward", "ring_forward",
                 "allgather_attn_forward", "ring_backward", "allgather_attn_backward")  # fmt: skip
    got = _replay(make_plan_for(method, lens, n, ulysses_degree=n), shape)
    assert calls["ulysses_forward"] == calls["ulysses_backward"] > 0, calls
    assert sum(calls.values()) == 2 * calls["ulysses_forward"], calls
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.outputs, w.outputs, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("method", METHODS)
def test_degree_one_runs_the_inner_op_alone(method, monkeypatch):
    """u = 1: no all-to-all (and none of its packing copies); outputs equal the inner method's op
    on the same layout (float64), bytes those of the plan (no all-to-all bytes)."""
    lens, n, pad = [40, 0, 7, 30, 46], 4, 5  # C = 128, pad rows on the last rank
    shape = AttnShape(4, 2, 8, "float64")
    plan = make_plan_for(method, lens, n, ulysses_degree=1, num_pad=pad)
    want = _replay(make_plan_for(INNER[method], lens, n, num_pad=pad), shape)
    calls = _spy(monkeypatch, "scatter_heads", "gather_heads")
    got = _replay(plan, shape)
    assert calls == {"scatter_heads": 0, "gather_heads": 0}
    assert got[0].comm["alltoall_bytes"] == 0
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.outputs, w.outputs, strict=True):
            assert float((a - b).abs().max()) < 1e-12
