"""FlashCP attention with sharding-aware communication (arXiv 2606.08476, §3), real execution.

Layout: the FlashCP plan (:func:`flashcp.heuristic.plan_flashcp`): some documents whole on one
rank, others split. Communication (Eq. 5): each rank contributes only the KV of its *non-last*
shards, packed into one compact buffer padded to the largest rank's; documents kept whole and the
last shard of every document are never sent. The backward re-gathers the same buffers and
reduce-scatters only the matching dK/dV rows.

Op anatomy: the forward, backward and autograd Function are shared by the
all-gather family in :mod:`flashcp.ops.allgather_attn` (the methods differ only in their metadata);
this module holds the method's ``prepare_flashcp`` and its thin public wrapper ``flashcp_attn``.
"""

from __future__ import annotations

from dataclasses import replace

from flashcp.ops.allgather_attn import AllGatherMeta, allgather_attention, build_allgather_meta
from flashcp.plan import Plan
from flashcp.registry import COMM_KIND

__all__ = ["flashcp_attn", "prepare_flashcp"]


def prepare_flashcp(plan: Plan, rank: int) -> AllGatherMeta:
    """Metadata of ``rank`` for a plan of any sharding-aware method (``flashcp``,
    ``flashcp_refined``, ``ilp``: :data:`flashcp.registry.COMM_KIND` ``allgather_sharded``), built
    once per batch (pure: no process group).

    Raises:
        ValueError: the plan's method does not use sharding-aware all-gather, or ``rank`` is out
            of range.
    """
    if COMM_KIND.get(plan.method) != "allgather_sharded":
        raise ValueError(
            "this op runs sharding-aware (flashcp, flashcp_refined, ilp) plans, got a plan for "
            f"{plan.method!r}"
        )
    # same shards, same digest: the op itself does not depend on which planner made the plan
    return build_allgather_meta(
        replace(plan, method="flashcp"), rank, "flashcp", sharding_aware=True
    )


def flashcp_attn(
    q, k, v, meta: AllGatherMeta, group=None, *, softmax_scale=None, backend="auto",
    counter=None, timer=None, grad_comm_dtype=None, heads_per_group=None,
):  # fmt: skip
    """FlashCP attention for this rank's tokens: :func:`~flashcp.ops.allgather_attn.allgather_attention`
    with ``method="flashcp"`` (arguments, shapes and errors there); ``meta`` from :func:`prepare_flashcp`."""
    return allgather_attention(
        q, k, v, meta, group, method="flashcp", softmax_scale=softmax_scale, backend=backend,
        counter=counter, timer=timer, grad_comm_dtype=grad_comm_dtype,
        heads_per_group=heads_per_group,
    )  # fmt: skip
