"""``method=flashcp_node``: node-aware FlashCP for a CP group that spans nodes (docs/scale.md).

The plan is Algorithm 1's (the paper's §3.3, :func:`flashcp.planners.flashcp.plan_flashcp`) with
its ranks relabelled so that the ranks sharing a cut document sit on one node where they can
(:func:`node_first_ranks`). A relabelling moves whole ranks: every rank keeps its shards, tokens
and workload, so the imbalance ratio, the Per-Doc set and Eq. 5's ``comm_tokens`` are exactly
Algorithm 1's ("where balance allows" holds with no loss of balance). On one node the relabelling
is the identity and the plan is flashcp's shard for shard.

What it changes is where the KV goes. Its op (:mod:`flashcp.ops.node_allgather_attn`) gathers the
non-last shards of a document whose shards all lie on one node inside that node only (an
all-gather over the node's ranks, NVLink), and over the whole CP group only the non-last shards of
the documents that span nodes (the Per-Doc documents, whose 2N chunks cover every rank, and the
cut documents the relabelling could not keep on one node). Its bytes per link class:
:func:`flashcp.comm.node_scoped_comm_volume` and :func:`flashcp.comm.node_scoped_volume_by_link`.
"""

from __future__ import annotations

import numpy as np

from flashcp.comm import node_local_docs, node_scope_rows
from flashcp.kinds import CommKind
from flashcp.plan import Plan, make_plan, planner_entry, shard_workload
from flashcp.planners.flashcp import TARGET_IMBALANCE, plan_flashcp
from flashcp.planners.flashcp.reference import _equalise
from flashcp.planners.layout import per_doc_chunk_sizes
from flashcp.registry import MethodSpec
from flashcp.topology import PLACEMENTS, Topology

__all__ = ["METHOD", "cross_node_tokens", "node_first_ranks", "plan_flashcp_node"]


