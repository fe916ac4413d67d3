"""``executor=emulate``'s record pass: one thread per CP rank runs the op on its shard through
an in-memory process group (:class:`RecordingGroup`), and what each kept rank receives is stored
for the replay (moved out of :mod:`flashcp.executors.emulate`, which calls :func:`record`; the
module docstring there describes both passes).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flashcp.ops import get_attn_op
from flashcp.ops.collectives import LocalGroup
from flashcp.plan import Plan

__all__ = ["Recording", "RecordingGroup", "record"]


def _on_device(device: torch.device):
    """``torch.cuda.device(device)`` for a CUDA device (what the ops create goes there, and
    streams and events default to it), else nothing."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class _Abandoned(RuntimeError):
    """A rank gave up waiting because another rank had failed (not the failure to report)."""


class _World:
    """State shared by the rank threads of one recording, or of one of its sub-groups (``parent``
    given: ``ranks`` are their CP ranks; the failure flag and the kept buffers are the
    recording's, so a rank's calls in every group it belongs to land in one list, in order)."""

    def __init__(
        self, n: int, timeout_s: float, keep: set[int], parent: _World | None = None,
        ranks: Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        self.n = n
        self.timeout_s = float(timeout_s)
        self.barrier = threading.Barrier(n, timeout=self.timeout_s)
        self.slots: list = [None] * n
        self.mail: dict[tuple[int, int], queue.Queue] = {}
        self.lock = threading.Lock()
        self.ranks = list(range(n)) if ranks is None else list(ranks)
        self.root: _World = self if parent is None else parent.root
        self.subs: dict[tuple[int, ...], _World] = {}  # the root's: every sub-group, by CP ranks
        if parent is None:
            self.failed = threading.Event()
            self.received: dict[int, list[tuple[str, list[torch.Tensor]]]] = {r: [] for r in keep}
        else:
            self.failed, self.received = self.root.failed, self.root.received

    def sub(self, ranks: Sequence[int]) -> _World:
        """The sub-group of this group's positions ``ranks``; every member gets the same one."""
        members = tuple(self.ranks[i] for i in ranks)
        root = self.root
        with root.lock:
            if members not in root.subs:
                root.subs[members] = _World(len(members), self.timeout_s, set(), self, members)
            return root.subs[members]

    def abort(self) -> None:
        """Mark the recording failed and break every group's barrier (waiters give up)."""
        root = self.root
        root.failed.set()
        with root.lock:
            worlds = [root, *root.subs.values()]
        for w in worlds:
            w.barrier.abort()

    def box(self, dst: int, tag: int) -> queue.Queue:
        with self.lock:
            return self.mail.setdefault((dst, tag), queue.Queue())

    def sync(self) -> None:
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            if self.failed.is_set():
                raise _Abandoned("emulated collective abandoned: another rank failed") from None
            self.abort()
            raise RuntimeError(
                f"emulated collective: a rank did not arrive within {self.timeout_s} s"
            ) from None


def _subgroup_ranks(group: LocalGroup, ranks) -> list[int]:
    """``ranks`` checked for :meth:`LocalGroup.new_subgroup` (as a list of ints)."""
    n, me = group.size(), group.rank()
    try:
        got = [int(r) for r in ranks]
    except (TypeError, ValueError):
        raise ValueError(f"sub-group ranks must be integers, got {ranks!r}") from None
    if not got or got != sorted(set(got)) or not 0 <= got[0] <= got[-1] < n:
        raise ValueError(f"sub-group ranks must be distinct ascending ranks in [0, {n}), got {got}")
    if me not in got:
        raise ValueError(f"rank {me} asked for sub-group {got} without itself")
    return got


class RecordingGroup(LocalGroup):
    """Rank ``rank``'s view of an in-memory process group shared by threads (record pass).

    Collectives meet at a barrier (bounded by the recording's timeout) and compute their result
    from every rank's buffer; ring messages go through per-(destination, tag) queues, in order.
    What a kept rank receives is stored for :class:`flashcp.executors.emulate.ReplayGroup`.
    ``rank`` is a position in ``world`` (a sub-group's, from :meth:`new_subgroup`, or the CP
    group's).
    """

    def __init__(self, world: _World, rank: int) -> None:
        self.world = world
        self._rank = rank

    def size(self) -> int:
        return self.world.n

    def rank(self) -> int:
        return self._rank

    def members(self) -> list[int]:
        return list(self.world.ranks)

    def new_subgroup(self, ranks: list[int]) -> RecordingGroup:
        ranks = _subgroup_ranks(self, ranks)
        return RecordingGroup(self.world.sub(ranks), ranks.index(self._rank))

    def _keep(self, kind: str, tensors: list[torch.Tensor]) -> None:
        me = self.world.ranks[self._rank]
        if me in self.world.received:
            self.world.received[me].append((kind, [t.detach().clone() for t in tensors]))

    def _exchange(self, value):
        """Deposit ``value``, wait for every rank's, return them all (then wait again so the slots
        can be reused)."""
        w = self.world
        w.slots[self._rank] = value
        w.sync()
        values = list(w.slots)
        w.sync()
        return values

    def all_gather_into_tensor(self, output, inp) -> None:
        parts = self._exchange(inp)
        torch.cat(parts, dim=0, out=output)
        self._keep("allgather", [output])

    def reduce_scatter_tensor(self, output, inp) -> None:
        parts = self._exchange(inp)
        m = output.shape[0]
        rows = slice(self._rank * m, (self._rank + 1) * m)
        acc = parts[0][rows].clone()
        for p in parts[1:]:
            acc += p[rows]
        output.copy_(acc)
        self._keep("reducescatter", [output])

    def all_to_all_single(self, output, inp) -> None:
        parts = self._exchange(inp)
        m = output.shape[0] // self.world.n
        mine = slice(self._rank * m, (self._rank + 1) * m)
        torch.cat([p[mine] for p in parts], dim=0, out=output)
        self._keep("alltoall", [output])

    def check_same_plan(self, plan) -> None:
        digests = self._exchange(plan.digest())
        if len(set(digests)) > 1:
            raise ValueError(f"ranks hold different plans (plan digests differ: {digests})")

    def ring_post(self, tensors, tag):
        nxt = (self._rank + 1) % self.world.n
        self.world.box(nxt, tag).put([t.detach().clone() for t in tensors])
        return tag

    def ring_wait(self, handle) -> list[torch.Tensor]:
        box = self.world.box(self._rank, handle)
        deadline = time.monotonic() + self.world.timeout_s
        while True:
            if self.world.failed.is_set():
                raise _Abandoned("emulated ring exchange abandoned: another rank failed")
            try:
                got = box.get(timeout=0.05)
                break
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"emulated ring exchange: nothing received within {self.world.timeout_s} s"
                    ) from None
        self._keep("p2p", got)
        return got


