"""The compiled planners and plan kernels (numba, :mod:`flashcp.compiled`) against their readable
references: identical plans (digest, status, info, metrics) on sampled and adversarial inputs.

* ``flashcp``: the compiled Algorithm 1 (:mod:`flashcp.planners.flashcp.compiled`) against
  :func:`flashcp.planners.flashcp.plan_flashcp_reference` (the paper's heuristic in plain Python) on
  10,000+ sequences sampled from the three datasets at 4K-128K, CP 2-16, several targets, and on
  adversarial inputs; ``flashcp_refined`` (:mod:`flashcp.planners.flashcp_refined.compiled`) against
  :func:`flashcp.planners.flashcp_refined.plan_flashcp_refined_reference` likewise on 2,010 sequences (2K-128K).
* every planner: the plan built with every kernel (layouts, ``make_plan``'s merge, the checks,
  the per-rank sums) against the one built with none (NumPy, as without numba).
* the baselines' fused kernels (one call: checks, layout, merge, validation, sums, metrics;
  :func:`flashcp.plan.fused_plan`) against the reference on 2,700 sampled sequences (CP 2-16,
  pad), and bad input: the same errors.
* ``Plan.validate``: the compiled check rejects every broken plan the NumPy one rejects.
* without numba (the GPU image, ``tests/device_image``) the planners fall back to the same plans.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flashcp import compiled
from flashcp.data import load_distribution, sample_sequences
from flashcp.plan import Plan, make_plan
from flashcp.planners.flashcp import plan_flashcp, plan_flashcp_reference
from flashcp.planners.flashcp_refined import plan_flashcp_refined, plan_flashcp_refined_reference
from flashcp.registry import FAST_METHODS, get_planner

pytestmark = pytest.mark.skipif(not compiled.enabled(), reason="numba is not installed")


@pytest.fixture(autouse=True)
def _kernels_from_the_first_call(monkeypatch):
    """The kernels from the first call (not after the warm-up of ``FLASHCP_COMPILED=auto``)."""
    monkeypatch.setenv("FLASHCP_COMPILED", "1")


REPO = Path(__file__).resolve().parents[2]
DATASETS = ("wlb_llm", "pile", "redpajama")
#: (context length, sequences per dataset): 10,050 sequences, most of them short (the reference
#: costs about a millisecond per 128K sequence at CP 8, the compiled planner ~1/20 of that)
SIZES = ((4096, 2000), (8192, 800), (16384, 400), (32768, 100), (65536, 25), (131072, 25))
#: the same for flashcp_refined, whose reference (up to 16 packing passes in Python and the
#: reference Algorithm 1) is ~10x slower: 2,010 sequences, to keep the test within its budget
SIZES_REFINED = ((2048, 400), (4096, 150), (8192, 80), (32768, 25), (131072, 15))
CP_SIZES = (2, 3, 4, 6, 8, 12, 16)
TARGETS = (1.0, 1.02, 1.05, 1.1, 1.3)


def key(plan: Plan, summary: bool = True) -> tuple:
    """What two implementations must agree on (the summary derives from the rest)."""
    out = plan.digest(), plan.status, json.dumps(plan.info, sort_keys=True)
    return (*out, plan.summary()) if summary else out


def adversarial() -> list[tuple[np.ndarray, int, int]]:
    """``(doc_lens, cp_size, num_pad)``: one huge document, all tiny ones, documents shorter than
    2N, zero-length documents, pad, and mixtures."""
    rng = np.random.default_rng(5)
    cases = []
    for n in (1, 2, 3, 4, 8, 16):
        c = 64 * n
        cases += [
            (np.array([c]), n, 0),  # one document
            (np.ones(c, np.int64), n, 0),  # all tiny
            (np.array([c - n, *[1] * n]), n, 0),  # one huge, a few tiny
            (np.array([0, c // 2, 0, 0, c // 2, 0]), n, 0),  # zero-length documents
            (np.array([c - 3 * n + 1, 1, 2]), n, 3 * n - 4 if n > 1 else 0),  # pad
            (np.array([2 * n - 1] * 4 + [c - 4 * (2 * n - 1)]), n, 0),  # shorter than 2N
            (np.array([0] * 3), n, n),  # only pad
        ]
        for _ in range(20):
            k = int(rng.integers(1, 40))
            lens = rng.integers(0, 3 * c // k + 2, k)
            pad = int(-lens.sum() % n) + n * int(rng.integers(0, 3))
            cases.append((lens, n, pad))
    return cases


@pytest.mark.parametrize(
    ("fast_planner", "ref_planner", "sizes"),
    [
        (plan_flashcp, plan_flashcp_reference, SIZES),
        (plan_flashcp_refined, plan_flashcp_refined_reference, SIZES_REFINED),
    ],
    ids=["flashcp", "flashcp_refined"],
)
@pytest.mark.slow  # the adversarial-input property test below is the inner loop's check
def test_compiled_equals_reference_on_sampled_sequences(fast_planner, ref_planner, sizes):
    """10,050 (flashcp) / 2,010 (flashcp_refined) sampled sequences x (CP, target) drawn per
    sequence: identical plans."""
    rng = np.random.default_rng(17)
    checked = 0
    for context_len, count in sizes:
        for ds in DATASETS:
            dist = load_distribution(ds, context_len=context_len)
            for d in sample_sequences(dist, count, context_len, seed=context_len + len(ds)):
                n = int(rng.choice(CP_SIZES))
                target = float(rng.choice(TARGETS))
                pad = -int(d.sum()) % n
                fast = fast_planner(d, n, target_imbalance=target, num_pad=pad)
                ref = ref_planner(d, n, target_imbalance=target, num_pad=pad)
                assert key(fast, False) == key(ref, False), (ds, context_len, n, target, d.tolist())
                checked += 1
    assert checked == 3 * sum(count for _, count in sizes)


@pytest.mark.parametrize(
    ("fast_planner", "ref_planner"),
    [
        (plan_flashcp, plan_flashcp_reference),
        (plan_flashcp_refined, plan_flashcp_refined_reference),
    ],
    ids=["flashcp", "flashcp_refined"],
)
def test_compiled_equals_reference_on_adversarial_inputs(fast_planner, ref_planner):
    for d, n, pad in adversarial():
        for target in (1.0, 1.05, 2.0):
            fast = fast_planner(d, n, target_imbalance=target, num_pad=pad)
            ref = ref_planner(d, n, target_imbalance=target, num_pad=pad)
            assert key(fast) == key(ref), (d.tolist(), n, pad, target)
        fast = fast_planner(d, n, pad_to_multiple=True)
        assert key(fast) == key(ref_planner(d, n, pad_to_multiple=True))


@pytest.mark.slow
def test_compiled_flashcp_at_large_cp_size():
    """CP 128-1024: the compiled planner's piece buffers grow with the documents plus 2N (they
    were N^2 per rank, 75 GB at CP 1024, a MemoryError), and it keeps the reference's plans;
    few documents over many ranks cut the most."""
    cases = [
        (d, n)
        for ds in DATASETS
        for d in sample_sequences(load_distribution(ds, context_len=131072), 1, 131072, seed=9)
        for n in (512, 1024)
    ]
    cases += [(np.array([40000, 30000, 20000]), 512), (np.full(200, 5), 128)]
    for d, n in cases:
        pad = -int(d.sum()) % n
        fast = plan_flashcp(d, n, num_pad=pad)
        assert key(fast) == key(plan_flashcp_reference(d, n, num_pad=pad)), (d.size, n)


@pytest.mark.slow
def test_compiled_flashcp_refined_at_cp_64():
    """CP 32 and 64 (8 nodes of 8 GPUs, ``flashcp advise --cp-size 64``): the compiled packing
    pass, with its shortcuts past searches that cannot win, keeps the reference's plans on
    sampled 32K-128K sequences of every dataset and several targets."""
    checked = 0
    for context_len, n in ((32768, 32), (131072, 64)):
        for i, ds in enumerate(DATASETS):
            dist = load_distribution(ds, context_len=context_len)
            for d in sample_sequences(dist, 2, context_len, seed=11 + i):
                target = TARGETS[checked % len(TARGETS)]
                pad = -int(d.sum()) % n
                fast = plan_flashcp_refined(d, n, target_imbalance=target, num_pad=pad)
                ref = plan_flashcp_refined_reference(d, n, target_imbalance=target, num_pad=pad)
                assert key(fast, False) == key(ref, False), (ds, context_len, n, target)
                checked += 1
    assert checked == 12


def plan_all(method: str, cases) -> list[tuple]:
    planner = get_planner(method)
    return [key(planner(d, n, num_pad=pad, pad_to_multiple=True)) for d, n, pad in cases]


def mixed_cases() -> list[tuple[np.ndarray, int, int]]:
    cases = []
    for context_len, ds in ((16384, "pile"), (65536, "wlb_llm"), (131072, "redpajama")):
        seqs = sample_sequences(
            load_distribution(ds, context_len=context_len), 8, context_len, seed=3
        )
        for i, d in enumerate(seqs):
            n = CP_SIZES[i % len(CP_SIZES)]
            d = np.insert(d, 1, 0) if i % 3 == 0 else d
            cases.append((d, n, -int(d.sum()) % (2 * n)))
    return cases + adversarial()[::3]


@pytest.mark.parametrize("method", FAST_METHODS)
def test_every_planner_same_plans_without_kernels(method, monkeypatch):
    """Layout kernels, make_plan's merge, the checks and the per-rank sums: the plans (and their
    metrics) equal those built with NumPy alone, as on a machine without numba."""
    cases = mixed_cases()
    fast = plan_all(method, cases)
    monkeypatch.setattr(compiled, "load", lambda name: None)
    assert plan_all(method, cases) == fast


def test_make_plan_merges_as_numpy_does(monkeypatch):
    """Pieces out of rank order, out of (doc, start) order, empty, continuing each other."""
    rng = np.random.default_rng(2)
    cases = []
    for _ in range(300):
        k = int(rng.integers(0, 12))
        cases.append(
            (
                rng.integers(0, 3, k),
                rng.integers(0, 3, k),
                rng.integers(0, 4, k) * 2,
                rng.integers(0, 3, k),
            )
        )
    cases.append(([0, 0, 1, 0], [0, 0, 0, 0], [0, 2, 4, 4], [2, 2, 3, 1]))

    def build():
        out = []
        for r, d, s, ln in cases:
            p = make_plan("x", 3, np.array([20, 20, 20]), r, d, s, ln, validate=False)
            out.append((p.rank.tolist(), p.doc.tolist(), p.start.tolist(), p.length.tolist()))
        return out

    fast = build()
    monkeypatch.setattr(compiled, "load", lambda name: None)
    assert build() == fast


def broken_plans() -> list[Plan]:
    """Plans that each violate one invariant of Plan.validate."""
    good = plan_flashcp(np.array([700, 300, 20, 4]), 4)
    cols = dict(rank=good.rank, doc=good.doc, start=good.start, length=good.length)

    def with_(**change):
        c = {k: v.copy() for k, v in cols.items()}
        pad = change.pop("pad", good.pad)
        for k, (i, v) in change.items():
            c[k][i] = v
        return Plan("flashcp", 4, good.doc_lens, **c, pad=np.asarray(pad, np.int64))

    last = good.num_shards - 1
    return [
        with_(length=(0, 0)),
        with_(length=(0, int(good.length[0]) - 1)),
        with_(start=(last, int(good.start[last]) + 1)),
        with_(start=(0, -1)),
        with_(rank=(0, 4)),
        with_(rank=(last, 0)),
        with_(doc=(0, 9)),
        with_(doc=(0, -1)),
        with_(pad=[1, 0, 0, 0]),
        with_(pad=[-1, 0, 0, 1]),
        with_(pad=[0, 0, 0]),
        with_(pad=[1, 0, 0, 1]),
    ]  # fmt: skip


def _view(plan: Plan) -> tuple:
    """Everything a caller reads of a plan: key (digest, status, info, summary), the arrays with
    their dtypes, the per-rank sums, the pickled copy's key and the JSON view."""
    arrays = [(a.dtype.str, a.tolist()) for a in plan._columns()]
    sums = (
        plan.tokens_per_rank.tolist(), plan.workload_per_rank.tolist(),
        plan.send_tokens_per_rank.tolist(), plan.shards_per_rank.tolist(),
        plan.split_docs.tolist(), plan.context_len, plan.num_pad,
    )  # fmt: skip
    return key(plan), arrays, sums, key(pickle.loads(pickle.dumps(plan))), plan.to_dict()


