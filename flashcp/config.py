"""Typed configuration schemas for the Hydra app (``conf/``), registered in Hydra's ConfigStore.

Every YAML file of a group extends its group's schema (``defaults: [base_<group>]``), so a
misspelt key or a value of the wrong type fails when Hydra composes the config, before any work.
Names with a fixed set of values are enums (:class:`Executor`, :class:`Overlong`,
:class:`Weighting`, :class:`flashcp.data.DatasetName`: a bad one fails at compose time, listing the valid ones); the
``hardware`` group is typed by :data:`HardwareConfig`, one field per simulator constant. Units are
in field names or comments; :func:`check_config` checks what a type alone cannot pin down (method
names and options against the method registry, divisibility, ranges).

Two kinds of primary config:

* ``conf/config.yaml`` (:class:`RunConfig`), the sweeps of ``flashcp-run``: one run = one
  (dataset, method, cp_size, model) over sampled sequences, priced or executed;
* one per experiment that writes its own tables (``conf/table2.yaml``, ``flashcp-table2``, ...),
  typed by a schema of its own that lives beside the experiment (``experiments/table2.py``) and
  uses the group schemas here (:class:`DatasetConfig`, :class:`ModelConfig`,
  :data:`HardwareConfig`).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from omegaconf import MISSING

from flashcp.data.datasets import DatasetName
from flashcp.sim.hardware import HardwareProfile

__all__ = [
    "DatasetConfig",
    "EmulateExecutorConfig",
    "Executor",
    "ExecutorConfig",
    "GridConfig",
    "HardwareConfig",
    "MethodConfig",
    "MethodNotApplicable",
    "MethodOption",
    "ModelConfig",
    "Overlong",
    "RunConfig",
    "Weighting",
    "check_config",
    "check_dataset_config",
    "check_method_heads",
    "check_modes",
    "method_option",
    "register_configs",
]


class Executor(StrEnum):
    """How a plan is run (docs/design.md §4)."""

    #: the analytic simulator on a hardware profile, anywhere
    sim = "sim"
    #: real ranks over torch.distributed (NCCL on GPUs, gloo on CPU)
    dist = "dist"
    #: every rank's real work replayed on one device, communication priced by the profile
    emulate = "emulate"


class Overlong(StrEnum):
    """What happens to a document longer than ``context_len`` (see :class:`DatasetConfig`)."""

    split = "split"
    cut = "cut"
    error = "error"


class Weighting(StrEnum):
    """How documents are drawn (:data:`flashcp.data.WEIGHTINGS`, see :class:`DatasetConfig`)."""

    documents = "documents"
    tokens = "tokens"


# Members are lower case, equal to their values: OmegaConf writes and reads enums by member name,
# and rows, run folders and saved configs keep the strings they always had.
#: executor -> its options that change a run's results (part of the run identity); a new
#: executor is one more member of :class:`Executor`, one line here and its conf/executor/<name>.yaml
EXECUTOR_OPTIONS: MappingProxyType[Executor, tuple[str, ...]] = MappingProxyType({
    Executor.sim: (),
    Executor.dist: ("backend", "warmup", "iters"),
    Executor.emulate: ("backend", "warmup", "iters", "ranks", "nccl_traffic"),
})  # fmt: skip
EXECUTORS = tuple(Executor)
#: executors whose results depend on the ``hardware`` profile (part of their identity); emulate
#: prices communication with it
USES_HARDWARE_PROFILE = frozenset({Executor.sim, Executor.emulate})
OVERLONG = tuple(Overlong)


@dataclass
class DatasetConfig:
    """Where document lengths come from (docs/design.md §5)."""

    #: wlb_llm | pile | redpajama | wlb_llm_synthetic | stress | file (:class:`flashcp.data.DatasetName`)
    name: DatasetName = MISSING
    #: for name=file: a text/CSV/.npy file of document lengths (tokens), one per document. Other
    #: datasets do not read it; flashcp-run refuses it on a command line that selects no
    #: dataset=file (experiments.common.launch.dataset_path_problem)
    path: str | None = None
    #: documents (a draw is a document) | tokens (length-biased: d drawn with prob. ∝ d·p(d))
    weighting: Weighting = Weighting.documents
    #: cap on a single draw, tokens, applied before cutting to the context (null: 4 x context_len)
    cap: int | None = None
    #: a document longer than context_len: split (into consecutive documents of at most
    #: context_len tokens, as a data loader streaming documents into sequences does; no token is
    #: lost) | cut (to context_len, the rest discarded, counted in overlong_tokens_cut and warned
    #: about) | error (refuse, before any work, a dataset that has such documents)
    overlong: Overlong = Overlong.split


@dataclass
class MethodConfig:
    """A CP method (planner + communication pattern), docs/design.md §3."""

    #: a registered method (flashcp.registry.method_names(): llama3, per_doc, ring, zigzag, flashcp,
    #: flashcp_refined, ilp); checked against the registry by check_config
    name: str = MISSING
    #: planner options passed as keyword arguments (e.g. target_imbalance for flashcp;
    #: block_size, time_limit_s, gap, solver for ilp), checked against the method's options
    #: dataclass (flashcp.registry.options_schema) by check_config
    options: dict[str, Any] = field(default_factory=dict)
    #: implementation of the layout: ours (this project's ops) | ring_flash_attn (the
    #: ring-flash-attn package, for ring, zigzag, llama3; docs/design.md §4)
    impl: str = "ours"


@dataclass
class ModelConfig:
    """One attention layer's shape."""

    name: str = MISSING
    #: query heads
    num_heads: int = 32
    #: KV heads (GQA), divides num_heads
    num_kv_heads: int = 32
    #: head dimension
    head_dim: int = 128
    #: bfloat16 | float16 | float32
    dtype: str = "bfloat16"
    #: the whole model around the layer, for the step model (flashcp.sim.step): decoder layers,
    #: hidden size, MLP intermediate size, vocabulary; all null (one attention layer) or all set
    num_layers: int | None = None
    hidden: int | None = None
    ffn: int | None = None
    vocab: int | None = None


