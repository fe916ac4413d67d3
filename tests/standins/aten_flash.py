"""Stand-ins for PyTorch's ``aten::_flash_attention_forward`` / ``aten::_flash_attention_backward``.

Registered with ``torch.library`` under their real schemas, so a call with a wrong argument
count, type or keyword fails as the real operator does:

* ``"2.3"``: the 2.3-era schema (``philox_seed, philox_offset``; ``scale`` the only keyword) and
  its bundled kernel's padded LSE ``(batch, heads, max_q)``;
* ``"current"``: the schema of the installed torch (``rng_state, unused``; window sizes,
  ``seqused_k``, ``alibi_slopes``, ...) and the ``(heads, total_q)`` LSE.

Both refuse what the kernel refuses (:func:`standins.varlen_kernel.check`, with a head_dim that
is not a multiple of 8 refused: the callers pad) and compute with :mod:`standins.varlen_kernel`.
"""

from __future__ import annotations

import functools

import torch

from standins import varlen_kernel as kern

_SCHEMA_23 = (
    "_flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, "
    "Tensor? cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, "
    "bool return_debug_mask, *, float? scale=None) -> (Tensor output, Tensor softmax_logsumexp, "
    "Tensor philox_seed, Tensor philox_offset, Tensor debug_attn_mask)",
    "_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
    "Tensor out, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, "
    "SymInt max_k, float dropout_p, bool is_causal, Tensor philox_seed, Tensor philox_offset, *, "
    "float? scale=None) -> (Tensor, Tensor, Tensor)",
)

_HEAD_MSG = "head_size must be a multiple of 8, this is ensured by padding!"


def _current_schemas() -> tuple[str, str]:
    """The installed torch's schemas of the two operators, without the ``aten::`` prefix."""
    ops = torch.ops.aten
    return tuple(
        str(getattr(ops, name).default._schema).removeprefix("aten::")
        for name in ("_flash_attention_forward", "_flash_attention_backward")
    )


def _no_extras(extras: dict) -> None:
    for key, val in extras.items():
        if val is not None:
            raise NotImplementedError(f"stand-in: {key}={val!r} is not modelled")


@functools.cache
def make_aten_flash(era: str, namespace: str):
    """Register the two stand-in operators of ``era`` (``"2.3"`` or ``"current"``) in
    ``namespace`` (once per pair; one namespace per test module) and return
    ``torch.ops.<namespace>``, whose ``_flash_attention_forward`` / ``_flash_attention_backward``
    replace ``torch.ops.aten``'s in a test (``monkeypatch.setattr(torch.ops.aten, name, op)``)."""
    if era not in ("2.3", "current"):
        raise ValueError(f"unknown era {era!r}")
    padded = era == "2.3"
    lib = torch.library.Library(namespace, "DEF")
    for schema in _SCHEMA_23 if padded else _current_schemas():
        lib.define(schema)

    def forward(
        query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
        return_debug_mask, *, scale=None, **extras,
    ):  # fmt: skip
        _no_extras(extras)
        if dropout_p != 0.0 or return_debug_mask:
            raise NotImplementedError("stand-in: dropout is not modelled")
        kern.check(
            query, key, value, cum_seq_q, cum_seq_k, what="forward", pad_head=False,
            head_msg=_HEAD_MSG,
        )  # fmt: skip
        s = query.shape[-1] ** -0.5 if scale is None else scale
        out, lse = kern.forward(
            query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, s, is_causal, padded
        )
        seed = torch.zeros(2 if not padded else (), dtype=torch.int64)
        return out, lse, seed, torch.zeros((), dtype=torch.int64), torch.empty(0, dtype=query.dtype)

    def backward(
        grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
        dropout_p, is_causal, seed, offset, *, scale=None, **extras,
    ):  # fmt: skip
        _no_extras(extras)
        if dropout_p != 0.0:
            raise NotImplementedError("stand-in: dropout is not modelled")
        kern.check(
            query, key, value, cum_seq_q, cum_seq_k, what="backward", pad_head=False,
            head_msg="head_size should be a multiple of 8",
        )  # fmt: skip
        s = query.shape[-1] ** -0.5 if scale is None else scale
        dq, dk, dv = (torch.empty_like(x) for x in (query, key, value))
        kern.backward(
            grad_out, query, key, value, out, logsumexp, dq, dk, dv, cum_seq_q, cum_seq_k,
            max_q, max_k, s, is_causal, padded,
        )  # fmt: skip
        return dq, dk, dv

    lib.impl("_flash_attention_forward", forward, "CPU")
    lib.impl("_flash_attention_backward", backward, "CPU")
    ns = getattr(torch.ops, namespace)
    ns._standin_library = lib  # keep the registrations alive
    return ns
