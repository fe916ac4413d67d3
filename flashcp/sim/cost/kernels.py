"""numba kernels of the batched step model (:class:`flashcp.sim.cost.PlanBatch`,
:func:`flashcp.sim.cost.price_plans`; :mod:`flashcp.compiled` says when they are used):
every plan's per-rank sums and tile statistics in one pass over its shards (:func:`batch_sums`,
:func:`allgather_stats`, :func:`ring_stats`), and the phase formulas that run on every (plan,
step, rank): the project's ring op per step (:func:`ring_compute_ours`), a ring pass
(:func:`ring_pass`) and the all-gather op per rank (:func:`allgather_ranks`).

Each kernel computes exactly what the NumPy code it stands in for computes (the reference:
:class:`PlanBatch`'s ``_ring_stats_reference`` and ``allgather``, :func:`flashcp.sim.kernel`'s
tile counts, :class:`~flashcp.sim.cost.PlanCost`'s ring methods and ``_allgather_phases``):
tile counts as exact integers (equal to the float64 closed forms for lengths below 2**40), sums
and maxima of integers below 2**53 (exact in any order), the phase formulas as the same float64
operations in the same order, sums over ring steps in NumPy's pairwise order; so the numbers are
the same to the bit (``tests/unit/test_price_batch.py``). Arrays are the batch's concatenated
(n_shards,) int64 columns ``rank, doc, start, length`` (each plan's ranks sorted), with ``off``
(S + 1,) int64 the first shard of each plan and ``nd`` (S,) int64 its documents.
"""

from __future__ import annotations

import numpy as np

from flashcp.compiled.jit import njit

__all__ = [
    "allgather_ranks",
    "allgather_stats",
    "batch_sums",
    "ring_compute_ours",
    "ring_pass",
    "ring_stats",
]


@njit(cache=True, inline="always")
def _cdiv(a, b, shift):
    """ceil(a / b) of int64 ``a`` >= 0 and ``b`` > 0: a shift when ``b`` is ``1 << shift``
    (``shift`` >= 0), else an integer division (equal to :func:`flashcp.sim.kernel._cdiv`)."""
    if shift >= 0:
        return (a + b - 1) >> shift
    return (a + b - 1) // b


@njit(cache=True, inline="always")
def _shift(b):
    """log2(b) when the int ``b`` > 0 is a power of two, else -1."""
    if b <= 0 or b & (b - 1):
        return -1
    k = 0
    while (1 << k) < b:
        k += 1
    return k


@njit(cache=True, inline="always")
def _fdiv(a, b, shift):
    """floor(a / b) of int64 ``a`` >= 0 and ``b`` > 0 (a shift when ``b`` is ``1 << shift``)."""
    if shift >= 0:
        return a >> shift
    return a // b


@njit(cache=True, inline="always")
def _fwd(q, k, bq, bk, sq, sk, rho):
    """:func:`flashcp.sim.kernel.fwd_tile_counts` of one causal segment (``k >= q >= 0``) in int64:
    ``(ctas, tiles, max_tiles)``; ``sq``, ``sk`` the shifts of ``bq``, ``bk`` (:func:`_shift`),
    ``rho = bq // bk``."""
    m = _cdiv(q, bq, sq)
    if m <= 0:
        return 0, 0, 0
    nk = _cdiv(k, bk, sk)
    m1 = m - 1
    # (rho / 2) m (m - 1) with m (m - 1) even: an integer
    return m, m1 * _cdiv(k - q, bk, sk) + rho * ((m * m1) >> 1) + nk, nk


@njit(cache=True, inline="always")
def _bwd(q, k, bq, bk, sq, sk, rho):
    """:func:`flashcp.sim.kernel.bwd_tile_counts` of one causal segment (``k >= q >= 0``) in
    int64: ``(ctas, tiles, max_tiles)``; ``rho = bk // bq``."""
    if q <= 0:
        return 0, 0, 0
    nk = _cdiv(k, bk, sk)
    if nk <= 0:
        return 0, 0, 0
    mq = _cdiv(q, bq, sq)
    a = k - q
    j0 = min(_fdiv(a, bk, sk), nk - 1)
    sum_j = ((nk - 1) * nk - j0 * (j0 + 1)) >> 1  # both products even
    return nk, nk * mq - rho * sum_j + (nk - 1 - j0) * _cdiv(a, bq, sq), mq


