"""Tests of the analytic simulator (flashcp.sim): kernel model, step model, hardware profiles."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from flashcp.comm import AttnShape, comm_volume
from flashcp.registry import COMM_KIND, FAST_METHODS, make_plan_for
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS
from flashcp.sim import attention_kernel_ms, list_hardware, load_hardware, simulate, simulate_many
from flashcp.sim.kernel import bwd_tile_counts, fwd_tile_counts

HW = load_hardware("h100_sxm")
SHAPE = AttnShape(num_heads=32, num_kv_heads=32, head_dim=128)
PHASES = [c for c in PHASE_COLUMNS if c != "total_ms"]

#: FlashAttention-2 H100 causal TFLOP/s (head_dim 128, 16K tokens per batch; docs/design.md §8).
FA2_TABLE = {  # seqlen: (fwd, fwd+bwd)
    512: (191, 163),
    1024: (260, 221),
    2048: (298, 265),
    4096: (319, 294),
    8192: (333, 308),
    16384: (335, 328),
}
#: band of the kernel targets in the calibration experiment (results/calibration/targets.csv)
FA2_TOLERANCE = 0.10


def _doc_lens(seed: int, context_len: int = 32768, long_frac: float = 0.3) -> np.ndarray:
    """Packed document lengths: mostly short documents, a few long ones, cut to ``context_len``."""
    rng = np.random.default_rng(seed)
    out, left = [], context_len
    while left > 0:
        d = (
            int(rng.integers(1, context_len // 2))
            if rng.random() < long_frac
            else int(rng.integers(1, 2048))
        )
        d = min(d, left)
        out.append(d)
        left -= d
    return np.array(out)


# ---- kernel model ------------------------------------------------------------------------------
def _brute_fwd(q, k, causal, bq, bk):
    m, tiles, mx = -(-q // bq), 0, 0
    for i in range(m):
        last_row = min(q, (i + 1) * bq) - 1
        hi = k - q + last_row + 1 if causal else k
        n = -(-hi // bk)
        tiles, mx = tiles + n, max(mx, n)
    return m, tiles, mx


def _brute_bwd(q, k, causal, bq, bk):
    nk, mq, tiles, mx = -(-k // bk), -(-q // bq), 0, 0
    for j in range(nk):
        row0 = max(0, j * bk - (k - q)) if causal else 0
        n = mq - row0 // bq
        tiles, mx = tiles + n, max(mx, n)
    return nk, tiles, mx


@pytest.mark.parametrize("blocks", [(128, 64, 64, 128), (128, 128, 64, 64), (64, 32, 32, 128)])
def test_tile_counts_match_brute_force(blocks):
    fq, fk, bq, bk = blocks
    rng = np.random.default_rng(1)
    q = rng.integers(1, 900, size=400)
    k = q + rng.integers(0, 900, size=400) * (rng.random(400) < 0.7)
    c = rng.random(400) < 0.6
    f = fwd_tile_counts(q, k, c, fq, fk)
    b = bwd_tile_counts(q, k, c, bq, bk)
    for n in range(q.size):
        args = (int(q[n]), int(k[n]), bool(c[n]))
        assert tuple(int(x[n]) for x in f) == _brute_fwd(*args, fq, fk)
        assert tuple(int(x[n]) for x in b) == _brute_bwd(*args, bq, bk)


@pytest.mark.parametrize("backward", [False, True])
def test_kernel_matches_fa2_table_within_tolerance(backward):
    shape = AttnShape(num_heads=16, num_kv_heads=16, head_dim=128)
    for s, (fwd_pub, fb_pub) in FA2_TABLE.items():
        q = np.full(16384 // s, s)
        flops = 4 * s * s * 128 * 16 / 2 * q.size
        t_fwd = attention_kernel_ms(q, q, True, shape, HW, False)
        if backward:
            t = t_fwd + attention_kernel_ms(q, q, True, shape, HW, True)
            model, pub = 3.5 * flops / (t * 1e9), fb_pub
        else:
            model, pub = flops / (t_fwd * 1e9), fwd_pub
        assert abs(model / pub - 1) <= FA2_TOLERANCE, (s, model, pub)


@pytest.mark.parametrize("backward", [False, True])
def test_many_short_segments_cost_more_than_one_long(backward):
    # 64 x 2048 and 1 x 16384 causal segments have (almost) the same query-key pairs
    short = np.full(64, 2048)
    assert 64 * 2048 * 2049 >= 16384 * 16385 * 0.99
    t_short = attention_kernel_ms(short, short, True, SHAPE, HW, backward)
    t_long = attention_kernel_ms([16384], [16384], True, SHAPE, HW, backward)
    assert t_short > t_long
    # and shards with a prefix: 8 chunks of one document vs the whole document
    t_chunks = sum(
        attention_kernel_ms([2048], [2048 * (i + 1)], True, SHAPE, HW, backward) for i in range(8)
    )
    assert t_chunks > t_long


@pytest.mark.parametrize("backward", [False, True])
def test_kernel_monotone_in_work(backward):
    rng = np.random.default_rng(2)
    for _ in range(50):
        q = rng.integers(1, 5000, size=int(rng.integers(1, 20)))
        k = q + rng.integers(0, 5000, size=q.size)
        base = attention_kernel_ms(q, k, True, SHAPE, HW, backward)
        i = int(rng.integers(q.size))
        longer_q = q.copy()
        longer_q[i] += int(rng.integers(1, 300))
        k2 = k + (longer_q - q)
        assert attention_kernel_ms(longer_q, k2, True, SHAPE, HW, backward) >= base
        k3 = k.copy()
        k3[i] += int(rng.integers(1, 300))
        assert attention_kernel_ms(q, k3, True, SHAPE, HW, backward) >= base
        assert (
            attention_kernel_ms(np.append(q, 7), np.append(k, 9), True, SHAPE, HW, backward) >= base
        )
        more_heads = AttnShape(num_heads=64, num_kv_heads=32, head_dim=128)
        assert attention_kernel_ms(q, k, True, more_heads, HW, backward) >= base


def test_kernel_bad_input():
    with pytest.raises(ValueError, match="kv_len"):
        attention_kernel_ms([10], [5], True, SHAPE, HW, False)
    with pytest.raises(ValueError):
        attention_kernel_ms([10, 3], [10], True, SHAPE, HW, False)
    assert attention_kernel_ms([], [], True, SHAPE, HW, False) == 0.0
    assert attention_kernel_ms([10], [5], False, SHAPE, HW, False) > 0


# ---- step model --------------------------------------------------------------------------------
@pytest.mark.parametrize("method", FAST_METHODS)
@pytest.mark.parametrize("seed", [0, 1])
def test_columns_total_and_bytes(method, seed):
    plan = make_plan_for(method, _doc_lens(seed), 4)
    for mode in ("train", "infer"):
        row = simulate(plan, SHAPE, HW, mode)
        assert set(row) == set(PHASE_COLUMNS) | set(COMM_COLUMNS)
        assert all(row[c] >= 0 for c in PHASE_COLUMNS)
        assert row["total_ms"] == pytest.approx(sum(row[c] for c in PHASES), rel=1e-12)
        vol = comm_volume(plan, COMM_KIND[method], SHAPE, mode)
        assert {c: row[c] for c in COMM_COLUMNS} == vol
        if mode == "infer":
            assert row["attn_bwd_ms"] == row["reducescatter_ms"] == 0.0


@pytest.mark.parametrize("method", ["ring", "zigzag"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_flash_attn_counts_n_grad_hops(method, n):
    """ring-flash-attn's ring backward sends dK/dV at each of its N steps (ours N - 1): its
    p2p_bytes hold one fp32 dK/dV block more, priced per hop as before (the step time is the
    same), and the simulator reports comm_volume's bytes."""
    from flashcp.comm import ring_grad_hops
    from flashcp.sim.impl import impl_plan

    assert ring_grad_hops(n, "ring_flash_attn") == n and ring_grad_hops(n) == n - 1
    assert ring_grad_hops(1, "ring_flash_attn") == 0
    plan, _ = impl_plan(method, "ring_flash_attn", [4096 * n, 2048 * n, 512 * n], n)
    block = int(plan.doc_tokens_per_rank.max())
    ours = comm_volume(plan, "p2p_ring", SHAPE, "train")
    rfa = comm_volume(plan, "p2p_ring", SHAPE, "train", impl="ring_flash_attn")
    grad_block = block * 2 * SHAPE.num_kv_heads * SHAPE.head_dim * 4  # fp32 partial sums
    assert rfa["p2p_bytes"] - ours["p2p_bytes"] == grad_block
    assert (
        rfa["p2p_bytes"]
        == 2 * (n - 1) * block * 2 * SHAPE.num_kv_heads * SHAPE.head_dim * 2 + n * grad_block
    )
    row = simulate(plan, SHAPE, HW, "train", impl="ring_flash_attn")
    assert row["p2p_bytes"] == rfa["p2p_bytes"]
    for mode in ("infer",):
        assert comm_volume(plan, "p2p_ring", SHAPE, mode, impl="ring_flash_attn") == comm_volume(
            plan, "p2p_ring", SHAPE, mode
        )
    with pytest.raises(ValueError, match=r"unknown method\.impl 'flash'"):
        comm_volume(plan, "p2p_ring", SHAPE, "train", impl="flash")


