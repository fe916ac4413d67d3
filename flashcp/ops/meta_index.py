"""Shard-level builders of the ops' per-rank index metadata: the same arrays as the readable
token-level code in :func:`flashcp.ops.allgather_attn.build_allgather_meta` and
:mod:`flashcp.ops.ring_meta`, computed from the plan's shards (hundreds) instead of its tokens
(``C``), so that preparing a 128K batch costs well under a millisecond per rank.

Every index here is a concatenation of row ranges ``[b_i, b_i + l_i)``; :func:`ranges` writes
one with a single ``repeat`` and ``arange``. :func:`allgather_index` relies on the plan's shards
tiling every document (what :meth:`flashcp.plan.Plan.validate` checks) and returns None for a
plan that does not, so the caller runs the token-level reference (whose result, or error, is then
the one given). ``tests/unit/test_meta_index.py`` holds both equal on random plans of every method.
"""

from __future__ import annotations

import numpy as np

from flashcp.plan import Plan, cu_seqlens, shard_workload

__all__ = [
    "RING_CALL_FIELDS",
    "allgather_index",
    "ranges",
    "ring_call_groups",
    "ring_calls",
    "ring_segments",
    "tiles_documents",
]


def ranges(begin: np.ndarray, length: np.ndarray) -> np.ndarray:
    """The rows ``[begin_0, begin_0 + length_0), [begin_1, ...), ...`` one after another.

    Args:
        begin, length: (n,) int64, length >= 0.
    Returns:
        (sum(length),) int64.
    """
    begin = np.asarray(begin, dtype=np.int64)
    length = np.asarray(length, dtype=np.int64)
    first = cu_seqlens(length)
    return np.repeat(begin - first[:-1], length) + np.arange(int(first[-1]), dtype=np.int64)


def tiles_documents(plan: Plan) -> bool:
    """True when the plan's shards are sorted by rank (each in ``[0, cp_size)``), non-empty, and
    tile every document exactly (sorted by (doc, start) they run back to back from 0 to its
    length): the layout :func:`allgather_index` reads shard by shard."""
    rank, doc, start, length = plan.rank, plan.doc, plan.start, plan.length
    if rank.size == 0:
        return bool((plan.doc_lens == 0).all())
    if (length <= 0).any() or (np.diff(rank) < 0).any() or rank[0] < 0 or rank[-1] >= plan.cp_size:
        return False
    if (doc < 0).any() or (doc >= plan.num_docs).any() or (start < 0).any():
        return False
    order = np.lexsort((start, doc))
    d, s, ln = doc[order], start[order], length[order]
    first = np.ones(d.size, dtype=bool)
    first[1:] = d[1:] != d[:-1]
    expected = np.where(first, 0, np.concatenate([[0], s[:-1] + ln[:-1]]))
    if (s != expected).any():
        return False
    covered = np.zeros(plan.num_docs, dtype=np.int64)
    np.add.at(covered, d, ln)
    return bool((covered == plan.doc_lens).all())


