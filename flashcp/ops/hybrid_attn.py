"""Hybrid head-parallel CP: Ulysses inside groups of u ranks, another CP op across the groups
(``usp``: zigzag ring P2P; ``flashcp_ulysses``: FlashCP's sharding-aware KV all-gather).

Layout (:func:`flashcp.plan.head_parallel.split_groups`): ranks ``g u .. g u + u - 1`` form group g and
hold, in order, the rows of super-rank g of the plan's :meth:`~flashcp.plan.Plan.group_plan`.
Process groups (:func:`hybrid_groups`, 2-D): ``intra`` = the u ranks of this rank's group,
``cross`` = the G = N/u ranks with this rank's position j inside their groups; ranks are the CP
group's (group ranks, for a CP group that is one of several in a larger job). They are made with
``torch.distributed.new_group``, which every process of the job must call for every group in the
same order, so with several CP groups every process makes every CP group's 2-D groups
(:func:`hybrid_groups`); an in-process group of ``executor=emulate`` makes them with its
``new_subgroup``.

Forward: KV heads replicated when num_kv_heads < u; one all-to-all inside the group
(:func:`flashcp.ops.ulysses_attn.scatter_heads`) gives each rank the super-rank's rows for its
H/u query heads and r Hkv/u KV heads; the inner op's forward runs over the cross group on the
group plan (``usp``: :func:`flashcp.ops.ring_attn.ring_forward` with the zigzag metadata of
super-rank g; ``flashcp_ulysses``: :func:`flashcp.ops.allgather_attn.allgather_attn_forward`
with the sharding-aware metadata of super-rank g) on the super-rank's document rows (its pad
rows, the last ones, take no part: output 0); one all-to-all brings the output back.

Backward: dO in through the group's all-to-all; the inner op's backward (its own cross-group
communication: the ring's KV and dK/dV hops, or the all-gather and reduce-scatter); dQ back in the
model dtype and dK / dV with it (in ``grad_comm_dtype`` when KV heads are replicated: the
replicas' sum is formed on the owning rank). Bytes per rank equal :func:`flashcp.comm.comm_volume`
for the method's comm kind on a plan with ``ulysses_degree`` u.

The two ends of the degree run their plain method, with nothing of the other around it:

* u = N (one group, whose super-rank holds every document whole): plain Ulysses,
  :func:`flashcp.ops.ulysses_attn.ulysses_forward` / ``ulysses_backward`` over the group (one
  varlen call over whole documents; no one-rank ring with its merges, no one-rank all-gather
  with its buffers).
* u = 1 (groups of one rank): the inner op alone on the rank's document rows (no all-to-all,
  no packing copies), as the ring or the all-gather op runs its own plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from flashcp.kinds import CommKind
from flashcp.ops.allgather_attn import (
    AllGatherMeta,
    allgather_attn_backward,
    allgather_attn_forward,
    build_allgather_meta,
)
from flashcp.ops.backends import VarlenBackend, get_backend, resolve_softmax_scale
from flashcp.ops.collectives import (
    LocalGroup,
    check_qkv,
    check_same_plan,
    group_size,
    resolve_grad_comm_dtype,
    resolve_group,
)
from flashcp.ops.ring_attn import RingMeta, prepare_ring_meta, ring_backward, ring_forward
from flashcp.ops.ring_comm import RingComm
from flashcp.ops.timing import as_timer
from flashcp.ops.ulysses_attn import (
    UlyssesMeta,
    fold_kv_grads,
    gather_heads,
    scatter_heads,
    ulysses_backward,
    ulysses_forward,
)
from flashcp.plan import Plan, cu_seqlens
from flashcp.plan.head_parallel import UlyssesHeads, one_group_documents, ulysses_heads

__all__ = [
    "HybridAttnFunction",
    "HybridGroups",
    "HybridMeta",
    "hybrid_attention",
    "hybrid_backward",
    "hybrid_forward",
    "hybrid_groups",
    "prepare_hybrid",
]


@dataclass(frozen=True)
class HybridGroups:
    """The 2-D process groups of one CP group: ``intra`` (this rank's u-rank group, for the
    all-to-alls), ``cross`` (the G ranks at this rank's position in every group, for the inner
    op); ``parent`` is the CP group they were made from (None: the default group)."""

    degree: int
    parent: object
    intra: object
    cross: object


def hybrid_groups(degree: int, group=None) -> HybridGroups:
    """Make the 2-D process groups of the CP group ``group`` for Ulysses degree u.

    Collective over the whole job: ``torch.distributed.new_group`` must be called by every process
    of the default group, in the same order, for every group, so every process calls this at the
    same point with its own CP group (one of disjoint CP groups covering the job, e.g. the
    ``cp`` groups of a data x CP mesh) and its degree. When ``group`` is the whole job the
    groups are made directly; otherwise the processes first all-gather their CP groups' ranks and
    degrees (one ``all_gather_object`` on the default group), check them, and make every CP
    group's N/u intra and u cross groups, CP groups in order of their ranks. Make them once and
    pass the result as the ops' ``group`` batch after batch (the ops otherwise make them on their
    first call, the same collective). An in-process
    :class:`~flashcp.ops.collectives.LocalGroup` (``executor=emulate``) makes this rank's two
    groups with its :meth:`~flashcp.ops.collectives.LocalGroup.new_subgroup` instead (no
    ``torch.distributed``).

    Args:
        degree: u, dividing the CP group's size N.
        group: None (the default group), a process group, a 1-D ``DeviceMesh``
            (:func:`~flashcp.ops.collectives.resolve_group`) or a LocalGroup.
    Returns:
        this process's :class:`HybridGroups` (``parent``: the CP process group).
    Raises:
        ValueError: ``degree`` does not divide N, or (on every process, after the all-gather)
            some process's does not, the CP groups of the job overlap, members of one CP group
            pass different degrees, or a CP group's ranks are not ascending in group-rank order.
    """
    group = resolve_group(group)
    n = group_size(group)
    bad = isinstance(degree, bool) or not isinstance(degree, int) or degree < 1 or n % degree
    error = (
        f"ulysses_degree = {degree!r} does not divide the {n} ranks of the group" if bad else None
    )
    if isinstance(group, LocalGroup):
        if error:
            raise ValueError(error)
        g, j = divmod(group.rank(), degree)
        intra = group.new_subgroup(list(range(g * degree, (g + 1) * degree)))
        return HybridGroups(degree, group, intra, group.new_subgroup(list(range(j, n, degree))))
    if not dist.is_initialized() or n == dist.get_world_size():  # the whole job is one CP group
        if error:
            raise ValueError(error)
        if n == 1:
            return HybridGroups(degree, group, None, None)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
        return _make_2d([(ranks, degree)], dist.get_rank(), group)
    ranks = dist.get_process_group_ranks(group)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (ranks, degree, error))  # the default group: the whole job
    return _make_2d(_cp_layout(every), dist.get_rank(), group)


def _cp_layout(every: list) -> list[tuple[list[int], int]]:
    """The job's CP groups and degrees, from every process's ``(ranks, degree, error)`` (the same
    list on every process, so every process raises the same error or none).

    Raises:
        ValueError: an error, overlapping groups, degrees that differ inside a group, or ranks
            that are not ascending.
    """
    for p, (_, _, error) in enumerate(every):
        if error is not None:
            raise ValueError(f"{error} (global rank {p})")
    layout: dict[tuple[int, ...], int] = {}
    for p, (ranks, degree, _) in enumerate(every):
        key = tuple(ranks)
        if layout.setdefault(key, degree) != degree:
            raise ValueError(
                f"the members of CP group {list(key)} pass different ulysses_degree values "
                f"({layout[key]} and {degree}, global rank {p})"
            )
        if list(key) != sorted(key):
            raise ValueError(
                f"CP group {list(key)}: its ranks must be ascending in group-rank order for its "
                "2-D groups"
            )
    owner: dict[int, tuple[int, ...]] = {}
    for key in layout:
        for r in key:
            if r in owner:
                raise ValueError(
                    f"the CP groups of the job overlap: {list(owner[r])} and {list(key)} share "
                    f"global rank {r}; every process must pass its own CP group, the CP groups "
                    "being disjoint"
                )
            owner[r] = key
    return [(list(key), layout[key]) for key in sorted(layout)]


def _make_2d(layout: list[tuple[list[int], int]], me: int, parent=None) -> HybridGroups:
    """Make every CP group's intra groups, then its cross groups, CP groups in ``layout`` order
    (``torch.distributed.new_group`` on every process, as torch requires); the groups of the CP
    group holding global rank ``me``."""
    mine = None
    for ranks, u in layout:
        if me not in ranks:
            for gg in range(len(ranks) // u):
                dist.new_group(ranks[gg * u : (gg + 1) * u])
            for jj in range(u):
                dist.new_group(ranks[jj::u])
            continue
        g, j = divmod(ranks.index(me), u)
        intra = cross = None
        for gg in range(len(ranks) // u):
            made = dist.new_group(ranks[gg * u : (gg + 1) * u])
            intra = made if gg == g else intra
        for jj in range(u):
            made = dist.new_group(ranks[jj::u])
            cross = made if jj == j else cross
        mine = HybridGroups(u, parent, intra, cross)
    return mine


#: 2-D groups already made in this process, per (CP group, degree): ``(group, default group at the
#: time, HybridGroups)``. Process groups are made once and kept (as torch.distributed keeps its
#: own), so a run over many batches does not create new ones per batch; a re-initialised default
#: group gets new ones.
_MADE: dict[tuple[int, int], tuple] = {}


def _groups_of(degree: int, group) -> HybridGroups:
    """:func:`hybrid_groups` of ``group``, made on the first call per (group, degree); an
    in-process group's are made anew each call (cheap, and not kept alive here)."""
    if isinstance(group, LocalGroup):
        return hybrid_groups(degree, group)
    world = dist.group.WORLD if dist.is_initialized() else None
    key = (id(group), degree)
    hit = _MADE.get(key)
    if hit is not None and hit[0] is group and hit[1] is world:
        return hit[2]
    made = hybrid_groups(degree, group)
    _MADE[key] = (group, world, made)
    return made


