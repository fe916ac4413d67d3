"""Hydra launchers: a small sweep under joblib and under submitit (local processes) is merged at
the end from what its jobs wrote on disk; an ``executor=dist`` job whose ranks are the tasks of a
submitit job (as on Slurm) measures; the Slurm configs become the sbatch options they promise;
and the default output folder is ignored by git (the Quick start leaves the checkout clean)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("hydra", reason="the Hydra harness needs hydra-core and omegaconf")
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.common.callbacks import JOBS_DIR, read_job_records
from experiments.run import CONF_DIR
from flashcp.config import register_configs

REPO = Path(__file__).resolve().parents[2]
SMALL = ["num_sequences=2", "context_len=8192", "progress=false", "workers=1"]


def _sweep(tmp_path: Path, name: str, *overrides: str, timeout: int = 240) -> Path:
    cmd = [
        sys.executable, "-m", "experiments.run", "-m", "method=flashcp,llama3", *SMALL,
        f"results_dir={tmp_path}", f"name={name}", *overrides,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp_path / name


def _merged_rows(exp_dir: Path) -> pd.DataFrame:
    """The sweep's merged per-sequence rows (Parquet, or CSV from a harness that wrote CSV)."""
    parquet = exp_dir / "rows.parquet"
    return pd.read_parquet(parquet) if parquet.exists() else pd.read_csv(exp_dir / "rows.csv")


def _check_merged(exp_dir: Path, methods: set[str]) -> pd.DataFrame:
    rows = _merged_rows(exp_dir)
    summary = pd.read_csv(exp_dir / "summary.csv")
    assert set(rows["method"]) == methods and (rows["status"] == "ok").all()
    assert len(rows) == len(methods) * 2 * 2  # methods x sequences x modes
    assert set(summary["method"]) == methods and len(summary) == len(methods) * 2
    assert rows["sweep_id"].nunique() == 1 and sorted(rows["job_num"].unique()) == [0, 1]
    assert not (exp_dir / ".sweep.lock").exists() and not (exp_dir / JOBS_DIR).exists()
    return rows


@pytest.mark.parametrize(
    "launcher",
    [
        ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
        ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5"],
    ],
    ids=["joblib", "submitit_local"],
)
def test_sweep_merges_under_launcher(tmp_path, launcher):
    exp_dir = _sweep(tmp_path, "l", *launcher)
    _check_merged(exp_dir, {"flashcp", "llama3"})


