"""The ``cpu`` backend: varlen flash attention emulated on CPU.

Large segments run on PyTorch's flash CPU kernel
(``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward, which take the LSE), one
segment at a time, split into a non-causal prefix block and a causal diagonal block (the kernel's
causal flag is top-left aligned); small segments run in blocked dense math
(:mod:`flashcp.ops.backends.dense`, in ``compute_dtype``), consecutive ones merged into one masked
block so that many tiny documents cost few calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from flashcp.ops.backends.base import VarlenBackend, compute_dtype
from flashcp.ops.backends.dense import dense_backward, dense_forward

__all__ = ["CpuBackend"]

# ---- the aten flash CPU kernel, one large segment at a time ----------------------------------------
# torch.ops.aten._scaled_dot_product_flash_attention_for_cpu takes (B, H, S, D) views, supports GQA
# (fewer KV heads) and returns the LSE; its backward op computes P from the given LSE and the row
# term from the given out, so blocks computed separately and merged have additive gradients. Its
# causal flag is top-left aligned, so a bottom-right causal segment (sq, sk = p + sq) is computed as
# a non-causal block over the p prefix keys plus a causal sq x sq diagonal block, merged by LSE; when
# sk < sq the first sq - sk rows see nothing and the rest form a causal sk x sk block.


def _seg_blocks(sq: int, sk: int, causal: bool):
    """Blocks ``(q0, k0, k1, causal)`` of one segment (queries q0:sq) for the aten kernel."""
    if not causal:
        return [(0, 0, sk, False)]
    if sk < sq:
        return [(sq - sk, 0, sk, True)]
    p = sk - sq
    return ([(0, 0, p, False)] if p else []) + [(0, p, sk, True)]


def _upcast(x):
    """A kernel input in ``compute_dtype`` (a CPU kernel gains nothing from bf16; float64 stays
    float64) with a unit last-dimension stride: the aten CPU kernel reads the last dimension as
    dense whatever its stride (a view ``x[..., ::2]`` would give a wrong result, silently), while
    it honours the strides of the other dimensions. No copy when ``x`` already fits."""
    x = x.to(compute_dtype(x.dtype))
    return x if x.stride(-1) == 1 else x.contiguous()


def _bhsd(x):
    return x.transpose(0, 1).unsqueeze(0)  # (S, H, D) -> (1, H, S, D) view


def _aten_segment_forward(q, k, v, causal, scale):
    """One segment with the aten kernel: q (sq, H, D), k, v (sk, Hkv, D) -> out (sq, H, D) and
    lse (H, sq), both in ``compute_dtype(q.dtype)``."""
    q, k, v = _upcast(q), _upcast(k), _upcast(v)
    sq, h, d = q.shape
    out = torch.zeros(sq, h, d, dtype=q.dtype, device=q.device)
    lse = torch.full((h, sq), float("-inf"), dtype=q.dtype, device=q.device)
    for q0, k0, k1, blk_causal in _seg_blocks(sq, k.shape[0], causal):
        o, lb = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q[q0:]), _bhsd(k[k0:k1]), _bhsd(v[k0:k1]), 0.0, blk_causal, scale=scale
        )
        o, lb = o[0].transpose(0, 1).to(q.dtype), lb[0].to(q.dtype)  # (n, H, D), (H, n)
        new = torch.logaddexp(lse[:, q0:], lb)
        out[q0:] = (out[q0:] * torch.exp(lse[:, q0:] - new).t()[..., None]
                    + o * torch.exp(lb - new).t()[..., None])  # fmt: skip
        lse[:, q0:] = new
    return out, lse


def _aten_segment_backward(dout, q, k, v, out, lse, causal, scale):
    """Backward of one segment from its given (global) out and lse; dq, dk, dv in
    ``compute_dtype(q.dtype)`` (the dtype of ``lse``)."""
    dout, q, k, v, out = _upcast(dout), _upcast(q), _upcast(k), _upcast(v), _upcast(out)
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=q.dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    for q0, k0, k1, blk_causal in _seg_blocks(q.shape[0], k.shape[0], causal):
        g = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout[q0:]), _bhsd(q[q0:]), _bhsd(k[k0:k1]), _bhsd(v[k0:k1]),
            _bhsd(out[q0:]), lse[None, :, q0:].contiguous(), 0.0, blk_causal, scale=scale,
        )  # fmt: skip
        dq[q0:] += g[0][0].transpose(0, 1)
        dk[k0:k1] += g[1][0].transpose(0, 1)
        dv[k0:k1] += g[2][0].transpose(0, 1)
    return dq, dk, dv


@dataclass(frozen=True)
class CpuBackend(VarlenBackend):
    """Varlen attention on CPU: the aten flash CPU kernel for large segments, dense math for
    small ones (module docstring).

    Attributes:
        block_budget: largest query x key block per head that merges consecutive small segments
            into one dense masked computation.
        kernel_min: segments with ``sq * sk >= kernel_min`` run on PyTorch's flash CPU kernel
            (``aten::_scaled_dot_product_flash_attention_for_cpu``) one at a time; smaller ones
            use the dense blocked math.
    """

    KIND: ClassVar[str] = "cpu"
    name: str = "cpu"
    block_budget: int = 1 << 12
    kernel_min: int = 1 << 8

    def _big(self, cu_q: list[int], cu_k: list[int]) -> list[bool]:
        """Per segment: run it on the aten kernel (True) or in the dense blocks (False)."""
        return [
            (cu_q[i + 1] - cu_q[i]) * (cu_k[i + 1] - cu_k[i]) >= self.kernel_min
            for i in range(len(cu_q) - 1)
        ]

    def _forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        cu_q, cu_k, scale = cu_q.tolist(), cu_k.tolist(), float(scale)
        dtype, big = compute_dtype(q.dtype), self._big(cu_q, cu_k)
        out, lse = dense_forward(q, k, v, cu_q, cu_k, causal, scale, dtype, self.block_budget, big)
        for i in (i for i, b in enumerate(big) if b):
            qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            out[qs], lse[:, qs] = _aten_segment_forward(q[qs], k[ks], v[ks], causal, scale)
        return out.to(q.dtype), lse

    def _backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        cu_q, cu_k, scale = cu_q.tolist(), cu_k.tolist(), float(scale)
        dtype, big = compute_dtype(q.dtype), self._big(cu_q, cu_k)
        dq, dk, dv = dense_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, dtype, self.block_budget, big
        )
        for i in (i for i, b in enumerate(big) if b):
            qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            dq[qs], dk[ks], dv[ks] = _aten_segment_backward(
                dout[qs], q[qs], k[ks], v[ks], out[qs], lse[:, qs], causal, scale
            )
        return dq, dk, dv  # compute dtype; backward() casts