@dataclass(eq=False)
class HybridMeta:
    """Per-batch metadata of one rank (build with :func:`prepare_hybrid`).

    Attributes:
        method: the plan's method (``usp``, ``flashcp_ulysses``).
        plan: the N-rank plan (checked across the CP group before the first collective).
        rank: this rank; cp_size: N; degree: u.
        tokens: T = C / N local rows, pad included.
        inner: the inner op's metadata for super-rank ``rank // u`` of the group plan
            (:class:`~flashcp.ops.ring_meta.RingMeta` of the zigzag ring, or
            :class:`~flashcp.ops.allgather_attn.AllGatherMeta` of the sharding-aware all-gather);
            with one group (u = N) the :class:`~flashcp.ops.ulysses_attn.UlyssesMeta` of plain
            Ulysses over its whole documents.
        rows: the super-rank's rows the inner op runs on (the rest are pad).
    """

    method: str
    plan: Plan
    rank: int
    cp_size: int
    degree: int
    tokens: int
    inner: RingMeta | AllGatherMeta | UlyssesMeta
    rows: int
    _verified: set = field(default_factory=set, repr=False)


def _prepare(plan: Plan, rank: int, method: str) -> tuple[Plan, int, int]:
    if not isinstance(plan, Plan):
        raise ValueError(f"prepare_{method} needs a Plan, got {type(plan).__name__}")
    if plan.method != method:
        raise ValueError(f"prepare_{method} needs a {method!r} plan, got one for {plan.method!r}")
    n = plan.cp_size
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n:
        raise ValueError(f"rank must be an integer in [0, {n}), got {rank!r}")
    return plan.group_plan(), plan.ulysses_degree, int(rank)


