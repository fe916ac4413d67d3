"""``experiments/gpu_check.py`` as the GPU machine runs it: from the checkout, uninstalled, without
Hydra, OmegaConf, PuLP or HiGHS, every step doing work; and a step that did nothing fails the check.

The packages are hidden by ``FLASHCP_DEVICE_IMAGE`` (a command wrapper) when set, else by the
workplace's ``shared/tools/as-device-image`` beside the checkout when there is one, else by the
repository's own ``tests/device_image/as-device-image``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from experiments import gpu_check

REPO = Path(__file__).resolve().parents[2]
_SHARED = REPO.parent / "shared/tools/as-device-image"
TOOL = Path(
    os.environ.get("FLASHCP_DEVICE_IMAGE")
    or (_SHARED if _SHARED.is_file() else REPO / "tests/device_image/as-device-image")
)
STEPS = ("emulate", "fit", "pytest", "dist", "kernels")


@pytest.mark.skipif(not TOOL.is_file(), reason=f"no {TOOL} (the GPU machine's image stand-in)")
def test_quick_check_runs_every_step_as_on_the_gpu_machine(tmp_path):
    """The README's command, ``--quick``: exit code 0, every step ok, the GPU tests collected (and
    skipped without CUDA), rows in every table, the checkout's own code imported."""
    out = tmp_path / "gq"
    cmd = [str(TOOL), sys.executable, "experiments/gpu_check.py", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    summary = (out / "summary.md").read_text()
    for step in STEPS:
        assert f"| {step} | ok |" in summary, summary
    env = dict(ln.split(": ", 1) for ln in (out / "env.txt").read_text().splitlines())
    assert Path(env["flashcp_from"]) == REPO
    items = gpu_check.pytest_outcomes((out / "pytest_gpu.txt").read_text())
    assert len(items) >= 10 and set(items.values()) == {"SKIPPED"}
    assert any("test_emulate_on_cuda" in t for t in items)
    for name in ("emulate.csv", "emulate_vs_sim.csv", "fitted_constants.csv", "kernels.csv"):
        assert len(pd.read_csv(out / name)) > 0, name
    dist = pd.read_csv(out / "dist.csv")
    assert set(dist["method"]) == set(gpu_check.METHODS) and (dist["status"] == "ok").all()


def test_a_step_that_did_nothing_fails_the_check(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "kernel_rows", lambda *a, **k: [])
    code = gpu_check.main(
        ["--quick", "--skip", "emulate,fit,pytest,dist", "--out", str(tmp_path / "gq")]
    )
    assert code == 1
    summary = (tmp_path / "gq" / "summary.md").read_text()
    assert "| kernels | failed: RuntimeError: no kernel measured |" in summary
    assert "The check failed" in summary


def test_an_emulate_step_that_replayed_nothing_fails_the_check(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "emulate_rows", lambda *a, **k: ([], []))
    code = gpu_check.main(
        ["--quick", "--skip", "fit,pytest,dist,kernels", "--out", str(tmp_path / "gq")]
    )
    assert code == 1
    summary = (tmp_path / "gq" / "summary.md").read_text()
    assert "| emulate | failed: RuntimeError: no unit replayed (0 rows) |" in summary


def test_a_dist_step_that_wrote_no_row_fails_the_check(tmp_path, monkeypatch):
    def no_rows(cmd, timeout_s, log_path):  # torchrun "succeeded" and wrote an empty table
        out = Path(cmd[cmd.index("--out") + 1])
        pd.DataFrame(columns=["method", "mode", "status"]).to_csv(out, index=False)
        Path(log_path).write_text("")
        return 0, ""

    monkeypatch.setattr(gpu_check, "run_bounded", no_rows)
    code = gpu_check.main(
        ["--quick", "--skip", "emulate,fit,pytest,kernels", "--out", str(tmp_path / "gq")]
    )
    assert code == 1
    summary = (tmp_path / "gq" / "summary.md").read_text()
    assert (
        "| dist | failed: RuntimeError: executor=dist wrote no row; see dist_log.txt |" in summary
    )


def test_pytest_step_verdicts():
    ok = (
        "tests/test_a.py::test_x[1] SKIPPED (needs a CUDA GPU)\n= 1 skipped, 9 deselected in 1.0s ="
    )
    assert gpu_check.check_pytest(0, ok, on_gpu=False) == {"SKIPPED": 1}
    with pytest.raises(RuntimeError, match="no GPU test passed on the GPU"):
        gpu_check.check_pytest(0, ok, on_gpu=True)
    with pytest.raises(RuntimeError, match="collected no GPU test"):
        gpu_check.check_pytest(5, "= 40 deselected in 1.0s =", on_gpu=False)
    # modules skipped as a whole (no Hydra) are no GPU test either
    only_modules = "SKIPPED [1] tests/app/test_app.py:12: no hydra\n= 1 skipped in 1.0s ="
    with pytest.raises(RuntimeError, match="collected no GPU test"):
        gpu_check.check_pytest(0, only_modules, on_gpu=False)
    failed = "tests/test_a.py::test_x FAILED\n= 1 failed in 1.0s ="
    with pytest.raises(RuntimeError, match="exit code 1"):
        gpu_check.check_pytest(1, failed, on_gpu=True)


_CORE = """
import sys
import flashcp, flashcp.ops, flashcp.sim, flashcp.sim.calibration, flashcp.data
import flashcp.executors.dist, flashcp.executors.emulate, flashcp.executors.kernels
import flashcp.executors.sim
from flashcp.ops import get_attn_op
from flashcp.registry import make_plan_for, methods
for m in methods():
    if m.name != "ilp":  # the ILP planner needs PuLP
        make_plan_for(m.name, [300, 100, 600, 24], 4)
        get_attn_op(m.name)
hidden = [m for m in ("hydra", "omegaconf", "pulp", "highspy") if m in sys.modules]
assert not hidden, hidden
print(flashcp.__file__)
"""


@pytest.mark.skipif(not TOOL.is_file(), reason=f"no {TOOL} (the GPU machine's image stand-in)")
def test_the_library_core_imports_without_hydra_omegaconf_pulp():
    """Planners but the ILP, ops, executors, simulator and calibration on the GPU machine's image."""
    proc = subprocess.run(
        [str(TOOL), sys.executable, "-c", _CORE],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert Path(proc.stdout.strip()).resolve().parent.parent == REPO


def test_the_check_is_a_driver_over_the_executors_and_the_calibration_module():
    """No rows or fits of its own: the replays through ``execute("emulate")``, the predictions
    through ``execute("sim")``, the fit in ``flashcp.sim.calibration``, the kernel timings in
    ``flashcp.executors.kernels``."""
    import inspect

    src = inspect.getsource(gpu_check)
    for own in ("emulate_step", "simulate(", "CalibTarget", "fit_constants", "inspect.signature",
                "make_plan_for", "attention_kernel_ms("):  # fmt: skip
        assert own not in src, own
    for used in ('execute("emulate"', 'execute("sim"', "fit_replays(", "measure_kernels("):
        assert used in src, used


def test_fit_replays_recovers_the_kernel_rate_that_made_the_measurements():
    from dataclasses import replace

    import numpy as np

    from flashcp.comm import AttnShape
    from flashcp.executors import RunSpec
    from flashcp.sim import load_hardware, simulate
    from flashcp.sim.calibration import fit_replays, free_constants, replay_targets
    from flashcp.sim.impl import impl_plan

    hw = load_hardware("h100_sxm")
    true = replace(hw, fwd_tile_tflops=0.7 * hw.fwd_tile_tflops)
    shape = AttnShape(16, 16, 128, "bfloat16")
    replays = []
    for k, lens in enumerate([np.array([8192, 4096, 4096]), np.array([16384])]):
        run = RunSpec("flashcp", 2, shape, ("train",))
        plan, _ = impl_plan("flashcp", "ours", lens, 2)
        replays.append((f"u{k}", run, lens, simulate(plan, shape, true, "train")))
    assert len(replay_targets(replays, source="test")) == 6  # fwd, bwd, others per replay
    free = {"fwd_tile_tflops": (0.1 * hw.fwd_tile_tflops, hw.fwd_tile_tflops)}
    res, consts, fitted = fit_replays(replays, hw, free, source="test")
    assert fitted.fwd_tile_tflops == pytest.approx(true.fwd_tile_tflops, rel=0.02)
    assert list(consts["constant"]) == ["fwd_tile_tflops"] and len(res.table) == 6
    with pytest.raises(ValueError, match="'no_such' is not a numeric hardware constant"):
        free_constants("no_such", hw)
    with pytest.raises(ValueError, match="outside its bounds"):
        free_constants("launch_us=1000:2000", hw)


def test_quick_check_writes_outside_results_by_default(tmp_path, monkeypatch):
    """``--quick`` (and a full run on a CPU) writes to the git-ignored ``outputs/``; only the real
    run on CUDA writes the committed ``results/gpu_check``; ``--out`` wins over both."""
    import torch

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert gpu_check.default_out(True, cpu) == Path("outputs/gpu_check_quick")
    assert gpu_check.default_out(True, cuda) == Path("outputs/gpu_check_quick")
    assert gpu_check.default_out(False, cpu) == Path("outputs/gpu_check")
    assert gpu_check.default_out(False, cuda) == Path("results/gpu_check")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(gpu_check, "kernel_rows", lambda *a, **k: [])
    gpu_check.main(["--quick", "--skip", "emulate,fit,pytest,dist"])
    assert (tmp_path / "outputs" / "gpu_check_quick" / "summary.md").is_file()
    assert not (tmp_path / "results").exists()
