"""numba kernels of the plan data model (:mod:`flashcp.plan`): building, checking and summing a
plan's shard columns in one pass each (:mod:`flashcp.compiled` says when they are used).

Each kernel computes exactly what the NumPy code it stands in for computes (the reference in
:mod:`flashcp.plan`); ``tests/test_compiled.py`` compares them. Arrays are (n_shards,) int64
columns ``rank, doc, start, length`` as in :class:`~flashcp.plan.Plan`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = [
    "merge_pieces",
    "per_doc_layout",
    "per_doc_sizes",
    "plan_ok",
    "rank_sums",
    "split_packed",
]


@njit(cache=True)
def _stack(a, b, c, d, m):
    """(4, m) int64 of the first m entries of four columns."""
    out = np.empty((4, m), np.int64)
    for i in range(m):
        out[0, i], out[1, i], out[2, i], out[3, i] = a[i], b[i], c[i], d[i]
    return out


@njit(cache=True)
def merge_pieces(rank, doc, start, length):
    """The first steps of :func:`flashcp.plan.make_plan`: drop empty pieces, sort the rows stably
    by rank and, when each rank's rows are then in (doc, start) order, merge the pieces of a rank
    that continue each other (the merged shard at the place of its first piece).

    Args:
        rank, doc, start, length: (n,) int64, one entry per piece in each rank's local order.
    Returns:
        ``(merged, cols)``: cols (4, m) int64, the new columns rank, doc, start, length (one
        array: each array handed back to Python costs a microsecond); ``merged`` False when some
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
            return False, _stack(r, d, s, ln, keep)
    m = 0
    for i in range(keep):
        if m and r[i] == r[m - 1] and d[i] == d[m - 1] and s[i] == s[m - 1] + ln[m - 1]:
            ln[m - 1] += ln[i]
        else:
            r[m], d[m], s[m], ln[m] = r[i], d[i], s[i], ln[i]
            m += 1
    return True, _stack(r, d, s, ln, m)


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
    total = 0
    for i in range(num_docs):
        if doc_lens[i] < 0:
            return False
        total += doc_lens[i]
    tokens = np.zeros(n, np.int64)
    for q in range(n):
        if pad[q] < 0:
            return False
        tokens[q] = pad[q]
        total += pad[q]
    m = rank.size
    per_doc = np.zeros(num_docs + 1, np.int64)
    for i in range(m):
        q, x = rank[i], doc[i]
        if length[i] <= 0 or q < 0 or q >= n or (i and q < rank[i - 1]):
            return False
        if x < 0 or x >= num_docs or start[i] < 0 or start[i] + length[i] > doc_lens[x]:
            return False
        tokens[q] += length[i]
        per_doc[x + 1] += 1
    if total % n:
        return False
    for q in range(n):
        if tokens[q] != total // n:
            return False
    # exact coverage: each document's shards, by start, tile it (a counting sort by document,
    # then each document's few shards by start)
    for x in range(num_docs):
        per_doc[x + 1] += per_doc[x]
    fill = per_doc[:-1].copy()
    by_doc = np.empty(m, np.int64)
    for i in range(m):
        by_doc[fill[doc[i]]] = i
        fill[doc[i]] += 1
    for x in range(num_docs):
        lo, hi = per_doc[x], per_doc[x + 1]
        if hi - lo > 32:
            seg = by_doc[lo:hi]
            by_doc[lo:hi] = seg[np.argsort(start[seg])]
        else:
            for t in range(lo + 1, hi):  # insertion sort by start
                i = by_doc[t]
                u = t
                while u > lo and start[by_doc[u - 1]] > start[i]:
                    by_doc[u] = by_doc[u - 1]
                    u -= 1
                by_doc[u] = i
        pos = 0
        for t in range(lo, hi):
            if start[by_doc[t]] != pos:
                return False
            pos += length[by_doc[t]]
        if pos != doc_lens[x]:
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
        ``(ok, sums)``: ``ok`` False (and the sums not computed) when a rank or a document index
        is out of range; sums (4, N) float64: document tokens, query-key pairs per head (summed in
        row order, as ``np.bincount`` with weights does), tokens of shards that do not end their
        document, shards (integers, exact in float64).
    """
    sums = np.zeros((4, cp_size), np.float64)
    tokens, work, send, shards = sums[0], sums[1], sums[2], sums[3]
    for i in range(rank.size):
        q, p, s = rank[i], start[i], length[i]
        if q < 0 or q >= cp_size or doc[i] < 0 or doc[i] >= doc_lens.size:
            return False, sums
        tokens[q] += s
        work[q] += float((2 * p + s + 1) * s // 2)
        shards[q] += 1
        if p + s != doc_lens[doc[i]]:
            send[q] += s
    return True, sums


@njit(cache=True)
def per_doc_sizes(doc_lens, n, cursor):
    """:func:`flashcp.layout.per_doc_chunk_sizes` (its docstring says the rule) in one pass:
    ``(sizes, cursor)``, sizes (n_docs, 2N) int64."""
    m = doc_lens.size
    sizes = np.empty((m, 2 * n), np.int64)
    parity = np.zeros(n, np.int64)  # extra tokens each rank got from the documents before
    first = cursor % n
    for i in range(m):
        d = doc_lens[i]
        base, rem = d // (2 * n), d % (2 * n)
        for r in range(n):
            extra = rem // n + (1 if (r - first) % n < rem % n else 0)
            front = (extra + (1 if parity[r] % 2 == 0 else 0)) // 2
            sizes[i, r] = base + front
            sizes[i, 2 * n - 1 - r] = base + extra - front
            parity[r] += extra
        first = (first + rem) % n
    return sizes, first if m else cursor


@njit(cache=True)
def split_packed(doc_lens, num_chunks, num_pad):
    """:func:`flashcp.layout.split_packed` in one pass, for a chunk size ``(sum(doc_lens) +
    num_pad) // num_chunks`` >= 1: ``(cols, chunk_pad)``, cols (4, n_pieces) int64 the columns
    chunk, doc, start, length."""
    m = doc_lens.size
    cu = np.zeros(m + 1, np.int64)
    for i in range(m):
        cu[i + 1] = cu[i] + doc_lens[i]
    real = cu[m]
    size = (real + num_pad) // num_chunks
    cap = m + num_chunks + 1
    chunk = np.empty(cap, np.int64)
    doc = np.empty(cap, np.int64)
    start = np.empty(cap, np.int64)
    length = np.empty(cap, np.int64)
    # walk the cuts: document starts and chunk bounds inside the documents, sorted, unique
    k = 0
    d = 0
    pos = 0
    while pos < real:
        while cu[d + 1] <= pos:  # the document holding pos (the last of equal starts)
            d += 1
        end = min(cu[d + 1], (pos // size + 1) * size)
        chunk[k], doc[k], start[k], length[k] = pos // size, d, pos - cu[d], end - pos
        k += 1
        pos = end
    chunk_pad = np.zeros(num_chunks, np.int64)
    for c in range(num_chunks):
        lo = max(c * size, real)
        if (c + 1) * size > lo:
            chunk_pad[c] = (c + 1) * size - lo
    return _stack(chunk, doc, start, length, k), chunk_pad


@njit(cache=True)
def per_doc_layout(doc_lens, n, num_pad):
    """The Per-Doc layout of :func:`baselines.per_doc.per_doc_layout` in one pass: ``(cols, pad)``,
    cols (4, n_shards) int64 the shard columns rank, doc, start, length, rank-major, per document chunk r then chunk 2N-1-r, empty
    chunks left out (:func:`flashcp.layout.per_doc_columns` keeps them for ``make_plan`` to
    drop), and (N,) pad tokens per rank."""
    m = doc_lens.size
    sizes, _ = per_doc_sizes(doc_lens, n, 0)
    starts = np.empty_like(sizes)
    for i in range(m):
        p = 0
        for j in range(2 * n):
            starts[i, j] = p
            p += sizes[i, j]
    total = num_pad
    for i in range(m):
        total += doc_lens[i]
    cap = 2 * n * m
    rank = np.empty(cap, np.int64)
    doc = np.empty(cap, np.int64)
    start = np.empty(cap, np.int64)
    length = np.empty(cap, np.int64)
    pad = np.full(n, total // n, np.int64)
    k = 0
    for r in range(n):
        for i in range(m):
            for j in (r, 2 * n - 1 - r):
                s = sizes[i, j]
                pad[r] -= s
                if s:
                    rank[k], doc[k], start[k], length[k] = r, i, starts[i, j], s
                    k += 1
    return _stack(rank, doc, start, length, k), pad
