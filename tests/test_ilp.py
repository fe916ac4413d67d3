"""The ILP planner against brute force, its honest status handling, and the refined heuristic."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest

from flashcp.heuristic import plan_flashcp
from flashcp.ilp import block_pieces, plan_ilp, plan_objective
from flashcp.plan import make_plan
from flashcp.refined import plan_flashcp_refined
from flashcp.registry import COMM_KIND, get_planner


def _brute_force(doc_lens, n, block_size, comm_weight, max_imbalance=None):
    """Minimum of the ILP objective over every assignment of the grid's pieces to ranks."""
    d = np.asarray(doc_lens, dtype=np.int64)
    pdoc, pstart, plen = block_pieces(d, block_size)
    tpr = int(d.sum()) // n
    best = np.inf
    for assign in itertools.product(range(n), repeat=pdoc.size):
        a = np.array(assign)
        if (np.bincount(a, weights=plen, minlength=n) != tpr).any():
            continue
        order = np.lexsort((pstart, pdoc, a))
        plan = make_plan("bf", n, d, a[order], pdoc[order], pstart[order], plen[order])
        if max_imbalance is not None and plan.imbalance_ratio > max_imbalance + 1e-12:
            continue
        best = min(best, plan_objective(plan, comm_weight))
    return best


def _solvers():
    out = ["cbc"]
    try:
        import highspy  # noqa: F401

        out.append("highs")
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("solver", _solvers())
@pytest.mark.parametrize(
    "doc_lens, n, block, weight, cap",
    [
        ([5, 3, 4, 2, 2], 2, 2, 1.0, None),
        ([7, 1, 4, 2, 2], 2, 3, 0.2, None),
        ([4, 3, 2, 3], 3, 2, 1.0, None),
        ([9, 2, 1], 3, 2, 0.5, None),
        ([6, 5, 3, 2], 2, 2, 5.0, 1.1),
    ],
)
def test_ilp_optimum_equals_brute_force(doc_lens, n, block, weight, cap, solver):
    expected = _brute_force(doc_lens, n, block, weight, cap)
    plan = plan_ilp(
        doc_lens,
        n,
        block_size=block,
        comm_weight=weight,
        max_imbalance=cap,
        solver=solver,
        gap=0.0,
        time_limit_s=30,
        warm_start=None,
    )
    plan.validate()
    assert plan.method == "ilp"
    assert plan.status == "ok" and plan.info["solver_status"] == "optimal"
    assert plan.info["objective"] == pytest.approx(expected, abs=1e-6)
    assert plan_objective(plan, weight) == pytest.approx(expected, abs=1e-6)
    # the model's objective is the plan's own metrics (both maxima tight at the optimum)
    assert plan.info["model_objective"] == pytest.approx(expected, abs=1e-5)
    assert plan.info["gap"] == pytest.approx(0.0, abs=1e-6)


def test_block_pieces_tile_documents_end_aligned():
    d = np.array([10, 3, 8, 1])
    doc, start, length = block_pieces(d, 4)
    # doc 0: 2 + 4 + 4; doc 1: 3; doc 2: 4 + 4; doc 3: 1
    assert doc.tolist() == [0, 0, 0, 1, 2, 2, 3]
    assert start.tolist() == [0, 2, 6, 0, 0, 4, 0]
    assert length.tolist() == [2, 4, 4, 3, 4, 4, 1]
    # extra cuts refine the grid without moving its points
    doc, start, length = block_pieces(d, 4, (np.array([0, 2, 1]), np.array([1, 5, 0])))
    assert start[doc == 0].tolist() == [0, 1, 2, 6]
    assert start[doc == 2].tolist() == [0, 4, 5]
    assert np.bincount(doc, weights=length).tolist() == d.tolist()
    with pytest.raises(ValueError, match="block_size"):
        block_pieces(d, 0)


def test_ilp_warm_start_never_worse_than_its_seed():
    rng = np.random.default_rng(0)
    d = rng.integers(1, 300, size=12)
    d[-1] += (-int(d.sum())) % 4
    seed = plan_flashcp(d, 4, target_imbalance=1.05)
    plan = plan_ilp(
        d, 4, block_size=64, time_limit_s=10, warm_start="flashcp", heuristic_target_imbalance=1.05
    )
    plan.validate()
    assert plan.status in ("ok", "time_limit")
    assert plan.info["objective"] <= plan_objective(seed) + 1e-9
    assert plan.info["seed_objective"] == pytest.approx(plan_objective(seed))


def test_infeasible_granularity_falls_back_with_a_warning():
    # pieces of 3, 3 and 2 tokens cannot give 4 tokens to each of 2 ranks
    with pytest.warns(RuntimeWarning, match="no solution"):
        plan = plan_ilp([3, 3, 2], 2, block_size=4, warm_start=None, time_limit_s=10)
    plan.validate()
    assert plan.method == "ilp"
    assert plan.status == "fallback"
    assert plan.info["solver_status"] == "infeasible"
    assert plan.info["fallback_method"] == "flashcp"
    assert plan.info["gap"] is None and plan.info["best_bound"] is None
    ref = plan_flashcp([3, 3, 2], 2)
    assert plan.digest() == ref.digest()
    with pytest.raises(ValueError, match="infeasible"):
        plan_ilp([3, 3, 2], 2, block_size=4, warm_start=None, on_failure="raise")


