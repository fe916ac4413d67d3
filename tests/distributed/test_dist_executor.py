"""``executor=dist`` on gloo ranks: step schema, positive times, counted bytes; a rank failure
ends every rank within seconds; a failing sequence is a status row."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from mp_utils import RankError, run_ranks

from flashcp.comm import AttnShape, comm_volume
from flashcp.executors.dist import check_comm, init_from_env, measure_step
from flashcp.registry import COMM_KIND, make_plan_for
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS

LENS = [5, 40, 3, 60, 1, 19]  # C = 128


def _measure(rank, n, methods):
    group = init_from_env(30)  # already initialised by run_ranks: returns the world group
    shape = AttnShape(4, 2, 8, "float32")
    out = {}
    for m in methods:
        plan = make_plan_for(m, LENS, n)
        for mode in ("train", "infer"):
            out[m, mode] = measure_step(
                plan, shape, mode, group=group, backend="cpu", warmup=1, iters=2, seed=3
            )
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_measure_step(n):
    methods = ["llama3", "per_doc", "flashcp"]
    res = run_ranks(_measure, n, methods, timeout_s=120)
    shape = AttnShape(4, 2, 8, "float32")
    for m in methods:
        plan = make_plan_for(m, LENS, n)
        for mode in ("train", "infer"):
            row = res[0][m, mode]
            assert set(row) == set(PHASE_COLUMNS) | set(COMM_COLUMNS) | {"out_checksum"}
            assert all(res[r][m, mode] == row for r in range(n))  # max over ranks: identical
            assert row["total_ms"] > 0 and row["attn_fwd_ms"] > 0
            assert (row["attn_bwd_ms"] > 0) == (mode == "train")
            assert row["p2p_ms"] == 0.0
            assert {k: row[k] for k in COMM_COLUMNS} == comm_volume(plan, COMM_KIND[m], shape, mode)


def test_check_comm_mismatch():
    plan = make_plan_for("llama3", LENS, 2)
    shape = AttnShape(4, 2, 8, "float32")
    good = comm_volume(plan, "allgather_full", shape, "train")
    assert check_comm(good, plan, shape, "train") == good
    with pytest.raises(ValueError, match="counted bytes"):
        check_comm({**good, "allgather_bytes": 1}, plan, shape, "train")


def _outside_torchrun(results):
    import os

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    torch.set_num_threads(1)
    group = init_from_env(30)
    plan = make_plan_for("flashcp", LENS, 1)
    row = measure_step(
        plan,
        AttnShape(2, 2, 8, "bfloat16"),
        "train",
        group=group,
        device=torch.device("cpu"),
        backend="cpu",
        iters=1,
    )
    results.put(row)


def test_init_from_env_outside_torchrun():
    """Without torchrun's variables init_from_env starts a one-rank gloo group."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    results = ctx.Queue()
    proc = ctx.Process(target=_outside_torchrun, args=(results,), daemon=True)
    proc.start()
    try:
        row = results.get(timeout=60)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    assert row["comm_bytes"] == 0 and row["total_ms"] > 0 and row["attn_bwd_ms"] > 0


def _one_rank_raises(rank, n):
    import torch.distributed as dist

    from flashcp.executors.dist import abort_group_on_error

    dist.barrier()  # every rank's gloo mesh is up: rank 2 fails in the step, not during the setup
    t0 = time.monotonic()
    try:
        with abort_group_on_error(None, "step"):
            if rank == 2:
                raise RuntimeError("injected failure on rank 2")
            dist.all_reduce(torch.ones(4))  # the others wait here for rank 2
    finally:
        print(f"rank {rank} ended after {time.monotonic() - t0:.1f} s")


def test_a_rank_failure_ends_every_rank_within_seconds():
    """Rank 2 raises while ranks 0, 1, 3 wait in a collective whose timeout is 60 s: every rank
    ends by itself (none is killed by run_ranks), rank 2 with its own exception, the others with
    PeerFailure (not the collective's timeout)."""
    with pytest.raises(RankError) as info:
        run_ranks(_one_rank_raises, 4, timeout_s=60)
    msg = str(info.value)
    assert "did not report" not in msg  # every rank ended by itself, none was killed
    ranks = msg.split("--- rank ")[1:]
    assert len(ranks) == 4
    for text in ranks:
        if text.startswith("2 "):
            assert "injected failure on rank 2" in text and "PeerFailure" not in text
        else:
            assert "PeerFailure" in text and "another rank failed" in text


def _layout(rank: int, doc_lens, n: int):
    """The stand-in planner's per_doc plan on global rank ``rank``: the per_doc planner's on even
    ranks, the ring's contiguous chunks (another valid layout) on odd ones."""
    from flashcp.plan import make_plan
    from flashcp.registry import get_planner

    if rank % 2 == 0:
        return get_planner("per_doc")(doc_lens, n)
    ring = get_planner("ring")(doc_lens, n)
    return make_plan("per_doc", n, ring.doc_lens, ring.rank, ring.doc, ring.start, ring.length)


