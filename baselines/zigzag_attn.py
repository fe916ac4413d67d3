"""Zigzag ring attention op (``zigzag_ring_flash_attn_varlen_func`` in the ``ring-flash-attn``
package): the per-document 2N-chunk layout (:mod:`baselines.zigzag`; rank r holds chunks r and
2N-1-r of every document, remainders spread, no padding) executed with ring point-to-point KV
exchanges.

The algorithm is shared with ``ring`` (:mod:`flashcp.ops.ring_attn`). With this layout the
document mask empties about half of every block: from an earlier rank only the front chunks are
visible (to both local chunks), from a later rank both its chunks are visible to the local back
chunks only; those pairs are all that is computed, which balances the work over ranks.
"""

from __future__ import annotations

import torch

from flashcp.ops.ring_attn import RingMeta, prepare_ring_meta, ring_attention
from flashcp.plan import Plan

__all__ = ["prepare_zigzag", "zigzag_attn"]


def prepare_zigzag(plan: Plan, rank: int) -> RingMeta:
    """Per-batch metadata of ``rank`` for :func:`zigzag_attn` (pure; reuse it for every layer).

    Raises:
        ValueError: ``plan`` is not a ``zigzag`` plan, ``rank`` is out of range, or the plan is
            invalid.
    """
    return prepare_ring_meta(plan, rank, "zigzag")


def zigzag_attn(
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
    """Zigzag ring context-parallel attention of this rank's tokens.

    Args:
        q: (C/N, num_heads, head_dim); k, v: (C/N, num_kv_heads, head_dim): rank r's chunks of
            every document in plan order.
        meta: from :func:`prepare_zigzag`; group: the N CP ranks (None: the default group);
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
        method="zigzag",
        softmax_scale=softmax_scale,
        backend=backend,
        counter=counter,
        timer=timer,
        grad_comm_dtype=grad_comm_dtype,
    )
