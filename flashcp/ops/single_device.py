"""Attention at cp_size 1: no CP work, whatever the method.

With one rank every registry planner's plan holds every document whole, in packed order, pad rows
last (:meth:`flashcp.plan.Plan.single_device_documents`), so the rank's q, k, v are the packed
sequence and attention is one plain document-masked varlen call over them: no collective, no
gather buffer, no ring step, no merge. Every op family takes this path at cp_size 1
(:mod:`flashcp.ops.families`), and the step model prices it the same for every method
(:mod:`flashcp.sim.cost`, docs/simulator.md).
"""

from __future__ import annotations

import numpy as np
import torch

from flashcp.ops.backends import resolve_softmax_scale
from flashcp.ops.collectives import check_qkv, resolve_grad_comm_dtype
from flashcp.ops.timing import as_timer
from flashcp.plan import cu_seqlens

__all__ = ["SingleDeviceAttn", "single_device_attention", "takes_single_device_path"]


def takes_single_device_path(meta) -> bool:
    """Whether an op's metadata (any family's: ``plan``, ``cp_size``) runs on one device: cp_size
    1 and a plan whose rank holds every document whole."""
    plan = getattr(meta, "plan", None)
    return getattr(meta, "cp_size", None) == 1 and plan.single_device_documents() is not None


class SingleDeviceAttn(torch.autograd.Function):
    """Autograd glue of the one-device call: saves (q, k, v, out, lse) of the document rows and
    runs the backend's varlen forward / backward over whole documents."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, scale, backend, timer):
        with timer.phase("attn_fwd"):
            out, lse = backend.forward(q, k, v, cu, cu, max_len, max_len, causal=True,
                                       softmax_scale=scale)  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = (cu, max_len, scale, backend, timer)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cu, max_len, scale, backend, timer = ctx.call
        with timer.phase("attn_bwd"):
            dq, dk, dv = backend.backward(dout.contiguous(), q, k, v, out, lse, cu, cu, max_len,
                                          max_len, causal=True, softmax_scale=scale)  # fmt: skip
        return dq, dk, dv, None, None, None, None, None


def single_device_attention(
    q, k, v, meta, group=None, *, method: str, softmax_scale=None, backend="auto", timer=None,
    grad_comm_dtype=None,
):  # fmt: skip
    """Attention of a cp_size 1 plan: one causal varlen call over its whole documents.

    Args:
        q: (T, num_heads, head_dim); k, v: (T, num_kv_heads, head_dim): the packed sequence, T = C
            rows (pad rows last), any float dtype.
        meta: the method's ``prepare(plan, 0)`` of a plan for which
            :func:`takes_single_device_path` holds; method: the method it must be of.
        group: a process group of one rank, or None; grad_comm_dtype: validated, unused (nothing
            is communicated); others as in the families' ops.
    Returns:
        out: (T, num_heads, head_dim) in q.dtype, differentiable; pad rows 0 (gradient 0).
    Raises:
        ValueError: metadata of another method or of more than one rank, bad shapes, dtypes,
            options or group.
    """
    if getattr(meta, "method", None) != method or not takes_single_device_path(meta):
        raise ValueError(
            f"{method}_attn's one-device path needs metadata from prepare_{method}(plan, 0) of a "
            f"cp_size 1 plan, got {type(meta).__name__}"
        )
    plan = meta.plan
    check_qkv(q, k, v, tokens=plan.context_len, rank=0, cp_size=1, group=group)
    resolve_grad_comm_dtype(grad_comm_dtype, k.dtype)  # raises on a bad value
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    from flashcp.ops.allgather_attn import resolve_backend

    kernel = resolve_backend(backend, q.device, dtype=q.dtype, head_dim=q.shape[-1])
    lens = plan.single_device_documents()
    rows = int(lens.sum())
    cu = torch.from_numpy(cu_seqlens(lens).astype(np.int32)).to(q.device)
    max_len = int(lens.max()) if lens.size else 0
    timer = as_timer(timer)
    if rows == q.shape[0]:
        return SingleDeviceAttn.apply(q, k, v, cu, max_len, scale, kernel, timer)
    # pad rows (the last ones) take no part: output 0, gradient 0 through the slicing
    out = SingleDeviceAttn.apply(q[:rows], k[:rows], v[:rows], cu, max_len, scale, kernel, timer)
    return torch.nn.functional.pad(out, (0, 0, 0, 0, 0, q.shape[0] - rows))
