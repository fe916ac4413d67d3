"""Attention shapes and the communication volume a plan implies, per method family.

This is the one place that turns a plan into bytes: the simulator prices these bytes, and the real
ops' byte counters are tested against them.

Conventions (DESIGN.md §2): volumes are the bytes **one rank receives** in one attention layer's
step, taking the largest rank (collectives are synchronous). KV bytes = tokens x 2 (K and V) x
``num_kv_heads`` x ``head_dim`` x bytes per element. All buffers are in the model dtype.

* ``allgather_full`` (``llama3``, ``per_doc``; Eq. 4): forward all-gathers the whole KV,
  (N-1) C/N tokens. Training all-gathers it again in the backward (no KV kept between passes) and
  reduce-scatters dK/dV, the same volume.
* ``allgather_sharded`` (``flashcp``; Eq. 5): the same with ``comm_tokens`` (each rank's
  contribution is padded to the largest rank's compact buffer).
* ``p2p_ring`` (``ring``, ``zigzag``): N-1 steps, each receiving one KV block of C/N tokens
  (forward; with pad tokens, the most document tokens any rank holds: pad rows are not sent);
  training passes the KV blocks around again and the dK/dV partial sums too, N-1 hops in float32
  (at least: summing in bfloat16 would round the growing sum at every hop).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from flashcp.plan import Plan, kv_bytes

__all__ = ["DTYPE_BYTES", "MODES", "AttnShape", "comm_volume"]

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


def comm_volume(plan: Plan, comm_kind: str, shape: AttnShape, mode: Mode) -> dict[str, int]:
    """Bytes one rank receives per attention-layer step, by kind of communication.

    Args:
        plan: the plan.
        comm_kind: ``allgather_full``, ``allgather_sharded`` or ``p2p_ring``
            (:data:`flashcp.registry.COMM_KIND`).
        shape: attention shape (KV heads, head_dim, dtype).
        mode: ``train`` or ``infer``.
    Returns:
        ``{"allgather_bytes", "reducescatter_bytes", "p2p_bytes", "comm_bytes"}`` (ints; ``comm_bytes``
        is their sum).
    Raises:
        ValueError: unknown ``comm_kind`` or ``mode``.
    """
    check_mode(mode)
    train = mode == "train"
    n = plan.cp_size
    ag = rs = p2p = 0
    if comm_kind in ("allgather_full", "allgather_sharded"):
        tokens = plan.comm_tokens_full if comm_kind == "allgather_full" else plan.comm_tokens
        one = shape.kv_bytes(tokens)
        ag = 2 * one if train else one
        rs = one if train else 0
    elif comm_kind == "p2p_ring":
        tokens = (n - 1) * int(plan.doc_tokens_per_rank.max())  # blocks leave out pad rows
        one = shape.kv_bytes(tokens)
        # fwd KV; bwd KV again + dK/dV partial sums in float32 (or wider)
        grad = kv_bytes(tokens, shape.num_kv_heads, shape.head_dim, max(shape.dtype_bytes, 4))
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
