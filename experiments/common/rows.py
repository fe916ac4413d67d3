"""The rows a ``flashcp-run`` job writes: each run's identity and provenance, the columns its
rows share, and the error rows of a failed job (moved out of :mod:`experiments.run`, which calls
them; docs/design.md §7 lists the columns).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from experiments.common.callbacks import is_rank0, read_lock
from experiments.common.grid import _container, grid_runs, run_topology
from experiments.common.overrides import explicit_hardware_keys, hardware_changes
from experiments.common.overrides import json_text as _json
from flashcp.config import EXECUTOR_OPTIONS, USES_HARDWARE_PROFILE
from flashcp.executors.rows import error_status
from flashcp.results import (
    COMM_COLUMNS,
    IDENTITY_COLUMNS,
    PHASE_COLUMNS,
    config_hash,
    identity_hash,
    provenance,
    read_rows,
    typed,
    write_rows_atomic,
)

#: flashcp-run's logger: the lines of a job's log keep the command's name
log = logging.getLogger("experiments.run")

#: columns that say which invocation wrote a row (not part of the identity)
JOB_COLUMNS = ("name", "sweep_id", "job_num", "launcher", "overrides", "run_id")
#: Hydra launcher classes -> the ``launcher`` a row records (any other: its class name)
LAUNCHERS = {
    "BasicLauncher": "basic",
    "JoblibLauncher": "joblib",
    "LocalLauncher": "submitit_local",
    "SlurmLauncher": "submitit_slurm",
}
#: a job's rows, in its Hydra output folder (Parquet: a paper-scale job holds millions of rows)
ROWS_FILE = "rows.parquet"


def step_model(m: Any) -> str:
    """The model around the attention layer as identity text: ``L<layers>-h<hidden>-f<ffn>-
    v<vocab>``, or ``-`` for an attention-only model (``num_layers`` null)."""
    if m.get("num_layers") is None:
        return "-"
    return f"L{int(m.num_layers)}-h{int(m.hidden)}-f{int(m.ffn)}-v{int(m.vocab)}"


def file_sha256(path: str | Path) -> str:
    """First 12 hex digits of the sha256 of a file's bytes; ``"missing"`` if it cannot be read."""
    import hashlib

    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]
    except OSError:
        return "missing"


def _hardware_sha256(
    hw: dict[str, Any], explicit: frozenset[str] = frozenset(), cfg: Any = None
) -> tuple[str, int | None]:
    """Hash of the constants the simulator really uses (fitted values loaded by the profile's
    ``calibration`` key included, explicit ones winning; the inter-node constants,
    :data:`flashcp.sim.hardware.NETWORK_KEYS`, only when the run's CP group spans nodes), and the
    run's node count (None: a flat profile or no valid topology); of the raw mapping when it is
    not a valid profile."""
    from flashcp.sim import load_hardware

    try:
        loaded = load_hardware(hw, explicit=explicit)
    except ValueError:
        return config_hash(hw), None
    topo = None
    if cfg is not None:
        try:
            topo = run_topology(cfg, loaded)
        except ValueError:
            pass
    spans = topo is not None and topo.spans_nodes
    return config_hash(loaded.to_dict(network=spans)), (None if topo is None else topo.num_nodes)


