"""Inputs at the edges of every planner and op: zero-length documents, pad tokens, all-empty input.

Planner checks are pure (loops over ranks); the op checks run every method on gloo ranks and compare
the document tokens with the float64 reference of the documents alone, pad rows with zero.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mp_utils import run_ranks

from flashcp.comm import AttnShape, comm_volume
from flashcp.ops import get_attn_op
from flashcp.ops.collectives import CommCounter
from flashcp.ops.reference import reference_attention
from flashcp.ops.sharding import global_rows, position_ids, shard_tensor, unshard
from flashcp.registry import COMM_KIND, FAST_METHODS, METHODS, make_plan_for

#: cu_seqlens of static-shape packing code: the last offset repeated, i.e. docs [16, 24, 0, 0]
CU_SEQLENS = [0, 16, 40, 40, 40]


def _columns(plan):
    return [a.tolist() for a in (plan.rank, plan.doc, plan.start, plan.length, plan.pad)]


# ---- zero-length documents: planners -----------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_zero_length_documents_change_nothing(method):
    doc_lens = np.diff(CU_SEQLENS)
    assert doc_lens.tolist() == [16, 24, 0, 0]
    plan = make_plan_for(method, doc_lens, 2)
    base = make_plan_for(method, [16, 24], 2)
    assert _columns(plan) == _columns(base)
    assert plan.doc_lens.tolist() == [16, 24, 0, 0] and plan.num_docs == 4
    assert {k: v for k, v in plan.summary().items() if k != "num_docs"} == {
        k: v for k, v in base.summary().items() if k != "num_docs"
    }
    # zero-length documents in front and between: indices stay the caller's
    mixed = make_plan_for(method, [0, 16, 0, 0, 24, 0], 2)
    kept = np.array([1, 4])
    assert mixed.doc.tolist() == kept[base.doc].tolist()
    assert mixed.workload_per_rank.tolist() == base.workload_per_rank.tolist()
    assert mixed.ranks() == [[s._replace(doc=int(kept[s.doc])) for s in r] for r in base.ranks()]


def test_zero_length_documents_keep_flashcp_info_indices():
    plan = make_plan_for("flashcp", [0, 12, 0, 4], 2)
    assert plan.info["per_doc_docs"] == [1]  # doc 1 (the 12) is Per-Doc, as doc 0 of [12, 4]
    assert make_plan_for("flashcp", [12, 4], 2).info["per_doc_docs"] == [0]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("doc_lens", [[], [0], [0, 0, 0]])
@pytest.mark.parametrize("cp_size", [1, 4])
def test_all_empty_input_gives_an_empty_plan(method, doc_lens, cp_size):
    plan = make_plan_for(method, doc_lens, cp_size)
    plan.validate()
    assert plan.num_shards == 0 and plan.context_len == 0
    assert plan.tokens_per_rank.tolist() == [0] * cp_size
    s = plan.summary()
    tokens = 0 if plan.moves_kv_tokens else None  # None: all-to-alls only (ulysses)
    assert (s["imbalance_ratio"], s["comm_tokens"], s["num_pieces"]) == (1.0, tokens, 0)
    pad = make_plan_for(method, doc_lens, cp_size, num_pad=8 * cp_size)
    assert pad.pad.tolist() == [8] * cp_size and pad.num_shards == 0


def test_only_negative_lengths_are_errors():
    for method in METHODS:
        with pytest.raises(ValueError, match=re.escape("doc_lens[2] = -1")):
            make_plan_for(method, [16, 0, -1], 2)


# ---- pad tokens: planners ----------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_pad_to_multiple_one_document_of_2999_at_cp_4(method):
    plan = make_plan_for(method, [2999], 4, pad_to_multiple=True)
    assert plan.num_pad == 1 and plan.context_len == 3000
    assert plan.tokens_per_rank.tolist() == [750] * 4
    assert plan.doc_tokens_per_rank.sum() == 2999
    assert plan.workload_per_rank.sum() == 2999 * 3000 // 2  # pad costs no work (Eq. 3)
    assert plan.comm_tokens_full == 3 * int(plan.doc_tokens_per_rank.max())  # pad is not sent


@pytest.mark.parametrize("method", METHODS)
def test_padding_off_names_the_multiple(method):
    multiple = "2 * cp_size = 8" if method == "llama3" else "cp_size = 4"
    with pytest.raises(
        ValueError, match=re.escape(f"pad to a multiple of {multiple}: num_pad = 1")
    ):
        make_plan_for(method, [2999], 4)


def test_llama3_pads_to_2n():
    with pytest.raises(ValueError, match=re.escape("2 * cp_size = 8, which this layout needs")):
        make_plan_for("llama3", [2996], 4)
    with pytest.raises(ValueError, match=re.escape("num_pad = 4")):
        make_plan_for("llama3", [2996], 4)
    assert make_plan_for("llama3", [2996], 4, pad_to_multiple=True).num_pad == 4
    assert make_plan_for("per_doc", [2996], 4, pad_to_multiple=True).num_pad == 0
    # the pad fills the last chunk: rank 0's back chunk (chunk 2N-1)
    plan = make_plan_for("llama3", [10, 3], 2, num_pad=3)
    assert plan.pad.tolist() == [3, 0] and plan.ranks()[0][-1].length == 1


@pytest.mark.parametrize("method", METHODS)
def test_static_shape_padding(method):
    """30 document tokens in a 64-token sequence at CP 4: some ranks hold mostly pad."""
    plan = make_plan_for(method, [10, 0, 20], 4, num_pad=34)
    assert plan.tokens_per_rank.tolist() == [16] * 4 and plan.num_pad == 34
    assert plan.workload_per_rank.sum() == 55 + 210
    assert plan.doc.max() == 2 and 1 not in plan.doc.tolist()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_bad_num_pad(bad):
    with pytest.raises(ValueError, match="num_pad must be an integer >= 0"):
        make_plan_for("per_doc", [16], 2, num_pad=bad)
    with pytest.raises(ValueError, match="pad_to_multiple must be True or False"):
        make_plan_for("per_doc", [16], 2, pad_to_multiple="yes")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(FAST_METHODS),
    st.lists(st.integers(0, 40), min_size=0, max_size=8),
    st.integers(1, 4),
    st.integers(0, 20),
)
def test_pad_and_empty_documents_property(method, doc_lens, cp_size, extra_pad):
    plan = make_plan_for(method, doc_lens, cp_size, num_pad=extra_pad, pad_to_multiple=True)
    plan.validate()
    real = sum(doc_lens)
    assert real + extra_pad <= plan.context_len < real + extra_pad + 2 * cp_size
    assert plan.workload_per_rank.sum() == sum(d * (d + 1) // 2 for d in doc_lens)
    assert all(doc_lens[d] > 0 for d in plan.doc.tolist())
    # the same layout as without the zero-length documents
    kept = [i for i, d in enumerate(doc_lens) if d]
    base = make_plan_for(method, [doc_lens[i] for i in kept], cp_size, num_pad=plan.num_pad)
    assert plan.rank.tolist() == base.rank.tolist() and plan.pad.tolist() == base.pad.tolist()
    assert plan.doc.tolist() == [kept[i] for i in base.doc.tolist()]
    # sharding: every row of the padded packed tensor exactly once; pad rows last on each rank
    rows = [global_rows(plan, r) for r in range(cp_size)]
    assert sorted(np.concatenate(rows).tolist()) == list(range(plan.context_len))
    for r in range(cp_size):
        tail = rows[r][len(rows[r]) - int(plan.pad[r]) :]
        assert (tail >= real).all() and (rows[r][: len(rows[r]) - len(tail)] < real).all()


def test_sharding_with_pad_and_empty_documents():
    lens = [5, 0, 1, 30, 0, 12]
    x = torch.arange(56)  # 48 document tokens, 8 pad
    doc_pos = torch.cat([torch.arange(d) for d in lens] + [torch.zeros(8, dtype=torch.int64)])
    for m in FAST_METHODS:
        plan = make_plan_for(m, lens, 4, num_pad=8)
        locs = [shard_tensor(x, plan, r) for r in range(4)]
        assert torch.equal(unshard(locs, plan), x)
        for r in range(4):
            assert torch.equal(position_ids(plan, r), shard_tensor(doc_pos, plan, r))
            assert (locs[r][locs[r].numel() - int(plan.pad[r]) :] >= 48).all()


# ---- the ops, on gloo ranks ----------------------------------------------------------------------

#: (name, doc_lens, num_pad, pad_to_multiple, cp_size)
OP_CASES = [
    ("cu_seqlens_repeat", [16, 24, 0, 0], 0, False, 2),
    ("one_doc_2999_scaled", [29], 0, True, 4),  # 29 tokens at CP 4: pad 3 (llama3: 3 as well)
    ("static_shape", [0, 10, 20, 0], 34, False, 4),  # ranks holding only pad
    ("all_empty", [0, 0], 0, False, 2),
    ("all_pad", [], 8, False, 2),
]


def _inputs(c, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(c, h, 8, generator=g) for h in (4, 2, 2, 4)]  # q, k, v, dout


def _run_ops(rank, n, plans):
    res = {}
    for (ci, m), plan in plans.items():
        q, k, v, dout = _inputs(plan.context_len, ci)
        prepare, attn = get_attn_op(m)
        ql, kl, vl = (shard_tensor(x, plan, rank).requires_grad_() for x in (q, k, v))
        counter = CommCounter()
        out = attn(ql, kl, vl, prepare(plan, rank), backend="cpu", counter=counter)
        out.backward(shard_tensor(dout, plan, rank))
        res[ci, m] = (out.detach(), ql.grad, kl.grad, vl.grad, counter.as_dict())
    return res


@pytest.mark.parametrize("n", [2, 4])
def test_ops_skip_empty_documents_and_pad(n):
    # planned once here and handed to every rank (the ILP solve is the slow part; the ops are
    # what is checked), so the ranks run the very plans the reference is compared against
    plans = {
        (ci, m): make_plan_for(m, lens, n, num_pad=num_pad, pad_to_multiple=pad_to)
        for ci, (_, lens, num_pad, pad_to, cp) in enumerate(OP_CASES)
        if cp == n
        for m in METHODS
    }
    results = run_ranks(_run_ops, n, plans, timeout_s=240)
    failures = []
    for ci, (name, lens, _, _, cp) in enumerate(OP_CASES):
        if cp != n:
            continue
        for m in METHODS:
            plan = plans[ci, m]
            c, real = plan.context_len, int(sum(lens))
            q, k, v, dout = _inputs(c, ci)
            per_rank = [results[r][ci, m] for r in range(n)]
            got = [unshard([pr[i] for pr in per_rank], plan) for i in range(4)]
            want = [torch.zeros(x.shape, dtype=torch.float64) for x in (q, q, k, v)]
            if real:
                kept = [d for d in lens if d]
                leaves = [x[:real].double().requires_grad_() for x in (q, k, v)]
                ref = reference_attention(*leaves, kept)
                ref.backward(dout[:real].double())
                for w, r in zip(want, [ref.detach()] + [x.grad for x in leaves], strict=True):
                    w[:real] = r
            for what, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
                err = float((g.double() - w).abs().max()) if g.numel() else 0.0
                if err > 1e-5 * max(1.0, float(w.abs().max()) if w.numel() else 1.0):
                    failures.append(f"{m} {name} {what}: err {err:.3g}")
                if float(g[real:].abs().max()) if c > real else 0.0:
                    failures.append(f"{m} {name} {what}: pad rows are not zero")
            expect = comm_volume(plan, COMM_KIND[m], AttnShape(4, 2, 8, "float32"), "train")
            for r, pr in enumerate(per_rank):
                if pr[4] != expect:  # every rank issues the same collectives, as counted
                    failures.append(f"{m} {name} rank {r}: counted {pr[4]} != {expect}")
    assert not failures, "\n".join(failures)


def test_length_files_keep_zero_lengths_and_the_sampler_drops_them(tmp_path):
    from flashcp.data import load_distribution, read_lengths_file

    path = tmp_path / "lens.txt"
    path.write_text("16\n24\n0\n0\n")  # np.diff(cu_seqlens) of a static-shape batch
    assert read_lengths_file(path).tolist() == [16, 24, 0, 0]
    dist = load_distribution("file", path=path)
    assert sorted(set(dist.sample(np.random.default_rng(0), 200).tolist())) == [16, 24]
    with pytest.raises(ValueError, match="-1"):
        path.write_text("16\n-1\n")
        read_lengths_file(path)


# ---- tiny documents: how many pieces the documents are cut into --------------------------------


def test_num_pieces_of_the_tiny_document_example():
    """[2, 6, 56] at CP 4: doc 2 goes Per-Doc (7 tokens in each of its 2N = 8 chunks, rank 3's
    two middle chunks merged: 7 shards), leaving 2 free tokens on every rank, so the 6-token
    document must span three ranks and the 2-token one fits whole: 7 + 3 + 1 = 11 pieces, the
    fewest this Per-Doc set allows."""
    plan = make_plan_for("flashcp", [2, 6, 56], 4)
    assert plan.info["per_doc_docs"] == [2]
    assert plan.num_pieces == plan.num_shards == 11 and plan.summary()["num_pieces"] == 11
    per_doc_tokens = np.bincount(plan.rank[plan.doc == 2], plan.length[plan.doc == 2], 4)
    assert per_doc_tokens.tolist() == [14] * 4  # 16 - 14 = 2 free tokens per rank
    assert (plan.doc == 0).sum() == 1 and (plan.doc == 1).sum() == 3


@pytest.mark.parametrize(
    ("doc_lens", "cp_size", "num_pieces", "whole"),
    [
        # the plain order (shortest whole pieces first, then a head) moved the 1-token doc and cut
        # the 2-token doc 2 in two; an exact fit moves doc 2 whole instead: only the Per-Doc doc
        # is cut
        ([1, 27, 2, 2], 2, 6, [0, 2, 3]),
        # free tokens 2, 2, 3 next to the Per-Doc 29: the 3-token doc fills the 3 whole and only
        # the 4-token doc is cut (2 + 2); the plain order cut both
        ([4, 3, 29], 3, 8, [1]),
    ],
)
def test_token_balancing_prefers_moves_that_cut_no_document(doc_lens, cp_size, num_pieces, whole):
    plan = make_plan_for("flashcp", doc_lens, cp_size)
    assert plan.status == "ok" and plan.imbalance_ratio <= 1.05
    assert plan.num_pieces == num_pieces
    counts = np.bincount(plan.doc, minlength=len(doc_lens))
    assert all(counts[d] == 1 for d in whole), plan.ranks()


def _measure_padded(rank, n):
    from flashcp.executors.dist import init_from_env, measure_step

    group = init_from_env(30)
    out = {}
    for m in ("llama3", "ring", "flashcp"):
        plan = make_plan_for(m, [5, 0, 40, 3, 0], n, num_pad=8, pad_to_multiple=True)
        out[m] = measure_step(
            plan, AttnShape(4, 2, 8, "float32"), "train", group=group, backend="cpu", iters=1
        )
    return out


def test_dist_executor_runs_padded_plans_with_zero_length_documents():
    res = run_ranks(_measure_padded, 2, timeout_s=120)
    for m in ("llama3", "ring", "flashcp"):
        plan = make_plan_for(m, [5, 0, 40, 3, 0], 2, num_pad=8, pad_to_multiple=True)
        expect = comm_volume(plan, COMM_KIND[m], AttnShape(4, 2, 8, "float32"), "train")
        assert res[0][m] == res[1][m]
        assert {k: res[0][m][k] for k in expect} == expect
