"""Hydra entry point of the harness: sample sequences, plan them, run the plans, write rows.

    flashcp-run                                   # one run (defaults in conf/config.yaml)
    flashcp-run -m experiment=fig5                # the paper's main comparison, simulated
    flashcp-run -m method=flashcp,llama3 dataset=pile cp_size=4,8 model=h16,h32 name=my_sweep
    torchrun --nproc-per-node 4 -m experiments.run executor=dist cp_size=4 ...   # real ranks

One run is one configuration (dataset, method and its options, cp_size, model, context_len, ...)
over ``num_sequences`` sampled sequences and every mode in ``modes``. It writes ``rows.csv`` (one
row per sequence and mode) atomically at the end into its Hydra output folder, next to
``.hydra/`` and its log (by default ``${results_dir}/${name}/runs/${run_key}``).

Identity. Every row carries the run's identity (:data:`flashcp.results.IDENTITY_COLUMNS`: every
value that changes its results, code version included) and ``run_id``, its hash, plus ``sweep_id``
and ``job_num`` of the invocation that wrote it.

Resume. A run whose ``rows.csv`` already holds rows of the same ``run_id`` is skipped. A run whose
rows came from other code (``code_version`` differs) or from a failed attempt is redone, with a
warning that names both versions.

Failures. A job that raises becomes rows with ``status = "error: ..."`` and its traceback in its log;
the sweep goes on, and :mod:`experiments.callbacks` ends it with one line counting the failed jobs
and a non-zero exit code. A sequence whose planner or simulation fails is a row of its own.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from flashcp.comm import AttnShape
from flashcp.config import (
    EXECUTOR_OPTIONS,
    OVERLONG,
    USES_HARDWARE_PROFILE,
    check_config,
    register_configs,
)
from flashcp.plan import Plan
from flashcp.registry import COMM_KIND, get_planner
from flashcp.results import (
    COMM_COLUMNS,
    IDENTITY_COLUMNS,
    PHASE_COLUMNS,
    config_hash,
    identity_hash,
    provenance,
    read_rows,
    typed,
    write_csv_atomic,
)

log = logging.getLogger(__name__)
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")

#: columns that say which invocation wrote a row (not part of the identity)
JOB_COLUMNS = ("name", "sweep_id", "job_num", "overrides", "run_id")


class ConfigError(ValueError):
    """A configuration value rejected before any work (the message names it)."""


def attn_shape(cfg: DictConfig) -> AttnShape:
    m = cfg.model
    return AttnShape(int(m.num_heads), int(m.num_kv_heads), int(m.head_dim), str(m.dtype))


def _container(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def file_sha256(path: str | Path) -> str:
    """First 12 hex digits of the sha256 of a file's bytes; ``"missing"`` if it cannot be read."""
    import hashlib

    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]
    except OSError:
        return "missing"


def hardware_changes(hw: dict[str, Any]) -> dict[str, Any]:
    """Constants of a composed hardware profile that differ from its file ``conf/hardware/<name>``
    (command-line overrides such as ``hardware.launch_us=10``); every constant if no such file."""
    from flashcp.sim.hardware import list_hardware, read_profile

    name = hw.get("name")
    base = read_profile(name) if name in list_hardware() else {}
    return {k: v for k, v in hw.items() if k != "defaults" and base.get(k) != v}


def _hardware_sha256(hw: dict[str, Any]) -> str:
    """Hash of the constants the simulator really uses (fitted values loaded by the profile's
    ``calibration`` key included); of the raw mapping when it is not a valid profile."""
    from flashcp.sim import load_hardware

    try:
        return config_hash(load_hardware(hw).to_dict())
    except ValueError:
        return config_hash(hw)