def test_packed_plan_equals_make_plan():
    """``packed_plan`` (one compiled call: merge, validation, sums, metrics, digest bytes) builds
    the plan ``make_plan`` builds from the same columns: shards out of order, pieces continuing
    each other, pad, validation off; invalid columns raise make_plan's error."""
    from flashcp.plan import packed_plan

    rng = np.random.default_rng(11)
    checked = 0
    for d, n, pad in mixed_cases()[:300]:
        good = plan_flashcp(d, n, num_pad=pad, pad_to_multiple=True)
        cols = np.stack([good.rank, good.doc, good.start, good.length])
        order = rng.permutation(cols.shape[1])
        cut = cols[:, order].copy()  # out of order, one piece cut in two where possible
        if cut.shape[1] and cut[3, 0] > 1:
            head = cut[:, :1].copy()
            head[3, 0] = 1
            cut[2, 0] += 1
            cut[3, 0] -= 1
            cut = np.ascontiguousarray(np.concatenate([cut, head], axis=1))
        info = {"per_doc_docs": [0], "target_imbalance": 1.05}
        for validate in (True, False):
            args = ("flashcp", good.cp_size, good.doc_lens)
            packed = packed_plan(
                *args, cut, good.pad.copy(), status="s", info=info, validate=validate
            )
            made = make_plan(
                *args, *cut, pad=good.pad.copy(), status="s", info=info, validate=validate
            )
            assert _view(packed) == _view(made)  # (merge_pieces takes some orders, not all)
            checked += 1
        # the columns as the compiled Algorithm 1 gives them: the one-call path itself
        same = packed_plan(
            "flashcp", good.cp_size, good.doc_lens, cols, good.pad.copy(), status=good.status,
            info=good.info,
        )  # fmt: skip
        assert "_packed" in same.__dict__ and _view(same) == _view(good)
    assert checked == 2 * len(mixed_cases()[:300]) >= 100
    broken = broken_plans()
    for i, plan in enumerate(broken[:8]):  # column faults (the pad faults: pad of another size)
        cols = np.stack([plan.rank, plan.doc, plan.start, plan.length])
        with pytest.raises(ValueError) as packed_err:
            packed_plan("flashcp", 4, plan.doc_lens, cols, plan.pad)
        with pytest.raises(ValueError) as made_err:
            make_plan("flashcp", 4, plan.doc_lens, *cols, pad=plan.pad)
        assert str(packed_err.value) == str(made_err.value), i
    # a context too long for the exact integer metrics: the general path, the same plan
    d = np.array([1 << 26, 1 << 25, 4096], np.int64)
    long = plan_flashcp(d, 4, num_pad=-int(d.sum()) % 4)
    cols = np.stack([long.rank, long.doc, long.start, long.length])
    packed = packed_plan(
        "flashcp", 4, long.doc_lens, cols, long.pad, status=long.status, info=long.info
    )
    assert "_packed" not in packed.__dict__ and _view(packed) == _view(long)


