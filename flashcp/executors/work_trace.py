"""What a CP op really issues, rank by rank: a dispatch-level work recorder.

:func:`trace_work` runs a plan's op (:func:`flashcp.ops.get_attn_op`, the code ``executor=dist``
runs) for every rank on one device: the ranks meet once in memory (the record pass of
:mod:`flashcp.executors.emulate`), then each rank is replayed alone, forward and backward, under a
:class:`torch.utils._python_dispatch.TorchDispatchMode` that sees every ATen op the rank issues.
Three kinds of event come out, in program order, each tagged with the pass (``fwd`` / ``bwd``) and
the ring step it falls in (the number of ring exchanges of that pass posted before it; 0 for the
ops without a ring):

* ``kernel``: one call of the backend's varlen entry (``VarlenBackend.forward`` / ``backward``),
  with its segments' query and key lengths and causal flag. The backend's own work inside the
  call (the CPU backend's dense blocks, the ``has_work`` short cut) is not recorded: on a GPU it
  is one FlashAttention-2 launch.
* ``comm``: a collective (``allgather``, ``reducescatter``, ``alltoall``) or a ring exchange
  (``p2p``), with the bytes this rank receives and the size of the group it ran in; the in-memory
  stand-in's own copies are not recorded.
* ``op``: any other ATen op, with its category (:data:`OP_CATEGORIES`: a device launch that moves
  memory, an allocation, a view, a host sync), the elements it writes and the bytes it reads plus
  writes (the rules of :func:`op_traffic`).

Nothing here times anything: the trace is the work itself, to hold against the simulator's account
of the same plan (:func:`flashcp.sim.work.work_account`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from flashcp.comm import AttnShape, check_mode
from flashcp.executors.emulate import ReplayGroup, _Clock, seeded_inputs
from flashcp.executors.emulate_record import record
from flashcp.ops import get_attn_op
from flashcp.ops.backends import VarlenBackend, get_backend
from flashcp.ops.collectives import CommCounter
from flashcp.plan import Plan

__all__ = [
    "OP_CATEGORIES",
    "RankTrace",
    "WorkEvent",
    "exchange_schedule",
    "op_traffic",
    "trace_work",
]

#: categories of a recorded ATen op: ``launch`` a device kernel moving memory (copies, casts,
#: fills, element-wise math, index gathers and scatters), ``alloc`` an allocation without a
#: kernel, ``view`` metadata only, ``host`` dispatched but launching nothing (a scalar wrapped as
#: a tensor, a type promotion, a ``copy_`` of a tensor onto the same memory, which ATen skips),
#: ``sync`` a device-to-host read
OP_CATEGORIES = ("launch", "alloc", "view", "host", "sync")

_ALLOC = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})
_VIEWLIKE = frozenset({"_unsafe_view", "lift_fresh", "detach", "alias", "unbind", "split"})
_SYNC = frozenset({"_local_scalar_dense", "item", "is_nonzero"})
_HOST = frozenset({"promote_types", "scalar_tensor", "result_type"})
#: ops that read only the rows they gather (2 x output: read + write)
_GATHER = frozenset({"index_select", "index", "gather"})
#: ops that read their source and read + write the rows of ``self`` they touch
_SCATTER = frozenset({"index_add", "index_add_", "index_copy_", "index_copy", "index_put_"})
_FILL = frozenset({"zeros", "zeros_like", "new_zeros", "zero_", "fill_", "full", "full_like",
                   "new_full", "ones", "ones_like"})  # fmt: skip


@dataclass(frozen=True)
class WorkEvent:
    """One thing a rank issued.

    Attributes:
        kind: ``kernel``, ``comm`` or ``op``.
        phase: ``fwd`` or ``bwd``.
        step: ring exchanges of this pass posted before it (0 for ops without a ring).
        name: ATen op name (``op``), ``forward`` / ``backward`` (``kernel``), the collective kind
            (``comm``: ``allgather``, ``reducescatter``, ``alltoall``, ``p2p``).
        category: ``op`` only: one of :data:`OP_CATEGORIES`.
        elements: ``op``: elements written; ``kernel``: query rows of the call.
        nbytes: ``op``: bytes read + written (:func:`op_traffic`); ``comm``: bytes received;
            ``kernel``: 0.
        q_lens, k_lens: ``kernel``: (n_seg,) int64 segment lengths; causal: its mask flag.
        heads: ``kernel``: query heads of the call.
        group_size: ``comm``: ranks of the group it ran in.
        dtype: ``op``: dtype of the first output (or mutated input).
    """

    kind: str
    phase: str
    step: int
    name: str
    category: str = ""
    elements: int = 0
    nbytes: int = 0
    q_lens: tuple[int, ...] = ()
    k_lens: tuple[int, ...] = ()
    causal: bool = False
    heads: int = 0
    group_size: int = 0
    dtype: str = ""


@dataclass
class RankTrace:
    """Everything one rank issued in one step (forward, then backward when training).

    Attributes:
        rank: the rank.
        events: :class:`WorkEvent` in program order.
        exchanges: one ``[phase, kind, posted, waited]`` per ring exchange, kind ``kv`` (the
            next KV block) or ``grad`` (a dK/dV partial sum); ``posted`` / ``waited``: how many
            events were recorded when it was posted and when its wait returned (-1 until then):
            the kernels between them ran while it was in flight (:func:`exchange_schedule`).
        links: with a topology (:func:`trace_work`), the bytes the rank received by link class,
            :meth:`flashcp.ops.collectives.CommCounter.by_link`; else None.
    """

    rank: int
    events: list[WorkEvent] = field(default_factory=list)
    exchanges: list[list] = field(default_factory=list)
    links: dict | None = None

    def select(self, kind: str, phase: str | None = None, **match) -> list[WorkEvent]:
        """The events of ``kind`` (and ``phase``, and every attribute given in ``match``)."""
        return [
            e
            for e in self.events
            if e.kind == kind
            and (phase is None or e.phase == phase)
            and all(getattr(e, k) == v for k, v in match.items())
        ]


def _nb(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def op_traffic(name: str, args, kwargs, out) -> tuple[int, int]:
    """``(elements written, bytes read + written)`` of one ATen op, by these rules:

    * gathers (``index_select``, ``index``): read and write the output: 2 x output bytes;
    * scatters (``index_add_``, ``index_copy_``): read the source, read and write as many rows of
      the destination (``index_add_``) or write them (``index_copy_``): 3 x / 2 x source bytes;
    * fills (``zeros``, ``zero_``, ``full``, ...): write the output;
    * everything else (copies, casts, ``cat``, ``stack``, element-wise math): read every tensor
      argument (broadcast ones at their own size) and write the output; an in-place op's output
      is its first argument (read and written).

    Index tensors and shapes are not counted.
    """
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    written = sum(_nb(t) for t in outs)
    elements = sum(t.numel() for t in outs)
    if name in _GATHER:
        return elements, 2 * written
    if name in _SCATTER:
        src = args[3] if len(args) > 3 else kwargs.get("source", kwargs.get("values"))
        if name == "index_put_":
            src = args[2]
        s = _nb(src)
        n_el = src.numel() if isinstance(src, torch.Tensor) else 0
        return n_el, (3 if name.startswith("index_add") else 2) * s
    if name in _FILL:
        return elements, written
    read = sum(_nb(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
    return elements, read + written


def _same_data(a, b) -> bool:
    """``copy_(a, b)`` of a tensor onto its own memory: ATen returns without a kernel."""
    return (
        isinstance(b, torch.Tensor)
        and a.dtype == b.dtype
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


class _Recorder(TorchDispatchMode):
    """Logs every ATen op as an ``op`` event while not paused."""

    def __init__(self, trace: RankTrace) -> None:
        super().__init__()
        self.trace = trace
        self.phase = "fwd"
        self.step = 0
        self.paused = 0

    @contextlib.contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def add(self, event: WorkEvent) -> None:
        self.trace.events.append(event)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        name = func._schema.name.split("::")[-1]
        if name in _ALLOC:
            cat = "alloc"
        elif name in _SYNC:
            cat = "sync"
        elif func.is_view or name in _VIEWLIKE:
            cat = "view"
        elif name in _HOST or (name == "copy_" and _same_data(args[0], args[1])):
            cat = "host"
        else:
            cat = "launch"
        elements, nbytes = op_traffic(name, args, kwargs, out) if cat == "launch" else (0, 0)
        first = next((t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)), None)
        if first is None and args and isinstance(args[0], torch.Tensor):
            first = args[0]
        dtype = str(first.dtype).removeprefix("torch.") if first is not None else ""
        self.add(WorkEvent("op", self.phase, self.step, name, cat, elements, nbytes, dtype=dtype))
        return out


def _segments(cu: torch.Tensor) -> tuple[int, ...]:
    c = cu.detach().to("cpu", torch.int64).numpy()
    return tuple(int(x) for x in np.diff(c))


def _traced_backend(inner: VarlenBackend, rec: _Recorder) -> VarlenBackend:
    """A copy of ``inner`` whose ``forward`` / ``backward`` log one ``kernel`` event each and hide
    the backend's own ops from the recorder."""
    be = copy.copy(inner)
    fwd, bwd = inner.forward, inner.backward

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        with rec.pause():
            rec.add(WorkEvent("kernel", rec.phase, rec.step, "forward", elements=q.shape[0],
                              q_lens=_segments(cu_q), k_lens=_segments(cu_k),
                              causal=bool(kw["causal"]), heads=q.shape[1]))  # fmt: skip
            return fwd(q, k, v, cu_q, cu_k, max_q, max_k, **kw)

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, **kw):
        with rec.pause():
            rec.add(WorkEvent("kernel", rec.phase, rec.step, "backward", elements=q.shape[0],
                              q_lens=_segments(cu_q), k_lens=_segments(cu_k),
                              causal=bool(kw["causal"]), heads=q.shape[1]))  # fmt: skip
            return bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, **kw)

    object.__setattr__(be, "forward", forward)
    object.__setattr__(be, "backward", backward)
    return be


