"""The op of ``flashcp_node`` (node-aware FlashCP, docs/scale.md): the sharding-aware all-gather of
:mod:`flashcp.ops.allgather_attn` in two scopes.

FlashCP's op (Eq. 5 of the paper) all-gathers every rank's non-last shards over the whole CP
group. Here a non-last shard goes only as far as the ranks that can need it:

* a document whose shards all lie on one node (:func:`flashcp.comm.node_local_docs`): its non-last shards are all-gathered over the ranks of that node (the
  *node* scope: NVLink);
* a document that spans nodes: its non-last shards are all-gathered over the whole CP group (the
  *group* scope), as FlashCP's op does.

So each rank holds ``source = [local KV (T rows); node buffers (R * Mn rows); group buffers (N *
Mg rows)]`` (R ranks per node, Mn / Mg the largest node / group send buffer over all ranks, so
every rank issues the same collectives), and one index gather builds every segment's keys, as in
the one-scope op. The backward scatter-adds dK/dV into a buffer shaped like ``source`` and
reduce-scatters each scope's part over the same ranks it was gathered from. The node groups are
the 2-D groups of :func:`flashcp.ops.hybrid_attn.hybrid_groups` (consecutive placement: groups of
R consecutive ranks; strided: the ranks ``j, j + K, ...`` of K nodes), made on the first call.

Bytes one rank receives (:func:`flashcp.comm.node_scoped_comm_volume`): forward
``(R - 1) Mn + (N - 1) Mg`` rows of K and V, training the same again plus the reduce-scatters
of the same rows in ``grad_comm_dtype``. A plan for one node is run by the one-scope op itself
(:func:`flashcp.ops.allgather_attn.allgather_attention`), collective for collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from flashcp.comm import node_local_docs, plan_topology, uses_node_scope
from flashcp.ops.allgather_attn import (
    HEAD_GROUP_BUDGET_BYTES,
    AllGatherMeta,
    allgather_attention,
    build_allgather_meta,
    check_heads_per_group,
    check_inputs,
    resolve_backend,
)
from flashcp.ops.backends import compute_dtype, resolve_softmax_scale
from flashcp.ops.collectives import (
    all_gather_into_tensor,
    check_same_plan,
    reduce_scatter_tensor,
    resolve_grad_comm_dtype,
    resolve_group,
)
from flashcp.ops.timing import as_timer
from flashcp.plan import Plan, cu_seqlens

__all__ = ["NodeGatherMeta", "build_node_meta", "flashcp_node_attn", "prepare_flashcp_node"]

METHOD = "flashcp_node"


@dataclass(eq=False)
class NodeGatherMeta:
    """Per-rank metadata of a ``flashcp_node`` plan over several nodes.

    Attributes:
        method, plan, rank, cp_size, tokens, doc_tokens: as :class:`AllGatherMeta`.
        num_nodes: K; placement: ``consecutive`` or ``strided``; ranks_per_node: R.
        node_max, group_max: Mn, Mg, rows of the largest node / group send buffer (all ranks).
        node_rows, group_rows: (n,) int64, local rows this rank sends in each scope, in buffer
            order.
        kv_index: (Tk,) int64 rows of ``source`` forming every segment's keys.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: as :class:`AllGatherMeta`.
    """

    method: str
    plan: Plan
    rank: int
    cp_size: int
    tokens: int
    doc_tokens: int
    num_nodes: int
    placement: str
    ranks_per_node: int
    node_max: int
    group_max: int
    node_rows: torch.Tensor
    group_rows: torch.Tensor
    kv_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    _on_device: dict = field(default_factory=dict, repr=False)
    _verified: set = field(default_factory=set, repr=False)

    def tensors(self, device) -> tuple[torch.Tensor, ...]:
        """``(node_rows, group_rows, kv_index, cu_seqlens_q, cu_seqlens_k)`` on ``device``."""
        key = str(torch.device(device))
        if key not in self._on_device:
            names = ("node_rows", "group_rows", "kv_index", "cu_seqlens_q", "cu_seqlens_k")
            self._on_device[key] = tuple(getattr(self, x).to(device) for x in names)
        return self._on_device[key]

    def without_pad(self) -> NodeGatherMeta:
        """This metadata for the rank's document rows only (cached)."""
        if self.doc_tokens == self.tokens:
            return self
        if "without_pad" not in self._on_device:
            self._on_device["without_pad"] = replace(
                self, tokens=self.doc_tokens, _on_device={}, _verified=self._verified
            )
        return self._on_device["without_pad"]

    @property
    def gathered_rows(self) -> int:
        """Rows of ``source`` past the local ones: R Mn + N Mg."""
        return self.ranks_per_node * self.node_max + self.cp_size * self.group_max