@dataclass
class ExecutorConfig:
    """How a plan is run: analytic simulator or real torch.distributed ranks."""

    #: sim | dist | emulate
    name: Executor = Executor.sim
    #: attention kernel backend for dist: auto | flash_attn | torch_cuda | cpu | reference
    backend: str = "auto"
    #: untimed warm-up steps before timing (dist)
    warmup: int = 1
    #: timed steps; the median is reported (dist)
    iters: int = 3
    #: timeout of every collective, seconds (dist)
    timeout_s: float = 120.0


@dataclass
class EmulateExecutorConfig(ExecutorConfig):
    """``executor=emulate`` (:mod:`flashcp.executors.emulate`): every rank's real work replayed
    on one device; ``backend``, ``warmup``, ``iters`` as for dist, ``timeout_s`` bounds the record
    pass's collectives. Communication is priced by the ``hardware`` profile."""

    name: Executor = Executor.emulate
    #: ranks to replay (null: all); the row reports the slowest of them per phase
    ranks: list[int] | None = None
    #: CUDA only: copy each ring message on a second stream while the rank computes
    nccl_traffic: bool = False
    #: refuse, before any record pass, a plan whose estimated memory exceeds the device's
    #: (:func:`flashcp.executors.emulate_memory.record_memory_bytes`); results do not depend on it
    check_memory: bool = True


def _hardware_schema() -> type:
    """``HardwareConfig``: the typed schema of the ``hardware`` group, one field per constant of
    :class:`flashcp.sim.hardware.HardwareProfile` (whose docstring gives each unit and meaning)
    plus ``calibration``, so the two cannot drift apart. Every constant is mandatory (a profile
    sets it or extends one that does) except those with a default (the per-size collective
    tables, none by default; ``alltoall_busbw_gbps``: None, null follows another constant); curves
    are lists (message sizes in whole KiB)."""
    hints = typing.get_type_hints(HardwareProfile)
    fields: list[tuple] = []
    for f in dataclasses.fields(HardwareProfile):
        if not f.init:
            continue
        hint = hints[f.name]
        if f.name == "busbw_curve_size_kib":
            hint = list[int]
        elif typing.get_origin(hint) is tuple:
            hint = list[float]
        default = MISSING if f.default is dataclasses.MISSING else f.default
        fields.append((f.name, hint, field(default=default)))
    #: sections of results/calibration/fitted_constants.yaml loaded over the constants
    fields.append(("calibration", list[str], field(default_factory=list)))
    return dataclasses.make_dataclass(
        "HardwareConfig", fields, namespace={"__doc__": _hardware_schema.__doc__}
    )


