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

Backends:

* ``flash_attn``: the ``flash-attn`` package (CUDA).
* ``torch_cuda``: PyTorch's bundled FlashAttention-2 varlen kernels (``aten::_flash_attention_*``).
* ``cpu``: large segments on PyTorch's flash CPU kernel
  (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward, which take the LSE), one
  segment at a time, split into a non-causal prefix block and a causal diagonal block (the kernel's
  causal flag is top-left aligned); small segments in blocked dense math (float32; float64 for
  float64 inputs), consecutive ones merged into one masked block so that many tiny documents cost
  few calls.
* ``reference``: the same formulas in float64, one segment at a time (tests).

One dtype rule (:func:`compute_dtype`) holds for every backend and every CP op: the LSE, LSE
merges and every partial sum (gradients accumulated over blocks or reduced over ranks, by default)
are in ``compute_dtype(input dtype)``: float32 for bfloat16, float16 and float32 inputs, float64
for float64 inputs, so a float64 computation is float64 end to end.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
from dataclasses import dataclass

import torch

__all__ = [
    "BACKENDS",
    "VarlenBackend",
    "check_varlen_args",
    "compute_dtype",
    "default_scale",
    "get_backend",
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
    q, k, v, cu_seqlens_q, cu_seqlens_k, *, out=None, lse=None, dout=None
) -> None:
    """Validate a varlen call (every backend runs this before its kernel).

    Args:
        q: (Tq, H, D); k, v: (Tk, Hkv, D), one dtype; ``H % Hkv == 0``.
        cu_seqlens_q, cu_seqlens_k: (n_seg + 1,) int32; on CPU also checked to rise from 0 to
            Tq / Tk (on CUDA that would cost a device sync per call).
        out, dout: (Tq, H, D) and lse: (H, Tq) in ``compute_dtype(q.dtype)``, for backward.
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
    if cu_seqlens_q.device.type != "cpu":
        return
    for name, cu, total in (
        ("cu_seqlens_q", cu_seqlens_q, q.shape[0]),
        ("cu_seqlens_k", cu_seqlens_k, k.shape[0]),
    ):
        c = cu.tolist()
        if c[0] != 0 or c[-1] != total or any(b < a for a, b in itertools.pairwise(c)):
            raise ValueError(
                f"{name} must rise from 0 to {total}, got {c[:8]}{'...' if len(c) > 8 else ''}"
            )


# ---- dense blocked math (cpu and reference backends) -------------------------------------------


def _row_windows(
    cu_q: list[int], cu_k: list[int], causal: bool, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute visible key interval ``[lo, hi)`` of every query row; (Tq,) int64 each.

    Bottom-right causal: row i of a segment (sq, sk) sees keys ``[0, clamp(i + sk - sq + 1, 0, sk))``
    of that segment.
    """
    cq = torch.tensor(cu_q, dtype=torch.int64, device=device)
    ck = torch.tensor(cu_k, dtype=torch.int64, device=device)
    sq, sk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    seg = torch.repeat_interleave(torch.arange(sq.numel(), device=device), sq)
    lo = ck[:-1][seg]
    if causal:
        i = torch.arange(int(cu_q[-1]), device=device) - cq[:-1][seg]
        width = torch.minimum(torch.clamp(i + (sk - sq)[seg] + 1, min=0), sk[seg])
    else:
        width = sk[seg]
    return lo, lo + width


