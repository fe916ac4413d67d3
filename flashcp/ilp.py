"""Exact FlashCP planning as an integer linear programme (arXiv 2606.08476, §3.4; DESIGN.md §3).

The heuristic (:mod:`flashcp.heuristic`) decides which documents to cut and where; this module
solves the same problem exactly at a chosen granularity, with PuLP and CBC (bundled) or HiGHS
(``pip install flashcp[highs]``).

Pieces
------
Every document ``d`` is cut into *pieces* on a grid of ``block_size`` tokens aligned to the end of
the document: piece boundaries sit at ``len_d - k * block_size``. All pieces but the first hold
exactly ``block_size`` tokens; the first (the document's head) holds ``len_d mod block_size``
tokens (or ``block_size`` when that is 0), and a document no longer than ``block_size`` is one
piece. Aligning to the end leaves the short, cheap remainder at the head, which is where moving a
few tokens costs least (moving a head of h tokens costs h tokens of KV, paper Fig. 4). A plan can
cut a document only at piece boundaries, so the optimum is optimal *at that granularity*: finer
blocks admit better plans and larger models (pieces ~ C / block_size + n_docs).

With a warm start (the default), the cut points of a heuristic's plan are added to the grid
(:func:`block_pieces` ``extra_cuts``), so that plan is representable and is handed to the solver
as its first incumbent. This matters: exact token equality (Eq. 2) over pieces of arbitrary
lengths is a subset-sum problem, and at 128K neither CBC nor HiGHS reliably finds *any* feasible
assignment within a minute from scratch.

Variables
---------
* ``x[i, r]`` in {0, 1}: piece i sits on rank r (binary).
* ``y[i, r]`` in [0, 1]: piece i and every later piece of its document sit on rank r ("rank r holds
  the document's tail from piece i on"). Only for pieces that are not their document's last one;
  for the last piece ``y = x``. Continuous: at an integral ``x`` it can always be raised to
  ``min(x, y_next)`` in {0, 1} without worsening the objective, so an optimum with integral y exists.
* ``z_w`` >= 0: the imbalance ratio, max_r W_r / mean_r W_r (Eq. 3 and the ratio's definition).
* ``z_c`` >= 0: communication as a fraction of the full all-gather, comm_tokens / comm_tokens_full.

Constraints
-----------
* Eq. 1 (each piece on exactly one rank): ``sum_r x[i, r] = 1``.
* Eq. 2 (exactly C / N tokens per rank): ``sum_i len_i x[i, r] = C / N`` for every r.
* Workload (Eq. 3; linearisation of a max): ``sum_i w_i x[i, r] <= z_w * W_mean`` for every r, with
  ``w_i = (2 p_i + s_i + 1) s_i / 2`` the workload of piece i (prefix p_i, length s_i) and
  ``W_mean = sum_d len_d (len_d + 1) / 2 / N``. Eq. 3 is additive over contiguous pieces, so a
  rank's workload is linear in x whichever pieces it merges into shards.
* Tail indicator (linearisation of a conjunction): ``y[i, r] <= x[i, r]`` and
  ``y[i, r] <= y[next(i), r]``, so ``y[i, r]`` can be 1 only when rank r holds pieces i..last.
* Communication (Eq. 5; linearisation of a max): a piece's KV is communicated exactly when some
  later piece of its document sits on another rank, i.e. when it is not part of its document's
  last shard; the piece then counts for the rank holding it. Per rank,
  ``sum_{i non-last} len_i (x[i, r] - y[i, r]) <= z_c * C / N``, so that
  ``(N - 1) * z_c * C / N`` bounds Eq. 5's ``(N - 1) * max_j sum(non-last tokens of rank j)`` and
  ``z_c`` bounds ``comm_tokens / comm_tokens_full`` (Eq. 4), i.e. ``1 - comm_saving``.
* Optional cap: ``z_w <= max_imbalance``.
* Symmetry breaking: ranks are interchangeable, so the last piece of the longest document is fixed
  on rank 0.

Objective
---------
``minimise z_w + comm_weight * z_c`` = imbalance_ratio + comm_weight * (1 - comm_saving): the
maximum rank workload (normalised by the mean, a constant) plus a weighted communication term.
With ``comm_weight = 1`` one percent of imbalance costs as much as one percent of the full
all-gather volume. At the optimum both maxima are tight, so the objective equals the plan's own
metrics (:attr:`Plan.imbalance_ratio`, :attr:`Plan.comm_saving`); :func:`plan_objective` computes it
for any plan.

Solving honestly
----------------
PuLP's ``LpStatus`` reads "Optimal" for a MIP that stopped on its time limit with an incumbent, so
the planner reads the *solution* status (``sol_status``): proven optimal (within ``gap``) gives
status ``"ok"``; an incumbent without proof gives status ``"time_limit"`` (the plan is the incumbent;
``info`` holds its best bound and gap); no solution (infeasible, time limit before any incumbent,
solver error) never yields a plan read from the solver: the planner warns and returns the
``flashcp`` heuristic's plan with status ``"fallback"`` (or raises ``ValueError`` with
``on_failure="raise"``). The best bound B also bounds what any plan on the same pieces can save:
with the cap ``max_imbalance``, ``comm_saving <= 1 - max(0, B - max_imbalance) / comm_weight``
(``info["saving_upper_bound"]``).

Practice at 128K, N = 4, 1K blocks (about 200 pieces, 800 binaries): the LP relaxation is weak
(fractional assignments spread every document over every rank and pay no communication), so
within minutes neither solver closes the gap (typically 3-15 %) nor improves on a good warm start.
The paper reports tens of minutes per sequence for its ILP.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
import warnings
from typing import Any

import numpy as np

from flashcp.plan import Plan, check_cp_args, check_doc_lens, make_plan

__all__ = ["block_pieces", "plan_ilp", "plan_objective"]

_SOLVERS = ("cbc", "highs")
_FAILURES = ("fallback", "raise")


def block_pieces(
    doc_lens, block_size: int, extra_cuts: tuple[np.ndarray, np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ILP's pieces: every document cut on a ``block_size`` grid aligned to its end.

    Args:
        doc_lens: (n_docs,) int, document lengths.
        block_size: granularity in tokens, >= 1.
        extra_cuts: optional ``(doc, pos)``, (k,) int each: further cut points (token offsets
            inside documents, 0 < pos < len) added to the grid, e.g. the cuts of a seed plan.
    Returns:
        ``(doc, start, length)``: (n_pieces,) int64 each, ordered by document, then start. Without
        ``extra_cuts``, within a document the first piece has ``len mod block_size`` tokens
        (``block_size`` if that is 0) and every other piece exactly ``block_size``.
    Raises:
        ValueError: ``block_size`` < 1.
    """
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int | np.integer)
        or block_size < 1
    ):
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    d = np.asarray(doc_lens, dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(d)])  # (n_docs + 1,) global document starts
    counts = -(-d // block_size)  # (n_docs,) grid pieces per document
    doc = np.repeat(np.arange(d.size, dtype=np.int64), counts)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    k = np.arange(doc.size, dtype=np.int64) - first[doc]  # piece index from the document's end
    # global token positions where a piece starts: document starts and the end-aligned grid
    bounds = [cu[:-1], cu[doc + 1] - k * block_size]
    if extra_cuts is not None:
        cdoc, cpos = (np.asarray(a, dtype=np.int64) for a in extra_cuts)
        inside = (cpos > 0) & (cpos < d[cdoc])
        bounds.append(cu[cdoc[inside]] + cpos[inside])
    cuts = np.unique(np.concatenate([*bounds, cu[-1:]]))
    pos, length = cuts[:-1], np.diff(cuts)
    doc = np.searchsorted(cu, pos, side="right") - 1
    return doc, pos - cu[doc], length


def plan_objective(plan: Plan, comm_weight: float = 1.0) -> float:
    """The ILP's objective evaluated on any plan: ``imbalance_ratio + comm_weight * (1 - comm_saving)``.

    Dimensionless; imbalance from Eq. 3, communication from Eq. 5 over Eq. 4.
    """
    return plan.imbalance_ratio + comm_weight * (1.0 - plan.comm_saving)


def _heuristic(doc_lens: np.ndarray, cp_size: int, method: str, target: float) -> Plan:
    """The seed / fallback plan of ``method`` (``flashcp`` or ``flashcp_refined``)."""
    if method == "flashcp":
        from flashcp.heuristic import plan_flashcp

        return plan_flashcp(doc_lens, cp_size, target_imbalance=target)
    if method == "flashcp_refined":
        from flashcp.refined import plan_flashcp_refined

        return plan_flashcp_refined(doc_lens, cp_size, target_imbalance=target)
    raise ValueError(f"warm_start must be 'flashcp', 'flashcp_refined' or None, got {method!r}")


def _cbc_bound(log_path: str) -> float | None:
    """Best bound from CBC's log (the last "Lower bound:" line of its result block), or None."""
    try:
        with open(log_path) as f:
            found = re.findall(r"^Lower bound:\s*(\S+)", f.read(), flags=re.MULTILINE)
        return float(found[-1]) if found else None
    except (OSError, ValueError):
        return None


def _solve(
    prob,
    variables: list,
    start: list[float] | None,
    solver: str,
    time_limit_s: float | None,
    gap: float | None,
    threads: int | None,
) -> tuple[int, float | None, str | None]:
    """Solve ``prob`` in place; return ``(sol_status, best_bound, error)``.

    ``sol_status`` is PuLP's *solution* status (``LpSolution*``), which, unlike ``LpStatus``, tells
    a proven optimum from an incumbent cut short by the time limit. CBC's "Integer infeasible"
    leaves ``sol_status`` at "no solution found" and ``status`` at "Infeasible"; it is returned as
    ``LpSolutionInfeasible``.

    ``start`` (values of ``variables``, or None) is a MIP start. The bound is the solver's best
    dual bound (None when unknown); ``error`` is the solver's error message, if it failed.
    """
    import pulp

    with tempfile.TemporaryDirectory(prefix="flashcp_ilp_") as tmp:
        log_path = os.path.join(tmp, "cbc.log")
        try:
            if solver == "cbc":
                if start is not None:
                    for v, val in zip(variables, start, strict=True):
                        v.setInitialValue(val)
                with warnings.catch_warnings():  # PuLP 3.x deprecates the bundled CBC's class name
                    warnings.simplefilter("ignore", DeprecationWarning)
                    slv = pulp.PULP_CBC_CMD(
                        msg=False,
                        timeLimit=time_limit_s,
                        gapRel=gap,
                        threads=threads,
                        logPath=log_path,
                        warmStart=start is not None,
                    )
                prob.solve(slv)
                sol = prob.sol_status
                if sol == pulp.LpSolutionNoSolutionFound and prob.status == pulp.LpStatusInfeasible:
                    sol = pulp.LpSolutionInfeasible
                return sol, _cbc_bound(log_path), None
            slv = pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=gap, threads=threads)
            if not slv.available():
                raise ValueError(
                    "solver='highs' needs the highspy package: pip install 'flashcp[highs]'"
                )
            # PuLP's HiGHS interface has no MIP start: its actualSolve, with setSolution added
            import highspy

            slv.createAndConfigureSolver(prob)
            slv.buildSolverModel(prob)
            if start is not None:
                sol = highspy.HighsSolution()
                vals = [0.0] * prob.solverModel.getNumCol()
                for v, val in zip(variables, start, strict=True):
                    vals[v.index] = float(val)
                sol.col_value = vals
                sol.value_valid = True
                prob.solverModel.setSolution(sol)
            slv.callSolver(prob)
            status, sol_status = slv.findSolutionValues(prob)
            prob.assignStatus(status, sol_status)
            return sol_status, float(prob.solverModel.getInfo().mip_dual_bound), None
        except pulp.PulpSolverError as exc:  # the solver crashed or wrote no solution
            return pulp.LpSolutionNoSolutionFound, None, str(exc)


