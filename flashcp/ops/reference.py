"""Independent float64 reference: single-device document-masked causal attention.

Correctness of every CP method is checked against this (docs/design.md §7), never against another CP
run. It shares no code with the kernels or the CP ops: the dense ``(C, C)`` document mask is built
explicitly from ``doc_lens`` and the softmax is plain autograd math, so ``.backward()`` gives the
reference gradients.
"""

from __future__ import annotations

import torch

from flashcp.ops.backends import resolve_softmax_scale

__all__ = ["document_mask", "reference_attention"]


def document_mask(doc_lens, device=None) -> torch.Tensor:
    """Dense intra-document causal mask.

    Args:
        doc_lens: (n_docs,) int document lengths summing to C.
    Returns:
        (C, C) bool; ``mask[i, j]`` is True when token i may attend to token j (same document and
        ``j <= i``).
    """
    lens = torch.as_tensor([int(x) for x in doc_lens], dtype=torch.int64, device=device)
    doc_id = torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens)  # (C,)
    pos = torch.arange(doc_id.numel(), device=device)
    return (doc_id[:, None] == doc_id[None, :]) & (pos[None, :] <= pos[:, None])


def reference_attention(q, k, v, doc_lens, softmax_scale: float | None = None) -> torch.Tensor:
    """Document-masked causal attention over the whole packed sequence, in float64.

    Args:
        q: (C, H, D); k, v: (C, Hkv, D) with ``H % Hkv == 0`` (query head h uses KV head
            ``h // (H // Hkv)``). Any float dtype; computed in float64.
        doc_lens: (n_docs,) int lengths summing to C.
        softmax_scale: default ``1 / sqrt(D)``
            (:func:`~flashcp.ops.backends.resolve_softmax_scale`).
    Returns:
        out: (C, H, D) float64, differentiable w.r.t. q, k, v.
    Raises:
        ValueError: shapes inconsistent with each other or with ``doc_lens``.
    """
    c, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != c or k.shape[2] != d or h % k.shape[1]:
        raise ValueError(f"bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if sum(int(x) for x in doc_lens) != c:
        raise ValueError(f"doc_lens sum to {sum(int(x) for x in doc_lens)}, expected {c}")
    scale = resolve_softmax_scale(softmax_scale, d)
    g = h // k.shape[1]
    qd = q.to(torch.float64).permute(1, 0, 2)  # (H, C, D)
    kd = k.to(torch.float64).repeat_interleave(g, dim=1).permute(1, 0, 2)  # (H, C, D)
    vd = v.to(torch.float64).repeat_interleave(g, dim=1).permute(1, 0, 2)
    s = torch.matmul(qd, kd.transpose(1, 2)) * scale  # (H, C, C)
    s = s.masked_fill(~document_mask(doc_lens, q.device), float("-inf"))
    p = torch.softmax(s, dim=-1)  # every token sees itself: no empty rows
    return torch.matmul(p, vd).permute(1, 0, 2)  # (C, H, D)
