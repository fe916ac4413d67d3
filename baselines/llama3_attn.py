"""Llama3 context-parallel attention (Llama 3 report; FlashCP paper §2.3), real execution.

Layout: the packed sequence in 2N equal chunks, rank r holding chunks r and 2N-1-r
(:func:`baselines.llama3.plan_llama3`); documents straddle chunk borders, so each local piece of a
document is one causal segment over its document's prefix. Communication: all-gather of the full KV
in the forward (and again in the backward), reduce-scatter of dK/dV (Eq. 4).

Op anatomy: the forward, backward and autograd Function are shared by the
all-gather family in :mod:`flashcp.ops.allgather_attn` (the methods differ only in their metadata);
this module holds the method's ``prepare_llama3`` and its thin public wrapper ``llama3_attn``.
"""

from __future__ import annotations

from flashcp.ops.allgather_attn import AllGatherMeta, allgather_attention, build_allgather_meta
from flashcp.plan import Plan

__all__ = ["llama3_attn", "prepare_llama3"]


def prepare_llama3(plan: Plan, rank: int) -> AllGatherMeta:
    """Metadata of ``rank`` for a ``llama3`` plan, built once per batch (pure: no process group).

    Raises:
        ValueError: the plan is not a ``llama3`` plan, or ``rank`` is out of range.
    """
    return build_allgather_meta(plan, rank, "llama3", sharding_aware=False)


def llama3_attn(
    q, k, v, meta: AllGatherMeta, group=None, *, softmax_scale=None, backend="auto",
    counter=None, timer=None, grad_comm_dtype=None, heads_per_group=None,
):  # fmt: skip
    """Llama3 CP attention for this rank's tokens: :func:`~flashcp.ops.allgather_attn.allgather_attention`
    with ``method="llama3"`` (arguments, shapes and errors there); ``meta`` from :func:`prepare_llama3`."""
    return allgather_attention(
        q, k, v, meta, group, method="llama3", softmax_scale=softmax_scale, backend=backend,
        counter=counter, timer=timer, grad_comm_dtype=grad_comm_dtype,
        heads_per_group=heads_per_group,
    )  # fmt: skip
