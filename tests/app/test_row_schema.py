"""One schema for every row file of a runs folder (failed jobs, ILP and non-ILP runs), read with
the tools users reach for (``pyarrow.dataset``, ``pandas.read_parquet`` of a list of files), and
the ILP's solve in every ``method=ilp`` row."""

from __future__ import annotations

import warnings
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from test_app import _small

from experiments.aggregate import merge_rows
from experiments.common.rows import write_error_rows
from experiments.run import run
from flashcp.results import (
    INT_COLUMNS,
    ROW_SCHEMA,
    arrow_row_schema,
    conform_rows,
    read_rows,
    runs_table,
    write_csv_atomic,
    write_rows_atomic,
)

_ILP = ("method=ilp", "method.options.block_size=2048", "method.options.threads=1",
        "method.options.lns=false")  # fmt: skip


@pytest.fixture(scope="module")
def runs_folder(tmp_path_factory) -> Path:
    """A runs folder of tiny ``executor=sim`` jobs written by the harness's own writers: a failed
    job (sorted first), a successful ILP job, a successful non-ILP job, an ILP job whose solves
    are killed (fallback rows) and one whose planner raises for every sequence (error rows in a
    finished job)."""
    tmp = tmp_path_factory.mktemp("rows")
    bad = _small(tmp, "method=ring", "num_sequences=1", "run_key=a_failed")
    write_error_rows(bad, RuntimeError("the job failed before any row"))
    run(_small(tmp, *_ILP, "method.options.time_limit_s=10", "num_sequences=1", "run_key=b_ilp"))
    run(_small(tmp, "method=flashcp", "num_sequences=2", "run_key=c_flashcp"))
    killed = ("method.options.time_limit_s=0.01", "method.options.watchdog_grace_s=0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the fallback is in the rows
        run(_small(tmp, *_ILP, *killed, "num_sequences=1", "run_key=d_killed"))
        run(_small(tmp, *_ILP, *killed, "method.options.on_failure=raise", "num_sequences=1",
                   "run_key=e_raises"))  # fmt: skip
    return tmp / "t" / "runs"


def _files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*/rows.parquet"))
    assert [f.parent.name for f in files] == ["a_failed", "b_ilp", "c_flashcp", "d_killed",
                                              "e_raises"]  # fmt: skip
    return files


def test_every_row_file_has_the_one_schema(runs_folder):
    want = arrow_row_schema()
    for f in _files(runs_folder):
        assert pq.read_schema(f).remove_metadata().equals(want), f.parent.name


def test_pyarrow_dataset_over_a_mixed_runs_folder_loses_no_column(runs_folder):
    table = ds.dataset(runs_folder, format="parquet").to_table()
    assert table.column_names == list(ROW_SCHEMA)
    assert table.num_rows == sum(pq.read_metadata(f).num_rows for f in _files(runs_folder))
    for col in INT_COLUMNS:
        if col in ROW_SCHEMA:
            assert table.schema.field(col).type == pa.int64(), col
    df = table.to_pandas()
    ilp = df[df["run_id"].isin(pd.read_parquet(runs_folder / "b_ilp" / "rows.parquet")["run_id"])]
    assert ilp["ilp_objective"].notna().all() and ilp["ilp_best_bound"].notna().all()


def test_pandas_list_of_files_keeps_columns_and_integers(runs_folder):
    df = pd.read_parquet(_files(runs_folder))  # the failed job's file first
    assert list(df.columns) == list(ROW_SCHEMA)
    for col in INT_COLUMNS:
        if col in df:
            assert df[col].dtype == "Int64", col
    failed = df[df["status"].str.startswith("error: RuntimeError")]
    assert len(failed) == 2 and failed["pad_tokens"].isna().all()
    assert (df.loc[df["plan_status"].notna(), "pad_tokens"] == 0).all()


def test_ilp_rows_carry_the_solve(runs_folder):
    solved = read_rows(runs_folder / "b_ilp" / "rows.parquet")
    assert (solved["status"] == "ok").all()
    assert solved["ilp_solver_status"].isin(["optimal", "time_limit"]).all()
    for col in ("ilp_objective", "ilp_best_bound", "ilp_gap"):
        assert solved[col].notna().all(), col
    assert (solved["ilp_objective"] >= solved["ilp_best_bound"] - 1e-9).all()
    assert (solved["ilp_threads"] == 1).all() and solved["ilp_warm_start_given"].all()
    assert solved["ilp_fallback_method"].isna().all()
    # a killed solve: the warm start's plan, and the row says so
    killed = read_rows(runs_folder / "d_killed" / "rows.parquet")
    assert (killed["plan_status"] == "fallback").all()
    assert (killed["ilp_solver_status"] == "killed").all()
    assert (killed["ilp_fallback_method"] == "flashcp_refined").all()
    raised = read_rows(runs_folder / "e_raises" / "rows.parquet")
    assert raised["status"].str.contains("returned no solution").all()
    other = read_rows(runs_folder / "c_flashcp" / "rows.parquet")
    assert other["ilp_objective"].isna().all() and other["ilp_threads"].isna().all()


def test_merge_with_failed_jobs_keeps_integers_and_the_csv_writes_them(runs_folder, tmp_path):
    rows = merge_rows(runs_folder.parent, _files(runs_folder))
    for col in INT_COLUMNS:
        if col in rows:
            assert rows[col].dtype == "Int64", col
    write_csv_atomic(rows, tmp_path / "rows.csv")
    raw = pd.read_csv(tmp_path / "rows.csv", dtype=str, keep_default_na=False)
    assert set(raw["pad_tokens"]) == {"0", ""}  # not "0.0"
    assert "." not in "".join(raw["cp_size"]) + "".join(raw["comm_bytes"])
    write_rows_atomic(rows, tmp_path / "rows.parquet")
    assert pq.read_schema(tmp_path / "rows.parquet").remove_metadata().equals(arrow_row_schema())


def test_conform_rows_refuses_what_the_schema_does_not_name():
    df = pd.DataFrame({"cp_size": [4], "pad_tokens": [0.0], "not_a_column": [1]})
    with pytest.raises(ValueError, match=r"\['not_a_column'\].*ROW_SCHEMA"):
        conform_rows(df)
    with pytest.raises(ValueError, match="'cp_size' must hold int"):
        conform_rows(pd.DataFrame({"cp_size": [4.5]}))
    out = conform_rows(pd.DataFrame({"cp_size": [4.0], "pad_tokens": [None]}))
    assert list(out.columns) == list(ROW_SCHEMA) and out["cp_size"].dtype == "Int64"
    assert out["pad_tokens"].dtype == "Int64" and out["ilp_warm_start_given"].dtype == "boolean"


def test_runs_table_equals_the_frame_of_repeated_constants(tmp_path):
    """The per-run columns expanded in Arrow give the table (and the file) that repeating them
    on every row and conforming the frame gives: values, nulls, types, pandas metadata."""
    import numpy as np

    rows = pd.DataFrame({
        "seq_idx": pd.array([0, 1, 2, 0, 1], dtype="Int64"),
        "mode": pd.array(["train", "infer", None, "train", "train"], dtype="string"),
        "total_ms": [1.5, np.nan, 2.0, 3.25, 0.0],
        "comm_bytes": pd.array([10, None, 3, 4, 5], dtype="Int64"),
    })  # fmt: skip
    per_run = pd.DataFrame({
        "run_id": ["a", "b", "c"], "cp_size": [4, 8, 16], "git_dirty": [True, False, True],
        "dataset_path": [None, "x.csv", None], "p2p_ms": [np.nan] * 3, "num_heads": [16.0] * 3,
    })  # fmt: skip
    run_of_row = np.array([0, 0, 2, 2, 2])
    table = runs_table(rows, per_run, run_of_row)
    frame = pd.concat([rows, per_run.iloc[run_of_row].reset_index(drop=True)], axis=1)
    want = pa.Table.from_pandas(conform_rows(frame), schema=arrow_row_schema(),
                                preserve_index=False)  # fmt: skip
    assert table.equals(want, check_metadata=True)
    write_rows_atomic(table, tmp_path / "a.parquet")
    write_rows_atomic(frame, tmp_path / "b.parquet")
    a, b = read_rows(tmp_path / "a.parquet"), read_rows(tmp_path / "b.parquet")
    pd.testing.assert_frame_equal(a, b)
    assert a["cp_size"].tolist() == [4, 4, 16, 16, 16] and a["cp_size"].dtype == "Int64"
    with pytest.raises(ValueError, match="'cp_size' must hold int"):
        runs_table(rows, per_run.assign(cp_size=[4, 8.5, 16]), run_of_row)
    with pytest.raises(ValueError, match=r"\['bogus'\].*ROW_SCHEMA"):
        runs_table(rows, per_run.assign(bogus=1), run_of_row)
    with pytest.raises(ValueError, match=r"\['mode'\] are given both"):
        runs_table(rows, per_run.assign(mode="x"), run_of_row)
    with pytest.raises(ValueError, match=r"outside \[0, 3\): 0\.\.3"):
        runs_table(rows, per_run, np.array([0, 0, 1, 3, 1]))
    with pytest.raises(ValueError, match="5 integer positions"):
        runs_table(rows, per_run, np.zeros(5))
    with pytest.raises(ValueError, match="ROW_SCHEMA's schema"):
        write_rows_atomic(pa.table({"x": [1]}), tmp_path / "c.parquet")


def test_table2_rows_carry_the_solve():
    from experiments.table2 import _ilp_row

    opts = {"time_limit_s": 10, "threads": 1, "lns": False, "block_size": 4096, "gap": 0.05}
    row = _ilp_row((0, [3000, 500, 4100, 700, 7000, 1084], 4, opts))
    assert row["ilp_threads"] == 1 and row["ilp_fallback_method"] is None
    assert row["ilp_objective"] is not None and row["ilp_best_bound"] is not None
    assert row["ilp_objective"] >= row["ilp_best_bound"] - 1e-9


def test_kv_token_metrics_are_null_where_they_do_not_apply(tmp_path):
    """``ulysses`` (and a hybrid whose one group holds every rank) moves q, k, v and the output
    by all-to-all: its KV-token metrics (Eq. 4 / 5) are typed nulls in the rows and empty in
    ``summary.csv``, never 0, while its bytes columns hold what it moves; a ring's are numbers."""
    from experiments.aggregate import aggregate
    from flashcp.registry import make_plan_for

    kv_tokens = ["comm_tokens", "comm_tokens_full", "comm_saving", "comm_tokens_sharded"]
    for method in ("ulysses", "ring"):
        run(_small(tmp_path, f"method={method}", "num_sequences=1", "context_len=4096"))
    aggregate(tmp_path / "t")
    rows = read_rows(tmp_path / "t" / "rows.parquet")
    uly, ring = rows[rows["method"] == "ulysses"], rows[rows["method"] == "ring"]
    assert len(uly) == len(ring) == 2
    assert uly[kv_tokens].isna().all().all() and ring[kv_tokens].notna().all().all()
    assert str(uly["comm_tokens"].dtype) == "Int64"
    assert (uly["alltoall_bytes"] > 0).all() and (ring["p2p_bytes"] > 0).all()
    with open(tmp_path / "t" / "summary.csv") as f:
        summary = pd.read_csv(f, dtype=str, keep_default_na=False)
    for method, empty in (("ulysses", True), ("ring", False)):
        values = summary.loc[summary["method"] == method, [f"{c}_mean" for c in kv_tokens]]
        assert ((values == "") == empty).all().all(), (method, values)
    # the plan's summary: None exactly where no KV moves by all-gather or ring
    for method, cp_size, applies in (
        ("ulysses", 4, False), ("usp", 4, True), ("ulysses", 1, True), ("flashcp", 4, True),
    ):  # fmt: skip
        plan = make_plan_for(method, [60, 4], cp_size)
        s = plan.summary()
        assert plan.moves_kv_tokens is applies
        assert all((s[c] is None) is not applies for c in kv_tokens), (method, cp_size, s)


def test_markdown_table_leaves_typed_nulls_empty():
    """A metric that does not apply (``<NA>`` in an Int64 column, NaN, None) is an empty cell in
    a printed table, never ``<NA>`` or ``nan``."""
    from flashcp.results import markdown_table

    df = pd.DataFrame({"method": ["ulysses", "ring"], "comm_tokens": pd.array([None, 6144], "Int64"),
                       "comm_saving": [float("nan"), 0.0], "note": [None, "x"]})  # fmt: skip
    lines = markdown_table(df).splitlines()
    assert lines[2] == "| ulysses |  |  |  |" and lines[3] == "| ring | 6144 | 0 | x |"


def test_step_columns_for_a_whole_model_and_nulls_for_attention_only(tmp_path):
    """``step_ms`` (rows) and ``step_ms_mean`` / ``step_speedup_vs_llama3`` (summary) are set for a
    model with layers (``small_1b``) and null for an attention-only preset, whose run_id does not
    depend on the step model's identity column."""
    from experiments.aggregate import aggregate
    from experiments.common.rows import run_identity
    from flashcp.results import IDENTITY_COLUMNS, config_hash, identity_hash

    for model in ("small_1b", "h16"):
        for method in ("llama3", "flashcp"):
            run(_small(tmp_path, f"method={method}", f"model={model}", "dataset=pile"))
    rows = ds.dataset(tmp_path / "t" / "runs", format="parquet").to_table().to_pandas()
    whole = rows["model"] == "small_1b"
    assert rows.loc[whole, "step_ms"].notna().all() and rows.loc[~whole, "step_ms"].isna().all()
    assert (rows.loc[whole, "step_ms"] > 32 * rows.loc[whole, "total_ms"]).all()  # 16 layers, x2
    assert set(rows.loc[~whole, "step_model"]) == {"-"}
    summary = aggregate(tmp_path / "t").set_index(["model", "mode", "method"])
    for mode in ("train", "infer"):
        att = summary.loc[("small_1b", mode, "flashcp"), "speedup_vs_llama3"]
        step = summary.loc[("small_1b", mode, "flashcp"), "step_speedup_vs_llama3"]
        assert 1 < step < att
    assert summary.loc["h16", "step_speedup_vs_llama3"].isna().all()
    ident = run_identity(_small(tmp_path, "model=h16"), "v")
    old = {k: ident[k] for k in IDENTITY_COLUMNS if k != "step_model"}
    assert identity_hash(ident) == config_hash(old)  # attention-only run ids unchanged
    whole_ident = run_identity(_small(tmp_path, "model=small_1b"), "v")
    assert whole_ident["step_model"] == "L16-h2048-f8192-v128256"
    changed = run_identity(_small(tmp_path, "model=small_1b", "model.num_layers=8"), "v")
    assert identity_hash(changed) != identity_hash(whole_ident)
