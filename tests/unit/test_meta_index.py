"""The shard-level index metadata (flashcp.ops.meta_index) equals the readable token-level code:
the all-gather family's send rows and key index on random plans of every method (pad, 1-token and
zero-length documents included), for every rank and both all-gather variants; the ring family's
kernel calls of every step (flashcp.ops.ring_meta), from its NumPy arrays and its compiled kernel
(flashcp.ops.ring_kernels), on the same plans; a plan whose shards do not tile its documents falls
back to the reference; and a
rank's labels (flashcp.training.shard_batch) are its shard of the whole batch's shifted labels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashcp import compiled
from flashcp.ops.allgather_attn import allgather_index_reference, build_allgather_meta
from flashcp.ops.meta_index import (
    RING_CALL_FIELDS,
    allgather_index,
    ranges,
    ring_calls,
    ring_segments,
    tiles_documents,
)
from flashcp.ops.ring_meta import _rows, prepare_ring_meta, ring_steps_reference
from flashcp.ops.sharding import shard_tensor
from flashcp.plan import cu_seqlens, make_plan
from flashcp.registry import make_plan_for, method_names
from flashcp.training import shard_batch, shift_labels

METHODS = [m for m in method_names() if m != "ilp"]  # ilp: the flashcp layout, solved slowly


def _random_plans(method: str, count: int, seed: int, max_docs: int = 12):
    """``count`` plans of ``method`` on random batches: 1 to ``max_docs`` documents, about a fifth
    of them zero-length and a fifth one token long, pad beyond what the layout needs."""
    rng = np.random.default_rng(seed)
    plans = []
    while len(plans) < count:
        n = int(rng.choice([2, 4, 8]))
        kind = rng.random(int(rng.integers(1, max_docs + 1)))
        lens = np.where(kind < 0.2, 0, np.where(kind < 0.4, 1, rng.integers(2, 300, kind.size)))
        if lens.sum() == 0:
            continue
        total = int(lens.sum())
        pad = (-total) % (2 * n) + 2 * n * int(rng.integers(0, 3))
        plans.append(make_plan_for(method, lens.tolist(), n, num_pad=pad))
    return plans


@pytest.mark.parametrize("method", METHODS)
def test_allgather_index_equals_the_token_level_reference(method):
    """Every rank of 25 random plans (and of their head-parallel group plans), sent shards only
    and every row: the same send_max, send_rows and kv_index, int64."""
    checked = 0
    for plan in _random_plans(method, 25, seed=sum(map(ord, method))):
        for p in {id(plan): plan, id(g := plan.group_plan()): g}.values():
            assert tiles_documents(p)
            for rank in range(p.cp_size):
                for aware in (True, False):
                    fast = allgather_index(p, rank, aware)
                    ref = allgather_index_reference(p, rank, aware)
                    assert fast[0] == ref[0]
                    for a, b in zip(fast[1:], ref[1:], strict=True):
                        assert a.dtype == b.dtype == np.int64 and np.array_equal(a, b)
                    checked += 1
    assert checked >= 25 * 2 * 2


def test_allgather_meta_of_the_fast_path_runs_the_same_keys():
    """build_allgather_meta (fast path) against the reference arrays on a batch with pad, a
    1-token and a zero-length document."""
    plan = make_plan_for("flashcp", [16, 0, 16, 1, 24, 0], 4, num_pad=7 + 8)
    for rank in range(4):
        meta = build_allgather_meta(plan, rank, "flashcp", sharding_aware=True)
        send_max, send_rows, kv_index = allgather_index_reference(plan, rank, True)
        assert meta.send_max == send_max
        assert torch.equal(meta.send_rows, torch.from_numpy(send_rows))
        assert torch.equal(meta.kv_index, torch.from_numpy(kv_index))


def test_a_plan_whose_shards_do_not_tile_falls_back_to_the_reference():
    """Shards that overlap (token 2 of document 0 held twice) or leave a gap: no shard-level
    index, so build_allgather_meta runs the token-level reference."""
    lens = np.array([4, 4])
    overlap = make_plan(
        "llama3", 2, lens, np.array([0, 1, 1]), np.array([0, 0, 1]), np.array([0, 2, 0]),
        np.array([3, 2, 4]), validate=False,
    )  # fmt: skip
    gap = make_plan(
        "llama3", 2, lens, np.array([0, 1]), np.array([0, 1]), np.array([0, 0]),
        np.array([3, 4]), validate=False,
    )  # fmt: skip
    good = make_plan_for("llama3", lens.tolist(), 2)
    assert tiles_documents(good) and allgather_index(good, 0, False) is not None
    for plan in (overlap, gap):
        assert not tiles_documents(plan) and allgather_index(plan, 0, False) is None


def test_ranges_and_ring_rows_equal_the_concatenated_aranges():
    rng = np.random.default_rng(0)
    for _ in range(200):
        begin = rng.integers(0, 1000, int(rng.integers(1, 8)))
        length = rng.integers(0, 50, begin.size)
        want = torch.cat(
            [torch.arange(b, b + n, dtype=torch.int64) for b, n in zip(begin, length, strict=True)]
        )
        assert torch.equal(torch.from_numpy(ranges(begin, length)), want)
        rows = _rows(begin, begin + length)
        if isinstance(rows, slice):
            assert torch.equal(torch.arange(rows.start, rows.stop), want)
        else:
            assert rows.dtype == torch.int64 and torch.equal(rows, want)


def _same_call(a, b) -> bool:
    def same(x, y):
        if isinstance(x, slice) or isinstance(y, slice):
            return x == y
        return x.dtype == y.dtype and torch.equal(x, y)

    return (
        (a.causal, a.max_seqlen_q, a.max_seqlen_k, a.pairs)
        == (b.causal, b.max_seqlen_q, b.max_seqlen_k, b.pairs)
        and all(same(getattr(a, f), getattr(b, f)) for f in ("q_rows", "k_rows"))
        and all(same(getattr(a, f), getattr(b, f)) for f in ("cu_seqlens_q", "cu_seqlens_k"))
    )


@pytest.mark.parametrize("mode", ["0", "1"])
@pytest.mark.parametrize("method", METHODS)
def test_ring_steps_equal_the_shard_by_shard_reference(method, mode, monkeypatch):
    """Every ring step's kernel calls of every rank of 25 random plans, 5 of them with up to 60
    documents (any layout runs the ring, and the hybrids' group plans): the same calls, rows,
    segments and pairs, from the NumPy arrays (``FLASHCP_COMPILED=0``) and from the compiled
    kernel (``1``; skipped without numba)."""
    monkeypatch.setenv("FLASHCP_COMPILED", mode)
    if mode == "1" and compiled.load("ring") is None:
        pytest.skip("numba is not installed")
    assert (compiled.load("ring") is None) == (mode == "0")
    checked = 0
    plans = _random_plans(method, 20, seed=2 + sum(map(ord, method)))
    plans += _random_plans(method, 5, seed=3 + sum(map(ord, method)), max_docs=60)
    for plan in plans:
        for p in {id(plan): plan, id(g := plan.group_plan()): g}.values():
            for rank in range(p.cp_size):
                got = prepare_ring_meta(p, rank, p.method).steps
                want = ring_steps_reference(p, rank)
                assert len(got) == len(want) == p.cp_size
                for s, (a, b) in enumerate(zip(got, want, strict=True)):
                    assert len(a) == len(b), (rank, s)
                    assert all(_same_call(x, y) for x, y in zip(a, b, strict=True)), (rank, s)
                checked += 1
    assert checked >= 25 * 2


@pytest.mark.parametrize("method", ["ring", "zigzag", "usp", "flashcp"])
def test_ring_kernel_writes_the_numpy_arrays(method, monkeypatch):
    """The compiled kernel's table, rows and cu_seqlens equal its NumPy twin's, bit for bit and
    dtype for dtype, on every rank of 10 random plans (zero-length, 1-token docs and pad)."""
    monkeypatch.setenv("FLASHCP_COMPILED", "1")
    kernels = compiled.load("ring")
    if kernels is None:
        pytest.skip("numba is not installed")
    for plan in _random_plans(method, 10, seed=4 + sum(map(ord, method)), max_docs=30):
        n, bounds = plan.cp_size, plan.rank_offsets
        first = cu_seqlens(plan.length)[:-1]
        cols = (plan.doc, plan.start, plan.length, first - first[bounds[plan.rank]])
        shards = [tuple(c[bounds[r] : bounds[r + 1]] for c in cols) for r in range(n)]
        for rank in range(n):
            blocks = [shards[(rank - s) % n] for s in range(n)]
            want = ring_calls(ring_segments(shards[rank], blocks))
            got = kernels.ring_calls(*cols, bounds, rank)
            for a, b in zip(got, want, strict=True):
                assert a.dtype == b.dtype == np.int64 and np.array_equal(a, b)
            assert want[0].shape[0] == len(RING_CALL_FIELDS)


@pytest.mark.parametrize("method", METHODS)
def test_rank_labels_are_the_shard_of_the_shifted_batch(method):
    """shard_batch shifts only its rank's rows: the same labels as shifting the whole batch and
    sharding it, on 10 random plans (every rank)."""
    for plan in _random_plans(method, 10, seed=1 + sum(map(ord, method))):
        lens = plan.doc_lens.tolist()
        ids = torch.randperm(plan.context_len, generator=torch.Generator().manual_seed(0)) + 5
        want = shift_labels(ids, lens)
        for rank in range(plan.cp_size):
            got = shard_batch(ids, lens, plan, rank).labels
            assert got.dtype == torch.int64 and torch.equal(got, shard_tensor(want, plan, rank))


def test_ring_steps_with_several_calls_per_step():
    """A query shard whose keys lie in two separate ranges of a block (document 0's chunks 0 and
    2 on rank 0, document 1 between them) needs two calls of one flag: the first fit the array
    code reproduces, on both ranks and steps."""
    plan = make_plan(
        "ring", 2, np.array([8, 2, 2]), np.array([0, 0, 0, 1, 1, 1]), np.array([0, 1, 0, 0, 0, 2]),
        np.array([0, 0, 4, 2, 6, 0]), np.array([2, 2, 2, 2, 2, 2]),
    )  # fmt: skip
    calls = 0
    for rank in range(2):
        got, want = prepare_ring_meta(plan, rank, "ring").steps, ring_steps_reference(plan, rank)
        for a, b in zip(got, want, strict=True):
            assert len(a) == len(b) and all(_same_call(x, y) for x, y in zip(a, b, strict=True))
        calls = max(calls, *(len(s) for s in want))
    assert calls >= 2
    assert [c.causal for c in ring_steps_reference(plan, 1)[1]] == [False, False]


def test_ring_steps_fuse_causal_segments_of_adjacent_shards():
    """Chunks 0 and 2 of a document side by side on rank 0: at step 0 chunk 2's keys are chunk 0
    and itself, so both causal segments fuse into one (rows 0-4 against keys 0-4), as _fuse does."""
    plan = make_plan(
        "ring", 2, np.array([6, 2]), np.array([0, 0, 1, 1]), np.array([0, 0, 0, 1]),
        np.array([0, 4, 2, 0]), np.array([2, 2, 2, 2]),
    )  # fmt: skip
    want = ring_steps_reference(plan, 0)
    got = prepare_ring_meta(plan, 0, "ring").steps
    assert [(c.causal, c.q_rows, c.k_rows) for c in want[0]] == [(True, slice(0, 4), slice(0, 4))]
    for a, b in zip(got, want, strict=True):
        assert len(a) == len(b) and all(_same_call(x, y) for x, y in zip(a, b, strict=True))