def test_fused_flashcp_is_the_general_path(monkeypatch):
    """``plan_flashcp``'s one-call path (checks, Algorithm 1, merge, validation and metrics in
    one compiled call) gives the plan of the general path (``_plan``: Algorithm 1 compiled, then
    ``packed_plan``), and takes only the inputs it can: lists, zero-length documents, other
    options and non-numeric targets go the general way (and raise its errors)."""
    import flashcp.planners.flashcp as heuristic

    cases = mixed_cases()[:300]
    fused = [_view(plan_flashcp(d, n, num_pad=pad, pad_to_multiple=True)) for d, n, pad in cases]
    calls = []
    general = heuristic._plan

    def spy(*args, **kwargs):
        calls.append(args)
        return general(*args, **kwargs)

    monkeypatch.setattr(heuristic, "_plan", spy)
    # the lengths as a list: the same plan by the general path
    slow = [
        _view(plan_flashcp(d.tolist(), n, num_pad=pad, pad_to_multiple=True)) for d, n, pad in cases
    ]
    assert fused == slow
    assert len(calls) == sum(bool(d.any()) for d, _, _ in cases)  # all-empty: no planning
    calls.clear()
    d = np.array([4000, 100, 20, 4], np.int64)
    for target in (1.05, 1, 1.3):
        plan_flashcp(d, 4, target_imbalance=target, validate=False)
    assert calls == []  # every one fused
    plan_flashcp(d.tolist(), 4)
    plan_flashcp(np.array([4000, 0, 120, 4]), 4)
    plan_flashcp(d, 4, target_imbalance=np.float64(1.1))
    assert len(calls) == 3
    for bad in (0.99, float("nan"), float("inf"), "x", None, 10**400):
        with pytest.raises(ValueError, match="target_imbalance"):
            plan_flashcp(d, 4, target_imbalance=bad)