def _blocks(cu_q: list[int], cu_k: list[int], causal: bool, budget: int | None, skip=None):
    """Dense blocks ``(q0, q1, k0, k1)`` covering every visible (query, key) pair.

    Consecutive segments are merged while the block's ``nq * nk`` stays within ``budget``; a
    segment larger than the budget is cut into query chunks, each with only the keys it can see.
    ``budget=None`` gives one block per segment. Blocks have disjoint query ranges. Segments
    flagged in ``skip`` are left out (and never merged across).
    """
    n = len(cu_q) - 1
    out = []
    i = 0
    while i < n:
        if cu_q[i + 1] == cu_q[i] or cu_k[i + 1] == cu_k[i] or (skip is not None and skip[i]):
            i += 1
            continue
        j = i
        if budget is not None:
            while (
                j + 1 < n
                and (skip is None or not skip[j + 1])
                and (cu_q[j + 2] - cu_q[i]) * (cu_k[j + 2] - cu_k[i]) <= budget
            ):
                j += 1
        q0, q1, k0, k1 = cu_q[i], cu_q[j + 1], cu_k[i], cu_k[j + 1]
        if budget is None or j > i or (q1 - q0) * (k1 - k0) <= budget:
            out.append((q0, q1, k0, k1))
        else:  # one long segment: query chunks, each with the keys it can see
            sq, sk = q1 - q0, k1 - k0
            rows = max(1, budget // sk)
            for a in range(0, sq, rows):
                b = min(sq, a + rows)
                kend = min(sk, b - 1 + sk - sq + 1) if causal else sk
                if kend > 0:
                    out.append((q0 + a, q0 + b, k0, k0 + kend))
        i = j + 1
    return out


def _scores(q, k, lo, hi, q0, q1, k0, k1, scale, dtype):
    """Masked scaled scores of one block: (Hkv, g, nq, nk) in ``dtype`` and the (Hkv, g*nq, D) q."""
    nq, nk = q1 - q0, k1 - k0
    h, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    g = h // hkv
    qh = q[q0:q1].to(dtype).view(nq, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * nq, d)
    kh = k[k0:k1].to(dtype).permute(1, 0, 2)  # (Hkv, nk, D)
    s = torch.matmul(qh, kh.transpose(1, 2)).mul_(scale).view(hkv, g, nq, nk)
    kpos = torch.arange(k0, k1, device=q.device)
    visible = (kpos >= lo[q0:q1, None]) & (kpos < hi[q0:q1, None])  # (nq, nk)
    if not bool(visible.all()):
        s = s.masked_fill(~visible, float("-inf"))
    return s, qh, kh


def _dense_forward(q, k, v, cu_q, cu_k, causal, scale, dtype, budget, skip=None):
    """Blocked dense forward in ``dtype``; returns out (Tq, H, D) in ``dtype``, lse (H, Tq) in
    ``compute_dtype(q.dtype)``. Rows of ``skip``-ped segments are left at out = 0, lse = -inf."""
    tq, h, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    out = torch.zeros(tq, h, d, dtype=dtype, device=q.device)
    lse = torch.full((h, tq), float("-inf"), dtype=dtype, device=q.device)
    lo, hi = _row_windows(cu_q, cu_k, causal, q.device)
    for q0, q1, k0, k1 in _blocks(cu_q, cu_k, causal, budget, skip):
        nq = q1 - q0
        s, _, _ = _scores(q, k, lo, hi, q0, q1, k0, k1, scale, dtype)
        m = torch.logsumexp(s, dim=-1)  # (Hkv, g, nq); -inf for rows with no visible key
        p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m).unsqueeze(-1))
        vh = v[k0:k1].to(dtype).permute(1, 0, 2)  # (Hkv, nk, D)
        o = torch.matmul(p.view(hkv, g * nq, -1), vh)  # (Hkv, g*nq, D)
        out[q0:q1] = o.view(hkv, g, nq, d).permute(2, 0, 1, 3).reshape(nq, h, d)
        lse[:, q0:q1] = m.reshape(h, nq)
    return out, lse.to(compute_dtype(q.dtype))


def _dense_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, dtype, budget, skip=None):
    """Blocked dense backward from the given (possibly global) out and lse (module docstring);
    returns dq, dk, dv in ``dtype`` (zero for ``skip``-ped segments)."""
    tq, h, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    dq = torch.zeros(tq, h, d, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=q.device)
    lo, hi = _row_windows(cu_q, cu_k, causal, q.device)
    drow = (dout.to(dtype) * out.to(dtype)).sum(-1).t()  # (H, Tq)
    lse_safe = torch.where(torch.isinf(lse), 0.0, lse).to(dtype)  # -inf rows see no key: P = 0
    for q0, q1, k0, k1 in _blocks(cu_q, cu_k, causal, budget, skip):
        nq, nk = q1 - q0, k1 - k0
        s, qh, kh = _scores(q, k, lo, hi, q0, q1, k0, k1, scale, dtype)
        p = torch.exp(s - lse_safe[:, q0:q1].reshape(hkv, g, nq, 1)).view(hkv, g * nq, nk)
        do = dout[q0:q1].to(dtype).view(nq, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * nq, d)
        vh = v[k0:k1].to(dtype).permute(1, 0, 2)  # (Hkv, nk, D)
        dv[k0:k1] += torch.matmul(p.transpose(1, 2), do).permute(1, 0, 2)
        dp = torch.matmul(do, vh.transpose(1, 2))  # (Hkv, g*nq, nk)
        ds = p.mul_(dp.sub_(drow[:, q0:q1].reshape(hkv, g * nq, 1))).mul_(scale)
        dq[q0:q1] = torch.matmul(ds, kh).view(hkv, g, nq, d).permute(2, 0, 1, 3).reshape(nq, h, d)
        dk[k0:k1] += torch.matmul(ds.transpose(1, 2), qh).permute(1, 0, 2)
    return dq, dk, dv


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
    """Inputs in ``compute_dtype`` (a CPU kernel gains nothing from bf16; float64 stays float64)."""
    return x.to(compute_dtype(x.dtype))


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


