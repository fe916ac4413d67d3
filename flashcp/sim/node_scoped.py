"""The step model of ``flashcp_node``'s two-scope all-gather across nodes (docs/scale.md).

Its op (:mod:`flashcp.ops.node_allgather_attn`) is FlashCP's all-gather op with each KV
all-gather and dK/dV reduce-scatter issued twice: once over the ranks of a node for the documents
kept on one node (``Mn`` rows a rank; NVLink only), once over the whole CP group for the others
(``Mg`` rows; across nodes on the two-level network). It is priced with the all-gather family's
own phase model (:func:`flashcp.sim.cost.allgather._allgather_phases`: the same kernels, copies,
head groups and host costs), its collective term replaced by the two calls' times, each priced
by the two-level network (:func:`flashcp.sim.network.collective_us`: the node scope with no
crossing, the group scope with the CP group's :class:`~flashcp.sim.network.Links`). Nothing here
restates a formula of the model. Two simplifications, both small against the collectives: the
send-buffer copies and the head-group sizing count ``(R Mn + N Mg) / N`` rows a rank (the op's
gathered rows over N), and the host dispatches of one collective per head group and pass, not
two. On one node a ``flashcp_node`` plan is flashcp's and the ordinary pricing applies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from flashcp.comm import (
    AttnShape,
    node_scope_rows,
    node_scoped_comm_volume,
    plan_topology,
    uses_node_scope,
)
from flashcp.plan import Plan, kv_bytes
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS
from flashcp.sim.cost import PlanCost
from flashcp.sim.cost.allgather import _ag_head_groups, _allgather_phases
from flashcp.sim.hardware import HardwareProfile
from flashcp.sim.kernel import TileStats
from flashcp.sim.network import FLAT, collective_us, group_links, topology_for

__all__ = ["price_node_scoped", "spans_nodes"]


def spans_nodes(plans: Sequence[Plan]) -> bool:
    """Whether some plan is a ``flashcp_node`` plan whose op gathers in two scopes
    (:func:`flashcp.comm.uses_node_scope`), which :func:`price_node_scoped` prices."""
    return any(p.method == "flashcp_node" and uses_node_scope(p) for p in plans)


def price_node_scoped(
    plans: Sequence[Plan],
    shape: AttnShape,
    modes: Sequence[str],
    hardware: HardwareProfile | Sequence[HardwareProfile],
    placement: str = "consecutive",
    nodes: int | None = None,
) -> dict[str, np.ndarray]:
    """Price S ``flashcp_node`` plans of one cp_size across nodes (module docstring) on P
    profiles that share their kernel tile shapes (perturbed copies of one profile).

    Args:
        plans: S plans of ``flashcp_node``, all for the topology ``(placement, nodes)`` gives on
            the profiles (:func:`flashcp.sim.network.topology_for`).
        shape: the attention shape; modes: M modes, ``train`` / ``infer``.
        hardware: one profile or P of them (the first one's tile shapes count the kernels' tiles).
    Returns:
        every ``PHASE_COLUMNS`` (ms) and ``COMM_COLUMNS`` (bytes,
        :func:`flashcp.comm.node_scoped_comm_volume`) column as a (P, M, S) array.
    Raises:
        ValueError: plans of several cp_sizes or of another topology than the run's (one line).
    """
    hws = [hardware] if isinstance(hardware, HardwareProfile) else list(hardware)
    n = plans[0].cp_size
    topo = topology_for(hws[0], n, placement, nodes)
    for p in plans:
        own = plan_topology(p)
        if topo is None or p.cp_size != n or not np.array_equal(own.node_of, topo.node_of):
            raise ValueError(
                f"flashcp_node plan for {own.describe()} priced on "
                f"{'a flat network' if topo is None else topo.describe()}: plan it with the run's "
                "nodes, placement and gpus_per_node"
            )
    links = group_links(topo)
    r = topo.ranks_per_node
    costs = [PlanCost(p, hws[0], "allgather_sharded", links=FLAT) for p in plans]
    scopes = np.array([node_scope_rows(p) for p in plans], dtype=np.int64)  # (S, 2): Mn, Mg
    local = np.stack([c.q_rows for c in costs])
    kv_rows = np.stack([c.kv_rows for c in costs])
    send_eff = (r * scopes[:, 0] + n * scopes[:, 1]) / n  # the op's gathered rows over N
    fwd = TileStats(*(np.stack([getattr(c.fwd, f) for c in costs]) for f in TileStats._fields))
    bwd = TileStats(*(np.stack([getattr(c.bwd, f) for c in costs]) for f in TileStats._fields))
    hkv, d, e = shape.num_kv_heads, shape.head_dim, shape.dtype_bytes
    _, hg, _ = _ag_head_groups(n, local, send_eff, hkv, d)
    dims = (len(hws), len(modes), len(plans))
    out = {c: np.zeros(dims) for c in PHASE_COLUMNS}
    out.update({c: np.zeros(dims, dtype=np.int64) for c in COMM_COLUMNS})
    for m, mode in enumerate(modes):
        vols = [node_scoped_comm_volume(p, shape, mode) for p in plans]
        vol = {k: np.array([v[k] for v in vols], dtype=np.int64) for k in COMM_COLUMNS}
        for a, hw in enumerate(hws):

            def coll(nbytes, total, busbw, op, hw=hw):
                """Both scopes' call for one head group, per plan (the arguments' one-scope
                bytes are replaced by each scope's own)."""
                elem = e if op == "all_gather" else _grad_elem(shape)
                t = np.zeros(len(plans))
                for i, (mn, mg) in enumerate(scopes):
                    for ranks, rows, lk in ((r, mn, FLAT), (n, mg, links)):
                        b = float(kv_bytes((ranks - 1) * int(rows), int(hg[i]), d, elem))
                        if b > 0:
                            t[i] += collective_us(hw, lk, b, b * ranks / (ranks - 1), busbw, op)
                return t

            ph = _allgather_phases(
                hw, n, local, kv_rows, send_eff, fwd, bwd, shape, mode, vol, coll, False
            )
            parts = [ph[c] for c in PHASE_COLUMNS if c != "total_ms"]
            for c in PHASE_COLUMNS:
                if c != "total_ms":
                    out[c][a, m] = ph[c]
            out["total_ms"][a, m] = [math.fsum(x) for x in zip(*parts, strict=True)]
            for c in COMM_COLUMNS:
                out[c][a, m] = vol[c]
    return out


def _grad_elem(shape: AttnShape) -> int:
    """Bytes of a dK/dV element in the reduce-scatter (the ops' default grad_comm_dtype)."""
    from flashcp.comm import grad_comm_bytes

    return grad_comm_bytes(shape)
