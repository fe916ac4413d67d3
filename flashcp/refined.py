"""A refined FlashCP planner: cheaper splits, chosen by search (method ``flashcp_refined``).

The paper's heuristic (:mod:`flashcp.heuristic`, kept faithful) reaches its imbalance target by
moving documents to the Per-Doc set *longest first*, cutting each into 2N chunks. A Per-Doc
document costs almost all of its tokens in communication (every non-last chunk counts, Eq. 5),
about d/N tokens on every rank, and once one long document is spread over every rank the ranks
that already hold other long documents overflow, so more documents follow it into the Per-Doc
set. The ILP (:mod:`flashcp.ilp`) and Eq. 5 point to a cheaper split, *tail + heads*: a document
keeps its tail (its expensive last tokens, Eq. 3) on one rank, where it is the last shard and costs
nothing, and only its head - cheap in workload - is cut into chunks for the other ranks, each
chunk costing its length on its receiver. The tail is as long as the least-loaded rank can take
within a workload budget ``f * W_mean``; head chunk sizes are water-filled so that the receivers'
sends (Eq. 5 is a max over ranks) stay even, the heaviest chunk going to the least-loaded rank.

The planner keeps the paper's other building blocks (greedy whole-document placement and token
equalisation by heads: :func:`flashcp.heuristic._whole_doc_pass`) and searches:

1. for each split layout in :data:`_LAYOUTS` (Per-Doc; tail + heads with budgets f = 0.5 ..
   0.85, heads over the other N - 1 ranks or all N; a hybrid that keeps documents heavier
   than 2 W_mean Per-Doc, where a tail would hold too little of them; or *tail + Per-Doc head*,
   the head cut into 2N zigzag chunks over all ranks or 2(N-1) over the others, for documents
   much heavier than a rank's share or longer than 2 C/N), the paper's loop: split
   the k longest documents, smallest k meeting the target R (others: k up to the Per-Doc k + 1);
2. *substitution*, in the best layout: the k - 1 longest plus one other document x, for x among the
   next ``num_candidates`` longest;
3. *elimination*: drop a member of the best split set while that lowers ``comm_tokens``;
4. return the candidate that meets R with the fewest ``comm_tokens`` (Eq. 5), ties broken by lower
   imbalance; when none meets R, the best-balanced one (status ``target_not_met``).

Every candidate is evaluated exactly (its plan is built and measured), and the paper's own plan
(:func:`~flashcp.heuristic.plan_flashcp` at the same target) is one of them, so on the same input
the result never communicates more than ``flashcp`` at the same target when that plan meets it.
Time: a few dozen whole-document passes, 5-50 ms per 128K sequence in CPython
(``experiments/bench_planners.py``).
"""

from __future__ import annotations

import numpy as np

from flashcp.heuristic import _whole_doc_pass, plan_flashcp
from flashcp.layout import per_doc_chunk_sizes, per_doc_columns
from flashcp.plan import (
    Plan,
    check_cp_args,
    check_doc_lens,
    doc_workload,
    make_plan,
    planner_entry,
    shard_workload,
)

__all__ = ["plan_flashcp_refined"]

#: split layouts tried: None = Per-Doc (2N chunks); ``(f, spread_all, g)`` = tail + heads with
#: tails of at most f * W_mean workload (Eq. 3), heads over the other N - 1 ranks or over all N;
#: split documents heavier than g * W_mean (None: none) stay Per-Doc; ``(f, "zigzag", o)`` =
#: tail + Per-Doc head (:func:`_zigzag_head`) within f * W_mean, the head over all N ranks
#: (o = None), over the N - 1 others (o = 1.0), or over the others but for the head's first
#: chunk, which stays with the tail (o = "first")
_LAYOUTS: tuple[tuple[float, bool | str, float | str | None] | None, ...] = (
    None,
    (0.7, False, None),
    (0.85, False, None),
    (0.5, True, None),
    (0.7, True, None),
    (0.85, True, None),
    (0.7, False, 2.0),
    (0.85, False, 2.0),
    (0.7, True, 2.0),
    (0.85, True, 2.0),
    (0.9, "zigzag", None),
    (0.97, "zigzag", None),
    (0.9, "zigzag", 1.0),
    (0.95, "zigzag", "first"),
    (1.0, "zigzag", "first"),
)