def prepare_hybrid(plan: Plan, rank: int, method: str, comm_kind: CommKind | str) -> HybridMeta:
    """Metadata of ``rank`` for :func:`hybrid_attention` (pure: no process group).

    Args:
        plan: a head-parallel plan of ``method`` (``ulysses_degree`` u; its
            :meth:`~flashcp.plan.Plan.group_plan` is the layout across the groups).
        rank: 0 <= rank < cp_size.
        method: the plan's method.
        comm_kind: the op across the groups: ``p2p_ring`` (the ring,
            :func:`~flashcp.ops.ring_meta.prepare_ring_meta`, as ``usp``) or
            ``allgather_sharded`` (the sharding-aware all-gather,
            :func:`~flashcp.ops.allgather_attn.build_allgather_meta`, as ``flashcp_ulysses``).
    Raises:
        ValueError: not a plan of ``method``, ``rank`` out of range, or another ``comm_kind``.
    """
    groups, u, rank = _prepare(plan, rank, method)
    across = replace(groups, method=method)
    tokens = plan.context_len // plan.cp_size
    whole = one_group_documents(plan)
    if whole is not None and comm_kind in (CommKind.P2P_RING, CommKind.ALLGATHER_SHARDED):
        # one group holding every document whole: plain Ulysses over the group
        inner = UlyssesMeta(
            method=method, plan=plan, rank=rank, cp_size=plan.cp_size, tokens=tokens,
            doc_rows=int(whole.sum()), cu_seqlens=cu_seqlens(whole, device="cpu"),
            max_seqlen=int(whole.max()) if whole.size else 0,
        )  # fmt: skip
        return HybridMeta(method, plan, rank, plan.cp_size, u, tokens, inner, inner.doc_rows)
    if comm_kind == CommKind.P2P_RING:
        inner = prepare_ring_meta(across, rank // u, method)
        return HybridMeta(method, plan, rank, plan.cp_size, u, tokens, inner, inner.block_tokens)
    if comm_kind == CommKind.ALLGATHER_SHARDED:
        inner = build_allgather_meta(across, rank // u, method, True).without_pad()
        return HybridMeta(method, plan, rank, plan.cp_size, u, tokens, inner, inner.doc_tokens)
    raise ValueError(
        f"the hybrid op runs comm kinds {CommKind.P2P_RING} and {CommKind.ALLGATHER_SHARDED} "
        f"across its groups, not {comm_kind!r}"
    )


# ---- forward and backward -------------------------------------------------------------------------


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, rows - x.shape[0]))


