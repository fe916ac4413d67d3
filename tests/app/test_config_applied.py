"""Configuration is applied as written or refused in one line, never dropped; rows and figures say
what was computed. Each test is built from a small example of the fault it guards against and one
more input of the same kind: explicit hardware constants against the fitted ones, grids that keep
the job's overrides, plain overrides of a gridded key, yes/no words for booleans,
``dataset.path`` without ``dataset=file``, the launcher in every row, a stacked bar with a missing
phase, the mode in Fig. 6's title, one sampler for every experiment, the tokens the length cap
drops, and the commands that were loud but broken (``solver=cbc``, duplicate modes, an unknown
method option, ``--compare``, ``--target-imbalance``)."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("hydra")
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

import experiments.plot as plot
from experiments.common.entry import check_experiment_config
from experiments.common.grid import ConfigError, _checked_runs, grid_runs, run_spec
from experiments.common.launch import explain_hydra_error, launch_problem
from experiments.common.rows import run_identity
from experiments.run import CONF_DIR, run, sample
from flashcp.config import register_configs
from flashcp.results import config_hash, read_rows
from flashcp.sim.hardware import load_hardware, read_fitted, read_profile

REPO = Path(__file__).resolve().parents[2]
SMALL = ("num_sequences=2", "context_len=16384", "cp_size=4", "progress=false", "dataset=pile")


def _compose(*overrides: str, config_name: str = "config", hydra_cfg: bool = False):
    register_configs()
    if config_name != "config":  # an experiment's module registers its schema
        importlib.import_module(f"experiments.{config_name}")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name, overrides=list(overrides), return_hydra_config=hydra_cfg)


def _small(tmp_path: Path, *overrides: str):
    return _compose(f"results_dir={tmp_path}", "name=t", *SMALL, *overrides)


# ---- explicit hardware constants win over the calibration ----------------------------------------

#: (constant, value, a method whose time depends on it): the issue's example and another of the
#: fitted constants
OVERRIDES = [("fwd_tile_tflops", 150.0, "flashcp"), ("bwd_cta_overhead_us", 1.0, "ring")]


@pytest.mark.parametrize(("key", "value", "method"), OVERRIDES)
def test_an_explicit_hardware_constant_wins_over_the_fitted_one(tmp_path, key, value, method):
    fitted = read_fitted(read_profile("h100_sxm")["calibration"])
    assert key in fitted and fitted[key] != value  # the calibration sets this constant
    hw = {**read_profile("h100_sxm"), key: value}
    assert getattr(load_hardware(hw), key) == value
    assert getattr(load_hardware("h100_sxm"), key) == fitted[key]  # unset: the fitted value
    plain = read_rows(run(_small(tmp_path, f"method={method}")))
    rows = read_rows(run(_small(tmp_path, f"method={method}", f"hardware.{key}={value}")))
    assert json.loads(rows["hardware_changes"].iloc[0]) == {key: value}
    # the hash is of the constants used, and the times are those of the overridden profile
    assert rows["hardware_sha256"].iloc[0] == config_hash(
        load_hardware(hw).to_dict(network=False)
    )  # one node
    assert rows["hardware_sha256"].iloc[0] != plain["hardware_sha256"].iloc[0]
    assert not np.allclose(rows["total_ms"], plain["total_ms"])


@pytest.fixture
def hydra_job():
    """Make a composed config (with its ``hydra`` node) the running Hydra job's, as under
    ``flashcp-run``; cleared afterwards."""
    from hydra.core.hydra_config import HydraConfig

    def start(*overrides: str):
        cfg = _compose(*overrides, hydra_cfg=True)
        HydraConfig.instance().set_config(cfg)
        return cfg

    yield start
    HydraConfig.instance().cfg = None


@pytest.mark.parametrize("key", ["fwd_tile_tflops", "bwd_cta_overhead_us"])
def test_a_constant_set_to_its_file_value_wins_too(hydra_job, monkeypatch, key):
    """hardware.<key>=<the YAML's start value> on the command line: that value, not the fitted."""
    import experiments.run as run_mod

    hw = read_profile("h100_sxm")
    value = hw[key]
    assert read_fitted(hw["calibration"])[key] != value
    cfg = hydra_job(*SMALL, "method=flashcp", f"hardware.{key}={value}")
    ident = run_identity(cfg, "v")
    assert json.loads(ident["hardware_changes"]) == {key: value}
    assert ident["hardware_sha256"] == config_hash(
        load_hardware(hw, explicit={key}).to_dict(network=False)
    )
    used = []
    real = run_mod.execute
    monkeypatch.setattr(run_mod, "execute", lambda *a, **k: used.extend(a[1]) or real(*a, **k))
    run_mod.execute_runs(cfg, [cfg], sample(cfg)[0])
    assert getattr(used[0].hardware, key) == value


