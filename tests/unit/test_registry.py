"""The method registry: one MethodSpec per method, read by everything else.

A toy method registered inside a test runs through the planner, the simulator, the Hydra app and
the real op on two gloo ranks (against the float64 document-masked reference), then is removed.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
import yaml
from mp_utils import run_ranks

import flashcp.registry as registry
from flashcp.comm import AttnShape, comm_volume
from flashcp.kinds import OpFamily
from flashcp.ops import get_attn_op
from flashcp.ops.collectives import CommCounter
from flashcp.ops.reference import reference_attention
from flashcp.ops.sharding import shard_tensor, unshard
from flashcp.plan import make_plan, planner_entry
from flashcp.registry import (
    COMM_KIND,
    ENTRY_POINT_GROUP,
    CommKind,
    MethodSpec,
    check_options,
    get_method,
    get_planner,
    make_plan_for,
    method_names,
    op_options,
    options_schema,
    register_method,
    split_options,
    unregister_method,
)
from flashcp.sim import load_hardware, simulate

REPO = Path(__file__).resolve().parents[2]
TOY = "toy_reversed"


@planner_entry(TOY)
def plan_toy_reversed(doc_lens, cp_size: int, *, reverse: bool = True, validate: bool = True):
    """Contiguous chunks of C / N tokens, chunk i on rank N - 1 - i (``reverse``) or on rank i."""
    d = np.asarray(doc_lens, dtype=np.int64)
    chunk = int(d.sum()) // cp_size
    cu = np.concatenate([[0], np.cumsum(d)])
    rank, doc, start, length = [], [], [], []
    for i in range(cp_size):
        lo, hi = i * chunk, (i + 1) * chunk
        for j in np.flatnonzero((cu[:-1] < hi) & (cu[1:] > lo)):
            a, b = max(lo, cu[j]), min(hi, cu[j + 1])
            rank.append(cp_size - 1 - i if reverse else i)
            doc.append(j)
            start.append(a - cu[j])
            length.append(b - a)
    return make_plan(TOY, cp_size, d, rank, doc, start, length, validate=validate)


@pytest.fixture
def toy():
    spec = register_method(
        MethodSpec(
            name=TOY,
            display_name="Toy (reversed chunks)",
            order=99,
            planner=plan_toy_reversed,
            comm_kind=CommKind.ALLGATHER_SHARDED,  # run by the all-gather op family
        )
    )
    try:
        yield spec
    finally:
        unregister_method(TOY)


# ---- the registry itself ---------------------------------------------------------------------


def test_the_registry_lists_every_method_once_in_display_order():
    assert method_names() == (
        "llama3", "per_doc", "ring", "zigzag", "flashcp", "flashcp_refined", "flashcp_node",
        "ulysses", "usp", "flashcp_ulysses", "ilp",
    )  # fmt: skip
    assert method_names(paper=True) == ("llama3", "per_doc", "ring", "zigzag", "flashcp")
    assert method_names(fast=True) == method_names()[:-1]
    assert dict(COMM_KIND) == {
        "llama3": "allgather_full", "per_doc": "allgather_full", "ring": "p2p_ring",
        "zigzag": "p2p_ring", "flashcp": "allgather_sharded",
        "flashcp_refined": "allgather_sharded", "ilp": "allgather_sharded", "ulysses": "alltoall",
        "usp": "p2p_ring", "flashcp_ulysses": "allgather_sharded",
        "flashcp_node": "allgather_sharded",
    }  # fmt: skip
    assert all(isinstance(k, CommKind) for k in COMM_KIND.values())
    # one Hydra method config per registered method; other configs of the group are variants
    # (other options) of a registered method
    configs = {p.stem: p for p in (REPO / "conf" / "method").glob("*.yaml")}
    assert set(method_names()) <= set(configs)
    for stem, path in configs.items():
        assert yaml.safe_load(path.read_text())["name"] in method_names(), stem


@pytest.mark.parametrize("method", method_names())
def test_every_method_config_validates_against_its_options_schema(method):
    data = yaml.safe_load((REPO / "conf" / "method" / f"{method}.yaml").read_text())
    assert data["name"] == method
    opts = data.get("options") or {}
    assert check_options(method, opts) == opts
    # the schema is the planner's keyword-only options with their defaults, then its op
    # family's options (keep_gathered_kv of the all-gather family)
    schema = {f.name: f.default for f in dataclasses.fields(options_schema(method))}
    params = inspect.signature(get_planner(method)).parameters
    ops = {k: default for k, (_, default) in op_options(method).items()}
    assert (
        schema
        == {
            k: p.default
            for k, p in params.items()
            if p.kind is p.KEYWORD_ONLY and k not in ("num_pad", "pad_to_multiple", "validate")
        }
        | ops
    )
    assert ("keep_gathered_kv" in ops) == (get_method(method).op is OpFamily.ALLGATHER)


def test_op_options_reach_the_op_not_the_planner():
    """``keep_gathered_kv`` is a method option of every all-gather method (typed, a yes/no word
    is a bool), split off before planning (same plan), refused for other methods."""
    assert check_options("llama3", {"keep_gathered_kv": "yes"}) == {"keep_gathered_kv": True}
    assert split_options("flashcp", {"target_imbalance": 1.1, "keep_gathered_kv": True}) == (
        {"target_imbalance": 1.1},
        {"keep_gathered_kv": True},
    )
    for m in ("llama3", "per_doc", "flashcp", "flashcp_refined"):
        assert make_plan_for(m, [40, 24], 2, keep_gathered_kv=True) == make_plan_for(m, [40, 24], 2)
    with pytest.raises(ValueError, match=r"bad value 'maybe' for option 'keep_gathered_kv'"):
        check_options("per_doc", {"keep_gathered_kv": "maybe"})
    for m in ("ring", "zigzag", "ulysses", "usp", "flashcp_ulysses"):
        with pytest.raises(ValueError, match=r"has no option 'keep_gathered_kv'"):
            check_options(m, {"keep_gathered_kv": True})


def test_bad_options_name_the_option_and_list_the_valid_ones():
    with pytest.raises(
        ValueError, match=r"no option 'num_candidates'; its options: target_imbalance"
    ):
        check_options("flashcp", {"num_candidates": 3})
    with pytest.raises(ValueError, match=r"no option 'target_imbalance'; its options: none"):
        make_plan_for("ring", [8, 8], 2, target_imbalance=1.1)
    with pytest.raises(ValueError, match=r"bad value 'abc' for option 'target_imbalance'"):
        check_options("flashcp", {"target_imbalance": "abc"})
    with pytest.raises(ValueError, match=r"bad value 1.5 for option 'block_size'"):
        check_options("ilp", {"block_size": 1.5})
    assert check_options("ilp", {"time_limit_s": 10, "max_imbalance": None}) == {
        "time_limit_s": 10.0, "max_imbalance": None,
    }  # fmt: skip


def test_registration_errors_are_readable(toy):
    with pytest.raises(ValueError, match="already registered"):
        register_method(toy)
    with pytest.raises(ValueError, match="unknown comm_kind 'nccl'"):
        dataclasses.replace(toy, comm_kind="nccl")
    with pytest.raises(ValueError, match="'module:function'"):
        dataclasses.replace(toy, planner="no_colon")
    with pytest.raises(ValueError, match="must match"):
        dataclasses.replace(toy, name="Toy")
    with pytest.raises(ValueError, match=r"unknown method 'nope'; choose one of llama3, "):
        get_method("nope")


def test_every_method_is_declared_beside_its_planner():
    """pyproject.toml's flashcp.methods entry points are the list: each names the MethodSpec in
    the module of its planner, and the registry holds exactly those."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    table = project["entry-points"][ENTRY_POINT_GROUP]
    assert set(table) == set(method_names())
    for name, target in table.items():
        module, attr = target.split(":")
        assert getattr(importlib.import_module(module), attr) is get_method(name)
        assert inspect.unwrap(get_planner(name)).__module__ == module, name
    families = {m: get_method(m).op for m in method_names()}
    assert families == {
        "llama3": "allgather", "per_doc": "allgather", "flashcp": "allgather",
        "flashcp_refined": "allgather", "ilp": "allgather", "ring": "ring", "zigzag": "ring",
        "ulysses": "ulysses", "usp": "hybrid", "flashcp_ulysses": "hybrid",
        "flashcp_node": None,  # an op of its own (flashcp.ops.node_allgather_attn)
    }  # fmt: skip
    assert [m for m in method_names() if get_method(m).reports_solve] == ["ilp"]


