"""Algorithm 1 of the paper (arXiv 2606.08476, §3.3) compiled with numba: the same steps, in the
same order and with the same tie-breaks, as the readable reference :mod:`flashcp.planners.flashcp`,
which is its oracle (``tests/unit/test_compiled.py`` compares their plans).

:func:`algorithm1` is the reference's search loop (steps 1-2c) and shard emission in one call.
Each rank's whole-document pieces are rows of (N, cap) arrays ``pdoc, pstart, plen`` with
``cnt[r]`` of them in use, kept in the order the reference's lists hold them (append at the end;
a piece moved off whole is removed, the others keep their order), because that order breaks the
ties of the stable sorts in step 2b. ``cap`` bounds the pieces of a rank: every document once,
plus one per cut (at most N - 1 receivers in each of at most N donor rounds). Three sets of these
buffers are allocated once per call: the best plan so far and the two step-2b variants of the
current Per-Doc set. :func:`flashcp_plan` is the whole planner in one call (the argument checks,
this search, the merge, validation and metrics of :func:`flashcp.plan.kernels.finish_plan`).
"""

from __future__ import annotations

import numpy as np

from flashcp.compiled.jit import njit
from flashcp.plan.kernels import _entry, _failed, _stack, finish_plan, per_doc_sizes

__all__ = ["algorithm1", "flashcp_plan"]


@njit(cache=True, inline="always")
def _workload(p, s):
    """Eq. 3: (2p + s + 1) s / 2."""
    return (2 * p + s + 1) * s // 2


@njit(cache=True)
def _greedy(whole, lens, base_tokens, base_work, pdoc, pstart, plen, cnt, work, tokens):
    """Step 2a (reference ``_greedy``) into the given buffers: each document of ``whole`` to the
    first rank of least workload, on top of the Per-Doc ``base_tokens`` / ``base_work``."""
    n = cnt.size
    for r in range(n):
        work[r], tokens[r], cnt[r] = base_work[r], base_tokens[r], 0
    for doc in whole:
        r = 0
        least = work[0]
        for q in range(1, n):
            wq = work[q]
            better = wq < least
            least = wq if better else least
            r = q if better else r
        d = lens[doc]
        c = cnt[r]
        pdoc[r, c], pstart[r, c], plen[r, c] = doc, 0, d
        cnt[r] = c + 1
        work[r] += _workload(0, d)
        tokens[r] += d


@njit(cache=True)
def _has_bit(bits, top, t):
    """Bit t of a bitset whose words above ``top >> 6`` are not written (all zero)."""
    if t > top:
        return False
    return (bits[t >> 6] >> np.uint64(t & 63)) & np.uint64(1) != 0


@njit(cache=True)
def _exact_subset(own, c, plen_row, need, small, out):
    """Reference ``_exact_subset``: writes to ``out`` the indices (into the donor's pieces) of
    pieces, taken from ``own[:c]`` (indices in length order), whose lengths sum to exactly
    ``need``, in the reference's order, and returns how many (0 when none do). ``small`` is
    scratch of at least ``c`` entries."""
    for j in range(c):
        i = own[j]
        if plen_row[i] == need:
            out[0] = i
            return 1
    m = 0
    total = 0
    for j in range(c):
        i = own[j]
        if plen_row[i] < need:
            small[m] = i
            m += 1
            total += plen_row[i]
    if total <= need:
        if total == need:
            out[:m] = small[:m]
            return m
        return 0
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
        return 0
    k = 0
    rem = need
    for i in range(rows, 0, -1):
        if rem and not _has_bit(reach[i - 1], top[i - 1], rem):  # rem needs piece i-1
            out[k] = small[i - 1]
            k += 1
            rem -= plen_row[small[i - 1]]
    return k


@njit(cache=True)
def _choose_moves(plen_row, own, c, need, later, nl, fewest_cuts, idx, takes, small):
    """Reference ``_choose_moves``: writes ``idx`` (indices into the donor's pieces) and
    ``takes`` (the tokens each moves) in moving order and returns how many; ``own[:c]`` are the
    donor's pieces in the order of a stable sort by length."""
    if fewest_cuts:
        m = _exact_subset(own, c, plen_row, need, small, idx)
        if m:
            for j in range(m):
                takes[j] = plen_row[idx[j]]
            return m
        for j in range(c):
            i = own[j]
            s = plen_row[i]
            if s > need:
                for q in range(nl):
                    if s - need == later[q]:
                        idx[0], takes[0] = i, need
                        return 1
    m = 0
    moved = 0
    for j in range(c):
        if moved == need:
            break
        i = own[j]
        take = min(plen_row[i], need - moved)
        idx[m], takes[m] = i, take
        m += 1
        moved += take
    return m