# ---- backends ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VarlenBackend:
    """A varlen attention kernel: :meth:`forward` -> (out, lse) and :meth:`backward` -> grads.

    Attributes:
        name: ``flash_attn``, ``torch_cuda``, ``cpu`` or ``reference``.
        block_budget: (cpu) largest query x key block per head that merges consecutive small
            segments into one dense masked computation.
        kernel_min: (cpu) segments with ``sq * sk >= kernel_min`` run on PyTorch's flash CPU
            kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``) one at a time; smaller
            ones (and every segment of the ``reference`` backend) use the dense blocked math.
    """

    name: str
    block_budget: int = 1 << 12
    kernel_min: int = 1 << 8

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
            max_seqlen_q, max_seqlen_k: longest segment (used by the CUDA kernels).
            causal: bottom-right aligned causal mask inside each segment.
            softmax_scale: multiplies the scores before the softmax (usually D ** -0.5).
        Returns:
            out: (Tq, H, D) in q.dtype (0 where a row sees no key);
            lse: (H, Tq) in ``compute_dtype(q.dtype)`` (-inf where a row sees no key).
        """
        check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k)
        if self.name == "flash_attn":
            return _fa_forward(
                q,
                k,
                v,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                causal,
                softmax_scale,
            )
        if self.name == "torch_cuda":
            return _torch_cuda_forward(
                q,
                k,
                v,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                causal,
                softmax_scale,
            )
        return self._cpu_forward(
            q, k, v, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), causal, float(softmax_scale)
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
            dout, out: (Tq, H, D); q: (Tq, H, D); k, v: (Tk, Hkv, D);
            lse: (H, Tq) in ``compute_dtype(q.dtype)``.
            grad_dtype: dtype of the returned gradients (default: q.dtype for dq, k.dtype for
                dk and dv); callers that add up partial gradients ask for
                ``compute_dtype(q.dtype)`` to round once at the end. The CUDA kernels round to
                the input dtype first.
            Others as in :meth:`forward`.
        Returns:
            dq: (Tq, H, D); dk, dv: (Tk, Hkv, D), summed over the query heads of each KV group.
        """
        check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, out=out, lse=lse, dout=dout)
        args = (dout, q, k, v, out, lse)
        if self.name == "flash_attn":
            grads = _fa_backward(*args, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 causal, softmax_scale)  # fmt: skip
        elif self.name == "torch_cuda":
            grads = _torch_cuda_backward(*args, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, causal, softmax_scale)  # fmt: skip
        else:
            grads = self._cpu_backward(*args, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), causal,
                                       float(softmax_scale))  # fmt: skip
        dtypes = (q.dtype, k.dtype, v.dtype) if grad_dtype is None else (grad_dtype,) * 3
        return tuple(g.to(dt) for g, dt in zip(grads, dtypes, strict=True))

    def _split(self, dtype: torch.dtype, cu_q: list[int], cu_k: list[int]):
        """(compute dtype, dense budget, per-segment flags: run on the aten kernel) for inputs
        of ``dtype``."""
        if self.name == "reference":
            return torch.float64, None, [False] * (len(cu_q) - 1)
        big = [
            (cu_q[i + 1] - cu_q[i]) * (cu_k[i + 1] - cu_k[i]) >= self.kernel_min
            for i in range(len(cu_q) - 1)
        ]
        return compute_dtype(dtype), self.block_budget, big

    def _cpu_forward(self, q, k, v, cu_q, cu_k, causal, scale):
        dtype, budget, big = self._split(q.dtype, cu_q, cu_k)
        out, lse = _dense_forward(q, k, v, cu_q, cu_k, causal, scale, dtype, budget, big)
        for i in (i for i, b in enumerate(big) if b):
            qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            out[qs], lse[:, qs] = _aten_segment_forward(q[qs], k[ks], v[ks], causal, scale)
        return out.to(q.dtype), lse

    def _cpu_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
        dtype, budget, big = self._split(q.dtype, cu_q, cu_k)
        dq, dk, dv = _dense_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, dtype, budget, big
        )
        for i in (i for i, b in enumerate(big) if b):
            qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            dq[qs], dk[ks], dv[ks] = _aten_segment_backward(
                dout[qs], q[qs], k[ks], v[ks], out[qs], lse[:, qs], causal, scale
            )
        return dq, dk, dv  # compute dtype; backward() casts


def _flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def get_backend(name: str = "auto", device=None) -> VarlenBackend:
    """Select a kernel backend.

    Args:
        name: ``auto`` (``flash_attn`` if importable on CUDA, else ``torch_cuda`` on CUDA, else
            ``cpu``), ``flash_attn``, ``torch_cuda``, ``cpu`` or ``reference``.
        device: the device the tensors live on (default: CPU).
    Raises:
        ValueError: unknown name, or a backend that cannot run on ``device`` here (says why).
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        if dev.type == "cuda":
            name = "flash_attn" if _flash_attn_available() else "torch_cuda"
        else:
            name = "cpu"
    if name in ("flash_attn", "torch_cuda"):
        if dev.type != "cuda":
            raise ValueError(f"backend {name!r} needs a CUDA device, got {dev}")
        if not torch.cuda.is_available():
            raise ValueError(f"backend {name!r} needs CUDA, but torch.cuda.is_available() is False")
        if name == "flash_attn" and not _flash_attn_available():
            raise ValueError(
                "backend 'flash_attn' needs the flash-attn package (pip install flash-attn)"
            )
    return VarlenBackend(name)


# ---- CUDA kernels ----------------------------------------------------------------------------------
# FlashAttention marks rows that see no key with lse = +inf (so that exp(s - lse) = 0 in backward);
# our convention is -inf. Convert on the way out and back.


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


def default_scale(head_dim: int) -> float:
    """The usual softmax scale ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim)
