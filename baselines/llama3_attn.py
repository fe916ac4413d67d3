"""Llama3 context-parallel attention (Llama 3 report; FlashCP paper §2.3), real execution.

Layout: the packed sequence in 2N equal chunks, rank r holding chunks r and 2N-1-r
(:func:`baselines.llama3.plan_llama3`); documents straddle chunk borders, so each local piece of a
document is one causal segment over its document's prefix. Communication: all-gather of the full KV
in the forward (and again in the backward), reduce-scatter of dK/dV (Eq. 4).

Op anatomy (STYLE.md §3): :func:`llama3_attn_forward`, :func:`llama3_attn_backward`, the autograd
:class:`Llama3Attn` (saves context, delegates) and the public :func:`llama3_attn`. The gather / scatter
machinery is shared with the other all-gather methods in :mod:`flashcp.ops.allgather_attn`.
"""

from __future__ import annotations

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

__all__ = [
    "Llama3Attn",
    "llama3_attn",
    "llama3_attn_backward",
    "llama3_attn_forward",
    "prepare_llama3",
]


def prepare_llama3(plan: Plan, rank: int) -> AllGatherMeta:
    """Metadata of ``rank`` for a ``llama3`` plan, built once per batch (pure: no process group).

    Raises:
        ValueError: the plan is not a ``llama3`` plan, or ``rank`` is out of range.
    """
    return build_allgather_meta(plan, rank, "llama3", sharding_aware=False)


def llama3_attn_forward(q, k, v, meta: AllGatherMeta, group, scale, backend, counter, timer):
    """All-gather the full KV, then one varlen causal call over every local shard.

    Args:
        q: (T_local, H, D); k, v: (T_local, Hkv, D).
    Returns:
        out: (T_local, H, D) in q.dtype; lse: (H, T_local) float32.
    """
    return allgather_attn_forward(q, k, v, meta, group, scale, backend, counter, timer)


def llama3_attn_backward(
    dout, q, k, v, out, lse, meta: AllGatherMeta, group, scale, backend, counter, timer
):
    """Re-gather the KV, kernel backward, reduce-scatter dK/dV back to their owners.

    Returns:
        dq: (T_local, H, D); dk, dv: (T_local, Hkv, D).
    """
    return allgather_attn_backward(
        dout, q, k, v, out, lse, meta, group, scale, backend, counter, timer
    )


class Llama3Attn(torch.autograd.Function):
    """Autograd glue: saves (q, k, v, out, lse) and the call's context, delegates both passes."""

    @staticmethod
    def forward(ctx, q, k, v, meta, group, scale, backend, counter, timer):
        out, lse = llama3_attn_forward(q, k, v, meta, group, scale, backend, counter, timer)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = (meta, group, scale, backend, counter, timer)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = llama3_attn_backward(dout.contiguous(), q, k, v, out, lse, *ctx.call)
        return dq, dk, dv, None, None, None, None, None, None


def llama3_attn(
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
    """Llama3 CP attention for this rank's tokens, with document-masked causal semantics.

    Args:
        q: (T_local, num_heads, head_dim); k, v: (T_local, num_kv_heads, head_dim), laid out as the
            plan gives this rank (see :func:`flashcp.ops.sharding.shard_tensor`).
        meta: from :func:`prepare_llama3` for this rank; reuse it for every layer of the batch.
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
    check_inputs(q, k, v, meta, AllGatherMeta, "llama3", group)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    kernel = resolve_backend(backend, q.device)
    meta.verify(group)
    return Llama3Attn.apply(q, k, v, meta, group, scale, kernel, counter, timer)
