"""Every CP op and CPU backend accepts q, k, v and dout in any layout (strided views).

A view of a wider tensor (``x[..., ::2]``), a transposed ``(H, T, D)`` buffer seen as
``(T, H, D)``, or the q / k / v slices of one fused projection must give the same output and
gradients as contiguous inputs: checked on two gloo ranks against the float64 reference
(:func:`flashcp.ops.reference.reference_attention`), forward and backward, for every method of the
registry and both CPU backends; and the backends alone on one device.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from mp_utils import run_ranks

from flashcp.ops import get_attn_op
from flashcp.ops.backends import CpuBackend, ReferenceBackend, get_backend
from flashcp.ops.reference import reference_attention
from flashcp.ops.sharding import shard_tensor, unshard
from flashcp.registry import make_plan_for, method_names

LENS = [9, 23, 5, 27]  # C = 64 on 2 ranks: documents split across ranks and kept whole
H, HKV, D = 4, 2, 8
LAYOUTS = ("every_other", "transposed", "fused_qkv")
BACKENDS = ("cpu", "cpu_aten", "reference")  # cpu_aten: every segment on the aten CPU kernel


@dataclass(frozen=True)
class _UnitStrideOnly(ReferenceBackend):
    """The reference kernel behind the check the CUDA kernels make: every tensor argument has a
    unit last-dimension stride (what the ops must hand any kernel)."""

    def _check(self, *tensors):
        strides = [t.stride(-1) for t in tensors]
        if any(s != 1 for s in strides):
            raise AssertionError(f"kernel got last-dimension strides {strides}")

    def _forward(self, q, k, v, *rest):
        self._check(q, k, v)
        return super()._forward(q, k, v, *rest)

    def _backward(self, dout, q, k, v, out, lse, *rest):
        self._check(dout, q, k, v, out, lse)
        return super()._backward(dout, q, k, v, out, lse, *rest)


def _backend(name):
    if name == "unit_stride":
        return _UnitStrideOnly()
    return CpuBackend(kernel_min=1) if name == "cpu_aten" else get_backend(name)


def _packed(seed=0):
    g = torch.Generator().manual_seed(seed)
    c = sum(LENS)
    q, k, v = (torch.randn(c, nh, D, generator=g) for nh in (H, HKV, HKV))
    return q, k, v, torch.randn(c, H, D, generator=g)


def _strided(layout: str, q, k, v, dout):
    """The same values as (q, k, v, dout), as non-contiguous views of ``layout``; returns the
    leaves (to differentiate) and the views (to pass to the op)."""
    t = q.shape[0]
    if layout == "every_other":  # the last dimension strided: x[..., ::2] of a wider tensor
        bases = [torch.zeros(*x.shape[:2], 2 * D) for x in (q, k, v)]
        for b, x in zip(bases, (q, k, v), strict=True):
            b[..., ::2] = x
        leaves = [b.requires_grad_() for b in bases]
        views = [b[..., ::2] for b in leaves]
    elif layout == "transposed":  # an (H, T, D) buffer seen as (T, H, D)
        leaves = [x.transpose(0, 1).contiguous().requires_grad_() for x in (q, k, v)]
        views = [b.transpose(0, 1) for b in leaves]
    else:  # one fused projection (T, 3 slots, H, D) with heads last-dim strided: (T, H, D, 3)
        fused = torch.zeros(t, H + 2 * HKV, D, 3)
        fused[:, :H, :, 0], fused[:, H : H + HKV, :, 1], fused[:, H + HKV :, :, 2] = q, k, v
        leaf = fused.requires_grad_()
        leaves = [leaf]
        views = [leaf[:, :H, :, 0], leaf[:, H : H + HKV, :, 1], leaf[:, H + HKV :, :, 2]]
    dbase = torch.zeros(t, 3, H, D)
    dbase[:, 1] = dout
    dview = dbase[:, 1]  # dout strided too (rows 3 x apart)
    if layout == "every_other":
        dbase = torch.zeros(t, H, 2 * D)
        dbase[..., 1::2] = dout
        dview = dbase[..., 1::2]
    for view in views:
        assert not view.is_contiguous()
    assert not dview.is_contiguous()
    return leaves, views, dview


def _run(rank, n, methods, backends, options):
    q, k, v, dout = _packed()
    res = {}
    for m in methods:
        plan = make_plan_for(m, LENS, n, **options)
        prepare, attn = get_attn_op(m)
        meta = prepare(plan, rank)
        local = [shard_tensor(x, plan, rank) for x in (q, k, v, dout)]
        for b in backends:
            for layout in LAYOUTS:
                _, views, dview = _strided(layout, *local)
                out = attn(*views, meta, backend=_backend(b))
                grads = torch.autograd.grad(out, views, dview)
                res[m, b, layout] = [out.detach(), *grads]
    return res


def _reference():
    q, k, v, dout = _packed()
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out = reference_attention(*leaves, LENS)
    out.backward(dout.double())
    return [out.detach()] + [x.grad for x in leaves]


GROUPS = [  # (methods, cp_size, planner options): the hybrids with both of their dimensions
    (("llama3", "per_doc", "ring", "zigzag"), 2, {}),
    (("flashcp", "flashcp_refined", "ilp"), 2, {}),
    (("ulysses",), 2, {}),
    (("usp", "flashcp_ulysses"), 4, {"ulysses_degree": 2}),
    (("flashcp_node",), 4, {"num_nodes": 2}),  # its two-scope gather (one node: flashcp's op)
]


@pytest.mark.parametrize(("methods", "n", "options"), GROUPS, ids=lambda x: "-".join(x)
                         if isinstance(x, tuple) else None)  # fmt: skip
def test_every_method_and_backend_accepts_strided_inputs(methods, n, options):
    want = _reference()
    backends = (*BACKENDS, "unit_stride")
    results = run_ranks(_run, n, methods, backends, options, timeout_s=120)
    failures = []
    for m in methods:
        plan = make_plan_for(m, LENS, n, **options)
        for b in backends:
            for layout in LAYOUTS:
                got = [
                    unshard([results[r][m, b, layout][i] for r in range(n)], plan) for i in range(4)
                ]
                for what, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
                    err = float((g.double() - w).abs().max())
                    if err > 1e-4 * max(1.0, float(w.abs().max())):
                        failures.append(f"{m} {b} {layout} {what}: max abs err {err:.3g}")
    assert not failures, "\n".join(failures)


def test_registry_methods_are_all_covered():
    covered = {m for methods, _, _ in GROUPS for m in methods}
    assert set(method_names()) <= covered, "a new method needs a strided-input check here"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_backend_accepts_strided_inputs(backend, layout):
    """One varlen call (the segments of LENS, causal) with strided q, k, v, dout, out: the same
    results as on contiguous copies."""
    q, k, v, dout = _packed(1)
    cu = torch.tensor([0, 9, 32, 37, 64], dtype=torch.int32)
    be = _backend(backend)
    args = (cu, cu, 27, 27)
    kw = {"causal": True, "softmax_scale": 0.3}
    out, lse = be.forward(q, k, v, *args, **kw)
    grads = be.backward(dout, q, k, v, out, lse, *args, **kw)
    _, views, dview = _strided(layout, q, k, v, dout)
    out_s, lse_s = be.forward(*views, *args, **kw)
    wide_out = torch.zeros(*out.shape[:2], 2 * D)
    wide_out[..., ::2] = out
    grads_s = be.backward(dview, *views, wide_out[..., ::2], lse, *args, **kw)
    torch.testing.assert_close(out_s, out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse_s, lse, rtol=1e-6, atol=1e-6)
    for g_s, g in zip(grads_s, grads, strict=True):
        torch.testing.assert_close(g_s, g, rtol=1e-5, atol=1e-6)


def _collectives(rank, n):
    from flashcp.ops.collectives import all_gather_into_tensor, reduce_scatter_tensor

    x = torch.arange(12.0).view(3, 4) + 100 * rank
    wide = torch.zeros(2 * n * 3, 4)
    gathered = wide[::2]  # (N * 3, 4) non-contiguous output
    all_gather_into_tensor(gathered, x.t().contiguous().t(), None)  # non-contiguous input
    summed = torch.zeros(3, 8)[:, ::2]
    reduce_scatter_tensor(summed, torch.full((4, 3 * n), rank + 1.0).t())  # (N * 3, 4) transposed
    return gathered, summed


def test_collectives_accept_strided_buffers():
    n = 2
    for gathered, summed in run_ranks(_collectives, n, timeout_s=30):
        want = torch.cat([torch.arange(12.0).view(3, 4) + 100 * r for r in range(n)])
        torch.testing.assert_close(gathered, want)
        torch.testing.assert_close(summed, torch.full((3, 4), float(sum(range(1, n + 1)))))