@njit(cache=True)
def _equalise(pdoc, pstart, plen, cnt, work, tokens, tpr, fewest_cuts, scratch, later, recv):
    """Step 2b in place (reference ``_equalise``); returns the number of documents cut.

    The donor's pieces in length order (the reference sorts them for every receiver) are sorted
    once per donor and kept in order as pieces leave and one is cut: a stable sort by length is
    the order of the key (length, index), which dropping pieces (the others' indices keep their
    order) does not change, and a cut only shortens one piece, which moves it left.
    ``scratch`` is (6, cap) int64 work space, ``later`` and ``recv`` (N,) int64.
    """
    n = tokens.size
    cuts = 0
    own, idx, takes, small, newpos, removed = (
        scratch[0], scratch[1], scratch[2], scratch[3], scratch[4], scratch[5],
    )  # fmt: skip
    while True:
        donor = 0
        for q in range(1, n):
            if tokens[q] > tokens[donor]:
                donor = q
        surplus = tokens[donor] - tpr
        if surplus <= 0:
            return cuts
        # receivers: ranks short of C/N, least workload first (stable: ties by rank)
        nrec = 0
        for q in range(n):
            if tokens[q] < tpr:
                j = nrec
                while j > 0 and work[recv[j - 1]] > work[q]:
                    recv[j] = recv[j - 1]
                    j -= 1
                recv[j] = q
                nrec += 1
        c = cnt[donor]
        prow = plen[donor]
        for q in range(c):  # insertion sort, stable: ties keep the list order
            j = q
            s = prow[q]
            while j > 0 and prow[own[j - 1]] > s:
                own[j] = own[j - 1]
                j -= 1
            own[j] = q
        for i in range(nrec):
            if surplus == 0:
                break
            rec = recv[i]
            need = min(surplus, tpr - tokens[rec])
            # reference _later_needs: what the next receivers will ask for
            nl = 0
            left = surplus - need
            if fewest_cuts:
                for j in range(i + 1, nrec):
                    if left <= 0:
                        break
                    deficit = tpr - tokens[recv[j]]
                    later[nl] = min(deficit, left)
                    nl += 1
                    left -= deficit
            nm = _choose_moves(prow, own, c, need, later, nl, fewest_cuts, idx, takes, small)
            moved = 0
            any_removed = False
            cut = -1
            for j in range(nm):
                pc, take = idx[j], takes[j]
                doc, p, s = pdoc[donor, pc], pstart[donor, pc], plen[donor, pc]
                w_head = _workload(p, take)
                cr = cnt[rec]
                if cr >= pdoc.shape[1]:
                    raise RuntimeError("flashcp: a rank's piece buffer is full (a bug)")
                pdoc[rec, cr], pstart[rec, cr], plen[rec, cr] = doc, p, take
                cnt[rec] = cr + 1
                if take == s:
                    removed[pc] = 1
                    any_removed = True
                else:  # donor keeps the tail
                    pstart[donor, pc], plen[donor, pc] = p + take, s - take
                    cuts += 1
                    cut = pc
                work[donor] -= w_head
                work[rec] += w_head
                moved += take
            if any_removed:  # drop the pieces moved whole, keeping the others' order
                m = 0
                for j in range(c):
                    if removed[j]:
                        newpos[j] = -1
                    else:
                        newpos[j] = m
                        pdoc[donor, m], pstart[donor, m], plen[donor, m] = (
                            pdoc[donor, j], pstart[donor, j], plen[donor, j],
                        )  # fmt: skip
                        m += 1
                cnt[donor] = m
                w = 0
                for j in range(c):
                    o = own[j]
                    if removed[o]:
                        removed[o] = 0
                    else:
                        own[w] = newpos[o]
                        w += 1
                c = m
                if cut >= 0:
                    cut = newpos[cut]
            if cut >= 0:  # the shortened piece moves left to its place in (length, index) order
                pos = 0
                while own[pos] != cut:
                    pos += 1
                s = prow[cut]
                while pos > 0 and (
                    prow[own[pos - 1]] > s or (prow[own[pos - 1]] == s and own[pos - 1] > cut)
                ):
                    own[pos] = own[pos - 1]
                    pos -= 1
                own[pos] = cut
            tokens[donor] -= moved
            tokens[rec] += moved
            surplus -= moved


