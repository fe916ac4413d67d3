"""ring-flash-attn's own varlen functions on CPU gloo ranks against the float64 reference.

The paper's Ring, Zigzag and Llama3 baselines are ``ring_flash_attn_varlen_func``,
``zigzag_ring_flash_attn_varlen_func`` and ``llama3_flash_attn_varlen_func`` of the PyPI package
``ring-flash-attn`` 0.1.8 (installed ``--no-deps`` in CI: ``.ci/run``). Here the package's code
runs unchanged on 2 and 4 gloo ranks, its P2P exchanges and collectives real, its kernels the
stand-in flash-attn (:mod:`standins.ring_flash_attn_peer`), each function in its own layout:

* ring: rank r holds chunk r of N equal chunks of every document (lengths multiples of N);
* zigzag: chunks r and 2N-1-r of 2N of every document (lengths multiples of 2N);
* llama3: chunk r of N contiguous chunks of the packed sequence (any lengths; C a multiple of N),
  its ``cu_seqlens`` from its own ``llama3_flash_attn_prepare_cu_seqlens``, KV heads gathered
  one at a time (``heads_k_stride=1``, so its head-group loop and contiguous dK/dV buffer run).

Inputs are bfloat16 (FlashAttention-2 and the stand-in refuse float32), GQA (4 query, 2 KV
heads), several documents. Outputs and dq, dk, dv, gathered back to packed order, must be within
``TOL`` of the float64 document-masked reference (:func:`flashcp.ops.reference.reference_attention`)
in max abs error relative to the reference's largest entry. The bound is set by bfloat16: the
stand-in rounds every block output and gradient to bfloat16 (relative 2^-8 = 0.0039), the
package merges in float32 and rounds the result once more; measured 0.002-0.005 here. The same
check on ``causal=False`` (the package's default; wrong for document-causal attention) errs by far
more than ``TOL`` (asserted: the check can fail).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from mp_utils import run_ranks
from standins.ring_flash_attn_peer import (
    import_peer,
    peer_cu_seqlens,
    peer_installed,
    peer_rows,
)

from flashcp.ops.reference import reference_attention

pytestmark = pytest.mark.skipif(
    not peer_installed(), reason="needs ring-flash-attn (pip install --no-deps ring-flash-attn)"
)

H, HKV, D = 4, 2, 16
#: max |peer - reference| / max |reference|, per output (module docstring)
TOL = 0.01
#: document lengths: multiples of 2N (ring needs N, zigzag 2N); llama3 gets odd ones too
DOCS = {2: (12, 28, 4, 20), 4: (24, 8, 40)}
LLAMA3_DOCS = {2: (13, 1, 30, 20), 4: (37, 9, 2, 24)}
NAMES = ("out", "dq", "dk", "dv")
METHODS = ("ring", "zigzag", "llama3")


def _inputs(c: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(c, nh, D, generator=g).to(torch.bfloat16) for nh in (H, HKV, HKV, H)]


def _run_peer(rfa, rank: int, n: int, method: str, docs, causal: bool) -> tuple:
    """The package's ``method`` function on this rank's rows, forward and backward."""
    q, k, v, dout = _inputs(sum(docs), len(docs))
    rows = torch.from_numpy(peer_rows(method, docs, n, rank))
    ql, kl, vl = (x[rows].clone().requires_grad_() for x in (q, k, v))
    if method == "llama3":
        cu = torch.tensor(np.concatenate([[0], np.cumsum(docs)]), dtype=torch.int32)
        cu_q, cu_k, mq, mk, kslice = rfa.llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, n)
        out = rfa.llama3_flash_attn_varlen_func(
            ql, kl, vl, cu_q, cu_k, mq, mk, 1, kslice, causal=causal
        )
    else:
        fn = getattr(rfa, f"{'zigzag_' if method == 'zigzag' else ''}ring_flash_attn_varlen_func")
        cu, max_len = peer_cu_seqlens(docs, n)
        out = fn(ql, kl, vl, cu, max_len, causal=causal)
    out.backward(dout[rows])
    return rows, [out.detach(), ql.grad, kl.grad, vl.grad]


def _run_all(rank: int, n: int, cases) -> list:
    """One rank: every case ``(method, docs, causal)`` (one import of the package per rank)."""
    rfa = import_peer("rfa_peer_num")
    return [_run_peer(rfa, rank, n, *case) for case in cases]


def _cases(n: int) -> tuple:
    cases = [(m, LLAMA3_DOCS[n] if m == "llama3" else DOCS[n], True) for m in METHODS]
    if n == 2:
        cases.append(("ring", DOCS[n], False))
    return tuple(cases)


@functools.cache
def _errors(n: int) -> dict:
    """``{(method, causal): {output: relative max error}}`` of every case at ``n`` ranks."""
    cases = _cases(n)
    per_rank = run_ranks(_run_all, n, cases, timeout_s=120)
    result = {}
    for c, (method, docs, causal) in enumerate(cases):
        q, k, v, dout = _inputs(sum(docs), len(docs))
        leaves = [x.double().requires_grad_() for x in (q, k, v)]
        ref = reference_attention(*leaves, list(docs))
        ref.backward(dout.double())
        want = [ref.detach(), *(x.grad for x in leaves)]
        errors = {}
        for i, name in enumerate(NAMES):
            got = torch.full_like(want[i], float("nan"))
            for r in range(n):
                rows, tensors = per_rank[r][c]
                assert tensors[i].dtype == torch.bfloat16, f"{name} is {tensors[i].dtype}"
                got[rows] = tensors[i].double()
            assert not got.isnan().any(), f"{method} N={n}: {name} has rows no rank returned"
            errors[name] = float((got - want[i]).abs().max() / want[i].abs().max())
        result[(method, causal)] = errors
    return result


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("method", METHODS)
def test_peer_matches_reference(method, n):
    errors = _errors(n)[(method, True)]
    bad = {k: e for k, e in errors.items() if not e <= TOL}
    assert not bad, f"ring-flash-attn {method} N={n}: relative max errors {errors} (TOL {TOL})"


def test_peer_check_can_fail():
    """The package's default ``causal=False`` (every key of every document) is caught."""
    errors = _errors(2)[("ring", False)]
    assert min(errors.values()) > 10 * TOL, errors
