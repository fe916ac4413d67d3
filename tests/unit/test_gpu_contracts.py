"""Contract tests of the GPU adapters, on CPU: ``flash_attn`` and ``torch_cuda`` against stand-ins.

The stand-ins (:mod:`standins`) have the entry points the adapters call, with the argument names,
order, return tuples, LSE layouts and refusals of flash-attn 2.5.x, 2.6.x, 2.7/2.8.x
(``torch.library.custom_op``) and of PyTorch's 2.3-era and current
``_flash_attention_forward/_backward`` schemas, computing as the GPU kernels do (the first
``max_seqlen`` rows of a segment only; the backward from the given lse and out) in float64. The
adapter classes run against them here, one kernel call at a time and inside every method's op
(CP 2, in-process ranks), and must match the float64 reference: in bfloat16 within 2x the error
of a plain single-device bfloat16 computation (flash-attention's own test criterion).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import itertools
import sys
import warnings

import pytest
import torch
from standins import make_aten_flash, make_flash_attn
from standins.flash_attn_pkg import install

from flashcp.executors.emulate_record import record
from flashcp.ops.backends import (
    FlashAttnBackend,
    ReferenceBackend,
    TorchCudaBackend,
    get_backend,
)
from flashcp.ops.backends import cuda as cuda_backends
from flashcp.ops.reference import document_mask, reference_attention
from flashcp.ops.sharding import shard_tensor, unshard
from flashcp.registry import make_plan_for, method_names

NAMESPACE = "flashcp_gpu_contracts"  # torch.library namespace of this module's stand-ins
FA_VERSIONS = ("2.5.9", "2.6.3", "2.7.4", "2.8.3")
ATEN_ERAS = ("2.3", "current")
KERNELS = [f"flash_attn-{v}" for v in FA_VERSIONS] + [f"torch_cuda-{e}" for e in ATEN_ERAS]
#: every registered method (a new one is covered without editing this file)
METHODS = tuple(method_names())
BF16 = torch.bfloat16


def _use(kernel: str, monkeypatch):
    """Install the stand-in ``kernel`` (``flash_attn-<version>`` or ``torch_cuda-<era>``) for
    one test; returns the adapter instance that runs on it."""
    name, which = kernel.split("-")
    if name == "flash_attn":
        install(monkeypatch, make_flash_attn(which, NAMESPACE))
        return FlashAttnBackend()
    ops = make_aten_flash(which, f"{NAMESPACE}_aten_{which.replace('.', '_')}")
    for op in ("_flash_attention_forward", "_flash_attention_backward"):
        monkeypatch.setattr(torch.ops.aten, op, getattr(ops, op))
    return TorchCudaBackend()


def _raw_forward(kernel: str, q, k, v, cu_q, cu_k, max_q, max_k, causal=True):
    """The stand-in's own forward entry point: (out, lse as the kernel returns it)."""
    name, which = kernel.split("-")
    if name == "flash_attn":
        fai = make_flash_attn(which, NAMESPACE).flash_attn_interface
        out, lse, _ = fai.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=0.5, causal=causal,
            return_attn_probs=True,
        )  # fmt: skip
        return out, lse
    ops = make_aten_flash(which, f"{NAMESPACE}_aten_{which.replace('.', '_')}")
    out, lse, *_ = ops._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=0.5
    )
    return out, lse


def _i32(*x):
    return torch.tensor(x, dtype=torch.int32)


def _longest(cu):
    return max((b - a for a, b in itertools.pairwise(cu)), default=0)


# ---- the stand-ins behave as the kernels do ---------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
def test_standins_refuse_what_the_kernels_refuse(kernel):
    q = torch.randn(4, 2, 8, dtype=BF16)
    cu = _i32(0, 4)
    with pytest.raises(RuntimeError, match="batch size must be positive"):
        _raw_forward(kernel, q[:0], q[:0], q[:0], _i32(0), _i32(0), 0, 0)
    with pytest.raises(RuntimeError, match="only support fp16 and bf16"):
        _raw_forward(kernel, q.float(), q.float(), q.float(), cu, cu, 4, 4)
    big = torch.randn(4, 2, 264, dtype=BF16)
    with pytest.raises(RuntimeError, match="head dimension at most 256"):
        _raw_forward(kernel, big, big, big, cu, cu, 4, 4)
    if kernel.startswith("torch_cuda"):  # aten takes padded heads only (sdpa pads before)
        odd = torch.randn(4, 2, 12, dtype=BF16)
        with pytest.raises(RuntimeError, match="multiple of 8"):
            _raw_forward(kernel, odd, odd, odd, cu, cu, 4, 4)