@njit(cache=True)
def _copy_set(src, dst, pdoc, pstart, plen, cnt, work, tokens):
    """Buffer set ``dst`` := buffer set ``src`` (the pieces in use)."""
    for r in range(cnt.shape[1]):
        c = cnt[src, r]
        pdoc[dst, r, :c] = pdoc[src, r, :c]
        pstart[dst, r, :c] = pstart[src, r, :c]
        plen[dst, r, :c] = plen[src, r, :c]
        cnt[dst, r], work[dst, r], tokens[dst, r] = c, work[src, r], tokens[src, r]


@njit(cache=True)
def _fewest_cuts_pass(
    whole, lens, base_tokens, base_work, tpr, target, mean_work, a, b, bufs, scratch, later, recv
):
    """Steps 2a and 2b for one Per-Doc set (reference ``_fewest_cuts_pass``) in buffer sets
    ``a`` and ``b`` of ``bufs = (pdoc, pstart, plen, cnt, work, tokens)``: ``(ratio, kept)``, the
    kept variant's imbalance ratio and buffer set."""
    pdoc, pstart, plen, cnt, work, tokens = bufs
    _greedy(whole, lens, base_tokens, base_work, pdoc[a], pstart[a], plen[a], cnt[a], work[a],
            tokens[a])  # fmt: skip
    if tokens[a].max() <= tpr:  # nothing to equalise
        return work[a].max() / mean_work, a
    _copy_set(a, b, pdoc, pstart, plen, cnt, work, tokens)  # the plain variant starts from here
    cuts = _equalise(pdoc[a], pstart[a], plen[a], cnt[a], work[a], tokens[a], tpr, True,
                     scratch, later, recv)  # fmt: skip
    ratio = work[a].max() / mean_work
    if cuts == 0 and ratio <= target:
        return ratio, a
    cuts2 = _equalise(pdoc[b], pstart[b], plen[b], cnt[b], work[b], tokens[b], tpr, False,
                      scratch, later, recv)  # fmt: skip
    ratio2 = work[b].max() / mean_work
    # min over (misses target, cuts if it meets it else ratio): the first of equal keys
    miss, miss2 = ratio > target, ratio2 > target
    if miss != miss2:
        second = miss
    elif not miss:
        second = cuts2 < cuts
    else:
        second = ratio2 < ratio
    if second:
        return ratio2, b
    return ratio, a


@njit(cache=True)
def _misses_target(pdoc, pstart, plen, cnt, work, tokens, base_tokens, base_work, tpr, mean_work,
                   target, offer_c, offer_t):  # fmt: skip
    """Whether step 2b, whatever pieces it moves, must leave some rank's workload over
    ``mean_work`` above ``target`` (the ratio the search compares, computed the same way): a proof that this Per-Doc set misses the target, found before running
    step 2b (the plan is then never this set's, unless no set meets the target, and
    :func:`algorithm1` reruns every set).

    A lower bound on every rank's workload after step 2b: a rank at or below C/N tokens only
    gains (receivers) or keeps its workload; a donor ends at exactly C/N tokens and keeps a
    suffix of each of its pieces (heads and whole pieces move), so it keeps K = C/N - its Per-Doc
    tokens of them, and a kept token of a piece ending at e is at position >= e - min(s, K)
    (Eq. 3 charges a token at position i with i + 1 keys): the cheapest such choice of K tokens
    (cheapest pieces first) bounds the donor's workload from below. ``offer_c``, ``offer_t``:
    scratch of the donor's piece count."""
    n = tokens.size
    for r in range(n):
        if tokens[r] <= tpr:
            if work[r] / mean_work > target:
                return True
            continue
        k = max(tpr - base_tokens[r], 0)
        c = cnt[r]
        for j in range(c):  # insertion sort of (cost per token, tokens offered) by cost
            e = pstart[r, j] + plen[r, j]
            t = min(plen[r, j], k)
            cost = e - t + 1
            q = j
            while q > 0 and offer_c[q - 1] > cost:
                offer_c[q], offer_t[q] = offer_c[q - 1], offer_t[q - 1]
                q -= 1
            offer_c[q], offer_t[q] = cost, t
        lb = base_work[r]
        left = k
        for j in range(c):
            if left == 0:
                break
            take = min(offer_t[j], left)
            lb += offer_c[j] * take
            left -= take
        if lb / mean_work > target:
            return True
    return False


