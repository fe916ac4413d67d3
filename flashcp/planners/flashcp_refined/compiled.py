"""``flashcp_refined``'s packing pass compiled with numba: the same steps, in the same order, with
the same integer and floating-point operations as the readable reference
:func:`flashcp.planners.flashcp_refined.reference._pack` (its oracle: ``tests/unit/test_compiled.py`` compares the plans).

The reference's closures become small functions taking what they read; its bisections
(``_largest`` with a predicate) are written out per predicate; the deferred head's receivers
(a dict in insertion order there) are an array in that order with their estimates beside it.
The piece loop keeps its candidates sorted by send as the pieces go out and skips the searches
whose answer provably cannot change the chosen piece (docs/scale.md, "Pricing and refined planning
at CP 64"): the same plans.
"""

from __future__ import annotations

import numpy as np

from flashcp.compiled.jit import njit

__all__ = ["pack"]


@njit(cache=True, inline="always")
def _workload(p, s):
    """Eq. 3: (2p + s + 1) s / 2."""
    return (2 * p + s + 1) * s // 2


@njit(cache=True)
def _fill(room, c, cum_t, cum_w, asc, left, alpha):
    """Reference ``fill``: F(room), the estimated workload of filling ``room`` tokens."""
    lo, hi = 0, left + 1  # bisect_left(cum_t, room, 0, left + 1)
    while lo < hi:
        mid = (lo + hi) // 2
        if cum_t[mid] < room:
            lo = mid + 1
        else:
            hi = mid
    j = lo
    if j > left:
        low = cum_w[left] + (room - cum_t[left]) * c
    elif j == 0:
        low = 0.0
    else:
        low = cum_w[j - 1] + (room - cum_t[j - 1]) * (asc[j - 1] + 1) / 2
    return alpha * low + (1.0 - alpha) * c * room


@njit(cache=True)
def _level(work, est_q, est_v, n_est, pool):
    """Reference ``level``: every receiver of the deferred head at the same level."""
    total = pool
    for i in range(n_est):
        total += work[est_q[i]] - est_v[i]
    lvl = total // n_est
    for i in range(n_est):
        q = est_q[i]
        other = work[q] - est_v[i]
        est_v[i] = lvl - other
        work[q] = lvl


@njit(cache=True)
def _beaten(work, send, est_q, est_v, n_est, pool, send_bound, work_bound):
    """Reference ``beaten``."""
    if n_est:
        _level(work, est_q, est_v, n_est, pool)
    return send.max() > send_bound or work.max() > work_bound


