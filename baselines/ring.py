"""Ring attention (Liu et al. 2023; ``ring_flash_attn_varlen_func`` in ``ring-flash-attn``).

Layout: the packed sequence cut into N contiguous chunks, chunk r on rank r. Communication: KV
blocks passed around a ring with point-to-point send/recv, N-1 steps, overlapped with attention.
"""

from __future__ import annotations

from flashcp.layout import split_packed
from flashcp.plan import Plan, check_cp_args, check_doc_lens, make_plan


def plan_ring(doc_lens, cp_size: int, *, validate: bool = True) -> Plan:
    """Plan the ring layout: N contiguous chunks of C/N tokens.

    Raises:
        ValueError: bad lengths, ``cp_size`` < 1, or C not divisible by N.
    """
    d = check_doc_lens(doc_lens)
    check_cp_args(int(d.sum()), cp_size)
    chunk, doc, start, length = split_packed(d, cp_size)
    return make_plan("ring", cp_size, d, chunk, doc, start, length, validate=validate)