def allgather_index(
    plan: Plan, rank: int, sharding_aware: bool
) -> tuple[int, np.ndarray, np.ndarray] | None:
    """``(send_max, send_rows, kv_index)`` of :class:`flashcp.ops.allgather_attn.AllGatherMeta`
    for ``rank``, from the shards; None when the plan's shards do not tile its documents
    (:func:`tiles_documents`).

    A shard's tokens sit together everywhere: in its owner's local rows (from ``local_off``), in
    the owner's send buffer when it is sent (from ``slot_off``: the sent tokens of the owner's
    earlier shards), and among a segment's keys, which are the prefix ``[0, start + length)`` of
    its document: the document's shards with ``start < start + length``, in order of start. So
    each key shard is one range of ``kv_index``: local rows when this rank owns it, else
    ``doc_tokens + owner * send_max + slot``.

    Returns:
        send_max: M, the most tokens a rank sends; send_rows: (n_send,) int64 local rows this
        rank sends; kv_index: (Tk,) int64 rows of ``[local; gathered]`` forming every segment's
        keys.
    Raises:
        ValueError: a key is held by another rank and not sent (as the reference).
    """
    if not tiles_documents(plan):
        return None
    n = plan.cp_size
    rk, doc, start, ln = plan.rank, plan.doc, plan.start, plan.length
    real = np.bincount(rk, weights=ln, minlength=n).astype(np.int64)
    rank_off = cu_seqlens(np.bincount(rk, minlength=n))  # shards of rank r: rank_off[r]..
    local_off = cu_seqlens(ln)[:-1] - cu_seqlens(real)[:-1][rk]
    sends = (start + ln != plan.doc_lens[doc]) if sharding_aware else np.ones(rk.size, dtype=bool)
    sent_len = np.where(sends, ln, 0)
    sent_before = cu_seqlens(sent_len)
    slot_off = sent_before[:-1] - sent_before[rank_off[:-1]][rk]
    per_rank = np.bincount(rk, weights=sent_len, minlength=n)
    send_max = int(per_rank.max()) if int(real.sum()) else 0

    own = rk == rank
    base = np.where(own, local_off, int(real[rank]) + rk * send_max + slot_off)
    mine = slice(int(rank_off[rank]), int(rank_off[rank + 1]))
    send_rows = ranges(local_off[mine][sends[mine]], ln[mine][sends[mine]])

    # each segment's key shards: its document's shards that start before the segment ends
    order = np.lexsort((start, doc))
    scale = int(plan.doc_lens.max()) + 1 if plan.doc_lens.size else 1
    key = doc[order] * scale + start[order]
    dq, klen = doc[mine], start[mine] + ln[mine]
    first = np.searchsorted(key, dq * scale, side="left")
    count = np.searchsorted(key, dq * scale + klen, side="left") - first
    shard = order[ranges(first, count)]
    if (~own[shard] & ~sends[shard]).any():
        raise ValueError("plan inconsistency: a needed key is held by another rank but not sent")
    return send_max, send_rows, ranges(base[shard], ln[shard])


