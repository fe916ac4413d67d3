"""numba kernel of the ring family's metadata (:mod:`flashcp.compiled` says when it is used): every
ring step's kernel calls of one rank in one pass over the plan's shards.

:func:`ring_calls` walks the shards as the readable reference does
(``_shard_segments``, ``_fuse`` and ``_calls`` of :mod:`flashcp.ops.ring_meta`, step by step) and
writes the flat arrays of :func:`flashcp.ops.meta_index.ring_calls` (its NumPy twin, the fallback
when the kernel is off): the same table, rows and ``cu_seqlens``, which
``tests/unit/test_meta_index.py`` compares on random plans of every method. One call instead of the
NumPy code's few dozen array operations is what brings a 128K zigzag batch's metadata (1,680
shards at CP 8) well under a millisecond.
"""

from __future__ import annotations

import numpy as np

from flashcp.compiled.jit import njit

__all__ = ["ring_calls"]


@njit(cache=True)
def ring_calls(doc, start, length, offset, bounds, rank):
    """Every ring step's kernel calls of ``rank``.

    Args:
        doc, start, length, offset: (n_shards,) int64 columns of the plan's shards sorted by rank
            (offset = first row of the shard in its rank's buffer), shards non-empty.
        bounds: (N + 1,) int64, rank r's shards are ``bounds[r]:bounds[r + 1]``.
        rank: the query rank; at step s it holds the block of rank ``(rank - s) mod N``.
    Returns:
        ``(table, rows, cu)`` of :func:`flashcp.ops.meta_index.ring_calls`: table
        (14, n_calls + 1) int64 (rows ``RING_CALL_FIELDS``), rows (n_rows,) int64, cu
        (2, n_seg + n_calls) int64.
    """
    n = bounds.size - 1
    l0, l1 = bounds[rank], bounds[rank + 1]
    span = 1
    for j in range(doc.size):
        span = max(span, doc[j] + 1)
    # capacity: a shard's runs at a step are at most its document's shards in the block
    cnt = np.zeros(span + 1, np.int64)
    cap = 0
    for s in range(n):
        src = (rank - s) % n
        cnt[:] = 0
        for j in range(bounds[src], bounds[src + 1]):
            cnt[doc[j]] += 1
        for i in range(l0, l1):
            cap += cnt[doc[i]]
    sq0 = np.empty(cap, np.int64)
    sq1 = np.empty(cap, np.int64)
    sk0 = np.empty(cap, np.int64)
    sk1 = np.empty(cap, np.int64)
    sc = np.empty(cap, np.bool_)
    # calls of every step: their segments in call order
    oq0 = np.empty(cap, np.int64)
    oq1 = np.empty(cap, np.int64)
    ok0 = np.empty(cap, np.int64)
    ok1 = np.empty(cap, np.int64)
    cstep = np.empty(cap, np.int64)
    ccausal = np.empty(cap, np.bool_)
    cbound = np.zeros(cap + 1, np.int64)
    first = np.empty(span + 1, np.int64)
    by_doc = np.empty(max(doc.size, 1), np.int64)
    runs = np.empty((max(doc.size, 1), 3), np.int64)
    group = np.empty(cap, np.int64)
    glast = np.empty(cap, np.int64)
    gcausal = np.empty(cap, np.bool_)
    gcount = np.empty(cap + 1, np.int64)
    ncall = 0
    out = 0
    for s in range(n):
        src = (rank - s) % n
        b0, b1 = bounds[src], bounds[src + 1]
        # the block's shards by document, in block order (a counting sort)
        cnt[:] = 0
        for j in range(b0, b1):
            cnt[doc[j] + 1] += 1
        first[0] = 0
        for d in range(span):
            first[d + 1] = first[d] + cnt[d + 1]
        fill = first.copy()
        for j in range(b0, b1):
            by_doc[fill[doc[j]]] = j
            fill[doc[j]] += 1
        m = 0  # this step's segments (_fuse's list)
        prev_single = False
        for i in range(l0, l1):
            d, qs, ql, qo = doc[i], start[i], length[i], offset[i]
            nr = 0
            for t in range(first[d], first[d + 1]):
                j = by_doc[t]
                if s == 0 and j - b0 == i - l0:
                    causal = True
                elif start[j] + length[j] <= qs:
                    causal = False
                else:  # after the query shard: masked
                    continue
                if nr > 0 and runs[nr - 1, 1] == offset[j] and runs[nr - 1, 2] == 0:
                    runs[nr - 1, 1] = offset[j] + length[j]
                    runs[nr - 1, 2] = 1 if causal else 0
                else:
                    runs[nr, 0], runs[nr, 1] = offset[j], offset[j] + length[j]
                    runs[nr, 2] = 1 if causal else 0
                    nr += 1
            if nr == 1 and prev_single:
                a = m - 1
                bc = runs[0, 2] == 1
                if sq1[a] == qo and sc[a] == bc:
                    if not bc and sk0[a] == runs[0, 0] and sk1[a] == runs[0, 1]:
                        sq1[a] = qo + ql
                        continue
                    if (
                        bc
                        and sk0[a] == runs[0, 0]
                        and (runs[0, 1] - runs[0, 0]) - ql == sk1[a] - sk0[a]
                    ):
                        sq1[a], sk1[a] = qo + ql, runs[0, 1]
                        continue
            for r in range(nr):
                sq0[m], sq1[m], sk0[m], sk1[m] = qo, qo + ql, runs[r, 0], runs[r, 1]
                sc[m] = runs[r, 2] == 1
                m += 1
            prev_single = nr == 1
        # _calls: first fit of the segments (non-decreasing q0) into calls of one flag
        ng = 0
        for t in range(m):
            g = 0
            while g < ng and not (gcausal[g] == sc[t] and glast[g] <= sq0[t]):
                g += 1
            if g == ng:
                gcausal[g] = sc[t]
                ng += 1
            glast[g] = sq1[t]
            group[t] = g
        gcount[: ng + 1] = 0
        for t in range(m):
            gcount[group[t] + 1] += 1
        for g in range(ng):
            gcount[g + 1] += gcount[g]
            cstep[ncall + g] = s
            ccausal[ncall + g] = gcausal[g]
            cbound[ncall + g + 1] = out + gcount[g + 1]
        for t in range(m):
            p = out + gcount[group[t]]
            gcount[group[t]] += 1
            oq0[p], oq1[p], ok0[p], ok1[p] = sq0[t], sq1[t], sk0[t], sk1[t]
        ncall += ng
        out += m
    # each call's numbers, cu_seqlens and rows (_block_call)
    table = np.zeros((14, ncall + 1), np.int64)
    cu = np.zeros((2, out + ncall), np.int64)
    nrows = 0
    for g in range(ncall):
        c0, c1 = cbound[g], cbound[g + 1]
        table[0, g], table[1, g] = cstep[g], 1 if ccausal[g] else 0
        table[11, g] = c0 + g
        pairs, mq, mk = 0, 0, 0
        qs_, ks_ = 1, 1
        for t in range(c0, c1):
            ql, kl = oq1[t] - oq0[t], ok1[t] - ok0[t]
            pairs += (2 * (kl - ql) + ql + 1) * ql // 2 if ccausal[g] else ql * kl  # Eq. 3
            mq, mk = max(mq, ql), max(mk, kl)
            cu[0, c0 + g + 1 + t - c0] = cu[0, c0 + g + t - c0] + ql
            cu[1, c0 + g + 1 + t - c0] = cu[1, c0 + g + t - c0] + kl
            if t > c0 and oq0[t] != oq1[t - 1]:
                qs_ = 0
            if t > c0 and ok0[t] != ok1[t - 1]:
                ks_ = 0
        table[2, g], table[3, g], table[4, g] = pairs, mq, mk
        table[5, g], table[6, g], table[7, g] = oq0[c0], oq1[c1 - 1], qs_
        table[8, g], table[9, g], table[10, g] = ok0[c0], ok1[c1 - 1], ks_
        if not qs_:
            nrows += cu[0, c1 + g]
        if not ks_:
            nrows += cu[1, c1 + g]
    table[11, ncall] = out + ncall
    rows = np.empty(nrows, np.int64)
    w = 0
    for f in range(2):
        lo, hi, flag, at = (oq0, oq1, 7, 12) if f == 0 else (ok0, ok1, 10, 13)
        for g in range(ncall):
            table[at, g] = w
            if table[flag, g] == 0:
                for t in range(cbound[g], cbound[g + 1]):
                    for x in range(lo[t], hi[t]):
                        rows[w] = x
                        w += 1
        table[at, ncall] = w
    return table, rows, cu