def test_ring_flash_attn_llama3_reduce_scatters_in_model_dtype():
    """ring-flash-attn's llama3 reduce-scatters a model-dtype dK/dV buffer (its dkv_buffer)."""
    from flashcp.sim.impl import impl_plan

    plan, _ = impl_plan("llama3", "ring_flash_attn", [30000, 2768], 4)
    ours = comm_volume(plan, "allgather_full", SHAPE, "train")
    rfa = comm_volume(plan, "allgather_full", SHAPE, "train", impl="ring_flash_attn")
    assert rfa["allgather_bytes"] == ours["allgather_bytes"]
    assert rfa["reducescatter_bytes"] * 2 == ours["reducescatter_bytes"]  # bf16 vs fp32
    assert rfa["reducescatter_bytes"] == rfa["allgather_bytes"] // 2
    row = simulate(plan, SHAPE, HW, "train", impl="ring_flash_attn")
    assert row["reducescatter_bytes"] == rfa["reducescatter_bytes"]


@pytest.mark.parametrize("method", FAST_METHODS)
def test_infer_cheaper_than_train(method):
    for seed in range(3):
        plan = make_plan_for(method, _doc_lens(seed), 8)
        train = simulate(plan, SHAPE, HW, "train")["total_ms"]
        infer = simulate(plan, SHAPE, HW, "infer")["total_ms"]
        assert 0 < infer < train


