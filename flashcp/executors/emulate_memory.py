"""``executor=emulate``'s memory check: the record pass holds every rank's traffic at once, so a
plan too large for the device is refused before any work (moved out of
:mod:`flashcp.executors.emulate`, which calls it; docs/execution.md gives the measurements).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from flashcp.comm import AttnShape, check_mode, comm_volume
from flashcp.plan import Plan

__all__ = [
    "available_memory_bytes",
    "check_job_memory",
    "check_record_memory",
    "job_device",
    "record_memory_bytes",
]


def record_memory_bytes(
    plan: Plan, shape: AttnShape, mode: str, keep: Sequence[int] | None = None
) -> int:
    """Estimated peak bytes of :func:`flashcp.executors.emulate.emulate_ranks` on its device (the
    record pass dominates).

    The record pass runs all ``cp_size`` ranks at once, so the step's whole communication is
    alive together: every rank's received K/V (and, in training, dK/dV) buffers, plus a copy of
    each buffer a kept rank receives (what the replay answers from). Estimate:

        inputs + outputs + (cp_size + len(keep)) * comm_bytes

    with inputs = ``context_len * (2 num_heads + 2 num_kv_heads) * head_dim * itemsize`` (q, k, v,
    dout; no dout in inference), outputs the same again (out, dq, dk, dv; out only in
    inference) and ``comm_bytes`` one rank's bytes received per step
    (:func:`flashcp.comm.comm_volume`, the most any rank receives). The rise in peak RSS measured
    on CPU (zigzag, CP 8, 32 heads, head_dim 128, bf16, training, 2K-8K tokens, one or all ranks
    kept) is within 20% of this estimate and linear in the context (docs/execution.md).

    Args:
        plan: the plan; shape: its attention shape; mode: ``train`` or ``infer``.
        keep: ranks replayed (default all).
    Returns:
        bytes (int).
    Raises:
        ValueError: bad ``mode`` or heads the plan's Ulysses degree does not allow.
    """
    from flashcp.registry import COMM_KIND

    check_mode(mode)
    train = mode == "train"
    kept = plan.cp_size if keep is None else len(keep)
    q_heads = shape.num_heads * (2 if train else 1)
    inputs = (
        plan.context_len * (q_heads + 2 * shape.num_kv_heads) * shape.head_dim * shape.dtype_bytes
    )
    outputs = (
        inputs if train else plan.context_len * shape.num_heads * shape.head_dim * shape.dtype_bytes
    )
    comm = comm_volume(plan, COMM_KIND[plan.method], shape, mode)["comm_bytes"]
    return int(inputs + outputs + (plan.cp_size + kept) * comm)


def available_memory_bytes(device) -> int | None:
    """Bytes that can still be allocated on ``device``: CUDA, the driver's free memory plus what
    PyTorch's caching allocator holds unused; CPU, ``MemAvailable`` of ``/proc/meminfo`` (Linux),
    else free physical pages (``os.sysconf``); None where neither can be read."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def check_record_memory(
    plan: Plan, shape: AttnShape, mode: str, device, keep: Sequence[int] | None = None
) -> int:
    """Refuse a plan whose :func:`record_memory_bytes` exceeds :func:`available_memory_bytes` of
    ``device`` (a process killed for memory, or a CUDA out-of-memory midway, loses the job).

    Returns:
        the estimate (bytes).
    Raises:
        ValueError: the estimate exceeds the available memory; the message gives both and what
            lowers the estimate.
    """
    need = record_memory_bytes(plan, shape, mode, keep)
    have = available_memory_bytes(device)
    if have is not None and need > have:
        kept = plan.cp_size if keep is None else len(keep)
        raise ValueError(
            f"executor=emulate: {plan.method} at cp_size = {plan.cp_size}, context_len = "
            f"{plan.context_len}, {mode} needs about {need / 2**30:.1f} GiB on {torch.device(device)} "
            f"(the record pass holds all {plan.cp_size} ranks' communication, "
            f"{kept} rank(s) kept), but {have / 2**30:.1f} GiB is available; use a shorter "
            f"context_len, fewer heads, or fewer replayed ranks (executor.ranks=[0]); "
            f"executor.check_memory=false skips this check"
        )
    return need


def job_device(run) -> torch.device:
    """Where ``executor=emulate`` replays ``run`` (a :class:`flashcp.executors.RunSpec`):
    ``executor.device``, else CUDA if available, else CPU."""
    dev = dict(run.executor).get("device")
    return torch.device(dev or ("cuda" if torch.cuda.is_available() else "cpu"))


def check_job_memory(run, plans: Sequence[Plan]) -> None:
    """:func:`check_record_memory` of the largest of ``plans`` (a job's, of ``run``: a
    :class:`flashcp.executors.RunSpec`) in each of its modes, on :func:`job_device`; nothing
    when ``executor.check_memory`` is false. The harness calls it before the job's folder is
    written, and :func:`flashcp.executors.emulate.execute` again before any record pass.

    Raises:
        ValueError: the estimate exceeds the available memory (:func:`check_record_memory`).
    """
    ex = dict(run.executor)
    if not bool(ex.get("check_memory", True)) or not plans:
        return
    ranks = None if ex.get("ranks") is None else [int(r) for r in ex["ranks"]]
    worst = max(
        plans, key=lambda p: max(record_memory_bytes(p, run.shape, m, ranks) for m in run.modes)
    )
    for mode in run.modes:
        check_record_memory(worst, run.shape, mode, job_device(run), ranks)
