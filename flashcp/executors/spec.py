"""What an executor needs to know of one run (:class:`RunSpec`): apart from the package, which
loads the executors by name, so they import it without a circle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flashcp.comm import AttnShape

__all__ = ["RunSpec"]


@dataclass(frozen=True)
class RunSpec:
    """What an executor needs to know of one run.

    Attributes:
        method: registry method name; ``options`` its planner options; ``impl`` its
            implementation (``ours`` or ``ring_flash_attn``, :mod:`flashcp.sim.impl`).
        cp_size: N, ranks.
        shape: query heads, KV heads, head_dim and dtype of the attention layer.
        modes: ``train`` and/or ``infer``.
        hardware: a :class:`flashcp.sim.HardwareProfile` (sim, emulate) or None (dist).
        seed: seed of the run (dist and emulate draw Q/K/V from ``seed + seq_idx``).
        executor: the executor's own options (dist/emulate: ``backend``, ``warmup``, ``iters``,
            ``timeout_s``; emulate: ``ranks``, ``nccl_traffic``, ``device``).
        placement, nodes: the CP group on the profile's nodes (sim;
            :func:`flashcp.sim.network.topology_for`).
    """

    method: str
    cp_size: int
    shape: AttnShape
    modes: tuple[str, ...]
    options: Mapping[str, Any] = field(default_factory=dict)
    impl: str = "ours"
    hardware: Any = None
    seed: int = 0
    executor: Mapping[str, Any] = field(default_factory=dict)
    placement: str = "consecutive"
    nodes: int | None = None

    @property
    def plan_key(self) -> tuple:
        """Runs with equal keys share their plans: (method, impl, cp_size, options)."""
        import json

        return (
            self.method,
            self.impl,
            self.cp_size,
            json.dumps(dict(self.options), sort_keys=True),
        )
