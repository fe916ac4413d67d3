"""Exact FlashCP planning as an integer linear programme (arXiv 2606.08476, §3.4; docs/design.md §3).

The heuristic (:mod:`flashcp.planners.flashcp`) decides which documents to cut and where; this
package solves the same problem exactly at a chosen granularity, with PuLP and CBC (bundled) or
HiGHS (``pip install flashcp[highs]``): minimise ``imbalance_ratio + comm_weight * comm_tokens /
comm_tokens_full`` subject to ``imbalance_ratio <= max_imbalance`` (default 1.05, the heuristic's
target), over plans that cut documents only on a grid of ``block_size`` pieces. Modules:
:mod:`~flashcp.planners.ilp.model` (pieces and the two formulations),
:mod:`~flashcp.planners.ilp.worker` (the solver process and its watchdog),
:mod:`~flashcp.planners.ilp.planner` (:func:`plan_ilp`: warm start, solve, read the plan, fall
back). The formulations, the LP-relaxation start, the neighbourhood search and how a solve's
status is read: docs/table2.md ("How the ILP is built").
"""

from flashcp.planners.ilp.model import CAP_TOLERANCE, FORMULATIONS, block_pieces, meets_cap
from flashcp.planners.ilp.planner import plan_ilp, plan_objective, saving_bound

__all__ = [
    "CAP_TOLERANCE",
    "FORMULATIONS",
    "block_pieces",
    "meets_cap",
    "plan_ilp",
    "plan_objective",
    "saving_bound",
]
