"""Fake ``flash_attn`` packages with the varlen API of three flash-attn generations.

Each has ``__version__``, a ``flash_attn_interface`` submodule and ``flash_attn_varlen_func``;
the submodule has ``_flash_attn_varlen_forward``, ``_flash_attn_varlen_backward`` and
``flash_attn_varlen_func`` with the argument names, order, defaults and return tuples of the real
package at that version (read from its source, tags v2.5.9, v2.6.3, v2.7.4 and v2.8.3):

* 2.5.x: plain functions; ``window_size`` pair; no ``softcap``; forward returns
  ``(out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)`` with the LSE padded
  ``(batch, heads, max_seqlen_q)``; the extension pads a head_dim that is not a multiple of 8 in
  the forward, the backward refuses one; the backward writes dq, dk, dv and returns
  ``(dq, dk, dv, softmax_d)``.
* 2.6.x: as 2.5.x plus ``softcap`` (after ``window_size``), and the LSE is ``(heads, total_q)``.
* 2.7.x / 2.8.x: ``torch.library.custom_op`` operators (``inspect.signature`` is
  ``(*args, **kwargs)``), ``window_size_left`` / ``window_size_right`` ints; forward returns
  ``(out, softmax_lse, S_dmask, rng_state)``; the extension refuses a head_dim that is not a
  multiple of 8 (``flash_attn_varlen_func`` pads it in Python); the backward mutates dq, dk, dv
  and returns ``softmax_d``.

The kernels are :mod:`standins.varlen_kernel` (float64). Options the harness never uses (dropout,
windows, softcap, ALiBi, paged KV, ...) raise ``NotImplementedError`` when set. The fixed-length
entry points ``_flash_attn_forward`` / ``_flash_attn_backward`` exist (``ring-flash-attn`` imports
them at package import) and raise ``NotImplementedError`` when called.
"""

import functools
import sys
import types

import torch

from standins import varlen_kernel as kern

Tensor = torch.Tensor


def _generation(version: str) -> tuple[int, int]:
    major, minor = (int(x) for x in version.split(".")[:2])
    if major != 2 or minor < 5:
        raise ValueError(f"no stand-in for flash-attn {version}")
    return major, min(minor, 7)


def _unused(**options) -> None:
    defaults = {
        "dropout_p": 0.0,
        "window_size": (-1, -1),
        "window_size_left": -1,
        "window_size_right": -1,
        "softcap": 0.0,
        "alibi_slopes": None,
        "block_table": None,
        "leftpad_k": None,
        "seqused_k": None,
        "return_softmax": False,
        "zero_tensors": False,
    }
    for key, val in options.items():
        if isinstance(val, torch.Tensor) or val != defaults[key]:
            raise NotImplementedError(f"stand-in: {key}={val!r} is not modelled")


def _pad8(x):
    d = x.shape[-1]
    return x if d % 8 == 0 else torch.nn.functional.pad(x, (0, 8 - d % 8))


def _contiguous_last(*xs):
    """The Python wrappers' ``maybe_contiguous`` (every version 2.5-2.8): a copy only when the
    last dimension is strided."""
    return [x.contiguous() if x.stride(-1) != 1 else x for x in xs]


def _fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, *, pad_head, padded_lse):
    """The wrapper's ``maybe_contiguous``, then the extension's ``varlen_fwd``: (out cropped to
    the input head_dim, q, k, v padded, out_padded, lse)."""
    q, k, v = _contiguous_last(q, k, v)
    kern.check(
        q, k, v, cu_q, cu_k, what="forward", pad_head=pad_head,
        head_msg="query, key, value, and out_ must have a head_size that is a multiple of 8",
    )  # fmt: skip
    d = q.shape[-1]
    qp, kp, vp = _pad8(q), _pad8(k), _pad8(v)
    out_padded, lse = kern.forward(qp, kp, vp, cu_q, cu_k, max_q, max_k, scale, causal, padded_lse)
    return out_padded[..., :d].contiguous(), qp, kp, vp, out_padded, lse


def _bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, scale, causal, padded):
    """The wrapper's ``maybe_contiguous``, then the extension's ``varlen_bwd``: writes dq, dk,
    dv; returns softmax_d."""
    dout, q, k, v, out = _contiguous_last(dout, q, k, v, out)
    kern.check(
        q, k, v, cu_q, cu_k, what="backward", pad_head=False,
        head_msg="head_size should be a multiple of 8",
    )  # fmt: skip
    kern.backward(
        dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, scale, causal, padded
    )
    b = cu_q.numel() - 1
    return torch.zeros(q.shape[1], q.shape[0] + 128 * b, dtype=torch.float32)


