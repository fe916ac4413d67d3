"""Counted collectives and the plan-agreement check.

Every CP op moves data through these wrappers so a :class:`CommCounter` can report the bytes this
rank *received*, by kind, with the same keys and conventions as :func:`flashcp.comm.comm_volume`:

* all-gather of a per-rank buffer of ``b`` bytes: this rank receives ``(N - 1) * b``;
* reduce-scatter to an output of ``b`` bytes per rank: this rank receives ``(N - 1) * b``;
* point-to-point: the bytes of every received buffer (the ring ops call :meth:`CommCounter.add`);
* all-to-all of a buffer of ``b`` bytes split in N equal parts: this rank receives
  ``(N - 1) / N * b`` (it keeps its own part).

Plans are made once per CP group and broadcast (:func:`broadcast_plan`, :func:`plan_on_one_rank`):
a time-limited ILP is not deterministic, and N ranks planning one sequence pay N times its time.

Gradient partial sums cross ranks in one dtype chosen by :func:`resolve_grad_comm_dtype` (the
``grad_comm_dtype`` option of every CP op).

``group`` is the CP group: None (the default group), a ``torch.distributed`` process group (one CP
group of several in a larger job: its ranks are the plan's ranks, P2P peers are translated to
global ranks where torch needs them), a 1-D ``DeviceMesh`` (e.g. ``mesh["cp"]``:
:func:`resolve_group`), or a :class:`LocalGroup`, an in-process stand-in for a process group: the
wrappers (and :class:`flashcp.ops.ring_comm.RingComm`) then route every collective through its
methods instead of ``torch.distributed``, and its :meth:`LocalGroup.new_subgroup` stands in for
``torch.distributed.new_group``. ``executor=emulate`` (:mod:`flashcp.executors.emulate`) uses it to
run the ops' own code for one rank on one device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from flashcp.comm import LINK_CLASSES
from flashcp.ops.backends import compute_dtype
from flashcp.plan import Plan

__all__ = [
    "COMM_KINDS",
    "GRAD_COMM_DTYPES",
    "CommCounter",
    "LocalGroup",
    "PlanningFailed",
    "all_gather_into_tensor",
    "all_to_all_single",
    "broadcast_plan",
    "check_qkv",
    "check_same_plan",
    "group_rank",
    "group_size",
    "plan_on_one_rank",
    "reduce_scatter_tensor",
    "resolve_grad_comm_dtype",
    "resolve_group",
]

COMM_KINDS: tuple[str, ...] = ("allgather", "reducescatter", "p2p", "alltoall")
#: names accepted by ``grad_comm_dtype`` (as in :data:`flashcp.comm.DTYPE_BYTES`)
GRAD_COMM_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32", "float64")


def resolve_grad_comm_dtype(grad_comm_dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype gradient partial sums travel in between ranks: the dK/dV reduce-scatter of the
    all-gather family (``llama3``, ``per_doc``, ``flashcp``) and the dK/dV ring hops of ``ring`` /
    ``zigzag``. Every op's ``grad_comm_dtype`` option goes through here.

    Args:
        grad_comm_dtype: None (default: :func:`flashcp.ops.backends.compute_dtype` of ``dtype``,
            i.e. float32 for bfloat16 / float16 / float32 models and float64 for float64), or a
            floating torch dtype or its name (one of :data:`GRAD_COMM_DTYPES`). A 16-bit choice
            halves those bytes but rounds every rank's partial sum before it is added, so the
            gradient error grows with cp_size.
        dtype: the model dtype (of k and v).
    Returns:
        a floating torch dtype.
    Raises:
        ValueError: anything else, naming the bad value.
    """
    if grad_comm_dtype is None:
        return compute_dtype(dtype)
    if isinstance(grad_comm_dtype, str) and grad_comm_dtype in GRAD_COMM_DTYPES:
        return getattr(torch, grad_comm_dtype)
    if isinstance(grad_comm_dtype, torch.dtype) and grad_comm_dtype.is_floating_point:
        return grad_comm_dtype
    raise ValueError(
        f"grad_comm_dtype must be None, a floating torch.dtype or one of "
        f"{', '.join(GRAD_COMM_DTYPES)}; got {grad_comm_dtype!r}"
    )


