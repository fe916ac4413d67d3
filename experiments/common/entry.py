"""What every experiment that writes its own tables shares: the fields where it writes
(:class:`ExperimentConfig`), the ``${experiment_key:}`` folder name, registering its schema,
the checks every such config gets, and the body of its Hydra app (:func:`run_experiment`).

Which experiments have their own command is read from the configs themselves
(:func:`experiment_commands`): every primary config ``conf/<name>.yaml`` other than
``conf/config.yaml`` names its command in ``hydra.callbacks.folder.prog``. Nothing here imports
an experiment; each experiment imports this module.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from omegaconf import MISSING

#: the figures ``plots=[...]`` and ``python -m experiments.plot`` draw (:func:`experiments.plot.draw`)
FIGURES = ("fig5", "fig6", "fig7", "fig3", "fig5_peers", "fig5_step", "scale")

__all__ = [
    "CONF_DIR",
    "ExperimentConfig",
    "at_least",
    "check_experiment_config",
    "experiment_commands",
    "experiment_key",
    "register_experiment",
    "run_experiment",
]


def _conf_dir() -> str:
    from flashcp.resources import resource_path

    return str(resource_path("conf"))


#: the folder of the primary configs (``conf/`` of a checkout, or the installed package's copy)
CONF_DIR = _conf_dir()
#: the primary config of ``flashcp-run``; every other ``conf/*.yaml`` is an experiment's own
RUN_CONFIG = "config"


@dataclass
class ExperimentConfig:
    """Fields every experiment with its own command (``flashcp-table2``, ``-calibration``,
    ``-sensitivity``, ``-fig3``) has: where it writes. Its tables go to
    ``${results_dir}/${name}/``, its Hydra log and saved config to
    ``${results_dir}/${name}/runs/${run_key}/``."""

    #: experiment name: results go to ${results_dir}/${name}
    name: str = MISSING
    #: root folder of results; outputs/ is ignored by git (the committed reference results are
    #: in results/: write there with results_dir=results)
    results_dir: str = "outputs"
    #: folder of this invocation's log and saved config inside ${results_dir}/${name}/runs
    #: (interpolated in the experiment's config: its name and the hash of its settings)
    run_key: str = "run"


#: fields of an experiment's config that do not change its results
_COSMETIC = frozenset({"name", "results_dir", "run_key", "workers", "progress", "hydra"})


def experiment_key(*, _root_: Any) -> str:
    """OmegaConf resolver ``${experiment_key:}``, the ``run_key`` of an experiment:
    ``<name>-<6 hex digits>``, the hash of every field that changes its results, so a rerun with
    the same settings finds its folder again and other settings get another."""
    from omegaconf import OmegaConf

    from flashcp.results import config_hash

    picked = {
        k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
        for k, v in _root_.items_ex(resolve=False)
        if k not in _COSMETIC
    }
    return f"{_root_.name}-{config_hash(picked)[:6]}"


def register_experiment(config_name: str, schema: type) -> None:
    """Register ``schema`` (a dataclass extending :class:`ExperimentConfig`) in Hydra's
    ConfigStore as ``base_<config_name>``, the first entry of ``conf/<config_name>.yaml``'s
    defaults, with the group schemas and resolvers of :func:`flashcp.config.register_configs`
    and ``${experiment_key:}`` (idempotent). An experiment's module calls it once at import,
    before its ``@hydra.main`` app composes.

    Raises:
        ValueError: ``schema`` does not extend :class:`ExperimentConfig`.
    """
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from flashcp.config import register_configs

    if not (isinstance(schema, type) and issubclass(schema, ExperimentConfig)):
        raise ValueError(f"{schema!r}: an experiment's schema extends ExperimentConfig")
    register_configs()
    OmegaConf.register_new_resolver("experiment_key", experiment_key, replace=True)
    ConfigStore.instance().store(name=f"base_{config_name}", node=schema)


@functools.cache
def experiment_commands(conf_dir: str | None = None) -> MappingProxyType[str, str]:
    """Experiment (primary config name) -> its command, for every experiment with its own
    command: each ``conf/<name>.yaml`` other than ``conf/config.yaml`` whose
    ``hydra.callbacks.folder.prog`` names it (``{"table2": "flashcp-table2", ...}``). Read from
    the YAML files, without composing or importing anything."""
    from omegaconf import OmegaConf

    out = {}
    for path in sorted(Path(conf_dir or CONF_DIR).glob("*.yaml")):
        if path.stem == RUN_CONFIG:
            continue
        prog = OmegaConf.select(OmegaConf.load(path), "hydra.callbacks.folder.prog")
        if prog:
            out[path.stem] = str(prog)
    return MappingProxyType(out)


def at_least(cfg: Any, key: str, low: float, strict: bool = False) -> None:
    """Raise ValueError when ``cfg[key]`` (present and not null) is below ``low`` (``strict``:
    at or below it)."""
    if key in cfg and cfg[key] is not None:
        v = cfg[key]
        if v < low or (strict and v == low):
            raise ValueError(f"{key} must be {'>' if strict else '>='} {low}, got {v}")


def check_experiment_config(cfg: Any, chunks_per_rank: int = 1) -> None:
    """Check the values of an experiment's config that a type cannot pin down and that every
    experiment with the field shares (``cp_size``, ``num_sequences`` >= 1; ``workers`` in [1,
    :func:`flashcp.executors.sim.max_workers`];
    ``context_len`` a positive multiple of ``chunks_per_rank * cp_size``, the most chunks per
    rank of the experiment's methods (2 with llama3), the message naming the nearest ones that
    are; ``modes``; the ``model`` shape), before
    any work; the fields a schema does not have are skipped. An experiment checks its own
    fields after these (its ``check`` of :func:`run_experiment`).

    Raises:
        ValueError: naming the bad value.
    """
    from flashcp.config import check_model_config, check_modes
    from flashcp.executors.sim import check_workers
    from flashcp.plan import check_context_len

    for key in ("cp_size", "num_sequences"):
        at_least(cfg, key, 1)
    if "workers" in cfg:
        check_workers(cfg.workers)
    if "context_len" in cfg:
        if cfg.context_len < 1:
            raise ValueError(f"context_len must be >= 1, got {cfg.context_len}")
        check_context_len(int(cfg.context_len), int(cfg.cp_size), chunks_per_rank)
    if "modes" in cfg:
        check_modes(cfg.modes)
    if "model" in cfg:
        check_model_config(cfg.model)


def log_job_error(log: Any, message: str, exc: BaseException) -> None:
    """Log a job's bad value (``message``, one line) and ``exc``'s traceback: the traceback to the
    root logger's file handlers only (the job's log file under Hydra); the line on the console too
    in a sweep, where it says which job failed, but not in a single run, whose command ends with
    the same message as its one error line."""
    import logging

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        log.error(message)
    record = log.makeRecord(
        log.name, logging.ERROR, __file__, 0, message, (), (type(exc), exc, exc.__traceback__)
    )
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def run_experiment(cfg: Any, work: Any, check: Any = check_experiment_config) -> dict[str, Any]:
    """The body of an experiment's Hydra app: check ``cfg`` (``check``, by default
    :func:`check_experiment_config`; an experiment with fields of its own passes a function that
    calls it and then checks them), run ``work(cfg)`` (which writes the tables and returns the
    main file) and return the job's record for
    :class:`experiments.common.callbacks.ExperimentFolder`: ``{"out": path or None, "error":
    message or None, "exit_code": 0 | 1 | 2}``. A failure is logged (traceback in the job's log; a
    bad value: one line, exit code 2) and returned, so the callback ends the command with one
    line."""
    import logging

    log = logging.getLogger("experiments")
    try:
        check(cfg)
        out = work(cfg)
    except Exception as exc:
        if isinstance(exc, ValueError):
            log_job_error(log, f"{cfg.name}: bad configuration: {exc}", exc)
        else:
            log.exception("%s failed", cfg.name)
        code = 2 if isinstance(exc, ValueError) else 1
        msg = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        return {"out": None, "error": msg, "exit_code": code}
    log.info("%s -> %s", cfg.name, out)
    return {"out": str(out), "error": None, "exit_code": 0}
