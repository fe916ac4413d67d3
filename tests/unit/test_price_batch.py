"""Batched pricing (flashcp.sim.cost.price_plans) against the per-plan step model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashcp.comm import AttnShape
from flashcp.registry import make_plan_for, method_names
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS
from flashcp.sim import load_hardware, simulate
from flashcp.sim.cost import price_plans
from flashcp.sim.impl import impl_plan

HWS = [load_hardware("h100_sxm"), load_hardware("a100_sxm")]
#: tile sides that are not powers of two: the compiled kernels' division paths (the shipped
#: profiles' sides are powers of two and take the shift paths)
ODD_TILES = dataclasses.replace(
    HWS[0], name="odd_tiles", fwd_block_q=96, fwd_block_k=48, bwd_block_q=48, bwd_block_k=144
)
SHAPES = [AttnShape(16, 16, 128, "bfloat16"), AttnShape(32, 8, 128, "bfloat16")]
MODES = ["train", "infer"]
#: every registered method but the ILP (slow; it is priced as any all-gather plan)
METHODS = [m for m in method_names() if m != "ilp"]


def _doc_lens(rng: np.random.Generator, context_len: int) -> np.ndarray:
    """Packed documents: short ones, some long ones, now and then one huge or a zero-length one."""
    out, left = [], context_len
    while left > 0:
        r = rng.random()
        d = int(rng.integers(1, context_len)) if r < 0.1 else int(rng.integers(0, 3000))
        d = min(d, left)
        out.append(d)
        left -= d
    return np.array(out)


def _plans(method: str, cp_size: int, count: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    plans = []
    for k in range(count):
        c = int(rng.choice([16384, 32768]))
        d = _doc_lens(rng, c)
        opts = {}
        if k % 3 == 2:  # pad tokens after the last document
            d = d.copy()
            d[-1] = max(d[-1] - 64, 0)
            opts["num_pad"] = c - int(d.sum())
        plans.append(make_plan_for(method, d, cp_size, **opts))
    return plans


def _check(plans, impl="ours", hws=HWS):
    got = price_plans(plans, SHAPES, MODES, hws, impl=impl)
    for a, hw in enumerate(hws):
        for b, shape in enumerate(SHAPES):
            for m, mode in enumerate(MODES):
                for k, plan in enumerate(plans):
                    ref = simulate(plan, shape, hw, mode, impl=impl)
                    for col in PHASE_COLUMNS:
                        np.testing.assert_allclose(
                            got[col][a, b, m, k], ref[col], rtol=1e-12, atol=0,
                            err_msg=f"{plan.method} {hw.name} {shape} {mode} plan {k} {col}",
                        )  # fmt: skip
                    for col in COMM_COLUMNS:
                        assert got[col][a, b, m, k] == ref[col], (plan.method, col)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cp_size", [4, 8])
def test_price_plans_equals_per_plan(method, cp_size):
    _check(_plans(method, cp_size, 6, seed=cp_size))


#: head counts every tiny plan's CP size divides (the head-parallel methods need it): MHA, GQA
TINY_SHAPES = [AttnShape(24, 24, 64, "bfloat16"), AttnShape(48, 24, 64, "float32")]


def _check_tiny(plans):
    """Every plan priced alone by the per-plan reference and by price_plans: equal to 1e-12."""
    for plan in plans:
        got = price_plans([plan], TINY_SHAPES, MODES, HWS[:1])
        for b, shape in enumerate(TINY_SHAPES):
            for m, mode in enumerate(MODES):
                ref = simulate(plan, shape, HWS[0], mode)
                where = f"{plan.method} {plan.doc_lens.tolist()} N={plan.cp_size} {shape} {mode}"
                for col in PHASE_COLUMNS:
                    np.testing.assert_allclose(
                        got[col][0, b, m, 0], ref[col], rtol=1e-12, atol=0, err_msg=f"{where} {col}"
                    )
                for col in COMM_COLUMNS:
                    assert got[col][0, b, m, 0] == ref[col], (where, col)


@st.composite
def tiny_sequences(draw):
    """``(doc_lens, cp_size, num_pad)``: few tiny documents (1-token and zero-length ones,
    documents shorter than N, one document or none) and pad, CP 1-8."""
    cp_size = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    doc_lens = draw(st.lists(st.sampled_from([0, 1, 1, 2, 3, 5, 9]), min_size=0, max_size=6))
    return doc_lens, cp_size, draw(st.integers(0, 2 * cp_size))


@pytest.mark.parametrize("compiled_mode", ["0", "1"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seq=tiny_sequences())
def test_tiny_and_degenerate_plans_priced_by_both_paths(compiled_mode, seq):
    """Both paths price every tiny or degenerate plan of every method (ring steps with nothing
    to attend: documents shorter than N, pad alone), train and infer, the same to 1e-12: with
    the readable references (FLASHCP_COMPILED=0, as before the background compile finishes or
    without numba) and with the compiled kernels."""
    if compiled_mode == "1":
        pytest.importorskip("numba")
    doc_lens, cp_size, num_pad = seq
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHCP_COMPILED", compiled_mode)
        plans = [
            make_plan_for(m, doc_lens, cp_size, num_pad=num_pad, pad_to_multiple=True)
            for m in METHODS
        ]
        _check_tiny(plans)


#: the failing shapes of each kind, every method with the ILP: four 2-token documents at CP 4
#: (empty ring steps), 1-token documents, one document, pad alone, zero-length documents
DEGENERATE = [([2, 2, 2, 2], 4, 0), ([1] * 3, 4, 1), ([7], 8, 1), ([], 3, 3), ([0, 0, 1], 2, 3)]


@pytest.mark.parametrize("compiled_mode", ["0", "1"])
@pytest.mark.parametrize(
    "method", [pytest.param(m, marks=pytest.mark.slow) if m == "ilp" else m for m in method_names()]
)
def test_degenerate_plans_every_method(method, compiled_mode, monkeypatch):
    if compiled_mode == "1":
        pytest.importorskip("numba")
    monkeypatch.setenv("FLASHCP_COMPILED", compiled_mode)
    _check_tiny(
        [make_plan_for(method, d, n, num_pad=pad, pad_to_multiple=True) for d, n, pad in DEGENERATE]
    )


def test_degenerate_plans_compiled_bitwise(monkeypatch):
    """The compiled kernels price the degenerate plans to the bit as the NumPy reference."""
    pytest.importorskip("numba")
    plans = [
        make_plan_for(m, d, n, num_pad=pad, pad_to_multiple=True)
        for m in METHODS
        for d, n, pad in DEGENERATE
    ]
    got = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("FLASHCP_COMPILED", mode)
        got[mode] = price_plans(plans, TINY_SHAPES, MODES, HWS)
    for col in got["0"]:
        np.testing.assert_array_equal(got["1"][col], got["0"][col], err_msg=col)


def test_price_plans_mixed_methods_and_cp_sizes():
    plans = [p for cp in (2, 4) for m in METHODS for p in _plans(m, cp, 1, seed=cp)]
    _check(plans)


def test_price_plans_per_size_collective_tables():
    """A profile pricing its all-gather and reduce-scatter from per-size tables (h200_sxm): the
    batched path reads the same tables (every method whose plans use a collective, one CP size)."""
    hw = load_hardware("h200_sxm")
    assert hw.falloff_table("all_gather") != hw.falloff_table(None)
    for method in METHODS:
        _check(_plans(method, 8, 2, seed=11), hws=[hw])


@pytest.mark.parametrize("method", ["ring", "zigzag", "llama3"])
def test_price_plans_ring_flash_attn(method):
    rng = np.random.default_rng(3)
    plans = [impl_plan(method, "ring_flash_attn", _doc_lens(rng, 16384), 4)[0] for _ in range(3)]
    _check(plans, impl="ring_flash_attn")


def test_price_plans_errors():
    plan = make_plan_for("flashcp", [1000, 3000], 2)
    with pytest.raises(ValueError, match="mode"):
        price_plans([plan], SHAPES, ["bogus"], HWS)
    with pytest.raises(ValueError, match="comm_kind"):
        price_plans([plan], SHAPES, MODES, HWS, comm_kind="bogus")
    empty = price_plans([], SHAPES, MODES, HWS)
    assert empty["total_ms"].shape == (2, 2, 2, 0)


#: many-piece layouts (per_doc, zigzag: 2N pieces per document), the other ring and all-gather
#: methods, and the hybrids (their group plans run the inner ring or all-gather)
KERNEL_METHODS = ["per_doc", "zigzag", "ring", "llama3", "flashcp", "usp", "flashcp_ulysses"]


def _batches(plans):
    """The PlanBatch a plan group is priced from (the hybrids': their group plans)."""
    from flashcp.sim.cost import PlanBatch

    if plans[0].ulysses_degree > 1:
        inner = "zigzag" if plans[0].method == "usp" else "flashcp"
        groups = [dataclasses.replace(p.group_plan(), method=inner) for p in plans]
        return [PlanBatch(groups, hybrid_inner=True)]
    return [PlanBatch(plans)]


def _flat(stats) -> list[np.ndarray]:
    """Every array of a statistics tuple (TileStats flattened)."""
    return [np.asarray(a) for y in stats for a in (y if isinstance(y, tuple) else (y,))]


@pytest.mark.parametrize(
    "method, cp_size",
    [*((m, n) for m in KERNEL_METHODS for n in (2, 4, 8, 16)), ("zigzag", 64), ("flashcp", 64)],
)
def test_price_kernels_equal_reference(method, cp_size, monkeypatch):
    """The compiled tile statistics (flashcp.sim.cost.kernels) equal the NumPy reference's
    exactly: the per-rank sums, every ring statistic and gather mask, every all-gather statistic
    (pad included); at CP 64 the ring's bit masks over the ranks use all 64 bits."""
    pytest.importorskip("numba")
    from flashcp import compiled
    from flashcp.sim.cost import PlanBatch

    monkeypatch.setenv("FLASHCP_COMPILED", "1")
    assert compiled.load("price") is not None

    plans = _plans(method, cp_size, 6, seed=20 + cp_size)
    for hw in [*HWS, ODD_TILES]:
        for batch in _batches(plans):
            monkeypatch.setenv("FLASHCP_COMPILED", "1")
            fast = PlanBatch(batch.plans, hybrid_inner=batch.hybrid_inner)
            fast_ring, fast_ag = fast._ring_stats(hw), fast.allgather(hw)
            monkeypatch.setenv("FLASHCP_COMPILED", "0")
            ref = PlanBatch(batch.plans, hybrid_inner=batch.hybrid_inner)
            ref_ring, ref_ag = ref._ring_stats(hw), ref.allgather(hw)
            for name in ("q_rows", "send_rows", "context_len", "tokens_full", "tokens_sharded"):
                a, b = getattr(fast, name), getattr(ref, name)
                assert a.dtype == b.dtype and a.shape == b.shape, name
                np.testing.assert_array_equal(a, b, err_msg=name)
            for got, ref in ((fast_ring, ref_ring), (fast_ag, ref_ag)):
                for a, b in zip(_flat(got), _flat(ref), strict=True):
                    assert a.dtype == b.dtype and a.shape == b.shape
                    np.testing.assert_array_equal(a, b, err_msg=f"{method} cp {cp_size} {hw.name}")


@pytest.mark.parametrize("compiled_mode", ["0", "1"])
@pytest.mark.parametrize("cp_size", [2, 16])
def test_price_plans_equals_per_plan_compiled(compiled_mode, cp_size, monkeypatch):
    """price_plans with and without the compiled statistics equals the per-plan path, at the CP
    sizes the main test leaves out, for the many-piece layouts and the hybrids."""
    if compiled_mode == "1":
        pytest.importorskip("numba")
    monkeypatch.setenv("FLASHCP_COMPILED", compiled_mode)
    plans = [p for m in KERNEL_METHODS for p in _plans(m, cp_size, 2, seed=30 + cp_size)]
    _check(plans, hws=HWS[:1])


@pytest.mark.parametrize("impl", ["ours", "ring_flash_attn"])
@pytest.mark.parametrize("cp_size", [1, 2, 8, 16])
def test_ring_pass_kernel_bitwise(impl, cp_size, monkeypatch):
    """The compiled ring pass (flashcp.sim.cost.kernels.ring_pass) and the op's per-step
    formulas (ring_compute_ours; ring-flash-attn's stay in NumPy) return NumPy's numbers to the
    bit: the pass's sums over the steps follow NumPy's pairwise order (every ring method, both
    impls, with the host idling after stream syncs where ring-flash-attn has them)."""
    pytest.importorskip("numba")
    from flashcp import compiled
    from flashcp.sim.cost import PlanBatch
    from flashcp.sim.cost.ring import (
        _ring_compute,
        _ring_pass_compiled,
        _stack_from_arrays,
        ring_pass_hops,
    )
    from flashcp.sim.impl import impl_ops

    monkeypatch.setenv("FLASHCP_COMPILED", "1")
    kernels = compiled.load("price")
    rng = np.random.default_rng(cp_size)
    for method in ("ring", "zigzag"):
        if impl == "ours":
            plans = _plans(method, cp_size, 4, seed=40 + cp_size)
        else:
            plans = [impl_plan(method, impl, _doc_lens(rng, 16384), cp_size)[0] for _ in range(4)]
        batch = PlanBatch(plans)
        for hw in HWS:
            n = batch.n
            stack = _stack_from_arrays(
                hw, "p2p_ring", impl, n, impl_ops(impl, method), batch.ndocs,
                batch.context_len // n, *batch.ring(hw),
            )  # fmt: skip
            hop = rng.random(len(plans)) * 50
            for shape in SHAPES:
                fwd, bwd = stack._ring_fwd_compute(shape), stack._ring_bwd_compute(shape)
                for ref, backward in ((fwd, False), (bwd, True)):  # the op's compiled formulas
                    got = _ring_compute(kernels, stack, shape, backward)
                    for a, b in zip(got, ref, strict=True):
                        np.testing.assert_array_equal(a, b)
                train_hops = ring_pass_hops(n, impl, True, hop, hop + 3.0)
                for parts in (fwd, bwd):
                    for hop_us, tail_us in (
                        ring_pass_hops(n, impl, False, hop),
                        train_hops,
                        (0.0, 0.0),
                    ):
                        ref = stack._ring_pass(*parts, hop_us, tail_us)
                        got = _ring_pass_compiled(kernels, stack, *parts, hop_us, tail_us)
                        for a, b in zip(got, ref, strict=True):
                            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cp_size", [2, 4, 8, 16])
def test_price_plans_compiled_bitwise(cp_size, monkeypatch):
    """price_plans with the compiled kernels (statistics, ring pass, the all-gather op's
    per-rank part) returns the NumPy path's numbers to the bit, every column, both profiles."""
    pytest.importorskip("numba")
    plans = [p for m in METHODS for p in _plans(m, cp_size, 2, seed=50 + cp_size)]
    got = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("FLASHCP_COMPILED", mode)
        got[mode] = price_plans(plans, SHAPES, MODES, HWS)
    for col in got["0"]:
        np.testing.assert_array_equal(got["1"][col], got["0"][col], err_msg=col)


def test_price_plans_in_memory_chunks_equal_one_batch(monkeypatch):
    """A ring-family group larger than PRICE_BATCH_BYTES is priced in chunks of plans with the
    same numbers, to the bit, as in one batch (a PlanBatch given or not; attention_balance too)."""
    from flashcp.sim.cost import PlanBatch, attention_balance, ring_price_bytes
    from flashcp.sim.cost import batch as cost_model

    plans = [
        *_plans("zigzag", 4, 4, seed=3), *_plans("ring", 4, 3, seed=4),
        *_plans("usp", 4, 3, seed=5), *_plans("flashcp", 4, 2, seed=6),
    ]  # fmt: skip
    one = price_plans(plans, SHAPES, MODES, HWS)
    bal = attention_balance(plans, SHAPES[0], "train", HWS[0])
    # two plans per chunk at most: every ring group is cut
    monkeypatch.setattr(cost_model, "PRICE_BATCH_BYTES", 2 * max(map(ring_price_bytes, plans)))
    chunks = cost_model._price_chunks(plans, list(range(4)))
    assert len(chunks) >= 2 and [i for c in chunks for i in c] == [0, 1, 2, 3]
    for batch_arg in (plans, PlanBatch(plans)):
        got = price_plans(batch_arg, SHAPES, MODES, HWS)
        for col in one:
            assert got[col].dtype == one[col].dtype
            np.testing.assert_array_equal(got[col], one[col], err_msg=col)
    got = attention_balance(PlanBatch(plans), SHAPES[0], "train", HWS[0])
    for col in bal:
        np.testing.assert_array_equal(got[col], bal[col], err_msg=col)


def test_price_plans_refuses_a_plan_too_large_for_memory(monkeypatch):
    """A ring-family plan whose statistics alone would take more than half the machine's memory
    is a ValueError naming its size, before any plan is priced (it was killed for memory)."""
    from flashcp.sim.cost import batch as cost_model

    plans = _plans("zigzag", 8, 1, seed=7)
    need = cost_model.ring_price_bytes(plans[0])
    monkeypatch.setattr(cost_model, "_physical_memory_bytes", lambda: need)  # half: need / 2
    with pytest.raises(ValueError, match=r"zigzag plan \(cp_size 8, \d+ shards"):
        price_plans(plans, SHAPES, MODES, HWS)
    monkeypatch.setattr(cost_model, "_physical_memory_bytes", lambda: 2 * need)
    price_plans(plans, SHAPES, MODES, HWS)  # fits: priced


#: the methods the all-gather op runs without head parallelism (``keep_gathered_kv`` applies)
KEEP_METHODS = ["llama3", "per_doc", "flashcp", "flashcp_refined"]


@pytest.mark.parametrize("compiled_mode", ["0", "1"])
@pytest.mark.parametrize("cp_size", [4, 8])
def test_keep_gathered_kv_priced_by_both_paths(compiled_mode, cp_size, monkeypatch):
    """``keep_gathered_kv``: price_plans (NumPy and compiled) equals the per-plan PlanCost to
    1e-12, and both price no backward all-gather: the forward's all-gather time and bytes only, a
    shorter step, the same attention and reduce-scatter as the default."""
    if compiled_mode == "1":
        pytest.importorskip("numba")
    monkeypatch.setenv("FLASHCP_COMPILED", compiled_mode)
    plans = [p for m in KEEP_METHODS for p in _plans(m, cp_size, 3, seed=60 + cp_size)]
    got = price_plans(plans, SHAPES, MODES, HWS, keep_gathered_kv=True)
    base = price_plans(plans, SHAPES, MODES, HWS)
    for a, hw in enumerate(HWS):
        for b, shape in enumerate(SHAPES):
            for m, mode in enumerate(MODES):
                for k, plan in enumerate(plans):
                    ref = simulate(plan, shape, hw, mode, keep_gathered_kv=True)
                    for col in PHASE_COLUMNS:
                        np.testing.assert_allclose(
                            got[col][a, b, m, k], ref[col], rtol=1e-12, atol=0,
                            err_msg=f"{plan.method} {hw.name} {shape} {mode} plan {k} {col}",
                        )  # fmt: skip
                    for col in COMM_COLUMNS:
                        assert got[col][a, b, m, k] == ref[col], (plan.method, col)
    train, infer = MODES.index("train"), MODES.index("infer")
    for col in ("attn_fwd_ms", "attn_bwd_ms", "reducescatter_ms", "reducescatter_bytes"):
        np.testing.assert_array_equal(got[col], base[col], err_msg=col)
    for col in ("allgather_ms", "allgather_bytes"):
        np.testing.assert_array_equal(got[col][:, :, train], base[col][:, :, infer], err_msg=col)
        np.testing.assert_array_equal(got[col][:, :, infer], base[col][:, :, infer], err_msg=col)
    assert (got["total_ms"][:, :, train] < base["total_ms"][:, :, train]).all()
    assert (got["others_ms"][:, :, train] < base["others_ms"][:, :, train]).all()
    np.testing.assert_array_equal(got["total_ms"][:, :, infer], base["total_ms"][:, :, infer])


def test_keep_gathered_kv_compiled_bitwise(monkeypatch):
    pytest.importorskip("numba")
    plans = [p for m in KEEP_METHODS for p in _plans(m, 8, 2, seed=70)]
    got = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("FLASHCP_COMPILED", mode)
        got[mode] = price_plans(plans, SHAPES, MODES, HWS, keep_gathered_kv=True)
    for col in got["0"]:
        np.testing.assert_array_equal(got["1"][col], got["0"][col], err_msg=col)


def test_keep_gathered_kv_refused_where_no_op_keeps_it():
    ring = _plans("ring", 4, 1, seed=1)
    llama3 = _plans("llama3", 4, 1, seed=1)
    with pytest.raises(ValueError, match="keep_gathered_kv=True is an option of the all-gather"):
        price_plans(llama3 + ring, SHAPES, MODES, HWS, keep_gathered_kv=True)
    with pytest.raises(ValueError, match="keep_gathered_kv must be True or False, got 1"):
        price_plans(llama3, SHAPES, MODES, HWS, keep_gathered_kv=1)
    with pytest.raises(ValueError, match="not impl=ring_flash_attn"):
        simulate(llama3[0], SHAPES[0], HWS[0], "train", impl="ring_flash_attn",
                 keep_gathered_kv=True)  # fmt: skip


@pytest.mark.parametrize("compiled_mode", ["0", "1"])
def test_grad_comm_dtype_priced_by_both_paths(compiled_mode, monkeypatch):
    """``grad_comm_dtype`` (the all-gather op's reduce-scatter dtype): both paths agree to 1e-12;
    in the model dtype (bf16) with ``keep_gathered_kv`` the step's bytes are Eq. 4 / Eq. 5's
    ``4 x tokens x Hkv x D`` elements; the reduce-scatter (time and bytes) moves, and the two
    casts around it (the gathered rows' fp32 dK/dV to bf16, the received rows back) add to
    others_ms where rows are sent."""
    if compiled_mode == "1":
        pytest.importorskip("numba")
    monkeypatch.setenv("FLASHCP_COMPILED", compiled_mode)
    plans = [p for m in KEEP_METHODS for p in _plans(m, 4, 2, seed=80)]
    got = price_plans(plans, SHAPES, MODES, HWS, keep_gathered_kv=True, grad_comm_dtype="bfloat16")
    base = price_plans(plans, SHAPES, MODES, HWS, keep_gathered_kv=True)
    train = MODES.index("train")
    for b, shape in enumerate(SHAPES):
        for k, plan in enumerate(plans):
            ref = simulate(plan, shape, HWS[0], "train", keep_gathered_kv=True,
                           grad_comm_dtype="bfloat16")  # fmt: skip
            for col in PHASE_COLUMNS:
                np.testing.assert_allclose(got[col][0, b, train, k], ref[col], rtol=1e-12, atol=0)
            tokens = (
                plan.comm_tokens_full if plan.method in ("llama3", "per_doc") else plan.comm_tokens
            )
            eq = 4 * tokens * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes
            assert ref["comm_bytes"] == eq == got["comm_bytes"][0, b, train, k], plan.method
    rs = got["reducescatter_bytes"][:, :, train]
    np.testing.assert_array_equal(2 * rs, base["reducescatter_bytes"][:, :, train])
    sent = base["reducescatter_bytes"][:, :, train] > 0
    assert (
        got["reducescatter_ms"][:, :, train][sent] < base["reducescatter_ms"][:, :, train][sent]
    ).all()
    for col in ("allgather_ms", "attn_fwd_ms", "attn_bwd_ms", "allgather_bytes"):
        np.testing.assert_array_equal(got[col], base[col], err_msg=col)
    infer = MODES.index("infer")
    np.testing.assert_array_equal(got["others_ms"][:, :, infer], base["others_ms"][:, :, infer])
    others, others0 = got["others_ms"][:, :, train], base["others_ms"][:, :, train]
    assert (others[sent] > others0[sent]).all() and (others[~sent] == others0[~sent]).all()
    # a float32 reduce-scatter of a bf16 model is the default: the same numbers to the bit
    f32 = price_plans(plans, SHAPES, MODES, HWS, keep_gathered_kv=True, grad_comm_dtype="float32")
    for col in base:
        np.testing.assert_array_equal(f32[col], base[col], err_msg=col)
    with pytest.raises(ValueError, match="grad_comm_dtype=bfloat16 is an option of the all-gather"):
        price_plans(_plans("ring", 4, 1, seed=1), SHAPES, MODES, HWS, grad_comm_dtype="bfloat16")
    with pytest.raises(ValueError, match="unknown grad_comm_dtype 'bf16'"):
        simulate(plans[0], SHAPES[0], HWS[0], "train", grad_comm_dtype="bf16")


def test_grad_comm_dtype_compiled_bitwise(monkeypatch):
    pytest.importorskip("numba")
    plans = [p for m in KEEP_METHODS for p in _plans(m, 8, 2, seed=90)]
    got = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("FLASHCP_COMPILED", mode)
        got[mode] = price_plans(plans, SHAPES, MODES, HWS, keep_gathered_kv=True,
                                grad_comm_dtype="bfloat16")  # fmt: skip
    for col in got["0"]:
        np.testing.assert_array_equal(got["1"][col], got["0"][col], err_msg=col)