def test_dist_job_on_submitit_tasks(tmp_path):
    """executor=dist with one rank per submitit task (hydra/launcher=slurm_dist's layout), gloo."""
    cmd = [
        sys.executable, "-m", "experiments.run", "-m", "method=flashcp", "executor=dist",
        "executor.backend=cpu", "executor.warmup=0", "executor.iters=1", "executor.timeout_s=60",
        "cp_size=2", "context_len=512", "num_sequences=1", "modes=[infer]", "model.num_heads=2",
        "model.num_kv_heads=2", "model.head_dim=16", "model.dtype=float32", "progress=false",
        "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.timeout_min=5", f"results_dir={tmp_path}", "name=d",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _merged_rows(tmp_path / "d")
    assert len(rows) == 1 and rows["status"].iloc[0] == "ok"  # rank 0 writes, once
    assert rows["executor"].iloc[0] == "dist" and rows["cp_size"].iloc[0] == 2
    assert rows["total_ms"].iloc[0] > 0 and rows["allgather_bytes"].iloc[0] > 0


def test_job_that_never_reported_counts_as_failed(tmp_path):
    folder = tmp_path / JOBS_DIR / "s1"
    folder.mkdir(parents=True)
    (folder / "0.json").write_text(json.dumps({"dir": "a", "rows": "a/rows.csv", "error": None}))
    (folder / "10.json").write_text(json.dumps({"dir": "c", "state": "started"}))
    (folder / "2.json").write_text(json.dumps({"dir": "b", "error": "ValueError: x"}))
    jobs = read_job_records(tmp_path, "s1")
    assert [j["dir"] for j in jobs] == ["a", "b", "c"]  # by job number
    assert jobs[2]["exit_code"] == 1 and "did not finish" in jobs[2]["error"]


def _launcher_params(*overrides: str) -> dict:
    """The parameters Hydra's submitit launcher hands to submitit for these overrides."""
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    hl = cfg.hydra.launcher
    skip = ("_target_", "submitit_folder", "name", "max_num_timeout")
    return {
        k: OmegaConf.to_object(hl[k]) if OmegaConf.is_config(hl[k]) else hl[k]
        for k in hl
        if k not in skip
    }


def test_slurm_dist_config_becomes_sbatch_options(tmp_path, monkeypatch):
    """What hydra/launcher=slurm_dist asks Slurm for: nodes x one task per GPU (the sbatch file
    submitit would submit; no cluster needed, only its check for srun is bypassed)."""
    import submitit

    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 1))
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    params = _launcher_params(
        "hydra/launcher=slurm_dist", "hydra.launcher.partition=gpu", "hydra.launcher.nodes=2",
        "executor=dist", "cp_size=16",
    )  # fmt: skip
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    # as the plugin's launcher does: queue-specific keys get the executor's prefix
    params = {(k if k in base else f"slurm_{k}"): v for k, v in params.items()}
    executor = submitit.AutoExecutor(folder=tmp_path, cluster="slurm")
    executor.update_parameters(**params)
    sbatch = executor._executor._make_submission_file_text("python -c pass", "uid")
    for line in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--partition=gpu"):
        assert f"#SBATCH {line}" in sbatch, sbatch


def test_default_outputs_are_ignored_by_git():
    """The Quick start's job writes under results_dir (default outputs/), which git ignores, so it
    leaves the checkout clean; the committed reference results stay in results/."""
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["experiment=fig5"])
    assert cfg.results_dir == "outputs"
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("outputs/fig5/rows.parquet", "outputs/fig5/runs/x/.hydra/hydra.yaml", "outputs/fig5/summary.csv"):  # fmt: skip
        proc = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO, timeout=30)
        assert proc.returncode == 0, f"{path} is not ignored by git"
    assert (REPO / "results" / "fig5" / "summary.csv").exists()  # the committed reference


def test_compare_matches_runs_across_code_versions(tmp_path):
    """``python -m experiments.aggregate --compare REF NEW``: runs match by identity apart from the
    code version; a changed time and a missing run are reported (exit code 1 for the latter)."""
    from experiments.aggregate import _cli, aggregate, compare
    from experiments.run import run

    register_configs()
    for method in ("llama3", "flashcp"):
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose("config", overrides=[*SMALL, f"method={method}", f"results_dir={tmp_path}", "name=ref"])  # fmt: skip
        run(cfg)
    aggregate(tmp_path / "ref")
    new = tmp_path / "new"
    new.mkdir()
    summary = pd.read_csv(tmp_path / "ref" / "summary.csv")
    summary["code_version"] = "other"
    summary["run_id"] = "other"
    summary.loc[summary["method"] == "flashcp", "total_ms_mean"] *= 1.5
    summary.to_csv(new / "summary.csv", index=False)
    table = compare(tmp_path / "ref", new)
    assert (table["found"] == "both").all() and len(table) == 4
    flash = table[table["method"] == "flashcp"]
    assert flash["total_ms_rel_change"].round(9).eq(0.5).all()
    assert table.loc[table["method"] == "llama3", "total_ms_rel_change"].eq(0).all()
    summary[summary["method"] == "llama3"].to_csv(new / "summary.csv", index=False)
    with pytest.raises(SystemExit) as info:
        _cli(["--compare", str(tmp_path / "ref"), str(new)])
    assert info.value.code == 1