@njit(cache=True)
def algorithm1(lens, n, tpr, target):
    """The reference :func:`flashcp.planners.flashcp.plan_flashcp` after its argument checks.

    Step 2b runs only for the Per-Doc sets it can make meet the target
    (:func:`_misses_target` proves the others miss it); the first set that meets it is the
    reference's. Where none does, the kept plan is the best balanced of all sets, so the search
    runs again over every set.

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
    out = _search(lens, n, tpr, target, True)
    if out[0] > target:  # no set met the target: the best balanced over every set
        out = _search(lens, n, tpr, target, False)
    return out


@njit(cache=True)
def _search(lens, n, tpr, target, prune):
    """:func:`algorithm1`'s search; ``prune``: skip the Per-Doc sets :func:`_misses_target`
    rules out (the result is then the reference's only when a set meets the target)."""
    m = lens.size
    order = np.argsort(-lens, kind="mergesort")  # longest first, stable
    total = 0
    for x in lens:
        total += _workload(0, x)
    mean_work = total / n
    sizes_sorted, _ = per_doc_sizes(lens[order], n, 0)
    # pieces a rank can hold: the whole documents plus at most 2N cuts per step 2b, since every
    # cut completes a move of min(surplus, deficit) tokens, so it fills its receiver (once per
    # rank: a full rank never receives again) or empties its donor's surplus (once per rank:
    # the donor is then at C/N and never gives again); _equalise checks it
    cap = m + 2 * n + 1
    # three buffer sets of pieces: the best plan so far and the two variants of step 2b
    pdoc = np.empty((3, n, cap), np.int64)
    pstart = np.empty((3, n, cap), np.int64)
    plen = np.empty((3, n, cap), np.int64)
    bufs = (pdoc, pstart, plen, np.zeros((3, n), np.int64), np.zeros((3, n), np.int64),
            np.zeros((3, n), np.int64))  # fmt: skip
    scratch = np.zeros((6, cap), np.int64)
    later = np.empty(n, np.int64)
    recv = np.empty(n, np.int64)
    base_tokens = np.zeros(n, np.int64)
    base_work = np.zeros(n, np.int64)
    best_ratio, best_k, bi = np.inf, -1, 2
    for k in range(m + 1):
        if k > 0:  # move the k-th longest document to the Per-Doc set
            p = 0
            for j in range(2 * n):
                s = sizes_sorted[k - 1, j]
                r = j if j < n else 2 * n - 1 - j
                base_tokens[r] += s
                base_work[r] += _workload(p, s)
                p += s
        a, b = (1, 2) if bi == 0 else ((0, 2) if bi == 1 else (0, 1))
        if prune:  # step 2a, then skip step 2b where it provably misses the target
            _greedy(order[k:], lens, base_tokens, base_work, pdoc[a], pstart[a], plen[a],
                    bufs[3][a], bufs[4][a], bufs[5][a])  # fmt: skip
            if bufs[5][a].max() > tpr and _misses_target(
                pdoc[a], pstart[a], plen[a], bufs[3][a], bufs[4][a], bufs[5][a], base_tokens,
                base_work, tpr, mean_work, target, scratch[0], scratch[1],
            ):  # fmt: skip
                continue
        ratio, kept = _fewest_cuts_pass(
            order[k:], lens, base_tokens, base_work, tpr, target, mean_work, a, b, bufs,
            scratch, later, recv,
        )  # fmt: skip
        if best_k < 0 or ratio < best_ratio or ratio <= target:
            best_ratio, best_k, bi = ratio, k, kept
        if ratio <= target:
            break
    k = best_k
    pdoc, pstart, plen, cnt = pdoc[bi], pstart[bi], plen[bi], bufs[3][bi]
    # emit shards sorted by (rank, doc, start), rank by rank (no sort of all the rows): its
    # Per-Doc chunks r and 2N-1-r of each Per-Doc document (documents ascending) merged with its
    # pieces sorted by (doc, start) (a few per rank); ties only between empty rows, which
    # finish_plan drops
    rows = 2 * n * k + cnt.sum()
    rank = np.empty(rows, np.int64)
    doc = np.empty(rows, np.int64)
    start = np.empty(rows, np.int64)
    length = np.empty(rows, np.int64)
    span = tpr * n + 1
    xs = np.argsort(order[:k])
    at = np.zeros((k, 2 * n + 1), np.int64)  # [x, j]: where chunk j of Per-Doc document x starts
    for x in range(k):
        for j in range(2 * n):
            at[x, j + 1] = at[x, j] + sizes_sorted[x, j]
    ckey = np.empty(2 * k, np.int64)  # one rank's Per-Doc chunks: key, start, length
    cst = np.empty(2 * k, np.int64)
    cln = np.empty(2 * k, np.int64)
    pkey = np.empty(plen.shape[1], np.int64)  # one rank's pieces: key, index, in key order
    pidx = np.empty(plen.shape[1], np.int64)
    i = 0
    for r in range(n):
        nc = 0
        for y in range(k):
            x = xs[y]
            for j in (r, 2 * n - 1 - r):
                s = sizes_sorted[x, j]
                if s:
                    ckey[nc], cst[nc], cln[nc] = order[x] * span + at[x, j], at[x, j], s
                    nc += 1
        npc = cnt[r]
        if npc <= 32:
            for c in range(npc):  # insertion sort by (doc, start)
                key = pdoc[r, c] * span + pstart[r, c]
                u = c
                while u > 0 and pkey[u - 1] > key:
                    pkey[u], pidx[u] = pkey[u - 1], pidx[u - 1]
                    u -= 1
                pkey[u], pidx[u] = key, c
        else:
            for c in range(npc):
                pkey[c] = pdoc[r, c] * span + pstart[r, c]
            pidx[:npc] = np.argsort(pkey[:npc])
            pkey[:npc] = pkey[:npc][pidx[:npc]]
        u = v = 0
        while u < nc or v < npc:
            if v >= npc or (u < nc and ckey[u] < pkey[v]):
                rank[i], doc[i], start[i], length[i] = r, ckey[u] // span, cst[u], cln[u]
                u += 1
            else:
                c = pidx[v]
                rank[i], doc[i], start[i], length[i] = r, pdoc[r, c], pstart[r, c], plen[r, c]
                v += 1
            i += 1
    pad = np.full(n, tpr, np.int64)
    for j in range(i):
        pad[rank[j]] -= length[j]
    return best_ratio, np.sort(order[:k]), _stack(rank, doc, start, length, i), pad


@njit(cache=True)
def flashcp_plan(doc_lens, cp_size, num_pad, pad_to_multiple, validate, target):
    """:func:`flashcp.planners.flashcp.plan_flashcp` of documents all of length >= 1 in one call: the
    checks of :func:`flashcp.plan.planner_entry` (:func:`flashcp.plan.kernels._entry`: more than
    ``EXACT_TOKENS`` tokens go the general path), :func:`algorithm1` and
    :func:`flashcp.plan.kernels.finish_plan` (compiled into this function: the cache's key covers
    both modules' sources, :func:`flashcp.compiled.jit.njit`).

    Args:
        doc_lens: (n_docs,) int64. cp_size: N >= 1. num_pad: pad tokens >= 0.
        pad_to_multiple, validate: as the planner's. target: R >= 1 (checked by the caller).
    Returns:
        ``(buf, ratio, per_doc)``: ``finish_plan``'s buffer (a 2-entry one with its status where
        the fused path does not take the input: :data:`flashcp.plan.kernels.FUSED_STATUS`), the
        plan's imbalance ratio and its Per-Doc documents (sorted).
    """
    status, num_pad = _entry(doc_lens, cp_size, num_pad, pad_to_multiple, 1)
    if status:
        return _failed(status), 0.0, np.empty(0, np.int64)
    real = 0
    for x in doc_lens:
        real += x
    ratio, per_doc, cols, pad = algorithm1(doc_lens, cp_size, (real + num_pad) // cp_size, target)
    buf = finish_plan(doc_lens, cp_size, cols[0], cols[1], cols[2], cols[3], pad, validate)
    return buf, ratio, per_doc
