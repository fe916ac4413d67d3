"""One row loop for every executor: ``sim``, ``dist`` and ``emulate`` give rows with the same
columns, in the same order, of the same dtypes, for the same run; they agree on what does not
depend on how a step is measured (the sequence, its plan, the bytes it moves)."""

from __future__ import annotations

import numpy as np
import pytest
from mp_utils import run_ranks

from flashcp.comm import AttnShape
from flashcp.executors import RunSpec, execute
from flashcp.executors.rows import PLAN_COLUMNS, ROW_COLUMNS, SEQ_COLUMNS, finish_rows
from flashcp.results import COMM_COLUMNS, ROW_SCHEMA

SEQS = [np.array([5, 40, 3, 60, 1, 19]), np.array([64, 64]), np.array([100, 20, 8])]  # C = 128
EX = {"backend": "cpu", "warmup": 0, "iters": 1, "timeout_s": 30, "device": "cpu"}


def _spec(method: str = "flashcp", cp_size: int = 2) -> RunSpec:
    return RunSpec(
        method=method, cp_size=cp_size, shape=AttnShape(4, 2, 8, "float32"),
        modes=("train", "infer"), hardware="h100_sxm", seed=1, executor=EX,
    )  # fmt: skip


def _dist(rank, n, method):
    rows = execute("dist", [_spec(method, n)], SEQS)
    return None if rows is None else rows


@pytest.fixture(scope="module")
def rows():
    import torch

    torch.set_num_threads(1)
    out = {"sim": execute("sim", [_spec()], SEQS), "emulate": execute("emulate", [_spec()], SEQS)}
    out["dist"] = run_ranks(_dist, 2, "flashcp", timeout_s=120)[0]
    return out


def test_same_columns_and_dtypes_from_every_executor(rows):
    for name, df in rows.items():
        assert tuple(df.columns) == ROW_COLUMNS, name
        assert (df["status"] == "ok").all() and len(df) == len(SEQS) * 2, name
        assert df["plan_ms"].notna().all() and (df["pad_tokens"] == 0).all(), name
    dtypes = {name: df.dtypes.astype(str).to_dict() for name, df in rows.items()}
    assert dtypes["sim"] == dtypes["dist"] == dtypes["emulate"]
    for col in ROW_COLUMNS[1:]:  # the row files' types (flashcp.results.ROW_SCHEMA)
        want = {"int": "Int64", "float": "float64", "bool": "boolean", "text": "string"}
        assert dtypes["sim"][col] == want[ROW_SCHEMA[col]], col


def test_executors_agree_on_sequence_plan_and_bytes(rows):
    same = [*SEQ_COLUMNS, "mode", *(c for c in PLAN_COLUMNS if c != "plan_ms"), *COMM_COLUMNS]
    want = rows["sim"][same].reset_index(drop=True)
    for name in ("dist", "emulate"):
        got = rows[name][same].reset_index(drop=True)
        assert got.equals(want), name


def test_a_failing_sequence_is_the_same_row_everywhere():
    # llama3 at CP 3: C = 128 does not divide into 2 x 3 chunks
    spec = _spec("llama3", 3)
    sim = execute("sim", [spec], SEQS[:1])
    emu = execute("emulate", [spec], SEQS[:1])
    for df in (sim, emu):
        assert tuple(df.columns) == ROW_COLUMNS
        assert df["status"].str.startswith("error: DivisibilityError").all() and len(df) == 2
    assert sim.dtypes.equals(emu.dtypes)
    assert sim[["seq_idx", "mode", "status"]].equals(emu[["seq_idx", "mode", "status"]])


def test_finish_rows_refuses_an_unknown_column():
    import pandas as pd

    with pytest.raises(ValueError, match=r"\['not_a_column'\]"):
        finish_rows([pd.DataFrame({"run_idx": [0], "seq_idx": [0], "not_a_column": [1]})])
    with pytest.raises(ValueError, match="'num_docs' must hold int"):
        finish_rows([pd.DataFrame({"run_idx": [0], "seq_idx": [0], "num_docs": ["x"]})])


def test_executors_import_the_row_loop_not_each_other():
    import ast
    from pathlib import Path

    import flashcp.executors as pkg

    names = {"sim", "dist", "emulate"}
    for name in names:
        tree = ast.parse((Path(pkg.__file__).parent / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            for mod in mods:
                other = mod.removeprefix("flashcp.executors.")
                assert other == mod or other not in names - {name}, f"{name}.py imports {mod}"
