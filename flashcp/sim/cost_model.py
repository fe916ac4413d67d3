"""Per-method step model: one attention layer's CP step on a hardware profile (``executor=sim``).

The result has every column of :data:`flashcp.results.PHASE_COLUMNS` (milliseconds) and of
:data:`flashcp.results.COMM_COLUMNS` (bytes one rank receives, from
:func:`flashcp.comm.comm_volume`; never recomputed here). :func:`simulate` prices one plan
(:class:`PlanCost`, the reference), :func:`price_plans` many plans x hardware profiles x shapes x
modes at once (:class:`PlanBatch`, equal to the reference to 1e-12, and to the bit where the
kernels of :mod:`flashcp.sim.price_kernels` run). What each family launches and how a phase is
priced (two queues, overlap, the all-gather, ring and all-to-all families, cp_size 1):
docs/simulator.md ("The step model, per family").
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
from collections.abc import Sequence

import numpy as np

from flashcp import compiled
from flashcp.comm import (
    AttnShape,
    check_keep_gathered_kv_kind,
    check_mode,
    comm_volume,
    grad_comm_bytes,
)
from flashcp.plan import Plan, cu_seqlens
from flashcp.plan.head_parallel import one_group_documents
from flashcp.registry import COMM_KIND
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS
from flashcp.sim.hardware import HardwareProfile, interp_loglog_v, load_hardware
from flashcp.sim.impl import AG_GROUP_BUDGET_BYTES, RFA_HEADS_K_STRIDE, check_impl, impl_ops
from flashcp.sim.kernel import (
    TileStats,
    bwd_extra_us,
    bwd_tile_counts,
    fwd_tile_counts,
    kernel_us,
    tile_us,
)

__all__ = [
    "COMM_KINDS", "PlanBatch", "PlanCost", "attention_balance", "overlap_us", "price_plans",
    "simulate", "simulate_many", "step_many",
]  # fmt: skip

COMM_KINDS = ("allgather_full", "allgather_sharded", "p2p_ring", "alltoall")
#: the largest cp_size the compiled ring statistics take (runs of shards as int64 bit masks
#: over the ranks); larger ones run the NumPy reference
RING_KERNEL_MAX_N = 62
#: the most bytes :func:`price_plans` lets one batch of ring-family plans take
#: (:func:`ring_price_bytes`): larger groups are priced in consecutive chunks of plans, with the
#: same numbers (each plan's statistics and phases are its own); 1 GiB
PRICE_BATCH_BYTES = 1 << 30


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


def overlap_us(compute, comm, hw: HardwareProfile):
    """Device time of ``compute`` µs of work overlapped with ``comm`` µs of communication.

    ``overlap_fraction`` (φ) of the communication runs beside the compute and the rest after it;
    while they run together the compute progresses at ``1 / nccl_slowdown`` (s). With
    ``c = φ * comm``: compute takes ``s * compute`` if that fits inside c, else
    ``compute + c * (1 - 1/s)``; the result is ``max(c, compute') + (1 - φ) * comm``.

    Returns:
        ``(time, compute')``: arrays broadcast from the inputs, µs.
    """
    comm = np.asarray(comm, dtype=np.float64)
    c = hw.overlap_fraction * comm
    s = hw.nccl_slowdown
    slowed = np.where(compute * s <= c, compute * s, compute + c * (1.0 - 1.0 / s))
    return np.maximum(c, slowed) + (1.0 - hw.overlap_fraction) * comm, slowed


def _op_us(hw: HardwareProfile, count, nbytes):
    """Device µs of ``count`` memory-bound launches moving ``nbytes`` (read + write)."""
    return count * hw.launch_us + hw.copy_us(nbytes)


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


def _alltoall_phases(
    hw: HardwareProfile,
    shape: AttnShape,
    train: bool,
    degree: int,
    t,
    fwd_k,
    bwd_k,
    *,
    kernels: bool = True,
    pad=1,
) -> dict:
    """:meth:`PlanCost._alltoall_phases` with T = ``t`` rows per rank and kernel times ``fwd_k``,
    ``bwd_k`` µs: scalars, or (S,) arrays for S plans (phase times in ms, ``total_ms`` left
    out). ``kernels``: the kernels run in this stage (Ulysses; a hybrid's are its inner op's);
    ``pad``: 1 where the forward pads the output before gathering heads (scalar or (S,))."""
    from flashcp.plan.head_parallel import ulysses_heads

    u = degree
    heads = ulysses_heads(shape.num_heads, shape.num_kv_heads, u)
    e, d = shape.dtype_bytes, shape.head_dim
    r = heads.kv_replication
    rep_kv = r > 1
    qkv = t * (shape.num_heads + 2 * r * shape.num_kv_heads) * d * e  # send buffer, bytes
    o = t * shape.num_heads * d * e
    frac = (u - 1) / u

    def a2a(nbytes):
        if u == 1:
            return 0.0
        if np.ndim(nbytes) == 0:
            return hw.alltoall_us(frac * nbytes, nbytes)
        return _collective_us_v(hw, frac * nbytes, nbytes, hw.alltoall_busbw_gbps, "all_gather")

    colls = hw.collective_host_us if u > 1 else 0.0
    kern = 1 if kernels else 0
    # KV heads replicated (two copies), q, k, v packed (a cat and its transposed copy: two passes
    # over the buffer) and split back (one copy per tensor), the output padded (``pad``) and,
    # when a rank holds several heads, the gathered output transposed into place
    many_q = int(heads.heads_per_rank > 1)
    rep = _op_us(hw, 2, 2 * t * shape.num_kv_heads * d * e * (1 + r)) if rep_kv else 0.0
    copies_f = rep + _op_us(hw, 5, 6 * qkv) + _op_us(hw, pad + many_q, (pad + many_q) * 2 * o)
    ops_f = 2 * rep_kv + 5 + pad + many_q
    comm_f = a2a(qkv) + a2a(o)
    host_f = (ops_f + kern) * hw.host_op_us + 2 * colls
    dev_f = copies_f + comm_f + fwd_k
    out = {
        "allgather_ms": 0.0,
        "attn_fwd_ms": fwd_k / 1e3,
        "attn_bwd_ms": 0.0,
        "reducescatter_ms": 0.0,
        "p2p_ms": 0.0,
        "alltoall_ms": comm_f / 1e3,
        "others_ms": (copies_f + np.maximum(host_f - dev_f, 0.0)) / 1e3,
    }
    if not train:
        return out
    acc = grad_comm_bytes(shape)  # compute dtype: whole gradients leave the kernel in it
    cast = int(acc != e)  # a dtype conversion is a real op (bf16 / fp16 in a float32 compute)
    # dK/dV send buffer: model dtype, or partial sums in grad_comm_dtype when replicated
    kvb = e if r == 1 else acc
    dkv = 2 * t * r * shape.num_kv_heads * d * kvb
    rows = u * t
    q_el = rows * heads.heads_per_rank * d  # this rank's dQ elements (every row of the group)
    kv_el = rows * 2 * heads.kv_heads_per_rank * d  # its dK/dV elements
    # the kernel's gradients: in the compute dtype from Ulysses' own kernel, in the model dtype
    # from a hybrid's inner op
    gb = acc if kernels else e
    # dO packed (cat, transposed copy); dq cast to the model dtype (Ulysses) and padded; dK, dV
    # concatenated, cast to the send dtype where it differs, padded
    dq_cast = cast if kernels else 0
    kv_cast = int(gb != kvb)
    copies_b = _op_us(hw, 2, 4 * o)
    copies_b += _op_us(hw, dq_cast, dq_cast * q_el * (acc + e)) + _op_us(hw, 1, 2 * q_el * e)
    copies_b += _op_us(hw, 1, 2 * kv_el * gb) + _op_us(hw, kv_cast, kv_cast * kv_el * (gb + kvb))
    copies_b += _op_us(hw, 1, 2 * kv_el * kvb)
    # the gathered dQ (several heads) and dK/dV transposed into place, the fold's reshape (several
    # KV heads), the replicas summed in the send dtype and cast once to the model dtype
    many_kv = int(heads.kv_heads_per_rank > 1)
    copies_b += _op_us(hw, many_q, many_q * 2 * o) + _op_us(
        hw, 1 + many_kv, (1 + many_kv) * 2 * dkv
    )
    out_kv = 2 * t * shape.num_kv_heads * d  # dk, dv elements returned
    if rep_kv:
        copies_b += _op_us(hw, 1, dkv + out_kv * kvb)
        copies_b += _op_us(hw, cast, cast * out_kv * (kvb + e))
    ops_b = 2 + dq_cast + 1 + 1 + kv_cast + 1 + many_q + 1 + many_kv + rep_kv * (1 + cast)
    comm_b = a2a(o) + a2a(o) + a2a(dkv)
    host_b = (ops_b + kern) * hw.host_op_us + 3 * colls
    dev_b = copies_b + comm_b + bwd_k
    out["attn_bwd_ms"] = bwd_k / 1e3
    out["alltoall_ms"] += comm_b / 1e3
    out["others_ms"] += (copies_b + np.maximum(host_b - dev_b, 0.0)) / 1e3
    return out


def _single_phases(hw: HardwareProfile, shape: AttnShape, train: bool, t, r, fwd_k, bwd_k):
    """One device (cp_size 1, :mod:`flashcp.ops.single_device`): one varlen call per pass over
    the whole documents (kernels of ``fwd_k`` / ``bwd_k`` µs), no communication. With pad rows
    (r document rows of t) the output is padded (one copy) and the backward narrows dO and pads
    dQ, dK, dV (four copies). Scalars or (S,) arrays; phase times in ms, ``total_ms`` left out."""
    pad = (np.asarray(r) < np.asarray(t)).astype(np.float64)
    e, d = shape.dtype_bytes, shape.head_dim
    q_row, kv_row = shape.num_heads * d * e, shape.num_kv_heads * d * e
    copies_f = _op_us(hw, pad, pad * (r + t) * q_row)
    host_f = (1 + pad) * hw.host_op_us
    out = {c: 0.0 for c in PHASE_COLUMNS if c != "total_ms"}
    out["attn_fwd_ms"] = fwd_k / 1e3
    out["others_ms"] = (copies_f + np.maximum(host_f - copies_f - fwd_k, 0.0)) / 1e3
    if train:
        copies_b = _op_us(hw, 4 * pad, pad * (r + t) * 2 * (q_row + kv_row))
        host_b = (1 + 4 * pad) * hw.host_op_us
        out["attn_bwd_ms"] = bwd_k / 1e3
        out["others_ms"] = (
            out["others_ms"] + (copies_b + np.maximum(host_b - copies_b - bwd_k, 0.0)) / 1e3
        )
    return out


class PlanCost:
    """Everything about one plan the step model needs that does not depend on shape or mode.

    Build once per (plan, hardware, comm_kind, impl) and call :meth:`step` per (shape, mode).
    ``keep_gathered_kv``: the all-gather op's option (``impl="ours"`` only; ValueError elsewhere).

    Attributes (all-gather family; (N,) arrays indexed by rank): ``fwd``, ``bwd`` (:class:`TileStats`
    of the rank's one varlen call), ``q_rows``, ``kv_rows``, ``send_rows`` (tokens).
    Ring family: the same tile statistics as (N_steps, N) arrays indexed ``[t, r]``, plus
    ``launched`` (bool, a kernel is launched even without tiles) and ``q_rows``/``kv_rows`` per step.
    """

    def __init__(
        self, plan: Plan, hw: HardwareProfile, comm_kind: str, impl: str = "ours", *,
        one_device: bool = True, keep_gathered_kv: bool = False,
    ) -> None:  # fmt: skip
        check_impl(plan.method, impl)
        _check_keep(plan, comm_kind, impl, keep_gathered_kv)
        self.keep = bool(keep_gathered_kv)
        self.plan = plan
        self.hw = hw
        self.comm_kind = comm_kind
        self.impl = impl
        self.n = plan.cp_size
        self.num_docs = plan.num_docs
        self._masks: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        #: the ring runs in :func:`flashcp.ops.ring_attn.ring_attention`, which cuts pad rows
        #: off (False for a hybrid's inner ring: the hybrid handles its pad)
        self.cuts_pad = True
        self._fwd_memo: dict[AttnShape, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        #: head-parallel hybrid (ulysses_degree u > 1 with KV moved across groups): the inner
        #: method's cost on the group plan, for H/u heads (:meth:`_step_hybrid`)
        self.u = plan.ulysses_degree if comm_kind != "alltoall" else 1
        self.inner: PlanCost | None = None
        #: cp_size 1 with every document whole (every registry plan at N = 1): every method's op
        #: runs one plain varlen call (:mod:`flashcp.ops.single_device`), priced the same
        #: (``one_device=False``: a hybrid's inner op on its group plan, which the hybrid runs
        #: itself at one super-rank)
        self.one_device = one_device
        self.single = one_device and impl == "ours" and plan.single_device_documents() is not None
        self.plain_ulysses = False
        if self.single:
            self.u = 1
            self._init_alltoall()
            return
        #: a hybrid with one group (u = N) is plain Ulysses, as its op runs it
        #: (:func:`flashcp.plan.head_parallel.one_group_documents`): priced as ``alltoall``
        self.plain_ulysses = comm_kind != "alltoall" and one_group_documents(plan) is not None
        if self.plain_ulysses:
            self.u = 1
            self._init_alltoall()
            return
        if self.u > 1:
            self.inner = PlanCost(plan.group_plan(), hw, comm_kind, impl, one_device=False)
            self.inner.cuts_pad = False
            return
        if comm_kind == "p2p_ring":
            self.ops = impl_ops(impl, plan.method)
            self._init_ring()
        elif comm_kind == "alltoall":
            self._init_alltoall()
        else:
            self._init_allgather()

    def with_hardware(self, hw: HardwareProfile) -> PlanCost:
        """This plan's cost on another profile, reusing the tile counts when its tile shapes are
        the same (a shallow copy; only ``hw`` changes), else rebuilt."""
        blocks = ("fwd_block_q", "fwd_block_k", "bwd_block_q", "bwd_block_k")
        if any(getattr(hw, b) != getattr(self.hw, b) for b in blocks):
            return PlanCost(
                self.plan, hw, self.comm_kind, self.impl, one_device=self.one_device,
                keep_gathered_kv=self.keep,
            )  # fmt: skip
        other = copy.copy(self)
        other.hw = hw
        other._fwd_memo = {}  # forward compute depends on the profile's constants
        if self.inner is not None:
            other.inner = self.inner.with_hardware(hw)
        return other

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
        # rows a rank puts in the all-gather: all its rows (full) or its non-last shards' rows
        self.send_rows = (
            self.q_rows
            if self.comm_kind == "allgather_full"
            else np.bincount(rank, weights=np.where(~plan.is_last, length, 0), minlength=n)
        )

    def attention_us(self, shape: AttnShape, train: bool) -> tuple[np.ndarray, np.ndarray]:
        """Per-rank device µs of the attention kernels alone (no communication, no copies, no
        contention), forward and backward: (N,) arrays for the all-gather family, (N_steps, N)
        for the ring family (plus its merges and accumulations, which the ring issues between
        kernels; not the device's idle waits after stream syncs, which the step adds). The one
        model of each layout's compute, used by the step model and by Fig. 3.
        """
        if self.inner is not None:
            return self.inner.attention_us(self._hybrid_shape(shape), train)
        if self.comm_kind == "alltoall" or self.plain_ulysses or self.single:
            return self._alltoall_kernels_us(shape, train)
        if self.comm_kind == "p2p_ring":
            f, fo, *_ = self._ring_fwd_compute(shape)
            if not train:
                return f + fo, np.zeros_like(f)
            b, bo, *_ = self._ring_bwd_compute(shape)
            return f + fo, b + bo
        h, d = shape.num_heads, shape.head_dim
        fwd = kernel_us(self.fwd, h, d, self.hw, False)
        if not train:
            return fwd, np.zeros_like(fwd)
        bwd = kernel_us(self.bwd, h, d, self.hw, True) + bwd_extra_us(
            self.q_rows, self.kv_rows, shape, self.hw
        )
        return fwd, bwd

    def _step_allgather(
        self, shape: AttnShape, train: bool, vol: dict[str, int]
    ) -> dict[str, float]:
        """The project's all-gather op (:mod:`flashcp.ops.allgather_attn`), KV heads in groups:
        per group, build the source buffer (local K/V copied in, send rows packed), all-gather,
        one index gather of every segment's keys, the kernel, outputs copied into place; backward
        the same, then dK/dV scatter-added (fp32) into a zeroed buffer, reduce-scattered and added
        to the local rows. Groups run one after another (no overlap)."""
        if self.impl == "ring_flash_attn":
            return self._step_rfa_llama3(shape, train, vol)
        # one implementation of the formulas, vectorised over plans (here: one plan)
        out = _step_allgather_batch([self], shape, "train" if train else "infer")
        return {c: float(out[c][0]) for c in PHASE_COLUMNS if c != "total_ms"}

    def _step_rfa_llama3(
        self, shape: AttnShape, train: bool, vol: dict[str, int]
    ) -> dict[str, float]:
        """ring-flash-attn's llama3: per head group, gather K and V, overlap the next group's
        gather with this group's kernel (module docstring)."""
        hw, n = self.hw, self.n
        h, hkv, d, e = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.dtype_bytes
        stride = max(k for k in range(1, min(RFA_HEADS_K_STRIDE, hkv) + 1) if hkv % k == 0)
        groups = hkv // stride
        gshape = AttnShape(h // groups, stride, d, shape.dtype)
        total_scale = n / (n - 1) if n > 1 else 1.0
        # one all-gather call carries K (or V) of one head group
        ag_call_bytes = vol["allgather_bytes"] / (2 if train else 1) / (2 * groups)
        ag_call = hw.allgather_us(ag_call_bytes, ag_call_bytes * total_scale)
        ag_group = 2 * ag_call
        local = self.q_rows  # (N,) tokens per rank
        slice_copy = 2 * (hw.launch_us + hw.copy_us(2.0 * local * stride * d * e))  # .contiguous()
        fwd_k = kernel_us(self.fwd, gshape.num_heads, d, hw, False)
        dev = ag_group + slice_copy  # group 0's slices and gathers, exposed
        attn_f = np.zeros(n)
        for g in range(groups):
            nxt = ag_group + slice_copy if g + 1 < groups else 0.0
            t, slowed = overlap_us(fwd_k, nxt, hw)
            dev = dev + t
            attn_f = attn_f + slowed
        cat = 2 * hw.launch_us + hw.copy_us(2.0 * local * h * d * e)  # torch.cat of out (and lse)
        dev_f = dev + cat
        host_f = groups * (2 * hw.collective_host_us + 3 * hw.host_op_us) + 2 * hw.host_op_us
        exposed_ag_f = ag_group
        others_f = dev_f - attn_f - exposed_ag_f
        out = {
            "allgather_ms": exposed_ag_f / 1e3,
            "attn_fwd_ms": float(attn_f.max()) / 1e3,
            "attn_bwd_ms": 0.0,
            "reducescatter_ms": 0.0,
            "p2p_ms": 0.0,
            "alltoall_ms": 0.0,
            "others_ms": float((others_f + np.maximum(host_f - dev_f, 0.0)).max()) / 1e3,
        }
        if not train:
            return out
        # its dK/dV buffers are in the model dtype: the same bytes as one all-gather pass
        rs_call_bytes = vol["allgather_bytes"] / 2 / (2 * groups)
        rs_call = hw.reducescatter_us(rs_call_bytes, rs_call_bytes * total_scale)
        gathered = n * local.max()
        zero = hw.launch_us + hw.copy_us(2.0 * gathered * stride * d * e)  # dkv_buffer.zero_()
        place = 2 * (hw.launch_us + hw.copy_us(2.0 * local * stride * d * e))  # dk[:, i:i+s] = dk_i
        bwd_k = kernel_us(self.bwd, gshape.num_heads, d, hw, True) + bwd_extra_us(
            self.q_rows, self.kv_rows, gshape, hw
        )
        dev = ag_group + slice_copy
        attn_b = np.zeros(n)
        for g in range(groups):
            nxt = ag_group + slice_copy if g + 1 < groups else 0.0
            t, slowed = overlap_us(bwd_k, nxt, hw)
            dev = dev + zero + t + 2 * rs_call + place
            attn_b = attn_b + slowed
        host_b = groups * (4 * hw.collective_host_us + 6 * hw.host_op_us)
        others_b = dev - attn_b - ag_group - groups * 2 * rs_call
        out["allgather_ms"] += ag_group / 1e3
        out["attn_bwd_ms"] = float(attn_b.max()) / 1e3
        out["reducescatter_ms"] = groups * 2 * rs_call / 1e3
        out["others_ms"] += float((others_b + np.maximum(host_b - dev, 0.0)).max()) / 1e3
        return out

    # ---- head-parallel all-to-all (Ulysses) ---------------------------------------------------
    def _init_alltoall(self) -> None:
        """Ulysses (:mod:`flashcp.ops.ulysses_attn`): every rank runs one varlen call over every
        non-empty document, whole (q_len = kv_len = d, causal), for its H/N heads; the same call
        on every rank, so (N,) arrays of equal entries."""
        plan, hw, n = self.plan, self.hw, self.n
        d = plan.doc_lens[plan.doc_lens > 0]
        one = np.zeros(d.size, dtype=np.int64)
        causal = np.ones(d.size, dtype=bool)
        f = _stats(one, 1, *fwd_tile_counts(d, d, causal, hw.fwd_block_q, hw.fwd_block_k))
        b = _stats(one, 1, *bwd_tile_counts(d, d, causal, hw.bwd_block_q, hw.bwd_block_k))
        self.fwd = TileStats(*(np.repeat(x, n) for x in f))
        self.bwd = TileStats(*(np.repeat(x, n) for x in b))
        rows = float(d.sum())
        self.q_rows = self.kv_rows = np.full(n, rows)

    def _alltoall_heads(self, shape: AttnShape):
        from flashcp.plan.head_parallel import ulysses_heads

        heads = ulysses_heads(shape.num_heads, shape.num_kv_heads, self.n)
        local = AttnShape(
            heads.heads_per_rank, heads.kv_heads_per_rank, shape.head_dim, shape.dtype
        )
        return heads, local

    def _alltoall_kernels_us(self, shape: AttnShape, train: bool):
        """(N,) forward and backward kernel µs of the Ulysses call (H/N heads, whole documents)."""
        _, local = self._alltoall_heads(shape)
        d = shape.head_dim
        fwd = kernel_us(self.fwd, local.num_heads, d, self.hw, False)
        if not train:
            return fwd, np.zeros_like(fwd)
        bwd = kernel_us(self.bwd, local.num_heads, d, self.hw, True) + bwd_extra_us(
            self.q_rows, self.kv_rows, local, self.hw
        )
        return fwd, bwd

    def _hybrid_shape(self, shape: AttnShape) -> AttnShape:
        """The heads one rank of a head-parallel group attends with: H/u and r Hkv/u."""
        from flashcp.plan.head_parallel import ulysses_heads

        heads = ulysses_heads(shape.num_heads, shape.num_kv_heads, self.u)
        return AttnShape(heads.heads_per_rank, heads.kv_heads_per_rank, shape.head_dim, shape.dtype)

    def _step_hybrid(self, shape: AttnShape, mode: str) -> dict[str, float]:
        """A hybrid (``usp``, ``flashcp_ulysses``): the inner method's step on the group plan for
        H/u heads (its kernels, copies and cross-group communication), plus the all-to-alls of
        the u-rank groups around it (:meth:`_alltoall_phases` without kernels)."""
        out = self.inner.step(self._hybrid_shape(shape), mode)
        a2a = self._alltoall_phases(shape, mode == "train", self.u, 0.0, 0.0, kernels=False)
        return {c: out[c] + a2a[c] for c in PHASE_COLUMNS if c != "total_ms"}

    def _step_alltoall(
        self, shape: AttnShape, train: bool, vol: dict[str, int]
    ) -> dict[str, float]:
        """Ulysses on one rank (all ranks do the same work: the slowest is any of them):
        :meth:`_alltoall_phases` of the N-rank group around the kernels of
        :meth:`_alltoall_kernels_us`."""
        fwd_k, bwd_k = (float(x[0]) for x in self._alltoall_kernels_us(shape, train))
        return self._alltoall_phases(shape, train, self.n, fwd_k, bwd_k)

    def _alltoall_phases(
        self,
        shape: AttnShape,
        train: bool,
        degree: int,
        fwd_k: float,
        bwd_k: float,
        *,
        kernels: bool = True,
    ) -> dict[str, float]:
        """The all-to-alls of a head-parallel group of u = ``degree`` ranks around kernels of
        ``fwd_k`` / ``bwd_k`` µs (the same on every rank).

        Forward: KV heads replicated when num_kv_heads < u (two copies), q, k, v packed into one
        send buffer (a cat and its transposed copy), one all-to-all of T (H + 2 r Hkv) D
        elements, the received buffer split into q, k, v (three copies), the kernels, the output
        padded (one copy: Ulysses; a hybrid where a super-rank's rows fall short of u T), one
        all-to-all of T H D elements back and transposed into place (a copy when H/u > 1).
        Backward: dO packed (cat, transposed copy) and sent, the kernels, dQ cast (Ulysses:
        its kernel returns the compute dtype) and padded, dK/dV concatenated, cast to the send
        dtype where it differs and padded, two all-to-alls back (dQ, then dK/dV in their
        ``comm_volume`` dtype), the gathered dQ (H/u > 1) and dK/dV transposed into place, the
        fold's reshape (r Hkv/u > 1), the replicas summed and cast (r > 1). ``kernels``: the
        kernels run here (Ulysses; a hybrid's are its inner op's, priced there). An all-to-all of a rank's S-byte
        buffer receives (u-1)/u S bytes (:meth:`HardwareProfile.alltoall_us`). Copies move read +
        written bytes at ``copy_bw_gbps``; every op costs ``host_op_us`` on the host, every
        all-to-all ``collective_host_us``; T = C / N.
        """
        t = self.plan.context_len / self.plan.cp_size
        pad = 1 if kernels else self._hybrid_pad()
        out = _alltoall_phases(self.hw, shape, train, degree, t, fwd_k, bwd_k, kernels=kernels,
                               pad=pad)  # fmt: skip
        return {k: float(v) for k, v in out.items()}

    def _hybrid_pad(self) -> int:
        """1 when a hybrid's forward pads its output before gathering heads: the inner op's rows
        fall short of u T (the all-gather inner op runs on each super-rank's document rows, so
        some super-rank's; the ring on the block's, the most any super-rank holds)."""
        inner = self.inner
        if inner is None:
            return 0
        t = self.plan.context_len // self.plan.cp_size
        if inner.comm_kind == "p2p_ring":
            return int(inner.q_rows[0].max() < self.u * t)
        return int((inner.q_rows < self.u * t).any())

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
        docstring): every step but the last overlaps one hop of ``hop_us``; ``tail_us`` is exposed
        at the end (scalars, or (S,) arrays for S plans); ``idle`` (µs the device waits for the
        host after a stream sync) adds to the step's device time and is charged to others.

        Returns ``(attention, others, exposed_p2p)`` in µs summing to the pass time, shaped
        ``attn.shape[:-2]``.
        """
        compute = attn + other
        hop = np.zeros(attn.shape[:-1])
        hop[..., :-1] = np.asarray(hop_us, dtype=np.float64)[..., None]
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
        fwd_hop = hw.p2p_us(fwd_p2p / steps) if n > 1 else 0.0
        fwd = self._fwd_memo.get(shape)
        if fwd is None:  # training and inference of one shape share the forward
            fwd = self._fwd_memo[shape] = self._ring_fwd_compute(shape)
        fa, fo, fp = self._ring_pass(*fwd, fwd_hop, 0.0)
        ba = bo = bp = 0.0
        if train and n > 1:
            grad_hop = hw.p2p_us((vol["p2p_bytes"] - 2 * fwd_p2p) / steps)
            ba, bo, bp = self._ring_pass(
                *self._ring_bwd_compute(shape), fwd_hop + grad_hop, grad_hop
            )
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

    # ---- public ------------------------------------------------------------------------------
    def step(self, shape: AttnShape, mode: str) -> dict[str, float]:
        """Phase times (ms) and communication bytes of one step for ``shape`` and ``mode``.

        Raises:
            ValueError: unknown mode.
        """
        check_mode(mode)
        train = mode == "train"
        vol = comm_volume(self.plan, self.comm_kind, shape, mode, keep_gathered_kv=self.keep)
        if self.single:
            fwd_k, bwd_k = (float(x[0]) for x in self._alltoall_kernels_us(shape, train))
            t, r = self.plan.context_len, float(self.q_rows[0])
            out = {k: float(v) for k, v in _single_phases(self.hw, shape, train, t, r, fwd_k,
                                                          bwd_k).items()}  # fmt: skip
        elif self.inner is not None:
            out = self._step_hybrid(shape, mode)
        elif self.comm_kind == "alltoall" or self.plain_ulysses:
            out = self._step_alltoall(shape, train, vol)
        elif self.comm_kind == "p2p_ring":
            fwd_p2p = vol["p2p_bytes"]
            if train:
                fwd_p2p = comm_volume(self.plan, self.comm_kind, shape, "infer")["p2p_bytes"]
            out = self._step_ring(shape, train, vol, fwd_p2p)
        else:
            out = self._step_allgather(shape, train, vol)
        out["total_ms"] = math.fsum(out[c] for c in PHASE_COLUMNS if c != "total_ms")
        for col in COMM_COLUMNS:
            out[col] = vol[col]
        return {k: out[k] for k in (*PHASE_COLUMNS, *COMM_COLUMNS)}


def step_many(costs: Sequence[PlanCost], shape: AttnShape, mode: str) -> dict[str, np.ndarray]:
    """:meth:`PlanCost.step` of many plans at once: (S,) arrays per column, equal (to rounding,
    1e-12 relative) to ``[c.step(shape, mode) for c in costs]``.

    Plans of one cp_size, hardware profile and implementation are priced with one set of numpy
    operations: the ring family on (S, N, N) arrays through :class:`PlanCost`'s own ring methods,
    the all-gather family (``impl="ours"``) on (S, N) arrays by :func:`_step_allgather_batch`;
    other plans (ring-flash-attn's llama3) fall back to one :meth:`PlanCost.step` each.

    Returns:
        Every column of ``PHASE_COLUMNS`` (float64) and ``COMM_COLUMNS`` (int64), (S,) each.
    Raises:
        ValueError: unknown mode.
    """
    check_mode(mode)
    cols = (*PHASE_COLUMNS, *COMM_COLUMNS)
    if not costs:
        return {c: np.zeros(0) for c in cols}
    first = costs[0]
    same = all(
        c.hw is first.hw
        and c.n == first.n
        and c.comm_kind == first.comm_kind
        and c.keep == first.keep
        and c.inner is None
        and not c.plain_ulysses
        and not c.single
        for c in costs
    )
    if same and first.comm_kind == "p2p_ring" and all(c.ops == first.ops for c in costs):
        return _step_ring_batch(costs, shape, mode)
    if (
        same
        and first.comm_kind not in ("p2p_ring", "alltoall")
        and all(c.impl == "ours" for c in costs)
    ):
        return _step_allgather_batch(costs, shape, mode)
    steps = [c.step(shape, mode) for c in costs]
    return {c: np.array([s[c] for s in steps]) for c in cols}


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


class _PlanCostStack(PlanCost):
    """The ring statistics of S plans (same cp_size, hardware, implementation) stacked along a
    leading axis: (S, N, N) arrays, so :class:`PlanCost`'s ring methods (written for any leading
    axes) price all of them with one set of numpy operations."""

    def __init__(self, costs: Sequence[PlanCost]) -> None:
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
    costs: Sequence[PlanCost], shape: AttnShape, mode: str
) -> dict[str, np.ndarray]:
    """:meth:`PlanCost._step_ring` of S plans at once (:class:`_PlanCostStack`)."""
    first = costs[0]
    hw, kind = first.hw, first.comm_kind
    train = mode == "train"
    vols = [comm_volume(c.plan, kind, shape, mode) for c in costs]
    fwd_p2p = [
        comm_volume(c.plan, kind, shape, "infer")["p2p_bytes"] if train else v["p2p_bytes"]
        for c, v in zip(costs, vols, strict=True)
    ]
    p2p = np.array([v["p2p_bytes"] for v in vols])

    def p2p_us(nbytes):  # one plan at a time, as HardwareProfile prices it
        return np.array([hw.p2p_us(b) for b in nbytes])

    out = _ring_phases(_PlanCostStack(costs), shape, mode, p2p, np.array(fwd_p2p), p2p_us)
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
    fa, fo, fp = ring_pass(*fwd, fwd_hop, 0.0)
    zero = np.zeros(s)
    ba = bo = bp = zero
    if train and n > 1:
        grad_hop = p2p_us((np.asarray(p2p_bytes, dtype=np.float64) - 2 * fwd_p2p) / steps)
        bwd = _ring_compute(kernels, stack, shape, True)
        ba, bo, bp = ring_pass(*bwd, fwd_hop + grad_hop, grad_hop)
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
    :class:`_PlanCostStack`, by :func:`flashcp.sim.price_kernels.ring_compute_ours` (the same
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
    :func:`flashcp.sim.price_kernels.ring_pass` (the same numbers, to the bit)."""
    s = attn.shape[0]

    def dense(x):
        return np.ascontiguousarray(np.broadcast_to(np.asarray(x, dtype=np.float64), attn.shape))

    def per_plan(x):
        return np.ascontiguousarray(np.broadcast_to(np.asarray(x, dtype=np.float64), (s,)))

    hw = stack.hw
    out = kernels.ring_pass(
        dense(attn), dense(other), dense(host), dense(idle), per_plan(hop_us), per_plan(tail_us),
        float(hw.overlap_fraction), float(hw.nccl_slowdown),
    )  # fmt: skip
    return out[0], out[1], out[2]


def _step_allgather_batch(
    costs: Sequence[PlanCost], shape: AttnShape, mode: str
) -> dict[str, np.ndarray]:
    """The project's all-gather op (``ours``; :meth:`PlanCost._step_allgather` describes it) for S
    plans on (S, N) arrays (``c_(x)`` marks a per-plan value broadcast over ranks)."""
    first = costs[0]
    hw, n, kind = first.hw, first.n, first.comm_kind
    keep = first.keep
    vols = [comm_volume(c.plan, kind, shape, mode, keep_gathered_kv=keep) for c in costs]
    vol = {k: np.array([v[k] for v in vols], dtype=np.int64) for k in COMM_COLUMNS}
    local = np.stack([c.q_rows for c in costs])  # (S, N)
    kv_rows = np.stack([c.kv_rows for c in costs])
    send_max = np.stack([c.send_rows for c in costs]).max(axis=1)  # (S,)
    fwd = TileStats(*(np.stack([getattr(c.fwd, f) for c in costs]) for f in TileStats._fields))
    bwd = TileStats(*(np.stack([getattr(c.bwd, f) for c in costs]) for f in TileStats._fields))

    def coll(nbytes, total, busbw, op):  # one plan at a time, as HardwareProfile prices it
        return np.array(
            [hw.collective_us(b, t, busbw, op) for b, t in zip(nbytes, total, strict=True)]
        )

    out = _allgather_phases(hw, n, local, kv_rows, send_max, fwd, bwd, shape, mode, vol, coll, keep)
    phases = [out[c] for c in PHASE_COLUMNS if c != "total_ms"]
    out["total_ms"] = np.array([math.fsum(x) for x in zip(*phases, strict=True)])
    out.update(vol)
    return out


def _ag_head_groups(n, local, send_max, hkv: int, d: int):
    """KV-head groups of the project's all-gather op for S plans: ``(rows, hg, groups)``, (S,)
    each: gathered rows of one head, KV heads per group (the largest divisor of ``hkv`` whose fp32
    gradient buffer fits ``AG_GROUP_BUDGET_BYTES``, else 1) and the groups run one after another."""
    rows = local.max(axis=1) + n * send_max
    per_head = rows * 2 * d * 4
    hg = np.ones(len(send_max), dtype=np.int64)
    for k in range(1, hkv + 1):  # the largest divisor of hkv whose buffer fits (else 1)
        if hkv % k == 0:
            hg = np.where(k * per_head <= AG_GROUP_BUDGET_BYTES, k, hg)
    return rows, hg, hkv // hg


def _check_keep(plan: Plan, comm_kind: str, impl: str, keep_gathered_kv) -> None:
    """Raise ValueError where ``keep_gathered_kv`` is not a bool or has no op that keeps the KV
    (:func:`flashcp.comm.check_keep_gathered_kv_kind`; ``impl`` other than ``ours``)."""
    check_keep_gathered_kv_kind(plan, comm_kind, keep_gathered_kv)
    if keep_gathered_kv and impl != "ours":
        raise ValueError(f"keep_gathered_kv=True is an option of impl=ours, not impl={impl}")


def _allgather_phases(
    hw, n, local, kv_rows, send_max, fwd, bwd, shape, mode, vol, coll, keep=False
):  # fmt: skip
    """Phase times (ms; (S,) arrays, ``total_ms`` left out) of the project's all-gather op for S
    plans from their (S, N) statistics: ``local`` / ``kv_rows`` query and key rows per rank,
    ``send_max`` (S,) the largest rank's send rows, ``vol`` their communication bytes, ``coll``
    :meth:`HardwareProfile.collective_us` over arrays ``(recv_bytes, total_bytes, busbw, op)``;
    ``keep``: the backward reuses the forward's gathered KV (no source buffer, no all-gather)."""
    train = mode == "train"
    h, hkv, d, e = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.dtype_bytes
    op_us = functools.partial(_op_us, hw)
    rows, hg, groups = _ag_head_groups(n, local, send_max, hkv, d)
    qh = h // groups
    total_scale = n / (n - 1) if n > 1 else 1.0
    n_ag = 2 if train and not keep else 1
    ag_bytes = vol["allgather_bytes"] / n_ag / groups
    ag = coll(ag_bytes, ag_bytes * total_scale, hw.allgather_busbw_gbps, "all_gather")
    c_ = lambda a: a[:, None]  # noqa: E731  (S,) -> (S, 1)
    kernels = compiled.load("price")
    if kernels is not None:
        return _allgather_phases_compiled(
            kernels, hw, rows, hg, groups, qh, ag, ag_bytes, local, kv_rows, send_max, fwd, bwd,
            shape, train, vol, coll, total_scale, keep,
        )  # fmt: skip
    kv_el = 2.0 * hg * d
    build = op_us(4, local * c_(kv_el) * e * 2 + c_(send_max * kv_el * e * 3))
    keys = op_us(1, kv_rows * c_(kv_el) * e * 2)
    split = groups > 1
    fwd_k = kernel_us(fwd, c_(qh), d, hw, False)
    fwd_copies = build + keys + np.where(c_(split), op_us(3, local * c_(qh) * d * e * 4), 0.0)
    fwd_ops = 5 + np.where(split, 3, 0)  # build 4, keys 1; split: q heads in, out and lse out
    coll_host = np.where(ag_bytes > 0, hw.collective_host_us, 0.0)
    dev_f = c_(groups) * (c_(ag) + fwd_copies + fwd_k)
    host_f = groups * (coll_host + hw.host_op_us * (fwd_ops + 1))
    out = {
        "allgather_ms": groups * ag / 1e3,
        "attn_fwd_ms": (c_(groups) * fwd_k).max(axis=1) / 1e3,
        "attn_bwd_ms": np.zeros(len(send_max)),
        "reducescatter_ms": np.zeros(len(send_max)),
        "p2p_ms": np.zeros(len(send_max)),
        "alltoall_ms": np.zeros(len(send_max)),
        "others_ms": (c_(groups) * fwd_copies + np.maximum(c_(host_f) - dev_f, 0.0)).max(axis=1)
        / 1e3,
    }
    if train:
        rs_bytes = vol["reducescatter_bytes"] / groups
        rs = coll(rs_bytes, rs_bytes * total_scale, hw.reducescatter_busbw_gbps, "reduce_scatter")
        # bwd_extra_us for the group shape (qh query heads, hg KV heads), per plan
        nbytes = local * c_(qh) * (d * (3 * e + 8) + 4)
        gqa = c_(qh != hg)
        nbytes = np.where(gqa, nbytes + kv_rows * 2 * d * e * c_(qh + hg), nbytes)
        launches = hw.bwd_extra_kernels + np.where(gqa, 1, 0)
        extra = np.where(local > 0, launches * hw.launch_us + hw.copy_us(nbytes), 0.0)
        bwd_k = kernel_us(bwd, c_(qh), d, hw, True) + extra
        # dq into place, the zeroed fp32 dK/dV buffer, two scatter-adds, the reduce-scattered
        # rows added to the local ones (only when rows are sent), dk and dv copied out (two)
        sends = np.where(send_max > 0, 1, 0)
        grads = op_us(
            c_(6 + sends),
            local * c_(qh) * d * e * 2
            + c_(rows * kv_el * 4)
            + kv_rows * c_(kv_el) * 12
            + c_(send_max * kv_el * 12)
            + local * c_(kv_el) * (4 + e),
        )
        # with keep: no source buffer (its 4 ops), no all-gather
        bbuild, bag = (0.0, np.zeros_like(ag)) if keep else (build, ag)
        bwd_copies = (
            bbuild + keys + grads + np.where(c_(split), op_us(3, local * c_(qh) * d * e * 2), 0.0)
        )
        bwd_ops = 11 - 4 * keep + sends + np.where(split, 3, 0)
        dev_b = c_(groups) * (c_(bag) + bwd_copies + bwd_k + c_(rs))
        host_b = groups * ((1 if keep else 2) * coll_host + hw.host_op_us * (bwd_ops + 1))
        out["allgather_ms"] = out["allgather_ms"] + groups * bag / 1e3
        out["attn_bwd_ms"] = (c_(groups) * bwd_k).max(axis=1) / 1e3
        out["reducescatter_ms"] = groups * rs / 1e3
        out["others_ms"] = (
            out["others_ms"]
            + (c_(groups) * bwd_copies + np.maximum(c_(host_b) - dev_b, 0.0)).max(axis=1) / 1e3
        )
    return out


def _allgather_phases_compiled(
    kernels, hw, rows, hg, groups, qh, ag, ag_bytes, local, kv_rows, send_max, fwd, bwd, shape,
    train, vol, coll, total_scale, keep=False,
):  # fmt: skip
    """:func:`_allgather_phases` with its per-rank part in
    :func:`flashcp.sim.price_kernels.allgather_ranks` (the same numbers, to the bit); the
    per-plan collective times stay here."""
    s = len(send_max)
    zero = np.zeros(s)
    rs = zero
    if train:
        rs_bytes = vol["reducescatter_bytes"] / groups
        rs = coll(rs_bytes, rs_bytes * total_scale, hw.reducescatter_busbw_gbps, "reduce_scatter")
    coll_host = np.where(ag_bytes > 0, hw.collective_host_us, 0.0)
    d = shape.head_dim
    consts = np.array([
        hw.launch_us, hw.copy_bw_gbps * 1e3, hw.host_op_us, hw.bwd_extra_kernels,
        hw.fwd_cta_overhead_us, tile_us(hw, d, False), hw.bwd_cta_overhead_us,
        tile_us(hw, d, True), hw.num_sms,
    ], dtype=np.float64)  # fmt: skip

    def f64(x):
        return np.ascontiguousarray(x, dtype=np.float64)

    def i64(x):
        return np.ascontiguousarray(x, dtype=np.int64)

    res = kernels.allgather_ranks(
        f64(local), f64(kv_rows), f64(send_max), f64(rows), i64(hg), i64(groups), i64(qh),
        f64(np.broadcast_to(ag, (s,))), f64(np.broadcast_to(rs, (s,))), f64(coll_host),
        f64(np.stack(fwd)), f64(np.stack(bwd)), train, d, shape.dtype_bytes, consts, keep,
    )  # fmt: skip
    out = {
        "allgather_ms": groups * ag / 1e3,
        "attn_fwd_ms": res[0] / 1e3,
        "attn_bwd_ms": zero,
        "reducescatter_ms": zero,
        "p2p_ms": zero,
        "alltoall_ms": zero,
        "others_ms": res[1] / 1e3,
    }
    if train:
        out["allgather_ms"] = out["allgather_ms"] + groups * (0.0 if keep else ag) / 1e3
        out["attn_bwd_ms"] = res[2] / 1e3
        out["reducescatter_ms"] = groups * rs / 1e3
        out["others_ms"] = out["others_ms"] + res[3] / 1e3
    return out


def _check_sim_args(plans: Sequence, shapes: Sequence, modes: Sequence) -> None:
    """Raise ValueError naming the argument when ``plans`` are not :class:`Plan` objects,
    ``shapes`` not a sequence of :class:`AttnShape`, or ``modes`` not a sequence of known modes
    (a single string or shape where a sequence belongs would be read element by element)."""
    for name, seq in (("shapes", shapes), ("modes", modes)):
        if isinstance(seq, str | AttnShape):
            raise ValueError(f"{name} must be a sequence (e.g. [{seq!r}]), got {seq!r}")
    for plan in plans:
        if not isinstance(plan, Plan):
            raise ValueError(f"plans must be flashcp.plan.Plan objects, got {type(plan).__name__}")
    for shape in shapes:
        if not isinstance(shape, AttnShape):
            raise ValueError(f"shapes must be flashcp.comm.AttnShape objects, got {shape!r}")
    for m in modes:
        check_mode(m)


def simulate(
    plan: Plan,
    shape: AttnShape,
    hw: HardwareProfile | str | dict,
    mode: str,
    comm_kind: str | None = None,
    impl: str = "ours",
    keep_gathered_kv: bool = False,
) -> dict[str, float]:
    """Simulate one attention layer's CP step of ``plan``.

    Args:
        plan: a valid plan (for ``impl="ring_flash_attn"``, the plan of
            :func:`flashcp.sim.impl.impl_plan`).
        shape: heads, KV heads, head_dim, dtype.
        hw: a :class:`HardwareProfile` (or a profile name / dict for :func:`load_hardware`).
        mode: ``train`` (forward + backward) or ``infer`` (forward only).
        comm_kind: ``allgather_full``, ``allgather_sharded`` or ``p2p_ring``; default
            ``COMM_KIND[plan.method]``.
        impl: ``ours`` or ``ring_flash_attn`` (:mod:`flashcp.sim.impl`).
        keep_gathered_kv: the all-gather op's option (:class:`PlanCost`).
    Returns:
        Every column of ``PHASE_COLUMNS`` (ms, floats; ``total_ms`` is their sum) and of
        ``COMM_COLUMNS`` (bytes one rank receives, ints, from :func:`flashcp.comm.comm_volume`).
    Raises:
        ValueError: unknown mode, comm_kind, impl or hardware profile, an impl that does not
            run the plan's method, ``keep_gathered_kv`` where no op keeps the KV, or a plan or
            shape of another type.
    """
    _check_sim_args([plan], [shape], [mode])
    kind = _check_comm_kind(plan, comm_kind)
    cost = PlanCost(plan, load_hardware(hw), kind, impl, keep_gathered_kv=keep_gathered_kv)
    return cost.step(shape, mode)


def simulate_many(
    plan: Plan,
    shapes: Sequence[AttnShape],
    modes: Sequence[str],
    hw: HardwareProfile | str | dict,
    comm_kind: str | None = None,
    impl: str = "ours",
) -> list[dict[str, float]]:
    """:func:`simulate` for every (shape, mode) pair, sharing the per-plan work.

    Returns:
        One dict per pair, in the order ``[(s, m) for s in shapes for m in modes]`` (shape-major),
        with the same numbers :func:`simulate` gives.
    Raises:
        ValueError: as :func:`simulate`.
    """
    _check_sim_args([plan], shapes, modes)
    cost = PlanCost(plan, load_hardware(hw), _check_comm_kind(plan, comm_kind), impl)
    return [cost.step(s, m) for s in shapes for m in modes]


# ---- batched pricing: many plans x hardware profiles x shapes x modes in one call ------------
def _excl_cumsum(a: np.ndarray) -> np.ndarray:
    out = np.zeros(a.size, dtype=np.int64)
    np.cumsum(a[:-1], out=out[1:])
    return out


def _busbw_fraction_v(hw: HardwareProfile, total_bytes, op: str | None = None) -> np.ndarray:
    """:meth:`HardwareProfile.busbw_fraction` of every entry of ``total_bytes`` (the same
    table, :meth:`HardwareProfile.falloff_table`, and interpolation, elementwise)."""
    return interp_loglog_v(*hw.falloff_table(op), total_bytes)


def _collective_us_v(
    hw: HardwareProfile, recv_bytes, total_bytes, busbw_gbps: float, op: str | None = None
):
    """:meth:`HardwareProfile.collective_us` elementwise (float64 arrays)."""
    recv = np.asarray(recv_bytes, dtype=np.float64)
    bw = busbw_gbps * 1e3 * _busbw_fraction_v(hw, total_bytes, op)
    return np.where(recv <= 0, 0.0, hw.collective_latency_us + recv / bw)


def _p2p_us_v(hw: HardwareProfile, nbytes):
    """:meth:`HardwareProfile.p2p_us` elementwise (float64 arrays)."""
    nb = np.asarray(nbytes, dtype=np.float64)
    bw = hw.p2p_bw_gbps * 1e3 * _busbw_fraction_v(hw, nb)
    return np.where(nb <= 0, 0.0, hw.p2p_latency_us + nb / bw)


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
        :func:`flashcp.sim.price_kernels.ring_stats`)."""
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
        self, comm_kind: str, shape: AttnShape, mode: str, u: int, cp_size: int, keep=False
    ):  # fmt: skip
        """:func:`flashcp.comm.comm_volume` of every plan: (S,) int64 per column of
        ``COMM_COLUMNS``. This batch holds the plans across head-parallel groups (the group plans
        when ``u`` > 1, ``cp_size`` the original plans' N); ``keep``: ``keep_gathered_kv``."""
        key = ("volumes", comm_kind, shape, mode, u, cp_size, keep)
        if key not in self._stats:
            self._stats[key] = self._volumes(comm_kind, shape, mode, u, cp_size, keep)
        return dict(self._stats[key])

    def _volumes(
        self, comm_kind: str, shape: AttnShape, mode: str, u: int, cp_size: int, keep=False
    ):  # fmt: skip
        from flashcp.comm import alltoall_bytes
        from flashcp.plan import kv_bytes
        from flashcp.plan.head_parallel import ulysses_heads

        train = mode == "train"
        grad_elem = grad_comm_bytes(shape)
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
            grad = kv_bytes(self.tokens_full, kv_heads, d, grad_elem)
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
        mode: str, vol: dict[str, np.ndarray], keep=False,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """Phase times (ms, (S,) arrays, ``total_ms`` left out) of every plan of this batch, no
        head parallelism around them (:meth:`PlanCost.step`'s model); ``keep``:
        ``keep_gathered_kv``."""
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
                fwd_p2p = self.volumes(comm_kind, shape, "infer", 1, n)["p2p_bytes"]
            p2p_us = functools.partial(_p2p_us_v, hw)
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
            return _alltoall_phases(hw, shape, mode == "train", n, t, fwd_k, bwd_k)
        fwd, bwd, kv_rows = self.allgather(hw)
        send = self.q_rows if comm_kind == "allgather_full" else self.send_rows
        coll = functools.partial(_collective_us_v, hw)
        return _allgather_phases(
            hw, n, self.q_rows, kv_rows, send.max(axis=1), fwd, bwd, shape, mode, vol, coll, keep
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
            ``keep_gathered_kv`` where no op keeps the KV); a ring-family
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
            for k, p in zip(idx, members, strict=True):
                cost = PlanCost(p, hws[0], kind, impl)
                for a, hw in enumerate(hws):
                    c = cost if a == 0 else cost.with_hardware(hw)
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
                keep=bool(keep_gathered_kv),
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
    plans, kind, impl, method, u, hws, shapes, modes, batch=None, keep=False
) -> dict[str, np.ndarray]:
    """:func:`price_plans` of plans sharing (comm_kind, method, cp_size, Ulysses degree u), from
    ``batch`` (a :class:`PlanBatch` of exactly these plans, statistics kept) when given."""
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
            vol = batch.volumes(kind, shape, mode, a2a_u, n, keep)
            for a, hw in enumerate(hws):
                ph = batch.phases(hw, kind, impl, inner_method, inner_shape, mode, vol, keep)
                if u > 1:
                    t = batch.context_len / n
                    a2a = _alltoall_phases(hw, shape, mode == "train", u, t, 0.0, 0.0,
                                           kernels=False, pad=pad)  # fmt: skip
                    ph = {c: ph[c] + a2a[c] for c in ph}
                total = 0.0
                for c in PHASE_COLUMNS:
                    if c != "total_ms":
                        out[c][a, b, m] = ph[c]
                        total = total + ph[c]
                out["total_ms"][a, b, m] = total
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
                total = 0.0
                for c in PHASE_COLUMNS:
                    if c != "total_ms":
                        out[c][a, b, m] = ph[c]
                        total = total + ph[c]
                out["total_ms"][a, b, m] = total
    return out
