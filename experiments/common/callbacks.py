"""Hydra callbacks of the harness's commands: one lock per experiment folder, an exit code that says
whether every job succeeded, and for ``flashcp-run`` (:class:`AggregateResults`) the merge and the
figures at the end; the experiments that write their own tables (``flashcp-table2``, ...) use
:class:`ExperimentFolder`.

A sweep (or a single run) owns its experiment folder while it runs: ``hydra.sweep.dir`` for
``-m``, ``${results_dir}/${name}`` otherwise. It takes ``<folder>/.sweep.lock`` (created
exclusively) holding its ``sweep_id``, process and code version; a second invocation on the same
folder stops with one line and exit code 2 instead of sharing run folders, rows and logs. A lock
left by a process that no longer runs on this host is taken over with a warning.

Under every launcher. Hydra calls ``on_job_start`` / ``on_job_end`` where the job runs (in this
process for the basic launcher; in a joblib worker; in a Slurm or local submitit job), and
``on_multirun_end`` where the sweep was launched. So each job writes what it returned to
``<folder>/.sweep_jobs/<sweep_id>/<job_num>.json`` and the end of the sweep reads those records
from disk (a shared file system on Slurm), merges the rows they name and removes them. A job that
started but never reported (killed, out of time) counts as failed.

Under submitit with ``executor=dist`` every task of a job is one rank: ``on_job_start`` exports
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` from the job's
environment (what ``torchrun`` sets), and ``on_job_end`` tears the job's process group down.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as _dt
import json
import logging
import os
import re
import shutil
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)

LOCK_NAME = ".sweep.lock"
#: per sweep, one record per job: what it returned (``rows``, ``error``, ``exit_code``) or that it
#: started
JOBS_DIR = ".sweep_jobs"


def release_process_group() -> None:
    """Under torchrun (executor=dist), tear the process group down on every rank together once the
    runs are over: a rank that exits while another still holds the group aborts the job. The
    group lives across the runs of a sweep because re-creating it on the same store hangs."""
    if "torch.distributed" not in sys.modules:
        return  # never imported: no group (keeps the simulator free of torch)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def is_rank0() -> bool:
    """True outside torchrun and on its rank 0 (the rank that writes rows, locks and merges)."""
    return os.environ.get("RANK", "0") == "0"


def read_lock(exp_dir: str | Path) -> dict[str, Any] | None:
    """The sweep that holds ``exp_dir`` (``sweep_id``, ``pid``, ``host``, ``started_utc``,
    ``provenance`` with its ``code_version``), or None when no sweep holds it (or its lock is
    unreadable)."""
    try:
        return json.loads((Path(exp_dir) / LOCK_NAME).read_text())
    except (OSError, ValueError):
        return None


def _alive(info: dict[str, Any]) -> bool:
    """Whether the process that wrote a lock may still run (always True for another host)."""
    if info.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, ValueError, TypeError):
        return True
    return True


def acquire_lock(exp_dir: str | Path) -> dict[str, Any]:
    """Take ``exp_dir/.sweep.lock`` for this process; return what it holds.

    Raises:
        RuntimeError: another live sweep holds the folder (the message names it and says what to do).
    """
    from flashcp.results import provenance

    exp_dir = Path(exp_dir)
    exp_dir.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now(_dt.timezone.utc)
    info = {
        "sweep_id": f"{now:%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}",
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started_utc": now.isoformat(timespec="seconds"),
        "provenance": provenance(),  # read once: every run of the sweep has the same code
    }
    path = exp_dir / LOCK_NAME
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            held = read_lock(exp_dir)
            if held is not None and _alive(held):
                raise RuntimeError(
                    f"{exp_dir} is in use by sweep {held.get('sweep_id')} (pid {held.get('pid')} on "
                    f"{held.get('host')}, since {held.get('started_utc')}); wait for it or choose "
                    "another name="
                ) from None
            log.warning("taking over %s left by a sweep that is no longer running: %s", path, held)
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
        return info
    raise RuntimeError(f"could not take {path}")


def release_lock(exp_dir: str | Path, info: dict[str, Any] | None) -> None:
    """Remove ``exp_dir/.sweep.lock`` if it is still the one ``info`` describes."""
    held = read_lock(exp_dir)
    if info is not None and held is not None and held.get("sweep_id") == info.get("sweep_id"):
        (Path(exp_dir) / LOCK_NAME).unlink(missing_ok=True)


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, default=str))
    os.replace(tmp, path)


def experiment_dir(config: DictConfig) -> Path:
    """The folder a run or sweep owns: ``hydra.sweep.dir`` under ``-m``, else
    ``${results_dir}/${name}`` (``config`` has its ``hydra`` node)."""
    from hydra.types import RunMode

    if config.hydra.mode == RunMode.MULTIRUN:
        return Path(str(config.hydra.sweep.dir))
    return Path(str(config.results_dir)) / str(config.name)


def output_problem(config: DictConfig, multirun: bool) -> str | None:
    """Why the folders a run or sweep writes cannot be written (one line naming the setting that
    places them), or None: the experiment folder (:func:`experiment_dir`) and, for a single run,
    its job folder ``hydra.run.dir`` (:func:`flashcp.results.check_output_dir`). Checked before
    the folder is locked, so a refused invocation writes nothing."""
    from flashcp.results import check_output_dir

    results_dir = str(config.get("results_dir", ""))
    folders = [(experiment_dir(config), "hydra.sweep.dir" if multirun else None)]
    if not multirun:
        folders.append((Path(str(config.hydra.run.dir)), "hydra.run.dir"))
    for folder, key in folders:
        under_results = results_dir and str(folder).startswith(results_dir)
        what = f"results_dir={results_dir}" if under_results or key is None else key
        try:
            check_output_dir(folder, what)
        except ValueError as exc:
            return str(exc)
    return None


def export_submitit_rank_env() -> bool:
    """Inside a submitit job of several tasks (``hydra/launcher=submitit_slurm`` or
    ``submitit_local`` with ``tasks_per_node`` x ``nodes`` > 1) and not under torchrun: export the
    variables of torch's ``env://`` rendezvous from the job (``MASTER_ADDR`` = the first node,
    ``MASTER_PORT`` from the job id, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), as torchrun would.
    Returns whether it did."""
    if "RANK" in os.environ:
        return False
    try:
        import submitit
        from submitit.helpers import TorchDistributedEnvironment

        env = submitit.JobEnvironment()
        if env.num_tasks < 2:
            return False
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    except (ImportError, RuntimeError):  # not a submitit job
        return False
    return True


#: the files Hydra writes with the absolute paths of the machine that ran it (``hydra.runtime.cwd``,
#: ``output_dir``, the config search path)
HYDRA_RECORDS = (".hydra/hydra.yaml", "multirun.yaml")


def scrub_machine_paths(path: str | Path, cwd: str | Path | None = None) -> bool:
    """Rewrite one of Hydra's records (:data:`HYDRA_RECORDS`) so it holds no absolute path of this
    machine: the working directory becomes ``.`` (paths under it become relative to it), the
    harness's own configuration folder ``<flashcp>/conf``, the home directory ``~``.

    Everything else in the file is kept byte for byte, so the record still says what Hydra ran
    (overrides, choices, launcher, sweep) and can be committed with the results.

    Args:
        path: the YAML file (missing: nothing to do).
        cwd: the directory the job ran from (default: the current one; Hydra does not change it).
    Returns:
        True if the file was rewritten.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError:
        return False
    from flashcp.resources import resource_path

    cwd = Path.cwd() if cwd is None else Path(cwd)
    conf = resource_path("conf").resolve()
    # (absolute root, what a path under it becomes, what the root alone becomes)
    roots = [(str(conf), "<flashcp>/conf/", "<flashcp>/conf")]
    roots += [(str(c), "", ".") for c in dict.fromkeys((str(cwd.resolve()), str(cwd)))]
    roots.append((str(Path.home()), "~/", "~"))
    new = text
    end = r"(?=$|[\s'\",\]}])"  # where a path ends in Hydra's YAML
    for root, under, alone in sorted(roots, key=lambda r: len(r[0]), reverse=True):
        if len(root.strip("/")) == 0:  # never "/" itself
            continue
        new = new.replace(root + "/", under)
        new = re.sub(re.escape(root) + end, alone, new, flags=re.MULTILINE)
    if new == text:
        return False
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new)
    os.replace(tmp, path)
    return True