def ring_segments(
    local: tuple[np.ndarray, ...], blocks: list[tuple[np.ndarray, ...]]
) -> tuple[np.ndarray, ...]:
    """The fused segments ``(step, q0, q1, k0, k1, causal)`` of every ring step at once, as
    arrays: for step s what ``_fuse(_shard_segments(local, blocks[s], same_rank=s == 0))`` of
    :mod:`flashcp.ops.ring_meta` lists, steps one after another.

    The pairs (query shard i, key shard j of its document in the step's block, in block order)
    that see each other (j = i on the rank's own block, step 0: causal; j ending before i
    starts: full) become runs where j's rows continue the previous full pair's; a query shard
    with a single run then fuses into the previous shard's single segment of the same step when
    one segment computes both (the conditions of ``_fuse``, which compare only each shard's
    segment with the previous one's).

    Args:
        local: ``(doc, start, length, offset)`` int64 arrays of the query rank's shards (offset =
            first row in the rank's buffer); shards non-empty.
        blocks: the same arrays of the KV block held at each step (``blocks[0]`` is ``local``).
    Returns:
        step, q0, q1, k0, k1: (n_seg,) int64; causal: (n_seg,) bool; by step, in ``_fuse``'s
        order within a step.
    """
    ld, ls, ll, lo = local
    nl, ns = ld.size, len(blocks)
    bstep = np.repeat(np.arange(ns), [b[0].size for b in blocks])
    bj = np.concatenate([np.arange(b[0].size) for b in blocks])  # index inside its block
    bd, bs, bl, bo = (np.concatenate([b[f] for b in blocks]) for f in range(4))
    span = int(max(ld.max(initial=-1), bd.max(initial=-1))) + 1
    key = bstep * span + bd
    border = np.argsort(key, kind="stable")
    want = (np.arange(ns)[:, None] * span + ld[None, :]).ravel()  # (step, i), step-major
    lo_j = np.searchsorted(key[border], want, side="left")
    cnt = np.searchsorted(key[border], want, side="right") - lo_j
    pu = np.repeat(np.arange(ns * nl), cnt)  # step * nl + i
    pj = border[ranges(lo_j, cnt)]
    pstep, pi = pu // nl, pu % nl
    causal = (pstep == 0) & (bj[pj] == pi)
    keep = causal | (bs[pj] + bl[pj] <= ls[pi])
    pu, pj, causal = pu[keep], pj[keep], causal[keep]
    k0, k1 = bo[pj], bo[pj] + bl[pj]
    if pu.size == 0:  # no pair sees another: no kernel call at any step
        return k0, k0.copy(), k0.copy(), k0.copy(), k0.copy(), causal
    # runs: a pair continues the run of the previous pair of its shard when the rows follow on
    # and that pair was full
    new = np.ones(pu.size, dtype=bool)
    new[1:] = (pu[1:] != pu[:-1]) | (k1[:-1] != k0[1:]) | causal[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:], pu.size) - 1
    ru, r0, r1, rc = pu[first], k0[first], k1[last], causal[last]
    ri = ru % nl
    q0, q1 = lo[ri], lo[ri] + ll[ri]
    # fuse: shard i's single segment into shard i - 1's single segment of the same step
    single = np.bincount(ru, minlength=ns * nl)[ru] == 1
    fuse = np.zeros(ru.size, dtype=bool)
    fuse[1:] = (
        single[1:] & single[:-1] & (ru[:-1] == ru[1:] - 1) & (ri[1:] > 0)
        & (q1[:-1] == q0[1:]) & (rc[:-1] == rc[1:]) & (r0[:-1] == r0[1:])
        & np.where(
            rc[1:],
            (r1[1:] - r0[1:]) - (q1[1:] - q0[1:]) == r1[:-1] - r0[:-1],
            r1[:-1] == r1[1:],
        )
    )  # fmt: skip
    head = np.flatnonzero(~fuse)
    tail = np.append(head[1:], ru.size) - 1
    return ru[head] // nl, q0[head], q1[tail], r0[tail], r1[tail], rc[head]


