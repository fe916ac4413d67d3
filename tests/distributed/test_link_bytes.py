"""Bytes per link class, counted: the ops on 4 gloo ranks grouped into nodes (2 nodes x 2 ranks,
consecutive and strided, and 4 nodes x 1) count, through a :class:`CommCounter` given the CP
group's :class:`~flashcp.topology.Topology`, the bytes each rank receives inside and across nodes,
per kind; they must equal :func:`flashcp.comm.comm_volume_by_link` for that rank, for every
registered method (the hybrids at every Ulysses degree), train and infer, and
``keep_gathered_kv`` for the all-gather family. The same counts are also held to a hand-made
account of a few plans (the ring's predecessors, NCCL's ring node by node, the all-to-all's
chunks), and the counter's topology checks are one-line errors. Plans are made here and handed to
the forked ranks (``tests/mp_utils.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mp_utils import run_ranks

from flashcp.comm import AttnShape, comm_volume, comm_volume_by_link
from flashcp.ops import get_attn_op
from flashcp.ops.collectives import COMM_KINDS, CommCounter, LocalGroup
from flashcp.ops.sharding import shard_tensor
from flashcp.registry import COMM_KIND, get_method, make_plan_for, method_names
from flashcp.topology import Topology

N = 4
LENS = [5, 21, 2, 9, 27]  # C = 64
SHAPE = AttnShape(4, 2, 8, "float32")
HYBRIDS = ("usp", "flashcp_ulysses")
#: name -> the CP group's topology: 2 nodes of 2 ranks, CP rank order node by node or
#: round-robin; every rank on its own node
TOPOLOGIES = {
    "2x2-consecutive": Topology(N, 2, "consecutive", 2),
    "2x2-strided": Topology(N, 2, "strided", 2),
    "4x1": Topology(N, 1, "strided"),
}


def _cases(methods, modes=("train", "infer")) -> list[tuple]:
    """(method, ulysses_degree, mode, keep_gathered_kv) of ``methods``: hybrids at u = 1, 2, 4;
    the all-gather family with and without keep_gathered_kv (train only: infer has no backward)."""
    out = []
    for m in methods:
        if get_method(m).op is None:  # an op of its own (flashcp_node's two-scope gather): its
            continue  # bytes per scope and link class are held to its account in its own test
        degrees = (1, 2, 4) if m in HYBRIDS else (None,)
        keeps = (False, True) if get_method(m).op.value == "allgather" else (False,)
        for u in degrees:
            for mode in modes:
                for keep in keeps:
                    if not (keep and mode == "infer"):
                        out.append((m, u, mode, keep))
    return out


def _plans(cases) -> dict:
    plans = {}
    for m, u, *_ in cases:
        if (m, u) not in plans:
            opts = {} if u is None else {"ulysses_degree": u}
            plans[m, u] = make_plan_for(m, LENS, N, **opts)
    return plans


def _count(rank, world, cases, plans, topologies):
    """Per (case, topology): this rank's counter (kinds, and bytes by link class)."""
    torch.manual_seed(0)
    full = [torch.randn(64, h, SHAPE.head_dim) for h in (4, 2, 2, 4)]
    group = dist.group.WORLD
    res = {}
    for case in cases:
        m, u, mode, keep = case
        plan = plans[m, u]
        prepare, attn = get_attn_op(m)
        meta = prepare(plan, rank)
        opts = {"keep_gathered_kv": True} if keep else {}
        for name, topo in topologies.items():
            q, k, v, dout = (shard_tensor(x, plan, rank) for x in full)
            train = mode == "train"
            q, k, v = (x.requires_grad_(train) for x in (q, k, v))
            counter = CommCounter(topology=topo, group=group)
            with torch.set_grad_enabled(train):
                out = attn(q, k, v, meta, group, backend="reference", counter=counter, **opts)
                if train:
                    out.backward(dout)
            res[case, name] = (counter.as_dict(), counter.by_link())
    return res


def _check(cases, plans, per_rank, topologies) -> list[str]:
    bad = []
    for case in cases:
        m, u, mode, keep = case
        plan = plans[m, u]
        kind = COMM_KIND[m]
        want_total = comm_volume(plan, kind, SHAPE, mode, keep_gathered_kv=keep)
        for name, topo in topologies.items():
            want = comm_volume_by_link(plan, kind, SHAPE, mode, topo, keep_gathered_kv=keep)
            for r in range(N):
                totals, links = per_rank[r][case, name]
                if totals != want_total:
                    bad.append(f"{case} {name} rank {r}: kinds {totals} != {want_total}")
                for c in ("intra", "inter"):
                    for k in COMM_KINDS:
                        if links[c][k] != int(want[c][k][r]):
                            bad.append(
                                f"{case} {name} rank {r}: {c} {k} counted {links[c][k]}, "
                                f"model {int(want[c][k][r])}"
                            )
    return bad


