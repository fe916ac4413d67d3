"""``flashcp_ulysses``: FlashCP's planner over head-parallel groups (docs/design.md §3).

The N ranks form G = N/u groups of u consecutive ranks (``ulysses_degree = u``). FlashCP's
heuristic (paper Algorithm 1, :func:`flashcp.planners.flashcp.plan_flashcp`, unchanged) plans the
documents over the G groups as super-ranks; each group's rows are cut into u consecutive pieces
(:func:`flashcp.plan.head_parallel.split_groups`). The op (:mod:`flashcp.ops.hybrid_attn`) runs
Ulysses inside each group (every rank attends over its group's shards for H/u heads) and
FlashCP's sharding-aware KV all-gather across the groups, so the plan's imbalance ratio and
communication saving are those of the FlashCP plan of the G super-ranks
(:meth:`flashcp.plan.Plan.summary`).
"""

from __future__ import annotations

from flashcp.kinds import CommKind, OpFamily
from flashcp.plan import Plan, check_cp_args, check_doc_lens, planner_entry
from flashcp.plan.head_parallel import check_ulysses_degree, split_groups
from flashcp.planners.flashcp import plan_flashcp
from flashcp.registry import MethodSpec

__all__ = ["plan_flashcp_ulysses"]


@planner_entry("flashcp_ulysses")
def plan_flashcp_ulysses(
    doc_lens,
    cp_size: int,
    *,
    ulysses_degree: int | None = None,
    target_imbalance: float = 1.05,
    num_pad: int = 0,
    validate: bool = True,
) -> Plan:
    """Plan FlashCP over N/u head-parallel groups of u ranks.

    Args:
        ulysses_degree: u, ranks per group, dividing ``cp_size``; None: the default of
            :func:`~flashcp.plan.head_parallel.check_ulysses_degree` (heads are checked by the op and
            by :func:`flashcp.comm.comm_volume`, which know them).
        target_imbalance: R of Algorithm 1, over the groups.
    Raises:
        ValueError: bad lengths, ``cp_size`` < 1, C (pad included) not divisible by N, a
            ``ulysses_degree`` that does not divide ``cp_size``, or a bad ``target_imbalance``.
    """
    d = check_doc_lens(doc_lens)
    u = check_ulysses_degree(ulysses_degree, cp_size)
    check_cp_args(int(d.sum()) + num_pad, cp_size)
    groups = plan_flashcp(
        d, cp_size // u, target_imbalance=target_imbalance, num_pad=num_pad, validate=validate
    )
    return split_groups(groups, u, "flashcp_ulysses", validate=validate)


#: the method's entry in the registry (declared in pyproject.toml's ``flashcp.methods`` entry points)
METHOD = MethodSpec(
    name="flashcp_ulysses", display_name="FlashCP x Ulysses", order=66, planner=plan_flashcp_ulysses,
    comm_kind=CommKind.ALLGATHER_SHARDED, op=OpFamily.HYBRID, color="#17becf",
)  # fmt: skip
