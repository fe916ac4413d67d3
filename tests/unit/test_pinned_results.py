"""The headline numbers are pinned: a subset of the committed Fig. 5 is recomputed from scratch.

``results/fig5/summary.csv`` is what the README and the figure report. This test reruns one slice
of its grid (the WLB-LLM job at CP 8, every method, both models, both modes, all of its 1,000
sequences) through the same Hydra entry point and compares every summary value that a figure or
table reads with the committed one. A change to a planner, the sampler or the cost model that moves
any of them fails here, so it is seen and the results are regenerated on purpose (docs/results.md
has the commands).

Tolerance: ``PIN_RTOL`` relative (the rerun is deterministic; what remains is float summation
order). The run identity (``run_id``) includes the code version, so runs are matched on their
configuration columns instead, as ``aggregate --compare`` matches them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("hydra", reason="the Hydra harness needs hydra-core and omegaconf")
from hydra import compose, initialize_config_dir

from experiments.aggregate import summarise
from experiments.run import CONF_DIR, run
from flashcp.config import register_configs
from flashcp.results import read_rows

pytestmark = pytest.mark.slow  # a Fig. 5 slice recomputed through the app: the full suite runs it

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "results" / "fig5" / "summary.csv"
#: the slice of Fig. 5's grid that is recomputed
SLICE = {"dataset": "wlb_llm", "cp_size": 8}
#: relative tolerance of a recomputed summary value
PIN_RTOL = 1e-9
#: configuration columns a run is matched on
KEYS = ["dataset", "method", "cp_size", "model", "mode", "num_sequences", "context_len", "seed"]
#: the values the figures and tables read
PINNED = [
    "total_ms_mean", "total_ms_median", "total_ms_p90", "allgather_ms_mean", "attn_fwd_ms_mean",
    "attn_bwd_ms_mean", "reducescatter_ms_mean", "p2p_ms_mean", "others_ms_mean",
    "imbalance_ratio_mean", "comm_bytes_mean", "comm_tokens_mean", "speedup_vs_llama3",
    "speedup_vs_llama3_gmean", "speedup_vs_llama3_ci95_lo", "speedup_vs_llama3_ci95_hi",
]  # fmt: skip


@pytest.fixture(scope="module")
def recomputed(tmp_path_factory) -> tuple:
    out = tmp_path_factory.mktemp("pin")
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "experiment=fig5",
                f"dataset={SLICE['dataset']}",
                f"grid.cp_size=[{SLICE['cp_size']}]",
                f"results_dir={out}",
                "progress=false",
                "plots=[]",
            ],
        )
    rows = read_rows(run(cfg))
    ref = read_rows(COMMITTED)
    ref = ref[(ref["dataset"] == SLICE["dataset"]) & (ref["cp_size"] == SLICE["cp_size"])]
    return summarise(rows), ref


def test_the_slice_is_the_committed_one(recomputed):
    """The rerun covers exactly the committed slice's runs (5 methods x 2 models x 2 modes)."""
    new, ref = recomputed
    assert len(ref) == 20, "the committed summary lost part of the slice"
    got = set(map(tuple, new[KEYS].astype(str).to_numpy()))
    want = set(map(tuple, ref[KEYS].astype(str).to_numpy()))
    assert got == want
    assert (new["num_error"] == 0).all() and (new["num_ok"] == 1000).all()


@pytest.mark.parametrize("col", PINNED)
def test_committed_fig5_values_are_reproduced(recomputed, col):
    new, ref = recomputed
    both = new.astype({k: str for k in KEYS}).merge(
        ref.astype({k: str for k in KEYS}), on=KEYS, suffixes=("_new", "_ref")
    )
    assert len(both) == len(ref)
    a, b = both[f"{col}_new"].to_numpy(float), both[f"{col}_ref"].to_numpy(float)
    bad = ~np.isclose(a, b, rtol=PIN_RTOL, atol=0.0, equal_nan=True)
    assert not bad.any(), (
        f"{col} moved from the committed results/fig5 in "
        + "; ".join(
            f"{r.method} {r.model} {r.mode}: {x:.9g} -> {y:.9g}"
            for r, x, y in zip(both[bad].itertuples(), b[bad], a[bad], strict=True)
        )
        + " (regenerate the results on purpose: docs/results.md)"
    )
