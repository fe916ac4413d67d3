"""Property and hand-checked tests of every planner in the registry.

Every check here is recomputed independently of :mod:`flashcp.plan`'s own metrics: a token-level
owner array (which rank holds each of the C tokens of the packed sequence) is built from the
shards, and coverage, tokens, workload (a count of visible (query, key) pairs) and communication
(Eq. 5) are derived from it. Hand-checked layouts are written out from docs/design.md §3.
"""

from __future__ import annotations

import inspect
import itertools
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashcp.plan import Shard, check_cp_args, check_doc_lens, make_plan
from flashcp.registry import FAST_METHODS as METHODS
from flashcp.registry import get_planner, make_plan_for

PER_DOC_LAYOUTS = ("per_doc", "zigzag")
PROPERTY_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def takes_target(method: str) -> bool:
    """Whether the method's planner has a ``target_imbalance`` option (flashcp and its variants)."""
    return "target_imbalance" in inspect.signature(get_planner(method)).parameters


# ---- independent recomputation from a token-level owner array ---------------------------------


def owner_array(plan) -> np.ndarray:
    """(C,) int64: the rank holding each token of the packed sequence.

    Asserts that every token is held exactly once and that no shard leaves its document.
    """
    doc_lens = plan.doc_lens
    cu = np.concatenate([[0], np.cumsum(doc_lens)])
    count = np.zeros(plan.context_len, dtype=np.int64)
    owner = np.full(plan.context_len, -1, dtype=np.int64)
    for r, shards in enumerate(plan.ranks()):
        for doc, start, length in shards:
            assert length >= 1
            assert 0 <= start and start + length <= doc_lens[doc], (doc, start, length)
            lo = cu[doc] + start
            count[lo : lo + length] += 1
            owner[lo : lo + length] = r
    held = np.flatnonzero(count != 1)
    assert held.size == 0, f"token {held[0]} held {count[held[0]]} times"
    return owner


def in_doc_position(doc_lens: np.ndarray) -> np.ndarray:
    """(C,) int64: each token's index inside its document (= its number of earlier same-doc keys)."""
    cu = np.concatenate([[0], np.cumsum(doc_lens)])
    doc_of_token = np.repeat(np.arange(doc_lens.size), doc_lens)
    return np.arange(int(cu[-1])) - cu[doc_of_token]


def brute_force_workload(owner: np.ndarray, doc_lens: np.ndarray, cp_size: int) -> np.ndarray:
    """(N,) int64: visible (query, key) pairs per rank under the document mask.

    A query at position j of its document sees keys 0..j of that document: j + 1 pairs.
    """
    pairs = in_doc_position(doc_lens) + 1
    return np.bincount(owner, weights=pairs, minlength=cp_size).astype(np.int64)


def mask_workload(owner: np.ndarray, doc_lens: np.ndarray, cp_size: int) -> np.ndarray:
    """The same count from an explicit (C, C) document-causal mask (small C only)."""
    doc_of_token = np.repeat(np.arange(doc_lens.size), doc_lens)
    c = owner.size
    mask = (doc_of_token[:, None] == doc_of_token[None, :]) & np.tri(c, dtype=bool)
    return np.bincount(owner, weights=mask.sum(axis=1), minlength=cp_size).astype(np.int64)


def eq5_from_shards(plan) -> int:
    """Eq. 5 from the readable shard lists: (N - 1) * max_j (tokens of rank j's non-last shards)."""
    send = [
        sum(s.length for s in shards if s.start + s.length != plan.doc_lens[s.doc])
        for shards in plan.ranks()
    ]
    return (plan.cp_size - 1) * max(send)