def test_the_registry_names_no_method():
    """No string of flashcp/registry.py (docstrings aside) names a method; ``flashcp`` is also
    the project's name, so only the other names are searched for."""
    tree = ast.parse((REPO / "flashcp" / "registry.py").read_text())
    docs = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef) and ast.get_docstring(n)
    }
    strings = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]
    for name in set(method_names()) - {"flashcp"}:
        assert not [s for s in strings if re.search(rf"\b{name}\b", s)], name
    assert not [s for s in strings if s.startswith("baselines")]


def test_spec_fields_choose_a_family_that_runs_the_comm_kind(toy):
    assert toy.op is OpFamily.ALLGATHER  # the default family of allgather_sharded
    ring = dataclasses.replace(toy, comm_kind=CommKind.P2P_RING, op=None)
    assert ring.op is OpFamily.RING
    with pytest.raises(ValueError, match="the ring op family runs comm kinds p2p_ring, not "):
        dataclasses.replace(toy, op=OpFamily.RING)
    with pytest.raises(ValueError, match="unknown op family 'tree'"):
        dataclasses.replace(toy, op="tree")
    with pytest.raises(ValueError, match="give both prepare and attn, or neither"):
        dataclasses.replace(toy, op=None, prepare="my_pkg.ops:prepare")
    with pytest.raises(ValueError, match="not both"):
        dataclasses.replace(toy, prepare="my_pkg.ops:prepare", attn="my_pkg.ops:attn")
    own = dataclasses.replace(toy, op=None, prepare=_toy_op, attn=_toy_op)
    assert own.op is None


