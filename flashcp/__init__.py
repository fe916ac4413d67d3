"""FlashCP harness: context parallelism over packed, document-masked sequences.

The library: the plan data model (:mod:`flashcp.plan`), the planners (:mod:`flashcp.planners.flashcp`,
the baselines in the top-level :mod:`baselines` package; each method's spec sits beside its
planner and :mod:`flashcp.registry` finds them through the ``flashcp.methods`` entry points),
document-length samplers (:mod:`flashcp.data`), the simulator (:mod:`flashcp.sim`) and the
executors.
"""

from flashcp.kinds import CommKind, OpFamily
from flashcp.plan import Plan, Shard, make_plan
from flashcp.registry import (
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
    "OpFamily",
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
