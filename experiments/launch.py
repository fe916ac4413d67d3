"""How ``flashcp-run`` starts and stops: readable errors, launch checks and signals.

    flashcp-run ...              # console entry point: experiments.launch:main
    python -m experiments.run    # the same (torchrun uses this form)

:func:`main` wraps the Hydra app (:func:`experiments.run.main`) so that a person sees one line
instead of a traceback or a page of Hydra internals:

* Composition errors become one line naming the bad value and the valid choices
  (:func:`explain_hydra_error`): an unknown group option (``method=nope``: the options, without the
  internal ``base_*`` schemas), an unknown key (``cp_sise=4``: the closest keys), a value of the
  wrong type (``cp_size=abc``: the type the field takes), an override Hydra cannot parse. Exit
  code 2. ``HYDRA_FULL_ERROR=1`` keeps Hydra's own report.
* Launch mistakes that Hydra would silently accept are refused before any job starts
  (:func:`launch_problem`, called by :class:`experiments.callbacks.AggregateResults`): a sweep over
  experiment configs (``-m experiment=fig6,fig7``: Hydra composes the sweep before choosing the
  experiment, so the sweeps they define are skipped), a launcher without ``-m`` (a single run
  ignores ``hydra/launcher``), an experiment that defines a sweep run without ``-m``, a key
  added with ``+`` that no schema has (``+cp_sise=4`` would run with the default ``cp_size``), and
  ``executor=dist`` under a submitit launcher whose tasks per job differ from ``cp_size``.
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
from collections.abc import Iterable
from typing import Any

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
    hint = (
        f"did you mean {' or '.join(prefix + c for c in close)}?"
        if close
        else f"keys {where}: {', '.join(fields)}"
    )
    return f"unknown key {key} (in {override}); {hint}"


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
        return f"{group}={option}: no such option; choose one of {_names(exc.options)}"
    if isinstance(exc, OverrideParseException):
        reason = str(exc.message).splitlines()[0]
        return f"cannot parse {exc.override!r}: {reason} (https://hydra.cc/docs/1.3/advanced/override_grammar/basic)"
    if isinstance(exc, ConfigCompositionException):
        cause = exc.__cause__
        override = _override_in(str(exc))
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
            return unknown_key_message(str(cause.full_key), override, cause.object_type)
        if isinstance(cause, ValidationError) and cause.full_key:
            key = str(cause.full_key)
            schema = cause.object_type
            value = override.split("=", 1)[-1] if "=" in override else "?"
            return f"{override}: {key} takes {_field_type(schema, key.rsplit('.', 1)[-1])}, got {value!r}"
        text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        if text.startswith("Ambiguous value for argument"):  # a sweep without -m
            text = text.split(" 1. ", 1)[0] + "; add -m to sweep over it, or write [a,b] for a list"
        return text or None
    if isinstance(exc, ValueError) and _raised_in_hydra(exc):  # a command-line usage error
        return str(exc).strip().splitlines()[0]
    return None


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
    default ``cp_size``. Keys under untyped mappings (``method.options``, ``hardware``, ``table2``)
    stay open: their owners check them.
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


def _is_sweep(config: Any, key: str) -> str | None:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for ov in OverridesParser.create().parse_overrides(list(config.hydra.overrides.task)):
        if ov.key_or_group == key and ov.is_sweep_override():
            return ov.input_line
    return None


def launch_problem(config: Any, multirun: bool) -> str | None:
    """What is wrong with how this invocation was launched (one line saying what to write
    instead), or None. ``config`` is the composed config with its ``hydra`` node, as a Hydra
    callback receives it at ``on_run_start`` / ``on_multirun_start``."""
    choices = config.hydra.runtime.choices
    experiment = choices.get("experiment")
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
            f"add -m ({PROG} -m hydra/launcher={launcher} ...)"
        )
    params = config.hydra.sweeper.get("params") or {}
    if not multirun and experiment and params:
        swept_keys = ", ".join(str(k) for k in params)
        return (
            f"experiment={experiment} defines a sweep (over {swept_keys}) that a single run skips; "
            f"add -m ({PROG} -m experiment={experiment}), or hydra.sweeper.params=null to run one "
            "configuration of it"
        )
    ranks = _submitit_ranks(config)
    if ranks is not None and config.executor.name == "dist" and not _is_sweep(config, "cp_size"):
        if int(config.cp_size) != ranks:
            hl = config.hydra.launcher
            return (
                f"executor=dist with cp_size={config.cp_size}, but hydra/launcher={launcher} starts "
                f"{ranks} task(s) per job, one rank each (hydra.launcher.nodes={hl.nodes} x "
                f"tasks_per_node={hl.tasks_per_node}); make nodes x tasks_per_node = cp_size "
                "(slurm_dist: tasks_per_node follows hydra.launcher.gpus_per_node)"
            )
    added = added_unknown_keys(config)
    return added[0] if added else None


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


def main(argv: list[str] | None = None) -> None:
    """Console entry point ``flashcp-run``: the Hydra app with readable errors and clean signals.

    Exit codes: 0 done; 1 a job or figure failed (one line from the callback); 2 a bad command line
    or configuration; 130 Ctrl-C; 143 SIGTERM.
    """
    from experiments.run import main as app

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
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
            f"{PROG}: interrupted (Ctrl-C); finished runs are kept, rerun the same command to resume",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_SIGINT) from None
    except Terminated:
        end_children()
        print(f"{PROG}: terminated (SIGTERM); finished runs are kept", file=sys.stderr)
        raise SystemExit(EXIT_SIGTERM) from None
    except Exception as exc:
        line = explain_hydra_error(exc) if translate else None
        if line is None:
            raise
        print(f"{PROG}: error: {line}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if translate:
            os.environ.pop("HYDRA_FULL_ERROR", None)