@pytest.mark.parametrize("method", FAST_METHODS)
def test_monotone_in_heads_and_tokens(method):
    for seed in range(3):
        d = _doc_lens(seed)
        plan = make_plan_for(method, d, 4)
        for mode in ("train", "infer"):
            t = [
                simulate(plan, AttnShape(num_heads=h, num_kv_heads=h, head_dim=128), HW, mode)[
                    "total_ms"
                ]
                for h in (8, 16, 32)
            ]
            assert t[0] <= t[1] <= t[2]
            # the same documents twice as long (context doubled): never cheaper
            big = make_plan_for(method, 2 * d, 4)
            assert (
                simulate(big, SHAPE, HW, mode)["total_ms"]
                >= simulate(plan, SHAPE, HW, mode)["total_ms"]
            )


def test_whole_doc_plan_has_zero_communication():
    plan = make_plan_for("flashcp", [2048] * 8, 4)
    assert plan.split_docs.size == 0 and plan.comm_tokens == 0
    for mode in ("train", "infer"):
        row = simulate(plan, SHAPE, HW, mode)
        assert row["allgather_ms"] == row["reducescatter_ms"] == row["p2p_ms"] == 0.0
        # the op still copies K/V into its source buffer and gathers the segments' keys
        assert row["others_ms"] > 0.0
        assert all(row[c] == 0 for c in COMM_COLUMNS)


