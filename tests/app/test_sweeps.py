"""Sweeps never mix, overwrite, lose or hide results: run identity in every row, summaries per
identity, resume on code changes, one sweep per folder, failed jobs as rows and a non-zero exit,
integer columns that stay integers, documents longer than the context, and figures that refuse
what they cannot draw. Each test is built from a small example of the fault it guards against."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

pytest.importorskip("hydra", reason="the Hydra harness needs hydra-core and omegaconf")
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

import experiments.plot as plot
import experiments.run as run_mod
from experiments.aggregate import aggregate, merge_rows
from experiments.common.callbacks import LOCK_NAME, acquire_lock, read_lock, release_lock
from experiments.common.rows import write_error_rows
from experiments.plot import draw
from experiments.run import CONF_DIR, run
from flashcp.config import register_configs
from flashcp.results import IDENTITY_COLUMNS, INT_COLUMNS, read_rows

REPO = Path(__file__).resolve().parents[2]


def _small(tmp_path: Path, *overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(
            "config",
            overrides=[
                f"results_dir={tmp_path}", "name=t", "num_sequences=3", "context_len=16384",
                "cp_size=4", "progress=false", "dataset=pile", *overrides,
            ],
        )  # fmt: skip


def _cli(tmp_path: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "experiments.run",
        *args,
        f"results_dir={tmp_path}",
        "progress=false",
    ]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_rows_carry_the_run_identity_and_job(tmp_path):
    df = read_rows(run(_small(tmp_path, "method=flashcp")))
    for col in (*IDENTITY_COLUMNS, "run_id", "sweep_id", "job_num", "overlong_docs"):
        assert col in df, col
    assert df["run_id"].nunique() == 1 and df["sweep_id"].nunique() == 1
    assert df["method_options"].iloc[0] == '{"target_imbalance": 1.05}'
    assert df["num_sequences"].iloc[0] == 3 and df["code_version"].iloc[0] != ""
    assert df["hardware_changes"].iloc[0] == "{}"
    # a hardware constant changed on the command line is visible and changes the identity
    hw = read_rows(run(_small(tmp_path, "method=flashcp", "hardware.launch_us=10")))
    assert json.loads(hw["hardware_changes"].iloc[0]) == {"launch_us": 10}
    assert hw["run_id"].iloc[0] != df["run_id"].iloc[0]


def test_swept_options_and_sizes_are_not_averaged(tmp_path):
    """Fault 1: three target_imbalance values, and 2 then 3 sequences, in one folder."""
    for r in ("1.01", "1.05", "1.2"):
        run(_small(tmp_path, "method=flashcp", f"method.options.target_imbalance={r}"))
    summary = aggregate(tmp_path / "t")
    train = summary[summary["mode"] == "train"]
    assert len(train) == 3  # one row per configuration, not one mean of three
    assert sorted(train["method_options"]) == sorted(
        f'{{"target_imbalance": {r}}}' for r in (1.01, 1.05, 1.2)
    )
    assert (train["num_rows"] == 3).all()
    # the imbalance of each row is its own configuration's, not a mix
    rows = read_rows(tmp_path / "t" / "rows.parquet")
    for _, s in train.iterrows():
        mine = rows[(rows["run_id"] == s["run_id"]) & (rows["mode"] == "train")]
        assert s["imbalance_ratio_mean"] == pytest.approx(mine["imbalance_ratio"].mean())

    # 2 then 3 sequences of llama3 and flashcp into one folder
    for n in (2, 3):
        run(_small(tmp_path, "name=n", "method=flashcp", f"num_sequences={n}"))
    run(_small(tmp_path, "name=n", "method=llama3", "num_sequences=2"))
    s = aggregate(tmp_path / "n")
    fl = (
        s[(s["method"] == "flashcp") & (s["mode"] == "train")]
        .set_index("num_sequences")
        .sort_index()
    )
    assert list(fl.index) == [2, 3] and list(fl["num_rows"]) == [2, 3]
    # speedup pairs only the llama3 run of the same identity: none exists for 3 sequences
    assert fl.loc[2, "speedup_vs_llama3"] > 0 and pd.isna(fl.loc[3, "speedup_vs_llama3"])


def test_merge_without_merged_rows(tmp_path):
    """merged_rows=false (the paper-scale fig5_100k): summary.csv only, a stale merged file gone,
    the same summary as a merge that writes the rows."""
    run(_small(tmp_path, "method=llama3"))
    full = aggregate(tmp_path / "t")
    assert (tmp_path / "t" / "rows.parquet").exists()
    slim = aggregate(tmp_path / "t", write_rows=False)
    assert not (tmp_path / "t" / "rows.parquet").exists()
    pd.testing.assert_frame_equal(full, slim)
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["experiment=fig5_100k"])
    assert cfg.name == "fig5_100k" and cfg.num_sequences == 100_000
    assert cfg.merged_rows is False and list(cfg.plots) == ["fig5"]
    assert list(cfg.grid.method) == ["llama3", "per_doc", "ring", "zigzag", "flashcp"]


def test_merge_refuses_the_same_run_twice(tmp_path):
    out = run(_small(tmp_path, "method=llama3"))
    copy = out.parent.with_name(out.parent.name + "-copy")
    copy.mkdir()
    (copy / out.name).write_bytes(out.read_bytes())
    with pytest.raises(ValueError, match="several files"):
        merge_rows(tmp_path / "t")


def test_resume_redoes_a_run_of_other_code(tmp_path, monkeypatch, caplog):
    """Fault 2: the code changed since the rows were written."""
    cfg = _small(tmp_path, "method=per_doc")
    out = run(cfg)
    old = read_rows(out)["code_version"].iloc[0]
    mtime = out.stat().st_mtime_ns
    assert run(cfg) == out and out.stat().st_mtime_ns == mtime  # same code: skipped
    real = run_mod.provenance
    monkeypatch.setattr(run_mod, "provenance", lambda: {**real(), "code_version": "c0ffee1"})
    with caplog.at_level(logging.WARNING, logger="experiments.run"):
        assert run(cfg) == out
    df = read_rows(out)
    assert (df["code_version"] == "c0ffee1").all()
    assert any(old in r.message and "c0ffee1" in r.message for r in caplog.records)


def test_one_sweep_per_folder(tmp_path):
    """Fault 3: a second sweep into a folder held by a live sweep stops; a dead one's lock is
    taken over."""
    held = acquire_lock(tmp_path / "x")
    with pytest.raises(RuntimeError, match="in use by sweep"):
        acquire_lock(tmp_path / "x")
    proc = _cli(tmp_path, "-m", "method=llama3,flashcp", "name=x", "num_sequences=1", timeout=120)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("flashcp-run: error:") and held["sweep_id"] in last
    assert not (tmp_path / "x" / "runs").exists()
    release_lock(tmp_path / "x", held)
    assert read_lock(tmp_path / "x") is None
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / LOCK_NAME).write_text(
        f'{{"sweep_id": "old", "pid": {int(dead.stdout)}, "host": "{__import__("socket").gethostname()}"}}'
    )
    assert acquire_lock(tmp_path / "y")["sweep_id"] != "old"


def test_failing_jobs_are_rows_and_the_sweep_goes_on(tmp_path):
    """Faults 3, 4, 6 and 8 in one sweep: a pinned hydra.sweep.dir, a dataset file that does not
    exist (two of four jobs fail), two CP sizes with plots=[fig5,fig6]."""
    pinned = tmp_path / "pinned"
    proc = _cli(
        tmp_path, "-m", "dataset=wlb_llm,file", "dataset.path=missing.csv", "method=llama3",
        "cp_size=2,4", "num_sequences=2", "context_len=8192", "name=f", f"hydra.sweep.dir={pinned}",
        "plots=[fig5,fig6]",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()
    assert any(line.startswith("flashcp-run: 2 of 4 jobs failed") for line in err), err[-5:]
    assert any(
        "fig6 needs one cp_size and model per dataset; this sweep has cp_size 2, 4" in x
        for x in err
    )
    assert not (pinned / "fig6.png").exists() and (pinned / "fig5.png").exists()
    # the merge found the rows where the jobs wrote them
    rows = read_rows(pinned / "rows.parquet")
    assert len(rows) == 2 * 2 * 2 + 2 * 2  # ok: 2 runs x 2 seq x 2 modes; failed: 2 runs x 2 modes
    failed = rows[rows["dataset"] == "file"]
    assert failed["status"].str.startswith("error: ConfigError").all()  # a ValueError
    assert failed["status"].str.contains("missing.csv").all() and failed["seq_idx"].isna().all()
    assert rows["sweep_id"].nunique() == 1 and sorted(rows["job_num"].unique()) == list(range(4))
    assert not (pinned / LOCK_NAME).exists()  # released
    # the failed job's traceback is in its own log
    logs = [p.read_text() for p in pinned.glob("runs/file-*/*.log")]
    assert len(logs) == 2 and all("Traceback" in t and "missing.csv" in t for t in logs)
    assert "Traceback" not in proc.stderr  # the console gets one line per failed job
    # integer columns stay integers beside error rows (fault 6)
    schema = pq.read_schema(pinned / "rows.parquet")
    assert schema.field("cp_size").type == "int64" and schema.field("comm_bytes").type == "int64"
    for col in INT_COLUMNS:
        if col in rows:
            assert rows[col].dtype == "Int64", col
    summary = read_rows(pinned / "summary.csv")
    assert (summary[summary["dataset"] == "file"]["num_ok"] == 0).all()
    assert summary["cp_size"].dtype == "Int64"


def test_failing_single_run_prints_its_error_once(tmp_path):
    """A single run with a value only its work would read (a missing length file) is refused
    before anything is written: the command's one error line, exit code 2, no result folder, no
    merge line."""
    proc = _cli(tmp_path, "dataset=file", "dataset.path=missing.csv", "name=one")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "flashcp-run: error: length file 'missing.csv' not found"
    ], proc.stderr
    assert not any(tmp_path.iterdir())


def test_error_rows_keep_integer_columns(tmp_path):
    """Fault 6: a run with an error row merged with a finished one."""
    run(_small(tmp_path, "method=llama3"))
    bad = _small(tmp_path, "method=flashcp", "dataset=file", "dataset.path=nope.txt")
    write_error_rows(bad, ValueError("nope.txt does not exist"))
    aggregate(tmp_path / "t")
    raw = pd.read_parquet(tmp_path / "t" / "rows.parquet")
    assert raw["cp_size"].dtype == "Int64" and raw["comm_bytes"].isna().any()
    schema = pq.read_schema(tmp_path / "t" / "rows.parquet")
    assert schema.field("comm_bytes").type == "int64"  # missing is null, not a float NaN
    rows = read_rows(tmp_path / "t" / "rows.parquet")
    assert rows["comm_bytes"].dtype == "Int64" and rows["seq_idx"].dtype == "Int64"
    # the summary stays a CSV whose integer columns read as integers
    assert "." not in pd.read_csv(tmp_path / "t" / "summary.csv", dtype=str)["cp_size"].iloc[0]


def _lengths(tmp_path: Path) -> Path:
    path = tmp_path / "lengths.txt"
    path.write_text("10000\n20000\n")
    return path


def test_overlong_documents_are_split_by_default(tmp_path):
    """Fault 7: lengths 10000 and 20000 at context_len 8192."""
    path = _lengths(tmp_path)
    cfg = _small(tmp_path, "dataset=file", f"dataset.path={path}", "context_len=8192", "method=per_doc",
                 "num_sequences=6")  # fmt: skip
    assert cfg.dataset.overlong == "split"
    seqs, counts = run_mod.sample(cfg)
    assert all(d.sum() == 8192 and d.max() <= 8192 for d in seqs)
    # pieces of 10000 = 8192 + 1808 and of 20000 = 8192 + 8192 + 3616 follow each other
    # (every document but a sequence's last, which packing cuts to fit, is a whole piece)
    assert all(set(d[:-1].tolist()) <= {8192, 1808, 3616} for d in seqs)
    assert any(d.size > 1 for d in seqs)  # a remainder piece shares a sequence
    assert all(
        c["overlong_tokens_cut"] == 0 and c["overlong_docs"] == len(d)
        for c, d in zip(counts, seqs, strict=True)
    )
    df = read_rows(run(cfg))
    assert (df["status"] == "ok").all() and (df["overlong_docs"] >= 1).all()


def test_overlong_cut_is_counted_and_warned_once(tmp_path, caplog):
    path = _lengths(tmp_path)
    cfg = _small(tmp_path, "dataset=file", f"dataset.path={path}", "context_len=8192", "method=per_doc",
                 "dataset.overlong=cut")  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="experiments.run"):
        df = read_rows(run(cfg))
    warned = [r for r in caplog.records if "longer than context_len" in r.message]
    assert len(warned) == 1
    train = df[df["mode"] == "train"]
    assert (train["num_docs"] == 1).all()
    assert set(train["overlong_tokens_cut"]) <= {10000 - 8192, 20000 - 8192}
    assert int(train["overlong_tokens_cut"].sum()) > 0


def test_overlong_error_refuses_before_work(tmp_path):
    path = _lengths(tmp_path)
    cfg = _small(tmp_path, "dataset=file", f"dataset.path={path}", "context_len=8192",
                 "dataset.overlong=error")  # fmt: skip
    with pytest.raises(ValueError, match="longer than context_len = 8192"):
        run(cfg)
    assert not (tmp_path / "t" / "runs").exists()
    with pytest.raises(ConfigCompositionException, match="overlong"):  # an enum: compose time
        _small(tmp_path, "dataset.overlong=truncate")


def test_figures_refuse_mixed_data_and_mark_missing_bars(tmp_path, monkeypatch):
    """Fault 8: two summary rows for one bar; a bar without data."""
    run(_small(tmp_path, "method=llama3"))
    run(_small(tmp_path, "method=flashcp"))
    run(_small(tmp_path, "method=flashcp", "method.options.target_imbalance=1.2"))
    aggregate(tmp_path / "t")
    with pytest.raises(ValueError, match="differ in method_options"):
        draw("fig5", tmp_path / "t")
    with pytest.raises(ValueError, match=r"fig6 .* differ in method_options"):
        draw("fig6", tmp_path / "t")
    # a failed zigzag run on one dataset: its bar is marked, not left out
    run(_small(tmp_path, "name=m", "method=llama3"))
    run(_small(tmp_path, "name=m", "method=zigzag"))
    run(_small(tmp_path, "name=m", "method=llama3", "dataset=wlb_llm"))
    write_error_rows(
        _small(tmp_path, "name=m", "method=zigzag", "dataset=wlb_llm"), RuntimeError("x")
    )
    aggregate(tmp_path / "m")
    marked = []
    monkeypatch.setattr(plot, "_mark_missing", lambda ax, x: marked.append(ax))
    draw("fig5", tmp_path / "m")
    assert len(marked) == 2 and all(
        ax.get_title().startswith("wlb_llm") for ax in marked
    )  # train, infer


def test_a_job_whose_rows_all_failed_exits_nonzero(tmp_path, monkeypatch):
    """Every sequence's planner fails: the rows are written (each names its error) and the job
    counts as failed; one good sequence makes it a success."""
    import flashcp.sim.impl as impl
    from experiments.run import main

    real = impl.impl_plan
    calls = []

    def failing(method, impl_name, doc_lens, cp_size, **options):
        calls.append(1)
        if len(calls) > limit[0]:
            raise ValueError("planner broke")
        return real(method, impl_name, doc_lens, cp_size, **options)

    limit = [0]
    monkeypatch.setattr(impl, "impl_plan", failing)
    res = main(_small(tmp_path, "method=llama3", "name=bad"))
    assert res["exit_code"] == 1 and "planner broke" in res["error"]
    rows = pd.read_parquet(res["rows"])
    assert len(rows) == 6 and rows["status"].str.contains("planner broke").all()
    limit[0], calls[:] = 1, []
    res = main(_small(tmp_path, "method=llama3", "name=good"))
    assert res["exit_code"] == 0 and res["error"] is None


@pytest.mark.parametrize(
    "methods", [("-m", "method=usp,flashcp_ulysses"), ("grid.method=[usp,flashcp_ulysses]",)]
)
def test_one_option_for_a_sweep_of_methods_that_all_take_it(tmp_path, methods):
    """``method.options.ulysses_degree=2`` beside a sweep or grid of methods that all take it
    (the config's own method, flashcp, does not) applies to each."""
    proc = _cli(
        tmp_path, *methods, "method.options.ulysses_degree=2", "cp_size=4", "context_len=4096",
        "num_sequences=2", "name=u",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_rows(tmp_path / "u" / "rows.parquet")
    assert sorted(rows["method"].unique()) == ["flashcp_ulysses", "usp"]
    assert (rows["status"] == "ok").all()
    options = {
        m: json.loads(o) for m, o in zip(rows["method"], rows["method_options"], strict=True)
    }
    assert all(o["ulysses_degree"] == 2 for o in options.values()), options


def test_grid_run_that_cannot_be_made_is_error_rows_others_run(tmp_path, caplog):
    """ulysses at cp_size 16 with 24 heads (16 does not divide 24) in a grid with llama3 and
    cp_size 8: that run is error rows naming why, the three others run, and one warning says so
    before any work."""
    cfg = _small(
        tmp_path, "grid.method=[llama3,ulysses]", "grid.cp_size=[8,16]", "model.num_heads=24",
        "model.num_kv_heads=8",
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="experiments.run"):
        rows = read_rows(run(cfg))
    warned = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "1 of 4 runs of the grid cannot be made" in warned[0], warned
    assert "method=ulysses cp_size=16" in warned[0]
    bad = (rows["method"] == "ulysses") & (rows["cp_size"] == 16)
    assert bad.sum() == 2 and rows[bad]["seq_idx"].isna().all()  # one error row per mode
    assert (
        rows[bad]["status"].str.contains("ulysses degree 16 does not divide num_heads = 24").all()
    )
    ok = rows[~bad]
    assert (ok["status"] == "ok").all()
    assert sorted(set(zip(ok["method"], ok["cp_size"], strict=True))) == [
        ("llama3", 8), ("llama3", 16), ("ulysses", 8)
    ]  # fmt: skip
    assert len(ok) == 3 * 3 * 2  # 3 runs x 3 sequences x 2 modes
    assert rows["run_id"].nunique() == 4
    # rerunning finds the job done (its rows hold exactly its runs)
    with caplog.at_level(logging.INFO, logger="experiments.run"):
        run(cfg)
    assert any("already done" in r.message for r in caplog.records)
    # the job exits 1 with one line counting the failed runs, so a script notices
    res = run_mod.main(cfg)
    assert res["exit_code"] == 1 and res["error"].startswith("1 of 4 runs failed"), res
    assert "ulysses degree 16 does not divide num_heads = 24" in res["error"]


def test_second_sweep_in_a_folder_says_which_runs_left_the_merge(tmp_path, caplog):
    """A sweep merges its own runs (docs/sweeps.md): a second sweep with the same name= replaces
    the merged rows and summary, and one warning counts the earlier runs that left them."""
    from omegaconf import OmegaConf

    from experiments.common.callbacks import AggregateResults

    end = AggregateResults()
    end.exp_dir = tmp_path / "t"
    config = OmegaConf.create({"plots": [], "merged_rows": True})

    def sweep(*methods: str) -> list[str]:  # what the end of a sweep of these runs logs
        jobs = [{"rows": str(run(_small(tmp_path, f"method={m}")))} for m in methods]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="experiments.common.callbacks"):
            assert end._merge_and_draw(config, jobs) == []
        return [r.getMessage() for r in caplog.records if "left the merge" in r.getMessage()]

    assert sweep("llama3", "flashcp") == []
    lines = sweep("ring")
    assert len(lines) == 1, lines
    assert "2 run(s) of an earlier sweep left the merge" in lines[0]
    assert "hold this sweep's 1 run(s) only" in lines[0] and "experiments.aggregate" in lines[0]
    assert set(read_rows(tmp_path / "t" / "summary.csv")["method"]) == {"ring"}
    assert sweep("ring") == []  # the same runs again: none left
