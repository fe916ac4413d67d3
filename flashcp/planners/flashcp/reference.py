"""FlashCP's planning heuristic (arXiv 2606.08476, §3.3, Algorithm 1; docs/design.md §3).

Each document is either kept *whole* on one rank (Whole-Doc; its KV is needed by nobody else) or
cut into 2N chunks (Per-Doc; perfectly balanced but its non-last chunks must be communicated).
The heuristic starts with every document whole and moves the longest remaining one to the Per-Doc
set until the imbalance ratio meets the target:

1. sort documents longest first;
2. repeat, with the k longest documents Per-Doc (k = 0, 1, ...):
   a. greedy: give every other document, whole, to the rank with the least workload so far
      (Per-Doc documents add the same workload to every rank);
   b. equalise tokens: while a rank holds more than C/N tokens, move pieces from the rank with the
      most tokens (the donor) to ranks with too few, least workload first: whole pieces, and the
      *head* of a document for the rest. The receiver holds the head; the donor keeps the tail and
      needs only the head's KV, so the communication is the head's length (paper Fig. 4);
   c. stop when ``imbalance_ratio <= target_imbalance``; otherwise k += 1.

The loop ends at the latest with every document Per-Doc (the ``per_doc`` layout); if even that
misses the target (remainder tokens of short documents), the plan's status is ``target_not_met``.

Our reading of step 2b. The paper says which documents move (the donor's) and how (heads); it does
not say *which* of the donor's pieces. Every cut adds a piece
(:attr:`~flashcp.plan.Plan.num_pieces`): one more attention segment, and a head whose KV is sent. So the pieces for each receiver are
chosen to cut as few documents as possible (:func:`_choose_moves`): whole pieces that fill the
receiver's deficit exactly (no cut); else the head of a piece whose tail then fills a later
receiver's deficit exactly (one cut instead of two); else whole pieces that fit, shortest first,
and the head of the next one (one cut). This is a greedy choice per receiver, not a minimum over
all arrangements. Fewer cuts can move a little more workload, so step 2b also runs in the plain
order (shortest whole pieces first, then one head), and of the two the one with fewer pieces
among those meeting the target is kept (else the better balanced): preferring fewer cuts never
adds a Per-Doc document. Some cuts are forced by the Per-Doc set: for ``[2, 6, 56]`` at N = 4 the
Per-Doc 56 leaves 2 free tokens on each rank, so the 6-token document must span three ranks.

The inner loops are plain Python over a few dozen documents (numbers of ranks and documents are
small), which is faster than numpy for these sizes: about a millisecond per 128K sequence (1.2 to
1.7x that with the two step-2b orders).
"""

from __future__ import annotations

import numpy as np

from flashcp.plan import (
    doc_workload,
    shard_workload,
)
from flashcp.planners.layout import per_doc_chunk_sizes

__all__ = ["TARGET_IMBALANCE"]

#: the paper's target imbalance ratio R (§3.3), the planners' default
TARGET_IMBALANCE = 1.05


def _later_needs(deficits: list[int], surplus: int) -> set[int]:
    """Token counts the next receivers of this donor will ask for (deficits capped by what is
    left of the surplus), for the cut look-ahead of :func:`_choose_moves`."""
    out = set()
    for deficit in deficits:
        if surplus <= 0:
            break
        out.add(min(deficit, surplus))
        surplus -= deficit
    return out


def _exact_subset(own: list[list[int]], need: int) -> list[list[int]] | None:
    """Donor pieces whose lengths sum to exactly ``need`` (one piece if one fits exactly), or None.

    Subset sum over the piece lengths on a bitset (bit t of ``reach[i]``: t tokens are reachable
    with the first i pieces), then a walk back choosing the pieces.
    """
    for pc in own:
        if pc[2] == need:
            return [pc]
    own = [pc for pc in own if pc[2] < need]
    total = sum(pc[2] for pc in own)
    if total <= need:
        return own if total == need else None
    mask = (1 << (need + 1)) - 1
    reach = [1]
    for pc in own:
        reach.append((reach[-1] | (reach[-1] << pc[2])) & mask)
        if reach[-1] >> need & 1:
            break
    if not reach[-1] >> need & 1:
        return None
    chosen, rem = [], need
    for i in range(len(reach) - 1, 0, -1):
        if rem and not reach[i - 1] >> rem & 1:  # rem needs piece i-1
            chosen.append(own[i - 1])
            rem -= own[i - 1][2]
    return chosen


