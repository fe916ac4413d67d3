"""Errors a person can read: each mistake on the ``flashcp-run`` command line is one line naming
the bad value and what to write instead (exit code 2); ``--help`` describes the groups and main
fields; Ctrl-C and SIGTERM end a sweep with one line, no traceback and no worker left behind."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("hydra", reason="the Hydra harness needs hydra-core and omegaconf")
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig

from experiments.common import launch
from experiments.common.entry import experiment_commands
from experiments.run import cli as main

REPO = Path(__file__).resolve().parents[2]
GROUPS = ("experiment", "dataset", "method", "model", "hardware", "executor")


def _entry(name: str):
    """The console entry point of experiment ``name`` (``experiments.<name>.cli``)."""
    import importlib

    return importlib.import_module(f"experiments.{name}").cli


@pytest.fixture(autouse=True)
def _isolate_hydra():
    """``main`` runs Hydra in this process: undo what it leaves behind (its config singleton,
    which would make later direct ``run(cfg)`` calls think they run under Hydra, and the logging
    handlers it installs on the captured streams)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    HydraConfig.instance().cfg = None
    GlobalHydra.instance().clear()
    root.handlers[:] = handlers
    root.setLevel(level)


def _flashcp_run(capsys, monkeypatch, *argv: str, entry=main) -> tuple[int, str, str]:
    """Run ``flashcp-run argv`` (or the console entry ``entry``) in this process; (exit code,
    stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["flashcp-run"])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as info:
        entry(list(argv))
    out = capsys.readouterr()
    return info.value.code, out.out, out.err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["method=nope"], "method=nope: no such option; choose one of flashcp, flashcp_node, flashcp_paper, flashcp_refined,"),
        (["hydra/launcher=nope"], "hydra/launcher=nope: no such option; choose one of basic, joblib,"),
        (["cp_sise=4"], "unknown key cp_sise (in cp_sise=4); did you mean cp_size?"),
        (["+cp_sise=4"], "unknown key cp_sise (in +cp_sise=4); did you mean cp_size?"),
        (["++cp_sise=4"], "unknown key cp_sise (in ++cp_sise=4); did you mean cp_size?"),
        (["-m", "+cp_sise=2,4"], "unknown key cp_sise (in +cp_sise=2,4); did you mean cp_size?"),
        (["model.num_hedas=3"], "did you mean model.num_heads or model.num_kv_heads"),
        (["+model.foo=1"], "unknown key model.foo (in +model.foo=1); keys in model: name, num_heads"),
        (["cp_size=abc"], "cp_size=abc: cp_size takes int, got 'abc'"),
        (["dataset.overlong=x"], "dataset.overlong takes one of split, cut, error, got 'x'"),
        (["dataset.weighting=bytes"], "dataset.weighting takes one of documents, tokens, got 'bytes'"),
        (["dataset.name=wlb"], "dataset.name takes one of wlb_llm, pile, redpajama, wlb_llm_synthetic, stress, file, got 'wlb'"),
        (["experiment=table2", "table2.num_sequences=2"], "experiment=table2 is its own command: flashcp-table2"),
        (["-m", "experiment=calibration"], "experiment=calibration is its own command: flashcp-calibration"),
        (["modes=[x"], "cannot parse 'modes=[x'"),
        (["method=flashcp,llama3"], "'method=flashcp,llama3'; add -m to sweep over it"),
        (["-m", "experiment=fig6,fig7"], "flashcp-run -m experiment=fig6; flashcp-run -m experiment=fig7"),
        (["-m", "name=a,b"], "name=a,b: a sweep merges its runs into one folder"),
        (["experiment=fig5"], "add -m (flashcp-run -m experiment=fig5), or hydra.sweeper.params=null"),
        (["hydra/launcher=joblib"], "a single run ignores it; add -m"),
        (["cp_size=0"], "cp_size must be >= 1, got 0"),
        # a head mismatch names where each count came from and the setting that fixes it
        (["method=ulysses", "model.num_heads=6", "cp_size=4"], "model.num_heads = 6 is not a multiple of model=h32's num_kv_heads = 32: set model.num_kv_heads= to a divisor of 6 (1, 2, 3, 6)"),
        (["model=h32kv8", "model.num_kv_heads=5"], "model=h32kv8's num_heads = 32 is not a multiple of model.num_kv_heads = 5"),
        # name= is one folder below results_dir: never outside it, never results_dir itself
        (["name=../../escape"], "name=../../escape is not one folder name"),
        (["name=a/b"], "name=a/b is not one folder name"),
        (["name=/tmp/abs"], "name=/tmp/abs is not one folder name"),
        (["name=.."], "name=.. is not one folder name"),
        (["name="], "name= is empty"),
        (["-m", "name=", "cp_size=2,4"], "name= is empty"),
        # a grid value no method takes is refused, not error rows beside the other runs
        (["grid.cp_size=[4,0]", "num_sequences=2"], "grid run cp_size=0: cp_size must be >= 1, got 0"),
        (["grid.cp_size=[-2,4]", "grid.method=[llama3,flashcp]"], "cp_size=-2: cp_size must be >= 1, got -2"),
        (["grid.method=[flashcp,flashcp]", "num_sequences=2", "name=dup"], "grid.method=[flashcp,flashcp] lists flashcp twice"),
        (["grid.cp_size=[4,8,4]"], "grid.cp_size=[4,8,4] lists 4 twice"),
        (["-m", "grid.model=[h16,h16]", "cp_size=2,4"], "grid.model=[h16,h16] lists h16 twice"),
        (["grid.cp_size=[4,3]", "context_len=4096"], "grid run cp_size=3: context_len = 4096 is not divisible by cp_size = 3"),
        (["modes=[train,train]"], "lists train twice"),
        (["method=ilp", "method.options.block_size=-3"], "block_size must be an integer >= 1, got -3"),
        (["method=ilp", "method.options.solver=glpk"], "solver must be one of ('cbc', 'highs'), got 'glpk'"),
        (["grid.method=[flashcp,flashcp_refined]", "method.options.target_imbalance=0.5"], "target_imbalance must be a number >= 1, got 0.5"),
        (["method=ilp", "method.options.threads=-1"], "threads must be an integer >= 1 or None, got -1"),
        (["executor=emulate", "executor.backend=nope"], "unknown attention backend executor.backend='nope'"),
        (["executor=emulate", "executor.iters=0"], "executor.iters >= 1"),
        (["context_len=4294967296"], "context_len = 4294967296 is above MAX_TOKENS = 2**31"),
        (["seed=-1"], "seed must be >= 0, got -1"),
        # a job whose rows would not fit in memory is refused before any work
        (["num_sequences=1000000000"], "num_sequences = 1000000000 makes 2000000000 rows (1 run(s) x 2 mode(s)), about 7629.4 GiB"),
        (["num_sequences=1000000000", "grid.cp_size=[4,8]"], "4000000000 rows (2 run(s) x 2 mode(s))"),
        # flashcp-run has no num_pad: its remedy is context_len
        (["method=llama3", "cp_size=4", "context_len=16388"], "(2 equal chunks per rank; use context_len = 16384 or 16392)"),
        # the suggested values suit the method's layout (llama3: 2 chunks per rank)
        (["method=llama3", "context_len=1000", "cp_size=3"], "use context_len = 996 or 1002)"),
        (["cp_size=4", "context_len=4099"], "not divisible by cp_size = 4: every rank must hold exactly context_len / cp_size tokens (use context_len = 4096 or 4100)"),
        (["cp_size=1000000000", "context_len=1000000000"], "cp_size = 1000000000 is above MAX_CP_SIZE = 2**16"),
        (["workers=100000"], "workers must be in [1, "),
        (["workers=0"], "got 0"),
        (["plots=[fig5,nope]"], "unknown figure 'nope'; choose from fig5, fig6, fig7, fig3, fig5_peers, fig5_step, scale"),
        (
            ["-m", "hydra/launcher=submitit_local", "executor=dist", "cp_size=4"],
            "make nodes x tasks_per_node = cp_size",
        ),
        # values only the job used to read: refused before the folder is made (a single run, and
        # a sweep whose jobs all share the value)
        (["dataset=file", "dataset.path=missing.csv"], "length file 'missing.csv' not found"),
        (["-m", "dataset=file", "dataset.path=missing.csv", "cp_size=2,4"], "length file 'missing.csv' not found"),
        (["dataset.cap=-1"], "dataset.cap = -1 must be >= 1"),
        (["-m", "dataset.cap=-1", "method=llama3,flashcp"], "dataset.cap = -1 must be >= 1"),
        (["hardware.p2p_bw_gbps=0"], "hardware constant p2p_bw_gbps must be > 0, got 0.0"),
        (["hardware.fwd_tile_tflops=-1"], "hardware constant fwd_tile_tflops must be > 0, got -1.0"),
        (["grid.hardware=[h100_sxm,a100_sxm]", "hardware.p2p_bw_gbps=0"], "hardware=h100_sxm: hardware constant p2p_bw_gbps must be > 0"),
        (["-m", "hardware.p2p_bw_gbps=0", "cp_size=2,4"], "hardware constant p2p_bw_gbps must be > 0"),
        (["dataset.overlong=error", "context_len=4096", "cp_size=4"], "has documents longer than context_len = 4096"),
        # an option set beside several methods applies to each: one that does not take it
        (["-m", "method=usp,flashcp,llama3", "method.options.ulysses_degree=2"],
         "method.options.ulysses_degree=2: methods flashcp, llama3 (in method=usp,flashcp,llama3) take no option 'ulysses_degree'"),
        (["-m", "method=usp,flashcp", "+method.options.ulysses_degree=2"],
         "set it on the methods that take it with flashcp-run -m method=usp +method.options.ulysses_degree=2"),
        (["grid.method=[usp,flashcp]", "method.options.ulysses_degree=2"],
         "method flashcp (in grid.method=[usp,flashcp]) takes no option 'ulysses_degree'"),
        (["-m", "grid.method=[usp,flashcp_ulysses],[flashcp]", "method.options.ulysses_degree=2"],
         "flashcp-run grid.method=[usp,flashcp_ulysses] method.options.ulysses_degree=2"),
        (["grid.method=[llama3]", "method.options.ulysses_degree=2"],
         "no method in grid.method=[llama3] takes option 'ulysses_degree'; drop it"),
        (["-m", "experiment=fig5", "method.options.target_imbalance=1.1"],
         "methods llama3_paper, per_doc_paper, ring_paper, zigzag_paper (in grid.method=[llama3_paper,per_doc_paper,ring_paper,zigzag_paper,flashcp_paper]) take no option 'target_imbalance'"),
            (["-m", "experiment=fig5_ours", "method.options.target_imbalance=1.1"],
             "methods llama3, per_doc, ring, zigzag (in grid.method=[llama3,per_doc,ring,zigzag,flashcp]) take no option 'target_imbalance'"),
    ],
)  # fmt: skip
def test_mistake_is_one_line_exit_2(capsys, monkeypatch, tmp_path, argv, expected):
    code, _, err = _flashcp_run(capsys, monkeypatch, *argv, f"results_dir={tmp_path}")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("flashcp-run: error: ") and expected in lines[0], lines[0]
    assert "base_" not in lines[0]  # the internal schemas are not choices
    assert not any(tmp_path.iterdir())  # refused before any job wrote anything


@pytest.mark.parametrize(
    ("entry", "argv"),
    [
        ("run", ["name=x"]),
        ("run", ["-m", "cp_size=2,4", "name=x"]),
        ("run", ["hydra.run.dir={file}/run"]),
        ("calibration", []),
        ("fig3", []),
        ("sensitivity", []),
        ("table2", []),
    ],
)
def test_unwritable_output_folder_is_one_line_exit_2(capsys, monkeypatch, tmp_path, entry, argv):
    """An output folder below a regular file (root writes anywhere else, so no chmod): one line
    naming the setting and the file, exit code 2, nothing written."""
    file = tmp_path / "file.txt"
    file.write_text("not a folder")
    argv = [a.format(file=file) for a in argv]
    if not any(a.startswith("hydra.run.dir") for a in argv):
        argv.append(f"results_dir={file}/sub")
    code, _, err = _flashcp_run(capsys, monkeypatch, *argv, entry=_entry(entry))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    prog = "flashcp-run" if entry == "run" else f"flashcp-{entry}"
    assert lines[0].startswith(f"{prog}: error: ") and f"{file} is a file, not a folder" in lines[0]
    assert "results_dir=" in lines[0] or "hydra.run.dir" in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_check_output_dir(tmp_path):
    from flashcp.results import check_output_dir

    file = tmp_path / "f"
    file.write_text("x")
    for bad in (file, file / "a" / "b"):
        with pytest.raises(
            ValueError, match=f"--out {bad}: cannot write the folder {bad}: .*a file"
        ):
            check_output_dir(bad, f"--out {bad}")
    check_output_dir(tmp_path / "new" / "deeper")  # creatable
    check_output_dir(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # the probe left nothing
    if os.geteuid() != 0:  # root writes into a read-only folder
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="takes no new entry"):
            check_output_dir(ro / "x")


def test_help_describes_every_group_and_the_main_fields(capsys, monkeypatch):
    code, out, _ = _flashcp_run(capsys, monkeypatch, "--help")
    assert code == 0
    for group in GROUPS:
        options = sorted(p.stem for p in (REPO / "conf" / group).glob("*.yaml"))
        line = next(x for x in out.splitlines() if x.strip().startswith(group))
        block = out[out.index(line) : out.index(line) + 400]
        missing = [o for o in options if o not in block]
        assert not missing, f"--help does not list {group} options {missing}"
    for launcher in ("basic", "joblib", "submitit_local", "submitit_slurm", "slurm", "slurm_dist"):
        assert launcher in out
    for field in ("cp_size=", "context_len=", "num_sequences=", "results_dir=", "method.options"):
        assert field in out
    assert "base_" not in out


@pytest.mark.parametrize(
    ("entry", "argv", "expected"),
    [
        ("table2", ["table2.num_sequences=2"], "unknown key table2 (in table2.num_sequences=2); keys at the top level: name,"),
        ("table2", ["dataset=wlb"], "dataset=wlb: no such option; choose one of file, pile,"),
        ("table2", ["highs_options.presolve=off"], "highs_options holds no key 'presolve' yet; add it with +highs_options.presolve=off"),
        ("table2", ["-m", "context_len=65536,131072"], "this sweep runs 2 jobs (over context_len) that would all write"),
        ("sensitivity", ["weightings=[bytes]"], "weightings[0] takes one of documents, tokens, got 'bytes'"),
        ("sensitivity", ["datasets=[pile,wlb]"], "datasets[1] takes one of wlb_llm, pile, redpajama, wlb_llm_synthetic, stress, file, got 'wlb'"),
        ("calibration", ["hydra/launcher=joblib"], "flashcp-calibration -m hydra/launcher=joblib"),
        ("sensitivity", ["dataset.path=x.txt"], "dataset.path=x.txt: the study samples a dataset config only when the command line selects one; add dataset=<name>"),
    ],
)  # fmt: skip
def test_experiment_entry_mistake_is_one_line_exit_2(
    capsys, monkeypatch, tmp_path, entry, argv, expected
):
    code, _, err = _flashcp_run(
        capsys, monkeypatch, *argv, f"results_dir={tmp_path}", entry=_entry(entry)
    )
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"flashcp-{entry}: error: ") and expected in lines[0], lines[0]
    assert not any(tmp_path.iterdir())  # refused before any job wrote anything


@pytest.mark.parametrize(
    ("entry", "argv", "expected"),
    [
        ("table2", ["num_sequences=0"], "num_sequences must be >= 1, got 0"),
        ("table2", ["gap=2"], "gap (relative) must be < 1, got 2"),
        ("table2", ["workers=100000"], "workers must be in [1, "),
        ("table2", ["dataset=file"], "dataset=file needs dataset.path="),
        ("table2", ["cp_size=4", "context_len=16388"], "(2 equal chunks per rank; use context_len = 16384 or 16392)"),
        ("sensitivity", ["methods=[zigzag]"], "must include llama3"),
        ("sensitivity", ["context_len=16392"], "(2 equal chunks per rank; use context_len = 16384 or 16400)"),
        ("sensitivity", ["context_len=16391"], "not divisible by cp_size = 8: every rank must hold exactly context_len / cp_size tokens (use context_len = 16384 or 16400)"),
        ("table2", ["cp_size=3", "context_len=1000"], "(use context_len = 996 or 1002)"),
        ("sensitivity", ["dataset=file"], "dataset=file needs dataset.path="),
        ("sensitivity", ["datasets=[file]"], "file needs a path; select it with dataset=file dataset.path="),
        ("sensitivity", ["datasets=[]"], "no data variant"),
    ],
)  # fmt: skip
def test_experiment_entry_bad_value_is_one_line_exit_2(
    capsys, monkeypatch, tmp_path, entry, argv, expected
):
    code, _, err = _flashcp_run(
        capsys, monkeypatch, *argv, f"results_dir={tmp_path}", entry=_entry(entry)
    )
    assert code == 2
    assert err.strip().splitlines() == [f"flashcp-{entry}: error: {expected}"] or (
        expected in err and err.strip().count("\n") == 0
    ), err
    assert not (tmp_path / entry / ".sweep.lock").exists()  # the folder is released


def test_every_experiment_entry_is_a_console_script():
    """Each primary config other than conf/config.yaml is an experiment with its own command: a
    console script calling its module's ``cli``, a module that registers its schema, no
    conf/experiment/<name>.yaml, and flashcp-run's refusal names the command."""
    import importlib

    import tomllib
    from hydra.core.config_store import ConfigStore

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["flashcp-run"] == "experiments.run:cli"
    commands = experiment_commands()
    primary = sorted(p.stem for p in (REPO / "conf").glob("*.yaml") if p.stem != "config")
    assert sorted(commands) == primary
    assert {"table2", "calibration", "sensitivity", "fig3"} <= set(commands)
    for config_name, prog in commands.items():
        assert scripts[prog] == f"experiments.{config_name}:cli"
        module = importlib.import_module(f"experiments.{config_name}")
        assert callable(module.cli) and module.PROG == prog
        assert ConfigStore.instance().load(f"base_{config_name}.yaml") is not None
        assert not (REPO / "conf" / "experiment" / f"{config_name}.yaml").exists()
        assert launch.moved_experiment_message(config_name).startswith(
            f"experiment={config_name} is its own command: {prog} "
        )


