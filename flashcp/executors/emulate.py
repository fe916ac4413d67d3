"""``executor=emulate``: replay every rank's real work of a plan on one device (docs/design.md §4).

The op code is the one ``executor=dist`` runs (:func:`flashcp.ops.get_attn_op`): only the process
group is replaced, by an in-process :class:`~flashcp.ops.collectives.LocalGroup`. Two passes:

1. **Record** (untimed). One thread per CP rank runs the op on its shard of seeded Q/K/V (the
   same tensors :func:`flashcp.executors.dist.measure_step` draws) through a
   :class:`~flashcp.executors.emulate_record.RecordingGroup`: the threads meet in real
   all-gathers, reduce-scatters and ring send/recv, computed in memory (the hybrids' 2-D groups
   are sub-groups of it, ``RecordingGroup.new_subgroup``). Every buffer a replayed rank
   *receives* is kept, in call order (:mod:`flashcp.executors.emulate_record`).
   (The backward is driven by calling the op's autograd node directly on its thread: PyTorch runs
   the backward of CUDA tensors on one shared device thread, where ranks waiting for each other
   would deadlock.)
2. **Replay** (timed), one rank after another on the device: the rank runs the op alone through a
   :class:`ReplayGroup`, which answers each collective and each ring exchange with the recorded
   buffer. The rank therefore issues exactly the kernels, copies, merges and accumulations of a
   real run, in the same order, on the same data (its outputs are those of a real run). Phases
   are timed by the op's :class:`~flashcp.ops.timing.PhaseTimer` (CUDA events on GPU, wall clock
   after a synchronisation on CPU), after ``warmup`` untimed steps; the median over ``iters``
   steps is kept.

**Communication from the model.** The time of each emulated call (a copy of the recorded buffer)
is cut out of the rank's timeline and replaced by the simulator's model on the hardware profile
(:mod:`flashcp.sim.hardware`), on a virtual timeline (:func:`compose_comm`):

* all-gather / reduce-scatter / all-to-all: blocking, ``HardwareProfile.allgather_us(recv,
  total)`` (``reducescatter_us``, ``alltoall_us``), the same formula and bytes as
  :mod:`flashcp.sim.cost`;
* ring exchange: the transfer starts when it is posted (or when the link frees up: transfers of
  one rank are serialised on its link) and takes ``HardwareProfile.p2p_us(bytes)``; a wait that
  comes before the transfer ends stalls the rank for the difference, which is ``p2p_ms`` (the
  exposed P2P time; hidden transfers cost nothing, as in the simulator's
  ``max(compute, p2p)``).

With ``nccl_traffic=True`` (CUDA only) the replayed ring exchange copies the recorded bytes on a
second CUDA stream while the rank computes, as NCCL's copy kernels would, so the attention
kernels feel the memory traffic of the overlapped transfer.

Result rows are those of ``sim`` and ``dist`` (:data:`flashcp.results.PHASE_COLUMNS`,
:data:`flashcp.results.COMM_COLUMNS`): per phase the median over timed steps, then the maximum over
the replayed ranks, as ``dist`` reports. Not modelled: waiting for a slower peer (each rank is
replayed alone, so a synchronous phase is not stretched to the slowest rank's pace), and SMs a
real NCCL kernel would take.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashcp.comm import AttnShape, check_mode
from flashcp.executors.emulate_memory import check_job_memory, check_record_memory, job_device
from flashcp.executors.emulate_record import (
    Recording,
    _on_device,
    _subgroup_ranks,
    record,
)
from flashcp.executors.progress import progress_bar
from flashcp.executors.rows import check_comm, finish_rows, measure_rows, plan_sequences
from flashcp.ops import get_attn_op
from flashcp.ops.collectives import CommCounter, LocalGroup
from flashcp.ops.sharding import shard_tensor
from flashcp.ops.timing import PhaseTimer, record_event
from flashcp.plan import Plan
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS
from flashcp.sim.hardware import HardwareProfile, load_hardware

__all__ = [
    "CommCall",
    "RankReplay",
    "ReplayGroup",
    "compose_comm",
    "emulate_ranks",
    "emulate_step",
    "execute",
    "seeded_inputs",
]

log = logging.getLogger(__name__)

#: phases of the op's timer that the emulated communication replaces by the model
COMM_PHASES: tuple[str, ...] = ("allgather", "reducescatter", "p2p", "alltoall")


# ---- inputs ---------------------------------------------------------------------------------------


def seeded_inputs(
    plan: Plan, shape: AttnShape, mode: str, seed: int, device
) -> list[tuple[torch.Tensor, ...]]:
    """Every rank's ``(q, k, v[, dout])``: the tensors ``executor=dist`` draws for the same seed.

    Full packed tensors are drawn in the order q, k, v, dout from one generator seeded ``seed`` on
    ``device`` and sharded by the plan (:func:`flashcp.ops.sharding.shard_tensor`).

    Returns:
        ``cp_size`` tuples; q, dout: (C / N, num_heads, head_dim); k, v: (C / N, num_kv_heads,
        head_dim); dtype ``shape.dtype``. ``dout`` only for ``mode="train"``.
    """
    gen = torch.Generator(device=device).manual_seed(int(seed))
    dtype = getattr(torch, shape.dtype)
    heads = [shape.num_heads, shape.num_kv_heads, shape.num_kv_heads]
    if mode == "train":
        heads.append(shape.num_heads)
    full = [
        torch.randn(plan.context_len, h, shape.head_dim, generator=gen, device=device, dtype=dtype)
        for h in heads
    ]
    return [tuple(shard_tensor(x, plan, r) for x in full) for r in range(plan.cp_size)]


# ---- replay: one rank alone, communication answered from the recording -----------------------------


class _Clock:
    """Marks on the device timeline: CUDA events on ``device``'s current stream, else
    perf_counter."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> int:
        if self.cuda:
            self.marks.append(record_event(self.device))
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def ms(self) -> list[float]:
        """Milliseconds of every mark since the first one (synchronises on CUDA)."""
        if not self.marks:
            return []
        if self.cuda:
            self.marks[-1].synchronize()
            first = self.marks[0]
            return [first.elapsed_time(ev) for ev in self.marks]
        return [(t - self.marks[0]) * 1e3 for t in self.marks]


