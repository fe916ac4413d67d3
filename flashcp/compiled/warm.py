"""Compile the numba kernels once and mark their cache ready (:mod:`flashcp.compiled`).

``flashcp.compiled`` starts this in a background process when it finds the cache cold
(:data:`flashcp.compiled.WARM_UP_COMMAND`); by hand::

    python -c "from flashcp.compiled.warm import warm_up; print(warm_up())"

It is a module of its own because it plans and prices (it imports the registry and the cost
model, which import :mod:`flashcp.compiled`).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from flashcp import compiled
from flashcp.compiled import jit

__all__ = ["PRELOAD_PLANS", "main", "preload", "prune", "warm_up"]

#: plans a job makes from which it loads every kernel before its first plan (:func:`preload`):
#: about a second's work of the references, what loading the kernels costs
PRELOAD_PLANS = 2000


def warm_up(marker: Path | None = None, *, mark: bool = True) -> float:
    """Compile (or load from numba's cache) every kernel in this process by planning and pricing a
    few small plans with every compiled path, then mark the cache ready and :func:`prune` the
    caches of older sources.

    Args:
        marker: the ready marker to write (default: this checkout's,
            :func:`flashcp.compiled.marker`, when it can be written).
        mark: False: write no marker (:func:`preload`, on a cache already marked).
    Returns:
        Seconds it took (0.0 when numba is not installed: nothing to compile).
    """
    t0 = time.perf_counter()
    old = os.environ.get("FLASHCP_COMPILED")
    os.environ["FLASHCP_COMPILED"] = "1"  # kernels from the first call
    try:
        if not compiled.enabled():  # numba is not installed: nothing to compile
            return 0.0
        from flashcp.comm import AttnShape
        from flashcp.registry import make_plan_for
        from flashcp.sim.cost import price_plans

        methods = ("llama3", "per_doc", "ring", "zigzag", "flashcp", "flashcp_refined")
        plans = [make_plan_for(method, [3000, 1000, 64, 32], 4) for method in methods]
        price_plans(plans, [AttnShape(4, 4, 64, "bfloat16")], ["train"], "h100_sxm")
        from flashcp.ops.ring_meta import prepare_ring_meta  # imports torch: the ops need it

        prepare_ring_meta(plans[3], 1, "zigzag")
    finally:
        if old is None:
            del os.environ["FLASHCP_COMPILED"]
        else:
            os.environ["FLASHCP_COMPILED"] = old
    marker = marker if marker is not None else compiled.marker()
    if mark and marker is not None:
        marker.touch()
        prune(marker.parent)
    return time.perf_counter() - t0


def prune(folder: Path) -> list[Path]:
    """Remove the kernels caches of other keys (older sources: about 6 MB each) beside ``folder``
    when it is in this checkout's ``flashcp/__pycache__``; a folder shared with other checkouts
    (``NUMBA_CACHE_DIR``, the user's cache) is left alone, as they may use those keys. A process
    still running the older kernels recompiles a kernel it has not loaded yet.

    Returns:
        The paths removed.
    """
    own = Path(jit.__file__).resolve().parents[1] / "__pycache__"
    if folder.resolve().parent != own:
        return []
    removed = []
    for other in sorted(own.glob("kernels-*")):
        if other.name == folder.name:
            continue
        if other.is_dir():
            shutil.rmtree(other, ignore_errors=True)
        else:  # a ready marker or lock of the layout before the keyed folders
            other.unlink(missing_ok=True)
        removed.append(other)
    return removed


def preload() -> bool:
    """Load every kernel into this process now, when the cache is ready (about 1.3 s: importing
    numba and loading the cached kernels), so that this process and the worker processes it forks
    afterwards plan and price with the kernels from their first call, without the
    :data:`flashcp.compiled.WARMUP_CALLS` requests of references each would otherwise run and
    the load each would pay (``executor=sim`` on a job of at least :data:`PRELOAD_PLANS` plans).

    Returns:
        True when the kernels were loaded; False when they are off (``FLASHCP_COMPILED=0``,
        numba not installed) or the cache is still cold (the background compile is then started,
        as by :func:`flashcp.compiled.load`, and the references run meanwhile).
    """
    if compiled.skipping_warmup():  # loaded already (an earlier job of this process)
        return True
    if not compiled.ready_now():
        return False
    warm_up(mark=False)
    compiled.skip_warmup()
    return True


def main(argv: list[str]) -> int:
    """:data:`flashcp.compiled.WARM_UP_COMMAND` ``[MARKER]``: :func:`warm_up`, then drop the lock
    next to the marker (the background compile that :mod:`flashcp.compiled` starts)."""
    marker = Path(argv[0]) if argv else compiled.marker()
    try:
        seconds = warm_up(marker)
    finally:
        if marker is not None:
            marker.with_suffix(".lock").unlink(missing_ok=True)
    print(f"flashcp kernels ready in {seconds:.1f} s")
    return 0
