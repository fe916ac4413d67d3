"""FlashAttention-2's varlen kernels (``mha_varlen_fwd`` / ``mha_varlen_bwd``) emulated in float64.

What is emulated is what a caller can get wrong:

* Refusals, with the kernels' messages: inputs other than float16/bfloat16, batch size 0
  (``cu_seqlens = [0]``), head_dim > 256, and (backward; forward where ``pad_head=False``) a
  head_dim that is not a multiple of 8.
* The grid: the forward computes the first ``max_seqlen_q`` rows of each segment and leaves the
  rest of ``out`` and ``lse`` unwritten (here NaN: memory the caller never sees written); the
  backward takes the first ``max_seqlen_q`` query rows and ``max_seqlen_k`` key rows of each
  segment and leaves the other rows of ``dq`` / ``dk`` / ``dv`` unwritten (NaN). So wrong
  ``max_seqlen`` metadata shows.
* Rows that see no key: ``out = 0``, ``lse = +inf``; ``max_seqlen_k = 0``: everything so.
* The LSE layouts: padded ``(batch, heads, max_seqlen_q)`` or ``(heads, total_q)``.
* The backward takes P = exp(scale * S - lse) from the *given* lse, literally (a -inf lse gives
  inf/NaN, as on the GPU), and Drow = rowsum(dout * out) from the given out; it writes ``dq``,
  ``dk``, ``dv`` in the input dtype.

The forward's numbers come from the float64 dense reference math
(:func:`flashcp.ops.backends.dense.dense_forward`).
"""

from __future__ import annotations

import torch

from flashcp.ops.backends.dense import dense_forward

NAN = float("nan")
INF = float("inf")


def check(q, k, v, cu_q, cu_k, *, what: str, pad_head: bool, head_msg: str) -> None:
    """The checks of ``mha_varlen_fwd`` / ``mha_varlen_bwd``, in their order, as RuntimeError."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if k.dtype != q.dtype:
        raise RuntimeError("query and key must have the same dtype")
    if v.dtype != q.dtype:
        raise RuntimeError("query and value must have the same dtype")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if cu.dtype != torch.int32:
            raise RuntimeError(f"{name} must have dtype int32")
    for x in (q, k, v):
        if x.stride(-1) != 1:
            raise RuntimeError("Input tensor must have contiguous last dimension")
    if cu_q.numel() - 1 <= 0:
        raise RuntimeError("batch size must be positive")
    d = q.shape[-1]
    if d > 256:
        raise RuntimeError(f"FlashAttention {what} only supports head dimension at most 256")
    if not pad_head and d % 8:
        raise RuntimeError(head_msg)
    if q.shape[1] % k.shape[1]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    if cu_k.numel() != cu_q.numel():
        raise RuntimeError("cu_seqlens_k must have shape (batch_size + 1)")


def forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool, padded_lse):
    """out (Tq, H, D) in q.dtype and lse float32, ``(batch, H, max_q)`` if ``padded_lse`` else
    ``(H, Tq)``; unwritten entries NaN (module docstring). Checked by the caller."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    b, (tq, h, _) = len(cq) - 1, q.shape
    out = torch.full_like(q, NAN)
    rows = torch.full((h, tq), NAN, dtype=torch.float32)
    if max_k > 0:
        o, lse = dense_forward(q, k, v, cq, ck, causal, float(scale), torch.float64, None)
        lse = torch.where(torch.isneginf(lse), INF, lse)  # a row without a key: +inf
        for i in range(b):
            r = slice(cq[i], cq[i] + min(cq[i + 1] - cq[i], max_q))  # the grid's rows
            out[r] = o[r].to(q.dtype)
            rows[:, r] = lse[:, r].float()
    else:  # "If seqlen_k == 0, then we have an empty tensor": out 0, lse +inf
        out.zero_()
        rows.fill_(INF)
    if not padded_lse:
        return out, rows
    lse = torch.full((b, h, max_q), NAN, dtype=torch.float32)
    for i in range(b):
        n = min(cq[i + 1] - cq[i], max_q)
        lse[i, :, :n] = rows[:, cq[i] : cq[i] + n]
    return out, lse


