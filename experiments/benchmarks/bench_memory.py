"""Benchmark: peak memory of the CP attention ops per rank, forward and backward, every method.

    python experiments/benchmarks/bench_memory.py                          # CPU, gloo, CP 4: ~1-2 minutes
    python experiments/benchmarks/bench_memory.py --cp-size 8 --doc-lens 16384 --heads 32 --kv-heads 8 \
        --head-dim 128 --dtype bfloat16                         # on 8 GPUs (NCCL, one per rank)

Runs ``cp_size`` ranks (forked processes; gloo on CPU, NCCL with one GPU per rank when
``--device cuda``), builds each method's plan for ``--doc-lens``, and on every rank measures the
peak bytes allocated *during* the op's forward call and during its backward call: buffers that
existed before the call (q, k, v, dout) are not counted; what the call returns and keeps (out and
the saved LSE; dq, dk, dv) is. How bytes are measured:

* CUDA: ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``, minus
  ``memory_allocated()`` before the call (the caching allocator's bytes in live tensors).
* CPU: ``torch.profiler`` with ``profile_memory=True`` records every allocation and free of the
  CPU tensor allocator with its pointer and time; the peak is the maximum, over time, of the bytes
  allocated during the call and not yet freed. It sees every tensor the op and its kernels
  allocate (including kernel temporaries made as tensors), not gloo's internal transport buffers
  nor malloc calls outside PyTorch's allocator.

The table gives, per method (and ``heads_per_group`` and ``keep_gathered_kv`` for the all-gather
family), the largest
rank's peak for the forward and the backward call, what stays allocated from the forward's
start to its end (``held``: out, lse and, with ``keep_gathered_kv``, the gathered KV kept for the
backward), the op's inputs on that rank (q, k, v), the
ratio peak / inputs, and for the all-gather family the peak predicted by
:func:`flashcp.ops.allgather_attn.allgather_peak_bytes` (its own buffers and outputs; the kernel's
workspace and the autograd engine's are not in it, so measured minus predicted is roughly that
workspace). Rows (per rank, bytes) can be written as CSV (``--csv``). Bytes depend only on the
shapes, not on CPU contention; gloo frees its staging buffers from its own threads, so a rank can
now and then show one staging buffer more.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import multiprocessing as mp
import os
import socket
import time
from datetime import timedelta

import pandas as pd
import torch
import torch.distributed as dist

from flashcp.kinds import OpFamily
from flashcp.ops import get_attn_op
from flashcp.ops.allgather_attn import (
    AllGatherMeta,
    allgather_peak_bytes,
    resolve_heads_per_group,
)
from flashcp.ops.backends import compute_dtype
from flashcp.ops.sharding import shard_tensor
from flashcp.registry import get_method, make_plan_for, method_names, options_schema

METHODS = method_names()
MIB = 2**20


def _head_groups(method: str) -> bool:
    """The method's op takes ``heads_per_group`` (the all-gather op family)."""
    return get_method(method).op is OpFamily.ALLGATHER


# ---- measuring -----------------------------------------------------------------------------------


def _cpu_peak(prof, at_end: bool = False) -> int:
    """Peak live bytes among CPU allocations recorded by ``prof`` (frees of older buffers
    ignored); ``at_end``: the live bytes at the end instead."""
    from torch._C._profiler import _EventType  # the event tree torch's own memory profiler reads

    def walk(nodes):
        for n in nodes:
            yield n
            yield from walk(n.children)

    events = sorted(
        (n.start_time_ns, n.extra_fields.ptr, n.extra_fields.alloc_size)
        for n in walk(prof.profiler.kineto_results.experimental_event_tree())
        if n.tag == _EventType.Allocation and n.extra_fields.device.type == "cpu"
    )
    live: dict[int, int] = {}
    cur = peak = 0
    for _, ptr, size in events:
        if size > 0:
            live[ptr] = size
            cur += size
        elif ptr in live:
            cur -= live.pop(ptr)
        peak = max(peak, cur)
    return cur if at_end else peak


