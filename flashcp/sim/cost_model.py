"""Per-method step model: one attention layer's CP step on a hardware profile (``executor=sim``).

The result has every column of :data:`flashcp.results.PHASE_COLUMNS` (milliseconds) and of
:data:`flashcp.results.COMM_COLUMNS` (bytes one rank receives, from
:func:`flashcp.comm.comm_volume`; never recomputed here). Synchronous phases are decided by the
slowest rank. Training is forward + backward; inference is the forward only.

**All-gather family** (``allgather_full``: ``llama3``, ``per_doc``; ``allgather_sharded``:
``flashcp``). Every rank runs one varlen call over its shards: shard (p, s) is the segment
q_len = s, kv_len = p + s, causal bottom-right (DESIGN.md §2).

* forward: all-gather of KV, then attention;
* backward (training): all-gather of KV again (KV is not kept between passes), attention backward,
  reduce-scatter of dK/dV. Each collective costs ``latency + recv_bytes / (busbw * falloff)``
  (:meth:`HardwareProfile.collective_us`); ``allgather_ms`` sums the forward and backward ones.
* ``others_ms``, data copies (bytes read + written over ``copy_bw_gbps`` plus one launch per
  copy): every segment with p > 0 assembles its contiguous KV ``[0, p + s)`` (p + s tokens); a
  segment with p = 0 (a Whole-Doc document, a first chunk) reads its local KV in place.
  ``allgather_full`` takes it from the full gathered KV with one copy per such shard;
  ``allgather_sharded`` takes it from the compact buffer with one copy per non-last shard it
  needs (the earlier shards of its document), and also packs the rank's non-last shards into
  the compact send buffer (one copy per such shard), whereas the full all-gather sends the
  rank's local buffer as it is. Training repeats gather and pack for the
  backward all-gather and scatters dK/dV back (the gather's copies again) before the
  reduce-scatter.
* ``total_ms`` = allgather + attn_fwd + attn_bwd + reducescatter + others (no overlap assumed).

**Ring family** (``p2p_ring``: ``ring``, ``zigzag``). Step t = 0..N-1: rank r attends its local
queries to the KV block of rank (r - t) mod N while receiving the next block (N - 1 P2P steps of
``comm_volume``'s bytes / (N - 1) each). Segments per (step, rank, document): at t = 0 one causal
segment over the rank's own tokens of the document; at t >= 1 one full rectangle of the local
pieces that see any of the source's pieces against the source pieces they see (this is exact for
the ring and zigzag layouts, where pieces of different ranks never interleave within such a
pair). A step launches a kernel unless the whole source block lies after the local block in the
packed sequence (block-level causal skip: ``ring`` skips t > r; ``zigzag`` never skips, and its
empty half-blocks simply have no tiles). Each t >= 1 step merges partial outputs by LSE
(``lse_merge_kernels`` launches; fp32 ``out`` read + written, the block's output and LSEs read).
The backward step runs the attention backward and accumulates dQ, dK, dV (``grad_accum_kernels``)
while dK/dV and KV travel on (``comm_volume``'s backward bytes / (N - 1) per step). Per step, with
``compute_t = max_r(attention + merge)``:

    pass time = sum_{t < N-1} max(compute_t, p2p_step) + compute_{N-1}

``attn_fwd_ms`` / ``attn_bwd_ms`` = sum over steps of the slowest rank's attention;
``others_ms`` = the merge/accumulation share of ``compute_t``; ``p2p_ms`` = P2P time not hidden
behind compute. So ``total_ms`` = sum of the phase columns for every method.

Not modelled (all methods alike): overlap of the all-gather with other work, SMs taken by NCCL
kernels while they overlap attention, host-side launch overhead (assumed hidden by asynchronous
launches), and the early-exiting CTAs of a varlen grid sized by the longest segment.

Speed: a plan's tile counts, segment lists and copy counts do not depend on heads, head_dim,
dtype or mode; :func:`simulate_many` computes them once and then prices each (shape, mode) with a
few numpy operations on (N,) or (N, N) arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flashcp.comm import AttnShape, check_mode, comm_volume
from flashcp.plan import Plan
from flashcp.registry import COMM_KIND
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS
from flashcp.sim.hardware import HardwareProfile, load_hardware
from flashcp.sim.kernel import TileStats, bwd_extra_us, bwd_tile_counts, fwd_tile_counts, kernel_us

__all__ = ["COMM_KINDS", "PlanCost", "simulate", "simulate_many"]

COMM_KINDS = ("allgather_full", "allgather_sharded", "p2p_ring")


def _check_comm_kind(plan: Plan, comm_kind: str | None) -> str:
    if comm_kind is None:
        if plan.method not in COMM_KIND:
            raise ValueError(
                f"plan method {plan.method!r} has no default comm_kind; pass one of {', '.join(COMM_KINDS)}"
            )
        return COMM_KIND[plan.method]
    if comm_kind not in COMM_KINDS:
        raise ValueError(f"unknown comm_kind {comm_kind!r}; choose one of {', '.join(COMM_KINDS)}")
    return comm_kind


def _stats(keys: np.ndarray, size: int, ctas, tiles, mx) -> TileStats:
    """Sum CTAs and tiles and max the largest CTA per key; (size,) float64 arrays.

    ``keys`` must be sorted (non-decreasing), in ``[0, size)``.
    """
    if keys.size == 0:
        z = np.zeros(size)
        return TileStats(z, z, z)
    head = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]]))
    out = []
    for arr, red in ((ctas, np.add), (tiles, np.add), (mx, np.maximum)):
        dense = np.zeros(size)
        dense[keys[head]] = red.reduceat(arr, head)
        out.append(dense)
    return TileStats(*out)


class PlanCost:
    """Everything about one plan the step model needs that does not depend on shape or mode.

    Build once per (plan, hardware, comm_kind) and call :meth:`step` per (shape, mode).

    Attributes (all-gather family; (N,) arrays indexed by rank): ``fwd``, ``bwd`` (:class:`TileStats`
    of the rank's one varlen call), ``q_rows``, ``kv_rows`` (tokens), ``gather_copies``,
    ``gather_tokens``, ``pack_copies``, ``pack_tokens``.
    Ring family: the same tile statistics as (N_steps, N) arrays indexed ``[t, r]``, plus
    ``launched`` (bool, a kernel is launched even without tiles) and ``q_rows``/``kv_rows`` per step.
    """

    def __init__(self, plan: Plan, hw: HardwareProfile, comm_kind: str) -> None:
        self.plan = plan
        self.hw = hw
        self.comm_kind = comm_kind
        self.n = plan.cp_size
        if comm_kind == "p2p_ring":
            self._init_ring()
        else:
            self._init_allgather()

    # ---- all-gather family -------------------------------------------------------------------
    def _init_allgather(self) -> None:
        plan, hw, n = self.plan, self.hw, self.n
        rank, start, length = plan.rank, plan.start, plan.length
        kv = start + length
        causal = np.ones(rank.size, dtype=bool)
        self.fwd = _stats(
            rank, n, *fwd_tile_counts(length, kv, causal, hw.fwd_block_q, hw.fwd_block_k)
        )
        self.bwd = _stats(
            rank, n, *bwd_tile_counts(length, kv, causal, hw.bwd_block_q, hw.bwd_block_k)
        )
        self.q_rows = np.bincount(rank, weights=length, minlength=n)
        self.kv_rows = np.bincount(rank, weights=kv, minlength=n)
        has_prefix = start > 0
        self.gather_tokens = np.bincount(rank, weights=np.where(has_prefix, kv, 0), minlength=n)
        if self.comm_kind == "allgather_full":
            # one copy per shard (with a prefix) out of the full gathered KV
            self.gather_copies = np.bincount(rank, weights=has_prefix, minlength=n)
        else:
            # one copy per non-last shard a segment needs: the earlier shards of its document
            order = np.lexsort((start, plan.doc))
            d_sorted = plan.doc[order]
            first = np.ones(d_sorted.size, dtype=bool)
            first[1:] = d_sorted[1:] != d_sorted[:-1]
            idx = np.arange(d_sorted.size)
            earlier = np.empty(d_sorted.size, dtype=np.int64)
            earlier[order] = idx - np.maximum.accumulate(np.where(first, idx, 0))
            self.gather_copies = np.bincount(rank, weights=earlier, minlength=n)
        if self.comm_kind == "allgather_sharded":
            not_last = ~plan.is_last
            self.pack_copies = np.bincount(rank, weights=not_last, minlength=n)
            self.pack_tokens = np.bincount(rank, weights=np.where(not_last, length, 0), minlength=n)
        else:  # the rank's whole local KV buffer is the all-gather input
            self.pack_copies = np.zeros(n)
            self.pack_tokens = np.zeros(n)

    def _copy_us(self, copies: np.ndarray, tokens: np.ndarray, shape: AttnShape) -> np.ndarray:
        """(N,) µs of ``copies`` launches moving the KV of ``tokens`` tokens (read + write)."""
        hw = self.hw
        return copies * hw.launch_us + hw.copy_us(2.0 * shape.kv_bytes(tokens))

    def _step_allgather(
        self, shape: AttnShape, train: bool, vol: dict[str, int]
    ) -> dict[str, float]:
        hw, n = self.hw, self.n
        h, d = shape.num_heads, shape.head_dim
        n_ag = 2 if train else 1
        ag_call = vol["allgather_bytes"] / n_ag
        total_scale = n / (n - 1) if n > 1 else 1.0
        ag_us = n_ag * hw.collective_us(ag_call, ag_call * total_scale, hw.allgather_busbw_gbps)
        rs = vol["reducescatter_bytes"]
        rs_us = hw.collective_us(rs, rs * total_scale, hw.reducescatter_busbw_gbps)
        fwd_us = float(kernel_us(self.fwd, h, d, hw, False).max())
        gather = self._copy_us(self.gather_copies, self.gather_tokens, shape)
        pack = self._copy_us(self.pack_copies, self.pack_tokens, shape)
        others_us = float((gather + pack).max())
        bwd_us = 0.0
        if train:
            bwd = kernel_us(self.bwd, h, d, hw, True) + bwd_extra_us(
                self.q_rows, self.kv_rows, shape, hw
            )
            bwd_us = float(bwd.max())
            others_us += float((2.0 * gather + pack).max())
        return {
            "allgather_ms": ag_us / 1e3,
            "attn_fwd_ms": fwd_us / 1e3,
            "attn_bwd_ms": bwd_us / 1e3,
            "reducescatter_ms": rs_us / 1e3,
            "p2p_ms": 0.0,
            "others_ms": others_us / 1e3,
        }

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
            fwd[0][1:], fwd[1][1:], fwd[2][1:] = fq.sum(2), (fq * fk).sum(2), fk.max(2)
            bwd[0][1:], bwd[1][1:], bwd[2][1:] = bk.sum(2), (bq * bk).sum(2), bq.max(2)
            self.q_rows[1:] = qs.sum(2)
            self.kv_rows[1:] = ks.sum(2)
        self.fwd = TileStats(*fwd)
        self.bwd = TileStats(*bwd)
        # block-level causal skip: launch unless the source block starts after the local one ends
        cu = np.concatenate([[0], np.cumsum(plan.doc_lens)])
        pos = cu[doc] + start
        lo = np.full(n, np.iinfo(np.int64).max)
        hi = np.zeros(n, dtype=np.int64)
        np.minimum.at(lo, rank, pos)
        np.maximum.at(hi, rank, pos + length)
        r = np.arange(n)
        src = (r[None, :] - r[:, None]) % n  # [t, r] -> source rank
        self.launched = lo[src] < hi[None, :]
        self.launched[0] = True

    def _ring_pass(
        self, compute: np.ndarray, attn: np.ndarray, p2p_us: float
    ) -> tuple[float, float, float]:
        """Compose one ring pass from per-step, per-rank compute and attention (µs, (N, N)).

        Returns ``(attention, others, exposed_p2p)`` in µs summing to the pass time.
        """
        c_t = compute.max(axis=1)
        a_t = attn.max(axis=1)
        steps = np.maximum(c_t[:-1], p2p_us).sum() + c_t[-1]
        return float(a_t.sum()), float(c_t.sum() - a_t.sum()), max(0.0, float(steps - c_t.sum()))

    def _step_ring(
        self, shape: AttnShape, train: bool, vol: dict[str, int], fwd_p2p: int
    ) -> dict[str, float]:
        hw, n = self.hw, self.n
        h, hkv, d, e = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.dtype_bytes
        steps = max(n - 1, 1)
        empty_launch = np.where(self.launched & (self.fwd.ctas == 0), hw.launch_us, 0.0)
        attn_f = kernel_us(self.fwd, h, d, hw, False) + empty_launch
        merge_rows = self.q_rows.copy()
        merge_rows[0] = 0
        merge = np.where(
            merge_rows > 0,
            hw.lse_merge_kernels * hw.launch_us + hw.copy_us(merge_rows * h * (d * (8 + e) + 12)),
            0.0,
        )
        fa, fo, fp = self._ring_pass(attn_f + merge, attn_f, hw.p2p_us(fwd_p2p / steps))
        ba = bo = bp = 0.0
        if train:
            attn_b = (
                kernel_us(self.bwd, h, d, hw, True)
                + bwd_extra_us(self.q_rows, self.kv_rows, shape, hw)
                + empty_launch
            )
            acc_bytes = (self.q_rows * h + self.kv_rows * 2 * hkv) * d * (8 + e)
            # step 0 writes the gradients directly; later steps accumulate into them
            acc_rows = self.q_rows.copy()
            acc_rows[0] = 0
            accum = np.where(
                acc_rows > 0, hw.grad_accum_kernels * hw.launch_us + hw.copy_us(acc_bytes), 0.0
            )
            bwd_p2p = (vol["p2p_bytes"] - fwd_p2p) / steps
            ba, bo, bp = self._ring_pass(attn_b + accum, attn_b, hw.p2p_us(bwd_p2p))
        return {
            "allgather_ms": 0.0,
            "attn_fwd_ms": fa / 1e3,
            "attn_bwd_ms": ba / 1e3,
            "reducescatter_ms": 0.0,
            "p2p_ms": (fp + bp) / 1e3,
            "others_ms": (fo + bo) / 1e3,
        }

    # ---- public ------------------------------------------------------------------------------
    def step(self, shape: AttnShape, mode: str) -> dict[str, float]:
        """Phase times (ms) and communication bytes of one step for ``shape`` and ``mode``.

        Raises:
            ValueError: unknown mode.
        """
        check_mode(mode)
        train = mode == "train"
        vol = comm_volume(self.plan, self.comm_kind, shape, mode)
        if self.comm_kind == "p2p_ring":
            fwd_p2p = vol["p2p_bytes"]
            if train:
                fwd_p2p = comm_volume(self.plan, self.comm_kind, shape, "infer")["p2p_bytes"]
            out = self._step_ring(shape, train, vol, fwd_p2p)
        else:
            out = self._step_allgather(shape, train, vol)
        out["total_ms"] = (
            out["allgather_ms"]
            + out["attn_fwd_ms"]
            + out["attn_bwd_ms"]
            + out["reducescatter_ms"]
            + out["p2p_ms"]
            + out["others_ms"]
        )
        for col in COMM_COLUMNS:
            out[col] = vol[col]
        return {k: out[k] for k in (*PHASE_COLUMNS, *COMM_COLUMNS)}


def simulate(
    plan: Plan,
    shape: AttnShape,
    hw: HardwareProfile | str | dict,
    mode: str,
    comm_kind: str | None = None,
) -> dict[str, float]:
    """Simulate one attention layer's CP step of ``plan``.

    Args:
        plan: a valid plan.
        shape: heads, KV heads, head_dim, dtype.
        hw: a :class:`HardwareProfile` (or a profile name / dict for :func:`load_hardware`).
        mode: ``train`` (forward + backward) or ``infer`` (forward only).
        comm_kind: ``allgather_full``, ``allgather_sharded`` or ``p2p_ring``; default
            ``COMM_KIND[plan.method]``.
    Returns:
        Every column of ``PHASE_COLUMNS`` (ms, floats; ``total_ms`` is their sum) and of
        ``COMM_COLUMNS`` (bytes one rank receives, ints, from :func:`flashcp.comm.comm_volume`).
    Raises:
        ValueError: unknown mode, comm_kind or hardware profile.
    """
    check_mode(mode)
    kind = _check_comm_kind(plan, comm_kind)
    return PlanCost(plan, load_hardware(hw), kind).step(shape, mode)


def simulate_many(
    plan: Plan,
    shapes: Sequence[AttnShape],
    modes: Sequence[str],
    hw: HardwareProfile | str | dict,
    comm_kind: str | None = None,
) -> list[dict[str, float]]:
    """:func:`simulate` for every (shape, mode) pair, sharing the per-plan work.

    Returns:
        One dict per pair, in the order ``[(s, m) for s in shapes for m in modes]`` (shape-major),
        with the same numbers :func:`simulate` gives.
    Raises:
        ValueError: as :func:`simulate`.
    """
    for m in modes:
        check_mode(m)
    cost = PlanCost(plan, load_hardware(hw), _check_comm_kind(plan, comm_kind))
    return [cost.step(s, m) for s in shapes for m in modes]