@pytest.mark.parametrize("kernel", KERNELS)
def test_standins_mark_keyless_rows_and_compute_only_max_seqlen_rows(kernel):
    """Causal (sq, sk) = (4, 2): the first two rows see no key (out 0, lse +inf). A max_seqlen_q
    shorter than a segment leaves its last rows unwritten, silently (NaN here)."""
    q, k = torch.randn(6, 2, 8, dtype=BF16), torch.randn(4, 2, 8, dtype=BF16)
    cu_q, cu_k = _i32(0, 4, 6), _i32(0, 2, 4)
    padded = kernel in ("flash_attn-2.5.9", "torch_cuda-2.3")
    out, lse = _raw_forward(kernel, q, k, k, cu_q, cu_k, 4, 2)
    assert lse.shape == ((2, 2, 4) if padded else (2, 6)) and lse.dtype == torch.float32
    rows = lse[0] if padded else lse[:, :4]  # segment 0: (H, 4)
    assert torch.isposinf(rows[:, :2]).all() and torch.isfinite(rows[:, 2:]).all()
    assert (out[:2] == 0).all() and not out.isnan().any()
    out, _ = _raw_forward(kernel, q, k, k, cu_q, cu_k, 3, 2)  # wrong: segment 0 has 4 rows
    assert out[3].isnan().all() and not out[:3].isnan().any() and not out[4:].isnan().any()


def test_custom_op_generations_hide_their_signature():
    """flash-attn >= 2.7 registers the varlen entry points as torch.library custom ops: their
    signature says nothing, so an adapter must not read argument names from it."""
    for version in FA_VERSIONS:
        fai = make_flash_attn(version, NAMESPACE).flash_attn_interface
        params = inspect.signature(fai._flash_attn_varlen_backward).parameters
        if version >= "2.7":
            assert list(params) == ["args", "kwargs"]
        else:
            assert "softmax_lse" in params and ("softcap" in params) == (version >= "2.6")


# ---- the calling convention: chosen once per version, both sides tested ------------------------


def test_flash_attn_convention_per_version():
    for version, padded, softcap, split in [
        ("2.4.2", True, False, False),
        ("2.5.9.post1", True, False, False),
        ("2.6.0", False, True, False),
        ("2.6.3", False, True, False),
        ("2.7.0.post2", False, True, True),
        ("2.8.3", False, True, True),
    ]:
        conv = cuda_backends.flash_attn_convention(version)
        assert (conv.padded_lse, conv.softcap, conv.split_window) == (padded, softcap, split)
    for bad in ("2.3.6", "3.0.0b1", "nightly"):
        with pytest.raises(ValueError, match="flash-attn"):
            cuda_backends.flash_attn_convention(bad)
    names = ["dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv", "cu_q", "cu_k"]
    for version in FA_VERSIONS:  # the positions land on the parameters of that version
        fai = make_flash_attn(version, NAMESPACE).flash_attn_interface
        if version >= "2.7":  # a custom op: its parameter names are in its schema
            op = fai._flash_attn_varlen_backward._opoverload
            params = [a.name for a in op._schema.arguments]
        else:
            params = list(inspect.signature(fai._flash_attn_varlen_backward).parameters)
        args = cuda_backends.flash_attn_convention(version).backward_args(
            *names, 101, 102, True, 0.25
        )
        got = dict(zip(params, args, strict=False))
        assert len(args) <= len(params) and args[:11] == tuple(names)
        assert got["max_seqlen_q"] == 101 and got["max_seqlen_k"] == 102
        assert got["causal"] is True and got["softmax_scale"] == 0.25 and got["dropout_p"] == 0
        assert got["alibi_slopes"] is None and got["deterministic"] is False
        assert got.get("softcap", 0.0) == 0.0 and ("softcap" in got) == (version >= "2.6")
        if version >= "2.7":
            assert got["window_size_left"] == got["window_size_right"] == -1
        else:
            assert got["window_size"] == (-1, -1)