@dataclass(frozen=True)
class CommCall:
    """One emulated communication call on a replayed rank's timeline.

    Attributes:
        kind: ``allgather`` / ``reducescatter`` / ``alltoall`` (blocking collectives), ``post`` /
            ``wait`` (the two halves of a ring exchange).
        recv_bytes: bytes this rank receives (for ``post``: of the exchange; 0 for ``wait``).
        begin_ms, end_ms: when the emulated call started and ended on the measured timeline.
        handle: pairs a ``wait`` with its ``post``.
        group_size: ranks of the group the call ran in (0: the CP group; a hybrid's
            all-to-alls run in its u-rank groups, its inner op across the N/u groups).
    """

    kind: str
    recv_bytes: int
    begin_ms: float
    end_ms: float
    handle: int = -1
    group_size: int = 0


def compose_comm(
    total_ms: float, calls: Sequence[CommCall], hw: HardwareProfile, cp_size: int
) -> dict[str, float]:
    """Replace the measured time of emulated communication by the simulator's model.

    Walks the calls in order on a virtual timeline that starts equal to the measured one. A
    collective's measured span becomes its modelled time ``allgather_us(recv, recv * n / (n-1))``
    (``reducescatter_us``, ``alltoall_us``), n the ranks of its group (``CommCall.group_size``, N by default). A ring ``post``'s span is cut; its transfer starts at the post (or when the previous
    transfer of this rank ends) and lasts ``p2p_us(recv_bytes)``; the matching ``wait``'s span is
    replaced by the time still left on that transfer (0 when compute hid it).

    Args:
        total_ms: measured wall time of the step.
        calls: in program order, non-overlapping, inside ``[0, total_ms]``.
        hw: the hardware profile.
        cp_size: N.
    Returns:
        ``allgather_ms``, ``reducescatter_ms``, ``alltoall_ms`` (modelled), ``p2p_ms`` (exposed transfer time),
        ``comm_measured_ms`` (the emulated calls' own time, removed) and ``total_ms`` (virtual).
    Raises:
        ValueError: an unknown kind, or a ``wait`` without its ``post``.
    """
    shift = 0.0  # virtual time - measured time at the current point, ms
    link_free = float("-inf")
    ready: dict[int, float] = {}
    out = {"allgather_ms": 0.0, "reducescatter_ms": 0.0, "p2p_ms": 0.0, "alltoall_ms": 0.0}
    out["comm_measured_ms"] = 0.0
    for c in calls:
        span = c.end_ms - c.begin_ms
        out["comm_measured_ms"] += span
        n = c.group_size or cp_size
        scale = n / (n - 1) if n > 1 else 1.0
        at = c.begin_ms + shift
        if c.kind in ("allgather", "reducescatter"):
            price = hw.allgather_us if c.kind == "allgather" else hw.reducescatter_us
            model = price(c.recv_bytes, c.recv_bytes * scale) / 1e3
            out[f"{c.kind}_ms"] += model
            shift += model - span
        elif c.kind == "alltoall":
            model = hw.alltoall_us(c.recv_bytes, c.recv_bytes * scale) / 1e3
            out["alltoall_ms"] += model
            shift += model - span
        elif c.kind == "post":
            start = max(at, link_free)
            ready[c.handle] = link_free = start + hw.p2p_us(c.recv_bytes) / 1e3
            shift -= span
        elif c.kind == "wait":
            if c.handle not in ready:
                raise ValueError(f"wait on handle {c.handle} without a post")
            stall = max(0.0, ready.pop(c.handle) - at)
            out["p2p_ms"] += stall
            shift += stall - span
        else:
            raise ValueError(f"unknown communication call kind {c.kind!r}")
    out["total_ms"] = total_ms + shift
    return out


