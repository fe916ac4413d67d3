"""The ILP's cap is met up to one stated tolerance (its own warm start at the cap is never
rejected), and a solve that the watchdog kills returns its warm start's plan."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from flashcp.planners.flashcp import plan_flashcp
from flashcp.planners.flashcp_refined import plan_flashcp_refined
from flashcp.planners.ilp import CAP_TOLERANCE, meets_cap, plan_ilp
from flashcp.planners.ilp.worker import _within_bounds


@pytest.mark.parametrize(
    "doc_lens",
    [
        [64, 64, 64, 64],  # one document per rank: imbalance exactly 1
        [256],  # one document cut into four: exactly balanced by Eq. 3 as well
    ],
)
def test_cap_of_one_accepts_its_own_warm_start(doc_lens):
    """max_imbalance = 1.0 on inputs a heuristic balances exactly: the seed's imbalance variable
    starts a hair above 1 and used to be refused by PuLP, falling back with a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback warning
        plan = plan_ilp(doc_lens, 4, max_imbalance=1.0, block_size=16, time_limit_s=20)
    assert plan.status == "ok" and plan.info["solver_status"] == "optimal"
    assert plan.info["warm_start_given"] and plan.info["warm_start_accepted"] is not False
    assert meets_cap(plan.imbalance_ratio, 1.0)


def test_tolerance_is_one_relative_constant():
    assert CAP_TOLERANCE == 1e-9
    assert meets_cap(1.0 + 1e-9, 1.0) and not meets_cap(1.0 + 1e-8, 1.0)
    assert meets_cap(1.05 * (1 + 1e-9), 1.05) and not meets_cap(1.0501, 1.05)
    assert meets_cap(7.0, None)

    class Var:
        lowBound, upBound = 0.0, 1.05

    assert _within_bounds(Var, 1.05 + 1e-10) == 1.05  # a rounding error: onto the bound
    assert _within_bounds(Var, 1.06) == 1.06  # a real violation is left for PuLP to name
    assert _within_bounds(Var, -1e-12) == 0.0 and _within_bounds(Var, 0.5) == 0.5


def _killed(doc_lens, **options):
    with pytest.warns(RuntimeWarning, match="killed") as caught:
        plan = plan_ilp(doc_lens, 4, time_limit_s=0.01, watchdog_grace_s=0.0, **options)
    assert plan.status == "fallback" and plan.info["solver_status"] == "killed"
    return plan, str(caught[0].message)


def _sampled():
    from flashcp.data import load_distribution, sample_sequences

    return sample_sequences(load_distribution("pile", context_len=16384), 1, 16384, seed=0)[0]


def test_a_killed_solve_returns_its_warm_start():
    """The watchdog kills the worker at once (a tiny kill timeout): the plan is the warm start's,
    here flashcp_refined's, which differs from flashcp's on this sequence."""
    lens = _sampled()
    refined = plan_flashcp_refined(lens, 4, target_imbalance=1.05)
    assert refined != plan_flashcp(lens, 4, target_imbalance=1.05)
    plan, message = _killed(lens)
    assert plan.info["seed_method"] == plan.info["fallback_method"] == "flashcp_refined"
    assert "returning the flashcp_refined heuristic's plan" in message
    assert plan.digest() == refined.digest()
    assert plan.info["heuristic_status"] == refined.status
    json.dumps(plan.to_dict())


def test_a_killed_solve_returns_the_warm_start_it_was_given():
    lens = np.array([3000, 500, 4100, 700, 7000, 1084])  # own input: 16384 tokens
    plan, _ = _killed(lens, warm_start="flashcp")
    assert plan.info["fallback_method"] == "flashcp"
    assert plan.digest() == plan_flashcp(lens, 4, target_imbalance=1.05).digest()
    plan, _ = _killed(lens, warm_start=None, max_imbalance=1.1)
    best = min(
        (
            plan_flashcp_refined(lens, 4, target_imbalance=1.1),
            plan_flashcp(lens, 4, target_imbalance=1.1),
        ),
        key=lambda p: (not meets_cap(p.imbalance_ratio, 1.1), p.imbalance_ratio - p.comm_saving),
    )  # fmt: skip  (ties: flashcp_refined, as the planner breaks them)
    assert plan.info["fallback_method"] == best.method and plan.digest() == best.digest()