def _rng():
    return torch.zeros(2, dtype=torch.int64)


def _build_25_26(version: str, softcap: bool) -> types.ModuleType:
    """flash-attn 2.5.x (``softcap=False``) or 2.6.x (``softcap=True``)."""
    padded = not softcap  # the (heads, total_q) LSE came with 2.6
    fai = types.ModuleType("flash_attn.flash_attn_interface")

    if softcap:

        def _flash_attn_varlen_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
            return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None,
        ):  # fmt: skip
            _unused(
                dropout_p=dropout_p, window_size=tuple(window_size), softcap=softcap,
                alibi_slopes=alibi_slopes, return_softmax=return_softmax,
                block_table=block_table, leftpad_k=leftpad_k, seqused_k=seqused_k,
            )  # fmt: skip
            out, qp, kp, vp, out_padded, lse = _fwd(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                causal, pad_head=True, padded_lse=padded,
            )  # fmt: skip
            return out, qp, kp, vp, out_padded, lse, None, _rng()

        def _flash_attn_varlen_backward(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
            alibi_slopes, deterministic, rng_state=None,
        ):  # fmt: skip
            _unused(
                dropout_p=dropout_p, window_size=tuple(window_size), softcap=softcap,
                alibi_slopes=alibi_slopes,
            )  # fmt: skip
            softmax_d = _bwd(
                dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                max_seqlen_q, max_seqlen_k, softmax_scale, causal, padded,
            )  # fmt: skip
            return dq, dk, dv, softmax_d

        def flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
        ):  # fmt: skip
            scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
            res = _flash_attn_varlen_forward(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                scale, causal=causal, window_size=window_size, softcap=softcap,
                alibi_slopes=alibi_slopes, return_softmax=return_attn_probs and dropout_p > 0,
                block_table=block_table,
            )  # fmt: skip
            return (res[0], res[5], res[6]) if return_attn_probs else res[0]

    else:

        def _flash_attn_varlen_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size, alibi_slopes, return_softmax, block_table,
        ):  # fmt: skip
            _unused(
                dropout_p=dropout_p, window_size=tuple(window_size), alibi_slopes=alibi_slopes,
                return_softmax=return_softmax, block_table=block_table,
            )  # fmt: skip
            out, qp, kp, vp, out_padded, lse = _fwd(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                causal, pad_head=True, padded_lse=padded,
            )  # fmt: skip
            return out, qp, kp, vp, out_padded, lse, None, _rng()

        def _flash_attn_varlen_backward(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
            alibi_slopes, deterministic, rng_state=None,
        ):  # fmt: skip
            _unused(dropout_p=dropout_p, window_size=tuple(window_size), alibi_slopes=alibi_slopes)
            softmax_d = _bwd(
                dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                max_seqlen_q, max_seqlen_k, softmax_scale, causal, padded,
            )  # fmt: skip
            return dq, dk, dv, softmax_d

        def flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
            softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
            deterministic=False, return_attn_probs=False, block_table=None,
        ):  # fmt: skip
            scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
            res = _flash_attn_varlen_forward(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                scale, causal=causal, window_size=window_size, alibi_slopes=alibi_slopes,
                return_softmax=return_attn_probs and dropout_p > 0, block_table=block_table,
            )  # fmt: skip
            return (res[0], res[5], res[6]) if return_attn_probs else res[0]

    fai._flash_attn_varlen_forward = _flash_attn_varlen_forward
    fai._flash_attn_varlen_backward = _flash_attn_varlen_backward
    fai.flash_attn_varlen_func = flash_attn_varlen_func
    return fai


