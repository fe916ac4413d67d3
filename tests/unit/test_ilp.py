"""The ILP planner against brute force, its honest status handling, and the refined heuristic."""

from __future__ import annotations

import functools
import itertools
import json
import os
import stat
import tempfile
import time
import warnings

import numpy as np
import pytest

from flashcp.plan import make_plan
from flashcp.planners.flashcp import plan_flashcp
from flashcp.planners.flashcp_refined import plan_flashcp_refined
from flashcp.planners.ilp import FORMULATIONS, block_pieces, plan_ilp, plan_objective
from flashcp.planners.ilp.worker import _cbc_log
from flashcp.registry import COMM_KIND, get_planner


@functools.cache
def _brute_force(doc_lens: tuple, n, block_size, comm_weight, max_imbalance=None):
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


@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize("solver", _solvers())
@pytest.mark.parametrize(
    "doc_lens, n, block, weight, cap",
    [
        ([5, 3, 4, 2, 2], 2, 2, 1.0, None),
        ([7, 1, 4, 2, 2], 2, 3, 0.2, None),
        ([4, 3, 2, 3], 3, 2, 1.0, None),
        ([9, 2, 1], 3, 2, 0.5, None),
        ([6, 5, 3, 2], 2, 2, 5.0, 1.1),
        ([2, 2, 2, 4, 1, 1], 3, 2, 3.0, 1.3),  # equal single-piece documents: aggregated
        ([12, 2, 2], 2, 2, 1.0, 1.2),  # a document heavier than any rank's budget
    ],
)
def test_ilp_optimum_equals_brute_force(doc_lens, n, block, weight, cap, solver, formulation):
    expected = _brute_force(tuple(doc_lens), n, block, weight, cap)
    plan = plan_ilp(
        doc_lens,
        n,
        block_size=block,
        comm_weight=weight,
        max_imbalance=cap,
        solver=solver,
        formulation=formulation,
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


@pytest.mark.parametrize("seed", [0, 1, pytest.param(2, marks=pytest.mark.slow)])
def test_formulations_agree_on_random_instances(seed):
    rng = np.random.default_rng(seed)
    d = rng.integers(1, 40, size=int(rng.integers(4, 8)))
    d[-1] += (-int(d.sum())) % 3
    objectives = []
    for formulation in FORMULATIONS:
        plan = plan_ilp(
            d, 3, block_size=8, max_imbalance=1.1, gap=0.0, time_limit_s=60,
            formulation=formulation, warm_start="best", lp_rounding=False,
        )  # fmt: skip
        assert plan.status == "ok", plan.info
        objectives.append(plan.info["objective"])
    assert objectives[0] == pytest.approx(objectives[1], abs=1e-6)


def test_default_ilp_respects_the_heuristic_imbalance_target():
    # the paper's ILP balances load: {1024} | {512, 512} (ratio 1.33) is not acceptable
    plan = get_planner("ilp")([1024, 512, 512], 2)
    plan.validate()
    assert plan.status == "ok"
    assert plan.info["max_imbalance"] == 1.05
    assert plan.imbalance_ratio <= 1.05 + 1e-12
    # without the cap, the weighting alone decides (the old behaviour, now explicit)
    free = plan_ilp([1024, 512, 512], 2, max_imbalance=None, warm_start=None)
    assert free.imbalance_ratio == pytest.approx(524800 / 393728)


def _fake_solver(tmp_path, body: str) -> str:
    path = tmp_path / "fake_cbc"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read()
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to check the process")
def test_watchdog_kills_a_hung_solver_and_cleans_up(tmp_path, monkeypatch):
    pid_file = tmp_path / "pid"
    # long enough that only the watchdog ends it (its status then reads "killed")
    fake = _fake_solver(tmp_path, f"echo $$ > {pid_file}\nexec sleep 120")
    work = tmp_path / "tmp"
    work.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(work))
    with pytest.warns(RuntimeWarning, match="killed"):
        plan = plan_ilp(
            [8, 4, 2, 2], 2, block_size=2, time_limit_s=1, watchdog_grace_s=1, solver_path=fake
        )
    plan.validate()
    assert plan.status == "fallback" and plan.info["solver_status"] == "killed"
    # the warm start's plan (the better heuristic at the cap), not necessarily flashcp's
    assert plan.info["fallback_method"] == plan.info["seed_method"]
    seed = get_planner(plan.info["seed_method"])([8, 4, 2, 2], 2, target_imbalance=1.05)
    assert plan.digest() == seed.digest()
    pid = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is delivered asynchronously
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid)
    assert list(work.iterdir()) == []  # no *-pulp.mps / .mst, no job folder left
    with pytest.raises(ValueError, match="killed"):
        plan_ilp([8, 4, 2, 2], 2, block_size=2, time_limit_s=1, watchdog_grace_s=0,
                 solver_path=fake, on_failure="raise")  # fmt: skip


