"""Run a function on several CPU ranks (gloo) in forked processes, for tests.

``run_ranks(fn, world_size, *args)`` forks ``world_size`` processes; each joins a gloo process
group (with a timeout on every collective) through a rendezvous file of its own, so that runs
in parallel test workers never compete for a TCP port, calls ``fn(rank, world_size, *args)`` and
sends back its return value. An exception on any rank fails the caller with that rank's traceback;
a run that exceeds ``timeout_s`` is killed and fails. Nothing is left running.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["RankError", "run_ranks"]


class RankError(RuntimeError):
    """A rank raised; the message holds every failing rank's traceback."""


def _child(fn, rank, world_size, store_path, timeout_s, args, results) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        value = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # report everything, including assertion failures
        results.put((rank, False, traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout_s: float = 60):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks.

    Args:
        fn: a function (forked, so closures work); its return value must be ``torch.save``-able.
        world_size: number of ranks.
        timeout_s: limit for the process-group collectives and for the whole run.
    Returns:
        list of the ranks' return values, indexed by rank.
    Raises:
        RankError: some rank raised (message: its traceback), or the run timed out.
    """
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    store_dir = tempfile.TemporaryDirectory(prefix="flashcp_ranks_")
    store_path = os.path.join(store_dir.name, "rendezvous")  # created by the ranks' FileStore
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, world_size, store_path, timeout_s, args, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    got: dict[int, tuple[bool, bytes | str]] = {}
    failed_at = None
    try:
        while len(got) < world_size:
            now = time.monotonic()
            if now > deadline or (failed_at is not None and now > failed_at + 2.0):
                break
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            got[rank] = (ok, payload)
            if not ok and failed_at is None:
                failed_at = time.monotonic()  # give the other ranks a moment to report too
    finally:
        for p in procs:
            p.join(timeout=0.5 if len(got) == world_size else 0.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
        store_dir.cleanup()
    errors = [f"--- rank {r} ---\n{payload}" for r, (ok, payload) in sorted(got.items()) if not ok]
    missing = [r for r in range(world_size) if r not in got]
    if errors or missing:
        msg = "\n".join(errors)
        if missing:
            msg += f"\nranks {missing} did not report within {timeout_s} s (killed)"
        raise RankError(msg)
    return [torch.load(io.BytesIO(got[r][1]), weights_only=False) for r in range(world_size)]
