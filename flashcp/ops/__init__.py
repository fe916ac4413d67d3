"""Real context-parallel attention ops and their building blocks.

Every method module exposes ``prepare_<method>(plan, rank) -> meta`` (pure: no process group) and
``<method>_attn(q, k, v, meta, group=None, *, softmax_scale=None, backend="auto", counter=None,
timer=None, grad_comm_dtype=None) -> out`` (the all-gather family also takes ``heads_per_group``).
:func:`get_attn_op` finds them by method name (the method's :class:`flashcp.registry.MethodSpec`)
without importing every module.

Numerics, the same for every op: the LSE, LSE merges and gradient partial sums are in
:func:`flashcp.ops.backends.compute_dtype` of the inputs (float32; float64 for float64 inputs, so
``backend="reference"`` is float64 end to end), and dK/dV partial sums cross ranks in
``grad_comm_dtype`` (default: that same dtype;
:func:`flashcp.ops.collectives.resolve_grad_comm_dtype`), which :func:`flashcp.comm.comm_volume`
counts.

Typical use inside a training step (one plan per batch, shared by every layer)::

    plan = make_plan_for("flashcp", doc_lens, cp_size)          # pure, same on every rank
    prepare, attn = get_attn_op("flashcp")
    meta = prepare(plan, rank)                                   # once per batch
    x_local = shard_tensor(x, plan, rank)                        # (C / N, ...) local tokens
    pos = position_ids(plan, rank)                               # RoPE positions
    out = attn(q, k, v, meta, group)                             # per layer; autograd works
"""

from __future__ import annotations

from flashcp.registry import get_attn_op

__all__ = ["get_attn_op"]
