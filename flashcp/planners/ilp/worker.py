"""The ILP's solver process and the watchdog that bounds it (arXiv 2606.08476, §3.4).

A MIP solver can overrun its own time limit or hang (a stuck CBC binary, a HiGHS call that never
returns), and a solver that runs inside the planner's process, or as its child, cannot be stopped
safely from Python. So :func:`run_job` builds and solves the model in a separate process
(``python -m flashcp.planners.ilp.worker JOB RESULT``) started in its own session, whose files (the job, the
result, PuLP's ``*-pulp.mps`` / ``*-pulp.mst`` / ``*-pulp.sol``, the solver's log) all live in one
temporary folder. The planner waits at most ``time_limit_s + grace_s``; past that it kills the
whole process group (the worker and the solver binary it started) and deletes the folder. The
same cleanup runs when the planner itself is interrupted. The worker reports whether the solver
accepted the MIP start: CBC can reject it ("mipstart values could not be used").
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import numpy as np

__all__ = ["check_highs_options", "pair_lns", "run_job", "solve_job"]


def _cbc_log(log_path: str) -> tuple[float | None, bool | None]:
    """``(best bound, MIP start accepted)`` from CBC's log; None where the log does not say.

    The bound is the last "Lower bound:" line of the result block. The MIP start counts as
    accepted when CBC reports "MIPStart provided solution with cost ..."; as rejected when it
    reports that the values "could not be used", are "not valid", or could not be read.
    """
    try:
        with open(log_path) as f:
            text = f.read()
    except OSError:
        return None, None
    found = re.findall(r"^Lower bound:\s*(\S+)", text, flags=re.MULTILINE)
    try:
        bound = float(found[-1]) if found else None
    except ValueError:
        bound = None
    if "MIPStart provided solution with cost" in text:
        accepted = True
    elif re.search(r"could not be used|MIPstart solution is not valid|No mipstart solution", text):
        accepted = False
    else:
        accepted = None
    return bound, accepted


def _highs_start_accepted(log_path: str) -> bool | None:
    """Whether HiGHS used the MIP start, from its log: it reports the start's objective as a
    feasible "solution" at the root, or says the start is infeasible; None when the log is silent."""
    try:
        with open(log_path) as f:
            text = f.read()
    except OSError:
        return None
    low = text.lower()
    if re.search(r"(start|user).{0,40}(infeasible|not feasible|rejected)", low):
        return False
    if re.search(r"(start|user).{0,60}(feasible|accepted|objective)", low):
        return True
    return None


def _set_highs_options(h, options: dict[str, Any]) -> None:
    """Set HiGHS options by name on the ``highspy.Highs`` object ``h``.

    Raises:
        ValueError: an unknown option name, or a value of the wrong type or out of range.
    """
    import highspy

    for name, value in options.items():
        if not isinstance(name, str):
            raise ValueError(f"HiGHS option names must be strings, got {name!r}")
        try:
            status = h.setOptionValue(name, value)
        except Exception as exc:  # highspy raises on some type mismatches
            raise ValueError(f"bad HiGHS option {name}={value!r}: {exc}") from None
        if status != highspy.HighsStatus.kOk:
            raise ValueError(f"bad HiGHS option {name}={value!r} (unknown name or bad value)")


def check_highs_options(options: dict[str, Any]) -> None:
    """Check HiGHS options (a name -> value dict) on a scratch solver, before any solve.

    Raises:
        ValueError: as :func:`_set_highs_options`.
    """
    import highspy

    # HiGHS prints its banner from C++ when the object is built (before output_flag can be set):
    # keep it off the user's console by pointing file descriptor 1 at /dev/null meanwhile
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    h.setOptionValue("output_flag", False)
    _set_highs_options(h, options)


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and its finished children (a CBC binary)."""
    import resource

    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


#: most LP solves of the dive in :func:`_lp_rounded_start`, and the share of the solve's time
#: limit it may take
_DIVE_SOLVES = 40
_DIVE_SHARE = 0.25


