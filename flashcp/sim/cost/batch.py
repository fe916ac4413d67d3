"""Batched pricing: many plans x hardware profiles x shapes x modes in one call
(:class:`PlanBatch`, :func:`price_plans`), equal to the per-plan model (to the bit where the
kernels of :mod:`flashcp.sim.cost.kernels` run), and :func:`attention_balance`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence

import numpy as np

from flashcp import compiled
from flashcp.comm import AttnShape, check_mode, grad_comm_bytes, ring_grad_hops
from flashcp.plan import Plan
from flashcp.plan.head_parallel import one_group_documents
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS
from flashcp.sim.cost.allgather import (
    _ag_head_groups,
    _allgather_phases,
    _check_grad_dtype,
    _check_keep,
)
from flashcp.sim.cost.alltoall import _alltoall_phases
from flashcp.sim.cost.base import PlanCost
from flashcp.sim.cost.ring import (
    RING_KERNEL_MAX_N,
    _gather_masks,
    _ring_phases,
    _stack_from_arrays,
    ring_price_bytes,
)
from flashcp.sim.cost.units import (
    _check_comm_kind,
    _check_sim_args,
    _excl_cumsum,
    _single_phases,
    _stats,
)
from flashcp.sim.hardware import HardwareProfile, load_hardware
from flashcp.sim.impl import check_impl, impl_ops
from flashcp.sim.kernel import (
    TileStats,
    bwd_extra_us,
    bwd_tile_counts,
    fwd_tile_counts,
    kernel_us,
)
from flashcp.sim.network import FLAT, Links, collective_us_v, group_links, p2p_us_v, topology_for

#: the most bytes :func:`price_plans` lets one batch of ring-family plans take
#: (:func:`ring_price_bytes`): larger groups are priced in consecutive chunks of plans, with the
#: same numbers (each plan's statistics and phases are its own); 1 GiB
PRICE_BATCH_BYTES = 1 << 30


def _physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX: no check
        return None


def _price_chunks(plans: Sequence[Plan], idx: list[int]) -> list[list[int]]:
    """``idx`` (a ring-family group of ``plans``) cut into consecutive chunks of at most
    :data:`PRICE_BATCH_BYTES` by :func:`ring_price_bytes` (at least one plan each).

    Raises:
        ValueError: one plan alone needs more than half this machine's physical memory (it
            would be killed for memory, or swap for hours, rather than finish).
    """
    chunks: list[list[int]] = [[]]
    used = 0
    limit = _physical_memory_bytes()
    for i in idx:
        need = ring_price_bytes(plans[i])
        if limit is not None and need > limit // 2:
            p = plans[i]
            raise ValueError(
                f"pricing this {p.method} plan (cp_size {p.cp_size}, {p.rank.size} shards, "
                f"{p.doc_lens.size} documents) with the ring step model needs about "
                f"{need / 2**30:.1f} GiB, more than half of this machine's {limit / 2**30:.1f} "
                "GiB (it grows as shards x cp_size and documents x cp_size^2); use a smaller "
                "cp_size or a shorter context_len"
            )
        if chunks[-1] and used + need > PRICE_BATCH_BYTES:
            chunks.append([])
            used = 0
        chunks[-1].append(i)
        used += need
    return chunks


def _chunk_groups(plans: Sequence[Plan], groups: dict[tuple, list[int]]) -> dict:
    """Each (comm_kind, method, cp_size, Ulysses degree) group of :func:`price_plans` as its
    chunks of plan indices: the ring family and the hybrids cut by :func:`_price_chunks`, the
    others whole."""
    return {
        key: _price_chunks(plans, idx) if key[0] == "p2p_ring" or key[3] > 1 else [idx]
        for key, idx in groups.items()
    }


class PlanBatch:
    """S plans of one cp_size N as flat arrays, for :func:`price_plans`.

    Attributes:
        plans: the S plans, in order.
        rank, doc, start, length: (n_shards_total,) int64, every plan's shards concatenated;
            ``pid`` the plan of each, ``gdoc`` its document's index in ``doc_lens``.
        doc_lens: (n_docs_total,) int64, every plan's documents; ``ndocs`` (S,) per plan,
            ``doc_off`` (S,) the first of each.
        q_rows, send_rows: (S, N) float64, tokens per rank and its non-last shards' tokens.
        tokens_full, tokens_sharded: (S,) int64, Eq. 4 and Eq. 5 tokens per plan.
        context_len: (S,) float64, C of each plan (documents + pad).
        hybrid_inner: the plans are a hybrid's group plans, run by its inner ring or all-gather
            (which leave the pad rows to the hybrid).

    Tile statistics are built per tile shape on demand (:meth:`allgather`, :meth:`ring`,
    :meth:`alltoall`), all plans at once, and kept: price every run of one set of plans from
    one batch.

    Raises:
        ValueError: no plans, or plans of several cp_sizes.
    """

    def __init__(self, plans: Sequence[Plan], *, hybrid_inner: bool = False) -> None:
        if not plans:
            raise ValueError("PlanBatch needs at least one plan")
        self.hybrid_inner = hybrid_inner
        s, n = len(plans), plans[0].cp_size
        if any(p.cp_size != n for p in plans):
            raise ValueError(
                f"PlanBatch holds plans of one cp_size; got {sorted({p.cp_size for p in plans})}"
            )
        self.plans = list(plans)
        self.s, self.n = s, n
        self._inner: PlanBatch | None = None
        counts = np.fromiter((p.rank.size for p in plans), np.int64, s)
        self.off = np.zeros(s + 1, dtype=np.int64)  # the first shard of each plan
        np.cumsum(counts, out=self.off[1:])
        self.ndocs = np.fromiter((p.doc_lens.size for p in plans), np.int64, s)
        # the four shard columns as rows of one block: one large allocation (fewer page faults)
        cols = np.empty((4, int(self.off[-1])), dtype=np.int64)
        for row, name in zip(cols, ("rank", "doc", "start", "length"), strict=True):
            np.concatenate([getattr(p, name) for p in plans], out=row, casting="same_kind")
        self.rank, self.doc, self.start, self.length = cols
        self.doc_lens = np.concatenate([p.doc_lens for p in plans]).astype(np.int64, copy=False)
        self.doc_off = _excl_cumsum(self.ndocs)
        pad = np.stack([p.pad for p in plans]).sum(axis=1)
        kernels = compiled.load("price")
        if kernels is not None:
            rows, docs = kernels.batch_sums(
                s, n, self.off, self.doc_off, self.rank, self.doc, self.start, self.length,
                self.doc_lens,
            )  # fmt: skip
            self.context_len = docs + pad
            self.q_rows, self.send_rows = rows[0], rows[1]
        else:
            doc_pid = np.repeat(np.arange(s), self.ndocs)
            self.context_len = np.bincount(doc_pid, weights=self.doc_lens, minlength=s) + pad
            self.q_rows = np.bincount(self.key, weights=self.length, minlength=s * n).reshape(s, n)
            send = np.where(self.is_last, 0, self.length)
            self.send_rows = np.bincount(self.key, weights=send, minlength=s * n).reshape(s, n)
        # Eq. 4 and Eq. 5 tokens (ints): (N - 1) x the largest rank's document / send tokens
        self.tokens_full = (n - 1) * self.q_rows.max(axis=1).astype(np.int64)
        self.tokens_sharded = (n - 1) * self.send_rows.max(axis=1).astype(np.int64)
        self._stats: dict[tuple, object] = {}

    # per shard, for the NumPy reference paths (built on first use)
    @functools.cached_property
    def pid(self) -> np.ndarray:
        """(n_shards_total,) int64: the plan of each shard."""
        return np.repeat(np.arange(self.s), np.diff(self.off))

    @functools.cached_property
    def gdoc(self) -> np.ndarray:
        """(n_shards_total,) int64: each shard's document's index in ``doc_lens``."""
        return self.doc + self.doc_off[self.pid]

    @functools.cached_property
    def key(self) -> np.ndarray:
        """(n_shards_total,) int64: plan * N + rank of each shard (non-decreasing)."""
        return self.pid * self.n + self.rank

    @functools.cached_property
    def is_last(self) -> np.ndarray:
        """(n_shards_total,) bool: the shard ends its document."""
        return self.start + self.length == self.doc_lens[self.gdoc]

    def _cached(self, kind: str, hw: HardwareProfile, build):
        k = (kind, hw.fwd_block_q, hw.fwd_block_k, hw.bwd_block_q, hw.bwd_block_k)
        if k not in self._stats:
            self._stats[k] = build(hw)
        return self._stats[k]

    # all-gather family: one varlen call per rank over its shards
    def allgather(self, hw: HardwareProfile) -> tuple[TileStats, TileStats, np.ndarray]:
        """(fwd, bwd, kv_rows): (S, N) arrays of every plan's per-rank call."""

        def build(hw):
            s, n = self.s, self.n
            kernels = compiled.load("price")
            if kernels is not None:
                st = kernels.allgather_stats(
                    s, n, self.off, self.rank, self.start, self.length,
                    hw.fwd_block_q, hw.fwd_block_k, hw.bwd_block_q, hw.bwd_block_k,
                )  # fmt: skip
                return TileStats(st[0], st[1], st[2]), TileStats(st[3], st[4], st[5]), st[6]
            kv = self.start + self.length
            causal = np.ones(kv.size, dtype=bool)
            fc = fwd_tile_counts(self.length, kv, causal, hw.fwd_block_q, hw.fwd_block_k)
            bc = bwd_tile_counts(self.length, kv, causal, hw.bwd_block_q, hw.bwd_block_k)
            fwd = TileStats(*(x.reshape(s, n) for x in _stats(self.key, s * n, *fc)))
            bwd = TileStats(*(x.reshape(s, n) for x in _stats(self.key, s * n, *bc)))
            kv_rows = np.bincount(self.key, weights=kv, minlength=s * n).reshape(s, n)
            return fwd, bwd, kv_rows

        return self._cached("allgather", hw, build)

    def alltoall(self, hw: HardwareProfile) -> tuple[TileStats, TileStats, np.ndarray]:
        """(fwd, bwd, rows): (S,) statistics of every plan's one call over its whole non-empty
        documents (Ulysses) and its query rows."""

        def build(hw):
            keep = self.doc_lens > 0
            d = self.doc_lens[keep]
            key = np.repeat(np.arange(self.s), self.ndocs)[keep]
            causal = np.ones(d.size, dtype=bool)
            fc = fwd_tile_counts(d, d, causal, hw.fwd_block_q, hw.fwd_block_k)
            bc = bwd_tile_counts(d, d, causal, hw.bwd_block_q, hw.bwd_block_k)
            rows = np.bincount(key, weights=d, minlength=self.s)
            return _stats(key, self.s, *fc), _stats(key, self.s, *bc), rows

        return self._cached("alltoall", hw, build)

    def ring(self, hw: HardwareProfile) -> tuple:
        """(fwd, bwd, q_rows, kv_rows, q_gather, k_gather): (S, N, N) arrays ``[plan, t, r]`` of
        every plan's ring steps (:meth:`PlanCost._init_ring`'s segments and gather masks, all
        plans at once)."""

        def build(hw):
            return self._ring_stats(hw)

        return self._cached("ring", hw, build)

    def _ring_stats(self, hw: HardwareProfile):
        s, n = self.s, self.n
        kernels = compiled.load("price")
        if kernels is not None and n <= RING_KERNEL_MAX_N:
            st, g = kernels.ring_stats(
                s, n, self.off, self.ndocs, self.rank, self.doc, self.start, self.length,
                hw.fwd_block_q, hw.fwd_block_k, hw.bwd_block_q, hw.bwd_block_k,
            )  # fmt: skip
            return (
                TileStats(st[0], st[1], st[2]),
                TileStats(st[3], st[4], st[5]),
                st[6],
                st[7],
                g[0],
                g[1],
            )
        return self._ring_stats_reference(hw)

    def _ring_stats_reference(self, hw: HardwareProfile):
        """:meth:`ring`'s statistics in NumPy (the reference of
        :func:`flashcp.sim.cost.kernels.ring_stats`)."""
        s, n = self.s, self.n
        rank, doc, start, length, pid = self.rank, self.doc, self.start, self.length, self.pid
        nd = self.ndocs
        # step 0: one causal segment per (plan, rank, document) over the rank's own tokens
        idx0 = _excl_cumsum(n * nd)[pid] + rank * nd[pid] + doc
        own = np.bincount(idx0, weights=length, minlength=int(n * nd.sum()))
        key0 = np.flatnonzero(own)
        q0 = own[key0]
        r0 = np.repeat(np.arange(s * n), np.repeat(nd, n))[key0]  # plan * N + rank, sorted
        causal = np.ones(q0.size, dtype=bool)
        f0 = _stats(r0, s * n, *fwd_tile_counts(q0, q0, causal, hw.fwd_block_q, hw.fwd_block_k))
        b0 = _stats(r0, s * n, *bwd_tile_counts(q0, q0, causal, hw.bwd_block_q, hw.bwd_block_k))
        fwd = [np.zeros((s, n, n)) for _ in range(3)]
        bwd = [np.zeros((s, n, n)) for _ in range(3)]
        for k in range(3):
            fwd[k][:, 0] = f0[k].reshape(s, n)
            bwd[k][:, 0] = b0[k].reshape(s, n)
        q_rows = np.zeros((s, n, n))
        kv_rows = np.zeros((s, n, n))
        q_rows[:, 0] = kv_rows[:, 0] = self.q_rows
        if n > 1:
            # first and last piece start of every (document, rank)
            i32 = np.int32 if n * n * int(nd.sum()) < 2**31 else np.int64
            dr = (self.gdoc * n + rank).astype(i32)
            size_dr = int(nd.sum()) * n
            min_start = np.full(size_dr, np.iinfo(np.int64).max)
            max_start = np.full(size_dr, -1, dtype=np.int64)
            np.minimum.at(min_start, dr, start)
            np.maximum.at(max_start, dr, start)
            # step t >= 1: the source rank (r - t) mod N and the rank (r + t) mod N that sees r
            r_t = np.arange(n, dtype=i32)[:, None] + np.arange(1, n, dtype=i32)[None, :]
            src_of = (r_t - 2 * np.arange(1, n, dtype=i32)[None, :]) % n  # (N, N-1) [r, t-1]
            dst_of = r_t % n
            rank32 = rank.astype(i32)
            gd = (dr - rank32)[:, None]  # gdoc * N
            st = start[:, None]
            q_vis = min_start[gd + src_of[rank32]] < st
            k_vis = max_start[gd + dst_of[rank32]] > st
            # rectangle [plan, t, r, doc]: plan p's block holds N * N * nd[p] entries, at key
            # base + (t * N + r) * nd[p] + doc
            ndp = nd[pid].astype(i32)
            base = (_excl_cumsum(n * n * nd)[pid] + doc).astype(i32)
            tn = np.arange(1, n, dtype=i32) * n
            q_key = (base + rank32 * ndp)[:, None] + (ndp[:, None] * tn[None, :])
            k_key = base[:, None] + (tn[None, :] + dst_of[rank32]) * ndp[:, None]
            size = int(n * n * nd.sum())
            m = s * n * n
            len_f = length.astype(np.float64)[:, None]
            if 4 * q_vis.size >= size and (nd > 0).all():
                # dense: most rectangles hold work; (plan, t, r) is a run of nd[p] documents
                qs = np.bincount(q_key.ravel(), weights=(len_f * q_vis).ravel(), minlength=size)
                ks = np.bincount(k_key.ravel(), weights=(len_f * k_vis).ravel(), minlength=size)
                head = _excl_cumsum(np.repeat(nd, n * n))
                at = None
            else:
                q_key, k_key = q_key[q_vis], k_key[k_vis]
                lq = np.broadcast_to(len_f, q_vis.shape)[q_vis]
                lk = np.broadcast_to(len_f, k_vis.shape)[k_vis]
                keys, inv = np.unique(np.concatenate([q_key, k_key]), return_inverse=True)
                qs = np.bincount(inv[: q_key.size], weights=lq, minlength=keys.size)
                ks = np.bincount(inv[q_key.size :], weights=lk, minlength=keys.size)
                # the (plan, t, r) of each rectangle, sorted
                seg = np.repeat(np.arange(m, dtype=i32), np.repeat(nd, n * n))[keys]
                # no rectangle at all (every step t >= 1 empty: documents shorter than N): none
                head = np.flatnonzero(np.concatenate([[seg.size > 0], seg[1:] != seg[:-1]]))
                at = seg[head]
            # sums and maxima over each (plan, t, r)'s documents
            fq, fk = np.ceil(qs / hw.fwd_block_q), np.ceil(ks / hw.fwd_block_k)
            bq, bk = np.ceil(qs / hw.bwd_block_q), np.ceil(ks / hw.bwd_block_k)
            cols = (
                (fwd[0], fq, np.add), (fwd[1], fq * fk, np.add), (fwd[2], fk, np.maximum),
                (bwd[0], bk, np.add), (bwd[1], bq * bk, np.add), (bwd[2], bq, np.maximum),
                (q_rows, qs, np.add), (kv_rows, ks, np.add),
            )  # fmt: skip
            for dense, values, red in cols:
                if at is None:
                    flat = red.reduceat(values, head)
                else:
                    flat = np.zeros(m)
                    if head.size:
                        flat[at] = red.reduceat(values, head)
                dense[:, 1:] = flat.reshape(s, n, n)[:, 1:]
            same = np.zeros(self.key.size, dtype=bool)
            same[1:] = self.key[1:] == self.key[:-1]
            at_t = (self.pid * (n * n))[:, None] + tn[None, :]
            q_gather, k_gather = _gather_masks(
                same, q_vis, k_vis, at_t + rank32[:, None], at_t + dst_of[rank32], m, (s, n, n)
            )
        else:
            q_gather = k_gather = np.zeros((s, n, n), dtype=bool)
        return TileStats(*fwd), TileStats(*bwd), q_rows, kv_rows, q_gather, k_gather

    # ---- pricing -----------------------------------------------------------------------------
    def volumes(
        self, comm_kind: str, shape: AttnShape, mode: str, u: int, cp_size: int, keep=False,
        impl: str = "ours", grad=None,
    ):  # fmt: skip
        """:func:`flashcp.comm.comm_volume` of every plan: (S,) int64 per column of
        ``COMM_COLUMNS``. This batch holds the plans across head-parallel groups (the group plans
        when ``u`` > 1, ``cp_size`` the original plans' N); ``keep``: ``keep_gathered_kv``;
        ``impl``: which code runs them (``comm_volume``'s ``impl``); ``grad``: its
        ``grad_comm_dtype``."""
        key = ("volumes", comm_kind, shape, mode, u, cp_size, keep, impl, grad)
        if key not in self._stats:
            self._stats[key] = self._volumes(comm_kind, shape, mode, u, cp_size, keep, impl, grad)
        return dict(self._stats[key])

    def _volumes(
        self, comm_kind: str, shape: AttnShape, mode: str, u: int, cp_size: int, keep=False,
        impl: str = "ours", grad=None,
    ):  # fmt: skip
        from flashcp.comm import alltoall_bytes
        from flashcp.plan import kv_bytes
        from flashcp.plan.head_parallel import ulysses_heads

        train = mode == "train"
        grad_elem = grad_comm_bytes(shape, grad)
        d, e = shape.head_dim, shape.dtype_bytes
        zero = np.zeros(self.s, dtype=np.int64)
        a2a, kv_heads = zero, shape.num_kv_heads
        if u > 1:
            heads = ulysses_heads(shape.num_heads, shape.num_kv_heads, u)
            kv_heads = heads.kv_heads_per_rank
            t = self.context_len.astype(np.int64) // cp_size
            q_or_o = alltoall_bytes(t, shape.num_heads, d, e, u)
            kv = alltoall_bytes(t, heads.kv_replication * shape.num_kv_heads, d, e, u)
            a2a = 2 * q_or_o + 2 * kv
            if train:
                dkv_elem = e if heads.kv_replication == 1 else grad_elem
                a2a = a2a + 2 * q_or_o + 2 * kv // e * dkv_elem
        ag = rs = p2p = zero
        if comm_kind in ("allgather_full", "allgather_sharded"):
            tokens = self.tokens_full if comm_kind == "allgather_full" else self.tokens_sharded
            one = kv_bytes(tokens, kv_heads, d, e)
            ag = 2 * one if train and not keep else one
            rs = kv_bytes(tokens, kv_heads, d, grad_elem) if train else zero
        elif comm_kind == "p2p_ring":
            one = kv_bytes(self.tokens_full, kv_heads, d, e)
            # one block per dK/dV hop: N - 1 (ours) or N (ring-flash-attn), comm.ring_grad_hops
            block = self.q_rows.max(axis=1).astype(np.int64)
            grad = kv_bytes(ring_grad_hops(self.n, impl) * block, kv_heads, d, grad_elem)
            p2p = 2 * one + grad if train else one
        vol = {
            "allgather_bytes": ag, "reducescatter_bytes": rs, "p2p_bytes": p2p,
            "alltoall_bytes": a2a,
        }  # fmt: skip
        vol = {k: np.asarray(v, dtype=np.int64) for k, v in vol.items()}
        vol["comm_bytes"] = ag + rs + p2p + a2a
        return vol

    def phases(
        self, hw: HardwareProfile, comm_kind: str, impl: str, method: str, shape: AttnShape,
        mode: str, vol: dict[str, np.ndarray], keep=False, grad=None, links: Links = FLAT,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """Phase times (ms, (S,) arrays, ``total_ms`` left out) of every plan of this batch, no
        head parallelism around them (:meth:`PlanCost.step`'s model); ``keep``:
        ``keep_gathered_kv``; ``links``: which exchanges cross nodes (:mod:`flashcp.sim.network`)."""
        n = self.n
        if comm_kind == "p2p_ring":
            key = ("stack", impl, method, id(hw))
            stack = self._stats.get(key)
            if stack is None:
                ops = impl_ops(impl, method)
                stack = self._stats[key] = _stack_from_arrays(
                    hw,
                    comm_kind,
                    impl,
                    n,
                    ops,
                    self.ndocs,
                    self.context_len // n,
                    *self.ring(hw),
                    cuts_pad=not self.hybrid_inner,
                )
            fwd_p2p = vol["p2p_bytes"]
            if mode == "train":
                fwd_p2p = self.volumes(comm_kind, shape, "infer", 1, n, impl=impl)["p2p_bytes"]
            p2p_us = functools.partial(p2p_us_v, hw, links)
            return _ring_phases(stack, shape, mode, vol["p2p_bytes"], fwd_p2p, p2p_us)
        if comm_kind == "alltoall":
            from flashcp.plan.head_parallel import ulysses_heads

            fwd, bwd, rows = self.alltoall(hw)
            heads = ulysses_heads(shape.num_heads, shape.num_kv_heads, n)
            local = AttnShape(heads.heads_per_rank, heads.kv_heads_per_rank, shape.head_dim,
                              shape.dtype)  # fmt: skip
            d = shape.head_dim
            fwd_k = kernel_us(fwd, local.num_heads, d, hw, False)
            bwd_k = 0.0
            if mode == "train":
                bwd_k = kernel_us(bwd, local.num_heads, d, hw, True) + bwd_extra_us(
                    rows, rows, local, hw
                )
            t = self.context_len / n
            return _alltoall_phases(hw, shape, mode == "train", n, t, fwd_k, bwd_k, links=links)
        fwd, bwd, kv_rows = self.allgather(hw)
        send = self.q_rows if comm_kind == "allgather_full" else self.send_rows
        coll = functools.partial(collective_us_v, hw, links)
        return _allgather_phases(
            hw,
            n,
            self.q_rows,
            kv_rows,
            send.max(axis=1),
            fwd,
            bwd,
            shape,
            mode,
            vol,
            coll,
            keep,
            grad,
        )


def _as_profiles(hardware) -> list[HardwareProfile]:
    if isinstance(hardware, (HardwareProfile, str, dict)):
        hardware = [hardware]
    return [load_hardware(h) for h in hardware]


def price_plans(
    plans: Sequence[Plan],
    shapes: Sequence[AttnShape],
    modes: Sequence[str],
    hardware,
    comm_kind: str | None = None,
    impl: str = "ours",
    keep_gathered_kv: bool = False,
    grad_comm_dtype: str | None = None,
    *,
    placement: str = "consecutive",
    nodes: int | None = None,
) -> dict[str, np.ndarray]:
    """:func:`simulate` of every plan x hardware profile x shape x mode in one call, from the
    plans' arrays: each plan group (same cp_size, method and head-parallel degree) is priced with
    one set of numpy operations per (profile, shape, mode) over all its plans and ranks; equal (to
    rounding, 1e-12 relative) to ``simulate(plan, shape, hw, mode, comm_kind, impl)`` one by one.

    Args:
        plans: S valid plans (any methods and cp_sizes; for ``impl="ring_flash_attn"`` the plans of
            :func:`flashcp.sim.impl.impl_plan`), or a :class:`PlanBatch` of them (its statistics
            are kept in it for the next call: price the runs of one set of plans from one batch).
        shapes: K attention shapes (heads, KV heads, head_dim, dtype).
        modes: M modes, ``train`` / ``infer``.
        hardware: one profile (a :class:`HardwareProfile`, name or mapping for
            :func:`load_hardware`) or a sequence of P of them.
        comm_kind: as in :func:`simulate` (default: each plan's method's).
        impl: ``ours`` or ``ring_flash_attn``.
        keep_gathered_kv: the all-gather op's option (:class:`PlanCost`); every plan must be run
            by that op (all-gather comm kind, no head parallelism) with ``impl="ours"``.
        grad_comm_dtype: the all-gather op's dK/dV reduce-scatter dtype (:class:`PlanCost`; the
            same plans only); None: its default.
        placement, nodes: as in :func:`simulate`, for every plan's cp_size and profile.
    Returns:
        Every column of ``PHASE_COLUMNS`` (ms, float64) and ``COMM_COLUMNS`` (bytes, int64) as a
        (P, K, M, S) array indexed ``[profile, shape, mode, plan]``.

    Memory: the ring family's statistics grow as shards x cp_size and documents x cp_size^2 per
    plan (:func:`ring_price_bytes`), so its groups are priced in consecutive chunks of at most
    :data:`PRICE_BATCH_BYTES` (same numbers; a ``batch``'s kept statistics are used only when its
    whole group fits one chunk).

    Raises:
        ValueError: as :func:`simulate` (unknown mode, comm_kind, impl or profile, an impl that does
            not run a plan's method, heads a plan's Ulysses degree does not allow;
            ``keep_gathered_kv`` where no op keeps the KV, a topology that does not fit); a ring-family
            plan that alone would need more than half the machine's memory
            (:func:`ring_price_bytes`), before any is priced.
    """
    batch = plans if isinstance(plans, PlanBatch) else None
    plans = batch.plans if batch is not None else plans
    _check_sim_args(plans, shapes, modes)
    hws = _as_profiles(hardware)
    dims = (len(hws), len(shapes), len(modes), len(plans))
    out = {c: np.zeros(dims) for c in PHASE_COLUMNS}
    out.update({c: np.zeros(dims, dtype=np.int64) for c in COMM_COLUMNS})
    groups: dict[tuple, list[int]] = {}
    kinds: dict[str, str] = {}  # comm kind per method (one registry look-up each)
    for i, p in enumerate(plans):
        kind = kinds.get(p.method)
        if kind is None:
            kind = kinds[p.method] = _check_comm_kind(p, comm_kind)
        _check_keep(p, kind, impl, keep_gathered_kv)
        _check_grad_dtype(p, kind, impl, grad_comm_dtype)
        u = p.ulysses_degree if kind != "alltoall" else 1
        # one group (u = N > 1) of whole documents: plain Ulysses (PlanCost.plain_ulysses)
        if u > 1 and kind != "alltoall" and one_group_documents(p) is not None:
            kind, u = "alltoall", 1
        if p.cp_size == 1 and impl == "ours" and p.single_device_documents() is not None:
            kind, u = "single", 1  # one device, no CP work (PlanCost.single)
        groups.setdefault((kind, p.method, p.cp_size, u), []).append(i)
    chunked = _chunk_groups(plans, groups)  # before any pricing: a plan too large is refused
    for key, idx in groups.items():
        kind, method, _, u = key
        check_impl(method, impl)
        members = [plans[i] for i in idx]
        if kind in ("allgather_full", "allgather_sharded") and impl != "ours" and u == 1:
            # ring-flash-attn's llama3: one plan at a time
            links = [group_links(topology_for(hw, p.cp_size, placement, nodes)) for hw in hws]
            for k, p in zip(idx, members, strict=True):
                cost = PlanCost(p, hws[0], kind, impl, links=links[0])
                for a, hw in enumerate(hws):
                    c = cost if a == 0 else cost.with_hardware(hw)
                    c.links = links[a]
                    for b, shape in enumerate(shapes):
                        for m, mode in enumerate(modes):
                            row = c.step(shape, mode)
                            for col in out:
                                out[col][a, b, m, k] = row[col]
            continue
        for chunk in chunked[key]:
            whole = batch if batch is not None and len(chunk) == len(plans) else None
            part = _price_group(
                [plans[i] for i in chunk], kind, impl, method, u, hws, shapes, modes, whole,
                keep=bool(keep_gathered_kv), grad=grad_comm_dtype, placement=placement,
                nodes=nodes,
            )  # fmt: skip
            for col in out:
                out[col][..., chunk] = part[col]
    return out


def attention_balance(
    plans: Sequence[Plan] | PlanBatch,
    shape: AttnShape,
    mode: str,
    hardware,
    comm_kind: str | None = None,
) -> dict[str, np.ndarray]:
    """Read-only account of every plan's attention kernels, per rank, as the step model adds them
    before it takes the slowest rank (the project's ops, ``impl="ours"``; no contention).

    A step's attention phases (``attn_fwd_ms + attn_bwd_ms``) are, per pass, the sum over its
    steps (one for the all-gather and all-to-all families, N for the ring) of the slowest rank's
    kernel time; on a profile with ``nccl_slowdown = 1`` they equal ``slowest_us`` below.

    Args:
        plans: S valid plans, or a :class:`PlanBatch` of them (its statistics are reused).
        shape: the attention shape; mode: ``train`` or ``infer``.
        hardware: one profile (a :class:`HardwareProfile`, name or mapping).
        comm_kind: as in :func:`price_plans` (default: each plan's method's).
    Returns:
        ``slowest_us``: (S,) float64, sum over passes and steps of the slowest rank's kernel µs;
        ``mean_us``: (S,) float64, the same with the mean over ranks in place of the slowest.
    Raises:
        ValueError: as :func:`price_plans`.
    """
    from flashcp.plan.head_parallel import ulysses_heads

    check_mode(mode)
    train = mode == "train"
    batch = plans if isinstance(plans, PlanBatch) else None
    plans = batch.plans if batch is not None else list(plans)
    hw = _as_profiles(hardware)[0]
    out = {"slowest_us": np.zeros(len(plans)), "mean_us": np.zeros(len(plans))}
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(plans):
        kind = _check_comm_kind(p, comm_kind)
        u = p.ulysses_degree if kind != "alltoall" else 1
        if p.single_device_documents() is not None:  # cp_size 1: one call, every head
            kind, u = "alltoall", 1
        groups.setdefault((kind, p.method, p.cp_size, u), []).append(i)
    chunked = _chunk_groups(plans, groups)
    for (kind, method, _, u), idx in (
        (key, chunk) for key, chunks in chunked.items() for chunk in chunks
    ):
        b = (
            batch
            if batch is not None and len(idx) == len(plans)
            else PlanBatch([plans[i] for i in idx])
        )
        inner_shape = shape
        if u > 1:  # the inner method on the group plans, for H/u heads (PlanCost._step_hybrid)
            method = "zigzag" if kind == "p2p_ring" else "flashcp"
            if b._inner is None:
                b._inner = PlanBatch(
                    [dataclasses.replace(p.group_plan(), method=method) for p in b.plans],
                    hybrid_inner=True,
                )
            b = b._inner
            heads = ulysses_heads(shape.num_heads, shape.num_kv_heads, u)
            inner_shape = AttnShape(
                heads.heads_per_rank, heads.kv_heads_per_rank, shape.head_dim, shape.dtype
            )
        passes = _attention_passes(b, hw, kind, method, inner_shape, train)
        out["slowest_us"][idx] = sum(a.max(axis=-1).sum(axis=-1) for a in passes)
        out["mean_us"][idx] = sum(a.mean(axis=-1).sum(axis=-1) for a in passes)
    return out


def _attention_passes(batch, hw, kind, method, shape, train) -> list[np.ndarray]:
    """Kernel µs per (plan, step, rank) of each pass of :func:`attention_balance`: (S, steps, N)
    arrays, as :meth:`PlanBatch.phases` composes them before the slowest rank is taken."""
    h, d, n = shape.num_heads, shape.head_dim, batch.n
    if kind == "p2p_ring":
        stack = _stack_from_arrays(hw, kind, "ours", n, impl_ops("ours", method), batch.ndocs,
                                   batch.context_len // n, *batch.ring(hw),
                                   cuts_pad=not batch.hybrid_inner)  # fmt: skip
        passes = [stack._ring_fwd_compute(shape)[0]]
        if train:
            passes.append(stack._ring_bwd_compute(shape)[0])
        return passes
    if kind == "alltoall":
        from flashcp.plan.head_parallel import ulysses_heads

        fwd, bwd, rows = batch.alltoall(hw)
        heads = ulysses_heads(shape.num_heads, shape.num_kv_heads, n)
        local = AttnShape(heads.heads_per_rank, heads.kv_heads_per_rank, d, shape.dtype)
        passes = [kernel_us(fwd, local.num_heads, d, hw, False)]
        if train:
            passes.append(
                kernel_us(bwd, local.num_heads, d, hw, True) + bwd_extra_us(rows, rows, local, hw)
            )
        return [np.repeat(p[:, None, None], n, axis=2) for p in passes]
    fwd, bwd, kv_rows = batch.allgather(hw)
    local = batch.q_rows
    send = local if kind == "allgather_full" else batch.send_rows
    groups = _ag_head_groups(n, local, send.max(axis=1), shape.num_kv_heads, d)[2]
    qh = (h // groups)[:, None]
    passes = [groups[:, None] * kernel_us(fwd, qh, d, hw, False)]
    if train:
        extra = np.zeros_like(local)
        for g in np.unique(groups):  # the backward's pre/post kernels of the group shape
            sel = groups == g
            gshape = AttnShape(h // int(g), shape.num_kv_heads // int(g), d, shape.dtype)
            extra[sel] = bwd_extra_us(local[sel], kv_rows[sel], gshape, hw)
        passes.append(groups[:, None] * (kernel_us(bwd, qh, d, hw, True) + extra))
    return [p[:, None, :] for p in passes]


def _price_group(
    plans, kind, impl, method, u, hws, shapes, modes, batch=None, keep=False, grad=None,
    placement="consecutive", nodes=None,
) -> dict[str, np.ndarray]:  # fmt: skip
    """:func:`price_plans` of plans sharing (comm_kind, method, cp_size, Ulysses degree u), from
    ``batch`` (a :class:`PlanBatch` of exactly these plans, statistics kept) when given; the
    CP group placed by ``placement`` / ``nodes`` on each profile's nodes."""
    from flashcp.plan.head_parallel import ulysses_heads

    if kind == "single":
        return _price_single(plans, hws, shapes, modes, batch)
    n = plans[0].cp_size
    inner_method = method
    if kind == "alltoall" and any(p.ulysses_degree not in (1, n) for p in plans):
        bad = next(p.ulysses_degree for p in plans if p.ulysses_degree not in (1, n))
        raise ValueError(
            f"comm_kind alltoall is Ulysses over all {n} ranks, but the plan's ulysses_degree is "
            f"{bad}"
        )
    if u > 1:  # the inner method's cost on the group plans, for H/u heads (PlanCost._step_hybrid)
        inner_method = "zigzag" if kind == "p2p_ring" else "flashcp"
        outer = batch
        batch = outer._inner if outer is not None else None
        if batch is None:
            batch = PlanBatch(
                [dataclasses.replace(p.group_plan(), method=inner_method) for p in plans],
                hybrid_inner=True,
            )
            if outer is not None:
                outer._inner = batch
    elif batch is None:
        batch = PlanBatch(plans)
    dims = (len(hws), len(shapes), len(modes), len(plans))
    out = {c: np.zeros(dims) for c in PHASE_COLUMNS}
    out.update({c: np.zeros(dims, dtype=np.int64) for c in COMM_COLUMNS})
    a2a_u = n if kind == "alltoall" else u
    links = [group_links(topology_for(hw, n, placement, nodes), a2a_u, kind == "alltoall")
             for hw in hws]  # fmt: skip
    pad = 0  # a hybrid's forward pads where its inner op's rows fall short (PlanCost._hybrid_pad)
    if u > 1:
        short = batch.q_rows < u * (batch.context_len // n)[:, None]
        pad = (short.all(axis=1) if kind == "p2p_ring" else short.any(axis=1)).astype(int)
    for b, shape in enumerate(shapes):
        inner_shape = shape
        if u > 1:
            heads = ulysses_heads(shape.num_heads, shape.num_kv_heads, u)
            inner_shape = AttnShape(
                heads.heads_per_rank, heads.kv_heads_per_rank, shape.head_dim, shape.dtype
            )
        for m, mode in enumerate(modes):
            vol = batch.volumes(kind, shape, mode, a2a_u, n, keep, impl, grad)
            for a, hw in enumerate(hws):
                ph = batch.phases(hw, kind, impl, inner_method, inner_shape, mode, vol, keep,
                                  grad, links[a])  # fmt: skip
                if u > 1:
                    t = batch.context_len / n
                    a2a = _alltoall_phases(hw, shape, mode == "train", u, t, 0.0, 0.0,
                                           kernels=False, pad=pad, links=links[a])  # fmt: skip
                    ph = {c: ph[c] + a2a[c] for c in ph}
                _store_phases(out, (a, b, m), ph)
                for c in COMM_COLUMNS:
                    out[c][a, b, m] = vol[c]
    return out


def _price_single(plans, hws, shapes, modes, batch=None) -> dict[str, np.ndarray]:
    """:func:`price_plans` of cp_size 1 plans of whole documents (:attr:`PlanCost.single`): one
    varlen call per pass over each plan's documents, no communication (:func:`_single_phases`),
    the same for every method."""
    batch = PlanBatch(plans) if batch is None else batch
    dims = (len(hws), len(shapes), len(modes), len(plans))
    out = {c: np.zeros(dims) for c in PHASE_COLUMNS}
    out.update({c: np.zeros(dims, dtype=np.int64) for c in COMM_COLUMNS})  # nothing moves
    for a, hw in enumerate(hws):
        fwd, bwd, rows = batch.alltoall(hw)  # whole non-empty documents, all heads
        for b, shape in enumerate(shapes):
            h, d = shape.num_heads, shape.head_dim
            fwd_k = kernel_us(fwd, h, d, hw, False)
            bwd_k = kernel_us(bwd, h, d, hw, True) + bwd_extra_us(rows, rows, shape, hw)
            for m, mode in enumerate(modes):
                train = mode == "train"
                ph = _single_phases(hw, shape, train, batch.context_len, rows, fwd_k,
                                    bwd_k if train else 0.0)  # fmt: skip
                _store_phases(out, (a, b, m), ph)
    return out


def _store_phases(out: dict, idx: tuple, ph: dict) -> None:
    """Write the phases ``ph`` at ``out[c][idx]`` and their sum, in PHASE_COLUMNS order (the
    order every path sums in, so the totals agree to the bit), at ``out["total_ms"][idx]``."""
    total = 0.0
    for c in PHASE_COLUMNS:
        if c != "total_ms":
            out[c][idx] = ph[c]
            total = total + ph[c]
    out["total_ms"][idx] = total
