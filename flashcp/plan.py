"""Plan data model: which shards of which documents each CP rank holds, and the metrics of a plan.

A *plan* assigns every token of a packed sequence to exactly one of ``cp_size`` ranks, as *shards*:
contiguous pieces ``(doc, start, length)`` of one document, where ``start`` is also the shard's
prefix length p (tokens of the same document before it). Every rank holds exactly
``context_len / cp_size`` tokens.

The plan is stored column-wise (one numpy row per shard, sorted by rank, then by the order in which
the rank holds its shards) so that metrics and the simulator are vectorised; :meth:`Plan.ranks`
gives the readable list-of-shards view.

Formulas (arXiv 2606.08476, "FlashCP", §3; notation in DESIGN.md §2):

* workload of a shard, Eq. 3: ``W = (2p + s + 1) * s / 2`` query-key pairs per head; the shards of
  one document sum to ``d (d + 1) / 2``.
* ``imbalance_ratio = max_r W_r / mean_r W_r``.
* ``comm_tokens_full`` (Eq. 4): ``(N - 1) * C / N`` KV tokens received per rank when the whole KV
  is all-gathered.
* ``comm_tokens`` (Eq. 5): ``(N - 1) * max_j sum(len of rank j's shards that are not the last shard
  of their document)`` for sharding-aware all-gather; a document kept whole costs nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "Plan",
    "Shard",
    "check_cp_args",
    "check_doc_lens",
    "doc_workload",
    "kv_bytes",
    "make_plan",
    "shard_workload",
]


class Shard(NamedTuple):
    """A contiguous piece of one document held by one rank.

    ``doc`` indexes ``doc_lens`` (packed order); ``start`` is the shard's first token inside its
    document, which is also its prefix length p; ``length`` is its number of tokens s >= 1.
    """

    doc: int
    start: int
    length: int

    @property
    def workload(self) -> int:
        """Query-key pairs per head, Eq. 3: (2p + s + 1) s / 2."""
        return (2 * self.start + self.length + 1) * self.length // 2


def shard_workload(start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Eq. 3 of the paper, vectorised: ``(2p + s + 1) * s / 2`` query-key pairs per head.

    Args:
        start: (n,) int, prefix length p of each shard.
        length: (n,) int, length s of each shard.
    Returns:
        (n,) int64, causal query-key pairs of each shard (exact integers).
    """
    start = np.asarray(start, dtype=np.int64)
    length = np.asarray(length, dtype=np.int64)
    return (2 * start + length + 1) * length // 2


def doc_workload(doc_lens: np.ndarray) -> np.ndarray:
    """Workload of whole documents, ``d (d + 1) / 2`` (Eq. 3 with p = 0, s = d); (n,) int64."""
    d = np.asarray(doc_lens, dtype=np.int64)
    return d * (d + 1) // 2


