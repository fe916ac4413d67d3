"""The two-level network of the step model: how a CP group's exchanges fall on the links inside a
node (the profile's NVLink constants) and between nodes (its NICs), and what each costs
(docs/multinode.md).

A :class:`Links` summarises, for one CP group on one :class:`~flashcp.topology.Topology` and one
Ulysses degree u, which exchanges cross nodes; it depends on neither the plan nor the shape, so the
per-plan model and the batch price every plan of a group with the same scalars (and stay equal).
Without a crossing every price is the one-level profile's own call, to the bit.

Prices on a crossing (``B = hw.nic_gpu_gbps``, one GPU's share of its node's NICs; ``L =
hw.inter_latency_us``; no per-size falloff: no public per-size table of these collectives across
nodes is collected, so latency + bytes / bandwidth, as ``h100_ib``):

* all-gather / reduce-scatter over a group that crosses nodes: NCCL's ring runs at its slowest
  link class, ``max(one-level time, L + recv / (m B))``, m = fewest group members on one node:
  NCCL spreads the ring's channels over the NICs of the node's members (nccl-tests issue #290:
  46-48 GB/s per NDR NIC in a ring).
* ring P2P: a step is as slow as its slowest pair: ``max(one-level hop, L + bytes / B)`` when
  some hop crosses (a single peer gets one NIC).
* all-to-all: a rank receives ``k / (u - 1)`` of its bytes from the k peers on other nodes at
  ``B`` (an all-to-all cannot aggregate NICs: nccl-tests issue #267), the rest at the profile's
  all-to-all rate, in parallel: ``max(intra time, L + inter bytes / B)``, the slowest rank's k.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from flashcp.sim.hardware import HardwareProfile
from flashcp.topology import Topology

__all__ = [
    "FLAT",
    "Links",
    "alltoall_us",
    "alltoall_us_v",
    "collective_us",
    "collective_us_v",
    "group_links",
    "p2p_us",
    "p2p_us_v",
    "topology_for",
]


@dataclass(frozen=True)
class Links:
    """Which exchanges of one CP group cross nodes (docs/multinode.md).

    Attributes:
        collective_crosses: some NCCL ring of the all-gather / reduce-scatter (over the whole
            group, or over a hybrid's cross groups) has a predecessor on another node.
        collective_per_node: fewest members of one such ring's process group on one node it
            spans (the NICs its channels spread over); 0 when nothing crosses.
        p2p_crosses: some hop of ring attention's ring (in group-rank order) crosses nodes.
        a2a_inter_peers: the distinct numbers of Ulysses group peers on another node, over the
            ranks; () when no peer is remote (or u = 1).
        a2a_degree: u, the all-to-all's group size.
    """

    collective_crosses: bool = False
    collective_per_node: int = 0
    p2p_crosses: bool = False
    a2a_inter_peers: tuple[int, ...] = ()
    a2a_degree: int = 1


#: nothing crosses: every price is the one-level profile's
FLAT = Links()


def topology_for(
    hw: HardwareProfile, cp_size: int, placement: str = "consecutive", nodes: int | None = None
) -> Topology | None:
    """The topology of a CP group of ``cp_size`` on ``hw``'s nodes, None on a flat profile.

    Raises:
        ValueError: (one line) a flat profile (``gpus_per_node`` null) given nodes other than
            None / 1 or a strided placement; what :class:`~flashcp.topology.Topology` raises.
    """
    if hw.gpus_per_node is None:
        if nodes not in (None, 1) or placement != "consecutive":
            raise ValueError(
                f"hardware {hw.name!r} is a flat network (gpus_per_node null): nodes={nodes} "
                f"placement={placement} do not apply; use a profile with gpus_per_node"
            )
        return None
    return Topology(int(cp_size), hw.gpus_per_node, placement, nodes)


@functools.lru_cache(maxsize=256)
def group_links(topology: Topology | None, u: int = 1, a2a_only: bool = False) -> Links:
    """:class:`Links` of ``topology``'s CP group with Ulysses degree ``u`` (groups ``g u .. g u
    + u - 1``, cross groups ``j, j + u, ...``: :func:`flashcp.ops.hybrid_attn.hybrid_groups`),
    as :func:`flashcp.comm.comm_volume_by_link` assigns the bytes. ``a2a_only``: a plain
    all-to-all over all N ranks (u = N), nothing across groups.

    Raises:
        ValueError: ``u`` does not divide the group.
    """
    from flashcp.comm import _ring_preds

    if topology is None or not topology.spans_nodes:
        return FLAT
    n = topology.cp_size
    if u < 1 or n % u:
        raise ValueError(f"ulysses degree {u} does not divide cp_size {n}")
    node = topology.node_of
    ranks = np.arange(n, dtype=np.int64)
    peers: tuple[int, ...] = ()
    if u > 1:
        members = (ranks // u * u)[:, None] + np.arange(u, dtype=np.int64)[None, :]
        remote = (node[members] != node[:, None]).sum(axis=1)
        peers = tuple(int(k) for k in np.unique(remote) if k > 0)
    coll = p2p = False
    per_node = 0
    if not a2a_only and n // u > 1:
        fewest = []
        for j in range(u):
            grp = ranks[j::u]
            p2p |= bool((node[_ring_preds(node, grp, False)] != node[grp]).any())
            if (node[_ring_preds(node, grp, True)] != node[grp]).any():
                coll = True
                fewest.append(int(np.bincount(node[grp])[np.unique(node[grp])].min()))
        per_node = min(fewest) if fewest else 0
    return Links(coll, per_node, p2p, peers, u)


def collective_us(
    hw: HardwareProfile, links: Links, recv: float, total: float, busbw: float, op
) -> float:
    """One all-gather / reduce-scatter on the two-level network, µs (module docstring):
    :meth:`HardwareProfile.collective_us` where nothing crosses."""
    t = hw.collective_us(recv, total, busbw, op)
    if not links.collective_crosses or recv <= 0:
        return t
    return max(t, hw.inter_latency_us + recv / (links.collective_per_node * hw.nic_gpu_gbps * 1e3))


def collective_us_v(hw: HardwareProfile, links: Links, recv, total, busbw, op) -> np.ndarray:
    """:func:`collective_us` elementwise over float64 arrays of bytes (equal to 1e-12)."""
    from flashcp.sim.cost.units import _collective_us_v

    t = _collective_us_v(hw, recv, total, busbw, op)
    if not links.collective_crosses:
        return t
    r = np.asarray(recv, dtype=np.float64)
    bw = links.collective_per_node * hw.nic_gpu_gbps * 1e3
    return np.maximum(t, np.where(r <= 0, 0.0, hw.inter_latency_us + r / bw))


def p2p_us(hw: HardwareProfile, links: Links, nbytes: float) -> float:
    """One ring step moving ``nbytes`` each way, µs (module docstring): :meth:`HardwareProfile.
    p2p_us` where no hop crosses."""
    t = hw.p2p_us(nbytes)
    if not links.p2p_crosses or nbytes <= 0:
        return t
    return max(t, hw.inter_latency_us + nbytes / (hw.nic_gpu_gbps * 1e3))


def p2p_us_v(hw: HardwareProfile, links: Links, nbytes) -> np.ndarray:
    """:func:`p2p_us` elementwise over a float64 array of bytes (equal to 1e-12)."""
    from flashcp.sim.cost.units import _p2p_us_v

    t = _p2p_us_v(hw, nbytes)
    if not links.p2p_crosses:
        return t
    nb = np.asarray(nbytes, dtype=np.float64)
    return np.maximum(t, np.where(nb <= 0, 0.0, hw.inter_latency_us + nb / (hw.nic_gpu_gbps * 1e3)))


def alltoall_us(hw: HardwareProfile, links: Links, recv: float, total: float) -> float:
    """One all-to-all in which a rank receives ``recv`` bytes of its ``total``-byte buffer, µs
    (module docstring): :meth:`HardwareProfile.alltoall_us` where no peer is remote."""
    if not links.a2a_inter_peers or recv <= 0:
        return hw.alltoall_us(recv, total)
    peers = links.a2a_degree - 1
    worst = 0.0
    for k in links.a2a_inter_peers:
        near = recv * (peers - k) / peers
        t = hw.alltoall_us(near, total) if near > 0 else 0.0
        t = max(t, hw.inter_latency_us + recv * k / peers / (hw.nic_gpu_gbps * 1e3))
        worst = max(worst, t)
    return worst


def alltoall_us_v(hw: HardwareProfile, links: Links, recv, total) -> np.ndarray:
    """:func:`alltoall_us` elementwise over float64 arrays of bytes (equal to 1e-12)."""
    from flashcp.sim.cost.units import _collective_us_v

    def near_us(r):
        return _collective_us_v(hw, r, total, hw.alltoall_busbw_gbps, "all_gather")

    r = np.asarray(recv, dtype=np.float64)
    if not links.a2a_inter_peers:
        return near_us(r)
    peers = links.a2a_degree - 1
    worst = np.zeros(r.shape)
    for k in links.a2a_inter_peers:
        far = r * k / peers
        t = np.maximum(
            near_us(r * (peers - k) / peers), hw.inter_latency_us + far / (hw.nic_gpu_gbps * 1e3)
        )
        worst = np.maximum(worst, np.where(r <= 0, 0.0, t))
    return worst
