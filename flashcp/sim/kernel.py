"""Tile-level model of a FlashAttention-2 varlen kernel on one GPU.

A varlen call runs a list of *segments* ``(q_len, kv_len)``. A causal segment is aligned
bottom-right (query row i sees key columns ``<= i + kv_len - q_len``; docs/design.md §2), a non-causal
one is a full rectangle. FlashAttention-2 (Dao 2023, §3; Dao-AILab/flash-attention ``csrc``):

* forward: one CTA per (segment, query block of ``fwd_block_q`` rows, head); it loops over the key
  blocks of ``fwd_block_k`` columns up to the causal diagonal;
* backward: one CTA per (segment, key block of ``bwd_block_k`` columns, head); it loops over the
  query blocks of ``bwd_block_q`` rows from the diagonal down; plus ``bwd_extra_kernels``
  memory-bound kernels (dot(dO, O), dQ conversion) and, for GQA, the sum of dK/dV over the query
  heads of each KV head (FlashAttention-2 computes dK/dV per query head, then reduces).

Cost of one CTA, in SM-µs: ``cta_overhead_us + tiles * tile_us`` where a tile is a full
``block_q x block_k`` block (a partial tile of a short segment costs as much as a full one, and
tiles above the diagonal are skipped), ``tile_us = tile_flops / (tile_tflops / num_sms)``,
``tile_flops = 4 * d * block_q * block_k`` forward and 2.5x that backward (five matmuls instead of
two; the convention of the FlashAttention papers). A call over all CTAs of all heads takes

    launch_us + max(sum(CTA costs) / num_sms, max CTA cost)

(the work spread over the SMs, or the longest CTA when it dominates). The kernel is compute-bound:
reading Q, K, V is inside the fitted per-CTA and per-tile costs.

Tile counts of a segment are exact closed forms (checked against brute force in the tests); they
depend only on the lengths, so a plan's counts are computed once and reused for every head count
and head_dim.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from flashcp.comm import AttnShape
from flashcp.sim.hardware import HardwareProfile, load_hardware

__all__ = [
    "TileStats",
    "attention_kernel_ms",
    "bwd_extra_us",
    "bwd_tile_counts",
    "fwd_tile_counts",
    "kernel_us",
    "tile_us",
]

#: backward FLOPs per forward FLOP (FlashAttention papers: five matmuls vs two).
BWD_FLOP_RATIO = 2.5


def _cdiv(a: np.ndarray, b: int) -> np.ndarray:
    """ceil(a / b) of float64 integers (exact: a correctly rounded quotient of integers below 2**52
    is an integer only when the division is exact)."""
    return np.ceil(a / b)


def fwd_tile_counts(
    q_len: np.ndarray, kv_len: np.ndarray, causal: np.ndarray, block_q: int, block_k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Forward CTAs and tiles of each segment (per head).

    Args:
        q_len, kv_len: (n,) int64, segment lengths; ``kv_len >= q_len`` where causal.
        causal: (n,) bool, bottom-right causal (else a full rectangle).
        block_q, block_k: tile shape; ``block_q`` a multiple of ``block_k``.
    Returns:
        ``(ctas, tiles, max_tiles)``: (n,) float64 each (integer values): query blocks ``ceil(q / block_q)``, tiles
        over all of them, and tiles of the segment's largest CTA.

    Causal: query block i (rows ``[i*Bq, (i+1)*Bq)``) needs key blocks up to column
    ``a + (i+1)*Bq - 1`` with ``a = kv - q``, i.e. ``ceil(a/Bk) + rho*(i+1)`` blocks for every block
    but the last (rho = Bq/Bk) and ``ceil(kv/Bk)`` for the last, so
    ``tiles = (m-1)*ceil(a/Bk) + rho*m*(m-1)/2 + ceil(kv/Bk)`` with ``m = ceil(q/Bq)``.
    """
    q = np.asarray(q_len, dtype=np.float64)
    k = np.asarray(kv_len, dtype=np.float64)
    rho = block_q // block_k
    m = _cdiv(q, block_q)
    nk = _cdiv(k, block_k)
    a_blocks = _cdiv(k - q, block_k)
    m1 = np.maximum(m - 1, 0)
    causal_tiles = m1 * a_blocks + (rho * 0.5) * m * m1 + nk
    tiles = np.where(causal, causal_tiles, m * nk)
    return m, np.where(m > 0, tiles, 0), np.where(m > 0, nk, 0)