def test_short_shards_cost_more_than_whole_documents():
    # 4 documents of 8000 on 4 ranks: whole (flashcp) vs cut into 2N chunks of 1000 (per_doc), the
    # same workload; chunks that are not multiples of the tile waste partial tiles
    d = [8000] * 4
    whole = simulate(make_plan_for("flashcp", d, 4), SHAPE, HW, "train")
    split = simulate(make_plan_for("per_doc", d, 4), SHAPE, HW, "train")
    assert split["attn_fwd_ms"] > whole["attn_fwd_ms"]
    assert split["attn_bwd_ms"] > whole["attn_bwd_ms"]


def test_zigzag_balances_a_single_long_document():
    plan_ring = make_plan_for("ring", [65536], 8)
    plan_zz = make_plan_for("zigzag", [65536], 8)
    for mode in ("train", "infer"):
        ring = simulate(plan_ring, SHAPE, HW, mode)
        zz = simulate(plan_zz, SHAPE, HW, mode)
        assert zz["attn_fwd_ms"] < ring["attn_fwd_ms"]
        assert zz["total_ms"] < ring["total_ms"]


def test_fewer_kv_heads_communicate_less():
    plan = make_plan_for("llama3", _doc_lens(0), 8)
    mha = simulate(plan, SHAPE, HW, "train")
    gqa = simulate(plan, AttnShape(num_heads=32, num_kv_heads=8, head_dim=128), HW, "train")
    assert gqa["allgather_ms"] < mha["allgather_ms"]
    assert gqa["comm_bytes"] * 4 == mha["comm_bytes"]


@pytest.mark.parametrize("method", FAST_METHODS)
def test_cp_size_one(method):
    plan = make_plan_for(method, [3000, 1000], 1)
    row = simulate(plan, SHAPE, HW, "train")
    assert row["allgather_ms"] == row["p2p_ms"] == row["reducescatter_ms"] == 0.0
    assert row["total_ms"] > 0
    # one rank is one device running the whole sequence: the same attention for every method;
    # they differ only in the copies, merges and casts their ops still issue
    ref = simulate(make_plan_for("llama3", [3000, 1000], 1), SHAPE, HW, "train")
    for col in ("attn_fwd_ms", "attn_bwd_ms"):
        assert row[col] == pytest.approx(ref[col], rel=1e-9)
    assert row["total_ms"] - row["others_ms"] == pytest.approx(ref["total_ms"] - ref["others_ms"])


@pytest.mark.parametrize("method", FAST_METHODS)
def test_simulate_many_matches_simulate(method):
    plan = make_plan_for(method, _doc_lens(3), 8)
    shapes = [SHAPE, AttnShape(num_heads=16, num_kv_heads=4, head_dim=64, dtype="float32")]
    modes = ["train", "infer"]
    many = simulate_many(plan, shapes, modes, HW)
    one = [simulate(plan, s, HW, m) for s in shapes for m in modes]
    assert many == one


def test_comm_kind_override_and_errors():
    plan = make_plan_for("per_doc", _doc_lens(0), 4)
    zz = simulate(make_plan_for("zigzag", _doc_lens(0), 4), SHAPE, HW, "train")
    assert simulate(plan, SHAPE, HW, "train", comm_kind="p2p_ring") == zz
    with pytest.raises(ValueError, match="mode"):
        simulate(plan, SHAPE, HW, "eval")
    with pytest.raises(ValueError, match="comm_kind"):
        simulate(plan, SHAPE, HW, "train", comm_kind="all_to_everyone")
    with pytest.raises(ValueError, match="mode"):
        simulate_many(plan, [SHAPE], ["train", "bogus"], HW)


# ---- hardware profiles -------------------------------------------------------------------------
def test_profiles_load():
    names = list_hardware()
    assert {"h100_sxm", "h100_ib"} <= set(names)
    for name in names:
        hw = load_hardware(name)
        assert hw.name == name
        assert load_hardware(hw.to_dict()) == hw
    ib = load_hardware("h100_ib")
    plan = make_plan_for("llama3", _doc_lens(0), 8)
    assert (
        simulate(plan, SHAPE, ib, "train")["allgather_ms"]
        > simulate(plan, SHAPE, HW, "train")["allgather_ms"]
    )


