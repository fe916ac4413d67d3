"""Analytic simulator (``executor=sim``): hardware profiles, a tile-level FlashAttention-2 varlen
kernel model and the per-method step model. See docs/design.md §4 and §8.

Public API::

    simulate(plan, shape, hw, mode, comm_kind=None, impl="ours") -> dict  # PHASE + COMM columns
    simulate_many(plan, shapes, modes, hw, comm_kind=None, impl="ours") -> list[dict]
    impl_plan(method, impl, doc_lens, cp_size, **options) -> (plan, pad_tokens)
    fit_constants(targets, profile, free) -> FitResult       # flashcp.sim.calibration
    attention_kernel_ms(q_lens, kv_lens, causal, shape, hw, backward) -> float
    load_hardware(name_or_dict) -> HardwareProfile
"""

from flashcp.sim.cost import PlanCost, simulate, simulate_many
from flashcp.sim.hardware import HardwareProfile, list_hardware, load_hardware
from flashcp.sim.impl import IMPLS, impl_plan
from flashcp.sim.kernel import attention_kernel_ms

__all__ = [
    "IMPLS",
    "HardwareProfile",
    "PlanCost",
    "attention_kernel_ms",
    "impl_plan",
    "list_hardware",
    "load_hardware",
    "simulate",
    "simulate_many",
]