class _TracingReplay(ReplayGroup):
    """:class:`ReplayGroup` that logs each collective and ring exchange as a ``comm`` event (its
    in-memory copies hidden from the recorder) and counts the ring steps."""

    rec: _Recorder
    kv_posts: set
    open_exchanges: dict

    def _comm(self, kind: str, nbytes: int) -> None:
        self.rec.add(WorkEvent("comm", self.rec.phase, self.rec.step, kind, nbytes=int(nbytes),
                               group_size=self.n))  # fmt: skip

    def all_gather_into_tensor(self, output, inp) -> None:
        self._comm("allgather", (self.n - 1) * _nb(inp))
        with self.rec.pause():
            super().all_gather_into_tensor(output, inp)

    def reduce_scatter_tensor(self, output, inp) -> None:
        self._comm("reducescatter", (self.n - 1) * _nb(output))
        with self.rec.pause():
            super().reduce_scatter_tensor(output, inp)

    def all_to_all_single(self, output, inp) -> None:
        self._comm("alltoall", (self.n - 1) * _nb(output) // self.n)
        with self.rec.pause():
            super().all_to_all_single(output, inp)

    def ring_post(self, tensors, tag):
        self._comm("p2p", sum(_nb(t) for t in tensors))
        with self.rec.pause():
            handle = super().ring_post(tensors, tag)
        if tag == 0:  # the KV block of the next ring step (tag 1: a dK/dV partial sum)
            self.kv_posts.add(handle[0])
        trace = self.rec.trace
        entry = [self.rec.phase, "kv" if tag == 0 else "grad", len(trace.events), -1]
        trace.exchanges.append(entry)
        self.open_exchanges[handle[0]] = entry
        return handle

    def ring_wait(self, handle):
        with self.rec.pause():
            got = super().ring_wait(handle)
        self.open_exchanges.pop(handle[0])[3] = len(self.rec.trace.events)
        if handle[0] in self.kv_posts:  # the next block arrived: the next ring step begins
            self.kv_posts.discard(handle[0])
            self.rec.step += 1
        return got


def trace_work(
    plan: Plan,
    shape: AttnShape,
    mode: str,
    *,
    backend="cpu",
    seed: int = 0,
    ranks: Sequence[int] | None = None,
    timeout_s: float = 60.0,
    op_options: Mapping[str, Any] | None = None,
    topology=None,
) -> list[RankTrace]:
    """Record what each rank's op issues for ``plan`` (module docstring), on CPU.

    Args:
        plan: any valid plan of a registered method.
        shape: heads, KV heads, head_dim, dtype (small: the op really runs).
        mode: ``train`` (forward + backward) or ``infer``.
        backend: kernel backend name (``cpu`` or ``reference``) or instance.
        seed: seeds the inputs (:func:`flashcp.executors.emulate.seeded_inputs`).
        ranks: ranks to trace (default all).
        timeout_s: bound on every emulated collective of the record pass.
        op_options: keyword options of the op (e.g. ``keep_gathered_kv``), in both passes.
        topology: a :class:`flashcp.topology.Topology` of the N ranks: each traced rank's op
            also counts its received bytes by link class (:attr:`RankTrace.links`).
    Returns:
        one :class:`RankTrace` per traced rank, in order.
    Raises:
        ValueError: bad mode or ranks; RuntimeError: the op failed on some rank.
    """
    check_mode(mode)
    n = plan.cp_size
    ranks = list(range(n)) if ranks is None else [int(r) for r in ranks]
    if not ranks or any(not 0 <= r < n for r in ranks):
        raise ValueError(f"ranks must be in [0, {n}), got {ranks}")
    device = torch.device("cpu")
    train = mode == "train"
    inputs = seeded_inputs(plan, shape, mode, seed, device)
    inner = (
        get_backend(backend, device, dtype=getattr(torch, shape.dtype), head_dim=shape.head_dim)
        if isinstance(backend, str)
        else backend
    )
    rec_pass = record(
        plan, mode, inputs, backend=inner, keep=ranks, timeout_s=timeout_s, op_options=op_options
    )
    prepare, attn = get_attn_op(plan.method)
    traces = []
    for rank in ranks:
        meta = prepare(plan, rank)
        trace = RankTrace(rank)
        rec = _Recorder(trace)
        group = _TracingReplay(rank, n, rec_pass, _Clock(device), False)
        group.rec, group.kv_posts, group.open_exchanges = rec, set(), {}
        be = _traced_backend(inner, rec)
        q, k, v = (x.detach().requires_grad_(train) for x in inputs[rank][:3])
        dout = inputs[rank][3] if train else None
        counter = CommCounter(topology=topology, group=group) if topology is not None else None
        with torch.set_grad_enabled(train), rec:
            out = attn(q, k, v, meta, group, backend=be, counter=counter, **(op_options or {}))
            if train:  # the gradients returned, not accumulated into leaves (no copy there)
                rec.phase, rec.step = "bwd", 0
                torch.autograd.grad(out, (q, k, v), dout)
        if group.cursor != len(group.script):
            raise RuntimeError(
                f"traced rank {rank} made {group.cursor} of {len(group.script)} recorded calls"
            )
        trace.links = counter.by_link() if counter is not None else None
        traces.append(trace)
    return traces


def exchange_schedule(trace: RankTrace, phase: str, steps: int) -> dict[str, np.ndarray]:
    """Which ring step's kernels each exchange of ``phase`` was in flight over.

    An exchange overlaps step t when a kernel call of step t ran between its post and the return
    of its wait (:attr:`RankTrace.exchanges`); one that no kernel call overlaps is exposed.
    Meaningful for a rank that calls a kernel at every step (else an exchange beside a step
    without work reads as exposed).

    Args:
        trace: one rank's trace; phase: ``fwd`` or ``bwd``; steps: ring steps of the pass (N).
    Returns:
        ``{kind: (steps + 1,) int64}`` for kinds ``kv`` and ``grad``: exchanges overlapping each
        step, the last entry the exposed ones.
    Raises:
        ValueError: an exchange overlapping kernels of two steps, or one never waited.
    """
    out = {k: np.zeros(steps + 1, dtype=np.int64) for k in ("kv", "grad")}
    for ph, kind, posted, waited in trace.exchanges:
        if ph != phase:
            continue
        if waited < 0:
            raise ValueError(f"rank {trace.rank}: a {kind} exchange of {phase} was never waited")
        over = {e.step for e in trace.events[posted:waited] if e.kind == "kernel"}
        if len(over) > 1:
            raise ValueError(f"rank {trace.rank}: a {kind} exchange spans steps {sorted(over)}")
        out[kind][over.pop() if over else steps] += 1
    return out


#: items :func:`trace_account` sums per (phase, step, rank)
TRACE_ITEMS = (
    "kernel_calls", "q_rows", "kv_rows", "ctas", "tiles", "max_tiles", "mem_ops", "mem_bytes",
    "host_ops", "views", "allocs", "host_only", "syncs",
)  # fmt: skip


def trace_account(traces: Sequence[RankTrace], hw, cp_size: int) -> dict:
    """The traces summed the way :class:`flashcp.sim.work.WorkAccount` counts.

    Args:
        traces: every rank's :class:`RankTrace`, in rank order.
        hw: the :class:`~flashcp.sim.hardware.HardwareProfile` whose tile shapes count tiles.
        cp_size: N.
    Returns:
        ``{"per_step": {(phase, item): (steps, N) float64}, "comm": {(phase, kind): [bytes of
        each call]}, "heads": {phase: set of query heads per kernel call}}``; items of
        :data:`TRACE_ITEMS`: kernels (calls, query and key rows, tile statistics per head from
        their segments), ``mem_ops`` / ``mem_bytes`` (ops of category ``launch``), ``host_ops``
        (every dispatch: kernels, collectives and ATen ops of any category), and the counts of
        views, allocations, host-only ops and syncs.
    """
    from flashcp.sim.kernel import bwd_tile_counts, fwd_tile_counts

    steps = 1 + max((e.step for t in traces for e in t.events), default=0)
    per: dict[tuple[str, str], np.ndarray] = {}
    comm: dict[tuple[str, str], list[int]] = {}
    heads: dict[str, set[int]] = {}

    def add(phase, item, s, r, v):
        key = (phase, item)
        if key not in per:
            per[key] = np.zeros((steps, cp_size))
        if item == "max_tiles":
            per[key][s, r] = max(per[key][s, r], v)
        else:
            per[key][s, r] += v

    for tr in traces:
        r = tr.rank
        for e in tr.events:
            p, s = e.phase, e.step
            if e.kind == "kernel":
                heads.setdefault(p, set()).add(e.heads)
                q, k = np.array(e.q_lens, np.int64), np.array(e.k_lens, np.int64)
                if p == "fwd":
                    c, t, m = fwd_tile_counts(q, k, np.full(q.size, e.causal), hw.fwd_block_q,
                                              hw.fwd_block_k)  # fmt: skip
                else:
                    c, t, m = bwd_tile_counts(q, k, np.full(q.size, e.causal), hw.bwd_block_q,
                                              hw.bwd_block_k)  # fmt: skip
                add(p, "kernel_calls", s, r, 1)
                add(p, "q_rows", s, r, q.sum())
                add(p, "kv_rows", s, r, k.sum())
                add(p, "ctas", s, r, c.sum())
                add(p, "tiles", s, r, t.sum())
                add(p, "max_tiles", s, r, m.max() if m.size else 0)
                add(p, "host_ops", s, r, 1)
            elif e.kind == "comm":
                if r == traces[0].rank:
                    comm.setdefault((p, e.name), []).append(e.nbytes)
                add(p, "host_ops", s, r, 1)
            else:
                item = {"launch": "mem_ops", "view": "views", "alloc": "allocs",
                        "host": "host_only", "sync": "syncs"}[e.category]  # fmt: skip
                add(p, item, s, r, 1)
                if e.category == "launch":
                    add(p, "mem_bytes", s, r, e.nbytes)
                add(p, "host_ops", s, r, 1)
    for key in list(per):
        for item in TRACE_ITEMS:
            per.setdefault((key[0], item), np.zeros((steps, cp_size)))
    return {"per_step": per, "comm": comm, "heads": heads}
