""":func:`plan_ilp`: warm start, solve under a watchdog, read the plan back, or fall back.

The formulations and what they optimise are documented in :mod:`flashcp.planners.ilp`.
"""

from __future__ import annotations

import inspect
import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from flashcp.kinds import CommKind, OpFamily
from flashcp.plan import Plan, check_cp_args, check_doc_lens, make_plan, planner_entry
from flashcp.planners.ilp.model import FORMULATIONS, Instance, block_pieces, meets_cap, piece_ranks
from flashcp.planners.ilp.worker import check_highs_options, run_job
from flashcp.registry import MethodSpec

__all__ = ["plan_ilp", "plan_objective", "saving_bound"]

_SOLVERS = ("cbc", "highs")
_FAILURES = ("fallback", "raise")
_WARM_STARTS = ("best", "flashcp", "flashcp_refined", None)


def _have_highs() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def plan_objective(plan: Plan, comm_weight: float = 1.0) -> float:
    """The ILP's objective evaluated on any plan: ``imbalance_ratio + comm_weight * (1 - comm_saving)``.

    Dimensionless; imbalance from Eq. 3, communication from Eq. 5 over Eq. 4.
    """
    return plan.imbalance_ratio + comm_weight * (1.0 - plan.comm_saving)


def saving_bound(
    bound: float | None, max_imbalance: float | None, comm_weight: float
) -> float | None:
    """Upper bound on the comm_saving of any plan on the grid, from the solver's best bound B.

    Every feasible plan has ``z_w <= max_imbalance`` and ``z_w + comm_weight * z_c >= B``, so
    ``z_c >= (B - max_imbalance) / comm_weight`` and ``comm_saving = 1 - z_c`` is at most
    ``1 - max(0, B - max_imbalance) / comm_weight``. None without a cap, a bound or a weight.
    """
    if bound is None or max_imbalance is None or comm_weight <= 0:
        return None
    return 1.0 - max(0.0, bound - max_imbalance) / comm_weight


def _heuristic(
    doc_lens: np.ndarray, cp_size: int, method: str, target: float, comm_weight: float
) -> Plan:
    """The seed / fallback plan of ``method``; ``best`` = the lower objective of the two
    heuristics among those meeting ``target`` (:func:`~flashcp.planners.ilp.model.meets_cap`; ties:
    ``flashcp_refined``)."""
    from flashcp.planners.flashcp import plan_flashcp
    from flashcp.planners.flashcp_refined import plan_flashcp_refined

    if method == "flashcp":
        return plan_flashcp(doc_lens, cp_size, target_imbalance=target)
    if method == "flashcp_refined":
        return plan_flashcp_refined(doc_lens, cp_size, target_imbalance=target)
    plans = [
        plan_flashcp_refined(doc_lens, cp_size, target_imbalance=target),
        plan_flashcp(doc_lens, cp_size, target_imbalance=target),
    ]
    return min(
        plans,
        key=lambda p: (not meets_cap(p.imbalance_ratio, target), plan_objective(p, comm_weight)),
    )