def _planned_once(rank, n, cp_groups, fail_on):
    """``execute`` on this process's CP group (one of ``cp_groups``) with a per_doc stand-in
    planner that counts its calls, gives odd global ranks another layout (a nondeterministic
    planner: ranks planning alone hold different plans) and raises for the second sequence on the
    global ranks ``fail_on``; plus ``plan_sequences`` with the executor's sharing directly, whose
    outcome every rank returns."""
    import torch.distributed as dist

    import flashcp.registry as registry
    from flashcp.comm import AttnShape
    from flashcp.executors import RunSpec, execute

    calls, get_planner = [], registry.get_planner

    def planner(doc_lens, cp_size, **options):
        calls.append(len(doc_lens))
        if rank in fail_on and len(doc_lens) == 2:  # the second sequence
            raise ValueError("planner rejects this sequence")
        registry.get_planner = get_planner  # the real planners inside _layout
        try:
            return _layout(rank, doc_lens, cp_size)
        finally:
            registry.get_planner = lambda name: planner

    registry.get_planner = lambda name: planner
    made = [dist.new_group(g) for g in cp_groups]
    group = next(g for g, ranks in zip(made, cp_groups, strict=True) if rank in ranks)
    spec = RunSpec(
        method="per_doc", cp_size=len(cp_groups[0]), shape=AttnShape(4, 2, 8, "float32"),
        modes=("infer",), executor={"backend": "cpu", "warmup": 0, "iters": 1, "timeout_s": 30},
    )  # fmt: skip
    seqs = [np.array(LENS), np.array([64, 64]), np.array([100, 20, 8])]
    rows = execute("dist", [spec], seqs, group=group)
    executed = len(calls)
    from flashcp.executors.dist import share_planning
    from flashcp.executors.rows import plan_sequences

    planned = plan_sequences(spec, seqs, share=lambda i, here: share_planning(here, group))
    return {
        "rows": None if rows is None else rows.to_dict("records"),
        "calls": executed,
        "errors": planned.errors,
        "digests": [p.digest() for p in planned.plans],
    }


@pytest.mark.parametrize(
    "cp_groups", [[[0, 1]], [[0, 1], [2, 3]], [[0, 2], [1, 3]]], ids=["world", "halves", "strided"]
)
def test_one_rank_per_cp_group_plans_and_every_rank_runs_its_plan(cp_groups):
    """Odd global ranks' planner gives another layout: ranks planning alone would hold different
    plans and the op's plan check would end the run. Each CP group plans each sequence once (on
    its rank 0, ``calls``) and every rank runs that plan; the planner raising on a group's rank 0
    is an error row on every rank and the next sequence runs."""
    world = sum(len(g) for g in cp_groups)
    firsts = [g[0] for g in cp_groups]
    res = run_ranks(_planned_once, world, cp_groups, firsts, timeout_s=120)
    digests = {}
    for ranks in cp_groups:
        rows = res[ranks[0]]["rows"]
        assert [r["seq_idx"] for r in rows] == [0, 1, 2]
        assert [r["status"] for r in rows] == [
            "ok", "error: ValueError: planner rejects this sequence", "ok"
        ]  # fmt: skip
        assert rows[2]["total_ms"] > 0 and rows[0]["plan_ms"] > 0
        for r in ranks:
            assert res[r]["calls"] == (3 if r == ranks[0] else 0), (r, res[r]["calls"])
            assert res[r]["errors"] == {1: "error: ValueError: planner rejects this sequence"}
            assert res[r]["rows"] is None or r == ranks[0]
            digests[r] = res[r]["digests"]
        # one plan per sequence in the group: its rank 0's layout
        want = [_layout(ranks[0], np.array(d), len(ranks)).digest() for d in (LENS, [100, 20, 8])]
        assert all(digests[r] == want for r in ranks), (ranks, digests, want)


def _rank_one_fails(rank, n):
    """Only rank 1's planner raises: rank 1 plans nothing, so every row is ok."""
    return _planned_once(rank, n, [[0, 1]], [1])


def test_a_planner_that_raises_off_the_planning_rank_is_never_called():
    res = run_ranks(_rank_one_fails, 2, timeout_s=120)
    assert [r["status"] for r in res[0]["rows"]] == ["ok", "ok", "ok"]
    assert res[1]["calls"] == 0 and res[1]["errors"] == {}


# ---- NCCL's case on gloo: a peer's abort does not end this rank's wait ------------------------------


