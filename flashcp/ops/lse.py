"""Merging partial attention results by their log-sum-exp (LSE).

Blockwise attention (Ring Attention, Liu et al. 2023; FlashAttention's online softmax, Dao et al.
2022) computes, for one query row, partial results over disjoint sets of keys: ``out_i`` (the
softmax-weighted mean of the values of set i) and ``lse_i = log sum_j exp(s_j)`` over that set. The
result over the union is

    lse = log(exp(lse_1) + exp(lse_2)),   out = exp(lse_1 - lse) * out_1 + exp(lse_2 - lse) * out_2.

Rows that see no key in a set carry ``lse_i = -inf`` and ``out_i = 0`` (the backend convention in
:mod:`flashcp.ops.backends`); a row with ``-inf`` on both sides stays ``out = 0``, ``lse = -inf`` and
never becomes NaN (the naive formula would compute ``-inf - (-inf)``).

Accumulators are in :func:`flashcp.ops.backends.compute_dtype` of the model dtype (float32 for
bfloat16 / float16 / float32, float64 for float64; the dtype of the LSE the backends return), so the
accumulated output is rounded to the model dtype once, at the end.
"""

from __future__ import annotations

import torch

from flashcp.ops.backends import compute_dtype

__all__ = ["merge_lse_", "merge_lse_rows_", "new_accumulator"]


def new_accumulator(
    num_tokens: int, num_heads: int, head_dim: int, device=None, dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty merge accumulator: every row has seen no key yet.

    Args:
        dtype: the model dtype; the accumulator is in ``compute_dtype(dtype)``.
    Returns:
        out: (num_tokens, num_heads, head_dim) zeros;
        lse: (num_heads, num_tokens), all ``-inf``; both in ``compute_dtype(dtype)``.
    """
    acc = compute_dtype(dtype)
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=acc, device=device)
    lse = torch.full((num_heads, num_tokens), float("-inf"), dtype=acc, device=device)
    return out, lse


def _check(out, lse, block_out, block_lse) -> None:
    if out.dtype != lse.dtype or compute_dtype(out.dtype) != out.dtype:
        raise ValueError(
            f"accumulator out and lse must share one dtype of float32 or wider, got out "
            f"{out.dtype}, lse {lse.dtype}"
        )
    if out.dim() != 3 or lse.shape != (out.shape[1], out.shape[0]):
        raise ValueError(
            f"accumulator shapes must be out (T, H, D) and lse (H, T), got {tuple(out.shape)} and "
            f"{tuple(lse.shape)}"
        )
    if block_out.shape != out.shape or block_lse.shape != lse.shape:
        raise ValueError(
            f"block shapes out {tuple(block_out.shape)}, lse {tuple(block_lse.shape)} do not match "
            f"the accumulator's {tuple(out.shape)}, {tuple(lse.shape)}"
        )
    if block_lse.dtype != lse.dtype:
        raise ValueError(
            f"block lse must be {lse.dtype} like the accumulator, got {block_lse.dtype}"
        )


def merge_lse_(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Merge a partial result into the accumulator in place (formula in the module docstring).

    Args:
        out: (T, H, D) accumulator (float32 or float64), updated in place.
        lse: (H, T) accumulator in out's dtype, updated in place.
        block_out: (T, H, D), any float dtype (0 on rows that saw no key).
        block_lse: (H, T) in the accumulator's dtype (``-inf`` on rows that saw no key).
    Raises:
        ValueError: wrong dtypes or shapes.
    """
    _check(out, lse, block_out, block_lse)
    new = torch.logaddexp(lse, block_lse)  # -inf only where both are -inf
    safe = torch.where(torch.isneginf(new), 0.0, new)
    w_old = torch.exp(lse - safe).t().unsqueeze(-1)  # (T, H, 1); 0 where lse = -inf
    w_blk = torch.exp(block_lse - safe).t().unsqueeze(-1)
    out.mul_(w_old).add_(block_out.to(out.dtype) * w_blk)
    lse.copy_(new)


def merge_lse_rows_(
    out: torch.Tensor,
    lse: torch.Tensor,
    rows: torch.Tensor | slice,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
) -> None:
    """Merge a partial result that covers only some rows of the accumulator, in place.

    Args:
        out: (T, H, D) accumulator; lse: (H, T) accumulator in out's dtype (float32 or float64).
        rows: a ``slice`` of rows, or a (Tb,) int64 tensor of distinct row indices.
        block_out: (Tb, H, D); block_lse: (H, Tb) in the accumulator's dtype, for those rows.
    Raises:
        ValueError: wrong dtypes or shapes.
    """
    if isinstance(rows, slice):
        merge_lse_(out[rows], lse[:, rows], block_out, block_lse)
        return
    sub_out, sub_lse = out.index_select(0, rows), lse.index_select(1, rows)
    merge_lse_(sub_out, sub_lse, block_out, block_lse)
    out.index_copy_(0, rows, sub_out)
    lse.index_copy_(1, rows, sub_lse)
