"""A refined FlashCP planner: two-dimensional packing with projected workload (``flashcp_refined``).

Where the paper's heuristic loses (:mod:`flashcp.planners.flashcp`, arXiv 2606.08476 §3.3, Algorithm 1,
kept faithful). Step 2a balances workload (Eq. 3) alone; step 2b then equalises tokens with
heads, which moves workload onto the ranks that hold the long documents (they have the fewest
tokens), and the loop turns the longest documents Per-Doc one by one until the target R holds.
Every rank must hold exactly C/N tokens *and* at most ``R * W_mean`` workload: a two-dimensional
packing. On WLB-LLM at 64K and CP 8, where every document of a sequence can be shorter than C/N,
the loop ends with most documents Per-Doc (saving 0.05 on the sequence of
``tests/unit/test_refined.py``) while a plan that cuts a few documents saves 0.76.

The planner packs the documents longest first so that every rank ends with exactly C/N tokens and
at most ``R * W_mean`` workload (Eq. 3): a document goes whole to the rank of least projected
workload that can still end within the budget, else its tail (its last shard: its most expensive
tokens, no communication, Eq. 5) stays whole on one rank and its head is cut over k others. The
pass runs for the variants of :data:`_VARIANTS` and the paper's own plan
(:func:`~flashcp.planners.flashcp.plan_flashcp` at the same R) is one more candidate; the result is
the candidate that meets R with the fewest ``comm_tokens`` (Eq. 5), ties broken by lower
imbalance, so it never communicates more than ``flashcp`` at the same target when that plan meets
it. The pass step by step (projected workload, feasibility, split, deferred head), the fallback
when no candidate meets R and the running time: docs/methods.md, section "flashcp_refined: the
packing pass".
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable

from flashcp.plan import (
    doc_workload,
    shard_workload,
)

__all__ = []

#: variants of the packing pass, in the order ``num_candidates`` takes them (chosen by forward
#: selection on sampled sequences of the three datasets, CP 4/8, 32K-128K, seed 7: each adds the
#: most mean saving to those before it): (budget f as a fraction of R * W_mean, head spread (None:
#: N ranks), alpha of the fill estimate F, zigzag head, joint tail and first-chunk share, deferred
#: head)
_VARIANTS: tuple[tuple[float, int | None, float, bool, bool, bool], ...] = (
    (1.0, None, 0.5, False, True, False),
    (1.0, None, 0.5, False, True, True),
    (1.0, 2, 1.0, True, False, False),
    (1.0, None, 0.5, True, True, False),
    (1.0, None, 0.5, False, False, False),
    (0.99, None, 0.5, False, True, False),
    (0.99, None, 1.0, False, False, False),
    (1.0, None, 1.0, False, True, False),
)


def _largest(ok: Callable[[int], bool], hi: int) -> int:
    """Largest x in [0, hi] with ``ok(x)``, for ``ok`` true up to some x and false above it (0
    when none): ``hi`` and 1 are tried first (the common cases), then bisection."""
    if hi <= 0 or ok(hi):
        return max(hi, 0)
    if not ok(1):
        return 0
    lo, hi = 1, hi - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _pack(
    lens: list[int],
    order: list[int],
    n: int,
    tpr: int,
    budget: float,
    spread: int,
    alpha: float,
    zigzag: bool,
    joint_tail: bool,
    send_bound: int,
    defer: bool = False,
    work_bound: float = float("inf"),
) -> tuple[list[tuple[int, int, int, int]], int, int] | None:
    """One packing pass (module docstring, steps 1-4).

    Args:
        lens: document lengths (all > 0).
        order: document indices, longest first.
        n: cp_size N.
        tpr: C / N tokens per rank.
        budget: B, workload per rank (query-key pairs per head, Eq. 3) not to exceed.
        spread: a split document's head goes to its tail's rank and k = min(spread, open other
            ranks) others.
        alpha: weight of the smallest-documents lower bound in the fill estimate F.
        zigzag: place the rest of a split document's head as 2k zigzag chunks when they fit.
        joint_tail: choose the tail so that its rank can also take an equal share of the head.
        send_bound: give up (return None) once a rank sends more non-last tokens than this:
            sends only grow, so the pass cannot beat a candidate that sends this many.
        defer: defer the head of the first document heavier than B (module docstring, step 4).
        work_bound: give up (return None) once some rank's workload must end above this (a
            rank's workload only grows, and the receivers of a deferred head end at their level
            on average): the caller passes R * W_mean once a candidate meets R.
    Returns:
        ``(rows, max_work, max_send)``: shard rows ``(rank, doc, start, length)``, the largest
        workload of a rank and the largest number of non-last tokens of a rank (exact: pieces of a
        document a rank holds contiguously with its tail are counted as part of the last shard);
        None when given up.
    """
    rng = range(n)
    work = [0] * n
    tokens = [0] * n
    send = [0] * n
    rows: list[tuple[int, int, int, int]] = []
    # the documents not yet placed are always the m shortest: cumulative tokens / workload of the
    # documents shortest first give the lower bound of F in O(log m)
    asc = [lens[i] for i in reversed(order)]
    cum_t = [0, *itertools.accumulate(asc)]
    cum_w = [0, *itertools.accumulate(doc_workload(x) for x in asc)]
    left = len(order)
    rem_w = cum_w[-1]
    rem_t = cum_t[-1]
    # a deferred head (defer): its document, first token, end, receivers, their token shares and
    # current workload estimates; its workload P is pooled, every receiver counted at the level
    # (P + their other workload) / k until the head is cut at the end of the pass
    held: list = []
    est: dict[int, int] = {}
    pool = 0

    def level() -> None:
        """Re-spread the pooled head workload so that every receiver sits at the same level."""
        other = {q: work[q] - e for q, e in est.items()}
        lvl = (pool + sum(other.values())) // len(other)
        for q in other:
            est[q] = lvl - other[q]
            work[q] = lvl

    def beaten() -> bool:
        """The pass can no longer win: it sends more than ``send_bound`` or a rank's workload
        must end above ``work_bound``."""
        if est:
            level()
        return max(send) > send_bound or max(work) > work_bound

    def fill(room: int, c: float) -> float:
        """F(room): estimated workload of the documents that will fill ``room`` tokens."""
        j = bisect.bisect_left(cum_t, room, 0, left + 1)
        if j > left:  # not enough shorter documents: the rest at the mean rate
            low = cum_w[left] + (room - cum_t[left]) * c
        elif j == 0:
            low = 0.0
        else:
            low = cum_w[j - 1] + (room - cum_t[j - 1]) * (asc[j - 1] + 1) / 2
        return alpha * low + (1.0 - alpha) * c * room

    for doc in order:
        length = lens[doc]
        w = doc_workload(length)
        rem_w -= w
        rem_t -= length
        left -= 1
        c = rem_w / rem_t if rem_t else 0.0
        if est:
            level()

        def fits_in(
            q: int, w: int = w, c: float = c, length: int = length, held: list = held
        ) -> bool:
            """Rank q can take the document whole and still end within B (a receiver of the
            deferred head: the receivers together, and q with its head share at its cheapest)."""
            f = fill(tpr - tokens[q] - length, c)
            if q not in est:
                return work[q] + w + f <= budget
            _, a, _, _, shares = held
            return (
                work[q] + w // len(est) + f <= budget
                and work[q] - est[q] + w + shard_workload(a, shares[q]) + f <= budget
            )

        # the rank of least projected workload with token room (P_r up to the constant c * C/N)
        r, low = -1, 0.0
        for q in rng:
            if tokens[q] + length <= tpr and (r < 0 or work[q] - c * tokens[q] < low):
                r, low = q, work[q] - c * tokens[q]
        if r >= 0 and not fits_in(r):
            fits = [q for q in rng if q != r and tokens[q] + length <= tpr]
            fits.sort(key=lambda q: work[q] - c * tokens[q])
            r = next((q for q in fits if fits_in(q)), -1)
        if r >= 0:  # whole
            rows.append((r, doc, 0, length))
            tokens[r] += length
            work[r] += w
            continue
        # split: the tail on the open rank of least projected workload, as long as it fits in B
        r = min((q for q in rng if tokens[q] < tpr), key=lambda q: work[q] + c * (tpr - tokens[q]))
        room = tpr - tokens[r]
        others = [q for q in rng if q != r and tokens[q] < tpr]
        k = min(spread, len(others))

        def tail_cost(
            t: int,
            joint: bool,
            c: float = c,
            room: int = room,
            k: int = k,
            r: int = r,
            n_: int = length,
        ) -> float:
            """Projected workload of rank r holding the tail of t tokens and, when ``joint``,
            the head's first chunk of ceil((length - t) / (k + 1)) tokens (its equal share)."""
            a = -(-(n_ - t) // (k + 1)) if joint else 0
            if t + a > room:
                return float("inf")
            return (
                work[r] + shard_workload(n_ - t, t) + shard_workload(0, a) + fill(room - t - a, c)
            )

        t = 0
        for joint in (True, False) if k and joint_tail else (False,):
            # the longest tail within B (the cost grows with t)
            t = _largest(lambda x, j=joint: tail_cost(x, j) <= budget, min(length, room))
            if t:
                break
        t = t or min(length, room)  # no room within B: tokens alone decide
        rows.append((r, doc, length - t, t))
        tokens[r] += t
        work[r] += shard_workload(length - t, t)
        end = length - t
        if not end:
            continue

        def longest(q: int, stop: int, limit: int, c: float = c) -> int:
            """Longest piece ``[stop - s, stop)``, s <= limit, rank q can take within B."""
            room, base = tpr - tokens[q], work[q]
            return _largest(
                lambda x: base + shard_workload(stop - x, x) + fill(room - x, c) <= budget, limit
            )

        # the tail's rank takes the head's first chunk, its cheapest tokens (Eq. 3), as its share
        share = -(-end // (k + 1))
        a = longest(r, share, min(share, tpr - tokens[r])) if k else 0
        if a and 4 * a >= share:  # a sliver would cost a shard for nothing
            rows.append((r, doc, 0, a))
            tokens[r] += a
            work[r] += shard_workload(0, a)
            send[r] += a
        else:
            a = 0
        tail_start = length - t
        if defer and not est and k and w > budget and k <= end - a:
            recv = sorted(others, key=send.__getitem__)[:k]
            base, extra = divmod(end - a, k)
            shares = {q: base + (j < extra) for j, q in enumerate(recv)}
            if all(tokens[q] + shares[q] <= tpr for q in recv):
                for q in recv:
                    tokens[q] += shares[q]
                    send[q] += shares[q]
                    est[q] = 0
                pool = shard_workload(a, end - a)
                held = [doc, a, end, recv, shares]
                level()
                if beaten():
                    return None
                continue
        if zigzag and k and 2 * k <= end - a:
            # the rest of the head as 2k zigzag chunks, receiver i holding chunks i and 2k-1-i
            # (equal tokens and nearly equal workload per receiver, Eq. 3)
            recv = sorted(others, key=send.__getitem__)[:k]
            base, extra = divmod(end - a, 2 * k)
            sizes = [base + (j < extra) for j in range(2 * k)]
            if all(tokens[q] + sizes[i] + sizes[2 * k - 1 - i] <= tpr for i, q in enumerate(recv)):
                p = a
                for j, sz in enumerate(sizes):
                    q = recv[j] if j < k else recv[2 * k - 1 - j]
                    rows.append((q, doc, p, sz))
                    tokens[q] += sz
                    work[q] += shard_workload(p, sz)
                    send[q] += sz
                    p += sz
                if beaten():
                    return None
                continue
        piece = -(-(end - a) // max(1, k))
        while end > a:  # the rest of the head, from its end, in pieces of at most `piece` tokens
            q, s = -1, 0
            for cand in sorted(others, key=send.__getitem__):
                full = min(end - a, tpr - tokens[cand], piece)
                got = longest(cand, end, full) if full > 0 else 0
                if got > s:
                    q, s = cand, got
                if got == full > 0:
                    break
            if q < 0:  # no room within B: the open rank that sends least
                q = min((q for q in rng if tokens[q] < tpr), key=send.__getitem__)
                s = min(end - a, tpr - tokens[q], piece)
            start = end - s
            rows.append((q, doc, start, s))
            tokens[q] += s
            work[q] += shard_workload(start, s)
            if q == r and end == tail_start:  # extends the last shard: not sent
                tail_start = start
            else:
                send[q] += s
            end = start
        if a and tail_start == a:  # the tail's rank ended up holding the whole document
            send[r] -= a
        if beaten():
            return None
    if est:  # cut the deferred head: each receiver's share to bring it nearest its level
        level()
        doc, lo, hi, _, shares = held
        # least head workload first: a front piece (cheap, Eq. 3) and a back piece per receiver
        recv = sorted(est, key=est.__getitem__)
        for i, q in enumerate(recv):
            s, base = shares[q], work[q] - est[q]
            if i == len(recv) - 1:
                y = s  # the last takes what is left, contiguous
            else:
                y = _largest(
                    lambda y, lo=lo, hi=hi, s=s, e=est[q]: (
                        shard_workload(lo, s - y) + shard_workload(hi - y, y) <= e
                    ),
                    s,
                )
            if s - y:
                rows.append((q, doc, lo, s - y))
            if y:
                rows.append((q, doc, hi - y, y))
            work[q] = base + shard_workload(lo, s - y) + shard_workload(hi - y, y)
            lo, hi = lo + s - y, hi - y
    return rows, max(work), max(send)


def _rank_key(ratio: float, comm_tokens: int, target: float) -> tuple[bool, float, float]:
    """Candidates' order: those meeting ``target`` first, by fewest ``comm_tokens`` (Eq. 5) then
    lower imbalance; then the others, best balanced first."""
    if ratio <= target:
        return (False, comm_tokens, ratio)
    return (True, ratio, comm_tokens)
