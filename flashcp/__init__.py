"""FlashCP harness: context parallelism over packed, document-masked sequences.

The library: the plan data model (:mod:`flashcp.plan`), the planners (:mod:`flashcp.heuristic`,
the baselines in the top-level :mod:`baselines` package, all registered in :mod:`flashcp.registry`),
document-length samplers (:mod:`flashcp.data`), the simulator (:mod:`flashcp.sim`) and the
executors.
"""

from flashcp.plan import Plan, Shard, make_plan
from flashcp.registry import (
    CommKind,
    MethodSpec,
    get_method,
    get_planner,
    make_plan_for,
    method_names,
    register_method,
)

__version__ = "0.1.0"

__all__ = [
    "CommKind",
    "MethodSpec",
    "Plan",
    "Shard",
    "__version__",
    "get_method",
    "get_planner",
    "make_plan",
    "make_plan_for",
    "method_names",
    "register_method",
]
