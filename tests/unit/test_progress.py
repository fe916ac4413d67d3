"""Long work says what it is doing: ``executor=emulate`` logs the device it replays on and counts
its replays on a progress bar, and ``executor=sim`` moves its bar per sequence when a planner is
slow (the ILP); bars go through tqdm on a terminal only (flashcp.executors.progress)."""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest
import torch

from flashcp.comm import AttnShape
from flashcp.executors import RunSpec, execute
from flashcp.executors.progress import progress_bar
from flashcp.sim import load_hardware

SHAPE = AttnShape(2, 2, 8, "float32")
SEQS = [np.array([10, 6]), np.array([16]), np.array([3, 5, 8])]


@pytest.fixture
def bars(monkeypatch):
    """Every tqdm bar opened, as ``[total, unit, [updates]]``, with stderr a terminal."""
    import tqdm

    opened = []

    class FakeTqdm:
        def __init__(self, total, desc, unit, **kwargs):
            self.record = [total, unit, []]
            opened.append(self.record)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n=1):
            self.record[2].append(n)

    monkeypatch.setattr(tqdm, "tqdm", FakeTqdm)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    return opened


def test_no_bar_without_a_label_or_a_terminal(bars, monkeypatch):
    with progress_bar(3, None) as bar:
        bar.update(1)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    with progress_bar(3, "job") as bar:
        bar.update(1)
    assert bars == []


def test_emulate_logs_its_device_and_counts_every_replay(bars, caplog, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run = RunSpec("zigzag", 2, SHAPE, ("train", "infer"), hardware=load_hardware("h100_sxm"),
                  executor={"backend": "cpu", "warmup": 0, "iters": 1})  # fmt: skip
    with caplog.at_level(logging.INFO, logger="flashcp.executors.emulate"):
        rows = execute("emulate", [run], SEQS, progress="job")
    assert (rows["status"] == "ok").all() and len(rows) == 6
    lines = [r.getMessage() for r in caplog.records if "executor=emulate" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("executor=emulate: replaying on cpu (no CUDA device): 3 sequences")
    assert bars == [[6, "step", [1] * 6]]  # one step per (sequence, mode)


@pytest.mark.parametrize(("method", "updates"), [("ilp", [1, 1, 1]), ("flashcp", [3])])
def test_sim_bar_moves_per_sequence_for_a_slow_planner(bars, method, updates):
    """The ILP's job is priced a sequence at a time, so its bar moves per sequence; a fast
    planner's job is one chunk."""
    options = {"time_limit_s": 5.0, "threads": 1} if method == "ilp" else {}
    run = RunSpec(method, 2, SHAPE, ("train",), options=options, hardware="h100_sxm")
    rows = execute("sim", [run], SEQS, progress="job")
    assert len(rows) == 3
    assert bars == [[3, "seq", updates]]


def test_table2_counts_its_ilp_solves(bars, tmp_path):
    import warnings

    from experiments.table2 import run_table2

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fallback plan, if any, is in the rows
        run_table2(2, context_len=4096, cp_size=2, time_limit_s=2, block_size=512,
                   out_dir=str(tmp_path), solver="highs")  # fmt: skip
    assert bars == [[2, "seq", [1, 1]]]
