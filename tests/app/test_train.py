"""``flashcp-train``: a real 2-process CP 2 run under torchrun (gloo, 127.0.0.1) writes one row
per step whose losses equal a one-process CP 1 run of the same seed and batches (float64), and
bad values are refused in one line with exit code 2 before any process group is made.

Every command starts at once (``Popen``) and the test then waits for all of them: about 20 s on
2 busy cores instead of the sum of their start-ups."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd

from experiments.train import PHASES, TRAIN_ROW_SCHEMA

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


def test_cp2_under_torchrun_matches_one_process_and_bad_values_are_refused(tmp_path):
    lens = tmp_path / "lens.txt"
    lens.write_text("\n".join(str(x) for x in (1, 7, 40, 13, 2, 31, 25, 9, 18, 4)) + "\n")
    common = [*TINY, f"dataset.path={lens}", f"results_dir={tmp_path}"]
    port = _free_port()
    procs = {
        "cp2": _start(
            ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
             "127.0.0.1", "--master-port", str(port), "-m", "experiments.train", "cp_size=2",
             *common, "name=cp2"],
            _env(),
        ),
        "cp1": _start(["-m", "experiments.train", *common, "name=cp1"], _env()),
        # cp_size beyond the one process of a run without torchrun
        "bad_cp": _start(["-m", "experiments.train", "cp_size=2", *common, "name=b1"], _env()),
        # Ulysses over 4 ranks with 2 heads, as rank 0 of a 4-rank torchrun job: refused
        # before the rendezvous (nobody else ever joins it; a collective would wait its timeout)
        "bad_heads": _start(
            ["-m", "experiments.train", "cp_size=4", "method=ulysses", "llama.num_heads=2",
             "llama.num_kv_heads=2", "timeout_s=30", *common, "name=b2"],
            _env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(_free_port())),
        ),
    }  # fmt: skip
    done = {k: _wait(p) for k, p in procs.items()}

    for key in ("cp2", "cp1"):
        code, err = done[key]
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

    for key, words in {
        "bad_cp": ("cp_size = 2", "world size (1"),
        "bad_heads": ("method=ulysses at cp_size = 4", "does not divide num_heads = 2"),
    }.items():
        code, err = done[key]
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2, f"{key}: exit {code}\n{err[-3000:]}"
        assert len(lines) == 1 and lines[0].startswith("flashcp-train: error: "), err[-3000:]
        assert all(w in lines[0] for w in words), lines[0]
        assert not (tmp_path / f"b{1 if key == 'bad_cp' else 2}").exists()  # nothing written