def run_identity(cfg: DictConfig, code_version: str) -> dict[str, Any]:
    """The values of :data:`flashcp.results.IDENTITY_COLUMNS` for ``cfg`` (every value that changes
    its results) at ``code_version``. Never raises for a missing dataset file (its hash reads
    ``"missing"``), so a failed job's rows still say which run failed."""
    ds, m, ex = cfg.dataset, cfg.model, cfg.executor
    c = int(cfg.context_len)
    uses_hw = ex.name in USES_HARDWARE_PROFILE
    from_file = ds.name == "file" and ds.path is not None  # other datasets ignore dataset.path
    hw = _container(cfg.hardware) if uses_hw else {}
    ident = {
        "dataset": ds.name,
        "dataset_path": str(ds.path) if from_file else "-",
        "dataset_sha256": file_sha256(ds.path) if from_file else "-",
        "weighting": ds.weighting,
        "dataset_cap": int(ds.cap) if ds.cap is not None else 4 * c,
        "overlong": ds.overlong,
        "method": cfg.method.name,
        "method_options": _json(_container(cfg.method.options)),
        "impl": str(cfg.method.get("impl", "ours")),
        "cp_size": int(cfg.cp_size),
        "context_len": c,
        "num_sequences": int(cfg.num_sequences),
        "seed": int(cfg.seed),
        "modes": ",".join(cfg.modes),
        "model": m.name,
        "num_heads": int(m.num_heads),
        "num_kv_heads": int(m.num_kv_heads),
        "head_dim": int(m.head_dim),
        "dtype": m.dtype,
        "executor": ex.name,
        "executor_options": _json(
            {k: _container(ex[k]) for k in EXECUTOR_OPTIONS.get(ex.name, ())}
        ),
        "hardware": hw.get("name", "unknown") if uses_hw else "measured",
        "hardware_changes": _json(hardware_changes(hw)) if uses_hw else "{}",
        "hardware_sha256": _hardware_sha256(hw) if uses_hw else "-",
        "code_version": code_version,
    }
    assert tuple(ident) == IDENTITY_COLUMNS, (
        "run_identity and IDENTITY_COLUMNS must list the same fields"
    )
    return ident