class CommCounter:
    """Bytes received by this rank, by kind of communication and, given a topology, by link class.

    ``as_dict()`` gives ``{"allgather_bytes", "reducescatter_bytes", "p2p_bytes", "alltoall_bytes",
    "comm_bytes"}``
    (the keys of :func:`flashcp.comm.comm_volume`; ``comm_bytes`` is their sum).

    Args:
        topology: optional :class:`flashcp.topology.Topology` of the CP group: the counted
            wrappers then also split each kind's bytes into ``intra`` (from a rank on this rank's
            node) and ``inter`` (from another node), :meth:`by_link`, by the rules of
            :func:`flashcp.comm.comm_volume_by_link` (docs/multinode.md): all-gather and
            reduce-scatter from this rank's predecessor on NCCL's ring over the group that runs
            them, visiting its members node by node; a ring exchange from the real source rank;
            an all-to-all chunk by chunk from each sender. None (the default): kinds only, as
            without nodes.
        group: the CP group (:func:`resolve_group`; None: the default group) whose rank r is CP
            rank r of ``topology``: ranks of the groups the ops run on (the hybrids' 2-D groups
            included) are mapped to CP ranks through it. Read only with a topology.
    Raises:
        ValueError: a topology whose ``cp_size`` is not the group's size, or that is not a
            Topology (before any collective).
    """

    def __init__(self, topology=None, group=None) -> None:
        self.bytes: dict[str, int] = dict.fromkeys(COMM_KINDS, 0)
        self.topology = topology
        self.links: dict[str, dict[str, int]] | None = None
        if topology is None:
            return
        from flashcp.topology import Topology

        if not isinstance(topology, Topology):
            raise ValueError(
                f"topology must be a flashcp.topology.Topology, got {type(topology).__name__}"
            )
        group = resolve_group(group)
        self._cp_globals = _member_ranks(group)
        if len(self._cp_globals) != topology.cp_size:
            raise ValueError(
                f"topology is for cp_size {topology.cp_size} but the CP group has "
                f"{len(self._cp_globals)} ranks"
            )
        self._cp_group = group
        self.links = {c: dict.fromkeys(COMM_KINDS, 0) for c in LINK_CLASSES}

    def add(self, kind: str, nbytes: int) -> None:
        """Count ``nbytes`` received bytes of ``kind`` (one of :data:`COMM_KINDS`).

        Raises:
            ValueError: unknown kind or negative byte count.
        """
        if kind not in self.bytes:
            raise ValueError(
                f"unknown communication kind {kind!r}; choose one of {', '.join(COMM_KINDS)}"
            )
        if nbytes < 0:
            raise ValueError(f"byte count must be >= 0, got {nbytes}")
        self.bytes[kind] += int(nbytes)

    # ---- per link class (with a topology) -------------------------------------------------------

    def cp_ranks(self, group) -> list[int]:
        """The CP ranks of ``group``'s members, in group-rank order (``group``: the CP group or
        a group of some of its ranks, as the ops pass it; a LocalGroup's own
        :meth:`LocalGroup.members`).

        Raises:
            ValueError: no topology, or a member outside the CP group.
        """
        if self.links is None:
            raise ValueError("this CommCounter has no topology")
        if isinstance(group, LocalGroup):
            return list(group.members())
        if group is self._cp_group:
            return list(range(len(self._cp_globals)))
        where = {g: r for r, g in enumerate(self._cp_globals)}
        out = []
        for g in _member_ranks(group):
            if g not in where:
                raise ValueError(f"global rank {g} of the op's group is not in the CP group")
            out.append(where[g])
        return out

    def _link(self, kind: str, nbytes: int, me: int, src: int) -> None:
        node = self.topology.node_of
        self.links["intra" if node[me] == node[src] else "inter"][kind] += int(nbytes)

    def add_ring_collective(self, kind: str, nbytes: int, group) -> None:
        """Count an all-gather or reduce-scatter of ``group`` of which this rank receives
        ``nbytes``: all of it from its predecessor on NCCL's ring over the group's members,
        node by node (by CP rank inside a node; :attr:`flashcp.topology.Topology.collective_ring`
        for the whole CP group)."""
        self.add(kind, nbytes)
        if self.links is None:
            return
        members = self.cp_ranks(group)
        me = members[group_rank(group)]
        node = self.topology.node_of
        ring = sorted(members, key=lambda r: (int(node[r]), r))
        self._link(kind, nbytes, me, ring[ring.index(me) - 1])

    def add_from(self, kind: str, nbytes: int, group, src: int) -> None:
        """Count ``nbytes`` received from rank ``src`` of ``group`` (a point-to-point receive)."""
        self.add(kind, nbytes)
        if self.links is not None:
            members = self.cp_ranks(group)
            self._link(kind, nbytes, members[group_rank(group)], members[src])

    def add_all_to_all(self, kind: str, chunk_bytes: int, group) -> None:
        """Count an all-to-all of ``group`` in which this rank receives ``chunk_bytes`` from
        every other member (its own chunk stays)."""
        members = self.cp_ranks(group) if self.links is not None else None
        n, me = group_size(group), group_rank(group)
        self.add(kind, (n - 1) * chunk_bytes)
        if members is not None:
            for j, src in enumerate(members):
                if j != me:
                    self._link(kind, chunk_bytes, members[me], src)

    def by_link(self) -> dict[str, dict[str, int]]:
        """``{"intra": {kind: bytes}, "inter": {kind: bytes}}`` received by this rank (kinds of
        :data:`COMM_KINDS`), the layout of one rank of :func:`flashcp.comm.comm_volume_by_link`.

        Raises:
            ValueError: the counter has no topology.
        """
        if self.links is None:
            raise ValueError("this CommCounter has no topology: pass CommCounter(topology=...)")
        return {c: dict(v) for c, v in self.links.items()}

    def reset(self) -> None:
        """Set every counter back to 0."""
        for kind in self.bytes:
            self.bytes[kind] = 0
        for per in (self.links or {}).values():
            for kind in per:
                per[kind] = 0

    def as_dict(self) -> dict[str, int]:
        out = {f"{kind}_bytes": int(n) for kind, n in self.bytes.items()}
        out["comm_bytes"] = sum(self.bytes.values())
        return out