@njit(cache=True)
def _tail_ok(t, joint, c, room, k, r, n_, work, budget, cum_t, cum_w, asc, left, alpha):
    """Reference ``tail_cost(t, joint) <= budget``."""
    a = -(-(n_ - t) // (k + 1)) if joint else 0
    if t + a > room:
        return False
    cost = (
        work[r]
        + _workload(n_ - t, t)
        + _workload(0, a)
        + _fill(room - t - a, c, cum_t, cum_w, asc, left, alpha)
    )
    return cost <= budget


@njit(cache=True)
def _largest_tail(hi, joint, c, room, k, r, n_, work, budget, cum_t, cum_w, asc, left, alpha):
    """Reference ``_largest(lambda x: tail_cost(x, joint) <= budget, hi)``."""
    if hi <= 0 or _tail_ok(
        hi, joint, c, room, k, r, n_, work, budget, cum_t, cum_w, asc, left, alpha
    ):
        return max(hi, 0)
    if not _tail_ok(1, joint, c, room, k, r, n_, work, budget, cum_t, cum_w, asc, left, alpha):
        return 0
    lo, hi = 1, hi - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _tail_ok(mid, joint, c, room, k, r, n_, work, budget, cum_t, cum_w, asc, left, alpha):
            lo = mid
        else:
            hi = mid - 1
    return lo


@njit(cache=True)
def _piece_ok(x, stop, room, base, c, budget, cum_t, cum_w, asc, left, alpha):
    """Reference ``longest``'s predicate."""
    return (
        base + _workload(stop - x, x) + _fill(room - x, c, cum_t, cum_w, asc, left, alpha) <= budget
    )


@njit(cache=True)
def _longest(q, stop, limit, c, tokens, work, tpr, budget, cum_t, cum_w, asc, left, alpha):
    """Reference ``longest``: the longest piece ``[stop - s, stop)``, s <= limit, rank q can take
    within B."""
    room, base = tpr - tokens[q], work[q]
    hi = limit
    if hi <= 0 or _piece_ok(hi, stop, room, base, c, budget, cum_t, cum_w, asc, left, alpha):
        return max(hi, 0)
    if not _piece_ok(1, stop, room, base, c, budget, cum_t, cum_w, asc, left, alpha):
        return 0
    lo, hi = 1, hi - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _piece_ok(mid, stop, room, base, c, budget, cum_t, cum_w, asc, left, alpha):
            lo = mid
        else:
            hi = mid - 1
    return lo


@njit(cache=True)
def _none_beyond(s, full, stop, room, base, c, budget, cum_t, cum_w, asc, left, alpha):
    """True when no piece ``[stop - x, stop)`` with s < x <= full <= stop fits in B
    (``_piece_ok`` false for every such x), so ``_longest`` returns at most s and not full.

    For x <= stop, Eq. 3's W(stop - x, x) = (2 stop - x + 1) x / 2 grows with x, and the fill
    estimate of the room left, F(room - x), shrinks as x grows (F is nondecreasing in the room
    when c >= 0 and 0 <= alpha <= 1: its pieces have slopes (len + 1) / 2 and c): so
    W(stop - s - 1, s + 1) + F(room - full) bounds every such piece's cost from below. Only a
    bound clearly above B (by 1e-9 relative plus one) answers True, far beyond the rounding of
    the float64 sums, so the answer is the reference's own (the caller then skips the search)."""
    x = s + 1
    low = base + _workload(stop - x, x) + _fill(room - full, c, cum_t, cum_w, asc, left, alpha)
    return low > budget + abs(budget) * 1e-9 + 1.0


@njit(cache=True)
def _largest_back(s, lo_, hi_, e):
    """Reference ``_largest(lambda y: W(lo, s - y) + W(hi - y, y) <= e, s)``."""
    hi = s
    if hi <= 0 or _workload(lo_, s - hi) + _workload(hi_ - hi, hi) <= e:
        return max(hi, 0)
    if not _workload(lo_, s - 1) + _workload(hi_ - 1, 1) <= e:
        return 0
    lo, hi = 1, hi - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _workload(lo_, s - mid) + _workload(hi_ - mid, mid) <= e:
            lo = mid
        else:
            hi = mid - 1
    return lo


@njit(cache=True)
def _by_send(cands, send):
    """``sorted(cands, key=send.__getitem__)`` (stable)."""
    return cands[np.argsort(send[cands], kind="mergesort")]


@njit(cache=True)
def _resort(order, q, send):
    """Keep ``order`` sorted by (send, rank) after ``send[q]`` grew: move q towards the end past
    every rank it now follows (nothing when q is not in ``order``)."""
    i = 0
    while i < order.size and order[i] != q:
        i += 1
    while i + 1 < order.size:
        o = order[i + 1]
        if send[o] < send[q] or (send[o] == send[q] and o < q):
            order[i] = o
            order[i + 1] = q
            i += 1
        else:
            break


@njit(cache=True)
def pack(
    lens, order, n, tpr, budget, spread, alpha, zigzag, joint_tail, send_bound, defer, work_bound
):
    """Reference :func:`flashcp.planners.flashcp_refined.reference._pack` (same arguments; ``lens`` and ``order`` int64
    arrays).

    Returns:
        ``(done, rows, max_work, max_send)``: ``done`` False where the reference returns None
        (given up); rows (n_rows, 4) int64 ``(rank, doc, start, length)`` in the reference's order.
    """
    work = np.zeros(n, np.int64)
    tokens = np.zeros(n, np.int64)
    send = np.zeros(n, np.int64)
    rows = []
    m = order.size
    asc = np.empty(m, np.int64)
    for i in range(m):
        asc[i] = lens[order[m - 1 - i]]
    cum_t = np.zeros(m + 1, np.int64)
    cum_w = np.zeros(m + 1, np.int64)
    for i in range(m):
        cum_t[i + 1] = cum_t[i] + asc[i]
        cum_w[i + 1] = cum_w[i] + _workload(0, asc[i])
    left = m
    rem_w = cum_w[m]
    rem_t = cum_t[m]
    # the deferred head: receivers in insertion order, their estimates and token shares
    est_q = np.empty(n, np.int64)
    est_v = np.zeros(n, np.int64)
    in_est = np.zeros(n, np.bool_)
    n_est = 0
    pool = 0
    h_doc, h_a, h_end = 0, 0, 0
    shares = np.zeros(n, np.int64)
    nothing = np.empty(0, np.int64).reshape(0, 4)
    for doc in order:
        length = lens[doc]
        w = _workload(0, length)
        rem_w -= w
        rem_t -= length
        left -= 1
        c = rem_w / rem_t if rem_t else 0.0
        if n_est:
            _level(work, est_q, est_v, n_est, pool)

        # the rank of least projected workload with token room
        r, low = -1, 0.0
        for q in range(n):
            if tokens[q] + length <= tpr and (r < 0 or work[q] - c * tokens[q] < low):
                r, low = q, work[q] - c * tokens[q]
        if r >= 0 and not _fits_in(
            r,
            w,
            c,
            length,
            tokens,
            work,
            tpr,
            budget,
            in_est,
            est_q,
            est_v,
            n_est,
            h_a,
            shares,
            cum_t,
            cum_w,
            asc,
            left,
            alpha,
        ):
            nf = 0
            fits = np.empty(n, np.int64)
            keys = np.empty(n, np.float64)
            for q in range(n):
                if q != r and tokens[q] + length <= tpr:
                    fits[nf] = q
                    keys[nf] = work[q] - c * tokens[q]
                    nf += 1
            fits = fits[:nf][np.argsort(keys[:nf], kind="mergesort")]
            r = -1
            for q in fits:
                if _fits_in(
                    q,
                    w,
                    c,
                    length,
                    tokens,
                    work,
                    tpr,
                    budget,
                    in_est,
                    est_q,
                    est_v,
                    n_est,
                    h_a,
                    shares,
                    cum_t,
                    cum_w,
                    asc,
                    left,
                    alpha,
                ):
                    r = q
                    break
        if r >= 0:  # whole
            rows.append((r, doc, 0, length))
            tokens[r] += length
            work[r] += w
            continue
        # split: the tail on the open rank of least projected workload, as long as it fits in B
        r = -1
        best = 0.0
        for q in range(n):
            if tokens[q] < tpr:
                v = work[q] + c * (tpr - tokens[q])
                if r < 0 or v < best:
                    r, best = q, v
        room = tpr - tokens[r]
        no = 0
        others = np.empty(n, np.int64)
        for q in range(n):
            if q != r and tokens[q] < tpr:
                others[no] = q
                no += 1
        others = others[:no].copy()
        k = min(spread, no)

        t = 0
        hi = min(length, room)
        if k and joint_tail:
            t = _largest_tail(
                hi, True, c, room, k, r, length, work, budget, cum_t, cum_w, asc, left, alpha
            )
            if not t:
                t = _largest_tail(
                    hi, False, c, room, k, r, length, work, budget, cum_t, cum_w, asc, left, alpha
                )
        else:
            t = _largest_tail(
                hi, False, c, room, k, r, length, work, budget, cum_t, cum_w, asc, left, alpha
            )
        if not t:  # no room within B: tokens alone decide
            t = min(length, room)
        rows.append((r, doc, length - t, t))
        tokens[r] += t
        work[r] += _workload(length - t, t)
        end = length - t
        if not end:
            continue

        # the tail's rank takes the head's first chunk, its cheapest tokens (Eq. 3), as its share
        share = -(-end // (k + 1))
        a = 0
        if k:
            a = _longest(
                r,
                share,
                min(share, tpr - tokens[r]),
                c,
                tokens,
                work,
                tpr,
                budget,
                cum_t,
                cum_w,
                asc,
                left,
                alpha,
            )
        if a and 4 * a >= share:  # a sliver would cost a shard for nothing
            rows.append((r, doc, 0, a))
            tokens[r] += a
            work[r] += _workload(0, a)
            send[r] += a
        else:
            a = 0
        tail_start = length - t
        if defer and not n_est and k and w > budget and k <= end - a:
            recv = _by_send(others, send)[:k]
            base, extra = divmod(end - a, k)
            room_ok = True
            for j in range(k):
                shares[recv[j]] = base + (1 if j < extra else 0)
                if tokens[recv[j]] + shares[recv[j]] > tpr:
                    room_ok = False
            if room_ok:
                for j in range(k):
                    q = recv[j]
                    tokens[q] += shares[q]
                    send[q] += shares[q]
                    est_q[n_est] = q
                    est_v[n_est] = 0
                    in_est[q] = True
                    n_est += 1
                pool = _workload(a, end - a)
                h_doc, h_a, h_end = doc, a, end
                _level(work, est_q, est_v, n_est, pool)
                if _beaten(work, send, est_q, est_v, n_est, pool, send_bound, work_bound):
                    return False, nothing, 0, 0
                continue
        if zigzag and k and 2 * k <= end - a:
            # the rest of the head as 2k zigzag chunks, receiver i holding chunks i and 2k-1-i
            recv = _by_send(others, send)[:k]
            base, extra = divmod(end - a, 2 * k)
            sizes = np.empty(2 * k, np.int64)
            for j in range(2 * k):
                sizes[j] = base + (1 if j < extra else 0)
            room_ok = True
            for i in range(k):
                if tokens[recv[i]] + sizes[i] + sizes[2 * k - 1 - i] > tpr:
                    room_ok = False
            if room_ok:
                p = a
                for j in range(2 * k):
                    sz = sizes[j]
                    q = recv[j] if j < k else recv[2 * k - 1 - j]
                    rows.append((q, doc, p, sz))
                    tokens[q] += sz
                    work[q] += _workload(p, sz)
                    send[q] += sz
                    p += sz
                if _beaten(work, send, est_q, est_v, n_est, pool, send_bound, work_bound):
                    return False, nothing, 0, 0
                continue
        piece = -(-(end - a) // max(1, k))
        monotone = c >= 0.0 and 0.0 <= alpha <= 1.0  # _fill nondecreasing in its room
        # the steepest rise of _fill per token of room: (len + 1) / 2 of the longest document
        # left, or c past them all
        top = max(c, (asc[left - 1] + 1) / 2) if left > 0 else c
        slope = alpha * top + (1.0 - alpha) * c
        # the candidates by send (stable: ties by rank, as others is ascending), kept sorted as
        # the pieces go out (one rank's send grows per piece) instead of sorted per piece
        by_send = _by_send(others, send)
        while end > a:  # the rest of the head, from its end, in pieces of at most `piece` tokens
            q, s = -1, 0
            for cand in by_send:
                full = min(end - a, tpr - tokens[cand], piece)
                got = 0
                if full > 0 and full <= s:
                    # got <= full <= s cannot win: only whether it is full (the break) matters,
                    # and _longest returns full exactly when full fits
                    if _piece_ok(full, end, tpr - tokens[cand], work[cand], c, budget, cum_t,
                                 cum_w, asc, left, alpha):  # fmt: skip
                        break
                    continue
                if (
                    full > s
                    and monotone
                    and work[cand] + _workload(end - s - 1, s + 1) > budget + abs(budget) * 1e-9 + 1
                ):
                    # every piece longer than s misses B on Eq. 3 alone (the fill estimate is
                    # >= 0, and W(end - x, x) rises with x): got <= s, not full
                    continue
                if s > 0 and full > s and monotone and end - full + 1 >= slope + 2.0:
                    # the cost of [end - x, end) rises with x on 1..full (by end - x >= end - full
                    # + 1 tokens of Eq. 3, minus at most `slope` of the fill estimate), so
                    # _piece_ok holds up to a threshold and _longest's bisection finds it: full
                    # when full fits, at most s when s + 1 does not
                    room_c, base_c = tpr - tokens[cand], work[cand]
                    if _piece_ok(full, end, room_c, base_c, c, budget, cum_t, cum_w, asc, left,
                                 alpha):  # fmt: skip
                        q, s = cand, full
                        break
                    if full == s + 1 or not _piece_ok(
                        s + 1, end, room_c, base_c, c, budget, cum_t, cum_w, asc, left, alpha
                    ):
                        continue
                    # the threshold lies in [s + 1, full - 1]: bisect there
                    lo, hi = s + 1, full - 1
                    while lo < hi:
                        mid = (lo + hi + 1) // 2
                        if _piece_ok(mid, end, room_c, base_c, c, budget, cum_t, cum_w, asc, left,
                                     alpha):  # fmt: skip
                            lo = mid
                        else:
                            hi = mid - 1
                    q, s = cand, lo
                    continue
                if s > 0 and full > 0 and monotone:
                    # every piece longer than s misses B (_none_beyond): got <= s, not full
                    if _none_beyond(s, full, end, tpr - tokens[cand], work[cand], c, budget,
                                    cum_t, cum_w, asc, left, alpha):  # fmt: skip
                        continue
                if full > 0:
                    got = _longest(
                        cand,
                        end,
                        full,
                        c,
                        tokens,
                        work,
                        tpr,
                        budget,
                        cum_t,
                        cum_w,
                        asc,
                        left,
                        alpha,
                    )
                if got > s:
                    q, s = cand, got
                if got == full and full > 0:
                    break
            if q < 0:  # no room within B: the open rank that sends least
                for x in range(n):
                    if tokens[x] < tpr and (q < 0 or send[x] < send[q]):
                        q = x
                s = min(end - a, tpr - tokens[q], piece)
            start = end - s
            rows.append((q, doc, start, s))
            tokens[q] += s
            work[q] += _workload(start, s)
            if q == r and end == tail_start:  # extends the last shard: not sent
                tail_start = start
            else:
                send[q] += s
                _resort(by_send, q, send)
            end = start
        if a and tail_start == a:  # the tail's rank ended up holding the whole document
            send[r] -= a
        if _beaten(work, send, est_q, est_v, n_est, pool, send_bound, work_bound):
            return False, nothing, 0, 0
    if n_est:  # cut the deferred head: each receiver's share to bring it nearest its level
        _level(work, est_q, est_v, n_est, pool)
        lo, hi = h_a, h_end
        # least head workload first (stable over the insertion order)
        by = np.argsort(est_v[:n_est], kind="mergesort")
        for i in range(n_est):
            q = est_q[by[i]]
            e = est_v[by[i]]
            s, base = shares[q], work[q] - e
            if i == n_est - 1:
                y = s  # the last takes what is left, contiguous
            else:
                y = _largest_back(s, lo, hi, e)
            if s - y:
                rows.append((q, h_doc, lo, s - y))
            if y:
                rows.append((q, h_doc, hi - y, y))
            work[q] = base + _workload(lo, s - y) + _workload(hi - y, y)
            lo, hi = lo + s - y, hi - y
    out = np.empty((len(rows), 4), np.int64)
    for i in range(len(rows)):
        out[i, 0], out[i, 1], out[i, 2], out[i, 3] = rows[i]
    return True, out, work.max(), send.max()


@njit(cache=True)
def _fits_in(
    q,
    w,
    c,
    length,
    tokens,
    work,
    tpr,
    budget,
    in_est,
    est_q,
    est_v,
    n_est,
    h_a,
    shares,
    cum_t,
    cum_w,
    asc,
    left,
    alpha,
):
    """Reference ``fits_in``: rank q can take the document whole and still end within B."""
    f = _fill(tpr - tokens[q] - length, c, cum_t, cum_w, asc, left, alpha)
    if not in_est[q]:
        return work[q] + w + f <= budget
    e = 0
    for i in range(n_est):
        if est_q[i] == q:
            e = est_v[i]
    return (
        work[q] + w // n_est + f <= budget
        and work[q] - e + w + _workload(h_a, shares[q]) + f <= budget
    )
