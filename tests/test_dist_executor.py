"""``executor=dist`` step measurement on gloo ranks: schema, positive times, counted bytes."""

from __future__ import annotations

import pytest
import torch
from mp_utils import run_ranks

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