@njit(cache=True)
def batch_sums(s, n, off, doc_off, rank, doc, start, length, doc_lens):
    """Every plan's tokens per rank, its non-last shards' tokens per rank and its document
    tokens (:class:`flashcp.sim.cost.PlanBatch`'s ``q_rows``, ``send_rows`` and
    ``context_len`` less pad).

    Args:
        s, n, off, rank, doc, start, length: as in the module docstring; doc_off (S,) int64 each
            plan's first document in doc_lens, the (n_docs_total,) int64 concatenated documents.
    Returns:
        ``(rows, docs)``: rows (2, S, N) float64 (tokens, send tokens), docs (S,) float64.
    """
    rows = np.zeros((2, s, n))
    docs = np.zeros(s)
    for p in range(s):
        base = doc_off[p]
        end = doc_off[p + 1] if p + 1 < s else doc_lens.size
        tot = 0
        for x in range(base, end):
            tot += doc_lens[x]
        docs[p] = tot
        i, hi = off[p], off[p + 1]
        while i < hi:  # one rank's shards (ranks sorted)
            r = rank[i]
            tok = send = 0
            while i < hi and rank[i] == r:
                ln = length[i]
                tok += ln
                if start[i] + ln != doc_lens[base + doc[i]]:
                    send += ln
                i += 1
            rows[0, p, r] += tok
            rows[1, p, r] += send
    return rows, docs


@njit(cache=True, inline="always")
def _add_rank(out, p, r, f0, f1, f2, b0, b1, b2, rows):
    """Add one run of rank r's shards to plan p's all-gather statistics (sums, and maxima of the
    largest CTA)."""
    out[0, p, r] += f0
    out[1, p, r] += f1
    out[2, p, r] = max(out[2, p, r], f2)
    out[3, p, r] += b0
    out[4, p, r] += b1
    out[5, p, r] = max(out[5, p, r], b2)
    out[6, p, r] += rows


@njit(cache=True)
def allgather_stats(s, n, off, rank, start, length, fbq, fbk, bbq, bbk):
    """Every plan's per-rank varlen call of the all-gather family: one causal segment per shard,
    q = its length, kv = its start + length.

    Args:
        s, n: plans and cp_size; off, rank, start, length: as in the module docstring.
        fbq, fbk, bbq, bbk: forward and backward tile shapes (ints > 0).
    Returns:
        (7, S, N) float64: forward CTAs, tiles, largest CTA; backward CTAs, tiles, largest CTA;
        key rows (summed over each rank's shards).
    """
    sfq, sfk, sbq, sbk = _shift(fbq), _shift(fbk), _shift(bbq), _shift(bbk)
    fr, br = fbq // fbk, bbk // bbq
    if sfq >= 0 and sfk >= 0 and sbq >= 0 and sbk >= 0:
        return _allgather_stats_pow2(s, n, off, rank, start, length, sfq, sfk, sbq, sbk)
    out = np.zeros((7, s, n))
    for p in range(s):
        i, hi = off[p], off[p + 1]
        while i < hi:  # one rank's shards (ranks sorted), summed in registers
            r = rank[i]
            f0 = f1 = f2 = b0 = b1 = b2 = rows = 0
            while i < hi and rank[i] == r:
                q = length[i]
                k = start[i] + q
                c, t, x = _fwd(q, k, fbq, fbk, sfq, sfk, fr)
                f0 += c
                f1 += t
                f2 = max(f2, x)
                c, t, x = _bwd(q, k, bbq, bbk, sbq, sbk, br)
                b0 += c
                b1 += t
                b2 = max(b2, x)
                rows += k
                i += 1
            _add_rank(out, p, r, f0, f1, f2, b0, b1, b2, rows)
    return out


