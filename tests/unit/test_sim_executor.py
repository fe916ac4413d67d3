"""``executor=sim`` (flashcp.executors.sim) and the job grid (experiments.common.grid.grid_runs):
rows equal to what ``flashcp.sim.simulate`` gives per plan for every method, mode and
implementation; a grid job writes the rows separate jobs would write; rows round-trip through
Parquet with their types."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("hydra", reason="the Hydra harness needs hydra-core and omegaconf")
from hydra import compose, initialize_config_dir

from experiments.common.grid import ConfigError, grid_runs
from experiments.common.rows import _resolved_hash, run_identity
from experiments.run import CONF_DIR, run
from flashcp.comm import AttnShape
from flashcp.config import register_configs
from flashcp.data import load_distribution, sample_sequences
from flashcp.executors import RunSpec, execute
from flashcp.executors.sim import CHUNK, plan_metrics
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS, read_rows, write_rows_atomic
from flashcp.sim import impl_plan, load_hardware, simulate

C = 16384
#: (method, impl) pairs the simulator models (ilp is covered by test_app; it is slow)
CASES = [
    ("llama3", "ours"), ("per_doc", "ours"), ("ring", "ours"), ("zigzag", "ours"),
    ("flashcp", "ours"), ("flashcp_refined", "ours"),
    ("llama3", "ring_flash_attn"), ("ring", "ring_flash_attn"), ("zigzag", "ring_flash_attn"),
]  # fmt: skip
SHAPES = (AttnShape(16, 16, 128, "bfloat16"), AttnShape(8, 2, 64, "float16"))


@pytest.fixture(scope="module")
def seqs():
    return sample_sequences(load_distribution("pile", context_len=C), 3, C, seed=3)


@pytest.mark.parametrize(("method", "impl"), CASES)
def test_rows_equal_simulate_per_plan(seqs, method, impl):
    """Every (model, hardware profile, mode) priced from one plan gives what ``simulate`` gives."""
    hws = [load_hardware("h100_sxm"), load_hardware("a100_sxm")]
    runs = [
        RunSpec(method, 4, shape, ("train", "infer"), impl=impl, hardware=hw)
        for hw in hws
        for shape in SHAPES
    ]
    rows = execute("sim", runs, seqs)
    assert (rows["status"] == "ok").all() and len(rows) == len(runs) * len(seqs) * 2
    for j, spec in enumerate(runs):
        mine = rows[rows["run_idx"] == j]
        assert list(mine["seq_idx"]) == [i for i in range(len(seqs)) for _ in range(2)]
        for i, d in enumerate(seqs):
            plan, pad = impl_plan(method, impl, d, 4)
            for mode in spec.modes:
                row = mine[(mine["seq_idx"] == i) & (mine["mode"] == mode)].iloc[0]
                want = simulate(plan, spec.shape, spec.hardware, mode, impl=impl)
                for col in PHASE_COLUMNS:
                    assert row[col] == pytest.approx(want[col], rel=1e-12, abs=0), (col, mode)
                for col in COMM_COLUMNS:
                    assert row[col] == want[col], col
                for col, value in plan_metrics(plan).items():
                    assert row[col] == pytest.approx(value, rel=1e-12), col
                assert row["pad_tokens"] == pad


def test_workers_give_the_same_rows(seqs, monkeypatch):
    """One chunk in this process, one per worker, and chunks of CHUNK (more than the workers):
    the same rows (a plan is priced the same whatever batch it is in)."""
    from flashcp.executors import sim

    runs = [RunSpec(m, 4, SHAPES[0], ("train",), hardware="h100_sxm") for m in ("ring", "flashcp")]
    seqs = list(seqs) * 50
    assert len(seqs) < CHUNK  # one chunk per worker
    one = execute("sim", runs, seqs)
    two = execute("sim", runs, seqs, workers=2)
    monkeypatch.setattr(sim, "CHUNK", 37)  # several chunks per worker
    many = execute("sim", runs, seqs, workers=2)
    cols = ["run_idx", "seq_idx", "mode", *PHASE_COLUMNS, *COMM_COLUMNS]
    pd.testing.assert_frame_equal(one[cols], two[cols])
    pd.testing.assert_frame_equal(one[cols], many[cols])


def test_a_failing_sequence_is_a_row(seqs):
    bad = RunSpec("llama3", 3, SHAPES[0], ("train", "infer"), hardware="h100_sxm")
    rows = execute("sim", [bad], seqs)  # C = 16384 does not divide into 2 x 3 chunks
    assert len(rows) == 6 and rows["status"].str.startswith("error: DivisibilityError").all()
    with pytest.raises(ValueError, match="unknown executor 'simulate'"):
        execute("simulate", [bad], seqs)


def _compose(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=list(overrides))


GRID = ("grid.method=[llama3,flashcp]", "grid.cp_size=[2,4]", "grid.model=[h16,h32]")


@pytest.mark.slow
def test_grid_runs_are_the_runs_overrides_compose():
    base = ("context_len=8192", "num_sequences=2", "dataset=pile")
    runs = grid_runs(_compose(*base, *GRID, "grid.hardware=[h100_sxm,a100_sxm]"))
    assert len(runs) == 16
    seen = set()
    for r in runs:
        alone = _compose(
            *base, f"method={r.method.name}", f"cp_size={r.cp_size}", f"model={r.model.name}",
            f"hardware={r.hardware.name}",
        )  # fmt: skip
        assert run_identity(r, "v") == run_identity(alone, "v")
        assert _resolved_hash(r) == _resolved_hash(alone) and r.run_key == alone.run_key
        seen.add(r.run_key)
    assert len(seen) == 16


def test_grid_placement_and_nodes_are_the_runs_overrides_compose():
    """grid.placement / grid.nodes vary the CP group's topology inside one job, each run the one
    the overrides compose; flashcp_node's planner options follow the run's topology."""
    base = ("context_len=8192", "num_sequences=1", "cp_size=16", "method=flashcp_node")
    runs = grid_runs(_compose(*base, "grid.placement=[consecutive,strided]", "grid.nodes=[2,4]"))
    assert sorted((r.placement, r.nodes) for r in runs) == [
        ("consecutive", 2), ("consecutive", 4), ("strided", 2), ("strided", 4),
    ]  # fmt: skip
    for r in runs:
        alone = _compose(*base, f"placement={r.placement}", f"nodes={r.nodes}")
        assert run_identity(r, "v") == run_identity(alone, "v")
        opts = r.method.options
        assert (opts.num_nodes, opts.placement, opts.gpus_per_node) == (r.nodes, r.placement, 8)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [(("grid.model=[h16,h64]",), "no model 'h64'; choose from h16, h32"),
     (("grid.cp_size=[]",), "grid.cp_size is empty"),
     (("grid.model=[h16]", "executor=dist"), "grid is for executor=sim"),
     (("grid.method=[llama3,llama3]",), r"lists llama3 twice: the same run would be made twice")],
)  # fmt: skip
def test_bad_grids_are_refused_before_work(tmp_path, overrides, needle):
    cfg = _compose(f"results_dir={tmp_path}", "num_sequences=1", "context_len=8192", *overrides)
    with pytest.raises(ConfigError, match=needle):
        run(cfg)
    assert not (tmp_path / "default" / "runs").exists()


def test_a_grid_misspelt_fails_at_compose_time():
    with pytest.raises(Exception, match="modelz"):
        _compose("grid.modelz=[h16]")


@pytest.mark.slow
def test_a_grid_job_writes_the_rows_of_separate_jobs(tmp_path):
    base = (f"results_dir={tmp_path}", "context_len=8192", "num_sequences=2", "dataset=pile",
            "progress=false")  # fmt: skip
    out = run(_compose(*base, "name=g", *GRID))
    assert "llama3+flashcp-cp2+4-h16+h32" in out.parent.name
    grid = read_rows(out)
    assert grid["run_id"].nunique() == 8 and len(grid) == 8 * 2 * 2
    assert run(_compose(*base, "name=g", *GRID)) == out  # finished: skipped
    cols = ["run_id", "seq_idx", "mode", "status", *PHASE_COLUMNS, *COMM_COLUMNS, "imbalance_ratio"]
    for key, mine in grid.groupby("run_id"):
        first = mine.iloc[0]
        alone = read_rows(
            run(
                _compose(
                    *base,
                    "name=a",
                    f"method={first['method']}",
                    f"cp_size={first['cp_size']}",
                    f"model={first['model']}",
                )
            )
        )
        assert alone["run_id"].iloc[0] == key
        pd.testing.assert_frame_equal(
            mine[cols].reset_index(drop=True), alone[cols].reset_index(drop=True)
        )


def test_rows_round_trip_through_parquet(tmp_path):
    df = pd.DataFrame({
        "run_id": ["1e5", "1e5"], "seq_idx": [0, None], "cp_size": [4, 4],
        "comm_bytes": [100663296, None], "total_ms": [1.5, np.nan], "status": ["ok", "error: x"],
    })  # fmt: skip
    write_rows_atomic(df, tmp_path / "rows.parquet")
    back = read_rows(tmp_path / "rows.parquet")
    assert back["seq_idx"].dtype == "Int64" and back["comm_bytes"].dtype == "Int64"
    assert back["run_id"].iloc[0] == "1e5" and pd.isna(back["comm_bytes"].iloc[1])
    assert int(back["comm_bytes"].iloc[0]) == 100663296
    with pytest.raises(ValueError, match=r"parquet or \.csv"):
        write_rows_atomic(df, tmp_path / "rows.json")


def test_head_groups_at_128k_equal_simulate():
    """At 128K the all-gather op's gradient buffer splits 32 KV heads into groups (the batched
    pricing's per-plan group sizes)."""
    c = 131072
    seqs = sample_sequences(load_distribution("wlb_llm", context_len=c), 2, c, seed=1)
    shapes = (AttnShape(32, 32, 128, "bfloat16"), AttnShape(32, 8, 128, "bfloat16"))
    hw = load_hardware("h100_sxm")
    for method in ("llama3", "flashcp"):
        runs = [RunSpec(method, 8, s, ("train", "infer"), hardware=hw) for s in shapes]
        rows = execute("sim", runs, seqs)
        for j, spec in enumerate(runs):
            for i, d in enumerate(seqs):
                plan, _ = impl_plan(method, "ours", d, 8)
                for mode in spec.modes:
                    row = rows[(rows["run_idx"] == j) & (rows["seq_idx"] == i)]
                    row = row[row["mode"] == mode].iloc[0]
                    want = simulate(plan, spec.shape, hw, mode)
                    for col in (*PHASE_COLUMNS, *COMM_COLUMNS):
                        assert row[col] == pytest.approx(want[col], rel=1e-12, abs=0), col


