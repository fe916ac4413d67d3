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
(:func:`grid_runs`): they share the job's sampled sequences, each (sequence, method, cp_size) is
planned once and priced for every model and hardware profile. The executor
(:func:`flashcp.executors.execute`: ``sim``, ``dist`` or ``emulate``) turns plans into rows; this
module adds identity and provenance and writes the job's rows (one row per run, sequence and mode)
atomically as ``rows.parquet`` into its Hydra output folder, next to ``.hydra/`` and its log (by
default ``${results_dir}/${name}/runs/${run_key}``). The log line of a job gives its time in
sampling, planning, pricing and writing.

Identity. Every row carries the run's identity (:data:`flashcp.results.IDENTITY_COLUMNS`: every
value that changes its results, code version included) and ``run_id``, its hash, plus ``sweep_id``
and ``job_num`` of the invocation that wrote it.

Resume. A job whose ``rows.parquet`` already holds rows of exactly its runs (the same ``run_id``
values) is skipped. A job whose rows came from other code (``code_version`` differs) or from a failed attempt is redone, with a
warning that names both versions.

Failures. A bad value is refused before anything is written (:func:`checked_grid`, registered as
the launch check: every run's config, its dataset and hardware profile). A run of a grid that
cannot be made at its setting becomes error rows while the others run, and the job exits 1 with
one line counting the failed runs. A job that raises becomes
rows with ``status = "error: ..."`` and its traceback in its log;
the sweep goes on, and :mod:`experiments.common.callbacks` ends it with one line counting the failed jobs
and a non-zero exit code. A sequence whose planner or simulation fails is a row of its own.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf, open_dict

from experiments.common.callbacks import is_rank0, read_lock
from experiments.common.entry import CONF_DIR, log_job_error
from experiments.common.launch import PROG, launch, register_value_check, swept_keys
from experiments.common.overrides import (
    explicit_hardware_keys,
    explicit_keys,
    hardware_changes,
)
from experiments.common.overrides import json_text as _json
from flashcp.comm import AttnShape
from flashcp.config import (
    EXECUTOR_OPTIONS,
    USES_HARDWARE_PROFILE,
    MethodNotApplicable,
    check_config,
    check_dataset_config,
    register_configs,
)
from flashcp.executors import RunSpec, execute
from flashcp.executors.rows import error_status
from flashcp.results import (
    COMM_COLUMNS,
    IDENTITY_COLUMNS,
    PHASE_COLUMNS,
    config_hash,
    identity_hash,
    provenance,
    read_rows,
    runs_table,
    typed,
    write_rows_atomic,
)

log = logging.getLogger(__name__)

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


class ConfigError(ValueError):
    """A configuration value rejected before any work (the message names it)."""


def attn_shape(cfg: DictConfig) -> AttnShape:
    m = cfg.model
    step = [m.get(k) for k in ("num_layers", "hidden", "ffn", "vocab")]  # None: attention only
    return AttnShape(int(m.num_heads), int(m.num_kv_heads), int(m.head_dim), str(m.dtype), *step)


def step_model(m: Any) -> str:
    """The model around the attention layer as identity text: ``L<layers>-h<hidden>-f<ffn>-
    v<vocab>``, or ``-`` for an attention-only model (``num_layers`` null)."""
    if m.get("num_layers") is None:
        return "-"
    return f"L{int(m.num_layers)}-h{int(m.hidden)}-f{int(m.ffn)}-v{int(m.vocab)}"


def _container(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


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
            topo = _run_topology(cfg, loaded)
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
    nodes = cfg.get("nodes")
    key = _json([hw, int(cfg.cp_size), nodes, str(cfg.get("placement", "consecutive"))])
    if key not in memo:
        explicit = explicit_hardware_keys() if uses_hw else frozenset()
        if uses_hw:
            sha, spans = _hardware_sha256(hw, explicit, cfg)
            memo[key] = (_json(hardware_changes(hw, explicit)), sha, spans)
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


GRID_GROUPS = ("method", "model", "hardware")
#: what ``grid`` may vary inside one job: config groups (their options are files
#: ``conf/<group>/<name>.yaml``), ``cp_size`` and the CP group's ``nodes`` and ``placement``. The
#: sampled sequences are shared, so nothing that changes them (dataset, context_len, seed,
#: num_sequences) can be in a grid.
GRID_KEYS = (*GRID_GROUPS, "cp_size", "nodes", "placement")


def _group_option(group: str, name: str) -> DictConfig:
    """``conf/<group>/<name>.yaml`` composed as Hydra composes a group option: its ``defaults``
    (the group's schema ``base_*`` from the ConfigStore, or another option of the group) first,
    then the file itself.

    Raises:
        ConfigError: no such option (naming the valid ones), or a defaults entry it cannot read.
    """
    from hydra.core.config_store import ConfigStore

    path = Path(CONF_DIR) / group / f"{name}.yaml"
    if not path.is_file():
        valid = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"grid: no {group} {name!r}; choose from {', '.join(valid)}")
    node = OmegaConf.load(path)
    defaults = list(node.pop("defaults", []) or [])
    out = OmegaConf.create({})
    self_seen = False
    parts: list[Any] = []
    for entry in defaults:
        if entry == "_self_":
            parts.append(node)
            self_seen = True
        elif isinstance(entry, str) and entry.startswith("base_"):
            parts.append(
                OmegaConf.structured(ConfigStore.instance().load(f"{group}/{entry}.yaml").node)
            )
        elif isinstance(entry, str):
            parts.append(_group_option(group, entry))
        else:
            raise ConfigError(f"grid: cannot read defaults entry {entry!r} of {path}")
    if not self_seen:
        parts.append(node)
    for part in parts:
        out = OmegaConf.merge(out, part)
    return out


def grid_runs(cfg: DictConfig) -> list[DictConfig]:
    """The runs of one job: ``cfg`` itself when ``cfg.grid`` is empty, else one config per
    combination of the values in ``cfg.grid`` (:class:`flashcp.config.GridConfig`: lists for keys
    of :data:`GRID_KEYS`; a group value is an option name such as ``grid.model=[h16,h32]``), each
    equal to the config the overrides ``key=value`` would compose, with an empty grid. What the
    job sets inside a gridded group over its option's file (:func:`group_changes`:
    ``model.num_kv_heads=8``, ``method.impl``, ``method.options.*``, ``hardware.<constant>``) is
    kept by every run, as the overrides ``model=h16 model.num_kv_heads=8`` would. The runs share
    the job's sampled sequences, and under ``executor=sim`` each plan is made once and priced for
    every model and hardware profile.

    Raises:
        ConfigError: an unknown grid key or option, an empty list, a repeated value, or a grid under
            ``executor=dist`` or ``emulate`` (one run per job).
    """
    import itertools

    grid = {k: v for k, v in (_container(cfg.get("grid")) or {}).items() if v is not None}
    if not grid:
        return [cfg]
    bad = [k for k in grid if k not in GRID_KEYS]
    if bad:
        raise ConfigError(f"grid: cannot vary {', '.join(bad)}; choose from {', '.join(GRID_KEYS)}")
    if cfg.executor.name != "sim":
        raise ConfigError(
            f"grid is for executor=sim; executor={cfg.executor.name} runs one configuration per "
            "job (sweep it with -m instead)"
        )
    for k, values in grid.items():
        if not values:
            raise ConfigError(f"grid.{k} is empty; list at least one value or leave it null")
    _check_grid_repeats(grid)
    changes = {k: group_changes(cfg, k) for k in GRID_GROUPS if k in grid}
    loaded = {
        (k, v): OmegaConf.merge(_group_option(k, str(v)), changes[k])
        for k in GRID_GROUPS
        if k in grid
        for v in grid[k]
    }
    runs = []
    for combo in itertools.product(*grid.values()):
        run_cfg = cfg.copy()
        with open_dict(run_cfg):
            for k in run_cfg.grid:
                run_cfg.grid[k] = None
            for k, v in zip(grid, combo, strict=True):
                run_cfg[k] = loaded[(k, v)].copy() if k in GRID_GROUPS else v
        runs.append(run_cfg)
    return runs


def _check_grid_repeats(grid: dict[str, Any]) -> None:
    """Refuse a grid list that repeats a value (the same run twice), naming it.

    Raises:
        ConfigError: ``grid.cp_size=[4,4] lists 4 twice``.
    """
    for k, values in grid.items():
        values = list(values or ())
        twice = sorted({str(v) for v in values if values.count(v) > 1})
        if twice:
            raise ConfigError(
                f"grid.{k}=[{','.join(map(str, values))}] lists {', '.join(twice)} twice: the same "
                "run would be made twice; list each value once"
            )


def _changed(value: Any, base: Any) -> Any:
    """The parts of ``value`` (a plain mapping) that differ from ``base``; mappings recursively."""
    out = {}
    for k, v in value.items():
        b = base.get(k, _changed) if isinstance(base, dict) else _changed
        if isinstance(v, dict) and isinstance(b, dict):
            sub = _changed(v, b)
            if sub:
                out[k] = sub
        elif v != b:
            out[k] = v
    return out


def _group_choice(cfg: DictConfig, group: str) -> str:
    """The option of ``group`` the job composed: the group's ``name`` field (equal to its file's
    stem for every option in conf/), else Hydra's choice when running under Hydra."""
    from hydra.core.hydra_config import HydraConfig

    name = str(cfg[group].name)
    if (Path(CONF_DIR) / group / f"{name}.yaml").is_file() or not HydraConfig.initialized():
        return name
    return str(HydraConfig.get().runtime.choices.get(group) or name)


def group_changes(cfg: DictConfig, group: str) -> dict[str, Any]:
    """What the job's config sets over its ``group`` option's file (``model.num_kv_heads=8``,
    ``method.impl=...``, ``method.options.lns=false``, ``hardware.p2p_bw_gbps=50``, or what an
    experiment file sets): the settings a ``grid.<group>`` run keeps when it replaces the option
    (``name`` excepted: the grid names the option).

    Raises:
        ConfigError: the job's option has no file to compare with (its settings could not be kept).
    """
    choice = _group_choice(cfg, group)
    try:
        base = _container(_group_option(group, choice))
    except ConfigError:
        raise ConfigError(
            f"grid.{group}: the job's {group} {choice!r} is no file conf/{group}/{choice}.yaml, so "
            f"its overrides cannot be carried to the grid's {group}s; set {group}= to one of them"
        ) from None
    out = _changed(_container(cfg[group]), base)
    for key in explicit_keys(group):  # set on the command line, even to the file's own value
        value = OmegaConf.select(cfg[group], key, default=None)
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = _container(value)
    out.pop("name", None)
    return out


def run_spec(cfg: DictConfig, hardware: Any = None) -> RunSpec:
    """The :class:`flashcp.executors.RunSpec` of one run's config (``hardware``: its loaded
    profile, shared between runs with the same one so their plan statistics are shared)."""
    ex = cfg.executor
    uses_hw = ex.name in USES_HARDWARE_PROFILE
    return RunSpec(
        method=str(cfg.method.name),
        cp_size=int(cfg.cp_size),
        shape=attn_shape(cfg),
        modes=tuple(cfg.modes),
        options=_container(cfg.method.options),
        impl=str(cfg.method.get("impl", "ours")),
        hardware=hardware if hardware is not None or not uses_hw else _container(cfg.hardware),
        seed=int(cfg.seed),
        executor={k: _container(v) for k, v in ex.items() if k != "name"},
        placement=str(cfg.get("placement", "consecutive")),
        nodes=None if cfg.get("nodes") is None else int(cfg.nodes),
    )


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


def _grid_label(cfg: DictConfig, run_cfg: DictConfig) -> str:
    """``method=ulysses cp_size=16``: the values of the job's grid that ``run_cfg`` takes."""
    gridded = [k for k, v in (_container(cfg.get("grid")) or {}).items() if v]
    return " ".join(f"{k}={run_cfg[k].name if k in GRID_GROUPS else run_cfg[k]}" for k in gridded)


def _grid_method_options(cfg: DictConfig) -> None:
    """Refuse a planner option the job sets (``method.options.<key>``, kept by every run of
    ``grid.method``) that a method of the grid does not take, naming those methods and the grid
    that sets it on the others (:func:`experiments.common.launch.method_option_problem`)."""
    from experiments.common.launch import method_option_problem

    methods = (_container(cfg.get("grid")) or {}).get("method") or []
    if not methods:
        return
    options = group_changes(cfg, "method").get("options") or {}
    form = f"grid.method=[{','.join(map(str, methods))}]"
    for key, value in options.items():
        override = f"method.options.{key}={_json(value)}"
        problem = method_option_problem(override, str(key), [str(m) for m in methods], form)
        if problem is not None:
            raise ConfigError(problem)


def checked_grid(cfg: DictConfig) -> tuple[list[DictConfig], dict[int, str]]:
    """:func:`grid_runs` with every run's config checked (:func:`flashcp.config.check_config`)
    and its method options converted to their declared types where a word stands for a boolean
    (``lns=no`` reaches the planner as False, and is the same run as ``lns=false``).

    A grid's runs are checked each (a ``method.impl`` or ``method.options.*`` against every
    method of ``grid.method``, not against the job's own ``method``). A run that cannot be made
    at its setting while the grid's other runs can (a head-parallel method whose degree the
    model's heads do not allow, :class:`flashcp.config.MethodNotApplicable`: ``ulysses`` at
    cp_size 16 with 24 heads; or any check that its method passes at another setting of the
    grid) is returned with its reason, to become error rows while the others run. A value
    wrong for a method at every setting of the grid (``method.impl=ring_flash_attn`` beside
    ``flashcp``), or for every run, is refused.

    Returns:
        runs: every run of the grid (:func:`grid_runs`'s order).
        inapplicable: run index -> why that run cannot be made (``grid run method=... : ...``).
    Raises:
        ConfigError: a bad value (naming it): every run fails its check, a planner option a
            method of the grid does not take, a bad hardware constant.
    """
    try:
        runs = grid_runs(cfg)
        _grid_method_options(cfg)
        failed: dict[int, ValueError] = {}
        for i, r in enumerate(runs):
            try:
                check_config(r, dataset=False)  # the runs share the job's dataset: checked once
            except ConfigError:
                raise
            except ValueError as exc:
                failed[i] = exc
        for i in failed:  # a value no method takes (cp_size=0): refused, never error rows
            where = f"grid run {_grid_label(cfg, runs[i])}: " if len(runs) > 1 else ""
            try:
                _check_setting(runs[i])
            except ValueError:  # the run's own message: it names the method's valid values
                raise ConfigError(f"{where}{failed[i]}") from None
        made = {str(r.method.name) for i, r in enumerate(runs) if i not in failed}
        for i, exc in failed.items():  # wrong for the method everywhere, or no run at all
            if len(failed) == len(runs) or not (
                isinstance(exc, MethodNotApplicable) or str(runs[i].method.name) in made
            ):
                where = f"grid run {_grid_label(cfg, runs[i])}: " if len(runs) > 1 else ""
                raise ConfigError(f"{where}{exc}")
        check_dataset_config(cfg.dataset, int(cfg.context_len))
        _check_hardware(runs)
        _check_rows_memory(cfg, len(runs) - len(failed))
        inapplicable = {i: f"grid run {_grid_label(cfg, runs[i])}: {m}" for i, m in failed.items()}
        return [r if i in failed else _coerce_bool_options(r) for i, r in enumerate(runs)], (
            inapplicable
        )
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


#: bytes a job holds per row (one sequence, run and mode) at its peak: its plan, metrics and row;
#: measured ~3 KiB (peak RSS, flashcp at cp_size 8, 128K context, 2,000 vs 20,000 sequences)
ROW_BYTES = 4 * 2**10


def _check_rows_memory(cfg: DictConfig, num_runs: int) -> None:
    """Refuse a job whose rows (``num_sequences`` x runs x modes, :data:`ROW_BYTES` each) would
    not fit the memory available (``MemAvailable``), before any work: a huge ``num_sequences``
    would otherwise run until the process is killed for memory.

    Raises:
        ConfigError: naming ``num_sequences``, the estimate, the memory and the most that fit.
    """
    from flashcp.executors.emulate import available_memory_bytes

    have = available_memory_bytes("cpu")
    per_seq = ROW_BYTES * max(num_runs, 1) * len(cfg.modes)
    need = int(cfg.num_sequences) * per_seq
    if have is not None and need > have:
        raise ConfigError(
            f"num_sequences = {cfg.num_sequences} makes {int(cfg.num_sequences) * max(num_runs, 1) * len(cfg.modes)} "
            f"rows ({max(num_runs, 1)} run(s) x {len(cfg.modes)} mode(s)), about {need / 2**30:.1f} GiB at "
            f"~{ROW_BYTES // 2**10} KiB a row, but {have / 2**30:.1f} GiB is available; use at most "
            f"num_sequences={have // per_seq} per job (more with other seed= values)"
        )


def _check_setting(run_cfg: DictConfig) -> None:
    """The checks of a run's values that hold whatever its method: ``1 <= cp_size <=
    MAX_CP_SIZE``, ``context_len`` a multiple of ``cp_size``, the model's head shape. A grid
    value failing one (``grid.cp_size=[4,0]``) is a bad value, not a run that cannot be made.

    Raises:
        ValueError: naming the bad value.
    """
    from flashcp.config import check_model_config
    from flashcp.plan import check_context_len

    check_context_len(int(run_cfg.context_len), run_cfg.cp_size)  # checks cp_size's range too
    check_model_config(run_cfg.model)


def _checked_runs(cfg: DictConfig) -> list[DictConfig]:
    """The runs of :func:`checked_grid` that can be made (the check ``flashcp-run`` registers
    for a single run: it raises for a bad value and lets a grid's inapplicable runs pass), and
    under ``executor=emulate`` the job's memory (:func:`_check_emulate_memory`)."""
    runs, inapplicable = checked_grid(cfg)
    made = [r for i, r in enumerate(runs) if i not in inapplicable]
    for r in made:
        if r.executor.name == "emulate":
            _check_emulate_memory(cfg, r)
    return made


def _check_emulate_memory(cfg: DictConfig, run_cfg: DictConfig) -> None:
    """Sample and plan the job's sequences as the job will and refuse, before its folder is
    written, a plan whose record pass needs more memory than the device has
    (:func:`flashcp.executors.emulate.check_job_memory`; ``executor.check_memory=false`` skips
    it). Planning is cheap beside the replay it guards.

    Raises:
        ConfigError: naming the estimate and the memory available.
    """
    if not bool(run_cfg.executor.get("check_memory", True)):
        return
    from flashcp.data import sample_dataset
    from flashcp.executors.emulate import check_job_memory
    from flashcp.executors.rows import plan_sequences

    ds = cfg.dataset
    seqs, _ = sample_dataset(
        str(ds.name), int(cfg.num_sequences), int(cfg.context_len), seed=int(cfg.seed),
        weighting=str(ds.weighting), cap=None if ds.cap is None else int(ds.cap),
        overlong=str(ds.overlong), path=ds.path,
    )  # fmt: skip
    spec = run_spec(run_cfg)
    try:
        check_job_memory(spec, plan_sequences(spec, seqs).plans)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_hardware(runs: list[DictConfig]) -> None:
    """Load every distinct hardware profile the runs price with (sim, emulate) as the job will
    (:func:`flashcp.sim.load_hardware`, the command line's constants winning over the fitted
    ones), so a bad constant (``hardware.p2p_bw_gbps=0``) is refused before any work.

    Raises:
        ConfigError: naming the bad constant (and the profile, in a hardware grid).
    """
    from flashcp.sim import load_hardware
    from flashcp.sim.network import topology_for

    explicit = explicit_hardware_keys()
    seen: dict[str, Any] = {}
    for r in runs:
        if r.executor.name not in USES_HARDWARE_PROFILE:
            continue
        hw = _container(r.hardware)
        key = _json(hw)
        where = f"hardware={hw.get('name')}: " if len(runs) > 1 else ""
        try:
            if key not in seen:
                seen[key] = load_hardware(hw, explicit=explicit)
            _run_topology(r, seen[key], topology_for)
        except ValueError as exc:
            raise ConfigError(f"{where}{exc}") from None


def _run_topology(r: DictConfig, hw: Any, topology_for=None):
    """The run's :class:`flashcp.topology.Topology` on the loaded profile ``hw`` (None: flat
    profile). Raises ValueError (one line) for nodes / placement that do not fit."""
    if topology_for is None:
        from flashcp.sim.network import topology_for
    nodes = r.get("nodes")
    return topology_for(
        hw, int(r.cp_size), str(r.get("placement", "consecutive")),
        None if nodes is None else int(nodes),
    )  # fmt: skip


def _shared_values(config: DictConfig) -> None:
    """The sweep check of ``flashcp-run`` (``-m``): the dataset (:func:`flashcp.config.check_dataset_config`),
    the hardware profile (:func:`_check_hardware`), a repeated grid value and the method options
    a ``grid.method`` keeps
    (:func:`_grid_method_options`) every job of the sweep shares, each when no
    swept key (:func:`experiments.common.launch.swept_keys`) changes it, so a bad shared value is
    refused before any job instead of failing every job. ``config``: the sweep's composed config.

    Raises:
        ConfigError: naming the bad value.
    """
    swept = swept_keys(config)

    def varies(*prefixes: str) -> bool:
        return any(k == p or k.startswith(f"{p}.") for k in swept for p in prefixes)

    try:
        if not varies("dataset", "context_len") and int(config.context_len) >= 1:
            check_dataset_config(config.dataset, int(config.context_len))
        if not varies("grid"):
            _check_grid_repeats(_container(config.get("grid")) or {})
        if not varies("method", "grid"):
            _grid_method_options(config)
        grid_hw = (_container(config.get("grid")) or {}).get("hardware")
        if not varies("hardware", "executor", "grid") and not grid_hw:
            _check_hardware([config])
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _coerce_bool_options(cfg: DictConfig) -> DictConfig:
    """``cfg``, or a copy of it whose ``method.options`` hold a boolean wherever a value checked
    as a boolean (:func:`flashcp.registry.check_options`) was written as a word (``no``, ``off``,
    ``"false"``). ``cfg`` itself is not changed (its ``run_key`` names the job's folder)."""
    import copy

    from flashcp.registry import check_options

    raw = _container(cfg.method.options) or {}
    words = {
        k: v
        for k, v in check_options(str(cfg.method.name), raw).items()
        if isinstance(v, bool) and not isinstance(raw[k], bool)
    }
    if not words:
        return cfg
    out = copy.deepcopy(cfg)
    with open_dict(out):
        for k, v in words.items():
            out.method.options[k] = v
    return out


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