def test_time_limited_solve_is_not_reported_optimal():
    rng = np.random.default_rng(1)
    d = np.minimum(rng.lognormal(np.log(1500), 1.2, size=80).astype(np.int64) + 1, 20000)
    d[-1] += 32768 - int(d.sum()) % 32768
    d = d[np.cumsum(d) <= 32768 * (int(d.sum()) // 32768)]
    d = np.append(d, 32768 * 2 - int(d.sum()) % (32768 * 2)) if d.sum() % 65536 else d
    assert int(d.sum()) % 4 == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        plan = plan_ilp(d, 4, block_size=256, time_limit_s=1, warm_start="flashcp")
    plan.validate()
    assert plan.status in ("time_limit", "fallback")
    assert plan.info["solver_status"] != "optimal"
    if plan.status == "time_limit":
        assert plan.info["best_bound"] is None or plan.info["best_bound"] <= (
            plan.info["objective"] + 1e-6
        )


def test_ilp_rejects_bad_options():
    with pytest.raises(ValueError, match="solver"):
        plan_ilp([4, 4], 2, solver="gurobi")
    with pytest.raises(ValueError, match="on_failure"):
        plan_ilp([4, 4], 2, on_failure="ignore")
    with pytest.raises(ValueError, match="comm_weight"):
        plan_ilp([4, 4], 2, comm_weight=-1)
    with pytest.raises(ValueError, match="max_imbalance"):
        plan_ilp([4, 4], 2, max_imbalance=0.5)
    with pytest.raises(ValueError, match="divisible"):
        plan_ilp([4, 3], 2)


def _random_sequences(count, context_len, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        lens = []
        while sum(lens) < context_len:
            lens.append(int(min(rng.lognormal(np.log(900), 1.4) + 1, context_len)))
        lens[-1] -= sum(lens) - context_len
        out.append(np.array([x for x in lens if x > 0]))
    return out


@pytest.mark.parametrize("n", [2, 4, 8])
def test_refined_plans_are_valid_and_honest(n):
    for d in _random_sequences(15, 16384, seed=n):
        plan = plan_flashcp_refined(d, n, target_imbalance=1.02)
        plan.validate()
        assert plan.method == "flashcp_refined"
        if plan.status == "ok":
            assert plan.imbalance_ratio <= 1.02
        else:
            assert plan.status == "target_not_met" and plan.imbalance_ratio > 1.02
        paper = plan_flashcp(d, n, target_imbalance=1.02)
        if paper.status == "ok":
            # the paper's plan is one of the refined planner's candidates
            assert plan.status == "ok"
            assert plan.comm_tokens <= paper.comm_tokens


def test_refined_is_deterministic_and_rejects_bad_target():
    d = _random_sequences(1, 8192, seed=5)[0]
    a = plan_flashcp_refined(d, 4)
    b = plan_flashcp_refined(d, 4)
    assert a.digest() == b.digest()
    with pytest.raises(ValueError, match="target_imbalance"):
        plan_flashcp_refined(d, 4, target_imbalance=0.9)
    # edge cases: one rank, one document spanning the context, documents shorter than 2N
    for lens, n in [([8], 1), ([8, 4], 1), ([4096], 4), ([1] * 16, 4), ([96, 2, 1, 1], 4)]:
        plan_flashcp_refined(lens, n).validate()


def test_registry_knows_the_new_planners():
    assert COMM_KIND["ilp"] == COMM_KIND["flashcp_refined"] == "allgather_sharded"
    plan = get_planner("flashcp_refined")([8, 4, 2, 2], 2)
    plan.validate()
    plan = get_planner("ilp")([8, 4, 2, 2], 2, block_size=2, time_limit_s=10)
    plan.validate()
    assert plan.method == "ilp"


def test_run_table2_smoke(tmp_path):
    pytest.importorskip("flashcp.data")
    from experiments.table2 import run_table2

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summary = run_table2(
            1, context_len=16384, cp_size=4, time_limit_s=2, block_size=512, out_dir=str(tmp_path)
        )
    assert set(summary["method"]) == {
        "flashcp",
        "flashcp_refined",
        "ilp",
        "llama3",
        "per_doc",
        "ring",
        "zigzag",
    }
    for name in ("table2.csv", "table2_rows.csv", "table2.md", "table2.tex"):
        assert (tmp_path / name).stat().st_size > 0
    ilp = summary.set_index("method").loc["ilp"]
    assert ilp["ilp_optimal"] + ilp["ilp_time_limit"] + ilp["ilp_fallback"] == 1
