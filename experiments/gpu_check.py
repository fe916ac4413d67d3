"""The prepared GPU check: one command, at most 8 minutes on one GPU with only PyTorch installed.

    python -m experiments.gpu_check                  # one H200/H100: CP 8, 128K, torch_cuda kernels
    python -m experiments.gpu_check --quick          # every step on a CPU, in well under a minute
    python experiments/gpu_check.py                  # the same (the checkout is put on sys.path)

From the repository root, uninstalled, with only PyTorch, NumPy, pandas, SciPy and pytest: the
check imports no Hydra, OmegaConf, PuLP or HiGHS (the GPU machine's image has none of them).

Steps, in order of value, each timed and printed; a step that no longer fits ``--budget-s``
(default 450 s, leaving half a minute of the 8 for start-up) is skipped and the report says so.
A step that fails, is skipped for lack of budget, or did nothing (no unit replayed, no test
collected, no row written) fails the check: the exit code is 1 and ``summary.md`` says which. So
does a replayed unit or a ``dist`` row that failed (the others are still written and fitted).

1. ``env.txt``: torch / CUDA / GPU / flash-attn versions.
2. ``emulate.csv``: ``executor=emulate`` (:mod:`flashcp.executors.emulate`): every rank of CP 8
   replayed on this one device, for ``--sequences`` sampled 128K sequences per dataset (WLB-LLM,
   Pile, RedPajama) and all five methods, training step (forward + backward). The op code is
   ``executor=dist``'s; communication is priced by the hardware profile. Next to each measured
   phase (``attn_fwd_ms``, ``attn_bwd_ms``, ``others_ms``, ...) the simulator's prediction for
   the same plan (``sim_*``, profile ``--hardware``). Work is taken round-robin (sequence 0 of
   every dataset and method first), so a run cut short by the budget still covers every method.
3. ``calibration_fit.csv``, ``fitted_constants.csv``: the simulator's free kernel and copy
   constants fitted to those measurements by :func:`flashcp.sim.calibration.fit_constants` (one
   target per sequence, method and phase: measured = the replay, predict = the simulator on the
   same plan and phase under the candidate profile); ``fit_*`` columns in ``emulate.csv``;
   ``emulate_vs_sim.csv``: medians per method and phase.
   Every rank must be replayed (``--ranks all``): the simulator's phases are the slowest rank's.
4. ``pytest_gpu.txt``: the GPU-marked tests (``pytest -m gpu``, among them ``executor=emulate``
   on CUDA against the float64 reference). With ``--quick`` on a CPU they are collected and skip;
   on a GPU at least one must pass.
5. ``dist.csv``: ``executor=dist`` through ``torchrun --nproc-per-node 1 -m flashcp.executors.dist``
   (its plain entry, no Hydra) for every method.
6. ``kernels.csv``: one varlen kernel call per rank for every method's all-gather layout, forward
   and backward, measured vs :func:`flashcp.sim.attention_kernel_ms`.
7. ``summary.md``: what ran, how long each step took, measured vs simulated per method and phase,
   the fitted constants.

Timing (docs/design.md §4, §7): warm-up, then the median of ``--iters`` runs timed with CUDA events
(wall clock after a synchronisation on CPU). ``--quick`` on a CPU only exercises the code: its
times say nothing about a GPU, and fitting GPU constants to them is meaningless.
"""

from __future__ import annotations

import time

_START = time.monotonic()  # the budget counts from process start (imports included)

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

if __package__ in (None, ""):  # `python experiments/gpu_check.py`: import the checkout it lies in
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
from dataclasses import fields  # noqa: E402
from functools import partial  # noqa: E402

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from flashcp.comm import AttnShape  # noqa: E402
from flashcp.data import load_distribution, sample_sequences  # noqa: E402
from flashcp.ops.backends import get_backend, resolve_softmax_scale  # noqa: E402
from flashcp.ops.timing import record_event  # noqa: E402
from flashcp.plan import cu_seqlens, shard_workload  # noqa: E402
from flashcp.registry import make_plan_for, method_names  # noqa: E402
from flashcp.resources import source_root  # noqa: E402
from flashcp.results import (  # noqa: E402
    COMM_COLUMNS,
    PHASE_COLUMNS,
    markdown_table,
    provenance,
    write_csv_atomic,
)
from flashcp.sim import HardwareProfile, attention_kernel_ms, load_hardware, simulate  # noqa: E402
from flashcp.sim.calibration import CalibTarget, fit_constants  # noqa: E402