def _choose_moves(
    donor_pieces: list[list[int]], need: int, later: set[int] | None
) -> list[tuple[list[int], int]]:
    """Which donor pieces move to one receiver in step 2b, cutting as few documents as possible.

    ``need`` tokens move, at most one piece is cut (its head moves, the donor keeps the tail):

    1. whole pieces that sum to exactly ``need`` (no cut), if some do;
    2. otherwise the head of a piece whose tail will then exactly fill a later receiver's need
       (``later``): one cut now, none for that receiver;
    3. otherwise whole pieces that fit, shortest first, then the head of the next one (one cut).

    ``later=None`` skips steps 1 and 2.

    Returns:
        ``(piece, tokens)`` pairs in moving order; ``tokens < piece length`` only for the last.
    """
    own = sorted(donor_pieces, key=lambda pc: pc[2])
    if later is not None:
        exact = _exact_subset(own, need)
        if exact is not None:
            return [(pc, pc[2]) for pc in exact]
        for pc in own:
            if pc[2] > need and pc[2] - need in later:
                return [(pc, need)]
    moves, moved = [], 0
    for pc in own:
        if moved == need:
            break
        take = min(pc[2], need - moved)
        moves.append((pc, take))
        moved += take
    return moves


def _greedy(
    whole: list[int], lens: list[int], base_tokens: list[int], base_work: list[int], cp_size: int
) -> tuple[list[list[list[int]]], list[int], list[int]]:
    """Step 2a for one Per-Doc set: every document of ``whole`` (longest first), whole, on the rank
    with the least workload so far.

    Args:
        whole: documents kept whole, longest first.
        lens: all document lengths.
        base_tokens, base_work: (N,) tokens and workload each rank already holds from Per-Doc docs.
        cp_size: N.
    Returns:
        ``(pieces, work, tokens)``: pieces[r] is a list of ``[doc, start, length]`` of rank r;
        work[r] and tokens[r] its totals (Per-Doc part included).
    """
    n = cp_size
    work = list(base_work)
    tokens = list(base_tokens)
    pieces: list[list[list[int]]] = [[] for _ in range(n)]
    for doc in whole:
        r = min(range(n), key=work.__getitem__)
        d = lens[doc]
        pieces[r].append([doc, 0, d])
        work[r] += doc_workload(d)
        tokens[r] += d
    return pieces, work, tokens


def _equalise(
    pieces: list[list[list[int]]],
    work: list[int],
    tokens: list[int],
    tokens_per_rank: int,
    fewest_cuts: bool,
) -> int:
    """Step 2b, in place: while a rank holds more than C/N tokens, move its surplus to the ranks
    with too few (least workload first), as whole pieces and document heads (paper Fig. 4).

    Args:
        pieces, work, tokens: from :func:`_greedy` (modified).
        tokens_per_rank: C / N.
        fewest_cuts: choose each receiver's pieces with :func:`_choose_moves` (exact fits
            first); False: shortest whole pieces first, then one head (its step 3 only).
    Returns:
        the number of documents cut (heads moved off a piece the donor keeps the rest of).
    """
    n = len(tokens)
    cuts = 0
    while True:
        donor = max(range(n), key=tokens.__getitem__)
        surplus = tokens[donor] - tokens_per_rank
        if surplus <= 0:
            return cuts
        receivers = sorted(
            (r for r in range(n) if tokens[r] < tokens_per_rank), key=work.__getitem__
        )
        deficits = [tokens_per_rank - tokens[r] for r in receivers]
        for i, rec in enumerate(receivers):
            if surplus == 0:
                break
            need = min(surplus, deficits[i])
            later = _later_needs(deficits[i + 1 :], surplus - need) if fewest_cuts else None
            moved = 0
            for pc, take in _choose_moves(pieces[donor], need, later):
                doc, p, s = pc
                w_head = shard_workload(p, take)
                pieces[rec].append([doc, p, take])
                if take == s:
                    pieces[donor].remove(pc)
                else:  # donor keeps the tail
                    pc[1], pc[2] = p + take, s - take
                    cuts += 1
                work[donor] -= w_head
                work[rec] += w_head
                moved += take
            tokens[donor] -= moved
            tokens[rec] += moved
            surplus -= moved