@pytest.mark.parametrize("era", ATEN_ERAS)
def test_aten_lse_layout_is_probed_once_per_operator(era):
    ops = make_aten_flash(era, f"{NAMESPACE}_aten_{era.replace('.', '_')}")
    assert cuda_backends.aten_lse_padded(ops._flash_attention_forward, "cpu") == (era == "2.3")


# ---- the adapters, one call at a time ---------------------------------------------------------

#: (name, cu_q, cu_k, H, Hkv, D, causal): prefix segments (k longer than q), an empty query
#: segment, a segment whose first rows see no key, a key-less segment, GQA, an odd head_dim
CALLS = [
    ("prefix_gqa", [0, 5, 5, 12, 13], [0, 3, 9, 20, 21], 4, 2, 16, True),
    ("full_gqa", [0, 5, 5, 12, 13], [0, 3, 9, 20, 21], 4, 2, 16, False),
    ("keyless_segment", [0, 4, 9], [0, 0, 9], 2, 1, 8, True),
    ("head_dim_12", [0, 7, 16], [0, 9, 18], 2, 2, 12, True),
    ("no_segment", [0], [0], 2, 2, 8, True),
    ("no_keys", [0, 3], [0, 0], 2, 2, 8, True),
]


def _segments_plain(q, k, v, dout, cu_q, cu_k, causal, scale):
    """Segment-wise attention in q's dtype (every op in it, autograd through them) and in
    float64: ``(plain [out, dq, dk, dv], float64 [out, dq, dk, dv])``."""
    res = []
    for dtype in (q.dtype, torch.float64):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        qs, ks, vs = leaves
        g = q.shape[1] // k.shape[1]
        outs = []
        for (q0, q1), (k0, k1) in zip(
            itertools.pairwise(cu_q), itertools.pairwise(cu_k), strict=True
        ):
            sq, sk = q1 - q0, k1 - k0
            a = qs[q0:q1].transpose(0, 1)  # (H, sq, D)
            b = ks[k0:k1].transpose(0, 1).repeat_interleave(g, 0)
            c = vs[k0:k1].transpose(0, 1).repeat_interleave(g, 0)
            s = torch.matmul(a, b.transpose(1, 2)) * scale
            if causal:
                mask = torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq)
                s = s.masked_fill(mask, float("-inf"))
            p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row without a key: 0
            outs.append(torch.matmul(p, c).transpose(0, 1))
        out = torch.cat(outs) if outs else qs * 0
        if out.requires_grad:
            out.backward(dout.to(dtype))
        res.append(
            [out.detach()] + [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves]
        )
    return res


def _err(a, b):
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


@pytest.mark.parametrize("call", CALLS, ids=[c[0] for c in CALLS])
@pytest.mark.parametrize("kernel", KERNELS)
def test_adapter_matches_the_float64_reference(kernel, call, monkeypatch):
    name, cu_q, cu_k, h, hkv, d, causal = call
    be = _use(kernel, monkeypatch)
    g = torch.Generator().manual_seed(len(name))
    q = torch.randn(cu_q[-1], h, d, generator=g).to(BF16)
    k, v = (torch.randn(cu_k[-1], hkv, d, generator=g).to(BF16) for _ in range(2))
    dout = torch.randn(cu_q[-1], h, d, generator=g).to(BF16)
    scale = d**-0.5
    plain, want = _segments_plain(q, k, v, dout, cu_q, cu_k, causal, scale)
    args = (_i32(*cu_q), _i32(*cu_k), _longest(cu_q), _longest(cu_k))
    kw = {"causal": causal, "softmax_scale": scale}
    out, lse = be.forward(q, k, v, *args, **kw)
    grads = be.backward(dout, q, k, v, out, lse, *args, **kw)
    ref_out, ref_lse = ReferenceBackend().forward(q, k, v, *args, **kw)
    assert lse.shape == (h, cu_q[-1]) and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))  # keyless rows: -inf
    finite = torch.isfinite(ref_lse)
    assert _err(lse[finite], ref_lse[finite]) < 1e-3
    for what, got, p, w in zip(("out", "dq", "dk", "dv"), (out, *grads), plain, want, strict=True):
        assert got.dtype == BF16 and got.shape == w.shape, what
        assert not got.isnan().any(), f"{what}: NaN"
        assert _err(got, w) <= 2 * _err(p, w) + 1e-6, f"{what}: {_err(got, w)} vs {_err(p, w)}"
    assert _err(ref_out, want[0]) <= 2 * _err(plain[0], want[0]) + 1e-6


