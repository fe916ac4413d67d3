"""Hydra entry point of the harness: compose the config, sample sequences, call an executor,
write rows.

    flashcp-run                                   # one run (defaults in conf/config.yaml)
    flashcp-run -m experiment=fig5                # the paper's main comparison, simulated
    flashcp-run -m method=flashcp,llama3 dataset=pile cp_size=4,8 model=h16,h32 name=my_sweep
    flashcp-run grid.model=[h16,h32] grid.cp_size=[4,8]   # 4 runs in one job, plans shared
    torchrun --nproc-per-node 4 -m experiments.run executor=dist cp_size=4 ...   # real ranks

The experiments that write their own tables have their own modules, commands and configs
(:mod:`experiments.common`): ``flashcp-table2``, ``flashcp-calibration``, ``flashcp-sensitivity``,
``flashcp-fig3``.

One run is one configuration (dataset, method and its options, cp_size, model, hardware,
context_len, ...) over ``num_sequences`` sampled sequences and every mode in ``modes``. One Hydra
job executes one run, or under ``executor=sim`` the runs of its ``grid``
(:func:`experiments.common.grid.grid_runs`): they share the job's sampled sequences, each
(sequence, method, cp_size) is planned once and priced for every model and hardware profile. The
executor (:func:`flashcp.executors.execute`: ``sim``, ``dist`` or ``emulate``) turns plans into
rows; this module adds identity and provenance (:mod:`experiments.common.rows`) and writes the
job's rows (one row per run, sequence and mode) atomically as ``rows.parquet`` into its Hydra
output folder, next to ``.hydra/`` and its log (by default
``${results_dir}/${name}/runs/${run_key}``). The log line of a job gives its time in sampling,
planning, pricing and writing.

Identity. Every row carries the run's identity (:data:`flashcp.results.IDENTITY_COLUMNS`: every
value that changes its results, code version included) and ``run_id``, its hash, plus ``sweep_id``
and ``job_num`` of the invocation that wrote it.

Resume. A job whose ``rows.parquet`` already holds rows of exactly its runs (the same ``run_id``
values) is skipped. A job whose rows came from other code (``code_version`` differs) or from a failed attempt is redone, with a
warning that names both versions.

Failures. A bad value is refused before anything is written
(:func:`experiments.common.grid.checked_grid`, registered as the launch check: every run's config,
its dataset and hardware profile). A run of a grid that
cannot be made at its setting becomes error rows while the others run, and the job exits 1 with
one line counting the failed runs. A job that raises becomes
rows with ``status = "error: ..."`` and its traceback in its log;
the sweep goes on, and :mod:`experiments.common.callbacks` ends it with one line counting the failed jobs
and a non-zero exit code. A sequence whose planner or simulation fails is a row of its own.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import pandas as pd
from omegaconf import DictConfig

from experiments.common.entry import CONF_DIR, log_job_error
from experiments.common.grid import (
    ConfigError,
    _checked_runs,
    _container,
    _shared_values,
    checked_grid,
    run_spec,
)
from experiments.common.launch import PROG, launch, register_value_check
from experiments.common.overrides import explicit_hardware_keys
from experiments.common.overrides import json_text as _json
from experiments.common.rows import (
    ROWS_FILE,
    _error_rows,
    _every_row_failed,
    _failed_runs,
    _previous,
    _resolved_hash,
    finish_rows,
    job_info,
    run_constants,
    run_identity,
    write_error_rows,
)
from flashcp.config import USES_HARDWARE_PROFILE, register_configs
from flashcp.executors import execute
from flashcp.results import identity_hash, provenance, runs_table, typed, write_rows_atomic

log = logging.getLogger(__name__)


def sample(cfg: DictConfig) -> tuple[list[np.ndarray], list[dict[str, int]]]:
    """The run's sequences and their overlong-document counts
    (:func:`flashcp.data.sample_dataset`, which Table 2 and the sensitivity study also use).

    Returns:
        seqs: ``num_sequences`` arrays of (n_docs,) int64 document lengths, each summing to C.
        overlong: per sequence ``{"overlong_docs", "overlong_tokens_cut"}``.
    Raises:
        ValueError: a bad dataset, or ``dataset.overlong = error`` with documents longer than C.
    """
    from flashcp.data import overlong_note, sample_dataset

    c = int(cfg.context_len)
    ds = cfg.dataset
    seqs, counts = sample_dataset(
        str(ds.name), int(cfg.num_sequences), c, seed=int(cfg.seed), weighting=str(ds.weighting),
        cap=None if ds.cap is None else int(ds.cap), overlong=str(ds.overlong), path=ds.path,
    )  # fmt: skip
    note = overlong_note(counts, str(ds.overlong), c, str(ds.name))  # the line every command logs
    if note:
        (log.warning if ds.overlong == "cut" else log.info)(note)
    return seqs, counts


def execute_runs(cfg: DictConfig, runs: list[DictConfig], seqs: list[np.ndarray]):
    """Call the configured executor (:func:`flashcp.executors.execute`) on the job's runs,
    loading each distinct hardware profile once."""
    hws: dict[str, Any] = {}
    specs = []
    explicit = explicit_hardware_keys()
    for r in runs:
        hw = None
        if r.executor.name in USES_HARDWARE_PROFILE:
            from flashcp.sim import load_hardware

            hw_dict = _container(r.hardware)
            key = _json(hw_dict)
            if key not in hws:
                hws[key] = load_hardware(hw_dict, explicit=explicit)
            hw = hws[key]
        specs.append(run_spec(r, hw))
    kwargs: dict[str, Any] = {}
    show = cfg.progress and sys.stderr.isatty()
    if cfg.executor.name == "sim":
        kwargs = {"workers": int(cfg.workers), "progress": str(cfg.run_key) if show else None}
    elif cfg.executor.name == "emulate":
        kwargs = {"progress": str(cfg.run_key) if show else None}
    return execute(cfg.executor.name, specs, seqs, **kwargs)


def run(cfg: DictConfig) -> Path | None:
    """Execute one job described by ``cfg`` (one run, or the runs of ``cfg.grid``); return the
    path of its rows file (None off rank 0).

    Raises:
        ConfigError: a configuration value is bad (before any work).
        Exception: whatever the run raised; :func:`main` turns it into error rows.
    """
    runs, inapplicable = checked_grid(cfg)

    job = job_info(cfg)
    prov = job["provenance"] or provenance()  # a sweep's: one code version per sweep
    memo: dict[str, Any] = {}
    idents = [run_identity(r, prov["code_version"], memo) for r in runs]
    run_ids = [identity_hash(i) for i in idents]
    if len(set(run_ids)) < len(run_ids):
        raise ConfigError("grid lists the same run twice (a repeated value)")
    out = job["out_dir"] / ROWS_FILE
    if out.exists():
        prev_ids, prev_code, failed = _previous(out)
        if prev_ids == set(run_ids) and not failed:
            log.info("%s: already done (run_id %s), skipping", cfg.run_key, ", ".join(run_ids))
            return out
        if failed:
            log.info("%s: the previous attempt failed; running again", cfg.run_key)
        elif prev_code != idents[0]["code_version"]:
            log.warning(
                "%s: %s was computed with code %s, this is %s: redoing the run",
                cfg.run_key, out.name, prev_code, idents[0]["code_version"],
            )  # fmt: skip
        else:
            log.warning(
                "%s: %s holds runs %s, this is %s: redoing the run",
                cfg.run_key, out.name, ", ".join(sorted(prev_ids)), ", ".join(run_ids),
            )  # fmt: skip
    if inapplicable:
        reasons = "; ".join(inapplicable.values())
        log.warning(
            "%s: %d of %d runs of the grid cannot be made and are error rows (the others run): %s",
            cfg.run_key, len(inapplicable), len(runs), reasons,
        )  # fmt: skip
    made = [i for i in range(len(runs)) if i not in inapplicable]
    t0 = time.perf_counter()
    seqs, overlong = sample(cfg)
    t1 = time.perf_counter()
    rows = execute_runs(cfg, [runs[i] for i in made], seqs)
    if rows is None:
        return None
    t2 = time.perf_counter()
    ov = pd.DataFrame(overlong)
    idx = rows["seq_idx"].to_numpy(dtype=np.int64)
    for col in ov:
        rows[col] = ov[col].to_numpy()[idx]
    # rows sorted by run (the executor's order); each run's shared columns once, expanded in Arrow
    data = [c for c in rows.columns if c != "run_idx"]
    run_of_row = rows["run_idx"].to_numpy(dtype=np.int64)
    if len(np.unique(run_of_row)) != len(made):
        raise RuntimeError(f"the executor returned rows of {len(np.unique(run_of_row))} of "
                           f"{len(made)} runs")  # fmt: skip
    per_run = pd.DataFrame(
        [run_constants(runs[i], idents[i], job, prov, _resolved_hash(runs[i]), data) for i in made]
    )
    table = runs_table(rows[data], per_run, run_of_row)
    if inapplicable:  # one error row per mode of each run that cannot be made, after the others
        import pyarrow as pa

        from flashcp.results import arrow_row_schema, conform_rows

        parts = [
            finish_rows(runs[i], _error_rows(runs[i], ConfigError(why)), idents[i], job, prov,
                        _resolved_hash(runs[i]), check_types=False)
            for i, why in inapplicable.items()
        ]  # fmt: skip
        errors = conform_rows(typed(pd.concat(parts, ignore_index=True)))
        errors = pa.Table.from_pandas(errors, schema=arrow_row_schema(), preserve_index=False)
        table = pa.concat_tables([table, errors])
    write_rows_atomic(table, out)
    t3 = time.perf_counter()
    sec = rows.attrs.get("seconds", {})
    ok = int(table["status"].to_pandas().eq("ok").sum())
    # the sim executor reports its planning and pricing CPU-seconds; dist and emulate do not
    inner = (
        f"planning {sec['plan_s']:.2f}, pricing {sec['price_s']:.2f} (CPU-s in workers), "
        if {"plan_s", "price_s"} <= sec.keys()
        else ""
    )
    log.info(
        "%s: %d runs, %d rows (%d ok) in %.1f s -> %s; seconds: sampling %.2f, %sexecutor %.2f, "
        "writing %.2f",
        cfg.run_key, len(runs), table.num_rows, ok, t3 - t0, out, t1 - t0, inner, t2 - t1, t3 - t2,
    )  # fmt: skip
    return out


register_configs()
register_value_check(PROG, _checked_runs, _shared_values)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> dict[str, Any]:
    """Console entry point ``flashcp-run`` (Hydra parses the command line).

    Returns (to :class:`experiments.common.callbacks.AggregateResults`) ``{"rows": path or None,
    "error": message or None, "exit_code": 0 | 1 | 2}``. A failing job writes error rows and its
    traceback to its log (a ``ValueError``, a bad value: one line on the console, exit code 2;
    any other exception: its traceback on the console too, exit code 1) and returns, so a sweep
    goes on; the callback prints one line and sets the exit code. A job whose rows all failed
    (every sequence's planning or measurement) keeps them and counts as failed (exit code 1). Under ``executor=dist`` a failure
    ends the process at once (the process group cannot be reused).
    """
    try:
        out = run(cfg)
        failed = _every_row_failed(out)
        if failed is not None:  # the rows stay (each names its error); the exit code says so
            log.error("%s: every row failed, e.g. %s", cfg.get("run_key", "run"), failed)
            return {"rows": str(out), "error": f"every row failed, e.g. {failed}", "exit_code": 1}
        lost = _failed_runs(out)
        if lost is not None:  # a grid's runs that became error rows: the others' rows stay
            log.error("%s: %s", cfg.get("run_key", "run"), lost)
            return {"rows": str(out), "error": lost, "exit_code": 1}
        return {"rows": str(out) if out is not None else None, "error": None, "exit_code": 0}
    except Exception as exc:
        key = cfg.get("run_key", "run")
        if isinstance(exc, ConfigError):
            log_job_error(log, f"{key}: bad configuration: {exc}", exc)
        elif isinstance(exc, ValueError):  # a bad value found by the work: one line at most
            log_job_error(log, f"{key} failed: {exc} (the traceback is in the run's log file)", exc)
        else:
            log.exception("%s failed", key)
        out = write_error_rows(cfg, exc)
        code = 2 if isinstance(exc, ValueError) else 1
        if cfg.executor.name == "dist" and "torch.distributed" in sys.modules:
            print(f"flashcp-run: error: {type(exc).__name__}: {exc}", file=sys.stderr)
            raise SystemExit(code) from None
        msg = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        return {"rows": str(out) if out is not None else None, "error": msg, "exit_code": code}


def cli(argv: list[str] | None = None) -> None:
    """Console entry point ``flashcp-run``: :func:`main` under
    :func:`experiments.common.launch.launch` (readable errors, clean Ctrl-C/SIGTERM)."""
    launch(main, PROG, argv)


if __name__ == "__main__":
    cli()