def test_crashing_solver_falls_back(tmp_path):
    fake = _fake_solver(tmp_path, "exit 3")
    with pytest.warns(RuntimeWarning, match="no solution"):
        plan = plan_ilp([8, 4, 2, 2], 2, block_size=2, time_limit_s=10, solver_path=fake)
    assert plan.status == "fallback" and plan.info["solver_status"] == "not_solved"


def test_cbc_warm_start_acceptance_is_read_from_its_log(tmp_path):
    log = tmp_path / "cbc.log"
    log.write_text(
        "MIPStart values read for 350 variables.\n"
        "Cbc0045I MIPStart provided solution with cost 1.05316\nLower bound: 1.0123\n"
    )
    assert _cbc_log(str(log)) == (1.0123, True)
    log.write_text(
        "MIPStart values read for 350 variables.\n"
        "Warning: mipstart values could not be used to build a solution.\n"
    )
    assert _cbc_log(str(log)) == (None, False)
    log.write_text("Result - Optimal solution found\n")
    assert _cbc_log(str(log)) == (None, None)


@pytest.mark.parametrize("solver", _solvers())
def test_warm_start_acceptance_is_recorded(solver):
    d = [5000, 3000, 4000, 2000, 2000] * 3
    plan = plan_ilp(d, 2, block_size=512, time_limit_s=30, gap=0.01, solver=solver)
    assert plan.info["warm_start_given"] is True
    assert plan.info["warm_start_accepted"] is True
    assert plan.info["objective"] <= plan.info["seed_objective"] + 1e-9
    cold = plan_ilp(
        [8, 4, 2, 2], 2, block_size=2, warm_start=None, max_imbalance=None, solver=solver
    )
    assert cold.info["warm_start_given"] is False and cold.info["warm_start_accepted"] is None


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


@pytest.mark.slow
def test_ilp_warm_start_never_worse_than_its_seed():
    rng = np.random.default_rng(0)
    d = rng.integers(1, 300, size=12)
    d[-1] += (-int(d.sum())) % 4
    seed = plan_flashcp(d, 4, target_imbalance=1.05)
    plan = plan_ilp(d, 4, block_size=64, time_limit_s=5, gap=0.01, warm_start="flashcp")
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
    # no warm start: the better of the two heuristics at the cap
    assert plan.info["fallback_method"] in ("flashcp", "flashcp_refined")
    assert plan.info["gap"] is None and plan.info["best_bound"] is None
    ref = get_planner(plan.info["fallback_method"])([3, 3, 2], 2, target_imbalance=1.05)
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
    with pytest.raises(ValueError, match="formulation"):
        plan_ilp([4, 4], 2, formulation="columns")
    with pytest.raises(ValueError, match="warm_start"):
        plan_ilp([4, 4], 2, warm_start="llama3")
    with pytest.raises(ValueError, match="highs_options need solver='highs'"):
        plan_ilp([4, 4], 2, solver="cbc", highs_options={"mip_heuristic_effort": 0.5})
    if "highs" in _solvers():
        with pytest.raises(ValueError, match="no_such_option"):
            plan_ilp([4, 4], 2, solver="highs", highs_options={"no_such_option": 1})
        with pytest.raises(ValueError, match="mip_heuristic_effort"):
            plan_ilp([4, 4], 2, solver="highs", highs_options={"mip_heuristic_effort": -3.0})