def test_loader_rejects_bad_input():
    with pytest.raises(ValueError, match="h100_sxm"):
        load_hardware("h100_pcie")
    d = HW.to_dict()
    with pytest.raises(ValueError, match="peak_tflop"):
        load_hardware({**d, "peak_tflop": 1.0})
    d_missing = dict(d)
    del d_missing["num_sms"]
    with pytest.raises(ValueError, match="num_sms"):
        load_hardware(d_missing)
    with pytest.raises(ValueError, match="launch_us"):
        load_hardware({**d, "launch_us": -1.0})
    with pytest.raises(ValueError, match="fwd_block_q"):
        load_hardware({**d, "fwd_block_q": 96})
    with pytest.raises(ValueError, match="fwd_tile_tflops"):
        load_hardware({**d, "fwd_tile_tflops": 2000.0})
    with pytest.raises(ValueError, match="num_sms"):
        load_hardware({**d, "num_sms": 13.5})
    assert load_hardware({**d, "defaults": ["base_hardware"]}) == HW


def test_collective_model():
    # bandwidth rises with message size, and the falloff reproduces the published curve's shape
    sizes = [2**k for k in range(12, 32, 2)]
    bw = [s * 7 / 8 / HW.collective_us(s * 7 / 8, s, HW.allgather_busbw_gbps) for s in sizes]
    assert all(b2 >= b1 for b1, b2 in pairwise(bw))
    assert bw[-1] == pytest.approx(HW.allgather_busbw_gbps * 1e3, rel=0.02)
    assert HW.collective_us(0, 0, HW.allgather_busbw_gbps) == 0.0


# ---- per-size collective tables (conf/hardware/nccl/) ---------------------------------------------
H200_TABLES = {  # collective: (table name, profile's pricing method name)
    "all_gather": ("h200_8x_all_gather_half", "allgather_us"),
    "reduce_scatter": ("h200_8x_reduce_scatter_half", "reducescatter_us"),
}


def _busbw(hw, op, size):
    """Modelled bus bandwidth of one 8-rank collective over a ``size``-byte buffer, GB/s."""
    recv = size * 7 / 8
    return recv / getattr(hw, H200_TABLES[op][1])(recv, size) / 1e3


@pytest.mark.parametrize("op", sorted(H200_TABLES))
def test_collective_table_exact_at_its_points_and_monotone_between(op):
    from flashcp.sim.hardware import read_collective_table

    table = read_collective_table(H200_TABLES[op][0])
    assert table.collective == op and table.ranks == 8 and len(table.size_bytes) == 11
    for hw in (
        load_hardware("h200_sxm"),
        load_hardware("h200_sxm", calibrated=False),
        load_hardware({**load_hardware("h200_sxm").to_dict(), "collective_latency_us": 18.5}),
    ):
        # every published point: its bus bandwidth and time, whatever the latency
        for size, bw, t in zip(table.size_bytes, table.busbw_gbps, table.times_us(), strict=True):
            assert _busbw(hw, op, size) == pytest.approx(bw, rel=1e-12)
            assert getattr(hw, H200_TABLES[op][1])(size * 7 / 8, size) == pytest.approx(
                t, rel=1e-12
            )
        # between the points (log-spaced), bus bandwidth and time never fall as the size grows
        sizes = np.geomspace(table.size_bytes[0], table.size_bytes[-1], 200)
        bws = [_busbw(hw, op, s) for s in sizes]
        times = [s / b for s, b in zip(sizes, bws, strict=True)]
        assert all(b2 >= b1 for b1, b2 in pairwise(bws))
        assert all(t2 > t1 for t1, t2 in pairwise(times))
        # below the table: the falloff curve's shape, scaled to meet the table's smallest point
        s0 = table.size_bytes[0]
        for s in (2**15, 2**20, 2**22):
            want = hw.busbw_fraction(s) / hw.busbw_fraction(s0)
            assert hw.busbw_fraction(s, op) / hw.busbw_fraction(s0, op) == pytest.approx(
                want, rel=1e-12
            )
            assert _busbw(hw, op, s) < _busbw(hw, op, s0)
        # beyond it: constant fraction (bandwidth only creeps up as the latency's share falls)
        assert hw.busbw_fraction(2**36, op) == hw.busbw_fraction(table.size_bytes[-1], op)
    # the bus bandwidth scales the whole table (what the sensitivity study varies)
    hw = load_hardware("h200_sxm")
    key = f"{op.replace('_', '')}_busbw_gbps"
    half = load_hardware({**hw.to_dict(), key: getattr(hw, key) / 2})
    assert half.busbw_fraction(2**25, op) == hw.busbw_fraction(2**25, op)
    lat = hw.collective_latency_us
    slow, fast = (getattr(p, H200_TABLES[op][1])(2**25 * 7 / 8, 2**25) - lat for p in (half, hw))
    assert slow == pytest.approx(2 * fast, rel=1e-12)


