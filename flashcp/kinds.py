"""The small vocabularies every layer shares: how a method moves KV (:class:`CommKind`) and which
family of real ops runs its plans (:class:`OpFamily`).

A leaf module (it imports nothing of the project), so the data model (:mod:`flashcp.plan`), the
registry (:mod:`flashcp.registry`), the simulator and the ops all read it without importing each
other.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["CommKind", "OpFamily"]


class CommKind(StrEnum):
    """How a method moves KV between CP ranks (docs/design.md §3, §4).

    Members compare and hash equal to their string values, so CSV columns, Hydra values and
    existing comparisons with ``"allgather_sharded"`` keep working.
    """

    #: every rank all-gathers the whole KV, Eq. 4: ``(N - 1) C / N`` tokens per rank
    ALLGATHER_FULL = "allgather_full"
    #: sharding-aware all-gather of the non-last shards only, Eq. 5
    ALLGATHER_SHARDED = "allgather_sharded"
    #: ring point-to-point: N - 1 steps of one C / N block each
    P2P_RING = "p2p_ring"
    #: head-parallel all-to-all only (Ulysses over all N ranks): q, k, v in and the output back,
    #: no KV exchange between ranks (docs/design.md §3, "Methods beyond the paper")
    ALLTOALL = "alltoall"


class OpFamily(StrEnum):
    """The real op that runs a method's plans (:func:`flashcp.ops.get_attn_op`); a method's
    :class:`~flashcp.kinds.CommKind` picks the variant inside the family.

    Every family runs any valid plan of its layout class, so a new planner whose plans one of them
    can run needs no op code of its own.
    """

    #: :mod:`flashcp.ops.allgather_attn`: one all-gather of KV per pass; ``allgather_full`` sends
    #: every local row (Eq. 4), ``allgather_sharded`` only the non-last shards (Eq. 5)
    ALLGATHER = "allgather"
    #: :mod:`flashcp.ops.ring_attn`: KV blocks passed around a ring of point-to-point exchanges,
    #: any layout (blocks a rank's documents cannot see are skipped)
    RING = "ring"
    #: :mod:`flashcp.ops.ulysses_attn`: head-parallel all-to-alls over all N ranks
    ULYSSES = "ulysses"
    #: :mod:`flashcp.ops.hybrid_attn`: all-to-alls inside groups of ``ulysses_degree`` ranks, and
    #: across the groups the ring (``p2p_ring``) or the sharding-aware all-gather
    #: (``allgather_sharded``)
    HYBRID = "hybrid"
