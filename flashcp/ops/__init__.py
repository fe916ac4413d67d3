"""Real context-parallel attention ops (issue 3) and their building blocks.

Every method module exposes ``prepare_<method>(plan, rank) -> meta`` (pure: no process group) and
``<method>_attn(q, k, v, meta, group=None, *, softmax_scale=None, backend="auto", counter=None,
timer=None, grad_comm_dtype=None) -> out`` (the all-gather family also takes ``heads_per_group``).
:func:`get_attn_op` finds them by method name without importing every module.

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

import importlib
from collections.abc import Callable
from types import MappingProxyType

__all__ = ["ATTN_OPS", "get_attn_op"]

#: method -> (module, prepare function, attention function); imported lazily.
ATTN_OPS = MappingProxyType(
    {
        "llama3": ("baselines.llama3_attn", "prepare_llama3", "llama3_attn"),
        "per_doc": ("baselines.per_doc_attn", "prepare_per_doc", "per_doc_attn"),
        "flashcp": ("flashcp.attn", "prepare_flashcp", "flashcp_attn"),
        # other planners of the sharding-aware family run through the FlashCP op
        "flashcp_refined": ("flashcp.attn", "prepare_flashcp", "flashcp_attn"),
        "ilp": ("flashcp.attn", "prepare_flashcp", "flashcp_attn"),
        "ring": ("baselines.ring_attn", "prepare_ring", "ring_attn"),
        "zigzag": ("baselines.zigzag_attn", "prepare_zigzag", "zigzag_attn"),
    }
)


def get_attn_op(method: str) -> tuple[Callable, Callable]:
    """``(prepare_fn, attn_fn)`` of ``method``.

    Raises:
        ValueError: unknown method (the message lists the known ones).
    """
    try:
        module, prepare, attn = ATTN_OPS[method]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown method {method!r}; choose one of {', '.join(ATTN_OPS)}"
        ) from None
    mod = importlib.import_module(module)
    return getattr(mod, prepare), getattr(mod, attn)
