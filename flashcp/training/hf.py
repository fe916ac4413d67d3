"""Any CP method as the attention of a Hugging Face ``transformers`` model.

:func:`register_hf_attention` registers ``"context_parallel"`` with ``transformers.AttentionInterface``
(and a mask function that builds no mask: documents and pad come from the plan; not "flashcp":
transformers 5 takes a name with "flash" in it for a flash-attention kernel to load). A model made with
``attn_implementation="context_parallel"`` then calls, in every attention layer, the attention passed to its
forward as ``flashcp_attention=`` (a :class:`flashcp.training.CPAttention` on a rank, or
:class:`flashcp.training.OneDeviceAttention` on one device), on one packed sequence (batch 1)::

    register_hf_attention()
    model = LlamaForCausalLM(LlamaConfig(..., attn_implementation="context_parallel"))
    batch = plan_and_shard(input_ids, doc_lens, "flashcp", cp)
    logits = model(input_ids=batch.input_ids[None], position_ids=batch.positions[None],
                   flashcp_attention=CPAttention(batch, cp), use_cache=False).logits[0]
    loss = cp_cross_entropy(logits, batch.labels, [cp, dp])   # not labels=: HF would shift again

Needs ``transformers`` with ``AttentionInterface`` (4.48 or later; tested with 5.x).
"""

from __future__ import annotations

import torch

__all__ = ["ATTENTION_KWARG", "HF_ATTENTION_NAME", "hf_attention_forward", "register_hf_attention"]

#: the ``attn_implementation`` name registered by :func:`register_hf_attention`
HF_ATTENTION_NAME = "context_parallel"
#: the keyword of the model's forward that carries the attention callable to every layer
ATTENTION_KWARG = "flashcp_attention"


def hf_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``transformers``' attention-function signature over a flashcp attention callable.

    Args:
        module: the calling attention layer (unused).
        query: (1, H, T, D); key, value: (1, Hkv, T, D) (transformers' layout, batch 1: one
            packed sequence).
        attention_mask: must be None (the documents' mask is the plan's).
        dropout: must be 0.
        scaling: softmax scale (transformers passes ``head_dim ** -0.5``).
        kwargs: must hold ``flashcp_attention`` (:data:`ATTENTION_KWARG`).
    Returns:
        ``(out, None)``: out (1, T, H, D) in query's dtype; no attention weights.
    Raises:
        ValueError: no ``flashcp_attention``, a batch other than 1, a mask, or dropout.
    """
    attention = kwargs.get(ATTENTION_KWARG)
    if attention is None:
        raise ValueError(
            f"attn_implementation={HF_ATTENTION_NAME!r} needs {ATTENTION_KWARG}= in the model's "
            "forward (a flashcp.training.CPAttention or OneDeviceAttention)"
        )
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(f"one packed sequence (batch 1) expected, got query {tuple(query.shape)}")
    if attention_mask is not None:
        raise ValueError(
            f"attention_mask of shape {tuple(attention_mask.shape)} given: with "
            f"{HF_ATTENTION_NAME!r} the documents and pad come from the plan, pass no mask"
        )
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, heads, D)
    out = attention(q, k, v, softmax_scale=scaling)
    return out[None], None


def _no_mask(*args, **kwargs) -> None:
    """Mask function of :data:`HF_ATTENTION_NAME`: no dense mask is built."""
    return None


def register_hf_attention(name: str = HF_ATTENTION_NAME) -> str:
    """Register :func:`hf_attention_forward` (and a mask function that builds none) with
    ``transformers`` under ``name``; idempotent.

    Returns:
        ``name``, for ``attn_implementation=``.
    Raises:
        ImportError: ``transformers`` missing, or without ``AttentionInterface``.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(name, hf_attention_forward)
    try:
        from transformers import AttentionMaskInterface
    except ImportError:  # older versions build the mask themselves; it arrives as None or raises
        return name
    AttentionMaskInterface.register(name, _no_mask)
    return name
