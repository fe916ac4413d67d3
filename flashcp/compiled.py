"""Optional compiled (numba) kernels of the planners and the plan data model.

The planners and :class:`~flashcp.plan.Plan` have two implementations of their hot paths: the
readable NumPy / pure-Python one (the reference: the paper's Algorithm 1 in
:mod:`flashcp.heuristic`, the checks in :meth:`flashcp.plan.Plan.validate`), and numba kernels
that compute the same plans, bit for bit, in microseconds (:mod:`flashcp.plan_kernels`,
:mod:`flashcp.heuristic_compiled`, :mod:`flashcp.refined_compiled`). The kernels are used when numba can be imported; without it
(e.g. on an image that lacks numba) every caller falls back to the reference, with identical
results.

numba costs a process about 1.3 s before its first kernel runs (importing numba, loading the
cached kernels), which pays off only for a process that plans many sequences (a sweep's worker:
tens of thousands). So by default (``FLASHCP_COMPILED=auto``) the first :data:`WARMUP_CALLS`
requests for kernels get None and run the reference (about a hundred plans, 500 of the baselines,
whose fused kernels ask once per plan), and only a process
that goes on planning loads numba: a one-shot ``flashcp plan``, a test's subprocess or a small
sweep never does. ``FLASHCP_COMPILED=1`` uses the kernels from the first call (the benchmarks and
the tests of the kernels), ``FLASHCP_COMPILED=0`` never. The mode only decides the speed: the
plans are the same.

The kernels are compiled with ``cache=True``: the first process on a machine compiles them (about
a minute on 2 busy cores, once) and writes them beside their sources (``__pycache__``); later
processes load them.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import os
from types import ModuleType

__all__ = ["WARMUP_CALLS", "enabled", "load"]

#: requests for kernels answered None before ``FLASHCP_COMPILED=auto`` loads numba (a plan asks
#: 2 to 6 times; a baseline's fused kernel once)
WARMUP_CALLS = 500
#: requests so far in this process (``auto`` mode): a lazy load's counter, like a cache
_REQUESTS = itertools.count()

#: modules of kernels, by the name callers ask for
_MODULES = {
    "plan": "flashcp.plan_kernels",
    "heuristic": "flashcp.heuristic_compiled",
    "refined": "flashcp.refined_compiled",
}


def _mode() -> str:
    """``FLASHCP_COMPILED``: ``0`` (off), ``1`` (on) or ``auto`` (the default; module docstring).

    Raises:
        ValueError: another value.
    """
    mode = os.environ.get("FLASHCP_COMPILED", "auto").strip().lower() or "auto"
    if mode not in ("0", "1", "auto"):
        raise ValueError(f"FLASHCP_COMPILED must be 0, 1 or auto, got {mode!r}")
    return mode


@functools.cache
def _numba_available() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def enabled() -> bool:
    """True when the compiled kernels can be used: numba imports and ``FLASHCP_COMPILED`` is not
    ``0``."""
    return _mode() != "0" and _numba_available()


def load(name: str) -> ModuleType | None:
    """The kernels module ``name`` (``"plan"``, ``"heuristic"`` or ``"refined"``), or None: the
    caller then runs its reference implementation (same results). None when the kernels are off
    (:func:`enabled`) and, in ``auto`` mode, for the first :data:`WARMUP_CALLS` requests.

    Raises:
        ValueError: an unknown ``name`` or ``FLASHCP_COMPILED`` value.
    """
    if name not in _MODULES:
        raise ValueError(f"unknown kernels module {name!r}; choose from {sorted(_MODULES)}")
    mode = _mode()
    if mode == "0" or (mode == "auto" and next(_REQUESTS) < WARMUP_CALLS):
        return None
    return _import(name)


@functools.cache
def _import(name: str) -> ModuleType | None:
    return importlib.import_module(_MODULES[name]) if _numba_available() else None
