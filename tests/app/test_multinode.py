"""The real multi-node launch on one machine: two ``torchrun --nnodes 2 --nproc-per-node 2``
launches (node ranks 0 and 1, a c10d rendezvous on 127.0.0.1, gloo) run ``executor=dist`` for
every registered method, and their rows equal a one-node 4-rank launch's: the same plans, bytes
per kind and output checksums; bytes across nodes on every method, none on one node (the executor
checks every rank's bytes by link class against :func:`flashcp.comm.comm_volume_by_link`).
The three launches start at once and the test waits for all of them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("hydra", reason="experiments.run is a Hydra app")

from flashcp.comm import AttnShape
from flashcp.ops.collectives import COMM_KINDS
from flashcp.registry import method_names

REPO = Path(__file__).resolve().parents[2]
LENS = (5, 40, 3, 60, 1, 19, 22, 7, 33, 12)
C = 128
SHAPE = AttnShape(4, 4, 8, "float32")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_args(tmp_path: Path, name: str) -> list[str]:
    return [
        "-m", "experiments.run", "-m", f"method={','.join(method_names())}", "executor=dist",
        "executor.backend=cpu", "executor.warmup=0", "executor.iters=1",
        "executor.timeout_s=120", "cp_size=4", f"context_len={C}", "num_sequences=1",
        "modes=[train]", "dataset=file", f"dataset.path={tmp_path / 'lens.txt'}",
        f"model.num_heads={SHAPE.num_heads}", f"model.num_kv_heads={SHAPE.num_kv_heads}",
        f"model.head_dim={SHAPE.head_dim}", f"model.dtype={SHAPE.dtype}", "progress=false",
        f"results_dir={tmp_path}", f"name={name}",
    ]  # fmt: skip


def _start(args: list[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *args], cwd=REPO, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip


def test_two_node_launch_rows_equal_one_node(tmp_path):
    (tmp_path / "lens.txt").write_text("\n".join(map(str, LENS)) + "\n")
    port = _free_port()
    procs = {
        f"node{nr}": _start([
            "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(nr),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two",
            *_run_args(tmp_path, "two"),
        ])
        for nr in (0, 1)
    }  # fmt: skip
    procs["one"] = _start([
        "--nproc-per-node", "4", "--master-addr", "127.0.0.1", "--master-port",
        str(_free_port()), *_run_args(tmp_path, "one"),
    ])  # fmt: skip
    logs = {}
    for key, p in procs.items():
        try:
            logs[key] = p.communicate(timeout=240)[0]
        except subprocess.TimeoutExpired:
            for q in procs.values():
                q.kill()
            raise AssertionError(f"{key} timed out:\n{p.communicate()[0][-3000:]}") from None
        assert p.returncode == 0, f"{key}:\n{logs[key][-3000:]}"
    one = pd.read_parquet(tmp_path / "one" / "rows.parquet").sort_values("method")
    two = pd.read_parquet(tmp_path / "two" / "rows.parquet").sort_values("method")
    assert sorted(two["method"]) == sorted(method_names()) == sorted(one["method"])
    assert (one["status"] == "ok").all() and (two["status"] == "ok").all()
    same = ["method", "mode", "num_pieces", "comm_tokens", "pad_tokens", "out_checksum",
            *(f"{k}_bytes" for k in COMM_KINDS), "comm_bytes"]  # fmt: skip
    pd.testing.assert_frame_equal(
        one[same].reset_index(drop=True), two[same].reset_index(drop=True)
    )
    assert (one["nodes"] == 1).all() and (two["nodes"] == 2).all()  # the launch's, in the identity
    assert one["run_id"].isin(two["run_id"]).sum() == 0
    assert (one["inter_node_bytes"] == 0).all()
    assert (one["intra_node_bytes"] == one["comm_bytes"]).all()
    # every rank's bytes by link class were checked against comm_volume_by_link by the executor
    # (a mismatch fails the launch); per rank intra + inter = comm_bytes, each column the max
    # over ranks
    for row in two.itertuples():
        assert 0 < row.inter_node_bytes <= row.comm_bytes, row.method
        assert row.intra_node_bytes <= row.comm_bytes <= row.intra_node_bytes + row.inter_node_bytes


@pytest.fixture
def _isolate_hydra():
    """The command runs Hydra in this process: undo its config singleton and logging handlers."""
    import logging

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

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
        # rank 0 of a torchrun launch of 2 nodes x 2: refused before the rendezvous
        (["nodes=3"], {"LOCAL_WORLD_SIZE": "2"}, "cp_size 4 does not split evenly over num_nodes 3"),
        (["nodes=1"], {"LOCAL_WORLD_SIZE": "2"}, "puts 4 ranks on a node of gpus_per_node 2"),
        (["nodes=2", "placement=strided"], {"LOCAL_WORLD_SIZE": "2"},
         "puts the CP ranks on nodes [0, 1, 0, 1], but the launch put them on [0, 0, 1, 1]"),
        (["nodes=2"], {"LOCAL_WORLD_SIZE": "4"}, "but the launch put them on [0, 0, 0, 0]"),
        # a submitit job of 2 nodes x 2 tasks asked for 4 nodes
        (["-m", "nodes=4", "hydra/launcher=submitit_local", "hydra.launcher.nodes=2",
          "hydra.launcher.tasks_per_node=2"], None, "nodes=4, but hydra/launcher=submitit_local"),
    ],
)  # fmt: skip
@pytest.mark.usefixtures("_isolate_hydra")
def test_bad_topology_of_a_dist_launch_is_one_line_exit_2(
    capsys, monkeypatch, tmp_path, argv, env, words
):
    from experiments.run import cli

    if env is not None:
        for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", **env}.items():
            monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", ["flashcp-run"])
    with pytest.raises(SystemExit) as info:
        cli([*argv, "executor=dist", "cp_size=4", f"results_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and words in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.iterdir())  # refused before any job wrote anything
