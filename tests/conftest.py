"""Session-wide test settings and the test tiers.

The tiers mirror the code's rooms: ``unit/`` (in-process: planners, simulator, data, registry,
kernels), ``distributed/`` (ops and executors on forked gloo ranks, ``executor=emulate``),
``app/`` (the commands, sweeps, launchers, install, notebooks: every test there is marked
``slow``) and ``house/`` (the house rules: import graph, docs links, machine paths). The inner
loop is ``python -m pytest -q -m "not slow"``; CI runs everything. ``mp_utils`` and ``standins``
(shared by the tiers) sit beside this file, which puts this folder on ``sys.path``.

One intra-op thread for the whole session: the tensors under test are tiny, and on a CI machine
with two busy cores (or with two test workers) torch's thread pool spins instead of helping. The
forked gloo ranks of ``mp_utils.run_ranks`` set the same.

Hypothesis runs derandomised (profile ``ci``, the default): every run of the suite tries the same
examples, so a failure reproduces and a pass means the same thing on every machine.
``HYPOTHESIS_PROFILE=explore`` draws fresh random examples (to look for new failures locally).

The compiled (numba) planner and pricing kernels are compiled once, in this process, before any
test (:func:`flashcp.compiled.warm.warm_up`): the multi-rank tests fork their ranks from it (they
inherit the loaded kernels) and later processes load them from the cache, instead of several
processes compiling them at once on a fresh checkout (a minute each on two busy cores).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", derandomize=False, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True, scope="session")
def _compiled_kernels_once():
    from flashcp.compiled.warm import warm_up

    if os.environ.get("FLASHCP_COMPILED") != "0":
        warm_up()  # also marks the cache ready: no test starts a background compile
    yield


_SLOW_TIERS = ("app",)


def pytest_collection_modifyitems(config, items):
    """Mark every test of a slow tier ``slow`` (the inner loop deselects them)."""
    root = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        rel = os.path.relpath(str(item.path), root)
        if rel.split(os.sep)[0] in _SLOW_TIERS:
            item.add_marker(pytest.mark.slow)