def _lse_rows(lse, cq: list[int], h: int, tq: int, max_q: int, padded_lse: bool):
    """(H, Tq) float64 view of the given LSE as the kernel indexes it."""
    if not padded_lse:
        if lse.shape != (h, tq):
            raise RuntimeError(f"softmax_lse must have shape ({h}, {tq}), got {tuple(lse.shape)}")
        return lse.double()
    if lse.dim() != 3 or lse.shape[:2] != (len(cq) - 1, h) or lse.shape[2] < max_q:
        raise RuntimeError(
            f"softmax_lse must have shape (batch, {h}, max_seqlen_q), got {tuple(lse.shape)}"
        )
    rows = torch.full((h, tq), NAN, dtype=torch.float64)
    for i in range(len(cq) - 1):
        n = min(cq[i + 1] - cq[i], max_q)
        rows[:, cq[i] : cq[i] + n] = lse[i, :, :n].double()
    return rows


def backward(
    dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, scale, causal, padded_lse
) -> None:
    """Write dq, dk, dv (module docstring). Checked by the caller."""
    for name, g, x in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if g.shape != x.shape or g.dtype != x.dtype:
            raise RuntimeError(f"{name} must have the shape and dtype of its input")
    if dout.shape != q.shape or out.shape != q.shape:
        raise RuntimeError("dout and out must have q's shape (head_size padded to a multiple of 8)")
    for name, x in (("out", out), ("dout", dout)):
        if x.dtype != q.dtype:
            raise RuntimeError(f"query and {name} must have the same dtype")
        if x.stride(-1) != 1:
            raise RuntimeError(f"{name} tensor must have contiguous last dimension")
    cq, ck = cu_q.tolist(), cu_k.tolist()
    tq, h, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    lse_rows = _lse_rows(lse, cq, h, tq, max_q, padded_lse)
    dq.fill_(NAN)
    dk.fill_(NAN)
    dv.fill_(NAN)
    for i in range(len(cq) - 1):
        sq, sk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        nq, nk = min(sq, max_q), min(sk, max_k)  # the grid's rows and keys
        qr, kr = slice(cq[i], cq[i] + nq), slice(ck[i], ck[i] + nk)
        qs = q[qr].double()  # (nq, H, D)
        ks = k[kr].double().repeat_interleave(g, dim=1)  # (nk, H, D): head h uses KV h // g
        vs = v[kr].double().repeat_interleave(g, dim=1)
        do, o = dout[qr].double(), out[qr].double()
        s = torch.einsum("ihd,jhd->hij", qs, ks) * scale  # (H, nq, nk)
        if causal:  # bottom-right aligned: row i sees keys j <= i + sk - sq
            ii = torch.arange(nq)[:, None]
            jj = torch.arange(nk)[None, :]
            s = s.masked_fill(jj > ii + (sk - sq), -INF)
        p = torch.exp(s - lse_rows[:, qr, None])  # from the given lse, literally
        drow = (do * o).sum(-1).t()  # (H, nq), from the given out
        dp = torch.einsum("ihd,jhd->hij", do, vs)
        ds = p * (dp - drow[:, :, None])
        dq[qr] = (scale * torch.einsum("hij,jhd->ihd", ds, ks)).to(dq.dtype)
        dkh = scale * torch.einsum("hij,ihd->jhd", ds, qs)  # (nk, H, D)
        dvh = torch.einsum("hij,ihd->jhd", p, do)
        dk[kr] = dkh.view(nk, hkv, g, d).sum(2).to(dk.dtype)
        dv[kr] = dvh.view(nk, hkv, g, d).sum(2).to(dv.dtype)