def _slots(sends: np.ndarray, owner: np.ndarray, real_off: np.ndarray, n: int):
    """Each token's place in its owner's send buffer of one scope (-1: not sent) and the largest
    buffer over ranks."""
    cs = np.cumsum(sends)
    before = np.concatenate([[0], cs])[real_off]
    slot = np.where(sends, cs - 1 - before[owner], -1)
    most = int(np.bincount(owner, weights=sends, minlength=n).max()) if sends.size else 0
    return slot, most


def build_node_meta(plan: Plan, rank: int) -> NodeGatherMeta:
    """Build :class:`NodeGatherMeta` for ``rank`` of a ``flashcp_node`` plan (pure).

    Raises:
        ValueError: another method's plan, a rank out of range, or ranks holding unequal token
            counts.
    """
    if plan.method != METHOD:
        raise ValueError(f"this op runs {METHOD!r} plans, got a plan for {plan.method!r}")
    n = plan.cp_size
    if isinstance(rank, bool) or not 0 <= int(rank) < n:
        raise ValueError(f"rank {rank!r} out of range for cp_size = {n}")
    rank = int(rank)
    tok = plan.tokens_per_rank
    if (tok != tok[0]).any():
        raise ValueError(f"every rank must hold the same number of tokens, got {tok.tolist()}")
    topo = plan_topology(plan)
    node_of = topo.node_of
    pos = np.empty(n, dtype=np.int64)  # place of each rank in its node's group (ascending ranks)
    for k in range(topo.num_nodes):
        members = np.flatnonzero(node_of == k)
        pos[members] = np.arange(members.size)

    # token-level view, as build_allgather_meta
    real = plan.doc_tokens_per_rank
    real_off = cu_seqlens(real)[:-1]
    n_tok = int(real.sum())
    shard_of = np.repeat(np.arange(plan.num_shards), plan.length)
    within = np.arange(n_tok, dtype=np.int64) - cu_seqlens(plan.length)[:-1][shard_of]
    doc_off = cu_seqlens(plan.doc_lens)[:-1]
    packed = doc_off[plan.doc[shard_of]] + plan.start[shard_of] + within
    where = np.empty(n_tok, dtype=np.int64)
    where[packed] = np.arange(n_tok)
    owner = np.repeat(np.arange(n), real)
    local_row = np.arange(n_tok, dtype=np.int64) - real_off[owner]
    sends = ~plan.is_last[shard_of]
    local_doc = node_local_docs(plan, node_of)[plan.doc[shard_of]]
    node_slot, node_max = _slots(sends & local_doc, owner, real_off, n)
    group_slot, group_max = _slots(sends & ~local_doc, owner, real_off, n)

    doc, start, ln = plan.rank_shards(rank)
    klen = start + ln
    k_within = np.arange(int(klen.sum()), dtype=np.int64) - np.repeat(cu_seqlens(klen)[:-1], klen)
    key = where[np.repeat(doc_off[doc], klen) + k_within]
    own = owner[key] == rank
    by_node = ~own & (node_slot[key] >= 0)
    by_group = ~own & (group_slot[key] >= 0)
    if (~own & ~by_node & ~by_group).any() or (
        by_node & (node_of[owner[key]] != node_of[rank])
    ).any():
        raise ValueError("plan inconsistency: a needed key is held by another rank but not sent")
    r_tok = int(real[rank])
    r = topo.ranks_per_node
    kv_index = np.where(
        own,
        local_row[key],
        np.where(
            by_node,
            r_tok + pos[owner[key]] * node_max + node_slot[key],
            r_tok + r * node_max + owner[key] * group_max + group_slot[key],
        ),
    )
    mine = slice(int(real_off[rank]), int(real_off[rank]) + r_tok)

    def rows(x):
        return torch.from_numpy(np.flatnonzero(x[mine]).astype(np.int64))

    return NodeGatherMeta(
        method=METHOD, plan=plan, rank=rank, cp_size=n, tokens=int(tok[0]), doc_tokens=r_tok,
        num_nodes=topo.num_nodes, placement=topo.placement, ranks_per_node=r,
        node_max=node_max, group_max=group_max, node_rows=rows(sends & local_doc),
        group_rows=rows(sends & ~local_doc), kv_index=torch.from_numpy(kv_index.astype(np.int64)),
        cu_seqlens_q=cu_seqlens(ln, device="cpu"), cu_seqlens_k=cu_seqlens(klen, device="cpu"),
        max_seqlen_q=int(ln.max()) if ln.size else 0,
        max_seqlen_k=int(klen.max()) if klen.size else 0,
    )  # fmt: skip