def _member_ranks(group) -> list[int]:
    """Global ranks (a LocalGroup: CP ranks) of ``group``'s members, in group-rank order."""
    if isinstance(group, LocalGroup):
        return list(group.members())
    if not dist.is_initialized():
        return [0]
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


class LocalGroup:
    """Interface of an in-process stand-in for a CP process group (no ``torch.distributed``).

    The counted wrappers of this module and :class:`flashcp.ops.ring_comm.RingComm` call these
    methods when an op is given such a group; their semantics are those of the NCCL/gloo calls
    they replace, for the rank :meth:`rank` (buffers as in :func:`all_gather_into_tensor`,
    :func:`reduce_scatter_tensor` and :meth:`RingComm.post`). Implementations live in
    :mod:`flashcp.executors.emulate`.
    """

    def size(self) -> int:
        """N, ranks in the group."""
        raise NotImplementedError

    def rank(self) -> int:
        """The rank this group object acts for."""
        raise NotImplementedError

    def members(self) -> list[int]:
        """The CP ranks of this group's members, in rank order (a sub-group's differ from its
        positions; :meth:`CommCounter.cp_ranks`). Default: ``0 .. size() - 1``."""
        return list(range(self.size()))

    def all_gather_into_tensor(self, output: torch.Tensor, inp: torch.Tensor) -> None:
        """Fill ``output`` (N * n, ...) with every rank's ``inp`` (n, ...)."""
        raise NotImplementedError

    def reduce_scatter_tensor(self, output: torch.Tensor, inp: torch.Tensor) -> None:
        """Fill ``output`` (n, ...) with this rank's slice of the sum of every rank's ``inp``."""
        raise NotImplementedError

    def all_to_all_single(self, output: torch.Tensor, inp: torch.Tensor) -> None:
        """Fill part j of ``output`` (N * n, ...) with part ``rank`` of rank j's ``inp``
        (N * n, ...)."""
        raise NotImplementedError

    def check_same_plan(self, plan) -> None:
        """Raise ValueError unless every rank runs ``plan``."""
        raise NotImplementedError

    def new_subgroup(self, ranks: list[int]) -> LocalGroup:
        """The sub-group of this group's ranks ``ranks`` (ascending, this rank among them), acting
        for this rank: ranks in it are positions in ``ranks``. The in-process counterpart of
        ``torch.distributed.new_group``, except that a rank asks only for the groups it belongs to
        (the 2-D groups of :func:`flashcp.ops.hybrid_attn.hybrid_groups`).

        Raises:
            ValueError: ``ranks`` not distinct ascending ranks of this group, or without this
                rank.
        """
        raise NotImplementedError

    def ring_post(self, tensors: list[torch.Tensor], tag: int):
        """Send ``tensors`` to rank + 1, receive same-shaped buffers from rank - 1; a handle."""
        raise NotImplementedError

    def ring_wait(self, handle) -> list[torch.Tensor]:
        """The buffers received for ``handle`` (from :meth:`ring_post`)."""
        raise NotImplementedError