def test_keep_gathered_kv_method_option_reaches_the_pricing(seqs):
    """``options={"keep_gathered_kv": True}`` (``+method.options.keep_gathered_kv=true``) plans
    the same plans and prices them with the option: rows equal ``simulate(...,
    keep_gathered_kv=True)``, one all-gather of bytes per training step instead of two; the
    emulate executor refuses it before any work."""
    hw = load_hardware("h100_sxm")
    for method in ("llama3", "flashcp"):
        runs = [
            RunSpec(method, 4, SHAPES[0], ("train",), hardware=hw, options=opts)
            for opts in ({}, {"keep_gathered_kv": True})
        ]
        rows = execute("sim", runs, seqs)
        assert (rows["status"] == "ok").all()
        base, keep = (rows[rows["run_idx"] == j].reset_index() for j in (0, 1))
        assert (2 * keep["allgather_bytes"] == base["allgather_bytes"]).all()
        for i, d in enumerate(seqs):
            plan, _ = impl_plan(method, "ours", d, 4)
            want = simulate(plan, SHAPES[0], hw, "train", keep_gathered_kv=True)
            for col in PHASE_COLUMNS:
                assert keep[col][i] == pytest.approx(want[col], rel=1e-12, abs=0), col
            for col in COMM_COLUMNS:
                assert keep[col][i] == want[col], col
    run = RunSpec("llama3", 4, SHAPES[0], ("train",), hardware=hw,
                  options={"keep_gathered_kv": True}, executor={"device": "cpu"})  # fmt: skip
    with pytest.raises(ValueError, match="executor=emulate does not replay op options"):
        execute("emulate", [run], seqs)