def _water_fill(levels: list[int], total: int) -> list[int]:
    """Integer amounts a_q >= 0 summing to ``total`` that raise the lowest ``levels`` first, so
    that ``max_q(levels[q] + a_q)`` is as small as possible."""
    lv = np.asarray(levels, dtype=np.float64)
    srt = np.sort(lv)
    k = len(lv)
    # smallest water level L with sum(max(0, L - lv)) >= total
    level = srt[-1] + (total - (srt[-1] * k - srt.sum())) / k
    for j in range(1, k + 1):
        cand = (total + srt[:j].sum()) / j
        if j == k or cand <= srt[j]:
            level = cand
            break
    amounts = np.floor(np.maximum(0.0, level - lv)).astype(np.int64)
    rest = total - int(amounts.sum())
    for q in np.argsort(lv + amounts, kind="stable")[:rest]:  # distribute the rounding remainder
        amounts[q] += 1
    return amounts.tolist()


def _tail_heads(
    lens: list[int],
    split: tuple[int, ...],
    n: int,
    tpr: int,
    budget: float,
    spread_all: bool,
    start: tuple[list[int], list[int], list[int]],
) -> list[tuple[int, int, int, int]] | None:
    """Shard rows ``(rank, doc, start, length)`` of the *tail + heads* split of ``split``.

    Each document (longest first) keeps its tail, as long as the least-loaded rank can hold with
    at most ``budget`` workload in total (Eq. 3), on that rank, where it is its document's last
    shard and costs nothing; the rest is cut into N - 1 contiguous chunks of near-equal length on
    the other ranks, the heaviest chunk (largest prefix) on the least-loaded of them. Each chunk is
    a non-last shard and costs its length on its rank (Eq. 5). ``start`` = (work, tokens, send)
    per rank already placed (e.g. by Per-Doc documents). Returns None when a rank would exceed C/N
    tokens or no tail fits.
    """
    work, tokens, send = (list(a) for a in start)
    rows = []
    for doc in sorted(split, key=lambda i: -lens[i]):
        length = lens[doc]
        r = min(range(n), key=work.__getitem__)
        room_w = budget - work[r]
        lo, hi = 0, min(length - 1, tpr - tokens[r])
        while lo < hi:  # longest tail u with Eq. 3 workload <= room_w
            mid = (lo + hi + 1) // 2
            if _work(length - mid, mid) <= room_w:
                lo = mid
            else:
                hi = mid - 1
        if lo == 0:
            return None
        rows.append((r, doc, length - lo, lo))
        work[r] += _work(length - lo, lo)
        tokens[r] += lo
        others = sorted((q for q in range(n) if spread_all or q != r), key=work.__getitem__)
        head = length - lo
        if not others:  # N = 1: nothing to split over
            return None
        # water-fill: chunk sizes that even out the ranks' sends (Eq. 5 is a max over ranks)
        sizes = _water_fill([send[q] for q in others], head)
        p = 0
        for q, s in zip(reversed(others), reversed(sizes), strict=True):  # lightest chunk first,
            if s:  # to the busiest rank
                rows.append((q, doc, p, s))
                work[q] += _work(p, s)
                tokens[q] += s
                send[q] += s
                p += s
    if max(tokens) > tpr:
        return None
    return rows