def peak_bytes(fn, device: torch.device, held: bool = False):
    """``(fn(), peak bytes allocated during the call)`` (method in the module docstring);
    ``held``: ``(fn(), peak, bytes allocated during the call and still live after it)``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        live = torch.cuda.memory_allocated(device) - base
        return (result, peak, live) if held else (result, peak)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    return (result, _cpu_peak(prof), _cpu_peak(prof, True)) if held else (result, _cpu_peak(prof))


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---- one rank ----------------------------------------------------------------------------------


def _rank_rows(rank: int, n: int, args, plans: dict) -> list[dict]:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    c = sum(args.doc_lens)
    gen = torch.Generator().manual_seed(0)
    full = [
        torch.randn(c, h, args.head_dim, generator=gen).to(dtype)
        for h in (args.heads, args.kv_heads, args.kv_heads, args.heads)
    ]
    rows = []
    for (method, hpg, keep), plan in plans.items():
        prepare, attn = get_attn_op(method)
        meta = prepare(plan, rank)
        q, k, v, dout = (shard_tensor(x, plan, rank).to(device) for x in full)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        opts = {"heads_per_group": hpg, "keep_gathered_kv": keep} if _head_groups(method) else {}
        forward = functools.partial(attn, q, k, v, meta, backend=args.backend, **opts)
        forward().backward(dout)  # warm-up (lazy initialisation is not the op's memory)
        q.grad = k.grad = v.grad = None
        dist.barrier()
        t0 = time.perf_counter()
        out, fwd_peak, held = peak_bytes(forward, device, held=True)
        _, bwd_peak = peak_bytes(functools.partial(out.backward, dout), device)
        wall = time.perf_counter() - t0
        inputs = _nbytes(q, k, v)
        row = {
            "method": method,
            "heads_per_group": "-",
            "keep_gathered_kv": "-",
            "rank": rank,
            "inputs_bytes": inputs,
            "fwd_peak_bytes": fwd_peak,
            "fwd_returned_bytes": _nbytes(out),  # + the saved LSE, counted in the peak
            "held_bytes": held,
            "bwd_peak_bytes": bwd_peak,
            "bwd_returned_bytes": _nbytes(q.grad, k.grad, v.grad),
            "wall_s": wall,
        }
        if isinstance(meta, AllGatherMeta):
            used = resolve_heads_per_group(hpg, meta, args.kv_heads, args.head_dim, dtype)
            row["heads_per_group"] = f"{used} (auto)" if hpg is None else str(used)
            row["keep_gathered_kv"] = "yes" if keep else "no"
            pred = allgather_peak_bytes(
                meta, args.heads, args.kv_heads, args.head_dim, dtype, heads_per_group=hpg,
                staged_collectives=device.type == "cpu",  # gloo stages through a temporary
                keep_gathered_kv=keep,
            )  # fmt: skip
            lse = meta.doc_tokens * args.heads * compute_dtype(dtype).itemsize
            row["held_predicted_bytes"] = pred["kept"] + _nbytes(out) + lse
            row["fwd_peak_predicted_bytes"] = pred["forward"]
            row["bwd_peak_predicted_bytes"] = pred["backward"]
        rows.append(row)
    return rows


def _child(rank, n, port, args, plans, queue) -> None:
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if args.device == "cuda":
            torch.cuda.set_device(rank)
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(
            backend, rank=rank, world_size=n, timeout=timedelta(seconds=args.timeout_s)
        )
        queue.put((rank, _rank_rows(rank, n, args, plans), None))
    except BaseException as e:  # report it: the parent must not wait forever
        queue.put((rank, None, repr(e)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(args) -> pd.DataFrame:
    """Measure every (method, heads_per_group) on ``args.cp_size`` ranks; one row per rank."""
    n = args.cp_size
    if args.device == "cuda" and torch.cuda.device_count() < n:
        raise SystemExit(f"--device cuda needs {n} GPUs, found {torch.cuda.device_count()}")
    plans = {}
    for method in args.methods:
        options = {f.name for f in dataclasses.fields(options_schema(method))}
        opts = {"time_limit_s": 30.0} if "time_limit_s" in options else {}  # a solver's cap
        plan = make_plan_for(method, args.doc_lens, n, **opts)
        ag = _head_groups(method)
        for hpg in args.heads_per_group if ag else [None]:
            for keep in args.keep_gathered_kv if ag else [False]:
                plans[method, hpg, keep] = plan
    ctx = mp.get_context("spawn" if args.device == "cuda" else "fork")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(target=_child, args=(r, n, port, args, plans, queue), daemon=True)
        for r in range(n)
    ]
    for p in procs:
        p.start()
    rows, errors = [], []
    try:
        for _ in range(n):
            rank, got, err = queue.get(timeout=args.timeout_s)
            if err is not None:
                errors.append(f"rank {rank}: {err}")
            else:
                rows.extend(got)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise SystemExit("\n".join(errors))
    return pd.DataFrame(rows)


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Largest rank per (method, heads_per_group, keep_gathered_kv), in MiB, with the derived
    columns."""
    key = ["method", "heads_per_group", "keep_gathered_kv"]
    g = df.groupby(key, sort=False).max(numeric_only=True).reset_index()
    out = g[key].copy()
    out["inputs_MiB"] = g["inputs_bytes"] / MIB
    out["held_MiB"] = g["held_bytes"] / MIB
    if "held_predicted_bytes" in g:
        out["held_pred_MiB"] = g["held_predicted_bytes"] / MIB
    for p in ("fwd", "bwd"):
        out[f"{p}_peak_MiB"] = g[f"{p}_peak_bytes"] / MIB
        if f"{p}_peak_predicted_bytes" in g:
            out[f"{p}_pred_MiB"] = g[f"{p}_peak_predicted_bytes"] / MIB
        out[f"{p}_peak_per_input"] = g[f"{p}_peak_bytes"] / g["inputs_bytes"]
    return out


