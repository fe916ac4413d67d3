"""One packed batch cut into a rank's share: tokens, labels, positions and the op's metadata.

Labels are shifted on the packed sequence, inside each document, *before* sharding: a rank's
shard boundary then never decides a target (shifting a rank's local tokens instead gives the token
before every shard cut the first token of the next shard, often another document's, or nothing).
Positions restart at 0 at each document start and continue across a shard cut (a shard's first
position is its offset in the document).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flashcp.ops import get_attn_op
from flashcp.ops.collectives import group_rank, group_size, plan_on_one_rank, resolve_group
from flashcp.ops.sharding import global_rows, position_ids, shard_tensor
from flashcp.plan import Plan, check_doc_lens, cu_seqlens
from flashcp.registry import make_plan_for

__all__ = [
    "IGNORE_INDEX",
    "RankBatch",
    "doc_positions",
    "plan_and_shard",
    "shard_batch",
    "shift_labels",
]

#: the label of tokens that have no next-token target (a document's last token, pad); PyTorch's
#: ``cross_entropy`` default
IGNORE_INDEX = -100


def _check_batch(input_ids: Any, doc_lens: Any) -> tuple[torch.Tensor, np.ndarray]:
    """``input_ids`` as a 1-D int64 tensor and ``doc_lens`` as int64, or a ValueError."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise ValueError(f"input_ids must be a 1-D tensor (C,), got {shape}")
    if input_ids.dtype != torch.int64:
        raise ValueError(f"input_ids must be int64, got {input_ids.dtype}")
    c = int(input_ids.shape[0])
    lens = check_doc_lens(doc_lens)
    if int(lens.sum()) > c:
        raise ValueError(f"doc_lens sum to {int(lens.sum())}, more than the {c} input_ids")
    return input_ids, lens


