"""Optional compiled (numba) kernels of the planners and the plan data model.

The planners and :class:`~flashcp.plan.Plan` have two implementations of their hot paths: the
readable NumPy / pure-Python one (the reference: the paper's Algorithm 1 in
:mod:`flashcp.planners.flashcp`, the checks in :meth:`flashcp.plan.Plan.validate`), and numba kernels
that compute the same plans, bit for bit, in microseconds (:mod:`flashcp.plan.kernels`,
:mod:`flashcp.planners.flashcp.compiled`, :mod:`flashcp.planners.flashcp_refined.compiled`; the batched step model's tile
statistics in :mod:`flashcp.sim.cost.kernels`; the ring family's metadata in
:mod:`flashcp.ops.ring_kernels`). The kernels are used when numba can be imported;
without it (e.g. on an image that lacks numba) every caller falls back to the reference, with
identical results. This module loads them by name (:func:`load`); they are declared with
:func:`flashcp.compiled.jit.njit`, and :mod:`flashcp.compiled.warm` compiles them ahead.

numba costs a process about 1.3 s before its first kernel runs (importing numba, loading the
cached kernels), which pays off only for a process that plans many sequences (a sweep's worker:
tens of thousands). So by default (``FLASHCP_COMPILED=auto``) the first :data:`WARMUP_CALLS`
requests for kernels get None and run the reference (about a hundred plans, 500 of the baselines,
whose fused kernels ask once per plan), and only a process
that goes on planning loads numba: a one-shot ``flashcp plan``, a test's subprocess or a small
sweep never does. ``FLASHCP_COMPILED=1`` uses the kernels from the first call (the benchmarks and
the tests of the kernels), ``FLASHCP_COMPILED=0`` never. The mode only decides the speed: the
plans are the same.

The kernels are compiled once per machine (a minute or more on 2 busy cores) and cached by numba
in a folder named by a key over every kernel module's source (:mod:`flashcp.compiled.jit`):
numba keys a function's cached code on its own file only, so without the key a kernel that calls
one of another module (``flashcp_plan`` calls ``finish_plan``) kept the callee's old code after an
edit of that module. The folder is ``kernels-<key>`` under the first of ``$NUMBA_CACHE_DIR/flashcp``
(when set), ``flashcp/__pycache__`` and ``$XDG_CACHE_HOME/flashcp`` (default ``~/.cache``) that
can be written; where none can (a read-only install and home) the kernels are not cached: ``auto``
mode runs the references and ``FLASHCP_COMPILED=1`` compiles them in each process, each saying so
in one log line (same plans either way). In ``auto`` mode the compile is kept off the command
that needs it: a process that finds the cache cold starts :func:`flashcp.compiled.warm.warm_up` in
a detached background process at the lowest CPU priority (:data:`WARM_UP_COMMAND`; one per cache
folder, under a lock file) and goes on with the references; it looks again every
:data:`RECHECK_CALLS` requests and switches to the kernels once the background compile has marked
the cache ready (:func:`marker`).
"""

from __future__ import annotations

import functools
import importlib
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

from flashcp.compiled.jit import (
    KERNEL_MODULES,
    cache_folder,
    marker,
    numba_available,
    numba_versions,
    say_once,
)

__all__ = [
    "RECHECK_CALLS",
    "WARMUP_CALLS",
    "WARM_UP_COMMAND",
    "cache_folder",
    "enabled",
    "load",
    "marker",
    "ready_now",
    "skip_warmup",
    "skipping_warmup",
]

#: requests for kernels answered None before ``FLASHCP_COMPILED=auto`` loads numba (a plan asks
#: 2 to 6 times; a baseline's fused kernel once)
WARMUP_CALLS = 500
#: requests so far in this process (``auto`` mode): a lazy load's counter, like a cache
_REQUESTS = itertools.count()
#: requests between two looks for the ready marker while the cache is cold (``auto`` mode)
RECHECK_CALLS = 2000
#: what the background compile runs (``python -c ... MARKER``; also by hand, without a marker)
WARM_UP_COMMAND = "import sys; from flashcp.compiled.warm import main; sys.exit(main(sys.argv[1:]))"
#: a background compile's lock older than this (seconds) is taken to be dead
LOCK_TIMEOUT_S = 900.0
#: this process's view of the cache (``auto`` mode): ready, requests since the last look, and
#: whether it has started a background compile
_CACHE = {"ready": False, "since_look": 0, "spawned": False, "skip": False}


