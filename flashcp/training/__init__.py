"""Context parallelism inside a training step: the per-rank batch, the loss and the gradients.

* :mod:`flashcp.training.batch`: from one packed batch (``input_ids``, document lengths) and a
  plan, each rank's tokens, next-token labels (shifted inside each document *before* sharding),
  positions inside documents and the op's metadata (:func:`shard_batch`, :func:`plan_and_shard`).
* :mod:`flashcp.training.loss`: cross-entropy summed over a rank's valid tokens and divided by the
  valid tokens of the whole CP (and data-parallel) group (:func:`cp_cross_entropy`), and the SUM
  all-reduce of parameter gradients (:func:`allreduce_grads`) that then gives the one-device
  gradient with no rescaling.
* :mod:`flashcp.training.attention`: the attention callables a model calls per layer (a CP op on
  a rank's batch, or the float64 document-masked reference on one device).
* :mod:`flashcp.training.model`: a small Llama-style model (RoPE on document positions, GQA,
  RMSNorm, SwiGLU) that takes either.

Recipe and derivation: docs/training.md.
"""

from __future__ import annotations

from flashcp.training.attention import CPAttention, OneDeviceAttention
from flashcp.training.batch import (
    IGNORE_INDEX,
    RankBatch,
    doc_positions,
    plan_and_shard,
    shard_batch,
    shift_labels,
)
from flashcp.training.loss import allreduce_grads, cp_cross_entropy

__all__ = [
    "IGNORE_INDEX",
    "CPAttention",
    "OneDeviceAttention",
    "RankBatch",
    "allreduce_grads",
    "cp_cross_entropy",
    "doc_positions",
    "plan_and_shard",
    "shard_batch",
    "shift_labels",
]
