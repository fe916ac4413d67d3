"""``flashcp_node`` (node-aware FlashCP, docs/scale.md): one node is flashcp's plan; across nodes
the imbalance stays within the target (or flashcp's own), fewer KV rows cross nodes, and the bytes
of its two-scope gather add up by link class; bad options are one-line errors."""

from __future__ import annotations

import numpy as np
import pytest

from flashcp.comm import (
    AttnShape,
    comm_volume,
    node_local_docs,
    node_scope_rows,
    node_scoped_comm_volume,
    node_scoped_volume_by_link,
    plan_topology,
)
from flashcp.data import load_distribution, sample_sequences
from flashcp.plan import make_plan
from flashcp.planners.flashcp_node import cross_node_tokens, node_first_ranks
from flashcp.registry import make_plan_for
from flashcp.topology import Topology

SHAPE = AttnShape(32, 8, 128, "bfloat16")


def _seqs(name: str, c: int, k: int = 6):
    return sample_sequences(load_distribution(name, context_len=c), k, c, seed=3)


@pytest.mark.parametrize("cp", [4, 8])
def test_one_node_is_flashcps_plan(cp):
    for d in _seqs("pile", 32768):
        a = make_plan_for("flashcp", d, cp)
        b = make_plan_for("flashcp_node", d, cp)
        for col in ("rank", "doc", "start", "length", "pad"):
            assert np.array_equal(getattr(a, col), getattr(b, col)), col
        for mode in ("train", "infer"):
            assert node_scoped_comm_volume(b, SHAPE, mode) == {
                **comm_volume(a, "allgather_sharded", SHAPE, mode),
                "node_scope_bytes": 0,
                "group_scope_bytes": comm_volume(a, "allgather_sharded", SHAPE, mode)["comm_bytes"],
            }


@pytest.mark.parametrize("dataset", ["wlb_llm", "pile"])
@pytest.mark.parametrize(("cp", "nodes"), [(16, 2), (32, 4)])
@pytest.mark.parametrize("placement", ["consecutive", "strided"])
def test_across_nodes_fewer_rows_cross_within_the_target(dataset, cp, nodes, placement):
    gathered = {"flashcp": 0, "flashcp_node": 0}
    for d in _seqs(dataset, 131072, 4):
        a = make_plan_for("flashcp", d, cp)
        b = make_plan_for("flashcp_node", d, cp, num_nodes=nodes, placement=placement)
        topo = plan_topology(b)
        assert (topo.num_nodes, topo.placement) == (nodes, placement)
        assert b.imbalance_ratio <= max(1.05, a.imbalance_ratio) + 1e-12
        assert b.info["cross_node_tokens"] == cross_node_tokens(b, topo.node_of)
        assert cross_node_tokens(b, topo.node_of) <= cross_node_tokens(a, topo.node_of)
        assert node_scope_rows(b)[1] <= node_scope_rows(a, topo.node_of)[1] + int(
            node_scope_rows(a, topo.node_of)[0]
        )
        links = node_scoped_volume_by_link(b, SHAPE, "train")
        vol = node_scoped_comm_volume(b, SHAPE, "train")
        for kind in ("allgather", "reducescatter"):
            assert ((links["intra"][kind] + links["inter"][kind]) == vol[f"{kind}_bytes"]).all()
        gathered["flashcp"] += cross_node_tokens(a, topo.node_of)
        gathered["flashcp_node"] += cross_node_tokens(b, topo.node_of)
    assert gathered["flashcp_node"] < gathered["flashcp"]


def test_relabelling_keeps_every_rank_whole():
    d = _seqs("wlb_llm", 65536, 1)[0]
    a = make_plan_for("flashcp", d, 16)
    new = node_first_ranks(a, Topology(16, 8, "consecutive", 2))
    assert sorted(new.tolist()) == list(range(16))
    assert np.array_equal(node_first_ranks(a, Topology(16, 16)), np.arange(16))