def hybrid_forward(q, k, v, meta: HybridMeta, heads: UlyssesHeads, groups: HybridGroups, backend,
                   scale, counter, timer):  # fmt: skip
    """Hybrid forward (module docstring).

    Args:
        q: (T, H, D); k, v: (T, Hkv, D); checked by :func:`hybrid_attention`.
    Returns:
        out: (T, H, D) in q.dtype; saved: ``(q_h, k_h, v_h, out_h, lse_h)`` on the super-rank's
        ``meta.rows`` rows, H/u (and r Hkv/u) heads, the LSE (H/u, rows) in compute dtype.
    """
    if isinstance(meta.inner, UlyssesMeta):  # one group: plain Ulysses
        return ulysses_forward(q, k, v, meta.inner, heads, groups.intra, backend, scale, counter,
                               timer)  # fmt: skip
    u, r, rows = heads.degree, heads.kv_replication, meta.rows
    if u == 1:  # groups of one rank: the inner op alone on the document rows
        # no slice without pad: its backward would copy each gradient into a zeroed buffer
        q_h, k_h, v_h = ((x if rows == len(x) else x[:rows]).contiguous() for x in (q, k, v))
    else:
        with timer.phase("others"):
            if r > 1:
                k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        parts = scatter_heads([q, k, v], u, groups.intra, counter, timer)
        q_h, k_h, v_h = (x[:rows] for x in parts)
    if isinstance(meta.inner, RingMeta):
        comm = RingComm(groups.cross, q.device, counter) if meta.inner.cp_size > 1 else None
        out_h, lse_h = ring_forward(q_h, k_h, v_h, meta.inner.to(q.device), comm, backend, scale,
                                    timer)  # fmt: skip
    else:
        out_h, lse_h = allgather_attn_forward(q_h, k_h, v_h, meta.inner, groups.cross, scale,
                                              backend, counter, timer)  # fmt: skip
    with timer.phase("others"):
        full = _pad_rows(out_h, u * meta.tokens) if rows < u * meta.tokens else out_h
    out = full if u == 1 else gather_heads(full, u, groups.intra, counter, timer)
    return out, (q_h, k_h, v_h, out_h, lse_h)