def test_plan_stats_equal_numpy_metrics(monkeypatch):
    """The exact integer metrics of ``plan_stats`` (any plan not made by a fused planner) equal
    the NumPy ones, within and beyond 2^26 tokens (beyond: the sums only, float maxima)."""
    cases = [(np.array(d), n) for d, n in [
        ([700, 300, 20, 4], 4), ([1 << 26, 1 << 25, 4096], 4), ([5, 0, 7, 4], 2), ([8], 8),
    ]]  # fmt: skip
    cases += [(d, n) for d, n, _ in mixed_cases()[:100]]
    plans = []
    for d, n in cases:
        d = np.append(d, -int(d.sum()) % n) if d.sum() % n else d
        plans.append(make_plan("x", n, d, *plan_flashcp(d, n)._columns()[1:5]))
    stats = [plans[1]._rank_sums.max_work is None, plans[0]._rank_sums.max_work is not None]
    fast = [_view(p) for p in plans]
    monkeypatch.setattr(compiled, "load", lambda name: None)
    slow = [_view(make_plan("x", p.cp_size, p.doc_lens, *p._columns()[1:5])) for p in plans]
    assert stats == [True, True] and fast == slow


def test_metrics_of_invalid_plans_equal_numpy(monkeypatch):
    """Plans built without validation that break an invariant (a pad of the wrong size, a shard
    out of its document or of range, a negative length): every metric the kernels give equals
    NumPy's, or both raise the same error."""

    def metrics(plan: Plan) -> list:
        out = []
        for name in ("tokens_per_rank", "workload_per_rank", "send_tokens_per_rank",
                     "shards_per_rank", "imbalance_ratio", "comm_tokens", "comm_tokens_full",
                     "num_split_docs", "max_shards_per_rank"):  # fmt: skip
            try:
                v = getattr(plan, name)
                out.append(v.tolist() if isinstance(v, np.ndarray) else v)
            except Exception as exc:  # the same error both ways
                out.append((type(exc).__name__, str(exc)))
        return out

    def fresh(plan: Plan) -> Plan:
        return Plan(plan.method, plan.cp_size, plan.doc_lens, *plan._columns()[1:5], pad=plan.pad)

    plans = broken_plans()
    big = plan_flashcp(np.array([700, 300, 20, 4]), 4)
    far = big.start.copy()
    far[0] = (1 << 26) + 5  # a shard beyond EXACT_TOKENS: the float sums, not the integers
    plans.append(Plan("flashcp", 4, big.doc_lens, big.rank, big.doc, far, big.length))
    fast = [metrics(fresh(p)) for p in plans]
    monkeypatch.setattr(compiled, "load", lambda name: None)
    assert [metrics(fresh(p)) for p in plans] == fast


