"""Every error about a file names the file: the merge of rows files (``python -m
experiments.aggregate``, ``--compare``), reading rows (:func:`flashcp.results.read_rows`), drawing
a figure from its CSV (``python -m experiments.plot``), a hardware profile's YAML and the fitted
calibration constants (:func:`flashcp.sim.hardware.load_hardware`)."""

from __future__ import annotations

import shutil

import pandas as pd
import pytest

pytest.importorskip("hydra", reason="the rows come from a tiny flashcp-run")
from hydra import compose, initialize_config_dir

from experiments.aggregate import _cli as aggregate_cli
from experiments.aggregate import aggregate, compare
from experiments.plot import draw
from experiments.run import CONF_DIR, run
from flashcp.config import register_configs
from flashcp.results import read_rows


@pytest.fixture(scope="module")
def run_rows(tmp_path_factory):
    """The rows file of one tiny simulated run (2 sequences of 4K, CP 2)."""
    tmp = tmp_path_factory.mktemp("rows")
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=[
            f"results_dir={tmp}", "name=t", "num_sequences=2", "context_len=4096", "cp_size=2",
            "progress=false", "method=llama3",
        ])  # fmt: skip
    return run(cfg)


def _folder(tmp_path, rows: pd.DataFrame, name: str = "r1"):
    """An experiment folder holding ``rows`` as one run's rows file; returns (folder, file)."""
    path = tmp_path / "exp" / "runs" / name / "rows.parquet"
    path.parent.mkdir(parents=True)
    rows.to_parquet(path)
    return tmp_path / "exp", path


def test_aggregate_names_the_file_with_a_column_the_schema_lacks(tmp_path, run_rows, capsys):
    rows = read_rows(run_rows)
    folder, path = _folder(tmp_path, rows.assign(extra_ms=1.0))
    with pytest.raises(SystemExit) as exc:
        aggregate_cli([str(folder)])
    assert exc.value.code == 2
    msg = capsys.readouterr().err
    assert msg.count("\n") == 1 and msg.startswith("python -m experiments.aggregate: error: ")
    assert str(path) in msg and "['extra_ms']" in msg and rows["run_id"].iloc[0] in msg, msg
    assert not (folder / "rows.parquet").exists()


