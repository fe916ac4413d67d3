"""numba kernels of the plan data model (:mod:`flashcp.plan`): building, checking and summing a
plan's shard columns in one pass each (:mod:`flashcp.compiled` says when they are used).

The fused planners (:func:`ring_plan`, :func:`llama3_plan`, :func:`per_doc_plan`) do a baseline's
whole plan in one call: the argument checks of :func:`flashcp.plan.planner_entry`, the layout,
``make_plan``'s merge, the validation, the per-rank sums and the metrics, into one buffer whose head
is the digest's bytes (:func:`flashcp.plan.fused_plan` reads it); every call from Python costs
about a microsecond and a half before it runs, so one call instead of six saves most of a plan's
time.

Each kernel computes exactly what the NumPy code it stands in for computes (the reference in
:mod:`flashcp.plan`); ``tests/unit/test_compiled.py`` compares them. Arrays are (n_shards,) int64
columns ``rank, doc, start, length`` as in :class:`~flashcp.plan.Plan`.
"""

from __future__ import annotations

import numpy as np

from flashcp.compiled.jit import njit

__all__ = [
    "FUSED_STATUS",
    "finish_plan",
    "llama3_plan",
    "merge_pieces",
    "per_doc_layout",
    "per_doc_plan",
    "per_doc_sizes",
    "plan_ok",
    "plan_stats",
    "rank_sums",
    "ring_plan",
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
def _doc_split(d, n):
    """``(base, whole, part)`` of a document of length ``d`` in the rule of
    :func:`flashcp.planners.layout.per_doc_chunk_sizes`: every chunk gets ``base = d // 2N``, every rank
    ``whole`` of the ``d % 2N`` extra tokens and ``part`` ranks from the first one one more
    (``rem // n``, ``rem % n`` without dividing: 0 <= rem < 2N)."""
    base, rem = d // (2 * n), d % (2 * n)
    whole = 1 if rem >= n else 0
    return base, whole, rem - n if whole else rem


@njit(cache=True)
def _rank_extra(r, n, first, whole, part, parity):
    """``(extra, front)``: the extra tokens of rank r in a document whose first extra token goes to
    rank ``first``, and those of them in its front chunk (``parity``: the rank's extra tokens from
    the documents before); its back chunk gets ``extra - front``."""
    offset = r - first if r >= first else r - first + n  # (r - first) % n: 0 <= r, first < n
    extra = whole + (1 if offset < part else 0)
    return extra, (extra + (1 if parity & 1 == 0 else 0)) >> 1  # extra >= 0


@njit(cache=True)
def _doc_chunk_sizes(d, n, first, parity, row):
    """The 2N chunk sizes of one document of length ``d`` into ``row`` ((2N,) int64), the rule of
    :func:`flashcp.planners.layout.per_doc_chunk_sizes`: ``first`` is the rank of its first extra token,
    ``parity`` (N,) the extra tokens each rank got from the documents before (updated). Returns
    the next document's ``first``."""
    base, whole, part = _doc_split(d, n)
    for r in range(n):
        extra, front = _rank_extra(r, n, first, whole, part, parity[r])
        row[r] = base + front
        row[2 * n - 1 - r] = base + extra - front
        parity[r] += extra
    first += part  # (first + rem) % n: rem = whole * n + part, first + part < 2n
    return first - n if first >= n else first


@njit(cache=True)
def per_doc_sizes(doc_lens, n, cursor):
    """:func:`flashcp.planners.layout.per_doc_chunk_sizes` (its docstring says the rule) in one pass:
    ``(sizes, cursor)``, sizes (n_docs, 2N) int64."""
    m = doc_lens.size
    sizes = np.empty((m, 2 * n), np.int64)
    parity = np.zeros(n, np.int64)  # extra tokens each rank got from the documents before
    first = cursor % n
    for i in range(m):
        first = _doc_chunk_sizes(doc_lens[i], n, first, parity, sizes[i])
    return sizes, first if m else cursor


@njit(cache=True)
def split_packed(doc_lens, num_chunks, num_pad):
    """:func:`flashcp.planners.layout.split_packed` in one pass, for a chunk size ``(sum(doc_lens) +
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
    chunks left out (:func:`flashcp.planners.layout.per_doc_columns` keeps them for ``make_plan`` to
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


# ---- fused planners: layout, make_plan's merge, validation, per-rank sums and metrics, one call --

#: what the last entry of a fused planner's buffer says (0: a plan; else the caller takes the
#: general path, which plans the same or raises the error naming the bad value)
FUSED_STATUS = {
    0: "ok",
    1: "no document, or a zero-length or negative one",
    2: "the total is not divisible as the layout needs",
    3: "the plan violates an invariant (plan_ok)",
    4: "a rank's pieces are not in (doc, start) order (make_plan merges them in general)",
    5: "more than EXACT_TOKENS tokens",
}
#: contexts up to this many tokens have every workload, per rank and in total, below 2^53: exact
#: int64 here, and exact in float64 in any summation order (so the imbalance ratio computed from
#: them equals NumPy's); the fused planners leave longer ones to the general path
EXACT_TOKENS = 1 << 26


@njit(cache=True)
def _entry(doc_lens, cp_size, num_pad, pad_to_multiple, chunks_per_rank):
    """:func:`flashcp.plan.planner_entry`'s checks for the fused path: ``(status, num_pad)``,
    status 1 (no document, or one of length <= 0), 2 (the total, pad included, not divisible by
    ``chunks_per_rank * cp_size``) or 5 (more than :data:`EXACT_TOKENS` tokens, checked document
    by document so that no sum wraps round int64), else 0 and ``num_pad`` after
    ``pad_to_multiple``."""
    if doc_lens.size == 0:
        return 1, num_pad
    real = 0
    for i in range(doc_lens.size):
        if doc_lens[i] <= 0:
            return 1, num_pad
        if doc_lens[i] > EXACT_TOKENS:
            return 5, num_pad
        real += doc_lens[i]  # at most 2 * EXACT_TOKENS here
        if real > EXACT_TOKENS:
            return 5, num_pad
    k = chunks_per_rank * cp_size
    if pad_to_multiple:
        num_pad += (k - (real + num_pad) % k) % k
    total = real + num_pad
    if total > EXACT_TOKENS:
        return 5, num_pad
    if total % cp_size or total % k:
        return 2, num_pad
    return 0, num_pad


@njit(cache=True)
def _failed(status):
    out = np.zeros(2, np.int64)
    out[1] = status
    return out


@njit(cache=True)
def _rank_maxima(tokens, send, shards, work):
    """From a plan's per-rank int64 rows: ``(max doc tokens, max send tokens, max workload, total
    workload, any rank with work (0/1), max shards)``."""
    max_tokens, max_send, max_work, total_work, any_work = tokens[0], send[0], work[0], 0, 0
    max_shards = shards[0]
    for q in range(tokens.size):
        max_tokens = max(max_tokens, tokens[q])
        max_send = max(max_send, send[q])
        max_work = max(max_work, work[q])
        max_shards = max(max_shards, shards[q])
        total_work += work[q]
        if work[q] != 0:
            any_work = 1
    return max_tokens, max_send, max_work, total_work, any_work, max_shards


@njit(cache=True)
def _metrics(out, size, n, m, doc, nd):
    """The tail of a fused planner's buffer (:func:`finish_plan`) from its per-rank rows: the
    document tokens and the pad tokens of the sequence, :func:`_rank_maxima`, the documents cut
    into more than one shard (of ``doc``, the m shards' documents, among ``nd``), the number of
    shards ``m`` and status 0."""
    max_tokens, max_send, max_work, total_work, any_work, max_shards = _rank_maxima(
        out[size : size + n], out[size + n : size + 2 * n], out[size + 2 * n : size + 3 * n],
        out[size + 3 * n : size + 4 * n],
    )  # fmt: skip
    doc_tokens = 0
    for i in range(nd):
        doc_tokens += out[1 + i]
    num_pad = 0
    for q in range(n):
        num_pad += out[size - n + q]
    out[-11], out[-10] = doc_tokens, num_pad
    out[-9], out[-8], out[-7], out[-6] = max_tokens, max_send, max_work, total_work
    out[-5], out[-4], out[-3] = any_work, _num_split(doc, nd), max_shards
    out[-2], out[-1] = m, 0


@njit(cache=True)
def _num_split(doc, nd):
    """Documents (indices in [0, nd)) that appear more than once in ``doc``: those cut into more
    than one shard (:attr:`flashcp.plan.Plan.split_docs`)."""
    seen = np.zeros(nd, np.int64)
    split = 0
    for i in range(doc.size):
        seen[doc[i]] += 1
        if seen[doc[i]] == 2:
            split += 1
    return split


@njit(cache=True)
def _within_exact(start, length):
    """Every shard inside ``[0, EXACT_TOKENS]`` (a valid plan of at most EXACT_TOKENS tokens is;
    with validation off, a plan may not be, and its workloads need not be exact integers)."""
    for i in range(start.size):
        if start[i] < 0 or length[i] < 0 or start[i] + length[i] > EXACT_TOKENS:
            return False
    return True


@njit(cache=True)
def plan_stats(cp_size, doc_lens, rank, doc, start, length, pad):
    """:func:`rank_sums` and, for at most :data:`EXACT_TOKENS` tokens held, the plan's metrics
    from them as int64, exact (what :attr:`flashcp.plan.Plan._rank_sums` keeps for a plan
    a fused planner did not make).

    Args:
        cp_size: N. doc_lens: (n_docs,) int64. rank, doc, start, length: (n_shards,) int64.
        pad: (N,) int64.
    Returns:
        ``(status, sums, stats)``: status 0 (a rank or document index out of range, or ``pad``
        not of N entries: nothing computed), 1 (more than :data:`EXACT_TOKENS` tokens held, or a
        shard outside ``[0, EXACT_TOKENS]``: ``sums`` only) or 2; ``sums`` as :func:`rank_sums`;
        ``stats`` (7,) int64: the maxima of the doc tokens, send tokens and workloads, the total
        workload, whether any rank has work, the documents cut into more than one shard, the most
        shards on a rank.
    """
    stats = np.zeros(7, np.int64)
    if pad.size != cp_size:
        return 0, np.zeros((4, cp_size), np.float64), stats
    ok, sums = rank_sums(cp_size, doc_lens, rank, doc, start, length)
    if not ok:
        return 0, sums, stats
    # exact: every shard inside [0, EXACT_TOKENS] and at most EXACT_TOKENS tokens held (so every
    # workload sum is an integer below 2^53 in any order; a plan that is not valid may break it)
    held = 0
    for q in range(cp_size):
        held += np.int64(sums[0, q])
    if held > EXACT_TOKENS:
        return 1, sums, stats
    if not _within_exact(start, length):
        return 1, sums, stats
    rows = sums.astype(np.int64)  # integers, exact in float64 (EXACT_TOKENS)
    max_tokens, max_send, max_work, total_work, any_work, max_shards = _rank_maxima(
        rows[0], rows[2], rows[3], rows[1]
    )
    stats[0], stats[1], stats[2], stats[3] = max_tokens, max_send, max_work, total_work
    stats[4], stats[5], stats[6] = any_work, _num_split(doc, doc_lens.size), max_shards
    return 2, sums, stats


@njit(cache=True)
def finish_plan(doc_lens, cp_size, rank, doc, start, length, pad, validate):
    """:func:`flashcp.plan.make_plan` (the merge of :func:`merge_pieces`), :meth:`Plan.validate
    <flashcp.plan.Plan.validate>` (:func:`plan_ok`) and the per-rank sums (:func:`rank_sums`) of a
    layout's pieces, packed into one int64 buffer (:func:`flashcp.plan.fused_plan` and
    :func:`flashcp.plan.packed_plan` read it)::

        [cp_size, doc_lens (n_docs), rank, doc, start, length (m each), pad (N),   <- digest bytes
         doc tokens, send tokens, shards, workload (N each),
         sum of doc_lens, sum of pad, max doc tokens, max send tokens, max workload,
         total workload, any work, split documents, max shards per rank, m, status]

    (all int64: a context of at most :data:`EXACT_TOKENS` tokens, status 5 for a longer one). A
    status other than 0 (:data:`FUSED_STATUS`) comes in a 2-entry buffer; ``validate`` False skips
    the check."""
    n = cp_size
    merged, cols = merge_pieces(rank, doc, start, length)
    if not merged:
        return _failed(4)
    m = cols.shape[1]
    nd = doc_lens.size
    if validate and not plan_ok(n, doc_lens, cols[0], cols[1], cols[2], cols[3], pad):
        return _failed(3)
    ok, sums = rank_sums(n, doc_lens, cols[0], cols[1], cols[2], cols[3])
    if not ok:
        return _failed(3)
    size = 1 + nd + 4 * m + n
    out = np.empty(size + 4 * n + 11, np.int64)
    out[0] = n
    out[1 : 1 + nd] = doc_lens
    for row in range(4):
        out[1 + nd + row * m : 1 + nd + (row + 1) * m] = cols[row]
    out[size - n : size] = pad
    total = 0
    for q in range(n):
        total += np.int64(sums[0, q]) + pad[q]
        if pad[q] < 0:  # (validate off) then the tokens held may pass EXACT_TOKENS
            return _failed(5)
    if total > EXACT_TOKENS or not _within_exact(cols[2], cols[3]):
        return _failed(5)
    for q in range(n):  # integers, exact in float64 (EXACT_TOKENS)
        out[size + q] = np.int64(sums[0, q])
        out[size + n + q] = np.int64(sums[2, q])
        out[size + 2 * n + q] = np.int64(sums[3, q])
        out[size + 3 * n + q] = np.int64(sums[1, q])
    _metrics(out, size, n, m, cols[1], nd)
    return out


@njit(cache=True)
def ring_plan(doc_lens, cp_size, num_pad, pad_to_multiple, validate):
    """:func:`baselines.ring.plan_ring` of documents all of length >= 1 in one call: N contiguous
    chunks (:func:`split_packed`), chunk r on rank r, then :func:`finish_plan` (its buffer)."""
    status, num_pad = _entry(doc_lens, cp_size, num_pad, pad_to_multiple, 1)
    if status:
        return _failed(status)
    cols, pad = split_packed(doc_lens, cp_size, num_pad)
    return finish_plan(doc_lens, cp_size, cols[0], cols[1], cols[2], cols[3], pad, validate)


@njit(cache=True)
def llama3_plan(doc_lens, cp_size, num_pad, pad_to_multiple, validate):
    """:func:`baselines.llama3.plan_llama3` of documents all of length >= 1 in one call: 2N equal
    chunks (:func:`split_packed`), rank r holding the pieces of chunk r then those of chunk
    2N-1-r (each in packed order, as the planner's stable sort by (rank, back) orders them), then
    :func:`finish_plan` (its buffer)."""
    n = cp_size
    status, num_pad = _entry(doc_lens, n, num_pad, pad_to_multiple, 2)
    if status:
        return _failed(status)
    cols, chunk_pad = split_packed(doc_lens, 2 * n, num_pad)
    k = cols.shape[1]
    first = np.zeros(2 * n + 1, np.int64)  # pieces of chunk c: first[c]:first[c + 1]
    for i in range(k):
        first[cols[0, i] + 1] += 1
    for c in range(2 * n):
        first[c + 1] += first[c]
    rank = np.empty(k, np.int64)
    doc = np.empty(k, np.int64)
    start = np.empty(k, np.int64)
    length = np.empty(k, np.int64)
    pad = np.empty(n, np.int64)
    j = 0
    for r in range(n):
        pad[r] = chunk_pad[r] + chunk_pad[2 * n - 1 - r]
        for c in (r, 2 * n - 1 - r):
            for i in range(first[c], first[c + 1]):
                rank[j], doc[j], start[j], length[j] = r, cols[1, i], cols[2, i], cols[3, i]
                j += 1
    return finish_plan(doc_lens, n, rank, doc, start, length, pad, validate)


@njit(cache=True)
def per_doc_plan(doc_lens, cp_size, num_pad, pad_to_multiple, validate):
    """:func:`baselines.per_doc.per_doc_layout` (``per_doc``, ``zigzag``) of documents all of
    length >= 1 in one call, in :func:`finish_plan`'s buffer: rank after rank, document after document,
    the rank's chunks r and 2N-1-r (:func:`per_doc_sizes`'s rule; empty ones left out, the two one
    shard where they continue each other, as ``make_plan`` merges them), with the per-rank sums in
    row order (as :func:`rank_sums`). A document's front chunks follow each other from its start
    and its back chunks from its end, rank after rank, so a chunk starts where the rank before left
    off (``lo``, ``hi``); with ``validate``, the invariants :func:`plan_ok` checks: pad >= 0 (every
    rank holds C / N tokens) and every document's front and back chunks meet (``lo == hi``: each
    token held once)."""
    status, num_pad = _entry(doc_lens, cp_size, num_pad, pad_to_multiple, 1)
    if status:
        return _failed(status)
    n = cp_size
    nd = doc_lens.size
    base = np.empty(nd, np.int64)  # per document: _doc_split and the rank of its first extra token
    whole = np.empty(nd, np.int64)
    part = np.empty(nd, np.int64)
    firsts = np.empty(nd, np.int64)
    first = 0
    total = num_pad
    for i in range(nd):
        total += doc_lens[i]
        base[i], whole[i], part[i] = _doc_split(doc_lens[i], n)
        firsts[i] = first
        first += part[i]
        if first >= n:
            first -= n
    if total > EXACT_TOKENS:
        return _failed(5)
    # shards at most (two per rank and document, one token each at least): the columns are
    # written cap apart, then moved together
    cap = min(2 * n * nd, total - num_pad)
    o = 1 + nd
    out = np.empty(o + 4 * cap + 5 * n + 11, np.int64)
    out[0] = n
    out[1:o] = doc_lens
    lo = np.zeros(nd, np.int64)  # where the document's next front chunk starts
    hi = doc_lens.copy()  # where its next back chunk ends
    pad = np.empty(n, np.int64)
    tokens = np.empty(n, np.int64)
    send = np.empty(n, np.int64)
    shards = np.empty(n, np.int64)
    works = np.empty(n, np.int64)
    k = 0
    for r in range(n):
        parity = 0
        tok, snd, cnt, work = 0, 0, 0, 0
        for i in range(nd):
            extra, front = _rank_extra(r, n, firsts[i], whole[i], part[i], parity)
            parity += extra
            pf, sf = lo[i], base[i] + front
            sb = base[i] + extra - front
            pb = hi[i] - sb
            lo[i], hi[i] = pf + sf, pb
            if sf != 0 and sb != 0 and pb == pf + sf:
                sf, sb = sf + sb, 0
            for half in range(2):
                p, s = (pf, sf) if half == 0 else (pb, sb)
                if s == 0:
                    continue
                out[o + k] = r
                out[o + cap + k] = i
                out[o + 2 * cap + k] = p
                out[o + 3 * cap + k] = s
                k += 1
                tok += s  # the per-rank sums in row order, as rank_sums
                work += (2 * p + s + 1) * s // 2  # exact: EXACT_TOKENS
                cnt += 1
                if p + s != doc_lens[i]:
                    snd += s
        tokens[r], send[r], shards[r], works[r] = tok, snd, cnt, work
        pad[r] = total // n - tok
    if validate:
        for r in range(n):
            if pad[r] < 0:
                return _failed(3)
        for i in range(nd):
            if lo[i] != hi[i]:
                return _failed(3)
    m = k
    for row in range(1, 4):  # the columns one after the other (each moves left, in order)
        src, dst = o + row * cap, o + row * m
        for t in range(m):
            out[dst + t] = out[src + t]
    size = o + 4 * m + n
    out[size - n : size] = pad
    out[size : size + n] = tokens
    out[size + n : size + 2 * n] = send
    out[size + 2 * n : size + 3 * n] = shards
    out[size + 3 * n : size + 4 * n] = works
    res = out[: size + 4 * n + 11]
    _metrics(res, size, n, m, res[o + m : o + 2 * m], nd)
    return res