def _zigzag_head(
    d: np.ndarray, n: int, split: tuple[int, ...], budget: float, others: bool | str
) -> tuple[np.ndarray, ...] | None:
    """Shard columns ``(rank, doc, start, length)`` of the *tail + Per-Doc head* split.

    Each document of ``split`` (longest first) keeps its tail on the least-loaded rank, as long
    as that rank can hold within ``budget`` workload counting its share of the head (Eq. 3); the
    head (the first ``d - t`` tokens) is cut into 2N Per-Doc chunks, rank r holding chunks r and
    2N-1-r, so that every rank gets an equal share of the head's tokens, workload and
    communication (``others``: 2(N-1) chunks over the N - 1 other ranks, so the tail's rank keeps
    its whole budget for the tail). For a document much heavier than a rank's share (several times W_mean, or
    longer than 2 C/N tokens) this keeps the expensive tail whole where Per-Doc would send
    almost all of it. ``others="first"``: the tail's rank also holds the head's first chunk
    ``[0, a)`` with ``a = h / N`` (the cheapest tokens of the head, Eq. 3), and the rest of the head
    goes to the N - 1 others in 2(N-1) chunks, so every rank sends about h / N tokens (Eq. 5 is
    a max over ranks) while the tail's rank adds only ``a (a+1) / 2`` workload: what the ILP's
    optimal plans do with a document longer than a rank's workload share. None when a rank
    would exceed C/N tokens.
    """
    tpr = int(d.sum()) // n
    work, tokens = [0.0] * n, [0.0] * n
    first = others == "first"
    m = n - 1 if others else n  # ranks sharing the (rest of the) head
    if n == 1:  # nothing to split over
        return None
    cols: list[tuple[np.ndarray, ...]] = []
    for doc in sorted(split, key=lambda i: -int(d[i])):
        length = int(d[doc])
        r = min(range(n), key=work.__getitem__)
        share = 0.0 if others else 1.0 / n  # the tail rank's share of the head

        def cost(t: int, length=length, share=share) -> float:  # tail plus r's share of head
            h = length - t
            if first:  # the head's first chunk [0, h // N)
                return (length * (length + 1) - h * (h + 1)) / 2 + (h // n) * (h // n + 1) / 2
            return (length * (length + 1) - h * (h + 1)) / 2 + share * h * (h + 1) / 2

        if first:  # tokens t + (length - t) / N within the rank's room
            hi = int((tpr - tokens[r] - length / n) / (1 - 1 / n))
        else:
            hi = int((tpr - tokens[r] - share * length) / (1 - share))
        hi = max(0, min(length - 1, hi))
        lo = 0
        while lo < hi:  # longest tail within the budget (cost grows with t)
            mid = (lo + hi + 1) // 2
            if work[r] + cost(mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        t = lo
        h = length - t
        if t:
            cols.append(tuple(np.array([x], dtype=np.int64) for x in (r, doc, h, t)))
            work[r] += (length * (length + 1) - h * (h + 1)) / 2
            tokens[r] += t
        a = h // n if first else 0  # the tail rank's first head chunk
        if a:
            cols.append(tuple(np.array([x], dtype=np.int64) for x in (r, doc, 0, a)))
            work[r] += a * (a + 1) / 2
            tokens[r] += a
        sizes, _ = per_doc_chunk_sizes(np.array([h - a], dtype=np.int64), m)
        hr, hd, hs, hl = per_doc_columns(np.array([doc], dtype=np.int64), sizes, m)
        hs = hs + a
        ranks = np.array([q for q in range(n) if not others or q != r], dtype=np.int64)
        hr = ranks[hr]
        cols.append((hr, hd, hs, hl))
        for q, w, k in zip(hr.tolist(), shard_workload(hs, hl).tolist(), hl.tolist(), strict=True):
            work[q] += w
            tokens[q] += k
    if not cols:
        return None
    rank, doc, start, length = (np.concatenate(c) for c in zip(*cols, strict=True))
    if np.bincount(rank, weights=length, minlength=n).max() > tpr:
        return None
    return rank, doc, start, length


def _candidate(
    d: np.ndarray,
    n: int,
    split: tuple[int, ...],
    order: list[int],
    layout: tuple[float, bool | str, float | None] | None,
) -> Plan | None:
    """The plan that splits the documents ``split`` (Per-Doc when ``layout`` is None, else
    tail + heads, see :data:`_LAYOUTS`) and places every other
    document with the paper's whole-document pass (greedy placement, then token equalisation by
    heads). Not validated; None when the split does not fit (see :func:`_tail_heads`)."""
    lens = d.tolist()
    tpr = int(d.sum()) // n
    mean_work = float(doc_workload(d).sum()) / n
    if layout is not None and layout[1] == "zigzag":
        mode = layout[2] if isinstance(layout[2], str) else bool(layout[2])
        cols4 = _zigzag_head(d, n, split, layout[0] * mean_work, mode)
        if cols4 is None:
            return None
        rank, doc, start, length = cols4
        per_doc, tail = (), ()
    elif layout is None:
        per_doc, tail = split, ()
    else:
        thr = np.inf if layout[2] is None else layout[2] * mean_work
        per_doc = tuple(i for i in split if lens[i] * (lens[i] + 1) // 2 > thr)
        tail = tuple(i for i in split if lens[i] * (lens[i] + 1) // 2 <= thr)
    if layout is None or layout[1] != "zigzag":
        ids = np.array(per_doc, dtype=np.int64)
        sizes, _ = per_doc_chunk_sizes(d[ids], n)  # (|S|, 2N) chunk lengths
        rank, doc, start, length = per_doc_columns(ids, sizes, n)
    if tail:
        keep = length > 0
        rank, doc, start, length = rank[keep], doc[keep], start[keep], length[keep]
        sent = np.where(start + length < d[doc], length, 0)
        state = (
            np.bincount(rank, weights=shard_workload(start, length), minlength=n).tolist(),
            np.bincount(rank, weights=length, minlength=n).astype(np.int64).tolist(),
            np.bincount(rank, weights=sent, minlength=n).astype(np.int64).tolist(),
        )
        th = _tail_heads(lens, tail, n, tpr, layout[0] * mean_work, layout[1], state)
        if th is None:
            return None
        r2, d2, s2, l2 = np.array(th, dtype=np.int64).reshape(-1, 4).T
        rank, doc = np.concatenate([rank, r2]), np.concatenate([doc, d2])
        start, length = np.concatenate([start, s2]), np.concatenate([length, l2])
    base_tokens = np.bincount(rank, weights=length, minlength=n).astype(np.int64).tolist()
    base_work = np.bincount(rank, weights=shard_workload(start, length), minlength=n)
    base_work = base_work.astype(np.int64).tolist()
    in_s = set(split)
    whole = [i for i in order if i not in in_s]
    pieces, _ = _whole_doc_pass(whole, lens, base_tokens, base_work, n, tpr)
    rows = [(r, dc, p, s) for r in range(n) for dc, p, s in pieces[r]]
    cols = np.array(rows, dtype=np.int64).reshape(-1, 4).T
    return make_plan(
        "flashcp_refined",
        n,
        d,
        np.concatenate([rank, cols[0]]),
        np.concatenate([doc, cols[1]]),
        np.concatenate([start, cols[2]]),
        np.concatenate([length, cols[3]]),
        validate=False,
    )


def _longest_suffix(end: int, room: float) -> int:
    """Largest l >= 0 with Eq. 3 workload of the segment [end - l, end) at most ``room``:
    ``l (2 end - l + 1) / 2 <= room`` (closed form of the quadratic, then corrected by one)."""
    if room <= 0:
        return 0
    b = 2 * end + 1
    disc = b * b - 8 * room
    if disc <= 0:
        return end
    ln = min(end, int((b - disc**0.5) / 2))
    while ln < end and (ln + 1) * (b - ln - 1) <= 2 * room:
        ln += 1
    while ln > 0 and ln * (b - ln) > 2 * room:
        ln -= 1
    return ln


def _fill(
    lens: list[int], order: list[int], n: int, tpr: int, budget: float, head_to_least_sent: bool
) -> list[tuple[int, int, int, int]]:
    """Shard rows ``(rank, doc, start, length)`` of the *fill* layout: documents, longest first,
    are placed whole on the rank with the most workload room that has token room for them; a
    document that fits whole nowhere is cut from its end: its tail (its last shard, free) goes to
    the rank that can take the longest suffix within ``budget`` workload (Eq. 3) and C/N tokens,
    and each further segment (a non-last shard: it costs its length, Eq. 5) to the rank that can
    take the longest one (``head_to_least_sent``: among ranks with room, the one that sends
    least). Splits therefore cut a document over as few ranks as the budget allows, instead of
    2N chunks. When the budget leaves no room, segments go to ranks by token room alone."""
    work = [0.0] * n
    tokens = [0] * n
    send = [0] * n
    rows = []
    for doc in order:
        length = lens[doc]
        fits = [
            r
            for r in range(n)
            if tpr - tokens[r] >= length and budget - work[r] >= length * (length + 1) / 2
        ]
        if fits:
            r = max(fits, key=lambda q: budget - work[q])
            rows.append((r, doc, 0, length))
            tokens[r] += length
            work[r] += length * (length + 1) // 2
            continue
        end = length
        while end > 0:
            open_ranks = [r for r in range(n) if tokens[r] < tpr]
            cands = [
                (min(tpr - tokens[r], _longest_suffix(end, budget - work[r])), r)
                for r in open_ranks
            ]
            best = max(c[0] for c in cands)
            if best == 0:  # the budget is spent: token room alone
                r = max(open_ranks, key=lambda q: tpr - tokens[q])
                seg = min(end, tpr - tokens[r])
            elif end < length and head_to_least_sent:
                r = min((q for ln, q in cands if ln > 0), key=lambda q: (send[q], -work[q]))
                seg = next(ln for ln, q in cands if q == r)
            else:
                seg, r = max(cands)
            start = end - seg
            rows.append((r, doc, start, seg))
            tokens[r] += seg
            work[r] += _work(start, seg)
            if end < length:
                send[r] += seg
            end = start
    return rows


def _fill_candidate(
    d: np.ndarray, n: int, order: list[int], budget_ratio: float, least_sent: bool
) -> Plan:
    """The plan of :func:`_fill` with a workload budget of ``budget_ratio * W_mean``. Not validated."""
    lens = d.tolist()
    tpr = int(d.sum()) // n
    mean_work = float(doc_workload(d).sum()) / n
    rows = _fill(lens, order, n, tpr, budget_ratio * mean_work, least_sent)
    cols = np.array(rows, dtype=np.int64).reshape(-1, 4).T
    return make_plan("flashcp_refined", n, d, *cols, validate=False)


def _work(p: int, s: int) -> int:
    """Eq. 3: query-key pairs per head of a shard with prefix p and length s."""
    return (2 * p + s + 1) * s // 2


@planner_entry("flashcp_refined")
def plan_flashcp_refined(
    doc_lens,
    cp_size: int,
    *,
    target_imbalance: float = 1.02,
    num_candidates: int = 12,
    validate: bool = True,
) -> Plan:
    """Plan a FlashCP layout by the search of the module docstring.

    Args:
        doc_lens: (n_docs,) int, document lengths in packed order (sum C divisible by N).
        cp_size: N >= 1.
        target_imbalance: R >= 1, the imbalance ratio to reach.
        num_candidates: documents (after the paper's k - 1 longest) tried as substitutes in step 2.
        validate: check the plan's invariants.
    Returns:
        A :class:`~flashcp.plan.Plan` with ``method="flashcp_refined"``, status ``"ok"`` when the
        imbalance ratio is <= R, else ``"target_not_met"``. ``info``: ``split_docs`` (sorted),
        ``split_layout`` (``per_doc``, ``tail_heads_<f>``, ``tail_heads_<f>_all`` or
        ``tail_zigzag_head_<f>``),
        ``paper_per_doc_docs`` (the paper heuristic's set), ``candidates`` (plans evaluated),
        ``target_imbalance``.
    Raises:
        ValueError: bad lengths, ``cp_size`` < 1, C not divisible by N, R < 1 or
            ``num_candidates`` < 0.
    """
    d = check_doc_lens(doc_lens)
    n = cp_size
    check_cp_args(int(d.sum()), n)
    if not np.isfinite(target_imbalance) or target_imbalance < 1.0:
        raise ValueError(f"target_imbalance must be a number >= 1, got {target_imbalance!r}")
    if num_candidates < 0:
        raise ValueError(f"num_candidates must be >= 0, got {num_candidates!r}")
    order = np.argsort(-d, kind="stable").tolist()
    cache: dict[tuple, Plan | None] = {}
    keys: dict[tuple, tuple] = {}  # the ranking key of every cached candidate, computed once

    def meets(p: Plan | None) -> bool:
        return p is not None and p.imbalance_ratio <= target_imbalance

    def rank_key(p: Plan | None) -> tuple:
        if p is None:
            return (True, np.inf, np.inf)
        ratio = p.imbalance_ratio
        return (ratio > target_imbalance, p.comm_tokens, ratio)

    def evaluate(
        layout: tuple[float, bool | str, float | None] | None, s: tuple[int, ...]
    ) -> tuple:
        """The ranking key of the candidate (``layout``, ``s``); its plan is ``cache[...]``."""
        key = (layout, tuple(sorted(s)))
        if key not in cache:
            cache[key] = _candidate(d, n, key[1], order, layout)
            keys[key] = rank_key(cache[key])
        return keys[key]

    def best_cached() -> tuple:
        key = min(keys, key=keys.__getitem__)
        return key, cache[key]

    # 1. the paper's longest-first loop, once per split layout
    paper_k = 0
    while paper_k < len(order) and evaluate(None, tuple(order[:paper_k]))[0]:
        paper_k += 1
    for layout in _LAYOUTS[1:]:  # tail + heads should need no more splits than Per-Doc
        for k in range(1, min(paper_k + 1, len(order)) + 1):
            if not evaluate(layout, tuple(order[:k]))[0]:
                break
    (layout, best_set), best = best_cached()
    k = len(best_set)
    # 2. substitution of the k-th longest, in the best layout
    if k > 0:
        for x in order[k : k + num_candidates]:
            evaluate(layout, (*order[: k - 1], x))
    (layout, best_set), best = best_cached()
    # 3. elimination
    while meets(best) and best_set:
        for x in best_set:
            evaluate(layout, tuple(m for m in best_set if m != x))
        (layout2, set2), cand = best_cached()
        if keys[(layout2, set2)] >= keys[(layout, best_set)]:
            break
        layout, best_set, best = layout2, set2, cand
    paper = plan_flashcp(d, n, target_imbalance=target_imbalance, validate=False)
    if rank_key(paper) < rank_key(best):  # the paper's exact plan
        layout, best_set, best = None, tuple(sorted(order[:paper_k])), paper
    status = "ok" if meets(best) else "target_not_met"
    info = {
        "split_docs": list(best_set),
        "split_layout": "per_doc"
        if layout is None
        else f"tail_zigzag_head_{layout[0]:g}"
        + ("_first" if layout[2] == "first" else "_others" if layout[2] else "")
        if layout[1] == "zigzag"
        else f"tail_heads_{layout[0]:g}"
        + ("_all" if layout[1] else "")
        + ("" if layout[2] is None else f"_perdoc_above_{layout[2]:g}"),
        "paper_per_doc_docs": sorted(order[:paper_k]),
        "candidates": len(cache),
        "target_imbalance": float(target_imbalance),
    }
    return make_plan(
        "flashcp_refined",
        n,
        d,
        best.rank,
        best.doc,
        best.start,
        best.length,
        status=status,
        info=info,
        validate=validate,
    )
