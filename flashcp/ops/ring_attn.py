"""Ring attention over document-masked varlen blocks, shared by ``ring`` and ``zigzag``.

Algorithm (Ring Attention, Liu et al. 2023; the varlen/zigzag scheduling of the ``ring-flash-attn``
package, re-derived here for arbitrary shard layouts). Rank r holds the shards of its plan in local
order (``q, k, v: (T_local, ., D)`` with ``T_local = C / N`` on every rank). In step
``s = 0 .. N-1`` it holds the KV block of rank ``src = (r - s) mod N`` and, for every local query
shard and every KV shard of the *same document* in that block:

* the same shard (step 0 only)   -> a causal segment (bottom-right aligned);
* a KV shard entirely before it  -> a full (non-causal) segment;
* a KV shard after it            -> nothing.

Shards of one document never overlap, so these three cases are exhaustive. Neighbouring pairs are
fused into as few varlen segments as possible (a query shard's visible KV shards that are adjacent
in the block become one segment; adjacent query shards with the same keys share one segment), and
segments go into at most a couple of varlen kernel calls per step (one causal, one full; more
only when a query row needs several non-adjacent key ranges). A step with no pair calls no
kernel at all: with the ``zigzag`` layout roughly half of every block is skipped, with ``ring``
every block from a later rank is.

Memory per rank, beyond q, k, v (T = C/N rows, e = element size, a = ``compute_dtype`` element
size, c = ``grad_comm_dtype`` element size): the forward holds the KV block it computes on and the
one it receives, 2 x 2 T Hkv D e, and the merge accumulators T H D a + H T a (with each call's
query / key slices and kernel outputs); the backward holds the same two KV blocks, dq
(T H D a), this rank's partial dK/dV of the held block and of its own block (2 x 2 T Hkv D a), the
partial sum it sends and the one it receives (2 x 2 T Hkv D c). None of it grows with N;
``experiments/bench_memory.py`` measures it.

All metadata is built once per batch by :func:`prepare_ring_meta` (pure, no process group) and
reused by every layer.

Block sizes: every plan gives every rank exactly C/N tokens (``Plan.validate``), so every KV block
has the same shape ``(2, C/N, Hkv, D)`` and no size exchange or padding is needed; ``zigzag`` ranks
differ only in their *number* of segments. With pad tokens (``plan.pad``, the last rows of each
rank) the blocks are cut to ``RingMeta.block_tokens`` rows, the most document tokens any rank holds
(known from the plan, the same on every rank): pad rows beyond that are never sent, and no kernel
call touches a pad row, so pad outputs and gradients are 0.

Forward: ``N - 1`` ring exchanges of the KV block (posted before the step's compute, waited after);
partial outputs merge by their LSE in ``compute_dtype`` of the inputs (float32, or float64 for
float64 inputs; :mod:`flashcp.ops.lse`).

Backward: the KV blocks travel around the ring again (``N - 1`` exchanges), dQ accumulates locally
in ``compute_dtype``, and the dK/dV partial sums of each block travel *with* the ring, one hop
behind the KV: rank ``src + 1`` starts the partial sum of block ``src`` (step 1), each following
rank adds its contribution and passes it on, and rank ``src - 1`` (step N-1) sends the sum home,
where the owner adds its own step-0 contribution, kept locally. That is ``N - 1`` dK/dV hops, so a
training step receives ``2 (N - 1)`` KV blocks of ``C/N`` tokens per rank plus ``N - 1`` dK/dV
blocks, exactly :func:`flashcp.comm.comm_volume` for ``p2p_ring``. The partial sums travel in
float32 by default (float64 for float64 inputs:
:func:`~flashcp.ops.collectives.resolve_grad_comm_dtype`), as :func:`~flashcp.comm.comm_volume`
counts and as the ``ring-flash-attn`` package does (it takes one hop more): summing in bfloat16
would round the growing sum at each hop, which at CP 8 puts dK/dV errors at up to ~3x a
single-device bfloat16 computation instead of within 2x. ``grad_comm_dtype=torch.bfloat16``
halves those bytes at that cost. Each block's gradients come from the backend backward fed with
the *global* merged ``out`` and ``lse`` (FlashAttention-2 backward, Dao 2023), which makes the
per-block contributions add up to the exact gradient.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from flashcp.ops.backends import VarlenBackend, compute_dtype, get_backend
from flashcp.ops.collectives import (
    check_same_plan,
    group_rank,
    group_size,
    resolve_grad_comm_dtype,
)
from flashcp.ops.lse import merge_lse_rows_, new_accumulator
from flashcp.ops.ring_comm import RingComm
from flashcp.ops.timing import as_timer
from flashcp.plan import Plan

__all__ = [
    "BlockCall",
    "RingAttnFunction",
    "RingMeta",
    "prepare_ring_meta",
    "ring_attention",
    "ring_backward",
    "ring_forward",
]

Rows = slice | torch.Tensor


# ---- metadata ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockCall:
    """One varlen kernel call of one ring step.

    Attributes:
        causal: bottom-right causal segments (True) or full segments (False).
        q_rows: rows of the local q taking part, in segment order: a ``slice`` or a (Tq,) int64
            tensor of distinct rows.
        k_rows: rows of the held KV block, in segment order: a ``slice`` or a (Tk,) int64 tensor
            (rows may repeat when two segments share keys).
        cu_seqlens_q, cu_seqlens_k: (n_seg + 1,) int32 segment boundaries in the gathered q / kv.
        max_seqlen_q, max_seqlen_k: longest segment.
        pairs: visible query-key pairs per head computed by this call.
    """

    causal: bool
    q_rows: Rows
    k_rows: Rows
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    pairs: int

    def to(self, device) -> BlockCall:
        def mv(x):
            return x if isinstance(x, slice) else x.to(device, non_blocking=True)

        return BlockCall(
            self.causal,
            mv(self.q_rows),
            mv(self.k_rows),
            mv(self.cu_seqlens_q),
            mv(self.cu_seqlens_k),
            self.max_seqlen_q,
            self.max_seqlen_k,
            self.pairs,
        )


@dataclass(frozen=True, eq=False)
class RingMeta:
    """Per-batch metadata of the ring family for one rank (build with :func:`prepare_ring_meta`).

    Attributes:
        method: ``ring`` or ``zigzag`` (checked by the op).
        plan: the plan it was built from (its digest is compared across ranks once).
        rank: this rank r.
        cp_size: N.
        local_tokens: C / N, rows of this rank's q, k and v (pad included).
        block_tokens: rows of every KV block sent around the ring: the most document tokens any
            rank holds (= ``local_tokens`` without pad).
        steps: ``steps[s]`` are the kernel calls on the KV block of rank ``(r - s) mod N``.
    """

    method: str
    plan: Plan
    rank: int
    cp_size: int
    local_tokens: int
    block_tokens: int
    steps: tuple[tuple[BlockCall, ...], ...]
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def kernel_calls(self) -> int:
        """Varlen kernel calls per forward pass (skipped blocks call none)."""
        return sum(len(calls) for calls in self.steps)

    @property
    def pairs(self) -> int:
        """Query-key pairs per head computed by this rank in one forward pass (equals the rank's
        Eq. 3 workload: nothing masked is computed)."""
        return sum(c.pairs for calls in self.steps for c in calls)

    def to(self, device) -> RingMeta:
        """This metadata with its index tensors on ``device`` (cached: cheap to call per layer)."""
        dev = torch.device(device)
        if dev.type == "cpu":
            return self
        key = str(dev)
        if key not in self._cache:
            steps = tuple(tuple(c.to(dev) for c in calls) for calls in self.steps)
            self._cache[key] = RingMeta(
                self.method,
                self.plan,
                self.rank,
                self.cp_size,
                self.local_tokens,
                self.block_tokens,
                steps,
                self._cache,
            )
        return self._cache[key]

    def check_plan_once(self, group) -> None:
        """Make sure every rank of ``group`` holds this plan (one digest all-gather, the first
        time only; shared by the device copies of this metadata).

        Raises:
            ValueError: the ranks' plans differ.
        """
        key = ("digest_checked", id(group))
        if key not in self._cache:
            check_same_plan(self.plan, group)
            self._cache[key] = True


def _offsets(length: np.ndarray) -> np.ndarray:
    return (np.cumsum(length) - length).astype(np.int64)


def _shard_segments(local, block, same_rank: bool) -> list[list[tuple]]:
    """Segments ``(q0, q1, k0, k1, causal)`` of each local query shard against one KV block.

    Args:
        local, block: ``(doc, start, length, offset)`` arrays of the query rank's shards and of
            the block owner's shards (offset = first row in the rank's buffer).
        same_rank: the block is the query rank's own (step 0): a shard meets itself causally.
    """
    by_doc: dict[int, list[int]] = {}
    for j, d in enumerate(block[0].tolist()):
        by_doc.setdefault(d, []).append(j)
    _, ks, kl, ko = (a.tolist() for a in block)
    out = []
    for i, (d, qs, ql, qo) in enumerate(zip(*(a.tolist() for a in local), strict=True)):
        runs: list[list] = []  # [k0, k1, causal]
        for j in by_doc.get(d, ()):
            if same_rank and j == i:
                causal = True
            elif ks[j] + kl[j] <= qs:
                causal = False
            else:  # after the query shard: masked
                continue
            if runs and runs[-1][1] == ko[j] and not runs[-1][2]:
                runs[-1][1], runs[-1][2] = ko[j] + kl[j], causal
            else:
                runs.append([ko[j], ko[j] + kl[j], causal])
        out.append([(qo, qo + ql, k0, k1, c) for k0, k1, c in runs])
    return out


def _fuse(per_shard: list[list[tuple]]) -> list[tuple]:
    """Fuse the single segments of adjacent query shards when one segment computes both.

    Full segments fuse when they have the same keys. Causal ones ``(Q1, K1)`` then ``(Q2, K2)``
    fuse into ``(Q1 + Q2, K2)`` when K1 is a prefix of K2 and ``|K2| - |Q2| = |K1|``: bottom-right
    alignment then gives every row of Q1 exactly the keys it had.
    """
    segs: list[tuple] = []
    prev_single = False
    for shard in per_shard:
        if len(shard) == 1 and prev_single:
            a, b = segs[-1], shard[0]
            if a[1] == b[0] and a[4] == b[4]:
                if not a[4] and (a[2], a[3]) == (b[2], b[3]):
                    segs[-1] = (a[0], b[1], a[2], a[3], False)
                    continue
                if a[4] and a[2] == b[2] and (b[3] - b[2]) - (b[1] - b[0]) == a[3] - a[2]:
                    segs[-1] = (a[0], b[1], b[2], b[3], True)
                    continue
        segs.extend(shard)
        prev_single = len(shard) == 1
    return segs


def _rows(ranges: list[tuple[int, int]]) -> Rows:
    """A slice when the ranges are back to back, else the (sum of lengths,) int64 row index."""
    if all(b[0] == a[1] for a, b in itertools.pairwise(ranges)):
        return slice(ranges[0][0], ranges[-1][1])
    return torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in ranges])


def _calls(segs: list[tuple]) -> tuple[BlockCall, ...]:
    """Group segments into kernel calls: one causal flag per call, disjoint query rows."""
    groups: list[list[tuple]] = []
    for seg in segs:  # segments arrive in non-decreasing q0: first fit keeps each call sorted
        for g in groups:
            if g[-1][4] == seg[4] and g[-1][1] <= seg[0]:
                g.append(seg)
                break
        else:
            groups.append([seg])
    calls = []
    for g in groups:
        ql = np.array([s[1] - s[0] for s in g], dtype=np.int64)
        kl = np.array([s[3] - s[2] for s in g], dtype=np.int64)
        causal = bool(g[0][4])
        pairs = int((ql * kl - (ql * (ql - 1) // 2 if causal else 0)).sum())
        calls.append(
            BlockCall(
                causal,
                _rows([(s[0], s[1]) for s in g]),
                _rows([(s[2], s[3]) for s in g]),
                torch.tensor(np.concatenate([[0], np.cumsum(ql)]), dtype=torch.int32),
                torch.tensor(np.concatenate([[0], np.cumsum(kl)]), dtype=torch.int32),
                int(ql.max()),
                int(kl.max()),
                pairs,
            )
        )
    return tuple(calls)


def prepare_ring_meta(plan: Plan, rank: int, method: str) -> RingMeta:
    """Build the ring-family metadata of ``rank`` (pure: no process group, no device).

    Args:
        plan: a ``ring`` or ``zigzag`` plan (any valid plan works; ``method`` must match it).
        rank: this rank's index in ``[0, plan.cp_size)``.
        method: the method the caller implements (``ring`` or ``zigzag``).
    Returns:
        :class:`RingMeta` with the varlen kernel calls of every ring step.
    Raises:
        ValueError: ``plan.method != method``, a rank out of range, or an invalid plan.
    """
    if not isinstance(plan, Plan):
        raise ValueError(f"expected a flashcp Plan, got {type(plan).__name__}")
    if plan.method != method:
        raise ValueError(f"{method} attention needs a {method!r} plan, got a {plan.method!r} plan")
    n = plan.cp_size
    if isinstance(rank, bool) or not isinstance(rank, int | np.integer) or not 0 <= rank < n:
        raise ValueError(f"rank must be an integer in [0, {n}), got {rank!r}")
    rank = int(rank)
    plan.validate()
    shards = []
    for r in range(n):
        d, s, ln = plan.rank_shards(r)
        shards.append((d, s, ln, _offsets(ln)))
    steps = []
    for s in range(n):
        src = (rank - s) % n
        per_shard = _shard_segments(shards[rank], shards[src], same_rank=s == 0)
        steps.append(_calls(_fuse(per_shard)))
    block = int(plan.doc_tokens_per_rank.max())
    return RingMeta(method, plan, rank, n, plan.context_len // n, block, tuple(steps))


# ---- forward and backward -------------------------------------------------------------------------


def _take(x: torch.Tensor, rows: Rows, dim: int = 0) -> torch.Tensor:
    if isinstance(rows, slice):
        return x[rows] if dim == 0 else x[:, rows].contiguous()
    return x.index_select(dim, rows)


def _add_rows(acc: torch.Tensor, rows: Rows, val: torch.Tensor) -> None:
    if isinstance(rows, slice):
        acc[rows] += val
    else:
        acc.index_add_(0, rows, val)


def ring_forward(
    q, k, v, meta: RingMeta, comm: RingComm | None, backend: VarlenBackend, scale: float, timer
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention forward (algorithm in the module docstring).

    Args:
        q: (T_local, H, D); k, v: (T_local, Hkv, D); checked by :func:`ring_attention`.
        meta: this rank's metadata, on q's device.
        comm: the ring (None when ``cp_size == 1``).
        backend: varlen kernel backend; scale: softmax scale; timer: phase timer.
    Returns:
        out: (T_local, H, D) in q.dtype; lse: (H, T_local) in ``compute_dtype(q.dtype)``.
    """
    t, h, d = q.shape
    out, lse = new_accumulator(t, h, d, q.device, dtype=q.dtype)
    kv = torch.stack([k, v])  # (2, T_local, Hkv, D): one message per step
    n = meta.cp_size
    for s in range(n):
        pending = comm.post([kv]) if s + 1 < n else None
        for call in meta.steps[s]:
            with timer.phase("attn_fwd"):
                o, lse_c = backend.forward(
                    _take(q, call.q_rows),
                    _take(kv[0], call.k_rows),
                    _take(kv[1], call.k_rows),
                    call.cu_seqlens_q,
                    call.cu_seqlens_k,
                    call.max_seqlen_q,
                    call.max_seqlen_k,
                    causal=call.causal,
                    softmax_scale=scale,
                )
            with timer.phase("others"):
                merge_lse_rows_(out, lse, call.q_rows, o, lse_c)
        if pending is not None:
            with timer.phase("p2p"):
                (kv,) = comm.wait(pending)
    return out.to(q.dtype), lse


