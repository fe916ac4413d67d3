"""Varlen attention kernel backends behind one interface (docs/design.md §4).

A backend computes attention over *segments*: query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``
attend to key rows ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``. ``causal`` is aligned bottom-right per
segment: with lengths ``(sq, sk)``, query ``i`` sees keys ``j <= i + sk - sq`` (a shard with prefix
p and length s has ``sq = s``, ``sk = p + s``; its last query sees the whole prefix and itself).

Forward returns ``out: (Tq, H, D)`` in ``q.dtype`` and ``lse: (H, Tq)`` in
``compute_dtype(q.dtype)`` (float32, or float64 for float64 inputs), the natural-log log-sum-exp of
the scaled scores of each row. A query row that sees no key gets ``out = 0`` and
``lse = -inf`` (never NaN), so partial results merge cleanly.

Backward follows FlashAttention-2 (Dao 2023, Algorithm 2): with ``P = exp(S * scale - lse)``
computed from the *given* ``lse`` and ``Drow = rowsum(dout * out)`` from the *given* ``out``,

    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - Drow),  dQ = scale * dS K,  dK = scale * dS^T Q.

Because only the given (global) ``out`` and ``lse`` enter, the backward of one block of a blockwise
(ring) computation yields exactly that block's contribution to the global gradients, so the
contributions of all blocks add up (ring-attention backward relies on this).

GQA: ``q`` has H heads, ``k``/``v`` have ``Hkv`` heads, ``H % Hkv == 0``; query head ``h`` uses KV
head ``h // (H // Hkv)``; ``dk``/``dv`` sum over the query heads of each KV group.

Backends, one class each behind :func:`get_backend` (which, for ``auto`` on CUDA, takes the first
CUDA backend whose kernels take the inputs' dtype and head_dim on this GPU):

* ``flash_attn`` (:class:`FlashAttnBackend`, :mod:`.cuda`): the ``flash-attn`` package (CUDA).
* ``torch_cuda`` (:class:`TorchCudaBackend`, :mod:`.cuda`): PyTorch's bundled FlashAttention-2
  varlen kernels (``aten::_flash_attention_*``).
* ``cpu`` (:class:`CpuBackend`, :mod:`.cpu`): large segments on PyTorch's flash CPU kernel
  (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward, which take the LSE), one
  segment at a time, split into a non-causal prefix block and a causal diagonal block (the kernel's
  causal flag is top-left aligned); small segments in blocked dense math (float32; float64 for
  float64 inputs), consecutive ones merged into one masked block so that many tiny documents cost
  few calls.
* ``reference`` (:class:`ReferenceBackend`, :mod:`.reference`): the same formulas in float64, one
  segment at a time (tests).

The interface, its argument checks and the dtype and softmax-scale rules are in :mod:`.base`; the
blocked dense math the ``cpu`` and ``reference`` backends share is in :mod:`.dense`.

One dtype rule (:func:`compute_dtype`) holds for every backend and every CP op: the LSE, LSE
merges and every partial sum (gradients accumulated over blocks or reduced over ranks, by default)
are in ``compute_dtype(input dtype)``: float32 for bfloat16, float16 and float32 inputs, float64
for float64 inputs, so a float64 computation is float64 end to end.
"""

from __future__ import annotations

import warnings
from types import MappingProxyType

import numpy as np
import torch

from flashcp.ops.backends.base import (
    BACKENDS,
    VarlenBackend,
    check_varlen_args,
    compute_dtype,
    default_scale,
    resolve_softmax_scale,
)
from flashcp.ops.backends.cpu import CpuBackend
from flashcp.ops.backends.cuda import (
    FlashAttnBackend,
    TorchCudaBackend,
    flash_attn_available,
    flash_attn_problem,
    flash_kernel_problem,
)
from flashcp.ops.backends.reference import ReferenceBackend

__all__ = [
    "BACKENDS",
    "BACKEND_CLASSES",
    "CpuBackend",
    "FlashAttnBackend",
    "ReferenceBackend",
    "TorchCudaBackend",
    "VarlenBackend",
    "backend_class",
    "check_varlen_args",
    "compute_dtype",
    "default_scale",
    "flash_attn_available",
    "get_backend",
    "resolve_softmax_scale",
]

