"""Plan data model: which shards of which documents each CP rank holds, and the metrics of a plan.

A *plan* assigns every token of a packed sequence to exactly one of ``cp_size`` ranks, as *shards*:
contiguous pieces ``(doc, start, length)`` of one document, where ``start`` is also the shard's
prefix length p (tokens of the same document before it). Every rank holds exactly
``context_len / cp_size`` tokens.

Two edge cases every planner shares are handled once, by :func:`planner_entry` (docs/design.md §2):

* *zero-length documents* (``cu_seqlens`` that repeat an offset, as static-shape packing code
  writes them) hold no token, get no shard and change nothing: the plan is the one of the other
  documents, with document indices still those of the caller. All-empty input gives a plan with
  no shard. Only negative lengths are errors.
* *pad tokens*: ``num_pad`` tokens after the last document (or ``pad_to_multiple=True``: the
  fewest that make the total divisible as the layout needs) belong to no document. A rank holds
  its pad tokens after its shards (:attr:`Plan.pad`); they attend to nothing, are attended by
  nothing, cost no workload and are never communicated by the all-gather family.

The plan is stored column-wise (one numpy row per shard, sorted by rank, then by the order in which
the rank holds its shards) so that metrics and the simulator are vectorised; :meth:`Plan.ranks`
gives the readable list-of-shards view.

Formulas (arXiv 2606.08476, "FlashCP", §3; notation in docs/design.md §2):

* workload of a shard, Eq. 3: ``W = (2p + s + 1) * s / 2`` query-key pairs per head; the shards of
  one document sum to ``d (d + 1) / 2``.
* ``imbalance_ratio = max_r W_r / mean_r W_r``.
* ``comm_tokens_full`` (Eq. 4): ``(N - 1) * C / N`` KV tokens received per rank when the whole KV
  is all-gathered (with pad tokens, which are not sent: ``(N - 1) * max_r`` document tokens of
  rank r).
* ``comm_tokens`` (Eq. 5): ``(N - 1) * max_j sum(len of rank j's shards that are not the last shard
  of their document)`` for sharding-aware all-gather; a document kept whole costs nothing.
"""

from flashcp.plan.build import (
    buffer_plan,
    fused_args,
    fused_plan,
    packed_plan,
    planner_entry,
)
from flashcp.plan.checks import (
    MAX_CP_SIZE,
    MAX_TOKENS,
    DivisibilityError,
    check_context_len,
    check_cp_args,
    check_doc_lens,
    cu_seqlens,
    doc_workload,
    json_value,
    kv_bytes,
    shard_workload,
)
from flashcp.plan.model import (
    Plan,
    Shard,
    make_plan,
)

__all__ = [
    "MAX_CP_SIZE",
    "MAX_TOKENS",
    "DivisibilityError",
    "Plan",
    "Shard",
    "buffer_plan",
    "check_context_len",
    "check_cp_args",
    "check_doc_lens",
    "cu_seqlens",
    "doc_workload",
    "fused_args",
    "fused_plan",
    "json_value",
    "kv_bytes",
    "make_plan",
    "packed_plan",
    "planner_entry",
    "shard_workload",
]