def ring_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    meta: RingMeta,
    comm: RingComm | None,
    backend,
    scale: float,
    timer,
    grad_comm_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ring attention backward (algorithm in the module docstring).

    Args:
        dout, out: (T_local, H, D); q: (T_local, H, D); k, v: (T_local, Hkv, D);
        lse: (H, T_local) in ``compute_dtype(q.dtype)``, the merged forward LSE. Others as in
        :func:`ring_forward`.
        grad_comm_dtype: dtype of the dK/dV partial sums sent around the ring
            (:func:`~flashcp.ops.collectives.resolve_grad_comm_dtype`; default
            ``compute_dtype(k.dtype)``).
    Returns:
        dq: (T_local, H, D) in q.dtype; dk, dv: (T_local, Hkv, D) in k.dtype.
    """
    n = meta.cp_size
    acc = compute_dtype(q.dtype)  # partial sums: round once, at the end
    gdt = resolve_grad_comm_dtype(grad_comm_dtype, k.dtype)
    dout = dout.contiguous()
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    own = None  # this rank's contribution to its own block's dK/dV (step 0), kept locally
    incoming = None  # posted exchange of a dK/dV partial sum
    for s in range(n):
        pending = comm.post([kv], tag=0) if s + 1 < n else None
        dkv = None  # (2, T_local, Hkv, D) in acc: this rank's share of the held block's dK/dV
        for call in meta.steps[s]:
            with timer.phase("attn_bwd"):
                dq_c, dk_c, dv_c = backend.backward(
                    _take(dout, call.q_rows),
                    _take(q, call.q_rows),
                    _take(kv[0], call.k_rows),
                    _take(kv[1], call.k_rows),
                    _take(out, call.q_rows),
                    _take(lse, call.q_rows, dim=1),
                    call.cu_seqlens_q,
                    call.cu_seqlens_k,
                    call.max_seqlen_q,
                    call.max_seqlen_k,
                    causal=call.causal,
                    softmax_scale=scale,
                    grad_dtype=acc,
                )
            with timer.phase("others"):
                if dkv is None:
                    dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
                _add_rows(dq, call.q_rows, dq_c)
                _add_rows(dkv[0], call.k_rows, dk_c)
                _add_rows(dkv[1], call.k_rows, dv_c)
        if s == 0:
            own = dkv
        else:
            with timer.phase("p2p"):
                partial = comm.wait(incoming)[0] if incoming is not None else None
            with timer.phase("others"):
                if partial is None:
                    send = dkv.to(gdt) if dkv is not None else torch.zeros_like(kv, dtype=gdt)
                elif dkv is not None:
                    send = (partial.to(acc) + dkv).to(gdt)
                else:
                    send = partial
            incoming = comm.post([send], tag=1)
        if pending is not None:
            with timer.phase("p2p"):
                (kv,) = comm.wait(pending)
    with timer.phase("p2p"):
        home = comm.wait(incoming)[0].to(acc) if incoming is not None else None
    with timer.phase("others"):
        if own is None:
            own = torch.zeros(kv.shape, dtype=acc, device=q.device)
        total = own if home is None else own + home
        dk, dv = total.to(k.dtype).unbind(0)
    return dq.to(q.dtype), dk, dv


class RingAttnFunction(torch.autograd.Function):
    """Autograd glue: saves what the backward needs and delegates to :func:`ring_forward` and
    :func:`ring_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, meta, comm, backend, scale, timer, grad_comm_dtype):
        out, lse = ring_forward(q, k, v, meta, comm, backend, scale, timer)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (meta, comm, backend, scale, timer, grad_comm_dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


# ---- checks and the public entry point ------------------------------------------------------------


def _check_inputs(q, k, v, meta: RingMeta, method: str, group, grad_comm_dtype) -> None:
    """Raise ValueError on inconsistent inputs, before any communication."""
    if not isinstance(meta, RingMeta):
        raise ValueError(
            f"{method}_attn needs the metadata of prepare_{method}(plan, rank), got "
            f"{type(meta).__name__}"
        )
    if meta.method != method:
        raise ValueError(f"{method}_attn got metadata prepared for {meta.method!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a (T_local, heads, head_dim) tensor")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on "
            f"{q.device}/{k.device}/{v.device}"
        )
    t = meta.local_tokens
    if q.shape[0] != t or k.shape[0] != t:
        raise ValueError(
            f"rank {meta.rank} holds {t} tokens in its plan, but q has {q.shape[0]} rows and k "
            f"has {k.shape[0]}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head_dim of q ({q.shape[2]}) and k ({k.shape[2]}) differ")
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"num_heads = {q.shape[1]} is not a multiple of num_kv_heads = {k.shape[1]}"
        )
    resolve_grad_comm_dtype(grad_comm_dtype, k.dtype)  # raises on a bad value
    size, rank = group_size(group), group_rank(group)
    if size != meta.cp_size or rank != meta.rank:
        raise ValueError(
            f"metadata is for rank {meta.rank} of {meta.cp_size}, but this process is rank {rank} "
            f"of a group of {size}"
        )


def ring_attention(
    q,
    k,
    v,
    meta: RingMeta,
    group=None,
    *,
    method: str,
    softmax_scale: float | None = None,
    backend="auto",
    counter=None,
    timer=None,
    grad_comm_dtype: torch.dtype | str | None = None,
) -> torch.Tensor:
    """Document-masked causal attention of this rank's tokens with ring P2P (``ring``/``zigzag``).

    Args:
        q: (T_local, num_heads, head_dim); k, v: (T_local, num_kv_heads, head_dim); laid out as
            the plan says (``flashcp.ops.sharding.shard_tensor``). Any float dtype.
        meta: from ``prepare_<method>(plan, rank)``.
        group: process group of the N CP ranks (None: the default group).
        method: ``ring`` or ``zigzag`` (must match the metadata).
        softmax_scale: default ``1 / sqrt(head_dim)``.
        backend: a name for :func:`flashcp.ops.backends.get_backend` or a backend object.
        counter: optional ``CommCounter`` (adds received ``p2p`` bytes).
        timer: optional ``PhaseTimer`` (phases ``attn_fwd``, ``attn_bwd``, ``p2p``, ``others``).
        grad_comm_dtype: dtype of the dK/dV partial sums passed around the ring in the backward.
            Default (None): ``compute_dtype(k.dtype)`` (float32 for bf16/fp16/fp32, float64 for
            float64), which is what :func:`flashcp.comm.comm_volume` counts and keeps dK/dV
            within 2x of a single-device bfloat16 computation at CP 8. ``torch.bfloat16`` (or
            ``"bfloat16"``) halves those bytes but each of the N-1 hops then rounds the growing
            partial sum (up to ~3x the error at CP 8). Same option, default and validation as the
            all-gather ops (:func:`~flashcp.ops.collectives.resolve_grad_comm_dtype`).
    Returns:
        out: (T_local, num_heads, head_dim) in q.dtype, differentiable w.r.t. q, k, v.
    Raises:
        ValueError: inconsistent inputs or metadata (before any communication), an unavailable
            backend, or ranks holding different plans (after one small all-gather of digests).
    """
    _check_inputs(q, k, v, meta, method, group, grad_comm_dtype)
    be = get_backend(backend, q.device) if isinstance(backend, str) else backend
    scale = 1.0 / math.sqrt(q.shape[2]) if softmax_scale is None else float(softmax_scale)
    meta = meta.to(q.device)
    comm = None
    if meta.cp_size > 1:
        meta.check_plan_once(group)
        comm = RingComm(group, q.device, counter)
    b = meta.block_tokens  # pad rows beyond the block take no part: output 0, gradient 0
    out = RingAttnFunction.apply(
        q[:b].contiguous(),
        k[:b].contiguous(),
        v[:b].contiguous(),
        meta,
        comm,
        be,
        scale,
        as_timer(timer),
        grad_comm_dtype,
    )
    return (
        out
        if b == meta.local_tokens
        else torch.nn.functional.pad(out, (0, 0, 0, 0, 0, meta.local_tokens - b))
    )
