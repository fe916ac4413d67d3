"""One plan per CP group: :func:`flashcp.ops.collectives.plan_on_one_rank` /
:func:`~flashcp.ops.collectives.broadcast_plan` on gloo ranks (two strided CP groups of a world of
4, a planning rank other than 0), a planner failure raised on every rank, bad arguments as
one-line errors on every rank, and the one-process path."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from mp_utils import run_ranks

from flashcp.ops.collectives import PlanningFailed, broadcast_plan, plan_on_one_rank
from flashcp.registry import make_plan_for

LENS = [5, 40, 3, 60, 1, 19]  # C = 128


def _lens(rank: int) -> list[int]:
    """Document lengths that differ per global rank: a planner whose plan depends on where it
    runs, as a time-limited ILP's may."""
    return [5 + rank, 40, 19 - rank, 64]


def _broadcast(rank, world):
    made = [dist.new_group(g) for g in ([0, 2], [1, 3])]
    group = made[rank % 2]
    me = dist.get_rank(group)
    calls = []

    def planner():
        calls.append(rank)
        return make_plan_for("per_doc", _lens(rank), 2)

    out = {"plan": plan_on_one_rank(planner, group, src=1).digest(), "calls": len(calls)}

    def failing():
        raise ValueError("no plan for this batch")

    for name, call in {
        "failed": lambda: plan_on_one_rank(failing, group),
        "src": lambda: broadcast_plan(None, group, src=2),
        "not a plan": lambda: broadcast_plan("a plan" if me == 0 else None, group),
    }.items():
        try:
            call()
        except (PlanningFailed, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    # the group still works after the failures: every rank took part in the same collectives
    plan = make_plan_for("zigzag", LENS, 2) if me == 0 else None
    out["again"] = broadcast_plan(plan, group).digest()
    return out


def test_one_rank_plans_and_every_rank_of_its_group_gets_the_plan():
    res = run_ranks(_broadcast, 4, timeout_s=60)
    for r in range(4):
        src = 2 if r % 2 == 0 else 3  # group rank 1 of {0, 2} and {1, 3}
        assert res[r]["plan"] == make_plan_for("per_doc", _lens(src), 2).digest()
        assert res[r]["calls"] == (1 if r == src else 0)
        assert res[r]["failed"] == "PlanningFailed: ValueError: no plan for this batch"
        assert res[r]["src"] == "ValueError: src must be a rank of the group, in [0, 2), got 2"
        assert res[r]["not a plan"].startswith(
            "ValueError: broadcast_plan: the planning rank passed str, not a Plan"
        )
        assert res[r]["again"] == make_plan_for("zigzag", LENS, 2).digest()


def test_one_process_plans_here():
    plan = make_plan_for("flashcp", LENS, 2)
    assert broadcast_plan(plan) is plan
    assert plan_on_one_rank(lambda: plan) is plan
    with pytest.raises(PlanningFailed, match="ValueError: no plan"):
        plan_on_one_rank(lambda: (_ for _ in ()).throw(ValueError("no plan")))
    with pytest.raises(ValueError, match="src must be a rank of the group"):
        broadcast_plan(plan, src=1)
