"""Units shared by every family of the step model: overlap of communication with compute,
memory-bound ops, tile statistics, collectives and P2P over arrays of plans, the comm kinds,
and the step at cp_size 1 (docs/simulator.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flashcp.comm import AttnShape, check_mode
from flashcp.plan import Plan
from flashcp.registry import COMM_KIND
from flashcp.results import PHASE_COLUMNS
from flashcp.sim.hardware import HardwareProfile, interp_loglog_v
from flashcp.sim.kernel import (
    TileStats,
)

COMM_KINDS = ("allgather_full", "allgather_sharded", "p2p_ring", "alltoall")


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
