"""Llama3 context parallelism (Llama 3 report; FlashCP paper §2.3).

Layout: the packed sequence is cut into 2N equal chunks; rank r holds chunks r and 2N-1-r, so every
rank gets one early (cheap) and one late (expensive) chunk. Documents straddle chunk borders freely.
Communication: all-gather of the full KV (forward), reduce-scatter of dK/dV (backward).
"""

from __future__ import annotations

import numpy as np

from flashcp.kinds import CommKind, OpFamily
from flashcp.plan import Plan, check_cp_args, check_doc_lens, make_plan, planner_entry
from flashcp.planners.layout import split_packed
from flashcp.registry import MethodSpec


@planner_entry("llama3", chunks_per_rank=2, fused="llama3_plan")
def plan_llama3(doc_lens, cp_size: int, *, num_pad: int = 0, validate: bool = True) -> Plan:
    """Plan the Llama3 2N-chunk layout.

    Args:
        doc_lens: (n_docs,) int, document lengths in packed order (zero-length ones skipped).
        cp_size: N >= 1.
        num_pad: pad tokens after the last document: they fill the last chunks (rank 0's back
            chunk first), and C including them must divide by 2N. ``pad_to_multiple=True`` adds
            the fewest that make it so (:func:`~flashcp.plan.planner_entry`).
        validate: check the plan's invariants.
    Returns:
        A :class:`~flashcp.plan.Plan`; a document crossing the border of chunks N-1 and N on rank
        N-1 is one shard there.
    Raises:
        ValueError: bad lengths, ``cp_size`` < 1, or C not divisible by 2N (the message names the
            multiple and the pad that would reach it).
    """
    d = check_doc_lens(doc_lens)
    n = cp_size
    check_cp_args(int(d.sum()) + num_pad, n, chunks_per_rank=2)
    chunk, doc, start, length, chunk_pad = split_packed(d, 2 * n, num_pad)
    back = chunk >= n
    rank = np.where(back, 2 * n - 1 - chunk, chunk)
    order = np.lexsort((back, rank))  # per rank: front chunk pieces, then back chunk pieces
    pad = chunk_pad[:n] + chunk_pad[n:][::-1]  # rank r holds chunks r and 2N-1-r
    return make_plan(
        "llama3", n, d, rank[order], doc[order], start[order], length[order], pad=pad,
        validate=validate,
    )  # fmt: skip


#: the method's entry in the registry (declared in pyproject.toml's ``flashcp.methods`` entry points)
METHOD = MethodSpec(
    name="llama3", display_name="Llama3 CP", order=10, planner=plan_llama3,
    comm_kind=CommKind.ALLGATHER_FULL, op=OpFamily.ALLGATHER, color="#7f7f7f", paper=True,
)  # fmt: skip