@njit(cache=True)
def _allgather_stats_pow2(s, n, off, rank, start, length, sfq, sfk, sbq, sbk):
    """:func:`allgather_stats` when every tile side is a power of two (``1 << sfq`` and so on, the
    shifts of :func:`_shift`): :func:`_fwd` and :func:`_bwd` written out with shifts and without
    their early returns (an empty shard, q = 0, adds zeros by selection), which lets the loop run
    without branches: about 1.7x faster on the ~1,100 shards of a CP 8 ``per_doc`` plan, the same
    integers."""
    fbq, fbk, bbq, bbk = 1 << sfq, 1 << sfk, 1 << sbq, 1 << sbk
    fr, br = fbq // fbk, bbk // bbq
    out = np.zeros((7, s, n))
    for p in range(s):
        i, hi = off[p], off[p + 1]
        while i < hi:  # one rank's shards [i, j) (ranks sorted), summed in registers
            r = rank[i]
            j = i
            while j < hi and rank[j] == r:
                j += 1
            f0 = f1 = f2 = b0 = b1 = b2 = rows = 0
            for u in range(i, j):
                q = length[u]
                a = start[u]  # the keys before the shard's queries (k - q)
                k = a + q
                some = q > 0
                # forward: m query blocks, nk key blocks (_fwd)
                m = (q + fbq - 1) >> sfq
                nk = (k + fbk - 1) >> sfk
                m1 = m - 1
                t = m1 * ((a + fbk - 1) >> sfk) + fr * ((m * m1) >> 1) + nk
                f0 += m
                f1 += t if some else 0
                f2 = max(f2, nk if some else 0)
                # backward: nk key blocks, mq query blocks (_bwd); nk > 0 whenever q > 0
                nk = (k + bbk - 1) >> sbk
                mq = (q + bbq - 1) >> sbq
                j0 = min(a >> sbk, nk - 1)
                sum_j = ((nk - 1) * nk - j0 * (j0 + 1)) >> 1  # both products even
                t = nk * mq - br * sum_j + (nk - 1 - j0) * ((a + bbq - 1) >> sbq)
                b0 += nk if some else 0
                b1 += t if some else 0
                b2 = max(b2, mq if some else 0)
                rows += k
            _add_rank(out, p, r, f0, f1, f2, b0, b1, b2, rows)
            i = j
    return out


@njit(cache=True, inline="always")
def _add_pairs(acc, r, q_row, k_row, h, holders, fbq, fbk, bbq, bbk, sfq, sfk, sbq, sbk):
    """Add one document's rectangles of rank r against each holder b (query rows ``q_row[b]``,
    key rows ``k_row[b]``) to ``acc[r, holders[b]]`` (:func:`ring_stats`): forward CTAs, tiles,
    largest CTA, backward CTAs, tiles, largest CTA, query rows, key rows (indexed in place: an
    array view would cost a reference count)."""
    for b in range(h):
        c = holders[b]
        q, k = q_row[b], k_row[b]
        fq, fk = _cdiv(q, fbq, sfq), _cdiv(k, fbk, sfk)
        bq, bk = _cdiv(q, bbq, sbq), _cdiv(k, bbk, sbk)
        acc[r, c, 0] += fq
        acc[r, c, 1] += fq * fk
        acc[r, c, 2] = max(acc[r, c, 2], fk)
        acc[r, c, 3] += bk
        acc[r, c, 4] += bq * bk
        acc[r, c, 5] = max(acc[r, c, 5], bq)
        acc[r, c, 6] += q
        acc[r, c, 7] += k


