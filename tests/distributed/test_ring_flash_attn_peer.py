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

Work equality (the peer's counterpart of ``tests/unit/test_work_equality.py``): the same ranks run
each function once under :class:`standins.ring_flash_attn_peer.PeerRecorder`, which records what
the package really issues (kernel calls and their segments and causal flags, ATen ops, P2P
exchanges and collectives, per ring step), and :func:`flashcp.executors.work_trace.trace_account`
sums it as it sums our ops. ``ring`` / ``zigzag`` are held against
:func:`flashcp.sim.work.work_account` with ``impl="ring_flash_attn"`` on the plan of
:func:`flashcp.sim.impl.impl_plan` (whose rows must be the package's layout), per pass, ring step
and rank: kernel calls, query / key rows, CTAs, tiles and largest CTA exactly; memory-bound
launches exactly after the listed differences (:data:`PEER_DIFFERENCES`); their bytes within
:data:`BYTE_BANDS`; P2P exchanges and bytes exactly, the dK/dV partial sums included: the
package sends them at every step, N hops (the last one home), and so do the model's
``comm_volume`` and work account for ``impl="ring_flash_attn"`` (:func:`flashcp.comm.ring_grad_hops`),
and the bytes every exchange receives sum to ``comm_volume``'s ``p2p_bytes``. ``llama3``
is held against the terms of the model's ring-flash-attn llama3 step (:func:`compare_llama3`).
Not compared: host syncs (on CPU a boolean-mask gather has none; on a GPU each is a
host-to-device copy), views and allocations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from mp_utils import run_ranks
from standins.ring_flash_attn_peer import (
    PeerRecorder,
    import_peer,
    peer_cu_seqlens,
    peer_installed,
    peer_rows,
)

from flashcp.comm import AttnShape, comm_volume
from flashcp.executors.work_trace import RankTrace, exchange_schedule, trace_account
from flashcp.ops.reference import reference_attention
from flashcp.ops.sharding import global_rows
from flashcp.sim.cost import PlanCost
from flashcp.sim.cost.ring import ring_overlap_schedule
from flashcp.sim.hardware import load_hardware
from flashcp.sim.impl import RFA_HEADS_K_STRIDE, impl_plan
from flashcp.sim.work import work_account

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
#: traced runs (work equality): per N, (method, doc_lens); zigzag with one document too (its halves
#: are slices then)
WORK_SAMPLES = {
    2: (("ring", (12, 28, 4, 20)), ("zigzag", (12, 28, 4, 20)), ("llama3", (13, 1, 30, 20))),
    4: (
        ("ring", (24, 8, 40)),
        ("zigzag", (24, 8, 40)),
        ("zigzag", (32,)),
        ("llama3", (37, 9, 2, 24)),
    ),
}
#: traced shapes: GQA; llama3 with 6 KV heads, so that the model's heads_k_stride (3) gives two
#: head groups
TRACE_SHAPES = {
    "ring": AttnShape(4, 2, 16, "bfloat16"),
    "zigzag": AttnShape(4, 2, 16, "bfloat16"),
    "llama3": AttnShape(12, 6, 8, "bfloat16"),
}


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


def _traced(rfa, rank: int, n: int, method: str, docs) -> RankTrace:
    """What the package's ``method`` function issues on this rank, forward and backward
    (:class:`standins.ring_flash_attn_peer.PeerRecorder`)."""
    shape = TRACE_SHAPES[method]
    g = torch.Generator().manual_seed(1)
    heads = (shape.num_heads, shape.num_kv_heads, shape.num_kv_heads, shape.num_heads)
    q, k, v, dout = (
        torch.randn(sum(docs), h, shape.head_dim, generator=g).to(torch.bfloat16) for h in heads
    )
    rows = torch.from_numpy(peer_rows(method, docs, n, rank))
    ql, kl, vl = (x[rows].clone().requires_grad_() for x in (q, k, v))
    dl = dout[rows].clone()
    trace = RankTrace(rank)
    rec = PeerRecorder(trace, n)
    if method == "llama3":
        cu = torch.tensor(np.concatenate([[0], np.cumsum(docs)]), dtype=torch.int32)
        cu_q, cu_k, mq, mk, kslice = rfa.llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, n)
        stride = max(s for s in range(1, RFA_HEADS_K_STRIDE + 1) if shape.num_kv_heads % s == 0)
        args = (cu_q, cu_k, mq, mk, stride, kslice)
        fn = rfa.llama3_flash_attn_varlen_func
    else:
        args = peer_cu_seqlens(docs, n)
        fn = getattr(rfa, f"{'zigzag_' if method == 'zigzag' else ''}ring_flash_attn_varlen_func")
    with rec.patched(rfa), rec:
        out = fn(ql, kl, vl, *args, causal=True)
        rec.start_backward()
        torch.autograd.grad(out, (ql, kl, vl), dl)
    return trace


def _run_all(rank: int, n: int, cases, samples) -> tuple[list, list]:
    """One rank: every traced sample ``(method, docs)``, then every numerical case ``(method,
    docs, causal)`` (one import of the package per rank)."""
    rfa = import_peer("rfa_peer")
    traces = [_traced(rfa, rank, n, *s) for s in samples]
    return traces, [_run_peer(rfa, rank, n, *case) for case in cases]


@functools.cache
def _ranks(n: int) -> list:
    return run_ranks(_run_all, n, _cases(n), WORK_SAMPLES[n], timeout_s=180)


def _cases(n: int) -> tuple:
    cases = [(m, LLAMA3_DOCS[n] if m == "llama3" else DOCS[n], True) for m in METHODS]
    if n == 2:
        cases.append(("ring", DOCS[n], False))
    return tuple(cases)


@functools.cache
def _errors(n: int) -> dict:
    """``{(method, causal): {output: relative max error}}`` of every case at ``n`` ranks."""
    cases = _cases(n)
    per_rank = [numerics for _, numerics in _ranks(n)]
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


# ---- work equality: what the package issues against what the simulator prices -----------------

HW = load_hardware("h100_sxm")
#: bytes (read + written) of the memory-bound launches, package / model per pass and rank:
#: measured 1.00-3.27 forward (the eager merge moves 41.75 bytes per output element, the model's
#: fused one merge_bytes_scripted = 10) and 1.000-1.007 backward, with margin
BYTE_BANDS = {"fwd": (1.0, 3.6), "bwd": (1.0, 1.02)}


@dataclass(frozen=True)
class PeerDifference:
    """One listed difference in memory-bound launches: ``delta(docs, acc)`` is the (steps, N)
    array of package - model for ``phase``."""

    name: str
    methods: tuple[str, ...]
    phases: tuple[str, ...]
    kind: str  # "intended" or "mismatch"
    reason: str
    delta: Callable


def _at_step0(value: float) -> Callable:
    def delta(docs, acc, phase):
        out = np.zeros_like(acc.per_step[(phase, "mem_ops")])
        out[0] = value(docs) if callable(value) else value
        return out

    return delta


def _merges(docs, acc, phase):
    calls = acc.per_step[("fwd", "kernel_calls")].copy()
    calls[0] = 0  # step 0 casts its block output (priced as 1 op, issued as 1)
    return 7 * calls


def _half_index(docs):
    return 2 * (1 + 3 * len(docs)) if len(docs) > 1 else 2


PEER_DIFFERENCES = (
    PeerDifference(
        "scripted_merge", ("ring", "zigzag"), ("fwd",), "intended",
        "update_out_and_lse's @torch.jit.script merge runs as 9 eager ops here (to(fp32), sub, "
        "sigmoid, sub, mul, sub; sub, log_sigmoid, sub); on a GPU TorchScript's fuser joins "
        "them and the model prices 2 launches (merge_bytes_scripted bytes)", _merges,
    ),
    PeerDifference(
        "half_index_loop", ("zigzag",), ("fwd",), "intended",
        "get_half_index, called twice at step 0: several documents: a host bool mask (zeros, and "
        "per document a fill_) and per document add and floor_divide of 0-dim cu_seqlens entries "
        "(device launches on a GPU, each followed by two .item() syncs); one document: one "
        "floor_divide per call (the slice bound). The model prices the loop as doc_host_us per "
        "document and call, not as launches", _at_step0(_half_index),
    ),
    PeerDifference(
        "half_cu_seqlens", ("zigzag",), ("fwd", "bwd"), "mismatch",
        "half_cu_seqlens = cu_seqlens // 2, once per pass: one launch on n_docs + 1 ints that the "
        "model does not price (about launch_us per pass)", _at_step0(1),
    ),
)  # fmt: skip


def _sample(n: int, i: int):
    method, docs = WORK_SAMPLES[n][i]
    traces = [rank[0][i] for rank in _ranks(n)]
    plan, pad = impl_plan(method, "ring_flash_attn", docs, n)
    assert pad == 0, "the samples need no padding"
    return method, docs, plan, TRACE_SHAPES[method], traces


def compare_ring(n: int, i: int) -> list[str]:
    """Every unexplained difference of ring / zigzag sample ``i`` at ``n`` ranks."""
    method, docs, plan, shape, traces = _sample(n, i)
    bad = []
    for r in range(n):
        if not np.array_equal(global_rows(plan, r), peer_rows(method, docs, n, r)):
            bad.append(f"rank {r}: the priced plan's rows are not the package's layout")
    acc = work_account(plan, shape, "train", HW, impl="ring_flash_attn")
    tr = trace_account(traces, HW, n)
    per = tr["per_step"]
    for t in traces:
        for e in t.select("kernel"):
            if e.causal != (e.step == 0) or e.heads != shape.num_heads:
                bad.append(f"rank {t.rank} {e.phase} step {e.step}: causal={e.causal}, "
                           f"heads={e.heads}")  # fmt: skip
    for phase in ("fwd", "bwd"):
        for item in ("kernel_calls", "q_rows", "kv_rows", "ctas", "tiles", "max_tiles"):
            op, sim = per[(phase, item)], acc.per_step[(phase, item)]
            if not np.array_equal(op, sim):
                bad.append(f"{phase} {item} [step, rank]: package {op.tolist()} != model "
                           f"{sim.tolist()}")  # fmt: skip
        rules = [d for d in PEER_DIFFERENCES if method in d.methods and phase in d.phases]
        op, sim = per[(phase, "mem_ops")], acc.per_step[(phase, "mem_ops")]
        fix = sum((d.delta(docs, acc, phase) for d in rules), np.zeros_like(sim))
        if not np.allclose(op, sim + fix):
            bad.append(f"{phase} mem_ops [step, rank]: package {op.tolist()} != model "
                       f"{sim.tolist()} + listed {fix.tolist()}")  # fmt: skip
        lo, hi = BYTE_BANDS[phase]
        ratio = per[(phase, "mem_bytes")].sum(0) / acc.per_step[(phase, "mem_bytes")].sum(0)
        if not ((ratio >= lo) & (ratio <= hi)).all():
            bad.append(f"{phase} mem_bytes package / model {np.round(ratio, 3).tolist()} "
                       f"outside [{lo}, {hi}]")  # fmt: skip
    # P2P: one batch_isend_irecv is one exchange; its bytes are this rank's receives
    calls_f, per_f = acc.comm[("fwd", "p2p")]
    calls_g, per_g = acc.comm[("bwd", "p2p_grad")]
    if calls_g != n:
        bad.append(f"bwd dK/dV hops: model {calls_g}, the package sends at every one of {n} steps")
    want = {"fwd": (calls_f, calls_f * per_f),
            "bwd": (calls_f + calls_g, calls_f * per_f + calls_g * per_g)}  # fmt: skip
    for phase, (calls, nbytes) in want.items():
        got = tr["comm"].get((phase, "p2p"), [])
        if len(got) != calls or sum(got) != nbytes:
            bad.append(f"{phase} p2p: package {len(got)} calls, {sum(got)} B != model "
                       f"{calls} calls, {nbytes} B")  # fmt: skip
    # per pass, the exchanges in flight over each step's kernels (and exposed) on the last rank,
    # which calls a kernel at every step, are the model's (tests/unit/test_ring_schedule.py)
    for phase, train in (("fwd", False), ("bwd", True)):
        got = exchange_schedule(traces[n - 1], phase, n)
        want = ring_overlap_schedule(n, "ring_flash_attn", train)
        for kind in ("kv", "grad"):
            if got[kind].tolist() != want[kind].tolist():
                bad.append(f"{phase} {kind} exchanges per step (last: exposed): package "
                           f"{got[kind].tolist()} != model {want[kind].tolist()}")  # fmt: skip
    # the bytes the package's exchanges receive in the step are the priced p2p_bytes
    got = sum(sum(tr["comm"].get((phase, "p2p"), [])) for phase in ("fwd", "bwd"))
    vol = comm_volume(plan, "p2p_ring", shape, "train", impl="ring_flash_attn")["p2p_bytes"]
    if got != vol:
        bad.append(f"p2p bytes: package {got} != comm_volume {vol}")
    return [f"{method} N={n} docs={docs}: {b}" for b in bad]


def compare_llama3(n: int, i: int) -> list[str]:
    """Every unexplained difference of llama3 sample ``i`` at ``n`` ranks against the model's
    ``impl=ring_flash_attn`` llama3 step (``PlanCost._step_rfa_llama3``; its head groups overlap
    gathers with kernels, so :func:`work_account` does not split it: counts read from its terms).
    """
    method, docs, plan, shape, traces = _sample(n, i)
    bad = []
    for r in range(n):
        if not np.array_equal(global_rows(plan, r), peer_rows(method, docs, n, r)):
            bad.append(f"rank {r}: the priced plan's rows are not the package's layout")
    hkv = shape.num_kv_heads
    stride = max(s for s in range(1, RFA_HEADS_K_STRIDE + 1) if hkv % s == 0)
    groups = hkv // stride
    cost = PlanCost(plan, HW, "allgather_full", "ring_flash_attn")
    tr = trace_account(traces, HW, n)
    vol = comm_volume(plan, "allgather_full", shape, "train")
    ag = vol["allgather_bytes"] / 2 / (2 * groups)  # one call: K or V of one head group
    # the model: per group the K and V slices made contiguous (2) and, backward, the dK/dV buffer
    # zeroed (1) and dK, dV copied into place (2); forward, out and lse concatenated (2)
    mem = {"fwd": 2 * groups + 2, "bwd": 5 * groups}
    comm = {("fwd", "allgather"): [ag] * 2 * groups, ("bwd", "allgather"): [ag] * 2 * groups,
            ("bwd", "reducescatter"): [ag] * 2 * groups}  # fmt: skip
    for phase in ("fwd", "bwd"):
        stats = cost.fwd if phase == "fwd" else cost.bwd
        want = {"kernel_calls": np.full(n, groups), "q_rows": groups * cost.q_rows,
                "kv_rows": groups * cost.kv_rows, "ctas": groups * stats.ctas,
                "tiles": groups * stats.tiles, "max_tiles": stats.max_tiles,
                "mem_ops": np.full(n, mem[phase])}  # fmt: skip
        for item, w in want.items():
            got = tr["per_step"][(phase, item)]
            got = got.max(0) if item == "max_tiles" else got.sum(0)
            if not np.array_equal(got, np.asarray(w, dtype=float)):
                bad.append(f"{phase} {item} per rank: package {got.tolist()} != model "
                           f"{np.asarray(w).tolist()}")  # fmt: skip
        for t in traces:
            for e in t.select("kernel", phase):
                if not e.causal or e.heads != shape.num_heads // groups:
                    bad.append(f"rank {t.rank} {phase}: causal={e.causal}, heads={e.heads}")
    for key, want_calls in comm.items():
        got = tr["comm"].get(key, [])
        if got != want_calls:
            bad.append(f"{key}: package {got} != model {want_calls}")
    extra = set(tr["comm"]) - set(comm)
    if extra:
        bad.append(f"communication the model does not price: {sorted(extra)}")
    return [f"{method} N={n} docs={docs}: {b}" for b in bad]


WORK_IDS = [(n, i) for n in WORK_SAMPLES for i in range(len(WORK_SAMPLES[n]))]


@pytest.mark.parametrize(
    "n,i", WORK_IDS, ids=[f"{WORK_SAMPLES[n][i][0]}-N{n}-{len(WORK_SAMPLES[n][i][1])}docs"
                          for n, i in WORK_IDS],
)  # fmt: skip
def test_peer_work_equals_model(n, i):
    compare = compare_llama3 if WORK_SAMPLES[n][i][0] == "llama3" else compare_ring
    bad = compare(n, i)
    assert not bad, "\n".join(bad)


def test_peer_work_check_can_fail(monkeypatch):
    """A model that merged once fewer per ring step (or moved one fewer P2P hop) is caught."""
    i = next(k for k, s in enumerate(WORK_SAMPLES[4]) if s[0] == "zigzag")
    assert not compare_ring(4, i)
    real = work_account

    def fewer(*a, **kw):
        acc = real(*a, **kw)
        acc.per_step[("fwd", "mem_ops")] = acc.per_step[("fwd", "mem_ops")] - 1
        acc.comm[("fwd", "p2p")] = (acc.comm[("fwd", "p2p")][0] - 1, acc.comm[("fwd", "p2p")][1])
        return acc

    monkeypatch.setitem(globals(), "work_account", fewer)
    bad = compare_ring(4, i)
    assert any("fwd mem_ops" in b for b in bad) and any("fwd p2p" in b for b in bad), bad
