"""``ulysses`` through the three executors: ``sim``, ``emulate`` and ``dist`` emit the same columns
and count the same all-to-all bytes; emulate prices the all-to-alls with the simulator's formula;
the simulator's all-to-all time is checked by hand on a small case."""

from __future__ import annotations

import pytest
import torch
from mp_utils import run_ranks

from flashcp.comm import AttnShape, comm_volume
from flashcp.executors.dist import init_from_env, measure_step
from flashcp.executors.emulate import CommCall, compose_comm, emulate_ranks, emulate_step
from flashcp.ops.reference import reference_attention
from flashcp.registry import make_plan_for
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS
from flashcp.sim import load_hardware, simulate

LENS = [5, 40, 0, 3, 60, 1, 19]  # C = 128, one zero-length document
SHAPES = (AttnShape(4, 2, 8, "float32"), AttnShape(4, 1, 8, "float32"))  # r = 1 and r = 2
HW = load_hardware("h100_sxm")


def _dist_rows(rank, n):
    group = init_from_env(30)
    plan = make_plan_for("ulysses", LENS, n)
    return {
        (i, mode): measure_step(plan, s, mode, group=group, backend="cpu", iters=1, seed=3)
        for i, s in enumerate(SHAPES)
        for mode in ("train", "infer")
    }


def test_sim_emulate_and_dist_agree():
    n = 2
    dist_rows = run_ranks(_dist_rows, n, timeout_s=120)[0]
    plan = make_plan_for("ulysses", LENS, n)
    for i, shape in enumerate(SHAPES):
        for mode in ("train", "infer"):
            row = emulate_step(plan, shape, mode, HW, backend="cpu", warmup=0, iters=1, seed=3)
            sim = simulate(plan, shape, HW, mode)
            # dist adds the checksum of its outputs (flashcp.results.DIST_COLUMNS)
            assert set(row) == set(sim) == set(dist_rows[i, mode]) - {"out_checksum"}
            assert set(row) == set(PHASE_COLUMNS) | set(COMM_COLUMNS)
            want = comm_volume(plan, "alltoall", shape, mode)
            assert want["alltoall_bytes"] == want["comm_bytes"] > 0
            assert {k: row[k] for k in COMM_COLUMNS} == {k: sim[k] for k in COMM_COLUMNS} == want
            assert {k: dist_rows[i, mode][k] for k in COMM_COLUMNS} == want
            # the emulated all-to-alls are priced by the simulator's formula on the same buffers
            assert row["alltoall_ms"] == pytest.approx(sim["alltoall_ms"], rel=1e-9)
            assert row["allgather_ms"] == row["p2p_ms"] == sim["p2p_ms"] == 0.0
            assert (row["attn_bwd_ms"] > 0) == (mode == "train")


def test_emulated_ranks_equal_the_float64_reference():
    n, shape = 4, AttnShape(8, 2, 8, "float64")  # 2 KV heads over 4 ranks: replicated
    plan = make_plan_for("ulysses", LENS, n)
    reps = emulate_ranks(plan, shape, "train", HW, backend="reference", warmup=0, iters=1,
                         seed=5, ranks=[0, 3])  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    full = [torch.randn(128, h, 8, generator=gen, dtype=torch.float64) for h in (8, 2, 2, 8)]
    leaves = [x.clone().requires_grad_() for x in full[:3]]
    ref = reference_attention(*leaves, [x for x in LENS if x])
    ref.backward(full[3])
    want = [ref.detach(), *(x.grad for x in leaves)]
    for rep in reps:
        rows = slice(32 * rep.rank, 32 * rep.rank + 32)  # contiguous chunks
        for got, w in zip(rep.outputs, want, strict=True):
            assert float((got - w[rows]).abs().max()) < 1e-12


def test_sim_alltoall_time_by_hand():
    """C = 1024, N = 4, H = 8, Hkv = 8, D = 64, bf16, inference: rank buffers of 256 rows; q, k, v
    go in one all-to-all of 256 x 24 x 64 x 2 B, the output back in one of 256 x 8 x 64 x 2 B;
    each receives 3/4 of its buffer at the all-to-all bus bandwidth after collective_latency_us, with the
    all-gather's per-size falloff of the profile."""
    plan = make_plan_for("ulysses", [1000, 24], 4)
    shape = AttnShape(8, 8, 64, "bfloat16")
    got = simulate(plan, shape, HW, "infer")
    total = 0.0
    for nbytes in (256 * 24 * 64 * 2, 256 * 8 * 64 * 2):
        # bytes per µs: the all-to-all bus bandwidth with the all-gather's per-size falloff
        bw = HW.alltoall_busbw_gbps * 1e3 * HW.busbw_fraction(nbytes, "all_gather")
        total += HW.collective_latency_us + 0.75 * nbytes / bw
    assert got["alltoall_ms"] == pytest.approx(total / 1e3, rel=1e-12)
    assert got["alltoall_bytes"] == 0.75 * (256 * 24 * 64 * 2 + 256 * 8 * 64 * 2)
    # every rank runs every document for H / N = 2 heads: the kernel of one rank of ulysses is
    # the whole-sequence kernel with 2 heads
    one = simulate(make_plan_for("ulysses", [1000, 24], 1), AttnShape(2, 2, 64, "bfloat16"),
                   HW, "infer")  # fmt: skip
    assert got["attn_fwd_ms"] == pytest.approx(one["attn_fwd_ms"], rel=1e-12)


def test_compose_comm_prices_alltoall():
    b = 48 << 20
    got = compose_comm(10.0, [CommCall("alltoall", b, 1.0, 2.0)], HW, 8)
    model = HW.alltoall_us(b, b * 8 / 7) / 1e3
    assert got["alltoall_ms"] == pytest.approx(model)
    assert got["total_ms"] == pytest.approx(10.0 - 1.0 + model)
