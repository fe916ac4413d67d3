"""One step time computed by hand, term by term, against the cost model.

A 2-rank FlashCP plan (two documents, 3,000 and 1,096 tokens; C = 4,096), inference, 4 query
heads, 2 KV heads, head_dim 64, bf16, on the calibrated ``h100_sxm`` profile. Every term of the
project's all-gather op (docs/design.md §3; :mod:`flashcp.ops.allgather_attn`) is computed here from
the plan's shards with plain arithmetic: the KV all-gather's bytes and time (the profile's per-size
bandwidth), the FlashAttention-2 forward kernel from its tiles counted one query block at a time
(not from the closed forms the simulator uses), the copies that build the send buffer and gather
each segment's keys, and the host's dispatch time against the device's. The simulator must give
each phase, and their sum, to 1e-12.
"""

from __future__ import annotations

import math

import pytest

from flashcp.comm import AttnShape
from flashcp.registry import make_plan_for
from flashcp.sim import load_hardware, simulate

DOCS = [3000, 1096]
SHAPE = AttnShape(num_heads=4, num_kv_heads=2, head_dim=64, dtype="bfloat16")


def _fwd_kernel_us(hw, segments, heads, d):
    """FlashAttention-2 forward over ``segments`` ((q_len, kv_len), causal, bottom-right): one CTA
    per query block of ``fwd_block_q`` rows and head; its tiles are the key blocks up to the
    diagonal of its last row. Time: launch + max(work spread over the SMs, the longest CTA)."""
    bq, bk = hw.fwd_block_q, hw.fwd_block_k
    ctas = tiles = longest = 0
    for q, kv in segments:
        a = kv - q
        for i in range(math.ceil(q / bq)):
            last_row = min((i + 1) * bq, q) - 1
            blocks = math.ceil((a + last_row + 1) / bk)
            ctas, tiles, longest = ctas + 1, tiles + blocks, max(longest, blocks)
    if ctas == 0:
        return 0.0
    tile_us = 4 * d * bq * bk / (hw.fwd_tile_tflops * 1e12 / hw.num_sms) * 1e6
    cta_us = hw.fwd_cta_overhead_us
    spread = heads * (ctas * cta_us + tiles * tile_us) / hw.num_sms
    return hw.launch_us + max(spread, cta_us + longest * tile_us)


def test_a_two_rank_inference_step_by_hand():
    hw = load_hardware("h100_sxm")
    plan = make_plan_for("flashcp", DOCS, 2)
    h, hkv, d, e = SHAPE.num_heads, SHAPE.num_kv_heads, SHAPE.head_dim, SHAPE.dtype_bytes
    n = plan.cp_size
    shards = [
        (int(r), int(s), int(ln), bool(last))
        for r, s, ln, last in zip(plan.rank, plan.start, plan.length, plan.is_last, strict=True)
    ]
    # rows: a rank's query rows, its segments' key rows (a shard sees its document's prefix),
    # and the rows it sends (the shards of documents that continue on a later rank)
    local = [sum(ln for r, _, ln, _ in shards if r == k) for k in range(n)]
    kv_rows = [sum(s + ln for r, s, ln, _ in shards if r == k) for k in range(n)]
    send = [sum(ln for r, _, ln, last in shards if r == k and not last) for k in range(n)]
    send_max = max(send)
    assert local == [2048, 2048] and send_max > 0  # a document is cut: there is KV to share

    # the KV all-gather: every rank contributes send_max rows of K and V (padded), one call
    kv_el = 2 * hkv * d  # K and V elements per row (one head group: the buffers are small)
    recv = (n - 1) * send_max * kv_el * e
    total = n * send_max * kv_el * e
    busbw = hw.allgather_busbw_gbps * hw.busbw_fraction(total, "all_gather")
    ag_us = hw.collective_latency_us + recv / (busbw * 1e3)

    want = {"allgather_ms": ag_us / 1e3, "attn_fwd_ms": 0.0, "others_ms": 0.0}
    for k in range(n):
        fwd_us = _fwd_kernel_us(hw, [(ln, s + ln) for r, s, ln, _ in shards if r == k], h, d)
        # device copies: the send buffer (local K/V in: 4 launches), one index gather of every
        # segment's keys; bytes read + written at the copy bandwidth
        build = 4 * hw.launch_us + (local[k] * kv_el * e * 2 + send_max * kv_el * e * 3) / (
            hw.copy_bw_gbps * 1e3
        )
        keys = hw.launch_us + kv_rows[k] * kv_el * e * 2 / (hw.copy_bw_gbps * 1e3)
        device = ag_us + build + keys + fwd_us
        host = hw.collective_host_us + hw.host_op_us * (5 + 1)  # 5 ops and the kernel
        others = build + keys + max(host - device, 0.0)
        want["attn_fwd_ms"] = max(want["attn_fwd_ms"], fwd_us / 1e3)
        want["others_ms"] = max(want["others_ms"], others / 1e3)

    got = simulate(plan, SHAPE, hw, "infer")
    assert got["allgather_bytes"] == recv
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=0), key
    for key in ("attn_bwd_ms", "reducescatter_ms", "p2p_ms", "alltoall_ms"):
        assert got[key] == 0.0, key
    assert got["total_ms"] == pytest.approx(sum(want.values()), rel=1e-12, abs=0)