def _whole_doc_pass(
    whole: list[int],
    lens: list[int],
    base_tokens: list[int],
    base_work: list[int],
    cp_size: int,
    tokens_per_rank: int,
) -> tuple[list[list[list[int]]], list[int]]:
    """Steps 2a and 2b with the plain step-2b order (shortest whole pieces first, then one head).

    Returns:
        ``(pieces, work)``: pieces[r] is a list of ``[doc, start, length]`` of rank r; work[r] its
        total workload (Per-Doc part included).
    """
    pieces, work, tokens = _greedy(whole, lens, base_tokens, base_work, cp_size)
    _equalise(pieces, work, tokens, tokens_per_rank, fewest_cuts=False)
    return pieces, work


def _fewest_cuts_pass(
    whole: list[int],
    lens: list[int],
    base_tokens: list[int],
    base_work: list[int],
    cp_size: int,
    tokens_per_rank: int,
    target: float,
    mean_work: float,
) -> tuple[float, list[list[list[int]]]]:
    """Steps 2a and 2b for one Per-Doc set; returns ``(imbalance ratio, pieces)``.

    Step 2b runs the fewest-cut choice (:func:`_choose_moves`) and, unless that already cut
    nothing or there was nothing to move, the plain one (shortest whole pieces first, then one
    head); of the two it keeps the one with fewer pieces among those meeting ``target``, else the
    better balanced. So preferring fewer cuts never costs balance beyond the target, nor an extra
    Per-Doc document in step 2c.
    """
    pieces, work, tokens = _greedy(whole, lens, base_tokens, base_work, cp_size)
    if max(tokens) <= tokens_per_rank:  # nothing to equalise
        return max(work) / mean_work, pieces
    plain = [[pc.copy() for pc in rank] for rank in pieces], list(work), list(tokens)
    results = []
    for fewest_cuts, (pc, wk, tk) in ((True, (pieces, work, tokens)), (False, plain)):
        cuts = _equalise(pc, wk, tk, tokens_per_rank, fewest_cuts)
        ratio = max(wk) / mean_work
        results.append((ratio > target, cuts if ratio <= target else ratio, ratio, pc))
        if cuts == 0 and ratio <= target:
            break
    _, _, ratio, pieces = min(results, key=lambda x: x[:2])
    return ratio, pieces


def _search(
    d: np.ndarray, n: int, tpr: int, target_imbalance: float
) -> tuple[float, list[int], np.ndarray, np.ndarray]:
    """Steps 1-2c of Algorithm 1 (module docstring), the reference implementation.

    Returns:
        ``(ratio, per_doc, cols, pad)``: the kept plan's imbalance ratio, its Per-Doc documents
        (sorted), its shard columns ``(4, n_shards)`` int64 (rank, doc, start, length) sorted by
        rank, document and start, and (N,) int64 pad tokens per rank.
    """
    lens = d.tolist()
    order = np.argsort(-d, kind="stable").tolist()
    mean_work = float(doc_workload(d).sum()) / n
    # Per-Doc chunk sizes of every document, in the order documents join the Per-Doc set
    sizes_sorted, _ = per_doc_chunk_sizes(d[order], n)
    size_rows = sizes_sorted.tolist()
    base_tokens = [0] * n
    base_work = [0] * n
    best = None
    for k in range(len(order) + 1):
        if k > 0:  # move the k-th longest document to the Per-Doc set
            row = size_rows[k - 1]
            p = 0
            for j in range(2 * n):
                s = row[j]
                r = j if j < n else 2 * n - 1 - j
                base_tokens[r] += s
                base_work[r] += shard_workload(p, s)
                p += s
        ratio, pieces = _fewest_cuts_pass(
            order[k:], lens, base_tokens, base_work, n, tpr, target_imbalance, mean_work
        )
        if best is None or ratio < best[0] or ratio <= target_imbalance:
            best = (ratio, k, pieces)
        if ratio <= target_imbalance:
            break
    ratio, k, pieces = best

    # emit shards: per rank, sorted by (doc, start)
    per_doc_ids = order[:k]
    rows: list[tuple[int, int, int, int]] = []
    starts = np.cumsum(sizes_sorted[:k], axis=1) - sizes_sorted[:k]
    for i, doc in enumerate(per_doc_ids):
        for j in range(2 * n):
            s = size_rows[i][j]
            if s:
                rows.append((j if j < n else 2 * n - 1 - j, doc, int(starts[i, j]), s))
    for r in range(n):
        rows.extend((r, doc, p, s) for doc, p, s in pieces[r])
    rows.sort()
    cols = np.array(rows, dtype=np.int64).T
    pad = tpr - np.bincount(cols[0], weights=cols[3], minlength=n).astype(np.int64)
    return ratio, sorted(per_doc_ids), cols, pad