@pytest.mark.skipif("highs" not in _solvers(), reason="needs highspy")
def test_highs_options_reach_the_solver_and_keep_the_optimum():
    d, n, block, weight, cap = [6, 5, 3, 2], 2, 2, 5.0, 1.1
    expected = _brute_force(tuple(d), n, block, weight, cap)
    plan = plan_ilp(
        d, n, block_size=block, comm_weight=weight, max_imbalance=cap, solver="highs",
        gap=0.0, time_limit_s=30, warm_start=None,
        highs_options={"mip_heuristic_effort": 1.0, "mip_detect_symmetry": False},
    )  # fmt: skip
    assert plan.status == "ok"
    assert plan.info["objective"] == pytest.approx(expected, abs=1e-6)
    assert plan.info["highs_options"] == {"mip_heuristic_effort": 1.0, "mip_detect_symmetry": False}
    # the options reach the solver process: a cutoff below the optimum leaves no solution
    with pytest.warns(RuntimeWarning, match="no solution"):
        cut = plan_ilp(
            d, n, block_size=block, comm_weight=weight, max_imbalance=cap, solver="highs",
            gap=0.0, time_limit_s=30, warm_start=None,
            highs_options={"objective_bound": expected - 0.5},
        )  # fmt: skip
    assert cut.status == "fallback"


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