def _write_table(path, rows, collective="all_gather", ranks="8"):
    head = (
        f"# source: a test\n# collective: {collective}\n# ranks: {ranks}\nsize_bytes,busbw_gbps\n"
    )
    path.write_text(head + "".join(f"{s},{b}\n" for s, b in rows))
    return str(path)


def test_bad_collective_table_is_a_value_error_naming_it(tmp_path):
    from flashcp.sim.hardware import CollectiveTable, read_collective_table

    d = load_hardware("h200_sxm").to_dict()
    good = [(2**23, 97.0), (2**24, 167.0), (2**25, 236.0)]
    table = _write_table(tmp_path / "ok.csv", good)
    ok = load_hardware({**d, "allgather_table": table, "allgather_busbw_gbps": 236.0})
    assert _busbw(ok, "all_gather", 2**24) == pytest.approx(167.0, rel=1e-12)
    cases = {
        "shrinking.csv": ([(2**23, 97.0), (2**23, 167.0), (2**25, 236.0)], "strictly increase"),
        "descending.csv": ([(2**24, 97.0), (2**23, 167.0)], "strictly increase"),
        "zero_bw.csv": ([(2**23, 97.0), (2**24, 0.0)], "positive"),
        "negative_bw.csv": ([(2**23, -1.0)], "positive"),
        "negative_size.csv": ([(-5, 97.0)], "positive"),
        "empty.csv": ([], "at least one point"),
        "text.csv": ([(2**23, "fast")], "not a number"),
    }
    for name, (rows, what) in cases.items():
        path = _write_table(tmp_path / name, rows)
        with pytest.raises(ValueError, match=what) as err:
            load_hardware({**d, "allgather_table": path})
        assert name in str(err.value)
    with pytest.raises(ValueError, match="ranks"):
        read_collective_table(_write_table(tmp_path / "one_rank.csv", good, ranks="1"))
    with pytest.raises(ValueError, match="not a all_gather one"):
        load_hardware({**d, "allgather_table": "h200_8x_reduce_scatter_half"})
    with pytest.raises(
        ValueError, match=r"unknown collective table 'h999'.*h200_8x_all_gather_half"
    ):
        load_hardware({**d, "allgather_table": "h999"})
    # the latency must stay below the table's smallest time (75.7 us at 8 MiB), as for the curve
    with pytest.raises(ValueError, match=r"collective_latency_us = 80.*h200_8x_all_gather_half"):
        load_hardware({**d, "collective_latency_us": 80.0, "busbw_curve_gbps": [0.1] * 4})
    with pytest.raises(ValueError, match=r"'t'.*strictly increase"):
        CollectiveTable("t", "all_gather", 8, (2.0, 1.0), (1.0, 1.0))
    with pytest.raises(ValueError, match=r"'t'.*collective"):
        CollectiveTable("t", "all_reduce", 8, (1.0,), (1.0,))
    with pytest.raises(ValueError, match="unknown collective"):
        ok.busbw_fraction(2**24, "all_reduce")


