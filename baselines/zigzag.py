"""Zigzag ring attention (``zigzag_ring_flash_attn_varlen_func`` in ``ring-flash-attn``).

Layout: the per-document 2N-chunk layout of Per-Doc CP (rank r holds chunks r and 2N-1-r of every
document). Unlike the upstream function, lengths need not divide by 2N: remainders are spread over
ranks as in :mod:`baselines.per_doc`, with no padding. Communication: ring P2P as in
:mod:`baselines.ring`, skipping blocks the causal mask makes empty: the ring family's op
(:mod:`flashcp.ops.ring_attn`). From an earlier rank only the front chunks are visible (to both
local chunks), from a later rank both its chunks are visible to the local back chunks only; those
pairs are all that is computed, which balances the work over ranks.
"""

from __future__ import annotations

from baselines.per_doc import per_doc_layout
from flashcp.kinds import CommKind, OpFamily
from flashcp.plan import Plan, planner_entry
from flashcp.registry import MethodSpec


@planner_entry("zigzag", fused="per_doc_plan")
def plan_zigzag(doc_lens, cp_size: int, *, num_pad: int = 0, validate: bool = True) -> Plan:
    """Plan the zigzag layout (identical shards and pad to ``per_doc``; executed with ring P2P).

    Raises:
        ValueError: bad lengths, ``cp_size`` < 1, or C (pad included) not divisible by N.
    """
    return per_doc_layout(doc_lens, cp_size, "zigzag", num_pad, validate)


#: the method's entry in the registry (declared in pyproject.toml's ``flashcp.methods`` entry points)
METHOD = MethodSpec(
    name="zigzag", display_name="Zigzag ring", order=40, planner=plan_zigzag,
    comm_kind=CommKind.P2P_RING, op=OpFamily.RING, color="#2ca02c", paper=True,
)  # fmt: skip
