"""The attention a model layer calls: ``attention(q, k, v) -> out``, on one rank or one device.

``q: (T, H, D)``, ``k, v: (T, Hkv, D)`` (``H % Hkv == 0``) -> ``out: (T, H, D)`` in q's dtype,
document-masked causal attention over the tokens' documents. The same model code runs either.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from flashcp.ops import get_attn_op
from flashcp.ops.reference import reference_attention
from flashcp.plan import check_doc_lens
from flashcp.training.batch import RankBatch

__all__ = ["CPAttention", "OneDeviceAttention"]


class CPAttention:
    """The plan's CP op on one rank's batch (one collective pattern per layer call).

    Args:
        batch: this rank's :class:`~flashcp.training.batch.RankBatch` (its metadata and method).
        group: the CP group the plan was made for (None: the default group; a 2-D group of
            :func:`flashcp.ops.hybrid_attn.hybrid_groups` for ``usp`` / ``flashcp_ulysses``
            works too).
        backend: kernel backend (``"reference"``: float64 end to end; ``"cpu"``, ``"auto"``).
        op_options: further keywords of the op (``softmax_scale``, ``grad_comm_dtype``, ...).
    """

    def __init__(self, batch: RankBatch, group=None, *, backend="auto", **op_options) -> None:
        if not isinstance(batch, RankBatch):
            raise ValueError(f"batch must be a RankBatch, got {type(batch).__name__}")
        self.meta = batch.meta
        self.group = group
        self.backend = backend
        self.op_options = op_options
        self._attn = get_attn_op(batch.plan.method)[1]

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **overrides
    ) -> torch.Tensor:
        """``out = attention(q, k, v)``; keywords (e.g. ``softmax_scale``) override the op's."""
        options = {**self.op_options, **overrides}
        return self._attn(q, k, v, self.meta, self.group, backend=self.backend, **options)


class OneDeviceAttention:
    """Document-masked causal attention over a whole packed sequence on one device: the float64
    reference (:func:`flashcp.ops.reference.reference_attention`), rounded to q's dtype; pad rows
    attend to nothing and give 0, as in the CP ops.

    Args:
        doc_lens: (n_docs,) int >= 0; context_len: C, the packed length (the rest is pad).
        softmax_scale: default ``1 / sqrt(D)``.
    Raises:
        ValueError: negative lengths or lengths summing past ``context_len``.
    """

    def __init__(self, doc_lens: Sequence[int], context_len: int, *, softmax_scale=None) -> None:
        lens = check_doc_lens(doc_lens)
        n = int(lens.sum())
        if n > context_len:
            raise ValueError(f"doc_lens sum to {n}, more than context_len = {context_len}")
        # pad tokens as 1-token documents (every softmax row non-empty), zeroed after
        self.lens = [int(x) for x in lens[lens > 0]] + [1] * (context_len - n)
        self.num_doc_tokens = n
        self.context_len = int(context_len)
        self.softmax_scale = softmax_scale

    def __call__(self, q, k, v, *, softmax_scale: float | None = None) -> torch.Tensor:
        """``out = attention(q, k, v)``; ``softmax_scale`` overrides the one given at init."""
        if q.shape[0] != self.context_len:
            raise ValueError(f"q has {q.shape[0]} rows, expected context_len = {self.context_len}")
        scale = self.softmax_scale if softmax_scale is None else softmax_scale
        out = reference_attention(q, k, v, self.lens, scale)
        keep = torch.from_numpy(np.arange(self.context_len) < self.num_doc_tokens).to(q.device)
        return (out * keep[:, None, None]).to(q.dtype)
