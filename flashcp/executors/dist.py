"""``executor=dist``: run a plan for real, one process per CP rank (docs/design.md §4).

Under ``torchrun`` every rank calls :func:`init_from_env` once and then :func:`measure_step` for each
plan: seeded random Q/K/V (identical on every rank), sharded by the plan, through the method's
real op (:func:`flashcp.ops.get_attn_op`), forward and, for ``mode="train"``, backward. Phases are
timed with :class:`flashcp.ops.timing.PhaseTimer` (CUDA events on GPU, wall clock on CPU), the
median over timed steps is taken per rank, and the slowest rank per phase is reported, as the
simulator does. Bytes come from the ops' counters and are checked against
:func:`flashcp.comm.comm_volume`.

Failures. A rank that raises inside a step cannot leave its peers waiting in a collective until
the timeout: :func:`abort_group_on_error` prints its traceback (prefixed with its rank), raises the
*failure flag* (a key of the rendezvous store holding its error) and aborts the process group.
On gloo that alone ends the peers' collectives: their connections close. On NCCL it does not: a
peer's kernel waiting for data from the aborted rank spins until the peer aborts its *own*
communicator (or its watchdog times out). So while :func:`execute` runs, a thread of every rank
(:func:`watch_peers`) looks at the flag several times a second; when a peer raised it, it logs
that peer's error, aborts this rank's process group (NCCL: ``ncclCommAbort`` ends the kernels this
rank is blocked in, so its next collective fails with :class:`PeerFailure`), and if the rank is
still stuck a few seconds later (a wait nothing wakes) ends the process with exit code 1. Every
rank therefore exits within seconds with the failing rank's error.

Nodes. The ranks' nodes come from the launch (:func:`launch_topology`: torchrun numbers ranks node
by node), are checked against the run's ``nodes`` / ``placement`` before any collective
(:func:`check_launch`), and the ops' counters then split every step's bytes into those received
from the rank's own node and from other nodes, held per rank to
:func:`flashcp.comm.comm_volume_by_link` (docs/execution.md, "Across nodes").

Planning. Each sequence is planned once per CP group, on its rank 0, and its plan (or its
planner's failure) is broadcast to the group's ranks (:func:`share_planning`,
:func:`flashcp.ops.collectives.broadcast_plan`) before any step: planners such as the
time-limited ILP are not deterministic, so ranks planning alone could hold different plans. A
planner failure becomes the sequence's error rows on every rank, and the run goes on.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from flashcp.comm import AttnShape, check_mode
from flashcp.executors.rows import (
    Planning,
    check_comm,
    finish_rows,
    measure_rows,
    plan_sequences,
)
from flashcp.ops import get_attn_op
from flashcp.ops.collectives import (
    CommCounter,
    broadcast_plan,
    group_rank,
    group_size,
    resolve_group,
)
from flashcp.ops.sharding import shard_tensor
from flashcp.ops.timing import PhaseTimer
from flashcp.plan import Plan
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS
from flashcp.topology import Topology

__all__ = [
    "PeerFailure",
    "abort_group",
    "abort_group_on_error",
    "check_comm",
    "check_launch",
    "execute",
    "failure_flag",
    "init_from_env",
    "launch_nodes",
    "launch_problem",
    "launch_topology",
    "main",
    "measure_step",
    "raise_failure_flag",
    "share_planning",
    "watch_peers",
]

log = logging.getLogger(__name__)


#: how a collective reports that another rank has gone (gloo transport errors, aborted communicators)
_PEER_GONE = ("by peer", "Connection reset", "Connection closed", "Broken pipe", "aborted")


class PeerFailure(RuntimeError):
    """This rank stopped because another rank failed and aborted the process group."""


#: rendezvous-store key prefix of the failure flag (one key per :func:`watch_peers` block; every
#: rank opens the same blocks in the same order, so they agree on the key)
FLAG_PREFIX = "flashcp/failed"
_flag_numbers = itertools.count()
_flag = {"key": f"{FLAG_PREFIX}/none", "peer": None}  # the open block's key; a peer's error seen
_abort_lock = threading.Lock()


def _default_store():
    """The default process group's rendezvous store (TCPStore under torchrun), or None."""
    with contextlib.suppress(Exception):
        return dist.distributed_c10d._get_default_store()
    return None


