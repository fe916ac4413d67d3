"""Optional compiled (numba) kernels of the planners and the plan data model.

The planners and :class:`~flashcp.plan.Plan` have two implementations of their hot paths: the
readable NumPy / pure-Python one (the reference: the paper's Algorithm 1 in
:mod:`flashcp.heuristic`, the checks in :meth:`flashcp.plan.Plan.validate`), and numba kernels
that compute the same plans, bit for bit, in microseconds (:mod:`flashcp.plan_kernels`,
:mod:`flashcp.heuristic_compiled`, :mod:`flashcp.refined_compiled`). The kernels are used when numba can be imported; without it
(e.g. on an image that lacks numba) or with ``FLASHCP_COMPILED=0`` in the environment, every
caller falls back to the reference, with identical results.

numba is imported on the first use of a kernel, not at ``import flashcp``: a process that plans
nothing pays nothing. The kernels are compiled with ``cache=True``: the first process on a
machine compiles them (a few seconds, once) and writes them beside their sources
(``__pycache__``); later processes load them (about 0.5 s for numba's start-up, once per process).
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

__all__ = ["enabled", "load"]

#: modules of kernels, by the name callers ask for
_MODULES = {
    "plan": "flashcp.plan_kernels",
    "heuristic": "flashcp.heuristic_compiled",
    "refined": "flashcp.refined_compiled",
}


@functools.cache
def enabled() -> bool:
    """True when the compiled kernels are used: numba imports and ``FLASHCP_COMPILED`` is not
    ``0`` (read once per process)."""
    if os.environ.get("FLASHCP_COMPILED", "1").strip() in ("0", "false", "no", "off"):
        return False
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def load(name: str) -> ModuleType | None:
    """The kernels module ``name`` (``"plan"``, ``"heuristic"`` or ``"refined"``), or None when compiled kernels
    are off (:func:`enabled`): the caller then runs its reference implementation.

    Raises:
        ValueError: an unknown ``name``.
    """
    if name not in _MODULES:
        raise ValueError(f"unknown kernels module {name!r}; choose from {sorted(_MODULES)}")
    if not enabled():
        return None
    return importlib.import_module(_MODULES[name])