def test_h200_profile_loads_and_prices():
    h200 = load_hardware("h200_sxm")
    assert (h200.peak_tflops, h200.num_sms) == (989.0, 132)
    assert h200.allgather_table and h200.reducescatter_table
    a100 = load_hardware("a100_sxm")  # a profile without tables: the curve's falloff
    assert not a100.allgather_table and a100.falloff_table("all_gather") == a100.falloff_table()
    assert HW.allgather_table == h200.allgather_table  # h100_sxm: the same NVLink4 tables
    # the kernel and host constants are the H100's (same GPU), the network's its own tables
    for key in ("fwd_tile_tflops", "bwd_tile_tflops", "host_op_us", "collective_latency_us"):
        assert getattr(h200, key) == getattr(HW, key)
    shape = AttnShape(num_heads=32, num_kv_heads=8, head_dim=128)
    plan = make_plan_for("llama3", _doc_lens(0), 8)
    a, b = simulate(plan, shape, h200, "train"), simulate(plan, shape, HW, "train")
    assert a["allgather_ms"] > 0 and a["reducescatter_ms"] > 0
    assert a["allgather_ms"] != b["allgather_ms"]
    assert a["comm_bytes"] == b["comm_bytes"]
    # a profile without a table: the curve-based formula of before
    for s in (2**16, 2**23, 2**27, 2**31):
        old = a100.collective_latency_us + s * 7 / 8 / (
            a100.allgather_busbw_gbps * 1e3 * a100.busbw_fraction(s)
        )
        assert a100.allgather_us(s * 7 / 8, s) == old
        assert a100.reducescatter_us(s * 7 / 8, s) == a100.collective_us(
            s * 7 / 8, s, a100.reducescatter_busbw_gbps
        )


def _ring_reference(plan):
    """Per (step, rank) query rows, key rows, forward and backward tiles, by brute force."""
    n = plan.cp_size
    q_rows = np.zeros((n, n))
    kv_rows = np.zeros((n, n))
    tiles = np.zeros((n, n))
    bwd_tiles = np.zeros((n, n))
    ranks = plan.ranks()
    for t in range(n):
        for r in range(n):
            local, source = ranks[r], ranks[(r - t) % n]
            for doc in {sh.doc for sh in local}:
                mine = [sh for sh in local if sh.doc == doc]
                if t == 0:
                    q = k = sum(sh.length for sh in mine)
                    causal = True
                else:
                    theirs = [sh for sh in source if sh.doc == doc]
                    q = sum(sh.length for sh in mine if any(o.start < sh.start for o in theirs))
                    k = sum(o.length for o in theirs if any(o.start < sh.start for sh in mine))
                    causal = False
                if q:
                    q_rows[t, r] += q
                    kv_rows[t, r] += k
                    tiles[t, r] += _brute_fwd(q, k, causal, HW.fwd_block_q, HW.fwd_block_k)[1]
                    bwd_tiles[t, r] += _brute_bwd(q, k, causal, HW.bwd_block_q, HW.bwd_block_k)[1]
    return q_rows, kv_rows, tiles, bwd_tiles


@pytest.mark.parametrize("method", ["ring", "zigzag"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ring_segments_match_brute_force(method, seed):
    from flashcp.sim import PlanCost

    plan = make_plan_for(method, _doc_lens(seed, context_len=8192), 4)
    cost = PlanCost(plan, HW, "p2p_ring")
    q_rows, kv_rows, tiles, bwd_tiles = _ring_reference(plan)
    np.testing.assert_array_equal(cost.q_rows, q_rows)
    np.testing.assert_array_equal(cost.kv_rows, kv_rows)
    np.testing.assert_array_equal(cost.fwd.tiles, tiles)
    np.testing.assert_array_equal(cost.bwd.tiles, bwd_tiles)


@pytest.mark.parametrize("method", FAST_METHODS)
def test_edge_inputs(method):
    # thousands of length-1 documents, documents shorter than 2N, a single document
    for d in ([1] * 3000 + [5 * 1024 - 3000 + 7 * 1024], [3] * 64, [8192]):
        plan = make_plan_for(method, d, 8)
        for mode in ("train", "infer"):
            row = simulate(plan, SHAPE, HW, mode)
            assert np.isfinite(row["total_ms"]) and row["total_ms"] > 0
