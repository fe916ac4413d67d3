"""The plan (:class:`Plan`: shards ``(doc, start, length)`` per rank, its metrics and
validation) and :func:`make_plan`, which builds one from its shard columns (:mod:`flashcp.plan`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import operator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from flashcp import compiled
from flashcp.kinds import CommKind
from flashcp.plan.checks import check_doc_lens, cu_seqlens, json_value, shard_workload


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
        """Query-key pairs per head, Eq. 3: (2p + s + 1) s / 2 (:func:`shard_workload`)."""
        return shard_workload(self.start, self.length)


@dataclass(frozen=True, eq=False)
class Plan:
    """A CP plan: shards per rank, stored column-wise.

    Attributes:
        method: planner name (``llama3``, ``per_doc``, ``ring``, ``zigzag``, ``flashcp``, ...).
        cp_size: N, number of CP ranks.
        doc_lens: (n_docs,) int64, document lengths in packed order (zero-length documents hold
            no shard); they sum to ``context_len - num_pad``.
        rank, doc, start, length: (n_shards,) int64 each; shard i is held by ``rank[i]`` and
            covers tokens ``[start[i], start[i] + length[i])`` of document ``doc[i]``. Rows are
            sorted by rank, then by the order in which the rank holds them (its local layout).
        status: ``"ok"`` or a planner-specific status (e.g. ``"target_not_met"``, ``"fallback"``).
        info: planner-specific details, e.g. FlashCP's Per-Doc set; stored as plain JSON
            types (:func:`json_value` converts NumPy scalars and tuples at construction), so
            ``json.dumps(plan.to_dict())`` works for every plan. A key ending in ``_docs`` holds
            a list of document indices (:func:`planner_entry` maps it back to the caller's
            documents).
        pad: (cp_size,) int64, pad tokens each rank holds after its shards (default none). The
            packed sequence's ``num_pad`` pad tokens come after its last document; rank r's are
            pad positions ``sum(pad[:r]) ..`` of them (:func:`flashcp.ops.sharding.global_rows`).

    Build with :func:`make_plan`, which validates and merges adjacent pieces; read a
    :meth:`to_dict` back with :meth:`from_dict`. Two plans are equal (``==``) when every field
    is (``info`` compared as JSON).
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
    pad: np.ndarray | None = None

    def __post_init__(self) -> None:
        pad = np.zeros(self.cp_size, np.int64) if self.pad is None else self.pad
        object.__setattr__(self, "pad", np.asarray(pad, dtype=np.int64))
        object.__setattr__(self, "cp_size", operator.index(self.cp_size))
        object.__setattr__(self, "info", json_value(dict(self.info), "plan.info"))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return (
            (self.method, self.cp_size, self.status) == (other.method, other.cp_size, other.status)
            and all(
                np.array_equal(a, b) for a, b in zip(self._columns(), other._columns(), strict=True)
            )
            and json.dumps(self.info, sort_keys=True) == json.dumps(other.info, sort_keys=True)
        )

    def __hash__(self) -> int:
        return hash((self.method, self.status, self.digest()))

    def _columns(self) -> tuple[np.ndarray, ...]:
        return (self.doc_lens, self.rank, self.doc, self.start, self.length, self.pad)

    # ---- sizes -------------------------------------------------------------------------------
    @functools.cached_property
    def context_len(self) -> int:
        """C, total tokens of the packed sequence: document tokens plus ``num_pad`` (computed once:
        a plan's arrays are not changed after it is built)."""
        return int(self.doc_lens.sum()) + self.num_pad

    @functools.cached_property
    def num_pad(self) -> int:
        """Pad tokens of the packed sequence (after its last document; no document's)."""
        return int(self.pad.sum())

    @property
    def num_docs(self) -> int:
        """Documents of ``doc_lens``, zero-length ones included."""
        return int(self.doc_lens.size)

    @property
    def num_shards(self) -> int:
        return int(self.rank.size)

    @property
    def num_pieces(self) -> int:
        """Pieces the documents are cut into: one per shard, so the number of non-empty documents
        when none is cut; each cut adds one (a piece is one attention segment, and a non-last
        piece's KV is sent to the ranks holding later ones)."""
        return self.num_shards

    @functools.cached_property
    def _rank_sums(self) -> _RankSums | None:
        """Per-rank sums from one compiled pass (:func:`flashcp.plan.kernels.rank_sums`), or None:
        the properties then use NumPy. A fused planner (:func:`fused_plan`) sets them, with the
        metrics, when it builds the plan."""
        kernels = compiled.load("plan")
        if kernels is None or not _int64_arrays(self.doc_lens, *self._columns()[1:]):
            return None
        status, sums, stats = kernels.plan_stats(
            self.cp_size, self.doc_lens, self.rank, self.doc, self.start, self.length, self.pad
        )
        if not status:
            return None
        counts = sums[_COUNT_ROWS].astype(np.int64).reshape(-1)
        if status == 1:  # a context too long for exact integer metrics: the sums only
            return _RankSums(counts, sums[1])
        max_tokens, max_send, max_work, total_work, any_work, num_split, max_shards = stats.tolist()
        return _RankSums(
            counts, sums[1], max_tokens, max_send, max_work, total_work, bool(any_work),
            num_split, max_shards,
        )  # fmt: skip

    def __getstate__(self) -> dict[str, Any]:
        """Pickle (and copy) without the digest buffer of a fused planner: the copy's arrays are
        no views of it (:meth:`digest` hashes them one by one)."""
        return {k: v for k, v in self.__dict__.items() if k != "_packed"}

    @property
    def doc_tokens_per_rank(self) -> np.ndarray:
        """(cp_size,) int64, document (non-pad) tokens held by each rank."""
        if self._rank_sums is not None:
            return self._rank_sums.counts[: self.cp_size].copy()
        return np.bincount(self.rank, weights=self.length, minlength=self.cp_size).astype(np.int64)

    @property
    def tokens_per_rank(self) -> np.ndarray:
        """(cp_size,) int64, tokens held by each rank, pad included (all C/N in a valid plan)."""
        return self.doc_tokens_per_rank + self.pad

    @property
    def rank_offsets(self) -> np.ndarray:
        """(cp_size + 1,) int64: shards of rank r are rows ``rank_offsets[r]:rank_offsets[r+1]``."""
        counts = np.bincount(self.rank, minlength=self.cp_size)
        return cu_seqlens(counts)

    # ---- workload ----------------------------------------------------------------------------
    @property
    def shard_workload(self) -> np.ndarray:
        """(n_shards,) int64, Eq. 3 per shard."""
        return shard_workload(self.start, self.length)

    @property
    def workload_per_rank(self) -> np.ndarray:
        """(cp_size,) float64, query-key pairs per head each rank computes: the sum of Eq. 3 over
        its shards; in a head-parallel plan (:attr:`ulysses_degree` u > 1) every rank of a group
        attends over all of its group's tokens for 1/u of the heads, so the group's sum / u."""
        if self._rank_sums is not None:
            w = np.array(self._rank_sums.work, dtype=np.float64)  # a copy (int64 when fused)
        else:
            w = np.bincount(self.rank, weights=self.shard_workload, minlength=self.cp_size)
            w = w.astype(np.float64, copy=False)  # bincount of no shard is int64
        u = self.ulysses_degree
        if u == 1:
            return w
        return np.repeat(w.reshape(-1, u).mean(axis=1), u)

    @property
    def imbalance_ratio(self) -> float:
        """max over ranks of workload / mean over ranks of workload (1.0 is perfect; 1.0 also
        when there is no work at all)."""
        sums = self._rank_sums
        if sums is not None and sums.max_work is not None and self.ulysses_degree == 1:
            # exact integers below 2^53: the same divisions as below, in Python floats
            return sums.max_work / (sums.total_work / self.cp_size) if sums.any_work else 1.0
        w = self.workload_per_rank
        # w.sum() / w.size is w.mean() (the same sum, then the same division), without its wrapper
        return float(w.max() / (w.sum() / w.size)) if w.any() else 1.0

    # ---- head parallelism (docs/design.md §3; flashcp.plan.head_parallel) ---------------------------
    @property
    def ulysses_degree(self) -> int:
        """u, ranks of a head-parallel (Ulysses) group: ``info["ulysses_degree"]``, 1 (no head
        parallelism) when absent. Ranks ``g u .. g u + u - 1`` form group g."""
        return int(self.info.get("ulysses_degree", 1))

    def group_plan(self) -> Plan:
        """The plan of the ``cp_size / u`` head-parallel groups as super-ranks (group g holds its
        ranks' shards, in rank order; pieces that continue each other merge), with u = 1 in its
        ``info``; ``self`` when u = 1. Its shards are the attention segments every rank of the
        group computes (for its heads), and its metrics are those of the communication across
        groups."""
        u = self.ulysses_degree
        if u == 1:
            return self
        info = {**self.info, "ulysses_degree": 1}
        pad = self.pad.reshape(-1, u).sum(axis=1)
        return make_plan(
            self.method, self.cp_size // u, self.doc_lens, self.rank // u, self.doc, self.start,
            self.length, status=self.status, info=info, pad=pad, validate=False,
        )  # fmt: skip

    # ---- communication -----------------------------------------------------------------------
    @property
    def is_last(self) -> np.ndarray:
        """(n_shards,) bool, True where the shard ends its document (its KV is needed by nobody else)."""
        return self.start + self.length == self.doc_lens[self.doc]

    @property
    def send_tokens_per_rank(self) -> np.ndarray:
        """(cp_size,) int64, tokens of each rank's non-last shards: its share of the compact
        sharding-aware all-gather buffer (Eq. 5)."""
        if self._rank_sums is not None:
            n = self.cp_size
            return self._rank_sums.counts[n : 2 * n].copy()
        w = np.where(self.is_last, 0, self.length)
        return np.bincount(self.rank, weights=w, minlength=self.cp_size).astype(np.int64)

    @property
    def comm_tokens(self) -> int:
        """Eq. 5: KV tokens each rank receives under sharding-aware all-gather, per K or V, per KV
        head, per pass: (N - 1) * max_j (non-last tokens of rank j). An all-gather pads every
        rank's contribution to the largest one."""
        sums = self._rank_sums
        if sums is not None and sums.max_send is not None:
            return (self.cp_size - 1) * sums.max_send
        return int((self.cp_size - 1) * self.send_tokens_per_rank.max())

    @property
    def comm_tokens_full(self) -> int:
        """Eq. 4: (N - 1) * C / N KV tokens received per rank when the whole KV is all-gathered.

        Pad tokens are not sent: with pad, every rank's contribution is its document tokens,
        padded (as all-gather buffers are) to the largest rank's, ``(N - 1) * max_r`` of them.
        """
        sums = self._rank_sums
        if sums is not None and sums.max_tokens is not None:
            return (self.cp_size - 1) * sums.max_tokens
        return (self.cp_size - 1) * int(self.doc_tokens_per_rank.max())

    @property
    def moves_kv_tokens(self) -> bool:
        """Whether the KV-token metrics (Eq. 4 / Eq. 5, :meth:`summary`) describe this plan's
        communication: False for a head-parallel plan of one group (u = N > 1: ``ulysses``, a
        hybrid with ``ulysses_degree`` = N), which moves q, k, v and the output by all-to-all
        and no KV by all-gather or ring."""
        return not (self.ulysses_degree > 1 and self.ulysses_degree == self.cp_size)

    def single_device_documents(self) -> np.ndarray | None:
        """At cp_size 1, the documents' lengths in local row order when the one rank holds every
        document whole (every registry planner's plan at N = 1): the ``cu_seqlens`` of one plain
        document-masked call, which the ops run and the step model prices at cp_size 1 (no CP
        work); None for any other plan (N > 1, or a document in pieces).

        Returns:
            (n_docs,) int64 lengths of the non-empty documents, or None.
        """
        if self.cp_size != 1:
            return None
        doc, start, length = self.rank_shards(0)
        whole = (start == 0) & (length == self.doc_lens[doc])
        return length.astype(np.int64) if bool(whole.all()) else None

    @property
    def comm_saving(self) -> float:
        """1 - comm_tokens / comm_tokens_full (0 when N = 1)."""
        full = self.comm_tokens_full
        return 1.0 - self.comm_tokens / full if full else 0.0

    # ---- structure ---------------------------------------------------------------------------
    @property
    def shards_per_rank(self) -> np.ndarray:
        """(cp_size,) int64, shards (= attention segments, one per shard) each rank holds."""
        if self._rank_sums is not None:
            n = self.cp_size
            return self._rank_sums.counts[2 * n :].copy()
        return np.bincount(self.rank, minlength=self.cp_size).astype(np.int64)

    @property
    def max_shards_per_rank(self) -> int:
        """The most shards (attention segments) one rank holds (0 for a plan with no shard)."""
        sums = self._rank_sums
        if sums is not None and sums.max_shards is not None:
            return sums.max_shards
        return int(self.shards_per_rank.max())

    @property
    def num_split_docs(self) -> int:
        """Documents cut into more than one shard (the size of :attr:`split_docs`)."""
        sums = self._rank_sums
        if sums is not None and sums.num_split is not None:
            return sums.num_split
        return int(self.split_docs.size)

    @property
    def split_docs(self) -> np.ndarray:
        """(k,) int64, documents cut into more than one shard."""
        counts = np.bincount(self.doc, minlength=self.num_docs)
        return np.flatnonzero(counts > 1)

    def ranks(self) -> list[list[Shard]]:
        """Readable view: for each rank, its shards in the order it holds them."""
        out: list[list[Shard]] = [[] for _ in range(self.cp_size)]
        for r, d, s, n in zip(
            self.rank.tolist(),
            self.doc.tolist(),
            self.start.tolist(),
            self.length.tolist(),
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
        packed = self.__dict__.get("_packed")
        if packed is not None:  # a fused planner's plan: these bytes, in this order, in one buffer
            return hashlib.sha256(packed).hexdigest()[:16]
        h = hashlib.sha256()
        h.update(np.int64(self.cp_size).tobytes())
        for a in (self.doc_lens, self.rank, self.doc, self.start, self.length, self.pad):
            if not (a.dtype == np.int64 and a.flags.c_contiguous):
                a = np.ascontiguousarray(a, dtype=np.int64)
            h.update(a)  # the buffer itself: its bytes, not a copy
        return h.hexdigest()[:16]

    def validate(self) -> None:
        """Check the plan's invariants.

        Every token of every document is held by exactly one rank, shards are non-empty, pad
        counts are non-negative, and every rank holds exactly ``context_len / cp_size`` tokens
        (shards plus pad).

        Raises:
            ValueError: naming the first violated invariant.
        """
        kernels = compiled.load("plan")
        fast = kernels is not None and _int64_arrays(self.doc_lens, *self._columns()[1:])
        if fast and kernels.plan_ok(self.cp_size, *self._columns()):
            return
        self._validate_reference()
        if fast:  # the compiled check and this one disagree: a bug in one of them
            raise RuntimeError(f"plan_ok rejected a plan Plan.validate accepts: {self.to_dict()}")

    def _validate_reference(self) -> None:
        """:meth:`validate` in NumPy, naming the first violated invariant (ValueError)."""
        n = self.cp_size
        if self.pad.shape != (n,) or (self.pad < 0).any():
            raise ValueError(f"pad must be {n} counts >= 0 (one per rank), got {self.pad.tolist()}")
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
            i = int(
                np.argmax((self.start < 0) | (self.start + self.length > self.doc_lens[self.doc]))
            )
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
            raise ValueError(
                f"document {i}: {int(covered[i])} of {int(self.doc_lens[i])} tokens held"
            )
        tok = self.tokens_per_rank
        if self.context_len % n or (tok != self.context_len // n).any():
            raise ValueError(
                f"every rank must hold context_len / cp_size = {self.context_len / n:g} tokens, "
                f"got {tok.tolist()}"
            )

    def summary(self, comm_kind: CommKind | str = CommKind.ALLGATHER_SHARDED) -> dict[str, Any]:
        """Scalar metrics of the plan (JSON-serialisable).

        ``comm_tokens``, ``comm_tokens_full``, ``comm_saving`` and ``comm_tokens_sharded`` are
        None where these KV-token metrics do not apply (:attr:`moves_kv_tokens` False: a
        head-parallel plan of one group, whose data moves by all-to-all only; its bytes are
        :func:`flashcp.comm.comm_volume`'s). Otherwise ``comm_tokens`` / ``comm_saving`` are what
        the plan's method moves, given its
        ``comm_kind`` (:class:`flashcp.kinds.CommKind`; the caller supplies it, e.g.
        :func:`flashcp.registry.comm_kind_of` ``(plan.method)``, so the data model reads no
        registry): Eq. 5 for sharding-aware all-gather (the default), Eq. 4 for full all-gather
        and ring methods, which move the whole KV whatever the layout. ``comm_tokens_sharded`` is
        Eq. 5 on the layout in every case.
        A head-parallel plan (:attr:`ulysses_degree` u > 1) reports these, and its pieces, on its
        :meth:`group_plan`: the KV moved across groups (tokens of 1/u of the KV heads, the
        all-to-alls not counted) and the segments the kernels see.

        Raises:
            ValueError: unknown ``comm_kind``.
        """
        # a head-parallel plan moves KV across its groups only: the group plan's tokens (each for
        # 1/u of the KV heads); its all-to-alls are bytes (flashcp.comm.comm_volume), not KV tokens
        across = self.group_plan()
        full = across.comm_tokens_full
        try:
            sharded = CommKind(comm_kind) is CommKind.ALLGATHER_SHARDED
        except ValueError:
            raise ValueError(
                f"unknown comm_kind {comm_kind!r}; choose one of {', '.join(CommKind)}"
            ) from None
        moved = across.comm_tokens if sharded else full
        applies = self.moves_kv_tokens
        return {
            "method": self.method,
            "cp_size": self.cp_size,
            "context_len": self.context_len,
            "num_docs": self.num_docs,
            "num_pad": self.num_pad,
            "status": self.status,
            "imbalance_ratio": self.imbalance_ratio,
            "comm_tokens": moved if applies else None,
            "comm_tokens_full": full if applies else None,
            "comm_saving": (1.0 - moved / full if full else 0.0) if applies else None,
            "comm_tokens_sharded": across.comm_tokens if applies else None,
            "num_split_docs": across.num_split_docs,
            "num_pieces": across.num_pieces,
            "max_shards_per_rank": across.max_shards_per_rank,
        }

    def to_dict(self, comm_kind: CommKind | str = CommKind.ALLGATHER_SHARDED) -> dict[str, Any]:
        """JSON view: the :meth:`summary` (for ``comm_kind``) plus ``info``, ``doc_lens`` and
        ``ranks = [{rank, tokens, pad, workload, shards: [{doc, start, length}, ...]}, ...]``.

        Plain Python types only: ``json.dumps(plan.to_dict())`` works for every plan, and
        :meth:`from_dict` reads it (or its ``json.loads``) back to an equal plan."""
        tok, wl = self.tokens_per_rank, self.workload_per_rank
        out = self.summary(comm_kind)
        out["info"] = self.info
        out["doc_lens"] = self.doc_lens.tolist()
        out["ranks"] = [
            {
                "rank": r,
                "tokens": int(tok[r]),
                "pad": int(self.pad[r]),
                "workload": int(wl[r]),
                "shards": [sh._asdict() for sh in shards],
            }
            for r, shards in enumerate(self.ranks())
        ]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, validate: bool = True) -> Plan:
        """The plan a :meth:`to_dict` describes (e.g. after ``json.loads(json.dumps(...))``).

        Reads ``method``, ``cp_size``, ``doc_lens``, ``status``, ``info`` and ``ranks`` (each
        rank's ``shards`` in its local order and its ``pad``); the summary metrics are derived,
        not read.

        Args:
            data: a mapping as :meth:`to_dict` returns it.
            validate: check the plan's invariants (:meth:`validate`).
        Returns:
            a :class:`Plan` equal to the one ``data`` was made from.
        Raises:
            ValueError: a missing key, ranks out of order or not ``cp_size`` of them, or (with
                ``validate``) a plan that violates an invariant; the message names the value.
        """
        try:
            method, cp_size, ranks = data["method"], data["cp_size"], data["ranks"]
            doc_lens = data["doc_lens"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"a plan dict needs {exc} (keys of Plan.to_dict)") from None
        if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
            raise ValueError(f"cp_size must be an integer >= 1, got {cp_size!r}")
        if [r.get("rank") for r in ranks] != list(range(cp_size)):
            raise ValueError(
                f"ranks must list ranks 0..{cp_size - 1} in order, got "
                f"{[r.get('rank') for r in ranks]}"
            )
        try:
            rows = [
                (r, int(sh["doc"]), int(sh["start"]), int(sh["length"]))
                for r, entry in enumerate(ranks)
                for sh in entry["shards"]
            ]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"every rank's shards need doc, start and length: {exc!r}") from None
        cols = np.array(rows, dtype=np.int64).reshape(-1, 4).T
        plan = cls(
            str(method),
            cp_size,
            check_doc_lens(doc_lens),
            *cols,
            status=str(data.get("status", "ok")),
            info=dict(data.get("info") or {}),
            pad=np.array([int(r.get("pad", 0)) for r in ranks], dtype=np.int64),
        )
        if validate:
            plan.validate()
        return plan