def test_experiment_entry_help_lists_its_fields(capsys, monkeypatch):
    """--help of every experiment entry lists its own fields (flashcp-fig3 runs end to end in
    tests/app/test_install.py, from the wheel)."""
    for entry, fields in [
        ("table2", ("num_sequences: 10", "time_limit_s: 60", "block_size: 1024", "dataset:")),
        ("calibration", ("results_dir: outputs",)),
        ("sensitivity", ("num_draws: 256", "datasets:", "hardware:")),
        ("fig3", ("cp_size: 8", "context_len: 131072", "model:")),
    ]:
        code, out, _ = _flashcp_run(capsys, monkeypatch, "--help", entry=_entry(entry))
        assert code == 0 and out.startswith(f"flashcp-{entry}: "), out[:200]
        assert all(f in out for f in fields) and "base_" not in out and "task" not in out


def test_experiment_entry_sweep_gives_each_job_its_folder(capsys, monkeypatch, tmp_path):
    """-m over an experiment entry with an interpolated name: one folder per job, and the jobs'
    results reach the sweep that locked its folder, so a failing job fails the command."""
    argv = ["-m", "model=h16,h32", "name=f3_${model.name}", "context_len=1004"]
    code, _, err = _flashcp_run(
        capsys, monkeypatch, *argv, f"results_dir={tmp_path}", entry=_entry("fig3")
    )
    assert code == 1 and "2 of 2 jobs failed" in err and "context_len = 1004" in err
    for model in ("h16", "h32"):  # each job logged in its own folder
        assert len(list((tmp_path / f"f3_{model}" / "runs").glob("*/fig3.log"))) == 1
    assert not list(tmp_path.rglob(".sweep.lock")) and not list(tmp_path.rglob(".sweep_jobs"))


