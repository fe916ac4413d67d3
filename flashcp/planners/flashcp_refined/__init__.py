"""``method=flashcp_refined``: a two-dimensional packing heuristic over FlashCP's layout (the
paper's plan as one candidate). :func:`plan_flashcp_refined` runs the compiled passes
(:mod:`.compiled`) when numba is available and the readable reference passes (:mod:`.reference`,
which explains the packing) otherwise, with the same plans; :func:`plan_flashcp_refined_reference`
always runs the reference.
"""

from __future__ import annotations

import numpy as np

from flashcp import compiled as loader
from flashcp.kinds import CommKind, OpFamily
from flashcp.plan import (
    Plan,
    check_cp_args,
    check_doc_lens,
    doc_workload,
    make_plan,
    planner_entry,
)
from flashcp.planners.flashcp import plan_flashcp, plan_flashcp_reference
from flashcp.planners.flashcp_refined.reference import _VARIANTS, _pack, _rank_key
from flashcp.registry import MethodSpec

__all__ = ["METHOD", "plan_flashcp_refined", "plan_flashcp_refined_reference"]


def _plan(
    doc_lens, cp_size: int, target_imbalance: float, num_candidates: int, validate: bool,
    compiled_ok: bool,
) -> Plan:  # fmt: skip
    """:func:`plan_flashcp_refined` with the compiled passes (:mod:`flashcp.planners.flashcp_refined.compiled`) and
    paper's plan when ``compiled_ok`` and they are available, else the reference ones."""
    d = check_doc_lens(doc_lens)
    n = cp_size
    check_cp_args(int(d.sum()), n)
    try:
        ok = np.isfinite(float(target_imbalance)) and float(target_imbalance) >= 1.0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"target_imbalance must be a number >= 1, got {target_imbalance!r}")
    if (
        isinstance(num_candidates, bool)
        or not isinstance(num_candidates, int | np.integer)
        or not 0 <= num_candidates <= len(_VARIANTS)
    ):
        raise ValueError(
            f"num_candidates must be an integer in 0..{len(_VARIANTS)}, got {num_candidates!r}"
        )
    target = float(target_imbalance)
    lens = d.tolist()
    tpr = int(d.sum()) // n
    mean_work = float(doc_workload(d).sum()) / n
    order = sorted(range(len(lens)), key=lambda i: -lens[i])

    kernels = loader.load("refined") if compiled_ok else None
    paper_planner = plan_flashcp if compiled_ok else plan_flashcp_reference
    paper = paper_planner(d, n, target_imbalance=target, validate=False)
    if kernels is not None:
        d_order = np.asarray(order, dtype=np.int64)
    ratio = paper.imbalance_ratio
    paper_key = _rank_key(ratio, paper.comm_tokens, target)
    best_key, best, construction = paper_key, None, "paper"
    candidates = 1
    # the passes with budgets from R; when none of them (nor the paper's plan) meets R, the best
    # balanced of the paper's plan and passes with budgets from 1.0 instead, a choice that does not
    # depend on R: so a target equal to a ratio the planner returned is met again
    for scale in (target, 1.0):
        for f, spread, alpha, zz, jt, df in _VARIANTS[:num_candidates]:
            # a pass that sends more than the best candidate meeting R cannot win: cut it short
            bound = best_key[1] // max(1, n - 1) if not best_key[0] else tpr
            budget = f * scale * mean_work
            # nor can one whose workload ends above R once a candidate meets R
            cap = target * mean_work * (1 + 1e-12) if not best_key[0] else float("inf")
            if kernels is None:
                res = _pack(lens, order, n, tpr, budget, spread or n, alpha, zz, jt, bound, df, cap)
            else:
                done, *res = kernels.pack(
                    d, d_order, n, tpr, budget, spread or n, alpha, zz, jt, bound, df, cap
                )
                res = res if done else None
            candidates += 1
            if res is None:
                continue
            rows, max_work, max_send = res
            ratio = max_work / mean_work if mean_work else 1.0
            key = _rank_key(ratio, (n - 1) * max_send, target)
            if key < best_key:
                best_key, best = key, rows
                construction = (
                    f"pack_budget{f * scale:g}_spread{spread or 'N'}_alpha{alpha:g}"
                    + "_zigzag" * zz
                    + "_joint" * jt
                    + "_defer" * df
                )
        if not best_key[0] or scale == 1.0:
            break
        best_key, best, construction = paper_key, None, "paper"
    info = {
        "construction": construction,
        "candidates": candidates,
        "target_imbalance": target,
    }
    status = "target_not_met" if best_key[0] else "ok"
    if best is None:
        cols = (paper.rank, paper.doc, paper.start, paper.length)
    else:
        cols = np.array(best, dtype=np.int64).reshape(-1, 4).T
    return make_plan("flashcp_refined", n, d, *cols, status=status, info=info, validate=validate)


@planner_entry("flashcp_refined")
def plan_flashcp_refined(
    doc_lens,
    cp_size: int,
    *,
    target_imbalance: float = 1.02,
    num_candidates: int = len(_VARIANTS),
    validate: bool = True,
) -> Plan:
    """Plan a FlashCP layout by the packing of the module docstring.

    Args:
        doc_lens: (n_docs,) int, document lengths in packed order (sum C divisible by N; zero-length
            documents and pad: :func:`~flashcp.plan.planner_entry`).
        cp_size: N >= 1.
        target_imbalance: R >= 1, the imbalance ratio (max / mean workload per rank) to reach.
        num_candidates: packing variants tried, 0 to 8 (:data:`_VARIANTS`, best on average
            first); the paper's plan is always one more candidate.
        validate: check the plan's invariants.
    Returns:
        A :class:`~flashcp.plan.Plan` with ``method="flashcp_refined"``, status ``"ok"`` when the
        imbalance ratio is <= R, else ``"target_not_met"``. ``info``: ``construction``
        (``pack_budget<B / W_mean>_spread<s>_alpha<a>[_zigzag][_joint][_defer]``, or ``paper`` when
        Algorithm 1's plan won), ``candidates``
        (plans compared) and ``target_imbalance``.
    Raises:
        ValueError: bad lengths, ``cp_size`` < 1, C not divisible by N, R < 1 or not a number, or
            ``num_candidates`` not an integer in 0..8.
    """
    return _plan(doc_lens, cp_size, target_imbalance, num_candidates, validate, compiled_ok=True)


@planner_entry("flashcp_refined")
def plan_flashcp_refined_reference(
    doc_lens,
    cp_size: int,
    *,
    target_imbalance: float = 1.02,
    num_candidates: int = len(_VARIANTS),
    validate: bool = True,
) -> Plan:
    """:func:`plan_flashcp_refined` with the readable pure-Python passes (:func:`_pack`) and the
    reference Algorithm 1: the oracle of the compiled planner (same plans)."""
    return _plan(doc_lens, cp_size, target_imbalance, num_candidates, validate, compiled_ok=False)


#: the method's entry in the registry (declared in pyproject.toml's ``flashcp.methods`` entry points)
METHOD = MethodSpec(
    name="flashcp_refined", display_name="FlashCP (refined)", order=60, planner=plan_flashcp_refined,
    comm_kind=CommKind.ALLGATHER_SHARDED, op=OpFamily.ALLGATHER, color="#9467bd",
)  # fmt: skip
