"""Moving packed tensors between the single-device layout and a plan's per-rank layout.

A rank's local tensor holds its shards' tokens one after another, in the order the plan lists
them (:meth:`flashcp.plan.Plan.rank_shards`), then its ``plan.pad[rank]`` pad tokens. The packed
tensor holds the documents' tokens, then the ``plan.num_pad`` pad tokens; rank r's pad rows are
pad positions ``sum(pad[:r]) ..`` of them. Zero-length documents occupy no row. These helpers are
pure index arithmetic on the plan.
"""

from __future__ import annotations

import numpy as np
import torch

from flashcp.plan import Plan, cu_seqlens

__all__ = ["global_rows", "position_ids", "shard_tensor", "unshard"]


def _check_rank(plan: Plan, rank: int) -> None:
    if not 0 <= int(rank) < plan.cp_size:
        raise ValueError(f"rank {rank} out of range for a plan with cp_size = {plan.cp_size}")


def global_rows(plan: Plan, rank: int) -> np.ndarray:
    """Packed-sequence positions of rank ``rank``'s local tokens.

    Returns:
        (C / N,) int64: local row i holds token ``global_rows[i]`` of the packed sequence (pad
        rows last, at positions >= the number of document tokens).
    Raises:
        ValueError: rank out of range.
    """
    _check_rank(plan, rank)
    doc, start, length = plan.rank_shards(rank)
    cu = cu_seqlens(plan.doc_lens)
    doc_off = cu[:-1]
    first = doc_off[doc] + start  # (n_shards,) packed position of each shard's first token
    seg_off = cu_seqlens(length)[:-1]
    within = np.arange(int(length.sum()), dtype=np.int64) - np.repeat(seg_off, length)
    pad0 = int(cu[-1]) + int(plan.pad[:rank].sum())
    pad_rows = np.arange(pad0, pad0 + int(plan.pad[rank]), dtype=np.int64)
    return np.concatenate([np.repeat(first, length) + within, pad_rows])


def position_ids(plan: Plan, rank: int) -> torch.Tensor:
    """Position of each local token inside its document (for RoPE); 0 for pad tokens.

    Returns:
        (C / N,) int64 tensor.
    """
    _check_rank(plan, rank)
    _, start, length = plan.rank_shards(rank)
    seg_off = cu_seqlens(length)[:-1]
    within = np.arange(int(length.sum()), dtype=np.int64) - np.repeat(seg_off, length)
    pad = np.zeros(int(plan.pad[rank]), dtype=np.int64)
    return torch.from_numpy(np.concatenate([np.repeat(start, length) + within, pad]))


def shard_tensor(x: torch.Tensor, plan: Plan, rank: int) -> torch.Tensor:
    """Rank ``rank``'s local rows of a packed tensor.

    Args:
        x: (C, ...) in packed order: document tokens, then ``plan.num_pad`` pad rows.
    Returns:
        (C / N, ...) the rank's tokens in its local (shard) order.
    Raises:
        ValueError: ``x.shape[0] != C`` or rank out of range.
    """
    if x.shape[0] != plan.context_len:
        raise ValueError(
            f"x has {x.shape[0]} rows but the plan covers context_len = {plan.context_len}"
        )
    rows = torch.from_numpy(global_rows(plan, rank)).to(x.device)
    return x.index_select(0, rows)


def unshard(locals_: list[torch.Tensor], plan: Plan) -> torch.Tensor:
    """Inverse of :func:`shard_tensor`: put every rank's local tensor back in packed order.

    Args:
        locals_: ``cp_size`` tensors, each (C / N, ...) with equal trailing shapes.
    Returns:
        (C, ...) packed tensor.
    Raises:
        ValueError: wrong number of tensors or rows.
    """
    if len(locals_) != plan.cp_size:
        raise ValueError(f"expected {plan.cp_size} local tensors, got {len(locals_)}")
    per = plan.context_len // plan.cp_size
    first = locals_[0]
    out = first.new_empty((plan.context_len, *first.shape[1:]))
    for r, t in enumerate(locals_):
        if t.shape[0] != per:
            raise ValueError(f"rank {r}'s tensor has {t.shape[0]} rows, expected {per}")
        out[torch.from_numpy(global_rows(plan, r)).to(out.device)] = t
    return out
