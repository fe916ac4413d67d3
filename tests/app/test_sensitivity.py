"""The sensitivity experiment on a tiny configuration: files, ranges, orderings, data variants."""

from __future__ import annotations

import logging
import sys

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("hydra", reason="the Hydra harness needs hydra-core and omegaconf")
from omegaconf import OmegaConf

from experiments.sensitivity import (
    VARIED,
    data_variants,
    dataset_override_problem,
    perturb,
    run_sensitivity,
)
from flashcp.sim import load_hardware

MODEL = {"num_heads": 8, "num_kv_heads": 8, "head_dim": 64, "dtype": "bfloat16"}


def tiny(**kw):
    hw = OmegaConf.to_container(OmegaConf.load("conf/hardware/h100_sxm.yaml"))
    base = {
        "hardware": hw, "model": MODEL, "cp_size": 4, "context_len": 16384, "seed": 0,
        "modes": ["train"], "num_sequences": 2, "num_draws": 4, "factor": 2.0,
        "datasets": ["pile"], "weightings": ["documents"], "dataset": None,
        "methods": ["llama3", "per_doc", "zigzag"],
    }  # fmt: skip
    return OmegaConf.create({**base, **kw})


def test_perturb_keeps_profiles_valid():
    hw = load_hardware("h100_sxm")
    for f in (0.5, 2.0):
        p = perturb(hw, dict.fromkeys(VARIED, f))
        assert p.overlap_fraction <= 1.0 and p.nccl_slowdown >= 1.0
        assert p.host_op_us == pytest.approx(hw.host_op_us * f)
        assert p.reducescatter_busbw_gbps == pytest.approx(hw.reducescatter_busbw_gbps * f)
    with pytest.raises(ValueError, match="not a varied constant"):
        perturb(hw, {"num_sms": 2.0})


def test_tiny_sensitivity_run(tmp_path):
    cfg = tiny()
    df = run_sensitivity(cfg, tmp_path)
    assert (df.kind == "one_at_a_time").sum() == 2 * len(VARIED) * 3
    assert df[df.kind == "joint"]["draw"].nunique() == 4
    assert set(df.dataset_variant) == {"pile/documents"} and set(df.weighting) == {"documents"}
    rng = pd.read_csv(tmp_path / "speedup_range.csv")
    assert set(rng.method) == {"per_doc", "zigzag"}
    assert {"dataset_variant", "dataset", "mode", "calibrated", "joint_p5"} <= set(rng.columns)
    assert (rng.joint_min <= rng.joint_max).all()
    assert (
        (rng.one_at_a_time_min <= rng.calibrated + 1e-12)
        & (rng.calibrated <= rng.one_at_a_time_max + 1e-12)
    ).all()
    order = pd.read_csv(tmp_path / "ordering.csv")
    assert len(order) == 3 and order.share_of_draws.between(0, 1).all()
    assert {"dataset_variant", "dataset", "faster", "slower", "at_95pct"} <= set(order.columns)
    assert (order.at_95pct == np.where(order.share_of_draws >= 0.95, "holds", order.at_95pct)).all()
    assert (tmp_path / "tornado.png").stat().st_size > 0
    with pytest.raises(ValueError, match="llama3"):
        run_sensitivity(OmegaConf.merge(cfg, {"methods": ["zigzag"]}), tmp_path)


def test_across_nodes_the_inter_node_constants_are_varied_too(tmp_path):
    """CP 16 on nodes of 8 spans 2 nodes: nic_bw_gbps and inter_latency_us join the varied
    constants and the rows record the topology; on one node (CP 4) neither happens."""
    from flashcp.sim.perturb import NETWORK_VARIED

    df = run_sensitivity(tiny(cp_size=16, methods=["llama3", "zigzag"]), tmp_path)
    varied = set(df.loc[df.kind == "one_at_a_time", "constant"])
    assert varied == {*VARIED, *NETWORK_VARIED}
    assert set(df["nodes"]) == {2} and set(df["placement"]) == {"consecutive"}
    slow = df[(df.constant == "nic_bw_gbps") & (df.method == "zigzag")]
    assert slow.total_ms_mean.iloc[0] > slow.total_ms_mean.iloc[1]  # half the NIC: slower
    one = run_sensitivity(tiny(methods=["llama3", "zigzag"]), tmp_path / "one")
    assert "nodes" not in one and set(one.constant) - {""} == set(VARIED)
    with pytest.raises(ValueError, match="does not split evenly over num_nodes 3"):
        run_sensitivity(tiny(cp_size=16, nodes=3), tmp_path / "bad")