def _saving_bound(
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


def plan_ilp(
    doc_lens,
    cp_size: int,
    *,
    block_size: int = 1024,
    time_limit_s: float | None = 60.0,
    gap: float | None = 1e-4,
    solver: str = "cbc",
    comm_weight: float = 1.0,
    max_imbalance: float | None = None,
    warm_start: str | None = "flashcp",
    heuristic_target_imbalance: float = 1.05,
    threads: int | None = None,
    on_failure: str = "fallback",
    validate: bool = True,
) -> Plan:
    """Plan FlashCP's layout by solving the ILP of the module docstring.

    Args:
        doc_lens: (n_docs,) int, document lengths in packed order (sum C divisible by N).
        cp_size: N >= 1.
        block_size: piece granularity in tokens (see :func:`block_pieces`); the model has about
            ``N * (C / block_size + n_docs)`` binaries.
        time_limit_s: solver wall-clock limit in seconds (None: no limit).
        gap: relative optimality gap at which the solver may stop and call the result optimal
            (None: solver default).
        solver: ``"cbc"`` (bundled with PuLP) or ``"highs"`` (needs ``highspy``).
        comm_weight: weight of ``comm_tokens / comm_tokens_full`` against the imbalance ratio in
            the objective (dimensionless, >= 0).
        max_imbalance: optional hard cap on the imbalance ratio (>= 1).
        warm_start: ``"flashcp"``, ``"flashcp_refined"`` or None. When set, that heuristic's plan
            (target ``max_imbalance`` if given, else ``heuristic_target_imbalance``) is computed,
            its cut points are added to the piece grid so that it is representable, and it is
            given to the solver as a MIP start. The optimum is then optimal over the grid refined
            by those cuts, and never worse than the seed (when the seed meets ``max_imbalance``).
            Without it, exact token equality (Eq. 2) is a subset-sum problem on which CBC and
            HiGHS often find no solution within a minute at 128K.
        heuristic_target_imbalance: target imbalance of the seed and the fallback heuristic.
        threads: solver threads (None: solver default).
        on_failure: ``"fallback"`` (warn, return the ``flashcp`` heuristic's plan with status
            ``"fallback"``) or ``"raise"`` (raise ``ValueError``) when the solver returns no
            solution.
        validate: check the plan's invariants.
    Returns:
        A :class:`~flashcp.plan.Plan` with ``method="ilp"`` and status ``"ok"`` (proven optimal
        within ``gap``), ``"time_limit"`` (incumbent without proof) or ``"fallback"``. ``info``:
        ``solver``, ``solver_status`` (``optimal`` / ``time_limit`` / ``infeasible`` /
        ``not_solved``), ``objective`` (of the returned plan), ``best_bound``, ``gap`` (relative,
        (objective - bound) / objective; None when unknown), ``saving_upper_bound`` (the most
        comm_saving any plan on the same pieces can reach under ``max_imbalance``, from the bound;
        None without a cap), ``seed_objective``, ``block_size``,
        ``num_pieces``, ``num_binaries``, ``build_time_s``, ``solve_time_s``, ``comm_weight``,
        ``max_imbalance``, ``warm_start``.
    Raises:
        ValueError: bad lengths, ``cp_size`` < 1, C not divisible by N, bad options, HiGHS asked
            for but not installed, or no solution with ``on_failure="raise"``.
    """
    import pulp

    d = check_doc_lens(doc_lens)
    n = cp_size
    context_len = int(d.sum())
    check_cp_args(context_len, n)
    if solver not in _SOLVERS:
        raise ValueError(f"solver must be one of {_SOLVERS}, got {solver!r}")
    if on_failure not in _FAILURES:
        raise ValueError(f"on_failure must be one of {_FAILURES}, got {on_failure!r}")
    if not np.isfinite(comm_weight) or comm_weight < 0:
        raise ValueError(f"comm_weight must be a finite number >= 0, got {comm_weight!r}")
    if max_imbalance is not None and not max_imbalance >= 1.0:
        raise ValueError(f"max_imbalance must be >= 1 or None, got {max_imbalance!r}")
    if time_limit_s is not None and not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0 or None, got {time_limit_s!r}")
    if gap is not None and not gap >= 0:
        raise ValueError(f"gap must be >= 0 or None, got {gap!r}")
    target = float(max_imbalance) if max_imbalance is not None else heuristic_target_imbalance

    t0 = time.perf_counter()
    seed = None if warm_start is None else _heuristic(d, n, warm_start, target)
    tpr = context_len // n
    cuts = None if seed is None else (seed.doc, seed.start)
    pdoc, pstart, plen = block_pieces(d, block_size, cuts)
    npieces = pdoc.size
    pwork = (2 * pstart + plen + 1) * plen // 2  # Eq. 3 per piece
    mean_work = float((d * (d + 1) // 2).sum()) / n
    is_last = pstart + plen == d[pdoc]

    prob = pulp.LpProblem("flashcp_ilp", pulp.LpMinimize)
    ranks = range(n)
    var = prob.add_variable
    x = [[var(f"x_{i}_{r}", 0, 1, cat=pulp.LpBinary) for r in ranks] for i in range(npieces)]
    y: dict[int, list[Any]] = {}
    for i in np.flatnonzero(~is_last).tolist():
        y[i] = [var(f"y_{i}_{r}", 0, 1) for r in ranks]
    z_w = var("z_w", 0, max_imbalance)
    z_c = var("z_c", 0)
    prob += z_w + float(comm_weight) * z_c

    lens, works = plen.tolist(), pwork.tolist()
    for i in range(npieces):  # Eq. 1
        prob += pulp.lpSum(x[i]) == 1, f"eq1_{i}"
    for r in ranks:
        prob += pulp.lpSum(lens[i] * x[i][r] for i in range(npieces)) == tpr, f"eq2_{r}"
        prob += (
            pulp.lpSum((works[i] / mean_work) * x[i][r] for i in range(npieces)) <= z_w,
            f"work_{r}",
        )
        prob += pulp.lpSum((lens[i] / tpr) * (x[i][r] - y[i][r]) for i in y) <= z_c, f"comm_{r}"
    for i, yi in y.items():  # the next piece of a non-last piece is i + 1
        for r in ranks:
            prob += yi[r] <= x[i][r], f"tail_x_{i}_{r}"
            prob += yi[r] <= (y[i + 1][r] if i + 1 in y else x[i + 1][r]), f"tail_y_{i}_{r}"
    # symmetry breaking: the last piece of the longest document on rank 0
    longest = int(np.argmax(d))
    sym_piece = int(np.flatnonzero((pdoc == longest) & is_last)[0])

    start_vals, variables = None, []
    if seed is not None:
        # rank of every piece in the seed: the shard containing the piece's first token
        order = np.lexsort((seed.start, seed.doc))
        key_seed = seed.doc[order] * (context_len + 1) + seed.start[order]
        idx = np.searchsorted(key_seed, pdoc * (context_len + 1) + pstart, side="right") - 1
        srank = seed.rank[order][idx]
        perm = np.arange(n)  # relabel ranks so that the symmetry-breaking constraint holds
        perm[[0, srank[sym_piece]]] = perm[[srank[sym_piece], 0]]
        srank = perm[srank]
        xs = np.zeros((npieces, n))
        xs[np.arange(npieces), srank] = 1.0
        ys = np.zeros((npieces, n))
        for i in range(npieces - 1, -1, -1):
            ys[i] = xs[i] if is_last[i] else np.minimum(xs[i], ys[i + 1])
        start_vals = []
        for i in range(npieces):
            variables += x[i]
            start_vals += xs[i].tolist()
            if i in y:
                variables += y[i]
                start_vals += ys[i].tolist()
        variables += [z_w, z_c]
        # the two maxima, a hair above their values so rounding cannot make the start infeasible
        start_vals += [seed.imbalance_ratio + 1e-9, 1.0 - seed.comm_saving + 1e-9]
        if max_imbalance is not None and seed.imbalance_ratio > max_imbalance:
            start_vals = None  # the seed breaks the cap: no MIP start
    prob += x[sym_piece][0] == 1, "sym"
    build_s = time.perf_counter() - t0

    t1 = time.perf_counter()
    sol, bound, error = _solve(prob, variables, start_vals, solver, time_limit_s, gap, threads)
    solve_s = time.perf_counter() - t1

    info: dict[str, Any] = {
        "solver": solver,
        "block_size": int(block_size),
        "num_pieces": int(npieces),
        "num_binaries": int(npieces * n),
        "build_time_s": build_s,
        "solve_time_s": solve_s,
        "time_limit_s": time_limit_s,
        "comm_weight": float(comm_weight),
        "max_imbalance": max_imbalance,
        "warm_start": warm_start,
        "seed_objective": None if seed is None else plan_objective(seed, comm_weight),
    }
    if sol in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        solver_status = "optimal" if sol == pulp.LpSolutionOptimal else "time_limit"
        xv = np.array([[v.value() or 0.0 for v in row] for row in x])  # (n_pieces, N)
        assign = xv.argmax(axis=1)
        if (np.abs(xv.max(axis=1) - 1.0) < 1e-6).all():
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
        else:
            plan, error = None, "the solver returned a fractional assignment"
        if plan is not None:
            obj = plan_objective(plan, comm_weight)
            if bound is not None and not np.isfinite(bound):
                bound = None
            if solver_status == "optimal" and bound is None:
                bound = obj
            plan.info.update(
                solver_status=solver_status,
                objective=obj,
                model_objective=float(pulp.value(prob.objective)),
                best_bound=bound,
                gap=None if bound is None else max(0.0, (obj - bound) / abs(obj)),
                saving_upper_bound=_saving_bound(bound, max_imbalance, comm_weight),
            )
            return plan
        solver_status = "not_solved"
    elif sol == pulp.LpSolutionInfeasible:
        solver_status = "infeasible"
    else:
        solver_status = "not_solved"

    reason = (
        f"ILP ({solver}, block_size={block_size}, {npieces} pieces) returned no solution: "
        f"{solver_status}" + (f" ({error})" if error else "")
    )
    if on_failure == "raise":
        raise ValueError(reason)
    warnings.warn(
        reason + "; returning the flashcp heuristic's plan (status 'fallback')",
        RuntimeWarning,
        stacklevel=2,
    )
    h = _heuristic(d, n, "flashcp", heuristic_target_imbalance)
    info.update(
        solver_status=solver_status,
        fallback_method="flashcp",
        fallback_reason=reason,
        heuristic_status=h.status,
        objective=plan_objective(h, comm_weight),
        best_bound=None,
        gap=None,
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
