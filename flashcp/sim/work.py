"""The work the simulator prices, item by item: :func:`work_account`.

The step model (:mod:`flashcp.sim.cost`) turns a plan into time as *work x unit costs*:
kernel calls over tile counts, memory-bound ops (launches and bytes), host dispatches, collective
and point-to-point calls and bytes. This module reads the work back out of the model itself, so
that it can be held against what an op really issues
(:func:`flashcp.executors.work_trace.trace_work`), and nothing here restates a pricing formula.

How: every term of the model is linear in its unit costs, so the model is evaluated on *probe*
profiles, copies of the given one whose unit costs are 0 or 1 (:func:`probe_profile`):

* ``launch_us = 1`` and every other cost 0: a memory-bound term counts its launches, a kernel
  term its calls;
* ``copy_bw_gbps`` such that ``copy_us(b) = b``: memory-bound terms give their bytes (read +
  written);
* ``host_op_us = 1`` (or ``collective_host_us``, ``doc_host_us``): the host terms count their
  dispatches (or documents of a Python loop);
* ``collective_latency_us = 1``: collective terms count their calls.

Where the model keeps per-rank, per-step arrays (the ring family's
:meth:`~flashcp.sim.cost.PlanCost.ring_terms`), the account keeps them; where it keeps
only the slowest rank's value (the all-gather and all-to-all phases), the account holds that
value (``rank_max``). Tile statistics and query / key rows are the model's own
(:class:`~flashcp.sim.kernel.TileStats` of the plan). Communication bytes are
:func:`flashcp.comm.comm_volume`'s, split over the calls the model prices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from flashcp.comm import AttnShape, check_mode, comm_volume, ring_grad_hops
from flashcp.plan import Plan
from flashcp.sim.hardware import HardwareProfile, load_hardware

__all__ = ["PHASES", "WorkAccount", "probe_profile", "work_account"]

PHASES = ("fwd", "bwd")

#: every unit cost of a profile that a probe sets to 0 unless asked otherwise
_COSTS = (
    "launch_us", "host_op_us", "collective_host_us", "ring_step_fwd_us", "ring_step_bwd_us",
    "doc_host_us", "fwd_cta_overhead_us", "bwd_cta_overhead_us", "collective_latency_us",
    "p2p_latency_us", "bwd_extra_kernels",
)  # fmt: skip
_HUGE = 1e15  # a bandwidth or throughput whose time terms vanish (GB/s, TFLOP/s)


def probe_profile(hw: HardwareProfile, **unit) -> HardwareProfile:
    """``hw`` with every unit cost 0 (bandwidths and throughputs huge) except those in ``unit``.

    ``copy_bytes=True`` makes ``copy_us(b) = b`` (bytes read + written become µs). Tile shapes,
    the SM count and every other structural constant stay ``hw``'s, so tile counts are the same.

    Raises:
        ValueError: an unknown unit name.
    """
    bad = set(unit) - set(_COSTS) - {"copy_bytes"}
    if bad:
        raise ValueError(f"unknown probe unit(s) {sorted(bad)}; choose from {_COSTS}")
    over = {name: 0 for name in _COSTS}
    over.update(
        copy_bw_gbps=1e-3 if unit.pop("copy_bytes", False) else _HUGE,
        peak_tflops=_HUGE, fwd_tile_tflops=_HUGE, bwd_tile_tflops=_HUGE,
        allgather_busbw_gbps=_HUGE, reducescatter_busbw_gbps=_HUGE, alltoall_busbw_gbps=_HUGE,
        p2p_bw_gbps=_HUGE,
        nccl_slowdown=1.0,
    )  # fmt: skip
    over.update(unit)
    return dataclasses.replace(hw, **over)


@dataclass
class WorkAccount:
    """The work :class:`~flashcp.sim.cost.PlanCost` prices for one plan, shape and mode.

    Attributes:
        method, impl, mode: what was priced; cp_size: N.
        per_step: ``(phase, item) -> (steps, N)`` float64 arrays ``[t, r]`` (ring family: the
            ring steps; one row otherwise). Items: ``kernel_calls``, ``q_rows`` / ``kv_rows``
            (query and key rows of the step's kernels, per head), ``ctas`` / ``tiles`` /
            ``max_tiles`` (their tile statistics, per head and call), and for the ring family
            ``mem_ops`` / ``mem_bytes`` (memory-bound launches and their bytes read + written),
            ``host_ops`` (host dispatches) and ``doc_loops`` (documents of a Python loop).
        rank_max: ``(phase, item) -> float``: the slowest rank's value where the model keeps only
            that (``mem_ops``, ``mem_bytes``, ``host_ops``, ``kernel_calls`` of the all-gather and
            all-to-all phases).
        comm: ``(phase, kind) -> (calls, bytes per call)`` per rank, kind ``allgather``,
            ``reducescatter``, ``alltoall``, ``p2p`` (a ring exchange), ``p2p_grad`` (a dK/dV hop).
        heads: query heads of one kernel call (H/u for a head-parallel group, the group's
            share for the all-gather op's head groups).
        inner_rank: (N,) the rank of the inner plan each rank runs (hybrids: r // u; else r).
    """

    method: str
    impl: str
    mode: str
    cp_size: int
    per_step: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)
    rank_max: dict[tuple[str, str], float] = field(default_factory=dict)
    comm: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)
    heads: int = 0
    inner_rank: np.ndarray | None = None

    def total(self, phase: str, item: str) -> np.ndarray:
        """(N,) per-rank total of a ``per_step`` item over steps, in this plan's ranks."""
        arr = self.per_step[(phase, item)]
        if item == "max_tiles":
            return arr.max(axis=0)[self.inner_rank]
        return arr.sum(axis=0)[self.inner_rank]


def _ring_account(cost, shape: AttnShape, train: bool, acc: WorkAccount) -> None:
    """The ring family's per-[t, r] terms (:meth:`PlanCost.ring_terms` on probe profiles)."""
    hw = cost.hw
    launched = cost.ring_masks()[0].astype(np.float64)
    probes = {
        "count": probe_profile(hw, launch_us=1),
        "bytes": probe_profile(hw, copy_bytes=True),
        "host": probe_profile(hw, host_op_us=1),
        "docs": probe_profile(hw, doc_host_us=1),
    }
    for phase in PHASES[: 1 + train]:
        terms = {k: cost.with_hardware(p).ring_terms(shape, phase) for k, p in probes.items()}
        stats = cost.fwd if phase == "fwd" else cost.bwd
        acc.per_step[(phase, "kernel_calls")] = launched
        for item in ("ctas", "tiles", "max_tiles"):
            acc.per_step[(phase, item)] = np.asarray(getattr(stats, item), dtype=np.float64)
        acc.per_step[(phase, "q_rows")] = cost.q_rows.astype(np.float64)
        acc.per_step[(phase, "kv_rows")] = cost.kv_rows.astype(np.float64)
        acc.per_step[(phase, "mem_ops")] = terms["count"][1]
        acc.per_step[(phase, "mem_bytes")] = terms["bytes"][1]
        acc.per_step[(phase, "host_ops")] = terms["host"][2]
        acc.per_step[(phase, "doc_loops")] = terms["docs"][2]


def _phase_split(cost, shape: AttnShape, mode: str, probe: HardwareProfile, column: str):
    """``{phase: value}`` of one step column on a probe profile (backward = train - infer)."""
    c = cost.with_hardware(probe)
    f = c.step(shape, "infer")[column] * 1e3
    if mode == "infer":
        return {"fwd": f}
    return {"fwd": f, "bwd": c.step(shape, "train")[column] * 1e3 - f}


def _step_account(cost, shape: AttnShape, mode: str, acc: WorkAccount) -> None:
    """Phase-level terms of a non-ring step (all-gather or all-to-all): the slowest rank's
    memory-bound launches, their bytes, host dispatches and collective host calls; kernel calls
    and the backward kernel's extra launches (GQA dK/dV sum) from the attention columns."""
    hw = cost.hw
    for item, probe in (
        ("mem_ops", probe_profile(hw, launch_us=1)),
        ("mem_bytes", probe_profile(hw, copy_bytes=True)),
        ("host_ops", probe_profile(hw, host_op_us=1)),
        ("collective_host", probe_profile(hw, collective_host_us=1)),
    ):
        for phase, v in _phase_split(cost, shape, mode, probe, "others_ms").items():
            acc.rank_max[(phase, item)] = float(v)
    c = cost.with_hardware(probe_profile(hw, launch_us=1))
    calls = {"fwd": c.step(shape, "infer")["attn_fwd_ms"] * 1e3}
    if mode == "train":  # the backward's calls are the forward's; the rest are extra launches
        calls["bwd"] = calls["fwd"]
        acc.rank_max[("bwd", "kernel_extra_launches")] = (
            c.step(shape, "train")["attn_bwd_ms"] * 1e3 - calls["fwd"]
        )
    for phase in PHASES[: 1 + (mode == "train")]:
        acc.rank_max[(phase, "kernel_calls")] = calls[phase]
        stats = cost.fwd if phase == "fwd" else cost.bwd
        k = round(calls[phase])  # every call of the phase has the same segments (head groups)
        for item in ("ctas", "tiles", "max_tiles"):
            x = np.asarray(getattr(stats, item), float)[None, :]
            acc.per_step[(phase, item)] = x if item == "max_tiles" else k * x
        acc.per_step[(phase, "q_rows")] = k * np.asarray(cost.q_rows, float)[None, :]
        acc.per_step[(phase, "kv_rows")] = k * np.asarray(cost.kv_rows, float)[None, :]
        acc.per_step[(phase, "kernel_calls")] = np.full((1, cost.n), float(k))


def _collective_calls(cost, shape, mode, kinds) -> dict:
    """``{(phase, kind): calls}`` of the blocking collectives, from a latency probe."""
    probe = probe_profile(cost.hw, collective_latency_us=1)
    out = {}
    for kind in kinds:
        for phase, v in _phase_split(cost, shape, mode, probe, f"{kind}_ms").items():
            out[(phase, kind)] = round(v)
    return out


def _hybrid_alltoall(cost, shape: AttnShape, train: bool, acc: WorkAccount) -> None:
    """The all-to-alls of a hybrid's u-rank groups and the copies around them (slowest rank)."""
    hw = cost.hw
    for item, probe, col in (
        ("a2a_mem_ops", probe_profile(hw, launch_us=1), "others_ms"),
        ("a2a_mem_bytes", probe_profile(hw, copy_bytes=True), "others_ms"),
        ("a2a_host_ops", probe_profile(hw, host_op_us=1), "others_ms"),
        ("a2a_collective_host", probe_profile(hw, collective_host_us=1), "others_ms"),
        ("alltoall", probe_profile(hw, collective_latency_us=1), "alltoall_ms"),
    ):
        p = cost.with_hardware(probe)
        f = p._alltoall_phases(shape, False, cost.u, 0.0, 0.0, kernels=False)[col] * 1e3
        vals = {"fwd": f}
        if train:
            full = p._alltoall_phases(shape, True, cost.u, 0.0, 0.0, kernels=False)[col]
            vals["bwd"] = full * 1e3 - f
        for phase, v in vals.items():
            if item == "alltoall":
                acc.comm[(phase, "alltoall")] = (round(v), float("nan"))
            else:
                acc.rank_max[(phase, item)] = float(v)


def work_account(
    plan: Plan,
    shape: AttnShape,
    mode: str,
    hw: HardwareProfile | str | dict = "h100_sxm",
    impl: str = "ours",
    comm_kind: str | None = None,
    keep_gathered_kv: bool = False,
    grad_comm_dtype: str | None = None,
) -> WorkAccount:
    """The simulator's account of the work of one attention layer's step of ``plan``.

    Args:
        plan: a valid plan; shape: heads, KV heads, head_dim, dtype; mode: ``train`` / ``infer``.
        hw: the profile whose tile shapes (and head-group budget) the model uses; unit costs
            do not matter (they are replaced by probes).
        impl: ``ours`` or ``ring_flash_attn`` (:mod:`flashcp.sim.impl`).
        comm_kind: default ``COMM_KIND[plan.method]``.
        keep_gathered_kv, grad_comm_dtype: the all-gather op's options
            (:class:`~flashcp.sim.cost.PlanCost`).
    Returns:
        a :class:`WorkAccount` (its attributes say what each entry counts).
    Raises:
        ValueError: as :func:`flashcp.sim.cost.simulate`, or ``impl="ring_flash_attn"``
            for a method it runs with all-gathers (``llama3``).
    """
    from flashcp.sim.cost import PlanCost
    from flashcp.sim.cost.units import _check_comm_kind

    check_mode(mode)
    hw = load_hardware(hw)
    kind = _check_comm_kind(plan, comm_kind)
    if impl != "ours" and kind != "p2p_ring":
        raise ValueError(
            f"work_account reads impl={impl!r} only as a ring: its {plan.method} step overlaps "
            "each head group's gather with the previous kernel, so its terms do not separate"
        )
    cost = PlanCost(
        plan, hw, kind, impl, keep_gathered_kv=keep_gathered_kv, grad_comm_dtype=grad_comm_dtype
    )
    n = plan.cp_size
    train = mode == "train"
    acc = WorkAccount(plan.method, impl, mode, n, inner_rank=np.arange(n))
    inner, ishape = cost, shape
    if cost.inner is not None:  # a hybrid: the inner method on the group plan, H/u heads
        inner, ishape = cost.inner, cost._hybrid_shape(shape)
        acc.inner_rank = np.arange(n) // cost.u
        _hybrid_alltoall(cost, shape, train, acc)
        vol, vol_f = (comm_volume(plan, kind, shape, m) for m in (mode, "infer"))
        a2a = {
            "fwd": vol_f["alltoall_bytes"],
            "bwd": vol["alltoall_bytes"] - vol_f["alltoall_bytes"],
        }
        for (phase, k), (calls, _) in list(acc.comm.items()):
            acc.comm[(phase, k)] = (calls, a2a[phase] / calls if calls else 0.0)
    vol, vol_f = (
        comm_volume(plan, kind, shape, m, grad_comm_dtype, keep_gathered_kv, impl)
        for m in (mode, "infer")
    )
    if inner.comm_kind == "p2p_ring" and not inner.single:  # cp_size 1: one call, no ring
        _ring_account(inner, ishape, train, acc)
        hops = inner.n - 1
        if hops:
            fwd = vol_f["p2p_bytes"]
            acc.comm[("fwd", "p2p")] = (hops, fwd / hops)
            if train:  # dK/dV: N - 1 hops (ours) or N (ring-flash-attn): comm.ring_grad_hops
                grad = ring_grad_hops(inner.n, impl)
                acc.comm[("bwd", "p2p")] = (hops, fwd / hops)
                acc.comm[("bwd", "p2p_grad")] = (grad, (vol["p2p_bytes"] - 2 * fwd) / grad)
    else:
        _step_account(inner, ishape, mode, acc)
        kinds = ("alltoall",) if inner.comm_kind == "alltoall" else ("allgather", "reducescatter")
        total = {
            ("fwd", "allgather"): vol_f["allgather_bytes"],
            ("bwd", "allgather"): vol["allgather_bytes"] - vol_f["allgather_bytes"],
            ("bwd", "reducescatter"): vol["reducescatter_bytes"],
            ("fwd", "alltoall"): vol_f["alltoall_bytes"],
            ("bwd", "alltoall"): vol["alltoall_bytes"] - vol_f["alltoall_bytes"],
        }
        for key, calls in _collective_calls(inner, ishape, mode, kinds).items():
            if calls:
                acc.comm[key] = (calls, total[key] / calls)
    acc.heads = ishape.num_heads
    return acc