#: the fast subset: one method per kind of exchange and a hybrid (2 x 2 nodes only)
FAST_CASES = [("ring", None, "train", False), ("llama3", None, "train", False),
              ("ulysses", None, "infer", False), ("usp", 2, "train", False)]  # fmt: skip
FAST_TOPOLOGIES = {k: TOPOLOGIES[k] for k in ("2x2-consecutive", "2x2-strided")}


@pytest.fixture(scope="module")
def fast_counts():
    """The fast cases' counts on every rank (one run of 4 gloo ranks for the module's tests)."""
    plans = _plans(FAST_CASES)
    return plans, run_ranks(_count, N, FAST_CASES, plans, FAST_TOPOLOGIES, timeout_s=120)


def test_counted_link_bytes_equal_the_model_fast(fast_counts):
    plans, per_rank = fast_counts
    bad = _check(FAST_CASES, plans, per_rank, FAST_TOPOLOGIES)
    assert not bad, "\n".join(bad[:20])


@pytest.mark.slow
def test_counted_link_bytes_equal_the_model_every_method():
    cases = _cases(method_names())
    plans = _plans(cases)
    per_rank = run_ranks(_count, N, cases, plans, TOPOLOGIES, timeout_s=300)
    bad = _check(cases, plans, per_rank, TOPOLOGIES)
    assert not bad, "\n".join(bad[:20])


# ---- by hand ------------------------------------------------------------------------------------


def _split(totals: dict, inter_ranks: dict) -> dict:
    """Per rank, the expected ``by_link``: each kind's bytes all ``inter`` on the listed ranks of
    that kind, else all ``intra``."""
    out = {}
    for r in range(N):
        links = {c: dict.fromkeys(COMM_KINDS, 0) for c in ("intra", "inter")}
        for k in COMM_KINDS:
            links["inter" if r in inter_ranks.get(k, ()) else "intra"][k] = totals[f"{k}_bytes"]
        out[r] = links
    return out


def test_counted_link_bytes_by_hand(fast_counts):
    """2 nodes x 2. ring (p2p from CP rank r - 1): consecutive nodes [0, 0, 1, 1] -> ranks 0 and
    2 receive across; strided [0, 1, 0, 1] -> all. llama3 (NCCL's ring node by node):
    consecutive ring 0 1 2 3 -> ranks 0, 2 across; strided ring 0 2 1 3 -> ranks 0, 1 across.
    ulysses: one of the three chunks from the node's other rank, two across. usp (u = 2:
    Ulysses groups {0, 1}, {2, 3}; rings over {0, 2}, {1, 3}): consecutive -> all-to-alls
    inside, ring hops across; strided -> the reverse."""
    plans, per_rank = fast_counts
    across = {
        ("ring", "2x2-consecutive"): {"p2p": (0, 2)},
        ("ring", "2x2-strided"): {"p2p": (0, 1, 2, 3)},
        ("llama3", "2x2-consecutive"): {"allgather": (0, 2), "reducescatter": (0, 2)},
        ("llama3", "2x2-strided"): {"allgather": (0, 1), "reducescatter": (0, 1)},
        ("usp", "2x2-consecutive"): {"p2p": (0, 1, 2, 3)},
        ("usp", "2x2-strided"): {"alltoall": (0, 1, 2, 3)},
    }
    for case in FAST_CASES:
        m, u, mode, _ = case
        totals = comm_volume(plans[m, u], COMM_KIND[m], SHAPE, mode)
        for name in FAST_TOPOLOGIES:
            if m == "ulysses":
                chunk = totals["alltoall_bytes"] // 3
                assert chunk > 0
                want = {r: {"intra": {**dict.fromkeys(COMM_KINDS, 0), "alltoall": chunk},
                             "inter": {**dict.fromkeys(COMM_KINDS, 0), "alltoall": 2 * chunk}}
                        for r in range(N)}  # fmt: skip
            else:
                want = _split(totals, across[m, name])
            for r in range(N):
                assert per_rank[r][case, name][1] == want[r], (case, name, r)


class _Members(LocalGroup):
    """A LocalGroup of the given CP ranks, acting for position ``me`` (counting only)."""

    def __init__(self, members, me):
        self._m, self._me = list(members), me

    def size(self):
        return len(self._m)

    def rank(self):
        return self._me

    def members(self):
        return list(self._m)