def _lp_rounded_start(
    model, inst, seed_objective: float | None, deadline: float | None = None
) -> dict[str, Any]:
    """A MIP start from ``model``'s LP relaxation.

    Solve the LP, then dive: fix the most decided fractional last-shard choice, re-solve, and
    repeat, one document at a time (at most :data:`_DIVE_SOLVES` LP solves; a choice that makes
    the LP infeasible is forbidden instead), then round the counts of aggregated documents. Cut
    the root and the dived solutions into plans (:func:`flashcp.planners.ilp.model.round_fractions`) and
    keep the better; when it meets the imbalance cap and beats ``seed_objective``, return it as
    a MIP start on the grid refined by its cut points. The LP solves count against the solve's
    time limit (they run before it starts); the dive stops at ``deadline``
    (``time.perf_counter()`` seconds, None: no deadline).

    Returns ``{"lp_bound", "objective", "instance", "seed_rank"}`` (``instance`` / ``seed_rank``
    None when the rounded plan is not used; ``lp_bound`` / ``objective`` None when unknown).
    """
    import pulp

    from flashcp.plan import make_plan
    from flashcp.planners.ilp.model import meets_cap, piece_ranks, refine_grid, round_fractions

    out = {"lp_bound": None, "objective": None, "instance": None, "seed_rank": None}
    cats = {v.name: v.cat for v in model.prob.variables()}
    for v in model.prob.variables():
        v.cat = pulp.LpContinuous
    fixed = []
    try:
        model.prob.solve(pulp.HiGHS(msg=False, threads=1))
        if model.prob.status != pulp.LpStatusOptimal:
            return out
        out["lp_bound"] = float(pulp.value(model.prob.objective))
        frac = root = model.fractions()
        # dive: fix the most decided fractional last-shard choice and re-solve, one document at
        # a time (forbid the choice instead when fixing it makes the LP infeasible), so that
        # fewer documents are cut where the LP shares them between ranks
        for _ in range(_DIVE_SOLVES):
            if deadline is not None and time.perf_counter() > deadline:
                break
            shares = [
                (max((v.value() or 0.0) for v in vs), vs) for vs in (model.tail_vars or {}).values()
            ]
            open_ = [(x, vs) for x, vs in shares if x < 1 - 1e-6]
            if not open_:
                break
            _, vs = max(open_, key=lambda t: t[0])
            v = max(vs, key=lambda w: w.value() or 0.0)
            fixed.append((v, v.lowBound, v.upBound))
            v.lowBound = 1
            model.prob.solve(pulp.HiGHS(msg=False, threads=1))
            if model.prob.status != pulp.LpStatusOptimal:
                v.lowBound, v.upBound = 0, 0
                model.prob.solve(pulp.HiGHS(msg=False, threads=1))
                if model.prob.status != pulp.LpStatusOptimal:
                    break
            frac = model.fractions()
        # then round the counts of aggregated documents (largest remainder), if the LP allows
        counts = []
        for cv in model.count_vars or []:
            vals = np.array([v.value() or 0.0 for v in cv])
            target = np.floor(vals + 1e-9)
            extra = round(float(vals.sum() - target.sum()))
            target[np.argsort(-(vals - target), kind="stable")[:extra]] += 1
            if np.abs(vals - target).max() > 1e-6:
                counts += [(v, v.lowBound, v.upBound, t) for v, t in zip(cv, target, strict=True)]
        if counts:
            for v, _, _, t in counts:
                v.lowBound = v.upBound = float(t)
            fixed += [(v, lb, ub) for v, lb, ub, _ in counts]
            model.prob.solve(pulp.HiGHS(msg=False, threads=1))
            if model.prob.status == pulp.LpStatusOptimal:
                frac = model.fractions()
    finally:
        for v, lb, ub in fixed:
            v.lowBound, v.upBound = lb, ub
        for v in model.prob.variables():
            v.cat = cats[v.name]
    n, d = inst.cp_size, inst.doc_lens
    best = None  # (over the cap, objective, plan) of the rounded root and dived solutions
    for f in (root, frac):
        try:
            plan = make_plan("ilp", n, d, *round_fractions(inst, f))
        except ValueError:
            continue
        over = not meets_cap(plan.imbalance_ratio, inst.max_imbalance)
        obj = plan.imbalance_ratio + inst.comm_weight * (1.0 - plan.comm_saving)
        if best is None or (over, obj) < best[:2]:
            best = (over, obj, plan)
    if best is None:
        return out
    over, obj, plan = best
    out["objective"] = obj
    if not over and (seed_objective is None or obj < seed_objective - 1e-12):
        refined = refine_grid(inst, plan.doc, plan.start)
        out["instance"] = refined
        out["seed_rank"] = piece_ranks(
            plan.rank, plan.doc, plan.start, refined.pdoc, refined.pstart, int(d.sum())
        )
    return out


