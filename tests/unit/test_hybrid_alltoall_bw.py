"""The all-to-all bus bandwidth is its own hardware constant (``alltoall_busbw_gbps``; unset: the
all-gather's), priced by every all-to-all of the simulator (per plan and batched) and varied on its
own by the peers' sensitivity studies (conf/study/peers*.yaml)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flashcp.comm import AttnShape
from flashcp.registry import make_plan_for
from flashcp.sim import load_hardware, simulate
from flashcp.sim.cost import price_plans
from flashcp.sim.hardware import list_hardware, read_profile

LENS = [9000, 300, 20000, 3468]  # C = 32768
SHAPE = AttnShape(32, 8, 128, "bfloat16")


@pytest.mark.parametrize("name", list_hardware())
def test_unset_it_is_the_allgather_bandwidth(name):
    hw = load_hardware(name)
    assert hw.alltoall_busbw_gbps == hw.allgather_busbw_gbps
    assert "alltoall_busbw_gbps" in read_profile(name)  # every profile says it (and why)
    explicit = load_hardware({**hw.to_dict(), "alltoall_busbw_gbps": 100.0})
    assert explicit.alltoall_busbw_gbps == 100.0


@pytest.mark.parametrize(
    ("method", "opts"), [("ulysses", {}), ("usp", {"ulysses_degree": 2}),
                         ("flashcp_ulysses", {"ulysses_degree": 4})],
)  # fmt: skip
def test_it_prices_the_alltoalls_alone(method, opts):
    base = load_hardware("h100_sxm")
    slow = dataclasses.replace(base, alltoall_busbw_gbps=base.allgather_busbw_gbps / 2)
    plan = make_plan_for(method, LENS, 8, **opts)
    for mode in ("train", "infer"):
        a, b = simulate(plan, SHAPE, base, mode), simulate(plan, SHAPE, slow, mode)
        assert b["alltoall_ms"] > 1.5 * a["alltoall_ms"] > 0
        for col in ("allgather_ms", "reducescatter_ms", "p2p_ms", "attn_fwd_ms"):
            assert b[col] == a[col], col
    got = price_plans([plan], [SHAPE], ["train", "infer"], [base, slow])
    for m, mode in enumerate(("train", "infer")):
        for a, hw in enumerate((base, slow)):
            want = simulate(plan, SHAPE, hw, mode)["total_ms"]
            np.testing.assert_allclose(got["total_ms"][a, 0, m, 0], want, rtol=1e-12)
    flashcp = make_plan_for("flashcp", LENS, 8)
    assert simulate(flashcp, SHAPE, slow, "train") == simulate(flashcp, SHAPE, base, "train")


def test_sensitivity_varies_it_alone_or_with_the_allgather():
    from experiments.sensitivity import perturb

    hw = load_hardware("h100_sxm")
    moved = perturb(hw, {"allgather_busbw_gbps": 0.5})
    assert moved.alltoall_busbw_gbps == moved.allgather_busbw_gbps == hw.allgather_busbw_gbps / 2
    apart = perturb(hw, {"allgather_busbw_gbps": 0.5, "alltoall_busbw_gbps": 2.0})
    assert apart.alltoall_busbw_gbps == 2 * hw.alltoall_busbw_gbps
    assert apart.allgather_busbw_gbps == hw.allgather_busbw_gbps / 2


@pytest.mark.parametrize(
    ("study", "model", "cp_size", "hardware"),
    [("peers", "h32", 8, "h100_sxm"), ("peers_gqa", "h32kv8", 8, "h100_sxm"),
     ("peers_gqa_cp4", "h32kv8", 4, "h100_sxm"), ("peers_ib16", "h32kv8", 16, "h100_ib")],
)  # fmt: skip
def test_peers_studies_vary_the_alltoall_bandwidth(study, model, cp_size, hardware):
    pytest.importorskip("hydra")
    from hydra import compose, initialize_config_dir

    from experiments.common.entry import CONF_DIR
    from experiments.sensitivity import VARIED, check_sensitivity_config

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("sensitivity", overrides=[f"+study={study}"])
    check_sensitivity_config(cfg)
    assert (cfg.model.name, cfg.cp_size, cfg.hardware.name) == (model, cp_size, hardware)
    assert cfg.name == f"sensitivity_{study}"
    assert set(cfg.constants) == {*VARIED, "alltoall_busbw_gbps"}
    assert {"ulysses", "usp", "flashcp_ulysses", "flashcp", "llama3"} == set(cfg.methods)
