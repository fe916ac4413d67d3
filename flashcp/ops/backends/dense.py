"""Blocked dense attention math shared by the ``cpu`` and ``reference`` backends.

Segments (``cu_q``, ``cu_k`` as Python lists) are covered by dense blocks: consecutive small
segments merged into one masked block up to a budget of query x key elements per head, a segment
larger than the budget cut into query chunks that each see only their keys. Forward returns
``out`` and the natural-log ``lse``; backward follows FlashAttention-2 (Dao 2023, Algorithm 2) from
the *given* ``out`` and ``lse`` (package docstring of :mod:`flashcp.ops.backends`).
"""

from __future__ import annotations

import torch

from flashcp.ops.backends.base import compute_dtype

__all__ = ["dense_backward", "dense_forward"]


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


def dense_forward(q, k, v, cu_q, cu_k, causal, scale, dtype, budget, skip=None):
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


def dense_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, dtype, budget, skip=None):
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