#: wall-clock limit of one neighbourhood solve of :func:`pair_lns`, seconds; and the share of
#: the solve's time limit (counted from the start of the build) by which the search stops
_LNS_SUB_S = 0.5
_LNS_SUB_MAX = 8  # most times _LNS_SUB_S after rounds without improvement
_LNS_SHARE = 0.5
#: weight of the two freed ranks' own communication (head tokens over C / N) in a
#: neighbourhood's objective: a tie-breaker that adds at most 2e-4
_LNS_TIE = 1e-4
#: the largest set of ranks a neighbourhood of :func:`pair_lns` frees
_LNS_MAX_SIZE = 2


def _constraint(prob, name: str):
    """The constraint ``name`` of a PuLP problem (PuLP >= 3.3 deprecates the dict lookup)."""
    get = getattr(prob, "get_constraint_by_name", None)
    return get(name) if get is not None else prob.constraints[name]


def pair_lns(
    model, deadline: float, sub_time_s: float = _LNS_SUB_S, max_size: int = _LNS_MAX_SIZE
) -> dict[str, Any]:
    """Improve ``model``'s MIP start by large-neighbourhood search over pairs of ranks.

    The objective is a max over ranks (imbalance, Eq. 3; communication, Eq. 5), and the MIP's own
    heuristics rarely move a 128K start whose ranks each hold exactly C / N tokens. Each
    neighbourhood keeps every rank's variables (:attr:`~flashcp.planners.ilp.model.Model.rank_vars`) fixed
    at the incumbent except those of two ranks a, b, and solves that sub-MIP (HiGHS, one thread,
    at most ``sub_time_s`` seconds, started from the incumbent): the two ranks may exchange any
    tails and head pieces, and cut their documents differently, as long as they keep their
    C / N tokens each. The maxima are often on a rank outside the pair, so the neighbourhood's
    objective also counts, with weight :data:`_LNS_TIE`, the two ranks' own communication: a
    move that keeps the objective and sends fewer head tokens from the pair is taken too
    (never one that makes the objective worse). Pairs are visited in turn (01, 02, ..., 23);
    after a round without improving the objective, each pair gets twice as long (up to
    :data:`_LNS_SUB_MAX` times ``sub_time_s``). When a round of pairs is a local optimum (every
    pair solved to optimality) or had the longest time, the search stops, or with ``max_size``
    >= 3 (default 2) frees three ranks, then up to ``max_size``: the objective can only fall when every rank at the maximum communication,
    or every rank at the maximum workload, changes, and at CP 8 such ties between two or three
    ranks are common, so each larger set holds the incumbent's rank of highest communication or
    of highest workload and ``size - 1`` others (at most N - 1 ranks: all N is the full MIP);
    each larger size gets one round, at twice ``sub_time_s`` per set, so that at CP 4 the
    search leaves the branch and bound its time. Any improvement returns to pairs. The search
    stops after the last size's local optimum or at ``deadline`` (``time.perf_counter()``
    seconds). Every incumbent is a solution of the full model, so the result stays a valid MIP
    start; it is written back into ``model.start_vals``.

    Returns ``{"start_objective", "objective", "solves", "time_s", "max_size"}`` (objectives of
    the model's objective, equal when nothing improved or the model has no start or no
    ``rank_vars``; ``max_size``: the largest set of ranks freed).
    """
    import itertools

    import highspy
    import pulp

    t0 = time.perf_counter()
    out = {"start_objective": None, "objective": None, "solves": 0, "time_s": 0.0, "max_size": None}
    if not model.start_vars or model.rank_vars is None:
        return out
    slv = pulp.HiGHS(msg=False, threads=1)
    slv.createAndConfigureSolver(model.prob)
    h = model.prob.solverModel
    h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_rel_gap", 1e-6)  # steps of 1e-4 still add up
    slv.buildSolverModel(model.prob)
    ncol = h.getNumCol()
    lp = h.getLp()
    lower, upper = np.array(lp.col_lower_), np.array(lp.col_upper_)
    cost = np.array(lp.col_cost_)
    rank = np.full(ncol, -1)
    for r, vs in enumerate(model.rank_vars):
        rank[[v.index for v in vs]] = r
    integral = np.zeros(ncol, dtype=bool)
    integral[[v.index for v in model.prob.variables() if v.cat == pulp.LpInteger]] = True
    cur = np.zeros(ncol)
    for v, val in zip(model.start_vars, model.start_vals, strict=True):
        cur[v.index] = val
    obj = out["start_objective"] = out["objective"] = float(cost @ cur)
    cols = np.arange(ncol, dtype=np.int32)
    n = len(model.rank_vars)
    # per rank, the communication row's coefficients (head tokens over C / N, Eq. 5 / Eq. 4)
    # without the maximum: a tie-breaker in each neighbourhood, so that freeing two ranks can
    # also move head tokens off them while the maximum stays on a rank outside the pair
    comm = np.zeros((n, ncol))
    work = np.zeros((n, ncol))
    for r in range(n):
        for v, c in _constraint(model.prob, f"comm_{r}").items():
            if v.index is not None and rank[v.index] >= 0:
                comm[r, v.index] = c
        for v, c in _constraint(model.prob, f"work_{r}").items():
            if v.index is not None and rank[v.index] >= 0:
                work[r, v.index] = c

    def neighbourhoods(size: int) -> list[tuple[int, ...]]:
        """Pairs in turn; larger sets only around the bottleneck ranks of the incumbent (the
        objective can only fall when every rank at the maximum workload, or every rank at the
        maximum communication, changes): each such set holds the rank of highest communication
        or of highest workload, and ``size - 1`` others."""
        if size == 2:
            return list(itertools.combinations(range(n), 2))
        sets: list[tuple[int, ...]] = []
        for key in (comm @ cur, work @ cur):
            top = int(np.argmax(key))
            rest = [r for r in range(n) if r != top]
            for others in itertools.combinations(rest, size - 1):
                s = tuple(sorted((top, *others)))
                if s not in sets:
                    sets.append(s)
        return sets

    limit = sub_time_s
    size = 2
    # freeing every rank would be the full MIP: at most N - 1 ranks (and pairs even at N = 2)
    top_size = max(2, min(max_size, n - 1))
    while time.perf_counter() < deadline and size <= top_size:
        improved, exhausted = False, True
        for free in neighbourhoods(size):
            left = deadline - time.perf_counter()
            if left <= 0.1:
                break
            fix = (rank >= 0) & ~np.isin(rank, free)
            h.changeColsBounds(ncol, cols, np.where(fix, cur, lower), np.where(fix, cur, upper))
            tie = _LNS_TIE * comm[list(free)].sum(axis=0)
            h.changeColsCost(ncol, cols, cost + tie)
            h.setOptionValue("time_limit", min(limit, left))
            start = highspy.HighsSolution()
            start.col_value = cur.tolist()
            start.value_valid = True
            h.setSolution(start)
            h.run()
            out["solves"] += 1
            exhausted &= h.getModelStatus() == highspy.HighsModelStatus.kOptimal
            if h.getInfo().primal_solution_status == 2:  # a feasible solution
                sol = np.array(h.getSolution().col_value)
                sol[integral] = np.round(sol[integral])
                new = float(cost @ sol)
                if new < obj - 1e-9 or (
                    new <= obj + 1e-12 and float(tie @ sol) < float(tie @ cur) - 1e-12
                ):
                    improved |= new < obj - 1e-9
                    obj, cur = min(obj, new), sol
            h.clearSolver()
        if improved:
            limit, size = sub_time_s, 2
        elif size > 2 or exhausted or limit >= _LNS_SUB_MAX * sub_time_s:
            # a local optimum of pairs (or no time for them), or one round of a larger size
            # (each set twice the pairs' first limit, so the round's cost stays bounded): try
            # the next size
            size += 1
            limit = 2 * sub_time_s
        else:  # some pair ran out of time: give each pair longer
            limit = min(2 * limit, _LNS_SUB_MAX * sub_time_s)
    out["max_size"] = min(size, top_size)  # the largest neighbourhood tried
    h.changeColsCost(ncol, cols, cost)
    out["objective"] = obj
    out["time_s"] = time.perf_counter() - t0
    if obj < out["start_objective"]:
        model.start_vals = [float(cur[v.index]) for v in model.start_vars]
    return out


