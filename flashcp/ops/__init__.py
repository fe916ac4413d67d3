"""Real context-parallel attention ops and their building blocks.

Every method's op is a pair ``prepare(plan, rank) -> meta`` (pure: no process group) and
``attn(q, k, v, meta, group=None, *, softmax_scale=None, backend="auto", counter=None,
timer=None, grad_comm_dtype=None) -> out`` (the all-gather family also takes ``heads_per_group``).
:func:`get_attn_op` builds it from the method's :class:`flashcp.registry.MethodSpec`: the op
family it names (:class:`flashcp.kinds.OpFamily`: all-gather, ring, Ulysses, hybrid; its comm
kind picks the variant, :mod:`flashcp.ops.families`), or the op of its own it names, importing
only the modules that op needs.

Numerics, the same for every op: the LSE, LSE merges and gradient partial sums are in
:func:`flashcp.ops.backends.compute_dtype` of the inputs (float32; float64 for float64 inputs, so
``backend="reference"`` is float64 end to end), and dK/dV partial sums cross ranks in
``grad_comm_dtype`` (default: that same dtype;
:func:`flashcp.ops.collectives.resolve_grad_comm_dtype`), which :func:`flashcp.comm.comm_volume`
counts.

Typical use inside a training step (one plan per batch, shared by every layer; planned on one
rank of the CP group ``group`` and broadcast, :func:`flashcp.ops.collectives.plan_on_one_rank`)::

    plan = plan_on_one_rank(lambda: make_plan_for("flashcp", doc_lens, cp_size), group)
    prepare, attn = get_attn_op("flashcp")
    meta = prepare(plan, rank)                                   # once per batch
    x_local = shard_tensor(x, plan, rank)                        # (C / N, ...) local tokens
    pos = position_ids(plan, rank)                               # RoPE positions
    out = attn(q, k, v, meta, group)                             # per layer; autograd works
"""

from __future__ import annotations

from collections.abc import Callable

from flashcp.ops.families import family_op
from flashcp.registry import get_method, load_target

__all__ = ["get_attn_op"]


def get_attn_op(method: str) -> tuple[Callable, Callable]:
    """``(prepare_fn, attn_fn)`` of ``method``'s real op.

    ``prepare_fn(plan, rank) -> meta`` runs plans of ``method`` only, and ``attn_fn`` only the
    metadata of that ``prepare_fn`` (signatures in the module docstring; shapes and errors:
    :func:`flashcp.ops.families.family_op`, or the method's own op).

    Raises:
        ValueError: unknown method (the message lists the known ones).
    """
    spec = get_method(method)
    if spec.prepare is not None:
        return load_target(spec.prepare), load_target(spec.attn)
    return family_op(spec.name, spec.op, spec.comm_kind)