def test_emulate_prices_with_the_explicit_hardware_constant(tmp_path):
    """executor=emulate prices communication with the profile: p2p_latency_us (fitted 14.998)
    set to 20 ms, far above the step's compute on the CPU, is exposed in p2p_ms."""
    common = (
        f"results_dir={tmp_path}", "cp_size=2", "context_len=256", "num_sequences=1",
        "dataset=pile", "method=ring", "model.num_heads=2", "model.num_kv_heads=2",
        "model.head_dim=8", "model.dtype=float32", "progress=false", "executor=emulate",
        "executor.backend=cpu", "executor.iters=1", "executor.warmup=0", "modes=[infer]",
    )  # fmt: skip
    plain = read_rows(run(_compose(*common, "name=a")))
    rows = read_rows(run(_compose(*common, "name=b", "hardware.p2p_latency_us=20000")))
    assert json.loads(rows["hardware_changes"].iloc[0]) == {"p2p_latency_us": 20000.0}
    hw = {**read_profile("h100_sxm"), "p2p_latency_us": 20000.0}
    assert rows["hardware_sha256"].iloc[0] == config_hash(
        load_hardware(hw).to_dict(network=False)
    )  # one node
    assert float(rows["p2p_ms"].iloc[0]) > float(plain["p2p_ms"].iloc[0])
    assert float(rows["p2p_ms"].iloc[0]) > 10  # one ring step of 20 ms, mostly exposed


def test_fig3_uses_the_explicit_hardware_constant(tmp_path):
    from experiments.fig3 import run_fig3

    tables = {}
    for extra in ((), ("hardware.fwd_tile_tflops=150",)):
        cfg = _compose(f"results_dir={tmp_path}", f"name=f{len(extra)}", *extra, config_name="fig3")
        tables[extra] = pd.read_csv(run_fig3(cfg))
    plain, mine = tables[()], tables[("hardware.fwd_tile_tflops=150",)]
    fwd = mine["pass"] == "forward"
    assert (mine.loc[fwd, "kernel_ms"] > plain.loc[fwd, "kernel_ms"]).all()  # 150 < fitted 354
    assert json.loads(mine["hardware_changes"].iloc[0]) == {"fwd_tile_tflops": 150.0}
    assert mine["hardware_sha256"].iloc[0] != plain["hardware_sha256"].iloc[0]


def test_sensitivity_varies_the_explicit_hardware_constant(monkeypatch, tmp_path):
    import experiments.sensitivity as sens

    seen = []
    real = sens.perturb
    monkeypatch.setattr(sens, "perturb", lambda hw, f: seen.append(hw) or real(hw, f))
    cfg = _compose(
        "hardware.fwd_tile_tflops=150", "num_sequences=1", "num_draws=2", "datasets=[pile]",
        "methods=[llama3,flashcp]", "context_len=16384", "cp_size=4", config_name="sensitivity",
    )  # fmt: skip
    sens.run_sensitivity(cfg, tmp_path)
    assert seen and all(hw.fwd_tile_tflops == 150.0 for hw in seen)


# ---- a grid keeps the job's overrides ----------------------------------------------------------


def test_grid_model_keeps_model_overrides():
    extra = ("model.num_kv_heads=8", "model.head_dim=64")
    runs = grid_runs(_compose(*SMALL, "grid.model=[h16,h32]", *extra))
    assert [(r.model.num_heads, r.model.num_kv_heads, r.model.head_dim) for r in runs] == [
        (16, 8, 64), (32, 8, 64)
    ]  # fmt: skip
    for r in runs:  # the run the overrides model=<name> model.num_kv_heads=8 ... compose
        alone = _compose(*SMALL, f"model={r.model.name}", *extra)
        assert run_identity(r, "v") == run_identity(alone, "v")


