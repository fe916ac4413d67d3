"""Ring-family metadata: which varlen kernel calls each ring step makes (pure, no process group).

Rank r holds the shards of its plan in local order (``T_local = C / N`` rows on every rank). In
ring step ``s = 0 .. N-1`` it holds the KV block of rank ``src = (r - s) mod N`` and, for every
local query shard and every KV shard of the *same document* in that block:

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

Block sizes: every plan gives every rank exactly C/N tokens (``Plan.validate``), so every KV block
has the same shape ``(2, C/N, Hkv, D)`` and no size exchange or padding is needed; ``zigzag`` ranks
differ only in their *number* of segments. With pad tokens (``plan.pad``, the last rows of each
rank) the blocks are cut to ``RingMeta.block_tokens`` rows, the most document tokens any rank holds
(known from the plan, the same on every rank).

:func:`prepare_ring_meta` builds it once per batch; every layer reuses it. The runtime that walks
these calls around the ring is :mod:`flashcp.ops.ring_attn`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from flashcp import compiled
from flashcp.ops.collectives import check_same_plan
from flashcp.ops.meta_index import ranges as row_ranges
from flashcp.ops.meta_index import ring_calls, ring_segments
from flashcp.plan import Plan, cu_seqlens, shard_workload

__all__ = ["BlockCall", "RingMeta", "Rows", "prepare_ring_meta"]

Rows = slice | torch.Tensor
"""Rows of a tensor taking part in a call: a ``slice`` or a (n,) int64 index tensor."""

#: the most rows an int32 ``cu_seqlens`` holds
_INT32_MAX = int(np.iinfo(np.int32).max)


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
        method: the plan's method (``ring``, ``zigzag``, ...; checked by the op).
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


def _shard_segments(local, block, same_rank: bool) -> list[list[tuple]]:
    """Segments ``(q0, q1, k0, k1, causal)`` of each local query shard against one KV block.

    Args:
        local, block: ``(doc, start, length, offset)`` lists of the query rank's shards and of
            the block owner's shards (offset = first row in the rank's buffer).
        same_rank: the block is the query rank's own (step 0): a shard meets itself causally.
    """
    by_doc: dict[int, list[int]] = {}
    for j, d in enumerate(block[0]):
        by_doc.setdefault(d, []).append(j)
    _, ks, kl, ko = block
    out = []
    for i, (d, qs, ql, qo) in enumerate(zip(*local, strict=True)):
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


def _rows(begin: np.ndarray, end: np.ndarray) -> Rows:
    """A slice when the ranges ``[begin_i, end_i)`` are back to back, else the (sum of lengths,)
    int64 row index (each range's rows in turn, :func:`flashcp.ops.meta_index.ranges`)."""
    if (begin[1:] == end[:-1]).all():
        return slice(int(begin[0]), int(end[-1]))
    return torch.from_numpy(row_ranges(begin, end - begin))


def _block_call(causal: bool, q0, q1, k0, k1) -> BlockCall:
    """The kernel call of segments ``[q0, q1) x [k0, k1)`` ((n,) int64 each)."""
    ql, kl = q1 - q0, k1 - k0
    # causal segments are bottom-right aligned: prefix kl - ql, so Eq. 3 counts their pairs
    pairs = int((shard_workload(kl - ql, ql) if causal else ql * kl).sum())
    return BlockCall(
        causal,
        _rows(q0, q1),
        _rows(k0, k1),
        cu_seqlens(ql, device="cpu"),
        cu_seqlens(kl, device="cpu"),
        int(ql.max()),
        int(kl.max()),
        pairs,
    )


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
        q0, q1, k0, k1 = (np.array([seg[i] for seg in g], dtype=np.int64) for i in range(4))
        calls.append(_block_call(bool(g[0][4]), q0, q1, k0, k1))
    return tuple(calls)


def _steps(cols, bounds: np.ndarray, rank: int) -> tuple[tuple[BlockCall, ...], ...]:
    """``_calls(_fuse(_shard_segments(...)))`` of every ring step at once, with every call's
    index tensors views of two tensors made once: from the compiled kernel
    (:func:`flashcp.ops.ring_kernels.ring_calls`) when :mod:`flashcp.compiled` gives it, else from
    its NumPy twin (:func:`flashcp.ops.meta_index.ring_segments` and
    :func:`~flashcp.ops.meta_index.ring_calls`); the same calls either way.

    Args:
        cols: ``(doc, start, length, offset)`` (n_shards,) int64 columns of the plan's shards,
            sorted by rank (offset = first row in its rank's buffer).
        bounds: (N + 1,) int64, rank r's shards are ``bounds[r]:bounds[r + 1]``.
        rank: the query rank.
    Raises:
        ValueError: a call's rows do not fit int32 ``cu_seqlens``.
    """
    n = bounds.size - 1
    kernels = compiled.load("ring")
    if kernels is not None:
        table, rows, cu = kernels.ring_calls(*cols, bounds, rank)
    else:
        shards = [tuple(c[bounds[r] : bounds[r + 1]] for c in cols) for r in range(n)]
        table, rows, cu = ring_calls(
            ring_segments(shards[rank], [shards[(rank - s) % n] for s in range(n)])
        )
    if cu.size and cu.max() > _INT32_MAX:
        raise ValueError(f"{int(cu.max())} rows do not fit int32 cu_seqlens")
    rows, cu = torch.from_numpy(rows), torch.from_numpy(cu.astype(np.int32))
    step, causal, pairs, max_q, max_k, *qk, cu_at, q_at, k_at = table.tolist()
    steps: list[list[BlockCall]] = [[] for _ in range(n)]
    for g, s in enumerate(step):
        if g == len(step) - 1:  # the table's last column: the offsets' ends only
            break
        r = []
        for (first, last, whole), at in ((qk[:3], q_at), (qk[3:], k_at)):
            r.append(slice(first[g], last[g]) if whole[g] else rows[at[g] : at[g + 1]])
        a, b = cu_at[g], cu_at[g + 1]
        steps[s].append(
            BlockCall(
                bool(causal[g]), r[0], r[1], cu[0, a:b], cu[1, a:b], max_q[g], max_k[g], pairs[g]
            )
        )
    return tuple(tuple(calls) for calls in steps)


def ring_steps_reference(plan: Plan, rank: int) -> tuple[tuple[BlockCall, ...], ...]:
    """:attr:`RingMeta.steps` of ``rank`` shard by shard in Python (the readable reference of
    :func:`prepare_ring_meta`'s array code, which gives the same calls)."""
    shards = []
    for r in range(plan.cp_size):
        d, s, ln = plan.rank_shards(r)
        shards.append(tuple(a.tolist() for a in (d, s, ln, cu_seqlens(ln)[:-1])))
    steps = []
    for s in range(plan.cp_size):
        src = (rank - s) % plan.cp_size
        per_shard = _shard_segments(shards[rank], shards[src], same_rank=s == 0)
        steps.append(_calls(_fuse(per_shard)))
    return tuple(steps)


def prepare_ring_meta(plan: Plan, rank: int, method: str) -> RingMeta:
    """Build the ring-family metadata of ``rank`` (pure: no process group, no device).

    Args:
        plan: a plan of ``method`` (any valid layout: ``ring``, ``zigzag``, or any method whose
            spec names the ring op family).
        rank: this rank's index in ``[0, plan.cp_size)``.
        method: the method the caller runs (``plan.method`` must be it).
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
    bounds = plan.rank_offsets  # shards of rank r: bounds[r]:bounds[r + 1]
    first = cu_seqlens(plan.length)[:-1]  # each shard's first row, counted over all ranks
    cols = (plan.doc, plan.start, plan.length, first - first[bounds[plan.rank]])
    steps = _steps(cols, bounds, rank)
    block = int(plan.doc_tokens_per_rank.max())
    return RingMeta(method, plan, rank, n, plan.context_len // n, block, steps)
