"""The sbatch script of a multi-node ``executor=dist`` run (``python -m experiments.slurm_job``):
its Slurm request, and what its ``srun`` line really starts, run by bash with stand-ins for
``srun`` and ``scontrol`` that record their arguments (no cluster, nothing submitted)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from experiments.slurm_job import job_script, main

OVERRIDES = ["-m", "method=llama3,per_doc,flashcp", "dataset=pile", "num_sequences=20",
             "name=dist h100"]  # fmt: skip

#: stand-ins on PATH: scontrol lists two hosts; srun records its argv as JSON
SCONTROL = '#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "gpu-a17\\ngpu-a18\\n"\n'
SRUN = (
    f"#!{sys.executable}\n"
    "import json, os, sys\n"
    "open(os.environ['SRUN_LOG'], 'w').write(json.dumps(sys.argv[1:]))\n"
)


def test_script_asks_slurm_for_nodes_and_one_torchrun_per_node():
    text = job_script(OVERRIDES, nodes=2, gpus_per_node=8, partition="gpu", time_min=90)
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for opt in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--cpus-per-task=64",
                "--time=90", "--partition=gpu"):  # fmt: skip
        assert f"#SBATCH {opt}" in lines, opt
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in lines
    assert "--partition" not in job_script([], nodes=1, gpus_per_node=4)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_srun_line_starts_torchrun_with_the_rendezvous_on_the_first_node(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "job.sbatch"
    assert main(["--nodes", "2", "--gpus-per-node", "8", "--port", "29411", "--out",
                 str(script), "--", *OVERRIDES]) == 0  # fmt: skip
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "gpu-a[17-18]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
           "SRUN_LOG": str(tmp_path / "srun.json")}  # fmt: skip
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    argv = json.loads((tmp_path / "srun.json").read_text())
    assert argv[:4] == ["--kill-on-bad-exit=1", "python", "-m", "torch.distributed.run"]
    torchrun = argv[4 : argv.index("-m", 4)]
    assert torchrun == ["--nnodes", "2", "--nproc-per-node", "8", "--rdzv-id", "4242",
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu-a17:29411"]  # fmt: skip
    run = argv[argv.index("-m", 4) :]
    assert run == ["-m", "experiments.run", *OVERRIDES, "executor=dist", "cp_size=16",
                   "nodes=2", "placement=consecutive"]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--nodes", "0"], "nodes must be a positive integer, got 0"),
        (["--nodes", "2", "--port", "70000"], "port must be in 1..65535, got 70000"),
        (["--nodes", "2", "--", "cp_size=8"], "cp_size=8: the job script sets"),
        (["--nodes", "2", "--", "executor=sim"], "executor=sim: the job script sets"),
        (["--nodes", "2", "--", "+nodes=3"], "+nodes=3: the job script sets"),
    ],
)
def test_bad_options_are_one_line_exit_2(capsys, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err


def test_executor_options_pass_through():
    text = job_script(["executor.iters=5", "executor.backend=flash_attn"], nodes=2,
                      gpus_per_node=8)  # fmt: skip
    assert "executor.iters=5 executor.backend=flash_attn executor=dist cp_size=16" in text