def test_compiled_validate_rejects_every_broken_plan():
    assert compiled.load("plan").plan_ok(
        4, *plan_flashcp(np.array([700, 300, 20, 4]), 4)._columns()
    )
    for i, plan in enumerate(broken_plans()):
        with pytest.raises(ValueError):
            plan.validate()
        assert not compiled.load("plan").plan_ok(plan.cp_size, *plan._columns()), i


def test_auto_mode_warms_up_on_the_reference(monkeypatch):
    """``auto``: the first requests run the reference, later ones the kernels, same plans."""
    monkeypatch.setenv("FLASHCP_COMPILED", "auto")
    monkeypatch.setattr(compiled, "_REQUESTS", iter(range(10**9)))
    monkeypatch.setattr(
        compiled, "_CACHE", {"ready": False, "since_look": 0, "spawned": False, "skip": False}
    )
    assert compiled.marker().exists()  # the session's warm_up (conftest) marked the cache ready
    d = np.array([900, 300, 40, 8])
    first = [compiled.load("plan") for _ in range(compiled.WARMUP_CALLS)]
    assert first == [None] * compiled.WARMUP_CALLS
    assert compiled.load("plan") is not None
    monkeypatch.setenv("FLASHCP_COMPILED", "0")
    assert compiled.load("plan") is None and not compiled.enabled()
    assert key(plan_flashcp(d, 4)) == key(plan_flashcp_reference(d, 4))
    monkeypatch.setenv("FLASHCP_COMPILED", "sometimes")
    with pytest.raises(ValueError, match="FLASHCP_COMPILED"):
        compiled.load("plan")