def test_grid_hardware_keeps_and_records_hardware_overrides():
    runs = grid_runs(
        _compose(*SMALL, "grid.hardware=[h100_sxm,a100_sxm]", "hardware.p2p_bw_gbps=50")
    )
    for r in runs:
        assert r.hardware.p2p_bw_gbps == 50
        assert json.loads(run_identity(r, "v")["hardware_changes"]) == {"p2p_bw_gbps": 50.0}
        alone = _compose(*SMALL, f"hardware={r.hardware.name}", "hardware.p2p_bw_gbps=50")
        assert run_identity(r, "v") == run_identity(alone, "v")


def test_grid_keeps_an_override_equal_to_the_jobs_own_file(hydra_job):
    """hardware.p2p_bw_gbps=130 is h100_sxm's own value, so no diff shows it; typed on the command
    line it still applies to a100_sxm (87 in its file) and is recorded."""
    cfg = hydra_job(*SMALL, "grid.hardware=[h100_sxm,a100_sxm]", "hardware.p2p_bw_gbps=130")
    runs = grid_runs(cfg)
    assert [r.hardware.p2p_bw_gbps for r in runs] == [130.0, 130.0]
    a100 = json.loads(run_identity(runs[1], "v")["hardware_changes"])
    assert a100 == {"p2p_bw_gbps": 130.0}


def test_grid_method_keeps_impl_and_options_and_checks_each_method():
    # method.impl=ring_flash_attn is checked against ring and zigzag, not the default flashcp
    runs = _checked_runs(
        _compose(*SMALL, "grid.method=[ring,zigzag]", "method.impl=ring_flash_attn")
    )
    assert [(r.method.name, r.method.impl) for r in runs] == [
        ("ring", "ring_flash_attn"), ("zigzag", "ring_flash_attn")
    ]  # fmt: skip
    runs = _checked_runs(
        _compose(
            *SMALL, "grid.method=[flashcp,flashcp_refined]", "method.options.target_imbalance=1.2"
        )
    )
    assert [r.method.options.target_imbalance for r in runs] == [1.2, 1.2]
    # an override one method of the grid cannot take: refused in one line naming that method
    with pytest.raises(ConfigError, match=r"grid run method=flashcp: .*ring_flash_attn"):
        _checked_runs(_compose(*SMALL, "grid.method=[ring,flashcp]", "method.impl=ring_flash_attn"))
    with pytest.raises(
        ConfigError,
        match=r"method llama3 \(in grid.method=\[llama3,flashcp\]\) takes no option "
        r"'target_imbalance'.* grid.method=\[flashcp\] method.options.target_imbalance=1.2",
    ):
        _checked_runs(
            _compose(*SMALL, "grid.method=[llama3,flashcp]", "method.options.target_imbalance=1.2")
        )


def test_experiment_grids_keep_model_overrides():
    cfg = _compose("experiment=fig5", "model.num_kv_heads=8", "model.dtype=float32")
    runs = grid_runs(cfg)
    assert len(runs) == 20
    assert {(r.model.num_kv_heads, r.model.dtype) for r in runs} == {(8, "float32")}
    runs = grid_runs(_compose("experiment=fig6", "model.head_dim=64"))
    assert {r.model.head_dim for r in runs} == {64}


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [(("experiment=fig5", "cp_size=2", "method=ring", "model=h16"), r"write grid.cp_size=\[2\]"),
     (("experiment=fig6", "method=ring"), r"write grid.method=\[ring\]"),
     (("grid.model=[h16,h32]", "model=h16"), r"write grid.model=\[h16\]")],
)  # fmt: skip
def test_a_plain_override_of_a_gridded_key_is_refused(overrides, needle):
    problem = launch_problem(_compose(*overrides, hydra_cfg=True), multirun=True)
    assert problem is not None and "\n" not in problem
    assert re.search(needle, problem), problem
    if overrides[0] == "experiment=fig5":  # a key the grid does not vary is not refused
        assert launch_problem(_compose("experiment=fig5", "seed=3", hydra_cfg=True), True) is None


# ---- yes/no words reach the planner as booleans ------------------------------------------------


