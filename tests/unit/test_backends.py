"""Kernel backends against an independent float64 computation (autograd for gradients)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from flashcp.ops.backends import get_backend

# (name, options): the cpu backend with its default split, only its dense path (whole and cut into
# query chunks by a tiny budget), only the aten-kernel path, and the float64 reference
CPU_BACKENDS = [
    ("cpu", {}),
    ("cpu", {"kernel_min": 1 << 30}),
    ("cpu", {"kernel_min": 1 << 30, "block_budget": 40}),
    ("cpu", {"kernel_min": 1}),
    ("reference", {}),
]


def _backend(name, options):
    b = get_backend(name)
    return type(b)(name, **options) if options else b


def _longest(cu):
    """max_seqlen of the segments with boundaries ``cu``."""
    return max(b - a for a, b in itertools.pairwise(cu))


def _naive(q, k, v, cu_q, cu_k, causal, scale):
    """Per-segment float64 attention with autograd; rows with no key give 0."""
    g = q.shape[1] // k.shape[1]
    outs = []
    for i in range(len(cu_q) - 1):
        qs = q[cu_q[i] : cu_q[i + 1]].double()
        ks = k[cu_k[i] : cu_k[i + 1]].double().repeat_interleave(g, 1)
        vs = v[cu_k[i] : cu_k[i + 1]].double().repeat_interleave(g, 1)
        sq, sk = qs.shape[0], ks.shape[0]
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if causal:
            seen = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + sk - sq
            s = s.masked_fill(~seen, float("-inf"))
        m = torch.logsumexp(s, -1, keepdim=True)
        p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m))
        outs.append(torch.einsum("hqk,khd->qhd", p, vs))
    return torch.cat(outs)


CASES = [
    ([0, 5, 5, 12, 13], [0, 3, 9, 20, 21]),  # sq != sk, an empty query segment, rows seeing nothing
    ([0, 7, 8, 30], [0, 7, 8, 30]),  # self-attention segments incl. a length-1 one
    ([0, 40], [0, 70]),  # one long shard with a prefix
    ([0, 0, 3], [0, 4, 4]),  # empty key segment -> rows with no key
]


@pytest.mark.parametrize("name,options", CPU_BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("case", CASES)
def test_forward_backward(name, options, causal, heads, case):
    torch.manual_seed(0)
    cu_q, cu_k = case
    h, hkv, d = *heads, 8
    scale = 1 / math.sqrt(d)
    q = torch.randn(cu_q[-1], h, d, requires_grad=True)
    k = torch.randn(cu_k[-1], hkv, d, requires_grad=True)
    v = torch.randn(cu_k[-1], hkv, d, requires_grad=True)
    ref = _naive(q, k, v, cu_q, cu_k, causal, scale)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    be = _backend(name, options)
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    with torch.no_grad():
        mq, mk = _longest(cu_q), _longest(cu_k)
        out, lse = be.forward(q, k, v, cq, ck, mq, mk, causal=causal, softmax_scale=scale)
        assert out.dtype == q.dtype and lse.dtype == torch.float32
        assert lse.shape == (h, cu_q[-1]) and not torch.isnan(out).any()
        torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
        empty = (ref.detach().abs().sum(-1) == 0).t()  # (H, Tq) rows with no visible key
        assert torch.isneginf(lse[empty]).all() and torch.isfinite(lse[~empty]).all()
        dq, dk, dv = be.backward(
            dout.float(), q, k, v, out, lse, cq, ck, mq, mk, causal=causal, softmax_scale=scale
        )
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert got.shape == want.shape and not torch.isnan(got).any()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,options", CPU_BACKENDS)
def test_blockwise_backward_with_global_lse(name, options):
    """A causal shard (s queries, prefix p) = non-causal block over the prefix + causal diagonal
    block. Forward both, merge with their LSE, then backward each block with the *global* out/lse:
    the contributions must add up to the gradients of the whole shard."""
    torch.manual_seed(1)
    s, p, h, hkv, d = 9, 13, 4, 2, 8
    scale = 0.3
    q = torch.randn(s, h, d, requires_grad=True)
    k = torch.randn(p + s, hkv, d, requires_grad=True)
    v = torch.randn(p + s, hkv, d, requires_grad=True)
    ref = _naive(q, k, v, [0, s], [0, p + s], True, scale)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    be = _backend(name, options)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    with torch.no_grad():
        o1, l1 = be.forward(
            q, k[:p], v[:p], i32(0, s), i32(0, p), s, p, causal=False, softmax_scale=scale
        )
        o2, l2 = be.forward(
            q, k[p:], v[p:], i32(0, s), i32(0, s), s, s, causal=True, softmax_scale=scale
        )
        lse = torch.logaddexp(l1, l2)  # (H, s)
        w1, w2 = torch.exp(l1 - lse).t()[..., None], torch.exp(l2 - lse).t()[..., None]
        out = w1 * o1 + w2 * o2
        torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
        dq1, dk1, dv1 = be.backward(
            dout.float(),
            q,
            k[:p],
            v[:p],
            out,
            lse,
            i32(0, s),
            i32(0, p),
            s,
            p,
            causal=False,
            softmax_scale=scale,
        )
        dq2, dk2, dv2 = be.backward(
            dout.float(),
            q,
            k[p:],
            v[p:],
            out,
            lse,
            i32(0, s),
            i32(0, s),
            s,
            s,
            causal=True,
            softmax_scale=scale,
        )
    torch.testing.assert_close(dq1 + dq2, q.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat([dk1, dk2]), k.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat([dv1, dv2]), v.grad, rtol=1e-4, atol=1e-4)


def test_get_backend_errors():
    assert get_backend("auto", "cpu").name == "cpu"
    assert get_backend("reference").name == "reference"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("nope")
    with pytest.raises(ValueError, match="CUDA"):
        get_backend("torch_cuda", "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        get_backend("flash_attn", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["torch_cuda", "flash_attn"])
@pytest.mark.parametrize("case", CASES[:3])
def test_cuda_backends(name, case):
    try:
        be = get_backend(name, "cuda")
    except ValueError as e:
        pytest.skip(str(e))
    torch.manual_seed(0)
    cu_q, cu_k = case
    h, hkv, d = 8, 2, 64
    dev = "cuda"
    q = torch.randn(cu_q[-1], h, d, device=dev, dtype=torch.bfloat16, requires_grad=False)
    k = torch.randn(cu_k[-1], hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(cu_k[-1], hkv, d, device=dev, dtype=torch.bfloat16)
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref = _naive(*leaves, cu_q, cu_k, True, d**-0.5)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    cq = torch.tensor(cu_q, dtype=torch.int32, device=dev)
    ck = torch.tensor(cu_k, dtype=torch.int32, device=dev)
    mq = max(b - a for a, b in itertools.pairwise(cu_q))
    mk = max(b - a for a, b in itertools.pairwise(cu_k))
    with torch.no_grad():
        out, lse = be.forward(q, k, v, cq, ck, mq, mk, causal=True, softmax_scale=d**-0.5)
        assert lse.shape == (h, cu_q[-1]) and not torch.isnan(out).any()
        torch.testing.assert_close(out.double().cpu(), ref.detach(), rtol=2e-2, atol=2e-2)
        grads = be.backward(
            dout.to(dev, torch.bfloat16),
            q,
            k,
            v,
            out,
            lse,
            cq,
            ck,
            mq,
            mk,
            causal=True,
            softmax_scale=d**-0.5,
        )
    for got, leaf in zip(grads, leaves, strict=True):
        torch.testing.assert_close(got.double().cpu(), leaf.grad, rtol=5e-2, atol=5e-2)


def test_bad_varlen_arguments_raise():
    be = get_backend("cpu")
    q, k = torch.randn(6, 4, 8), torch.randn(6, 2, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    kw = {"causal": True, "softmax_scale": 0.3}
    out, lse = be.forward(q, k, k, cu, cu, 4, 4, **kw)
    bad_forward = [
        ((q, torch.randn(6, 3, 8), torch.randn(6, 3, 8), cu, cu), "multiple of num_kv_heads"),
        ((q, k, k, cu.long(), cu), "int32"),
        ((q, k, k, torch.tensor([0, 2, 5], dtype=torch.int32), cu), "rise from 0 to 6"),
        ((q, k, k, cu, torch.tensor([0, 6], dtype=torch.int32)), "same segments"),
        ((q, k.double(), k.double(), cu, cu), "dtypes differ"),
    ]
    for args, match in bad_forward:
        with pytest.raises(ValueError, match=match):
            be.forward(*args, 4, 4, **kw)
    for bad_lse in (lse.t(), lse.double(), lse[:, :3]):
        with pytest.raises(ValueError, match="lse must be"):
            be.backward(out, q, k, k, out, bad_lse, cu, cu, 4, 4, **kw)
    with pytest.raises(ValueError, match="out must have"):
        be.backward(out, q, k, k, out[:3], lse, cu, cu, 4, 4, **kw)


@pytest.mark.parametrize(
    "name,options", [("reference", {}), ("cpu", {}), ("cpu", {"kernel_min": 1})]
)
def test_float64_lse_and_gradients_stay_float64(name, options):
    """float64 inputs: the LSE comes back in float64 (compute_dtype), the backward takes it and
    refuses a float32 one, and out/grads match float64 autograd to rounding error."""
    torch.manual_seed(2)
    cu_q, cu_k = [0, 5, 5, 12, 13], [0, 3, 9, 20, 21]
    q = torch.randn(cu_q[-1], 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(cu_k[-1], 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(cu_k[-1], 2, 8, dtype=torch.float64, requires_grad=True)
    ref = _naive(q, k, v, cu_q, cu_k, True, 0.3)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    be = _backend(name, options)
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    kw = {"causal": True, "softmax_scale": 0.3}
    with torch.no_grad():
        mq, mk = _longest(cu_q), _longest(cu_k)
        out, lse = be.forward(q, k, v, cq, ck, mq, mk, **kw)
        assert out.dtype == lse.dtype == torch.float64
        torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)
        grads = be.backward(dout, q, k, v, out, lse, cq, ck, mq, mk, **kw, grad_dtype=torch.float64)
        with pytest.raises(ValueError, match=r"lse must be .* torch\.float64"):
            be.backward(dout, q, k, v, out, lse.float(), cq, ck, mq, mk, **kw)
    for got, leaf in zip(grads, (q, k, v), strict=True):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, leaf.grad, rtol=1e-12, atol=1e-12)


def test_compute_dtype_is_one_rule():
    from flashcp.ops.backends import compute_dtype

    assert compute_dtype(torch.bfloat16) == compute_dtype(torch.float16) == torch.float32
    assert compute_dtype(torch.float32) == torch.float32
    assert compute_dtype(torch.float64) == torch.float64
    with pytest.raises(ValueError, match="floating-point"):
        compute_dtype(torch.int32)
