"""Ring attention (Liu et al. 2023; ``ring_flash_attn_varlen_func`` in ``ring-flash-attn``).

Layout: the packed sequence cut into N contiguous chunks, chunk r on rank r. Communication: KV
blocks passed around a ring with point-to-point send/recv, N-1 steps, overlapped with attention.
Its op is the ring family's (:mod:`flashcp.ops.ring_attn`): with this contiguous layout a rank's
blocks from later ranks hold only later tokens and are skipped without a kernel call, so rank r
computes on r + 1 blocks (the ring's known load imbalance).
"""

from __future__ import annotations

from flashcp.kinds import CommKind, OpFamily
from flashcp.plan import Plan, check_cp_args, check_doc_lens, make_plan, planner_entry
from flashcp.planners.layout import split_packed
from flashcp.registry import MethodSpec


@planner_entry("ring", fused="ring_plan")
def plan_ring(doc_lens, cp_size: int, *, num_pad: int = 0, validate: bool = True) -> Plan:
    """Plan the ring layout: N contiguous chunks of C/N tokens.

    ``num_pad`` pad tokens after the last document fill the last chunks (the last ranks); zero-
    length documents are skipped (:func:`~flashcp.plan.planner_entry`).

    Raises:
        ValueError: bad lengths, ``cp_size`` < 1, or C (pad included) not divisible by N.
    """
    d = check_doc_lens(doc_lens)
    check_cp_args(int(d.sum()) + num_pad, cp_size)
    chunk, doc, start, length, pad = split_packed(d, cp_size, num_pad)
    return make_plan("ring", cp_size, d, chunk, doc, start, length, pad=pad, validate=validate)


#: the method's entry in the registry (declared in pyproject.toml's ``flashcp.methods`` entry points)
METHOD = MethodSpec(
    name="ring", display_name="Ring", order=30, planner=plan_ring,
    comm_kind=CommKind.P2P_RING, op=OpFamily.RING, color="#ff7f0e", paper=True,
)  # fmt: skip