def _within_bounds(var, value: float) -> float:
    """A MIP start value moved onto its variable's bound when it lies outside by at most
    :data:`flashcp.planners.ilp.model.CAP_TOLERANCE` (relative): PuLP refuses any initial value outside
    the bounds, and a start from the heuristic or the neighbourhood search can sit a rounding
    error beyond one. A value further out is returned as is (PuLP then names it)."""
    from flashcp.planners.ilp.model import CAP_TOLERANCE

    value = float(value)
    lo, hi = var.lowBound, var.upBound
    if hi is not None and hi < value <= hi + CAP_TOLERANCE * max(1.0, abs(hi)):
        return float(hi)
    if lo is not None and lo - CAP_TOLERANCE * max(1.0, abs(lo)) <= value < lo:
        return float(lo)
    return value


def solve_job(job: dict[str, Any]) -> dict[str, Any]:
    """Build and solve one model (runs in the worker process).

    ``job``: ``formulation``, ``instance`` (:class:`flashcp.planners.ilp.model.Instance`), ``seed_rank``
    ((n_pieces,) int64 or None), ``solver`` (``cbc`` / ``highs``), ``solver_path`` (a CBC
    executable, or None for PuLP's bundled one), ``time_limit_s`` (wall clock for build + solve,
    or None), ``gap``, ``threads``, ``tmpdir``; optional ``highs_options`` (HiGHS options by
    name), ``lns`` (improve the MIP start by :func:`pair_lns` until half the time limit),
    ``lp_rounding`` (first solve the LP relaxation and use its rounded plan as the MIP start when it beats the seed,
    :func:`_lp_rounded_start`) and ``seed_objective`` (the seed plan's objective).

    Returns a dict: ``sol`` (``optimal`` / ``feasible`` / ``infeasible`` / ``none``), ``assign``
    ((n_pieces,) int64 or None), ``bound``, ``model_objective``, ``error``,
    ``warm_start_given``, ``warm_start_accepted`` (True / False / None = unknown),
    ``num_binaries``, ``num_integers``, ``build_time_s``, ``solve_time_s`` (wall clock) and
    ``solve_cpu_s`` (CPU seconds of the solve: on a loaded machine, what the solver really got),
    ``total_cpu_s`` (CPU seconds of the whole job: build, LP rounding, LNS and solve),
    ``lp_bound`` (the root LP relaxation's objective), ``lp_rounded_objective``,
    ``warm_start_source`` (``heuristic`` / ``lp_rounding`` / None), ``mip_nodes`` and
    ``lp_iterations`` (HiGHS's branch-and-bound nodes and simplex iterations of the MIP, None
    under CBC: deterministic measures of the work done, unlike times on a loaded machine),
    ``lns_max_size`` and ``instance`` (the refined
    instance whose pieces ``assign`` refers to, when the rounded start refined the grid; else None).
    """
    import pulp

    from flashcp.planners.ilp.model import Infeasible, build_model

    t0 = time.perf_counter()
    c0 = _cpu_s()
    out: dict[str, Any] = {
        "sol": "none",
        "assign": None,
        "bound": None,
        "model_objective": None,
        "error": None,
        "warm_start_given": False,
        "warm_start_accepted": None,
        "num_binaries": None,
        "num_integers": None,
        "build_time_s": None,
        "solve_time_s": None,
        "solve_cpu_s": None,
        "total_cpu_s": None,
        "lp_bound": None,
        "lp_rounded_objective": None,
        "warm_start_source": None if job["seed_rank"] is None else "heuristic",
        "instance": None,
        "lns_start_objective": None,
        "lns_objective": None,
        "lns_solves": None,
        "lns_time_s": None,
        "lns_max_size": None,
        "mip_nodes": None,
        "lp_iterations": None,
    }
    inst, seed_rank = job["instance"], job["seed_rank"]
    try:
        model = build_model(job["formulation"], inst, seed_rank)
        if job.get("lp_rounding"):
            limit = job["time_limit_s"]  # the dive may take a quarter of the time limit
            deadline = None if limit is None else t0 + _DIVE_SHARE * limit
            rounded = _lp_rounded_start(model, inst, job.get("seed_objective"), deadline)
            out.update(lp_bound=rounded["lp_bound"], lp_rounded_objective=rounded["objective"])
            if rounded["instance"] is not None:  # a better start than the heuristic's
                inst, seed_rank = rounded["instance"], rounded["seed_rank"]
                model = build_model(job["formulation"], inst, seed_rank)
                out.update(warm_start_source="lp_rounding", instance=inst)
    except Infeasible as exc:
        out.update(sol="infeasible", error=str(exc), build_time_s=time.perf_counter() - t0)
        return out
    if job.get("lns") and model.start_vars:
        limit = job["time_limit_s"]
        deadline = t0 + _LNS_SHARE * limit if limit is not None else float("inf")
        lns = pair_lns(model, deadline, max_size=job.get("lns_max_size", _LNS_MAX_SIZE))
        out.update(
            lns_start_objective=lns["start_objective"],
            lns_objective=lns["objective"],
            lns_solves=lns["solves"],
            lns_time_s=lns["time_s"],
            lns_max_size=lns.get("max_size"),
        )
    prob = model.prob
    start = bool(model.start_vars)
    out.update(
        num_binaries=int(model.num_binaries),
        num_integers=int(model.num_integers),
        warm_start_given=start,
        build_time_s=time.perf_counter() - t0,
    )
    limit = job["time_limit_s"]
    if limit is not None:  # the build counts against the wall-clock limit
        limit = max(1.0, limit - (time.perf_counter() - t0))
    tmp = job["tmpdir"]
    log_path = os.path.join(tmp, "solver.log")
    t1, c1 = time.perf_counter(), _cpu_s()
    try:
        if job["solver"] == "cbc":
            for v, val in zip(model.start_vars, model.start_vals, strict=True):
                v.setInitialValue(_within_bounds(v, val))
            with warnings.catch_warnings():  # PuLP 3.x deprecates the bundled CBC's class name
                warnings.simplefilter("ignore", DeprecationWarning)
                opts = dict(
                    msg=False,
                    timeLimit=limit,
                    gapRel=job["gap"],
                    threads=job["threads"],
                    logPath=log_path,
                    warmStart=start,
                )
                if job["solver_path"]:
                    slv = pulp.COIN_CMD(path=job["solver_path"], **opts)
                else:
                    slv = pulp.PULP_CBC_CMD(**opts)
            slv.tmpDir = tmp  # PuLP's *-pulp.mps / .mst / .sol go to the watched folder
            prob.solve(slv)
            sol = prob.sol_status
            if sol == pulp.LpSolutionNoSolutionFound and prob.status == pulp.LpStatusInfeasible:
                sol = pulp.LpSolutionInfeasible
            bound, accepted = _cbc_log(log_path)
        else:
            import highspy

            slv = pulp.HiGHS(msg=False, timeLimit=limit, gapRel=job["gap"], threads=job["threads"])
            # PuLP's HiGHS interface has no MIP start: its actualSolve, with setSolution added
            slv.createAndConfigureSolver(prob)
            h = prob.solverModel
            h.setOptionValue("output_flag", True)
            h.setOptionValue("log_to_console", False)
            h.setOptionValue("log_file", log_path)
            _set_highs_options(h, job.get("highs_options") or {})
            slv.buildSolverModel(prob)
            if start:
                hs = highspy.HighsSolution()
                vals = [0.0] * h.getNumCol()
                for v, val in zip(model.start_vars, model.start_vals, strict=True):
                    vals[v.index] = float(val)
                hs.col_value = vals
                hs.value_valid = True
                h.setSolution(hs)
            slv.callSolver(prob)
            status, sol = slv.findSolutionValues(prob)
            prob.assignStatus(status, sol)
            hinfo = h.getInfo()
            bound = float(hinfo.mip_dual_bound)
            out.update(
                mip_nodes=int(hinfo.mip_node_count),
                lp_iterations=int(hinfo.simplex_iteration_count),
            )
            accepted = _highs_start_accepted(log_path) if start else None
    except pulp.PulpSolverError as exc:  # the solver crashed or wrote no solution
        out.update(error=str(exc), solve_time_s=time.perf_counter() - t1)
        return out
    out["solve_time_s"] = time.perf_counter() - t1
    out["solve_cpu_s"] = _cpu_s() - c1
    out["total_cpu_s"] = _cpu_s() - c0
    out["warm_start_accepted"] = accepted if start else None
    out["bound"] = bound if bound is not None and np.isfinite(bound) else None
    if sol == pulp.LpSolutionInfeasible:
        out["sol"] = "infeasible"
    elif sol in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        assign = model.read()
        if assign is None:
            out["error"] = "the solver returned a fractional assignment"
        else:
            out.update(
                sol="optimal" if sol == pulp.LpSolutionOptimal else "feasible",
                assign=assign,
                model_objective=float(pulp.value(prob.objective)),
            )
    return out


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the worker's process group (the worker and any solver binary it started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def run_job(job: dict[str, Any], time_limit_s: float | None, grace_s: float) -> dict[str, Any]:
    """Run :func:`solve_job` in a worker process under a watchdog.

    Args:
        job: as for :func:`solve_job` (``tmpdir`` is set here).
        time_limit_s: the solver's wall-clock limit, seconds (None: wait for ever).
        grace_s: extra seconds granted before the watchdog kills the worker's process group.
    Returns:
        :func:`solve_job`'s dict, plus ``killed`` (the watchdog ended the worker) and
        A worker that dies or writes no result gives ``sol = "none"`` and its
        stderr in ``error``.
    """
    tmp = tempfile.mkdtemp(prefix="flashcp_ilp_")
    proc = None
    try:
        job = {**job, "tmpdir": tmp}
        job_path, res_path = os.path.join(tmp, "job.pkl"), os.path.join(tmp, "result.pkl")
        with open(job_path, "wb") as f:
            pickle.dump(job, f)
        err_path = os.path.join(tmp, "worker.err")
        # the worker imports this very flashcp, however the caller found it
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])]
        )}  # fmt: skip
        with open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "flashcp.planners.ilp.worker", job_path, res_path],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,  # its own process group, killed as a whole
            )
            wait = None if time_limit_s is None else time_limit_s + grace_s
            try:
                proc.wait(timeout=wait)
                killed = False
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                killed = True
        if not killed and os.path.exists(res_path):
            with open(res_path, "rb") as f:
                res = pickle.load(f)
        else:
            with open(err_path, "rb") as f:
                tail = f.read()[-2000:].decode(errors="replace").strip()
            res = {
                "sol": "none",
                "assign": None,
                "bound": None,
                "model_objective": None,
                "warm_start_given": bool(job.get("seed_rank") is not None),
                "warm_start_accepted": None,
                "error": (
                    f"the watchdog killed the solver after {wait:g} s"
                    if killed
                    else f"the solver process exited with code {proc.returncode}: {tail}"
                ),
            }
        res["killed"] = killed
        return res
    finally:
        if proc is not None and proc.poll() is None:  # interrupted: leave nothing running
            _kill_group(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def _orphan_guard(parent: int, tmpdir: str) -> None:
    """Runs in a daemon thread of the worker: when the planner process dies without cleaning up
    (e.g. SIGKILL), delete the job's folder and kill the worker's process group."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            shutil.rmtree(tmpdir, ignore_errors=True)
            os.killpg(os.getpgrp(), signal.SIGKILL)


def _main(argv: list[str]) -> int:
    import threading

    job_path, res_path = argv
    with open(job_path, "rb") as f:
        job = pickle.load(f)
    threading.Thread(target=_orphan_guard, args=(os.getppid(), job["tmpdir"]), daemon=True).start()
    res = solve_job(job)
    tmp_res = res_path + ".part"
    with open(tmp_res, "wb") as f:
        pickle.dump(res, f)
    os.replace(tmp_res, res_path)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