class ReplayGroup(LocalGroup):
    """Rank ``rank`` alone: every collective and ring exchange is answered from a recording.

    The ``i``-th call must be the ``i``-th recorded one (same kind and shapes). Each call is marked
    on the rank's timeline (:class:`CommCall`) so its own time can be replaced by the model. Its
    sub-groups (:meth:`new_subgroup`) answer from the same recording, cursor and timeline.

    Args:
        rank, cp_size: the replayed rank and N.
        recording: from :func:`~flashcp.executors.emulate_record.record` (``rank`` must be kept
            there).
        clock: the step's timeline (its device is the replayed tensors' device).
        nccl_traffic: copy ring messages on a second CUDA stream of that device, overlapping
            compute.
    """

    def __init__(
        self, rank: int, cp_size: int, recording: Recording, clock: _Clock, nccl_traffic: bool
    ) -> None:
        if rank not in recording.received:
            raise ValueError(f"rank {rank} was not kept by the record pass")
        self._rank, self.n = rank, cp_size
        self.recording = recording
        self.script = recording.received[rank]
        self.clock = clock
        self.device = clock.device
        self.side = torch.cuda.Stream(device=self.device) if nccl_traffic else None
        self.cursor = 0
        # kind, bytes, begin, end, handle, group size
        self.calls: list[tuple[str, int, int, int, int, int]] = []
        self.cp_rank = rank
        self._root = self
        self._members = list(range(cp_size))

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self._rank

    def members(self) -> list[int]:
        return list(self._members)

    def new_subgroup(self, ranks: list[int]) -> ReplayGroup:
        ranks = _subgroup_ranks(self, ranks)
        sub = copy.copy(self)  # shares the recording, timeline, side stream and call list
        sub._rank, sub.n = ranks.index(self._rank), len(ranks)
        sub._members = [self._members[i] for i in ranks]
        return sub

    def _next(self, kind: str, like: list[torch.Tensor]) -> list[torch.Tensor]:
        root, rank = self._root, self.cp_rank
        if root.cursor >= len(self.script):
            raise RuntimeError(f"replay of rank {rank} diverged: more calls than recorded")
        rec_kind, bufs = self.script[root.cursor]
        shapes = [(tuple(t.shape), t.dtype) for t in like]
        if rec_kind != kind or shapes != [(tuple(t.shape), t.dtype) for t in bufs]:
            raise RuntimeError(
                f"replay of rank {rank} diverged at call {root.cursor}: recorded {rec_kind} "
                f"{[(tuple(t.shape), t.dtype) for t in bufs]}, got {kind} {shapes}"
            )
        root.cursor += 1
        return bufs

    def _collective(self, kind: str, output: torch.Tensor, recv_bytes: int) -> None:
        begin = self.clock.mark()
        (buf,) = self._next(kind, [output])
        output.copy_(buf)
        end = self.clock.mark()
        self.calls.append((kind, recv_bytes, begin, end, -1, self.n))

    def all_gather_into_tensor(self, output, inp) -> None:
        # a rank receives every part but its own
        self._collective("allgather", output, (self.n - 1) * inp.numel() * inp.element_size())

    def reduce_scatter_tensor(self, output, inp) -> None:
        self._collective(
            "reducescatter", output, (self.n - 1) * output.numel() * output.element_size()
        )

    def all_to_all_single(self, output, inp) -> None:
        # a rank receives every part but its own
        nbytes = output.numel() * output.element_size()
        self._collective("alltoall", output, (self.n - 1) * nbytes // self.n)

    def check_same_plan(self, plan) -> None:
        if plan.digest() != self.recording.digest:
            raise ValueError("the replayed plan is not the recorded one (plan digests differ)")

    def ring_post(self, tensors, tag):
        begin = self.clock.mark()
        bufs = self._next("p2p", list(tensors))
        recv = [torch.empty_like(b) for b in bufs]
        event = None
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.device(self.device), torch.cuda.stream(self.side):
                for dst, src in zip(recv, bufs, strict=True):
                    dst.copy_(src)
                    dst.record_stream(self.side)
            event = self.side.record_event()
        else:
            for dst, src in zip(recv, bufs, strict=True):
                dst.copy_(src)
        end = self.clock.mark()
        handle = len(self.calls)
        nbytes = sum(b.numel() * b.element_size() for b in bufs)
        self.calls.append(("post", nbytes, begin, end, handle, self.n))
        return handle, recv, event

    def ring_wait(self, handle) -> list[torch.Tensor]:
        post, recv, event = handle
        begin = self.clock.mark()
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        end = self.clock.mark()
        self.calls.append(("wait", 0, begin, end, post, self.n))
        return recv

    def timeline(self) -> list[CommCall]:
        """The calls of the step as :class:`CommCall` (synchronises on CUDA)."""
        ms = self.clock.ms()
        return [CommCall(k, nb, ms[b], ms[e], h, g) for k, nb, b, e, h, g in self.calls]


# ---- the executor ------------------------------------------------------------------------------------


@dataclass
class RankReplay:
    """One replayed rank.

    Attributes:
        rank: the rank.
        phases: every key of :data:`PHASE_COLUMNS` (ms, median over timed steps).
        comm: every key of :data:`COMM_COLUMNS` (bytes counted by the op).
        comm_measured_ms: median time of the emulated calls themselves (removed from the timeline).
        outputs: ``(out, dq, dk, dv)`` of the last step (gradients only in training), local rows.
    """

    rank: int
    phases: dict[str, float]
    comm: dict[str, int]
    comm_measured_ms: float
    outputs: tuple[torch.Tensor, ...]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_args(plan, mode, warmup, iters, ranks, nccl_traffic, device) -> list[int]:
    check_mode(mode)
    if not isinstance(plan, Plan):
        raise ValueError(f"expected a flashcp Plan, got {type(plan).__name__}")
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    n = plan.cp_size
    ranks = list(range(n)) if ranks is None else [r for r in ranks]
    if not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks must be distinct and non-empty, got {ranks}")
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n:
            raise ValueError(f"rank {r!r} out of range for cp_size = {n}")
    if nccl_traffic and device.type != "cuda":
        raise ValueError("nccl_traffic=True needs a CUDA device (it copies on a second stream)")
    return ranks


def emulate_ranks(
    plan: Plan,
    shape: AttnShape,
    mode: str,
    hw: HardwareProfile | str | dict,
    *,
    device=None,
    backend="auto",
    warmup: int = 1,
    iters: int = 3,
    seed: int = 0,
    ranks: Sequence[int] | None = None,
    nccl_traffic: bool = False,
    timeout_s: float = 120.0,
    check_memory: bool = True,
) -> list[RankReplay]:
    """Record the plan once, then replay and time each rank of ``ranks`` alone.

    Args and errors as :func:`emulate_step`.
    Returns:
        one :class:`RankReplay` per replayed rank, in the order of ``ranks``.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    ranks = _check_args(plan, mode, warmup, iters, ranks, nccl_traffic, device)
    hw = load_hardware(hw)
    train = mode == "train"
    if check_memory:
        check_record_memory(plan, shape, mode, device, ranks)
    # the device's current stream and events: those of the replayed tensors' device
    with _on_device(device):
        inputs = seeded_inputs(plan, shape, mode, seed, device)
        rec = record(plan, mode, inputs, backend=backend, keep=ranks, timeout_s=timeout_s)
        prepare, attn = get_attn_op(plan.method)
        replays = []
        for rank in ranks:
            meta = prepare(plan, rank)
            per_step: dict[str, list[float]] = {name: [] for name in PHASE_COLUMNS}
            removed: list[float] = []
            counted: dict[str, int] = {}
            outputs: tuple[torch.Tensor, ...] = ()
            for step in range(warmup + iters):
                clock = _Clock(device)
                group = ReplayGroup(rank, plan.cp_size, rec, clock, nccl_traffic)
                timer, counter = PhaseTimer(device), CommCounter()
                q, k, v = (x.detach().requires_grad_(train) for x in inputs[rank][:3])
                _sync(device)
                clock.mark()
                with torch.set_grad_enabled(train):
                    out = attn(q, k, v, meta, group, backend=backend, counter=counter, timer=timer)
                    if train:
                        out.backward(inputs[rank][3])
                stop = clock.mark()
                _sync(device)
                if group.cursor != len(group.script):
                    raise RuntimeError(
                        f"replay of rank {rank} made {group.cursor} of {len(group.script)} recorded calls"
                    )
                if step < warmup:
                    continue
                total = clock.ms()[stop]
                comm = compose_comm(total, group.timeline(), hw, plan.cp_size)
                ms = timer.as_ms()
                for name in COMM_PHASES:
                    ms.pop(name, None)
                for name in PHASE_COLUMNS:
                    key = name.removesuffix("_ms")
                    per_step[name].append(
                        comm[name] if key in (*COMM_PHASES, "total") else ms.pop(key, 0.0)
                    )
                per_step["others_ms"][-1] += sum(
                    ms.values()
                )  # phases outside the schema count as others
                removed.append(comm["comm_measured_ms"])
                counted = counter.as_dict()
                outputs = (out.detach(), *(x.grad for x in (q, k, v) if train))
            replays.append(
                RankReplay(
                    rank,
                    {name: statistics.median(v) for name, v in per_step.items()},
                    counted,
                    statistics.median(removed),
                    outputs,
                )
            )
        return replays


def emulate_step(
    plan: Plan,
    shape: AttnShape,
    mode: str,
    hw: HardwareProfile | str | dict,
    *,
    device=None,
    backend="auto",
    warmup: int = 1,
    iters: int = 3,
    seed: int = 0,
    ranks: Sequence[int] | None = None,
    nccl_traffic: bool = False,
    timeout_s: float = 120.0,
    check: bool = True,
    check_memory: bool = True,
) -> dict[str, float | int]:
    """One attention layer's CP step of ``plan``, every rank replayed on one device.

    Args:
        plan: the plan.
        shape: heads, KV heads, head_dim, dtype.
        mode: ``train`` (forward + backward) or ``infer`` (forward only).
        hw: hardware profile whose collective / P2P model prices the communication.
        device: where the ranks are replayed (default CPU).
        backend: kernel backend (:func:`flashcp.ops.backends.get_backend`).
        warmup: untimed replays per rank; iters: timed replays (median kept).
        seed: seeds Q, K, V and dO (the tensors ``executor=dist`` draws for the same seed).
        ranks: ranks to replay (default all); the row reports the maximum over them.
        nccl_traffic: (CUDA) copy ring messages on a second stream while the rank computes.
        timeout_s: bound on every emulated collective of the record pass.
        check: raise if the counted bytes differ from :func:`flashcp.comm.comm_volume`.
        check_memory: refuse, before any work, a plan whose
            :func:`~flashcp.executors.emulate_memory.record_memory_bytes` exceeds the device's
            available memory (:func:`check_record_memory`).
    Returns:
        every key of :data:`PHASE_COLUMNS` (ms; per phase the maximum over replayed ranks of the
        median over steps; communication phases from the model, see :func:`compose_comm`) and of
        :data:`COMM_COLUMNS` (bytes received, maximum over replayed ranks).
    Raises:
        ValueError: bad mode, ``iters``/``warmup``, ranks, ``nccl_traffic`` off CUDA, hardware
            profile, (with ``check_memory``) a plan too large for the device's memory, or (with
            ``check``) counted bytes that disagree with the plan.
        RuntimeError: the record pass failed or the replay diverged from it.
    """
    reps = emulate_ranks(
        plan, shape, mode, hw, device=device, backend=backend, warmup=warmup, iters=iters,
        seed=seed, ranks=ranks, nccl_traffic=nccl_traffic, timeout_s=timeout_s,
        check_memory=check_memory,
    )  # fmt: skip
    row: dict[str, float | int] = {
        name: max(r.phases[name] for r in reps) for name in PHASE_COLUMNS
    }
    row.update({k: max(int(r.comm[k]) for r in reps) for k in COMM_COLUMNS})
    if check:
        check_comm(row, plan, shape, mode)
    return row


def execute(runs, seqs, *, progress: str | None = None):
    """``executor=emulate`` (:mod:`flashcp.executors`' interface, the row loop of
    :mod:`flashcp.executors.rows`): plan every sequence and replay every rank of its plan on one
    device; communication priced by the run's hardware profile. One process, so a sequence whose
    planning or replay fails is a row with ``status = "error: ..."``.

    Args:
        runs: exactly one :class:`flashcp.executors.RunSpec` (``executor`` options ``backend``,
            ``warmup``, ``iters``, ``timeout_s``, ``ranks``, ``nccl_traffic``, ``check_memory``,
            and ``device``: where to replay, default CUDA if available, else CPU).
        seqs: (n_docs,) int64 document lengths per sequence.
        progress: label of a progress bar on a terminal, one step per (sequence, mode) replayed
            (None: no bar; :func:`flashcp.executors.progress.progress_bar`).
    Returns:
        the rows (:func:`flashcp.executors.rows.finish_rows`).
    Raises:
        ValueError: several runs, an op option set (``keep_gathered_kv``: not replayed here; use
            ``executor=dist`` or ``sim``), or (``check_memory``, default on) a plan of the job
            too large for the device's memory (:func:`check_record_memory`), before any record
            pass.

    Logs one line first: the device it replays on (and why: no CUDA device) and the work ahead.
    """
    if len(runs) != 1:
        raise ValueError(f"executor=emulate runs one run per job, got {len(runs)}")
    run = runs[0]
    from flashcp.registry import split_options

    op_opts = {k: v for k, v in split_options(run.method, run.options)[1].items() if v}
    if op_opts:
        raise ValueError(
            f"executor=emulate does not replay op options ({op_opts}); run them with "
            "executor=dist or executor=sim"
        )
    ex = dict(run.executor)
    hw = load_hardware(run.hardware)
    device = job_device(run)
    ranks = None if ex.get("ranks") is None else [int(r) for r in ex["ranks"]]
    planned = plan_sequences(run, seqs)
    why = ""
    if device.type == "cpu":
        why = " (no CUDA device)" if not torch.cuda.is_available() else " (asked for)"
    log.info(
        "executor=emulate: replaying on %s%s: %d sequences x %d modes, %s of %d ranks each "
        "(%d warm-up + %d timed steps), %s backend",
        device, why, len(planned.plans), len(run.modes),
        "all" if ranks is None else f"{len(ranks)}", run.cp_size, int(ex.get("warmup", 1)),
        int(ex.get("iters", 3)), ex.get("backend", "auto"),
    )  # fmt: skip
    check_job_memory(run, planned.plans)  # before any record pass (one line, exit code 2)
    seq_of = {
        id(p): int(planned.seq["seq_idx"][k])
        for k, p in zip(planned.ok, planned.plans, strict=True)
    }

    def measure(plans: list[Plan], mode: str) -> dict[str, list]:
        (plan,) = plans
        try:
            res = emulate_step(
                plan, run.shape, mode, hw, device=device, backend=ex.get("backend", "auto"),
                warmup=int(ex.get("warmup", 1)), iters=int(ex.get("iters", 3)),
                seed=run.seed + seq_of[id(plan)], ranks=ranks,
                nccl_traffic=bool(ex.get("nccl_traffic", False)),
                timeout_s=float(ex.get("timeout_s", 120.0)),
                check_memory=bool(ex.get("check_memory", True)),
            )  # fmt: skip
        finally:
            bar.update(1)
        return {k: [v] for k, v in res.items()}

    bar = progress_bar(len(planned.plans) * len(run.modes), progress, unit="step")
    with bar:
        return finish_rows([measure_rows(run, planned, measure, batch=1)])