def check_ilp_options(**options: Any) -> tuple[bool, dict[str, Any]]:
    """Check the option values of :func:`plan_ilp` without solving anything (the harness runs it
    before any work, where the ILP is too slow for a trial plan): every option's type and range,
    ``solver_path`` an executable (CBC only), ``lns=True`` only with a warm start.

    Args:
        options: keyword options of :func:`plan_ilp`; those not given take its defaults (read
            from its signature, the one place they are written).
    Returns:
        ``(lns, highs_options)``: ``lns`` resolved (None: whether ``highspy`` is installed) and
        the HiGHS options as a dict.
    Raises:
        ValueError: naming the bad option and value, or HiGHS asked for but not installed.
    """
    o = {
        name: p.default
        for name, p in inspect.signature(plan_ilp).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    o.update(options)
    block_size, time_limit_s, gap, solver = (
        o["block_size"],
        o["time_limit_s"],
        o["gap"],
        o["solver"],
    )
    formulation, comm_weight, max_imbalance = o["formulation"], o["comm_weight"], o["max_imbalance"]
    warm_start, highs_options, on_failure = o["warm_start"], o["highs_options"], o["on_failure"]
    watchdog_grace_s, lns, lns_max_size = o["watchdog_grace_s"], o["lns"], o["lns_max_size"]
    threads, solver_path = o["threads"], o["solver_path"]
    for name in ("validate", "lp_rounding"):
        if not isinstance(o[name], bool | np.bool_):
            raise ValueError(f"{name} must be True or False, got {o[name]!r}")
    if lns is not None and not isinstance(lns, bool | np.bool_):
        raise ValueError(f"lns must be True, False or None, got {lns!r}")
    if lns and warm_start is None:
        raise ValueError("lns=True improves the warm start's plan: it needs warm_start, got None")
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int | np.integer) or threads < 1
    ):
        raise ValueError(f"threads must be an integer >= 1 or None, got {threads!r}")
    if not o["heuristic_target_imbalance"] >= 1.0:
        raise ValueError(
            f"heuristic_target_imbalance must be >= 1, got {o['heuristic_target_imbalance']!r}"
        )
    if solver not in _SOLVERS:
        raise ValueError(f"solver must be one of {_SOLVERS}, got {solver!r}")
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {formulation!r}")
    if on_failure not in _FAILURES:
        raise ValueError(f"on_failure must be one of {_FAILURES}, got {on_failure!r}")
    if warm_start not in _WARM_STARTS:
        raise ValueError(f"warm_start must be one of {_WARM_STARTS}, got {warm_start!r}")
    if not np.isfinite(comm_weight) or comm_weight < 0:
        raise ValueError(f"comm_weight must be a finite number >= 0, got {comm_weight!r}")
    if max_imbalance is not None and not max_imbalance >= 1.0:
        raise ValueError(f"max_imbalance must be >= 1 or None, got {max_imbalance!r}")
    if time_limit_s is not None and not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0 or None, got {time_limit_s!r}")
    if gap is not None and not 0 <= gap < 1:
        raise ValueError(f"gap (relative) must be in [0, 1) or None, got {gap!r}")
    if solver_path is not None:
        if solver != "cbc":
            raise ValueError(
                f"solver_path is a CBC executable: it needs solver='cbc', got {solver!r}"
            )
        if not (os.path.isfile(solver_path) and os.access(solver_path, os.X_OK)):
            raise ValueError(f"solver_path must be an executable file, got {solver_path!r}")
    if not watchdog_grace_s >= 0:
        raise ValueError(f"watchdog_grace_s must be >= 0, got {watchdog_grace_s!r}")
    if solver == "highs":
        try:
            import highspy  # noqa: F401
        except ImportError:
            raise ValueError(
                "solver='highs' needs the highspy package: pip install 'flashcp[highs]'"
            ) from None
    if lns is None:
        lns = _have_highs()
    elif lns and not _have_highs():
        raise ValueError("lns=True needs the highspy package: pip install 'flashcp[highs]'")
    if isinstance(lns_max_size, bool) or not isinstance(lns_max_size, int) or lns_max_size < 2:
        raise ValueError(f"lns_max_size must be an integer >= 2, got {lns_max_size!r}")
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int | np.integer)
        or block_size < 1
    ):
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    if highs_options is not None and not isinstance(highs_options, Mapping):
        raise ValueError(
            f"highs_options must be a mapping of HiGHS option names to values, got {highs_options!r}"
        )
    highs_options = dict(highs_options or {})
    if highs_options:
        if solver != "highs":
            raise ValueError(f"highs_options need solver='highs', got solver={solver!r}")
        check_highs_options(highs_options)
    return bool(lns), highs_options