@pytest.mark.parametrize("kernel", KERNELS)
def test_adapter_takes_strided_inputs_and_an_fp32_dout(kernel, monkeypatch):
    """Views of a wider projection (last-dim stride 2) for q, k, v and dout, and a float32 dout
    over bf16 attention: the kernels refuse both; the adapter hands them what they take and
    matches the same call on dense bf16 tensors."""
    be = _use(kernel, monkeypatch)
    g = torch.Generator().manual_seed(3)
    cu = [0, 5, 12]
    wide = [torch.randn(12, 4, 32, generator=g).to(BF16) for _ in range(4)]
    q, k, v, dout = (x[..., ::2] for x in wide)  # (12, 4, 16), stride(-1) == 2
    args = (_i32(*cu), _i32(*cu), 7, 7)
    kw = {"causal": True, "softmax_scale": 0.25}
    out, lse = be.forward(q, k, v, *args, **kw)
    grads = be.backward(dout.float(), q, k, v, out, lse, *args, **kw)
    dense = [x.contiguous() for x in (q, k, v, dout)]
    out_d, lse_d = be.forward(*dense[:3], *args, **kw)
    grads_d = be.backward(dense[3], *dense[:3], out_d, lse_d, *args, **kw)
    assert torch.equal(out, out_d) and torch.equal(lse, lse_d)
    for got, want in zip(grads, grads_d, strict=True):
        assert got.dtype == BF16 and torch.equal(got, want)


@pytest.mark.parametrize("kernel", ["flash_attn-2.8.3", "torch_cuda-current"])
def test_adapter_refuses_inputs_the_kernels_refuse_with_a_value_error(kernel, monkeypatch):
    be = _use(kernel, monkeypatch)
    cu = _i32(0, 4)
    q = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match=r"float16 or bfloat16 inputs, got torch\.float32"):
        be.forward(q, q, q, cu, cu, 4, 4, causal=True, softmax_scale=0.5)
    big = torch.randn(4, 2, 320, dtype=BF16)
    with pytest.raises(ValueError, match=r"head_dim 1\.\.256, got 320"):
        be.forward(big, big, big, cu, cu, 4, 4, causal=True, softmax_scale=0.5)


def test_max_seqlen_shorter_than_a_segment_is_refused_on_cpu():
    """The CUDA kernels would silently skip the rows beyond max_seqlen; every backend's entry
    check refuses it where cu_seqlens are on the host."""
    q = torch.randn(6, 2, 8)
    be = get_backend("cpu")
    with pytest.raises(ValueError, match="max_seqlen_q = 3 is shorter than the longest segment"):
        be.forward(q, q, q, _i32(0, 4, 6), _i32(0, 4, 6), 3, 4, causal=True, softmax_scale=1.0)
    with pytest.raises(ValueError, match="max_seqlen_k must be an integer >= 0"):
        be.forward(q, q, q, _i32(0, 6), _i32(0, 6), 6, -1, causal=True, softmax_scale=1.0)


# ---- every method's op on the adapters (CP 2, in-process ranks) --------------------------------

#: (name, doc_lens, num_pad): a mix; ranks mostly pad; every rank pad only
OP_CASES = [("mix", [5, 20, 1, 14, 8], 0), ("pad_heavy", [6, 3], 23), ("all_pad", [], 8)]


