"""The whole training (or inference) step of a decoder-only transformer around the CP attention
layer the simulator prices (docs/simulator.md, "The step model").

Every other phase of the harness is one attention layer. A model with ``num_layers`` set
(:class:`flashcp.comm.AttnShape`) also gets the work outside attention that each rank does on its
own tokens: the QKV and output projections, the SwiGLU MLP (three GEMMs), two RMSNorms, RoPE and
two residual adds per layer, plus the embedding lookup, the final norm, the LM head GEMM over the
vocabulary and the cross-entropy loss once per step. All of it is linear in the rank's tokens (pad
tokens cost like tokens: they run through every GEMM). GEMMs run at :func:`gemm_tflops`, the
element-wise operations at the profile's ``copy_bw_gbps`` (read + write bytes). The backward pass
costs :data:`BWD_GEMM_FACTOR` times the forward GEMM FLOPs (the gradients of input and weight)
and :data:`BWD_BYTES_FACTOR` times the forward element-wise bytes.

    step = num_layers * (attention layer + per-layer work) + embedding / head / loss work
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flashcp.comm import AttnShape, check_mode

__all__ = [
    "BWD_BYTES_FACTOR",
    "BWD_GEMM_FACTOR",
    "GEMM_EFFICIENCY",
    "gemm_tflops",
    "head_bytes",
    "head_flops",
    "layer_bytes",
    "layer_flops",
    "nonattn_ms",
    "step_ms",
]

#: achieved dense bf16 GEMM throughput over peak: the best measured matmul on H100 SXM, ~795 of
#: 989 TFLOP/s (docs/design.md §8), applied to every profile's ``peak_tflops`` (an assumption for
#: A100, H800 and H200: no public GEMM table of theirs is collected here)
GEMM_EFFICIENCY = 795.0 / 989.0
#: backward GEMM FLOPs over forward: dX = dY W^T and dW = X^T dY, each the forward's FLOPs
BWD_GEMM_FACTOR = 2.0
#: backward element-wise bytes over forward: reads the output gradient and the saved input,
#: writes the input gradient (an assumption: unfused kernels, fp32 accumulation ignored)
BWD_BYTES_FACTOR = 2.0


def gemm_tflops(hw: Any) -> float:
    """Achieved dense GEMM TFLOP/s of one GPU: ``hw.peak_tflops`` x :data:`GEMM_EFFICIENCY`."""
    return float(hw.peak_tflops) * GEMM_EFFICIENCY


def _check(shape: AttnShape) -> None:
    if shape.num_layers is None:
        raise ValueError(
            "the step model needs the model's num_layers, hidden, ffn and vocab; this model is "
            "one attention layer (num_layers=None)"
        )


def layer_flops(shape: AttnShape, tokens: Any) -> Any:
    """Forward GEMM FLOPs of one layer outside attention for ``tokens`` tokens (array-like).

    QKV projection 2 t h (H + 2 H_kv) d, output projection 2 t H d h, SwiGLU MLP 3 x 2 t h f.

    Raises:
        ValueError: an attention-only shape (``num_layers`` None).
    """
    _check(shape)
    h, d = shape.hidden, shape.head_dim
    qkv = 2 * h * (shape.num_heads + 2 * shape.num_kv_heads) * d
    out = 2 * shape.num_heads * d * h
    mlp = 3 * 2 * h * shape.ffn
    return np.asarray(tokens, dtype=np.float64) * (qkv + out + mlp)


def layer_bytes(shape: AttnShape, tokens: Any) -> Any:
    """Forward element-wise bytes (read + write) of one layer for ``tokens`` tokens.

    Two RMSNorms (read h, write h), RoPE on Q and K (read and write (H + H_kv) d), the SwiGLU
    gate (read 2f, write f), two residual adds (read 2h, write h); ``dtype_bytes`` each.

    Raises:
        ValueError: an attention-only shape.
    """
    _check(shape)
    h = shape.hidden
    elems = 2 * 2 * h + 2 * (shape.num_heads + shape.num_kv_heads) * shape.head_dim
    elems += 3 * shape.ffn + 2 * 3 * h
    return np.asarray(tokens, dtype=np.float64) * elems * shape.dtype_bytes


def head_flops(shape: AttnShape, tokens: Any) -> Any:
    """Forward GEMM FLOPs of the LM head (2 t h V), once per step.

    Raises:
        ValueError: an attention-only shape.
    """
    _check(shape)
    return np.asarray(tokens, dtype=np.float64) * 2 * shape.hidden * shape.vocab


def head_bytes(shape: AttnShape, tokens: Any) -> Any:
    """Forward element-wise bytes once per step: the embedding lookup (read and write h), the
    final RMSNorm (read h, write h) and the softmax of the loss (read V logits, write V).

    Raises:
        ValueError: an attention-only shape.
    """
    _check(shape)
    elems = 2 * shape.hidden + 2 * shape.hidden + 2 * shape.vocab
    return np.asarray(tokens, dtype=np.float64) * elems * shape.dtype_bytes


def nonattn_ms(shape: AttnShape, hw: Any, tokens: Any, mode: str) -> tuple[Any, Any]:
    """Time of the work outside attention on a rank holding ``tokens`` tokens, ms.

    Args:
        shape: a model with ``num_layers`` set.
        hw: a hardware profile (``peak_tflops``, ``copy_bw_gbps``).
        tokens: tokens of the rank, pad included (array-like).
        mode: ``train`` (forward + backward) or ``infer`` (forward).
    Returns:
        ``(per_layer_ms, head_ms)``: one layer's work and the once-per-step work, each the
        shape of ``tokens``.
    Raises:
        ValueError: an attention-only shape, an unknown mode.
    """
    check_mode(mode)
    _check(shape)
    f = 1.0 + BWD_GEMM_FACTOR if mode == "train" else 1.0
    b = 1.0 + BWD_BYTES_FACTOR if mode == "train" else 1.0
    flops_per_ms = gemm_tflops(hw) * 1e9
    bytes_per_ms = float(hw.copy_bw_gbps) * 1e6
    layer = f * layer_flops(shape, tokens) / flops_per_ms
    layer = layer + b * layer_bytes(shape, tokens) / bytes_per_ms
    head = f * head_flops(shape, tokens) / flops_per_ms
    head = head + b * head_bytes(shape, tokens) / bytes_per_ms
    return layer, head


def step_ms(shape: AttnShape, hw: Any, attn_ms: Any, tokens: Any, mode: str) -> Any:
    """Step time of the whole model, ms: ``num_layers x (attn_ms + per-layer work) + head work``
    (:func:`nonattn_ms`).

    Args:
        shape: a model with ``num_layers`` set.
        hw: a hardware profile.
        attn_ms: one attention layer's time in ``mode`` (the simulator's ``total_ms``), array-like.
        tokens: the tokens of the busiest rank, pad included, same shape as ``attn_ms``.
        mode: ``train`` or ``infer``.
    Raises:
        ValueError: an attention-only shape, an unknown mode.
    """
    layer, head = nonattn_ms(shape, hw, tokens, mode)
    return shape.num_layers * (np.asarray(attn_ms, dtype=np.float64) + layer) + head