def check_qkv(q, k, v, *, tokens: int, rank: int, cp_size: int, group=None) -> None:
    """Validate one rank's inputs of a CP attention op, before any collective (every op's check).

    Args:
        q: (T, H, D); k, v: (T, Hkv, D): floating point, one dtype, one device, ``T == tokens``,
            ``H % Hkv == 0``.
        tokens: the rows the plan gives this rank; rank, cp_size: the rank and CP size the op's
            metadata was prepared for; group: the process group the op runs on (its size and this
            process's rank must be ``cp_size`` and ``rank``).
    Raises:
        ValueError: naming the first problem and its values.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(
                f"{name} must be a (tokens, heads, head_dim) tensor, got "
                f"{tuple(getattr(x, 'shape', ())) or type(x).__name__}"
            )
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if x.shape[0] != tokens:
            raise ValueError(
                f"rank {rank} holds {tokens} tokens in its plan, but {name} has {x.shape[0]} rows"
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head_dim of q ({q.shape[2]}) and k ({k.shape[2]}) differ")
    if k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"num_heads = {q.shape[1]} is not a multiple of num_kv_heads = {k.shape[1]}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    size, me = group_size(group), group_rank(group)
    if size != cp_size or me != rank:
        raise ValueError(
            f"metadata is for rank {rank} of {cp_size}, but this process is rank {me} of a "
            f"group of {size}"
        )


def resolve_group(group):
    """The process group an op runs on, from what a caller may pass as its CP group.

    Args:
        group: None (the default group), a ``torch.distributed.ProcessGroup`` (any subgroup of the
            job: the plan's rank r is this group's rank r), a 1-D ``DeviceMesh`` (its group; pass
            ``mesh["cp"]`` of a multi-dimensional mesh), or a :class:`LocalGroup`.
    Returns:
        None, the ProcessGroup, or the LocalGroup.
    Raises:
        ValueError: a multi-dimensional mesh (naming its dimensions), this process not a member
            (``torch.distributed.new_group`` gives non-members ``GroupMember.NON_GROUP_MEMBER``),
            or anything else (naming its type).
    """
    if group is None or isinstance(group, LocalGroup | dist.ProcessGroup):
        return group
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            "this process is not a member of the process group it was given "
            "(torch.distributed.new_group returns GroupMember.NON_GROUP_MEMBER to non-members); "
            "pass this process's own CP group"
        )
    mesh_type = _device_mesh_type()
    if mesh_type is not None and isinstance(group, mesh_type):
        if group.ndim != 1:
            names = getattr(group, "mesh_dim_names", None) or tuple(range(group.ndim))
            raise ValueError(
                f"the CP group must be a 1-D DeviceMesh, got one of {group.ndim} dimensions "
                f"{tuple(names)}; pass one of its dimensions, e.g. mesh[{names[-1]!r}]"
            )
        return group.get_group()
    raise ValueError(
        f"group must be None, a ProcessGroup, a 1-D DeviceMesh or a LocalGroup, got "
        f"{type(group).__name__} {group!r}"
    )


def _device_mesh_type():
    """torch's DeviceMesh class, or None where torch.distributed lacks it."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch builds without device_mesh
        return None
    return DeviceMesh


def group_size(group=None) -> int:
    """World size of ``group`` (1 when torch.distributed is not initialised)."""
    if isinstance(group, LocalGroup):
        return group.size()
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group=None) -> int:
    """This process's rank in ``group`` (0 when torch.distributed is not initialised)."""
    if isinstance(group, LocalGroup):
        return group.rank()
    return dist.get_rank(group) if dist.is_initialized() else 0


