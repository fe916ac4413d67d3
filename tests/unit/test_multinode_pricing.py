"""The two-level network (flashcp.sim.network): the per-plan model and the batch agree on CP
groups that span nodes, one node prices as the flat profile did, and the crossings are the ones
the per-link byte account (flashcp.comm.comm_volume_by_link) puts on the NICs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flashcp.comm import AttnShape, comm_volume_by_link
from flashcp.registry import COMM_KIND, make_plan_for
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS
from flashcp.sim import load_hardware, simulate
from flashcp.sim.cost import price_plans
from flashcp.sim.network import group_links, topology_for
from flashcp.topology import Topology

HW = load_hardware("h100_sxm")
FLAT = dataclasses.replace(HW, name="h100_flat", gpus_per_node=None)
SHAPES = [AttnShape(32, 8, 128, "bfloat16"), AttnShape(16, 16, 128, "bfloat16")]
MODES = ["train", "infer"]
LENS = [30000, 2000, 50000, 17000, 32072]  # C = 131072
PLANS = [
    ("llama3", {}), ("flashcp", {}), ("ring", {}), ("zigzag", {}), ("ulysses", {}),
    ("usp", {"ulysses_degree": 2}), ("usp", {"ulysses_degree": 8}),
    ("flashcp_ulysses", {"ulysses_degree": 4}), ("flashcp_ulysses", {"ulysses_degree": 8}),
]  # fmt: skip
#: (placement, nodes) at cp_size 16 on nodes of 8 GPUs
LAYOUTS = [("consecutive", None), ("consecutive", 4), ("strided", 2), ("strided", None)]
SHAPE_A = SHAPES[0]


@pytest.mark.parametrize("compiled_mode", ["0", "1"])
@pytest.mark.parametrize("placement, nodes", LAYOUTS)
def test_batch_equals_per_plan_across_nodes(placement, nodes, compiled_mode, monkeypatch):
    """Both pricing paths agree to 1e-12 on every layout, with the NumPy statistics and with
    the compiled ones."""
    if compiled_mode == "1":
        pytest.importorskip("numba")
    monkeypatch.setenv("FLASHCP_COMPILED", compiled_mode)
    plans = [make_plan_for(m, LENS, 16, **o) for m, o in PLANS]
    got = price_plans(plans, SHAPES, MODES, [HW], placement=placement, nodes=nodes)
    for k, p in enumerate(plans):
        for b, shape in enumerate(SHAPES):
            for m, mode in enumerate(MODES):
                want = simulate(p, shape, HW, mode, placement=placement, nodes=nodes)
                for col in PHASE_COLUMNS:
                    assert got[col][0, b, m, k] == pytest.approx(want[col], rel=1e-12, abs=1e-12), (
                        f"{p.method} u={p.ulysses_degree} {shape} {mode} {col}"
                    )
                for col in COMM_COLUMNS:
                    assert got[col][0, b, m, k] == want[col]


@pytest.mark.parametrize("cp_size", [4, 8])
def test_one_node_is_the_flat_profile_to_the_bit(cp_size):
    plans = [
        make_plan_for(m, LENS, cp_size, **o)
        for m, o in PLANS
        if o.get("ulysses_degree", 1) <= cp_size
    ]
    got = price_plans(plans, SHAPES, MODES, [HW])
    flat = price_plans(plans, SHAPES, MODES, [FLAT])
    for col in (*PHASE_COLUMNS, *COMM_COLUMNS):
        np.testing.assert_array_equal(got[col], flat[col])
    for p in plans[:3]:
        assert simulate(p, SHAPES[0], HW, "train", nodes=1) == simulate(p, SHAPES[0], FLAT, "train")


def test_crossing_nodes_slows_the_ring_and_ulysses_more_than_the_gather():
    """At CP 16 over 2 nodes the ring's crossing hops run at one NIC (47 GB/s, not NVLink's
    send/recv rate) and half of Ulysses' all-to-all peers are remote; the all-gather's ring spreads
    over the node's 8 NICs (8 x 47 GB/s > the NVLink bus bandwidth): it changes least."""
    shape = SHAPES[0]
    col = {"zigzag": "p2p_ms", "ulysses": "alltoall_ms", "llama3": "allgather_ms"}
    ratio = {}
    for method, c in col.items():
        p = make_plan_for(method, LENS, 16)
        two = simulate(p, shape, HW, "train")
        one = simulate(p, shape, FLAT, "train")
        assert two[c] >= one[c]
        ratio[method] = two[c] / one[c]
    assert ratio["zigzag"] > 1.5 and ratio["ulysses"] > 1.5
    assert ratio["llama3"] < min(ratio["zigzag"], ratio["ulysses"])


@pytest.mark.parametrize("placement, nodes", LAYOUTS)
@pytest.mark.parametrize("method, opts", PLANS)
def test_links_cross_where_the_byte_account_puts_bytes_on_nics(method, opts, placement, nodes):
    plan = make_plan_for(method, LENS, 16, **opts)
    kind = COMM_KIND[method].value
    topo = topology_for(HW, 16, placement, nodes)
    a2a_only = kind == "alltoall" or plan.ulysses_degree == 16
    links = group_links(topo, 16 if a2a_only else plan.ulysses_degree, a2a_only)
    inter = comm_volume_by_link(plan, kind, SHAPE_A, "train", topo)["inter"]
    if kind == "p2p_ring":
        assert links.p2p_crosses == bool(inter["p2p"].any())
    elif kind != "alltoall":
        assert links.collective_crosses == bool(inter["allgather"].any())
        assert links.collective_crosses == bool(inter["reducescatter"].any())
    assert bool(links.a2a_inter_peers) == bool(inter["alltoall"].any())


def test_bad_topologies_are_one_line_errors():
    plan = make_plan_for("zigzag", LENS, 16)
    with pytest.raises(ValueError, match="does not split evenly over num_nodes 3"):
        simulate(plan, SHAPE_A, HW, "train", nodes=3)
    with pytest.raises(ValueError, match="flat network"):
        simulate(plan, SHAPE_A, FLAT, "train", nodes=2)
    with pytest.raises(ValueError, match="unknown placement 'diagonal'"):
        price_plans([plan], [SHAPE_A], ["train"], [HW], placement="diagonal")
    assert topology_for(HW, 16) == Topology(16, 8)
