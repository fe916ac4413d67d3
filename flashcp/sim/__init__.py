"""Analytic simulator (``executor=sim``): hardware profiles, a tile-level FlashAttention-2 varlen
kernel model and the per-method step model. See DESIGN.md §4 and §8.

Public API::

    simulate(plan, shape, hw, mode, comm_kind=None) -> dict   # PHASE_COLUMNS (ms) + COMM_COLUMNS
    simulate_many(plan, shapes, modes, hw, comm_kind=None) -> list[dict]
    attention_kernel_ms(q_lens, kv_lens, causal, shape, hw, backward) -> float
    load_hardware(name_or_dict) -> HardwareProfile
"""

from flashcp.sim.cost_model import PlanCost, simulate, simulate_many
from flashcp.sim.hardware import HardwareProfile, list_hardware, load_hardware
from flashcp.sim.kernel import attention_kernel_ms

__all__ = [
    "HardwareProfile",
    "PlanCost",
    "attention_kernel_ms",
    "list_hardware",
    "load_hardware",
    "simulate",
    "simulate_many",
]