def hybrid_backward(dout, saved, meta: HybridMeta, heads: UlyssesHeads, groups: HybridGroups,
                    backend, scale, counter, timer, grad_comm_dtype=None):  # fmt: skip
    """Hybrid backward (module docstring).

    Returns:
        dq: (T, H, D) in q's dtype; dk, dv: (T, Hkv, D) in k's dtype.
    """
    if isinstance(meta.inner, UlyssesMeta):  # one group: plain Ulysses
        return ulysses_backward(dout, saved, meta.inner, heads, groups.intra, backend, scale,
                                counter, timer, grad_comm_dtype)  # fmt: skip
    q_h, k_h, v_h, out_h, lse_h = saved
    u, r, rows, t = heads.degree, heads.kv_replication, meta.rows, meta.tokens
    if u == 1:
        do_h = (dout if rows == len(dout) else dout[:rows]).contiguous()
    else:
        (do_h,) = scatter_heads([dout], u, groups.intra, counter, timer)
        do_h = do_h[:rows].contiguous()
    if isinstance(meta.inner, RingMeta):
        comm = RingComm(groups.cross, q_h.device, counter) if meta.inner.cp_size > 1 else None
        dq_h, dk_h, dv_h = ring_backward(do_h, q_h, k_h, v_h, out_h, lse_h,
                                         meta.inner.to(q_h.device), comm, backend, scale, timer,
                                         grad_comm_dtype)  # fmt: skip
    else:
        dq_h, dk_h, dv_h = allgather_attn_backward(do_h, q_h, k_h, v_h, out_h, lse_h, meta.inner,
                                                   groups.cross, scale, backend, counter, timer,
                                                   grad_comm_dtype=grad_comm_dtype)  # fmt: skip
    if u == 1:  # the inner op's gradients, pad rows 0 (as the inner op alone gives them)
        with timer.phase("others"):
            return tuple(_pad_rows(x.to(y.dtype), t) if rows < t else x.to(y.dtype)
                         for x, y in ((dq_h, q_h), (dk_h, k_h), (dv_h, v_h)))  # fmt: skip
    kv_dtype = resolve_grad_comm_dtype(grad_comm_dtype, k_h.dtype) if r > 1 else k_h.dtype
    with timer.phase("others"):
        dq_h = _pad_rows(dq_h, u * t)
        dkv_h = _pad_rows(torch.cat([dk_h, dv_h], 1).to(kv_dtype), u * t)
    dq = gather_heads(dq_h, u, groups.intra, counter, timer)
    dkv = gather_heads(dkv_h, u, groups.intra, counter, timer)  # (T, 2 u h_kv, D)
    with timer.phase("others"):  # replicas of a KV head summed in float32 or wider
        acc = torch.promote_types(kv_dtype, torch.float32)
        dk, dv = fold_kv_grads(dkv, heads, acc, k_h.dtype)
    return dq, dk, dv