def _yes(word: str) -> bool:
    if word not in ("yes", "no"):
        raise argparse.ArgumentTypeError(f"--keep-gathered-kv takes yes or no, got {word!r}")
    return word == "yes"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp-size", type=int, default=4)
    ap.add_argument("--doc-lens", type=lambda s: [int(x) for x in s.split(",")],
                    default=[2048, 1024, 512, 256, 256], help="comma-separated document lengths")  # fmt: skip
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"]
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--backend", default="auto", help="kernel backend (flashcp.ops.backends)")
    ap.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS))
    ap.add_argument("--heads-per-group", type=lambda s: [None if x == "auto" else int(x) for x in s.split(",")],
                    default=None, help="all-gather family: comma-separated values, 'auto' = default "
                    "(default: all KV heads at once, then 1)")  # fmt: skip
    ap.add_argument("--keep-gathered-kv", type=lambda s: [_yes(x) for x in s.split(",")],
                    default=[False, True], help="all-gather family: comma-separated yes/no "
                    "(default: no,yes)")  # fmt: skip
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--csv", default=None, help="also write the per-rank rows here")
    args = ap.parse_args(argv)
    if args.heads_per_group is None:
        args.heads_per_group = [args.kv_heads, 1]
    df = run(args)
    if args.csv:
        df.to_csv(args.csv, index=False)
    print(
        f"peak bytes allocated by the op per rank (largest rank), CP {args.cp_size}, "
        f"docs {args.doc_lens}, H={args.heads} Hkv={args.kv_heads} D={args.head_dim} {args.dtype}, "
        f"{args.device} ({'torch.cuda.max_memory_allocated' if args.device == 'cuda' else 'torch.profiler allocation events'})"
    )
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(summarize(df).to_string(index=False, float_format=lambda x: f"{x:.2f}"))


if __name__ == "__main__":
    main()
