"""Attention shapes and the communication volume a plan implies, per method family.

This is the one place that turns a plan into bytes: the simulator prices these bytes, and the real
ops' byte counters are tested against them.

Conventions (docs/design.md §2): volumes are the bytes **one rank receives** in one attention layer's
step, taking the largest rank (collectives are synchronous). KV bytes = tokens x 2 (K and V) x
``num_kv_heads`` x ``head_dim`` x bytes per element. KV buffers are in the model dtype; gradient
partial sums (dK/dV) cross ranks in ``grad_comm_dtype``, by default the model dtype promoted to at
least float32 (float32 for bfloat16 / float16 / float32, float64 for float64), as every op sends
them by default (:func:`flashcp.ops.collectives.resolve_grad_comm_dtype`).

* ``allgather_full`` (``llama3``, ``per_doc``; Eq. 4): forward all-gathers the whole KV,
  (N-1) C/N tokens. Training all-gathers it again in the backward (no KV kept between passes) and
  reduce-scatters dK/dV, the same tokens in ``grad_comm_dtype``.
* ``allgather_sharded`` (``flashcp``; Eq. 5): the same with ``comm_tokens`` (each rank's
  contribution is padded to the largest rank's compact buffer).
* ``p2p_ring`` (``ring``, ``zigzag``): N-1 steps, each receiving one KV block of C/N tokens
  (forward; with pad tokens, the most document tokens any rank holds: pad rows are not sent);
  training passes the KV blocks around again and the dK/dV partial sums too, N-1 hops in
  ``grad_comm_dtype``.

Reducing gradients in bfloat16 would round every rank's partial sum (or, around the ring, the
growing sum at every hop), so the dK/dV error would grow with cp_size.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from flashcp.plan import Plan, kv_bytes

__all__ = ["DTYPE_BYTES", "MODES", "AttnShape", "comm_volume", "grad_comm_bytes"]

DTYPE_BYTES = MappingProxyType({"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8})
MODES = ("train", "infer")
Mode = Literal["train", "infer"]


@dataclass(frozen=True)
class AttnShape:
    """Shape of one attention layer.

    Attributes:
        num_heads: query heads H.
        num_kv_heads: KV heads (GQA), divides ``num_heads``.
        head_dim: D.
        dtype: element type of Q, K, V and of communicated buffers (a key of ``DTYPE_BYTES``).
    """

    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = 128
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads = {self.num_heads} is not a multiple of num_kv_heads = {self.num_kv_heads}"
            )
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(
                f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPE_BYTES)}"
            )

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def kv_bytes(self, tokens):
        """Bytes of K and V for ``tokens`` tokens (all KV heads)."""
        return kv_bytes(tokens, self.num_kv_heads, self.head_dim, self.dtype_bytes)


def check_mode(mode: str) -> None:
    """Raise ValueError unless ``mode`` is ``train`` (forward + backward) or ``infer`` (forward)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")


def grad_comm_bytes(shape: AttnShape, grad_comm_dtype: str | None = None) -> int:
    """Bytes per element of the dK/dV partial sums that cross ranks.

    Args:
        shape: gives the model dtype.
        grad_comm_dtype: a key of :data:`DTYPE_BYTES`, or None for the ops' default (the model
            dtype promoted to at least float32).
    Raises:
        ValueError: unknown ``grad_comm_dtype``.
    """
    if grad_comm_dtype is None:
        return max(shape.dtype_bytes, DTYPE_BYTES["float32"])
    if grad_comm_dtype not in DTYPE_BYTES:
        raise ValueError(
            f"unknown grad_comm_dtype {grad_comm_dtype!r}; choose one of {', '.join(DTYPE_BYTES)}"
        )
    return DTYPE_BYTES[grad_comm_dtype]


def comm_volume(
    plan: Plan, comm_kind: str, shape: AttnShape, mode: Mode, grad_comm_dtype: str | None = None
) -> dict[str, int]:
    """Bytes one rank receives per attention-layer step, by kind of communication.

    Args:
        plan: the plan.
        comm_kind: ``allgather_full``, ``allgather_sharded`` or ``p2p_ring``
            (:data:`flashcp.registry.COMM_KIND`).
        shape: attention shape (KV heads, head_dim, dtype).
        mode: ``train`` or ``infer``.
        grad_comm_dtype: dtype of the dK/dV reduce-scatter (all-gather family) or ring hops
            (ring family), a key of :data:`DTYPE_BYTES`; None: the ops' default, the model dtype
            promoted to at least float32 (see :func:`grad_comm_bytes`).
    Returns:
        ``{"allgather_bytes", "reducescatter_bytes", "p2p_bytes", "comm_bytes"}`` (ints; ``comm_bytes``
        is their sum).
    Raises:
        ValueError: unknown ``comm_kind``, ``mode`` or ``grad_comm_dtype``.
    """
    check_mode(mode)
    train = mode == "train"
    n = plan.cp_size
    grad_elem = grad_comm_bytes(shape, grad_comm_dtype)
    ag = rs = p2p = 0
    if comm_kind in ("allgather_full", "allgather_sharded"):
        tokens = plan.comm_tokens_full if comm_kind == "allgather_full" else plan.comm_tokens
        one = shape.kv_bytes(tokens)
        ag = 2 * one if train else one
        # bwd: dK/dV of the same rows, reduce-scattered in grad_comm_dtype
        rs = kv_bytes(tokens, shape.num_kv_heads, shape.head_dim, grad_elem) if train else 0
    elif comm_kind == "p2p_ring":
        tokens = (n - 1) * int(plan.doc_tokens_per_rank.max())  # blocks leave out pad rows
        one = shape.kv_bytes(tokens)
        # fwd KV; bwd KV again + dK/dV partial sums in grad_comm_dtype
        grad = kv_bytes(tokens, shape.num_kv_heads, shape.head_dim, grad_elem)
        p2p = 2 * one + grad if train else one
    else:
        raise ValueError(
            f"unknown comm_kind {comm_kind!r}; choose allgather_full, allgather_sharded or p2p_ring"
        )
    return {
        "allgather_bytes": int(ag),
        "reducescatter_bytes": int(rs),
        "p2p_bytes": int(p2p),
        "comm_bytes": int(ag + rs + p2p),
    }
