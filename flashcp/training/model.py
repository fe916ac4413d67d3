"""A small Llama-style decoder in plain PyTorch whose attention is any CP op or the reference.

RoPE on the tokens' positions inside their documents, grouped-query attention, RMSNorm, SwiGLU,
untied embedding and head. Every layer calls the ``attention`` it is given
(:class:`flashcp.training.CPAttention` on a rank, :class:`flashcp.training.OneDeviceAttention`
on one device), so one model's weights run either way. Packed, unbatched: one sequence of T
tokens per call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "TinyLlama", "rope"]


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of :class:`TinyLlama` (defaults: the tests' tiny model)."""

    vocab_size: int = 64
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 64
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}, "
                f"itself a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"head_dim {self.hidden_size // self.num_heads} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form) at the given positions.

    Args:
        x: (T, heads, D) float, D even; positions: (T,) int64.
    Returns:
        (T, heads, D) in x's dtype; angles computed in float64.
    """
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # (T, D/2)
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :].to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, hd, kv = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads
        self.cfg = cfg
        self.attn_norm = RMSNorm(h, cfg.rms_eps)
        self.q_proj = nn.Linear(h, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, kv * hd, bias=False)
        self.v_proj = nn.Linear(h, kv * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.rms_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, x, positions, attention):
        cfg, t = self.cfg, x.shape[0]
        y = self.attn_norm(x)
        q = self.q_proj(y).view(t, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(y).view(t, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(y).view(t, cfg.num_kv_heads, cfg.head_dim)
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
        x = x + self.o_proj(attention(q, k, v).reshape(t, -1))
        y = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class TinyLlama(nn.Module):
    """Llama-style decoder over one packed sequence.

    Args:
        config: sizes (:class:`LlamaConfig`).
        seed: initialisation seed (weights N(0, 0.02), norms 1): the same on every rank.
        dtype: parameter dtype (float32 or float64).
    Raises:
        ValueError: a dtype other than float32 / float64.
    """

    def __init__(
        self,
        config: LlamaConfig | None = None,
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        self.config = cfg = config or LlamaConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if not name.endswith("norm.weight"):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        self.to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Logits of a packed sequence.

        Args:
            input_ids: (T,) int64 tokens; positions: (T,) int64 positions inside documents.
            attention: ``attention(q (T, H, D), k (T, Hkv, D), v) -> (T, H, D)``.
        Returns:
            (T, vocab_size) logits in the model's dtype.
        Raises:
            ValueError: shapes or dtypes of the inputs, or token ids out of the vocabulary.
        """
        if input_ids.dim() != 1 or input_ids.dtype != torch.int64:
            raise ValueError(
                f"input_ids must be (T,) int64, got {tuple(input_ids.shape)} {input_ids.dtype}"
            )
        if positions.shape != input_ids.shape or positions.dtype != torch.int64:
            raise ValueError(
                f"positions must be {tuple(input_ids.shape)} int64, got "
                f"{tuple(positions.shape)} {positions.dtype}"
            )
        if input_ids.numel() and (
            int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size
        ):
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions, attention)
        return self.lm_head(self.norm(x))
