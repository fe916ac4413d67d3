"""Where the ranks of one CP group sit on the nodes of a cluster, and which link class each
exchange between two of them crosses (NVLink inside a node, the NICs across nodes).

A leaf module (NumPy only), read by the data model's per-link byte account
(:func:`flashcp.comm.comm_volume_by_link`), the simulator's two-level network and the ops' byte
counters, so that all three agree on which rank is on which node. docs/multinode.md derives the
link classes each method's exchanges use.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = ["PLACEMENTS", "Topology"]

#: ``consecutive``: CP ranks fill a node before the next (CP innermost in the job's rank order);
#: ``strided``: CP rank r on node ``r % num_nodes`` (CP outer to tensor or data parallelism, e.g.
#: Llama 3's TP 8 x CP 16, where every CP peer is on another node).
PLACEMENTS = ("consecutive", "strided")


@dataclass(frozen=True)
class Topology:
    """A CP group of ``cp_size`` ranks over ``num_nodes`` nodes of ``gpus_per_node`` GPUs each.

    Attributes:
        cp_size: ranks in the CP group (N).
        gpus_per_node: GPUs of one node (8 on an HGX H100/H200 node).
        placement: one of :data:`PLACEMENTS`.
        num_nodes: nodes the group spans; None (the default) derives it: ``consecutive`` fills
            nodes (``ceil(cp_size / gpus_per_node)``), ``strided`` puts every rank on its own
            node (``cp_size``).

    The group has ``ranks_per_node = cp_size / num_nodes`` ranks on each of its nodes (the rest of
    a node's GPUs belong to other groups). CP rank r sits on node ``r // ranks_per_node``
    (consecutive) or ``r % num_nodes`` (strided).

    Raises:
        ValueError: a size below 1, an unknown placement, or a node count that does not divide
            ``cp_size`` into at most ``gpus_per_node`` ranks per node; the message names the value.
    """

    cp_size: int
    gpus_per_node: int
    placement: str = "consecutive"
    num_nodes: int | None = None

    def __post_init__(self) -> None:
        for name in ("cp_size", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"unknown placement {self.placement!r}; choose {' or '.join(PLACEMENTS)}"
            )
        n, g = int(self.cp_size), int(self.gpus_per_node)
        nodes = self.num_nodes
        if nodes is None:
            nodes = -(-n // g) if self.placement == "consecutive" else n
        elif isinstance(nodes, bool) or not isinstance(nodes, (int, np.integer)) or nodes < 1:
            raise ValueError(f"num_nodes must be a positive integer, got {nodes!r}")
        nodes = int(nodes)
        if n % nodes:
            raise ValueError(
                f"cp_size {n} does not split evenly over num_nodes {nodes} "
                f"(each node of the CP group holds the same number of its ranks)"
            )
        if n // nodes > g:
            raise ValueError(
                f"cp_size {n} over num_nodes {nodes} puts {n // nodes} ranks on a node of "
                f"gpus_per_node {g}; use at least {-(-n // g)} nodes"
            )
        object.__setattr__(self, "cp_size", n)
        object.__setattr__(self, "gpus_per_node", g)
        object.__setattr__(self, "num_nodes", nodes)

    @classmethod
    def single_node(cls, cp_size: int) -> Topology:
        """Every rank on one node (the paper's setting, §5)."""
        return cls(cp_size, cp_size)

    @property
    def ranks_per_node(self) -> int:
        """CP ranks on each node the group spans."""
        return self.cp_size // self.num_nodes

    @property
    def spans_nodes(self) -> bool:
        """True when the group crosses a node boundary."""
        return self.num_nodes > 1

    @cached_property
    def node_of(self) -> np.ndarray:
        """(cp_size,) int64: the node (0 .. num_nodes - 1) of each CP rank."""
        r = np.arange(self.cp_size, dtype=np.int64)
        if self.placement == "consecutive":
            return r // self.ranks_per_node
        return r % self.num_nodes

    def same_node(self, a, b) -> np.ndarray | bool:
        """Whether CP ranks ``a`` and ``b`` (ints or int arrays) share a node."""
        node = self.node_of
        return node[a] == node[b]

    @cached_property
    def collective_ring(self) -> np.ndarray:
        """(cp_size,) int64: the CP ranks in the order NCCL's ring visits them for an all-gather or
        reduce-scatter over the group: node by node, by rank inside a node (NCCL orders its rings
        so that each node's ranks are adjacent and the ring leaves a node once; NCCL docs,
        "NCCL_ALGO"/ring, and nccl-tests doc/PERFORMANCE.md). The ring crosses ``num_nodes``
        node boundaries when the group spans nodes, none otherwise."""
        return np.lexsort((np.arange(self.cp_size), self.node_of)).astype(np.int64)

    @cached_property
    def collective_pred_crosses(self) -> np.ndarray:
        """(cp_size,) bool: whether rank r's predecessor on :attr:`collective_ring` (the rank it
        receives from in a ring all-gather / reduce-scatter) is on another node."""
        order = self.collective_ring
        pred = np.empty(self.cp_size, dtype=np.int64)
        pred[order] = np.roll(order, 1)
        return self.node_of[pred] != self.node_of

    @cached_property
    def p2p_ring_crosses(self) -> np.ndarray:
        """(cp_size,) bool: whether rank r receives across nodes on the CP ring of ring attention,
        which passes blocks from rank r - 1 to rank r in CP rank order (not reordered by node)."""
        r = np.arange(self.cp_size, dtype=np.int64)
        return self.node_of[(r - 1) % self.cp_size] != self.node_of

    def describe(self) -> str:
        """One line for logs and CSV: e.g. ``16 ranks, 2 nodes x 8 (consecutive)``."""
        return (
            f"{self.cp_size} ranks, {self.num_nodes} nodes x {self.ranks_per_node} "
            f"({self.placement}, {self.gpus_per_node} GPUs per node)"
        )