def raise_failure_flag(message: str, store=None) -> None:
    """Tell every rank that this one failed: set the open :func:`watch_peers` block's flag to
    ``message`` (the first rank to fail keeps it). Never raises (a store that is gone is ignored).
    """
    store = store if store is not None else _default_store()
    if store is None:
        return
    with contextlib.suppress(Exception):
        store.compare_set(_flag["key"], "", message)


def failure_flag(store=None) -> str | None:
    """The error another rank put in the open block's failure flag, or None (also without a store)."""
    store = store if store is not None else _default_store()
    with contextlib.suppress(Exception):
        if store is not None and store.check([_flag["key"]]):
            return store.get(_flag["key"]).decode(errors="replace")
    return None


def abort_group(group=None) -> None:
    """Abort ``group`` (default: the world) on this rank without waiting for the others (later
    calls, once it is gone, do nothing): on gloo the peers' pending and later collectives fail at
    once (their connections close); on NCCL this rank's communicators are aborted, which ends the
    kernels *this* rank is blocked in, not a peer's (see :func:`watch_peers`)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if not _abort_lock.acquire(timeout=5.0):
        return  # another thread of this rank is aborting it
    try:
        with contextlib.suppress(Exception):
            if not dist.is_initialized():
                return
            if abort is not None:
                abort(group) if group is not None and group is not dist.group.WORLD else abort()
            else:
                dist.destroy_process_group(group)
    finally:
        _abort_lock.release()


@contextlib.contextmanager
def watch_peers(group=None, *, poll_s: float = 0.2, grace_s: float = 10.0) -> Iterator[None]:
    """While the block runs, watch the failure flag that a failing rank raises
    (:func:`abort_group_on_error`), from a daemon thread, every ``poll_s`` seconds (one store
    look-up). When another rank raised it: log its error, abort this rank's ``group``
    (:func:`abort_group`; on NCCL this ends the collective kernels this rank waits in, so its
    next collective fails and :func:`abort_group_on_error` turns that into :class:`PeerFailure`
    with the peer's error) and, if the block is still running ``grace_s`` seconds later (a wait
    nothing wakes), print the error and end the process with exit code 1 (``os._exit``).
    Nothing is watched with one rank or without a store.

    Raises:
        ValueError: ``poll_s`` or ``grace_s`` not positive.
    """
    if not (poll_s > 0 and grace_s > 0):
        raise ValueError(f"poll_s and grace_s must be > 0, got {poll_s} and {grace_s}")
    store = _default_store()
    if store is None or group_size(group) == 1:
        yield
        return
    rank = group_rank(group)
    _flag["key"], _flag["peer"] = f"{FLAG_PREFIX}/{next(_flag_numbers)}", None
    done = threading.Event()

    def exit_unless_done(msg: str) -> None:  # the deadline runs even if the abort hangs
        if done.wait(grace_s):
            return
        sys.stderr.write(
            f"rank {rank}: still blocked {grace_s:g} s after aborting its process group; "
            f"exiting. Another rank failed: {msg}\n"
        )
        sys.stderr.flush()
        os._exit(1)

    def watch() -> None:
        while not done.wait(poll_s):
            msg = failure_flag(store)
            if msg is None:
                continue
            if msg.startswith(f"rank {rank}:"):
                return  # this rank's own failure: its main thread reports it
            _flag["peer"] = msg
            log.error("rank %d: another rank failed, aborting the process group: %s", rank, msg)
            threading.Thread(target=exit_unless_done, args=(msg,), daemon=True).start()
            abort_group(group)
            return

    thread = threading.Thread(target=watch, name="flashcp-watch-peers", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=poll_s + 1.0)


@contextlib.contextmanager
def abort_group_on_error(group=None, what: str = "step") -> Iterator[None]:
    """Run a block of collectives; if it raises on this rank, log the traceback with the rank
    (an ERROR record: the console and the job's log), abort ``group`` so no other rank waits for this one, and re-raise.

    An error that is this rank's view of another rank's abort (a collective failing because a peer
    closed the group) is re-raised as :class:`PeerFailure` with one line, so only the rank that
    failed first prints a traceback.

    Raises:
        PeerFailure: another rank aborted the group.
        Exception: the block's own exception, after the abort.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    store = _default_store()  # gone once the group is aborted
    try:
        yield
    except PeerFailure:
        raise
    except Exception as exc:
        other = _flag["peer"] or failure_flag(store)  # the error a failing peer left
        if other is not None and other.startswith(f"rank {rank}:"):
            other = None  # this rank's own, from an earlier block
        peer = (
            other is not None
            or isinstance(exc, getattr(dist, "DistBackendError", ()))
            or any(sign in str(exc) for sign in _PEER_GONE)
        )
        if not peer:  # this rank failed first: say why to the others before leaving them
            raise_failure_flag(f"rank {rank}: {what}: {type(exc).__name__}: {exc}", store)
        abort_group(group)
        if peer:
            raise PeerFailure(
                f"rank {rank}: {what}: stopped, another rank failed ({other or exc})"
            ) from None
        text = f"rank {rank}: {what} failed; aborting the process group\n{traceback.format_exc()}"
        log.error("%s", text)  # Hydra's console and job log; stderr without logging config
        raise


def share_planning(plan_here, group=None) -> Planning:
    """One sequence's planning, done on rank 0 of ``group`` only and given to every rank of it:
    the plan (:func:`flashcp.ops.collectives.broadcast_plan`, digest-checked) with the planning
    rank's ``pad_tokens`` and ``plan_ms``, or its planner's failure as every rank's error.
    A collective of ``group`` (under its timeout).

    Args:
        plan_here: ``() -> (plan, pad_tokens, plan_ms, error)``
            (:func:`flashcp.executors.rows.plan_one`), called on rank 0 only.
    Returns:
        ``(plan, pad_tokens, plan_ms, error)``, the same on every rank (error: the ``status`` of
        a failed planning, plan None).
    """
    if group_size(group) == 1:
        return plan_here()
    if group_rank(group) == 0:
        plan, pad_tokens, plan_ms, err = plan_here()
    else:
        plan, pad_tokens, plan_ms, err = None, 0, 0.0, None
    head = [(pad_tokens, plan_ms, err)]  # first the outcome: a failure ends it on every rank
    root = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(head, src=root, group=group)
    pad_tokens, plan_ms, err = head[0]
    if err is not None:
        return None, pad_tokens, plan_ms, err
    return broadcast_plan(plan, group), pad_tokens, plan_ms, None


def init_from_env(timeout_s: float = 120.0):
    """Join (or create) the default process group; returns it.

    Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) uses the ``env://`` rendezvous; otherwise
    starts a one-rank group on 127.0.0.1. NCCL when CUDA is available (binding ``LOCAL_RANK``'s
    GPU), gloo otherwise. Every collective gets ``timeout_s``.
    """
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if cuda else "gloo"
        timeout = timedelta(seconds=float(timeout_s))
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=0,
                world_size=1,
                timeout=timeout,
            )
    return dist.group.WORLD