def test_counter_maps_a_subgroup_to_cp_ranks():
    """A cross group {1, 3} of a strided 2 x 2 (nodes [0, 1, 0, 1]): both members on node 1, so
    its all-gather and ring hops stay inside; the intra group {0, 1} crosses. Without a topology
    nothing else changes."""
    topo = Topology(N, 2, "strided", 2)
    counter = CommCounter(topology=topo, group=_Members(range(N), 1))
    cross, intra = _Members([1, 3], 0), _Members([0, 1], 1)
    counter.add_ring_collective("allgather", 100, cross)
    counter.add_from("p2p", 7, cross, 1)
    counter.add_from("p2p", 5, intra, 0)
    counter.add_all_to_all("alltoall", 3, _Members(range(N), 1))  # chunks from 0, 2, 3
    assert counter.by_link() == {
        "intra": {"allgather": 100, "reducescatter": 0, "p2p": 7, "alltoall": 3},
        "inter": {"allgather": 0, "reducescatter": 0, "p2p": 5, "alltoall": 6},
    }
    assert counter.as_dict()["comm_bytes"] == 100 + 12 + 9
    counter.reset()
    assert counter.as_dict()["comm_bytes"] == 0 and not any(counter.by_link()["inter"].values())
    plain = CommCounter()
    plain.add_ring_collective("allgather", 4, cross)
    plain.add_all_to_all("alltoall", 2, _Members(range(N), 0))
    assert plain.as_dict()["comm_bytes"] == 10
    with pytest.raises(ValueError, match="no topology"):
        plain.by_link()


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"topology": Topology(8, 8), "group": _Members(range(N), 0)}, "cp_size 8 but the CP group has 4"),
        ({"topology": "2x2", "group": None}, "must be a flashcp.topology.Topology, got str"),
    ],
)  # fmt: skip
def test_bad_counter_topology_is_one_line_error(kwargs, words):
    with pytest.raises(ValueError, match=words) as exc:
        CommCounter(**kwargs)
    assert "\n" not in str(exc.value)


# ---- executor=dist: the launch's topology, per-link bytes and checksums in the rows ---------------


def _dist_rows(rank, world, methods):
    """executor=dist rows of ``methods`` as if launched on 1 node of 4 and on 2 nodes of 2
    (torchrun's LOCAL_WORLD_SIZE), and the launch topologies of a few groups and settings."""
    import os

    from flashcp.executors import RunSpec, execute
    from flashcp.executors.dist import launch_topology

    out = {}
    for local in ("4", "2"):
        os.environ["LOCAL_WORLD_SIZE"] = local
        for m in methods:
            spec = RunSpec(method=m, cp_size=N, shape=SHAPE, modes=("train", "infer"),
                           executor={"backend": "cpu", "warmup": 0, "iters": 1})  # fmt: skip
            rows = execute("dist", [spec], [np.array(LENS)], group=None)
            if rows is not None:
                out[local, m] = rows.to_dict("list")
    evens = dist.new_group([0, 2])
    three = dist.new_group([0, 1, 2])
    topo = {}
    for name, group, env in (("world-4x1", None, {"LOCAL_WORLD_SIZE": "1"}),
                             ("evens-2x2", evens, {"LOCAL_WORLD_SIZE": "2"}),
                             ("world-none", None, {}),
                             ("three-2x2", three, {"LOCAL_WORLD_SIZE": "2"}),
                             ("world-bad3", None, {"LOCAL_WORLD_SIZE": "3"})):  # fmt: skip
        if name.startswith(("evens", "three")) and group == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        try:
            t = launch_topology(group, env)
            topo[name] = (t.num_nodes, t.placement, t.node_of.tolist())
        except ValueError as exc:
            topo[name] = str(exc)
    return out, topo


@pytest.mark.slow
def test_dist_rows_record_bytes_by_node_and_checksums():
    """One node of 4 vs two nodes of 2 (LOCAL_WORLD_SIZE): the same plans give the same bytes
    per kind and the same output checksums; the bytes across nodes are 0 on one node and the
    model's slowest rank's on two (the executor also checks every rank against it)."""
    methods = ("ring", "flashcp", "ulysses")
    res = run_ranks(_dist_rows, N, methods, timeout_s=180)
    rows, topo = res[0]
    for m in methods:
        one, two = rows["4", m], rows["2", m]
        assert one["status"] == two["status"] == ["ok", "ok"], (m, one["status"], two["status"])
        for col in ("comm_bytes", "allgather_bytes", "p2p_bytes", "alltoall_bytes", "out_checksum"):
            assert one[col] == two[col], (m, col)
        assert len(set(one["out_checksum"])) == 2  # train (with gradients) and infer differ
        assert one["inter_node_bytes"] == [0, 0] and one["intra_node_bytes"] == one["comm_bytes"]
        plan = make_plan_for(m, LENS, N)
        for i, mode in enumerate(("train", "infer")):
            want = comm_volume_by_link(
                plan, COMM_KIND[m], SHAPE, mode, TOPOLOGIES["2x2-consecutive"]
            )
            inter = sum(want["inter"][k] for k in COMM_KINDS)
            assert two["inter_node_bytes"][i] == int(inter.max()) > 0, (m, mode)
    assert topo["world-4x1"] == (4, "consecutive", [0, 1, 2, 3])
    assert topo["evens-2x2"] == (2, "consecutive", [0, 1])
    assert topo["world-none"] == (1, "consecutive", [0, 0, 0, 0])
    assert "sit on nodes [0, 0, 1]" in topo["three-2x2"] and "neither" in topo["three-2x2"]
    assert topo["world-bad3"].startswith("LOCAL_WORLD_SIZE = '3' must be a positive integer")