def _check_topology(cp_size: int, num_nodes, placement, gpus_per_node) -> Topology:
    """The planner's topology, as the simulator places a run's CP group
    (:func:`flashcp.sim.network.topology_for`): ``gpus_per_node`` None is a flat network (one
    node); ``num_nodes`` None is as few nodes as the placement allows (``consecutive``: filled
    nodes, ``strided``: one rank per node). ValueError (one line) naming a bad value."""
    for name, value in (("num_nodes", num_nodes), ("gpus_per_node", gpus_per_node)):
        bad = isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1
        if value is not None and bad:
            raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; choose {' or '.join(PLACEMENTS)}")
    if num_nodes is not None and cp_size % int(num_nodes):
        raise ValueError(
            f"num_nodes {num_nodes} does not divide cp_size {cp_size} (each node holds the same "
            "number of CP ranks)"
        )
    if gpus_per_node is None:
        if num_nodes not in (None, 1):
            return Topology(cp_size, cp_size // int(num_nodes), placement, int(num_nodes))
        return Topology.single_node(cp_size)
    return Topology(cp_size, int(gpus_per_node), placement, num_nodes)


def node_first_ranks(plan: Plan, topology: Topology) -> np.ndarray:
    """The new rank of each rank of ``plan`` that puts ranks sharing a cut document on one node.

    Greedy, deterministic: the cut documents that span at most ``ranks_per_node`` ranks, most
    non-last tokens first (the rows an all-gather sends), merge their ranks into one cluster when
    the merged cluster still fits a node; the clusters then fill the nodes largest first (first
    fit), a cluster that fits no node's free slots being split over them; inside a node the ranks
    keep their order. Documents spanning more ranks than a node holds (Per-Doc ones) stay
    cross-node whatever the labels.

    Args:
        plan: an N-rank plan; topology: its N ranks over the nodes.
    Returns:
        (N,) int64 permutation: ``new[r]`` is the rank that rank r's shards move to.
    """
    n = plan.cp_size
    per = topology.ranks_per_node
    if topology.num_nodes == 1:
        return np.arange(n, dtype=np.int64)
    parent = list(range(n))
    size = [1] * n

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    sent = np.bincount(plan.doc, weights=np.where(plan.is_last, 0, plan.length),
                       minlength=plan.doc_lens.size)  # fmt: skip
    ranks_of: dict[int, set[int]] = {}
    for r, dc in zip(plan.rank.tolist(), plan.doc.tolist(), strict=True):
        ranks_of.setdefault(dc, set()).add(r)
    cut = [dc for dc, rs in ranks_of.items() if 1 < len(rs) <= per]
    cut.sort(key=lambda dc: (-sent[dc], dc))
    for dc in cut:
        roots = sorted({find(r) for r in ranks_of[dc]})
        if sum(size[x] for x in roots) > per:
            continue
        for x in roots[1:]:
            parent[x] = roots[0]
            size[roots[0]] += size[x]
    clusters: dict[int, list[int]] = {}
    for r in range(n):
        clusters.setdefault(find(r), []).append(r)
    order = sorted(clusters.values(), key=lambda c: (-len(c), c[0]))
    free = [per] * topology.num_nodes
    members: list[list[int]] = [[] for _ in range(topology.num_nodes)]
    spill: list[int] = []
    for c in order:
        k = next((k for k in range(topology.num_nodes) if free[k] >= len(c)), None)
        if k is None:
            spill.extend(c)
            continue
        members[k].extend(c)
        free[k] -= len(c)
    for r in spill:  # split over the free slots, in rank order
        k = next(k for k in range(topology.num_nodes) if free[k])
        members[k].append(r)
        free[k] -= 1
    new = np.empty(n, dtype=np.int64)
    node_of = topology.node_of
    for k in range(topology.num_nodes):
        slots = np.flatnonzero(node_of == k)
        new[sorted(members[k])] = slots
    return new


def _within_node(
    pieces: list[tuple[int, int, int]], ranks: int, tpr: int, target: float
) -> tuple[float, list[list[list[int]]]]:
    """Algorithm 1's steps 2a-2c (the paper's §3.3) over the pieces ``(doc, start, length)`` one
    node holds, for its ``ranks`` ranks of ``tpr`` tokens: the k longest pieces cut into 2R chunks
    (chunk j and 2R-1-j on rank j: their workloads, Eq. 3 with the piece's prefix, pair up to
    the same sum for any prefix), the others whole on the rank of least workload, then tokens
    equalised by moving heads (:func:`flashcp.planners.flashcp.reference._equalise`, which
    prices a head with its prefix); k grows until the node's ratio meets ``target``.

    Returns:
        ``(ratio, pieces)``: the node's imbalance ratio (max over mean of its ranks' workloads)
        and each of its ranks' ``[doc, start, length]`` list.
    """
    order = sorted(range(len(pieces)), key=lambda i: (-pieces[i][2], i))
    work_of = [shard_workload(p, s) for _, p, s in pieces]
    mean = max(sum(work_of) / ranks, 1e-300)
    sizes = per_doc_chunk_sizes(np.array([pieces[i][2] for i in order], dtype=np.int64), ranks)[0]
    base_pieces: list[list[list[int]]] = [[] for _ in range(ranks)]
    base_tokens, base_work = [0] * ranks, [0] * ranks
    best = None
    for k in range(len(order) + 1):
        if k:
            doc, p, _ = pieces[order[k - 1]]
            for j, c in enumerate(sizes[k - 1].tolist()):
                r = j if j < ranks else 2 * ranks - 1 - j
                if c:
                    base_pieces[r].append([doc, p, c])
                    base_tokens[r] += c
                    base_work[r] += shard_workload(p, c)
                p += c
        whole: list[list[list[int]]] = [[] for _ in range(ranks)]  # as the reference's pieces
        work, tokens = list(base_work), list(base_tokens)
        for i in order[k:]:
            r = min(range(ranks), key=work.__getitem__)
            whole[r].append(list(pieces[i]))
            work[r] += work_of[i]
            tokens[r] += pieces[i][2]
        _equalise(whole, work, tokens, tpr, fewest_cuts=True)
        out = [[pc.copy() for pc in base_pieces[r]] + whole[r] for r in range(ranks)]
        ratio = max(work) / mean
        if best is None or ratio < best[0] or ratio <= target:
            best = (ratio, out)
        if ratio <= target:
            break
    return best


def _hierarchical(d: np.ndarray, num_pad: int, topo: Topology, target: float) -> Plan:
    """Documents to nodes, then each node's pieces to its ranks: Algorithm 1 with one rank per
    node (:func:`plan_flashcp` at ``cp_size = num_nodes``), then :func:`_within_node` on every
    node. Only the documents Algorithm 1 cuts between nodes span nodes."""
    k, per = topo.num_nodes, topo.ranks_per_node
    top = plan_flashcp(d, k, target_imbalance=target, num_pad=num_pad, validate=False)
    tpr = top.context_len // topo.cp_size
    rank, doc, start, length = [], [], [], []
    for node in range(k):
        sel = top.rank == node
        pieces = list(zip(top.doc[sel].tolist(), top.start[sel].tolist(),
                          top.length[sel].tolist(), strict=True))  # fmt: skip
        _, out = _within_node(pieces, per, tpr, target)
        slots = np.flatnonzero(topo.node_of == node)
        for i, rank_pieces in enumerate(out):
            for dc, p, s in rank_pieces:
                rank.append(int(slots[i]))
                doc.append(dc)
                start.append(p)
                length.append(s)
    pad = tpr - np.bincount(rank, weights=length, minlength=topo.cp_size).astype(np.int64)
    info = {"per_doc_docs": top.info["per_doc_docs"], "layout": "hierarchical"}
    return make_plan(
        "flashcp_node", topo.cp_size, d, rank, doc, start, length, info=info, pad=pad,
        validate=False,
    )  # fmt: skip


def cross_node_tokens(plan: Plan, node_of: np.ndarray) -> int:
    """Non-last tokens of the documents that span nodes: the rows :mod:`flashcp.ops.
    node_allgather_attn` gathers over the whole CP group (summed over ranks)."""
    local = node_local_docs(plan, node_of)
    return int(plan.length[~plan.is_last & ~local[plan.doc]].sum())


def _cross_cost(plan: Plan, node_of: np.ndarray) -> tuple[int, int, int]:
    """What the choice between the two layouts minimises: the group scope's buffer Mg (every
    rank receives (N - 1) Mg rows over the whole group, the ring's inter-node hops included),
    then the cross-node tokens, then the node scope's buffer."""
    mn, mg = node_scope_rows(plan, node_of)
    return mg, cross_node_tokens(plan, node_of), mn


@planner_entry("flashcp_node")
def plan_flashcp_node(
    doc_lens,
    cp_size: int,
    *,
    num_nodes: int | None = None,
    placement: str = "consecutive",
    gpus_per_node: int | None = None,
    target_imbalance: float = TARGET_IMBALANCE,
    num_pad: int = 0,
    validate: bool = True,
) -> Plan:
    """Plan node-aware FlashCP: Algorithm 1's plan with its ranks relabelled node-first.

    Args:
        doc_lens: (n_docs,) int, document lengths in packed order.
        cp_size: N >= 1.
        num_nodes: nodes the CP group spans (dividing N); None: as few as ``placement`` allows
            on nodes of ``gpus_per_node`` GPUs (as :func:`flashcp.sim.network.topology_for`).
        placement: ``consecutive`` or ``strided`` (:data:`flashcp.topology.PLACEMENTS`): which
            CP ranks share a node (:attr:`flashcp.topology.Topology.node_of`).
        gpus_per_node: GPUs of a node; None with ``num_nodes`` None or 1: every rank on one
            node (a flat network), where the plan is flashcp's.
        target_imbalance: Algorithm 1's R (paper default 1.05).
        num_pad: pad tokens after the last document (as :func:`plan_flashcp`).
        validate: check the plan's invariants.
    Returns:
        A :class:`~flashcp.plan.Plan` with ``method="flashcp_node"``: Algorithm 1's shards on the
        ranks :func:`node_first_ranks` gives; ``info`` holds Algorithm 1's keys plus
        ``num_nodes``, ``placement`` and ``node_local_tokens`` (the non-last tokens of documents
        kept on one node: what the node-scoped all-gather sends, summed over ranks).
    Raises:
        ValueError: a bad length, ``cp_size``, ``target_imbalance``, ``num_nodes`` (not dividing
            N) or ``placement``; the message names the value.
    """
    topo = _check_topology(int(cp_size), num_nodes, placement, gpus_per_node)
    base = plan_flashcp(
        doc_lens, cp_size, target_imbalance=target_imbalance, num_pad=num_pad, validate=False
    )
    new = node_first_ranks(base, topo)
    pad = np.empty(base.cp_size, dtype=np.int64)
    pad[new] = base.pad
    plan = make_plan(
        "flashcp_node", base.cp_size, base.doc_lens, new[base.rank], base.doc, base.start,
        base.length, status=base.status, info={**base.info, "layout": "relabelled"}, pad=pad,
        validate=False,
    )  # fmt: skip
    status = base.status
    if topo.num_nodes > 1:
        alt = _hierarchical(base.doc_lens, num_pad, topo, float(target_imbalance))
        ok = alt.imbalance_ratio <= target_imbalance
        if (ok or alt.imbalance_ratio <= plan.imbalance_ratio) and _cross_cost(
            alt, topo.node_of
        ) <= _cross_cost(plan, topo.node_of):
            plan = alt
            status = "ok" if ok else "target_not_met"
    one_scope = int(plan.send_tokens_per_rank.max()) if plan.num_shards else 0
    mn, mg = node_scope_rows(plan, topo.node_of)
    info = {
        **plan.info,
        "num_nodes": topo.num_nodes,
        "placement": topo.placement,
        "cross_node_tokens": cross_node_tokens(plan, topo.node_of),
        # two scopes only where they shrink the buffer that crosses nodes
        "node_scope": bool(topo.spans_nodes and mn > 0 and mg < one_scope),
    }
    return make_plan(
        "flashcp_node", plan.cp_size, plan.doc_lens, plan.rank, plan.doc, plan.start,
        plan.length, status=status, info=info, pad=plan.pad, validate=validate,
    )  # fmt: skip


#: the method's entry in the registry (declared in pyproject.toml's ``flashcp.methods`` entry points)
METHOD = MethodSpec(
    name="flashcp_node", display_name="FlashCP (node-aware)", order=61,
    planner=plan_flashcp_node, comm_kind=CommKind.ALLGATHER_SHARDED,
    prepare="flashcp.ops.node_allgather_attn:prepare_flashcp_node",
    attn="flashcp.ops.node_allgather_attn:flashcp_node_attn", color="#8c564b",
)  # fmt: skip