def test_auto_mode_compiles_in_the_background_when_the_cache_is_cold(monkeypatch, tmp_path):
    """``auto`` with a cold cache: the references run, one background compile is started, the
    marker is looked for every RECHECK_CALLS requests, and the kernels load once it is there."""
    marker = tmp_path / "kernels-test.ready"
    spawned = []
    monkeypatch.setenv("FLASHCP_COMPILED", "auto")
    monkeypatch.setattr(compiled, "_REQUESTS", iter(range(compiled.WARMUP_CALLS, 10**9)))
    monkeypatch.setattr(
        compiled, "_CACHE", {"ready": False, "since_look": 0, "spawned": False, "skip": False}
    )
    monkeypatch.setattr(compiled, "marker", lambda: marker)
    monkeypatch.setattr(compiled, "_spawn_warm_up", spawned.append)
    assert [compiled.load("plan") for _ in range(compiled.RECHECK_CALLS)] == [None] * (
        compiled.RECHECK_CALLS
    )
    assert spawned == [marker]
    marker.touch()  # the background compile is done
    assert compiled.load("plan") is not None
    assert compiled.load("heuristic") is not None and spawned == [marker]


def test_preload_loads_the_kernels_once_for_a_big_job(monkeypatch, tmp_path):
    """``preload`` (a big sim job, before its workers fork): with a ready cache the kernels from
    the next request on, loaded once; off or with a cold cache nothing is loaded (the cold cache
    starts the background compile) and the warm-up requests stay."""
    from flashcp.compiled import warm as compile_cache

    monkeypatch.setenv("FLASHCP_COMPILED", "auto")
    monkeypatch.setattr(compiled, "_REQUESTS", iter(range(10**9)))
    monkeypatch.setattr(
        compiled, "_CACHE", {"ready": False, "since_look": 0, "spawned": False, "skip": False}
    )
    warmed = []
    monkeypatch.setattr(compile_cache, "warm_up", lambda **kw: warmed.append(kw) or 0.0)
    monkeypatch.setenv("FLASHCP_COMPILED", "0")
    assert not compile_cache.preload() and not warmed
    monkeypatch.setenv("FLASHCP_COMPILED", "auto")
    cold = tmp_path / "kernels-test.ready"
    spawned = []
    monkeypatch.setattr(compiled, "marker", lambda: cold)
    monkeypatch.setattr(compiled, "_spawn_warm_up", spawned.append)
    assert not compile_cache.preload() and not warmed and spawned == [cold]
    assert compiled.load("plan") is None  # still the warm-up requests
    cold.touch()  # the background compile is done
    assert compile_cache.preload() and warmed == [{"mark": False}]
    assert compiled.load("plan") is not None  # at once: no warm-up requests left to run
    assert compile_cache.preload() and len(warmed) == 1  # loaded once per process