@pytest.mark.parametrize("where", ["missing", "empty", "file"])
def test_aggregate_without_runs_is_one_line_exit_2(tmp_path, capsys, where):
    """A folder that does not exist, holds no runs, or is a file: one line, exit code 2."""
    folder = tmp_path / "exp"
    if where == "empty":
        folder.mkdir()
    elif where == "file":
        folder.write_text("")
    with pytest.raises(SystemExit) as exc:
        aggregate_cli([str(folder)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m experiments.aggregate: error: "), err
    assert str(folder) in err


def test_aggregate_names_the_file_with_a_bad_value(tmp_path, run_rows):
    rows = read_rows(run_rows)
    folder, bad_path = _folder(
        tmp_path, rows.astype({"num_pieces": "float64"}).assign(num_pieces=1.5)
    )
    with pytest.raises(ValueError, match="column 'num_pieces' must hold integers") as exc:
        aggregate(folder)
    assert str(exc.value).startswith(f"{bad_path}: "), exc.value


def test_aggregate_names_a_corrupt_file(tmp_path):
    path = tmp_path / "exp" / "runs" / "r1" / "rows.parquet"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=f"^{path}: "):
        aggregate(tmp_path / "exp")


def test_read_rows_names_the_file(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("run_id,cp_size\nx,abc\n")
    with pytest.raises(ValueError, match=f"^{path}: cannot read rows: "):
        read_rows(path)
    broken = tmp_path / "rows.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=f"^{broken}: cannot read rows: "):
        read_rows(broken)


def test_compare_names_the_summary_without_a_column(tmp_path, run_rows):
    folder, _ = _folder(tmp_path, read_rows(run_rows))
    aggregate(folder)
    old = tmp_path / "old"
    old.mkdir()
    pd.read_csv(folder / "summary.csv").drop(columns="total_ms_mean").to_csv(old / "summary.csv")
    with pytest.raises(ValueError, match=f"{old / 'summary.csv'} has no column"):
        compare(old, folder)


def test_plot_names_the_csv(tmp_path):
    exp = tmp_path / "fig7"
    exp.mkdir()
    shutil.copy("results/fig7/summary.csv", exp / "summary.csv")
    table = pd.read_csv(exp / "summary.csv")
    table[table.method != "llama3"].to_csv(exp / "summary.csv", index=False)
    with pytest.raises(ValueError, match=f"^{exp / 'summary.csv'}: fig7 plots speedup over"):
        draw("fig7", exp)
    table.drop(columns="speedup_vs_llama3").to_csv(exp / "summary.csv", index=False)
    with pytest.raises(
        ValueError, match=f"^{exp / 'summary.csv'} has no column 'speedup_vs_llama3'"
    ):
        draw("fig7", exp)


@pytest.fixture
def hw_dir(tmp_path, monkeypatch):
    """A copy of conf/hardware in which a test writes a broken profile."""
    import flashcp.sim.hardware as hardware

    folder = tmp_path / "hardware"
    shutil.copytree(hardware.hardware_dir(), folder)
    monkeypatch.setattr(hardware, "hardware_dir", lambda: folder)
    return folder


def test_hardware_profile_errors_name_the_yaml(hw_dir):
    from flashcp.sim.hardware import load_hardware

    (hw_dir / "bad.yaml").write_text("defaults: [h100_sxm, _self_]\nname: bad\nlaunch_us: -1\n")
    with pytest.raises(ValueError, match=f"{hw_dir / 'bad.yaml'}.*launch_us must be > 0"):
        load_hardware("bad", calibrated=False)
    (hw_dir / "bad.yaml").write_text("name: bad\nlaunch_us: [1\n")
    with pytest.raises(ValueError, match=f"^{hw_dir / 'bad.yaml'}: cannot read as YAML"):
        load_hardware("bad")


def test_fitted_constants_errors_name_the_file(tmp_path, monkeypatch):
    import flashcp.sim.hardware as hardware

    fitted = tmp_path / "fitted_constants.yaml"
    monkeypatch.setattr(hardware, "fitted_path", lambda: fitted)
    real = hardware.read_profile("h100_sxm")["calibration"]
    fitted.write_text("sections:\n" + "".join(f"  {s}: {{launch_us: abc}}\n" for s in real))
    with pytest.raises(ValueError, match=f"{fitted}: section .*launch_us = 'abc' is not a finite"):
        hardware.load_hardware("h100_sxm")
    fitted.write_text("sections:\n" + "".join(f"  {s}: {{nope_us: 1.0}}\n" for s in real))
    with pytest.raises(ValueError, match=f"{fitted}: fitted constants name unknown hardware key"):
        hardware.load_hardware("h100_sxm")


def test_advise_model_file_errors_name_the_file(tmp_path, monkeypatch):
    import flashcp.resources
    from flashcp.cli.advise import load_model

    conf = tmp_path / "conf"
    shutil.copytree(flashcp.resources.resource_path("conf") / "model", conf / "model")
    monkeypatch.setattr(flashcp.resources, "resource_path", lambda name: tmp_path / name)
    path = conf / "model" / "bad.yaml"
    path.write_text("name: bad\nnum_heads: 32\n")
    with pytest.raises(ValueError, match=f"^{path} has no num_kv_heads, head_dim, dtype$"):
        load_model("bad")
    path.write_text("name: bad\nnum_heads: [32\n")
    with pytest.raises(ValueError, match=f"^{path}: cannot read as YAML"):
        load_model("bad")
    path.write_text("name: bad\nnum_heads: 32\nnum_kv_heads: 5\nhead_dim: 128\ndtype: bfloat16\n")
    with pytest.raises(ValueError, match=f"^model 'bad' \\({path}\\): "):
        load_model("bad")
    with pytest.raises(ValueError, match=f"^model 'bad' \\({path} with num_kv_heads=7\\): "):
        load_model("bad", num_kv_heads=7)