#: backend name -> its class (every name of :data:`BACKENDS` but ``auto``).
BACKEND_CLASSES = MappingProxyType(
    {
        "flash_attn": FlashAttnBackend,
        "torch_cuda": TorchCudaBackend,
        "cpu": CpuBackend,
        "reference": ReferenceBackend,
    }
)


def backend_class(name: str) -> type[VarlenBackend]:
    """The class of backend ``name`` (no device check; see :func:`get_backend`).

    Raises:
        ValueError: ``name`` is not a backend (the message lists the valid ones).
    """
    try:
        return BACKEND_CLASSES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}"
        ) from None


def _cuda_problem(name: str, dev: torch.device, dtype, head_dim) -> str | None:
    """Why CUDA backend ``name`` cannot run ``dtype`` / ``head_dim`` inputs on ``dev``, or None."""
    if not torch.cuda.is_available():
        return f"backend {name!r} needs CUDA, but torch.cuda.is_available() is False"
    if name == "flash_attn":
        problem = flash_attn_problem()
        if problem is not None:
            return f"backend 'flash_attn': {problem}"
    elif not getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)():
        return "backend 'torch_cuda': this PyTorch build has no flash attention kernels"
    return flash_kernel_problem(name, dtype, head_dim, torch.cuda.get_device_capability(dev))


def _check_dtype_head_dim(dtype, head_dim) -> None:
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
    if head_dim is not None and (
        isinstance(head_dim, bool) or not isinstance(head_dim, int | np.integer) or head_dim < 1
    ):
        raise ValueError(f"head_dim must be an integer >= 1 or None, got {head_dim!r}")


def get_backend(
    name: str = "auto", device=None, *, dtype: torch.dtype | None = None, head_dim=None
) -> VarlenBackend:
    """Select a kernel backend for inputs of ``dtype`` and ``head_dim`` on ``device``.

    Args:
        name: ``auto``, ``flash_attn``, ``torch_cuda``, ``cpu`` or ``reference``. ``auto`` on CPU
            is ``cpu``; on CUDA the first of ``flash_attn`` (the package imports here and its
            version is supported), ``torch_cuda`` (this PyTorch has flash kernels) whose kernels
            take ``dtype`` and ``head_dim`` on this GPU (float16/bfloat16, head_dim <= 256,
            compute capability >= 8.0: :func:`~flashcp.ops.backends.cuda.flash_kernel_problem`),
            else ``reference`` (float64 dense math, one block per segment: slow) with a
            ``RuntimeWarning`` that says why. A flash-attn that is installed but fails to
            import (a wheel built for another torch) is skipped with a ``RuntimeWarning``.
        device: the device the tensors live on (default: CPU).
        dtype: the input dtype (None: not checked; the kernels then check it at the call).
        head_dim: D (None: not checked).
    Returns:
        an instance of the backend's class (:data:`BACKEND_CLASSES`) with its default options.
    Raises:
        ValueError: unknown name, a bad ``dtype``/``head_dim``, or a backend that cannot run on
            ``device`` or take these inputs here (the message names the value and, for an
            unimportable flash-attn, the import error).
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    _check_dtype_head_dim(dtype, head_dim)
    if name == "auto":
        if dev.type != "cuda":
            return BACKEND_CLASSES["cpu"]()
        if not torch.cuda.is_available():
            raise ValueError(f"device {dev} needs CUDA, but torch.cuda.is_available() is False")
        problems = []
        for candidate in ("flash_attn", "torch_cuda"):
            problem = _cuda_problem(candidate, dev, dtype, head_dim)
            if problem is None:
                name = candidate
                break
            problems.append(problem)
            if candidate == "flash_attn" and "cannot be used" in problem:
                warnings.warn(f"backend='auto' skips flash_attn: {problem}", RuntimeWarning, 2)
        else:
            warnings.warn(
                f"backend='auto' on {dev}: {'; '.join(problems)}; using the float64 'reference' "
                "backend (slow: one dense block per segment)",
                RuntimeWarning,
                2,
            )
            return BACKEND_CLASSES["reference"]()
    if name in ("flash_attn", "torch_cuda"):
        if dev.type != "cuda":
            raise ValueError(f"backend {name!r} needs a CUDA device, got {dev}")
        problem = _cuda_problem(name, dev, dtype, head_dim)
        if problem is not None:
            raise ValueError(problem)
    return BACKEND_CLASSES[name]()
