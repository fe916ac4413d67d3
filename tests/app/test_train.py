"""``flashcp-train``: a real 2-process CP 2 run under torchrun (gloo, 127.0.0.1) writes one row
per step whose losses equal a one-process CP 1 run of the same seed and batches (float64), and
bad values are refused in one line with exit code 2 before any process group is made.

The two runs start at once (``Popen``) and the test then waits for both; the refusals run the
command in this process (as tests/app/test_errors.py does)."""

from __future__ import annotations

import logging
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip(
    "hydra", reason="flashcp-train is a Hydra app (the GPU machine's image has none)"
)
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig

from experiments.train import PHASES, TRAIN_ROW_SCHEMA, cli

REPO = Path(__file__).resolve().parents[2]
#: a tiny float64 run: 3 steps of C = 128 tokens (documents of 1 to 40 tokens)
TINY = [
    "steps=3", "context_len=128", "dtype=float64", "seed=3", "progress=false", "lr=1e-2",
    "dataset=file",
]  # fmt: skip
#: CP 2 vs CP 1, float64: the same sums in other orders (the ops' blocks, the all-reduces)
TOL = 1e-10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args], cwd=REPO, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def _wait(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"timed out: {proc.args}\n{err[-3000:]}") from None
    return proc.returncode, err


def _lens_file(tmp_path: Path) -> Path:
    lens = tmp_path / "lens.txt"
    lens.write_text("\n".join(str(x) for x in (1, 7, 40, 13, 2, 31, 25, 9, 18, 4)) + "\n")
    return lens


def test_cp2_under_torchrun_matches_one_process(tmp_path):
    common = [*TINY, f"dataset.path={_lens_file(tmp_path)}", f"results_dir={tmp_path}"]
    procs = {
        "cp2": _start(
            ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
             "127.0.0.1", "--master-port", str(_free_port()), "-m", "experiments.train",
             "cp_size=2", *common, "name=cp2"],
            _env(),
        ),
        "cp1": _start(["-m", "experiments.train", *common, "name=cp1"], _env()),
    }  # fmt: skip
    done = {k: _wait(p) for k, p in procs.items()}
    for key, (code, err) in done.items():
        assert code == 0, f"{key}: {err[-3000:]}"
    cp2 = pd.read_csv(tmp_path / "cp2" / "train_rows.csv")
    cp1 = pd.read_csv(tmp_path / "cp1" / "train_rows.csv")
    assert list(cp2.columns) == list(TRAIN_ROW_SCHEMA) == list(cp1.columns)
    assert cp2["step"].tolist() == [1, 2, 3] and cp1["step"].tolist() == [1, 2, 3]
    assert (cp2["cp_size"] == 2).all() and (cp2["world_size"] == 2).all()
    assert (cp1["cp_size"] == 1).all() and (cp2["dist_backend"] == "gloo").all()
    assert (cp2["method"] == "flashcp").all() and cp2["git_commit"].notna().all()
    assert cp2["config_hash"].nunique() == 1 and cp2["config_hash"][0] != cp1["config_hash"][0]
    for col in ["loss", "tokens_per_s", *(f"{p}_ms" for p in PHASES)]:
        assert cp2[col].map(math.isfinite).all() and (cp2[col] >= 0).all(), col
    assert (cp2["step_ms"] > cp2["forward_ms"] + cp2["backward_ms"]).all()
    assert (cp2["tokens"] == 128).all() and (cp2["valid_tokens"] < 128).all()
    # the same batches, so the same valid tokens; the losses of every step (the model after 1
    # and 2 AdamW steps included) equal the one-process run's
    assert cp2["valid_tokens"].tolist() == cp1["valid_tokens"].tolist()
    diff = (cp2["loss"] - cp1["loss"]).abs().max()
    assert diff <= TOL, f"CP 2 losses differ from CP 1 by {diff}"
    assert cp1["loss"].iloc[0] > 3.0  # about log(64): an untrained model, a real loss


@pytest.fixture
def _isolate_hydra():
    """The command runs Hydra in this process: undo its config singleton and logging handlers."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    HydraConfig.instance().cfg = None
    GlobalHydra.instance().clear()
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize(
    ("argv", "env", "words"),
    [
        # cp_size beyond the one process of a run without torchrun
        (["cp_size=2"], {}, ("cp_size = 2", "world size (1")),
        # Ulysses over 4 ranks with 2 heads, as rank 0 of a 4-rank torchrun job: refused before
        # the rendezvous (nobody else ever joins it: a collective would wait its timeout)
        (
            ["cp_size=4", "method=ulysses", "llama.num_heads=2", "llama.num_kv_heads=2"],
            {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1"},
            ("method=ulysses at cp_size = 4", "does not divide num_heads = 2"),
        ),
        (["method=nope"], {}, ("method=nope: no such option",)),
    ],
    ids=["cp_size", "heads", "method"],
)
def test_bad_values_are_refused_before_any_work(
    tmp_path, capsys, monkeypatch, _isolate_hydra, argv, env, words
):
    import torch.distributed as dist

    monkeypatch.setattr(sys, "argv", ["flashcp-train"])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    for key, value in {**env, "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as info:
        cli(
            [
                *TINY,
                f"dataset.path={_lens_file(tmp_path)}",
                f"results_dir={tmp_path}",
                "name=b",
                *argv,
            ]
        )
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert info.value.code == 2, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("flashcp-train: error: "), err[-3000:]
    assert all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "b").exists() and not dist.is_initialized()  # nothing written or joined