@njit(cache=True)
def ring_stats(s, n, off, nd, rank, doc, start, length, fbq, fbk, bbq, bbk):
    """Every plan's ring steps (:meth:`flashcp.sim.cost.PlanBatch.ring`): step 0 one causal
    segment per (rank, document) over the rank's own tokens; step t >= 1 one full rectangle per
    (rank r, document) of r's shards that follow a shard of the source rank (r - t) mod N against
    the source's shards that precede one of r's; a step gathers its query (key) rows by index
    when its visible shards form more than one run in the rank's order.

    Document by document: only the ranks that hold a shard of document x (its holders, h of
    them) see rows of x at a step t >= 1. x's shards go into a (m, h) table, column b the m
    shards of holder b (padded with empty shards): starts ``ss``, lengths ``ls``. For each holder
    a (rank r) two passes over the table, each a loop over the h holders that the compiler
    vectorizes, give its row of rectangles against every holder b (source c): the query rows
    ``q[b]`` of a's shards after b's first start, the key rows ``k[b]`` of b's shards before a's
    last start; then the eight statistics of each (r, c) add x's rectangle. The same passes mark
    each shard's visible sources (key seers) as bit masks, and one pass over each rank's shards in
    its order counts their runs. The work is about h * h * (m + 2) per document, in the cache.
    Sums and maxima of integers: the same numbers in any order.

    Args:
        s, n, off, nd, rank, doc, start, length: as in the module docstring.
        fbq, fbk, bbq, bbk: forward and backward tile shapes (ints > 0).
    Returns:
        ``(stats, gather)``: stats (8, S, N, N) float64 ``[., plan, t, r]``: forward CTAs, tiles,
        largest CTA, backward CTAs, tiles, largest CTA, query rows, key rows; gather (2, S, N, N)
        bool: the step gathers its query rows, its key rows.
    """
    sfq, sfk, sbq, sbk = _shift(fbq), _shift(fbk), _shift(bbq), _shift(bbk)
    fr, br = fbq // fbk, bbk // bbq
    stats = np.empty((8, s, n, n))
    gather = np.zeros((2, s, n, n), np.bool_)
    max_nd = 0
    max_sh = 0
    for p in range(s):
        max_nd = max(max_nd, nd[p])
        max_sh = max(max_sh, off[p + 1] - off[p])
    own = np.zeros(max_nd, np.int64)
    seen = np.full(max_nd, -1, np.int64)  # the last rank seen holding document x (step 0)
    docs = np.empty(max_sh, np.int64)  # one rank's distinct documents
    # shards grouped by document (counting sort, each group in the plan's order: ranks sorted)
    dend = np.zeros(max_nd + 1, np.int64)
    by_doc = np.empty(max_sh, np.int64)
    holders = np.empty(n, np.int64)
    cnt = np.zeros(n, np.int64)  # shards of each holder in the document
    lo_x = np.empty(n, np.int64)  # each holder's first and last shard start in the document
    hi_x = np.empty(n, np.int64)
    big = 9223372036854775807  # int64 max
    # (m, h) tables [u, b]: holder b's u-th shard's start, length, index, key seers (bit c:
    # the shard precedes a shard of rank c); rows grown as needed
    sst = np.empty((1, n), np.int64)
    lst = np.empty((1, n), np.int64)
    ixt = np.empty((1, n), np.int64)
    vkt = np.empty((1, n), np.int64)
    q_row = np.empty(n, np.int64)
    k_row = np.empty(n, np.int64)
    vis_q = np.empty(max_sh, np.int64)  # bit c: the shard follows a shard of source c
    vis_k = np.empty(max_sh, np.int64)  # bit c: the shard precedes a shard of rank c
    # [r, c, .]: sums over the documents of (rank r, source c): forward CTAs, tiles, largest;
    # backward CTAs, tiles, largest; query rows, key rows
    acc = np.zeros((n, n, 8), np.int64)
    many_q = np.zeros(n, np.int64)
    many_k = np.zeros(n, np.int64)
    for p in range(s):
        lo, hi, nx = off[p], off[p + 1], nd[p]
        # step 0: the rank's own tokens of each document, one causal segment each
        i = lo
        for r in range(n):
            nt = 0
            while i < hi and rank[i] == r:
                x = doc[i]
                if seen[x] != r:
                    seen[x] = r
                    docs[nt] = x
                    nt += 1
                own[x] += length[i]
                i += 1
            f0 = f1 = f2 = b0 = b1 = b2 = rows = 0
            for j in range(nt):
                x = docs[j]
                q = own[x]
                c, t, y = _fwd(q, q, fbq, fbk, sfq, sfk, fr)
                f0 += c
                f1 += t
                f2 = max(f2, y)
                c, t, y = _bwd(q, q, bbq, bbk, sbq, sbk, br)
                b0 += c
                b1 += t
                b2 = max(b2, y)
                rows += q
                own[x] = 0
            _put(stats, p, 0, r, f0, f1, f2, b0, b1, b2, rows, rows)
        for x in range(nx):
            seen[x] = -1
        if n == 1:
            continue
        for x in range(nx + 1):
            dend[x] = 0
        for i in range(lo, hi):
            dend[doc[i] + 1] += 1
        for x in range(nx):
            dend[x + 1] += dend[x]
        for i in range(lo, hi):
            x = doc[i]
            by_doc[dend[x]] = i
            dend[x] += 1
        # dend[x] is now the end of document x's group
        acc[:] = 0
        g0 = 0
        for x in range(nx):
            g1 = dend[x]
            # the holders (ascending), their shard counts and extreme starts
            h = m = 0
            for g in range(g0, g1):
                i = by_doc[g]
                if h == 0 or holders[h - 1] != rank[i]:
                    holders[h] = rank[i]
                    cnt[h] = 0
                    lo_x[h] = big
                    hi_x[h] = -1
                    h += 1
                a = h - 1
                cnt[a] += 1
                m = max(m, cnt[a])
                lo_x[a] = min(lo_x[a], start[i])
                hi_x[a] = max(hi_x[a], start[i])
            if h == 1:
                for g in range(g0, g1):
                    vis_q[by_doc[g] - lo] = 0
                    vis_k[by_doc[g] - lo] = 0
                g0 = g1
                continue
            if sst.shape[0] < m:
                sst = np.empty((2 * m, n), np.int64)
                lst = np.empty((2 * m, n), np.int64)
                ixt = np.empty((2 * m, n), np.int64)
                vkt = np.empty((2 * m, n), np.int64)
            for u in range(m):
                for b in range(h):
                    sst[u, b] = big  # an empty shard: after every start, no rows
                    lst[u, b] = 0
                    vkt[u, b] = 0
            a = -1
            u = 0
            for g in range(g0, g1):
                i = by_doc[g]
                if a < 0 or holders[a] != rank[i]:
                    a += 1
                    u = 0
                sst[u, a] = start[i]
                lst[u, a] = length[i]
                ixt[u, a] = i - lo
                u += 1
            for a in range(h):
                # query rows of a's shards after each holder's first start
                for b in range(h):
                    q_row[b] = 0
                    k_row[b] = 0
                for u in range(cnt[a]):
                    st, ln = sst[u, a], lst[u, a]
                    vq = 0
                    for b in range(h):
                        f = np.int64(lo_x[b] < st)
                        q_row[b] += ln * f
                        vq |= f << holders[b]
                    vis_q[ixt[u, a]] = vq
                # key rows of each holder's shards before a's last start
                ha, bit = hi_x[a], np.int64(1) << holders[a]
                for u in range(m):
                    for b in range(h):
                        f = np.int64(sst[u, b] < ha)
                        k_row[b] += lst[u, b] * f
                        vkt[u, b] |= bit * f
                # every ordered pair (a with itself adds to acc[:, r, r], which no step reads)
                _add_pairs(acc, holders[a], q_row, k_row, h, holders,
                           fbq, fbk, bbq, bbk, sfq, sfk, sbq, sbk)  # fmt: skip
            for a in range(h):
                for u in range(cnt[a]):
                    vis_k[ixt[u, a]] = vkt[u, a]
            g0 = g1
        # runs of visible shards in each rank's order, as bit masks over the other rank (a run
        # starts where a shard is visible and its predecessor on the rank is not)
        i = lo
        for r in range(n):
            prev_q = once_q = twice_q = prev_k = once_k = twice_k = 0
            while i < hi and rank[i] == r:
                vq, vk = vis_q[i - lo], vis_k[i - lo]
                first = vq & ~prev_q
                twice_q |= once_q & first
                once_q |= first
                prev_q = vq
                first = vk & ~prev_k
                twice_k |= once_k & first
                once_k |= first
                prev_k = vk
                i += 1
            many_q[r] = twice_q
            many_k[r] = twice_k
        for r in range(n):
            for c in range(n):
                if c == r:
                    continue
                t = (r - c) % n
                _put(
                    stats, p, t, r, acc[r, c, 0], acc[r, c, 1], acc[r, c, 2], acc[r, c, 3],
                    acc[r, c, 4], acc[r, c, 5], acc[r, c, 6], acc[r, c, 7],
                )  # fmt: skip
                gather[0, p, t, r] = (many_q[r] >> c) & 1
                gather[1, p, t, r] = (many_k[c] >> r) & 1
    return stats, gather


