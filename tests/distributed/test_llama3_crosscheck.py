"""Cross-check our all-gather machinery with ``ring-flash-attn``'s ``llama3_flash_attn_varlen_func``.

The package's llama3 op implements the *N contiguous chunks* layout (our ``ring`` plan), not the
paper's 2N-chunk Llama3 layout, so this test runs our all-gather forward/backward
(:mod:`flashcp.ops.allgather_attn`) on ``ring`` plans and compares both with the float64 reference
and with each other, on real gloo ranks on CPU. Skipped unless ``ring_flash_attn`` is installed.

Its kernels come from ``flash_attn`` (CUDA only), so each rank installs a test-only stand-in for
``flash_attn.flash_attn_interface`` built on our CPU backend: varlen forward returning (out, lse) and
a backward writing into the given dq/dk/dv (FlashAttention-2's calling convention).

Upstream quirks met (ring-flash-attn 0.1.8, read from its source):

* ``import ring_flash_attn`` runs its ``adapters`` (Hugging Face), which need ``transformers``; the
  test imports ``ring_flash_attn.llama3_flash_attn_varlen`` without running the package
  ``__init__``.
* ``llama3_flash_attn_varlen_func`` defaults to ``causal=False``; document-causal needs ``causal=True``.
* Its layout is N contiguous chunks (``llama3_flash_attn_prepare_cu_seqlens``), each rank's keys a
  slice ``local_k_slice`` of the all-gathered KV starting at the first local document's start.
* It all-gathers K and V of all heads in ``nheads_k / heads_k_stride`` rounds, and reduce-scatters
  dK/dV in the input dtype; ours moves K and V in one buffer per pass.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import numpy as np
import pytest
import torch
from mp_utils import run_ranks

from flashcp.ops.allgather_attn import (
    allgather_attn_backward,
    allgather_attn_forward,
    build_allgather_meta,
)
from flashcp.ops.backends import get_backend
from flashcp.ops.reference import reference_attention
from flashcp.ops.sharding import shard_tensor, unshard
from flashcp.registry import make_plan_for


def _installed(name: str) -> bool:
    """Whether ``name`` can be imported (an import hook that refuses it counts as missing)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


pytestmark = pytest.mark.skipif(
    not _installed("ring_flash_attn"), reason="needs the ring-flash-attn package"
)


def _install_cpu_flash_attn_stand_in() -> None:
    """Register a CPU ``flash_attn.flash_attn_interface`` in this (forked) process only."""
    cpu = get_backend("cpu")

    def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, dropout_p, softmax_scale, causal,
                                   window_size_left=-1, window_size_right=-1, softcap=0.0,
                                   alibi_slopes=None, return_softmax=False):  # fmt: skip
        out, lse = cpu.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal=causal, softmax_scale=softmax_scale)  # fmt: skip
        return out, lse, None, None

    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                    cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                    softmax_scale, causal, window_size_left=-1,
                                    window_size_right=-1, softcap=0.0, alibi_slopes=None,
                                    deterministic=False, rng_state=None):  # fmt: skip
        grads = cpu.backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
                             max_seqlen_q, max_seqlen_k, causal=causal,
                             softmax_scale=softmax_scale)  # fmt: skip
        for dst, src in zip((dq, dk, dv), grads, strict=True):
            dst.copy_(src)
        return dq, dk, dv

    fa = types.ModuleType("flash_attn")
    fai = types.ModuleType("flash_attn.flash_attn_interface")
    fai._flash_attn_varlen_forward = _flash_attn_varlen_forward
    fai._flash_attn_varlen_backward = _flash_attn_varlen_backward
    fa.flash_attn_interface = fai
    sys.modules["flash_attn"], sys.modules["flash_attn.flash_attn_interface"] = fa, fai
    pkg = types.ModuleType("ring_flash_attn")  # skip the package __init__ (it needs transformers)
    pkg.__path__ = list(importlib.util.find_spec("ring_flash_attn").submodule_search_locations)
    sys.modules["ring_flash_attn"] = pkg


def _inputs(lens, h, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    c = sum(lens)
    return [torch.randn(c, nh, d, generator=g) for nh in (h, hkv, hkv, h)]


CASES = [[37, 1, 60, 30], [128], [3, 5, 100, 20]]


def _both(rank, n, cases):
    _install_cpu_flash_attn_stand_in()
    from ring_flash_attn.llama3_flash_attn_varlen import (
        llama3_flash_attn_prepare_cu_seqlens,
        llama3_flash_attn_varlen_func,
    )

    torch.set_num_threads(1)
    cpu = get_backend("cpu")
    res = []
    for ci, lens in enumerate(cases):
        q, k, v, dout = _inputs(lens, 4, 2, 8, ci)
        plan = make_plan_for("ring", lens, n)
        # ours: all-gather machinery on the N-chunk layout
        meta = build_allgather_meta(plan, rank, "ring", sharding_aware=False)
        ql, kl, vl, dl = (shard_tensor(x, plan, rank) for x in (q, k, v, dout))
        scale = 8**-0.5
        out, lse = allgather_attn_forward(ql, kl, vl, meta, None, scale, cpu, None, None)
        ours = (out, *allgather_attn_backward(dl, ql, kl, vl, out, lse, meta, None, scale, cpu,
                                              None, None))  # fmt: skip
        # upstream
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
        cu_q, cu_k, mq, mk, kslice = llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, n)
        qu, ku, vu = (x.clone().requires_grad_() for x in (ql, kl, vl))
        up = llama3_flash_attn_varlen_func(qu, ku, vu, cu_q, cu_k, mq, mk, 2, kslice,
                                           softmax_scale=scale, causal=True)  # fmt: skip
        up.backward(dl)
        res.append((ours, (up.detach(), qu.grad, ku.grad, vu.grad)))
    return res


@pytest.mark.parametrize("n", [2, 4])
def test_llama3_n_chunk_layout_matches_ring_flash_attn(n):
    results = run_ranks(_both, n, CASES, timeout_s=120)
    for ci, lens in enumerate(CASES):
        q, k, v, dout = _inputs(lens, 4, 2, 8, ci)
        leaves = [x.double().requires_grad_() for x in (q, k, v)]
        ref = reference_attention(*leaves, lens)
        ref.backward(dout.double())
        want = [ref.detach()] + [x.grad for x in leaves]
        plan = make_plan_for("ring", lens, n)
        for i, what in enumerate(("out", "dq", "dk", "dv")):
            ours = unshard([results[r][ci][0][i] for r in range(n)], plan)
            theirs = unshard([results[r][ci][1][i] for r in range(n)], plan)
            torch.testing.assert_close(ours.double(), want[i], rtol=1e-4, atol=1e-4, msg=what)
            torch.testing.assert_close(theirs.double(), want[i], rtol=1e-4, atol=1e-4, msg=what)
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, msg=what)