def _mode() -> str:
    """``FLASHCP_COMPILED``: ``0`` (off), ``1`` (on) or ``auto`` (the default; module docstring).

    Raises:
        ValueError: another value.
    """
    mode = os.environ.get("FLASHCP_COMPILED", "auto").strip().lower() or "auto"
    if mode not in ("0", "1", "auto"):
        raise ValueError(f"FLASHCP_COMPILED must be 0, 1 or auto, got {mode!r}")
    return mode


def enabled() -> bool:
    """True when the compiled kernels can be used: numba imports and ``FLASHCP_COMPILED`` is not
    ``0``."""
    return _mode() != "0" and numba_available()


def load(name: str) -> ModuleType | None:
    """The kernels module ``name`` (``"plan"``, ``"heuristic"``, ``"refined"``, ``"price"`` or
    ``"ring"``), or
    None: the caller then runs its reference implementation (same results). None when the kernels
    are off (:func:`enabled`) and, in ``auto`` mode, for the first :data:`WARMUP_CALLS` requests,
    while the kernels' cache is cold and where it cannot be written (module docstring).

    Raises:
        ValueError: an unknown ``name`` or ``FLASHCP_COMPILED`` value.
    """
    if name not in KERNEL_MODULES:
        raise ValueError(f"unknown kernels module {name!r}; choose from {sorted(KERNEL_MODULES)}")
    mode = _mode()
    if mode == "0":
        return None
    if mode == "auto" and not _CACHE["skip"]:
        if next(_REQUESTS) < WARMUP_CALLS:
            return None
        if not _CACHE["ready"] and not _cache_ready():
            return None
    return _import(name)


def ready_now() -> bool:
    """True when :func:`load` may give the kernels from the next request on: they are enabled and,
    in ``auto`` mode, the cache is marked ready (a cold cache starts the background compile, as in
    :func:`load`, and gives False)."""
    if not enabled():
        return False
    if _mode() == "1" or _CACHE["ready"]:
        return True
    _CACHE["since_look"] = 0  # look now
    return _cache_ready()


def skipping_warmup() -> bool:
    """True once :func:`skip_warmup` was called in this process (or the process it forked from)."""
    return _CACHE["skip"]


def skip_warmup() -> None:
    """From now on :func:`load` answers the kernels at once in ``auto`` mode (no
    :data:`WARMUP_CALLS` requests of references): for a process that has just loaded every
    kernel (:func:`flashcp.compiled.warm.preload`). Worker processes forked afterwards inherit
    it, with the loaded kernels."""
    _CACHE["skip"] = True


@functools.cache
def _import(name: str) -> ModuleType | None:
    return importlib.import_module(KERNEL_MODULES[name]) if numba_available() else None


def _cache_ready() -> bool:
    """``auto`` mode: True once the kernels' cache is ready; else start one background compile
    (:func:`_spawn_warm_up`), or say once that nothing can be cached (the references run), and
    look again after :data:`RECHECK_CALLS` requests."""
    if _CACHE["since_look"] > 0:
        _CACHE["since_look"] = (_CACHE["since_look"] + 1) % RECHECK_CALLS
        return False
    _CACHE["since_look"] = 1
    ready = marker()
    if ready is None:
        _, why = cache_folder()
        if numba_versions() is not None:
            say_once(
                f"flashcp: the compiled kernels cannot be cached ({why}); planning with the "
                "reference code (the same plans; NUMBA_CACHE_DIR=<a writable folder> caches them)"
            )
        return False
    if ready.exists():
        _CACHE["ready"] = True
        return True
    if not _CACHE["spawned"]:
        _CACHE["spawned"] = True
        _spawn_warm_up(ready)
    return False


def _spawn_warm_up(marker: Path) -> bool:
    """Start :data:`WARM_UP_COMMAND` detached, at the lowest CPU priority, unless another
    process holds a live lock on this cache. Returns True when one was started."""
    lock = marker.with_suffix(".lock")
    try:
        if time.time() - lock.stat().st_mtime < LOCK_TIMEOUT_S:
            return False
        lock.unlink()
    except FileNotFoundError:
        pass
    except OSError:
        return False
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except OSError:  # another process took it first
        return False
    os.close(fd)
    env = dict(os.environ, FLASHCP_COMPILED="1")
    root = str(Path(__file__).resolve().parents[1])  # flashcp importable from a checkout too
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    try:
        subprocess.Popen(
            [sys.executable, "-c", WARM_UP_COMMAND, str(marker)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=env, start_new_session=True, preexec_fn=lambda: os.nice(19),
        )  # fmt: skip
    except OSError:
        lock.unlink(missing_ok=True)
        return False
    return True