def _nccl_like_failure(rank, n):
    """``execute`` where rank 2's step raises while the others wait in a stand-in for an NCCL
    collective: it ends only when *this* rank's communicator is aborted (a peer's abort does not
    reach a spinning NCCL kernel), then the rank's next collective fails."""
    import threading

    import torch.distributed as dist

    import flashcp.executors.dist as d
    from flashcp.comm import AttnShape
    from flashcp.executors import RunSpec

    aborted, real_abort = threading.Event(), d.abort_group

    def abort_group(group=None):  # this rank's communicator is aborted: its kernels end
        aborted.set()
        real_abort(group)

    def measure_step(plan, shape, mode, **kwargs):
        if rank == 2:
            raise RuntimeError("injected failure on rank 2")
        if not aborted.wait(30):  # the kernel spins until this rank aborts its communicator
            raise TimeoutError("still waiting after 30 s")
        dist.all_reduce(torch.ones(1))  # the next collective, on the aborted group

    d.abort_group, d.measure_step = abort_group, measure_step
    spec = RunSpec(method="per_doc", cp_size=n, shape=AttnShape(4, 2, 8, "float32"),
                   modes=("infer",), executor={"backend": "cpu"})  # fmt: skip
    t0 = time.monotonic()
    try:
        d.execute([spec], [np.array(LENS)])
    finally:
        print(f"rank {rank} ended after {time.monotonic() - t0:.1f} s")


def test_nccl_like_wait_ends_within_seconds_with_the_failing_ranks_error():
    # no wall-clock bound: a peer the abort did not wake raises "still waiting after 30 s"
    # instead of carrying rank 2's error, which the checks below catch
    with pytest.raises(RankError) as info:
        run_ranks(_nccl_like_failure, 4, timeout_s=60)
    ranks = str(info.value).split("--- rank ")[1:]
    assert len(ranks) == 4, str(info.value)  # every rank reported by itself, none was killed
    for text in ranks:
        assert "injected failure on rank 2" in text  # the peers carry rank 2's error
        assert ("PeerFailure" in text) == (not text.startswith("2 ")), text


def _fork_ranks(fn, n: int, timeout_s: float = 30.0):
    """Fork ``n`` gloo ranks running ``fn(rank, n)``; a rank exits 0, or 1 after printing its
    traceback. Returns (exit codes, seconds from start until each process had ended)."""
    import multiprocessing as mp
    import os
    import sys
    import tempfile
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="flashcp_fork_") as tmp:

        def child(rank):
            dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank,
                                    world_size=n, timeout=timedelta(seconds=timeout_s))  # fmt: skip
            try:
                fn(rank, n)
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(1)
            os._exit(0)

        procs = [ctx.Process(target=child, args=(r,), daemon=True) for r in range(n)]
        t0 = time.monotonic()
        for p in procs:
            p.start()
        ended: dict[int, float] = {}
        while len(ended) < n and time.monotonic() - t0 < timeout_s:
            for r, p in enumerate(procs):
                if r not in ended and not p.is_alive():
                    ended[r] = time.monotonic() - t0
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        return [p.exitcode for p in procs], ended


def _blocked_for_good(rank, n):
    from flashcp.executors.dist import abort_group_on_error, watch_peers

    with watch_peers(None, poll_s=0.1, grace_s=1.0), abort_group_on_error(None, "step"):
        if rank == 1:
            raise RuntimeError("injected failure on rank 1")
        time.sleep(60)  # a wait that nothing wakes (a host thread stuck in a driver call)


def test_a_rank_stuck_after_the_abort_exits_with_the_peers_error(capfd):
    codes, ended = _fork_ranks(_blocked_for_good, 3)
    assert codes == [1, 1, 1] and max(ended.values()) < 10, (codes, ended)
    err = capfd.readouterr().err
    assert "injected failure on rank 1" in err
    for r in (0, 2):
        assert f"rank {r}: still blocked 1 s after aborting its process group; exiting" in err


def _keep_rows(rank, n):
    from flashcp.executors import RunSpec, execute

    rows = {}
    for method in ("llama3", "flashcp"):
        for opts in ({}, {"keep_gathered_kv": True}):
            spec = RunSpec(
                method=method, cp_size=n, shape=AttnShape(4, 2, 8, "float32"), modes=("train",),
                options=opts, executor={"backend": "cpu", "warmup": 0, "iters": 1},
            )  # fmt: skip
            out = execute("dist", [spec], [np.array(LENS)], group=None)
            if out is not None:
                rows[method, bool(opts)] = out.iloc[0].to_dict()
    return rows


def test_keep_gathered_kv_method_option_runs_the_op_with_it():
    """``executor=dist`` hands the method option ``keep_gathered_kv`` to the op (not the
    planner): the counted bytes pass the executor's check against ``comm_volume`` with the
    option, the forward's all-gather only, half the default's all-gather bytes."""
    res = run_ranks(_keep_rows, 2, timeout_s=120)[0]
    shape = AttnShape(4, 2, 8, "float32")
    for method in ("llama3", "flashcp"):
        base, keep = res[method, False], res[method, True]
        assert base["status"] == keep["status"] == "ok"
        plan = make_plan_for(method, LENS, 2)
        want = comm_volume(plan, COMM_KIND[method], shape, "train", keep_gathered_kv=True)
        assert {c: keep[c] for c in COMM_COLUMNS} == want
        assert 2 * keep["allgather_bytes"] == base["allgather_bytes"] > 0
