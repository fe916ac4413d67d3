"""Ring attention op (Ring Attention, Liu et al. 2023; ``ring_flash_attn_varlen_func`` in the
``ring-flash-attn`` package): the ``ring`` layout (N contiguous chunks, :mod:`baselines.ring`)
executed with KV blocks passed around a ring of point-to-point exchanges.

The algorithm (forward, backward, autograd Function) is shared with ``zigzag`` and lives once in
:mod:`flashcp.ops.ring_attn`; the two methods differ only in their layout. With the contiguous
layout, a rank's blocks from later ranks hold only later tokens and are skipped without a kernel
call, so rank r computes on r + 1 blocks (the ring's known load imbalance).
"""

from __future__ import annotations

import torch

from flashcp.ops.ring_attn import RingMeta, prepare_ring_meta, ring_attention
from flashcp.plan import Plan

__all__ = ["prepare_ring", "ring_attn"]


def prepare_ring(plan: Plan, rank: int) -> RingMeta:
    """Per-batch metadata of ``rank`` for :func:`ring_attn` (pure; reuse it for every layer).

    Raises:
        ValueError: ``plan`` is not a ``ring`` plan, ``rank`` is out of range, or the plan is
            invalid.
    """
    return prepare_ring_meta(plan, rank, "ring")


def ring_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: RingMeta,
    group=None,
    *,
    softmax_scale: float | None = None,
    backend="auto",
    counter=None,
    timer=None,
    grad_comm_dtype: torch.dtype | str | None = None,
) -> torch.Tensor:
    """Ring context-parallel attention of this rank's tokens.

    Args:
        q: (C/N, num_heads, head_dim); k, v: (C/N, num_kv_heads, head_dim): rank r's contiguous
            chunk of the packed sequence.
        meta: from :func:`prepare_ring`; group: the N CP ranks (None: the default group);
        softmax_scale: default ``1 / sqrt(head_dim)``; backend: kernel backend name or object;
        counter: ``CommCounter`` (received ``p2p`` bytes); timer: ``PhaseTimer``;
        grad_comm_dtype: dtype of the dK/dV sums passed around the ring (default float32, float64
            for float64 inputs, as ``flashcp.comm.comm_volume`` counts; see
            :func:`flashcp.ops.ring_attn.ring_attention`).
    Returns:
        out: (C/N, num_heads, head_dim) in q.dtype, differentiable w.r.t. q, k and v.
    Raises:
        ValueError: bad inputs or metadata (before any communication), or ranks holding
            different plans.
    """
    return ring_attention(
        q,
        k,
        v,
        meta,
        group,
        method="ring",
        softmax_scale=softmax_scale,
        backend=backend,
        counter=counter,
        timer=timer,
        grad_comm_dtype=grad_comm_dtype,
    )