class HybridAttnFunction(torch.autograd.Function):
    """Autograd glue: saves the forward's head-parallel tensors and the call's context, and
    delegates to :func:`hybrid_forward` / :func:`hybrid_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, meta, heads, groups, backend, scale, counter, timer, gdt):
        out, saved = hybrid_forward(q, k, v, meta, heads, groups, backend, scale, counter, timer)
        ctx.save_for_backward(*saved)
        ctx.args = (meta, heads, groups, backend, scale, counter, timer, gdt)
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = hybrid_backward(dout.contiguous(), ctx.saved_tensors, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None, None


# ---- checks and the public entry points -----------------------------------------------------------


def _check_inputs(q, k, v, meta, method, group, grad_comm_dtype) -> UlyssesHeads:
    """Raise ValueError on inconsistent inputs, before any communication; the head split."""
    if not isinstance(meta, HybridMeta) or meta.method != method:
        raise ValueError(
            f"{method}_attn needs the metadata of prepare_{method}(plan, rank), got "
            f"{type(meta).__name__}"
        )
    parent = group.parent if isinstance(group, HybridGroups) else group
    if isinstance(group, HybridGroups) and group.degree != meta.degree:
        raise ValueError(
            f"process groups are for ulysses_degree {group.degree}, the plan's is {meta.degree}"
        )
    check_qkv(q, k, v, tokens=meta.tokens, rank=meta.rank, cp_size=meta.cp_size, group=parent)
    heads = ulysses_heads(q.shape[1], k.shape[1], meta.degree)
    resolve_grad_comm_dtype(grad_comm_dtype, k.dtype)  # raises on a bad value
    return heads


def hybrid_attention(q, k, v, meta: HybridMeta, group=None, *, method: str, softmax_scale=None,
                     backend="auto", counter=None, timer=None, grad_comm_dtype=None):  # fmt: skip
    """Hybrid CP attention of this rank's tokens (document-masked, causal); the public ops
    (``flashcp.ops.get_attn_op("usp")``, ...) bind their ``method``.

    Args:
        q: (C/N, num_heads, head_dim); k, v: (C/N, num_kv_heads, head_dim), laid out as the plan
            gives this rank (:func:`flashcp.ops.sharding.shard_tensor`). Any float dtype.
        meta: from :func:`prepare_hybrid` for ``method``.
        group: the N CP ranks (None: the default group; a process group or 1-D ``DeviceMesh``
            that is one CP group of a larger job; or an in-process
            :class:`~flashcp.ops.collectives.LocalGroup`), or their :func:`hybrid_groups`; for a
            plain group they are made on the first call with its degree (:func:`hybrid_groups`:
            a collective of every process of the job, which every CP group's op call makes at
            the same step) and reused by later calls in this process.
        softmax_scale, backend, timer: as every op's; counter: ``CommCounter`` (``alltoall``
            bytes, and the inner op's ``p2p`` or ``allgather`` / ``reducescatter`` bytes).
        grad_comm_dtype: dtype of the inner op's gradient partial sums and of replicated KV
            heads' gradients (default float32, float64 for float64 inputs).
    Returns:
        out: (C/N, num_heads, head_dim) in q.dtype, differentiable w.r.t. q, k and v.
    Raises:
        ValueError: bad inputs or metadata, heads that u does not divide (naming the valid
            degrees), a bad ``softmax_scale`` (all before any
            communication), or ranks holding different plans.
    """
    if not isinstance(group, HybridGroups):
        group = resolve_group(group)
    heads = _check_inputs(q, k, v, meta, method, group, grad_comm_dtype)
    scale = resolve_softmax_scale(softmax_scale, q.shape[2])
    be = (
        backend
        if isinstance(backend, VarlenBackend)
        else get_backend(backend, q.device, dtype=q.dtype, head_dim=q.shape[2])
    )
    if isinstance(group, HybridGroups):
        groups, parent = group, group.parent
    else:
        groups, parent = _groups_of(meta.degree, group), group
    if meta.cp_size > 1 and id(parent) not in meta._verified:
        check_same_plan(meta.plan, parent)
        meta._verified.add(id(parent))
    return HybridAttnFunction.apply(
        q, k, v, meta, heads, groups, be, scale, counter, as_timer(timer), grad_comm_dtype
    )