@pytest.mark.parametrize(
    ("key", "override"),
    [("lns", "method.options.lns=no"), ("lp_rounding", "+method.options.lp_rounding=off")],
)
def test_boolean_words_reach_the_planner_as_booleans(key, override):
    from flashcp.registry import get_planner

    cfg = _compose("method=ilp", "context_len=8192", "cp_size=2", override)
    (r,) = _checked_runs(cfg)
    opts = run_spec(r).options
    assert opts[key] is False
    words = json.loads(run_identity(r, "v")["method_options"])[key]
    assert words is False  # the same run as method.options.<key>=false
    if key == "lns":
        opts.update(time_limit_s=5, solver="highs")
        plan = get_planner("ilp")([3000, 2000, 1500, 1692], 2, **opts)
        assert plan.info["lns"] is False


# ---- dataset.path without dataset=file ---------------------------------------------------------


def test_dataset_path_without_dataset_file_is_refused(tmp_path):
    for overrides in (("dataset.path=x.txt",), ("dataset=pile", "dataset.path=x.txt")):
        problem = launch_problem(_compose(*overrides, hydra_cfg=True), multirun=False)
        assert problem is not None and "add dataset=file" in problem and "\n" not in problem
    lengths = tmp_path / "x.txt"
    lengths.write_text("1000\n2000\n")
    cfg = _compose("dataset=file", f"dataset.path={lengths}", hydra_cfg=True)
    assert launch_problem(cfg, multirun=False) is None
    # a sweep whose jobs include dataset=file: the other datasets' jobs do not read the path
    cfg.dataset.name = "pile"
    cfg.hydra.overrides.task = ["dataset=pile,file", f"dataset.path={lengths}"]
    assert launch_problem(cfg, multirun=True) is None


# ---- provenance: the launcher ------------------------------------------------------------------


