"""The sensitivity study's perturbation of the simulator's constants: which hardware constants
vary (:data:`VARIED`, :data:`OPTIONAL_VARIED`; :data:`NETWORK_VARIED` across nodes), a profile with some scaled (:func:`perturb`) and the
joint draws of factors (:func:`joint_factors`), used by ``flashcp-sensitivity`` and
``flashcp advise`` (docs/calibration.md has the study).

A factor scales a constant's calibrated value, except ``nccl_slowdown`` (the factor applies to
its excess over 1) and ``overlap_fraction`` (to the part not overlapped, capped at 1);
``collective_latency_us`` stays below the published curve's smallest time, so every perturbed
profile is one the profile accepts.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from flashcp.sim.hardware import HardwareProfile

__all__ = ["NETWORK_VARIED", "OPTIONAL_VARIED", "VARIED", "joint_factors", "perturb", "varied_for"]


#: the overhead constants varied (the kernel tile rates, fixed by the FA2 table, are not)
VARIED = (
    "launch_us",
    "copy_bw_gbps",
    "fwd_cta_overhead_us",
    "bwd_cta_overhead_us",
    "collective_latency_us",
    "allgather_busbw_gbps",
    "p2p_latency_us",
    "p2p_bw_gbps",
    "host_op_us",
    "collective_host_us",
    "ring_step_fwd_us",
    "ring_step_bwd_us",
    "doc_host_us",
    "merge_bytes_scripted",
    "merge_bytes_eager",
    "accum_bytes_eager",
    "nccl_slowdown",
    "overlap_fraction",
)
#: constants a study may add to VARIED (``constants``): the all-to-all bus bandwidth, which follows
#: ``allgather_busbw_gbps`` when not varied itself (its profile value is derived from it)
OPTIONAL_VARIED = ("alltoall_busbw_gbps",)
#: the inter-node constants (docs/multinode.md), varied where the CP group spans nodes
NETWORK_VARIED = ("nic_bw_gbps", "inter_latency_us")


def varied_for(spans_nodes: bool, varied: tuple[str, ...] = VARIED) -> tuple[str, ...]:
    """``varied`` plus :data:`NETWORK_VARIED` when the CP group spans nodes (on one node those
    constants price nothing, and the draws of the other constants stay the ones they were)."""
    return (*varied, *NETWORK_VARIED) if spans_nodes else tuple(varied)


def perturb(hw: HardwareProfile, factors: dict[str, float]) -> HardwareProfile:
    """``hw`` with each named constant scaled by its factor (the module docstring: special
    cases); ``reducescatter_busbw_gbps`` follows ``allgather_busbw_gbps``, and so does
    ``alltoall_busbw_gbps`` unless it is among ``factors`` itself.

    Raises:
        ValueError: an unknown constant.
    """
    vals: dict[str, float] = {}
    for k, f in factors.items():
        if k not in (*VARIED, *OPTIONAL_VARIED, *NETWORK_VARIED):
            known = ", ".join((*VARIED, *OPTIONAL_VARIED, *NETWORK_VARIED))
            raise ValueError(f"{k!r} is not a varied constant; choose from {known}")
        v = float(getattr(hw, k))
        if k == "nccl_slowdown":
            vals[k] = 1.0 + (v - 1.0) * f
        elif k == "overlap_fraction":
            vals[k] = min(1.0, 1.0 - (1.0 - v) * f)
        elif k == "collective_latency_us":  # stays below the published curve's smallest time
            cap = min(hw._curve_seconds()) * 1e6 * 0.99
            vals[k] = min(v * f, cap)
        else:
            vals[k] = v * f
        if k == "allgather_busbw_gbps":
            vals["reducescatter_busbw_gbps"] = hw.reducescatter_busbw_gbps * f
            if "alltoall_busbw_gbps" not in factors:
                vals["alltoall_busbw_gbps"] = hw.alltoall_busbw_gbps * f
    return dataclasses.replace(hw, **vals)


def joint_factors(
    num_draws: int, factor: float, seed: int, varied: tuple[str, ...] = VARIED
) -> list[dict[str, float]]:
    """The joint study's draws: ``num_draws`` points of a Latin hypercube
    (``scipy.stats.qmc.LatinHypercube``, seeded) of log-uniform factors in ``[1/factor, factor]``,
    one per constant of ``varied`` (default :data:`VARIED`; give each to :func:`perturb`).

    Raises:
        ValueError: ``num_draws`` < 1 or ``factor`` <= 1.
    """
    from scipy.stats import qmc

    if int(num_draws) < 1 or not float(factor) > 1.0:
        raise ValueError(
            f"joint draws need num_draws >= 1 and factor > 1, got {num_draws}, {factor}"
        )
    lhs = qmc.LatinHypercube(d=len(varied), seed=int(seed)).random(int(num_draws))
    logf = (2.0 * lhs - 1.0) * math.log(float(factor))
    return [dict(zip(varied, row.tolist(), strict=True)) for row in np.exp(logf)]
