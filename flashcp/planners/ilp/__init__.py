"""Exact FlashCP planning as an integer linear programme (arXiv 2606.08476, §3.4; docs/design.md §3).

The heuristic (:mod:`flashcp.planners.flashcp`) decides which documents to cut and where; this package
solves the same problem exactly at a chosen granularity, with PuLP and CBC (bundled) or HiGHS
(``pip install flashcp[highs]``). Modules: :mod:`~flashcp.planners.ilp.model` (pieces and the two
formulations), :mod:`~flashcp.planners.ilp.worker` (the solver process and its watchdog),
:mod:`~flashcp.planners.ilp.planner` (:func:`plan_ilp`: warm start, solve, read the plan, fall back).

What it optimises
-----------------
``minimise imbalance_ratio + comm_weight * comm_tokens / comm_tokens_full`` subject to
``imbalance_ratio <= max_imbalance``, over every plan that cuts documents only at piece
boundaries and gives each rank exactly C / N tokens (Eq. 1, Eq. 2). Imbalance is Eq. 3's max over
mean; communication is Eq. 5 over Eq. 4, i.e. ``1 - comm_saving``. By default the cap is the
``flashcp`` heuristic's target (1.05), so the ILP never trades balance beyond what the paper's
heuristic allows; ``max_imbalance=None`` removes it (then ``comm_weight`` alone sets the
trade-off, and a plan 2x out of balance can be "optimal" when it saves enough communication).

Pieces
------
Every document ``d`` is cut into *pieces* on a grid of ``block_size`` tokens aligned to the end of
the document (:func:`block_pieces`): all pieces but the first hold ``block_size`` tokens; the
first (the head) holds the remainder. Aligning to the end leaves the short, cheap remainder at the
head, where moving tokens costs least (moving a head of h tokens costs h tokens of KV, paper
Fig. 4). The optimum is optimal *at that granularity*. With a warm start, the seed plan's cut
points are added to the grid so the seed is representable and becomes the first incumbent.

Formulation ``pieces`` (the original, kept for comparison)
----------------------------------------------------------
``x[i, r]`` binary (piece i on rank r); ``y[i, r]`` in [0, 1] (pieces i..last of its document all
on rank r, linearised by ``y[i, r] <= x[i, r]``, ``y[i, r] <= y[i+1, r]``); per rank, tokens
``sum len_i x[i, r] = C / N``, workload ``sum w_i x[i, r] <= z_w W_mean`` and non-last tokens
``sum len_i (x[i, r] - y[i, r]) <= z_c C / N``; the longest document's last piece on rank 0. Its
LP relaxation is weak: fractional ``x`` spreads every document over every rank at zero
communication, so the bound stays near 1 and the solver cannot close the gap at 128K.

Formulation ``patterns`` (the default)
--------------------------------------
Every plan gives each document exactly one *last shard*, a suffix ("tail") of its pieces on one
rank; every piece before the tail is a non-last shard piece and costs its length in
communication (Eq. 5) on whichever rank holds it. So:

* ``u[d, k, r]`` binary: document d's tail starts at piece k and sits on rank r (k = its first
  piece: d whole on r). ``sum_{k, r} u[d, k, r] = 1``. Only tails that fit on a rank exist: at
  most C / N tokens and, under the cap, at most ``max_imbalance * W_mean`` workload (Eq. 3 of the
  tail, ``(d (d+1) - p (p+1)) / 2`` for prefix p). This is what makes the LP bound meaningful: a
  document heavier than a rank's budget cannot be "whole on every rank a little"; the LP must pay
  for its head in communication.
* ``h[i, r]`` binary: piece i is a head piece on rank r; ``sum_r h[i, r] = sum_{k > i, r}
  u[d, k, r]`` (piece i is a head piece exactly when its document's tail starts after it).
* Per rank r: tokens ``sum T_dk u[d, k, r] + sum len_i h[i, r] = C / N`` (Eq. 2); workload
  ``sum W_dk u[d, k, r] + sum w_i h[i, r] <= z_w W_mean`` (Eq. 3); communication
  ``sum len_i h[i, r] <= z_c C / N`` (Eq. 5 over Eq. 4), with T_dk, W_dk the tail's tokens and
  workload. A head piece on its tail's rank next to the tail is counted as communication here
  though the plan merges it into the last shard; a model solution therefore never reports less
  than its plan's cost, and the plan with the maximal tail is also a solution, so the optimum is
  the same as ``pieces``'.
* Symmetry: ranks are interchangeable, so label them by the first document (longest first) whose
  tail they hold: the tail of the document at position j in that order sits on a rank <= j.
* Aggregation: documents that are a single piece and have equal length are interchangeable;
  each such group gets one integer count per rank instead of a binary per document and rank.

A start from the LP relaxation
------------------------------
The ``patterns`` LP bound sits a few percent below the heuristics' plans, and at 128K the MIP's
own primal heuristics rarely close that from above: an exact C / N tokens per rank on a grid of
1K pieces is a subset-sum problem, and with one document several times a rank's workload share
the heuristics' plans are far from optimal (Pile sequences with a 64K-token book: 0.29 saving
where the optimum is above 0.5). So with a warm start, ``plan_ilp`` first solves the LP
relaxation, *dives* (fixes the most decided fractional last-shard choice and re-solves, one
document at a time) and cuts the fractional solution into a plan instead of rounding it
(:func:`~flashcp.planners.ilp.model.round_fractions`: piece i gives ``len_i * x[i, r]`` tokens to rank
r, so every rank keeps exactly C / N). Head pieces shared between ranks cost what the LP counted;
only documents whose last shard the LP still shares pay extra. When that plan meets the cap and
beats the heuristic seed, its cut points join the grid (as the seed's do) and it is the MIP start
(``info["warm_start_source"] = "lp_rounding"``).

Improving the start by neighbourhood search
-------------------------------------------
Where the solve stops at 128K is mostly the incumbent, not the bound: on the Table 2 setup the
root bound after HiGHS's cuts stays within about 1% of the best plans found in long solves, while
the MIP's own heuristics leave a heuristic start untouched for minutes (every rank must keep
exactly C / N tokens, an equality knapsack that rounding and diving rarely satisfy). With
``lns`` (on when ``highspy`` is installed), ``plan_ilp`` first improves the start by
large-neighbourhood search over pairs of ranks (:func:`~flashcp.planners.ilp.worker.pair_lns`): keep
every rank's variables but two ranks' fixed at the incumbent, solve that sub-MIP (the two ranks
may exchange tails and head pieces and cut documents differently while keeping C / N tokens
each), and go round the N (N - 1) / 2 pairs until a round brings nothing or half the time
limit has passed. At CP 8 two or three ranks often tie at the maximum communication, and no pair
can lower a maximum held by a rank outside it; with ``lns_max_size`` 3 or more (default 2:
pairs only), from a local optimum of pairs the search frees three ranks, then up to
``lns_max_size``, each set holding the incumbent's rank of highest communication or of highest
workload, one round per size, and returns to pairs after any improvement. On the WLB-LLM CP 8
128K runs that was no clear gain at 60 s (better plans on 3 of 5 sequences, worse on 2, whose
pair-only runs left the branch and bound more time), so it stays off by default.
Every step is a solution of the full model, so the result is a valid MIP start and the bound,
gap and status keep their meaning.

Solving honestly
----------------
The solve runs in a separate process under a watchdog (:mod:`flashcp.planners.ilp.worker`): past
``time_limit_s`` plus a grace period the solver's process group is killed and its files deleted.
PuLP's ``LpStatus`` reads "Optimal" for a MIP cut short with an incumbent, so the planner reads
the *solution* status: proven optimal (within ``gap``) gives status ``"ok"``; an incumbent without
proof gives ``"time_limit"`` (``info`` holds its bound and gap); no solution (infeasible, killed,
no incumbent, solver error) returns the warm start's plan (the better heuristic of ``flashcp`` and
``flashcp_refined`` by default; ``info["fallback_method"]`` names it) with status ``"fallback"``
and a warning (or raises ``ValueError`` with ``on_failure="raise"``). Every comparison with the
cap ``max_imbalance`` allows the relative tolerance :data:`~flashcp.planners.ilp.model.CAP_TOLERANCE`
(1e-9): a warm start at exactly the cap is accepted. The best bound B also bounds
what any plan on the same pieces can save: ``comm_saving <= 1 - max(0, B - max_imbalance) /
comm_weight`` (``info["saving_upper_bound"]``).
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
