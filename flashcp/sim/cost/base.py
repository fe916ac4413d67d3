"""The per-plan step model: :class:`PlanCost` (one plan on one hardware profile, built of the
families' parts), :func:`simulate`, :func:`simulate_many` and :func:`step_many`; the reference the
batch is tested against (docs/simulator.md).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import numpy as np

from flashcp.comm import AttnShape, check_mode, comm_volume
from flashcp.plan import Plan
from flashcp.plan.head_parallel import one_group_documents
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS
from flashcp.sim.cost.allgather import (
    AllGatherCost,
    _check_grad_dtype,
    _check_keep,
    _step_allgather_batch,
)
from flashcp.sim.cost.alltoall import AllToAllCost
from flashcp.sim.cost.ring import RingCost, _step_ring_batch
from flashcp.sim.cost.units import _check_comm_kind, _check_sim_args, _single_phases
from flashcp.sim.hardware import HardwareProfile, load_hardware
from flashcp.sim.impl import check_impl, impl_ops
from flashcp.sim.network import FLAT, group_links, topology_for


class PlanCost(AllGatherCost, AllToAllCost, RingCost):
    """Everything about one plan the step model needs that does not depend on shape or mode.

    Build once per (plan, hardware, comm_kind, impl) and call :meth:`step` per (shape, mode).
    ``keep_gathered_kv``: the all-gather op's option (``impl="ours"`` only; ValueError elsewhere);
    ``grad_comm_dtype``: the all-gather op's dK/dV reduce-scatter dtype (a name of
    :data:`flashcp.comm.DTYPE_BYTES`, or None for the op's default, float32 for bf16 models;
    ``impl="ours"`` only), which sets the reduce-scatter's bytes (:func:`flashcp.comm.comm_volume`).
    ``topology``: a :class:`flashcp.topology.Topology` of the plan's cp_size, whose crossings
    (:func:`flashcp.sim.network.group_links`) price the exchanges on two levels; None (the
    default): one level, as a flat profile (``simulate`` derives it from the profile's
    ``gpus_per_node``). ``links``: the :class:`flashcp.sim.network.Links` themselves (a
    hybrid's inner op gets its parent's).

    Attributes (all-gather family; (N,) arrays indexed by rank): ``fwd``, ``bwd`` (:class:`TileStats`
    of the rank's one varlen call), ``q_rows``, ``kv_rows``, ``send_rows`` (tokens).
    Ring family: the same tile statistics as (N_steps, N) arrays indexed ``[t, r]``, plus
    ``launched`` (bool, a kernel is launched even without tiles) and ``q_rows``/``kv_rows`` per step.
    """

    def __init__(
        self, plan: Plan, hw: HardwareProfile, comm_kind: str, impl: str = "ours", *,
        one_device: bool = True, keep_gathered_kv: bool = False,
        grad_comm_dtype: str | None = None, topology=None, links=None,
    ) -> None:  # fmt: skip
        check_impl(plan.method, impl)
        if topology is not None and topology.cp_size != plan.cp_size:
            raise ValueError(
                f"topology cp_size {topology.cp_size} does not match the plan's {plan.cp_size}"
            )
        _check_keep(plan, comm_kind, impl, keep_gathered_kv)
        _check_grad_dtype(plan, comm_kind, impl, grad_comm_dtype)
        self.keep = bool(keep_gathered_kv)
        self.grad_dtype = grad_comm_dtype
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
        #: which exchanges cross nodes (flashcp.sim.network; FLAT: none, the one-level prices)
        self.links = FLAT if links is None else links
        if self.single:
            self.u = 1
            self._init_alltoall()
            return
        #: a hybrid with one group (u = N) is plain Ulysses, as its op runs it
        #: (:func:`flashcp.plan.head_parallel.one_group_documents`): priced as ``alltoall``
        self.plain_ulysses = comm_kind != "alltoall" and one_group_documents(plan) is not None
        if links is None and topology is not None:
            a2a_only = comm_kind == "alltoall" or self.plain_ulysses
            u = self.n if a2a_only else self.u
            self.links = group_links(topology, u, a2a_only)
        if self.plain_ulysses:
            self.u = 1
            self._init_alltoall()
            return
        if self.u > 1:
            self.inner = PlanCost(
                plan.group_plan(), hw, comm_kind, impl, one_device=False, links=self.links
            )
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
                keep_gathered_kv=self.keep, grad_comm_dtype=self.grad_dtype, links=self.links,
            )  # fmt: skip
        other = copy.copy(self)
        other.hw = hw
        other._fwd_memo = {}  # forward compute depends on the profile's constants
        if self.inner is not None:
            other.inner = self.inner.with_hardware(hw)
        return other

    # ---- public ------------------------------------------------------------------------------
    def step(self, shape: AttnShape, mode: str) -> dict[str, float]:
        """Phase times (ms) and communication bytes of one step for ``shape`` and ``mode``.

        Raises:
            ValueError: unknown mode.
        """
        check_mode(mode)
        train = mode == "train"
        vol = comm_volume(
            self.plan, self.comm_kind, shape, mode, self.grad_dtype, self.keep, self.impl
        )
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
                fwd_p2p = comm_volume(self.plan, self.comm_kind, shape, "infer", impl=self.impl)[
                    "p2p_bytes"
                ]
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
        and c.grad_dtype == first.grad_dtype
        and c.links == first.links
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


def simulate(
    plan: Plan,
    shape: AttnShape,
    hw: HardwareProfile | str | dict,
    mode: str,
    comm_kind: str | None = None,
    impl: str = "ours",
    keep_gathered_kv: bool = False,
    grad_comm_dtype: str | None = None,
    *,
    placement: str = "consecutive",
    nodes: int | None = None,
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
        keep_gathered_kv, grad_comm_dtype: the all-gather op's options (:class:`PlanCost`).
        placement, nodes: where the CP ranks sit on the profile's nodes
            (:func:`flashcp.sim.network.topology_for`; nodes None: as few as the placement
            allows); one node, or a flat profile, prices the one-level network.
    Returns:
        Every column of ``PHASE_COLUMNS`` (ms, floats; ``total_ms`` is their sum) and of
        ``COMM_COLUMNS`` (bytes one rank receives, ints, from :func:`flashcp.comm.comm_volume`).
    Raises:
        ValueError: unknown mode, comm_kind, impl or hardware profile, an impl that does not
            run the plan's method, ``keep_gathered_kv`` where no op keeps the KV, a plan or
            shape of another type, or a placement / node count that does not fit the profile's
            nodes (:func:`flashcp.sim.network.topology_for`).
    """
    _check_sim_args([plan], [shape], [mode])
    kind = _check_comm_kind(plan, comm_kind)
    hw = load_hardware(hw)
    topo = topology_for(hw, plan.cp_size, placement, nodes)
    cost = PlanCost(
        plan, hw, kind, impl, keep_gathered_kv=keep_gathered_kv,
        grad_comm_dtype=grad_comm_dtype, topology=topo,
    )  # fmt: skip
    return cost.step(shape, mode)


def simulate_many(
    plan: Plan,
    shapes: Sequence[AttnShape],
    modes: Sequence[str],
    hw: HardwareProfile | str | dict,
    comm_kind: str | None = None,
    impl: str = "ours",
    *,
    placement: str = "consecutive",
    nodes: int | None = None,
) -> list[dict[str, float]]:
    """:func:`simulate` for every (shape, mode) pair, sharing the per-plan work.

    Returns:
        One dict per pair, in the order ``[(s, m) for s in shapes for m in modes]`` (shape-major),
        with the same numbers :func:`simulate` gives.
    Raises:
        ValueError: as :func:`simulate`.
    """
    _check_sim_args([plan], shapes, modes)
    hw = load_hardware(hw)
    topo = topology_for(hw, plan.cp_size, placement, nodes)
    cost = PlanCost(plan, hw, _check_comm_kind(plan, comm_kind), impl, topology=topo)
    return [cost.step(s, m) for s in shapes for m in modes]