def eq5_from_owner(owner: np.ndarray, doc_lens: np.ndarray, cp_size: int) -> int:
    """Eq. 5 at token level: a token is in its document's last shard when it and every later
    token of its document are held by the same rank; all other tokens are sent."""
    cu = np.concatenate([[0], np.cumsum(doc_lens)])
    in_last = np.zeros(owner.size, dtype=bool)
    for i in range(doc_lens.size):
        seg = owner[cu[i] : cu[i + 1]]
        # length of the run of equal owners at the end of the document
        differs = np.flatnonzero(seg != seg[-1])
        run_start = differs[-1] + 1 if differs.size else 0
        in_last[cu[i] + run_start : cu[i + 1]] = True
    send = np.bincount(owner, weights=~in_last, minlength=cp_size)
    return int((cp_size - 1) * send.max())


def computed_by(plan, held: np.ndarray) -> np.ndarray:
    """Work each rank computes from the work of the tokens it holds: in a head-parallel plan
    (``ulysses_degree`` u > 1) a group's u ranks share the group's work, 1/u of the heads each."""
    u = plan.ulysses_degree
    return np.repeat(held.reshape(-1, u).mean(axis=1), u) if u > 1 else held


def check_plan(plan, doc_lens, cp_size: int) -> np.ndarray:
    """All method-independent invariants of a plan; returns its owner array."""
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    plan.validate()
    assert plan.cp_size == cp_size
    np.testing.assert_array_equal(plan.doc_lens, doc_lens)
    c = int(doc_lens.sum())
    assert plan.context_len == c
    owner = owner_array(plan)
    tokens = np.bincount(owner, minlength=cp_size)
    assert (tokens == c // cp_size).all(), tokens
    np.testing.assert_array_equal(plan.tokens_per_rank, tokens)
    # workload: Eq. 3 per rank equals a brute-force count; the total is sum d(d+1)/2
    brute = computed_by(plan, brute_force_workload(owner, doc_lens, cp_size))
    np.testing.assert_allclose(plan.workload_per_rank, brute, rtol=1e-12)
    assert round(plan.workload_per_rank.sum()) == int((doc_lens * (doc_lens + 1) // 2).sum())
    assert plan.imbalance_ratio == pytest.approx(brute.max() / brute.mean(), rel=1e-12)
    # communication: Eq. 4 and Eq. 5
    assert plan.comm_tokens_full == (cp_size - 1) * c // cp_size
    assert plan.comm_tokens == eq5_from_shards(plan) == eq5_from_owner(owner, doc_lens, cp_size)
    assert plan.comm_tokens <= plan.comm_tokens_full
    if plan.split_docs.size == 0:
        assert plan.comm_tokens == 0
    # each rank holds no two adjacent pieces of a document unmerged
    for shards in plan.ranks():
        for a, b in itertools.pairwise(shards):
            assert not (a.doc == b.doc and a.start + a.length == b.start), (a, b)
    # to_dict agrees with the readable view
    d = plan.to_dict()
    assert [r["rank"] for r in d["ranks"]] == list(range(cp_size))
    for r, shards in enumerate(plan.ranks()):
        assert d["ranks"][r]["tokens"] == c // cp_size
        assert d["ranks"][r]["workload"] == int(brute[r])
        assert [Shard(**s) for s in d["ranks"][r]["shards"]] == shards
    return owner


# ---- strategies --------------------------------------------------------------------------------

doc_len = st.one_of(
    st.just(1),
    st.integers(1, 16),
    st.integers(1, 600),
    st.integers(1, 5000),
)


@st.composite
def sequences(draw, divisible_by_2n: bool = True):
    """(doc_lens, cp_size): a random mix of documents, the total made divisible by 2N (or N).

    The total is fixed up by appending one document of the missing length, so the mix keeps its
    drawn lengths; single-document sequences are drawn too.
    """
    cp_size = draw(st.integers(1, 8))
    unit = 2 * cp_size if divisible_by_2n else cp_size
    if draw(st.integers(0, 9)) == 0:  # a single document
        return [unit * draw(st.integers(1, 5000 // unit + 1))], cp_size
    lens = draw(st.lists(doc_len, min_size=1, max_size=40))
    if draw(st.booleans()):  # many length-1 documents
        lens += [1] * draw(st.integers(1, 300))
        lens = draw(st.permutations(lens))
    missing = -sum(lens) % unit
    if missing:
        lens.append(missing)
    return list(lens), cp_size


# ---- properties of every planner ---------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@PROPERTY_SETTINGS
@given(seq=sequences())
def test_planner_invariants(method, seq):
    doc_lens, cp_size = seq
    plan = make_plan_for(method, doc_lens, cp_size)
    assert plan.method == method
    check_plan(plan, doc_lens, cp_size)


@pytest.mark.parametrize("method", [m for m in METHODS if m != "llama3"])
@PROPERTY_SETTINGS
@given(seq=sequences(divisible_by_2n=False))
def test_planner_invariants_context_divisible_by_n(method, seq):
    """Layouts that only need C divisible by N (all but llama3) work with odd C/N."""
    doc_lens, cp_size = seq
    check_plan(make_plan_for(method, doc_lens, cp_size), doc_lens, cp_size)


def global_starts(plan) -> list[list[int]]:
    """For each rank, the packed-sequence position of each of its shards, in local order."""
    cu = np.concatenate([[0], np.cumsum(plan.doc_lens)]).tolist()
    return [[cu[s.doc] + s.start for s in shards] for shards in plan.ranks()]


@PROPERTY_SETTINGS
@given(seq=sequences())
def test_packed_layouts_match_their_definition(seq):
    """llama3: 2N equal chunks of the packed sequence, rank r holds chunks r and 2N-1-r; ring: N
    equal chunks, chunk r on rank r. Each rank holds its pieces in packed order."""
    doc_lens, cp_size = seq
    c, n = sum(doc_lens), cp_size
    chunk = np.arange(c) // (c // (2 * n))
    expected = np.where(chunk < n, chunk, 2 * n - 1 - chunk)
    plan = make_plan_for("llama3", doc_lens, cp_size)
    np.testing.assert_array_equal(owner_array(plan), expected)
    assert all(g == sorted(g) for g in global_starts(plan))
    plan = make_plan_for("ring", doc_lens, cp_size)
    np.testing.assert_array_equal(owner_array(plan), np.arange(c) // (c // n))
    assert all(g == sorted(g) for g in global_starts(plan))


@pytest.mark.parametrize("method", PER_DOC_LAYOUTS)
@PROPERTY_SETTINGS
@given(seq=sequences(divisible_by_2n=False))
def test_per_doc_layout_matches_its_definition(method, seq):
    """Every document in 2N contiguous chunks of d // 2N or d // 2N + 1 tokens (remainders
    spread), rank r holding chunks r and 2N-1-r; each rank holds its pieces in packed order."""
    doc_lens, n = seq
    plan = make_plan_for(method, doc_lens, n)
    owner = owner_array(plan)
    cu = np.concatenate([[0], np.cumsum(doc_lens)])
    for i, d in enumerate(doc_lens):
        seg = owner[cu[i] : cu[i + 1]].tolist()
        # collapse the document's owners into runs; they must visit ranks 0..N-1, N-1..0 in order
        runs = [(r, len(list(g))) for r, g in itertools.groupby(seg)]
        order = list(range(n)) + list(range(n - 1, -1, -1))
        visited = [r for r, _ in runs]
        it = iter(order)
        assert all(r in it for r in visited), (d, runs)  # a subsequence of the zigzag order
        # every chunk holds d // 2N or d // 2N + 1 tokens (the middle run is two chunks)
        for r, length in runs:
            chunks = 2 if r == n - 1 else 1
            assert chunks * (d // (2 * n)) <= length <= chunks * (d // (2 * n) + 1), (d, runs)
    assert all(g == sorted(g) for g in global_starts(plan))


@pytest.mark.parametrize("method", PER_DOC_LAYOUTS)
@PROPERTY_SETTINGS
@given(
    cp_size=st.integers(1, 8),
    multiples=st.lists(st.integers(1, 300), min_size=1, max_size=30),
)
def test_per_doc_balanced_when_lengths_divide(method, cp_size, multiples):
    """Every length a multiple of 2N: every rank gets the same chunks, imbalance exactly 1."""
    doc_lens = [2 * cp_size * m for m in multiples]
    plan = make_plan_for(method, doc_lens, cp_size)
    owner = check_plan(plan, doc_lens, cp_size)
    brute = brute_force_workload(owner, np.asarray(doc_lens), cp_size)
    assert (brute == brute[0]).all()
    assert plan.imbalance_ratio == 1.0
    # two shards of C/(2N) per document (one when rank N-1 holds the two middle chunks)
    expected = [1 if r == cp_size - 1 else 2 for r in range(cp_size)]
    assert plan.shards_per_rank.tolist() == [e * len(doc_lens) for e in expected]


@pytest.mark.parametrize("method", [m for m in METHODS if takes_target(m)])
@PROPERTY_SETTINGS
@given(seq=sequences(divisible_by_2n=False), target=st.floats(1.0, 1.6))
def test_flashcp_meets_target_when_ok(method, seq, target):
    doc_lens, cp_size = seq
    plan = make_plan_for(method, doc_lens, cp_size, target_imbalance=target)
    check_plan(plan, doc_lens, cp_size)
    assert plan.status in ("ok", "target_not_met")
    if plan.status == "ok":
        assert plan.imbalance_ratio <= target
    else:
        assert plan.imbalance_ratio > target
    # Per-Doc documents are cut into pieces on every rank that has tokens of them
    for doc in plan.info.get("per_doc_docs", []):
        assert doc in plan.split_docs or doc_lens[doc] == 1 or cp_size == 1


@pytest.mark.parametrize("method", [m for m in METHODS if takes_target(m)])
@PROPERTY_SETTINGS
@given(seq=sequences(divisible_by_2n=False))
def test_flashcp_target_on_the_boundary(method, seq):
    """A target equal to a ratio the planner reached is met again (no float round-off at the edge)."""
    doc_lens, cp_size = seq
    first = make_plan_for(method, doc_lens, cp_size, target_imbalance=1.0 + 1e-9)
    again = make_plan_for(method, doc_lens, cp_size, target_imbalance=first.imbalance_ratio)
    assert again.status == "ok"
    assert again.imbalance_ratio <= first.imbalance_ratio


@pytest.mark.parametrize("method", [m for m in METHODS if takes_target(m)])
@PROPERTY_SETTINGS
@given(cp_size=st.integers(1, 8), n_each=st.integers(1, 20), size=st.integers(1, 500))
def test_flashcp_equal_documents_stay_whole(method, cp_size, n_each, size):
    """N * k equal documents: k whole documents per rank is perfect, with no communication."""
    doc_lens = [size] * (cp_size * n_each)
    plan = make_plan_for(method, doc_lens, cp_size)
    check_plan(plan, doc_lens, cp_size)
    assert plan.status == "ok"
    assert plan.imbalance_ratio == 1.0
    assert plan.split_docs.size == 0
    assert plan.comm_tokens == 0
    assert plan.comm_saving == (1.0 if cp_size > 1 else 0.0)


@pytest.mark.parametrize("method", METHODS)
def test_thousands_of_length_one_documents(method):
    for cp_size in (1, 3, 8):
        doc_lens = [1] * (4096 * 3 if cp_size == 3 else 4096)
        plan = make_plan_for(method, doc_lens, cp_size)
        check_plan(plan, doc_lens, cp_size)
        assert plan.imbalance_ratio == 1.0  # every token costs exactly one pair
        assert plan.comm_tokens == 0  # no document is ever split


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cp_size", [1, 2, 5, 8])
def test_single_document(method, cp_size):
    doc_lens = [2 * cp_size * 37]
    check_plan(make_plan_for(method, doc_lens, cp_size), doc_lens, cp_size)


@pytest.mark.parametrize("method", METHODS)
def test_workload_matches_explicit_mask(method):
    """Eq. 3 per rank equals a count over an explicit (C, C) document-causal mask."""
    doc_lens = np.array([5, 1, 1, 17, 2, 9, 13], dtype=np.int64)  # C = 48
    for cp_size in (1, 2, 3, 4, 6):
        plan = make_plan_for(method, doc_lens, cp_size)
        owner = check_plan(plan, doc_lens, cp_size)
        np.testing.assert_allclose(
            plan.workload_per_rank, computed_by(plan, mask_workload(owner, doc_lens, cp_size))
        )


def test_cp_size_one_is_the_whole_sequence():
    for method in METHODS:
        plan = make_plan_for(method, [3, 5, 8], 1)
        assert plan.imbalance_ratio == 1.0
        assert plan.comm_tokens == plan.comm_tokens_full == 0
        assert plan.comm_saving == 0.0
        assert sorted(plan.ranks()[0]) == [Shard(0, 0, 3), Shard(1, 0, 5), Shard(2, 0, 8)]


# ---- hand-checked layouts (docs/design.md §3) ------------------------------------------------------


def S(*triples):
    return [Shard(*t) for t in triples]


def test_llama3_hand_checked():
    # C = 16, 2N = 4 chunks of 4 tokens: chunk 0 = doc 0; chunks 1..3 = doc 1 [0,4) [4,8) [8,12).
    # Rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (one contiguous shard).
    plan = make_plan_for("llama3", [4, 12], 2)
    assert plan.ranks() == [S((0, 0, 4), (1, 8, 4)), S((1, 0, 8))]
    # workload: 4*5/2 + (2*8+4+1)*4/2 = 10 + 42; 8*9/2 = 36
    assert plan.workload_per_rank.tolist() == [52, 36]
    assert plan.imbalance_ratio == pytest.approx(52 / 44)
    # Eq. 5: rank 1's [0,8) of doc 1 is not last -> (2-1) * 8
    assert plan.comm_tokens == 8 and plan.comm_tokens_full == 8
    # documents straddling chunk borders, N = 2: chunks [0,4) [4,8) [8,12) [12,16) of [3, 10, 3]
    plan = make_plan_for("llama3", [3, 10, 3], 2)
    assert plan.ranks() == [S((0, 0, 3), (1, 0, 1), (1, 9, 1), (2, 0, 3)), S((1, 1, 8))]
    # N = 3, 2N = 6 chunks of 2 tokens of [12]: rank r holds [2r, 2r+2) and [10-2r, 12-2r)
    plan = make_plan_for("llama3", [12], 3)
    assert plan.ranks() == [S((0, 0, 2), (0, 10, 2)), S((0, 2, 2), (0, 8, 2)), S((0, 4, 4))]


def test_per_doc_hand_checked():
    # every document in 2N = 4 chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1-2
    plan = make_plan_for("per_doc", [8, 8], 2)
    assert plan.ranks() == [
        S((0, 0, 2), (0, 6, 2), (1, 0, 2), (1, 6, 2)),
        S((0, 2, 4), (1, 2, 4)),
    ]
    # W(0,2) + W(6,2) = 3 + 15 per doc; W(2,4) = 18 per doc
    assert plan.workload_per_rank.tolist() == [36, 36]
    assert plan.comm_tokens == 8  # rank 0's chunk 0 of each doc, rank 1's chunks 1-2: max(4, 8)
    plan = make_plan_for("per_doc", [4, 12], 2)
    assert plan.ranks() == [S((0, 0, 1), (0, 3, 1), (1, 0, 3), (1, 9, 3)), S((0, 1, 2), (1, 3, 6))]


def test_per_doc_remainders_hand_checked():
    # [5, 11], N = 2 (flashcp.planners.layout.per_doc_chunk_sizes): doc 0 = 4 chunks of 1 plus 1 extra token
    # to rank 0 (its first extra: front chunk): sizes [2, 1, 1, 1]. Doc 1 = chunks of 2 plus 3
    # extra tokens, the round-robin cursor now at rank 1: ranks 1, 0, 1 -> rank 1 front and back,
    # rank 0 (its second single extra: back chunk): sizes [2, 3, 3, 3].
    plan = make_plan_for("per_doc", [5, 11], 2)
    assert plan.ranks() == [
        S((0, 0, 2), (0, 4, 1), (1, 0, 2), (1, 8, 3)),
        S((0, 2, 2), (1, 2, 6)),
    ]
    # documents shorter than 2N: one token each, round-robin over ranks
    plan = make_plan_for("per_doc", [1, 1, 1, 1], 2)
    assert plan.ranks() == [S((0, 0, 1), (2, 0, 1)), S((1, 0, 1), (3, 0, 1))]
    assert plan.comm_tokens == 0


def test_ring_hand_checked():
    plan = make_plan_for("ring", [4, 12], 2)
    assert plan.ranks() == [S((0, 0, 4), (1, 0, 4)), S((1, 4, 8))]
    assert plan.workload_per_rank.tolist() == [20, 68]
    assert plan.comm_tokens == 4  # Eq. 5 counts rank 0's head of doc 1
    # documents aligned with the N chunks stay whole: no sharding-aware communication
    plan = make_plan_for("ring", [8, 8], 2)
    assert plan.ranks() == [S((0, 0, 8)), S((1, 0, 8))]
    assert plan.split_docs.size == 0 and plan.comm_tokens == 0 and plan.comm_saving == 1.0
    plan = make_plan_for("ring", [2, 5, 2], 3)
    assert plan.ranks() == [S((0, 0, 2), (1, 0, 1)), S((1, 1, 3)), S((1, 4, 1), (2, 0, 2))]


def test_zigzag_is_the_per_doc_layout():
    for doc_lens, cp_size in (([4, 12], 2), ([5, 11], 2), ([3, 1, 7, 13], 4), ([9], 3)):
        zz = make_plan_for("zigzag", doc_lens, cp_size)
        pd = make_plan_for("per_doc", doc_lens, cp_size)
        assert zz.method == "zigzag"
        assert zz.ranks() == pd.ranks()
    plan = make_plan_for("zigzag", [8, 8], 2)
    assert plan.ranks() == [
        S((0, 0, 2), (0, 6, 2), (1, 0, 2), (1, 6, 2)),
        S((0, 2, 4), (1, 2, 4)),
    ]


def test_flashcp_hand_checked():
    # two equal documents: each stays whole on its own rank, perfectly balanced, no communication
    plan = make_plan_for("flashcp", [8, 8], 2)
    assert plan.ranks() == [S((0, 0, 8)), S((1, 0, 8))]
    assert plan.status == "ok" and plan.info["per_doc_docs"] == []
    assert plan.imbalance_ratio == 1.0 and plan.comm_tokens == 0

    # [12, 4], N = 2, C/N = 8, loose target: greedy puts doc 0 on rank 0 and doc 1 on rank 1; rank 0
    # has 4 tokens too many, so it moves the head [0, 4) of doc 0 to rank 1 and keeps the tail.
    plan = make_plan_for("flashcp", [12, 4], 2, target_imbalance=2.0)
    assert plan.ranks() == [S((0, 4, 8)), S((0, 0, 4), (1, 0, 4))]
    assert plan.workload_per_rank.tolist() == [68, 20]  # W(4, 8) = 68; W(0, 4) + 10 = 20
    assert plan.status == "ok" and plan.info["per_doc_docs"] == []
    assert plan.comm_tokens == 4 and plan.comm_saving == 0.5  # only the head is communicated

    # default target 1.05: 68/44 misses it, so doc 0 goes Per-Doc (chunks of 3: rank 0 holds
    # [0,3) and [9,12), rank 1 [3,9)); doc 1 whole on rank 0 (tie, lowest rank), which then
    # gives the head [0,2) of doc 1 to rank 1: workloads 39 + W(2,2) = 46 and 39 + W(0,2) = 42.
    plan = make_plan_for("flashcp", [12, 4], 2)
    assert plan.ranks() == [S((0, 0, 3), (0, 9, 3), (1, 2, 2)), S((0, 3, 6), (1, 0, 2))]
    assert plan.workload_per_rank.tolist() == [46, 42]
    assert plan.status == "ok" and plan.info["per_doc_docs"] == [0]
    assert plan.imbalance_ratio == pytest.approx(46 / 44)
    assert plan.comm_tokens == 8  # rank 1 sends [3,9) of doc 0 and [0,2) of doc 1

    # an unreachable target is reported, not hidden
    plan = make_plan_for("flashcp", [1, 3], 2, target_imbalance=1.0)
    assert plan.status == "target_not_met" and plan.imbalance_ratio > 1.0


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    ("doc_lens", "cp_size", "message"),
    [
        ([4, -4], 2, "doc_lens must be >= 0, got doc_lens[1] = -4"),
        ([4.5, 11.5], 2, "4.5"),
        ([4, float("nan")], 2, "nan"),
        (["4", "12"], 2, "dtype"),
        ("4,12", 2, "'4,12'"),
        ([[4, 12]], 2, "shape (1, 2)"),
        ([4, 12], 0, "cp_size must be >= 1, got 0"),
        ([4, 12], -3, "got -3"),
        ([4, 12], 2.0, "cp_size must be an integer, got 2.0"),
        ([4, 13], 2, "context_len = 17 is not divisible by cp_size = 2"),
        ([4, 13], 2, "num_pad = "),
        ([4, 12], 3, "context_len = 16 is not divisible by cp_size = 3"),
    ],
)
def test_bad_input_names_the_value(method, doc_lens, cp_size, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_plan_for(method, doc_lens, cp_size)


def test_llama3_needs_context_divisible_by_2n():
    with pytest.raises(
        ValueError, match=re.escape("context_len = 18 is not divisible by 2 * cp_size = 4")
    ):
        make_plan_for("llama3", [6, 12], 2)
    for method in ("per_doc", "ring", "zigzag", "flashcp"):
        make_plan_for(method, [6, 12], 2).validate()  # C divisible by N is enough


@pytest.mark.parametrize("method", [m for m in METHODS if takes_target(m)])
@pytest.mark.parametrize("target", [0.99, 0.0, -1.0, float("nan"), float("inf")])
def test_bad_target_imbalance(method, target):
    with pytest.raises(ValueError, match="target_imbalance"):
        make_plan_for(method, [4, 12], 2, target_imbalance=target)


def test_unknown_method():
    with pytest.raises(ValueError, match=re.escape("unknown method 'striped'")):
        get_planner("striped")
    with pytest.raises(ValueError, match="unknown method"):
        make_plan_for("", [4, 12], 2)


def test_check_helpers_name_the_value():
    with pytest.raises(ValueError, match=re.escape("doc_lens sum to 16 but context_len = 32")):
        check_doc_lens([4, 12], context_len=32)
    np.testing.assert_array_equal(check_doc_lens([4, 12], context_len=16), [4, 12])
    np.testing.assert_array_equal(check_doc_lens(np.array([4.0, 12.0])), [4, 12])
    with pytest.raises(ValueError, match=re.escape("cp_size = 5")):
        check_cp_args(16, 5)
    check_cp_args(16, 8)
    with pytest.raises(ValueError, match=re.escape("2 * cp_size = 16")):
        check_cp_args(24, 8, chunks_per_rank=2)


def test_make_plan_rejects_broken_layouts():
    doc_lens = [4, 4]
    with pytest.raises(ValueError, match="held twice"):  # token 2 of doc 0 on both ranks
        make_plan("x", 2, doc_lens, [0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 2, 0], [3, 1, 2, 3])
    with pytest.raises(ValueError, match=re.escape("got [3, 5]")):  # unequal tokens
        make_plan("x", 2, doc_lens, [0, 1, 1], [0, 0, 1], [0, 3, 0], [3, 1, 4])
    with pytest.raises(ValueError, match="outside its document"):
        make_plan("x", 2, doc_lens, [0, 1], [0, 1], [0, 0], [4, 5])
    plan = make_plan("x", 2, doc_lens, [1, 0], [1, 0], [0, 0], [4, 4])  # rows sorted by rank
    assert plan.ranks() == [S((0, 0, 4)), S((1, 0, 4))]
    assert plan.comm_tokens == 0
