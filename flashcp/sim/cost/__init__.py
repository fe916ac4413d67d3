"""The step model: one attention layer's CP step on a hardware profile (``executor=sim``), every
column of :data:`flashcp.results.PHASE_COLUMNS` (ms) and :data:`flashcp.results.COMM_COLUMNS`
(bytes, :func:`flashcp.comm.comm_volume`). One module per family, each with its per-plan and
batched code: :mod:`.allgather`, :mod:`.ring`, :mod:`.alltoall` (and the hybrids); the shared units
(:mod:`.units`), the per-plan model built of them (:mod:`.base`: :class:`PlanCost`,
:func:`simulate`), the batch (:mod:`.batch`: :class:`PlanBatch`, :func:`price_plans`,
:func:`attention_balance`) and its numba kernels (:mod:`.kernels`). What each family launches and
how a phase is priced: docs/simulator.md ("The step model, per family").
"""

from flashcp.sim.cost.base import PlanCost, simulate, simulate_many, step_many
from flashcp.sim.cost.batch import PlanBatch, attention_balance, price_plans
from flashcp.sim.cost.ring import ring_price_bytes
from flashcp.sim.cost.units import COMM_KINDS, overlap_us

__all__ = [
    "COMM_KINDS",
    "PlanBatch",
    "PlanCost",
    "attention_balance",
    "overlap_us",
    "price_plans",
    "ring_price_bytes",
    "simulate",
    "simulate_many",
    "step_many",
]