#: the ``hardware`` group's schema (conf/hardware/*.yaml extend it, directly or through another
#: profile: ``h100_ib`` is ``h100_sxm`` with its network constants replaced)
HardwareConfig = _hardware_schema()


@dataclass
class GridConfig:
    """``executor=sim``: the runs of one job, sharing its sampled sequences and plans
    (``experiments.common.grid.grid_runs``). Each combination of the listed values is its own run
    (its own ``run_id`` and identity), equal to the run the overrides ``key=value`` would configure,
    with every setting the job makes inside a gridded group kept (``model.num_kv_heads=8``,
    ``method.impl``, ``method.options.*``, ``hardware.<constant>``); null leaves the job's own
    value. A plain override of a gridded key (``cp_size=2`` beside ``grid.cp_size``) is refused
    by flashcp-run (``experiments.common.launch.grid_override_problem``). Plans are made once per
    (sequence, method, cp_size) and priced for every model and hardware profile."""

    #: method options (conf/method/), e.g. [llama3, flashcp]
    method: list[str] | None = None
    #: model options (conf/model/), e.g. [h16, h32]
    model: list[str] | None = None
    #: hardware profiles (conf/hardware/), e.g. [h100_sxm, a100_sxm]
    hardware: list[str] | None = None
    #: CP sizes, e.g. [4, 8]
    cp_size: list[int] | None = None
    #: nodes the CP group spans (docs/multinode.md), e.g. [2, 4]; every run of the grid must
    #: fit (a node count that does not divide a run's cp_size is refused)
    nodes: list[int] | None = None
    #: placements of the CP ranks on the nodes, e.g. [consecutive, strided]
    placement: list[str] | None = None


@dataclass
class RunConfig:
    """Top-level config of one run: one (dataset, method, cp_size, model) over sampled sequences."""

    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    #: hardware profile of the simulator and of emulate's communication model (conf/hardware/*.yaml;
    #: typed here, values checked by flashcp.sim.load_hardware)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    #: experiment name: results go to ${results_dir}/${name}
    name: str = "default"
    #: folder name of one run inside ${results_dir}/${name}/runs (interpolated in config.yaml)
    run_key: str = "run"
    #: root folder of results; outputs/ is ignored by git (the committed reference results are
    #: in results/: write there with results_dir=results)
    results_dir: str = "outputs"
    #: N, number of CP ranks
    cp_size: int = 8
    #: nodes the CP group spans on the hardware profile's nodes of ``gpus_per_node`` GPUs
    #: (docs/multinode.md); null: as few as ``placement`` allows (one node up to gpus_per_node
    #: ranks, consecutive); a flat profile (gpus_per_node null, h100_ib) takes only null or 1
    nodes: int | None = None
    #: where CP rank r sits: ``consecutive`` (filling nodes in rank order) or ``strided``
    #: (rank r on node r mod nodes; default nodes: one rank per node)
    placement: str = "consecutive"
    #: C, tokens per packed sequence
    context_len: int = 131072
    #: sequences sampled per run
    num_sequences: int = 200
    #: seed of the sampler (same seed -> same sequences for every method)
    seed: int = 0
    #: train (forward + backward) and/or infer (forward only)
    modes: list[str] = field(default_factory=lambda: ["train", "infer"])
    #: worker processes for planning + simulation (1 = in-process)
    workers: int = 1
    #: show a progress bar
    progress: bool = True
    #: figures to draw after a sweep: fig5 | fig6 | fig7
    plots: list[str] = field(default_factory=list)
    #: write the merged per-sequence rows (``<folder>/rows.parquet``) when a sweep ends; false
    #: (a paper-scale sweep) writes only summary.csv, each run's rows staying in runs/
    merged_rows: bool = True
    #: executor=sim: runs of this job that share its sequences and plans (see GridConfig)
    grid: GridConfig = field(default_factory=GridConfig)


#: config fields that change a run's results; their hash names the run's folder
RESULT_KEYS = (
    "dataset", "method", "model", "hardware", "executor", "cp_size", "context_len",
    "num_sequences", "seed", "modes", "grid", "nodes", "placement",
)  # fmt: skip


_LEGACY_TASK = "main"