@pytest.mark.parametrize("module", ["experiments.aggregate", "experiments.plot"])
def test_module_help_exits_0(module):
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:")


def _group_pids(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (Linux /proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # field 5 (pgrp), state not zombie
            pids.append(int(stat.parent.name))
    return pids


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize(
    ("signum", "to_group", "code", "line"),
    [
        (signal.SIGINT, True, 130, "flashcp-run: interrupted (Ctrl-C)"),  # a terminal's Ctrl-C
        (signal.SIGTERM, False, 143, "flashcp-run: terminated (SIGTERM)"),  # kill <pid>
    ],
)
def test_signal_ends_sweep_with_one_line_and_no_orphans(tmp_path, signum, to_group, code, line):
    cmd = [
        sys.executable, "-m", "experiments.run", "-m", "method=flashcp,llama3", "num_sequences=20000",
        "workers=2", f"results_dir={tmp_path}", "name=sig", "progress=false",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(_group_pids(proc.pid)) < 3:  # the run's two pool workers have started
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
            time.sleep(0.2)
        time.sleep(1.0)
        os.killpg(proc.pid, signum) if to_group else proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(line)
    deadline = time.monotonic() + 30  # the workers end with the run; poll, do not time them
    while _group_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _group_pids(proc.pid) == [], "worker processes outlived flashcp-run"
    assert not (tmp_path / "sig" / ".sweep.lock").exists()  # the next sweep starts cleanly


def test_launcher_in_experiment_config_needs_multirun(capsys, monkeypatch, tmp_path):
    """An experiment config may choose its launcher (Hydra honours it under -m); without -m a
    single run would ignore it, so that is refused."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "par.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /hydra/launcher: joblib\nname: par\n"
    )
    search = f"hydra.searchpath=[file://{tmp_path / 'conf'}]"
    code, _, err = _flashcp_run(
        capsys, monkeypatch, "experiment=par", search, f"results_dir={tmp_path / 'out'}"
    )
    assert code == 2 and err.strip().count("\n") == 0
    assert "hydra/launcher=joblib launches the jobs of a sweep" in err and "add -m" in err


def test_name_is_checked_resolved():
    """``name=`` is checked as it resolves: an interpolation naming one folder passes, one that
    resolves to a path does not."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(
        {"name": "f3_${model.name}", "model": {"name": "h32"}, "results_dir": "o"}
    )
    assert launch.name_problem(cfg) is None
    cfg.model.name = "../up"
    assert "name=f3_../up is not one folder name" in launch.name_problem(cfg)


def test_emulate_memory_refusal_writes_nothing(capsys, monkeypatch, tmp_path):
    """An ``executor=emulate`` job whose record pass would not fit the device is refused with one
    line before its folder is written (no rows, no summary, no runs/)."""
    import flashcp.executors.emulate_memory as emulate_memory

    # 1 MiB free
    monkeypatch.setattr(emulate_memory, "available_memory_bytes", lambda device: 2**20)
    code, _, err = _flashcp_run(
        capsys, monkeypatch, "executor=emulate", "cp_size=2",
        "dataset=pile", "method=zigzag", "num_sequences=2", "context_len=4096", "name=e4",
        f"results_dir={tmp_path}",
    )  # fmt: skip
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "executor=emulate: zigzag at cp_size = 2" in lines[0], err
    assert "but 0.0 GiB is available" in lines[0]
    assert not any(tmp_path.iterdir())
