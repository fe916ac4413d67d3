"""The varlen backend interface, its argument checks, and the dtype and softmax-scale rules.

A backend computes attention over *segments*: query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``
attend to key rows ``cu_seqlens_k[i]:cu_seqlens_k[i+1]`` (package docstring:
:mod:`flashcp.ops.backends`). :class:`VarlenBackend` validates every call once, here, and leaves
the computation to one subclass per kernel (:mod:`.reference`, :mod:`.cpu`, :mod:`.cuda`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

__all__ = [
    "BACKENDS",
    "VarlenBackend",
    "check_varlen_args",
    "compute_dtype",
    "default_scale",
    "has_work",
    "resolve_softmax_scale",
]

BACKENDS: tuple[str, ...] = ("auto", "flash_attn", "torch_cuda", "cpu", "reference")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention on ``dtype`` inputs computes and accumulates in.

    ``torch.promote_types(dtype, torch.float32)``: float32 for bfloat16, float16 and float32,
    float64 for float64. It is the dtype of the LSE a backend returns (and its backward accepts),
    of LSE-merge accumulators (:mod:`flashcp.ops.lse`), of partial gradients summed over blocks,
    and the default dtype of gradient reductions across ranks
    (:func:`flashcp.ops.collectives.resolve_grad_comm_dtype`). Rounding to the model dtype happens
    once, at the end. This is the one place the rule is written down.

    Raises:
        ValueError: ``dtype`` is not a floating-point torch dtype.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"attention needs a floating-point dtype, got {dtype!r}")
    return torch.promote_types(dtype, torch.float32)


def check_varlen_args(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    out=None,
    lse=None,
    dout=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
) -> None:
    """Validate a varlen call (every backend runs this before its kernel).

    Args:
        q: (Tq, H, D); k, v: (Tk, Hkv, D), one dtype; ``H % Hkv == 0``.
        cu_seqlens_q, cu_seqlens_k: (n_seg + 1,) int32; on CPU also checked to rise from 0 to
            Tq / Tk (on CUDA that would cost a device sync per call).
        out, dout: (Tq, H, D) and lse: (H, Tq) in ``compute_dtype(q.dtype)``, for backward.
        max_seqlen_q, max_seqlen_k: integers >= 0 (None: not checked); with CPU ``cu_seqlens``
            also checked to be at least the longest segment: the CUDA kernels size their grid
            by them and silently skip the rows of a longer segment.
    Raises:
        ValueError: naming the inconsistency.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be (tokens, heads, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head_dim of q ({q.shape[2]}) and k ({k.shape[2]}) differ")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"num_heads = {q.shape[1]} is not a multiple of num_kv_heads = {k.shape[1]}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("out", out), ("dout", dout)):
        if t is not None and t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
    if lse is not None:
        want = compute_dtype(q.dtype)
        if lse.shape != (q.shape[1], q.shape[0]) or lse.dtype != want:
            raise ValueError(
                f"lse must be (num_heads, Tq) = {(q.shape[1], q.shape[0])} {want} for {q.dtype} "
                f"inputs, got {tuple(lse.shape)} {lse.dtype}"
            )
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{name} must be a 1-D int32 tensor, got {cu.dtype} {tuple(cu.shape)}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.numel()} entries but cu_seqlens_k has "
            f"{cu_seqlens_k.numel()}: both describe the same segments"
        )
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if m is not None and (isinstance(m, bool) or not isinstance(m, int | np.integer) or m < 0):
            raise ValueError(f"{name} must be an integer >= 0, got {m!r}")
    if cu_seqlens_q.device.type != "cpu":
        return
    for name, cu, total, longest in (
        ("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
        ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k),
    ):
        c = cu.tolist()
        if c[0] != 0 or c[-1] != total or any(b < a for a, b in itertools.pairwise(c)):
            raise ValueError(
                f"{name} must rise from 0 to {total}, got {c[:8]}{'...' if len(c) > 8 else ''}"
            )
        seg = max((b - a for a, b in itertools.pairwise(c)), default=0)
        if longest is not None and longest < seg:
            raise ValueError(
                f"max_seqlen_{name[-1]} = {longest} is shorter than the longest segment of "
                f"{name} ({seg} rows)"
            )


def has_work(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k) -> bool:
    """Whether a (checked) varlen call has a (query, key) pair to compute.

    False when there are no segments (``cu_seqlens = [0]``: a rank without documents or with
    pad only), no query or no key rows, or ``max_seqlen_* = 0``: the CUDA kernels refuse batch
    size 0 ("batch size must be positive"), so such calls never reach a kernel; their result is
    out = 0, lse = -inf and zero gradients. Reads shapes and host integers only (no device sync).
    """
    return (
        cu_seqlens_q.numel() > 1
        and q.shape[0] > 0
        and k.shape[0] > 0
        and int(max_seqlen_q) > 0
        and int(max_seqlen_k) > 0
    )


