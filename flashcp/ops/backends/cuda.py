"""The CUDA backends: ``torch_cuda`` (PyTorch's bundled FlashAttention-2 varlen kernels,
``aten::_flash_attention_*``) and ``flash_attn`` (the ``flash-attn`` package).

FlashAttention marks rows that see no key with lse = +inf (so that exp(s - lse) = 0 in backward);
our convention is -inf. Both backends convert on the way out and back.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import ClassVar

import torch

from flashcp.ops.backends.base import VarlenBackend

__all__ = ["FlashAttnBackend", "TorchCudaBackend", "flash_attn_available"]


def flash_attn_available() -> bool:
    """Whether the ``flash-attn`` package is importable here."""
    return importlib.util.find_spec("flash_attn") is not None


def _lse_out(lse, h, tq):
    lse = lse.float()
    if lse.shape != (h, tq):
        raise ValueError(f"kernel returned lse of shape {tuple(lse.shape)}, expected {(h, tq)}")
    return torch.where(torch.isinf(lse), float("-inf"), lse)


def _lse_in(lse):
    return torch.where(torch.isneginf(lse), float("inf"), lse).contiguous()


def _torch_cuda_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, int(max_q), int(max_k), 0.0, bool(causal), False, scale=float(scale)
    )
    out = torch.where(torch.isnan(out), 0.0, out) if out.numel() else out
    return out, _lse_out(lse, q.shape[1], q.shape[0])


def _torch_cuda_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    dummy = torch.zeros(
        2, dtype=torch.uint64 if hasattr(torch, "uint64") else torch.int64, device=q.device
    )
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout.contiguous(),
        q,
        k,
        v,
        out.contiguous(),
        _lse_in(lse),
        cu_q,
        cu_k,
        int(max_q),
        int(max_k),
        0.0,
        bool(causal),
        dummy,
        torch.empty(0, device=q.device),
        scale=float(scale),
    )
    return dq, dk, dv


def _fa_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    from flash_attn import flash_attn_varlen_func

    out, lse, _ = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        cu_k,
        int(max_q),
        int(max_k),
        dropout_p=0.0,
        softmax_scale=float(scale),
        causal=bool(causal),
        return_attn_probs=True,
    )
    return out, _lse_out(lse, q.shape[1], q.shape[0])


def _fa_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    import inspect

    from flash_attn import flash_attn_interface as fai

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    params = inspect.signature(fai._flash_attn_varlen_backward).parameters
    kwargs = dict(
        dout=dout.contiguous(),
        q=q,
        k=k,
        v=v,
        out=out.contiguous(),
        softmax_lse=_lse_in(lse),
        dq=dq,
        dk=dk,
        dv=dv,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=int(max_q),
        max_seqlen_k=int(max_k),
        dropout_p=0.0,
        softmax_scale=float(scale),
        causal=bool(causal),
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
    )
    if "window_size_left" in params:
        kwargs.update(window_size_left=-1, window_size_right=-1)
    else:
        kwargs["window_size"] = (-1, -1)
    if "softcap" in params:
        kwargs["softcap"] = 0.0
    fai._flash_attn_varlen_backward(**{key: val for key, val in kwargs.items() if key in params})
    return dq, dk, dv


@dataclass(frozen=True)
class TorchCudaBackend(VarlenBackend):
    """PyTorch's bundled FlashAttention-2 varlen kernels (CUDA only)."""

    KIND: ClassVar[str] = "torch_cuda"
    name: str = "torch_cuda"

    def _forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        return _torch_cuda_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)

    def _backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        return _torch_cuda_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale
        )


@dataclass(frozen=True)
class FlashAttnBackend(VarlenBackend):
    """The ``flash-attn`` package's varlen kernels (CUDA only; ``pip install flash-attn``)."""

    KIND: ClassVar[str] = "flash_attn"
    name: str = "flash_attn"

    def _forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        return _fa_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)

    def _backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        return _fa_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale)
