"""Registry of planners keyed by method name.

Every planner is a pure function ``planner(doc_lens, cp_size, **options) -> Plan`` that never
touches a process group. ``COMM_KIND`` says how each method moves KV, which the simulator, the
executors and the accounting use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import MappingProxyType

from flashcp.plan import Plan, planner_entry

__all__ = ["COMM_KIND", "FAST_METHODS", "METHODS", "get_planner", "make_plan_for"]

# method -> "module:function"; imported lazily so that `flashcp` does not import `baselines` eagerly
_PLANNERS = MappingProxyType(
    {
        "llama3": "baselines.llama3:plan_llama3",
        "per_doc": "baselines.per_doc:plan_per_doc",
        "ring": "baselines.ring:plan_ring",
        "zigzag": "baselines.zigzag:plan_zigzag",
        "flashcp": "flashcp.heuristic:plan_flashcp",
        "flashcp_refined": "flashcp.refined:plan_flashcp_refined",
        "ilp": "flashcp.ilp:plan_ilp",
    }
)

#: how each method communicates KV: full all-gather (Eq. 4), sharding-aware all-gather (Eq. 5),
#: or ring point-to-point.
COMM_KIND = MappingProxyType(
    {
        "llama3": "allgather_full",
        "per_doc": "allgather_full",
        "flashcp": "allgather_sharded",
        "flashcp_refined": "allgather_sharded",
        "ilp": "allgather_sharded",
        "ring": "p2p_ring",
        "zigzag": "p2p_ring",
    }
)

METHODS: tuple[str, ...] = tuple(_PLANNERS)
#: planners that run in milliseconds (every method but the ILP, which solves a MIP per sequence)
FAST_METHODS: tuple[str, ...] = tuple(m for m in METHODS if m != "ilp")


def get_planner(method: str) -> Callable[..., Plan]:
    """Return the planner function of ``method``.

    Every planner returned takes zero-length documents and pad tokens (``num_pad``,
    ``pad_to_multiple``): a planner module that does not declare that handling itself with
    :func:`flashcp.plan.planner_entry` gets it here, so every method shares it.

    Raises:
        ValueError: unknown method (the message lists the known ones).
    """
    try:
        target = _PLANNERS[method]
    except (KeyError, TypeError):
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}") from None
    module, func = target.split(":")
    planner = getattr(importlib.import_module(module), func)
    if not getattr(planner, "is_planner_entry", False):
        planner = planner_entry(method)(planner)
    return planner


def make_plan_for(method: str, doc_lens, cp_size: int, **options) -> Plan:
    """Plan ``doc_lens`` over ``cp_size`` ranks with ``method`` (options go to the planner).

    ``doc_lens`` may hold zero-length documents (skipped; the plan is the one without them, with
    the caller's document indices); ``num_pad=P`` adds P pad tokens after the last document and
    ``pad_to_multiple=True`` the fewest the layout needs (:func:`flashcp.plan.planner_entry`).
    """
    return get_planner(method)(doc_lens, cp_size, **options)
