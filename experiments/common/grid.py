"""The runs of one ``flashcp-run`` job and the checks made before any work (moved out of
:mod:`experiments.run`, which calls them).

:func:`grid_runs` expands a job's ``grid`` into one config per combination (a gridded group keeps
what the job set over its option's file, :func:`group_changes`); :func:`checked_grid` checks every
run's config and tells the runs that cannot be made at their setting from the values no run takes
(:class:`ConfigError`); :func:`_checked_runs` and :func:`_shared_values` are the launch checks
``flashcp-run`` registers (one job; the values a sweep's jobs share). :func:`run_spec` is the
:class:`flashcp.executors.RunSpec` of one run's config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from experiments.common.entry import CONF_DIR
from experiments.common.launch import swept_keys
from experiments.common.overrides import explicit_hardware_keys, explicit_keys
from experiments.common.overrides import json_text as _json
from flashcp.comm import AttnShape
from flashcp.config import (
    USES_HARDWARE_PROFILE,
    MethodNotApplicable,
    check_config,
    check_dataset_config,
)
from flashcp.executors import RunSpec


class ConfigError(ValueError):
    """A configuration value rejected before any work (the message names it)."""


def attn_shape(cfg: DictConfig) -> AttnShape:
    m = cfg.model
    step = [m.get(k) for k in ("num_layers", "hidden", "ffn", "vocab")]  # None: attention only
    return AttnShape(int(m.num_heads), int(m.num_kv_heads), int(m.head_dim), str(m.dtype), *step)


def _container(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


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
    from flashcp.executors.emulate_memory import available_memory_bytes

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
    (:func:`flashcp.executors.emulate_memory.check_job_memory`; ``executor.check_memory=false`` skips
    it). Planning is cheap beside the replay it guards.

    Raises:
        ConfigError: naming the estimate and the memory available.
    """
    if not bool(run_cfg.executor.get("check_memory", True)):
        return
    from flashcp.data import sample_dataset
    from flashcp.executors.emulate_memory import check_job_memory
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
    ones), so a bad constant (``hardware.p2p_bw_gbps=0``) is refused before any work; under
    ``executor=dist`` the run's ``nodes`` / ``placement`` against where torchrun put the ranks
    (:func:`flashcp.executors.dist.launch_problem`).

    Raises:
        ConfigError: naming the bad constant (and the profile, in a hardware grid).
    """
    from flashcp.sim import load_hardware

    explicit = explicit_hardware_keys()
    seen: dict[str, Any] = {}
    for r in runs:
        if r.executor.name == "dist":
            from flashcp.executors.dist import launch_problem

            nodes = r.get("nodes")
            problem = launch_problem(
                int(r.cp_size), None if nodes is None else int(nodes),
                str(r.get("placement", "consecutive")),
            )  # fmt: skip
            if problem is not None:
                raise ConfigError(problem)
        if r.executor.name not in USES_HARDWARE_PROFILE:
            continue
        hw = _container(r.hardware)
        key = _json(hw)
        where = f"hardware={hw.get('name')}: " if len(runs) > 1 else ""
        try:
            if key not in seen:
                seen[key] = load_hardware(hw, explicit=explicit)
            topo = run_topology(r, seen[key])  # nodes / placement that do not fit: one line
            _check_planner_topology(r, topo)
        except ValueError as exc:
            raise ConfigError(f"{where}{exc}") from None


def _check_planner_topology(r: DictConfig, topo: Any) -> None:
    """A planner that takes the topology (``flashcp_node``: ``num_nodes``, ``placement``,
    ``gpus_per_node``, which conf/method/flashcp_node.yaml takes from the run) must plan for the
    run's CP group (``topo``, None: one node), which the simulator prices (docs/scale.md).

    Raises:
        ValueError: (one line) naming the method options that place the ranks elsewhere.
    """
    import numpy as np

    from flashcp.planners.flashcp_node import _check_topology
    from flashcp.registry import option_names

    method = str(r.method.name)
    if "num_nodes" not in option_names(method):
        return
    o = r.method.get("options") or {}
    nodes, gpn = o.get("num_nodes"), o.get("gpus_per_node")
    placement = str(o.get("placement", "consecutive"))
    own = _check_topology(int(r.cp_size), nodes, placement, gpn)
    run_nodes = np.zeros(int(r.cp_size), dtype=np.int64) if topo is None else topo.node_of
    if not np.array_equal(own.node_of, run_nodes):
        where = "a flat network" if topo is None else topo.describe()
        raise ValueError(
            f"method.options num_nodes={nodes} placement={placement} gpus_per_node={gpn} plan "
            f"{method} for {own.describe()}, but the run prices {where}; leave them to the run's "
            "nodes, placement and hardware.gpus_per_node"
        )


def run_topology(r: DictConfig, hw: Any):
    """The run's :class:`flashcp.topology.Topology` on the loaded profile ``hw`` (None: a flat
    profile; :func:`flashcp.sim.network.topology_for`).

    Raises:
        ValueError: (one line) nodes / placement that do not fit the profile's nodes.
    """
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
