"""The ILP's pieces and its two formulations, built with PuLP (arXiv 2606.08476, §3.4).

Both formulations describe the same plans (an assignment of every piece to a rank, with exactly
C / N tokens per rank) and the same objective, so they have the same optimum; they differ in how
tight their LP relaxations are. :mod:`flashcp.planners.ilp` documents both.

Everything here is a pure function of numpy arrays; :mod:`flashcp.planners.ilp.worker` calls it inside the
solver process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from flashcp.plan import cu_seqlens, doc_workload, shard_workload

__all__ = [
    "CAP_TOLERANCE",
    "FORMULATIONS",
    "Infeasible",
    "Instance",
    "Model",
    "block_pieces",
    "build_model",
    "cap_bound",
    "meets_cap",
    "piece_ranks",
    "refine_grid",
    "round_fractions",
]

#: the ILP formulations (see :mod:`flashcp.planners.ilp`)
FORMULATIONS = ("patterns", "pieces")
#: relative tolerance of every comparison with the imbalance cap ``max_imbalance``: a value v
#: meets cap c when ``v <= c * (1 + CAP_TOLERANCE)`` (:func:`meets_cap`). It applies to the
#: model's bound on the imbalance variable, to pruning tails that exceed the cap, to a MIP start's
#: values against their bounds, and to the planner's checks of seed and rounded plans; so a plan
#: at exactly the cap, whose ratio float rounding puts a hair above it (1.0 + 1e-9 for a perfect
#: balance), is never rejected.
CAP_TOLERANCE = 1e-9
# margin added to a MIP start's maxima so that the solver's own sums of the same terms (in another
# order) never exceed them; the start stays within the bound cap * (1 + CAP_TOLERANCE)
_START_MARGIN = 1e-9


def cap_bound(cap: float | None) -> float | None:
    """The largest value that meets ``cap`` (:data:`CAP_TOLERANCE`); None without a cap."""
    return None if cap is None else float(cap) * (1.0 + CAP_TOLERANCE)


def meets_cap(value: float, cap: float | None) -> bool:
    """``value <= cap`` up to :data:`CAP_TOLERANCE` (always True without a cap)."""
    return cap is None or float(value) <= cap_bound(cap)


def block_pieces(
    doc_lens, block_size: int, extra_cuts: tuple[np.ndarray, np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ILP's pieces: every document cut on a ``block_size`` grid aligned to its end.

    Args:
        doc_lens: (n_docs,) int, document lengths.
        block_size: granularity in tokens, >= 1.
        extra_cuts: optional ``(doc, pos)``, (k,) int each: further cut points (token offsets
            inside documents, 0 < pos < len) added to the grid, e.g. the cuts of a seed plan.
    Returns:
        ``(doc, start, length)``: (n_pieces,) int64 each, ordered by document, then start. Without
        ``extra_cuts``, within a document the first piece has ``len mod block_size`` tokens
        (``block_size`` if that is 0) and every other piece exactly ``block_size``.
    Raises:
        ValueError: ``block_size`` < 1.
    """
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int | np.integer)
        or block_size < 1
    ):
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    d = np.asarray(doc_lens, dtype=np.int64)
    cu = cu_seqlens(d)  # (n_docs + 1,) global document starts
    counts = -(-d // block_size)  # (n_docs,) grid pieces per document
    doc = np.repeat(np.arange(d.size, dtype=np.int64), counts)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    k = np.arange(doc.size, dtype=np.int64) - first[doc]  # piece index from the document's end
    # global token positions where a piece starts: document starts and the end-aligned grid
    bounds = [cu[:-1], cu[doc + 1] - k * block_size]
    if extra_cuts is not None:
        cdoc, cpos = (np.asarray(a, dtype=np.int64) for a in extra_cuts)
        inside = (cpos > 0) & (cpos < d[cdoc])
        bounds.append(cu[cdoc[inside]] + cpos[inside])
    cuts = np.unique(np.concatenate([*bounds, cu[-1:]]))
    pos, length = cuts[:-1], np.diff(cuts)
    doc = np.searchsorted(cu, pos, side="right") - 1
    return doc, pos - cu[doc], length


class Infeasible(Exception):
    """The model has no feasible plan, found while building it (a document fits on no rank)."""


@dataclass(frozen=True)
class Instance:
    """One ILP instance: the pieces of a packed sequence and the objective's parameters.

    Attributes:
        doc_lens: (n_docs,) int64, document lengths.
        cp_size: N.
        pdoc, pstart, plen: (n_pieces,) int64, the pieces (:func:`block_pieces`), ordered by
            document, then start.
        comm_weight: weight of ``comm_tokens / comm_tokens_full`` in the objective.
        max_imbalance: cap on the imbalance ratio, or None.
    """

    doc_lens: np.ndarray
    cp_size: int
    pdoc: np.ndarray
    pstart: np.ndarray
    plen: np.ndarray
    comm_weight: float
    max_imbalance: float | None

    @property
    def tokens_per_rank(self) -> int:
        return int(self.doc_lens.sum()) // self.cp_size

    @property
    def mean_work(self) -> float:
        """W_mean: total Eq. 3 workload over N (query-key pairs per head)."""
        d = self.doc_lens
        return float(doc_workload(d).sum()) / self.cp_size

    @property
    def pwork(self) -> np.ndarray:
        """(n_pieces,) int64, Eq. 3 workload of each piece."""
        return shard_workload(self.pstart, self.plen)

    @property
    def is_last(self) -> np.ndarray:
        """(n_pieces,) bool, the piece ends its document."""
        return self.pstart + self.plen == self.doc_lens[self.pdoc]

    def tail_candidates(self) -> np.ndarray:
        """(n_pieces,) bool: a *tail* starting at this piece (the piece and every later piece of
        its document, on one rank) fits on a rank: at most C / N tokens and, under a cap, at most
        ``max_imbalance * W_mean`` workload (Eq. 3: ``(d (d+1) - p (p+1)) / 2`` for prefix p).
        Every plan's last shards are such tails, so no plan is lost by restricting to them."""
        d = self.doc_lens[self.pdoc]
        p = self.pstart
        ok = d - p <= self.tokens_per_rank
        if self.max_imbalance is not None:
            work = shard_workload(p, d - p)
            ok &= work <= cap_bound(self.max_imbalance) * self.mean_work
        return ok


@dataclass
class Model:
    """A built PuLP model and how to read a plan back from it.

    Attributes:
        prob: the ``pulp.LpProblem``.
        start_vars, start_vals: a MIP start (variables and their values), empty when none.
        read: ``read()`` -> (n_pieces,) int64 rank of every piece from the solved variables, or
            None when they are not integral.
        num_binaries, num_integers: model size.
        fractions: ``fractions()`` -> (n_pieces, N) float64, the share of every piece on every
            rank in the current (possibly fractional, e.g. LP-relaxed) solution; rows sum to 1.
        tail_vars: ``{doc: [binary, ...]}``, the variables choosing each document's last shard
            (exactly one is 1), or None (formulation ``pieces``); single-piece documents of
            equal length, aggregated into counts, have none.
        count_vars: ``[[integer, ...], ...]``, per group of aggregated documents its count on
            every rank (summing to the group's size), or None.
        rank_vars: ``[[var, ...], ...]``, per rank r the variables that place something on r
            (every variable but the two maxima belongs to exactly one rank); the neighbourhoods
            of :func:`flashcp.planners.ilp.worker.pair_lns` free two ranks' variables and fix the rest.
    """

    prob: Any
    start_vars: list
    start_vals: list
    read: Any
    num_binaries: int
    num_integers: int
    fractions: Any = None
    tail_vars: dict | None = None
    count_vars: list | None = None
    rank_vars: list | None = None


def _expr(pairs: list[tuple[Any, float]]):
    import pulp

    return pulp.LpAffineExpression(pairs)


def _tails(inst: Instance, seed_rank: np.ndarray) -> np.ndarray:
    """(n_docs,) int64: first piece of each document's maximal tail in the seed assignment
    (the longest suffix of its pieces on one rank: its last shard)."""
    n_docs = inst.doc_lens.size
    last = np.searchsorted(inst.pdoc, np.arange(n_docs), side="right") - 1
    first = np.searchsorted(inst.pdoc, np.arange(n_docs), side="left")
    out = np.empty(n_docs, dtype=np.int64)
    for doc in range(n_docs):
        k = int(last[doc])
        while k > first[doc] and seed_rank[k - 1] == seed_rank[last[doc]]:
            k -= 1
        out[doc] = k
    return out


def _seed_maxima(inst: Instance, seed_rank: np.ndarray) -> tuple[float, float]:
    """``(z_w, z_c)`` of a seed assignment: imbalance ratio (Eq. 3) and comm_tokens over
    comm_tokens_full (Eq. 5 / Eq. 4), each a hair above its value so rounding cannot make the MIP
    start infeasible."""
    n = inst.cp_size
    work = np.bincount(seed_rank, weights=inst.pwork, minlength=n)
    tails = _tails(inst, seed_rank)
    head = np.arange(inst.pdoc.size) < tails[inst.pdoc]
    send = np.bincount(seed_rank, weights=np.where(head, inst.plen, 0), minlength=n)
    return float(work.max() / inst.mean_work), float(send.max() / inst.tokens_per_rank)


def _with_maxima(model: Model, inst: Instance, seed_rank: np.ndarray | None, z_w, z_c) -> Model:
    """Complete a MIP start with the two maxima, each a margin above the seed's value and within
    its variable's bound (or drop the start when the seed breaks the cap, :func:`meets_cap`)."""
    if seed_rank is None or not model.start_vars:
        return model
    zw, zc = _seed_maxima(inst, seed_rank)
    if not meets_cap(zw, inst.max_imbalance):
        model.start_vars, model.start_vals = [], []
        return model
    zw += _START_MARGIN
    if inst.max_imbalance is not None:
        zw = min(zw, cap_bound(inst.max_imbalance))
    model.start_vars += [z_w, z_c]
    model.start_vals += [zw, zc + _START_MARGIN]
    return model


def _build_pieces(inst: Instance, seed_rank: np.ndarray | None) -> Model:
    """The piece-assignment formulation (see :mod:`flashcp.planners.ilp`, ``formulation="pieces"``)."""
    import pulp

    n, tpr, mean_work = inst.cp_size, inst.tokens_per_rank, inst.mean_work
    npieces = inst.pdoc.size
    lens, works = inst.plen.tolist(), inst.pwork.tolist()
    is_last = inst.is_last
    prob = pulp.LpProblem("flashcp_ilp_pieces", pulp.LpMinimize)
    var = prob.add_variable
    ranks = range(n)
    x = [[var(f"x_{i}_{r}", 0, 1, cat=pulp.LpBinary) for r in ranks] for i in range(npieces)]
    y = {i: [var(f"y_{i}_{r}", 0, 1) for r in ranks] for i in np.flatnonzero(~is_last).tolist()}
    z_w = var("z_w", 0, cap_bound(inst.max_imbalance))
    z_c = var("z_c", 0)
    prob += z_w + float(inst.comm_weight) * z_c
    for i in range(npieces):  # Eq. 1
        prob += _expr([(v, 1) for v in x[i]]) == 1, f"eq1_{i}"
    for r in ranks:
        prob += _expr([(x[i][r], lens[i]) for i in range(npieces)]) == tpr, f"eq2_{r}"
        work = [(x[i][r], works[i] / mean_work) for i in range(npieces)]
        prob += _expr([*work, (z_w, -1)]) <= 0, f"work_{r}"
        comm = [(x[i][r], lens[i] / tpr) for i in y] + [(y[i][r], -lens[i] / tpr) for i in y]
        prob += _expr([*comm, (z_c, -1)]) <= 0, f"comm_{r}"
    for i, yi in y.items():  # the next piece of a non-last piece is i + 1
        for r in ranks:
            prob += yi[r] <= x[i][r], f"tail_x_{i}_{r}"
            prob += yi[r] <= (y[i + 1][r] if i + 1 in y else x[i + 1][r]), f"tail_y_{i}_{r}"
    # symmetry breaking: the last piece of the longest document on rank 0
    longest = int(np.argmax(inst.doc_lens))
    sym_piece = int(np.flatnonzero((inst.pdoc == longest) & is_last)[0])
    prob += x[sym_piece][0] == 1, "sym"

    svars, svals = [], []
    if seed_rank is not None:
        perm = np.arange(n)  # relabel ranks so that the symmetry-breaking constraint holds
        perm[[0, seed_rank[sym_piece]]] = perm[[seed_rank[sym_piece], 0]]
        srank = perm[seed_rank]
        xs = np.zeros((npieces, n))
        xs[np.arange(npieces), srank] = 1.0
        ys = np.zeros((npieces, n))
        for i in range(npieces - 1, -1, -1):
            ys[i] = xs[i] if is_last[i] else np.minimum(xs[i], ys[i + 1])
        for i in range(npieces):
            svars += x[i]
            svals += xs[i].tolist()
            if i in y:
                svars += y[i]
                svals += ys[i].tolist()

    def read() -> np.ndarray | None:
        xv = np.array([[v.value() or 0.0 for v in row] for row in x])  # (n_pieces, N)
        if not (np.abs(xv.max(axis=1) - 1.0) < 1e-6).all():
            return None
        return xv.argmax(axis=1).astype(np.int64)

    def fractions() -> np.ndarray:
        return np.array([[v.value() or 0.0 for v in row] for row in x])  # (n_pieces, N)

    rank_vars = [[x[i][r] for i in range(npieces)] + [yi[r] for yi in y.values()] for r in ranks]
    model = Model(prob, svars, svals, read, npieces * n, 0, fractions, rank_vars=rank_vars)
    return _with_maxima(model, inst, seed_rank, z_w, z_c)


def _build_patterns(inst: Instance, seed_rank: np.ndarray | None) -> Model:
    """The tail-pattern formulation (see :mod:`flashcp.planners.ilp`, ``formulation="patterns"``)."""
    import pulp

    n, tpr, mean_work = inst.cp_size, inst.tokens_per_rank, inst.mean_work
    d = inst.doc_lens
    n_docs = d.size
    pdoc, pstart, plen = inst.pdoc, inst.pstart, inst.plen
    pwork = inst.pwork
    first = np.searchsorted(pdoc, np.arange(n_docs), side="left")
    last = np.searchsorted(pdoc, np.arange(n_docs), side="right") - 1
    tail_ok = inst.tail_candidates()
    tail_tokens = (d[pdoc] - pstart).tolist()
    tail_work = ((d[pdoc] * (d[pdoc] + 1) - pstart * (pstart + 1)) // 2).tolist()

    # symmetry order: longest first; a document's tail may only sit on ranks <= its position.
    # Single-piece documents of equal length (whole-only and interchangeable) are aggregated
    # into one integer count per rank.
    order = np.lexsort((np.arange(n_docs), -d)).tolist()
    single = (first == last).tolist()
    groups: dict[int, list[int]] = {}
    for doc in order:
        if single[doc]:
            groups.setdefault(int(d[doc]), []).append(doc)
    agg = {g[0]: g for g in groups.values() if len(g) > 1}  # leader -> members (symmetry order)
    in_agg = {m for g in agg.values() for m in g}

    prob = pulp.LpProblem("flashcp_ilp_patterns", pulp.LpMinimize)
    var = prob.add_variable
    z_w = var("z_w", 0, cap_bound(inst.max_imbalance))
    z_c = var("z_c", 0)
    prob += z_w + float(inst.comm_weight) * z_c
    tok: list[list[tuple[Any, float]]] = [[] for _ in range(n)]  # (var, coefficient) per rank
    wrk: list[list[tuple[Any, float]]] = [[] for _ in range(n)]
    com: list[list[tuple[Any, float]]] = [[] for _ in range(n)]
    u: dict[int, dict[tuple[int, int], Any]] = {}  # doc -> (tail start piece, rank) -> binary
    h: dict[int, list[Any]] = {}  # head piece -> per-rank binaries
    cnt: dict[int, list[Any]] = {}  # aggregated group leader -> per-rank counts
    nbin = nint = 0
    for pos, doc in enumerate(order):
        if doc in in_agg:
            if doc not in agg:
                continue
            members = agg[doc]
            top = min(n - 1, order.index(members[-1]))  # the group's last symmetry position
            i = int(first[doc])
            if not tail_ok[i]:
                raise Infeasible(f"document {doc} ({int(d[doc])} tokens) fits on no rank")
            cnt[doc] = [
                var(f"n_{doc}_{r}", 0, len(members), cat=pulp.LpInteger) for r in range(top + 1)
            ]
            nint += len(cnt[doc])
            prob += _expr([(v, 1) for v in cnt[doc]]) == len(members), f"count_{doc}"
            for r, v in enumerate(cnt[doc]):
                tok[r].append((v, tail_tokens[i]))
                wrk[r].append((v, tail_work[i] / mean_work))
            continue
        top = min(n - 1, pos)
        ks = [k for k in range(int(first[doc]), int(last[doc]) + 1) if tail_ok[k]]
        if not ks:
            raise Infeasible(
                f"no tail of document {doc} ({int(d[doc])} tokens) fits on a rank "
                f"(C / N = {tpr} tokens, workload cap {inst.max_imbalance})"
            )
        u[doc] = {
            (k, r): var(f"u_{doc}_{k}_{r}", 0, 1, cat=pulp.LpBinary)
            for k in ks
            for r in range(top + 1)
        }
        nbin += len(u[doc])
        prob += _expr([(v, 1) for v in u[doc].values()]) == 1, f"tail_{doc}"
        for (k, r), v in u[doc].items():
            tok[r].append((v, tail_tokens[k]))
            wrk[r].append((v, tail_work[k] / mean_work))
        # head pieces: every piece before the tail's first piece, on any rank, is non-last
        for i in range(int(first[doc]), (max(ks) if ks else int(first[doc]))):
            h[i] = [var(f"h_{i}_{r}", 0, 1, cat=pulp.LpBinary) for r in range(n)]
            nbin += n
            later = [(v, -1) for (k, _), v in u[doc].items() if k > i]
            prob += _expr([*((v, 1) for v in h[i]), *later]) == 0, f"head_{i}"
            for r, v in enumerate(h[i]):
                tok[r].append((v, int(plen[i])))
                wrk[r].append((v, int(pwork[i]) / mean_work))
                com[r].append((v, int(plen[i]) / tpr))
    for r in range(n):
        prob += _expr(tok[r]) == tpr, f"eq2_{r}"
        prob += _expr([*wrk[r], (z_w, -1)]) <= 0, f"work_{r}"
        prob += _expr([*com[r], (z_c, -1)]) <= 0, f"comm_{r}"

    svars, svals = [], []
    if seed_rank is not None:
        tails = _tails(inst, seed_rank)
        # relabel ranks by first appearance of a tail in the symmetry order, so the seed obeys
        # the symmetry restrictions
        label: dict[int, int] = {}
        for doc in order:
            label.setdefault(int(seed_rank[last[doc]]), len(label))
        for r in range(n):
            label.setdefault(r, len(label))
        srank = np.array([label[int(r)] for r in seed_rank.tolist()], dtype=np.int64)
        ok = True
        for doc, uv in u.items():
            key = (int(tails[doc]), int(srank[last[doc]]))
            ok &= key in uv
            for kr, v in uv.items():
                svars.append(v)
                svals.append(1.0 if kr == key else 0.0)
        for i, hv in h.items():
            in_head = i < tails[pdoc[i]]
            for r, v in enumerate(hv):
                svars.append(v)
                svals.append(1.0 if in_head and srank[i] == r else 0.0)
        for leader, cv in cnt.items():
            c = np.bincount(srank[first[agg[leader]]], minlength=n)
            ok &= bool((c[len(cv) :] == 0).all())
            svars += cv
            svals += c[: len(cv)].astype(float).tolist()
        if not ok:  # the seed uses a tail outside the model (it breaks the cap)
            svars, svals = [], []

    def read() -> np.ndarray | None:
        out = np.full(pdoc.size, -1, dtype=np.int64)
        for doc, uv in u.items():
            chosen = [kr for kr, v in uv.items() if (v.value() or 0.0) > 0.5]
            if len(chosen) != 1:
                return None
            k, r = chosen[0]
            out[k : last[doc] + 1] = r
        for i, hv in h.items():
            if out[i] >= 0:
                continue
            vals = np.array([v.value() or 0.0 for v in hv])
            if abs(vals.max() - 1.0) > 1e-6:
                return None
            out[i] = int(vals.argmax())
        for leader, cv in cnt.items():
            counts = [round(v.value() or 0.0) for v in cv]
            members = agg[leader]
            if sum(counts) != len(members):
                return None
            out[first[members]] = np.repeat(np.arange(len(counts)), counts)
        return out if (out >= 0).all() else None

    def fractions() -> np.ndarray:
        out = np.zeros((pdoc.size, n))
        for doc, uv in u.items():  # a tail from piece k covers pieces k .. last
            for (k, r), v in uv.items():
                out[k : last[doc] + 1, r] += v.value() or 0.0
        for i, hv in h.items():
            out[i] += [v.value() or 0.0 for v in hv]
        for leader, cv in cnt.items():
            members = agg[leader]
            share = np.array([v.value() or 0.0 for v in cv]) / len(members)
            out[first[members], : len(cv)] += share
        return np.clip(out, 0.0, None)

    tail_vars = {doc: list(uv.values()) for doc, uv in u.items()}
    rank_vars: list[list[Any]] = [[] for _ in range(n)]
    for uv in u.values():
        for (_, r), v in uv.items():
            rank_vars[r].append(v)
    for vs in [*h.values(), *cnt.values()]:
        for r, v in enumerate(vs):
            rank_vars[r].append(v)
    model = Model(
        prob, svars, svals, read, nbin, nint, fractions, tail_vars, list(cnt.values()), rank_vars
    )
    return _with_maxima(model, inst, seed_rank, z_w, z_c)


def build_model(formulation: str, inst: Instance, seed_rank: np.ndarray | None) -> Model:
    """Build ``formulation`` (one of :data:`FORMULATIONS`) for ``inst``.

    Args:
        formulation: ``"patterns"`` or ``"pieces"``.
        inst: the instance.
        seed_rank: (n_pieces,) int64 rank of every piece in a seed plan, or None; becomes the MIP
            start (dropped when it is outside the model, e.g. it breaks the imbalance cap).
    Raises:
        ValueError: unknown formulation.
    """
    if formulation == "patterns":
        return _build_patterns(inst, seed_rank)
    if formulation == "pieces":
        return _build_pieces(inst, seed_rank)
    raise ValueError(f"formulation must be one of {FORMULATIONS}, got {formulation!r}")


def piece_ranks(
    rank: np.ndarray,
    doc: np.ndarray,
    start: np.ndarray,
    pdoc: np.ndarray,
    pstart: np.ndarray,
    context_len: int,
) -> np.ndarray:
    """(n_pieces,) int64: the rank of every grid piece ``(pdoc, pstart)`` in a plan given by its
    shard columns ``(rank, doc, start)`` (the shard holding the piece's first token). The grid
    must contain the plan's cut points (:func:`block_pieces` with ``extra_cuts``)."""
    order = np.lexsort((start, doc))
    key = doc[order] * (context_len + 1) + start[order]
    idx = np.searchsorted(key, pdoc * (context_len + 1) + pstart, side="right") - 1
    return rank[order][idx]


def refine_grid(inst: Instance, doc: np.ndarray, start: np.ndarray) -> Instance:
    """``inst`` with its pieces further cut at the token offsets ``start`` of documents ``doc``
    ((k,) int each), e.g. the cut points of a plan, so that the plan is representable."""
    d = inst.doc_lens
    cu = cu_seqlens(d)
    inside = (start > 0) & (start < d[doc])
    cuts = np.unique(
        np.concatenate([cu[inst.pdoc] + inst.pstart, cu[doc[inside]] + start[inside], cu[-1:]])
    )
    pos, length = cuts[:-1], np.diff(cuts)
    pdoc = np.searchsorted(cu, pos, side="right") - 1
    return Instance(
        d, inst.cp_size, pdoc, pos - cu[pdoc], length, inst.comm_weight, inst.max_imbalance
    )


def round_fractions(inst: Instance, frac: np.ndarray) -> tuple[np.ndarray, ...]:
    """Shard columns ``(rank, doc, start, length)`` of a plan that realises a fractional solution
    by cutting pieces instead of rounding them: piece i gives about ``len_i * frac[i, r]`` tokens
    to rank r, rounded so that every piece keeps its length and every rank gets exactly C / N
    tokens (Eq. 1, Eq. 2). Within a piece, the rank holding most of its document's last piece
    takes the piece's end, so that a document whose tail the solution keeps on one rank keeps it
    there as its last shard; the other shares come before it, lowest rank first.

    Args:
        inst: the instance (its pieces).
        frac: (n_pieces, N) float, shares of every piece on every rank, rows summing to 1 and
            columns to C / N tokens (an LP solution's :attr:`Model.fractions`).
    Returns:
        (k,) int64 each, in no particular order (:func:`flashcp.plan.make_plan` sorts and merges).
    """
    n, tpr = inst.cp_size, inst.tokens_per_rank
    plen = inst.plen
    f = np.clip(np.nan_to_num(np.asarray(frac, dtype=np.float64)), 0.0, None)
    f /= np.maximum(f.sum(axis=1, keepdims=True), 1e-12)
    want = plen[:, None] * f  # (n_pieces, N) tokens
    amount = np.floor(want + 1e-9).astype(np.int64)
    # give every piece its remaining tokens, largest fractional parts first, on ranks that still
    # lack tokens (total row and column deficits are equal, so this always completes)
    col_left = tpr - amount.sum(axis=0)
    for i in np.flatnonzero(amount.sum(axis=1) < plen):
        need = int(plen[i] - amount[i].sum())
        for r in np.argsort(-(want[i] - amount[i]), kind="stable"):
            if need == 0:
                break
            take = min(need, int(col_left[r]))
            if take > 0 and want[i, r] - amount[i, r] > 1e-9:
                amount[i, r] += take
                col_left[r] -= take
                need -= take
        for r in np.argsort(-col_left, kind="stable"):
            if need == 0:
                break
            take = min(need, int(col_left[r]))
            amount[i, r] += take
            col_left[r] -= take
            need -= take
    # a rank over C / N (rounding up where its column had no room) gives back to one under it
    over = np.flatnonzero(col_left < 0)
    for r in over:
        for i in np.flatnonzero(amount[:, r] > 0):
            if col_left[r] >= 0:
                break
            for q in np.flatnonzero(col_left > 0):
                move = min(int(amount[i, r]), int(-col_left[r]), int(col_left[q]))
                amount[i, r] -= move
                amount[i, q] += move
                col_left[r] += move
                col_left[q] -= move
    n_docs = inst.doc_lens.size
    last = np.searchsorted(inst.pdoc, np.arange(n_docs), side="right") - 1
    tail_rank = amount[last].argmax(axis=1)  # (n_docs,)
    rows = []
    for i in range(plen.size):
        tr = int(tail_rank[inst.pdoc[i]])
        p = int(inst.pstart[i])
        for r in [*(q for q in range(n) if q != tr), tr]:
            a = int(amount[i, r])
            if a:
                rows.append((r, int(inst.pdoc[i]), p, a))
                p += a
    return tuple(np.array(c, dtype=np.int64) for c in zip(*rows, strict=True))