def _launch_sizes(env, world: int) -> tuple[int, int]:
    """(WORLD_SIZE, LOCAL_WORLD_SIZE) of the launch, checked (defaults: ``world`` ranks on one
    node)."""
    size = env.get("WORLD_SIZE", str(world))
    world = int(size) if size.isdigit() else world
    text = env.get("LOCAL_WORLD_SIZE", str(world))
    local = int(text) if text.isdigit() else 0
    if local < 1 or world % local:
        raise ValueError(
            f"LOCAL_WORLD_SIZE = {text!r} must be a positive integer dividing WORLD_SIZE = {world} "
            "(the same number of ranks on every node)"
        )
    return world, local


def launch_topology(group=None, env=None) -> Topology:
    """Where the launcher put the ranks of the CP group ``group``: its
    :class:`~flashcp.topology.Topology` over the nodes of the job.

    torchrun (and a submitit job, :func:`experiments.common.callbacks.export_submitit_rank_env`)
    numbers ranks node by node, ``RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK`` (torchrun's
    documentation, "Environment Variables"), so global rank g is on node
    ``g // LOCAL_WORLD_SIZE``; a process without ``LOCAL_WORLD_SIZE`` is on one node with every
    rank. Reads the environment and the group's ranks only (no collective).

    Args:
        group: the CP group (None: the default group; a one-rank group without
            torch.distributed).
        env: the environment (default ``os.environ``).
    Returns:
        the Topology: ``gpus_per_node`` = ``LOCAL_WORLD_SIZE``, ``consecutive`` when the group's
        ranks fill its nodes in order, ``strided`` when they go round the nodes.
    Raises:
        ValueError: ``LOCAL_WORLD_SIZE`` not a positive integer dividing ``WORLD_SIZE``, or the
            group's ranks on nodes that are neither pattern (naming the nodes).
    """
    env = os.environ if env is None else env
    group = resolve_group(group)
    if not dist.is_initialized():
        return Topology.single_node(1)
    world = dist.get_world_size()
    members = list(range(world)) if group is None else dist.get_process_group_ranks(group)
    _, local = _launch_sizes({**env, "WORLD_SIZE": str(world)}, world)
    hosts = [g // local for g in members]
    order = {h: i for i, h in enumerate(sorted(set(hosts)))}
    nodes = [order[h] for h in hosts]
    for placement in ("consecutive", "strided"):
        try:
            topo = Topology(len(members), local, placement, len(order))
        except ValueError:
            continue
        if topo.node_of.tolist() == nodes:
            return topo
    raise ValueError(
        f"the CP group's ranks {members} sit on nodes {nodes} (LOCAL_WORLD_SIZE = {local}): "
        "neither consecutive (filling each node in turn) nor strided (round the nodes)"
    )


def check_launch(launched: Topology, nodes: int | None, placement: str) -> None:
    """Check the run's ``nodes`` / ``placement`` (the config keys of docs/multinode.md) against
    where the launch put the CP group (:func:`launch_topology`); before any collective.

    Raises:
        ValueError: (one line) a topology :class:`~flashcp.topology.Topology` refuses with the
            launch's ranks per node as ``gpus_per_node`` (nodes not dividing cp_size, more ranks
            on a node than the launch started there), or one that puts the ranks on other nodes.
    """
    where = f"nodes={nodes} placement={placement}"
    try:
        want = Topology(launched.cp_size, launched.gpus_per_node, placement, nodes)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc} (the launch: {launched.describe()})") from None
    if want.node_of.tolist() != launched.node_of.tolist():
        raise ValueError(
            f"{where} puts the CP ranks on nodes {want.node_of.tolist()}, but the launch put them "
            f"on {launched.node_of.tolist()} ({launched.describe()}; torchrun numbers ranks node "
            "by node, --nnodes x --nproc-per-node)"
        )