def prepare_flashcp_node(plan: Plan, rank: int) -> AllGatherMeta | NodeGatherMeta:
    """Metadata of ``rank`` for a ``flashcp_node`` plan (pure: no process group): the one-scope
    all-gather's (:func:`flashcp.ops.allgather_attn.build_allgather_meta`, sharding-aware) for a
    plan on one node or whose planner kept one scope (:func:`flashcp.comm.uses_node_scope`),
    else :func:`build_node_meta`.

    Raises:
        ValueError: as :func:`build_node_meta`.
    """
    if not uses_node_scope(plan):
        return build_allgather_meta(plan, rank, METHOD, sharding_aware=True)
    return build_node_meta(plan, rank)


def _node_group(meta: NodeGatherMeta, group):
    """The process group of this rank's node (module docstring)."""
    from flashcp.ops.hybrid_attn import _groups_of

    if meta.placement == "consecutive":
        return _groups_of(meta.ranks_per_node, group).intra
    return _groups_of(meta.num_nodes, group).cross


def _heads_per_group(heads_per_group, meta: NodeGatherMeta, hkv: int, d: int, dtype) -> int:
    """KV heads per group: as :func:`flashcp.ops.allgather_attn.resolve_heads_per_group`, for the
    rows ``C/N + R Mn + N Mg`` of this op's gradient buffer (the same on every rank)."""
    check_heads_per_group(heads_per_group)
    if heads_per_group is not None:
        return min(int(heads_per_group), hkv)
    rows = meta.plan.context_len // meta.cp_size + meta.gathered_rows
    per_head = rows * 2 * d * compute_dtype(dtype).itemsize
    fits = [h for h in range(1, hkv + 1) if hkv % h == 0]
    return max([h for h in fits if h * per_head <= HEAD_GROUP_BUDGET_BYTES] or [1])


def _scopes(meta: NodeGatherMeta, node_group, group):
    """``(first row in source, rows per rank, ranks, send rows index, process group)`` of each
    non-empty scope, node first."""
    t, r, n = meta.tokens, meta.ranks_per_node, meta.cp_size
    out = []
    if meta.node_max:
        out.append((t, meta.node_max, r, 0, node_group))
    if meta.group_max:
        out.append((t + r * meta.node_max, meta.group_max, n, 1, group))
    return out


