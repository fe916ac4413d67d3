"""How the harness's commands start and stop: readable errors, launch checks and signals.

    flashcp-run ...                      # the sweeps (Fig. 5, 6, 7): experiments.run:cli
    python -m experiments.run            # the same (torchrun uses this form)
    flashcp-table2 ...                   # Table 2: experiments.table2:cli (python -m experiments.table2)
    flashcp-calibration ...              # calibration: experiments.calibration:cli
    flashcp-sensitivity ...              # sensitivity: experiments.sensitivity:cli
    flashcp-fig3 ...                     # Fig. 3: experiments.fig3:cli

Each is its own Hydra app with its own primary config and schema (``conf/config.yaml`` and
:class:`flashcp.config.RunConfig`; ``conf/<experiment>.yaml`` and the schema in
``experiments/<experiment>.py``). Each module's ``cli`` calls :func:`launch` on its app, so that
a person sees one line instead of a traceback or a page of Hydra internals:

* Composition errors become one line naming the bad value and the valid choices
  (:func:`explain_hydra_error`): an unknown group option (``method=nope``: the options, without the
  internal ``base_*`` schemas), an unknown key (``cp_sise=4``: the closest keys), a value of the
  wrong type (``cp_size=abc``: the type the field takes), an override Hydra cannot parse. Exit
  code 2. ``HYDRA_FULL_ERROR=1`` keeps Hydra's own report. ``flashcp-run experiment=table2`` (an
  experiment that has its own command, :func:`experiments.common.entry.experiment_commands`)
  names that command.
* Launch mistakes that Hydra would silently accept are refused before any job starts
  (:func:`launch_problem`, called by :class:`experiments.common.callbacks.ExperimentFolder`): a sweep over
  experiment configs (``-m experiment=fig6,fig7``: Hydra composes the sweep before choosing the
  experiment, so the sweeps they define are skipped), a launcher without ``-m`` (a single run
  ignores ``hydra/launcher``), an experiment that defines a sweep run without ``-m``, a key
  added with ``+`` that no schema has (``+cp_sise=4`` would run with the default ``cp_size``),
  ``executor=dist`` under a submitit launcher whose tasks per job differ from ``cp_size`` (or
  whose nodes differ from ``nodes``), and a
  sweep of an experiment entry whose jobs would all write the same folder
  ``<results_dir>/<name>`` (:func:`experiment_sweep_problem`), a ``flashcp-run`` sweep over
  ``name`` or ``results_dir`` (its runs would be merged into one folder), and a plain override of
  a key the config's ``grid`` varies (``experiment=fig5 cp_size=2``: write ``grid.cp_size=[2]``;
  :func:`grid_override_problem`), and ``dataset.path`` without ``dataset=file``
  (:func:`dataset_path_problem`).
* Values only a job would read (a length file, ``dataset.cap``, hardware constants; for a sweep
  those every job shares) are checked by the command's registered check
  (:func:`register_value_check`), and the folders it writes by
  :func:`experiments.common.callbacks.output_problem`, before the folder is locked: a refused
  invocation writes nothing. A ``method.options.<key>=`` beside a sweep or grid of methods
  applies to each (:func:`shared_method_options`), and is refused naming a method that does not
  take it.
* Ctrl-C (SIGINT) and SIGTERM end the process with one line (exit 130 / 143). Workers of the
  simulator's process pool ignore SIGINT (their initializer, :mod:`flashcp.executors.sim`); the run
  drops the queued chunks and joins them, and :func:`end_children` terminates any child left, so
  none outlives the sweep and none prints a traceback. Finished runs stay on disk: rerunning the
  command resumes. (Under ``hydra/launcher=joblib`` a terminal's Ctrl-C also reaches joblib's own
  worker processes, which may print their interruption; the sweep still ends.)
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import multiprocessing
import os
import signal
import sys
import typing
from collections.abc import Callable, Iterable
from typing import Any

from experiments.common.entry import experiment_commands

PROG = "flashcp-run"
#: exit codes: a bad command line or configuration; Ctrl-C; SIGTERM (128 + signal number)
EXIT_USAGE, EXIT_SIGINT, EXIT_SIGTERM = 2, 128 + signal.SIGINT, 128 + signal.SIGTERM


class Terminated(BaseException):
    """Raised in the main process by SIGTERM (a BaseException, like KeyboardInterrupt, so that
    the job's ``except Exception`` does not turn it into error rows)."""


def _names(options: Iterable[str]) -> str:
    return ", ".join(o for o in options if not o.startswith("base_"))


def _fields(schema: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []


def _field_type(schema: Any, key: str) -> str:
    try:
        hint = typing.get_type_hints(schema)[key]
    except (KeyError, NameError, TypeError):
        return "another type"
    return _describe_type(hint)


def _describe_type(hint: Any) -> str:
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(str(m.value) for m in hint)
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def unknown_key_message(key: str, override: str, schema: Any) -> str:
    """One line for a key that ``schema`` (a config dataclass) does not have."""
    leaf = key.rsplit(".", 1)[-1]
    fields = _fields(schema)
    close = difflib.get_close_matches(leaf, fields, n=3, cutoff=0.6)
    where = f"in {key.rsplit('.', 1)[0]}" if "." in key else "at the top level"
    prefix = key[: len(key) - len(leaf)]
    if not fields and "." in key and not override.startswith("+"):  # a free-form mapping
        parent = key.rsplit(".", 1)[0]
        return f"{override}: {parent} holds no key {leaf!r} yet; add it with +{override}"
    hint = (
        f"did you mean {' or '.join(prefix + c for c in close)}?"
        if close
        else f"keys {where}: {', '.join(fields)}"
    )
    return f"unknown key {key} (in {override}); {hint}"


def unknown_option_message(cause: Any, override: str) -> str | None:
    """One line for ``method.options.<key>=...`` naming a key the method's file does not list
    (Hydra then refuses the override): the method's valid options (its options dataclass,
    :func:`flashcp.registry.options_schema`), and the ``+method.options.<key>=...`` that adds a
    valid one. None when the key is not under ``method.options`` or the method is unknown."""
    key = str(cause.full_key)
    if not key.startswith("method.options.") or key.count(".") != 2:
        return None
    leaf = key.rsplit(".", 1)[1]
    try:
        method = str(cause.parent_node._get_parent()["name"])
        from flashcp.registry import options_schema

        valid = [f.name for f in dataclasses.fields(options_schema(method))]
    except Exception:  # no method node to read: the generic message
        return None
    value = override.split("=", 1)[1] if "=" in override else "..."
    if leaf in valid:
        return (
            f"{override}: method {method!r} takes option {leaf!r}, but conf/method/{method}.yaml "
            f"does not list it; add it with +method.options.{leaf}={value}"
        )
    close = difflib.get_close_matches(leaf, valid, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return (
        f"unknown key {key} (in {override}): method {method!r} has no option {leaf!r}; {hint}"
        f"its options: {', '.join(valid) or 'none'}"
    )


def explain_hydra_error(exc: BaseException) -> str | None:
    """One line for a Hydra composition error a person caused, or None for anything else.

    Handles ``hydra.errors.MissingConfigException`` (unknown group option), ``OverrideParseException``
    and ``ConfigCompositionException`` caused by an OmegaConf ``ConfigKeyError`` (unknown key) or
    ``ValidationError`` (value of the wrong type).
    """
    from hydra.errors import (
        ConfigCompositionException,
        MissingConfigException,
        OverrideParseException,
    )
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file:
        path = str(exc.missing_cfg_file)
        if exc.options is None:  # the primary config itself, or a group that does not exist
            return f"no config {path!r}"
        group, _, option = path.rpartition("/")
        if not group:
            return f"no config {path!r}"
        if group == "experiment" and option in experiment_commands():
            return moved_experiment_message(option)
        return f"{group}={option}: no such option; choose one of {_names(exc.options)}"
    if isinstance(exc, OverrideParseException):
        reason = str(exc.message).splitlines()[0]
        return f"cannot parse {exc.override!r}: {reason} (https://hydra.cc/docs/1.3/advanced/override_grammar/basic)"
    if isinstance(exc, ConfigCompositionException):
        cause = exc.__cause__
        override = _override_in(str(exc))
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
            option = unknown_option_message(cause, override)
            if option is not None:
                return option
            return unknown_key_message(str(cause.full_key), override, cause.object_type)
        if isinstance(cause, ValidationError) and cause.full_key:
            key = str(cause.full_key)
            value = override.split("=", 1)[-1] if "=" in override else "?"
            if key.endswith("]"):  # an element of a typed list, e.g. datasets[0]
                meta = getattr(cause.parent_node, "_metadata", None)
                element = getattr(meta, "element_type", None)
                kind = _describe_type(element) if element not in (None, Any) else "another type"
                return f"{override}: {key} takes {kind}, got {cause.value!r}"
            schema = cause.object_type
            return f"{override}: {key} takes {_field_type(schema, key.rsplit('.', 1)[-1])}, got {value!r}"
        text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        if text.startswith("Ambiguous value for argument"):  # a sweep without -m
            text = text.split(" 1. ", 1)[0] + "; add -m to sweep over it, or write [a,b] for a list"
        return text or None
    if isinstance(exc, ValueError) and _raised_in_hydra(exc):  # a command-line usage error
        return str(exc).strip().splitlines()[0]
    return None


def moved_experiment_message(option: str) -> str:
    """One line for ``flashcp-run experiment=<option>`` when that experiment is its own command."""
    prog = experiment_commands()[option]
    return (
        f"experiment={option} is its own command: {prog} [field=value ...] (python -m "
        f"experiments.{option}); its options are top-level fields (num_sequences=2, not "
        f"{option}.num_sequences=2), listed by {prog} --help"
    )


def _raised_in_hydra(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith("hydra.")


def _override_in(message: str) -> str:
    """The override a Hydra message names (``Could not override 'x'`` / ``merging override x=1``)."""
    lines = message.strip().splitlines()
    for line in lines:  # "To append to your config use +key=value"
        if "use +" in line:
            return line.split("use +", 1)[1].strip()
    first = lines[0] if lines else ""
    for marker in ("merging override ", "Could not override ", "Could not append to config "):
        if marker in first:
            return first.split(marker, 1)[1].strip().strip("'.")
    return first


def added_unknown_keys(config: Any) -> list[str]:
    """One line per ``+key=value`` override (sweeps included) whose key no config schema has.

    Hydra lets ``+`` add any key, even to a typed config, so ``+cp_sise=4`` would run with the
    default ``cp_size``. Keys under untyped mappings (``method.options``) stay open: their owners
    check them.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import DictConfig, OmegaConf

    overrides = list(config.hydra.overrides.task)
    problems = []
    for ov in OverridesParser.create().parse_overrides(overrides):
        if not (ov.is_add() or ov.is_force_add()) or ov.key_or_group.startswith("hydra"):
            continue
        key = ov.key_or_group
        if key in config.hydra.runtime.choices:  # +group=option adds a config, not a key
            continue
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(config, parent_key) if parent_key else config
        if not isinstance(parent, DictConfig):
            continue
        schema = OmegaConf.get_type(parent)
        if dataclasses.is_dataclass(schema) and leaf not in _fields(schema):
            problems.append(unknown_key_message(key, ov.input_line or key, schema))
    return problems


def _sweep_overrides(config: Any) -> list[Any]:
    """The command line's sweep overrides (``key=a,b``, ranges, ...), parsed by Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    return [ov for ov in parsed if ov.is_sweep_override()]


def swept_keys(config: Any) -> frozenset[str]:
    """The keys a sweep varies: those of the command line's sweep overrides and of
    ``hydra.sweeper.params`` (an experiment's own sweep, e.g. ``experiment=fig5``'s datasets)."""
    params = config.hydra.sweeper.get("params") or {}
    return frozenset(
        [*(ov.key_or_group for ov in _sweep_overrides(config)), *(str(k) for k in params)]
    )


def _is_sweep(config: Any, key: str) -> str | None:
    """The override that sweeps ``key`` (as typed), or None."""
    return next((ov.input_line for ov in _sweep_overrides(config) if ov.key_or_group == key), None)


def _sweep_sizes(config: Any) -> dict[str, int]:
    """Swept key -> number of its values, over the command line's sweep overrides."""
    return {
        ov.key_or_group: sum(1 for _ in ov.sweep_string_iterator())
        for ov in _sweep_overrides(config)
    }


def name_problem(config: Any) -> str | None:
    """Why ``name`` (resolved: ``name=f3_${model.name}`` works) cannot name the command's one
    folder below ``results_dir``: empty (the results would land in ``results_dir`` itself),
    absolute, ``.``/``..`` or holding a path separator (``name=../../escape`` would write outside
    it); None when it can (or the config has no ``name``)."""
    if "name" not in config:
        return None
    name = str(config.name)
    if not name.strip():
        return (
            f"name= is empty: it names the folder below results_dir={config.results_dir} that the "
            "results go to; give one (name=my_run)"
        )
    if name in (".", "..") or "/" in name or "\\" in name or os.path.isabs(name):
        return (
            f"name={name} is not one folder name: results go to <results_dir>/<name>, so name "
            "takes no '/', '\\', '.' or '..'; to write elsewhere set results_dir= (name=my_run "
            "results_dir=/path/to/results)"
        )
    return None


def experiment_sweep_problem(config: Any, prog: str) -> str | None:
    """A sweep (``-m``) of an experiment entry whose jobs would write the same folder: each job
    writes its tables to ``<results_dir>/<name>``, so a later job would overwrite an earlier one's.
    None when every job can have its own folder (a swept or interpolated ``name``/``results_dir``
    with as many values as jobs)."""
    import math

    from omegaconf import OmegaConf

    sizes = _sweep_sizes(config)
    jobs = math.prod(sizes.values()) if sizes else 1
    folders = sizes.get("name", 1) * sizes.get("results_dir", 1)
    raw = OmegaConf.to_container(config, resolve=False)
    interpolated = any("${" in str(raw.get(k, "")) for k in ("name", "results_dir"))
    if jobs <= folders or interpolated:
        return None
    swept = ", ".join(k for k in sizes if k not in ("name", "results_dir"))
    return (
        f"this sweep runs {jobs} jobs (over {swept}) that would all write their tables to "
        f"{config.results_dir}/{config.name}, each overwriting the last; give each job its own "
        f"folder with a name that names the setting, e.g. {prog} -m ... 'name=table2_${{context_len}}', "
        "or run one command per setting"
    )


def launch_problem(config: Any, multirun: bool, prog: str = PROG) -> str | None:
    """What is wrong with how this invocation was launched (one line saying what to write
    instead), or None. ``config`` is the composed config with its ``hydra`` node, as a Hydra
    callback receives it at ``on_run_start`` / ``on_multirun_start``; ``prog`` the command that
    composed it (``flashcp-run`` or an experiment's command,
    :func:`experiments.common.entry.experiment_commands`)."""
    from flashcp.registry import method_names

    try:
        method_names()  # the registry's declarations load (a bad one would fail every job)
    except ValueError as exc:
        return str(exc)
    problem = name_problem(config)
    if problem is not None:
        return problem
    choices = config.hydra.runtime.choices
    experiment = choices.get("experiment")
    if prog != PROG and multirun:
        problem = experiment_sweep_problem(config, prog)
        if problem is not None:
            return problem
    folder = (_is_sweep(config, "name") or _is_sweep(config, "results_dir")) if multirun else None
    if prog == PROG and folder:
        return (
            f"{folder}: a sweep merges its runs into one folder <results_dir>/<name>, so the jobs "
            "of a swept name or results_dir would be merged into one of them; run one sweep per "
            f"folder ({PROG} -m name=... per value)"
        )
    swept = _is_sweep(config, "experiment") if multirun else None
    if swept:
        values = swept.split("=", 1)[1]
        each = "; ".join(f"{PROG} -m experiment={v.strip()}" for v in values.split(","))
        return (
            f"{swept}: Hydra composes a sweep before it picks the experiment, so the runs each "
            f"experiment defines would be skipped; run one experiment per command: {each}"
        )
    launcher = choices.get("hydra/launcher")
    if not multirun and launcher not in (None, "basic"):
        return (
            f"hydra/launcher={launcher} launches the jobs of a sweep and a single run ignores it; "
            f"add -m ({prog} -m hydra/launcher={launcher} ...)"
        )
    params = config.hydra.sweeper.get("params") or {}
    if not multirun and experiment and params:
        swept_keys = ", ".join(str(k) for k in params)
        return (
            f"experiment={experiment} defines a sweep (over {swept_keys}) that a single run skips; "
            f"add -m ({PROG} -m experiment={experiment}), or hydra.sweeper.params=null to run one "
            "configuration of it"
        )
    if prog == PROG:
        problem = (
            grid_override_problem(config) or dataset_path_problem(config) or plots_problem(config)
        )
        if problem is None:
            problem = run_values_problem(config, prog, multirun)
        if problem is not None:
            return problem
    else:  # another command's registered value check (register_value_check), if any
        problem = run_values_problem(config, prog, multirun)
        if problem is not None:
            return problem
    ranks = _submitit_ranks(config)
    dist = "executor" in config and config.executor.name == "dist"
    if ranks is not None and dist and not _is_sweep(config, "cp_size"):
        if int(config.cp_size) != ranks:
            hl = config.hydra.launcher
            return (
                f"executor=dist with cp_size={config.cp_size}, but hydra/launcher={launcher} starts "
                f"{ranks} task(s) per job, one rank each (hydra.launcher.nodes={hl.nodes} x "
                f"tasks_per_node={hl.tasks_per_node}); make nodes x tasks_per_node = cp_size "
                "(slurm_dist: tasks_per_node follows hydra.launcher.gpus_per_node)"
            )
        nodes = config.get("nodes")
        if nodes is not None and not _is_sweep(config, "nodes"):
            hl = config.hydra.launcher
            if int(nodes) != int(hl.nodes):
                return (
                    f"executor=dist with nodes={nodes}, but hydra/launcher={launcher} starts "
                    f"hydra.launcher.nodes={hl.nodes}; make them equal (or drop nodes)"
                )
    added = added_unknown_keys(config)
    return added[0] if added else None


#: per command, the checks of a single run's values and of a sweep's shared values (registered
#: by the command's module)
_VALUE_CHECKS: dict[str, tuple[Any, Any]] = {}


def register_value_check(prog: str, check: Any, sweep_check: Any = None) -> None:
    """Have :func:`launch_problem` run ``check(config)`` (raising ``ValueError`` naming the bad
    value) on a single run of ``prog`` before its job starts, and ``sweep_check(config)`` on a
    sweep (``-m``) before its first job; the command's module registers them (so this module
    imports no command)."""
    _VALUE_CHECKS[prog] = (check, sweep_check)


def run_values_problem(config: Any, prog: str = PROG, multirun: bool = False) -> str | None:
    """The first bad value of a single run of ``prog`` (its registered check: for
    ``flashcp-run`` every run of its grid checked as the job checks it), or None: refused
    before the job starts, so a bad ``cp_size``, ``modes``, method option, dataset or hardware
    constant writes nothing. A sweep (``multirun``) gets the command's sweep check: the values
    every job shares (those no swept key changes); a job's own bad value is a row of the sweep."""
    import copy

    from hydra.core.hydra_config import HydraConfig

    check = _VALUE_CHECKS.get(prog, (None, None))[1 if multirun else 0]
    if check is None:
        return None
    # the check reads the command line's overrides (explicit hardware constants, ...) from
    # HydraConfig, as the job will; Hydra sets it only when the job starts
    hc = HydraConfig.instance()
    previous = hc.cfg
    if previous is None and "hydra" in config:
        hc.set_config(copy.deepcopy(config))
    try:
        check(config)
    except ValueError as exc:
        return str(exc)
    finally:
        hc.cfg = previous
    return None


#: keys a ``flashcp-run`` grid varies (experiments.common.grid.GRID_KEYS): groups and cp_size
_GRID_KEYS = ("method", "model", "hardware", "cp_size")


def grid_override_problem(config: Any) -> str | None:
    """A plain override (``cp_size=2``, ``method=ring``, ``model=h16``, ``hardware=...``, swept or
    not) of a key the composed config's ``grid`` varies (e.g. set by ``experiment=fig5``): the
    grid's values would replace it, so it is refused with the ``grid.<key>=[...]`` to write
    instead. Settings inside a group (``model.num_kv_heads=8``, ``method.options.lns=false``) are
    not refused: every run of the grid keeps them (:func:`experiments.common.grid.grid_runs`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    grid = config.get("grid") if "grid" in config else None
    if grid is None:
        return None
    parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    for ov in parsed:
        key = ov.key_or_group
        if key not in _GRID_KEYS or grid.get(key) is None:
            continue
        values = (
            [str(v) for v in ov.sweep_string_iterator()]
            if ov.is_sweep_override()
            else [str(ov.value())]
        )
        listed = ",".join(str(v) for v in OmegaConf.to_container(grid[key]))
        experiment = config.hydra.runtime.choices.get("experiment")
        source = f" (set by experiment={experiment})" if experiment else ""
        return (
            f"{ov.input_line}: the grid varies {key} over grid.{key}=[{listed}]{source}, which "
            f"would replace it; write grid.{key}=[{','.join(values)}] instead"
        )
    return None


def plots_problem(config: Any) -> str | None:
    """A figure in ``plots`` that :func:`experiments.plot.draw` does not know: refused before
    any job runs (drawing happens after the whole sweep)."""
    from experiments.common.entry import FIGURES

    unknown = [f for f in config.get("plots") or [] if f not in FIGURES]
    if unknown:
        return f"plots={list(config.plots)}: unknown figure {unknown[0]!r}; choose from {', '.join(FIGURES)}"
    return None


def dataset_path_problem(config: Any) -> str | None:
    """``dataset.path=...`` on a command line whose runs never read it: no ``dataset=file``
    (plain or among a sweep's values) and a composed dataset other than ``file``. A sweep
    ``dataset=wlb_llm,file dataset.path=x.csv`` is fine: the file's jobs read it, the others
    record ``dataset_path = "-"``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if "dataset" not in config or config.dataset.get("path") is None:
        return None
    if str(config.dataset.name) == "file":
        return None
    parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    path_ov = next((ov for ov in parsed if ov.key_or_group == "dataset.path"), None)
    for ov in parsed:
        if ov.key_or_group == "dataset":
            values = (
                [str(v) for v in ov.sweep_string_iterator()]
                if ov.is_sweep_override()
                else [str(ov.value())]
            )
            if "file" in values:
                return None
    typed = path_ov.input_line if path_ov is not None else f"dataset.path={config.dataset.path}"
    return (
        f"{typed}: only dataset=file reads dataset.path, and this run samples "
        f"dataset={config.dataset.name}; add dataset=file to use the file, or drop dataset.path"
    )


def _submitit_ranks(config: Any) -> int | None:
    """Tasks per job (nodes x tasks_per_node) of a submitit launcher; None for other launchers."""
    launcher = config.hydra.launcher
    if "submitit" not in str(launcher.get("_target_", "")):
        return None
    return int(launcher.nodes) * int(launcher.tasks_per_node)


def _signal_handler(main_pid: int) -> Any:
    """SIGINT/SIGTERM handler of the main process: raise KeyboardInterrupt / :class:`Terminated`
    there. A worker forked from it inherits the handler: there Ctrl-C is ignored (the parent ends
    the worker) and SIGTERM takes its default action, so no worker prints a traceback."""

    def handle(signum: int, frame: Any) -> None:
        if os.getpid() != main_pid:
            if signum == signal.SIGTERM:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signal.Signals(signum).name)

    return handle


def end_children() -> None:
    """Terminate (then kill, after 5 s) every child process this process started through
    :mod:`multiprocessing`, such as the simulator's ``ProcessPoolExecutor`` workers."""
    children = multiprocessing.active_children()
    for p in children:
        p.terminate()
    for p in children:
        p.join(5)
        if p.is_alive():
            p.kill()


def _swept_methods(parsed: list[Any], multirun: bool) -> tuple[list[str], str]:
    """The methods of a command line's runs when it names several (``-m method=a,b``, or
    ``grid.method=[a,b]``, swept or not) and the override that names them; ``([], "")`` when
    it names none or a set not listed (a glob)."""
    methods: list[str] = []
    form = ""
    for ov in parsed:
        key = ov.key_or_group
        if key == "grid.method" and not ov.is_sweep_override() and isinstance(ov.value(), list):
            methods += [str(m) for m in ov.value()]
            form = ov.input_line
        elif key == "grid.method" and ov.is_sweep_override() and "glob" not in ov.input_line:
            for value in ov.sweep_iterator():
                methods += [str(m) for m in value] if isinstance(value, list) else []
            form = ov.input_line
        elif (
            key == "method" and multirun and ov.is_sweep_override() and "glob" not in ov.input_line
        ):
            methods += [str(m) for m in ov.sweep_string_iterator()]
            form = form or ov.input_line
    return list(dict.fromkeys(methods)), form


def method_option_problem(override: str, option: str, methods: list[str], form: str) -> str | None:
    """One line when some of ``methods`` (the methods a sweep or grid runs, named by ``form``:
    ``method=a,b`` or ``grid.method=[a,b]``) take no planner option ``option`` (set by ``override``,
    applied to each of them), naming those methods and the command that sets it on the methods
    that take it; None when every method takes it (or one is unknown: composing names it)."""
    from flashcp.config import method_option
    from flashcp.registry import option_names

    def takes_option(m: str) -> bool:
        try:
            return option in option_names(m)
        except ValueError:  # a file of the method group (conf/method/llama3_paper.yaml): its method
            return option in option_names(method_option(m).method)

    try:
        takes = {m: takes_option(m) for m in methods}
    except ValueError:
        return None
    without = [m for m in methods if not takes[m]]
    if not without:
        return None
    with_it = [m for m in methods if takes[m]]
    listed = (
        f"-m method={','.join(with_it)}"
        if form.startswith("method")
        else f"grid.method=[{','.join(with_it)}]"
    )
    if not with_it:
        return f"{override}: no method in {form} takes option {option!r}; drop it"
    return (
        f"{override}: method{'s' if len(without) > 1 else ''} {', '.join(without)} (in {form}) "
        f"take{'' if len(without) > 1 else 's'} no option {option!r} (an option set beside a "
        f"sweep or grid of methods applies to each); set it on the methods that take it with "
        f"{PROG} {listed} {override}, and run the others without it"
    )


def shared_method_options(argv: list[str]) -> list[str]:
    """``argv`` with each ``method.options.<key>=value`` that sets an option on the methods of a
    sweep or grid (``-m method=a,b``, ``grid.method=[a]``) written as ``++method.options.<key>=value``:
    Hydra composes a sweep (and a grid's job) with the config's own ``method`` first, which need
    not take the option, and would refuse it there although every run's method takes it.

    Raises:
        ValueError: a method of the sweep or grid takes no such option
            (:func:`method_option_problem`: the methods, and the command that sets it on the others).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    parsed: dict[int, Any] = {}
    for i, arg in enumerate(argv):
        if (arg.startswith("-") and not arg.startswith("+")) or "=" not in arg:
            continue
        try:
            parsed[i] = parser.parse_override(arg)
        except HydraException:  # Hydra reports it when it composes
            continue
    multirun = any(a in ("-m", "--multirun") for a in argv)
    methods, form = _swept_methods(list(parsed.values()), multirun)
    if not methods:
        return argv
    out = list(argv)
    for i, ov in parsed.items():
        key = ov.key_or_group
        if not key.startswith("method.options.") or ov.is_delete():
            continue
        option = key.split(".")[2]
        problem = method_option_problem(ov.input_line, option, methods, form)
        if problem is not None:
            raise ValueError(problem)
        if not (ov.is_add() or ov.is_force_add()):
            out[i] = f"++{argv[i]}"
    return out


def launch(app: Callable[[], Any], prog: str, argv: list[str] | None = None) -> None:
    """Run the Hydra app ``app`` (a ``@hydra.main`` function) as the command ``prog``, with
    readable errors and clean signals.

    Exit codes: 0 done; 1 a job or figure failed (one line from the callback); 2 a bad command line
    or configuration; 130 Ctrl-C; 143 SIGTERM.
    """
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        sys.argv[1:] = shared_method_options(sys.argv[1:])
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    translate = not os.environ.get("HYDRA_FULL_ERROR")
    if translate:  # Hydra then raises composition errors instead of printing them and exiting
        os.environ["HYDRA_FULL_ERROR"] = "1"
    handler = _signal_handler(os.getpid())
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        app()
    except KeyboardInterrupt:
        end_children()
        print(
            f"{prog}: interrupted (Ctrl-C); finished runs are kept, rerun the same command to resume",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_SIGINT) from None
    except Terminated:
        end_children()
        print(f"{prog}: terminated (SIGTERM); finished runs are kept", file=sys.stderr)
        raise SystemExit(EXIT_SIGTERM) from None
    except Exception as exc:
        line = explain_hydra_error(exc) if translate else None
        if line is None:
            raise
        print(f"{prog}: error: {line}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if translate:
            os.environ.pop("HYDRA_FULL_ERROR", None)
