"""The sensitivity experiment on a tiny configuration: files, ranges and orderings."""

from __future__ import annotations

import pandas as pd
import pytest

pytest.importorskip("hydra", reason="the Hydra harness needs hydra-core and omegaconf")
from omegaconf import OmegaConf

from experiments.sensitivity import VARIED, perturb, run_sensitivity
from flashcp.sim import load_hardware


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
    hw = OmegaConf.to_container(OmegaConf.load("conf/hardware/h100_sxm.yaml"))
    cfg = OmegaConf.create({
        "hardware": hw, "model": {"num_heads": 8, "num_kv_heads": 8, "head_dim": 64, "dtype": "bfloat16"},
        "cp_size": 4, "context_len": 16384, "seed": 0, "modes": ["train"],
        "num_sequences": 2, "num_draws": 4, "factor": 2.0, "datasets": ["pile"],
        "methods": ["llama3", "per_doc", "zigzag"],
    })  # fmt: skip
    df = run_sensitivity(cfg, tmp_path)
    assert (df.kind == "one_at_a_time").sum() == 2 * len(VARIED) * 3
    assert df[df.kind == "joint"]["draw"].nunique() == 4
    rng = pd.read_csv(tmp_path / "speedup_range.csv")
    assert set(rng.method) == {"per_doc", "zigzag"}
    assert (rng.joint_min <= rng.joint_max).all()
    assert (
        (rng.one_at_a_time_min <= rng.calibrated + 1e-12)
        & (rng.calibrated <= rng.one_at_a_time_max + 1e-12)
    ).all()
    order = pd.read_csv(tmp_path / "ordering.csv")
    assert len(order) == 3 and order.share_of_draws.between(0, 1).all()
    assert (tmp_path / "tornado.png").stat().st_size > 0
    with pytest.raises(ValueError, match="llama3"):
        run_sensitivity(OmegaConf.merge(cfg, {"methods": ["zigzag"]}), tmp_path)
