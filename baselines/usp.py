"""USP (Fang & Zhao, 2024; also LoongTrain, TransformerEngine's ``a2a+p2p``): hybrid
head-parallel x ring context parallelism.

Layout: the N ranks form G = N/u groups of u consecutive ranks (``ulysses_degree = u``). Across
the groups, the zigzag layout (:mod:`baselines.zigzag`: every document in 2G chunks, group g
holding chunks g and 2G-1-g); inside a group, the group's rows cut into u consecutive pieces of
C/N (:func:`flashcp.plan.head_parallel.split_groups`). Communication: an all-to-all inside each group
(Ulysses, H/u heads per rank over the group's tokens) and ring P2P across the groups for those
heads (:mod:`flashcp.ops.hybrid_attn`).
"""

from __future__ import annotations

from baselines.zigzag import plan_zigzag
from flashcp.kinds import CommKind, OpFamily
from flashcp.plan import Plan, check_cp_args, check_doc_lens, planner_entry
from flashcp.plan.head_parallel import check_ulysses_degree, split_groups
from flashcp.registry import MethodSpec


@planner_entry("usp")
def plan_usp(
    doc_lens,
    cp_size: int,
    *,
    ulysses_degree: int | None = None,
    num_pad: int = 0,
    validate: bool = True,
) -> Plan:
    """Plan USP with Ulysses degree u: zigzag over N/u groups, each group's rows in u pieces.

    ``ulysses_degree=None`` takes the default of :func:`flashcp.plan.head_parallel.check_ulysses_degree`.

    Heads are checked against u by the op and by :func:`flashcp.comm.comm_volume`
    (:func:`flashcp.plan.head_parallel.ulysses_heads`), which know them.

    Raises:
        ValueError: bad lengths, ``cp_size`` < 1, C (pad included) not divisible by N, or a
            ``ulysses_degree`` that does not divide ``cp_size`` (naming the valid ones).
    """
    d = check_doc_lens(doc_lens)
    u = check_ulysses_degree(ulysses_degree, cp_size)
    check_cp_args(int(d.sum()) + num_pad, cp_size)
    groups = plan_zigzag(d, cp_size // u, num_pad=num_pad, validate=validate)
    return split_groups(groups, u, "usp", validate=validate)


#: the method's entry in the registry (declared in pyproject.toml's ``flashcp.methods`` entry points)
METHOD = MethodSpec(
    name="usp", display_name="USP (Ulysses x ring)", order=64, planner=plan_usp,
    comm_kind=CommKind.P2P_RING, op=OpFamily.HYBRID, color="#bcbd22",
)  # fmt: skip