@njit(cache=True, inline="always")
def _put(stats, p, t, r, f0, f1, f2, b0, b1, b2, qr, kr):
    """Store one (plan, step, rank)'s eight statistics (int64, exact in float64)."""
    stats[0, p, t, r] = f0
    stats[1, p, t, r] = f1
    stats[2, p, t, r] = f2
    stats[3, p, t, r] = b0
    stats[4, p, t, r] = b1
    stats[5, p, t, r] = b2
    stats[6, p, t, r] = qr
    stats[7, p, t, r] = kr


@njit(cache=True, inline="always")
def _pairwise_sum(a):
    """``a.sum()`` of a 1-D float64 array of at most 128 entries, in NumPy's order (its pairwise
    summation: below 8 entries one after another, else eight partial sums combined as a tree and
    the remainder added), so the result is NumPy's to the bit."""
    n = a.size
    if n < 8:
        res = a[0] if n else 0.0
        for i in range(1, n):
            res += a[i]
        return res
    r0, r1, r2, r3, r4, r5, r6, r7 = a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]
    i = 8
    while i + 8 <= n:
        r0 += a[i]
        r1 += a[i + 1]
        r2 += a[i + 2]
        r3 += a[i + 3]
        r4 += a[i + 4]
        r5 += a[i + 5]
        r6 += a[i + 6]
        r7 += a[i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[i]
        i += 1
    return res


@njit(cache=True)
def ring_pass(attn, other, host, idle, hop_us, tail_us, phi, slowdown):
    """:meth:`flashcp.sim.cost.PlanCost._ring_pass` of S stacked plans: the same float64
    operations in the same order, NumPy's summation order over the steps (equal to the bit).

    Args:
        attn, other, host, idle: (S, N, N) float64 ``[plan, t, r]`` µs (idle: zeros without
            stream syncs).
        hop_us: (S, N) float64 µs of exchanges overlapped with each step
            (:func:`flashcp.sim.cost.ring.ring_pass_hops`; 0 on the last step).
        tail_us: (S,) float64 µs exposed at the end.
        phi, slowdown: the profile's ``overlap_fraction`` and ``nccl_slowdown``.
    Returns:
        (3, S) float64: attention, others and exposed P2P µs of each plan's pass.
    Raises:
        ValueError: N above 128.
    """
    s, n = attn.shape[0], attn.shape[1]
    if n > 128:
        raise ValueError("ring_pass takes at most 128 steps")
    out = np.empty((3, s))
    keep = 1.0 - 1.0 / slowdown
    rest = 1.0 - phi
    attn_t = np.empty(n)
    diff_t = np.empty(n)
    total_t = np.empty(n)
    for p in range(s):
        for t in range(n):
            hop = hop_us[p, t]
            c = phi * hop
            a_max = comp_max = dev_max = tot_max = -np.inf
            for r in range(n):
                at = attn[p, t, r]
                compute = at + other[p, t, r]
                fast = compute * slowdown
                slowed = fast if fast <= c else compute + c * keep
                device = max(c, slowed) + rest * hop
                scale = slowed / compute if compute > 0 else 1.0
                a_max = max(a_max, at * scale)
                comp_max = max(comp_max, slowed)
                dev_max = max(dev_max, device)
                tot_max = max(tot_max, max(device + idle[p, t, r], host[p, t, r]))
            attn_t[t] = a_max
            diff_t[t] = dev_max - comp_max
            total_t[t] = tot_max
        a = _pairwise_sum(attn_t)
        p2p = _pairwise_sum(diff_t) + tail_us[p]
        out[0, p] = a
        out[1, p] = _pairwise_sum(total_t) + tail_us[p] - a - p2p
        out[2, p] = p2p
    return out


@njit(cache=True)
def allgather_ranks(
    local, kv_rows, send_max, rows, hg, groups, qh, ag, rs, coll_host, fwd, bwd, train, d, e, c,
    keep=False, cast=0.0, acc_b=4.0,
):  # fmt: skip
    """The per-rank part of :func:`flashcp.sim.cost.allgather._allgather_phases` (the project's
    all-gather op) for S plans: the same float64 operations in the same order, so the same
    numbers to the bit (a maximum over ranks is exact in any order).

    Args:
        local, kv_rows: (S, N) float64 query and key rows per rank; send_max, rows (S,) float64;
        hg, groups, qh: (S,) int64 KV heads per group, groups, query heads per group; ag, rs,
        coll_host: (S,) float64 µs of one all-gather, one reduce-scatter, the host's collective
        call (0 when nothing is sent); fwd, bwd: (3, S, N) float64 tile statistics; train: the
        backward too; d, e: head_dim and dtype bytes; c: (9,) float64 profile constants
        ``launch_us, copy_bw_gbps * 1e3, host_op_us, bwd_extra_kernels, fwd_cta_overhead_us,
        fwd tile_us, bwd_cta_overhead_us, bwd tile_us, num_sms``; keep: the backward reuses the
        forward's gathered KV (``keep_gathered_kv``: no source buffer, no all-gather); cast:
        bytes per element of ``grad_comm_dtype`` where the op casts dK/dV to it (0: no cast),
        acc_b: of the accumulation dtype.
    Returns:
        (4, S) float64: per plan the largest rank's forward attention and forward others, its
        backward attention and backward others (µs; zeros without ``train``).
    """
    launch, copy_bw, host_op, extra_k = c[0], c[1], c[2], c[3]
    f_cta, f_tile, b_cta, b_tile, sms = c[4], c[5], c[6], c[7], c[8]
    s, n = local.shape
    out = np.zeros((4, s))
    for p in range(s):
        g, h, k = groups[p], qh[p], hg[p]
        kv_el = 2.0 * k * d
        split = g > 1
        fwd_ops = 5 + (3 if split else 0)
        host_f = g * (coll_host[p] + host_op * (fwd_ops + 1))
        send_b = send_max[p] * kv_el * e * 3
        sends = 1 if send_max[p] > 0 else 0
        bwd_ops = 11 + sends + (3 if split else 0)
        if keep:
            bwd_ops = bwd_ops - 4
        if cast > 0:
            bwd_ops = bwd_ops + 2 * sends
        host_b = g * ((1 if keep else 2) * coll_host[p] + host_op * (bwd_ops + 1))
        bag = 0.0 if keep else ag[p]
        gqa = h != k
        launches = extra_k + (1 if gqa else 0)
        grads_fixed = rows[p] * kv_el * 4
        send_g = send_max[p] * kv_el * 12
        fa = fo = ba = bo = -np.inf
        for r in range(n):
            lq, kv = local[p, r], kv_rows[p, r]
            build = 4 * launch + (lq * kv_el * e * 2 + send_b) / copy_bw
            keys = 1 * launch + (kv * kv_el * e * 2) / copy_bw
            ctas = fwd[0, p, r]
            fwd_k = 0.0
            if ctas > 0:
                spread = h * (ctas * f_cta + fwd[1, p, r] * f_tile) / sms
                fwd_k = launch + max(spread, f_cta + fwd[2, p, r] * f_tile)
            copies = build + keys
            if split:
                copies = copies + (3 * launch + (lq * h * d * e * 4) / copy_bw)
            else:
                copies = copies + 0.0
            dev_f = g * (ag[p] + copies + fwd_k)
            fa = max(fa, g * fwd_k)
            fo = max(fo, g * copies + max(host_f - dev_f, 0.0))
            if not train:
                continue
            nbytes = lq * h * (d * (3 * e + 8) + 4)
            if gqa:
                nbytes = nbytes + kv * 2 * d * e * (h + k)
            extra = launches * launch + nbytes / copy_bw if lq > 0 else 0.0
            ctas = bwd[0, p, r]
            bwd_k = 0.0
            if ctas > 0:
                spread = h * (ctas * b_cta + bwd[1, p, r] * b_tile) / sms
                bwd_k = launch + max(spread, b_cta + bwd[2, p, r] * b_tile)
            bwd_k = bwd_k + extra
            grads = (6 + sends) * launch + (
                lq * h * d * e * 2 + grads_fixed + kv * kv_el * 12 + send_g + lq * kv_el * (4 + e)
            ) / copy_bw
            bcopies = (0.0 if keep else build) + keys + grads
            if split:
                bcopies = bcopies + (3 * launch + (lq * h * d * e * 2) / copy_bw)
            else:
                bcopies = bcopies + 0.0
            if cast > 0:
                bcopies = bcopies + (
                    2 * sends * launch + ((n + 1) * send_max[p] * kv_el * (acc_b + cast)) / copy_bw
                )
            dev_b = g * (bag + bcopies + bwd_k + rs[p])
            ba = max(ba, g * bwd_k)
            bo = max(bo, g * bcopies + max(host_b - dev_b, 0.0))
        out[0, p], out[1, p] = fa, fo
        if train:
            out[2, p], out[3, p] = ba, bo
    return out


@njit(cache=True)
def ring_compute_ours(
    q_rows, kv_rows, stats, q_gather, k_gather, local_tokens, cut_ok, backward, h, hkv, d, e, c
):
    """:meth:`flashcp.sim.cost.PlanCost._ring_fwd_compute` (``backward`` False) or
    ``_ring_bwd_compute`` of S stacked plans for the project's ring op (``impl="ours"``, its
    ImplOps: no per-document host loop, no stream syncs, no views of halves, no indexed
    accumulation): the same float64 operations in the same order, so the same numbers to the bit.

    Args:
        q_rows, kv_rows: (S, N, N) float64 ``[plan, t, r]``; stats: (3, S, N, N) float64 the
            pass's tile statistics; q_gather, k_gather: (S, N, N) bool; local_tokens: (S,)
            float64 C / N; cut_ok: the op cuts pad rows off (``PlanCost.cuts_pad``); h, hkv, d,
            e: heads, KV heads, head_dim, dtype bytes; c: (11,) float64 ``launch_us,
            copy_bw_gbps * 1e3, host_op_us, cta_overhead_us, tile_us, num_sms, ring_step_us,
            merge_bytes_eager (forward) or accum_bytes_eager (backward), merge_ops or
            accum_ops, half_gather_ops, bwd_extra_kernels``.
    Returns:
        (3, S, N, N) float64: attention, other ops' device and host µs (the device never idles).
    """
    launch, copy_bw, host_op, cta, tile, sms = c[0], c[1], c[2], c[3], c[4], c[5]
    step_us, op_bytes, base_ops, half_ops, extra_k = c[6], c[7], c[8], c[9], c[10]
    s, n = q_rows.shape[0], q_rows.shape[1]
    out = np.empty((3, s, n, n))
    for p in range(s):
        block = -np.inf
        for r in range(n):
            block = max(block, q_rows[p, 0, r])
        local = local_tokens[p]
        cut = 1 if (block < local) and cut_ok else 0
        rows = block + local
        for t in range(n):
            for r in range(n):
                q, kv = q_rows[p, t, r], kv_rows[p, t, r]
                work = q > 0
                launched = work  # a rank holding only pad calls no kernel, step 0 included
                ctas = stats[0, p, t, r]
                attn = 0.0
                if ctas > 0:
                    spread = h * (ctas * cta + stats[1, p, t, r] * tile) / sms
                    attn = launch + max(spread, cta + stats[2, p, t, r] * tile)
                gq, gk = q_gather[p, t, r], k_gather[p, t, r]
                if not backward:
                    empty = launch if launched and ctas == 0 else 0.0
                    attn = attn + empty
                    out_el = q * h * d
                    local_el = block * h * d  # every rank's tensors hold the block's rows
                    n_ops = (base_ops if work else 0) + (4 if gq else 0) + (half_ops if gk else 0)
                    nbytes = (out_el * op_bytes if work else 0.0) + (16.0 * out_el if gq else 0.0)
                    nbytes = nbytes + (2.0 * kv * hkv * d * 2 * e if gk else 0.0)
                    n_ops = n_ops + (1 if gq else 0)
                    nbytes = nbytes + (out_el * 2 * e if gq else 0.0)
                    if t == 0:
                        n_ops += 3
                        nbytes = nbytes + (local_el * 4 + block * (h * 4 + 4 * hkv * d * e))
                    if t == n - 1:
                        n_ops += 1
                        nbytes = nbytes + local_el * (4 + e)
                        n_ops += cut
                        nbytes = nbytes + cut * rows * h * d * e
                else:
                    extra = 0.0
                    if q > 0:
                        nb = q * h * (d * (3 * e + 8) + 4)
                        launches = extra_k
                        if h != hkv:
                            nb = nb + kv * 2 * d * e * (h + hkv)
                            launches += 1
                        extra = launches * launch + nb / copy_bw
                    empty = launch if launched and ctas == 0 else 0.0
                    attn = attn + extra + empty
                    q_el = q * h * d
                    kv_el = 2.0 * kv * hkv * d
                    local_q = block * h * d
                    local_kv = 2.0 * block * hkv * d
                    n_ops = (base_ops if work else 0) + (half_ops if gk else 0)
                    nbytes = (q_el + kv_el) * op_bytes if work else 0.0
                    nbytes = nbytes + (kv_el * 2 * e if gk else 0.0)
                    lse_b = q * h * 4 * 2.0
                    part_q = work and q < block  # part of the block's rows, step 0 too
                    sliced = part_q and not gq
                    combine = work and t >= 2
                    idle_zero = (not work) and t == 1
                    n_ops = (
                        n_ops + 4 * (1 if gq else 0) + (1 if sliced else 0) + (1 if work else 0)
                        + (1 if combine else 0) + (1 if idle_zero else 0)
                    )  # fmt: skip
                    nbytes = nbytes + (3.0 * q_el * 2 * e + lse_b if gq else 0.0)
                    nbytes = nbytes + (lse_b if sliced else 0.0)
                    nbytes = nbytes + local_kv * (
                        (4.0 if work else 0.0) + (12.0 if combine else 0.0)
                        + (4.0 if idle_zero else 0.0)
                    )  # fmt: skip
                    if t == 0:
                        n_ops += 2
                        nbytes = nbytes + (local_q * 4 + local_kv * 2 * e)
                    if t == n - 1:
                        if not q_rows[p, 0, r] > 0:  # only pad: its own dK/dV zeroed at the end
                            n_ops += 1
                            nbytes = nbytes + local_kv * 4
                        n_ops += 3
                        nbytes = nbytes + (local_q + local_kv) * (4 + e)
                        n_ops += 3 * cut
                        nbytes = nbytes + cut * rows * (h + 2 * hkv) * d * e
                out[0, p, t, r] = attn
                out[1, p, t, r] = n_ops * launch + nbytes / copy_bw if n_ops > 0 else 0.0
                out[2, p, t, r] = step_us + host_op * ((1 if launched else 0) + n_ops)
    return out
