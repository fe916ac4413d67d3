"""FlashCP attention with sharding-aware communication (arXiv 2606.08476, §3), real execution.

Layout: the FlashCP plan (:func:`flashcp.heuristic.plan_flashcp`): some documents whole on one
rank, others split. Communication (Eq. 5): each rank contributes only the KV of its *non-last*
shards, packed into one compact buffer padded to the largest rank's; documents kept whole and the
last shard of every document are never sent. The backward re-gathers the same buffers and
reduce-scatters only the matching dK/dV rows.

Op anatomy (STYLE.md §3): :func:`flashcp_attn_forward`, :func:`flashcp_attn_backward`, the autograd
:class:`FlashCPAttn` (saves context, delegates) and the public :func:`flashcp_attn`. The gather / scatter
machinery is shared with the other all-gather methods in :mod:`flashcp.ops.allgather_attn`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from flashcp.ops.allgather_attn import (
    AllGatherMeta,
    allgather_attn_backward,
    allgather_attn_forward,
    build_allgather_meta,
    check_inputs,
    resolve_backend,
    resolve_scale,
)
from flashcp.plan import Plan
from flashcp.registry import COMM_KIND

__all__ = [
    "FlashCPAttn",
    "flashcp_attn",
    "flashcp_attn_backward",
    "flashcp_attn_forward",
    "prepare_flashcp",
]


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
    return build_allgather_meta(replace(plan, method="flashcp"), rank, "flashcp", sharding_aware=True)


def flashcp_attn_forward(q, k, v, meta: AllGatherMeta, group, scale, backend, counter, timer):
    """All-gather the compact non-last-shard KV buffers, then one varlen causal call.

    Args:
        q: (T_local, H, D); k, v: (T_local, Hkv, D).
    Returns:
        out: (T_local, H, D) in q.dtype; lse: (H, T_local) float32.
    """
    return allgather_attn_forward(q, k, v, meta, group, scale, backend, counter, timer)


def flashcp_attn_backward(
    dout, q, k, v, out, lse, meta: AllGatherMeta, group, scale, backend, counter, timer
):
    """Re-gather the compact buffers, kernel backward, reduce-scatter only the sent rows' dK/dV.

    Returns:
        dq: (T_local, H, D); dk, dv: (T_local, Hkv, D).
    """
    return allgather_attn_backward(
        dout, q, k, v, out, lse, meta, group, scale, backend, counter, timer
    )


class FlashCPAttn(torch.autograd.Function):
    """Autograd glue: saves (q, k, v, out, lse) and the call's context, delegates both passes."""

    @staticmethod
    def forward(ctx, q, k, v, meta, group, scale, backend, counter, timer):
        out, lse = flashcp_attn_forward(q, k, v, meta, group, scale, backend, counter, timer)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = (meta, group, scale, backend, counter, timer)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flashcp_attn_backward(dout.contiguous(), q, k, v, out, lse, *ctx.call)
        return dq, dk, dv, None, None, None, None, None, None


def flashcp_attn(
    q,
    k,
    v,
    meta: AllGatherMeta,
    group=None,
    *,
    softmax_scale=None,
    backend="auto",
    counter=None,
    timer=None,
):
    """FlashCP attention for this rank's tokens, with document-masked causal semantics.

    Args:
        q: (T_local, num_heads, head_dim); k, v: (T_local, num_kv_heads, head_dim), laid out as the
            plan gives this rank (see :func:`flashcp.ops.sharding.shard_tensor`).
        meta: from :func:`prepare_flashcp` for this rank; reuse it for every layer of the batch.
        group: process group of the CP ranks (default: the world); size ``cp_size``.
        softmax_scale: default ``head_dim ** -0.5``.
        backend: kernel backend name or instance (:func:`flashcp.ops.backends.get_backend`).
        counter: :class:`~flashcp.ops.collectives.CommCounter` receiving the bytes moved.
        timer: :class:`~flashcp.ops.timing.PhaseTimer` receiving per-phase times.
    Returns:
        out: (T_local, num_heads, head_dim), differentiable w.r.t. q, k, v.
    Raises:
        ValueError: bad metadata, shapes, dtypes or group (before any communication), or ranks
            holding different plans (checked once per group before the first collective).
    """
    check_inputs(q, k, v, meta, AllGatherMeta, "flashcp", group)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    kernel = resolve_backend(backend, q.device)
    meta.verify(group)
    return FlashCPAttn.apply(q, k, v, meta, group, scale, kernel, counter, timer)