def resolve_softmax_scale(softmax_scale: float | None, head_dim: int) -> float:
    """The softmax scale of every CP op and backend: ``softmax_scale``, or ``1 / sqrt(head_dim)``.

    The default is the scaled dot-product attention of Vaswani et al. (2017, Eq. 1), written as
    PyTorch's ``scaled_dot_product_attention`` computes it (a correctly rounded square root, then
    one division). This is the one place the rule is written down.

    Args:
        softmax_scale: the scale the caller asked for (None: the default).
        head_dim: D, the size of each query/key head, >= 1.
    Returns:
        the scale, a finite float > 0.
    Raises:
        ValueError: ``softmax_scale`` is not finite and > 0, or ``head_dim`` is not an integer
            >= 1.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int | np.integer) or head_dim < 1:
        raise ValueError(f"head_dim must be an integer >= 1, got {head_dim!r}")
    scale = 1.0 / math.sqrt(int(head_dim)) if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale!r}")
    return scale


def default_scale(head_dim: int) -> float:
    """The usual softmax scale ``1 / sqrt(head_dim)`` (:func:`resolve_softmax_scale`)."""
    return resolve_softmax_scale(None, head_dim)


@dataclass(frozen=True)
class VarlenBackend:
    """A varlen attention kernel: :meth:`forward` -> (out, lse) and :meth:`backward` -> grads.

    One subclass per kernel (``flash_attn``, ``torch_cuda``, ``cpu``, ``reference``); each
    implements ``_forward`` and ``_backward`` on arguments this class has already checked. This
    class itself has no kernel and cannot be built: :func:`flashcp.ops.backends.get_backend`
    (``name``, device) gives a backend that can run here, and
    ``flashcp.ops.backends.backend_class(name)(**options)`` one with options, without the device
    check (:data:`flashcp.ops.backends.BACKEND_CLASSES`).

    Attributes:
        name: the backend's name; a registered subclass accepts only its own (:attr:`KIND`).
    """

    KIND: ClassVar[str | None] = None
    name: str

    def __new__(cls, *args, **kwargs):
        """Raises:
        TypeError: ``cls`` is :class:`VarlenBackend` itself (it has no kernel)."""
        if cls is VarlenBackend:
            name = args[0] if args else kwargs.get("name")
            raise TypeError(
                f"VarlenBackend is the interface, not a backend: use get_backend({name!r}) or "
                f"backend_class({name!r})(**options) from flashcp.ops.backends"
            )
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if self.KIND is not None and self.name != self.KIND:
            raise ValueError(
                f"{type(self).__name__} is the {self.KIND!r} backend, not {self.name!r}"
            )

    def forward(
        self,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        *,
        causal: bool,
        softmax_scale: float,
    ):
        """Varlen attention forward.

        Args:
            q: (Tq, H, D); k, v: (Tk, Hkv, D); same dtype and device.
            cu_seqlens_q, cu_seqlens_k: (n_seg + 1,) int32 segment boundaries.
            max_seqlen_q, max_seqlen_k: at least the longest segment (the CUDA kernels size
                their grid by them; checked when ``cu_seqlens`` are on CPU).
            causal: bottom-right aligned causal mask inside each segment.
            softmax_scale: multiplies the scores before the softmax
                (usually :func:`resolve_softmax_scale`'s default, ``1 / sqrt(D)``).
        Returns:
            out: (Tq, H, D) in q.dtype (0 where a row sees no key);
            lse: (H, Tq) in ``compute_dtype(q.dtype)`` (-inf where a row sees no key).
            A call without work (:func:`has_work`: no segment, no rows) returns these without
            calling the kernel.
        Raises:
            ValueError: inconsistent arguments (:func:`check_varlen_args`).
        """
        check_varlen_args(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
        )  # fmt: skip
        if not has_work(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
            tq, h, _ = q.shape
            lse = torch.full((h, tq), float("-inf"), dtype=compute_dtype(q.dtype), device=q.device)
            return torch.zeros_like(q), lse
        return self._forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale
        )

    def backward(
        self,
        dout,
        q,
        k,
        v,
        out,
        lse,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        *,
        causal: bool,
        softmax_scale: float,
        grad_dtype: torch.dtype | None = None,
    ):
        """Varlen attention backward from the given ``out`` and ``lse`` (which may be the global
        merged values of a blockwise computation).

        Args:
            dout, out: (Tq, H, D), any float dtype (read in q.dtype, as the kernels take them:
                an fp32 ``dout`` from an fp32 loss over bf16 attention is rounded once here);
                q: (Tq, H, D); k, v: (Tk, Hkv, D); lse: (H, Tq) in ``compute_dtype(q.dtype)``.
            grad_dtype: dtype of the returned gradients (default: q.dtype for dq, k.dtype for
                dk and dv); callers that add up partial gradients ask for
                ``compute_dtype(q.dtype)`` to round once at the end. The CUDA kernels round to
                the input dtype first.
            Others as in :meth:`forward`.
        Returns:
            dq: (Tq, H, D); dk, dv: (Tk, Hkv, D), summed over the query heads of each KV group;
            zero, without a kernel call, for a call without work (:func:`has_work`).
        Raises:
            ValueError: inconsistent arguments (:func:`check_varlen_args`).
        """
        check_varlen_args(
            q, k, v, cu_seqlens_q, cu_seqlens_k, out=out, lse=lse, dout=dout,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        )  # fmt: skip
        dtypes = (q.dtype, k.dtype, v.dtype) if grad_dtype is None else (grad_dtype,) * 3
        if not has_work(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
            return tuple(torch.zeros(x.shape, dtype=dt, device=x.device)
                         for x, dt in zip((q, k, v), dtypes, strict=True))  # fmt: skip
        dout, out = dout.to(q.dtype), out.to(q.dtype)  # no copy when they already are
        grads = self._backward(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            causal, softmax_scale,
        )  # fmt: skip
        return tuple(g.to(dt) for g, dt in zip(grads, dtypes, strict=True))

    def _forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        """(out, lse) as :meth:`forward` returns them, on checked arguments."""
        raise NotImplementedError(f"backend {self.name!r} has no forward kernel")

    def _backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        """(dq, dk, dv) in any float dtype (:meth:`backward` casts), on checked arguments."""
        raise NotImplementedError(f"backend {self.name!r} has no backward kernel")