METHODS = method_names(paper=True)
DATASETS = ("wlb_llm", "pile", "redpajama")
#: measured phases the fit uses as targets (communication phases come from the profile itself)
FIT_PHASES = ("attn_fwd_ms", "attn_bwd_ms", "others_ms")
#: constants a one-device replay measures, fitted by default where the profile has them: kernel
#: rates up to the peak, per-CTA, launch and per-op host costs, copy bandwidth, ring step
#: overheads (not the network, nor NCCL's contention: the replay has no NCCL)
DEFAULT_FREE = (
    "fwd_tile_tflops", "bwd_tile_tflops", "fwd_cta_overhead_us", "bwd_cta_overhead_us",
    "launch_us", "copy_bw_gbps", "host_op_us", "ring_step_fwd_us", "ring_step_bwd_us",
)  # fmt: skip
#: their bounds (widened to hold the starting profile's value): an eager PyTorch op costs
#: 5-25 µs of host time, a kernel launch about 5 µs (docs/design.md §8)
DEFAULT_BOUNDS = {
    "fwd_cta_overhead_us": (0.0, 20.0),
    "bwd_cta_overhead_us": (0.0, 20.0),
    "launch_us": (0.0, 50.0),
    "copy_bw_gbps": (300.0, 6000.0),
    "host_op_us": (1.0, 50.0),
    "ring_step_fwd_us": (0.0, 200.0),
    "ring_step_bwd_us": (0.0, 400.0),
}


# ---- budget ---------------------------------------------------------------------------------------


class Budget:
    """Wall-clock budget of the whole check.

    Args:
        total_s: seconds for everything.
        start: ``time.monotonic()`` at which it started (default: now).
    """

    def __init__(self, total_s: float, start: float | None = None) -> None:
        self.total_s = float(total_s)
        self.start = time.monotonic() if start is None else start
        self.steps: list[dict] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.total_s - self.elapsed()

    def failures(self) -> list[str]:
        """``"step: status"`` of every step that did not end ``ok``."""
        return [f"{s['step']}: {s['status']}" for s in self.steps if s["status"] != "ok"]

    def run(self, name: str, fn, need_s: float):
        """Run ``fn()`` as step ``name`` if at least ``need_s`` seconds are left; record and print
        its time and status. A failing step is recorded (with its error) and the check goes on.

        Returns:
            ``fn()``'s value, or None when skipped or failed.
        """
        left = self.left()
        if left < need_s:
            self.steps.append(
                {
                    "step": name,
                    "status": f"skipped: {left:.0f} s left, needs {need_s:.0f} s",
                    "seconds": 0.0,
                }
            )
            print(
                f"[{name}] skipped: {left:.0f} s of the budget left, needs {need_s:.0f} s",
                flush=True,
            )
            return None
        t0 = time.monotonic()
        print(f"[{name}] start ({left:.0f} s of the budget left)", flush=True)
        try:
            value, status = fn(), "ok"
        except Exception as exc:  # a failed step is reported, the others still run
            value, status = None, f"failed: {type(exc).__name__}: {exc}"
        dt = time.monotonic() - t0
        self.steps.append({"step": name, "status": status, "seconds": dt})
        print(f"[{name}] {status} in {dt:.1f} s ({self.left():.0f} s left)", flush=True)
        return value


# ---- helpers ----------------------------------------------------------------------------------------


def _time_ms(fn, device: torch.device, warmup: int, iters: int) -> float:
    """Median wall time of ``fn()`` in ms (CUDA events on GPU)."""
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