@pytest.mark.slow  # run_table2 end to end; tests/app's table2 tests run it too
def test_run_table2_smoke(tmp_path):
    pytest.importorskip("flashcp.data")
    import pandas as pd

    from experiments.table2 import run_table2

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summary = run_table2(
            1,
            context_len=16384,
            cp_size=4,
            time_limit_s=2,
            block_size=512,
            out_dir=str(tmp_path),
            solver="highs",
            highs_options={"random_seed": 7, "mip_heuristic_effort": 0.5},
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
    # the options as JSON in both CSVs (not a Python repr), read back to the same mapping
    for name in ("table2.csv", "table2_rows.csv"):
        cells = set(pd.read_csv(tmp_path / name)["ilp_highs_options"])
        assert cells == {'{"mip_heuristic_effort": 0.5, "random_seed": 7}'}, (name, cells)
        assert json.loads(cells.pop()) == {"random_seed": 7, "mip_heuristic_effort": 0.5}


@pytest.mark.parametrize(
    "planner, opts",
    [(plan_flashcp_refined, {}), (plan_ilp, {"block_size": 2, "time_limit_s": 10})],
)
def test_refined_and_ilp_share_the_zero_length_and_pad_handling(planner, opts):
    assert planner.is_planner_entry
    plan = planner([8, 0, 4, 2, 0, 2], 2, **opts)
    plan.validate()
    assert plan.num_docs == 6 and 1 not in plan.doc.tolist() and 4 not in plan.doc.tolist()
    assert all(i not in (1, 4) for k, v in plan.info.items() if k.endswith("_docs") for i in v)
    padded = planner([8, 4, 2, 1], 2, pad_to_multiple=True, **opts)
    padded.validate()
    assert padded.num_pad == 1 and padded.tokens_per_rank.tolist() == [8, 8]
    empty = planner([0, 0], 2, **opts)
    assert empty.num_shards == 0
    if planner is plan_ilp:
        assert "num_grid_pieces" in plan.info and "num_pieces" not in plan.info


def _lp_instance(seed, n=3, block=8):
    from flashcp.planners.ilp.model import Instance

    rng = np.random.default_rng(seed)
    d = rng.integers(1, 40, size=int(rng.integers(4, 9)))
    d[-1] += (-int(d.sum())) % n
    pdoc, pstart, plen = block_pieces(d, block)
    return Instance(d, n, pdoc, pstart, plen, 1.0, None)


@pytest.mark.parametrize("seed", range(6))
def test_rounding_a_fractional_solution_gives_a_valid_plan(seed):
    from flashcp.planners.ilp.model import round_fractions

    inst = _lp_instance(seed)
    n, tpr = inst.cp_size, inst.tokens_per_rank
    rng = np.random.default_rng(seed)
    # a fractional point with the right marginals: piece shares proportional to random weights,
    # then scaled (Sinkhorn) so that every rank holds C / N tokens
    f = rng.random((inst.plen.size, n)) + 1e-3
    for _ in range(500):
        f /= f.sum(axis=1, keepdims=True)
        f *= tpr / (inst.plen[:, None] * f).sum(axis=0)
    f /= f.sum(axis=1, keepdims=True)
    plan = make_plan("ilp", n, inst.doc_lens, *round_fractions(inst, f))
    plan.validate()  # every token once, exactly C / N per rank (Eq. 1, Eq. 2)
    # an integral point is reproduced exactly: the plan of a heuristic, one-hot on the grid
    ref = plan_flashcp(inst.doc_lens, n)
    from flashcp.planners.ilp.model import piece_ranks, refine_grid

    fine = refine_grid(inst, ref.doc, ref.start)
    ranks = piece_ranks(
        ref.rank, ref.doc, ref.start, fine.pdoc, fine.pstart, int(ref.doc_lens.sum())
    )
    onehot = np.eye(n)[ranks]
    again = make_plan("ilp", n, fine.doc_lens, *round_fractions(fine, onehot))
    assert again.rank.size == ref.rank.size
    assert again.comm_tokens == ref.comm_tokens
    assert again.workload_per_rank.tolist() == ref.workload_per_rank.tolist()


def test_refine_grid_keeps_every_cut_and_adds_the_new_ones():
    from flashcp.planners.ilp.model import refine_grid

    inst = _lp_instance(0, block=4)
    fine = refine_grid(inst, np.array([0, 1, 1]), np.array([1, 2, 0]))
    old = set(zip(inst.pdoc.tolist(), inst.pstart.tolist(), strict=True))
    new = set(zip(fine.pdoc.tolist(), fine.pstart.tolist(), strict=True))
    assert old <= new and (0, 1) in new
    assert (1, 2) in new or inst.doc_lens[1] <= 2
    assert np.bincount(fine.pdoc, weights=fine.plen).tolist() == inst.doc_lens.tolist()


@pytest.mark.parametrize("solver", _solvers())
def test_lp_rounded_start_is_valid_and_never_worse_than_the_grid_optimum(solver):
    doc_lens, n, block, cap = [6, 5, 3, 2], 2, 2, 1.1
    expected = _brute_force(tuple(doc_lens), n, block, 1.0, cap)
    plan = plan_ilp(
        doc_lens, n, block_size=block, max_imbalance=cap, solver=solver, gap=0.0,
        time_limit_s=30, warm_start="flashcp", lp_rounding=True,
    )  # fmt: skip
    plan.validate()
    assert plan.info["lp_rounding"] is True
    assert plan.info["lp_bound"] is not None and plan.info["lp_bound"] <= expected + 1e-9
    assert plan.info["warm_start_source"] in ("heuristic", "lp_rounding")
    # the grid only gains cut points (the warm starts'), so the optimum can only improve
    assert plan.status == "ok" and plan.info["objective"] <= expected + 1e-9
    assert plan.imbalance_ratio <= cap + 1e-12
    without = plan_ilp(doc_lens, n, block_size=block, max_imbalance=cap, warm_start=None)
    assert without.info["lp_rounding"] is False and without.info["lp_bound"] is None


@pytest.mark.skipif("highs" not in _solvers(), reason="needs highspy")
@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_pair_lns_only_improves_and_keeps_a_solution_of_the_model(formulation):
    from flashcp.planners.ilp.model import build_model, piece_ranks, refine_grid
    from flashcp.planners.ilp.worker import pair_lns

    inst = _lp_instance(1, block=4)
    n = inst.cp_size
    seed = plan_flashcp(inst.doc_lens, n)
    inst = refine_grid(inst, seed.doc, seed.start)
    ranks = piece_ranks(
        seed.rank, seed.doc, seed.start, inst.pdoc, inst.pstart, int(inst.doc_lens.sum())
    )
    model = build_model(formulation, inst, ranks)
    assert model.start_vars and model.rank_vars is not None
    res = pair_lns(model, time.perf_counter() + 20.0, sub_time_s=1.0)
    assert res["solves"] >= n * (n - 1) // 2  # at least one full round of pairs
    assert res["objective"] <= res["start_objective"] + 1e-12
    # the new start is a solution of the model: read it back as a plan and check it
    for v, val in zip(model.start_vars, model.start_vals, strict=True):
        v.varValue = val
    assign = model.read()
    assert assign is not None
    order = np.lexsort((inst.pstart, inst.pdoc, assign))
    plan = make_plan(
        "ilp", n, inst.doc_lens, assign[order], inst.pdoc[order], inst.pstart[order],
        inst.plen[order], validate=True,
    )  # fmt: skip
    # the model never reports less than its plan's cost (merged heads count as communication)
    assert plan_objective(plan, inst.comm_weight) <= res["objective"] + 1e-6


@pytest.mark.skipif("highs" not in _solvers(), reason="needs highspy")
def test_ilp_with_lns_keeps_the_optimum_and_records_it():
    doc_lens, n, block, cap = [6, 5, 3, 2], 2, 2, 1.1
    expected = _brute_force(tuple(doc_lens), n, block, 1.0, cap)
    plan = plan_ilp(
        doc_lens, n, block_size=block, max_imbalance=cap, solver="cbc", gap=0.0,
        time_limit_s=30, warm_start="flashcp", lp_rounding=False, lns=True,
    )  # fmt: skip
    plan.validate()
    assert plan.status == "ok" and plan.info["objective"] <= expected + 1e-9
    assert plan.info["lns"] is True
    assert plan.info["lns_objective"] <= plan.info["lns_start_objective"] + 1e-12
    assert plan.info["seed_objective"] >= plan.info["objective"] - 1e-9
    off = plan_ilp(
        doc_lens, n, block_size=block, max_imbalance=cap, warm_start="flashcp", lns=False
    )
    assert off.info["lns"] is False and off.info["lns_objective"] is None


#: an instance (N = 4, 4-token blocks, cap 1.1, seeded by flashcp) where the neighbourhood search
#: over pairs stops at a local optimum that freeing three ranks improves (found by a search over
#: random instances)
LNS_TRIPLE_DOCS = [25, 20, 11, 13, 2, 3, 2]


@pytest.mark.skipif("highs" not in _solvers(), reason="needs highspy")
def test_lns_beyond_pairs_escapes_a_local_optimum_of_pairs():
    """From the pairs' local optimum, freeing three ranks (one of them a bottleneck) finds a
    better solution of the model on this instance; every step stays a solution of the model."""
    from flashcp.planners.ilp.model import Instance, build_model, piece_ranks
    from flashcp.planners.ilp.worker import pair_lns

    d, n, block, cap = np.array(LNS_TRIPLE_DOCS), 4, 4, 1.1
    seed = plan_flashcp(d, n, target_imbalance=cap)
    pdoc, pstart, plen = block_pieces(d, block, (seed.doc, seed.start))
    inst = Instance(d, n, pdoc, pstart, plen, 1.0, cap)
    ranks = piece_ranks(seed.rank, seed.doc, seed.start, pdoc, pstart, int(d.sum()))
    res = {}
    for size in (2, 3):
        model = build_model("patterns", inst, ranks)
        res[size] = pair_lns(model, time.perf_counter() + 60.0, sub_time_s=1.0, max_size=size)
        assert res[size]["max_size"] == size
        for v, val in zip(model.start_vars, model.start_vals, strict=True):
            v.varValue = val
        assign = model.read()
        order = np.lexsort((pstart, pdoc, assign))
        plan = make_plan(
            "ilp", n, d, assign[order], pdoc[order], pstart[order], plen[order], validate=True
        )
        assert plan.imbalance_ratio <= cap * (1 + 1e-9)
        assert plan_objective(plan, 1.0) <= res[size]["objective"] + 1e-6
    assert res[3]["objective"] < res[2]["objective"] - 1e-6


def test_lns_max_size_is_checked():
    with pytest.raises(ValueError, match="lns_max_size"):
        plan_ilp([4, 4], 2, lns_max_size=1)


@pytest.mark.skipif("highs" not in _solvers(), reason="needs highspy")
def test_highs_solves_report_their_nodes_and_iterations():
    plan = plan_ilp([6, 5, 3, 2], 2, block_size=2, solver="highs", time_limit_s=30, gap=0.0)
    assert isinstance(plan.info["mip_nodes"], int) and plan.info["mip_nodes"] >= 0
    assert isinstance(plan.info["lp_iterations"], int) and plan.info["lp_iterations"] >= 0
    cbc = plan_ilp([6, 5, 3, 2], 2, block_size=2, solver="cbc", time_limit_s=30, lns=False)
    assert cbc.info["mip_nodes"] is None