def test_data_variants_are_listed_in_order():
    cfg = tiny(
        datasets=["pile", "wlb_llm_synthetic", "stress"], weightings=["documents", "tokens"],
        dataset={"name": "file", "path": "x.txt", "weighting": "tokens", "cap": None, "overlong": "cut"},
    )  # fmt: skip
    labels = [v.label for v in data_variants(cfg)]
    assert labels == [
        "pile/documents", "pile/tokens", "wlb_llm_synthetic/documents", "stress/documents",
        "file/tokens/cut",
    ]  # fmt: skip
    # a selected dataset equal to a listed variant is not studied twice
    same = {"name": "pile", "path": None, "weighting": "tokens", "cap": None, "overlong": "split"}
    assert len(data_variants(OmegaConf.merge(cfg, {"dataset": same}))) == 4


def test_data_variants_are_sampled_as_flashcp_run_samples(tmp_path):
    """Each variant's rows are its dataset config's sequences (flashcp-run's sampler, with that
    weighting and the file's lengths), priced on the calibrated profile: recomputed here one plan
    at a time."""
    from experiments.common.rows import file_sha256
    from flashcp.comm import AttnShape
    from flashcp.data import sample_dataset
    from flashcp.registry import COMM_KIND, get_planner
    from flashcp.sim.cost import PlanCost

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(x) for x in (300, 5000, 12000, 700, 2500, 40000)) + "\n")
    cfg = tiny(
        datasets=["pile", "wlb_llm_synthetic"], weightings=["documents", "tokens"],
        dataset={"name": "file", "path": str(lengths), "weighting": "documents", "cap": None,
                 "overlong": "split"},
        num_draws=20,
    )  # fmt: skip
    df = run_sensitivity(cfg, tmp_path / "out")
    variants = ["pile/documents", "pile/tokens", "wlb_llm_synthetic/documents", "file/documents"]
    assert list(dict.fromkeys(df.dataset_variant)) == variants
    hw = load_hardware("h100_sxm")
    shape = AttnShape(8, 8, 64, "bfloat16")
    for label, name, w, path in [
        ("pile/tokens", "pile", "tokens", None),
        ("wlb_llm_synthetic/documents", "wlb_llm_synthetic", "documents", None),
        ("file/documents", "file", "documents", str(lengths)),
    ]:
        seqs, _ = sample_dataset(name, 2, 16384, seed=0, weighting=w, path=path)
        rows = df[(df.dataset_variant == label) & (df.kind == "calibrated")].set_index("method")
        assert rows.weighting.eq(w).all() and rows.dataset.eq(name).all()
        for method in cfg.methods:
            plans = [get_planner(method)(d, 4) for d in seqs]
            want = np.mean(
                [PlanCost(p, hw, COMM_KIND[method]).step(shape, "train")["total_ms"] for p in plans]
            )
            assert rows.at[method, "total_ms_mean"] == pytest.approx(want, rel=1e-9)
    file_rows = df[df.dataset == "file"]
    assert file_rows.dataset_sha256.eq(file_sha256(lengths)).all()
    assert file_rows.dataset_path.eq(str(lengths)).all()
    assert df[df.dataset != "file"].dataset_sha256.eq("-").all()
    # document and token weighting give other sequences, so other speedups
    cal = df[df.kind == "calibrated"].set_index(["dataset_variant", "method"])["speedup_vs_llama3"]
    assert cal[("pile/documents", "per_doc")] != cal[("pile/tokens", "per_doc")]

    order = pd.read_csv(tmp_path / "out" / "ordering.csv")
    assert list(dict.fromkeys(order.dataset_variant)) == variants
    assert len(order) == 3 * len(variants)
    summary = pd.read_csv(tmp_path / "out" / "data_variants.csv", keep_default_na=False)
    assert len(summary) == 2 * len(variants)
    for _, r in order.iterrows():  # each ordering that holds is in the summary, both sides
        s = summary[summary.dataset_variant == r.dataset_variant].set_index("method")
        win, lose = (r.faster, r.slower) if r.at_95pct == "holds" else (r.slower, r.faster)
        held = r.at_95pct != "uncertain"
        if win != "llama3":
            assert (lose in s.at[win, "beats_in_95pct"].split(";")) == held
        if lose != "llama3":
            assert (win in s.at[lose, "loses_to_in_95pct"].split(";")) == held
    md = (tmp_path / "out" / "data_variants.md").read_text()
    assert all(f"| {v} | train |" in md for v in variants)


