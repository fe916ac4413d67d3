"""Llama3 context parallelism (Llama 3 report; FlashCP paper §2.3).

Layout: the packed sequence is cut into 2N equal chunks; rank r holds chunks r and 2N-1-r, so every
rank gets one early (cheap) and one late (expensive) chunk. Documents straddle chunk borders freely.
Communication: all-gather of the full KV (forward), reduce-scatter of dK/dV (backward).
"""

from __future__ import annotations

import numpy as np

from flashcp.layout import split_packed
from flashcp.plan import Plan, check_cp_args, check_doc_lens, make_plan


def plan_llama3(doc_lens, cp_size: int, *, validate: bool = True) -> Plan:
    """Plan the Llama3 2N-chunk layout.

    Args:
        doc_lens: (n_docs,) int, document lengths in packed order.
        cp_size: N >= 1.
        validate: check the plan's invariants.
    Returns:
        A :class:`~flashcp.plan.Plan`; a document crossing the border of chunks N-1 and N on rank
        N-1 is one shard there.
    Raises:
        ValueError: bad lengths, ``cp_size`` < 1, or C not divisible by 2N.
    """
    d = check_doc_lens(doc_lens)
    n = cp_size
    check_cp_args(int(d.sum()), n, chunks_per_rank=2)
    chunk, doc, start, length = split_packed(d, 2 * n)
    back = chunk >= n
    rank = np.where(back, 2 * n - 1 - chunk, chunk)
    order = np.lexsort((back, rank))  # per rank: front chunk pieces, then back chunk pieces
    return make_plan(
        "llama3", n, d, rank[order], doc[order], start[order], length[order], validate=validate
    )
