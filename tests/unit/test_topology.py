"""The CP group's placement on nodes (flashcp.topology): node of each rank, ring crossings, errors."""

import numpy as np
import pytest

from flashcp.topology import Topology


def test_consecutive_fills_nodes_and_the_rings_cross_once_per_node():
    t = Topology(16, 8)
    assert t.num_nodes == 2 and t.ranks_per_node == 8 and t.spans_nodes
    np.testing.assert_array_equal(t.node_of, [0] * 8 + [1] * 8)
    assert np.flatnonzero(t.collective_pred_crosses).tolist() == [0, 8]
    assert np.flatnonzero(t.p2p_ring_crosses).tolist() == [0, 8]


def test_strided_puts_neighbours_on_other_nodes_but_nccl_ring_groups_by_node():
    t = Topology(8, 8, "strided", num_nodes=2)
    np.testing.assert_array_equal(t.node_of, [0, 1] * 4)
    assert t.collective_ring.tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert int(t.collective_pred_crosses.sum()) == 2  # the ring leaves each node once
    assert t.p2p_ring_crosses.all()  # CP rank order alternates nodes
    assert Topology(4, 8, "strided").num_nodes == 4


def test_one_node_crosses_nothing():
    for t in (Topology(4, 8), Topology.single_node(8)):
        assert not t.spans_nodes
        assert not t.collective_pred_crosses.any() and not t.p2p_ring_crosses.any()


@pytest.mark.parametrize(
    "args, match",
    [
        ((16, 4, "consecutive", 2), "8 ranks on a node of gpus_per_node 4"),
        ((6, 8, "diagonal"), "unknown placement 'diagonal'"),
        ((7, 8, "consecutive", 2), "cp_size 7 does not split evenly over num_nodes 2"),
        ((0, 8), "cp_size must be a positive integer, got 0"),
        ((8, 8, "consecutive", 0), "num_nodes must be a positive integer, got 0"),
    ],
)
def test_bad_topologies_are_one_line_errors(args, match):
    with pytest.raises(ValueError, match=match):
        Topology(*args)
