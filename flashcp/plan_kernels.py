"""numba kernels of the plan data model (:mod:`flashcp.plan`): building, checking and summing a
plan's shard columns in one pass each (:mod:`flashcp.compiled` says when they are used).

Each kernel computes exactly what the NumPy code it stands in for computes (the reference in
:mod:`flashcp.plan`); ``tests/test_compiled.py`` compares them. Arrays are (n_shards,) int64
columns ``rank, doc, start, length`` as in :class:`~flashcp.plan.Plan`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["merge_pieces", "plan_ok", "rank_sums"]


@njit(cache=True)
def merge_pieces(rank, doc, start, length):
    """The first steps of :func:`flashcp.plan.make_plan`: drop empty pieces, sort the rows stably
    by rank and, when each rank's rows are then in (doc, start) order, merge the pieces of a rank
    that continue each other (the merged shard at the place of its first piece).

    Args:
        rank, doc, start, length: (n,) int64, one entry per piece in each rank's local order.
    Returns:
        ``(merged, rank, doc, start, length)``: new (m,) int64 columns; ``merged`` False when some
        rank's rows are not in (doc, start) order, and the columns are then only filtered and
        sorted by rank (the caller merges them in general).
    """
    n = rank.size
    keep = 0
    for i in range(n):
        if length[i] != 0:
            keep += 1
    r = np.empty(keep, np.int64)
    d = np.empty(keep, np.int64)
    s = np.empty(keep, np.int64)
    ln = np.empty(keep, np.int64)
    j = 0
    by_rank = True
    for i in range(n):
        if length[i] != 0:
            r[j], d[j], s[j], ln[j] = rank[i], doc[i], start[i], length[i]
            if j and r[j] < r[j - 1]:
                by_rank = False
            j += 1
    if not by_rank:
        order = np.argsort(r, kind="mergesort")  # stable, as np.argsort(kind="stable")
        r, d, s, ln = r[order], d[order], s[order], ln[order]
    for i in range(1, keep):
        if r[i] == r[i - 1] and (d[i] < d[i - 1] or (d[i] == d[i - 1] and s[i] < s[i - 1])):
            return False, r, d, s, ln
    m = 0
    for i in range(keep):
        if m and r[i] == r[m - 1] and d[i] == d[m - 1] and s[i] == s[m - 1] + ln[m - 1]:
            ln[m - 1] += ln[i]
        else:
            r[m], d[m], s[m], ln[m] = r[i], d[i], s[i], ln[i]
            m += 1
    return True, r[:m].copy(), d[:m].copy(), s[:m].copy(), ln[:m].copy()


@njit(cache=True)
def plan_ok(cp_size, doc_lens, rank, doc, start, length, pad):
    """True when the plan satisfies every invariant :meth:`flashcp.plan.Plan.validate` checks
    (which then names the first one violated): pad of shape (N,) >= 0, shards non-empty, ranks in
    [0, N) and sorted, documents in range, shards inside their documents, every token of every
    document held exactly once, and C / N tokens on every rank.

    Args:
        cp_size: N.
        doc_lens: (n_docs,) int64.
        rank, doc, start, length: (n_shards,) int64.
        pad: (cp_size,) int64 expected (any shape is checked).
    """
    n = cp_size
    if pad.ndim != 1 or pad.size != n:
        return False
    num_docs = doc_lens.size
    cu = np.zeros(num_docs + 1, np.int64)
    for i in range(num_docs):
        if doc_lens[i] < 0:
            return False
        cu[i + 1] = cu[i] + doc_lens[i]
    total = cu[num_docs]
    tokens = np.zeros(n, np.int64)
    for q in range(n):
        if pad[q] < 0:
            return False
        tokens[q] = pad[q]
        total += pad[q]
    m = rank.size
    key = np.empty(m, np.int64)
    for i in range(m):
        q, x = rank[i], doc[i]
        if length[i] <= 0 or q < 0 or q >= n or (i and q < rank[i - 1]):
            return False
        if x < 0 or x >= num_docs or start[i] < 0 or start[i] + length[i] > doc_lens[x]:
            return False
        key[i] = cu[x] + start[i]  # the shard's first row in the packed sequence
        tokens[q] += length[i]
    # each shard lies inside its document: they tile the documents exactly when, in packed
    # order, they tile the document tokens [0, cu[-1])
    order = np.argsort(key)
    pos = 0
    for i in range(m):
        if key[order[i]] != pos:
            return False
        pos += length[order[i]]
    if pos != cu[num_docs] or total % n:
        return False
    for q in range(n):
        if tokens[q] != total // n:
            return False
    return True


@njit(cache=True)
def rank_sums(cp_size, doc_lens, rank, doc, start, length):
    """Per-rank sums of a plan: document tokens, workload (Eq. 3) and non-last tokens (Eq. 5).

    Args:
        cp_size: N.
        doc_lens: (n_docs,) int64.
        rank, doc, start, length: (n_shards,) int64 (ranks in [0, N)).
    Returns:
        ``(ok, tokens, work, send, shards)``: ``ok`` False (and the sums not computed) when a rank
        or a document index is out of range; (N,) int64 document tokens, (N,) float64 query-key
        pairs per head (summed in row order, as ``np.bincount`` with weights does), (N,) int64
        tokens of shards that do not end their document, (N,) int64 shards.
    """
    tokens = np.zeros(cp_size, np.int64)
    work = np.zeros(cp_size, np.float64)
    send = np.zeros(cp_size, np.int64)
    shards = np.zeros(cp_size, np.int64)
    for i in range(rank.size):
        q, p, s = rank[i], start[i], length[i]
        if q < 0 or q >= cp_size or doc[i] < 0 or doc[i] >= doc_lens.size:
            return False, tokens, work, send, shards
        tokens[q] += s
        work[q] += float((2 * p + s + 1) * s // 2)
        shards[q] += 1
        if p + s != doc_lens[doc[i]]:
            send[q] += s
    return True, tokens, work, send, shards