def launch_problem(cp_size: int, nodes: int | None, placement: str, env=None) -> str | None:
    """:func:`check_launch` for a run whose CP group is the whole launch, from the environment
    alone (before the process group exists): the message, or None (also outside a launch, no
    ``RANK``, where :func:`execute` checks once the group exists)."""
    env = os.environ if env is None else env
    if "RANK" not in env:
        return None
    try:
        world, local = _launch_sizes(env, int(cp_size))
        if world != int(cp_size):
            return None  # execute refuses it, naming both
        k = world // local
        check_launch(Topology(world, local, "consecutive", k), nodes, placement)
    except ValueError as exc:
        return str(exc)
    return None


def launch_nodes(env=None) -> int:
    """Nodes of the launch: ``WORLD_SIZE / LOCAL_WORLD_SIZE`` (1 outside torchrun or a job).

    Raises:
        ValueError: as :func:`launch_topology`.
    """
    env = os.environ if env is None else env
    world, local = _launch_sizes(env, 1)
    return world // local


def _checksum(tensors, group) -> str:
    """sha256 (first 16 hex digits) of every rank's ``tensors`` (their bytes, in order), ranks in
    group order: one ``all_gather_object`` of each rank's own digest."""
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    mine = h.hexdigest()
    every = [mine]
    if group_size(group) > 1:
        every = [None] * group_size(group)
        dist.all_gather_object(every, mine, group=group)
    return hashlib.sha256("".join(every).encode()).hexdigest()[:16]


