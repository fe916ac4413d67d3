"""Result-row schema shared by every executor (sim, dist, emulate).

One row per (run, sequence, mode); units are in the column names. Executors fill
:data:`PHASE_COLUMNS` and :data:`COMM_COLUMNS`; the harness adds plan metrics and provenance.
"""

from __future__ import annotations

__all__ = ["COMM_COLUMNS", "PHASE_COLUMNS"]

#: latency breakdown of one attention layer's CP step, milliseconds (slowest rank per phase).
#: ``others_ms`` holds data copies (gathering/scattering KV pieces), LSE merges and launch overheads.
PHASE_COLUMNS: tuple[str, ...] = (
    "allgather_ms",
    "attn_fwd_ms",
    "attn_bwd_ms",
    "reducescatter_ms",
    "p2p_ms",
    "others_ms",
    "total_ms",
)

#: bytes one rank receives in the step (see :func:`flashcp.comm.comm_volume`).
COMM_COLUMNS: tuple[str, ...] = ("allgather_bytes", "reducescatter_bytes", "p2p_bytes", "comm_bytes")
