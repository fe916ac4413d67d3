"""flashcp-run refuses, before any work and in one line, ``flashcp_node`` options that plan for
another CP group than the one the run prices (docs/scale.md: its topology follows the run's)."""

from __future__ import annotations

import pytest

pytest.importorskip("hydra")
from hydra import compose, initialize_config_dir

from experiments.common.grid import ConfigError, _checked_runs
from experiments.run import CONF_DIR
from flashcp.config import register_configs

SMALL = ("num_sequences=2", "context_len=16384", "progress=false", "method=flashcp_node")


def _cfg(tmp_path, *overrides):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(
            "config", overrides=[f"results_dir={tmp_path}", "name=n", *SMALL, *overrides]
        )


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (("cp_size=16", "nodes=2", "method.options.num_nodes=4"), "num_nodes=4"),
        (("cp_size=16", "hardware=h100_ib", "method.options.num_nodes=2"), "a flat network"),
        (("cp_size=16", "method.options.placement=strided"), "placement=strided"),
    ],
)
def test_flashcp_node_options_that_disagree_with_the_run_are_refused(tmp_path, overrides, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        _checked_runs(_cfg(tmp_path, *overrides))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [("cp_size=16",), ("cp_size=16", "nodes=4", "placement=strided"), ("hardware=h100_ib",)],
)
def test_flashcp_node_following_the_run_passes(tmp_path, overrides):
    assert _checked_runs(_cfg(tmp_path, *overrides))