# torch >= 2.13 renames the tensor collectives (*_single); older versions have only the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather_into_tensor(
    output: torch.Tensor, inp: torch.Tensor, group=None, counter: CommCounter | None = None
) -> torch.Tensor:
    """All-gather equal-sized buffers, counted.

    Args:
        output: (N * n, ...) receives rank j's ``inp`` at rows ``j*n:(j+1)*n``.
        inp: (n, ...) this rank's contribution, contiguous, same dtype as ``output``.
    Returns:
        ``output``. With one rank it is a copy of ``inp`` and nothing is counted.
    """
    n = group_size(group)
    if n == 1:
        output.copy_(inp)
        return output
    if isinstance(group, LocalGroup):
        group.all_gather_into_tensor(output, inp.contiguous())
    else:
        _ALL_GATHER(output, inp.contiguous(), group=group)
    if counter is not None:
        counter.add_ring_collective("allgather", (n - 1) * _nbytes(inp), group)
    return output


def reduce_scatter_tensor(
    output: torch.Tensor, inp: torch.Tensor, group=None, counter: CommCounter | None = None
) -> torch.Tensor:
    """Sum ``inp`` over ranks and keep this rank's slice, counted.

    Args:
        output: (n, ...) receives ``sum_j inp_j[rank*n:(rank+1)*n]``.
        inp: (N * n, ...) contiguous, same dtype as ``output``.
    Returns:
        ``output``.
    """
    n = group_size(group)
    if n == 1:
        output.copy_(inp)
        return output
    if isinstance(group, LocalGroup):
        group.reduce_scatter_tensor(output, inp.contiguous())
    else:
        _REDUCE_SCATTER(output, inp.contiguous(), op=dist.ReduceOp.SUM, group=group)
    if counter is not None:
        counter.add_ring_collective("reducescatter", (n - 1) * _nbytes(output), group)
    return output


