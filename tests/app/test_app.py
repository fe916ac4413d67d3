"""The Hydra app: config composition of every experiment, typed-schema errors, one small sweep end
to end (rows, provenance, resume, aggregation, figures), and bad configuration values."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("hydra", reason="the Hydra harness needs hydra-core and omegaconf")
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.aggregate import aggregate
from experiments.common.entry import experiment_commands
from experiments.plot import draw
from experiments.run import CONF_DIR, run
from flashcp.config import register_configs
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS, read_rows

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


def _compose(*overrides: str, hydra_cfg: bool = False, config_name: str = "config"):
    register_configs()
    if config_name != "config":  # an experiment's module registers its schema
        importlib.import_module(f"experiments.{config_name}")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name, overrides=list(overrides), return_hydra_config=hydra_cfg)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes(experiment):
    cfg = _compose(f"experiment={experiment}", hydra_cfg=True)
    assert cfg.name == experiment
    OmegaConf.resolve(cfg)  # every interpolation resolves
    # line 1 is Hydra's package header; the first comment after it is the command that runs it
    lines = (REPO / "conf" / "experiment" / f"{experiment}.yaml").read_text().splitlines()
    assert lines[0] == "# @package _global_"
    assert lines[1].startswith("# flashcp-run") and f"experiment={experiment}" in lines[1]


@pytest.mark.parametrize(("config_name", "prog"), sorted(experiment_commands().items()))
def test_every_experiment_entry_composes(config_name, prog):
    """Each experiment that writes its own tables has its own primary config, typed by the schema
    beside it in its module (only its fields, at the top level), and its first comment names its
    command."""
    from experiments.common.entry import ExperimentConfig

    cfg = _compose(hydra_cfg=True, config_name=config_name)
    schema = OmegaConf.get_type(cfg)
    assert issubclass(schema, ExperimentConfig) and cfg.name == config_name
    module = importlib.import_module(f"experiments.{config_name}")
    assert schema.__module__ == module.__name__ and getattr(module, schema.__name__) is schema
    OmegaConf.resolve(cfg)
    assert cfg.run_key.startswith(f"{config_name}-")
    assert cfg.hydra.callbacks.folder.prog == prog
    assert not {"task", "grid", "executor", config_name} & set(cfg)  # no task switch
    # flashcp-train takes flashcp-run's method group (conf/method/); no other entry has a method
    assert "method" not in cfg or (config_name == "train" and "name" in cfg.method)
    first = (REPO / "conf" / f"{config_name}.yaml").read_text().splitlines()[0]
    assert first.startswith(f"# {prog} ") and f"python -m experiments.{config_name}" in first


def test_experiment_entry_fields_are_top_level_and_hash_their_folder():
    cfg = _compose("num_sequences=2", "time_limit_s=5", "dataset=wlb_llm", config_name="table2")
    assert cfg.num_sequences == 2 and cfg.time_limit_s == 5 and cfg.dataset.name == "wlb_llm"
    assert _compose(config_name="table2").dataset.name == "pile"  # the paper's table
    keys = {_compose(*o, config_name="table2").run_key for o in [(), ("seed=1",), ("workers=2",)]}
    assert len(keys) == 2  # workers does not change the results, seed does
    sens = _compose("hardware=a100_sxm", "datasets=[pile]", config_name="sensitivity")
    assert sens.hardware.name == "a100_sxm" and list(sens.datasets) == ["pile"]
    with pytest.raises(Exception, match="wlb"):
        _compose("datasets=[wlb]", config_name="sensitivity")  # an enum: fails at compose time


def test_run_folders_keep_their_names():
    """The hash in a run folder's name did not change when Table 2, calibration, sensitivity and
    Fig. 3 left this config: the committed runs of Fig. 6 are found again (resume)."""
    runs = sorted(p.name for p in (REPO / "results" / "fig6" / "runs").iterdir())
    assert runs
    for name in runs:
        cfg = _compose("experiment=fig6", f"dataset={name.split('-')[0]}", "model=h32")
        assert cfg.run_key in runs


def test_fig5_sweeps_the_paper_grid():
    cfg = _compose("experiment=fig5", hydra_cfg=True)
    params = cfg.hydra.sweeper.params
    assert params.dataset == "wlb_llm,pile,redpajama"  # one job per dataset ...
    grid = cfg.grid  # ... planning and pricing these runs from the same sequences
    paper = ["llama3", "per_doc", "ring", "zigzag", "flashcp"]  # as the paper ran them
    assert list(grid.method) == [f"{m}_paper" for m in paper]
    assert list(grid.cp_size) == [4, 8] and list(grid.model) == ["h16", "h32"]
    assert cfg.context_len == 131072 and list(cfg.modes) == ["train", "infer"]
    ours = _compose("experiment=fig5_ours", hydra_cfg=True)  # the same grid on the project's ops
    assert list(ours.grid.method) == paper and ours.name == "fig5_ours"
    assert ours.hydra.sweeper.params.dataset == params.dataset
    assert list(ours.grid.cp_size) == [4, 8] and list(ours.grid.model) == ["h16", "h32"]


@pytest.mark.parametrize(
    "override", ["model.num_headz=4", "cp_sise=4", "dataset=wlb", "method=flashcpp", "cp_size=four"]
)
def test_typos_fail_at_compose_time(override):
    with pytest.raises(Exception) as info:
        _compose(override)
    assert type(info.value).__module__.split(".")[0] in ("hydra", "omegaconf")


def _small(tmp_path: Path, *overrides: str):
    return _compose(
        f"results_dir={tmp_path}", "name=t", "num_sequences=3", "context_len=16384", "cp_size=4",
        "progress=false", *overrides,
    )  # fmt: skip


def test_run_writes_rows_then_resumes_and_aggregates(tmp_path):
    frames = []
    for method in ("llama3", "flashcp", "ring"):
        cfg = _small(tmp_path, f"method={method}", "dataset=pile")
        out = run(cfg)
        df = read_rows(out)
        frames.append(df)
        assert len(df) == 3 * 2 and set(df["mode"]) == {"train", "infer"}
        assert (df["status"] == "ok").all()
        for col in (*PHASE_COLUMNS, *COMM_COLUMNS, "imbalance_ratio", "comm_saving", "git_commit",
                    "torch_version", "flashcp_version", "config_hash", "seed", "executor", "hardware"):  # fmt: skip
            assert col in df, col
        assert (df["total_ms"] > 0).all()
        mtime = out.stat().st_mtime_ns
        assert run(cfg) == out and out.stat().st_mtime_ns == mtime  # finished run is skipped
    # the same seed gives every method the same sequences
    assert all((f["num_docs"].values == frames[0]["num_docs"].values).all() for f in frames)
    summary = aggregate(tmp_path / "t")
    assert (tmp_path / "t" / "rows.parquet").exists()
    base = summary[summary["method"] == "llama3"]
    assert (base["speedup_vs_llama3"] == 1.0).all()
    fl = summary[summary["method"] == "flashcp"]
    assert (fl["comm_saving_mean"] >= 0).all() and fl["speedup_vs_llama3"].notna().all()
    png = draw("fig5", tmp_path / "t")
    assert png.exists() and png.stat().st_size > 10_000


@pytest.mark.parametrize(
    "overrides",
    [("method=flashcp_refined",),
     ("method=ilp", "method.options.time_limit_s=2", "method.options.block_size=1024")],
)  # fmt: skip
def test_issue4_planners_run_in_the_app(tmp_path, overrides):
    out = run(_small(tmp_path, *overrides, "num_sequences=1"))
    df = read_rows(out)
    assert (df["status"] == "ok").all() and (df["comm_saving"] >= 0).all()
    assert df["plan_status"].iloc[0] in ("ok", "time_limit", "fallback", "target_not_met")
    if "method=ilp" in overrides:  # the solver's outcome travels with the rows
        assert {"ilp_solver_status", "ilp_warm_start_accepted"} <= set(df.columns)


def test_changed_config_is_rerun(tmp_path):
    out = run(_small(tmp_path, "method=per_doc"))
    before = read_rows(out)["config_hash"].iloc[0]
    out2 = run(_small(tmp_path, "method=per_doc", "seed=1"))
    assert out2 != out and out.exists()  # its own folder: the finished run is kept
    assert read_rows(out2)["config_hash"].iloc[0] != before
    # a swept field that is not in the readable part of the folder name still gets its own folder
    out3 = run(_small(tmp_path, "method=per_doc", "model.num_kv_heads=8"))
    assert out3 not in (out, out2)


@pytest.mark.parametrize(
    ("override", "needle"),
    [("cp_size=3", "context_len = 16384"), ("num_sequences=0", "num_sequences"),
     ("model.num_kv_heads=5", "num_kv_heads = 5"), ("modes=[training]", "training"),
     ("method.options.target_imbalance=0.5", "0.5"),
     ("dataset=file", "path"),
     ("method.options.target_imbalance=abc", "abc"), ("+method.options.bogus=1", "bogus"),
     ("method=llama3 context_len=16380", "16380")],
)  # fmt: skip
def test_bad_values_raise_before_work(tmp_path, override, needle):
    with pytest.raises(ValueError, match=needle):
        run(_small(tmp_path, *override.split()))
    assert not (tmp_path / "t" / "runs").exists() or not any((tmp_path / "t" / "runs").iterdir())


def test_multirun_cli_merges_the_sweep(tmp_path):
    cmd = [
        sys.executable, "-m", "experiments.run", "-m", "method=flashcp,llama3", "cp_size=2,4",
        "num_sequences=2", "context_len=8192", f"results_dir={tmp_path}", "name=sweep",
        "progress=false", "plots=[fig5]",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_rows(tmp_path / "sweep" / "rows.parquet")
    assert set(rows["method"]) == {"flashcp", "llama3"} and set(rows["cp_size"]) == {2, 4}
    assert len(rows) == 2 * 2 * 2 * 2
    assert (tmp_path / "sweep" / "fig5.png").exists()


def test_cli_bad_value_is_one_line_exit_2(tmp_path):
    cmd = [sys.executable, "-m", "experiments.run", "cp_size=0", f"results_dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("flashcp-run: error: cp_size must be")


def test_plots_refuse_data_they_cannot_show(tmp_path):
    run(_small(tmp_path, "method=llama3"))
    run(_small(tmp_path, "method=flashcp"))
    aggregate(tmp_path / "t")
    with pytest.raises(ValueError, match="context_len"):
        draw("fig7", tmp_path / "t")  # a single context length: no line to draw
    with pytest.raises(ValueError, match="unknown figure"):
        draw("fig9", tmp_path / "t")
    assert draw("fig5", tmp_path / "t").exists()