def _text(x) -> str:
    """Captured output of a subprocess (bytes after a timeout, str otherwise)."""
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def run_bounded(cmd: list[str], timeout_s: float, log: Path) -> tuple[int, str]:
    """Run ``cmd`` (in the checkout, if any) in its own session, at most ``timeout_s`` seconds;
    write its output to ``log`` and return ``(exit code, output)``. On timeout the whole session
    (e.g. torchrun's workers) is killed, so nothing is left holding the GPU.

    Raises:
        subprocess.TimeoutExpired: it ran out of time (the log says how far it got).
    """
    import os
    import signal

    proc = subprocess.Popen(cmd, cwd=source_root(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        text, _ = proc.communicate(timeout=max(timeout_s, 1.0))
    except BaseException:  # its time ran out, or the check's own (watchdog, Ctrl-C)
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        log.write_text(_text(text))
        raise
    log.write_text(_text(text))
    return proc.returncode, _text(text)


def pytest_outcomes(text: str) -> dict[str, str]:
    """Test id -> outcome (``PASSED``, ``SKIPPED``, ``FAILED``, ``ERROR``, ``XFAIL``, ``XPASS``)
    of every test item in the output of ``pytest -v`` (a module skipped as a whole is no item)."""
    pat = r"^(\S+::\S+) (PASSED|SKIPPED|FAILED|ERROR|XFAIL|XPASS)\b"
    return {m[1]: m[2] for m in re.finditer(pat, text, flags=re.MULTILINE)}


def check_pytest(code: int, text: str, on_gpu: bool) -> dict[str, int]:
    """The GPU-test step's verdict on ``pytest -v -m gpu``'s exit code and output.

    Returns:
        outcome -> number of GPU test items.
    Raises:
        RuntimeError: no GPU test item collected (exit code 5, or none in the output), a failure
            or error, or on a GPU no test that passed (every GPU test skipped there: none ran).
    """
    outcomes = pytest_outcomes(text)
    counts = {o: list(outcomes.values()).count(o) for o in sorted(set(outcomes.values()))}
    last = text.strip().splitlines()[-1] if text.strip() else "(no output)"
    if code == 5 or not outcomes:
        raise RuntimeError(f"pytest -m gpu collected no GPU test (exit code {code}): {last}")
    if code != 0:
        raise RuntimeError(f"pytest -m gpu failed (exit code {code}): {last}")
    if on_gpu and not counts.get("PASSED"):
        raise RuntimeError(f"no GPU test passed on the GPU: {last}")
    return counts


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def sampled_sequences(args) -> dict[str, list[np.ndarray]]:
    """``--sequences`` seeded sequences of ``context_len`` tokens per dataset of ``--datasets``."""
    return {
        ds: sample_sequences(
            load_distribution(ds, context_len=args.context_len), args.sequences, args.context_len,
            seed=args.seed,
        )
        for ds in args.datasets
    }  # fmt: skip


# ---- step 2: executor=emulate --------------------------------------------------------------------


def emulate_rows(
    args, device, shape: AttnShape, hw: HardwareProfile, budget: Budget, reserve_s: float
):
    """Replay CP ``args.cp_size`` for every (sequence, dataset, method), round-robin, while the
    budget (less ``reserve_s`` for later steps) allows another unit of the slowest size seen.

    Returns:
        ``(rows, plans)``: one dict per unit (measured phases, ``sim_*`` predictions, status),
        and ``{(dataset, seq_idx, method): plan}`` of the units that succeeded.
    """
    from flashcp.executors.emulate import emulate_step

    seqs = sampled_sequences(args)
    backend = get_backend(
        args.backend, device, dtype=getattr(torch, shape.dtype), head_dim=shape.head_dim
    ).name
    units = [
        (i, ds, m) for i in range(args.sequences) for ds in args.datasets for m in args.methods
    ]
    rows, plans, slowest = [], {}, 0.0
    for n_done, (i, ds, method) in enumerate(units):
        if budget.left() - reserve_s < 1.3 * slowest:
            print(
                f"emulate: budget reached, {len(units) - n_done} of {len(units)} units not run",
                flush=True,
            )
            break
        lens = seqs[ds][i]
        ident = {
            "dataset": ds, "seq_idx": i, "method": method, "cp_size": args.cp_size,
            "context_len": args.context_len, "num_docs": int(lens.size), "max_doc_len": int(lens.max()),
            "num_heads": shape.num_heads, "num_kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim, "dtype": shape.dtype, "backend": backend,
            "ranks": "all" if args.ranks is None else " ".join(map(str, args.ranks)),
            "hardware": hw.name,
        }  # fmt: skip
        t0 = time.monotonic()
        try:
            plan = make_plan_for(method, lens, args.cp_size)
            row = emulate_step(
                plan, shape, "train", hw, device=device, backend=backend, warmup=args.warmup,
                iters=args.iters, seed=args.seed + i, ranks=args.ranks,
                nccl_traffic=args.nccl_traffic,
            )  # fmt: skip
            sim = simulate(plan, shape, hw, "train")
            status = "ok"
            plans[ds, i, method] = plan
        except Exception as exc:  # an OOM or a failure is a row, not a crash
            row, sim, status = {}, {}, f"error: {type(exc).__name__}: {exc}"
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        dt = time.monotonic() - t0
        slowest = max(slowest, dt)
        out = {**ident, "status": status, "unit_s": dt, **row}
        out.update({f"sim_{k}": sim[k] for k in PHASE_COLUMNS if k in sim})
        rows.append(out)
        if status == "ok":
            print(
                f"emulate {ds} seq{i} {method:8s} {dt:6.1f} s  fwd {row['attn_fwd_ms']:9.3f} ms "
                f"(sim {sim['attn_fwd_ms']:9.3f})  bwd {row['attn_bwd_ms']:9.3f} ms "
                f"(sim {sim['attn_bwd_ms']:9.3f})  others {row['others_ms']:8.3f} ms "
                f"(sim {sim['others_ms']:8.3f})",
                flush=True,
            )
        else:
            print(f"emulate {ds} seq{i} {method}: {status}", flush=True)
    return rows, plans


# ---- step 3: calibration fit -----------------------------------------------------------------------


def parse_free(spec: str | None, hw: HardwareProfile) -> dict[str, tuple[float, float]]:
    """Free profile fields and bounds: ``name`` (default bounds) or ``name=lo:hi``, comma-separated.

    Without ``spec``: the fields of :data:`DEFAULT_FREE` the profile has. Default bounds:
    ``DEFAULT_BOUNDS`` (widened to hold the profile's value), rates ``(0.1 * value,
    peak_tflops)``, otherwise ``(0.25 * value, 4 * value)``.

    Raises:
        ValueError: a name that is not a numeric profile field, or bounds that do not hold the
            profile's value.
    """
    numeric = {f.name for f in fields(HardwareProfile) if f.init and f.type in ("float", "int")}
    if spec:
        names = tuple(s.strip() for s in spec.split(",") if s.strip())
    else:
        names = tuple(n for n in DEFAULT_FREE if n in numeric)
    free = {}
    for item in names:
        name, _, rng = item.partition("=")
        if name not in numeric:
            raise ValueError(
                f"--free: {name!r} is not a numeric hardware constant; choose from {', '.join(sorted(numeric))}"
            )
        value = float(getattr(hw, name))
        if rng:
            lo, _, hi = rng.partition(":")
            bounds = (float(lo), float(hi))
        elif name in DEFAULT_BOUNDS:
            lo, hi = DEFAULT_BOUNDS[name]
            bounds = (min(lo, value), max(hi, value))
        elif name.endswith("_tflops"):
            bounds = (0.1 * value, float(hw.peak_tflops))
        else:
            bounds = (0.25 * value, 4.0 * value)
        if not bounds[0] <= value <= bounds[1]:
            raise ValueError(f"--free: {name} = {value} lies outside its bounds {bounds}")
        free[name] = bounds
    return free


def _phases_under(plan, shape: AttnShape):
    """``phases(hw)``: the simulator's training-step row of ``plan`` under profile ``hw``; the last
    profile's row is cached, so every phase of one plan costs one simulation per candidate."""
    last: dict = {}

    def phases(hw: HardwareProfile) -> dict[str, float]:
        if last.get("hw") is not hw:
            last["hw"], last["row"] = hw, simulate(plan, shape, hw, "train")
        return last["row"]

    return phases


def fit_targets(rows: list[dict], plans: dict, shape: AttnShape, source: str) -> list[dict]:
    """One calibration target per replayed (dataset, sequence, method) and phase of
    :data:`FIT_PHASES` with a measured time above zero, as keyword arguments of
    ``CalibTarget`` (``predict(hw)`` = the simulator on the same plan and phase)."""
    targets = []
    for row in rows:
        key = (row["dataset"], row["seq_idx"], row["method"])
        if row["status"] != "ok" or key not in plans:
            continue
        phases = _phases_under(plans[key], shape)
        for phase in FIT_PHASES:
            if not row[phase] > 0:
                continue
            targets.append({
                "name": f"emulate/{key[0]}/seq{key[1]}/{key[2]}/{phase}",
                "predict": lambda hw, ph=phase, f=phases: float(f(hw)[ph]),
                "measured": float(row[phase]),
                "unit": "ms",
                "band": ("rel", 0.10),
                "source": source,
            })  # fmt: skip
    return targets


def fit(args, rows, plans, shape, hw, out: Path, env: dict):
    """Fit the free constants to the replayed phases; write the fit table and constants; add
    ``fit_*`` columns to ``rows``. Returns the fitted profile.

    Raises:
        RuntimeError: no target, or a subset of ranks replayed.
    """
    if args.ranks is not None:
        raise RuntimeError(
            "the fit needs every rank replayed (--ranks all): the simulator's phases are the slowest rank's"
        )
    free = parse_free(args.free, hw)
    source = f"measured: experiments/gpu_check.py executor=emulate on {env['gpu']}, backend {rows[0]['backend']}"
    targets = [CalibTarget(**t) for t in fit_targets(rows, plans, shape, source)]
    if not targets:
        raise RuntimeError("no replayed unit to fit")
    # bound the optimiser (each evaluation simulates every replayed plan)
    res = fit_constants(targets, hw, free, max_nfev=40 * len(free))
    write_csv_atomic(res.table, out / "calibration_fit.csv")
    fitted = load_hardware({**hw.to_dict(), **res.constants})
    consts = pd.DataFrame([
        {"constant": k, "before": getattr(hw, k), "fitted": res.constants.get(k), "lower": lo, "upper": hi}
        for k, (lo, hi) in free.items()
    ])  # fmt: skip
    write_csv_atomic(consts, out / "fitted_constants.csv")
    for row in rows:
        key = (row["dataset"], row["seq_idx"], row["method"])
        if key in plans:
            sim = simulate(plans[key], shape, fitted, "train")
            row.update({f"fit_{k}": sim[k] for k in PHASE_COLUMNS})
    print(f"fit: success={res.success} ({res.message}); {len(targets)} targets", flush=True)
    print(consts.to_string(index=False), flush=True)
    return res, consts


def comparison(rows: list[dict]) -> pd.DataFrame:
    """Median over sequences of measured vs simulated (default and fitted profile) per method and
    phase, with the median ratio measured / simulated. Phases zero on both sides for a method are
    left out; ``allgather_ms`` / ``reducescatter_ms`` come from the profile on both sides and
    ``p2p_ms`` is the model's transfer time left exposed by the measured compute."""
    df = pd.DataFrame([r for r in rows if r["status"] == "ok"])
    out = []
    for method, g in df.groupby("method", sort=False):
        for phase in PHASE_COLUMNS:
            if not (g[phase].abs().sum() or g[f"sim_{phase}"].abs().sum()):
                continue
            rec = {"method": method, "phase": phase, "units": len(g), "measured": g[phase].median(),
                   "sim": g[f"sim_{phase}"].median(),
                   "measured_over_sim": (g[phase] / g[f"sim_{phase}"]).median()}  # fmt: skip
            if f"fit_{phase}" in g:
                rec["fitted_sim"] = g[f"fit_{phase}"].median()
                rec["measured_over_fitted"] = (g[phase] / g[f"fit_{phase}"]).median()
            out.append(rec)
    return pd.DataFrame(out)


# ---- step 5: kernels ---------------------------------------------------------------------------------


def kernel_rows(
    args, device: torch.device, shape: AttnShape, hw: HardwareProfile, budget: Budget
) -> list[dict]:
    """Measured vs simulated kernel time per (case, method, rank, pass), while the budget lasts."""
    dtype = getattr(torch, shape.dtype)
    backend = get_backend(args.backend, device, dtype=dtype, head_dim=shape.head_dim)
    c, n = args.context_len, args.cp_size
    cases = {"1x128K": np.array([c]), "16x8K": np.full(16, c // 16)}
    for ds, seqs in sampled_sequences(args).items():
        cases.update({f"{ds}#{i}": d for i, d in enumerate(seqs)})
    scale = resolve_softmax_scale(None, shape.head_dim)
    rows, slowest = [], 0.0
    for case, lens in cases.items():
        for method in args.methods:
            if budget.left() - 5 < 1.3 * slowest:
                print(f"kernels: budget reached before {case} {method}", flush=True)
                return rows
            t0 = time.monotonic()
            plan = make_plan_for(method, lens, n)
            for r in range(n):
                _, start, length = plan.rank_shards(r)
                q_lens, kv_lens = length, start + length
                cu_q = cu_seqlens(q_lens, device=device)
                cu_k = cu_seqlens(kv_lens, device=device)
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
                    pairs = float(shard_workload(start, length).sum())
                    flops = (
                        4.0 * shape.head_dim * shape.num_heads * pairs * (2.5 if backward else 1.0)
                    )
                    rows.append({
                        "case": case, "method": method, "rank": r, "pass": name,
                        "num_segments": int(q_lens.size), "q_tokens": tq, "kv_tokens": tk,
                        "measured_ms": ms, "sim_ms": sim, "ratio": ms / sim,
                        "measured_tflops": flops / (ms * 1e-3) / 1e12, "backend": backend.name,
                    })  # fmt: skip
            slowest = max(slowest, time.monotonic() - t0)
            print(f"kernels: {case} {method} {time.monotonic() - t0:.1f} s", flush=True)
    return rows


# ---- driver -------------------------------------------------------------------------------------------


def _environment(device: torch.device) -> dict:
    env = {**provenance(), "device": str(device), "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none (cpu)"}  # fmt: skip
    try:
        import flash_attn

        env["flash_attn"] = flash_attn.__version__
    except ImportError:
        env["flash_attn"] = "not installed"
    import flashcp

    env["flashcp_from"] = str(Path(flashcp.__file__).resolve().parent.parent)  # the checkout run
    return env


def _markdown(args, env, budget: Budget, rows, comp, consts, fit_res) -> str:
    ok = sum(r["status"] == "ok" for r in rows)
    lines = [
        "# GPU check",
        "",
        f"Command: `python -m experiments.gpu_check {' '.join(sys.argv[1:])}`; device {env['gpu']} "
        f"(torch {env['torch_version']}, CUDA {env['cuda']}, flash-attn {env['flash_attn']}); "
        f"commit {env['git_commit']}{' (dirty)' if env['git_dirty'] else ''}.",
        "",
        f"executor=emulate: CP {args.cp_size}, context {args.context_len}, "
        f"{args.num_heads} heads (MHA), head_dim {args.head_dim}, {args.dtype}, training step; "
        f"{ok} of {len(rows)} units ok; ranks {'all' if args.ranks is None else args.ranks}; "
        f"communication from profile `{args.hardware}`.",
    ]
    if args.quick:
        lines += ["", "**--quick on a CPU: these numbers exercise the code only; they say nothing "
                      "about a GPU, and the fitted constants are meaningless.**"]  # fmt: skip
    lines += ["", "## Steps", "", "| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {s['step']} | {s['status']} | {s['seconds']:.1f} |" for s in budget.steps]
    failed = budget.failures()
    lines += ["", f"**The check failed**: {'; '.join(failed)}." if failed else "Every step ok."]
    if comp is not None and len(comp):
        lines += ["", "## Measured vs simulated (median over sequences)", "", markdown_table(comp)]
    if consts is not None:
        lines += ["", f"## Fitted constants ({fit_res.message})", "", markdown_table(consts)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out",
        default=None,
        help="output folder (default results/gpu_check; results/gpu_check_quick with --quick)",
    )
    ap.add_argument(
        "--backend",
        default="auto",
        help="kernel backend (auto: flash_attn, else torch_cuda, else cpu)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes on any device, in seconds")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds for everything (default 450; 180 with --quick)",
    )
    ap.add_argument(
        "--sequences",
        type=int,
        default=None,
        help="sampled sequences per dataset (default 3; 1 with --quick)",
    )
    ap.add_argument("--datasets", default=",".join(DATASETS), help="comma-separated")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    ap.add_argument("--ranks", default="all", help="ranks to replay: all, or e.g. 0,7")
    ap.add_argument(
        "--num-heads",
        type=int,
        default=None,
        help="query = KV heads (default 16: MHA as in the paper's h16)",
    )
    ap.add_argument(
        "--hardware",
        default="h100_sxm",
        help="starting profile (conf/hardware) for the simulator and the communication model",
    )
    ap.add_argument(
        "--free",
        default=None,
        help="constants to fit: name or name=lo:hi, comma-separated (default: kernel rates, per-CTA and launch costs, copy bandwidth)",
    )
    ap.add_argument(
        "--nccl-traffic",
        action="store_true",
        help="(CUDA) copy ring messages on a second stream while ranks compute",
    )
    ap.add_argument(
        "--warmup", type=int, default=None, help="untimed replays (default 1; 0 with --quick)"
    )
    ap.add_argument(
        "--iters",
        type=int,
        default=None,
        help="timed replays, median kept (default 2; 1 with --quick)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", default="", help="steps to skip: emulate,fit,pytest,kernels,dist")
    args = ap.parse_args(argv)
    # from the command line the budget counts from process start (imports, CUDA start included)
    start = _START if argv is None else time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    if args.quick:
        args.context_len, args.cp_size, args.head_dim, args.dtype = 1024, 8, 16, "float32"
        args.num_heads = args.num_heads or 4
        args.sequences = args.sequences or 1
        args.warmup = 0 if args.warmup is None else args.warmup
        args.iters = args.iters or 1
        budget = Budget(args.budget_s or 180.0, start)
        # one intra-op thread: the record pass runs a thread per rank, and spinning OpenMP pools
        # of several rank threads on a few cores cost far more than the tiny kernels
        torch.set_num_threads(1)
    else:
        args.context_len, args.cp_size, args.head_dim, args.dtype = 131072, 8, 128, "bfloat16"
        args.num_heads = args.num_heads or 16
        args.sequences = args.sequences or 3
        args.warmup = 1 if args.warmup is None else args.warmup
        args.iters = args.iters or 2
        budget = Budget(args.budget_s or 450.0, start)
    args.ranks = None if args.ranks == "all" else [int(r) for r in args.ranks.split(",")]
    args.datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for name, got, known in (
        ("dataset", args.datasets, DATASETS),
        ("method", args.methods, METHODS),
    ):
        if not got or set(got) - set(known):
            raise ValueError(f"--{name}s must name some of {', '.join(known)}, got {got}")
    for r in args.ranks or ():
        if not 0 <= r < args.cp_size:
            raise ValueError(f"--ranks: rank {r} out of range for cp_size = {args.cp_size}")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    shape = AttnShape(args.num_heads, args.num_heads, args.head_dim, args.dtype)
    hw = load_hardware(args.hardware)
    if args.free:
        parse_free(args.free, hw)  # bad names fail now, not after the measurements
    out = Path(args.out or Path("results") / ("gpu_check_quick" if args.quick else "gpu_check"))
    out = out.resolve()  # the runs it starts work in the checkout: give them an absolute path
    out.mkdir(parents=True, exist_ok=True)

    # a hard stop shortly after the budget: whatever hangs is interrupted, the step is reported as
    # failed, the later steps are skipped and the report is still written
    import signal

    def _out_of_time(signum, frame):
        raise TimeoutError(f"the {budget.total_s:.0f} s budget of the GPU check ran out")

    watchdog = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    if watchdog:
        previous = signal.signal(signal.SIGALRM, _out_of_time)
        signal.alarm(max(1, int(budget.left() + 10)))
    try:
        env = _environment(device)
        (out / "env.txt").write_text("".join(f"{k}: {v}\n" for k, v in env.items()))
        print(env, flush=True)

        # kept back from the emulate step for the later ones (fit, GPU tests, dist, kernels)
        reserve = 45.0 if args.quick else 150.0
        rows, plans = [], {}
        if "emulate" not in skip:

            def emulate():
                got = emulate_rows(args, device, shape, hw, budget, reserve)
                rows.extend(got[0])
                plans.update(got[1])
                bad = [r["status"] for r in rows if r["status"] != "ok"]
                if not plans or bad:  # the rows that are ok still go to the fit and the tables
                    first = bad[0] if bad else "no unit started"
                    raise RuntimeError(f"{len(bad)} of {len(rows)} units failed; first: {first}")

            budget.run("emulate", emulate, 10.0 if args.quick else 30.0)
        fit_res = consts = None
        if plans and "fit" not in skip:
            got = budget.run("fit", lambda: fit(args, rows, plans, shape, hw, out, env), 10.0)
            if got is not None:
                fit_res, consts = got
        comp = comparison(rows) if plans else None
        if rows:
            df = pd.DataFrame(rows)
            for col in (*PHASE_COLUMNS, *COMM_COLUMNS):
                if col not in df:
                    df[col] = np.nan
            for k, v in env.items():
                df[k] = v
            write_csv_atomic(df, out / "emulate.csv")
        if comp is not None:
            write_csv_atomic(comp, out / "emulate_vs_sim.csv")
            print(
                "measured vs simulated, median over sequences:\n"
                + comp.round(3).to_string(index=False),
                flush=True,
            )

        if "pytest" not in skip:

            def gpu_tests():
                cmd = [sys.executable, "-m", "pytest", "-v", "-m", "gpu", "-rs"]
                if not _importable("hydra"):  # its pytest plugin is registered but cannot load
                    cmd += ["-p", "no:hydra_pytest"]
                code, text = run_bounded(cmd, min(budget.left() - 20, 150), out / "pytest_gpu.txt")
                counts = check_pytest(code, text, on_gpu=device.type == "cuda")
                print(f"pytest -m gpu: {counts}", flush=True)

            budget.run("pytest", gpu_tests, 30.0 if args.quick else 60.0)

        if "dist" not in skip:

            def dist_run():
                cmd = [
                    sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                    "-m", "flashcp.executors.dist", "--methods", ",".join(args.methods),
                    "--cp-size", "1", "--context-len", str(args.context_len),
                    "--num-sequences", "1", "--dataset", "wlb_llm", "--backend", args.backend,
                    "--num-heads", str(args.num_heads), "--num-kv-heads", str(args.num_heads),
                    "--head-dim", str(args.head_dim), "--dtype", args.dtype,
                    "--warmup", str(args.warmup), "--iters", str(args.iters),
                    "--out", str(out / "dist.csv"),
                ]  # fmt: skip
                (out / "dist.csv").unlink(missing_ok=True)
                code, _ = run_bounded(
                    cmd, budget.left() - (25 if not args.quick else 5), out / "dist_log.txt"
                )
                if code != 0 or not (out / "dist.csv").exists():
                    raise RuntimeError(f"executor=dist exited with {code}; see dist_log.txt")
                rows_d = pd.read_csv(out / "dist.csv")
                bad = rows_d[rows_d["status"] != "ok"]
                if rows_d.empty or len(bad):
                    first = bad["status"].iloc[0] if len(bad) else "no row"
                    raise RuntimeError(
                        f"executor=dist: {len(bad)} of {len(rows_d)} rows failed: {first}"
                    )
                cols = ["method", "mode", "attn_fwd_ms", "attn_bwd_ms", "total_ms"]
                print(rows_d[cols].to_string(), flush=True)

            budget.run("dist", dist_run, 45.0 if not args.quick else 10.0)

        if "kernels" not in skip:

            def kernels():
                df = pd.DataFrame(kernel_rows(args, device, shape, hw, budget))
                if df.empty:
                    raise RuntimeError("no kernel measured")
                for k, v in env.items():
                    df[k] = v
                write_csv_atomic(df, out / "kernels.csv")
                summary = df.groupby(["method", "pass"])["ratio"].median().unstack()
                print(
                    "median measured / simulated kernel time:\n" + summary.round(2).to_string(),
                    flush=True,
                )

            budget.run("kernels", kernels, 20.0 if not args.quick else 3.0)

        (out / "summary.md").write_text(_markdown(args, env, budget, rows, comp, consts, fit_res))
        print(f"total {budget.elapsed():.0f} s of {budget.total_s:.0f}; wrote {out}", flush=True)
        failed = budget.failures()
        if failed:
            print("gpu_check FAILED:\n  " + "\n  ".join(failed), file=sys.stderr, flush=True)
        return 1 if failed else 0
    finally:
        if watchdog:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)


if __name__ == "__main__":
    sys.exit(main())