def bwd_tile_counts(
    q_len: np.ndarray, kv_len: np.ndarray, causal: np.ndarray, block_q: int, block_k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Backward CTAs and tiles of each segment (per head).

    Args:
        q_len, kv_len, causal: as in :func:`fwd_tile_counts`.
        block_q, block_k: backward tile shape; ``block_k`` a multiple of ``block_q``.
    Returns:
        ``(ctas, tiles, max_tiles)``: (n,) float64 each (integer values): key blocks ``ceil(kv / block_k)``, tiles over all of them,
        and the largest CTA's tiles (``ceil(q / block_q)``, key block 0).

    Causal: key block j (columns from ``j*Bk``) is seen from query row ``max(0, j*Bk - a)`` on, so
    it loops over ``mq - floor(max(0, j*Bk - a) / Bq)`` query blocks (``mq = ceil(q/Bq)``); with
    ``J0 = floor(a/Bk)`` and rho = Bk/Bq the sum is
    ``nk*mq - rho*(sum of j for J0 < j < nk) + (nk - 1 - J0)*ceil(a/Bq)``.
    """
    q = np.asarray(q_len, dtype=np.float64)
    k = np.asarray(kv_len, dtype=np.float64)
    rho = block_k // block_q
    nk = np.where(q > 0, _cdiv(k, block_k), 0)
    mq = _cdiv(q, block_q)
    a = k - q
    j0 = np.minimum(np.floor(a / block_k), np.maximum(nk - 1, 0))
    sum_j = 0.5 * ((nk - 1) * nk - j0 * (j0 + 1))
    causal_tiles = nk * mq - rho * sum_j + (nk - 1 - j0) * _cdiv(a, block_q)
    tiles = np.where(causal, causal_tiles, nk * mq)
    return nk, np.where(nk > 0, tiles, 0), np.where(nk > 0, mq, 0)


class TileStats(NamedTuple):
    """Per-head tile statistics of one or many kernel calls (arrays of any common shape).

    ``ctas``: CTAs per head; ``tiles``: tiles per head; ``max_tiles``: tiles of the largest CTA.
    """

    ctas: Any
    tiles: Any
    max_tiles: Any


def tile_us(hw: HardwareProfile, head_dim: int, backward: bool) -> float:
    """SM-µs of one full tile: ``tile_flops / (tile_tflops * 1e12 / num_sms) * 1e6``."""
    if backward:
        flops = BWD_FLOP_RATIO * 4 * head_dim * hw.bwd_block_q * hw.bwd_block_k
        rate = hw.bwd_tile_tflops
    else:
        flops = 4 * head_dim * hw.fwd_block_q * hw.fwd_block_k
        rate = hw.fwd_tile_tflops
    return flops * hw.num_sms / (rate * 1e6)


def kernel_us(stats: TileStats, num_heads: int, head_dim: int, hw: HardwareProfile, backward: bool):
    """Time of the main attention kernel of each call, µs (0 where a call has no CTA).

    ``launch_us + max(heads * (ctas * cta_us + tiles * tile_us) / num_sms,
    cta_us + max_tiles * tile_us)``; elementwise over the arrays of ``stats``.
    """
    t = tile_us(hw, head_dim, backward)
    c = hw.bwd_cta_overhead_us if backward else hw.fwd_cta_overhead_us
    spread = num_heads * (stats.ctas * c + stats.tiles * t) / hw.num_sms
    longest = c + stats.max_tiles * t
    return np.where(stats.ctas > 0, hw.launch_us + np.maximum(spread, longest), 0.0)


def bwd_extra_us(q_rows, kv_rows, shape: AttnShape, hw: HardwareProfile):
    """Memory-bound kernels of a FlashAttention-2 backward call, µs (0 where ``q_rows`` is 0).

    Bytes (read + write), with E = ``dtype_bytes``: dot(dO, O) reads dO and O (2E per element of
    Q's shape), writes D (4 bytes per row and head) and clears the fp32 dQ accumulator (4); the
    conversion reads it (4) and writes dQ (E). With GQA, the per-query-head dK/dV (E each) are
    read and summed into the KV heads (written, E each). Plus ``bwd_extra_kernels`` launches (and
    one more for the GQA sum).

    Args:
        q_rows, kv_rows: query and key tokens of the call (scalars or arrays).
    """
    e = shape.dtype_bytes
    h, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    nbytes = q_rows * h * (d * (3 * e + 8) + 4)
    launches = hw.bwd_extra_kernels
    if h != hkv:
        nbytes = nbytes + kv_rows * 2 * d * e * (h + hkv)
        launches += 1
    return np.where(np.asarray(q_rows) > 0, launches * hw.launch_us + hw.copy_us(nbytes), 0.0)


def _int_lengths(lens: Any, name: str) -> np.ndarray:
    """``lens`` as an int64 array of at least one dimension; ValueError naming ``name`` when a
    value is not an integer (integral floats are taken)."""
    a = np.atleast_1d(np.asarray(lens))
    if a.dtype.kind == "f":
        bad = ~np.isfinite(a) | (a != np.round(a))
        if bad.any():
            raise ValueError(f"{name} must be integers, got {a[bad][0]!r}")
    elif a.dtype.kind not in "iu" and a.size:
        raise ValueError(f"{name} must be integers, got dtype {a.dtype} (e.g. {a.flat[0]!r})")
    return a.astype(np.int64)


def attention_kernel_ms(
    q_lens, kv_lens, causal, shape: AttnShape, hw: HardwareProfile, backward: bool
) -> float:
    """Time of one FlashAttention-2 varlen call over the given segments, ms.

    Args:
        q_lens, kv_lens: (n,) int, query and key length of each segment (>= 0; a segment with no
            query is skipped).
        causal: bool or (n,) bool; causal segments are aligned bottom-right and need
            ``kv_len >= q_len``.
        shape: heads, head_dim and dtype (GQA: compute is per query head).
        hw: hardware profile (or a profile name / dict for :func:`load_hardware`).
        backward: the backward call (main kernel + pre/post kernels) instead of the forward;
            a training step costs the sum of both.
    Returns:
        Milliseconds (0.0 for no segment).
    Raises:
        ValueError: lengths that are not integers (a float with a fraction, a string), of
            different shapes or negative, a causal segment with ``kv_len < q_len``, or an unknown
            hardware profile.
    """
    q, k = _int_lengths(q_lens, "q_lens"), _int_lengths(kv_lens, "kv_lens")
    hw = load_hardware(hw)
    if q.shape != k.shape or q.ndim != 1:
        raise ValueError(
            f"q_lens and kv_lens must be 1-D of equal length, got {q.shape} and {k.shape}"
        )
    c = np.broadcast_to(np.asarray(causal, dtype=bool), q.shape)
    if (q < 0).any() or (k < 0).any():
        raise ValueError("segment lengths must be >= 0")
    if (c & (k < q)).any():
        i = int(np.argmax(c & (k < q)))
        raise ValueError(
            f"causal segment {i} has kv_len {int(k[i])} < q_len {int(q[i])} (bottom-right alignment "
            "needs kv_len >= q_len)"
        )
    keep = q > 0
    q, k, c = q[keep], k[keep], c[keep]
    if q.size == 0:
        return 0.0
    if backward:
        ctas, tiles, mx = bwd_tile_counts(q, k, c, hw.bwd_block_q, hw.bwd_block_k)
    else:
        ctas, tiles, mx = fwd_tile_counts(q, k, c, hw.fwd_block_q, hw.fwd_block_k)
    stats = TileStats(ctas.sum(), tiles.sum(), mx.max())
    us = float(kernel_us(stats, shape.num_heads, shape.head_dim, hw, backward))
    if backward:
        us += float(bwd_extra_us(int(q.sum()), int(k.sum()), shape, hw))
    return us / 1e3