def test_background_compile_takes_the_lock_once(monkeypatch, tmp_path):
    """A live lock means another process compiles: nothing is started; a stale one is replaced."""
    marker = tmp_path / "kernels-test.ready"
    started = []
    monkeypatch.setattr(compiled.subprocess, "Popen", lambda *a, **k: started.append(a[0]))
    lock = marker.with_suffix(".lock")
    lock.touch()
    assert not compiled._spawn_warm_up(marker) and not started
    old = lock.stat().st_mtime - compiled.LOCK_TIMEOUT_S - 1
    os.utime(lock, (old, old))
    assert compiled._spawn_warm_up(marker)
    assert started and started[0][1:3] == ["-c", compiled.WARM_UP_COMMAND] and lock.exists()


def test_background_compile_marks_the_cache_ready(tmp_path):
    """``python -c WARM_UP_COMMAND MARKER`` (what the background process runs:
    :func:`flashcp.compiled.warm.main`) loads or compiles
    every kernel, writes the marker and drops the lock."""
    marker = tmp_path / "kernels-test.ready"
    marker.with_suffix(".lock").touch()
    out = subprocess.run([sys.executable, "-c", compiled.WARM_UP_COMMAND, str(marker)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "kernels ready" in out.stdout
    assert marker.exists() and not marker.with_suffix(".lock").exists()


def test_planners_fall_back_without_numba():
    """On the GPU machine's image (no numba) the planners run the reference code: same plans."""
    cases = adversarial()[::7]
    code = (
        "import json, sys, numpy as np\n"
        "from flashcp import compiled\n"
        "from flashcp.registry import get_planner\n"
        "assert not compiled.enabled(), 'numba was importable'\n"
        "out = []\n"
        "for m, d, n, pad in json.load(sys.stdin):\n"
        "    p = get_planner(m)(np.array(d, dtype=np.int64), n, num_pad=pad, pad_to_multiple=True)\n"
        "    out.append([p.digest(), p.status, p.info])\n"
        "print(json.dumps(out))\n"
    )
    todo = [[m, d.tolist(), n, pad] for m in FAST_METHODS for d, n, pad in cases]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [str(REPO / "tests/device_image/as-device-image"), sys.executable, "-c", code],
        input=json.dumps(todo), capture_output=True, text=True, cwd=REPO, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    want = []
    for m, d, n, pad in todo:
        p = get_planner(m)(np.array(d, dtype=np.int64), n, num_pad=pad, pad_to_multiple=True)
        want.append([p.digest(), p.status, p.info])
    assert got == want


#: the baselines with a fused kernel (:func:`flashcp.plan.fused_plan`)
FUSED = ("llama3", "per_doc", "ring", "zigzag")


def full_key(plan: Plan) -> tuple:
    """Everything a plan holds and the metrics the benchmarks and sweeps read."""
    return (
        *key(plan),
        plan.method,
        plan.cp_size,
        [a.tolist() for a in plan._columns()],
        [a.dtype.str for a in plan._columns()],
        plan.imbalance_ratio,
        plan.comm_tokens,
        plan.comm_tokens_full,
        plan.comm_saving,
        *[
            (a.dtype.str, a.tolist())
            for a in (
                plan.workload_per_rank,
                plan.doc_tokens_per_rank,
                plan.send_tokens_per_rank,
                plan.shards_per_rank,
                plan.tokens_per_rank,
            )
        ],
        type(plan.imbalance_ratio),
        type(plan.comm_tokens),
        json.dumps(plan.to_dict(), sort_keys=True),
    )


@pytest.mark.slow
def test_fused_baselines_equal_reference_on_sampled_sequences(monkeypatch):
    """2,700 sampled sequences (three datasets, 2K-128K, CP 2-16, pad, pad_to_multiple, validate
    on and off) x the four baselines: the fused plan equals the reference's (NumPy, no kernel) in
    every array, the digest and every metric."""
    rng = np.random.default_rng(23)
    cases = []
    for context_len, count in ((2048, 400), (8192, 300), (32768, 150), (131072, 50)):
        for ds in DATASETS:
            dist = load_distribution(ds, context_len=context_len)
            for d in sample_sequences(dist, count, context_len, seed=context_len + 7):
                n = int(rng.integers(2, 17))
                kw = {"num_pad": int(rng.integers(0, 3 * n)), "pad_to_multiple": True}
                if rng.random() < 0.3:  # a pad that fits (no pad_to_multiple), or none
                    kw = {"num_pad": int(-d.sum() % (2 * n))} if rng.random() < 0.7 else {}
                if rng.random() < 0.2:
                    kw["validate"] = False
                cases.append((str(rng.choice(FUSED)), d, n, kw))
    fused, skipped = [], 0
    for method, d, n, kw in cases:
        try:
            plan = get_planner(method)(d, n, **kw)
        except ValueError:  # no pad and not divisible: compared below as an error
            fused.append(None)
            continue
        skipped += "_packed" not in plan.__dict__
        fused.append(full_key(plan))
    assert skipped == 0  # every plan came from a fused kernel
    monkeypatch.setattr(compiled, "load", lambda name: None)
    for (method, d, n, kw), want in zip(cases, fused, strict=True):
        if want is None:
            with pytest.raises(ValueError):
                get_planner(method)(d, n, **kw)
        else:
            assert full_key(get_planner(method)(d, n, **kw)) == want, (method, n, kw, d.tolist())
    assert len(cases) == 2700


def errors(method: str) -> list[str]:
    """The messages of the planner's errors on bad input."""
    bad = [
        (np.array([5, -1, 4]), 2, {}),
        (np.array([5, 3, 4]), 5, {}),
        (np.array([6, 6]), 0, {}),
        (np.array([6, 6]), 2, {"num_pad": -1}),
        (np.array([6, 6]), 2, {"num_pad": 1}),
        (np.array([6, 6]), 2, {"pad_to_multiple": 1}),
        (np.array([6, 6]), 2.0, {}),
        (np.array([6, 6]), True, {}),
        (np.array([[6, 6]]), 2, {}),
        (np.array([6.5, 6]), 2, {}),
        (np.array([7, 6]), 3, {"num_pad": 1, "validate": False}),
        (np.array([7, 6]), 4, {"num_pad": 1, "pad_to_multiple": False}),
    ]
    out = []
    for d, n, kw in bad:
        with pytest.raises(ValueError) as exc:
            get_planner(method)(d, n, **kw)
        out.append(str(exc.value))
    return out


@pytest.mark.parametrize("method", FUSED)
def test_fused_baselines_same_errors_and_edge_cases(method, monkeypatch):
    """Bad input raises the reference's ValueError (the fused path defers to it); zero-length
    documents, pad only and other dtypes give the reference's plans; a pickled or copied plan has
    the same digest and metrics."""
    edge = [
        (np.array([0, 9, 0, 7]), 4, {}),
        (np.zeros(3, np.int64), 4, {"num_pad": 8}),
        (np.array([], np.int64), 2, {"num_pad": 4}),
        (np.array([9, 7], np.int32), 4, {}),
        ([9, 7], 4, {}),
        (np.array([9, 7]), np.int64(4), {}),
        (np.array([1, 1, 1]), 1, {"num_pad": 1}),
        (np.array([3]), 16, {"pad_to_multiple": True}),
    ]
    got = [full_key(get_planner(method)(d, n, **kw)) for d, n, kw in edge]
    plan = get_planner(method)(np.array([900, 300, 41, 7]), 4, num_pad=8)
    assert "_packed" in plan.__dict__
    for copied in (pickle.loads(pickle.dumps(plan)), copy.deepcopy(plan)):
        assert "_packed" not in copied.__dict__ and full_key(copied) == full_key(plan)
    fast_errors = errors(method)
    monkeypatch.setattr(compiled, "load", lambda name: None)
    assert [full_key(get_planner(method)(d, n, **kw)) for d, n, kw in edge] == got
    assert errors(method) == fast_errors
