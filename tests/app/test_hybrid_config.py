"""A head-parallel method whose Ulysses degree the model's heads do not allow is refused at startup
(one line naming the numbers and the nearest valid degrees), by ``flashcp-run`` (one run, or a
grid none of whose runs can be made; in a grid, that run alone becomes error rows) and by
``flashcp plan --num-heads``, instead of failing sequence by sequence."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("hydra")
from test_config_applied import SMALL, _compose

from experiments.common.grid import ConfigError, _checked_runs, checked_grid
from flashcp.cli import main


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (("method=ulysses", "cp_size=8", "model.num_heads=12", "model.num_kv_heads=12"),
         r"method=ulysses at cp_size = 8: ulysses degree 8 does not divide num_heads = 12 .*"
         r"nearest: 6, 12\)"),
        (("method=usp", "method.options.ulysses_degree=4", "model.num_heads=6",
          "model.num_kv_heads=2"),
         r"method=usp at cp_size = 4: ulysses degree 4 does not divide num_heads = 6 .*"
         r"nearest: 2, 6\)"),
        (("method=flashcp_ulysses", "method.options.ulysses_degree=2", "model.num_heads=6",
          "model.num_kv_heads=3"),
         r"ulysses_degree = 2: ulysses degree 2 neither divides nor is a multiple of "
         r"num_kv_heads = 3"),
    ],
)  # fmt: skip
def test_heads_the_degree_does_not_allow_are_a_config_error(overrides, match):
    cfg = _compose(*SMALL, *overrides)
    with pytest.raises(ConfigError, match=match) as err:
        _checked_runs(cfg)
    assert "\n" not in str(err.value)


def test_grids_name_the_run_the_heads_refuse():
    # in a grid, that run alone cannot be made: it becomes error rows, the others run
    cfg = _compose(*SMALL, "grid.method=[flashcp,ulysses]", "grid.cp_size=[4,8]",
                   "model.num_heads=12", "model.num_kv_heads=12")  # fmt: skip
    runs, inapplicable = checked_grid(cfg)
    assert len(runs) == 4 and list(inapplicable) == [3]
    assert re.search(r"grid run method=ulysses cp_size=8: .*nearest: 6, 12", inapplicable[3])
    # a grid none of whose runs can be made is refused
    cfg = _compose(*SMALL, "grid.method=[ulysses]", "grid.cp_size=[8]", "model.num_heads=12",
                   "model.num_kv_heads=12")  # fmt: skip
    with pytest.raises(ConfigError, match=r"nearest: 6, 12"):
        _checked_runs(cfg)


def test_allowed_degrees_pass():
    # KV heads replicated up to the degree (8 KV heads over 16 ranks), u = 1, and other methods
    for overrides in (
        ("method=ulysses", "cp_size=16", "model=h32kv8"),
        ("method=usp", "method.options.ulysses_degree=1", "model.num_heads=3",
         "model.num_kv_heads=3"),
        ("method=flashcp", "model.num_heads=3", "model.num_kv_heads=3"),
    ):  # fmt: skip
        assert len(_checked_runs(_compose(*SMALL, *overrides))) == 1


def test_flashcp_plan_refuses_heads_the_degree_does_not_allow(capsys):
    argv = ["plan", "--method", "ulysses", "--cp-size", "3", "--doc-lens", "30"]
    assert main([*argv, "--num-heads", "32"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "ulysses degree 3 does not divide num_heads = 32" in err
    assert "nearest: 2, 4" in err
    assert main(argv) == 0  # without heads nothing to check
    assert main([*argv, "--num-kv-heads", "4"]) == 2
    assert "--num-kv-heads needs --num-heads" in capsys.readouterr().err
    usp = ["plan", "--method", "usp", "--cp-size", "8", "--doc-lens", "64", "--option",
           "ulysses_degree=4", "--num-heads", "32", "--num-kv-heads"]  # fmt: skip
    assert main([*usp, "8"]) == 0
    assert main([*usp, "6"]) == 2  # 32 % 6: H not a multiple of Hkv
    assert "num_heads = 32 is not a multiple of num_kv_heads = 6" in capsys.readouterr().err