def run_identity(
    cfg: DictConfig, code_version: str, memo: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The values of :data:`flashcp.results.IDENTITY_COLUMNS` for ``cfg`` (every value that changes
    its results) at ``code_version``. Never raises for a missing dataset file (its hash reads
    ``"missing"``), so a failed job's rows still say which run failed.

    ``memo``: a dict shared by the runs of one job, so each distinct hardware profile's file and
    fitted constants are read once."""
    ds, m, ex = cfg.dataset, cfg.model, cfg.executor
    c = int(cfg.context_len)
    uses_hw = ex.name in USES_HARDWARE_PROFILE
    from_file = ds.name == "file" and ds.path is not None  # other datasets ignore dataset.path
    hw = _container(cfg.hardware) if uses_hw else {}
    memo = {} if memo is None else memo
    key = _json([hw, int(cfg.cp_size), cfg.get("nodes"), str(cfg.get("placement", "consecutive"))])
    if key not in memo:
        explicit = explicit_hardware_keys() if uses_hw else frozenset()
        if uses_hw:
            sha, nodes = _hardware_sha256(hw, explicit, cfg)
            memo[key] = (_json(hardware_changes(hw, explicit)), sha, nodes)
        elif ex.name == "dist":  # the nodes of the launch (checked against cfg.nodes)
            from flashcp.executors.dist import launch_nodes

            try:
                memo[key] = ("{}", "-", launch_nodes())
            except ValueError:
                memo[key] = ("{}", "-", None)
        else:
            memo[key] = ("{}", "-", None)
    hw_ident = memo[key]
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
        "step_model": step_model(m),
        "executor": ex.name,
        "executor_options": _json(
            {k: _container(ex[k]) for k in EXECUTOR_OPTIONS.get(ex.name, ())}
        ),
        "hardware": hw.get("name", "unknown") if uses_hw else "measured",
        "hardware_changes": hw_ident[0],
        "hardware_sha256": hw_ident[1],
        "code_version": code_version,
        "nodes": hw_ident[2],
        "placement": str(cfg.get("placement", "consecutive")),
    }
    assert tuple(ident) == IDENTITY_COLUMNS, (
        "run_identity and IDENTITY_COLUMNS must list the same fields"
    )
    return ident


def job_info(cfg: DictConfig) -> dict[str, Any]:
    """Where this run writes and who it belongs to.

    ``launcher``: what ran the job (a row column): the sweep's Hydra launcher
    (:func:`launcher_name`), ``single_run`` (Hydra without ``-m``), ``torchrun`` (a single run
    under torchrun) or ``direct`` (called from Python).

    Under Hydra: the job's output folder (rows beside ``.hydra/`` and its log, wherever
    ``hydra.sweep.dir`` / ``hydra.run.dir`` put it), the experiment folder the callback locked,
    its ``sweep_id`` and provenance (code version; from the lock), the job number and the overrides. Called
    directly: ``${results_dir}/${name}/runs/${run_key}``, a fresh ``sweep_id``, job 0.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized():
        hc = HydraConfig.get()
        multirun = hc.mode == RunMode.MULTIRUN
        exp_dir = Path(hc.sweep.dir) if multirun else Path(cfg.results_dir) / cfg.name
        out_dir = Path(hc.runtime.output_dir)
        job_num, overrides = int(hc.job.num) if multirun else 0, " ".join(hc.overrides.task)
        launcher = launcher_name(hc) if multirun else "single_run"
        if not multirun and os.environ.get("TORCHELASTIC_RUN_ID"):
            launcher = "torchrun"
    else:
        exp_dir = Path(cfg.results_dir) / cfg.name
        out_dir, job_num, overrides = exp_dir / "runs" / cfg.run_key, 0, ""
        launcher = "direct"
    # under Hydra the callback locked exp_dir for this invocation; a direct call has no sweep
    lock = (read_lock(exp_dir) or {}) if HydraConfig.initialized() else {}
    return {
        "exp_dir": exp_dir,
        "out_dir": out_dir,
        "sweep_id": lock.get("sweep_id")
        or f"direct-{os.getpid()}-{time.strftime('%Y%m%dT%H%M%S')}",
        "provenance": lock.get("provenance"),
        "job_num": job_num,
        "launcher": launcher,
        "overrides": overrides,
    }


def launcher_name(hydra_cfg: Any) -> str:
    """What launched a sweep's jobs, from ``hydra.launcher._target_``: ``basic``, ``joblib``,
    ``submitit_local``, ``submitit_slurm`` (:data:`LAUNCHERS`), else the launcher's class name."""
    target = str((hydra_cfg.get("launcher") or {}).get("_target_", "") or "")
    cls = target.rsplit(".", 1)[-1]
    return LAUNCHERS.get(cls, cls or "unknown")


def run_constants(
    cfg: DictConfig,
    ident: dict[str, Any],
    job: dict[str, Any],
    prov: dict[str, Any],
    chash: str,
    row_columns,
) -> dict[str, Any]:
    """The columns one run's rows share (docs/design.md §7), by name in order: the job columns
    and the run identity (these win over a row column of the same name), then the provenance,
    ``config_hash`` and every phase and communication column the rows lack (NaN), none of which
    is in ``row_columns`` (the executor's columns)."""
    out: dict[str, Any] = {
        "name": cfg.name, "sweep_id": job["sweep_id"], "job_num": job["job_num"],
        "launcher": job.get("launcher", "direct"), "overrides": job["overrides"],
        "run_id": identity_hash(ident), **ident,
    }  # fmt: skip
    have = set(out) | set(row_columns)
    out.update((k, v) for k, v in prov.items() if k not in have)
    out["config_hash"] = chash
    out.update((c, np.nan) for c in (*PHASE_COLUMNS, *COMM_COLUMNS) if c not in have)
    return out


