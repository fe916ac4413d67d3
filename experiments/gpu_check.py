"""The prepared GPU check: one command for a session that is lent a GPU.

    python experiments/gpu_check.py                      # on the GPU machine, ~5 minutes
    python experiments/gpu_check.py --quick --backend cpu   # the same code paths on a CPU, tiny sizes

Writes under ``--out`` (default ``results/gpu_check``), every file a CSV or text a later session can
commit and read:

1. ``env.txt``: torch / CUDA / GPU / flash-attn versions.
2. ``pytest_gpu.txt``: the GPU-marked tests (``pytest -m gpu``: CUDA kernels vs the float64
   reference, the ring-flash-attn cross-checks where that package imports).
3. ``kernels.csv``: real varlen attention kernel time per rank for every method's layout (the
   all-gather family's one call per rank: q = local shards, kv = prefix + shard), forward and
   backward, next to the simulator's prediction for the same segments (``sim_ms``, ``ratio``): this
   is what calibrates :mod:`flashcp.sim.kernel` on real hardware. Cases: Fig. 3's one 128K
   document and 16 x 8K documents, and sampled WLB-LLM / Pile sequences, CP 8, 32 heads, bf16.
4. ``dist.csv``: ``executor=dist`` through ``torchrun --nproc-per-node 1`` (cp_size 1) for every
   method's op on one 128K sequence: the same rows as the simulator.

Timing (STYLE.md §9): warm-up, then the median of ``--iters`` runs timed with CUDA events (wall
clock after a synchronisation on CPU).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from flashcp.comm import AttnShape
from flashcp.data import load_distribution, sample_sequences
from flashcp.ops.backends import get_backend
from flashcp.registry import make_plan_for
from flashcp.results import provenance, write_csv_atomic
from flashcp.sim import attention_kernel_ms, load_hardware

REPO = Path(__file__).resolve().parents[1]
METHODS = ("llama3", "per_doc", "ring", "zigzag", "flashcp")


def _time_ms(fn, device: torch.device, warmup: int, iters: int) -> float:
    """Median wall time of ``fn()`` in ms (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def kernel_rows(args, device: torch.device, shape: AttnShape) -> list[dict]:
    """Measured vs simulated kernel time per (case, method, rank, pass)."""
    backend = get_backend(args.backend, device)
    hw = load_hardware("h100_sxm")
    dtype = getattr(torch, shape.dtype)
    c, n = args.context_len, args.cp_size
    cases = {"1x128K": np.array([c]), "16x8K": np.full(16, c // 16)}
    for ds in ("wlb_llm", "pile"):
        seqs = sample_sequences(load_distribution(ds, context_len=c), args.sequences, c, seed=0)
        cases.update({f"{ds}#{i}": d for i, d in enumerate(seqs)})
    scale = shape.head_dim**-0.5
    rows = []
    for case, lens in cases.items():
        for method in METHODS:
            plan = make_plan_for(method, lens, n)
            for r in range(n):
                _, start, length = plan.rank_shards(r)
                q_lens, kv_lens = length, start + length
                cu_q = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device=device)
                cu_k = torch.tensor(np.concatenate([[0], np.cumsum(kv_lens)]), dtype=torch.int32, device=device)
                tq, tk = int(q_lens.sum()), int(kv_lens.sum())
                q = torch.randn(tq, shape.num_heads, shape.head_dim, device=device, dtype=dtype)
                k = torch.randn(tk, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype)
                v = torch.randn_like(k)
                mq, mk = int(q_lens.max()), int(kv_lens.max())

                meta = (cu_q, cu_k, mq, mk)
                fwd = partial(backend.forward, q, k, v, *meta, causal=True, softmax_scale=scale)
                out, lse = fwd()
                bwd = partial(backend.backward, torch.randn_like(out), q, k, v, out, lse, *meta,
                              causal=True, softmax_scale=scale)  # fmt: skip

                for name, fn, backward in (("forward", fwd, False), ("backward", bwd, True)):
                    ms = _time_ms(fn, device, args.warmup, args.iters)
                    sim = attention_kernel_ms(q_lens, kv_lens, True, shape, hw, backward=backward)
                    pairs = float(((2 * start + length + 1) * length // 2).sum())
                    flops = 4.0 * shape.head_dim * shape.num_heads * pairs * (2.5 if backward else 1.0)
                    rows.append({
                        "case": case, "method": method, "rank": r, "pass": name,
                        "num_segments": int(q_lens.size), "q_tokens": tq, "kv_tokens": tk,
                        "measured_ms": ms, "sim_ms": sim, "ratio": ms / sim,
                        "measured_tflops": flops / (ms * 1e-3) / 1e12, "backend": backend.name,
                    })  # fmt: skip
            print(f"kernels: {case} {method} done", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "results" / "gpu_check"))
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (to exercise the code on a CPU)")
    ap.add_argument("--sequences", type=int, default=2, help="sampled sequences per dataset")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    args.context_len, args.cp_size = (4096, 4) if args.quick else (131072, 8)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = AttnShape(8, 2, 64, "float32") if args.quick else AttnShape(32, 32, 128, "bfloat16")

    env = {**provenance(), "device": str(device), "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "none"}  # fmt: skip
    try:
        import flash_attn

        env["flash_attn"] = flash_attn.__version__
    except ImportError:
        env["flash_attn"] = "not installed"
    (out / "env.txt").write_text("".join(f"{k}: {v}\n" for k, v in env.items()))
    print(env, flush=True)

    if not args.quick:
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs"], cwd=REPO,
                             capture_output=True, text=True, timeout=900)  # fmt: skip
        (out / "pytest_gpu.txt").write_text(res.stdout + res.stderr)
        print(res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr, flush=True)

    df = pd.DataFrame(kernel_rows(args, device, shape))
    for k, v in env.items():
        df[k] = v
    write_csv_atomic(df, out / "kernels.csv")
    summary = df.groupby(["method", "pass"])["ratio"].median().unstack()
    print("median measured / simulated kernel time:\n", summary.round(2).to_string(), flush=True)

    dist_dir = out / "dist"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "experiments.run",
        "-m", f"method={','.join(METHODS)}", "executor=dist", f"executor.backend={args.backend}",
        "cp_size=1", f"context_len={args.context_len}", "num_sequences=1", "dataset=wlb_llm",
        f"results_dir={out}", "name=dist", "progress=false",
    ]  # fmt: skip
    if args.quick:
        cmd += ["model.num_heads=8", "model.num_kv_heads=2", "model.head_dim=64", "model.dtype=float32"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    (out / "dist_log.txt").write_text(res.stdout + res.stderr)
    if (dist_dir / "rows.csv").exists():
        rows = pd.read_csv(dist_dir / "rows.csv")
        write_csv_atomic(rows, out / "dist.csv")
        print(rows[["method", "mode", "attn_fwd_ms", "attn_bwd_ms", "total_ms"]].to_string(), flush=True)
    else:
        print("executor=dist failed; see dist_log.txt", flush=True)


if __name__ == "__main__":
    main()