@functools.cache
def _plan(method, case):
    _, lens, num_pad = next(c for c in OP_CASES if c[0] == case)
    return make_plan_for(method, lens, 2, num_pad=num_pad)


@functools.cache
def _op_expectations(case):
    """Full bf16 inputs and per-quantity (want, tolerance) of ``case`` (documents only)."""
    _, lens, _ = next(c for c in OP_CASES if c[0] == case)
    c = _plan("per_doc", case).context_len
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(c, hh, 16, generator=g).to(BF16) for hh in (4, 2, 2, 4)]  # q k v dout
    real = sum(lens)
    want = [torch.zeros(x.shape, dtype=torch.float64) for x in (full[0], *full[:3])]
    tol = [0.0] * 4
    if real:
        docs = [d for d in lens if d]
        leaves = [x[:real].double().requires_grad_() for x in full[:3]]
        ref = reference_attention(*leaves, docs)
        ref.backward(full[3][:real].double())
        plain = _plain_bf16(*(x[:real] for x in full), docs)
        for i, r in enumerate([ref.detach()] + [x.grad for x in leaves]):
            want[i][:real] = r
            tol[i] = 2 * _err(plain[i], r) + 1e-6
    return full, real, want, tol


def _plain_bf16(q, k, v, dout, lens):
    """Plain single-device document-masked attention in bf16, autograd through it."""
    g = q.shape[1] // k.shape[1]
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    qb, kb, vb = (x.transpose(0, 1) for x in leaves)
    kb, vb = kb.repeat_interleave(g, 0), vb.repeat_interleave(g, 0)
    s = torch.matmul(qb, kb.transpose(1, 2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~document_mask(lens), float("-inf"))
    out = torch.matmul(torch.softmax(s, dim=-1), vb).transpose(0, 1)
    out.backward(dout)
    return [out.detach()] + [x.grad for x in leaves]


@pytest.mark.parametrize("case", [c[0] for c in OP_CASES])
@pytest.mark.parametrize("kernel", KERNELS)
def test_every_method_matches_the_reference_on_the_adapter(kernel, case, monkeypatch):
    be = _use(kernel, monkeypatch)
    full, real, want, tol = _op_expectations(case)
    failures = []
    for m in METHODS:
        try:
            plan = _plan(m, case)
        except ImportError as e:  # the ILP's solver is not installed here
            warnings.warn(f"{m}: {e}", stacklevel=1)
            continue
        inputs = [tuple(shard_tensor(x, plan, r) for x in full) for r in range(2)]
        rec = record(plan, "train", inputs, backend=be, keep_outputs=True, timeout_s=30)
        for i, what in enumerate(("out", "dq", "dk", "dv")):
            got = unshard([rec.outputs[r][i] for r in range(2)], plan)
            if got.dtype != BF16 or got.isnan().any():
                failures.append(f"{m} {what}: {got.dtype}, NaN: {bool(got.isnan().any())}")
            elif _err(got[:real], want[i][:real]) > tol[i]:
                failures.append(f"{m} {what}: err {_err(got, want[i]):.3g} > {tol[i]:.3g}")
            elif (got[real:] != 0).any():
                failures.append(f"{m} {what}: pad rows are not zero")
    assert not failures, "\n".join(failures)


# ---- backend=auto on CUDA: dtype, head_dim, GPU and an unimportable flash-attn -----------------


def test_every_op_tells_auto_the_inputs_dtype_and_head_dim(monkeypatch):
    """``backend="auto"`` can only fall back past a kernel that refuses the inputs (fp32, a
    head_dim over 256) when the op passes them: every method's op does, forward and backward."""
    import pkgutil

    import flashcp.ops as ops_pkg

    calls = []
    for info in pkgutil.walk_packages(ops_pkg.__path__, ops_pkg.__name__ + "."):
        name = info.name
        mod = importlib.import_module(name)
        real = getattr(mod, "get_backend", None)
        if real is not get_backend:
            continue

        def spy(backend, device=None, *, _mod=name, **kw):
            calls.append((_mod, backend, kw))
            return get_backend(backend, device, **kw)

        monkeypatch.setattr(mod, "get_backend", spy)
    assert calls == [] and "flashcp.ops.ulysses_attn" in sys.modules
    full = [torch.randn(_plan("per_doc", "mix").context_len, h, 12) for h in (4, 2, 2, 4)]  # fp32
    for m in METHODS:
        try:
            plan = _plan(m, "mix")
        except ImportError as e:
            warnings.warn(f"{m}: {e}", stacklevel=1)
            continue
        inputs = [tuple(shard_tensor(x, plan, r) for x in full) for r in range(2)]
        del calls[:]
        record(plan, "train", inputs, backend="auto", keep_outputs=False, timeout_s=30)
        assert calls, f"{m}: no op asked get_backend (the spy is not on its path)"
        for mod, name, kw in calls:
            assert name == "auto" and kw.get("dtype") == torch.float32, (m, mod, kw)
            assert kw.get("head_dim") == 12, (m, mod, kw)


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device of capability 9.0 as far as get_backend can tell (nothing runs on it);
    flash-attn's import check re-done for the test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    check = getattr(cuda_backends, "flash_attn_problem", None)  # the import check, cached
    if check is not None:
        check.cache_clear()
    yield monkeypatch
    if check is not None:
        check.cache_clear()
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        del sys.modules[name]


def test_auto_on_cuda_considers_dtype_head_dim_and_the_gpu(fake_cuda):
    install(fake_cuda, make_flash_attn("2.8.3", NAMESPACE))
    assert get_backend("auto", "cuda", dtype=BF16, head_dim=128).name == "flash_attn"
    assert get_backend("auto", "cuda").name == "flash_attn"  # inputs unknown: not checked
    for dtype, head_dim in ((torch.float32, 64), (torch.float64, 64), (BF16, 320)):
        with pytest.warns(RuntimeWarning, match="using the float64 'reference' backend"):
            assert get_backend("auto", "cuda", dtype=dtype, head_dim=head_dim).name == "reference"
    for name in ("flash_attn", "torch_cuda"):
        with pytest.raises(ValueError, match=r"got torch\.float32"):
            get_backend(name, "cuda", dtype=torch.float32)
        with pytest.raises(ValueError, match=r"head_dim 1\.\.256, got 320"):
            get_backend(name, "cuda", dtype=BF16, head_dim=320)
    fake_cuda.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ValueError, match=r"compute capability >= 8\.0 \(Ampere\), got 7\.5"):
        get_backend("torch_cuda", "cuda", dtype=BF16)
    with pytest.warns(RuntimeWarning, match="compute capability"):
        assert get_backend("auto", "cuda", dtype=BF16).name == "reference"
    with pytest.raises(ValueError, match="head_dim must be an integer >= 1"):
        get_backend("auto", "cuda", head_dim=0)
    fake_cuda.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="is_available"):
        get_backend("auto", "cuda", dtype=BF16)


def test_auto_skips_a_flash_attn_that_does_not_import(fake_cuda, tmp_path):
    """A wheel built for another torch: find_spec finds it, its extension fails to load."""
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('__version__ = "2.8.3"\n')
    (pkg / "flash_attn_interface.py").write_text(
        'raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")\n'
    )
    fake_cuda.syspath_prepend(str(tmp_path))
    try:
        importlib.util.find_spec("flash_attn")
    except ImportError as e:  # an interpreter that blocks the name (the GPU machine's image)
        pytest.skip(str(e))
    with pytest.warns(RuntimeWarning, match="skips flash_attn.*undefined symbol"):
        assert get_backend("auto", "cuda").name == "torch_cuda"
    with pytest.raises(ValueError, match="undefined symbol"):
        get_backend("flash_attn", "cuda", dtype=BF16)
    assert not cuda_backends.flash_attn_available()


def test_auto_without_flash_attn_picks_torch_cuda_quietly(fake_cuda):
    fake_cuda.setattr(cuda_backends.importlib.util, "find_spec", lambda name, *a: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get_backend("auto", "cuda", dtype=BF16, head_dim=64).name == "torch_cuda"
    with pytest.raises(ValueError, match="not installed"):
        get_backend("flash_attn", "cuda")
