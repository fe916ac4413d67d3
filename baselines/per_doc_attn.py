"""Per-Doc context-parallel attention (WLB-LLM, OSDI'25), real execution.

Layout: every document cut into 2N chunks, rank r holding chunks r and 2N-1-r of each
(:func:`baselines.per_doc.plan_per_doc`; remainders spread, no padding). Communication: all-gather
of the full KV in the forward (and again in the backward), reduce-scatter of dK/dV (Eq. 4).

Op anatomy: the forward, backward and autograd Function are shared by the
all-gather family in :mod:`flashcp.ops.allgather_attn` (the methods differ only in their metadata);
this module holds the method's ``prepare_per_doc`` and its thin public wrapper ``per_doc_attn``.
"""

from __future__ import annotations

from flashcp.ops.allgather_attn import AllGatherMeta, allgather_attention, build_allgather_meta
from flashcp.plan import Plan

__all__ = ["per_doc_attn", "prepare_per_doc"]


def prepare_per_doc(plan: Plan, rank: int) -> AllGatherMeta:
    """Metadata of ``rank`` for a ``per_doc`` plan, built once per batch (pure: no process group).

    Raises:
        ValueError: the plan is not a ``per_doc`` plan, or ``rank`` is out of range.
    """
    return build_allgather_meta(plan, rank, "per_doc", sharding_aware=False)


def per_doc_attn(
    q, k, v, meta: AllGatherMeta, group=None, *, softmax_scale=None, backend="auto",
    counter=None, timer=None, grad_comm_dtype=None, heads_per_group=None,
):  # fmt: skip
    """Per-Doc CP attention for this rank's tokens: :func:`~flashcp.ops.allgather_attn.allgather_attention`
    with ``method="per_doc"`` (arguments, shapes and errors there); ``meta`` from :func:`prepare_per_doc`."""
    return allgather_attention(
        q, k, v, meta, group, method="per_doc", softmax_scale=softmax_scale, backend=backend,
        counter=counter, timer=timer, grad_comm_dtype=grad_comm_dtype,
        heads_per_group=heads_per_group,
    )  # fmt: skip
