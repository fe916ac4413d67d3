"""The all-gather family of the step model (``allgather_full``: ``llama3``, ``per_doc``;
``allgather_sharded``: ``flashcp``): the per-plan step (:class:`AllGatherCost`) and the same
formulas on (S, N) arrays of plans (:func:`_step_allgather_batch`); docs/simulator.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from flashcp import compiled
from flashcp.comm import (
    DTYPE_BYTES,
    AttnShape,
    check_keep_gathered_kv_kind,
    comm_volume,
    grad_comm_bytes,
)
from flashcp.plan import Plan
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS
from flashcp.sim.cost.units import _op_us, _stats, overlap_us
from flashcp.sim.impl import AG_GROUP_BUDGET_BYTES, RFA_HEADS_K_STRIDE
from flashcp.sim.kernel import (
    TileStats,
    bwd_extra_us,
    bwd_tile_counts,
    fwd_tile_counts,
    kernel_us,
    tile_us,
)
from flashcp.sim.network import collective_us


class AllGatherCost:
    """The all-gather family's per-plan step (``allgather_full``, ``allgather_sharded``),
    a part of :class:`~flashcp.sim.cost.base.PlanCost` (its attributes are set there)."""

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
        links = self.links
        ag_call = collective_us(
            hw, links, ag_call_bytes, ag_call_bytes * total_scale, hw.allgather_busbw_gbps,
            "all_gather",
        )  # fmt: skip
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
        rs_call = collective_us(
            hw, links, rs_call_bytes, rs_call_bytes * total_scale, hw.reducescatter_busbw_gbps,
            "reduce_scatter",
        )  # fmt: skip
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


def _step_allgather_batch(
    costs: Sequence[AllGatherCost], shape: AttnShape, mode: str
) -> dict[str, np.ndarray]:
    """The project's all-gather op (``ours``; :meth:`PlanCost._step_allgather` describes it) for S
    plans on (S, N) arrays (``c_(x)`` marks a per-plan value broadcast over ranks)."""
    first = costs[0]
    hw, n, kind = first.hw, first.n, first.comm_kind
    keep, grad = first.keep, first.grad_dtype
    vols = [comm_volume(c.plan, kind, shape, mode, grad, keep_gathered_kv=keep) for c in costs]
    vol = {k: np.array([v[k] for v in vols], dtype=np.int64) for k in COMM_COLUMNS}
    local = np.stack([c.q_rows for c in costs])  # (S, N)
    kv_rows = np.stack([c.kv_rows for c in costs])
    send_max = np.stack([c.send_rows for c in costs]).max(axis=1)  # (S,)
    fwd = TileStats(*(np.stack([getattr(c.fwd, f) for c in costs]) for f in TileStats._fields))
    bwd = TileStats(*(np.stack([getattr(c.bwd, f) for c in costs]) for f in TileStats._fields))

    links = first.links

    def coll(nbytes, total, busbw, op):  # one plan at a time, as HardwareProfile prices it
        return np.array(
            [collective_us(hw, links, b, t, busbw, op) for b, t in zip(nbytes, total, strict=True)]
        )

    out = _allgather_phases(
        hw, n, local, kv_rows, send_max, fwd, bwd, shape, mode, vol, coll, keep, grad
    )
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


def _check_grad_dtype(plan: Plan, comm_kind: str, impl: str, grad_comm_dtype) -> None:
    """Raise ValueError unless ``grad_comm_dtype`` is None, or a dtype name
    (:data:`flashcp.comm.DTYPE_BYTES`) for a plan the project's all-gather op runs (all-gather comm
    kind, no head parallelism, ``impl="ours"``): the only op whose reduction dtype the simulator
    takes as an option (its ``grad_comm_dtype``)."""
    if grad_comm_dtype is None:
        return
    if grad_comm_dtype not in DTYPE_BYTES:
        raise ValueError(
            f"unknown grad_comm_dtype {grad_comm_dtype!r}; choose one of {', '.join(DTYPE_BYTES)}"
        )
    if (
        comm_kind not in ("allgather_full", "allgather_sharded")
        or plan.ulysses_degree > 1
        or impl != "ours"
    ):
        raise ValueError(
            f"grad_comm_dtype={grad_comm_dtype} is an option of the all-gather op family "
            f"(impl=ours); a {plan.method} plan (comm_kind {comm_kind}, impl {impl}, "
            f"ulysses_degree {plan.ulysses_degree}) is not run by it"
        )


def _allgather_phases(
    hw, n, local, kv_rows, send_max, fwd, bwd, shape, mode, vol, coll, keep=False, grad=None
):  # fmt: skip
    """Phase times (ms; (S,) arrays, ``total_ms`` left out) of the project's all-gather op for S
    plans from their (S, N) statistics: ``local`` / ``kv_rows`` query and key rows per rank,
    ``send_max`` (S,) the largest rank's send rows, ``vol`` their communication bytes, ``coll``
    :meth:`HardwareProfile.collective_us` over arrays ``(recv_bytes, total_bytes, busbw, op)``;
    ``keep``: the backward reuses the forward's gathered KV (no source buffer, no all-gather);
    ``grad``: ``grad_comm_dtype``. Where it differs from the op's accumulation dtype (fp32 for
    16-bit models) the op casts the gathered rows' dK/dV to it before the reduce-scatter
    (``dsource[t:].to(gdt)``: N x send_max rows) and the received rows back
    (``rs_out.to(acc)``: send_max rows, the largest rank's), two more ops per head group."""
    train = mode == "train"
    h, hkv, d, e = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.dtype_bytes
    acc_b = grad_comm_bytes(shape)  # the accumulation dtype's bytes (the default comm dtype)
    comm_b = grad_comm_bytes(shape, grad)
    cast = float(comm_b) if comm_b != acc_b else 0.0  # 0: no cast (the send rows are a view)
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
            shape, train, vol, coll, total_scale, keep, cast, float(acc_b),
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
        if cast:  # dK/dV of the send rows cast to grad_comm_dtype and the received rows back
            bwd_copies = bwd_copies + op_us(
                c_(2 * sends), c_((n + 1) * send_max * kv_el * (acc_b + cast))
            )
            bwd_ops = bwd_ops + 2 * sends
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
    train, vol, coll, total_scale, keep=False, cast=0.0, acc_b=4.0,
):  # fmt: skip
    """:func:`_allgather_phases` with its per-rank part in
    :func:`flashcp.sim.cost.kernels.allgather_ranks` (the same numbers, to the bit); the
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
        cast, acc_b,
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
