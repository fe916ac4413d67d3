"""The ring family of the step model (``p2p_ring``: ``ring``, ``zigzag``): the per-plan step
(:class:`RingCost`) and S plans stacked on a leading axis (:class:`_PlanCostStack`,
:func:`_step_ring_batch`); docs/simulator.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from flashcp import compiled
from flashcp.comm import AttnShape, comm_volume, ring_grad_hops
from flashcp.plan import Plan, cu_seqlens
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS
from flashcp.sim.cost.units import _op_us, _stats, overlap_us
from flashcp.sim.kernel import (
    TileStats,
    bwd_extra_us,
    bwd_tile_counts,
    fwd_tile_counts,
    kernel_us,
    tile_us,
)
from flashcp.sim.network import p2p_us


class RingCost:
    """The ring family's per-plan step (``p2p_ring``: ``ring``, ``zigzag``), a part of
    :class:`~flashcp.sim.cost.base.PlanCost`; its methods work on any leading axes (the batch
    stacks S plans, :class:`_PlanCostStack`)."""

    # ---- ring family -------------------------------------------------------------------------
    def _init_ring(self) -> None:
        plan, hw, n = self.plan, self.hw, self.n
        rank, doc, start, length = plan.rank, plan.doc, plan.start, plan.length
        n_docs = plan.num_docs
        # step 0: one causal segment per (rank, document) over the rank's own tokens
        own = np.bincount(rank * n_docs + doc, weights=length, minlength=n * n_docs)
        key0 = np.flatnonzero(own)
        q0 = own[key0]
        r0 = key0 // n_docs  # sorted
        causal = np.ones(q0.size, dtype=bool)
        f0 = _stats(r0, n, *fwd_tile_counts(q0, q0, causal, hw.fwd_block_q, hw.fwd_block_k))
        b0 = _stats(r0, n, *bwd_tile_counts(q0, q0, causal, hw.bwd_block_q, hw.bwd_block_k))
        fwd = [np.zeros((n, n)) for _ in range(3)]
        bwd = [np.zeros((n, n)) for _ in range(3)]
        for dense, row in ((fwd, f0), (bwd, b0)):
            for k in range(3):
                dense[k][0] = row[k]
        self.q_rows = np.zeros((n, n))
        self.kv_rows = np.zeros((n, n))
        self.q_rows[0] = self.kv_rows[0] = np.bincount(rank, weights=length, minlength=n)
        if n > 1:
            # first and last piece start of every document on every rank: (n_docs, N)
            dr = doc * n + rank
            min_start = np.full(n_docs * n, np.iinfo(np.int64).max)
            max_start = np.full(n_docs * n, -1, dtype=np.int64)
            np.minimum.at(min_start, dr, start)
            np.maximum.at(max_start, dr, start)
            t = np.arange(1, n)[None, :]  # (1, N-1)
            # local piece i sees something of source rank (r - t) iff that rank holds an earlier
            # piece of its document; source piece j is seen on rank (r + t) iff a later one is there
            src = rank[:, None] - t  # (n_shards, N-1), mod N
            src += n * (src < 0)
            dst = rank[:, None] + t
            dst -= n * (dst >= n)
            q_vis = min_start[doc[:, None] * n + src] < start[:, None]
            k_vis = max_start[doc[:, None] * n + dst] > start[:, None]
            size = n * n * n_docs
            q_key = ((t * n + rank[:, None]) * n_docs + doc[:, None]).ravel()
            k_key = ((t * n + dst) * n_docs + doc[:, None]).ravel()
            # (N, N, n_docs) rectangle [t, r, doc]: query rows x key rows (both 0 or both > 0)
            qs = np.bincount(q_key, weights=(length[:, None] * q_vis).ravel(), minlength=size)
            ks = np.bincount(k_key, weights=(length[:, None] * k_vis).ravel(), minlength=size)
            qs = qs.reshape(n, n, n_docs)[1:]
            ks = ks.reshape(n, n, n_docs)[1:]
            # full rectangles: forward CTAs ceil(q/Bq) x ceil(k/Bk) tiles, backward transposed
            fq, fk = np.ceil(qs / hw.fwd_block_q), np.ceil(ks / hw.fwd_block_k)
            bq, bk = np.ceil(qs / hw.bwd_block_q), np.ceil(ks / hw.bwd_block_k)
            # initial=0: a plan of pad alone has no documents (an empty last axis)
            fwd[0][1:], fwd[1][1:], fwd[2][1:] = fq.sum(2), (fq * fk).sum(2), fk.max(2, initial=0)
            bwd[0][1:], bwd[1][1:], bwd[2][1:] = bk.sum(2), (bq * bk).sum(2), bq.max(2, initial=0)
            self.q_rows[1:] = qs.sum(2)
            self.kv_rows[1:] = ks.sum(2)
            same = np.zeros(rank.size, dtype=bool)
            same[1:] = rank[1:] == rank[:-1]
            self.q_gather, self.k_gather = _gather_masks(
                same, q_vis, k_vis, t * n + rank[:, None], t * n + dst, n * n, (n, n)
            )
        else:
            self.q_gather = self.k_gather = np.zeros((n, n), dtype=bool)
        self.fwd = TileStats(*fwd)
        self.bwd = TileStats(*bwd)
        # block-level causal skip: launch unless the source block starts after the local one ends
        cu = cu_seqlens(plan.doc_lens)
        pos = cu[doc] + start
        lo = np.full(n, np.iinfo(np.int64).max)
        hi = np.zeros(n, dtype=np.int64)
        np.minimum.at(lo, rank, pos)
        np.maximum.at(hi, rank, pos + length)
        r = np.arange(n)
        src = (r[None, :] - r[:, None]) % n  # [t, r] -> source rank
        self.launched = lo[src] < hi[None, :]
        self.launched[0] = True
        self.local_tokens = plan.context_len // n

    def _ring_masks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(N, N) masks ``[t, r]``: a kernel is launched; the step uses part of the local query
        block; the step uses part of the source KV block (computed once per plan; read-only)."""
        if self._masks is None:
            self._masks = self._compute_ring_masks()
        return self._masks

    def ring_masks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Read-only view of the ring family's (N, N) ``[t, r]`` masks: a kernel is launched, the
        step uses part of the local query block, the step uses part of the source KV block."""
        return self._ring_masks()

    def ring_terms(self, shape: AttnShape, phase: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Read-only: the ring family's (N, N) ``[t, r]`` device µs of attention, device µs of the
        other ops and host µs of ``phase`` (``fwd`` / ``bwd``), as the step model prices them
        (:mod:`flashcp.sim.work` reads its work back out of these)."""
        if phase not in ("fwd", "bwd"):
            raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")
        if phase == "fwd":
            return self._ring_fwd_compute(shape)
        return self._ring_bwd_compute(shape)

    def _compute_ring_masks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = self.n
        local = self.q_rows[..., 0, :]
        r = np.arange(n)
        src_rows = local[..., (r[None, :] - np.arange(n)[:, None]) % n]
        work = self.q_rows > 0
        part_k = work & (self.kv_rows < src_rows)
        part_k[..., 0, :] = False
        if self.impl == "ours":
            # no call without a visible pair (step 0 of a rank holding only pad included); the
            # op's q, k, v and lse have the block's b rows (the most document rows any rank
            # holds), so a step's query rows are part of them when fewer than b, step 0 too
            launched = work.copy()
            block = local.max(axis=-1)[..., None, None]
            part_q = work & (self.q_rows < block)
            return launched, part_q, part_k
        if self.ops.skip_after_rank:
            launched = np.broadcast_to(np.arange(n)[:, None] <= r[None, :], work.shape).copy()
        else:
            launched = np.ones(work.shape, dtype=bool)
        launched[..., 0, :] = True
        part_q = work & (self.q_rows < local[..., None, :])
        part_q[..., 0, :] = False
        return launched, part_q, part_k

    def _op_us(self, count, nbytes):
        """Device µs of ``count`` memory-bound launches moving ``nbytes`` (read + write)."""
        return _op_us(self.hw, count, nbytes)

    def _half_views(self) -> np.ndarray:
        """Bool, broadcastable to ``[..., t, r]``: the halves of a block are views, not index
        gathers (``ImplOps.one_doc_views`` and a plan of one document)."""
        if not self.ops.one_doc_views:
            return np.zeros((1, 1), dtype=bool)
        return (np.asarray(self.num_docs) == 1)[..., None, None]

    def _local_rows(self) -> np.ndarray:
        """Rows of a rank's own tensors (merge accumulators, send buffers, gradients),
        broadcastable to ``[..., r]``: the project's op holds the block's b rows on every rank
        (the most document rows any rank holds); ring-flash-attn the rank's own rows."""
        own = self.q_rows[..., 0, :]
        if self.impl != "ours":
            return own
        return np.broadcast_to(own.max(axis=-1)[..., None], own.shape)

    def _pad_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The project's op with pad (:func:`flashcp.ops.ring_attn.ring_attention`): the ring
        runs on blocks of the most document rows any rank holds, b, not on all T = C / N rows.
        Returns ``(cut, rows)`` broadcastable to ``[..., r]``: 1 where b < T (else 0) and
        b + T, the rows a pad of the output or of a gradient back to T rows reads and writes."""
        block = self.q_rows[..., 0, :].max(axis=-1)
        local = np.asarray(self.local_tokens, dtype=np.float64)
        cut = (block < local) & (self.impl == "ours") & self.cuts_pad
        return cut.astype(np.int64)[..., None], (block + local)[..., None]

    def _ring_fwd_compute(self, shape: AttnShape) -> tuple[np.ndarray, ...]:
        """Forward of the ring: (N, N) ``[t, r]`` device µs of attention, device µs of the other
        ops (merges, gathers, casts), host µs (ops, kernel calls, per-step and per-document work),
        and µs the device idles after stream syncs (``ImplOps.mask_syncs``; 0.0 without)."""
        hw, ops = self.hw, self.ops
        h, hkv, d, e = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.dtype_bytes
        launched, part_q, part_k = self._ring_masks()
        empty = np.where(launched & (self.fwd.ctas == 0), hw.launch_us, 0.0)
        attn = kernel_us(self.fwd, h, d, hw, False) + empty
        work = self.q_rows > 0
        out_el = self.q_rows * h * d  # elements of the merged rows' output
        rows0 = self._local_rows()
        local_el = rows0 * h * d
        merge_b = getattr(hw, ops.merge_bytes)
        views = self._half_views()
        # the rows a step gathers: ring-flash-attn picks part of a block by index; the project's
        # op slices a contiguous run of rows (a view, merged in place) and gathers only the
        # others (``q_gather`` / ``k_gather``)
        ours = self.impl == "ours"
        gather_q = self.q_gather if ours else part_q
        gather_k = (self.k_gather if ours else part_k) & ~views
        # a merge into half of out: gather out and lse, merge, scatter both back (4 ops, 16 bytes
        # per fp32 element); on a view only the result is copied back (2 ops, 8 bytes)
        n_ops = (
            np.where(work, ops.merge_ops, 0)
            + np.where(gather_q, np.where(views, 2, 4), 0)
            + np.where(gather_k, ops.half_gather_ops, 0)
        )
        nbytes = np.where(work, out_el * merge_b, 0.0) + np.where(
            gather_q, np.where(views, 8.0, 16.0) * out_el, 0.0
        )
        nbytes = nbytes + np.where(gather_k, 2.0 * self.kv_rows * hkv * d * 2 * e, 0.0)
        if ours:  # the query rows of a step that gathers them (index_select)
            n_ops = n_ops + gather_q
            nbytes = nbytes + np.where(gather_q, out_el * 2 * e, 0.0)
            # step 0: the fp32 merge accumulators (out zeroed, lse filled) and the KV block
            # stacked into the first send buffer (k, v read and written)
            n_ops[..., 0, :] += 3
            nbytes[..., 0, :] += local_el * 4 + rows0 * (h * 4 + 4 * hkv * d * e)
        else:  # ring-flash-attn: step 0 only casts its block to fp32 (out = block_out.to(fp32))
            n_ops[..., 0, :] = 1
            nbytes[..., 0, :] = out_el[..., 0, :] * (e + 4)
        n_ops[..., -1, :] += 1  # out.to(q.dtype)
        nbytes[..., -1, :] += local_el * (4 + e)
        cut, rows = self._pad_rows()  # with pad: the output padded back to T rows
        n_ops[..., -1, :] += cut
        nbytes[..., -1, :] += cut * rows * h * d * e
        other = np.where(n_ops > 0, self._op_us(n_ops, nbytes), 0.0)
        host = hw.ring_step_fwd_us + hw.host_op_us * (launched + n_ops)
        idle = 0.0
        if ops.per_doc_host:  # get_half_index twice, q[half_index1] once per call
            docs = np.asarray(self.num_docs)[..., None]
            host[..., 0, :] += 2 * docs * hw.doc_host_us + hw.host_op_us
            other[..., 0, :] += np.where(views[..., 0, :], 0.0, self._op_us(1, local_el * e))
        if ops.mask_syncs:  # k0, v0 gathers; out/lse gathered and scattered back; q[half_index1]
            syncs = np.where(gather_k, ops.half_gather_ops, 0) + np.where(part_q & ~views, 4, 0)
            syncs = syncs + np.zeros(other.shape)
            syncs[..., 0, :] += np.where(views[..., 0, :], 0, 1) if ops.per_doc_host else 0
            idle = syncs * hw.host_op_us
        return attn, other, host, idle

    def _ring_bwd_compute(self, shape: AttnShape) -> tuple[np.ndarray, ...]:
        """Backward of the ring, as :meth:`_ring_fwd_compute` (attention backward kernels,
        accumulations, gathers, casts)."""
        hw, ops = self.hw, self.ops
        h, hkv, d, e = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.dtype_bytes
        launched, part_q, part_k = self._ring_masks()
        empty = np.where(launched & (self.bwd.ctas == 0), hw.launch_us, 0.0)
        attn = (
            kernel_us(self.bwd, h, d, hw, True)
            + np.where(self.q_rows > 0, bwd_extra_us(self.q_rows, self.kv_rows, shape, hw), 0.0)
            + empty
        )
        work = self.q_rows > 0
        q_el = self.q_rows * h * d
        kv_el = 2.0 * self.kv_rows * hkv * d
        rows0 = self._local_rows()
        local_q = rows0 * h * d
        local_kv = 2.0 * rows0 * hkv * d
        views = self._half_views()
        ours = self.impl == "ours"
        if ours:  # index gathers only where the rows are not one contiguous run (forward)
            gather_q, gather_k = self.q_gather, self.k_gather
        else:
            gather_q, gather_k = part_q & ~views, part_k & ~views
        n_ops = np.where(work, ops.accum_ops, 0) + np.where(gather_k, ops.half_gather_ops, 0)
        nbytes = np.where(work, (q_el + kv_el) * hw.accum_bytes_eager, 0.0)
        nbytes = nbytes + np.where(gather_k, kv_el * 2 * e, 0.0)
        if ops.indexed_accum_ops:  # dq[half] += ..., dk[half] += ...: gather + scatter (fp32)
            n_ops = n_ops + ops.indexed_accum_ops * (gather_q + 2 * gather_k)
            nbytes = (
                nbytes
                + np.where(gather_q, 16.0 * q_el, 0.0)
                + np.where(gather_k, 16.0 * kv_el, 0.0)
            )
        if ours:
            # the kernel's row inputs: a gathered step index-selects dout, q, out and the lse
            # (4 ops); a contiguous part of the block is a view but for the lse, whose rows are
            # its second axis (one contiguous copy). Per step with work: zero this step's dK/dV
            # (fp32), from step 2 on add the incoming partial sum (step 0 keeps its own, step 1
            # has none); a step 1 without work sends zeros; partial sums travel in the compute
            # dtype (no cast). Step 0: dq zeroed (fp32) and the KV block stacked into the first
            # send buffer.
            lse_b = self.q_rows * h * 4 * 2.0
            sliced_q = part_q & ~gather_q
            step = np.arange(work.shape[-2])[:, None]
            combine = work & (step >= 2)
            idle_zero = ~work & (step == 1)
            n_ops = n_ops + 4 * gather_q + sliced_q + work + combine + idle_zero
            nbytes = nbytes + np.where(gather_q, 3.0 * q_el * 2 * e + lse_b, 0.0)
            nbytes = nbytes + np.where(sliced_q, lse_b, 0.0)
            nbytes = nbytes + local_kv[..., None, :] * (
                np.where(work, 4.0, 0.0)
                + np.where(combine, 12.0, 0.0)
                + np.where(idle_zero, 4.0, 0.0)
            )
            n_ops[..., 0, :] += 2
            nbytes[..., 0, :] += local_q * 4 + local_kv * 2 * e
            # a rank without work at step 0 (only pad) zeroes its own block's dK/dV at the end
            idle0 = ~work[..., 0, :]
            n_ops[..., -1, :] += idle0
            nbytes[..., -1, :] += np.where(idle0, local_kv * 4, 0.0)
        else:  # step 0 casts the block gradients to fp32
            n_ops[..., 0, :] = 3
            nbytes[..., 0, :] = (q_el[..., 0, :] + kv_el[..., 0, :]) * (e + 4)
        n_ops[..., -1, :] += 3  # final casts of dq, dk, dv
        nbytes[..., -1, :] += (local_q + local_kv) * (4 + e)
        cut, rows = self._pad_rows()  # with pad: dq, dk, dv padded back to T rows
        n_ops[..., -1, :] += 3 * cut
        nbytes[..., -1, :] += cut * rows * (h + 2 * hkv) * d * e
        other = np.where(n_ops > 0, self._op_us(n_ops, nbytes), 0.0)
        host = hw.ring_step_bwd_us + hw.host_op_us * (launched + n_ops)
        idle = 0.0
        if ops.per_doc_host:  # get_half_lse: a Python loop over documents; dout/q/out halves
            docs = np.asarray(self.num_docs)[..., None]
            host[..., 0, :] += docs * hw.doc_host_us + 3 * hw.host_op_us
            other[..., 0, :] += docs * hw.launch_us + np.where(
                views[..., 0, :], 0.0, self._op_us(3, 1.5 * local_q * 2 * e)
            )
        if ops.mask_syncs:  # k0, v0 gathers; dk/dv[half] and dq[half] gathered and scattered
            per_k = ops.half_gather_ops + 2 * ops.indexed_accum_ops
            syncs = np.where(gather_k, per_k, 0) + np.where(gather_q, ops.indexed_accum_ops, 0)
            syncs = syncs + np.zeros(other.shape)
            syncs[..., 0, :] += np.where(views[..., 0, :], 0, 3) if ops.per_doc_host else 0
            idle = syncs * hw.host_op_us
        return attn, other, host, idle

    def _ring_pass(self, attn, other, host, idle, hop_us, tail_us):
        """Compose one ring pass from (..., N, N) ``[t, r]`` device and host µs (module
        docstring): step t overlaps ``hop_us[..., t]`` µs of exchanges (:func:`ring_pass_hops`;
        0 on the last step); ``tail_us`` is exposed at the end (scalars, or (S,) arrays for S
        plans); ``idle`` (µs the device waits for the host after a stream sync) adds to the
        step's device time and is charged to others.

        Returns ``(attention, others, exposed_p2p)`` in µs summing to the pass time, shaped
        ``attn.shape[:-2]``.
        """
        compute = attn + other
        hop = np.broadcast_to(np.asarray(hop_us, dtype=np.float64), attn.shape[:-1])
        device, slowed = overlap_us(compute, hop[..., None], self.hw)
        scale = np.divide(slowed, compute, out=np.ones_like(compute), where=compute > 0)
        attn_t = (attn * scale).max(axis=-1)
        comp_t = slowed.max(axis=-1)
        gpu_t = device.max(axis=-1)
        total_t = np.maximum(device + idle, host).max(axis=-1)
        p2p = (gpu_t - comp_t).sum(axis=-1) + tail_us
        a = attn_t.sum(axis=-1)
        return a, total_t.sum(axis=-1) + tail_us - a - p2p, p2p

    def _step_ring(
        self, shape: AttnShape, train: bool, vol: dict[str, int], fwd_p2p: int
    ) -> dict[str, float]:
        hw, n = self.hw, self.n
        steps = max(n - 1, 1)
        fwd_hop = p2p_us(hw, self.links, fwd_p2p / steps) if n > 1 else 0.0
        fwd = self._fwd_memo.get(shape)
        if fwd is None:  # training and inference of one shape share the forward
            fwd = self._fwd_memo[shape] = self._ring_fwd_compute(shape)
        fa, fo, fp = self._ring_pass(*fwd, *ring_pass_hops(n, self.impl, False, fwd_hop))
        ba = bo = bp = 0.0
        if train and n > 1:  # N - 1 grad hops (ours) or N (ring-flash-attn): comm.ring_grad_hops
            grad_hop = p2p_us(
                hw, self.links, (vol["p2p_bytes"] - 2 * fwd_p2p) / ring_grad_hops(n, self.impl)
            )
            hops = ring_pass_hops(n, self.impl, True, fwd_hop, grad_hop)
            ba, bo, bp = self._ring_pass(*self._ring_bwd_compute(shape), *hops)
        elif train:
            ba, bo, bp = self._ring_pass(*self._ring_bwd_compute(shape), 0.0, 0.0)
        return {
            "allgather_ms": 0.0,
            "attn_fwd_ms": float(fa) / 1e3,
            "attn_bwd_ms": float(ba) / 1e3,
            "reducescatter_ms": 0.0,
            "p2p_ms": (float(fp) + float(bp)) / 1e3,
            "alltoall_ms": 0.0,
            "others_ms": (float(fo) + float(bo)) / 1e3,
        }


#: the largest cp_size the compiled ring statistics take (runs of shards as int64 bit masks
#: over the ranks: 64 bits, bit 63 the sign bit, which ``|``, ``&``, ``~`` and ``(m >> c) & 1``
#: treat as any other; tested against the NumPy reference at CP 64); larger ones run the NumPy
#: reference
RING_KERNEL_MAX_N = 64


def ring_exchange_steps(n: int, impl: str, train: bool) -> tuple[np.ndarray, np.ndarray]:
    """The exchanges the step model charges on each step of a ring pass of ``n`` ranks.

    Step t's exchanges overlap its compute; the last step's are exposed after it (the pass's
    tail). The KV block of the next step: steps 0 .. N-2, forward and backward. The dK/dV partial
    sums (backward only), :func:`flashcp.comm.ring_grad_hops` of them, on the last steps:
    ``ours`` (:func:`flashcp.ops.ring_attn.ring_backward`) posts one at each step 1 .. N-1 (the
    owner keeps its step-0 contribution; the last sum goes home after the last step);
    ring-flash-attn 0.1.8 at each step 0 .. N-1 (``d_kv_comm.send_recv_kv`` at the end of every
    iteration of its loop). Both ops post a step's dK/dV after its kernels, so the sum overlaps
    the next step's compute: the model charges it one step early, the counts (overlapped and
    exposed) are the ops' (``tests/unit/test_ring_schedule.py``; docs/simulator.md).

    Args:
        n: cp_size N (>= 1); impl: ``ours`` or ``ring_flash_attn``; train: backward pass.
    Returns:
        ``(kv, grad)``: (N,) int64 exchanges of each kind per step.
    Raises:
        ValueError: an unknown ``impl``.
    """
    kv = np.zeros(n, dtype=np.int64)
    grad = np.zeros(n, dtype=np.int64)
    hops = ring_grad_hops(n, impl)  # checks impl
    if n > 1:
        kv[:-1] = 1
        if train:
            grad[n - hops :] = 1
    return kv, grad


def ring_overlap_schedule(n: int, impl: str, train: bool) -> dict[str, np.ndarray]:
    """The model's exchanges of a ring pass laid out as
    :func:`flashcp.executors.work_trace.exchange_schedule` lays out an op's recorded ones.

    Returns:
        ``{kind: (N + 1,) int64}`` for ``kv`` and ``grad``: exchanges overlapping each step's
        kernels, the last entry the exposed ones; each dK/dV hop is put on the step after the one
        :func:`ring_exchange_steps` charges it on (the step whose kernels it overlaps).
    Raises:
        ValueError: an unknown ``impl``.
    """
    kv, grad = ring_exchange_steps(n, impl, train)
    out = {}
    for kind, per, shift in (("kv", kv, 0), ("grad", grad, 1)):
        sched = np.zeros(n + 1, dtype=np.int64)
        sched[shift : n - 1 + shift] = per[:-1]
        sched[n] = per[-1]
        out[kind] = sched
    return out


def ring_pass_hops(n: int, impl: str, train: bool, fwd_hop, grad_hop=0.0):
    """Per-step and exposed exchange µs of a ring pass (:func:`ring_exchange_steps`).

    Args:
        n, impl, train: as :func:`ring_exchange_steps`.
        fwd_hop, grad_hop: µs of one KV hop and of one dK/dV hop (scalars, or (S,) arrays).
    Returns:
        ``(hop_us, tail_us)``: (..., N) µs overlapped with each step (0 on the last step) and
        (...) µs exposed after the last step.
    """
    kv, grad = ring_exchange_steps(n, impl, train)
    f = np.asarray(fwd_hop, dtype=np.float64)[..., None]
    g = np.asarray(grad_hop, dtype=np.float64)[..., None]
    per_step = np.where(kv > 0, f, 0.0) + np.where(grad > 0, g, 0.0)
    tail = per_step[..., -1].copy()
    per_step[..., -1] = 0.0
    if np.ndim(fwd_hop) == 0 and np.ndim(grad_hop) == 0:
        tail = float(tail)
    return per_step, tail


def ring_price_bytes(plan: Plan) -> int:
    """Estimated peak bytes of pricing ``plan`` with the ring step model (``p2p_ring`` and the
    hybrids' inner ring) in a :class:`PlanBatch`: about 160 B per (step, rank) for the statistics
    and phase arrays, (S, N, N) float64, plus, on the NumPy path (cp_size above
    :data:`RING_KERNEL_MAX_N`, or without numba), 64 B per (shard, rank) of visibility masks and
    keys and 8 B per (document, step, rank) rectangle. Measured on WLB-LLM 128K (peak RSS of
    ``price_plans``): ``zigzag`` 19.5 MB per plan at CP 64 (estimate 21.3), 72.5 MB at CP 128
    (82.2); ``ring`` 10.1 MB at CP 256 (60.5: most rectangles are empty). The estimate always
    counts the NumPy path, so it is an upper bound where the kernels run."""
    n = int(plan.cp_size)
    return 160 * n * n + 64 * int(plan.rank.size) * n + 8 * int(plan.doc_lens.size) * n * n


def _gather_masks(same, q_vis, k_vis, q_key, k_key, size, shape):
    """Which ring steps of the project's op gather rows by index rather than slice a view.

    A step's query rows are its visible local shards in local order, its key rows the visible
    shards of the source block (:mod:`flashcp.ops.ring_meta`: one segment per visible shard, every
    registry layout); they are one ``slice`` (a view, no copy) when those shards are one
    contiguous run, else an int64 index (``index_select``).

    Args:
        same: (n_shards,) bool, the shard's predecessor in the arrays is on the same rank (and
            plan); q_vis, k_vis: (n_shards, N-1) bool, the shard is visible as a query (key) at
            step t = 1 .. N-1; q_key, k_key: (n_shards, N-1) flat index of the step's
            ``[.., t, r]`` entry (the query rank, the rank that sees the key shard); size, shape:
            of the flat and the dense result.
    Returns:
        ``(q_gather, k_gather)``: bool arrays of ``shape``, True where the step's visible shards
        form more than one run (step 0 is always a slice: False).
    """
    out = []
    for vis, key in ((q_vis, q_key), (k_vis, k_key)):
        first = vis.copy()
        first[1:] &= ~(vis[:-1] & same[1:, None])
        runs = np.bincount(key[first], minlength=size)
        out.append((runs > 1).reshape(shape))
    return out[0], out[1]


class _PlanCostStack(RingCost):
    """The ring statistics of S plans (same cp_size, hardware, implementation) stacked along a
    leading axis: (S, N, N) arrays, so :class:`PlanCost`'s ring methods (written for any leading
    axes) price all of them with one set of numpy operations."""

    def __init__(self, costs: Sequence[RingCost]) -> None:
        first = costs[0]
        self.plan = None
        self.hw, self.comm_kind, self.impl, self.n, self.ops = (
            first.hw, first.comm_kind, first.impl, first.n, first.ops,
        )  # fmt: skip
        self.num_docs = np.array([c.num_docs for c in costs])
        self.local_tokens = np.array([c.local_tokens for c in costs])
        self.cuts_pad = first.cuts_pad
        self.fwd = TileStats(
            *(np.stack([getattr(c.fwd, f) for c in costs]) for f in TileStats._fields)
        )
        self.bwd = TileStats(
            *(np.stack([getattr(c.bwd, f) for c in costs]) for f in TileStats._fields)
        )
        self.q_rows = np.stack([c.q_rows for c in costs])
        self.kv_rows = np.stack([c.kv_rows for c in costs])
        self.q_gather = np.stack([c.q_gather for c in costs])
        self.k_gather = np.stack([c.k_gather for c in costs])
        self._masks = None
        self._fwd_memo = {}


def _stack_from_arrays(
    hw,
    comm_kind,
    impl,
    n,
    ops,
    num_docs,
    local_tokens,
    fwd,
    bwd,
    q_rows,
    kv_rows,
    q_gather,
    k_gather,
    *,
    cuts_pad: bool = True,
):
    """A :class:`_PlanCostStack` of already stacked (S, N, N) ring statistics."""
    stack = object.__new__(_PlanCostStack)
    stack.plan = None
    stack.hw, stack.comm_kind, stack.impl, stack.n, stack.ops = hw, comm_kind, impl, n, ops
    stack.num_docs = num_docs
    stack.local_tokens = local_tokens
    stack.cuts_pad = cuts_pad
    stack.fwd, stack.bwd, stack.q_rows, stack.kv_rows = fwd, bwd, q_rows, kv_rows
    stack.q_gather, stack.k_gather = q_gather, k_gather
    stack._masks = None
    stack._fwd_memo = {}
    return stack


def _step_ring_batch(
    costs: Sequence[RingCost], shape: AttnShape, mode: str
) -> dict[str, np.ndarray]:
    """:meth:`PlanCost._step_ring` of S plans at once (:class:`_PlanCostStack`)."""
    first = costs[0]
    hw, kind = first.hw, first.comm_kind
    train = mode == "train"
    vols = [comm_volume(c.plan, kind, shape, mode, impl=c.impl) for c in costs]
    fwd_p2p = [
        comm_volume(c.plan, kind, shape, "infer", impl=c.impl)["p2p_bytes"]
        if train
        else v["p2p_bytes"]
        for c, v in zip(costs, vols, strict=True)
    ]
    p2p = np.array([v["p2p_bytes"] for v in vols])

    links = first.links

    def hop_us(nbytes):  # one plan at a time, as HardwareProfile prices it
        return np.array([p2p_us(hw, links, b) for b in nbytes])

    out = _ring_phases(_PlanCostStack(costs), shape, mode, p2p, np.array(fwd_p2p), hop_us)
    phases = [out[c] for c in PHASE_COLUMNS if c != "total_ms"]
    out["total_ms"] = np.array([math.fsum(x) for x in zip(*phases, strict=True)])
    out.update({k: np.array([v[k] for v in vols], dtype=np.int64) for k in COMM_COLUMNS})
    return out


def _ring_phases(stack, shape: AttnShape, mode: str, p2p_bytes, fwd_p2p, p2p_us) -> dict:
    """Phase times (ms; (S,) arrays, ``total_ms`` left out) of S stacked ring plans (a
    :class:`_PlanCostStack`): ``p2p_bytes`` / ``fwd_p2p`` (S,) bytes of the step and of its forward,
    ``p2p_us`` :meth:`HardwareProfile.p2p_us` over an array."""
    n = stack.n
    train = mode == "train"
    steps = max(n - 1, 1)
    fwd_p2p = np.asarray(fwd_p2p, dtype=np.float64)
    s = fwd_p2p.size
    fwd_hop = p2p_us(fwd_p2p / steps) if n > 1 else np.zeros(s)
    kernels = compiled.load("price") if n <= 128 else None
    fwd = stack._fwd_memo.get(shape)
    if fwd is None:  # training and inference of one shape share the forward
        fwd = stack._fwd_memo[shape] = _ring_compute(kernels, stack, shape, False)
    ring_pass = stack._ring_pass if kernels is None else functools.partial(_ring_pass_compiled,
                                                                          kernels, stack)  # fmt: skip
    fa, fo, fp = ring_pass(*fwd, *ring_pass_hops(n, stack.impl, False, fwd_hop))
    zero = np.zeros(s)
    ba = bo = bp = zero
    if train and n > 1:
        grad = np.asarray(p2p_bytes, dtype=np.float64) - 2 * fwd_p2p
        grad_hop = p2p_us(grad / ring_grad_hops(n, stack.impl))
        bwd = _ring_compute(kernels, stack, shape, True)
        ba, bo, bp = ring_pass(*bwd, *ring_pass_hops(n, stack.impl, True, fwd_hop, grad_hop))
    elif train:
        ba, bo, bp = ring_pass(*_ring_compute(kernels, stack, shape, True), 0.0, 0.0)
    return {
        "allgather_ms": zero,
        "attn_fwd_ms": fa / 1e3,
        "attn_bwd_ms": ba / 1e3,
        "reducescatter_ms": zero,
        "p2p_ms": (fp + bp) / 1e3,
        "alltoall_ms": zero,
        "others_ms": (fo + bo) / 1e3,
    }


def _ring_compute(kernels, stack, shape: AttnShape, backward: bool):
    """``stack._ring_fwd_compute(shape)`` (``_ring_bwd_compute`` when ``backward``) of a
    :class:`_PlanCostStack`, by :func:`flashcp.sim.cost.kernels.ring_compute_ours` (the same
    numbers, to the bit) for the project's op, whose ImplOps the kernel assumes."""
    ops = stack.ops
    simple = (
        kernels is not None
        and stack.impl == "ours"
        and not (ops.per_doc_host or ops.mask_syncs or ops.one_doc_views or ops.indexed_accum_ops)
        and np.ndim(stack.q_rows) == 3
    )
    if not simple:
        return stack._ring_bwd_compute(shape) if backward else stack._ring_fwd_compute(shape)
    hw = stack.hw
    d = shape.head_dim
    stats = stack.bwd if backward else stack.fwd
    consts = np.array([
        hw.launch_us, hw.copy_bw_gbps * 1e3, hw.host_op_us,
        hw.bwd_cta_overhead_us if backward else hw.fwd_cta_overhead_us,
        tile_us(hw, d, backward), hw.num_sms,
        hw.ring_step_bwd_us if backward else hw.ring_step_fwd_us,
        hw.accum_bytes_eager if backward else getattr(hw, ops.merge_bytes),
        ops.accum_ops if backward else ops.merge_ops, ops.half_gather_ops, hw.bwd_extra_kernels,
    ], dtype=np.float64)  # fmt: skip
    s = stack.q_rows.shape[0]
    out = kernels.ring_compute_ours(
        np.ascontiguousarray(stack.q_rows, dtype=np.float64),
        np.ascontiguousarray(stack.kv_rows, dtype=np.float64),
        np.ascontiguousarray(np.stack(stats), dtype=np.float64),
        np.ascontiguousarray(stack.q_gather, dtype=np.bool_),
        np.ascontiguousarray(stack.k_gather, dtype=np.bool_),
        np.ascontiguousarray(np.broadcast_to(np.asarray(stack.local_tokens, np.float64), (s,))),
        bool(stack.cuts_pad), backward, shape.num_heads, shape.num_kv_heads, d,
        shape.dtype_bytes, consts,
    )  # fmt: skip
    return out[0], out[1], out[2], 0.0


def _ring_pass_compiled(kernels, stack, attn, other, host, idle, hop_us, tail_us):
    """:meth:`PlanCost._ring_pass` of a :class:`_PlanCostStack`'s (S, N, N) arrays by
    :func:`flashcp.sim.cost.kernels.ring_pass` (the same numbers, to the bit)."""
    s = attn.shape[0]

    def dense(x):
        return np.ascontiguousarray(np.broadcast_to(np.asarray(x, dtype=np.float64), attn.shape))

    def per_plan(x, *shape):
        return np.ascontiguousarray(np.broadcast_to(np.asarray(x, dtype=np.float64), (s, *shape)))

    hw = stack.hw
    out = kernels.ring_pass(
        dense(attn), dense(other), dense(host), dense(idle), per_plan(hop_us, attn.shape[1]),
        per_plan(tail_us),
        float(hw.overlap_fraction), float(hw.nccl_slowdown),
    )  # fmt: skip
    return out[0], out[1], out[2]
