"""Single varlen kernel calls timed against the kernel model (the GPU check's step 4,
``experiments/gpu_check.py``): :func:`measure_kernels` runs each rank's kernel of a plan through
:mod:`flashcp.ops.backends` and prices it with :func:`flashcp.sim.attention_kernel_ms`. It sits
with the executors, which run ops; the simulator only prices plans.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from flashcp.comm import AttnShape
from flashcp.sim.hardware import HardwareProfile

__all__ = ["measure_kernels"]


def _time_ms(fn, device, warmup: int, iters: int) -> float:
    """Median wall time of ``fn()`` in ms (CUDA events on GPU, wall clock after it on CPU)."""
    import time

    import torch

    from flashcp.ops.timing import record_event

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start = record_event(device)
            fn()
            end = record_event(device)
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def measure_kernels(
    cases: Mapping[str, np.ndarray],
    methods: Sequence[str],
    cp_size: int,
    shape: AttnShape,
    hw: HardwareProfile,
    *,
    device,
    backend: str = "auto",
    warmup: int = 1,
    iters: int = 2,
    stop: Callable[[float], bool] | None = None,
) -> list[dict]:
    """Measured vs simulated time of one varlen kernel call per rank of every method's plan
    (the all-gather layout: rank r's shards against the KV before them), forward and backward,
    on random causal Q/K/V; simulated by :func:`flashcp.sim.attention_kernel_ms`.

    Args:
        cases: name -> (n_docs,) document lengths of one sequence.
        methods: registry methods; cp_size: N.
        shape: heads, KV heads, head_dim, dtype; hw: the profile that prices the kernels.
        device: a torch device; backend: kernel backend (:func:`flashcp.ops.backends.get_backend`).
        warmup, iters: untimed and timed calls (median kept).
        stop: ``stop(slowest_s)``, asked before each (case, method) with the slowest one's
            seconds so far; True ends the measurements (a budget).
    Returns:
        one dict per (case, method, rank, pass): ``case``, ``method``, ``rank``, ``pass``
        (``forward``/``backward``), ``num_segments``, ``q_tokens``, ``kv_tokens``,
        ``measured_ms``, ``sim_ms``, ``ratio`` (measured / sim), ``measured_tflops``, ``backend``.
    Raises:
        ValueError: an unknown method or backend, or what a planner raises.
    """
    import time
    from functools import partial

    import torch

    from flashcp.ops.backends import get_backend, resolve_softmax_scale
    from flashcp.plan import cu_seqlens, shard_workload
    from flashcp.registry import make_plan_for
    from flashcp.sim.kernel import attention_kernel_ms

    dtype = getattr(torch, shape.dtype)
    kern = get_backend(backend, device, dtype=dtype, head_dim=shape.head_dim)
    scale = resolve_softmax_scale(None, shape.head_dim)
    rows, slowest = [], 0.0
    for case, lens in cases.items():
        for method in methods:
            if stop is not None and stop(slowest):
                return rows
            t0 = time.monotonic()
            plan = make_plan_for(method, lens, cp_size)
            for r in range(cp_size):
                _, start, length = plan.rank_shards(r)
                q_lens, kv_lens = length, start + length
                cu_q = cu_seqlens(q_lens, device=device)
                cu_k = cu_seqlens(kv_lens, device=device)
                tq, tk = int(q_lens.sum()), int(kv_lens.sum())
                q = torch.randn(tq, shape.num_heads, shape.head_dim, device=device, dtype=dtype)
                k = torch.randn(tk, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype)
                v = torch.randn_like(k)
                meta = (cu_q, cu_k, int(q_lens.max()), int(kv_lens.max()))
                fwd = partial(kern.forward, q, k, v, *meta, causal=True, softmax_scale=scale)
                out, lse = fwd()
                bwd = partial(kern.backward, torch.randn_like(out), q, k, v, out, lse, *meta,
                              causal=True, softmax_scale=scale)  # fmt: skip
                pairs = float(shard_workload(start, length).sum())
                for name, fn, backward in (("forward", fwd, False), ("backward", bwd, True)):
                    ms = _time_ms(fn, device, warmup, iters)
                    sim = attention_kernel_ms(q_lens, kv_lens, True, shape, hw, backward=backward)
                    flops = (
                        4.0 * shape.head_dim * shape.num_heads * pairs * (2.5 if backward else 1.0)
                    )
                    rows.append({
                        "case": case, "method": method, "rank": r, "pass": name,
                        "num_segments": int(q_lens.size), "q_tokens": tq, "kv_tokens": tk,
                        "measured_ms": ms, "sim_ms": sim, "ratio": ms / sim,
                        "measured_tflops": flops / (ms * 1e-3) / 1e12, "backend": kern.name,
                    })  # fmt: skip
            slowest = max(slowest, time.monotonic() - t0)
    return rows