def all_to_all_single(
    output: torch.Tensor, inp: torch.Tensor, group=None, counter: CommCounter | None = None
) -> torch.Tensor:
    """All-to-all of equal parts, counted (``torch.distributed.all_to_all_single``; gloo and NCCL
    support it).

    Args:
        output: (N * n, ...) receives, at rows ``j*n:(j+1)*n``, part ``rank`` of rank j's ``inp``.
        inp: (N * n, ...) contiguous, same dtype and shape as ``output``; rows ``j*n:(j+1)*n`` go
            to rank j.
    Returns:
        ``output``. With one rank it is a copy of ``inp`` and nothing is counted.
    """
    n = group_size(group)
    if n == 1:
        output.copy_(inp)
        return output
    if isinstance(group, LocalGroup):
        group.all_to_all_single(output, inp.contiguous())
    else:
        dist.all_to_all_single(output, inp.contiguous(), group=group)
    if counter is not None:
        counter.add_all_to_all("alltoall", _nbytes(output) // n, group)
    return output


def _comm_device(group):
    """Device for small control tensors: the current CUDA device under NCCL, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_same_plan(plan, group=None) -> None:
    """Check every rank of ``group`` executes the same plan (one all-gather of its digest).

    Call before the first collective of an op that uses ``plan``; a mismatch then fails on every
    rank with the same message instead of hanging or computing garbage.

    Raises:
        ValueError: the digests differ; the message lists which ranks hold which digest.
    """
    n = group_size(group)
    if n == 1:
        return
    if plan.cp_size != n:
        raise ValueError(
            f"plan is for cp_size = {plan.cp_size} but the process group has {n} ranks"
        )
    if isinstance(group, LocalGroup):
        group.check_same_plan(plan)
        return
    mine = torch.tensor(
        [int(plan.digest()[:15], 16)], dtype=torch.int64, device=_comm_device(group)
    )
    every = torch.empty(n, dtype=torch.int64, device=mine.device)
    _ALL_GATHER(every, mine, group=group)
    vals = every.tolist()
    if len(set(vals)) > 1:
        by: dict[int, list[int]] = {}
        for r, x in enumerate(vals):
            by.setdefault(x, []).append(r)
        groups = "; ".join(f"ranks {rs} hold {x:015x}" for x, rs in by.items())
        raise ValueError(f"ranks hold different plans (plan digests differ: {groups})")


class PlanningFailed(RuntimeError):
    """The planner raised on the planning rank of :func:`broadcast_plan`; every rank of the group
    raises this, its message ``"<type>: <message>"`` of the planner's exception."""


def broadcast_plan(plan, group=None, *, src: int = 0) -> Plan:
    """Give every rank of ``group`` the plan made on its rank ``src`` (one
    ``broadcast_object_list`` on ``group``; the received plan's digest is checked).

    Plan each sequence on one rank of the CP group and call this on every rank of it, instead of
    planning on every rank: planners such as the time-limited ILP are not deterministic (thread
    timing, load), so ranks planning alone may hold different plans, and N ranks pay N times the
    planning time. A planner failure on ``src`` is passed on, so the other ranks raise too instead
    of waiting in the op's first collective. Under NCCL the object travels through the current
    CUDA device; pass a gloo group of the same ranks to keep it on the host.

    Args:
        plan: on ``src``: the :class:`~flashcp.plan.Plan`, or the exception its planner raised;
            on the other ranks: ignored (None).
        group: the CP group (:func:`resolve_group`: None, a process group, a 1-D DeviceMesh);
            an in-process :class:`LocalGroup` or a one-rank group sends nothing.
        src: the planning rank, a rank of ``group`` (not a global rank).
    Returns:
        the plan: ``plan`` itself on ``src``, an equal copy elsewhere.
    Raises:
        ValueError: ``src`` not a rank of the group (before any communication), or on ``src`` a
            ``plan`` that is neither a Plan nor an exception (every rank raises it).
        PlanningFailed: ``plan`` on ``src`` was an exception (every rank raises it).
        RuntimeError: a received plan whose digest differs from the sent one.
    """
    group = resolve_group(group)
    n = group_size(group)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < n:
        raise ValueError(f"src must be a rank of the group, in [0, {n}), got {src!r}")
    if n == 1 or isinstance(group, LocalGroup) or group_rank(group) == src:
        payload = _plan_payload(plan)
        if n > 1 and not isinstance(group, LocalGroup):
            _broadcast_objects([payload], group, src)
        return _unpack_plan(payload, plan)
    got = [None]
    _broadcast_objects(got, group, src)
    return _unpack_plan(got[0], None)


def plan_on_one_rank(planner: Callable[[], Plan], group=None, *, src: int = 0) -> Plan:
    """Run ``planner()`` on rank ``src`` of ``group`` only and give its plan to every rank
    (:func:`broadcast_plan`), e.g. in a training loop, once per batch on every rank of the CP
    group: ``plan = plan_on_one_rank(lambda: make_plan_for("ilp", doc_lens, cp_size), group)``.

    Args:
        planner: called with no arguments on ``src``, returns the Plan; never called elsewhere.
        group, src: as :func:`broadcast_plan`.
    Returns:
        the plan, on every rank.
    Raises:
        ValueError, RuntimeError: as :func:`broadcast_plan`.
        PlanningFailed: ``planner`` raised on ``src`` (on every rank).
    """
    group = resolve_group(group)
    n = group_size(group)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < n:
        raise ValueError(f"src must be a rank of the group, in [0, {n}), got {src!r}")
    plan = None
    if group_rank(group) == src or isinstance(group, LocalGroup):
        try:
            plan = planner()
        except Exception as exc:  # passed on to every rank by broadcast_plan
            plan = exc
    return broadcast_plan(plan, group, src=src)


def _plan_payload(plan) -> tuple:
    """What :func:`broadcast_plan` sends: ``("plan", plan, digest)``, ``("failed", message)`` or
    ``("bad", message)``."""
    if isinstance(plan, Plan):
        return ("plan", plan, plan.digest())
    if isinstance(plan, BaseException):
        return ("failed", f"{type(plan).__name__}: {plan}")
    return ("bad", f"broadcast_plan: the planning rank passed {type(plan).__name__}, not a Plan "
                   "or the exception its planner raised")  # fmt: skip


def _unpack_plan(payload: tuple, own) -> Plan:
    kind = payload[0]
    if kind == "failed":
        raise PlanningFailed(payload[1]) from (own if isinstance(own, BaseException) else None)
    if kind == "bad":
        raise ValueError(payload[1])
    plan, digest = payload[1], payload[2]
    if own is None and plan.digest() != digest:
        raise RuntimeError(
            f"broadcast_plan: the received plan's digest {plan.digest()} differs from the sent "
            f"{digest}"
        )
    return plan


def _broadcast_objects(objects: list, group, src: int) -> None:
    """``broadcast_object_list`` from group rank ``src`` (torch takes a global rank)."""
    root = src if group is None else dist.get_global_rank(group, src)
    dist.broadcast_object_list(objects, src=root, group=group)
