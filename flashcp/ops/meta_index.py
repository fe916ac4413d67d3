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

from flashcp.plan import Plan, cu_seqlens

__all__ = ["allgather_index", "ranges", "tiles_documents"]


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
