"""`flashcp advise --nodes`: node-aware FlashCP is planned for the advised topology and priced
with its two-scope gather, as ``executor=sim`` prices it (docs/multinode.md, docs/scale.md)."""

from __future__ import annotations

import numpy as np

from flashcp.cli.advise import _sample, advise, load_model
from flashcp.registry import make_plan_for
from flashcp.sim.hardware import load_hardware
from flashcp.sim.node_scoped import price_node_scoped, spans_nodes


def test_advise_plans_and_prices_flashcp_node_on_its_nodes():
    kw = dict(dataset="pile", context_len=32768, num_sequences=3, seed=0)
    df = advise(
        cp_size=16, nodes=2, methods=["flashcp", "flashcp_node"], num_draws=1, draw_sequences=1,
        **kw,
    )  # fmt: skip
    seqs = _sample(None, "pile", 32768, 3, 0, "split")[0]
    plans = [
        make_plan_for("flashcp_node", s, 16, num_nodes=2, placement="consecutive", gpus_per_node=8)
        for s in seqs
    ]
    assert spans_nodes(plans)  # the node scope is used: otherwise this checks nothing new
    hw = load_hardware("h100_sxm")
    want = price_node_scoped(plans, load_model("h32"), ["train"], hw)
    rows = df.attrs["rows"]
    got = rows[rows["method"] == "flashcp_node"]["total_ms"].to_numpy()
    np.testing.assert_allclose(got, want["total_ms"][0, 0], rtol=1e-12)


def test_advise_reports_the_bytes_that_cross_nodes():
    from flashcp.cli.advise import format_report

    kw = dict(dataset="pile", context_len=32768, num_sequences=2, num_draws=1, draw_sequences=1)
    two = advise(cp_size=16, nodes=2, methods=["flashcp", "flashcp_node"], **kw).set_index("method")
    # an all-gather ring leaves each node once: the node's first rank gets its whole share from
    # the other node (docs/multinode.md); the two-scope gather keeps some of it on NVLink
    assert two.loc["flashcp", "inter_mib_per_rank"] == two.loc["flashcp", "comm_mib_per_rank"] > 0
    node = two.loc["flashcp_node"]
    assert 0 < node["inter_mib_per_rank"] < node["comm_mib_per_rank"]
    assert "inter_mib_per_rank" in format_report(two.reset_index())
    one = advise(cp_size=8, methods=["flashcp"], **kw)
    assert (one["inter_mib_per_rank"] == 0).all()
    assert "inter_mib_per_rank" not in format_report(one)
