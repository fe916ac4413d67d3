"""The ``reference`` backend: every segment in float64 dense math, one block per segment (tests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from flashcp.ops.backends.base import VarlenBackend
from flashcp.ops.backends.dense import dense_backward, dense_forward

__all__ = ["ReferenceBackend"]


@dataclass(frozen=True)
class ReferenceBackend(VarlenBackend):
    """The varlen formulas in float64, one dense masked block per segment, on any device.

    Slow and memory-hungry (a segment's whole score matrix at once); the yardstick of the tests.
    Returns ``out`` in the input dtype and ``lse`` in ``compute_dtype`` of it, as every backend.
    """

    KIND: ClassVar[str] = "reference"
    name: str = "reference"

    def _forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        out, lse = dense_forward(
            q, k, v, cu_q.tolist(), cu_k.tolist(), causal, float(scale), torch.float64, None
        )
        return out.to(q.dtype), lse

    def _backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        return dense_backward(
            dout, q, k, v, out, lse, cu_q.tolist(), cu_k.tolist(), causal, float(scale),
            torch.float64, None,
        )  # fmt: skip