def ring_call_groups(
    step: np.ndarray, q0: np.ndarray, causal: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The segments of each varlen kernel call of every ring step: ``_calls``'s first fit
    (:mod:`flashcp.ops.ring_meta`) on a step's segments, which come in non-decreasing ``q0`` and
    whose query rows are one shard's (equal ranges) or disjoint. The k-th segment of one flag on
    the same rows goes to the k-th call of that flag (the first k are busy up to those rows' end;
    the next is free).

    Args:
        step, q0: (n,) int64 segments' ring step and first query row (by step);
        causal: (n,) bool.
    Returns:
        order: (n,) int64 positions of the segments, call after call (the calls by step, in the
        order they open within it); bounds: (n_calls + 1,) int64, call g's segments are
        ``order[bounds[g]:bounds[g + 1]]``.
    """
    m = q0.size
    if m == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
    order = np.lexsort((np.arange(m), causal, q0, step))
    ks, kq, kc = step[order], q0[order], causal[order]
    starts = np.ones(m, dtype=bool)
    starts[1:] = (ks[1:] != ks[:-1]) | (kq[1:] != kq[:-1]) | (kc[1:] != kc[:-1])
    first = np.maximum.accumulate(np.where(starts, np.arange(m), 0))
    k = np.empty(m, dtype=np.int64)
    k[order] = np.arange(m) - first
    call = (step * (k.max() + 1) + k) * 2 + causal  # one call per (step, k, flag)
    _, opened, which = np.unique(call, return_index=True, return_inverse=True)
    # number the calls in the order they open (their first segment's position: by step)
    seq = np.empty(opened.size, dtype=np.int64)
    seq[np.argsort(opened)] = np.arange(opened.size)
    pos = seq[which.ravel()]
    return np.argsort(pos, kind="stable"), cu_seqlens(np.bincount(pos, minlength=opened.size))


#: the rows of :func:`ring_calls`'s table: per call (its first ``n_calls`` columns) its ring step,
#: causal flag (0/1), pairs, longest query and key segment, first and end query row and whether
#: its query rows are that one slice (0/1), the same of its key rows; then (all ``n_calls + 1``
#: columns) offsets: of each call's ``cu_seqlens`` in ``cu``, of its query and key rows in ``rows``
RING_CALL_FIELDS = (
    "step", "causal", "pairs", "max_q", "max_k", "q_first", "q_last", "q_slice",
    "k_first", "k_last", "k_slice", "cu_at", "q_rows_at", "k_rows_at",
)  # fmt: skip


def ring_calls(segments: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every ring step's kernel calls at once, as flat arrays: what ``_block_call`` of
    :mod:`flashcp.ops.ring_meta` computes call by call, for the calls of :func:`ring_call_groups`
    on the segments of :func:`ring_segments`.

    A call's ``cu_seqlens`` are its segments' lengths' running sums from 0; its query (key) rows
    are one slice when its segments' ranges run back to back, else the rows of each range in turn
    (:func:`ranges`); its pairs are Eq. 3 of its causal (bottom-right aligned: prefix
    ``kl - ql``) segments, ``ql * kl`` of full ones.

    Args:
        segments: ``(step, q0, q1, k0, k1, causal)`` of :func:`ring_segments`.
    Returns:
        table: (len(RING_CALL_FIELDS), n_calls + 1) int64, the rows :data:`RING_CALL_FIELDS`,
        calls by step in the order they open; rows: (n_rows,) int64 the query rows then the key
        rows of the calls whose rows are not one slice; cu: (2, n_seg + n_calls) int64, row 0 the
        calls' ``cu_seqlens_q`` one after another (call g's at ``cu_at[g]:cu_at[g + 1]``), row 1
        their ``cu_seqlens_k``.
    """
    step, q0, q1, k0, k1, causal = segments
    order, bounds = ring_call_groups(step, q0, causal)
    step, q0, q1, k0, k1, causal = (a[order] for a in (step, q0, q1, k0, k1, causal))
    ncall, nseg = bounds.size - 1, order.size
    head, last = bounds[:-1], bounds[1:] - 1
    of = np.repeat(np.arange(ncall), np.diff(bounds))  # each segment's call
    same = of[1:] == of[:-1]
    ql, kl = q1 - q0, k1 - k0
    table = np.zeros((len(RING_CALL_FIELDS), ncall + 1), dtype=np.int64)
    table[:2, :ncall] = step[head], causal[head]
    if ncall:
        work = np.where(causal, shard_workload(kl - ql, ql), ql * kl)
        table[2:5, :ncall] = [np.add.reduceat(work, head)] + [
            np.maximum.reduceat(x, head) for x in (ql, kl)
        ]
    table[11] = bounds + np.arange(ncall + 1)  # call g's cu_seqlens: n_g + 1 entries
    cu = np.zeros((2, nseg + ncall), dtype=np.int64)
    at = np.arange(nseg) + of + 1
    for row, length in enumerate((ql, kl)):
        run = np.cumsum(length)
        cu[row, at] = run - (run - length)[head][of]
    rows = []
    for f, b, e, ln in ((5, q0, q1, ql), (8, k0, k1, kl)):
        broken = np.bincount(of[1:][same & (b[1:] != e[:-1])], minlength=ncall) > 0
        pick = broken[of]
        rows.append(ranges(b[pick], ln[pick]))
        table[f : f + 3, :ncall] = b[head], e[last], ~broken
        table[12 if f == 5 else 13] = cu_seqlens(
            np.bincount(of[pick], weights=ln[pick], minlength=ncall)
        )
    table[13] += rows[0].size
    return table, np.concatenate(rows), cu