def _topological(root) -> list:
    """Autograd nodes reachable from ``root``, each before the nodes it feeds (its inputs')."""
    post, seen, stack = [], {root}, [(root, iter(root.next_functions))]
    while stack:
        node, children = stack[-1]
        for child, _ in children:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append((child, iter(child.next_functions)))
                break
        else:
            post.append(node)
            stack.pop()
    return post[::-1]


def _run_backward(out: torch.Tensor, dout: torch.Tensor, inputs: Sequence[torch.Tensor]):
    """Gradients of ``out`` w.r.t. the leaves ``inputs``, with the op's own autograd graph run on
    the calling thread (not by the autograd engine, whose single CUDA device thread would run
    every rank's backward in turn, so ranks waiting for each other would deadlock).

    Nodes run in topological order, each called with the gradient of its one output (the op's
    graph: its autograd Function and the views and pads around it); gradients reaching a leaf
    are summed. Returns a tuple like ``inputs`` (None where no gradient arrived).

    Raises:
        RuntimeError: a node with several outputs, or a custom Function returning gradients for
            inputs that are not graph edges (tensor inputs must come first).
    """
    grads: dict = {}
    pending = {out.grad_fn: dout}
    with torch.no_grad():  # as the engine runs a backward (no create_graph)
        for node in _topological(out.grad_fn):
            g = pending.pop(node, None)
            if g is None:
                continue
            leaf = getattr(node, "variable", None)
            if leaf is not None:  # AccumulateGrad of a leaf
                grads[leaf] = g if leaf not in grads else grads[leaf] + g
                continue
            if len(getattr(node, "_input_metadata", (None,))) != 1:
                raise RuntimeError(f"cannot run {type(node).__name__} (several outputs) here")
            custom = isinstance(node, torch.autograd.function.BackwardCFunction)
            res = node.apply(g) if custom else node(g)
            res = res if isinstance(res, tuple) else (res,)
            edges = node.next_functions
            if len(res) < len(edges) or any(r is not None for r in res[len(edges) :]):
                raise RuntimeError(
                    f"{type(node).__name__} returned gradients that do not line up with its inputs"
                )
            for (nxt, _), gn in zip(edges, res, strict=False):
                if nxt is not None and gn is not None:
                    pending[nxt] = gn if nxt not in pending else pending[nxt] + gn
    return tuple(grads.get(x) for x in inputs)