def check_doc_lens(doc_lens: Any, context_len: int | None = None) -> np.ndarray:
    """Validate document lengths and return them as a (n_docs,) int64 array.

    Raises:
        ValueError: empty input, non-integer values, a length <= 0, or (when ``context_len`` is
            given) lengths that do not sum to ``context_len``. The message names the bad value.
    """
    if isinstance(doc_lens, str | bytes):
        raise ValueError(f"doc_lens must be a sequence of integers, got the string {doc_lens!r}")
    arr = np.asarray(doc_lens)
    if arr.ndim != 1:
        raise ValueError(f"doc_lens must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError("doc_lens is empty: a sequence needs at least one document")
    if arr.dtype.kind == "f":
        bad = arr[~np.isfinite(arr) | (arr != np.round(arr))]
        if bad.size:
            raise ValueError(f"doc_lens must be integers, got {bad[0]!r}")
    elif arr.dtype.kind not in "iu":
        raise ValueError(f"doc_lens must be integers, got dtype {arr.dtype} (e.g. {arr.flat[0]!r})")
    arr = arr.astype(np.int64)
    if (arr <= 0).any():
        i = int(np.argmax(arr <= 0))
        raise ValueError(f"doc_lens must be >= 1, got doc_lens[{i}] = {int(arr[i])}")
    if context_len is not None and int(arr.sum()) != int(context_len):
        raise ValueError(
            f"doc_lens sum to {int(arr.sum())} but context_len = {context_len}; "
            "pack or cut the documents to context_len first"
        )
    return arr


def check_cp_args(context_len: int, cp_size: int, chunks_per_rank: int = 1) -> None:
    """Check ``cp_size >= 1`` and that ``context_len`` divides by ``chunks_per_rank * cp_size``.

    Raises:
        ValueError: naming the bad value.
    """
    if isinstance(cp_size, bool) or not isinstance(cp_size, int | np.integer):
        raise ValueError(f"cp_size must be an integer, got {cp_size!r}")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if context_len % cp_size:
        raise ValueError(
            f"context_len = {context_len} is not divisible by cp_size = {cp_size}: every rank must "
            "hold exactly context_len / cp_size tokens"
        )
    n = chunks_per_rank * cp_size
    if context_len % n:
        raise ValueError(
            f"context_len = {context_len} is not divisible by {chunks_per_rank} * cp_size = {n}, "
            f"which this layout needs ({chunks_per_rank} equal chunks per rank)"
        )


def kv_bytes(tokens: Any, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> Any:
    """Bytes of K and V for ``tokens`` tokens: tokens x 2 x num_kv_heads x head_dim x dtype_bytes.

    DESIGN.md §2 ("bytes"). Training moves this twice per pass direction (forward all-gather of KV,
    backward reduce-scatter of dK/dV); callers apply that factor.
    """
    return tokens * 2 * num_kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True, eq=False)
class Plan:
    """A CP plan: shards per rank, stored column-wise.

    Attributes:
        method: planner name (``llama3``, ``per_doc``, ``ring``, ``zigzag``, ``flashcp``, ...).
        cp_size: N, number of CP ranks.
        doc_lens: (n_docs,) int64, document lengths in packed order; sums to ``context_len``.
        rank, doc, start, length: (n_shards,) int64 each; shard i is held by ``rank[i]`` and
            covers tokens ``[start[i], start[i] + length[i])`` of document ``doc[i]``. Rows are
            sorted by rank, then by the order in which the rank holds them (its local layout).
        status: ``"ok"`` or a planner-specific status (e.g. ``"target_not_met"``, ``"fallback"``).
        info: planner-specific details (JSON-serialisable), e.g. FlashCP's Per-Doc set.

    Build with :func:`make_plan`, which validates and merges adjacent pieces.
    """

    method: str
    cp_size: int
    doc_lens: np.ndarray
    rank: np.ndarray
    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray
    status: str = "ok"
    info: dict = field(default_factory=dict)

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def context_len(self) -> int:
        """C, total tokens of the packed sequence."""
        return int(self.doc_lens.sum())

    @property
    def num_docs(self) -> int:
        return int(self.doc_lens.size)

    @property
    def num_shards(self) -> int:
        return int(self.rank.size)

    @property
    def tokens_per_rank(self) -> np.ndarray:
        """(cp_size,) int64, tokens held by each rank (all equal to C/N in a valid plan)."""
        return np.bincount(self.rank, weights=self.length, minlength=self.cp_size).astype(np.int64)

    @property
    def rank_offsets(self) -> np.ndarray:
        """(cp_size + 1,) int64: shards of rank r are rows ``rank_offsets[r]:rank_offsets[r+1]``."""
        counts = np.bincount(self.rank, minlength=self.cp_size)
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    # ---- workload ----------------------------------------------------------------------------
    @property
    def shard_workload(self) -> np.ndarray:
        """(n_shards,) int64, Eq. 3 per shard."""
        return shard_workload(self.start, self.length)

    @property
    def workload_per_rank(self) -> np.ndarray:
        """(cp_size,) float64, sum of Eq. 3 over each rank's shards (query-key pairs per head)."""
        return np.bincount(self.rank, weights=self.shard_workload, minlength=self.cp_size)

    @property
    def imbalance_ratio(self) -> float:
        """max over ranks of workload / mean over ranks of workload (1.0 is perfect)."""
        w = self.workload_per_rank
        return float(w.max() / w.mean())

    # ---- communication -----------------------------------------------------------------------
    @property
    def is_last(self) -> np.ndarray:
        """(n_shards,) bool, True where the shard ends its document (its KV is needed by nobody else)."""
        return self.start + self.length == self.doc_lens[self.doc]

    @property
    def send_tokens_per_rank(self) -> np.ndarray:
        """(cp_size,) int64, tokens of each rank's non-last shards: its share of the compact
        sharding-aware all-gather buffer (Eq. 5)."""
        w = np.where(self.is_last, 0, self.length)
        return np.bincount(self.rank, weights=w, minlength=self.cp_size).astype(np.int64)

    @property
    def comm_tokens(self) -> int:
        """Eq. 5: KV tokens each rank receives under sharding-aware all-gather, per K or V, per KV
        head, per pass: (N - 1) * max_j (non-last tokens of rank j). An all-gather pads every
        rank's contribution to the largest one."""
        return int((self.cp_size - 1) * self.send_tokens_per_rank.max())

    @property
    def comm_tokens_full(self) -> int:
        """Eq. 4: (N - 1) * C / N KV tokens received per rank when the whole KV is all-gathered."""
        return (self.cp_size - 1) * self.context_len // self.cp_size

    @property
    def comm_saving(self) -> float:
        """1 - comm_tokens / comm_tokens_full (0 when N = 1)."""
        full = self.comm_tokens_full
        return 1.0 - self.comm_tokens / full if full else 0.0

    # ---- structure ---------------------------------------------------------------------------
    @property
    def shards_per_rank(self) -> np.ndarray:
        """(cp_size,) int64, shards (= attention segments, one per shard) each rank holds."""
        return np.bincount(self.rank, minlength=self.cp_size).astype(np.int64)

    @property
    def split_docs(self) -> np.ndarray:
        """(k,) int64, documents cut into more than one shard."""
        counts = np.bincount(self.doc, minlength=self.num_docs)
        return np.flatnonzero(counts > 1)

    def ranks(self) -> list[list[Shard]]:
        """Readable view: for each rank, its shards in the order it holds them."""
        out: list[list[Shard]] = [[] for _ in range(self.cp_size)]
        for r, d, s, n in zip(
            self.rank.tolist(), self.doc.tolist(), self.start.tolist(), self.length.tolist(),
            strict=True,
        ):
            out[r].append(Shard(d, s, n))
        return out

    def rank_shards(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(doc, start, length) arrays of rank ``r``'s shards, in local order."""
        off = self.rank_offsets
        sl = slice(int(off[r]), int(off[r + 1]))
        return self.doc[sl], self.start[sl], self.length[sl]

    def digest(self) -> str:
        """A short hash of the layout (cp_size, doc_lens and every shard): ranks compare it before
        their first collective to make sure they execute the same plan."""
        h = hashlib.sha256()
        h.update(np.int64(self.cp_size).tobytes())
        for a in (self.doc_lens, self.rank, self.doc, self.start, self.length):
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        return h.hexdigest()[:16]

    def validate(self) -> None:
        """Check the plan's invariants.

        Every token of every document is held by exactly one rank, shards are non-empty, and every
        rank holds exactly ``context_len / cp_size`` tokens.

        Raises:
            ValueError: naming the first violated invariant.
        """
        n = self.cp_size
        if (self.length <= 0).any():
            i = int(np.argmax(self.length <= 0))
            raise ValueError(f"shard {i} has length {int(self.length[i])} <= 0")
        if ((self.rank < 0) | (self.rank >= n)).any():
            raise ValueError(f"rank ids must be in [0, {n}), got {sorted(set(self.rank.tolist()))}")
        if (np.diff(self.rank) < 0).any():
            raise ValueError("shards must be sorted by rank")
        if ((self.doc < 0) | (self.doc >= self.num_docs)).any():
            raise ValueError("shard refers to a document index out of range")
        if (self.start < 0).any() or (self.start + self.length > self.doc_lens[self.doc]).any():
            i = int(np.argmax((self.start < 0) | (self.start + self.length > self.doc_lens[self.doc])))
            raise ValueError(
                f"shard {i} (doc {int(self.doc[i])}, start {int(self.start[i])}, length "
                f"{int(self.length[i])}) lies outside its document of length "
                f"{int(self.doc_lens[self.doc[i]])}"
            )
        # exact coverage: sorted by (doc, start), pieces must tile each document
        order = np.lexsort((self.start, self.doc))
        d, s, ln = self.doc[order], self.start[order], self.length[order]
        first = np.ones(d.size, dtype=bool)
        first[1:] = d[1:] != d[:-1]
        expected = np.where(first, 0, np.concatenate([[0], s[:-1] + ln[:-1]]))
        if (s != expected).any():
            i = int(np.argmax(s != expected))
            raise ValueError(
                f"document {int(d[i])}: a shard starts at {int(s[i])} but {int(expected[i])} was "
                "expected (tokens missing or held twice)"
            )
        covered = np.zeros(self.num_docs, dtype=np.int64)
        np.add.at(covered, d, ln)
        if (covered != self.doc_lens).any():
            i = int(np.argmax(covered != self.doc_lens))
            raise ValueError(f"document {i}: {int(covered[i])} of {int(self.doc_lens[i])} tokens held")
        tok = self.tokens_per_rank
        if self.context_len % n or (tok != self.context_len // n).any():
            raise ValueError(
                f"every rank must hold context_len / cp_size = {self.context_len / n:g} tokens, "
                f"got {tok.tolist()}"
            )

    def summary(self) -> dict[str, Any]:
        """Scalar metrics of the plan (JSON-serialisable).

        ``comm_tokens`` / ``comm_saving`` are what the plan's *method* moves: Eq. 5 for a
        sharding-aware method (:data:`flashcp.registry.COMM_KIND` ``allgather_sharded``, and any
        unregistered method name), Eq. 4 for full all-gather and ring methods, which move the whole
        KV whatever the layout. ``comm_tokens_sharded`` is Eq. 5 on the layout in every case.
        """
        from flashcp.registry import COMM_KIND

        full = self.comm_tokens_full
        sharded = COMM_KIND.get(self.method, "allgather_sharded") == "allgather_sharded"
        moved = self.comm_tokens if sharded else full
        return {
            "method": self.method,
            "cp_size": self.cp_size,
            "context_len": self.context_len,
            "num_docs": self.num_docs,
            "status": self.status,
            "imbalance_ratio": self.imbalance_ratio,
            "comm_tokens": moved,
            "comm_tokens_full": full,
            "comm_saving": 1.0 - moved / full if full else 0.0,
            "comm_tokens_sharded": self.comm_tokens,
            "num_split_docs": int(self.split_docs.size),
            "max_shards_per_rank": int(self.shards_per_rank.max()),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON view: the summary plus ``ranks = [{rank, tokens, workload, shards: [...]}, ...]``."""
        tok, wl = self.tokens_per_rank, self.workload_per_rank
        out = self.summary()
        out["info"] = self.info
        out["doc_lens"] = self.doc_lens.tolist()
        out["ranks"] = [
            {
                "rank": r,
                "tokens": int(tok[r]),
                "workload": int(wl[r]),
                "shards": [sh._asdict() for sh in shards],
            }
            for r, shards in enumerate(self.ranks())
        ]
        return out


def make_plan(
    method: str,
    cp_size: int,
    doc_lens: np.ndarray,
    rank: Any,
    doc: Any,
    start: Any,
    length: Any,
    *,
    status: str = "ok",
    info: dict | None = None,
    validate: bool = True,
) -> Plan:
    """Build a :class:`Plan` from shard columns given in each rank's local order.

    Rows are stably sorted by rank (keeping each rank's order), empty pieces are dropped, and
    pieces of one rank that continue each other inside a document are merged into one shard at
    the place of the first of them (so a rank holding chunks N-1 and N of a document holds one
    segment, not two, and a rank holding a document's whole tail in pieces sends none of it).

    Args:
        method: planner name stored in the plan.
        cp_size: N.
        doc_lens: (n_docs,) int, document lengths in packed order.
        rank, doc, start, length: (n,) int, one entry per piece.
        status, info: stored as is.
        validate: run :meth:`Plan.validate` (planners call it; hot loops may skip it).
    Raises:
        ValueError: when ``validate`` and an invariant is violated.
    """
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    rank = np.asarray(rank, dtype=np.int64)
    doc = np.asarray(doc, dtype=np.int64)
    start = np.asarray(start, dtype=np.int64)
    length = np.asarray(length, dtype=np.int64)
    keep = length != 0
    if not keep.all():
        rank, doc, start, length = rank[keep], doc[keep], start[keep], length[keep]
    if rank.size > 1 and (np.diff(rank) < 0).any():
        order = np.argsort(rank, kind="stable")
        rank, doc, start, length = rank[order], doc[order], start[order], length[order]
    if rank.size > 1:
        # merge pieces of one rank that continue each other inside a document, wherever they sit
        # in the rank's order: the merged shard takes the place of its first piece
        by = np.lexsort((start, doc, rank))
        r_, d_, s_, n_ = rank[by], doc[by], start[by], length[by]
        cont = (r_[1:] == r_[:-1]) & (d_[1:] == d_[:-1]) & (s_[1:] == s_[:-1] + n_[:-1])
        if cont.any():
            group_sorted = np.cumsum(np.concatenate([[True], ~cont])) - 1
            group = np.empty_like(group_sorted)
            group[by] = group_sorted  # group of each piece, in the given order
            total = np.bincount(group_sorted, weights=n_).astype(np.int64)
            first_start = np.full(total.size, np.iinfo(np.int64).max)
            np.minimum.at(first_start, group_sorted, s_)
            _, keep = np.unique(group, return_index=True)  # first piece of each group, in order
            keep.sort()
            g = group[keep]
            rank, doc, start, length = rank[keep], doc[keep], first_start[g], total[g]
    plan = Plan(method, int(cp_size), doc_lens, rank, doc, start, length, status, dict(info or {}))
    if validate:
        plan.validate()
    return plan