def shift_labels(
    input_ids: torch.Tensor, doc_lens: Sequence[int], *, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Next-token labels of a packed sequence, shifted inside each document.

    Args:
        input_ids: (C,) int64, the documents' tokens one after another, then pad.
        doc_lens: (n_docs,) int >= 0, summing to at most C (the rest is pad).
        ignore_index: label of a document's last token and of pad.
    Returns:
        (C,) int64: ``labels[i] = input_ids[i + 1]`` when tokens i and i + 1 are in one document,
        else ``ignore_index``.
    Raises:
        ValueError: ``input_ids`` not 1-D int64, negative lengths, or lengths summing past C.
    """
    input_ids, lens = _check_batch(input_ids, doc_lens)
    labels = torch.full_like(input_ids, ignore_index)
    n = int(lens.sum())
    if n > 1:
        labels[: n - 1] = input_ids[1:n]
    ends = np.cumsum(lens)[lens > 0] - 1  # each non-empty document's last token
    labels[torch.from_numpy(ends)] = ignore_index
    return labels


def doc_positions(doc_lens: Sequence[int], context_len: int) -> torch.Tensor:
    """Position of every packed token inside its document (0 for pad), for RoPE.

    Args:
        doc_lens: (n_docs,) int >= 0 summing to at most ``context_len``.
    Returns:
        (context_len,) int64.
    Raises:
        ValueError: negative lengths or lengths summing past ``context_len``.
    """
    lens = check_doc_lens(doc_lens)
    n = int(lens.sum())
    if n > context_len:
        raise ValueError(f"doc_lens sum to {n}, more than context_len = {context_len}")
    starts = np.cumsum(lens) - lens
    pos = np.arange(n, dtype=np.int64) - np.repeat(starts, lens)
    return torch.from_numpy(np.concatenate([pos, np.zeros(context_len - n, dtype=np.int64)]))


@dataclass(eq=False)
class RankBatch:
    """One rank's share of a packed batch, in the plan's local order (T = C / N rows).

    Attributes:
        input_ids: (T,) int64 tokens.
        labels: (T,) int64 next-token targets, ``IGNORE_INDEX`` where none.
        positions: (T,) int64 positions inside documents (0 for pad).
        meta: what the method's ``prepare(plan, rank)`` returns, for every layer's attention.
        plan: the plan; rank: this rank in the CP group.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    meta: Any
    plan: Plan
    rank: int

    @property
    def num_valid(self) -> int:
        """Tokens of this rank with a label (the loss's local count)."""
        return int((self.labels != IGNORE_INDEX).sum())


def shard_batch(
    input_ids: torch.Tensor,
    doc_lens: Sequence[int],
    plan: Plan,
    rank: int,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> RankBatch:
    """Rank ``rank``'s tokens, labels, positions and op metadata under ``plan`` (no collective).

    Args:
        input_ids: (C,) int64 packed tokens (documents, then ``C - sum(doc_lens)`` pad).
        doc_lens: (n_docs,) int >= 0, the lengths ``plan`` was made for (zero-length allowed).
        plan: a plan of those lengths with ``C - sum(doc_lens)`` pad tokens.
        rank: this rank in the CP group, in ``[0, plan.cp_size)``.
    Returns:
        :class:`RankBatch` of T = C / N rows on ``input_ids``' device.
    Raises:
        ValueError: bad ``input_ids`` or ``doc_lens``, a plan of other lengths, another pad count
            or another context length, a bad rank, or what the method's ``prepare`` raises.
    """
    input_ids, lens = _check_batch(input_ids, doc_lens)
    if not isinstance(plan, Plan):
        raise ValueError(f"plan must be a flashcp.plan.Plan, got {type(plan).__name__}")
    if not np.array_equal(np.asarray(plan.doc_lens), lens):
        raise ValueError(
            f"the plan was made for doc_lens {plan.doc_lens.tolist()}, not {lens.tolist()}"
        )
    c = int(input_ids.shape[0])
    if plan.context_len != c:
        raise ValueError(
            f"the plan covers context_len = {plan.context_len} (with {plan.num_pad} pad), "
            f"but input_ids has {c} tokens ({c - int(lens.sum())} pad)"
        )
    if (
        isinstance(rank, bool)
        or not isinstance(rank, int | np.integer)
        or not (0 <= rank < plan.cp_size)
    ):
        raise ValueError(f"rank must be an integer in [0, {plan.cp_size}), got {rank!r}")
    rank = int(rank)
    prepare, _ = get_attn_op(plan.method)
    meta = prepare(plan, rank)
    return RankBatch(
        input_ids=shard_tensor(input_ids, plan, rank),
        labels=_rank_labels(input_ids, plan, rank, ignore_index),
        positions=position_ids(plan, rank).to(input_ids.device),
        meta=meta,
        plan=plan,
        rank=rank,
    )


def _rank_labels(input_ids: torch.Tensor, plan: Plan, rank: int, ignore_index: int) -> torch.Tensor:
    """``shard_tensor(shift_labels(input_ids, plan.doc_lens), plan, rank)`` without shifting the
    whole batch: a local row's label is the next packed token, except on the last row of a shard
    that ends its document and on pad rows (``ignore_index``).

    Returns:
        (C / N,) int64 on ``input_ids``' device.
    """
    rows = global_rows(plan, rank)
    doc, start, length = plan.rank_shards(rank)
    ignore = np.zeros(rows.size, dtype=bool)
    ignore[(cu_seqlens(length)[1:] - 1)[start + length == plan.doc_lens[doc]]] = True
    ignore[int(length.sum()) :] = True  # pad rows
    nxt = np.where(ignore, 0, rows + 1)
    labels = input_ids.index_select(0, torch.from_numpy(nxt).to(input_ids.device))
    return labels.masked_fill_(torch.from_numpy(ignore).to(input_ids.device), ignore_index)


def plan_and_shard(
    input_ids: torch.Tensor,
    doc_lens: Sequence[int],
    method: str,
    group=None,
    *,
    ignore_index: int = IGNORE_INDEX,
    **plan_options,
) -> RankBatch:
    """Plan the batch once per CP group (on its rank 0, broadcast) and take this rank's share.

    Every rank of ``group`` calls it with the same ``input_ids`` and ``doc_lens``; the pad count
    ``C - sum(doc_lens)`` goes to the planner as ``num_pad``.

    Args:
        input_ids: (C,) int64 packed tokens; doc_lens: (n_docs,) int >= 0.
        method: a registered method (:func:`flashcp.registry.method_names`).
        group: the CP group (None: the default group; a ProcessGroup or 1-D DeviceMesh).
        plan_options: the planner's options (:func:`flashcp.registry.make_plan_for`).
    Returns:
        :class:`RankBatch` for this process's rank in ``group``.
    Raises:
        ValueError: bad ``input_ids`` / ``doc_lens`` (before any collective), or as
            :func:`shard_batch`.
        flashcp.ops.collectives.PlanningFailed: the planner raised (on every rank).
    """
    input_ids, lens = _check_batch(input_ids, doc_lens)
    group = resolve_group(group)
    num_pad = int(input_ids.shape[0]) - int(lens.sum())
    n = group_size(group)
    plan = plan_on_one_rank(
        lambda: make_plan_for(method, lens, n, num_pad=num_pad, **plan_options), group
    )
    return shard_batch(input_ids, lens, plan, group_rank(group), ignore_index=ignore_index)
