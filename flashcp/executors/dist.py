"""``executor=dist``: run a plan for real, one process per CP rank (DESIGN.md §4).

Under ``torchrun`` every rank calls :func:`init_from_env` once and then :func:`measure_step` for each
plan: seeded random Q/K/V (identical on every rank), sharded by the plan, through the method's
real op (:func:`flashcp.ops.get_attn_op`), forward and, for ``mode="train"``, backward. Phases are
timed with :class:`flashcp.ops.timing.PhaseTimer` (CUDA events on GPU, wall clock on CPU), the
median over timed steps is taken per rank, and the slowest rank per phase is reported, as the
simulator does. Bytes come from the ops' counters and are checked against
:func:`flashcp.comm.comm_volume`.
"""

from __future__ import annotations

import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from flashcp.comm import AttnShape, check_mode, comm_volume
from flashcp.ops import get_attn_op
from flashcp.ops.collectives import CommCounter, group_rank, group_size
from flashcp.ops.sharding import shard_tensor
from flashcp.ops.timing import PhaseTimer
from flashcp.plan import Plan
from flashcp.registry import COMM_KIND
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS

__all__ = ["check_comm", "init_from_env", "measure_step"]


def init_from_env(timeout_s: float = 120.0):
    """Join (or create) the default process group; returns it.

    Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) uses the ``env://`` rendezvous; otherwise
    starts a one-rank group on 127.0.0.1. NCCL when CUDA is available (binding ``LOCAL_RANK``'s
    GPU), gloo otherwise. Every collective gets ``timeout_s``.
    """
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if cuda else "gloo"
        timeout = timedelta(seconds=float(timeout_s))
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=0,
                world_size=1,
                timeout=timeout,
            )
    return dist.group.WORLD


def check_comm(result: dict, plan: Plan, shape: AttnShape, mode: str) -> dict[str, int]:
    """Compare counted bytes (``result[COMM_COLUMNS]``) with the plan's prediction.

    Returns:
        the predicted ``comm_volume`` dict.
    Raises:
        ValueError: any of the byte columns differs (the message gives both).
    """
    expect = comm_volume(plan, COMM_KIND[plan.method], shape, mode)
    got = {k: int(result[k]) for k in COMM_COLUMNS}
    if got != expect:
        raise ValueError(f"{plan.method}: counted bytes {got} differ from the plan's {expect}")
    return expect


def _reduce_max(values: list[float], group, device) -> list[float]:
    """Element-wise max over the ranks of ``group``."""
    if group_size(group) == 1:
        return values
    dev = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_step(
    plan: Plan,
    shape: AttnShape,
    mode: str,
    *,
    group=None,
    device=None,
    backend: str = "auto",
    warmup: int = 1,
    iters: int = 3,
    seed: int = 0,
    check: bool = True,
) -> dict[str, float | int]:
    """Time one attention layer's CP step of ``plan`` on this process group.

    Args:
        plan: the plan (identical on every rank; checked by the op before its first collective).
        shape: heads, KV heads, head_dim and dtype of Q/K/V and of the communicated buffers.
        mode: ``train`` (forward + backward) or ``infer`` (forward only).
        group: the CP process group (size ``plan.cp_size``).
        device: where tensors live (default CPU).
        backend: kernel backend (:func:`flashcp.ops.backends.get_backend`).
        warmup: untimed steps first; iters: timed steps (median reported).
        seed: seeds Q, K, V and dO (same on every rank).
        check: raise if the counted bytes differ from :func:`flashcp.comm.comm_volume`.
    Returns:
        every key of :data:`PHASE_COLUMNS` (ms; median over steps, max over ranks; ``total_ms`` is
        the wall time of the whole step; phases the method lacks are 0.0) and of
        :data:`COMM_COLUMNS` (bytes received per step, max over ranks).
    Raises:
        ValueError: bad mode, group size different from ``plan.cp_size``, bad ``iters``, or (with
            ``check``) counted bytes that disagree with the plan.
    """
    check_mode(mode)
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    n, rank = group_size(group), group_rank(group)
    if n != plan.cp_size:
        raise ValueError(f"plan is for cp_size = {plan.cp_size} but the group has {n} ranks")
    prepare, attn = get_attn_op(plan.method)
    meta = prepare(plan, rank)
    dtype = getattr(torch, shape.dtype)
    train = mode == "train"

    gen = torch.Generator(device=device).manual_seed(int(seed))
    c = plan.context_len

    def local(heads):  # seeded full tensor (same on every rank), then this rank's rows
        full = torch.randn(c, heads, shape.head_dim, generator=gen, device=device, dtype=dtype)
        return shard_tensor(full, plan, rank)

    q, k, v = local(shape.num_heads), local(shape.num_kv_heads), local(shape.num_kv_heads)
    dout = local(shape.num_heads) if train else None

    phases: dict[str, list[float]] = {name: [] for name in PHASE_COLUMNS}
    counted: dict[str, int] = {}
    for step in range(warmup + iters):
        timer, counter = PhaseTimer(device), CommCounter()
        ql, kl, vl = (x.detach().requires_grad_(train) for x in (q, k, v))
        if n > 1:
            dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        with torch.set_grad_enabled(train):
            out = attn(ql, kl, vl, meta, group, backend=backend, counter=counter, timer=timer)
            if train:
                out.backward(dout)
        _sync(device)
        total = (time.perf_counter() - t0) * 1e3
        if step < warmup:
            continue
        ms = timer.as_ms()
        for name in PHASE_COLUMNS:
            phases[name].append(ms.pop(name.removesuffix("_ms"), 0.0))
        phases["others_ms"][-1] += sum(ms.values())  # phases outside the schema count as others
        phases["total_ms"][-1] = total
        counted = counter.as_dict()

    med = [statistics.median(phases[name]) for name in PHASE_COLUMNS]
    byte_vals = [float(counted[k]) for k in COMM_COLUMNS]
    reduced = _reduce_max(med + byte_vals, group, device)
    result: dict[str, float | int] = dict(
        zip(PHASE_COLUMNS, reduced[: len(PHASE_COLUMNS)], strict=True)
    )
    result.update(
        {k: int(x) for k, x in zip(COMM_COLUMNS, reduced[len(PHASE_COLUMNS) :], strict=True)}
    )
    if check:
        check_comm(result, plan, shape, mode)
    return result
