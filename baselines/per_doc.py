"""Per-Doc context parallelism (WLB-LLM, OSDI'25).

Layout: every document cut into 2N chunks; rank r holds chunk r and chunk 2N-1-r of every document.
Remainder tokens (d mod 2N) are spread round-robin over ranks so every rank holds exactly C/N tokens
with no padding (:func:`flashcp.planners.layout.per_doc_chunk_sizes`). Communication: all-gather of the full
KV, reduce-scatter of dK/dV.
"""

from __future__ import annotations

import numpy as np

from flashcp import compiled
from flashcp.kinds import CommKind, OpFamily
from flashcp.plan import Plan, check_cp_args, check_doc_lens, make_plan, planner_entry
from flashcp.planners.layout import per_doc_chunk_sizes, per_doc_columns
from flashcp.registry import MethodSpec


def per_doc_layout(doc_lens, cp_size: int, method: str, num_pad: int, validate: bool) -> Plan:
    """The per-document 2N-chunk layout shared by ``per_doc`` and ``zigzag``.

    Pad tokens fill every rank up to C/N after its document tokens (which differ by at most one
    token between ranks, so pad goes mostly evenly).
    """
    d = check_doc_lens(doc_lens)
    check_cp_args(int(d.sum()) + num_pad, cp_size)
    kernels = compiled.load("plan")
    if kernels is not None:
        cols, pad = kernels.per_doc_layout(d, int(cp_size), int(num_pad))
        return make_plan(method, cp_size, d, *cols, pad=pad, validate=validate)
    sizes, _ = per_doc_chunk_sizes(d, cp_size)
    cols = per_doc_columns(np.arange(d.size), sizes, cp_size)
    real = sizes[:, :cp_size].sum(axis=0) + sizes[:, cp_size:][:, ::-1].sum(axis=0)  # (N,)
    pad = (int(d.sum()) + num_pad) // cp_size - real
    return make_plan(method, cp_size, d, *cols, pad=pad, validate=validate)


@planner_entry("per_doc", fused="per_doc_plan")
def plan_per_doc(doc_lens, cp_size: int, *, num_pad: int = 0, validate: bool = True) -> Plan:
    """Plan the Per-Doc layout (each document in 2N chunks, remainders spread, no padding needed).

    Documents shorter than 2N simply leave some chunks empty; zero-length ones are skipped and
    ``num_pad`` pad tokens fill the ranks after their documents
    (:func:`~flashcp.plan.planner_entry`).

    Raises:
        ValueError: bad lengths, ``cp_size`` < 1, or C (pad included) not divisible by N.
    """
    return per_doc_layout(doc_lens, cp_size, "per_doc", num_pad, validate)


#: the method's entry in the registry (declared in pyproject.toml's ``flashcp.methods`` entry points)
METHOD = MethodSpec(
    name="per_doc", display_name="Per-Doc CP", order=20, planner=plan_per_doc,
    comm_kind=CommKind.ALLGATHER_FULL, op=OpFamily.ALLGATHER, color="#1f77b4", paper=True,
)  # fmt: skip
