"""Merging partial attention results by their log-sum-exp (LSE).

Blockwise attention (Ring Attention, Liu et al. 2023; FlashAttention's online softmax, Dao et al.
2022) computes, for one query row, partial results over disjoint sets of keys: ``out_i`` (the
softmax-weighted mean of the values of set i) and ``lse_i = log sum_j exp(s_j)`` over that set. The
result over the union is

    lse = log(exp(lse_1) + exp(lse_2)),   out = exp(lse_1 - lse) * out_1 + exp(lse_2 - lse) * out_2.

Rows that see no key in a set carry ``lse_i = -inf`` and ``out_i = 0`` (the backend convention in
:mod:`flashcp.ops.backends`); a row with ``-inf`` on both sides stays ``out = 0``, ``lse = -inf`` and
never becomes NaN (the naive formula would compute ``-inf - (-inf)``).

Everything here is in float32 whatever the model dtype, so the accumulated output is rounded to
the model dtype once, at the end.
"""

from __future__ import annotations

import torch

__all__ = ["merge_lse_", "merge_lse_rows_", "new_accumulator"]


def new_accumulator(
    num_tokens: int, num_heads: int, head_dim: int, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty merge accumulator: every row has seen no key yet.

    Returns:
        out: (num_tokens, num_heads, head_dim) float32 zeros;
        lse: (num_heads, num_tokens) float32, all ``-inf``.
    """
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=device)
    lse = torch.full((num_heads, num_tokens), float("-inf"), dtype=torch.float32, device=device)
    return out, lse


def _check(out, lse, block_out, block_lse) -> None:
    if out.dtype != torch.float32 or lse.dtype != torch.float32:
        raise ValueError(f"accumulator must be float32, got out {out.dtype}, lse {lse.dtype}")
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
    if block_lse.dtype != torch.float32:
        raise ValueError(f"block lse must be float32, got {block_lse.dtype}")


def merge_lse_(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Merge a partial result into the accumulator in place (formula in the module docstring).

    Args:
        out: (T, H, D) float32 accumulator, updated in place.
        lse: (H, T) float32 accumulator, updated in place.
        block_out: (T, H, D), any float dtype (0 on rows that saw no key).
        block_lse: (H, T) float32 (``-inf`` on rows that saw no key).
    Raises:
        ValueError: wrong dtypes or shapes.
    """
    _check(out, lse, block_out, block_lse)
    new = torch.logaddexp(lse, block_lse)  # -inf only where both are -inf
    safe = torch.where(torch.isneginf(new), 0.0, new)
    w_old = torch.exp(lse - safe).t().unsqueeze(-1)  # (T, H, 1); 0 where lse = -inf
    w_blk = torch.exp(block_lse - safe).t().unsqueeze(-1)
    out.mul_(w_old).add_(block_out.float() * w_blk)
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
        out: (T, H, D) float32 accumulator; lse: (H, T) float32 accumulator.
        rows: a ``slice`` of rows, or a (Tb,) int64 tensor of distinct row indices.
        block_out: (Tb, H, D); block_lse: (H, Tb) float32, for those rows in that order.
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