class OverlongDocs:
    """A length distribution whose draws longer than ``context_len`` are handled by ``policy``.

    * ``split``: a document of d > C tokens becomes ceil(d / C) consecutive documents (C tokens
      each, the rest last), as a training data loader that streams documents into sequences does.
    * ``cut``: it is cut to C tokens and the rest is discarded.
    * ``error``: :meth:`check` raises before any work when the dataset has such documents.

    :meth:`sample` has the signature of :meth:`flashcp.data.LengthDistribution.sample` and records
    the original length behind every length it returns, so :meth:`per_sequence` can count the
    documents and tokens each sequence lost or split.
    """

    def __init__(self, dist: Any, context_len: int, policy: str):
        if policy not in OVERLONG:
            raise ValueError(f"dataset.overlong = {policy!r}; choose one of {', '.join(OVERLONG)}")
        self.dist, self.context_len, self.policy = dist, int(context_len), policy
        self.name = dist.name
        self._sources: list[np.ndarray] = []  # original draw behind each returned length

    def check(self, cap: int) -> None:
        """Raise ValueError (policy ``error``) if a document can be longer than ``context_len``."""
        c = self.context_len
        share = 1.0 - float(self.dist.cdf(c))
        if self.policy == "error" and cap > c and share > 0:
            raise ValueError(
                f"dataset {self.name!r} has documents longer than context_len = {c} "
                f"({100 * share:.3g}% of its documents) and dataset.overlong = error; "
                "use dataset.overlong=split or cut, or dataset.cap"
            )

    def sample(
        self, rng: np.random.Generator, size: int, *, weighting: str, cap: int | None
    ) -> np.ndarray:
        """(m,) int64 lengths <= context_len (m >= size under ``split``)."""
        d = self.dist.sample(rng, size, weighting=weighting, cap=cap)
        c = self.context_len
        if self.policy == "split":
            pieces = -(-d // c)
            src = np.repeat(d, pieces)
            first = np.cumsum(pieces) - pieces  # index of each draw's first piece
            k = np.arange(src.size) - np.repeat(first, pieces)  # piece number inside its draw
            out = np.minimum(c, src - k * c)
        else:
            src, out = d, np.minimum(d, c)
        self._sources.append(src)
        return out

    def per_sequence(self, offsets: np.ndarray) -> list[dict[str, int]]:
        """Per sequence: ``overlong_docs`` (documents, or pieces of documents under ``split``, that
        came from a draw longer than context_len) and ``overlong_tokens_cut`` (their tokens
        discarded by ``cut``)."""
        c = self.context_len
        src = (
            np.concatenate(self._sources)[: offsets[-1]] if self._sources else np.zeros(0, np.int64)
        )
        long = src > c
        cut = np.where(long, src - c, 0) if self.policy == "cut" else np.zeros_like(src)
        n_long = np.add.reduceat(long.astype(np.int64), offsets[:-1]) if src.size else []
        n_cut = np.add.reduceat(cut, offsets[:-1]) if src.size else []
        return [
            {"overlong_docs": int(a), "overlong_tokens_cut": int(b)}
            for a, b in zip(n_long, n_cut, strict=True)
        ]


def sample(cfg: DictConfig) -> tuple[list[np.ndarray], list[dict[str, int]]]:
    """The run's sequences and their overlong-document counts (see :class:`OverlongDocs`).

    Returns:
        seqs: ``num_sequences`` arrays of (n_docs,) int64 document lengths, each summing to C.
        overlong: per sequence ``{"overlong_docs", "overlong_tokens_cut"}``.
    Raises:
        ValueError: a bad dataset, or ``dataset.overlong = error`` with documents longer than C.
    """
    from flashcp.data import load_distribution, sample_packed

    c = int(cfg.context_len)
    dist = load_distribution(cfg.dataset.name, context_len=c, path=cfg.dataset.path)
    cap = int(cfg.dataset.cap) if cfg.dataset.cap is not None else 4 * c
    over = OverlongDocs(dist, c, str(cfg.dataset.overlong))
    over.check(cap)
    doc_lens, offsets = sample_packed(
        over,
        int(cfg.num_sequences),
        c,
        seed=int(cfg.seed),
        weighting=str(cfg.dataset.weighting),
        cap=cap,
    )
    counts = over.per_sequence(offsets)
    n_long = sum(x["overlong_docs"] for x in counts)
    if n_long and over.policy == "cut":
        lost = sum(x["overlong_tokens_cut"] for x in counts)
        log.warning(
            "%s: %d documents longer than context_len = %d were cut to it (%d tokens discarded; "
            "column overlong_tokens_cut); dataset.overlong=split keeps them as consecutive documents",
            cfg.dataset.name, n_long, c, lost,
        )  # fmt: skip
    elif n_long:
        log.info(
            "%s: %d pieces of documents longer than context_len = %d", cfg.dataset.name, n_long, c
        )
    return np.split(doc_lens, offsets[1:-1]), counts


def plan_metrics(plan: Plan) -> dict[str, Any]:
    """Plan columns of a row (from :meth:`flashcp.plan.Plan.summary`).

    ``comm_tokens`` is what the method really moves: KV tokens one rank receives per pass, per K or
    V, per KV head — Eq. 4 for full all-gather and for the ring, Eq. 5 for sharding-aware
    all-gather — and ``comm_saving`` = 1 - comm_tokens / comm_tokens_full. ``comm_tokens_sharded``
    is Eq. 5 on the method's layout: what sharding-aware communication would move for it. ILP
    plans add ``ilp_solver_status``, ``ilp_gap``, ``ilp_warm_start_given`` and
    ``ilp_warm_start_accepted``.
    """
    s = plan.summary()
    keys = ("imbalance_ratio", "comm_tokens", "comm_tokens_full", "comm_saving",
            "comm_tokens_sharded", "num_split_docs", "num_pieces",
            "max_shards_per_rank")  # fmt: skip
    out = {k: s[k] for k in keys}
    if plan.method == "ilp":  # the solver's outcome (flashcp.ilp.plan_ilp's info)
        for k in ("solver_status", "gap", "warm_start_given", "warm_start_accepted"):
            out[f"ilp_{k}"] = plan.info.get(k)
    return out


def _error_status(exc: BaseException) -> str:
    return f"error: {type(exc).__name__}: {exc}"


def plan_rows(
    seqs: list[np.ndarray],
    first_idx: int,
    method: str,
    cp_size: int,
    options: dict[str, Any],
    shape: AttnShape,
    modes: list[str],
    hw: Any,
    impl: str = "ours",
) -> list[dict[str, Any]]:
    """Plan and simulate sequences ``first_idx, first_idx + 1, ...``: one row per (sequence, mode).

    ``impl`` picks the implementation (:mod:`flashcp.sim.impl`): its layout (with the padding
    ring-flash-attn needs, counted in ``pad_tokens``) and the ops it launches.
    A sequence whose planner or simulation fails becomes rows with ``status = "error: ..."``.
    """
    from flashcp.sim import simulate_many
    from flashcp.sim.impl import impl_plan

    comm_kind = COMM_KIND[method]
    rows: list[dict[str, Any]] = []
    for i, d in enumerate(seqs, start=first_idx):
        base = {"seq_idx": i, "num_docs": int(d.size), "max_doc_len": int(d.max())}
        try:
            t0 = time.perf_counter()
            plan, pad_tokens = impl_plan(method, impl, d, cp_size, **options)
            plan_ms = (time.perf_counter() - t0) * 1e3
            sims = simulate_many(plan, [shape], modes, hw, comm_kind=comm_kind, impl=impl)
        except Exception as exc:  # a failure is a row, not a crash (docs/design.md §7)
            log.warning("sequence %d failed: %s", i, exc)
            rows.extend({**base, "mode": mode, "status": _error_status(exc)} for mode in modes)
            continue
        metrics = {"plan_status": plan.status, "plan_ms": plan_ms, "pad_tokens": pad_tokens}
        metrics.update(plan_metrics(plan))
        for mode, sim in zip(modes, sims, strict=True):
            rows.append({**base, **metrics, "mode": mode, "status": "ok", **sim})
    return rows


def _plan_rows_star(args: tuple) -> list[dict[str, Any]]:
    return plan_rows(*args)


def run_sim(cfg: DictConfig, seqs: list[np.ndarray]) -> list[dict[str, Any]]:
    """Plan + simulate every sequence, in ``cfg.workers`` processes, with a progress bar."""
    from tqdm import tqdm

    from flashcp.sim import load_hardware

    hw = load_hardware(_container(cfg.hardware))
    shape = attn_shape(cfg)
    modes = list(cfg.modes)
    options = _container(cfg.method.options)
    impl = str(cfg.method.get("impl", "ours"))
    chunk = 64
    jobs = [
        (seqs[i : i + chunk], i, cfg.method.name, int(cfg.cp_size), options, shape, modes, hw, impl)
        for i in range(0, len(seqs), chunk)
    ]
    rows: list[dict[str, Any]] = []
    bar = tqdm(
        total=len(seqs),
        desc=cfg.run_key,
        unit="seq",
        disable=not (cfg.progress and sys.stderr.isatty()),
        leave=False,
    )
    with bar:
        if int(cfg.workers) == 1:
            results = map(_plan_rows_star, jobs)
        else:
            pool = ProcessPoolExecutor(max_workers=int(cfg.workers))
            results = pool.map(_plan_rows_star, jobs)
        for job, part in zip(jobs, results, strict=True):
            rows.extend(part)
            bar.update(len(job[0]))
        if int(cfg.workers) > 1:
            pool.shutdown()
    return rows


def run_dist(cfg: DictConfig, seqs: list[np.ndarray]) -> list[dict[str, Any]] | None:
    """Run every plan for real on the torchrun process group; rows on rank 0, None elsewhere.

    Every rank plans every sequence (a pure function, so identical everywhere) and the ranks agree
    on whether planning succeeded (:func:`flashcp.executors.dist.agree_errors`): a sequence whose
    planner fails on any rank is a row with ``status = "error: ..."`` on all of them. An exception
    while measuring (inside collectives) cannot be recovered: the rank that raised prints it and
    aborts the group, so every rank stops within seconds
    (:func:`flashcp.executors.dist.abort_group_on_error`).
    """
    import torch
    import torch.distributed as dist

    from flashcp.executors.dist import (
        abort_group_on_error,
        agree_errors,
        init_from_env,
        measure_step,
    )

    group = init_from_env(float(cfg.executor.timeout_s))
    world = dist.get_world_size()
    if world != int(cfg.cp_size):
        raise ValueError(
            f"torchrun started {world} ranks but cp_size = {cfg.cp_size}; they must match"
        )
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    planner = get_planner(cfg.method.name)
    options = _container(cfg.method.options)
    shape = attn_shape(cfg)
    rows: list[dict[str, Any]] = []
    for i, d in enumerate(seqs):
        base = {"seq_idx": i, "num_docs": int(d.size), "max_doc_len": int(d.max())}
        try:
            plan, err = planner(d, int(cfg.cp_size), **options), None
        except Exception as exc:
            plan, err = None, _error_status(exc)
        status = agree_errors(err, group)
        if status is not None:
            log.warning("sequence %d failed: %s", i, status)
            rows.extend({**base, "mode": mode, "status": status} for mode in cfg.modes)
            continue
        metrics = {"plan_status": plan.status, "pad_tokens": 0, **plan_metrics(plan)}
        for mode in cfg.modes:
            with abort_group_on_error(group, f"sequence {i}, mode {mode}"):
                res = measure_step(
                    plan, shape, mode, group=group, device=device, backend=cfg.executor.backend,
                    warmup=int(cfg.executor.warmup), iters=int(cfg.executor.iters), seed=int(cfg.seed) + i,
                )  # fmt: skip
            rows.append({**base, **metrics, "mode": mode, "status": "ok", **res})
    return rows if dist.get_rank() == 0 else None


def run_emulate(cfg: DictConfig, seqs: list[np.ndarray]) -> list[dict[str, Any]]:
    """Replay every plan's ranks on one device (``executor=emulate``,
    :mod:`flashcp.executors.emulate`); communication priced by ``cfg.hardware``. One process, so
    a sequence whose planning or replay fails is a row with ``status = "error: ..."``."""
    import torch

    from flashcp.executors.emulate import emulate_step
    from flashcp.sim import load_hardware

    hw = load_hardware(_container(cfg.hardware))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    planner = get_planner(cfg.method.name)
    options = _container(cfg.method.options)
    ex = cfg.executor
    ranks = None if ex.ranks is None else [int(r) for r in ex.ranks]
    rows: list[dict[str, Any]] = []
    for i, d in enumerate(seqs):
        base = {"seq_idx": i, "num_docs": int(d.size), "max_doc_len": int(d.max())}
        try:
            t0 = time.perf_counter()
            plan = planner(d, int(cfg.cp_size), **options)
            plan_ms = (time.perf_counter() - t0) * 1e3
            metrics = {"plan_status": plan.status, "plan_ms": plan_ms, "pad_tokens": 0}
            metrics.update(plan_metrics(plan))
            res = [
                emulate_step(
                    plan, attn_shape(cfg), mode, hw, device=device, backend=ex.backend,
                    warmup=int(ex.warmup), iters=int(ex.iters), seed=int(cfg.seed) + i,
                    ranks=ranks, nccl_traffic=bool(ex.nccl_traffic), timeout_s=float(ex.timeout_s),
                )
                for mode in cfg.modes
            ]  # fmt: skip
        except Exception as exc:  # a failure is a row, not a crash (docs/design.md §7)
            log.warning("sequence %d failed: %s", i, exc)
            rows.extend({**base, "mode": m, "status": _error_status(exc)} for m in cfg.modes)
            continue
        for mode, r in zip(cfg.modes, res, strict=True):
            rows.append({**base, **metrics, "mode": mode, "status": "ok", **r})
    return rows


def job_info(cfg: DictConfig) -> dict[str, Any]:
    """Where this run writes and who it belongs to.

    Under Hydra: the job's output folder (rows beside ``.hydra/`` and its log, wherever
    ``hydra.sweep.dir`` / ``hydra.run.dir`` put it), the experiment folder the callback locked,
    its ``sweep_id`` and provenance (code version; from the lock), the job number and the overrides. Called
    directly: ``${results_dir}/${name}/runs/${run_key}``, a fresh ``sweep_id``, job 0.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from experiments.callbacks import read_lock

    if HydraConfig.initialized():
        hc = HydraConfig.get()
        multirun = hc.mode == RunMode.MULTIRUN
        exp_dir = Path(hc.sweep.dir) if multirun else Path(cfg.results_dir) / cfg.name
        out_dir = Path(hc.runtime.output_dir)
        job_num, overrides = int(hc.job.num) if multirun else 0, " ".join(hc.overrides.task)
    else:
        exp_dir = Path(cfg.results_dir) / cfg.name
        out_dir, job_num, overrides = exp_dir / "runs" / cfg.run_key, 0, ""
    # under Hydra the callback locked exp_dir for this invocation; a direct call has no sweep
    lock = (read_lock(exp_dir) or {}) if HydraConfig.initialized() else {}
    return {
        "exp_dir": exp_dir,
        "out_dir": out_dir,
        "sweep_id": lock.get("sweep_id")
        or f"direct-{os.getpid()}-{time.strftime('%Y%m%dT%H%M%S')}",
        "provenance": lock.get("provenance"),
        "job_num": job_num,
        "overrides": overrides,
    }


def finish_rows(
    cfg: DictConfig,
    rows: list[dict[str, Any]],
    ident: dict[str, Any],
    job: dict[str, Any],
    prov: dict[str, Any],
    chash: str,
) -> pd.DataFrame:
    """Attach the job columns, the run identity and provenance to every row
    (docs/design.md §7) and order the columns: job, identity, measurements, provenance."""
    front = {
        "name": cfg.name, "sweep_id": job["sweep_id"], "job_num": job["job_num"],
        "overrides": job["overrides"], "run_id": identity_hash(ident), **ident,
    }  # fmt: skip
    df = pd.DataFrame(rows)
    for k, v in reversed(list(front.items())):
        df.insert(0, k, v)
    for k, v in prov.items():
        if k not in df:
            df[k] = v
    df["config_hash"] = chash
    for col in (*PHASE_COLUMNS, *COMM_COLUMNS):
        if col not in df:
            df[col] = np.nan
    return typed(df)  # an integer column holding a fraction is a bug: raise here


def _resolved_hash(cfg: DictConfig) -> str:
    resolved = OmegaConf.to_container(cfg, resolve=True)
    for cosmetic in ("progress", "workers", "plots"):  # do not change results
        resolved.pop(cosmetic, None)
    return config_hash(resolved)


def _previous(out: Path) -> tuple[str | None, str | None, bool]:
    """(run_id, code_version, failed) of the rows already in ``out``; Nones if unreadable."""
    try:
        prev = read_rows(out)
    except (OSError, ValueError, pd.errors.ParserError):
        return None, None, True
    if "run_id" not in prev or prev.empty:
        return None, None, True
    failed = bool(prev["seq_idx"].isna().all()) if "seq_idx" in prev else True
    return (
        str(prev["run_id"].iloc[0]),
        str(prev.get("code_version", pd.Series(["?"])).iloc[0]),
        failed,
    )


def run(cfg: DictConfig) -> Path | None:
    """Execute one run described by ``cfg``; return the path of its rows.csv (None off rank 0).

    Raises:
        ConfigError: a configuration value is bad (before any work).
        Exception: whatever the run raised; :func:`main` turns it into error rows.
    """
    try:
        check_config(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.task == "kernel_efficiency":
        from experiments.fig3 import run_fig3

        out = run_fig3(cfg)
        log.info("kernel efficiency -> %s and fig3.png", out)
        return out
    if cfg.task in ("calibration", "sensitivity"):
        from experiments.calibration import run_calibration
        from experiments.sensitivity import run_sensitivity

        out_dir = Path(cfg.results_dir) / cfg.name
        if cfg.task == "calibration":
            run_calibration(out_dir)
        else:
            run_sensitivity(cfg, out_dir)
        log.info("%s -> %s", cfg.task, out_dir)
        return out_dir
    if cfg.task == "table2":
        from experiments.table2 import run_table2

        out_dir = Path(cfg.results_dir) / cfg.name
        run_table2(
            out_dir=str(out_dir), seed=int(cfg.seed), dataset=cfg.dataset.name,
            cp_size=int(cfg.cp_size), context_len=int(cfg.context_len),
            **OmegaConf.to_container(cfg.table2, resolve=True),
        )  # fmt: skip
        log.info("Table 2 -> %s/table2.{csv,md,tex}", out_dir)
        return out_dir / "table2.csv"

    job = job_info(cfg)
    prov = job["provenance"] or provenance()  # a sweep's: one code version per sweep
    ident = run_identity(cfg, prov["code_version"])
    run_id = identity_hash(ident)
    out = job["out_dir"] / "rows.csv"
    if out.exists():
        prev_id, prev_code, failed = _previous(out)
        if prev_id == run_id and not failed:
            log.info("%s: already done (run_id %s), skipping", cfg.run_key, run_id)
            return out
        if failed:
            log.info("%s: the previous attempt failed; running again", cfg.run_key)
        elif prev_code != ident["code_version"]:
            log.warning(
                "%s: rows.csv was computed with code %s, this is %s: redoing the run",
                cfg.run_key, prev_code, ident["code_version"],
            )  # fmt: skip
        else:
            log.warning(
                "%s: rows.csv holds run %s, this is %s: redoing the run",
                cfg.run_key,
                prev_id,
                run_id,
            )
    t0 = time.perf_counter()
    seqs, overlong = sample(cfg)
    runners = {"sim": run_sim, "dist": run_dist, "emulate": run_emulate}
    rows = runners[cfg.executor.name](cfg, seqs)
    if rows is None:
        return None
    for r in rows:
        r.update(overlong[r["seq_idx"]])
    df = finish_rows(cfg, rows, ident, job, prov, _resolved_hash(cfg))
    write_csv_atomic(df, out)
    ok = (df["status"] == "ok").sum()
    log.info(
        "%s: %d rows (%d ok) in %.1f s -> %s",
        cfg.run_key,
        len(df),
        ok,
        time.perf_counter() - t0,
        out,
    )
    return out


def write_error_rows(cfg: DictConfig, exc: BaseException) -> Path | None:
    """Record a failed run: one row per mode with ``seq_idx`` missing and ``status = "error: ..."``,
    identity and provenance as a finished run has them. None off rank 0 or if even that fails."""
    from experiments.callbacks import is_rank0

    if not is_rank0():
        return None
    try:
        job = job_info(cfg)
        prov = job["provenance"] or provenance()  # a sweep's: one code version per sweep
        ident = run_identity(cfg, prov["code_version"])
        rows = [{"seq_idx": None, "mode": mode, "status": _error_status(exc)} for mode in cfg.modes]
        out = job["out_dir"] / "rows.csv"
        write_csv_atomic(finish_rows(cfg, rows, ident, job, prov, _resolved_hash(cfg)), out)
    except Exception:  # the job already failed; say so in its log and keep the first error
        log.exception("could not write the error rows of %s", cfg.get("run_key"))
        return None
    return out


register_configs()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> dict[str, Any]:
    """Console entry point ``flashcp-run`` (Hydra parses the command line).

    Returns (to :class:`experiments.callbacks.AggregateResults`) ``{"rows": path or None,
    "error": message or None, "exit_code": 0 | 1 | 2}``. A failing job writes error rows and its
    traceback to its log (a bad configuration value: one line, exit code 2) and returns, so a sweep
    goes on; the callback prints one line and sets the exit code. Under ``executor=dist`` a failure
    ends the process at once (the process group cannot be reused).
    """
    try:
        out = run(cfg)
        return {"rows": str(out) if out is not None else None, "error": None, "exit_code": 0}
    except Exception as exc:
        if isinstance(exc, ConfigError):
            log.error("%s: bad configuration: %s", cfg.get("run_key", "run"), exc)
        else:
            log.exception("%s failed", cfg.get("run_key", "run"))
        out = write_error_rows(cfg, exc)
        code = 2 if isinstance(exc, ValueError) else 1
        if cfg.executor.name == "dist" and "torch.distributed" in sys.modules:
            print(f"flashcp-run: error: {type(exc).__name__}: {exc}", file=sys.stderr)
            raise SystemExit(code) from None
        msg = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
        return {"rows": str(out) if out is not None else None, "error": msg, "exit_code": code}


if __name__ == "__main__":
    main()
