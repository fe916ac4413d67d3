"""Every op on a CP group that is not the whole world: two CP groups of 2 in a world of 4
(contiguous {0,1},{2,3}, strided {0,2},{1,3}, and the same from a torch DeviceMesh), and the
hybrids' 2-D groups in a world of 8 with two CP groups of 4 (Ulysses degree 2: intra and cross
groups of 2 each). Outputs and gradients against the float64 reference; each CP group runs its own
inputs, so a group that mixed ranks of another would show. Plans are made here once and handed to
the ranks (forked gloo processes, a timeout on every collective: ``tests/mp_utils.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from mp_utils import run_ranks
from test_ulysses_attn import _inputs, _maxerr, _reference

from flashcp.comm import AttnShape, comm_volume
from flashcp.ops import get_attn_op
from flashcp.ops.collectives import CommCounter
from flashcp.ops.hybrid_attn import hybrid_groups
from flashcp.ops.sharding import shard_tensor, unshard
from flashcp.registry import COMM_KIND, METHODS, make_plan_for

HYBRIDS = ("usp", "flashcp_ulysses")
LENS = [5, 21, 2, 9, 27]  # C = 64
H, HKV, D = 4, 2, 8

#: layout -> the CP groups (global ranks, each in group-rank order) of a world of 4 or 8
LAYOUTS = {
    "contiguous": [[0, 1], [2, 3]],
    "strided": [[0, 2], [1, 3]],
    "mesh-contiguous": [[0, 1], [2, 3]],
    "mesh-strided": [[0, 2], [1, 3]],
    "world8-contiguous": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "world8-strided": [[0, 2, 4, 6], [1, 3, 5, 7]],
}


def _plans(n: int, methods) -> dict:
    """(method, degree) -> plan over ``n`` ranks; hybrids at every degree dividing n."""
    out = {}
    for m in methods:
        degrees = [u for u in (1, 2, 4) if n % u == 0] if m in HYBRIDS else [None]
        for u in degrees:
            opts = {} if u is None else {"ulysses_degree": u}
            out[m, u] = make_plan_for(m, LENS, n, **opts)
    return out


def _cp_group(rank: int, layout: str):
    """This process's CP group (every process makes every group, in one order, as torch asks)
    and the group's index; a DeviceMesh's CP dimension for the ``mesh-*`` layouts."""
    groups = LAYOUTS[layout]
    mine = next(i for i, g in enumerate(groups) if rank in g)
    if layout.startswith("mesh-"):
        from torch.distributed.device_mesh import init_device_mesh

        names = ("dp", "cp") if layout == "mesh-contiguous" else ("cp", "dp")
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        return mesh["cp"], mine
    made = [dist.new_group(g) for g in groups]
    return made[mine], mine


def _run(rank, world, layout, plans, upfront):
    group, gi = _cp_group(rank, layout)
    me = LAYOUTS[layout][gi].index(rank)  # this process's rank in its CP group
    res = {}
    for (m, u), plan in plans.items():
        q, k, v, dout = _inputs(plan.context_len, H, HKV, D, torch.float64, seed=gi)
        prepare, attn = get_attn_op(m)
        g = hybrid_groups(u, group) if upfront and m in HYBRIDS else group
        ql, kl, vl = (shard_tensor(x, plan, me).requires_grad_() for x in (q, k, v))
        counter = CommCounter()
        out = attn(ql, kl, vl, prepare(plan, me), g, backend="reference", counter=counter)
        out.backward(shard_tensor(dout, plan, me))
        res[m, u] = (out.detach(), ql.grad, kl.grad, vl.grad, counter.as_dict())
    return res


def _check(layout: str, plans: dict, per_rank: list) -> list[str]:
    failures = []
    shape = AttnShape(H, HKV, D, "float64")
    for gi, ranks in enumerate(LAYOUTS[layout]):
        for (m, u), plan in plans.items():
            q, k, v, dout = _inputs(plan.context_len, H, HKV, D, torch.float64, seed=gi)
            ref = _reference(q, k, v, LENS, dout, 0)
            got = [unshard([per_rank[r][m, u][t] for r in ranks], plan) for t in range(4)]
            for t, what in enumerate(("out", "dq", "dk", "dv")):
                err = _maxerr(got[t], ref[t])
                if not err <= 1e-12:
                    failures.append(f"{layout} group {ranks} {m} u={u}: {what} error {err:.3g}")
            want = comm_volume(plan, COMM_KIND[m], shape, "train")
            for r in ranks:
                if per_rank[r][m, u][4] != want:
                    failures.append(f"{layout} {m} u={u} rank {r}: counted {per_rank[r][m, u][4]}")
    return failures


@pytest.mark.parametrize("layout", ["contiguous", "strided", "mesh-contiguous", "mesh-strided"])
def test_every_method_on_two_cp_groups_of_a_world_of_4(layout):
    """Every registered method, its plan's ranks being CP-group ranks (the strided groups put
    group rank 1 on global rank 2 or 3): the hybrids make their 2-D groups inside the op."""
    plans = _plans(2, METHODS)
    per_rank = run_ranks(_run, 4, layout, plans, False, timeout_s=60)
    failures = _check(layout, plans, per_rank)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    ("layout", "upfront"),
    [
        ("world8-contiguous", False),
        ("world8-strided", True),
        pytest.param("world8-contiguous", True, marks=pytest.mark.slow),
        pytest.param("world8-strided", False, marks=pytest.mark.slow),
    ],
)
def test_hybrids_on_two_cp_groups_of_4_in_a_world_of_8(layout, upfront):
    """``usp`` / ``flashcp_ulysses`` with Ulysses degree 2 on CP groups of 4 (G = 2 groups of 2:
    intra and cross groups of 2 in each CP group), every degree: the 2-D groups of both CP groups
    are made by every process in one order, by the op's first call or by ``hybrid_groups`` up
    front (``upfront``). About 2 s each on 2 cores."""
    plans = _plans(4, HYBRIDS)
    per_rank = run_ranks(_run, 8, layout, plans, upfront, timeout_s=60)
    failures = _check(layout, plans, per_rank)
    assert not failures, "\n".join(failures)


def _bad_groups(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from flashcp.ops.collectives import resolve_group

    errors = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    a, b, c = (dist.new_group(g) for g in ([0, 1], [2, 3], [1, 2]))
    calls = {
        "2-D mesh": lambda: resolve_group(mesh),
        "string": lambda: resolve_group("cp"),
        # not this process's group: torch gives non-members GroupMember.NON_GROUP_MEMBER
        "not a member": lambda: resolve_group(b if rank < 2 else a),
        # every process calls; rank 3's degree does not divide its group: every rank raises
        "degree": lambda: hybrid_groups(3 if rank == 3 else 2, mesh["cp"]),
        # {0, 1} (rank 0), {1, 2} (ranks 1, 2), {2, 3} (rank 3): not a partition of the job
        "overlap": lambda: hybrid_groups(2, {0: a, 1: c, 2: c, 3: b}[rank]),
    }
    for name, call in calls.items():
        try:
            call()
        except ValueError as exc:
            errors[name] = str(exc)
    return errors


def test_bad_groups_are_one_line_errors_on_every_rank():
    per_rank = run_ranks(_bad_groups, 4, timeout_s=60)
    for errors in per_rank:
        assert "pass one of its dimensions" in errors["2-D mesh"], errors
        assert "a ProcessGroup, a 1-D DeviceMesh" in errors["string"], errors
        assert "not a member of the process group" in errors["not a member"], errors
        assert "ulysses_degree = 3 does not divide the 2 ranks" in errors["degree"], errors
        assert "the CP groups of the job overlap" in errors["overlap"], errors