def run_hash(*, _root_: Any) -> str:
    """OmegaConf resolver ``${run_hash:}``: 6 hex digits of the fields in :data:`RESULT_KEYS`, so
    two runs that differ in any of them (e.g. a swept ``model.num_heads``) get different folders,
    and rerunning the same config finds its finished folder again."""
    from omegaconf import OmegaConf

    from flashcp.results import config_hash

    picked = {
        k: OmegaConf.to_container(_root_[k], resolve=True)
        if OmegaConf.is_config(_root_[k])
        else _root_[k]
        for k in RESULT_KEYS
        if k in _root_
    }
    if not any((picked.get("grid") or {}).values()):  # no grid: the folder name it always had
        picked.pop("grid", None)
    if picked.get("nodes") is None:  # the default topology: the folder name it always had
        picked.pop("nodes", None)
    if picked.get("placement") == "consecutive":
        picked.pop("placement", None)
    if isinstance(picked.get("model"), dict):  # an attention-only model: the name it always had
        for k in ("num_layers", "hidden", "ffn", "vocab"):
            if picked["model"].get(k, 0) is None:
                picked["model"].pop(k)
    # the hash of a run folder keeps the ``task`` key configs had when one primary config also
    # ran Table 2, calibration, sensitivity and Fig. 3: existing folders keep their names and a
    # rerun finds them (resume)
    picked["task"] = _LEGACY_TASK
    return config_hash(picked)[:6]


def run_name(*, _root_: Any) -> str:
    """OmegaConf resolver ``${run_name:}``, the folder name of a job (``run_key``):
    ``<dataset>-<method>-cp<N>-h<heads>kv<kv_heads>-C<context_len>-<run_hash>``. A dimension the
    job's ``grid`` varies lists its values joined by ``+`` (``llama3+flashcp``, ``cp4+8``,
    ``h16+h32``; a hardware grid adds ``-h100_sxm+a100_sxm``)."""
    from omegaconf import OmegaConf

    grid = OmegaConf.to_container(_root_.grid) if "grid" in _root_ else {}
    grid = {k: v for k, v in (grid or {}).items() if v is not None}

    def part(key: str, single: str) -> str:
        return "+".join(str(v) for v in grid[key]) if key in grid else single

    m = _root_.model
    name = (
        f"{_root_.dataset.name}-{part('method', _root_.method.name)}-cp{part('cp_size', _root_.cp_size)}"
        f"-{part('model', f'h{m.num_heads}kv{m.num_kv_heads}')}"
    )
    if "hardware" in grid:
        name += f"-{part('hardware', '')}"
    return f"{name}-C{_root_.context_len}-{run_hash(_root_=_root_)}"


