"""The CUDA backends: ``torch_cuda`` (PyTorch's bundled FlashAttention-2 varlen kernels,
``aten::_flash_attention_*``) and ``flash_attn`` (the ``flash-attn`` package).

What the kernels take (FlashAttention-2's ``mha_varlen_fwd`` / ``mha_varlen_bwd``, in the
``flash-attn`` package and in PyTorch's copy of it): float16 or bfloat16 inputs, a head_dim of at
most 256 (the backward, and since flash-attn 2.7 and in current PyTorch the forward too, only a
multiple of 8: the adapters zero-pad the head dimension, as the package's own autograd function
does; zero columns change no score), a GPU of compute capability 8.0 or newer, and at least one
segment (``batch size must be positive``; :class:`~flashcp.ops.backends.base.VarlenBackend` never
calls a kernel without work).

What changed between versions, and how each adapter follows it (each choice made once):

* ``flash-attn`` (:func:`flash_attn_convention`, from ``flash_attn.__version__``):

  - 2.4 and 2.5: ``_flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv,
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
    window_size, alibi_slopes, deterministic, rng_state)`` with ``window_size = (left, right)``;
    the varlen LSE is padded, ``(batch, heads, max_seqlen_q)``.
  - 2.6: ``softcap`` between ``window_size`` and ``alibi_slopes``; the LSE is
    ``(heads, total_q)``.
  - 2.7 and later (2.8.x included): ``window_size_left, window_size_right`` as two ints, and the
    functions are ``torch.library.custom_op`` operators (with torch >= 2.4), whose
    ``inspect.signature`` is ``(*args, **kwargs)``: the adapter passes every argument by
    position, in the order of that version's definition.

  In every version the backward writes into the ``dq, dk, dv`` it is given, and the forward runs
  through the public ``flash_attn_varlen_func(..., return_attn_probs=True)``, which returns
  ``(out, softmax_lse, S_dmask)``.
* PyTorch's ``aten::_flash_attention_forward`` returns the LSE of its bundled kernel: padded
  ``(batch, heads, max_q)`` in older builds (and ROCm builds on AOTriton without compact varlen
  LSE), ``(heads, total_q)`` in current CUDA builds. The forward reads the layout from the
  returned shape; the backward gives the kernel the layout its forward returns, found once per
  operator and device by a 3-row probe (:func:`aten_lse_padded`). Both schemas (the 2.3-era
  ``philox_seed, philox_offset`` and the current ``rng_state, unused``) take the same positional
  arguments and ``scale`` as a keyword, which is all the adapter passes.

FlashAttention marks rows that see no key with lse = +inf (so that exp(s - lse) = 0 in backward);
our convention is -inf. Both backends convert on the way out and back.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from typing import ClassVar

import torch

from flashcp.ops.backends.base import VarlenBackend

__all__ = [
    "FLASH_DTYPES",
    "FLASH_MAX_HEAD_DIM",
    "FLASH_MIN_CAPABILITY",
    "FlashAttnBackend",
    "FlashAttnConvention",
    "TorchCudaBackend",
    "aten_lse_padded",
    "flash_attn_available",
    "flash_attn_convention",
    "flash_attn_problem",
    "flash_kernel_problem",
]

#: input dtypes the FlashAttention-2 kernels take
FLASH_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
#: largest head_dim they take (``mha_varlen_fwd``: "head dimension at most 256")
FLASH_MAX_HEAD_DIM = 256
#: oldest GPU they run on ("FlashAttention only supports Ampere GPUs or newer")
FLASH_MIN_CAPABILITY = (8, 0)


def flash_kernel_problem(name: str, dtype=None, head_dim=None, capability=None) -> str | None:
    """Why the FlashAttention-2 kernels of backend ``name`` cannot take these inputs, or None.

    Args:
        name: the backend's name (for the message).
        dtype: the input dtype (None: not checked).
        head_dim: D (None: not checked).
        capability: the GPU's ``(major, minor)`` compute capability (None: not checked).
    Returns:
        a sentence naming the value the kernels refuse, or None when they take all three.
    """
    if dtype is not None and dtype not in FLASH_DTYPES:
        return f"backend {name!r} takes float16 or bfloat16 inputs, got {dtype}"
    if head_dim is not None and not 1 <= int(head_dim) <= FLASH_MAX_HEAD_DIM:
        return f"backend {name!r} takes head_dim 1..{FLASH_MAX_HEAD_DIM}, got {head_dim}"
    if capability is not None and tuple(capability) < FLASH_MIN_CAPABILITY:
        return (
            f"backend {name!r} needs a GPU of compute capability >= 8.0 (Ampere), got "
            f"{capability[0]}.{capability[1]}"
        )
    return None


# ---- the flash-attn package: import once, one calling convention per version -------------------


@dataclass(frozen=True)
class FlashAttnConvention:
    """How one ``flash-attn`` version is called (:func:`flash_attn_convention`).

    Attributes:
        version: the package's ``__version__``.
        padded_lse: the varlen LSE is ``(batch, heads, max_seqlen_q)`` (< 2.6), else
            ``(heads, total_q)``.
        softcap: ``_flash_attn_varlen_backward`` takes ``softcap`` (>= 2.6).
        split_window: it takes ``window_size_left, window_size_right`` (>= 2.7), else one
            ``window_size`` pair.
    """

    version: str
    padded_lse: bool
    softcap: bool
    split_window: bool

    def backward_args(
        self, dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, causal, scale
    ) -> tuple:
        """The positional arguments of this version's ``_flash_attn_varlen_backward`` (no
        dropout, no window, no softcap, no ALiBi, non-deterministic, no RNG state)."""
        window = (-1, -1) if self.split_window else ((-1, -1),)
        softcap = (0.0,) if self.softcap else ()
        return (
            dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, int(max_q), int(max_k),
            0.0, float(scale), bool(causal), *window, *softcap, None, False, None,
        )  # fmt: skip


@functools.cache
def flash_attn_convention(version: str) -> FlashAttnConvention:
    """The calling convention of ``flash-attn`` ``version`` (module docstring; chosen once).

    Raises:
        ValueError: a version older than 2.4 or not 2.x (not supported; the message names it).
    """
    m = re.match(r"\s*(\d+)\.(\d+)", str(version))
    if m is None:
        raise ValueError(f"cannot read the flash-attn version {version!r}")
    major, minor = int(m.group(1)), int(m.group(2))
    if major != 2 or minor < 4:
        raise ValueError(f"flash-attn {version} is not supported: need 2.x with x >= 4")
    return FlashAttnConvention(
        version=str(version), padded_lse=minor < 6, softcap=minor >= 6, split_window=minor >= 7
    )


@functools.cache
def flash_attn_problem() -> str | None:
    """Why the ``flash-attn`` package cannot be used here, or None (checked once per process).

    A wheel built for another torch is found by ``find_spec`` but fails when its extension
    ``flash_attn_2_cuda`` loads (``ImportError``/``OSError``, "undefined symbol"): the check
    imports ``flash_attn.flash_attn_interface`` and reads the version's calling convention.
    """
    try:
        found = importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):
        found = "flash_attn" in sys.modules  # a module without __spec__
    if not found:
        return "the flash-attn package is not installed (pip install flash-attn)"
    try:
        package = importlib.import_module("flash_attn")
        importlib.import_module("flash_attn.flash_attn_interface")
        flash_attn_convention(getattr(package, "__version__", "unknown"))
    except Exception as e:  # any failure to load means: not usable here
        return f"flash-attn is installed but cannot be used: {type(e).__name__}: {e}"
    return None


def flash_attn_available() -> bool:
    """Whether the ``flash-attn`` package imports here and its version is supported
    (:func:`flash_attn_problem`)."""
    return flash_attn_problem() is None


def _flash_attn():
    """``(flash_attn_interface module, its FlashAttnConvention)``."""
    package = importlib.import_module("flash_attn")
    fai = importlib.import_module("flash_attn.flash_attn_interface")
    return fai, flash_attn_convention(getattr(package, "__version__", "unknown"))


# ---- shared pieces --------------------------------------------------------------------------------


def _check_inputs(name: str, q) -> None:
    problem = flash_kernel_problem(name, q.dtype, q.shape[-1])
    if problem is not None:
        raise ValueError(problem)


def _pad_head(x, d8: int):
    """x (..., D) zero-padded to (..., d8), contiguous."""
    d = x.shape[-1]
    return x.contiguous() if d == d8 else torch.nn.functional.pad(x, (0, d8 - d)).contiguous()


def _rows_of_segments(cu, total: int):
    """For each of ``total`` rows: (its segment, its position in the segment); int64, on cu's
    device, without a host sync."""
    cu = cu.long()
    rows = torch.arange(total, device=cu.device)
    seg = torch.searchsorted(cu[1:], rows, right=True)
    return seg, rows - cu[seg]


def _lse_out(lse, cu_q, h: int, tq: int):
    """A kernel's LSE, padded ``(batch, H, max_q)`` or ``(H, Tq)``, as (H, Tq) float32 with -inf
    for rows that see no key."""
    lse = lse.float()
    if lse.dim() == 3 and lse.shape[:2] == (cu_q.numel() - 1, h):
        seg, pos = _rows_of_segments(cu_q, tq)
        lse = lse[seg, :, pos].t()  # (Tq, H) -> (H, Tq)
    if lse.shape != (h, tq):
        raise RuntimeError(
            f"kernel returned an lse of shape {tuple(lse.shape)}; expected {(h, tq)} or "
            f"(batch, {h}, max_seqlen_q)"
        )
    return torch.where(torch.isinf(lse), float("-inf"), lse)


def _lse_in(lse, cu_q, max_q: int, padded: bool):
    """Our (H, Tq) LSE as the kernel reads it: +inf for rows that see no key, padded
    ``(batch, H, max_q)`` if ``padded``."""
    lse = torch.where(torch.isneginf(lse), float("inf"), lse).float()
    if not padded:
        return lse.contiguous()
    h, tq = lse.shape
    seg, pos = _rows_of_segments(cu_q, tq)
    out = torch.full((cu_q.numel() - 1, h, int(max_q)), float("inf"), device=lse.device)
    out[seg, :, pos] = lse.t()
    return out


# ---- torch_cuda -----------------------------------------------------------------------------------


@functools.cache
def aten_lse_padded(op, device: str) -> bool:
    """Whether ``op`` (an ``aten::_flash_attention_forward``) returns the padded
    ``(batch, heads, max_q)`` varlen LSE on ``device``; found once per operator and device by a
    3-row, 2-segment call."""
    x = torch.zeros(3, 1, 8, dtype=torch.float16, device=device)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    lse = op(x, x, x, cu, cu, 2, 2, 0.0, False, False, scale=1.0)[1]
    return lse.dim() == 3


def _torch_cuda_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    _check_inputs("torch_cuda", q)
    tq, h, d = q.shape
    d8 = -(-d // 8) * 8
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        _pad_head(q, d8), _pad_head(k, d8), _pad_head(v, d8), cu_q, cu_k, int(max_q), int(max_k),
        0.0, bool(causal), False, scale=float(scale),
    )  # fmt: skip
    out = out[..., :d]
    out = torch.where(torch.isnan(out), 0.0, out) if out.numel() else out
    return out, _lse_out(lse, cu_q, h, tq)


def _torch_cuda_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    _check_inputs("torch_cuda", q)
    op = torch.ops.aten._flash_attention_forward
    padded = aten_lse_padded(op, str(q.device))
    d = q.shape[-1]
    d8 = -(-d // 8) * 8
    rng_state = torch.zeros(
        2, dtype=torch.uint64 if hasattr(torch, "uint64") else torch.int64, device=q.device
    )
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        _pad_head(dout, d8),
        _pad_head(q, d8),
        _pad_head(k, d8),
        _pad_head(v, d8),
        _pad_head(out, d8),
        _lse_in(lse, cu_q, max_q, padded),
        cu_q,
        cu_k,
        int(max_q),
        int(max_k),
        0.0,
        bool(causal),
        rng_state,
        torch.empty(0, device=q.device),
        scale=float(scale),
    )
    return dq[..., :d], dk[..., :d], dv[..., :d]


# ---- flash_attn -----------------------------------------------------------------------------------


def _fa_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    _check_inputs("flash_attn", q)
    fai, _ = _flash_attn()
    out, lse, _ = fai.flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        cu_k,
        int(max_q),
        int(max_k),
        dropout_p=0.0,
        softmax_scale=float(scale),
        causal=bool(causal),
        return_attn_probs=True,
    )
    return out, _lse_out(lse, cu_q, q.shape[1], q.shape[0])


def _fa_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    _check_inputs("flash_attn", q)
    fai, conv = _flash_attn()
    d = q.shape[-1]
    d8 = -(-d // 8) * 8  # the kernel takes a head_dim that is a multiple of 8
    q8, k8, v8 = _pad_head(q, d8), _pad_head(k, d8), _pad_head(v, d8)
    dq, dk, dv = torch.empty_like(q8), torch.empty_like(k8), torch.empty_like(v8)
    fai._flash_attn_varlen_backward(
        *conv.backward_args(
            _pad_head(dout, d8), q8, k8, v8, _pad_head(out, d8),
            _lse_in(lse, cu_q, max_q, conv.padded_lse), dq, dk, dv,
            cu_q, cu_k, max_q, max_k, causal, scale,
        )
    )  # fmt: skip
    return dq[..., :d], dk[..., :d], dv[..., :d]


@dataclass(frozen=True)
class TorchCudaBackend(VarlenBackend):
    """PyTorch's bundled FlashAttention-2 varlen kernels (CUDA only; module docstring).

    Raises (from forward/backward):
        ValueError: inputs the kernels refuse (dtype, head_dim; :func:`flash_kernel_problem`).
    """

    KIND: ClassVar[str] = "torch_cuda"
    name: str = "torch_cuda"

    def _forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        return _torch_cuda_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)

    def _backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        return _torch_cuda_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale
        )


@dataclass(frozen=True)
class FlashAttnBackend(VarlenBackend):
    """The ``flash-attn`` package's varlen kernels, 2.4 and later (CUDA only;
    ``pip install flash-attn``; module docstring).

    Raises (from forward/backward):
        ValueError: inputs the kernels refuse (dtype, head_dim; :func:`flash_kernel_problem`), or
            an unsupported flash-attn version.
    """

    KIND: ClassVar[str] = "flash_attn"
    name: str = "flash_attn"

    def _forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        return _fa_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)

    def _backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        return _fa_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale)
