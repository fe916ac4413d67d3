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
2. ``emulate.csv``: ``execute("emulate")`` (:mod:`flashcp.executors.emulate`): every rank of
   CP 8 replayed on this one device, for ``--sequences`` sampled 128K sequences per dataset
   (WLB-LLM, Pile, RedPajama) and all five methods, training step (forward + backward). The op
   code is ``executor=dist``'s; communication is priced by the hardware profile. A row is the
   executor's row (the columns every executor writes, :mod:`flashcp.executors.rows`) with the
   unit's dataset, shape, backend, ranks and wall time (``unit_s``); next to each measured phase
   (``attn_fwd_ms``, ``attn_bwd_ms``, ``others_ms``, ...) ``execute("sim")``'s for the same run
   and sequence (``sim_*``, profile ``--hardware``). Work is taken round-robin (sequence 0 of
   every dataset and method first), so a run cut short by the budget still covers every method.
3. ``calibration_fit.csv``, ``fitted_constants.csv``: the simulator's free kernel and copy
   constants fitted to those measurements by :func:`flashcp.sim.calibration.fit_replays` (one
   target per sequence, method and phase: measured = the replay, predict = the simulator on the
   same plan and phase under the candidate profile); ``fit_*`` columns in ``emulate.csv``
   (``execute("sim")`` under the fitted profile); ``emulate_vs_sim.csv``: medians per method and
   phase (:func:`flashcp.sim.calibration.measured_vs_model`).
   Every rank must be replayed (``--ranks all``): the simulator's phases are the slowest rank's.
4. ``pytest_gpu.txt``: the GPU-marked tests (``pytest -m gpu``, among them ``executor=emulate``
   on CUDA against the float64 reference). With ``--quick`` on a CPU they are collected and skip;
   on a GPU at least one must pass.
5. ``dist.csv``: ``execute("dist")`` through ``torchrun --nproc-per-node 1 -m flashcp.executors.dist``
   (its plain entry, no Hydra) for every method.
6. ``kernels.csv``: one varlen kernel call per rank for every method's all-gather layout, forward
   and backward, measured vs :func:`flashcp.sim.attention_kernel_ms`
   (:func:`flashcp.executors.kernels.measure_kernels`).
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
from dataclasses import replace  # noqa: E402

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from flashcp.comm import AttnShape  # noqa: E402
from flashcp.data import load_distribution, sample_sequences  # noqa: E402
from flashcp.executors import RunSpec, execute  # noqa: E402
from flashcp.executors.kernels import measure_kernels  # noqa: E402
from flashcp.executors.rows import ILP_COLUMNS  # noqa: E402
from flashcp.ops.backends import get_backend  # noqa: E402
from flashcp.registry import method_names  # noqa: E402
from flashcp.resources import source_root  # noqa: E402
from flashcp.results import PHASE_COLUMNS, markdown_table, provenance, write_csv_atomic  # noqa: E402
from flashcp.sim import HardwareProfile, load_hardware  # noqa: E402
from flashcp.sim.calibration import fit_replays, free_constants, measured_vs_model  # noqa: E402

METHODS = method_names(paper=True)
DATASETS = ("wlb_llm", "pile", "redpajama")


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


def _emulate_run(args, method: str, shape: AttnShape, hw, backend: str, device, seq_idx: int):
    """The :class:`RunSpec` of one replayed unit: CP ``args.cp_size``, a training step, every
    rank of ``args.ranks`` replayed on ``device``, seeded as ``executor=dist`` seeds sequence
    ``seq_idx`` (``args.seed + seq_idx``)."""
    ex = {"backend": backend, "warmup": args.warmup, "iters": args.iters, "ranks": args.ranks,
          "nccl_traffic": args.nccl_traffic, "device": str(device)}  # fmt: skip
    return RunSpec(method, args.cp_size, shape, ("train",), hardware=hw,
                   seed=args.seed + seq_idx, executor=ex)  # fmt: skip


def _one_row(rows: pd.DataFrame) -> dict:
    """The executor's one row of a unit, without the job's run index and the ILP's columns."""
    (row,) = rows.drop(columns=["run_idx", *ILP_COLUMNS]).to_dict("records")
    return {k: (None if v is pd.NA else v) for k, v in row.items()}