def _build_27(version: str, namespace: str) -> types.ModuleType:
    """flash-attn 2.7.x / 2.8.x: the two entry points are custom ops in ``namespace``."""
    fai = types.ModuleType("flash_attn.flash_attn_interface")

    @torch.library.custom_op(f"{namespace}::_flash_attn_varlen_forward", mutates_args=())
    def _flash_attn_varlen_forward(
        q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
        max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float,
        causal: bool, window_size_left: int = -1, window_size_right: int = -1,
        softcap: float = 0.0, alibi_slopes: Tensor | None = None,
        return_softmax: bool = False, block_table: Tensor | None = None,
        leftpad_k: Tensor | None = None, seqused_k: Tensor | None = None,
        zero_tensors: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
        _unused(
            dropout_p=dropout_p, window_size_left=window_size_left,
            window_size_right=window_size_right, softcap=softcap, alibi_slopes=alibi_slopes,
            return_softmax=return_softmax, block_table=block_table, leftpad_k=leftpad_k,
            seqused_k=seqused_k, zero_tensors=zero_tensors,
        )  # fmt: skip
        out, _, _, _, _, lse = _fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            causal, pad_head=False, padded_lse=False,
        )  # fmt: skip
        return out, lse, torch.empty(0, dtype=q.dtype), _rng()

    @torch.library.custom_op(
        f"{namespace}::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv")
    )
    def _flash_attn_varlen_backward(
        dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
        dq: Tensor | None, dk: Tensor | None, dv: Tensor | None,
        cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
        dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
        window_size_right: int, softcap: float,
        alibi_slopes: Tensor | None, deterministic: bool,
        rng_state: Tensor | None = None, zero_tensors: bool = False,
    ) -> Tensor:  # fmt: skip
        _unused(
            dropout_p=dropout_p, window_size_left=window_size_left,
            window_size_right=window_size_right, softcap=softcap, alibi_slopes=alibi_slopes,
            zero_tensors=zero_tensors,
        )  # fmt: skip
        dq = torch.empty_like(q) if dq is None else dq
        dk = torch.empty_like(k) if dk is None else dk
        dv = torch.empty_like(v) if dv is None else dv
        return _bwd(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, softmax_scale, causal, False,
        )  # fmt: skip

    def flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
        deterministic=False, return_attn_probs=False, block_table=None,
    ):  # fmt: skip
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        d = q.shape[-1]
        out_padded, lse, s_dmask, _ = _flash_attn_varlen_forward(
            _pad8(q), _pad8(k), _pad8(v), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, dropout_p, scale, causal=causal, window_size_left=window_size[0],
            window_size_right=window_size[1], softcap=softcap, alibi_slopes=alibi_slopes,
            return_softmax=return_attn_probs and dropout_p > 0, block_table=None,
        )  # fmt: skip
        out = out_padded[..., :d]
        return (out, lse, s_dmask) if return_attn_probs else out

    fai._flash_attn_varlen_forward = _flash_attn_varlen_forward
    fai._flash_attn_varlen_backward = _flash_attn_varlen_backward
    fai.flash_attn_varlen_func = flash_attn_varlen_func
    return fai


def _fixed_length(*args, **kwargs):
    """``_flash_attn_forward`` / ``_flash_attn_backward``: importable, never modelled."""
    raise NotImplementedError("stand-in: the fixed-length (non-varlen) kernels are not modelled")


@functools.cache
def make_flash_attn(version: str, namespace: str) -> types.ModuleType:
    """A fake ``flash_attn`` package of ``version`` (2.5.x, 2.6.x, 2.7.x or 2.8.x).

    Args:
        version: its ``__version__``, e.g. ``"2.8.3"``.
        namespace: the ``torch.library`` namespace of its custom ops (2.7+; one per test module,
            so that registrations never clash); built once per (version, namespace).
    Returns:
        the package module (install it with ``sys.modules["flash_attn"] = pkg`` and
        ``sys.modules["flash_attn.flash_attn_interface"] = pkg.flash_attn_interface``).
    """
    _, minor = _generation(version)
    if minor >= 7:
        fai = _build_27(version, f"{namespace}_{version.replace('.', '_')}")
    else:
        fai = _build_25_26(version, softcap=minor >= 6)
    fai._flash_attn_forward = fai._flash_attn_backward = _fixed_length
    pkg = types.ModuleType("flash_attn")
    pkg.__version__ = version
    pkg.__path__ = []  # a package
    pkg.flash_attn_interface = fai
    pkg.flash_attn_varlen_func = fai.flash_attn_varlen_func
    return pkg


def install(monkeypatch, pkg: types.ModuleType) -> None:
    """Make ``import flash_attn`` (and its interface module) give ``pkg`` for one test."""
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", pkg.flash_attn_interface)


__all__ = ["install", "make_flash_attn"]
