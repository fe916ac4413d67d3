"""Kernel efficiency by layout (the paper's Fig. 3) from the step model's own compute.

One model serves Fig. 3, the calibration and the CP step model: the per-rank compute of
:meth:`flashcp.sim.cost.PlanCost.attention_us` (attention kernels; for a ring layout also
its merges and gradient accumulations, as its implementation issues them between kernels).
Layouts of a packed sequence over ``cp_size`` ranks:

* ``whole``: every document whole on one device (the sequence at CP 1): the ceiling;
* ``per_doc``: every document in 2N chunks, one varlen call per rank over its chunks;
* ``zigzag``: the same layout run as ring-flash-attn's zigzag ring (the paper's baseline), with
  its LSE merges and accumulations.

The latency of a layout is the sum over ranks (and ring steps) of forward + backward compute; its
ratio to ``whole`` is what the paper's Fig. 3 plots (1.0 = as efficient as one device).
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np

from flashcp.comm import AttnShape
from flashcp.sim.hardware import HardwareProfile

__all__ = [
    "FIG3_CASES",
    "FIG3_LAYOUTS",
    "FIG3_SHAPE",
    "fig3_compute_us",
    "fig3_cost",
    "fig3_latency_ratio",
]

#: the paper's two packed sequences of 128K tokens
FIG3_CASES = MappingProxyType({"1x128K": (131072,), "16x8K": (8192,) * 16})
FIG3_LAYOUTS = ("whole", "per_doc", "zigzag")
#: 32 heads, head_dim 128 (docs/design.md §6)
FIG3_SHAPE = AttnShape(num_heads=32, num_kv_heads=32, head_dim=128)


def fig3_cost(hw: HardwareProfile, doc_lens, layout: str, cp_size: int = 8):
    """The :class:`~flashcp.sim.cost.PlanCost` of a Fig. 3 layout.

    Raises:
        ValueError: unknown layout, or lengths the layout's planner rejects.
    """
    from flashcp.registry import make_plan_for
    from flashcp.sim.cost import PlanCost
    from flashcp.sim.impl import impl_plan

    d = np.asarray(doc_lens, dtype=np.int64)
    if layout == "whole":
        cost = PlanCost(make_plan_for("llama3", d, 1), hw, "allgather_full")
    elif layout == "per_doc":
        cost = PlanCost(make_plan_for("per_doc", d, cp_size), hw, "allgather_full")
    elif layout == "zigzag":
        plan, _ = impl_plan("zigzag", "ring_flash_attn", d, cp_size)
        cost = PlanCost(plan, hw, "p2p_ring", "ring_flash_attn")
    else:
        raise ValueError(
            f"unknown Fig. 3 layout {layout!r}; choose one of {', '.join(FIG3_LAYOUTS)}"
        )
    return cost


def fig3_compute_us(
    hw: HardwareProfile,
    doc_lens,
    layout: str,
    cp_size: int = 8,
    shape: AttnShape = FIG3_SHAPE,
    cost=None,
) -> tuple[float, float, int]:
    """Forward and backward compute of a layout summed over ranks (µs), and its kernel calls.

    Args:
        cost: a :func:`fig3_cost` of the same layout to reuse (its tile counts), priced on ``hw``.
    Raises:
        ValueError: unknown layout, or lengths the layout's planner rejects.
    """
    cost = fig3_cost(hw, doc_lens, layout, cp_size) if cost is None else cost.with_hardware(hw)
    fwd, bwd = cost.attention_us(shape, train=True)
    calls = int((fwd > 0).sum())
    return float(fwd.sum()), float(bwd.sum()), calls


def fig3_latency_ratio(
    hw: HardwareProfile,
    doc_lens,
    layout: str,
    cp_size: int = 8,
    shape: AttnShape = FIG3_SHAPE,
    costs=None,
) -> float:
    """Forward + backward compute of ``layout`` over that of ``whole`` (the paper's Fig. 3).

    Args:
        costs: optional ``(layout cost, whole cost)`` from :func:`fig3_cost` to reuse.
    """
    c, cw = costs if costs is not None else (None, None)
    f, b, _ = fig3_compute_us(hw, doc_lens, layout, cp_size, shape, c)
    fw, bw, _ = fig3_compute_us(hw, doc_lens, "whole", cp_size, shape, cw)
    return (f + b) / (fw + bw)