#: rows of :func:`flashcp.plan.kernels.rank_sums`'s sums that are counts: doc tokens, send tokens,
#: shards (row 1 is the workload)
_COUNT_ROWS = [0, 2, 3]


class _RankSums(NamedTuple):
    """A plan's per-rank sums (:attr:`Plan._rank_sums`): ``counts`` (3 N,) int64, the doc tokens,
    send tokens and shards of ranks 0..N-1 one after the other, ``work`` (N,), the workloads
    (float64; int64, exact, from a fused planner), and, computed with them as exact integers
    where the context has at most :data:`flashcp.plan.kernels.EXACT_TOKENS` tokens (else None),
    the maxima of the doc and send tokens and of the workloads, the total workload, whether any
    rank has work (u = 1), the documents cut into more than one shard and the most shards on a
    rank."""

    counts: np.ndarray
    work: np.ndarray
    max_tokens: int | None = None
    max_send: int | None = None
    max_work: int | None = None
    total_work: int | None = None
    any_work: bool | None = None
    num_split: int | None = None
    max_shards: int | None = None


def _int64_arrays(*arrays: Any) -> bool:
    """True when every argument is a 1-D C-contiguous int64 ndarray (what the compiled kernels are
    compiled for: a strided view would compile another specialisation on its first call)."""
    return all(
        type(a) is np.ndarray and a.dtype == np.int64 and a.ndim == 1 and a.flags.c_contiguous
        for a in arrays
    )


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
    pad: Any = None,
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
        pad: (cp_size,) int, pad tokens of each rank (default none).
        validate: run :meth:`Plan.validate` (planners call it; hot loops may skip it).
    Raises:
        ValueError: when ``validate`` and an invariant is violated.
    """
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    rank = np.asarray(rank, dtype=np.int64)
    doc = np.asarray(doc, dtype=np.int64)
    start = np.asarray(start, dtype=np.int64)
    length = np.asarray(length, dtype=np.int64)
    kernels = compiled.load("plan")
    merged = False
    if (
        kernels is not None
        and rank.ndim == doc.ndim == start.ndim == length.ndim == 1
        and rank.size == doc.size == start.size == length.size
    ):
        merged, cols = kernels.merge_pieces(rank, doc, start, length)
        rank, doc, start, length = cols
    else:
        keep = length != 0
        if not keep.all():
            rank, doc, start, length = rank[keep], doc[keep], start[keep], length[keep]
        if rank.size > 1 and (np.diff(rank) < 0).any():
            order = np.argsort(rank, kind="stable")
            rank, doc, start, length = rank[order], doc[order], start[order], length[order]
    if rank.size > 1 and not merged:
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
    plan = Plan(
        method, int(cp_size), doc_lens, rank, doc, start, length, status, dict(info or {}), pad
    )
    if validate:
        plan.validate()
    return plan
