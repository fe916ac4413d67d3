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
      most tokens to ranks with too few: first whole documents that fit the deficit (shortest
      first; a moved whole document still costs no communication), then the *head* of one more
      document for the rest. The receiver holds the head; the donor keeps the tail and needs only
      the head's KV, so the communication is the head's length (paper Fig. 4);
   c. stop when ``imbalance_ratio <= target_imbalance``; otherwise k += 1.

The loop ends at the latest with every document Per-Doc (the ``per_doc`` layout); if even that
misses the target (remainder tokens of short documents), the plan's status is ``target_not_met``.

The inner loops are plain Python over a few dozen documents (numbers of ranks and documents are
small), which is faster than numpy for these sizes: about a millisecond per 128K sequence.
"""

from __future__ import annotations

import numpy as np

from flashcp.layout import per_doc_chunk_sizes
from flashcp.plan import Plan, check_cp_args, check_doc_lens, make_plan, planner_entry

__all__ = ["plan_flashcp"]


def _workload(p: int, s: int) -> int:
    """Eq. 3: query-key pairs per head of a shard with prefix p and length s."""
    return (2 * p + s + 1) * s // 2


def _whole_doc_pass(
    whole: list[int],
    lens: list[int],
    base_tokens: list[int],
    base_work: list[int],
    cp_size: int,
    tokens_per_rank: int,
) -> tuple[list[list[list[int]]], list[int]]:
    """Steps 2a and 2b for one Per-Doc set.

    Args:
        whole: documents kept whole, longest first.
        lens: all document lengths.
        base_tokens, base_work: (N,) tokens and workload each rank already holds from Per-Doc docs.
        cp_size: N.
        tokens_per_rank: C / N.
    Returns:
        ``(pieces, work)``: pieces[r] is a list of ``[doc, start, length]`` of rank r; work[r] its
        total workload (Per-Doc part included).
    """
    n = cp_size
    work = list(base_work)
    tokens = list(base_tokens)
    pieces: list[list[list[int]]] = [[] for _ in range(n)]
    # 2a. greedy placement, longest first, on the least-loaded rank
    for doc in whole:
        r = min(range(n), key=work.__getitem__)
        d = lens[doc]
        pieces[r].append([doc, 0, d])
        work[r] += d * (d + 1) // 2
        tokens[r] += d
    # 2b. equalise tokens
    while True:
        donor = max(range(n), key=tokens.__getitem__)
        surplus = tokens[donor] - tokens_per_rank
        if surplus <= 0:
            break
        receivers = sorted(
            (r for r in range(n) if tokens[r] < tokens_per_rank), key=work.__getitem__
        )
        for rec in receivers:
            if surplus == 0:
                break
            need = min(surplus, tokens_per_rank - tokens[rec])
            moved = 0
            # whole pieces that fit, shortest first (no new communication), then one head
            own = sorted(pieces[donor], key=lambda pc: pc[2])
            for pc in own:
                if moved == need:
                    break
                doc, p, s = pc
                take = min(s, need - moved)
                w_head = _workload(p, take)
                pieces[rec].append([doc, p, take])
                if take == s:
                    pieces[donor].remove(pc)
                else:  # donor keeps the tail
                    pc[1], pc[2] = p + take, s - take
                work[donor] -= w_head
                work[rec] += w_head
                moved += take
            tokens[donor] -= moved
            tokens[rec] += moved
            surplus -= moved
    return pieces, work


@planner_entry("flashcp")
def plan_flashcp(
    doc_lens,
    cp_size: int,
    *,
    target_imbalance: float = 1.05,
    num_pad: int = 0,
    validate: bool = True,
) -> Plan:
    """Plan FlashCP's hybrid Whole-Doc / Per-Doc layout with the paper's heuristic.

    Args:
        doc_lens: (n_docs,) int, document lengths in packed order (zero-length ones skipped,
            :func:`~flashcp.plan.planner_entry`).
        cp_size: N >= 1.
        target_imbalance: R >= 1, the imbalance ratio to reach (paper default 1.05).
        num_pad: pad tokens after the last document; C = sum(doc_lens) + num_pad must divide by
            N. Step 2b fills every rank up to C/N document tokens at most, and the ranks left
            short hold the pad (no workload, no communication).
        validate: check the plan's invariants.
    Returns:
        A :class:`~flashcp.plan.Plan` with ``method="flashcp"``; ``info`` holds ``per_doc_docs``
        (indices of Per-Doc documents), ``iterations`` and ``target_imbalance``. ``status`` is
        ``"ok"`` when the target was met, else ``"target_not_met"`` (then the plan is the best
        balanced of those tried, normally the all-Per-Doc one).
    Raises:
        ValueError: bad lengths, ``cp_size`` < 1, C not divisible by N, or ``target_imbalance`` < 1.
    """
    d = check_doc_lens(doc_lens)
    n = cp_size
    check_cp_args(int(d.sum()) + num_pad, n)
    try:
        ok = np.isfinite(float(target_imbalance)) and float(target_imbalance) >= 1.0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"target_imbalance must be a number >= 1, got {target_imbalance!r}")
    context_len = int(d.sum()) + num_pad
    tpr = context_len // n
    lens = d.tolist()
    order = np.argsort(-d, kind="stable").tolist()
    mean_work = float((d * (d + 1) // 2).sum()) / n

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
                base_work[r] += _workload(p, s)
                p += s
        pieces, work = _whole_doc_pass(order[k:], lens, base_tokens, base_work, n, tpr)
        ratio = max(work) / mean_work
        if best is None or ratio < best[0]:
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
    status = "ok" if ratio <= target_imbalance else "target_not_met"
    info = {
        "per_doc_docs": sorted(per_doc_ids),
        "iterations": k + 1,
        "target_imbalance": float(target_imbalance),
    }
    return make_plan("flashcp", n, d, *cols, status=status, info=info, pad=pad, validate=validate)