def _reduce_max(values: list[float], group, device) -> list[float]:
    """Element-wise max over the ranks of ``group``."""
    if group_size(group) == 1:
        return values
    dev = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_step(
    plan: Plan,
    shape: AttnShape,
    mode: str,
    *,
    group=None,
    device=None,
    backend: str = "auto",
    warmup: int = 1,
    iters: int = 3,
    seed: int = 0,
    check: bool = True,
    op_options=None,
    topology: Topology | None = None,
) -> dict[str, float | int | str]:
    """Time one attention layer's CP step of ``plan`` on this process group.

    Args:
        plan: the plan (identical on every rank; checked by the op before its first collective).
        shape: heads, KV heads, head_dim and dtype of Q/K/V and of the communicated buffers.
        mode: ``train`` (forward + backward) or ``infer`` (forward only).
        group: the CP process group (size ``plan.cp_size``).
        device: where tensors live (default CPU).
        backend: kernel backend (:func:`flashcp.ops.backends.get_backend`).
        warmup: untimed steps first; iters: timed steps (median reported).
        seed: seeds Q, K, V and dO (same on every rank).
        check: raise if the counted bytes differ from :func:`flashcp.comm.comm_volume`.
        op_options: keyword options of the op (``keep_gathered_kv``), counted by the check too.
        topology: where the group's ranks are (:func:`launch_topology`): the bytes are also
            counted by link class (:meth:`flashcp.ops.collectives.CommCounter.by_link`) and, with
            ``check``, held per rank to :func:`flashcp.comm.comm_volume_by_link`.
    Returns:
        every key of :data:`PHASE_COLUMNS` (ms; median over steps, max over ranks; ``total_ms`` is
        the wall time of the whole step; phases the method lacks are 0.0) and of
        :data:`COMM_COLUMNS` (bytes received per step, max over ranks); with a topology
        ``intra_node_bytes`` and ``inter_node_bytes`` (per rank the sum over kinds, max over
        ranks); ``out_checksum``: :func:`_checksum` of every rank's output (``train``: and dQ, dK,
        dV) of the last step, the same for the same plan, seed and group size wherever the ranks
        run.
    Raises:
        ValueError: bad mode, group size different from ``plan.cp_size``, bad ``iters``, or (with
            ``check``) counted bytes that disagree with the plan (also per link class).
    """
    check_mode(mode)
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    group = resolve_group(group)
    n, rank = group_size(group), group_rank(group)
    if n != plan.cp_size:
        raise ValueError(f"plan is for cp_size = {plan.cp_size} but the group has {n} ranks")
    prepare, attn = get_attn_op(plan.method)
    meta = prepare(plan, rank)
    dtype = getattr(torch, shape.dtype)
    train = mode == "train"

    gen = torch.Generator(device=device).manual_seed(int(seed))
    c = plan.context_len

    def local(heads):  # seeded full tensor (same on every rank), then this rank's rows
        full = torch.randn(c, heads, shape.head_dim, generator=gen, device=device, dtype=dtype)
        return shard_tensor(full, plan, rank)

    q, k, v = local(shape.num_heads), local(shape.num_kv_heads), local(shape.num_kv_heads)
    dout = local(shape.num_heads) if train else None

    # small control tensors (the plan-digest all-gather) and NCCL's streams follow the current
    # CUDA device: make it the tensors' device
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        phases: dict[str, list[float]] = {name: [] for name in PHASE_COLUMNS}
        counted: dict[str, int] = {}
        for step in range(warmup + iters):
            timer = PhaseTimer(device)
            counter = CommCounter(topology, group) if topology is not None else CommCounter()
            ql, kl, vl = (x.detach().requires_grad_(train) for x in (q, k, v))
            if n > 1:
                dist.barrier(group=group)
            _sync(device)
            t0 = time.perf_counter()
            with torch.set_grad_enabled(train):
                out = attn(
                    ql, kl, vl, meta, group, backend=backend, counter=counter, timer=timer,
                    **(op_options or {}),
                )  # fmt: skip
                if train:
                    out.backward(dout)
            _sync(device)
            total = (time.perf_counter() - t0) * 1e3
            if step < warmup:
                continue
            ms = timer.as_ms()
            for name in PHASE_COLUMNS:
                phases[name].append(ms.pop(name.removesuffix("_ms"), 0.0))
            phases["others_ms"][-1] += sum(ms.values())  # phases outside the schema count as others
            phases["total_ms"][-1] = total
            counted = counter.as_dict()
        grads = (ql.grad, kl.grad, vl.grad) if train else ()
        checksum = _checksum([out, *grads], group)

    med = [statistics.median(phases[name]) for name in PHASE_COLUMNS]
    byte_vals = [float(counted[k]) for k in COMM_COLUMNS]
    if topology is not None:
        links = counter.by_link()
        if check:
            _check_links(links, plan, shape, mode, op_options, topology, rank)
        byte_vals += [float(sum(links[c].values())) for c in ("intra", "inter")]
    reduced = _reduce_max(med + byte_vals, group, device)
    result: dict[str, float | int] = dict(
        zip(PHASE_COLUMNS, reduced[: len(PHASE_COLUMNS)], strict=True)
    )
    byte_cols = [*COMM_COLUMNS, *(("intra_node_bytes", "inter_node_bytes") if topology else ())]
    result.update(
        {k: int(x) for k, x in zip(byte_cols, reduced[len(PHASE_COLUMNS) :], strict=True)}
    )
    result["out_checksum"] = checksum
    if check:
        check_comm(result, plan, shape, mode, op_options)
    return result