def emulate_rows(
    args, device, shape: AttnShape, hw: HardwareProfile, budget: Budget, reserve_s: float
):
    """``execute("emulate")`` on CP ``args.cp_size`` for every (sequence, dataset, method),
    round-robin, while the budget (less ``reserve_s`` for later steps) allows another unit of the
    slowest size seen; beside each row the simulator's prediction for the same run and sequence
    (``execute("sim")``: columns ``sim_<phase>``).

    Returns:
        ``(rows, replays)``: one dict per unit (the executor's row with the unit's ``dataset``,
        ``seq_idx``, shape, ``backend``, ``ranks``, ``hardware`` and ``unit_s``), and the
        ``(name, run, doc_lens, row)`` of the units that succeeded, for the fit
        (:func:`flashcp.sim.calibration.fit_replays`).
    """
    seqs = sampled_sequences(args)
    backend = get_backend(
        args.backend, device, dtype=getattr(torch, shape.dtype), head_dim=shape.head_dim
    ).name
    units = [
        (i, ds, m) for i in range(args.sequences) for ds in args.datasets for m in args.methods
    ]
    rows, replays, slowest = [], [], 0.0
    for n_done, (i, ds, method) in enumerate(units):
        if budget.left() - reserve_s < 1.3 * slowest:
            print(
                f"emulate: budget reached, {len(units) - n_done} of {len(units)} units not run",
                flush=True,
            )
            break
        lens = seqs[ds][i]
        run = _emulate_run(args, method, shape, hw, backend, device, i)
        ident = {
            "dataset": ds, "method": method, "cp_size": args.cp_size,
            "context_len": args.context_len, "num_heads": shape.num_heads,
            "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim, "dtype": shape.dtype,
            "backend": backend, "ranks": "all" if args.ranks is None else " ".join(map(str, args.ranks)),
            "hardware": hw.name,
        }  # fmt: skip
        t0 = time.monotonic()
        try:
            row = _one_row(execute("emulate", [run], [lens]))
            sim = _one_row(execute("sim", [replace(run, executor={})], [lens]))
            if row["status"] == "ok" and sim["status"] != "ok":
                row["status"] = f"sim {sim['status']}"
        except Exception as exc:  # an OOM or a failure is a row, not a crash
            row, sim = {"status": f"error: {type(exc).__name__}: {exc}"}, {}
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        dt = time.monotonic() - t0
        slowest = max(slowest, dt)
        out = {**ident, **row, "seq_idx": i, "unit_s": dt}
        out.update({f"sim_{k}": sim[k] for k in PHASE_COLUMNS if k in sim})
        rows.append(out)
        if out["status"] == "ok":
            replays.append((f"emulate/{ds}/seq{i}/{method}", run, lens, out))
            print(
                f"emulate {ds} seq{i} {method:8s} {dt:6.1f} s  fwd {out['attn_fwd_ms']:9.3f} ms "
                f"(sim {out['sim_attn_fwd_ms']:9.3f})  bwd {out['attn_bwd_ms']:9.3f} ms "
                f"(sim {out['sim_attn_bwd_ms']:9.3f})  others {out['others_ms']:8.3f} ms "
                f"(sim {out['sim_others_ms']:8.3f})",
                flush=True,
            )
        else:
            print(f"emulate {ds} seq{i} {method}: {out['status']}", flush=True)
    return rows, replays


# ---- step 3: calibration fit -----------------------------------------------------------------------