def test_dataset_override_without_a_dataset_is_refused():
    assert "add dataset=<name>" in dataset_override_problem(["dataset.path=x.txt"])
    assert dataset_override_problem(["dataset=file", "dataset.path=x.txt"]) is None
    assert dataset_override_problem(["num_draws=4"]) is None


def test_command_studies_a_users_file(tmp_path, monkeypatch, capsys):
    """flashcp-sensitivity dataset=file dataset.path=...: Hydra composes the optional dataset
    group into the study, which adds the file as a data variant."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from experiments.sensitivity import cli

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("1000\n3000\n9000\n")
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    monkeypatch.setattr(sys, "argv", ["flashcp-sensitivity"])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    try:
        cli([
                f"results_dir={tmp_path}", "datasets=[]", "dataset=file", f"dataset.path={lengths}",
                "dataset.weighting=tokens", "num_draws=2", "num_sequences=1", "cp_size=2",
                "context_len=8192", "model.num_heads=4", "model.num_kv_heads=4",
                "methods=[llama3,per_doc]",
        ])  # fmt: skip
    finally:
        HydraConfig.instance().cfg = None
        GlobalHydra.instance().clear()
        root.handlers[:] = handlers
        root.setLevel(level)
    rng = pd.read_csv(tmp_path / "sensitivity" / "speedup_range.csv")
    assert list(rng.dataset_variant) == ["file/tokens"] and list(rng.method) == ["per_doc"]


def test_method_options_are_studied_as_configured(tmp_path):
    """An option of the method group (``llama3_paper``, ``zigzag_paper``: the paper's
    configuration) is planned and priced with its impl and options, labelled by its method; a
    method listed twice or an unknown entry is refused, naming it."""
    from flashcp.comm import AttnShape
    from flashcp.config import method_option
    from flashcp.data import sample_dataset
    from flashcp.registry import COMM_KIND
    from flashcp.sim import simulate
    from flashcp.sim.impl import impl_plan

    cfg = tiny(methods=["llama3_paper", "zigzag_paper"], num_draws=2)
    df = run_sensitivity(cfg, tmp_path)
    cal = df[df.kind == "calibrated"].set_index("method")["total_ms_mean"]
    seqs, _ = sample_dataset("pile", 2, 16384, seed=0)
    hw, shape = load_hardware("h100_sxm"), AttnShape(8, 8, 64, "bfloat16")
    for option in ("llama3_paper", "zigzag_paper"):
        m = method_option(option)
        want = np.mean([
            simulate(impl_plan(m.method, m.impl, d, 4)[0], shape, hw, "train",
                     COMM_KIND[m.method], m.impl, **m.op_options)["total_ms"]
            for d in seqs
        ])  # fmt: skip
        assert cal[m.method] == pytest.approx(want, rel=1e-9)
    with pytest.raises(ValueError, match="run llama3 twice"):
        run_sensitivity(OmegaConf.merge(cfg, {"methods": ["llama3", "llama3_paper"]}), tmp_path)
    with pytest.raises(ValueError, match="'zigzag_papr' is neither a method"):
        run_sensitivity(OmegaConf.merge(cfg, {"methods": ["llama3", "zigzag_papr"]}), tmp_path)