def _check_links(links, plan, shape, mode, op_options, topology, rank) -> None:
    """This rank's counted bytes by link class against :func:`flashcp.comm.comm_volume_by_link`.

    Raises:
        ValueError: a class and kind that differ (naming both counts).
    """
    from flashcp.comm import comm_volume_by_link
    from flashcp.registry import COMM_KIND

    want = comm_volume_by_link(
        plan, COMM_KIND[plan.method], shape, mode, topology, **(op_options or {})
    )
    for c, per in links.items():
        for kind, got in per.items():
            if got != int(want[c][kind][rank]):
                raise ValueError(
                    f"{plan.method}: rank {rank} counted {got} {c}-node {kind} bytes, the plan's "
                    f"{int(want[c][kind][rank])} ({topology.describe()})"
                )


def execute(runs, seqs, *, group=None):
    """``executor=dist``: run one plan per sequence for real on the process group
    (:mod:`flashcp.executors`' interface, the row loop of :mod:`flashcp.executors.rows`); rows on
    rank 0, None elsewhere.

    Rank 0 of ``group`` plans every sequence and gives every rank its plan, or its failure
    (:func:`share_planning`, once per sequence, before any step): a sequence whose planner fails
    is a row with ``status = "error: ..."`` on every rank, and the run goes on. An exception
    while measuring (inside collectives) cannot be recovered: the rank that raised prints it and
    aborts the group, so every other rank stops within seconds (:func:`abort_group_on_error`).

    Args:
        runs: exactly one :class:`flashcp.executors.RunSpec` (``executor`` options ``backend``,
            ``warmup``, ``iters``, ``timeout_s``).
        seqs: (n_docs,) int64 document lengths per sequence.
        group: the CP group (default: :func:`init_from_env`, ``torchrun``'s ranks; a process
            group or 1-D DeviceMesh that is one CP group of a larger job: rows on its rank 0).
    Returns:
        the rows (:func:`flashcp.executors.rows.finish_rows`) on rank 0, None on the others.
    Raises:
        ValueError: several runs, a group size other than the run's ``cp_size``, or the run's
            ``nodes`` / ``placement`` not where the launch put the ranks (:func:`check_launch`;
            before any collective).
    """
    if len(runs) != 1:
        raise ValueError(f"executor=dist runs one run per job, got {len(runs)}")
    run = runs[0]
    ex = dict(run.executor)
    if group is None:
        group = init_from_env(float(ex.get("timeout_s", 120.0)))
    group = resolve_group(group)
    world = group_size(group)
    if world != run.cp_size:
        raise ValueError(
            f"the CP group has {world} ranks (torchrun's, unless a group is given) but "
            f"cp_size = {run.cp_size}; they must match"
        )
    topology = launch_topology(group)
    check_launch(topology, getattr(run, "nodes", None), getattr(run, "placement", "consecutive"))
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )

    from flashcp.registry import split_options

    op_opts = split_options(run.method, run.options)[1]  # keep_gathered_kv: the op's, not planned

    def share(i: int, plan_here) -> Planning:
        with abort_group_on_error(group, f"sequence {i}, sharing its plan"):
            return share_planning(plan_here, group)

    def measure(plans: list[Plan], mode: str) -> dict[str, list]:
        (plan,) = plans
        i = seq_of[id(plan)]
        with abort_group_on_error(group, f"sequence {i}, mode {mode}"):
            res = measure_step(
                plan, run.shape, mode, group=group, device=device,
                backend=ex.get("backend", "auto"), warmup=int(ex.get("warmup", 1)),
                iters=int(ex.get("iters", 3)), seed=run.seed + i, op_options=op_opts,
                topology=topology,
            )  # fmt: skip
        return {k: [v] for k, v in res.items()}

    with watch_peers(group):
        planned = plan_sequences(run, seqs, share=share)
        seq_of = {
            id(p): int(planned.seq["seq_idx"][k])
            for k, p in zip(planned.ok, planned.plans, strict=True)
        }
        rows = measure_rows(run, planned, measure, batch=1, catch=False)
    if group_rank(group) != 0:
        return None
    return finish_rows([rows])