def fit(args, rows, replays, hw, out: Path, env: dict):
    """Fit the free constants to the replayed phases (:func:`flashcp.sim.calibration.fit_replays`);
    write the fit table and constants; add ``fit_<phase>`` columns (``execute("sim")`` under the
    fitted profile) to the replayed units' rows. Returns ``(result, constants)``.

    Raises:
        RuntimeError: a subset of ranks replayed.
        ValueError: no replayed phase to fit.
    """
    if args.ranks is not None:
        raise RuntimeError(
            "the fit needs every rank replayed (--ranks all): the simulator's phases are the slowest rank's"
        )
    free = free_constants(args.free, hw)
    source = f"measured: experiments/gpu_check.py executor=emulate on {env['gpu']}, backend {rows[0]['backend']}"
    res, consts, fitted = fit_replays(replays, hw, free, source=source)
    write_csv_atomic(res.table, out / "calibration_fit.csv")
    write_csv_atomic(consts, out / "fitted_constants.csv")
    for _, run, lens, row in replays:
        sim = _one_row(execute("sim", [replace(run, hardware=fitted, executor={})], [lens]))
        row.update({f"fit_{k}": sim[k] for k in PHASE_COLUMNS})
    print(f"fit: success={res.success} ({res.message}); {len(res.table)} targets", flush=True)
    print(consts.to_string(index=False), flush=True)
    return res, consts


# ---- step 6: kernels ---------------------------------------------------------------------------------


def kernel_rows(
    args, device: torch.device, shape: AttnShape, hw: HardwareProfile, budget: Budget
) -> list[dict]:
    """Measured vs simulated kernel time per (case, method, rank, pass), while the budget lasts
    (:func:`flashcp.executors.kernels.measure_kernels`): one 128K document, 16 of 8K, and every
    sampled sequence."""
    c = args.context_len
    cases = {"1x128K": np.array([c]), "16x8K": np.full(16, c // 16)}
    for ds, seqs in sampled_sequences(args).items():
        cases.update({f"{ds}#{i}": d for i, d in enumerate(seqs)})

    def stop(slowest_s: float) -> bool:
        if budget.left() - 5 < 1.3 * slowest_s:
            print("kernels: budget reached", flush=True)
            return True
        return False

    return measure_kernels(
        cases, args.methods, args.cp_size, shape, hw, device=device, backend=args.backend,
        warmup=args.warmup, iters=args.iters, stop=stop,
    )  # fmt: skip


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


def default_out(quick: bool, device: torch.device) -> Path:
    """The output folder without ``--out``, relative to the working directory (the checkout's
    root): ``results/gpu_check`` (the committed reference) for the real run on CUDA,
    ``outputs/gpu_check_quick`` with ``--quick`` and ``outputs/gpu_check`` for a full run on a CPU,
    whose numbers are not the GPU's (``outputs/`` is git-ignored: the tree stays clean)."""
    if device.type == "cuda" and not quick:
        return Path("results") / "gpu_check"
    return Path("outputs") / ("gpu_check_quick" if quick else "gpu_check")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out",
        default=None,
        help="output folder (default results/gpu_check on a GPU; outputs/gpu_check_quick with "
        "--quick, outputs/gpu_check on a CPU)",
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
        free_constants(args.free, hw)  # bad names fail now, not after the measurements
    out = Path(args.out or default_out(args.quick, device))
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
        rows, replays = [], []
        if "emulate" not in skip:

            def emulate():
                got = emulate_rows(args, device, shape, hw, budget, reserve)
                rows.extend(got[0])
                replays.extend(got[1])
                bad = [r["status"] for r in rows if r["status"] != "ok"]
                if bad:  # the rows that are ok still go to the fit and the tables
                    raise RuntimeError(f"{len(bad)} of {len(rows)} units failed; first: {bad[0]}")
                if not replays:
                    raise RuntimeError(f"no unit replayed ({len(rows)} rows)")

            budget.run("emulate", emulate, 10.0 if args.quick else 30.0)
        fit_res = consts = None
        if replays and "fit" not in skip:
            got = budget.run("fit", lambda: fit(args, rows, replays, hw, out, env), 10.0)
            if got is not None:
                fit_res, consts = got
        comp = measured_vs_model(pd.DataFrame(rows), PHASE_COLUMNS) if replays else None
        if rows:
            df = pd.DataFrame(rows)
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
                if rows_d.empty:
                    raise RuntimeError("executor=dist wrote no row; see dist_log.txt")
                if len(bad):
                    raise RuntimeError(
                        f"executor=dist: {len(bad)} of {len(rows_d)} rows failed: "
                        f"{bad['status'].iloc[0]}"
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