def test_rows_record_their_launcher(tmp_path):
    from omegaconf import OmegaConf

    from experiments.common.rows import launcher_name

    for target, name in [
        ("hydra._internal.core_plugins.basic_launcher.BasicLauncher", "basic"),
        ("hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "joblib"),
        ("hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher", "submitit_local"),
        ("hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher", "submitit_slurm"),
    ]:
        assert launcher_name(OmegaConf.create({"launcher": {"_target_": target}})) == name
    assert set(read_rows(run(_small(tmp_path, "method=llama3")))["launcher"]) == {"direct"}
    cmd = [sys.executable, "-m", "experiments.run", "-m", f"results_dir={tmp_path}", "name=m",
           "num_sequences=1", "context_len=8192", "cp_size=2", "progress=false", "method=llama3",
           "seed=1"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert set(read_rows(tmp_path / "m" / "rows.parquet")["launcher"]) == {"basic"}


# ---- Fig. 6: a missing phase is marked, the title names the mode ---------------------------------


def _fig6_summary(mode: str) -> pd.DataFrame:
    rows = []
    for m, ag in (("llama3", 2.0), ("flashcp", 1.0)):
        rows.append({
            "dataset": "pile", "method": m, "mode": mode, "cp_size": 8, "num_heads": 32,
            "allgather_ms_mean": ag, "attn_fwd_ms_mean": 3.0, "attn_bwd_ms_mean": 0.0,
            "reducescatter_ms_mean": 0.0, "p2p_ms_mean": 0.0, "others_ms_mean": 0.5,
            "total_ms_mean": ag + 3.5,
        })  # fmt: skip
    return pd.DataFrame(rows)


@pytest.mark.parametrize(("phase", "label"), [("others_ms_mean", "Others"),
                                              ("allgather_ms_mean", "AllGather")])  # fmt: skip
def test_fig6_marks_a_missing_phase(tmp_path, monkeypatch, phase, label):
    summary = _fig6_summary("train")
    summary.loc[summary["method"] == "flashcp", phase] = np.nan
    marked = []
    monkeypatch.setattr(
        plot, "_mark_missing_phases", lambda ax, x, lo, hi, ph: marked.append((x, lo, hi, ph))
    )
    plot.plot_fig6(summary, tmp_path / "fig6.png")
    assert len(marked) == 1
    x, lo, hi, phases = marked[0]
    assert x == 1 and phases == [label] and hi == 4.5 and lo < hi  # the gap is the missing phase


@pytest.mark.parametrize(("mode", "title"), [("infer", "inference"), ("train", "training")])
def test_fig6_title_names_the_mode_drawn(tmp_path, monkeypatch, mode, title):
    figs = []
    monkeypatch.setattr(plot.plt, "close", lambda fig: figs.append(fig))
    plot.plot_fig6(_fig6_summary(mode), tmp_path / "fig6.png")
    text = figs[0]._suptitle.get_text()
    assert text.startswith(f"Latency breakdown, {title}"), text
    plot.plt.close("all")


# ---- one sampler; the tokens the cap drops ---------------------------------------------------------


class _Constant:
    """Every draw has ``length`` tokens (a length distribution's sampling interface)."""

    name = "constant"

    def __init__(self, length: int):
        self.length = length

    def sample(self, rng, size, *, weighting="documents", cap=None):
        rng.random(size)
        out = np.full(size, self.length, dtype=np.int64)
        return out if cap is None else np.minimum(out, cap)

    def cdf(self, x):
        return float(x >= self.length)


@pytest.mark.parametrize(
    ("length", "c", "cut", "split"),
    [(100_000, 16384, 83_616, 100_000 - 4 * 16384), (50_000, 8192, 41_808, 50_000 - 4 * 8192)],
)
def test_overlong_tokens_cut_counts_what_the_cap_drops(length, c, cut, split):
    from flashcp.data import OverlongDocs, sample_packed

    for policy, lost in (("cut", cut), ("split", split)):
        over = OverlongDocs(_Constant(length), c, policy)
        _, offsets = sample_packed(over, 5, c, seed=0, cap=over.cap)
        counts = over.per_sequence(offsets)
        # every sequence of cut holds one draw; under split a draw's 4 pieces fill 4 sequences and
        # its loss to the cap is counted once, on its first piece
        got = [x["overlong_tokens_cut"] for x in counts]
        assert got == ([lost] * 5 if policy == "cut" else [lost, 0, 0, 0, lost]), (policy, got)
        assert all(x["overlong_docs"] == 1 for x in counts)


def test_a_run_reports_the_tokens_the_cap_drops(tmp_path):
    lens = tmp_path / "lens.txt"
    lens.write_text("100000\n")
    for policy, lost in (("cut", 83_616), ("split", 34_464)):
        rows = read_rows(run(_small(tmp_path, "dataset=file", f"dataset.path={lens}",
                                    f"dataset.overlong={policy}", "method=llama3", "num_sequences=1")))  # fmt: skip
        assert set(rows["overlong_tokens_cut"]) == {lost}, policy


def _planner_inputs(monkeypatch) -> list[list[int]]:
    """Record the document lengths every planner is given (flashcp.registry.get_planner)."""
    import flashcp.registry as registry

    seen: list[list[int]] = []
    real = registry.get_planner

    def get_planner(name):
        planner = real(name)
        return lambda d, *a, **k: seen.append(list(map(int, d))) or planner(d, *a, **k)

    monkeypatch.setattr(registry, "get_planner", get_planner)
    return seen


@pytest.mark.parametrize(("dataset", "c"), [("redpajama", 16384), ("wlb_llm", 32768)])
def test_table2_and_sensitivity_sample_the_sequences_of_flashcp_run(
    tmp_path, monkeypatch, dataset, c
):
    import experiments.sensitivity as sens
    import experiments.table2 as t2
    import flashcp.planners.ilp as ilp
    from flashcp.data import load_distribution, sample_sequences
    from flashcp.registry import make_plan_for

    want = [list(map(int, s)) for s in sample(_small(tmp_path, f"dataset={dataset}",
                                                     f"context_len={c}", "num_sequences=4"))[0]]  # fmt: skip
    old = sample_sequences(load_distribution(dataset, context_len=c), 4, c, seed=0)
    assert any(list(map(int, o)) != w for o, w in zip(old, want, strict=True))  # split matters here
    seen = _planner_inputs(monkeypatch)
    # the ILP is not what is checked: its row is flashcp's plan
    monkeypatch.setattr(ilp, "plan_ilp", lambda d, n, **k: make_plan_for("flashcp", d, n))
    t2.run_table2(
        num_sequences=4, context_len=c, cp_size=4, dataset=dataset, out_dir=str(tmp_path / "t2")
    )
    table2_seqs = list(dict.fromkeys(map(tuple, seen)))  # each sequence in order, once
    assert [list(s) for s in table2_seqs] == want
    seen.clear()
    cfg = _compose("num_sequences=4", "num_draws=2", f"datasets=[{dataset}]",
                   "methods=[llama3,flashcp]", f"context_len={c}", "cp_size=4",
                   config_name="sensitivity")  # fmt: skip
    sens.run_sensitivity(cfg, tmp_path / "s")
    # its data variants <dataset>/documents, then <dataset>/tokens: flashcp-run's with that weighting
    tokens = [list(map(int, s)) for s in sample(_small(tmp_path, f"dataset={dataset}",
              f"context_len={c}", "num_sequences=4", "dataset.weighting=tokens"))[0]]  # fmt: skip
    # each variant's sequences are planned once per method (llama3, flashcp), in order
    assert seen == want + want + tokens + tokens


# ---- loud but broken -----------------------------------------------------------------------------


def test_table2_runs_with_cbc_and_highs_options_can_be_cleared(tmp_path):
    from experiments.table2 import check_table2_config, table2_from_config

    base = (f"results_dir={tmp_path}", "num_sequences=1", "context_len=4096", "cp_size=2",
            "time_limit_s=10", "block_size=512")  # fmt: skip
    cfg = _compose(*base, "solver=cbc", config_name="table2")
    check_table2_config(cfg)
    rows = pd.read_csv(table2_from_config(cfg).with_name("table2_rows.csv"))
    ilp = rows[rows["method"] == "ilp"]
    assert (ilp["ilp_solver"] == "cbc").all() and ilp["ilp_highs_options"].isna().all()
    assert _compose(*base, "highs_options=null", config_name="table2").highs_options is None
    bad = _compose(*base, "solver=cbc", "highs_options={mip_heuristic_effort: 0.5}",
                   config_name="table2")  # fmt: skip
    with pytest.raises(ValueError, match="are HiGHS options and solver=cbc"):
        check_table2_config(bad)


def test_duplicate_modes_are_refused(tmp_path):
    for modes in ("[train,train]", "[infer,train,infer]"):
        with pytest.raises(ConfigError, match="twice"):
            run(_small(tmp_path, f"modes={modes}"))
    with pytest.raises(ValueError, match="infer twice"):
        check_experiment_config(_compose("modes=[infer,infer]", config_name="sensitivity"))
    assert not (tmp_path / "t" / "runs").exists()


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [(("method.options.lp_rounding=off",), "method 'flashcp' has no option 'lp_rounding'; its options: target_imbalance"),
     (("method=ilp", "method.options.lp_roundin=off"), "did you mean lp_rounding? its options: block_size"),
     (("method=ilp", "method.options.lp_rounding=off"), "add it with +method.options.lp_rounding=off")],
)  # fmt: skip
def test_an_unknown_method_option_lists_the_valid_ones(overrides, needle):
    with pytest.raises(ConfigCompositionException) as info:
        _compose(*overrides)
    line = explain_hydra_error(info.value)
    assert line is not None and needle in line and "\n" not in line, line


def test_compare_prints_a_line_per_changed_run(tmp_path):
    from experiments.aggregate import aggregate, compare, compare_report

    for method in ("llama3", "flashcp", "per_doc"):
        run(_compose(f"results_dir={tmp_path}", "name=ref", *SMALL, f"method={method}"))
    aggregate(tmp_path / "ref")
    new = tmp_path / "new"
    new.mkdir()
    summary = pd.read_csv(tmp_path / "ref" / "summary.csv")
    summary["code_version"] = "other"
    summary.loc[summary["method"] == "flashcp", "total_ms_mean"] *= 1.5
    summary.loc[(summary["method"] == "per_doc") & (summary["mode"] == "train"), "total_ms_mean"] *= 0.5  # fmt: skip
    summary.to_csv(new / "summary.csv", index=False)
    lines = compare_report(compare(tmp_path / "ref", new))
    changed = [x for x in lines if x.startswith("changed: ")]
    assert len(changed) == 3  # flashcp train and infer, per_doc train; llama3 and per_doc infer not
    assert sum("method=flashcp" in x and "+50.000%" in x for x in changed) == 2
    assert (
        sum("method=per_doc" in x and "mode=train" in x and "-50.000%" in x for x in changed) == 1
    )
    assert "3 of 6 runs in both changed" in lines
