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
            assert set(row) == set(PHASE_COLUMNS) | set(COMM_COLUMNS)
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


def _dist_rows(rank, n):
    import flashcp.registry as registry
    from flashcp.comm import AttnShape
    from flashcp.executors import RunSpec, execute

    real = registry.get_planner("per_doc")

    def planner(doc_lens, cp_size, **options):
        if rank == 1 and len(doc_lens) == 2:  # the second sequence fails on rank 1 only
            raise ValueError("planner rejects this sequence")
        return real(doc_lens, cp_size, **options)

    registry.get_planner = lambda name: planner
    spec = RunSpec(
        method="per_doc", cp_size=n, shape=AttnShape(4, 2, 8, "float32"), modes=("infer",),
        executor={"backend": "cpu", "warmup": 0, "iters": 1, "timeout_s": 30},
    )  # fmt: skip
    seqs = [np.array(LENS), np.array([64, 64]), np.array([100, 20, 8])]
    rows = execute("dist", [spec], seqs)
    return None if rows is None else rows.to_dict("records")


def test_a_failing_sequence_is_a_status_row():
    res = run_ranks(_dist_rows, 2, timeout_s=120)
    rows = res[0]
    assert res[1] is None and [r["seq_idx"] for r in rows] == [0, 1, 2]
    assert rows[0]["status"] == "ok" and rows[2]["status"] == "ok" and rows[2]["total_ms"] > 0
    assert rows[1]["status"] == "error: ValueError: planner rejects this sequence (rank 1)"
