"""The ring passes' exchange schedule: what the step model charges per ring step against what the
project's ring op really has in flight (the package ring-flash-attn's schedule is held in
``tests/distributed/test_ring_flash_attn_peer.py``).

The op (:func:`flashcp.ops.ring_attn.ring_backward`) posts the next KV block at the start of
steps 0 .. N-2 and a dK/dV partial sum after the kernels of steps 1 .. N-1 (the owner keeps its
step-0 contribution): N - 1 dK/dV hops, N - 2 of them in flight over the next step's kernels, the
last one exposed. The model (:func:`flashcp.sim.cost.ring.ring_exchange_steps`) charges each
KV hop on the step it overlaps, each dK/dV hop one step early, and the last exposed: the same
counts. A model charging a dK/dV hop beside step 0 too (N hops of time) fails here.
"""

from __future__ import annotations

import numpy as np
import pytest

from flashcp.comm import AttnShape, ring_grad_hops
from flashcp.executors.work_trace import exchange_schedule, trace_work
from flashcp.registry import make_plan_for
from flashcp.sim.cost import PlanBatch, PlanCost, step_many
from flashcp.sim.cost.ring import ring_exchange_steps, ring_overlap_schedule
from flashcp.sim.hardware import load_hardware
from flashcp.sim.work import probe_profile

SHAPE = AttnShape(2, 1, 8, "float32")
HW = load_hardware("h100_sxm")


@pytest.mark.parametrize("method", ["ring", "zigzag"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_model_schedule_is_the_ops(method, n):
    """Per pass, the KV and dK/dV exchanges in flight over each step's kernels (and exposed) of
    the op's last rank, which calls a kernel at every step (one document over every rank),
    equal the model's."""
    plan = make_plan_for(method, np.array([16 * n]), n)
    (trace,) = trace_work(plan, SHAPE, "train", ranks=[n - 1])
    for phase, train in (("fwd", False), ("bwd", True)):
        steps = {e.step for e in trace.select("kernel", phase)}
        assert steps == set(range(n)), f"rank {n - 1} has kernels at steps {sorted(steps)}"
        got = exchange_schedule(trace, phase, n)
        want = ring_overlap_schedule(n, "ours", train)
        for kind in ("kv", "grad"):
            assert got[kind].tolist() == want[kind].tolist(), (phase, kind)
    assert ring_overlap_schedule(n, "ours", True)["grad"].sum() == ring_grad_hops(n, "ours")


def test_schedule_counts():
    """N - 1 dK/dV hops for the project's op (none beside step 0), N for ring-flash-attn, the
    last exposed; KV beside steps 0 .. N-2; nothing on one rank."""
    for n in (2, 5, 8):
        kv, grad = ring_exchange_steps(n, "ours", True)
        assert kv.tolist() == [1] * (n - 1) + [0]
        assert grad.tolist() == [0] + [1] * (n - 1)
        kv_r, grad_r = ring_exchange_steps(n, "ring_flash_attn", True)
        assert kv_r.tolist() == kv.tolist() and grad_r.tolist() == [1] * n
        assert ring_exchange_steps(n, "ours", False)[1].sum() == 0
    assert ring_exchange_steps(1, "ours", True)[0].sum() == 0
    with pytest.raises(ValueError, match=r"unknown method\.impl"):
        ring_exchange_steps(4, "nccl", True)


@pytest.mark.parametrize("impl", ["ours", "ring_flash_attn"])
def test_priced_hops_follow_the_schedule(impl):
    """With compute, host and bandwidth terms gone and 1 µs per hop (a probe profile), a pass's
    exposed P2P is its number of hops: forward N - 1; backward N - 1 KV hops plus
    ``ring_grad_hops`` dK/dV hops, per plan (``PlanCost.step``) and batched (``step_many``,
    the compiled pass where numba is there)."""
    from flashcp.sim.impl import impl_plan

    n = 4
    hw = probe_profile(HW, p2p_latency_us=1.0)
    docs = [64, 32, 32]
    if impl == "ours":
        plans = [make_plan_for(m, np.array(docs), n) for m in ("ring", "zigzag")]
    else:
        plans = [impl_plan(m, impl, docs, n)[0] for m in ("ring", "zigzag")]
    want = {"infer": n - 1, "train": 2 * (n - 1) + ring_grad_hops(n, impl)}
    for mode, hops in want.items():
        for plan in plans:
            got = PlanCost(plan, hw, "p2p_ring", impl).step(SHAPE, mode)["p2p_ms"] * 1e3
            assert got == pytest.approx(hops, rel=1e-6), (plan.method, mode)
        costs = [PlanCost(p, hw, "p2p_ring", impl) for p in plans]
        got = step_many(costs, SHAPE, mode)["p2p_ms"] * 1e3
        np.testing.assert_allclose(got, hops, rtol=1e-6)
    if impl == "ours":  # the batch of the sweeps (PlanBatch.phases)
        batch = PlanBatch(plans)
        vol = batch.volumes("p2p_ring", SHAPE, "train", 1, n, impl=impl)
        got = batch.phases(hw, "p2p_ring", impl, "ring", SHAPE, "train", vol)["p2p_ms"] * 1e3
        np.testing.assert_allclose(got, want["train"], rtol=1e-6)