def finish_rows(
    cfg: DictConfig,
    rows: pd.DataFrame | list[dict[str, Any]],
    ident: dict[str, Any],
    job: dict[str, Any],
    prov: dict[str, Any],
    chash: str,
    check_types: bool = True,
) -> pd.DataFrame:
    """Attach the job columns, the run identity and provenance to every row of one run
    (:func:`run_constants`) and order the columns: job, identity, measurements, provenance.
    ``check_types``: give the columns their types (:func:`flashcp.results.typed`); a caller that
    concatenates several runs does it once on the result."""
    df = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows)
    n = len(df)
    data = [c for c in df.columns if c != "run_idx"]
    const = run_constants(cfg, ident, job, prov, chash, data)
    # every column at once (one DataFrame, no concatenation or insertion one column at a time):
    # the job and identity columns, the executor's (each keeping its dtype), then provenance
    rep = {k: np.repeat(np.array([v], dtype=object if isinstance(v, str) else None), n)
           for k, v in const.items()}  # fmt: skip
    front = (*JOB_COLUMNS, *ident)
    cols: dict[str, Any] = {k: rep[k] for k in front}
    cols.update((c, df[c].array) for c in data if c not in cols)
    cols.update((k, v) for k, v in rep.items() if k not in cols)
    out = pd.DataFrame(cols, index=pd.RangeIndex(n))
    return typed(out) if check_types else out  # an integer holding a fraction: raise here


def _resolved_hash(cfg: DictConfig) -> str:
    resolved = OmegaConf.to_container(cfg, resolve=True)
    for cosmetic in ("progress", "workers", "plots", "merged_rows"):  # do not change results
        resolved.pop(cosmetic, None)
    return config_hash(resolved)


def _previous(out: Path) -> tuple[set[str], str | None, bool]:
    """(run_ids, code_version, failed) of the rows already in ``out``; empty if unreadable."""
    try:
        prev = read_rows(out)
    except (OSError, ValueError, pd.errors.ParserError):
        return set(), None, True
    if "run_id" not in prev or prev.empty:
        return set(), None, True
    failed = bool(prev["seq_idx"].isna().all()) if "seq_idx" in prev else True
    return (
        set(prev["run_id"].dropna().astype(str)),
        str(prev.get("code_version", pd.Series(["?"])).iloc[0]),
        failed,
    )


def _every_row_failed(out: Path | None) -> str | None:
    """The first row's status if ``out`` (a job's ``rows.parquet``) holds rows and none is ``ok``
    (every sequence's planning or measurement failed), else None."""
    if out is None:
        return None
    import pyarrow.parquet as pq

    status = pq.read_table(out, columns=["status"]).column("status").to_pylist()
    if not status or "ok" in status:
        return None
    return str(status[0])


def _failed_runs(out: Path | None) -> str | None:
    """``k of n runs failed, e.g. <status>`` if some runs in ``out`` (a job's ``rows.parquet``)
    have no ``ok`` row (a grid's runs that cannot be made at their setting), else None."""
    if out is None:
        return None
    import pyarrow.parquet as pq

    rows = pq.read_table(out, columns=["run_id", "status"]).to_pandas()
    ok = rows["status"].eq("ok").groupby(rows["run_id"], sort=False).any()
    if ok.all():
        return None
    first = rows.loc[rows["run_id"] == ok.index[~ok.to_numpy()][0], "status"].iloc[0]
    return f"{int((~ok).sum())} of {len(ok)} runs failed (error rows), e.g. {first}"


def _error_rows(run_cfg: DictConfig, exc: BaseException) -> list[dict[str, Any]]:
    """The rows of a run that failed as a whole: one per mode, ``seq_idx`` missing,
    ``status = "error: <type>: <message>"``."""
    status = error_status(exc)
    return [{"seq_idx": None, "mode": mode, "status": status} for mode in run_cfg.modes]


def write_error_rows(cfg: DictConfig, exc: BaseException) -> Path | None:
    """Record a failed job: per run of the job (one when its grid is bad) one row per mode with
    ``seq_idx`` missing and ``status = "error: ..."``, identity and provenance as a finished run
    has them. None off rank 0 or if even that fails."""
    if not is_rank0():
        return None
    try:
        job = job_info(cfg)
        prov = job["provenance"] or provenance()  # a sweep's: one code version per sweep
        try:
            runs = grid_runs(cfg)
        except ValueError:
            runs = [cfg]
        parts = []
        for r in runs:
            ident = run_identity(r, prov["code_version"])
            parts.append(finish_rows(r, _error_rows(r, exc), ident, job, prov, _resolved_hash(r)))
        out = job["out_dir"] / ROWS_FILE
        write_rows_atomic(typed(pd.concat(parts, ignore_index=True)), out)
    except Exception:  # the job already failed; say so in its log and keep the first error
        log.exception("could not write the error rows of %s", cfg.get("run_key"))
        return None
    return out
