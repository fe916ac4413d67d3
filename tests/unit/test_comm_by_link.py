"""Per-rank bytes by link class (flashcp.comm.comm_volume_by_link): the split adds up to
comm_volume on every rank, and each kind's bytes land on the link class its sender implies."""

import numpy as np
import pytest

from flashcp.comm import AttnShape, comm_volume, comm_volume_by_link
from flashcp.registry import COMM_KIND, make_plan_for
from flashcp.topology import Topology

LENS = [30000, 2000, 50000, 49072]  # C = 131072
SHAPE = AttnShape(32, 8, 128, "bfloat16")
KINDS = ("allgather", "reducescatter", "p2p", "alltoall")
TOPOLOGIES = [
    Topology.single_node(16),
    Topology(16, 8),  # 2 nodes x 8
    Topology(16, 4),  # 4 nodes x 4
    Topology(16, 8, "strided", num_nodes=2),
    Topology(16, 8, "strided"),  # every rank on its own node
]
PLANS = [
    ("llama3", {}),
    ("flashcp", {}),
    ("ring", {}),
    ("zigzag", {}),
    ("ulysses", {}),
    ("usp", {"ulysses_degree": 4}),
    ("flashcp_ulysses", {"ulysses_degree": 4}),
    ("flashcp_ulysses", {"ulysses_degree": 16}),
]


@pytest.mark.parametrize("method, opts", PLANS)
def test_every_rank_receives_comm_volume_split_over_links(method, opts):
    plan = make_plan_for(method, LENS, 16, **opts)
    kind = COMM_KIND[method].value
    for topo in TOPOLOGIES:
        for mode in ("train", "infer"):
            _check_split(plan, kind, topo, mode)


def _check_split(plan, kind, topo, mode):
    vol = comm_volume(plan, kind, SHAPE, mode)
    got = comm_volume_by_link(plan, kind, SHAPE, mode, topo)
    total = np.zeros(16, dtype=np.int64)
    for k in KINDS:
        for c in ("intra", "inter"):
            assert got[c][k].dtype == np.int64 and got[c][k].shape == (16,)
            assert (got[c][k] >= 0).all()
        both = got["intra"][k] + got["inter"][k]
        np.testing.assert_array_equal(both, np.full(16, vol[f"{k}_bytes"]))
        total += both
    assert int(total.max()) == vol["comm_bytes"]
    if not topo.spans_nodes:
        assert not any(got["inter"][k].any() for k in KINDS)


def test_whole_group_collective_follows_the_topology_ring():
    plan = make_plan_for("flashcp", LENS, 16)
    for topo in TOPOLOGIES:
        got = comm_volume_by_link(plan, "allgather_sharded", SHAPE, "train", topo)
        for k in ("allgather", "reducescatter"):
            np.testing.assert_array_equal(got["inter"][k] > 0, topo.collective_pred_crosses)


def test_ring_follows_cp_rank_order():
    plan = make_plan_for("zigzag", LENS, 16)
    for topo in TOPOLOGIES:
        got = comm_volume_by_link(plan, "p2p_ring", SHAPE, "train", topo)
        np.testing.assert_array_equal(got["inter"]["p2p"] > 0, topo.p2p_ring_crosses)


def test_ulysses_chunks_by_sender_node():
    plan = make_plan_for("ulysses", LENS, 16)
    a2a = comm_volume(plan, "alltoall", SHAPE, "train")["alltoall_bytes"]
    got = comm_volume_by_link(plan, "alltoall", SHAPE, "train", Topology(16, 8))
    # 7 of the 15 peers share the node, 8 are on the other one
    np.testing.assert_array_equal(got["intra"]["alltoall"], np.full(16, a2a // 15 * 7))
    np.testing.assert_array_equal(got["inter"]["alltoall"], np.full(16, a2a // 15 * 8))


def test_hybrid_groups_inside_nodes_send_only_the_cross_ring_between_nodes():
    """usp with u = 8 on 2 nodes x 8: the all-to-all stays inside each node; the 2-group zigzag
    ring between rank j and rank 8 + j crosses on every hop."""
    plan = make_plan_for("usp", LENS, 16, ulysses_degree=8)
    got = comm_volume_by_link(plan, "p2p_ring", SHAPE, "train", Topology(16, 8))
    assert not got["inter"]["alltoall"].any() and got["intra"]["alltoall"].all()
    assert got["inter"]["p2p"].all() and not got["intra"]["p2p"].any()
    # strided over 2 nodes: the group's members alternate nodes, the cross ring (j, 8 + j)
    # stays on one node
    got = comm_volume_by_link(
        plan, "p2p_ring", SHAPE, "train", Topology(16, 8, "strided", num_nodes=2)
    )
    assert not got["inter"]["p2p"].any()
    a2a = got["intra"]["alltoall"] + got["inter"]["alltoall"]
    np.testing.assert_array_equal(got["inter"]["alltoall"] * 7, a2a * 4)  # 4 of 7 peers remote


def test_hybrid_cross_allgather_uses_ncc_ring_of_the_cross_group():
    """flashcp_ulysses u = 2 over 4 nodes x 4 consecutive: cross group j = {j, j+2, ..., j+14},
    two members per node; NCCL's ring over it leaves each node once: 4 of 8 receive inter."""
    plan = make_plan_for("flashcp_ulysses", LENS, 16, ulysses_degree=2)
    got = comm_volume_by_link(plan, "allgather_sharded", SHAPE, "train", Topology(16, 4))
    assert np.flatnonzero(got["inter"]["allgather"]).tolist() == [0, 1, 4, 5, 8, 9, 12, 13]
    assert not got["inter"]["alltoall"].any()  # pairs (2g, 2g + 1) share a node


def test_topology_size_must_match():
    plan = make_plan_for("ring", LENS, 8)
    with pytest.raises(ValueError, match="topology cp_size 16 does not match the plan's cp_size 8"):
        comm_volume_by_link(plan, "p2p_ring", SHAPE, "train", Topology(16, 8))