# ---- the plain entry point (no Hydra) ---------------------------------------------------------------


def main(argv=None) -> int:
    """``torchrun --nproc-per-node N -m flashcp.executors.dist --cp-size N ...``: ``executor=dist``
    without the Hydra harness (for an image with only PyTorch, NumPy and pandas).

    Samples ``--num-sequences`` sequences of ``--dataset`` (the seed of ``--seed``), runs each
    method of ``--methods`` through :func:`execute` on torchrun's ranks (one process group for all
    of them) and writes every row, with ``method``, ``dataset``, ``cp_size``, ``context_len`` and
    the shape, to ``--out`` (CSV, rank 0). The Hydra app (``-m experiments.run executor=dist``)
    runs the same :func:`execute` and adds the harness's identity and provenance columns.

    Returns:
        the exit code: 0 when every row is ``ok``, 1 otherwise.
    Raises:
        ValueError: bad arguments (a method, dataset, dtype or mode that does not exist, or
            ``--cp-size`` different from torchrun's world size).
    """
    import argparse

    import pandas as pd

    from flashcp.data import DATASETS, load_distribution, sample_sequences
    from flashcp.executors.spec import RunSpec
    from flashcp.registry import method_names
    from flashcp.results import write_csv_atomic

    ap = argparse.ArgumentParser(prog="python -m flashcp.executors.dist", description=main.__doc__)
    ap.add_argument("--methods", default=",".join(method_names(paper=True)), help="comma-separated")
    ap.add_argument("--cp-size", type=int, required=True, help="ranks: torchrun's world size")
    ap.add_argument("--dataset", default="wlb_llm", choices=[str(d) for d in DATASETS])
    ap.add_argument("--context-len", type=int, default=131072)
    ap.add_argument("--num-sequences", type=int, default=1)
    ap.add_argument("--num-heads", type=int, default=16)
    ap.add_argument("--num-kv-heads", type=int, default=None, help="default: --num-heads (MHA)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--modes", default="train,infer", help="comma-separated: train, infer")
    ap.add_argument("--backend", default="auto", help="kernel backend (auto, flash_attn, ...)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="bound on every collective")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="CSV file for the rows (written by rank 0)")
    args = ap.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    for m in modes:
        check_mode(m)
    unknown = sorted(set(methods) - set(method_names()))
    if not methods or unknown:
        raise ValueError(f"--methods: unknown {unknown or methods}; choose from {method_names()}")
    shape = AttnShape(
        args.num_heads, args.num_kv_heads or args.num_heads, args.head_dim, args.dtype
    )
    group = init_from_env(args.timeout_s)
    rank = group_rank(group)
    logging.basicConfig(
        level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s"
    )
    seqs = sample_sequences(
        load_distribution(args.dataset, context_len=args.context_len),
        args.num_sequences, args.context_len, seed=args.seed,
    )  # fmt: skip
    ex = {"backend": args.backend, "warmup": args.warmup, "iters": args.iters,
          "timeout_s": args.timeout_s}  # fmt: skip
    frames = []
    for method in methods:
        spec = RunSpec(method=method, cp_size=args.cp_size, shape=shape, modes=modes,
                       seed=args.seed, executor=ex)  # fmt: skip
        rows = execute([spec], seqs, group=group)
        if rows is not None:
            ident = {"method": method, "dataset": args.dataset, "cp_size": args.cp_size,
                     "context_len": args.context_len, "num_heads": shape.num_heads,
                     "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
                     "dtype": shape.dtype, "backend": args.backend}  # fmt: skip
            frames.append(rows.assign(**ident))
    if group_size(group) > 1:
        dist.barrier(group=group)  # nobody tears the group down while another rank still works
    dist.destroy_process_group()
    if rank != 0:
        return 0
    out = pd.concat(frames, ignore_index=True)
    write_csv_atomic(out, args.out)
    bad = out[out["status"] != "ok"]
    print(f"executor=dist: {len(out) - len(bad)} of {len(out)} rows ok; wrote {args.out}")
    return 1 if len(bad) else 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