def _gather(k, v, meta, scopes, rows, counter, timer):
    """``source`` (T + R Mn + N Mg, 2, h, D) with the local KV and both scopes' buffers."""
    t = meta.tokens
    with timer.phase("others"):
        source = k.new_empty((t + meta.gathered_rows, 2, *k.shape[1:]))
        source[:t, 0] = k
        source[:t, 1] = v
    for first, m, ranks, which, grp in scopes:
        with timer.phase("others"):
            send = k.new_zeros((m, 2, *k.shape[1:]))
            torch.index_select(source[:t], 0, rows[which], out=send[: rows[which].numel()])
        with timer.phase("allgather"):
            all_gather_into_tensor(source[first : first + ranks * m], send, grp, counter)
    return source


class NodeGatherAttn(torch.autograd.Function):
    """Autograd glue: forward and backward of the two-scope all-gather, KV heads in groups."""

    @staticmethod
    def forward(ctx, q, k, v, meta, groups, scale, backend, counter, timer, hpg, gdt):
        timer = as_timer(timer)
        node_rows, group_rows, kv_index, cu_q, cu_k = meta.tensors(q.device)
        hkv, d = k.shape[1], k.shape[2]
        g = q.shape[1] // hkv
        h = _heads_per_group(hpg, meta, hkv, d, k.dtype)
        scopes = _scopes(meta, *groups)
        out = q.new_empty(q.shape)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=compute_dtype(q.dtype), device=q.device)
        for h0 in range(0, hkv, h):
            h1 = min(h0 + h, hkv)
            source = _gather(k[:, h0:h1], v[:, h0:h1], meta, scopes, (node_rows, group_rows),
                             counter, timer)  # fmt: skip
            with timer.phase("others"):
                k_seg, v_seg = source.index_select(0, kv_index).unbind(1)
                del source
                q_g = q[:, h0 * g : h1 * g].contiguous()
            with timer.phase("attn_fwd"):
                out_g, lse_g = backend.forward(
                    q_g, k_seg, v_seg, cu_q, cu_k, meta.max_seqlen_q, meta.max_seqlen_k,
                    causal=True, softmax_scale=scale,
                )  # fmt: skip
            with timer.phase("others"):
                out[:, h0 * g : h1 * g] = out_g
                lse[h0 * g : h1 * g] = lse_g
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = (meta, groups, scale, backend, counter, timer, h, gdt)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        meta, groups, scale, backend, counter, timer, h, gdt = ctx.call
        dout = dout.contiguous()
        node_rows, group_rows, kv_index, cu_q, cu_k = meta.tensors(q.device)
        t, hkv, d = k.shape
        g = q.shape[1] // hkv
        acc = compute_dtype(q.dtype)
        gdt = resolve_grad_comm_dtype(gdt, k.dtype)
        scopes = _scopes(meta, *groups)
        rows = (node_rows, group_rows)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for h0 in range(0, hkv, h):
            h1 = min(h0 + h, hkv)
            qh = slice(h0 * g, h1 * g)
            source = _gather(k[:, h0:h1], v[:, h0:h1], meta, scopes, rows, counter, timer)
            with timer.phase("others"):
                k_seg, v_seg = source.index_select(0, kv_index).unbind(1)
                n_rows = source.shape[0]
                del source
                args = [x[:, qh].contiguous() for x in (dout, q)]
                args += [k_seg, v_seg, out[:, qh].contiguous(), lse[qh]]
            with timer.phase("attn_bwd"):
                dq_g, dk_seg, dv_seg = backend.backward(
                    *args, cu_q, cu_k, meta.max_seqlen_q, meta.max_seqlen_k, causal=True,
                    softmax_scale=scale, grad_dtype=acc,
                )  # fmt: skip
            with timer.phase("others"):
                dq[:, qh] = dq_g
                dsource = torch.zeros((n_rows, 2, h1 - h0, d), dtype=acc, device=q.device)
                dsource[:, 0].index_add_(0, kv_index, dk_seg)
                dsource[:, 1].index_add_(0, kv_index, dv_seg)
                dlocal = dsource[:t]
            for first, m, ranks, which, grp in scopes:
                with timer.phase("others"):
                    rs_in = dsource[first : first + ranks * m].to(gdt)
                    rs_out = rs_in.new_empty((m, *rs_in.shape[1:]))
                with timer.phase("reducescatter"):
                    reduce_scatter_tensor(rs_out, rs_in, grp, counter)
                with timer.phase("others"):
                    n_sent = rows[which].numel()
                    dlocal.index_add_(0, rows[which], rs_out[:n_sent].to(acc))
            with timer.phase("others"):
                dk[:, h0:h1] = dlocal[:, 0]
                dv[:, h0:h1] = dlocal[:, 1]
        return dq, dk, dv, None, None, None, None, None, None, None, None