def read_job_records(exp_dir: str | Path, sweep_id: str) -> list[dict[str, Any]]:
    """The records the jobs of sweep ``sweep_id`` wrote, by job number; a job that started but
    never reported is ``{"dir", "error": "... did not finish ...", "exit_code": 1}``."""
    folder = Path(exp_dir) / JOBS_DIR / sweep_id
    jobs = []
    for path in sorted(
        folder.glob("*.json"), key=lambda p: int(p.stem) if p.stem.isdigit() else -1
    ):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            rec = {"dir": str(path), "state": "started"}
        if rec.get("state") == "started":
            rec = {
                "dir": rec.get("dir"),
                "error": "the job started but did not finish (killed, out of memory or out of time?)",
                "exit_code": 1,
            }
        jobs.append(rec)
    return jobs


def merged_run_ids(exp_dir: str | Path) -> set[str]:
    """The ``run_id`` values of the runs an earlier merge left in ``exp_dir/summary.csv`` (empty
    when there is none or it cannot be read)."""
    import pandas as pd

    try:
        ids = pd.read_csv(Path(exp_dir) / "summary.csv", usecols=["run_id"], dtype=str)
    except (OSError, ValueError):
        return set()
    return set(ids["run_id"].dropna())


class ExperimentFolder(Callback):
    """Refuse a launch Hydra would silently get wrong
    (:func:`experiments.common.launch.launch_problem`); lock the experiment folder when a run or sweep
    starts; when it ends, release the lock and exit non-zero with one line when a job failed.
    The callback of the experiments that write their own tables (``flashcp-table2``, ...); the
    sweeps of ``flashcp-run`` use :class:`AggregateResults`, which also merges their rows.

    Args:
        prog: the command, for the one-line messages (``flashcp-run``, ``flashcp-table2``, ...).
    """

    #: where a failed job's details are, in the line that counts failed jobs
    failed_note = "traceback in each run's log"

    def __init__(self, prog: str = "flashcp-run") -> None:
        self.prog = prog
        self.exp_dir: Path | None = None
        self.lock: dict[str, Any] | None = None
        self.multirun = False
        self.rank_env = False  # this process exported a submitit job's rank variables

    def _start(self, config: DictConfig, multirun: bool) -> None:
        from experiments.common.launch import launch_problem

        self.exp_dir, self.multirun = experiment_dir(config), multirun
        problem = launch_problem(config, multirun, prog=self.prog) or output_problem(
            config, multirun
        )  # the same on every torchrun rank
        if problem is not None:
            if is_rank0():
                print(f"{self.prog}: error: {problem}", file=sys.stderr)
            raise SystemExit(2)
        if not is_rank0():
            return
        try:
            self.lock = acquire_lock(self.exp_dir)
        except RuntimeError as exc:
            print(f"{self.prog}: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        # an interrupted sweep (Ctrl-C, SIGTERM) never reaches _finish: clean up at exit
        atexit.register(self._cleanup)

    def _cleanup(self) -> None:
        """Remove this sweep's job records and release its lock (idempotent)."""
        if self.exp_dir is None or self.lock is None:
            return
        shutil.rmtree(self.exp_dir / JOBS_DIR / self.lock["sweep_id"], ignore_errors=True)
        with contextlib.suppress(OSError):  # empty once no other sweep has records here
            (self.exp_dir / JOBS_DIR).rmdir()
        release_lock(self.exp_dir, self.lock)

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._start(config, multirun=False)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._start(config, multirun=True)

    def _record_path(self, config: DictConfig) -> Path | None:
        """Where this job's record goes (None off rank 0, or when no sweep holds the folder)."""
        if not is_rank0():
            return None
        # the folder this invocation locked (set where the sweep started; a job run by another
        # launcher process gets the callback's state with it); a job's own hydra.sweep.dir can
        # differ when its name is interpolated ('name=table2_${context_len}')
        exp_dir = self.exp_dir if self.exp_dir is not None else experiment_dir(config)
        lock = read_lock(exp_dir)
        if lock is None:
            log.warning("no sweep holds %s: this job's result is not recorded", exp_dir)
            return None
        num = int(config.hydra.job.get("num") or 0)
        return exp_dir / JOBS_DIR / str(lock["sweep_id"]) / f"{num}.json"

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if "executor" in config and config.executor.name == "dist":
            self.rank_env = export_submitit_rank_env()
        path = self._record_path(config)
        if path is not None:
            run_dir = str(config.hydra.runtime.output_dir)
            _write_json_atomic(path, {"dir": run_dir, "state": "started"})

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if self.rank_env:  # this job's ranks end here; a later job is another Slurm job
            release_process_group()
        path = self._record_path(config)
        if path is None:
            return
        run_dir = str(job_return.hydra_cfg.hydra.runtime.output_dir)
        scrub_machine_paths(Path(run_dir) / HYDRA_RECORDS[0])
        if job_return.status == JobStatus.FAILED:  # main() turns failures into rows; not expected
            err = job_return._return_value
            rec = {"dir": run_dir, "error": f"{type(err).__name__}: {err}", "exit_code": 1}
        else:
            rec = {"dir": run_dir, **(job_return.return_value or {})}
        _write_json_atomic(path, rec)

    def _merge_and_draw(self, config: DictConfig, jobs: list[dict[str, Any]]) -> list[str]:
        """What goes wrong after the jobs (one line each); nothing here: each job wrote its tables."""
        return []

    def _finish(self, config: DictConfig) -> None:
        release_process_group()
        if not is_rank0() or self.exp_dir is None or self.lock is None:
            return  # under torchrun only rank 0 locks, merges and reports
        jobs = read_job_records(self.exp_dir, self.lock["sweep_id"])
        scrub_machine_paths(self.exp_dir / HYDRA_RECORDS[1])
        try:
            problems = self._merge_and_draw(config, jobs)
        finally:
            self._cleanup()
        failed = [j for j in jobs if j.get("error")]
        if failed and not self.multirun:
            problems.insert(0, f"error: {failed[0]['error']}")
        elif failed:
            problems.insert(
                0,
                f"{len(failed)} of {len(jobs)} jobs failed ({self.failed_note}); "
                f"first: {failed[0]['dir']}: {failed[0]['error']}",
            )
        for line in problems:
            print(f"{self.prog}: {line}", file=sys.stderr)
        if problems:  # a single run keeps its job's code (2: bad configuration); a sweep exits 1
            codes = [int(j.get("exit_code") or 1) for j in failed] if not self.multirun else []
            raise SystemExit(max([1, *codes]))

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._finish(config)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._finish(config)


class AggregateResults(ExperimentFolder):
    """:class:`ExperimentFolder` for the sweeps of ``flashcp-run``: when a run or sweep ends, also
    merge the rows its jobs wrote (where they wrote them, as each job records its rows file on
    disk) into ``<folder>/rows.parquet`` and ``summary.csv``
    (:func:`experiments.aggregate.aggregate`) and draw the figures in ``plots``. A failed job's
    rows have status ``error: ...``.

    Runs of earlier invocations stay in ``runs/`` but are not merged (a warning counts those of
    the earlier merge it replaces); ``python -m experiments.aggregate DIR`` merges every run of a
    folder.
    """

    failed_note = "rows with status 'error: ...', traceback in each run's log"

    def _merge_and_draw(self, config: DictConfig, jobs: list[dict[str, Any]]) -> list[str]:
        """Merge the jobs' rows and draw the figures; return what went wrong (one line each)."""
        from experiments.aggregate import aggregate
        from experiments.plot import draw

        paths = [Path(j["rows"]) for j in jobs if j.get("rows")]
        before = merged_run_ids(self.exp_dir) if paths else set()
        try:
            write_rows = bool(config.get("merged_rows", True))
            summary = aggregate(self.exp_dir, paths, write_rows=write_rows) if paths else None
        except ValueError as exc:
            return [f"error: merge refused: {exc}"]
        if summary is None:
            return [f"error: no rows to merge into {self.exp_dir}"]
        left = before - set(summary["run_id"].astype(str))
        if left:
            log.warning(
                "%d run(s) of an earlier sweep left the merge in %s: rows.parquet and summary.csv "
                "now hold this sweep's %d run(s) only (the earlier rows stay in runs/); "
                "python -m experiments.aggregate %s merges every run of the folder",
                len(left), self.exp_dir, summary["run_id"].nunique(), self.exp_dir,
            )  # fmt: skip
        problems = []
        for fig in config.get("plots", []):
            try:
                log.info("figure %s -> %s", fig, draw(fig, self.exp_dir))
            except ValueError as exc:
                problems.append(
                    f"error: figure {fig} not drawn: {exc} (the rows are merged; plots=[] draws none)"
                )
        return problems
