"""A method from another package: ``pip install`` of a package that declares a ``MethodSpec`` in
the ``flashcp.methods`` entry points adds the method to every command, with no edit here.

The package is built in a temporary folder and installed by pip (``--target``, offline, with the
setuptools build backend of this environment), then used from subprocesses that have that folder
on ``PYTHONPATH``: ``flashcp plan`` (the CLI), ``flashcp-run`` (the Hydra app, a ``sim`` run) and
the real op on 2 gloo ranks (against the float64 reference). The console scripts are run as their
``pyproject.toml`` entries name them. Without its entry point the same installed module is not a
method.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

pytest.importorskip("setuptools", reason="the plugin package is built with setuptools")

REPO = Path(__file__).resolve().parents[2]
NAME = "toy_cp"
LENS = "5,11,3,15,4,26"  # C = 64 over 2 ranks; document 3 straddles the two chunks
TIMEOUT_S = 120

PYPROJECT = f"""\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "flashcp-toy-plugin"
version = "0.1.0"

[tool.setuptools]
py-modules = ["{NAME}"]

[project.entry-points."flashcp.methods"]
{NAME} = "{NAME}:METHOD"
"""

MODULE = f'''\
"""A toy CP method: contiguous chunks of C / N tokens, chunk i on rank N - 1 - i."""

import numpy as np

from flashcp.kinds import CommKind
from flashcp.plan import make_plan, planner_entry
from flashcp.registry import MethodSpec


@planner_entry("{NAME}")
def plan_toy(doc_lens, cp_size, *, validate=True):
    d = np.asarray(doc_lens, dtype=np.int64)
    chunk = int(d.sum()) // cp_size
    cu = np.concatenate([[0], np.cumsum(d)])
    cols = [[], [], [], []]
    for i in range(cp_size):
        lo, hi = i * chunk, (i + 1) * chunk
        for j in np.flatnonzero((cu[:-1] < hi) & (cu[1:] > lo)):
            a, b = max(lo, cu[j]), min(hi, cu[j + 1])
            for col, value in zip(cols, (cp_size - 1 - i, j, a - cu[j], b - a)):
                col.append(value)
    return make_plan("{NAME}", cp_size, d, *cols, validate=validate)


METHOD = MethodSpec(
    name="{NAME}", display_name="Toy (reversed chunks)", order=99, planner=plan_toy,
    comm_kind=CommKind.ALLGATHER_SHARDED,  # run by the all-gather op family, sharding-aware
)
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The folder pip installed the plugin package into."""
    root = tmp_path_factory.mktemp("plugin")
    src, target = root / "src", root / "site"
    src.mkdir()
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / f"{NAME}.py").write_text(MODULE)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
           "--no-index", "--disable-pip-version-check", "--target", str(target), str(src)]  # fmt: skip
    proc = subprocess.run(pip, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert list(target.glob("*.dist-info/entry_points.txt")), "pip wrote no entry points"
    return target


def _console(script: str, *args: str) -> list[str]:
    """The command line of console script ``script``, run as ``pyproject.toml`` declares it."""
    target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"][script]
    module, func = target.split(":")
    code = f"import sys; sys.argv[0] = {script!r}; from {module} import {func}; sys.exit({func}())"
    return [sys.executable, "-c", code, *args]


PLAN_ARGS = ["plan", "--method", NAME, "--cp-size", "2", "--doc-lens", LENS, "--json"]
APP_ARGS = [
    "cp_size=2", "context_len=4096", "num_sequences=2", "method=ring", f"method.name={NAME}",
    "progress=false", "results_dir=out", "name=plugin", "executor=sim",
]  # fmt: skip


#: the method's real op on 2 gloo ranks, against the float64 document-masked reference, and its
#: counted communication against the plan's
OP_CHECK = f"""
import sys
sys.path.insert(0, {str(REPO / "tests")!r})
import torch
from mp_utils import run_ranks
from flashcp.comm import AttnShape, comm_volume
from flashcp.ops import get_attn_op
from flashcp.ops.collectives import CommCounter
from flashcp.ops.reference import reference_attention
from flashcp.ops.sharding import shard_tensor, unshard
from flashcp.registry import COMM_KIND, make_plan_for

LENS = [{LENS}]

def inputs(plan):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(plan.context_len, h, 8, generator=g) for h in (4, 2, 2, 4)]

def rank_fn(rank, n):
    plan = make_plan_for({NAME!r}, LENS, n)
    q, k, v, dout = inputs(plan)
    prepare, attn = get_attn_op({NAME!r})
    leaves = [shard_tensor(x, plan, rank).requires_grad_() for x in (q, k, v)]
    counter = CommCounter()
    out = attn(*leaves, prepare(plan, rank), backend="cpu", counter=counter)
    out.backward(shard_tensor(dout, plan, rank))
    return [out.detach()] + [x.grad for x in leaves], counter.as_dict()

n = 2
got = run_ranks(rank_fn, n, timeout_s=60)
plan = make_plan_for({NAME!r}, LENS, n)
q, k, v, dout = inputs(plan)
leaves = [x.double().requires_grad_() for x in (q, k, v)]
ref = reference_attention(*leaves, LENS)
ref.backward(dout.double())
for i, want in enumerate([ref.detach()] + [x.grad for x in leaves]):
    err = float((unshard([got[r][0][i] for r in range(n)], plan).double() - want).abs().max())
    assert err <= 1e-5 * max(1.0, float(want.abs().max())), (i, err)
expect = comm_volume(plan, COMM_KIND[{NAME!r}], AttnShape(4, 2, 8, "float32"), "train")
assert expect["allgather_bytes"] > 0 and all(got[r][1] == expect for r in range(n)), got
print("op ok")
"""


@pytest.fixture(scope="module")
def runs(site, tmp_path_factory) -> dict[str, tuple[int, str, str, Path]]:
    """``name -> (exit code, stdout, stderr, its folder)`` of the commands, run at once, each in
    a folder of its own with the plugin's folder (``bare``: without its entry point) and the
    checkout on ``PYTHONPATH``."""
    bare = tmp_path_factory.mktemp("bare") / "site"
    shutil.copytree(site, bare)
    for ep in bare.glob("*.dist-info/entry_points.txt"):
        ep.unlink()
    commands = {
        "cli": (_console("flashcp", *PLAN_ARGS), site),
        "bare": (_console("flashcp", *PLAN_ARGS), bare),
        "app": (_console("flashcp-run", *APP_ARGS), site),
        "op": ([sys.executable, "-c", OP_CHECK], site),
    }
    started = {}
    for name, (cmd, path) in commands.items():
        cwd = tmp_path_factory.mktemp(name)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path), str(REPO)]))
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)  # fmt: skip
        started[name] = (proc, cwd)
    done = {}
    try:
        for name, (proc, cwd) in started.items():
            out, err = proc.communicate(timeout=TIMEOUT_S)
            done[name] = (proc.returncode, out, err, cwd)
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def test_an_installed_package_adds_a_method_to_the_cli(runs):
    code, out, err, _ = runs["cli"]
    assert code == 0, err
    plan = json.loads(out)
    assert plan["method"] == NAME and plan["status"] == "ok"
    # its layout: the first chunk (documents 0-2 and the head of 3) sits on the last rank
    assert [s["doc"] for s in plan["ranks"][1]["shards"]] == [0, 1, 2, 3]
    assert plan["comm_tokens"] == plan["comm_tokens_sharded"] > 0  # sharding-aware (Eq. 5)


def test_without_its_entry_point_the_module_is_no_method(runs, site):
    code, _, err, _ = runs["bare"]
    assert code == 2 and f"invalid choice: '{NAME}'" in err, err
    assert (site / f"{NAME}.py").is_file()  # the module is installed; only its declaration is not


def test_an_installed_method_runs_in_the_app(runs):
    from flashcp.results import read_rows

    code, _, err, cwd = runs["app"]
    assert code == 0, err[-3000:]
    found = list((cwd / "out" / "plugin" / "runs").glob("*/rows.parquet"))
    assert len(found) == 1, found
    rows = read_rows(found[0])
    assert set(rows["method"]) == {NAME} and (rows["status"] == "ok").all(), rows["status"]
    assert len(rows) == 4 and (rows["comm_tokens"] == rows["comm_tokens_sharded"]).all()


def test_an_installed_method_runs_its_op_on_gloo_ranks(runs):
    code, out, err, _ = runs["op"]
    assert code == 0 and "op ok" in out, err[-3000:]