def flashcp_node_attn(
    q, k, v, meta, group=None, *, softmax_scale=None, backend="auto", counter=None, timer=None,
    grad_comm_dtype=None, heads_per_group=None,
):  # fmt: skip
    """CP attention of this rank's tokens for a ``flashcp_node`` plan (document-masked causal).

    Args:
        q: (T_local, H, D); k, v: (T_local, Hkv, D), laid out as the plan gives this rank; any
            float dtype (float64 end to end with ``backend="reference"``).
        meta: from :func:`prepare_flashcp_node`; reuse it for every layer.
        group: the CP process group (default: the world; a subgroup or a 1-D ``DeviceMesh``,
            :func:`~flashcp.ops.collectives.resolve_group`); its node groups are made on the
            first call (:func:`flashcp.ops.hybrid_attn.hybrid_groups`, collective over the job).
        softmax_scale, backend, counter, timer, grad_comm_dtype, heads_per_group: as
            :func:`flashcp.ops.allgather_attn.allgather_attention`.
    Returns:
        out: (T_local, H, D), differentiable w.r.t. q, k, v.
    Raises:
        ValueError: bad metadata, shapes, dtypes, options or group (before any communication),
            or ranks holding different plans.
    """
    from flashcp.ops.single_device import single_device_attention, takes_single_device_path

    if isinstance(meta, AllGatherMeta):  # one node: FlashCP's op, collective for collective
        if takes_single_device_path(meta):
            check_heads_per_group(heads_per_group)
            return single_device_attention(
                q, k, v, meta, group, method=METHOD, softmax_scale=softmax_scale,
                backend=backend, timer=timer, grad_comm_dtype=grad_comm_dtype,
            )  # fmt: skip
        return allgather_attention(
            q, k, v, meta, group, method=METHOD, softmax_scale=softmax_scale, backend=backend,
            counter=counter, timer=timer, grad_comm_dtype=grad_comm_dtype,
            heads_per_group=heads_per_group,
        )  # fmt: skip
    group = resolve_group(group)
    check_inputs(q, k, v, meta, NodeGatherMeta, METHOD, group)
    resolve_grad_comm_dtype(grad_comm_dtype, k.dtype)
    check_heads_per_group(heads_per_group)
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    kernel = resolve_backend(backend, q.device, dtype=q.dtype, head_dim=q.shape[-1])
    key = id(group)
    if key not in meta._verified:
        check_same_plan(meta.plan, group)
        meta._verified.add(key)
    groups = (_node_group(meta, group), group)
    r = meta.doc_tokens
    args = (meta.without_pad(), groups, scale, kernel, counter, timer, heads_per_group,
            grad_comm_dtype)  # fmt: skip
    if r == meta.tokens:
        return NodeGatherAttn.apply(q, k, v, *args)
    out = NodeGatherAttn.apply(q[:r], k[:r], v[:r], *args)
    return torch.nn.functional.pad(out, (0, 0, 0, 0, 0, meta.tokens - r))