def test_bad_declarations_are_named(monkeypatch):
    def declared(*pairs):
        eps = [(metadata.EntryPoint(n, v, ENTRY_POINT_GROUP), where) for n, v, where in pairs]
        for key, value in (("_declared", lambda: eps), ("_REGISTRY", {}), ("_SOURCES", {}),
                           ("_discovered", [])):  # fmt: skip
            monkeypatch.setattr(registry, key, value)

    declared(("spiral", "baselines.ring:METHOD", "a test"))
    with pytest.raises(ValueError, match=r"must be the MethodSpec of method 'spiral'"):
        method_names()
    declared(("spiral", "no_such_pkg.spiral:METHOD", "a test"))
    with pytest.raises(ValueError, match=r"'spiral' .*declared in a test\) does not load"):
        method_names()
    declared(("ring", "baselines.ring:METHOD", "one"), ("ring", "baselines.ring:METHOD", "two"))
    with pytest.raises(ValueError, match=r"method 'ring' is declared twice .*in one and in two"):
        method_names()
    declared(("ring", "baselines.ring:METHOD", "one"))
    assert method_names() == ("ring",)  # discovered once, on first use


def test_a_bad_declaration_is_one_line_before_any_work(monkeypatch, capsys):
    """``flashcp plan`` (whose parser lists the methods) and the launch checks of every Hydra
    command report a declaration that does not load as one line, before any job."""
    from experiments.common.launch import launch_problem
    from flashcp.cli import main

    eps = [
        (metadata.EntryPoint("spiral", "no_such_pkg.spiral:METHOD", ENTRY_POINT_GROUP), "a test")
    ]
    for key, value in (("_declared", lambda: eps), ("_REGISTRY", {}), ("_SOURCES", {}),
                       ("_discovered", [])):  # fmt: skip
        monkeypatch.setattr(registry, key, value)
    assert main(["plan", "--method", "llama3", "--cp-size", "2", "--doc-lens", "4,4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'spiral'" in err[0] and "does not load" in err[0], err
    problem = launch_problem(None, multirun=False)
    assert problem is not None and "does not load" in problem


def test_the_core_imports_neither_baselines_nor_torch():
    code = (
        "import sys, flashcp, flashcp.registry, flashcp.plan\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('baselines', 'torch')]\n"
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # flashcp.registry imports only the project's leaf modules, and flashcp.plan (the data model)
    # does not import the registry; neither names a method module
    for module, allowed in (
        ("registry.py", {"flashcp.kinds", "flashcp.resources"}),
        *((f"plan/{m}.py", None) for m in ("__init__", "checks", "model", "build")),
    ):
        imported = _imports(REPO / "flashcp" / module)
        assert not [m for m in imported if m.split(".")[0] == "baselines"], module
        if allowed is not None:
            assert {m for m in imported if m.split(".")[0] == "flashcp"} <= allowed, module
        else:
            assert "flashcp.registry" not in imported
    for leaf in ("kinds", "resources"):
        assert not [m for m in _imports(REPO / "flashcp" / f"{leaf}.py") if m.startswith("flashcp")]


def _imports(path: Path) -> list[str]:
    """Modules a file imports at run time (typing-only imports do not run)."""
    tree = ast.parse(path.read_text())
    tree.body = [  # typing-only imports do not run
        n
        for n in tree.body
        if not (isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    ]
    return [
        n.module if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in (n.names if isinstance(n, ast.Import) else [n])
        if (n.module if isinstance(n, ast.ImportFrom) else a.name)
    ]


# ---- a method added in one line runs everywhere --------------------------------------------------

LENS = [5, 11, 3, 13]  # C = 32 over 2 ranks
SHAPE = AttnShape(4, 2, 8, "float32")


def test_a_registered_method_plans_and_simulates(toy):
    assert TOY in method_names() and method_names()[-1] == TOY
    assert COMM_KIND[TOY] == CommKind.ALLGATHER_SHARDED
    plan = make_plan_for(TOY, LENS, 2)
    assert plan.method == TOY
    assert [sh.doc for sh in plan.ranks()[1]] == [0, 1]  # the first chunk sits on the last rank
    # shared edge handling: zero-length documents and pad tokens, from planner_entry
    padded = make_plan_for(TOY, [5, 0, 11, 3, 12], 2, pad_to_multiple=True)
    assert padded.num_pad == 1 and padded.doc_lens.tolist() == [5, 0, 11, 3, 12]
    with pytest.raises(ValueError, match="its options: reverse"):
        make_plan_for(TOY, LENS, 2, target_imbalance=1.1)
    assert check_options(TOY, {"reverse": False}) == {"reverse": False}
    hw = load_hardware("h100_sxm")
    for mode in ("train", "infer"):
        row = simulate(plan, SHAPE, hw, mode)
        vol = comm_volume(plan, CommKind.ALLGATHER_SHARDED, SHAPE, mode)
        assert {k: row[k] for k in vol} == vol and row["total_ms"] > 0
    assert plan.summary()["comm_tokens"] == plan.comm_tokens  # priced as sharding-aware (Eq. 5)


def test_a_registered_method_runs_in_the_app(toy, tmp_path):
    from hydra import compose, initialize_config_dir

    from experiments.run import CONF_DIR, run
    from flashcp.config import register_configs
    from flashcp.results import read_rows

    register_configs()
    overrides = [
        f"results_dir={tmp_path}", "name=t", "num_sequences=2", "context_len=8192", "cp_size=4",
        "progress=false", "method=ring", f"method.name={TOY}",
    ]  # fmt: skip
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    df = read_rows(run(cfg))
    assert set(df["method"]) == {TOY} and (df["status"] == "ok").all() and len(df) == 4
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        bad = compose("config", overrides=[*overrides, "+method.options.bogus=1"])
    with pytest.raises(ValueError, match="no option 'bogus'; its options: reverse"):
        run(bad)


def _toy_op(rank, n, lens):
    plan = make_plan_for(TOY, lens, n)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(plan.context_len, h, 8, generator=g) for h in (4, 2, 2, 4))
    prepare, attn = get_attn_op(TOY)
    ql, kl, vl = (shard_tensor(x, plan, rank).requires_grad_() for x in (q, k, v))
    counter = CommCounter()
    out = attn(ql, kl, vl, prepare(plan, rank), backend="cpu", counter=counter)
    out.backward(shard_tensor(dout, plan, rank))
    return out.detach(), ql.grad, kl.grad, vl.grad, counter.as_dict()


def test_a_registered_method_runs_its_op_on_gloo_ranks(toy):
    n = 2
    results = run_ranks(_toy_op, n, LENS, timeout_s=120)
    plan = make_plan_for(TOY, LENS, n)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(plan.context_len, h, 8, generator=g) for h in (4, 2, 2, 4))
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref = reference_attention(*leaves, LENS)
    ref.backward(dout.double())
    want = [ref.detach()] + [x.grad for x in leaves]
    for i, (what, w) in enumerate(zip(("out", "dq", "dk", "dv"), want, strict=True)):
        got = unshard([results[r][i] for r in range(n)], plan).double()
        err = float((got - w).abs().max())
        assert err <= 1e-5 * max(1.0, float(w.abs().max())), f"{what}: err {err:.3g}"
    expect = comm_volume(plan, COMM_KIND[TOY], SHAPE, "train")
    assert all(results[r][4] == expect for r in range(n))  # counted == planned communication


# ---- typed configuration ----------------------------------------------------------------------


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir

    from experiments.run import CONF_DIR
    from flashcp.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("name", ["h100_sxm", "h100_ib", "h800_sxm", "a100_sxm", "h200_sxm"])
def test_hardware_profiles_extend_h100_sxm_through_hydra_defaults(name):
    from omegaconf import OmegaConf

    from flashcp.sim.hardware import read_profile

    composed = OmegaConf.to_container(_compose(f"hardware={name}").hardware)
    assert composed == read_profile(name)  # Hydra and load_hardware read the same constants
    assert load_hardware(composed) == load_hardware(name)
    base = read_profile("h100_sxm")
    own = yaml.safe_load((REPO / "conf" / "hardware" / f"{name}.yaml").read_text())
    if name != "h100_sxm":
        assert own["defaults"] == ["h100_sxm", "_self_"]
        # the file holds only what differs; everything else is h100_sxm's
        assert all(own[k] != base[k] for k in own if k != "defaults")
        assert {k: v for k, v in composed.items() if k not in own} == {
            k: v for k, v in base.items() if k not in own
        }


@pytest.mark.parametrize(
    "override",
    [
        "hardware.launch_uss=1", "hardware.launch_us=abc", "hardware.num_sms=1.5", "task=fig5",
        "dataset.name=wlb",
        "executor.name=simm", "dataset.overlong=truncate",
    ],
)  # fmt: skip
def test_typos_in_typed_fields_fail_at_compose_time(override):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        _compose(override)


def test_enum_fields_keep_their_strings():
    from omegaconf import OmegaConf

    from flashcp.config import Executor, Overlong
    from flashcp.data import DatasetName
    from flashcp.results import config_hash

    cfg = _compose("executor=emulate", "dataset=pile")
    assert cfg.executor.name is Executor.emulate and cfg.dataset.name is DatasetName.pile
    assert cfg.dataset.overlong is Overlong.split
    # saved configs, hashes and rows see the same strings as before the enums
    assert "name: emulate" in OmegaConf.to_yaml(cfg.executor)
    assert "name: pile" in OmegaConf.to_yaml(cfg.dataset)
    plain = {"executor": "emulate", "dataset": "pile", "overlong": "split"}
    typed = {
        "executor": cfg.executor.name,
        "dataset": cfg.dataset.name,
        "overlong": cfg.dataset.overlong,
    }
    assert config_hash(typed) == config_hash(plain)


def test_the_plan_cli_takes_any_planner_option(capsys):
    import json

    from flashcp.cli import main

    args = [
        "plan",
        "--method",
        "flashcp_refined",
        "--cp-size",
        "4",
        "--doc-lens",
        "9000,3000,500,4000",
    ]
    assert (
        main([*args, "--option", "num_candidates=4", "--option", "target_imbalance=1.3", "--json"])
        == 0
    )
    got = json.loads(capsys.readouterr().out)
    want = make_plan_for(
        "flashcp_refined", [9000, 3000, 500, 4000], 4, num_candidates=4, target_imbalance=1.3
    )
    assert got["ranks"] == want.to_dict()["ranks"]
    for bad, needle in [
        ("bogus=1", "no option 'bogus'; its options: target_imbalance, num_candidates"),
        ("num_candidates=many", "bad value 'many' for option 'num_candidates'"),
        ("num_candidates", "--option takes KEY=VALUE"),
    ]:
        assert main([*args, "--option", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert main(["plan", "--method", "striped", "--cp-size", "2", "--doc-lens", "4"]) == 2
    assert "invalid choice: 'striped'" in capsys.readouterr().err
