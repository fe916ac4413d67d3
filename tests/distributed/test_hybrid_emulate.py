"""``executor=emulate`` runs the hybrids (``usp``, ``flashcp_ulysses``): the in-process groups'
sub-groups stand in for the 2-D process groups, so every rank replays its real work. Replayed
outputs and gradients equal the float64 reference, counted bytes equal ``comm_volume``, and the
emulated collectives are priced as the simulator prices the same plan."""

from __future__ import annotations

import pytest
import torch

from flashcp.comm import AttnShape, comm_volume
from flashcp.executors.emulate import emulate_ranks, emulate_step
from flashcp.executors.emulate_record import RecordingGroup, _World
from flashcp.ops.reference import reference_attention
from flashcp.ops.sharding import shard_tensor
from flashcp.registry import COMM_KIND, make_plan_for
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS
from flashcp.sim import load_hardware, simulate

METHODS = ("usp", "flashcp_ulysses")
HW = load_hardware("h100_sxm")
# C = 2048 with 16 pad rows, CP 4, u = 2: a zero-length document, a long one split across groups
LENS, PAD = [300, 0, 900, 77, 5, 600, 150], 16


def _reference(full, lens, pad):
    """float64 out, dq, dk, dv of the packed (C, h, D) tensors, document by document (pad rows:
    output and gradients 0)."""
    leaves = [x.double().requires_grad_() for x in full[:3]]
    outs, start = [], 0
    for n in (x for x in lens if x):
        rows = slice(start, start + n)
        outs.append(reference_attention(*(x[rows] for x in leaves), [n]))
        start += n
    out = torch.cat(outs)
    out.backward(full[3][:start].double())
    out = torch.nn.functional.pad(out.detach(), (0, 0, 0, 0, 0, pad))
    return [out, *(x.grad for x in leaves)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("hkv", [2, 1])  # r = 1, and KV heads replicated (1 KV head, u = 2)
def test_replayed_ranks_equal_the_float64_reference(method, hkv):
    n, shape = 4, AttnShape(4, hkv, 8, "float64")
    plan = make_plan_for(method, LENS, n, num_pad=PAD, ulysses_degree=2)
    assert plan.context_len == 2048
    reps = emulate_ranks(plan, shape, "train", HW, backend="reference", warmup=0, iters=1,
                         seed=7)  # fmt: skip
    gen = torch.Generator().manual_seed(7)  # the tensors seeded_inputs drew
    full = [torch.randn(2048, h, 8, generator=gen, dtype=torch.float64) for h in (4, hkv, hkv, 4)]
    want = _reference(full, LENS, PAD)
    for rep in reps:
        assert rep.comm == comm_volume(plan, COMM_KIND[method], shape, "train")
        for what, got, w in zip(("out", "dq", "dk", "dv"), rep.outputs, want, strict=True):
            err = float((got - shard_tensor(w, plan, rep.rank)).abs().max())
            assert err < 1e-12, f"{method} rank {rep.rank} {what}: max error {err}"


@pytest.mark.parametrize("method", METHODS)
def test_bytes_and_collective_times_equal_the_simulators(method):
    """The group all-to-alls (u = 2 ranks) and the all-gather / reduce-scatter across the groups
    (N/u = 2 super-ranks) are priced at their own group's size, as the simulator prices them
    (buffers above the profile's smallest falloff point, where the size matters)."""
    plan = make_plan_for(method, LENS, 4, num_pad=PAD, ulysses_degree=2)
    shape = AttnShape(8, 2, 16, "float32")
    for mode in ("train", "infer"):
        row = emulate_step(plan, shape, mode, HW, backend="cpu", warmup=0, iters=1, seed=3)
        sim = simulate(plan, shape, HW, mode)
        assert set(row) == set(sim) == set(PHASE_COLUMNS) | set(COMM_COLUMNS)
        want = comm_volume(plan, COMM_KIND[method], shape, mode)
        assert {k: row[k] for k in COMM_COLUMNS} == {k: sim[k] for k in COMM_COLUMNS} == want
        assert want["alltoall_bytes"] > 0 and want["comm_bytes"] > want["alltoall_bytes"]
        for col in ("alltoall_ms", "allgather_ms", "reducescatter_ms"):
            assert row[col] == pytest.approx(sim[col], rel=1e-9), col
        assert row["alltoall_ms"] > 0 and (row["allgather_ms"] > 0) == (method != "usp")


def test_subgroup_ranks_are_checked():
    group = RecordingGroup(_World(4, 1.0, set()), 1)
    sub = group.new_subgroup([1, 3])
    assert (sub.size(), sub.rank(), sub.world.ranks) == (2, 0, [1, 3])
    assert group.new_subgroup([1, 3]).world is sub.world  # every member meets in one group
    for bad, match in (([0, 2], "without itself"), ([3, 1], "ascending"), ([1, 4], "ascending"),
                       (["x"], "integers")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            group.new_subgroup(bad)