def _env(world: int, local: int) -> dict[str, str]:
    return {"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local)}


@pytest.mark.parametrize(
    ("cp", "nodes", "placement", "env", "words"),
    [
        (4, 3, "consecutive", _env(4, 2), "nodes=3 placement=consecutive: cp_size 4 does not split evenly over num_nodes 3"),
        (4, 1, "consecutive", _env(4, 2), "puts 4 ranks on a node of gpus_per_node 2; use at least 2 nodes"),
        (4, 2, "strided", _env(4, 2), "puts the CP ranks on nodes [0, 1, 0, 1], but the launch put them on [0, 0, 1, 1]"),
        (4, None, "strided", _env(4, 2), "puts the CP ranks on nodes [0, 1, 2, 3]"),
        (4, 2, "consecutive", _env(4, 4), "puts the CP ranks on nodes [0, 0, 1, 1], but the launch put them on [0, 0, 0, 0]"),
        (4, 2, "consecutive", {**_env(4, 2), "LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE = '3' must be a positive integer dividing WORLD_SIZE = 4"),
        (4, 2, "diagonal", _env(4, 2), "unknown placement 'diagonal'"),
    ],
)  # fmt: skip
def test_bad_launch_topology_is_one_line_error(cp, nodes, placement, env, words):
    """The run's nodes / placement against torchrun's layout (env only, before any group)."""
    from flashcp.executors.dist import launch_problem

    problem = launch_problem(cp, nodes, placement, env)
    assert problem is not None and words in problem and "\n" not in problem, problem


def test_good_launch_topologies_pass():
    from flashcp.executors.dist import launch_nodes, launch_problem

    assert launch_problem(4, None, "consecutive", _env(4, 2)) is None
    assert launch_problem(4, 2, "consecutive", _env(4, 2)) is None
    assert launch_problem(4, 4, "strided", _env(4, 1)) is None  # one rank per node: both fit
    assert launch_problem(4, 3, "consecutive", {}) is None  # no launch: execute checks later
    assert launch_nodes(_env(16, 8)) == 2 and launch_nodes({}) == 1


def _count_in_cp_groups(rank, world, cases, plans, topologies):
    """Counts of CP groups {0, 2, 4, 6} and {1, 3, 5, 7} of a world of 8 (CP rank r of group
    {1, 3, 5, 7} is global rank 2 r + 1)."""
    groups = [dist.new_group([0, 2, 4, 6]), dist.new_group([1, 3, 5, 7])]
    group = groups[rank % 2]
    me = rank // 2
    torch.manual_seed(0)
    full = [torch.randn(64, h, SHAPE.head_dim) for h in (4, 2, 2, 4)]
    res = {}
    for case in cases:
        m, u, _, _ = case
        plan = plans[m, u]
        prepare, attn = get_attn_op(m)
        meta = prepare(plan, me)
        for name, topo in topologies.items():
            q, k, v, dout = (shard_tensor(x, plan, me) for x in full)
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            counter = CommCounter(topology=topo, group=group)
            out = attn(q, k, v, meta, group, backend="reference", counter=counter)
            out.backward(dout)
            res[case, name] = (counter.as_dict(), counter.by_link())
    return res


@pytest.mark.slow
def test_counted_link_bytes_of_cp_groups_inside_a_larger_world():
    """The counter maps the global ranks of the op's groups (the CP group, and the hybrids' 2-D
    groups made from it) to CP ranks: two CP groups of 4 in a world of 8 count what the model
    gives their CP ranks."""
    cases = [(m, u, "train", False) for m, u in (("ring", None), ("llama3", None),
             ("ulysses", None), ("usp", 2), ("flashcp_ulysses", 2))]  # fmt: skip
    plans = _plans(cases)
    per_rank = run_ranks(_count_in_cp_groups, 2 * N, cases, plans, FAST_TOPOLOGIES, timeout_s=180)
    for g in (0, 1):
        cp = [per_rank[2 * r + g] for r in range(N)]
        bad = _check(cases, plans, cp, FAST_TOPOLOGIES)
        assert not bad, f"CP group {g}: " + "\n".join(bad[:20])