@planner_entry("ilp")
def plan_ilp(
    doc_lens,
    cp_size: int,
    *,
    block_size: int = 1024,
    time_limit_s: float | None = 60.0,
    gap: float | None = 1e-4,
    solver: str = "cbc",
    formulation: str = "patterns",
    comm_weight: float = 1.0,
    max_imbalance: float | None = 1.05,
    warm_start: str | None = "best",
    heuristic_target_imbalance: float = 1.05,
    threads: int | None = None,
    highs_options: dict[str, Any] | None = None,
    on_failure: str = "fallback",
    watchdog_grace_s: float = 10.0,
    solver_path: str | None = None,
    validate: bool = True,
    lp_rounding: bool = True,
    lns: bool | None = None,
    lns_max_size: int = 2,
) -> Plan:
    """Plan FlashCP's layout by solving the ILP of :mod:`flashcp.planners.ilp`.

    Optimises ``imbalance_ratio + comm_weight * (1 - comm_saving)`` subject to
    ``imbalance_ratio <= max_imbalance`` over plans that cut documents at piece boundaries
    (paper §3.4: Eq. 1, Eq. 2, Eq. 3 and Eq. 5).

    Args:
        doc_lens: (n_docs,) int, document lengths in packed order (sum C divisible by N).
        cp_size: N >= 1.
        block_size: piece granularity in tokens (see :func:`flashcp.planners.ilp.block_pieces`).
        time_limit_s: wall-clock limit of the solve (model build included), seconds; None: no
            limit and no watchdog.
        gap: relative optimality gap at which the solver may stop and call the result optimal
            (None: solver default).
        solver: ``"cbc"`` (bundled with PuLP) or ``"highs"`` (needs ``highspy``).
        formulation: ``"patterns"`` (tail patterns, tight LP bound) or ``"pieces"`` (piece
            assignment, the original); same optimum, see :mod:`flashcp.planners.ilp`.
        comm_weight: weight of ``comm_tokens / comm_tokens_full`` against the imbalance ratio in
            the objective (dimensionless, >= 0).
        max_imbalance: hard cap on the imbalance ratio (>= 1); default 1.05, the ``flashcp``
            heuristic's default target. None: no cap. Met up to the relative tolerance
            :data:`flashcp.planners.ilp.model.CAP_TOLERANCE` (a plan at exactly the cap is never
            rejected for a rounding error, nor is the warm start).
        warm_start: ``"best"`` (the better of ``flashcp`` and ``flashcp_refined`` by the
            objective, among those meeting the cap), ``"flashcp"``, ``"flashcp_refined"`` or
            None. The seed's heuristic targets ``max_imbalance`` (``heuristic_target_imbalance``
            without a cap); its cut points are added to the piece grid, and it is given to the
            solver as a MIP start. ``info["warm_start_accepted"]`` says whether the solver used
            it (None: the solver's log did not say).
        heuristic_target_imbalance: target of the seed (and of a fallback without a seed)
            when there is no cap.
        threads: solver threads (None: solver default); recorded as ``info["threads"]``.
        highs_options: further HiGHS options by name, e.g. ``{"mip_heuristic_effort": 0.5}``
            (the share of the branch-and-bound effort spent on primal heuristics; HiGHS's default
            0.05). Only with ``solver="highs"``; an unknown name or a bad value raises
            ``ValueError`` before the solve.
        on_failure: ``"fallback"`` (warn, return the warm start's plan, the better heuristic
            with ``warm_start="best"``, with status ``"fallback"``; ``info["fallback_method"]``
            names its heuristic; without a warm start the better heuristic's) or ``"raise"``
            (raise ``ValueError``) when the solver returns no solution, fails, or is killed by
            the watchdog.
        watchdog_grace_s: seconds past ``time_limit_s`` after which the solver's process group is
            killed and its temporary files deleted.
        solver_path: a CBC executable to use instead of PuLP's bundled one.
        validate: check the fallback plan's invariants (a solver's plan is always checked).
        lp_rounding: before the MIP, solve its LP relaxation and cut the fractional solution
            into a plan (each piece shared among ranks in the LP's proportions,
            :func:`flashcp.planners.ilp.model.round_fractions`); when that plan meets the cap and beats
            the warm start, its cut points are added to the grid and it becomes the MIP start
            (``info["warm_start_source"] = "lp_rounding"``). Like the warm start's cut points,
            only with a ``warm_start``: without one the grid is exactly ``block_size``'s.
        lns: improve the MIP start, before the MIP, by large-neighbourhood search over pairs of
            ranks (:func:`flashcp.planners.ilp.worker.pair_lns`: free two ranks, fix the others, solve
            the sub-MIP with HiGHS) until half of ``time_limit_s``; needs a ``warm_start`` and
            ``highspy`` (whatever ``solver`` finishes the solve). None: on when ``highspy`` is
            installed. ``lns_max_size`` (>= 2; default 2: pairs only): after a round of pairs
            brings nothing, free three ranks, then up to ``lns_max_size``, each set holding the
            rank of highest communication or workload (:func:`flashcp.planners.ilp.worker.pair_lns`). ``info``: ``lns``, ``lns_start_objective``, ``lns_objective``,
            ``lns_solves``, ``lns_time_s``, ``lns_max_size`` (the
            largest neighbourhood, in ranks, the search reached).
    Returns:
        A :class:`~flashcp.plan.Plan` with ``method="ilp"`` and status ``"ok"`` (proven optimal
        within ``gap``), ``"time_limit"`` (incumbent without proof) or ``"fallback"``. ``info``:
        ``solver``, ``formulation``, ``solver_status`` (``optimal`` / ``time_limit`` /
        ``infeasible`` / ``not_solved`` / ``killed``), ``objective`` (of the returned plan),
        ``model_objective``, ``best_bound``, ``gap`` ((objective - bound) / objective; None when
        unknown), ``saving_upper_bound`` (:func:`saving_bound`), ``seed_objective``,
        ``seed_method``, ``warm_start_given``, ``warm_start_accepted``, ``warm_start_source``,
        ``lp_rounding``, ``lp_bound`` (the root LP relaxation), ``lp_rounded_objective``,
        ``threads``, ``mip_nodes`` and ``lp_iterations`` (HiGHS's
        branch-and-bound nodes and simplex iterations of the MIP; None under CBC), ``fallback_method`` (after a fallback), ``block_size``,
        ``num_grid_pieces`` (pieces of the grid, not of the plan: :attr:`Plan.num_pieces`), ``num_binaries``, ``num_integers``, ``build_time_s``, ``solve_time_s``,
        ``solve_cpu_s`` (the MIP alone), ``total_cpu_s`` (the worker: build, LP rounding, LNS
        and MIP), ``wall_time_s``, ``time_limit_s``, ``comm_weight``, ``max_imbalance``, ``warm_start``.
    Raises:
        ValueError: bad lengths, ``cp_size`` < 1, C not divisible by N, bad options, HiGHS asked
            for but not installed, or no solution with ``on_failure="raise"``.
    """
    d = check_doc_lens(doc_lens)
    context_len = int(d.sum())
    check_cp_args(context_len, cp_size)
    n = int(cp_size)
    lns, highs_options = check_ilp_options(
        block_size=block_size, time_limit_s=time_limit_s, gap=gap, solver=solver,
        formulation=formulation, comm_weight=comm_weight, max_imbalance=max_imbalance,
        warm_start=warm_start, highs_options=highs_options, on_failure=on_failure,
        watchdog_grace_s=watchdog_grace_s, lns=lns, lns_max_size=lns_max_size, threads=threads,
        solver_path=solver_path, validate=validate, lp_rounding=lp_rounding,
        heuristic_target_imbalance=heuristic_target_imbalance,
    )  # fmt: skip
    threads = None if threads is None else int(threads)  # a NumPy integer as a Python int
    target = float(max_imbalance) if max_imbalance is not None else heuristic_target_imbalance

    t0 = time.perf_counter()
    seed = None if warm_start is None else _heuristic(d, n, warm_start, target, comm_weight)
    cuts = None if seed is None else (seed.doc, seed.start)
    pdoc, pstart, plen = block_pieces(d, block_size, cuts)
    inst = Instance(d, n, pdoc, pstart, plen, float(comm_weight), max_imbalance)
    seed_rank = (
        None
        if seed is None
        else piece_ranks(seed.rank, seed.doc, seed.start, pdoc, pstart, context_len)
    )
    job = {
        "formulation": formulation,
        "instance": inst,
        "seed_rank": seed_rank,
        "solver": solver,
        "solver_path": solver_path,
        "time_limit_s": time_limit_s,
        "gap": gap,
        "threads": threads,
        "highs_options": highs_options,
        "lp_rounding": bool(lp_rounding) and seed is not None,
        "lns": bool(lns) and seed is not None,
        "lns_max_size": int(lns_max_size),
        "seed_objective": None if seed is None else plan_objective(seed, comm_weight),
    }
    res = run_job(job, time_limit_s, watchdog_grace_s)
    if res.get("instance") is not None:  # the rounded LP start refined the grid
        inst = res["instance"]
        pdoc, pstart, plen = inst.pdoc, inst.pstart, inst.plen
    wall = time.perf_counter() - t0

    info: dict[str, Any] = {
        "solver": solver,
        "formulation": formulation,
        "block_size": int(block_size),
        "num_grid_pieces": int(pdoc.size),
        "num_binaries": res.get("num_binaries"),
        "num_integers": res.get("num_integers"),
        "build_time_s": res.get("build_time_s"),
        "solve_time_s": res.get("solve_time_s"),
        "solve_cpu_s": res.get("solve_cpu_s"),
        "total_cpu_s": res.get("total_cpu_s"),
        "wall_time_s": wall,
        "time_limit_s": time_limit_s,
        "comm_weight": float(comm_weight),
        "max_imbalance": max_imbalance,
        "warm_start": warm_start,
        "highs_options": highs_options,
        "threads": threads,
        "seed_method": None if seed is None else seed.method,
        "seed_objective": None if seed is None else plan_objective(seed, comm_weight),
        "warm_start_given": bool(res.get("warm_start_given")),
        "warm_start_accepted": res.get("warm_start_accepted"),
        "warm_start_source": res.get("warm_start_source"),
        "lp_rounding": job["lp_rounding"],
        "lns": job["lns"],
        "lns_start_objective": res.get("lns_start_objective"),
        "lns_objective": res.get("lns_objective"),
        "lns_solves": res.get("lns_solves"),
        "lns_time_s": res.get("lns_time_s"),
        "lp_bound": res.get("lp_bound"),
        "lp_rounded_objective": res.get("lp_rounded_objective"),
        "lns_max_size": res.get("lns_max_size"),
        "mip_nodes": res.get("mip_nodes"),
        "lp_iterations": res.get("lp_iterations"),
    }
    error = res.get("error")
    if res["sol"] in ("optimal", "feasible"):
        solver_status = "optimal" if res["sol"] == "optimal" else "time_limit"
        assign = res["assign"]
        order = np.lexsort((pstart, pdoc, assign))
        try:
            plan = make_plan(
                "ilp",
                n,
                d,
                assign[order],
                pdoc[order],
                pstart[order],
                plen[order],
                status="ok" if solver_status == "optimal" else "time_limit",
                info=info,
                validate=True,
            )
        except ValueError as exc:
            plan, error = None, f"solution violates the plan invariants: {exc}"
        if plan is not None:
            obj = plan_objective(plan, comm_weight)
            bound = res["bound"]
            if solver_status == "optimal" and bound is None:
                bound = obj
            solved = {
                "solver_status": solver_status,
                "objective": obj,
                "model_objective": res["model_objective"],
                "best_bound": bound,
                "gap": None if bound is None else max(0.0, (obj - bound) / abs(obj)),
                "saving_upper_bound": saving_bound(bound, max_imbalance, comm_weight),
            }
            return replace(plan, info={**plan.info, **solved})  # Plan makes info JSON-clean
        solver_status = "not_solved"
    elif res["sol"] == "infeasible":
        solver_status = "infeasible"
    elif res.get("killed"):
        solver_status = "killed"
    else:
        solver_status = "not_solved"

    reason = (
        f"ILP ({solver}, {formulation}, block_size={block_size}, {pdoc.size} pieces) returned no "
        f"solution: {solver_status}" + (f" ({error})" if error else "")
    )
    if on_failure == "raise":
        raise ValueError(reason)
    # the warm start is the better heuristic's plan (warm_start="best"); without one, pick it now
    h = seed if seed is not None else _heuristic(d, n, "best", target, comm_weight)
    warnings.warn(
        reason + f"; returning the {h.method} heuristic's plan (status 'fallback')",
        RuntimeWarning,
        stacklevel=2,
    )
    info.update(
        solver_status=solver_status,
        fallback_method=h.method,
        fallback_reason=reason,
        heuristic_status=h.status,
        objective=plan_objective(h, comm_weight),
        model_objective=None,
        best_bound=None,
        gap=None,
        saving_upper_bound=None,
    )
    return make_plan(
        "ilp",
        n,
        d,
        h.rank,
        h.doc,
        h.start,
        h.length,
        status="fallback",
        info=info,
        validate=validate,
    )


#: the method's entry in the registry (declared in pyproject.toml's ``flashcp.methods`` entry points)
METHOD = MethodSpec(
    name="ilp", display_name="ILP", order=70, planner=plan_ilp,
    comm_kind=CommKind.ALLGATHER_SHARDED, op=OpFamily.ALLGATHER, color="#8c564b", fast=False, reports_solve=True,
    check_options=check_ilp_options,
)  # fmt: skip
