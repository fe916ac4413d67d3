"""Algorithm 1 of the paper (arXiv 2606.08476, §3.3) compiled with numba: the same steps, in the
same order and with the same tie-breaks, as the readable reference :mod:`flashcp.heuristic`,
which is its oracle (``tests/test_compiled.py`` compares their plans).

:func:`algorithm1` is the reference's search loop (steps 1-2c) and shard emission in one call.
Each rank's whole-document pieces are rows of (N, cap) arrays ``pdoc, pstart, plen`` with
``cnt[r]`` of them in use, kept in the order the reference's lists hold them (append at the end;
a piece moved off whole is removed, the others keep their order), because that order breaks the
ties of the stable sorts in step 2b. ``cap`` bounds the pieces of a rank: every document once,
plus one per cut (at most N - 1 receivers in each of at most N donor rounds).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from flashcp.plan_kernels import _stack, per_doc_sizes

__all__ = ["algorithm1"]


@njit(cache=True, inline="always")
def _workload(p, s):
    """Eq. 3: (2p + s + 1) s / 2."""
    return (2 * p + s + 1) * s // 2


@njit(cache=True)
def _greedy(whole, lens, base_tokens, base_work, n, cap):
    """Step 2a (reference ``_greedy``): each document of ``whole`` to the first rank of least
    workload."""
    work = base_work.copy()
    tokens = base_tokens.copy()
    pdoc = np.empty((n, cap), np.int64)
    pstart = np.empty((n, cap), np.int64)
    plen = np.empty((n, cap), np.int64)
    cnt = np.zeros(n, np.int64)
    for doc in whole:
        r = 0
        for q in range(1, n):
            if work[q] < work[r]:
                r = q
        d = lens[doc]
        c = cnt[r]
        pdoc[r, c], pstart[r, c], plen[r, c] = doc, 0, d
        cnt[r] = c + 1
        work[r] += _workload(0, d)
        tokens[r] += d
    return pdoc, pstart, plen, cnt, work, tokens


@njit(cache=True)
def _has_bit(bits, top, t):
    """Bit t of a bitset whose words above ``top >> 6`` are not written (all zero)."""
    if t > top:
        return False
    return (bits[t >> 6] >> np.uint64(t & 63)) & np.uint64(1) != 0


@njit(cache=True)
def _exact_subset(own, plen_row, need):
    """Reference ``_exact_subset``: indices (into the donor's pieces) of pieces, taken from
    ``own`` (indices in length order), whose lengths sum to exactly ``need``, in the reference's
    order; an empty array when none do."""
    for i in own:
        if plen_row[i] == need:
            out = np.empty(1, np.int64)
            out[0] = i
            return out
    small = np.empty(own.size, np.int64)
    m = 0
    total = 0
    for i in own:
        if plen_row[i] < need:
            small[m] = i
            m += 1
            total += plen_row[i]
    if total <= need:
        if total == need:
            return small[:m].copy()
        return np.empty(0, np.int64)
    # subset sum on bitsets: bit t of reach[i] says t tokens are reachable with small[:i]; only
    # the words up to top[i] (no bit is set above it) are written
    words = (need >> 6) + 1
    reach = np.empty((m + 1, words), np.uint64)
    top = np.zeros(m + 1, np.int64)
    reach[0, 0] = np.uint64(1)
    rows = m
    for i in range(m):
        s = plen_row[small[i]]
        ws, bs = s >> 6, s & 63
        prev, cur = reach[i], reach[i + 1]
        pw = top[i] >> 6  # prev's last written word
        top[i + 1] = min(top[i] + s, need)
        for w in range((top[i + 1] >> 6) + 1):
            v = prev[w] if w <= pw else np.uint64(0)
            src = w - ws
            if 0 <= src <= pw:
                v |= prev[src] << np.uint64(bs)
            if bs and 1 <= src <= pw + 1:
                v |= prev[src - 1] >> np.uint64(64 - bs)
            cur[w] = v
        if _has_bit(cur, top[i + 1], need):
            rows = i + 1
            break
    if not _has_bit(reach[rows], top[rows], need):
        return np.empty(0, np.int64)
    chosen = np.empty(rows, np.int64)
    c = 0
    rem = need
    for i in range(rows, 0, -1):
        if rem and not _has_bit(reach[i - 1], top[i - 1], rem):  # rem needs piece i-1
            chosen[c] = small[i - 1]
            c += 1
            rem -= plen_row[small[i - 1]]
    return chosen[:c].copy()


@njit(cache=True)
def _choose_moves(plen_row, count, need, later, fewest_cuts):
    """Reference ``_choose_moves``: ``(pieces, takes)``, indices into the donor's pieces and the
    tokens each moves, in moving order."""
    own = np.argsort(plen_row[:count], kind="mergesort")  # stable: ties keep the list order
    if fewest_cuts:
        exact = _exact_subset(own, plen_row, need)
        if exact.size:
            takes = np.empty(exact.size, np.int64)
            for j in range(exact.size):
                takes[j] = plen_row[exact[j]]
            return exact, takes
        for i in own:
            s = plen_row[i]
            if s > need:
                for x in later:
                    if s - need == x:
                        out = np.empty(1, np.int64)
                        out[0] = i
                        t = np.empty(1, np.int64)
                        t[0] = need
                        return out, t
    idx = np.empty(count, np.int64)
    takes = np.empty(count, np.int64)
    m = 0
    moved = 0
    for i in own:
        if moved == need:
            break
        take = min(plen_row[i], need - moved)
        idx[m], takes[m] = i, take
        m += 1
        moved += take
    return idx[:m].copy(), takes[:m].copy()


@njit(cache=True)
def _equalise(pdoc, pstart, plen, cnt, work, tokens, tpr, fewest_cuts):
    """Step 2b in place (reference ``_equalise``); returns the number of documents cut."""
    n = tokens.size
    cuts = 0
    removed = np.zeros(pdoc.shape[1], np.bool_)
    while True:
        donor = 0
        for q in range(1, n):
            if tokens[q] > tokens[donor]:
                donor = q
        surplus = tokens[donor] - tpr
        if surplus <= 0:
            return cuts
        nrec = 0
        cand = np.empty(n, np.int64)
        for q in range(n):
            if tokens[q] < tpr:
                cand[nrec] = q
                nrec += 1
        open_ranks = cand[:nrec]
        receivers = open_ranks[np.argsort(work[open_ranks], kind="mergesort")]
        deficits = tpr - tokens[receivers]
        for i in range(nrec):
            if surplus == 0:
                break
            rec = receivers[i]
            need = min(surplus, deficits[i])
            # reference _later_needs: what the next receivers will ask for
            later = np.empty(nrec, np.int64)
            nl = 0
            left = surplus - need
            if fewest_cuts:
                for j in range(i + 1, nrec):
                    if left <= 0:
                        break
                    later[nl] = min(deficits[j], left)
                    nl += 1
                    left -= deficits[j]
            c = cnt[donor]
            idx, takes = _choose_moves(plen[donor], c, need, later[:nl], fewest_cuts)
            moved = 0
            any_removed = False
            for j in range(idx.size):
                pc, take = idx[j], takes[j]
                doc, p, s = pdoc[donor, pc], pstart[donor, pc], plen[donor, pc]
                w_head = _workload(p, take)
                cr = cnt[rec]
                pdoc[rec, cr], pstart[rec, cr], plen[rec, cr] = doc, p, take
                cnt[rec] = cr + 1
                if take == s:
                    removed[pc] = True
                    any_removed = True
                else:  # donor keeps the tail
                    pstart[donor, pc], plen[donor, pc] = p + take, s - take
                    cuts += 1
                work[donor] -= w_head
                work[rec] += w_head
                moved += take
            if any_removed:  # drop the pieces moved whole, keeping the others' order
                m = 0
                for j in range(c):
                    if removed[j]:
                        removed[j] = False
                    else:
                        pdoc[donor, m], pstart[donor, m], plen[donor, m] = (
                            pdoc[donor, j], pstart[donor, j], plen[donor, j],
                        )  # fmt: skip
                        m += 1
                cnt[donor] = m
            tokens[donor] -= moved
            tokens[rec] += moved
            surplus -= moved


@njit(cache=True)
def _fewest_cuts_pass(whole, lens, base_tokens, base_work, n, tpr, target, mean_work, cap):
    """Steps 2a and 2b for one Per-Doc set (reference ``_fewest_cuts_pass``): ``(ratio, pdoc,
    pstart, plen, cnt)`` of the kept variant."""
    pdoc, pstart, plen, cnt, work, tokens = _greedy(whole, lens, base_tokens, base_work, n, cap)
    if tokens.max() <= tpr:  # nothing to equalise
        return work.max() / mean_work, pdoc, pstart, plen, cnt
    plain = (pdoc.copy(), pstart.copy(), plen.copy(), cnt.copy(), work.copy(), tokens.copy())
    cuts = _equalise(pdoc, pstart, plen, cnt, work, tokens, tpr, True)
    ratio = work.max() / mean_work
    if cuts == 0 and ratio <= target:
        return ratio, pdoc, pstart, plen, cnt
    pdoc2, pstart2, plen2, cnt2, work2, tokens2 = plain
    cuts2 = _equalise(pdoc2, pstart2, plen2, cnt2, work2, tokens2, tpr, False)
    ratio2 = work2.max() / mean_work
    # min over (misses target, cuts if it meets it else ratio): the first of equal keys
    miss, miss2 = ratio > target, ratio2 > target
    if miss != miss2:
        second = miss
    elif not miss:
        second = cuts2 < cuts
    else:
        second = ratio2 < ratio
    if second:
        return ratio2, pdoc2, pstart2, plen2, cnt2
    return ratio, pdoc, pstart, plen, cnt


@njit(cache=True)
def algorithm1(lens, n, tpr, target):
    """The reference :func:`flashcp.heuristic.plan_flashcp` after its argument checks.

    Args:
        lens: (n_docs,) int64 document lengths (all > 0).
        n: N.
        tpr: C / N.
        target: R.
    Returns:
        ``(ratio, per_doc, cols, pad)``: the kept plan's imbalance ratio, its Per-Doc documents
        (sorted), its shard columns (4, n_shards) int64 rank, doc, start, length sorted by (rank,
        doc, start) and (N,) pad tokens per rank.
    """
    m = lens.size
    order = np.argsort(-lens, kind="mergesort")  # longest first, stable
    total = 0
    for x in lens:
        total += _workload(0, x)
    mean_work = total / n
    sizes_sorted, _ = per_doc_sizes(lens[order], n, 0)
    cap = m + n * n + 1
    base_tokens = np.zeros(n, np.int64)
    base_work = np.zeros(n, np.int64)
    best_ratio, best_k = np.inf, -1
    best = (np.empty((n, 0), np.int64), np.empty((n, 0), np.int64), np.empty((n, 0), np.int64),
            np.zeros(n, np.int64))  # fmt: skip
    for k in range(m + 1):
        if k > 0:  # move the k-th longest document to the Per-Doc set
            p = 0
            for j in range(2 * n):
                s = sizes_sorted[k - 1, j]
                r = j if j < n else 2 * n - 1 - j
                base_tokens[r] += s
                base_work[r] += _workload(p, s)
                p += s
        ratio, pdoc, pstart, plen, cnt = _fewest_cuts_pass(
            order[k:], lens, base_tokens, base_work, n, tpr, target, mean_work, cap
        )
        if best_k < 0 or ratio < best_ratio or ratio <= target:
            best_ratio, best_k = ratio, k
            best = (pdoc, pstart, plen, cnt)
        if ratio <= target:
            break
    k = best_k
    pdoc, pstart, plen, cnt = best
    # emit shards: the Per-Doc chunks, then each rank's pieces; sorted by (rank, doc, start)
    rows = 2 * n * k + cnt.sum()
    rank = np.empty(rows, np.int64)
    doc = np.empty(rows, np.int64)
    start = np.empty(rows, np.int64)
    length = np.empty(rows, np.int64)
    i = 0
    for x in range(k):
        p = 0
        for j in range(2 * n):
            s = sizes_sorted[x, j]
            if s:
                rank[i], doc[i], start[i], length[i] = (
                    (j if j < n else 2 * n - 1 - j),
                    order[x],
                    p,
                    s,
                )
                i += 1
            p += s
    for r in range(n):
        for c in range(cnt[r]):
            rank[i], doc[i], start[i], length[i] = r, pdoc[r, c], pstart[r, c], plen[r, c]
            i += 1
    span = tpr * n + 1
    key = (rank[:i] * m + doc[:i]) * span + start[:i]
    srt = np.argsort(key)
    rank, doc, start, length = rank[srt], doc[srt], start[srt], length[srt]
    pad = np.full(n, tpr, np.int64)
    for j in range(i):
        pad[rank[j]] -= length[j]
    return best_ratio, np.sort(order[:k]), _stack(rank, doc, start, length, i), pad