def register_configs() -> None:
    """Register the schemas of ``flashcp-run`` and of the config groups in Hydra's ConfigStore,
    and the ``run_hash`` and ``run_name`` resolvers (idempotent). An experiment with its own
    command registers its own schema (:func:`experiments.common.entry.register_experiment`)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("run_hash", run_hash, replace=True)
    OmegaConf.register_new_resolver("run_name", run_name, replace=True)

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RunConfig)
    cs.store(group="dataset", name="base_dataset", node=DatasetConfig)
    cs.store(group="method", name="base_method", node=MethodConfig)
    cs.store(group="model", name="base_model", node=ModelConfig)
    cs.store(group="hardware", name="base_hardware", node=HardwareConfig)
    cs.store(group="executor", name="base_executor", node=ExecutorConfig)
    cs.store(group="executor", name="base_emulate_executor", node=EmulateExecutorConfig)


class MethodNotApplicable(ValueError):
    """A method that cannot run at one setting (its Ulysses degree and the model's heads): in a
    grid of runs, that run is an error row while the others run
    (``experiments.common.grid.checked_grid``)."""


def check_config(cfg: Any, dataset: bool = True) -> None:
    """Check values a type cannot pin down; raise ValueError naming the bad value.

    Called before any work (and, for ``executor=dist``, before any collective) on a config composed
    against :class:`RunConfig` (the enums are checked by then). ``dataset``: also check the
    dataset as the sampler reads it (:func:`check_dataset_config`); a caller checking the runs of
    one job, which share it, checks it once.
    """
    from flashcp.registry import get_method

    get_method(cfg.method.name)  # ValueError naming the known methods
    from flashcp.plan import MAX_TOKENS, check_context_len, check_cp_args

    check_cp_args(0, cfg.cp_size)  # 1 <= cp_size <= MAX_CP_SIZE

    if cfg.context_len > MAX_TOKENS:
        raise ValueError(
            f"context_len = {cfg.context_len} is above MAX_TOKENS = 2**31 = {MAX_TOKENS}, the most "
            "tokens a packed sequence holds"
        )
    if cfg.seed < 0:
        raise ValueError(f"seed must be >= 0, got {cfg.seed}")
    if cfg.context_len < 1:
        raise ValueError(f"context_len must be >= 1, got {cfg.context_len}")
    from flashcp.registry import get_planner

    # the nearest valid ones for the method's layout (llama3: multiples of 2 * cp_size)
    chunks = getattr(get_planner(cfg.method.name), "chunks_per_rank", 1)
    check_context_len(int(cfg.context_len), int(cfg.cp_size), chunks)
    if dataset:
        check_dataset_config(cfg.dataset, int(cfg.context_len))
    if cfg.executor.name in ("dist", "emulate"):
        from flashcp.ops.backends import BACKENDS

        ex = cfg.executor
        if ex.backend not in BACKENDS:
            raise ValueError(
                f"unknown attention backend executor.backend={ex.backend!r}; choose one of "
                f"{', '.join(BACKENDS)}"
            )
        if ex.warmup < 0 or ex.iters < 1 or not ex.timeout_s > 0:
            raise ValueError(
                "executor.warmup must be >= 0, executor.iters >= 1 and executor.timeout_s > 0; got "
                f"warmup={ex.warmup}, iters={ex.iters}, timeout_s={ex.timeout_s}"
            )
    if cfg.executor.name == "emulate":
        ranks = cfg.executor.get("ranks")
        if ranks is not None and (not ranks or len(set(ranks)) != len(ranks)):
            raise ValueError(f"executor.ranks must be distinct and non-empty, got {list(ranks)}")
        for r in ranks or ():
            if not 0 <= r < cfg.cp_size:
                raise ValueError(
                    f"executor.ranks: rank {r} out of range for cp_size = {cfg.cp_size}"
                )
    if cfg.num_sequences < 1:
        raise ValueError(f"num_sequences must be >= 1, got {cfg.num_sequences}")
    from flashcp.executors.sim import check_workers

    check_workers(cfg.workers)
    check_modes(cfg.modes)
    m = cfg.model
    check_model_config(m)
    trial = check_method_options(
        cfg.method.name, cfg.method.options, int(cfg.context_len), int(cfg.cp_size)
    )
    check_method_heads(
        cfg.method.name, cfg.method.options, int(cfg.cp_size), int(m.num_heads),
        int(m.num_kv_heads), trial,
    )  # fmt: skip
    check_impl_config(cfg.method.name, cfg.method.get("impl", "ours"), cfg.executor.name)


def check_model_config(m: Any) -> None:
    """Check a model config's attention shape (:class:`flashcp.comm.AttnShape`). A head count
    that is not a multiple of the KV head count names where each came from (the model file's
    value, or one set on the command line) and the settings that fix it.

    Raises:
        ValueError: naming the bad value.
    """
    from flashcp.comm import AttnShape

    step = [m.get(k) for k in ("num_layers", "hidden", "ffn", "vocab")]  # None: attention only
    try:
        AttnShape(m.num_heads, m.num_kv_heads, m.head_dim, m.dtype, *step)
    except ValueError:
        h, kv = m.num_heads, m.num_kv_heads
        if not (isinstance(h, int) and isinstance(kv, int) and h >= 1 and kv >= 1 and h % kv):
            raise
        file = _model_file(str(m.get("name", "")))

        def what(key: str, v: int) -> str:
            return f"model={m.name}'s {key} = {v}" if file.get(key) == v else f"model.{key} = {v}"

        divisors = [d for d in range(1, h + 1) if h % d == 0]
        raise ValueError(
            f"{what('num_heads', h)} is not a multiple of {what('num_kv_heads', kv)}: set "
            f"model.num_kv_heads= to a divisor of {h} ({', '.join(map(str, divisors))}), e.g. "
            f"model.num_kv_heads={h}, or model.num_heads= to a multiple of {kv}"
        ) from None


def _model_file(name: str) -> dict[str, Any]:
    """The fields of ``conf/model/<name>.yaml`` ({} if there is no such readable file)."""
    import yaml

    from flashcp.resources import resource_path

    try:
        with (resource_path("conf") / "model" / f"{name}.yaml").open() as fh:
            data = yaml.safe_load(fh)
    except (OSError, ValueError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class MethodOption:
    """A method as one option of the ``method`` group configures it
    (``conf/method/<option>.yaml``; e.g. ``llama3_paper``: method ``llama3``, its all-gather op
    keeping the gathered KV).

    Attributes:
        option: the file's name; method: the registry method it runs (``name:``);
        impl: ``method.impl`` (``ours`` unless set); planner_options, op_options: its
        ``options``, split by :func:`flashcp.registry.split_options`.
    """

    option: str
    method: str
    impl: str
    planner_options: dict
    op_options: dict


def method_option(option: str) -> MethodOption:
    """``conf/method/<option>.yaml`` composed as Hydra composes a ``method=<option>`` choice: the
    options it names in ``defaults`` (other files of the group) first, then the file itself.

    Raises:
        ValueError: no such option (naming the valid ones), or one whose method is unknown.
    """
    from omegaconf import OmegaConf

    from flashcp.registry import get_method, split_options
    from flashcp.resources import resource_path

    folder = resource_path("conf") / "method"
    path = folder / f"{option}.yaml"
    if not path.is_file():
        valid = sorted(p.stem for p in folder.glob("*.yaml"))
        raise ValueError(f"no method option {option!r}; choose one of {', '.join(valid)}")
    node = OmegaConf.load(path)
    out = OmegaConf.create({"impl": "ours", "options": {}})
    for entry in node.pop("defaults", []) or []:
        if isinstance(entry, str) and not entry.startswith("base_") and entry != "_self_":
            base = method_option(entry)
            options = {**base.planner_options, **base.op_options}
            out = OmegaConf.merge(out, {"name": base.method, "impl": base.impl, "options": options})
    out = OmegaConf.merge(out, node)
    method = str(out.name)
    get_method(method)  # ValueError naming the known methods
    planner, ops = split_options(method, OmegaConf.to_container(out.options, resolve=True))
    return MethodOption(option, method, str(out.impl), planner, ops)


def check_dataset_config(ds: Any, context_len: int) -> None:
    """Check a :class:`DatasetConfig` as the sampler would read it, before any work: a length
    file (``dataset=file``) that is named, exists and reads as lengths, ``dataset.cap`` >= 1,
    the dataset's table, and ``dataset.overlong = error`` against its documents longer than
    ``context_len`` (:class:`flashcp.data.OverlongDocs`).

    Raises:
        ValueError: naming the bad value.
    """
    from flashcp.data import OverlongDocs, load_distribution

    if ds.name == "file" and ds.path is None:
        raise ValueError(
            "dataset=file needs dataset.path=<a file of lengths: text, CSV, Parquet, JSON or .npy>"
        )
    if ds.cap is not None and ds.cap < 1:
        raise ValueError(
            f"dataset.cap = {ds.cap} must be >= 1 (tokens, the longest single draw; null: "
            "4 x context_len)"
        )
    path = ds.path if ds.name == "file" else None  # other datasets do not read dataset.path
    dist = load_distribution(str(ds.name), context_len=context_len, path=path)
    cap = None if ds.cap is None else int(ds.cap)
    OverlongDocs(dist, context_len, str(ds.overlong), cap).check()


def check_modes(modes: Any) -> None:
    """Raise ValueError for an empty list of modes, an unknown mode or one listed twice."""
    from flashcp.comm import check_mode

    modes = list(modes)
    if not modes:
        raise ValueError("modes is empty; use [train], [infer] or [train, infer]")
    for mode in modes:
        check_mode(mode)
    twice = sorted({m for m in modes if modes.count(m) > 1})
    if twice:
        raise ValueError(
            f"modes = {modes} lists {', '.join(twice)} twice; list each mode once, e.g. [train, infer]"
        )


def check_impl_config(method: str, impl: str, executor: str) -> None:
    """Reject an implementation the method or executor cannot run, before any work.

    Raises:
        ValueError: unknown impl, an impl without this method, or ``ring_flash_attn`` under
            ``executor=dist`` (which needs the ``flash-attn`` and ``ring-flash-attn`` packages).
    """
    import importlib.util

    from flashcp.sim.impl import check_impl

    check_impl(method, impl)
    if impl == "ring_flash_attn" and executor != "sim":
        missing = [
            p for p in ("flash_attn", "ring_flash_attn") if importlib.util.find_spec(p) is None
        ]
        if missing:
            raise ValueError(
                f"method.impl=ring_flash_attn under executor={executor} needs {' and '.join(missing)} "
                "(pip install flash-attn ring-flash-attn, CUDA only); executor=sim models it anywhere"
            )
        raise ValueError(
            f"method.impl=ring_flash_attn is modelled by executor=sim only; executor={executor} runs "
            "method.impl=ours"
        )


def check_method_options(method: str, options: Any, context_len: int, cp_size: int) -> None:
    """Reject planner options the planner does not take, values of the wrong type and values it
    rejects, before any work: names and types against the method's options dataclass
    (:func:`flashcp.registry.check_options`), then values by running the planner once on a trial
    sequence (one document filling the context, which also checks the layout's divisibility of
    ``context_len``).

    Returns:
        the trial plan (None for a method too slow to plan here, the ILP).
    Raises:
        ValueError: naming the bad option or value.
    """
    from omegaconf import OmegaConf

    from flashcp.plan import DivisibilityError
    from flashcp.registry import check_options, get_method, get_planner, split_options

    opts = check_options(
        method,
        OmegaConf.to_container(options, resolve=True) if OmegaConf.is_config(options) else options,
    )
    opts, op_opts = split_options(method, opts)  # op options (keep_gathered_kv) are not planned
    grad = op_opts.get("grad_comm_dtype")
    if grad is not None:
        from flashcp.comm import DTYPE_BYTES

        if grad not in DTYPE_BYTES:
            raise ValueError(
                f"method {method!r}: method.options.grad_comm_dtype={grad!r} is not a dtype; "
                f"choose one of {', '.join(DTYPE_BYTES)} (or null: float32 for 16-bit models)"
            )
    spec = get_method(method)
    if not spec.fast:  # a trial solve is too slow to run here (the ILP): its own value checks
        from flashcp.plan import check_cp_args
        from flashcp.registry import load_target

        check_cp_args(context_len, cp_size)
        if spec.check_options is not None:
            load_target(spec.check_options)(**opts)
        return None
    try:
        return get_planner(method)([context_len], cp_size, **opts)
    except TypeError as exc:  # e.g. a list where a planner's code expects a number
        raise ValueError(f"method {method!r}: bad option value in {opts}: {exc}") from None
    except DivisibilityError as exc:  # name context_len, not the planners' num_pad
        raise ValueError(exc.context_fix()) from None


def check_method_heads(
    method: str, options: Any, cp_size: int, num_heads: int, num_kv_heads: int, trial=None
) -> None:
    """Reject a head-parallel method whose Ulysses degree the model's heads do not allow, before
    any work (else every sequence of the run would fail alone).

    The degree is the trial plan's ``ulysses_degree`` (``trial``, from
    :func:`check_method_options`), else the op family's: N for Ulysses, ``ulysses_degree``
    (or its default) for the hybrids; 1 (nothing to check) for every other method.

    Raises:
        MethodNotApplicable: one line naming the method, cp_size, the degree, the heads and the
            nearest valid degrees (:func:`flashcp.plan.head_parallel.ulysses_heads`).
    """
    from omegaconf import OmegaConf

    from flashcp.kinds import OpFamily
    from flashcp.plan.head_parallel import check_ulysses_degree, ulysses_heads
    from flashcp.registry import get_method

    if trial is not None:
        u = trial.ulysses_degree
    else:
        family = get_method(method).op
        opts = OmegaConf.to_container(options) if OmegaConf.is_config(options) else options
        u = (
            cp_size if family == OpFamily.ULYSSES
            else check_ulysses_degree((opts or {}).get("ulysses_degree"), cp_size)
            if family == OpFamily.HYBRID
            else 1
        )  # fmt: skip
    if u == 1:
        return
    try:
        ulysses_heads(num_heads, num_kv_heads, u)
    except ValueError as exc:
        where = f"method={method} at cp_size = {cp_size}"
        if u != cp_size:
            where += f" with ulysses_degree = {u}"
        raise MethodNotApplicable(f"{where}: {exc}") from None