def test_node_local_docs_by_hand():
    # document 0 on ranks 0 and 1 (node 0), document 1 on ranks 1 and 2 (nodes 0 and 1),
    # document 2 on rank 3 only; document 3 has no shard
    plan = make_plan(
        "x", 4, [6, 4, 4, 0], [0, 1, 1, 2, 3], [0, 0, 1, 1, 2], [0, 4, 0, 2, 0],
        [4, 2, 2, 2, 4], pad=[0, 0, 2, 0],
    )  # fmt: skip
    assert node_local_docs(plan, np.array([0, 0, 1, 1])).tolist() == [True, False, True, True]
    assert node_scope_rows(plan, np.array([0, 0, 1, 1])) == (4, 2)


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        ({"num_nodes": 3}, "num_nodes 3 does not divide cp_size 8"),
        ({"num_nodes": 0}, "num_nodes must be a positive integer or None, got 0"),
        ({"placement": "ring"}, "unknown placement 'ring'"),
    ],
)
def test_bad_options_are_one_line_errors(opts, match):
    with pytest.raises(ValueError, match=match) as err:
        make_plan_for("flashcp_node", [100, 28], 8, **opts)
    assert "\n" not in str(err.value)


def test_pricing_one_scope_plans_is_the_all_gather_familys():
    """A flashcp_node plan across nodes that keeps one scope runs FlashCP's op: the node-scoped
    pricing gives price_plans' numbers for it; a two-scope plan's collectives move fewer bytes
    across nodes than its one-scope gather would."""
    from flashcp.sim import load_hardware
    from flashcp.sim.cost import price_plans
    from flashcp.sim.node_scoped import price_node_scoped, spans_nodes

    hw = load_hardware("h100_sxm")
    two = [make_plan_for("flashcp_node", d, 16, gpus_per_node=8) for d in _seqs("pile", 131072)]
    two = [p for p in two if p.info["node_scope"]]
    # the same plans as a planner keeping one scope makes them (FlashCP's op)
    one = [
        make_plan(
            p.method, p.cp_size, p.doc_lens, p.rank, p.doc, p.start, p.length,
            info={**p.info, "node_scope": False}, pad=p.pad,
        )
        for p in two
    ]  # fmt: skip
    assert two
    assert not spans_nodes(one) and spans_nodes(two)
    for mode in ("train", "infer"):
        mine = price_node_scoped(one, SHAPE, [mode], [hw, hw])
        ref = price_plans(one, [SHAPE], [mode], [hw], "allgather_sharded", nodes=2)
        for col in ("total_ms", "allgather_ms", "others_ms", "comm_bytes"):
            for a in (0, 1):
                assert np.allclose(mine[col][a, 0], ref[col][0, 0, 0], rtol=1e-9, atol=0), col
    for p in two:
        mn, mg = node_scope_rows(p)
        assert mn > 0 and mg < int(p.send_tokens_per_rank.max())
        links = node_scoped_volume_by_link(p, SHAPE, "infer")
        flat = comm_volume(p, "allgather_sharded", SHAPE, "infer")["allgather_bytes"]
        assert links["inter"]["allgather"].max() < flat


def test_scale_figure_and_link_table_from_a_small_summary(tmp_path):
    """experiments.plot's scale figure (one file per dataset and mode) and experiments.scale_links'
    table from a two-point summary: every method's bytes by link class, flashcp_node's inter-node
    bytes no more than flashcp's."""
    import pandas as pd

    from experiments.plot import draw
    from experiments.scale_links import link_table

    rows = []
    for cp, nodes in ((8, 1), (16, 2)):
        for method, speedup in (("llama3", 1.0), ("flashcp", 1.5), ("flashcp_node", 1.6)):
            rows.append({
                "dataset": "pile", "context_len": 16384, "cp_size": cp, "nodes": nodes,
                "placement": "consecutive", "method": method, "mode": "train",
                "speedup_vs_llama3": speedup, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64,
                "dtype": "bfloat16", "seed": 0, "num_sequences": 2, "hardware": "h100_sxm",
                "executor": "sim", "num_ok": 2,
            })  # fmt: skip
    pd.DataFrame(rows).to_csv(tmp_path / "summary.csv", index=False)
    assert draw("scale", tmp_path) == tmp_path / "scale_pile_train.png"
    table = link_table(pd.read_csv(tmp_path / "summary.csv"))
    assert len(table) == 6 and set(table["mode"]) == {"train"}
    two = table[table["cp_size"] == 16].set_index("method")
    assert two.loc["llama3", "inter_mib_max_rank"] > 0
    assert two.loc["flashcp_node", "inter_mib_max_rank"] <= two.loc["flashcp", "inter_mib_max_rank"]
    assert (table[table["cp_size"] == 8]["inter_mib_max_rank"] == 0).all()