@dataclass
class Recording:
    """What the record pass keeps.

    Attributes:
        digest: the plan's digest.
        received: rank -> ``[(kind, buffers)]`` in call order, for the kept ranks.
        outputs: rank -> ``(out, dq, dk, dv)`` (gradients only in training) of the record pass.
    """

    digest: str
    received: dict[int, list[tuple[str, list[torch.Tensor]]]]
    outputs: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)


def record(
    plan: Plan,
    mode: str,
    inputs: Sequence[tuple[torch.Tensor, ...]],
    *,
    backend="auto",
    keep: Sequence[int] | None = None,
    keep_outputs: bool = False,
    timeout_s: float = 120.0,
    op_options: Mapping[str, Any] | None = None,
) -> Recording:
    """Run the plan's op on every rank at once, one thread per rank, in memory (untimed).

    Args:
        plan: the plan.
        mode: ``train`` or ``infer``.
        inputs: per rank ``(q, k, v[, dout])`` as
            :func:`flashcp.executors.emulate.seeded_inputs` gives.
        backend: kernel backend (name or instance).
        keep: ranks whose received buffers are kept (default: all).
        keep_outputs: also keep the kept ranks' ``(out, dq, dk, dv)``.
        timeout_s: bound on every emulated collective and ring wait; the whole pass gets
            four times as long.
        op_options: keyword options of the op (e.g. ``keep_gathered_kv``).
    Returns:
        the :class:`Recording`.
    Raises:
        RuntimeError: a rank failed (its exception is chained) or a wait timed out.
    """
    n = plan.cp_size
    keep = set(range(n)) if keep is None else set(keep)
    world = _World(n, timeout_s, keep)
    prepare, attn = get_attn_op(plan.method)
    train = mode == "train"
    errors: list[BaseException | None] = [None] * n
    outputs: dict[int, tuple[torch.Tensor, ...]] = {}

    def record_rank(rank: int) -> None:
        meta = prepare(plan, rank)
        q, k, v = (x.detach().requires_grad_(train) for x in inputs[rank][:3])
        with torch.set_grad_enabled(train):
            out = attn(
                q, k, v, meta, RecordingGroup(world, rank), backend=backend, **(op_options or {})
            )
        grads = _run_backward(out, inputs[rank][3], (q, k, v)) if train else ()
        if keep_outputs and rank in keep:
            outputs[rank] = (out.detach(), *(g.detach() for g in grads))

    def body(rank: int) -> None:
        try:
            # the CUDA current device is per thread (a new thread starts on device 0): work on
            # the inputs' device, so whatever the op creates lands beside them
            with _on_device(inputs[rank][0].device):
                record_rank(rank)
        except BaseException as exc:  # surfaced by the caller
            errors[rank] = exc
            world.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    # on CPU the rank threads are the parallelism: intra-op pools of N threads at once would
    # oversubscribe the cores (the untimed record pass only; restored before the replay)
    intra_op = torch.get_num_threads()
    if inputs[0][0].device.type == "cpu":
        torch.set_num_threads(1)
    deadline = time.monotonic() + 4 * timeout_s
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        torch.set_num_threads(intra_op)
    if any(t.is_alive() for t in threads):
        world.abort()
        raise RuntimeError(f"record pass of {plan.method} did not finish within {timeout_s * 4} s")
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        # the first rank that failed for a reason of its own, not because a peer left
        primary = next(((r, e) for r, e in failed if not isinstance(e, _Abandoned)), failed[0])
        raise RuntimeError(f"record pass: rank {primary[0]} failed: {primary[1]}") from primary[1]
    return Recording(plan.digest(), world.received, outputs)
