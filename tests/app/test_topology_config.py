"""The run config's topology (nodes, placement): rows record it, it changes the price only where
the CP group spans nodes, and a topology that does not fit is refused in one line before any work
(docs/multinode.md)."""

from __future__ import annotations

import pytest

pytest.importorskip("hydra")
from hydra import compose, initialize_config_dir

from experiments.common.grid import ConfigError, _checked_runs
from experiments.common.rows import run_identity
from experiments.run import CONF_DIR, run
from flashcp.config import register_configs
from flashcp.results import read_rows

SMALL = ("num_sequences=2", "context_len=16384", "progress=false", "dataset=pile", "method=zigzag")


def _small(tmp_path, name, *overrides):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(
            "config", overrides=[f"results_dir={tmp_path}", f"name={name}", *SMALL, *overrides]
        )


def test_rows_record_the_topology_and_crossing_nodes_costs_more(tmp_path):
    one = read_rows(run(_small(tmp_path, "one", "cp_size=16", "hardware=h100_ib")))
    two = read_rows(run(_small(tmp_path, "two", "cp_size=16")))
    strided = read_rows(run(_small(tmp_path, "str", "cp_size=16", "placement=strided")))
    assert one["nodes"].isna().all()  # a flat profile: no nodes
    assert set(two["nodes"]) == {2} and set(two["placement"]) == {"consecutive"}
    assert set(strided["nodes"]) == {16} and set(strided["placement"]) == {"strided"}
    assert (strided["p2p_ms"].to_numpy() >= two["p2p_ms"].to_numpy()).all()
    # one node of h100_sxm: the inter-node constants are not part of the hardware's identity
    cfg8 = _small(tmp_path, "eight", "cp_size=8")
    nic = _small(tmp_path, "eight", "cp_size=8", "hardware.nic_bw_gbps=10")
    assert run_identity(cfg8, "v")["hardware_sha256"] == run_identity(nic, "v")["hardware_sha256"]
    cfg16 = _small(tmp_path, "x", "cp_size=16")
    nic16 = _small(tmp_path, "x", "cp_size=16", "hardware.nic_bw_gbps=10")
    assert (
        run_identity(cfg16, "v")["hardware_sha256"] != run_identity(nic16, "v")["hardware_sha256"]
    )


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (("cp_size=16", "nodes=3"), "cp_size 16 does not split evenly over num_nodes 3"),
        (("cp_size=16", "nodes=1"), "puts 16 ranks on a node of gpus_per_node 8"),
        (("cp_size=8", "placement=diagonal"), "unknown placement 'diagonal'"),
        (("cp_size=8", "nodes=2", "hardware=h100_ib"), "flat network"),
    ],
)
def test_a_topology_that_does_not_fit_is_refused_in_one_line(tmp_path, overrides, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        _checked_runs(_small(tmp_path, "bad", *overrides))
    assert "\n" not in str(err.value)
