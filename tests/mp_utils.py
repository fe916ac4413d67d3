"""Run a function on several CPU ranks (gloo) in forked processes, for tests.

``run_ranks(fn, world_size, *args)`` forks ``world_size`` processes; each joins a gloo process
group on 127.0.0.1 (with a timeout on every collective), calls ``fn(rank, world_size, *args)`` and
sends back its return value. An exception on any rank fails the caller with that rank's traceback;
a run that exceeds ``timeout_s`` is killed and fails. Nothing is left running.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["RankError", "free_port", "run_ranks"]


class RankError(RuntimeError):
    """A rank raised; the message holds every failing rank's traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, port, timeout_s, args, results) -> None:
    try:
        torch.set_num_threads(1)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
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
    port = free_port()
    procs = [
        ctx.Process(
            target=_child, args=(fn, r, world_size, port, timeout_s, args, results), daemon=True
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
    errors = [f"--- rank {r} ---\n{payload}" for r, (ok, payload) in sorted(got.items()) if not ok]
    missing = [r for r in range(world_size) if r not in got]
    if errors or missing:
        msg = "\n".join(errors)
        if missing:
            msg += f"\nranks {missing} did not report within {timeout_s} s (killed)"
        raise RankError(msg)
    return [torch.load(io.BytesIO(got[r][1]), weights_only=False) for r in range(world_size)]
