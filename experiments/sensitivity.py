"""How robust is each conclusion of the simulator, to its constants and to the data?
``flashcp-sensitivity`` (or ``python -m experiments.sensitivity``; conf/sensitivity.yaml,
:class:`SensitivityConfig`).

Every overhead constant of the hardware profile (:data:`VARIED`, :mod:`flashcp.sim.perturb`) is varied over a plausible range,
a factor of ``1/2`` to ``2`` of its calibrated value (``factor``; for
``nccl_slowdown`` the factor applies to its excess over 1, for ``overlap_fraction`` to the part
not overlapped; values stay within what the profile accepts):

* one at a time (low and high end; the tornado plot);
* jointly: a Latin hypercube (``scipy.stats.qmc.LatinHypercube``) of ``num_draws``
  draws of log-uniform factors.

The data is the study's other dimension: each *data variant* (:func:`data_variants`) is a dataset
under a weighting, ``<dataset>/<weighting>``: every dataset of ``datasets`` under each of
``weightings`` (documents: a draw is a document; tokens: length-biased, datasets/README.md), except
the generators (``wlb_llm_synthetic``, ``stress``), whose rules draw documents (documents only);
and, when the command line selects a dataset (``dataset=file dataset.path=lengths.txt``), that
dataset config as one more variant, with its own weighting, cap and overlong policy.

For each variant, ``num_sequences`` sequences are sampled as ``flashcp-run`` samples that
dataset config (:func:`flashcp.data.sample_dataset`: the listed variants with its defaults,
cap 4 x C and overlong split, so ``<dataset>/documents`` are the sequences of Fig. 5 / 7), planned
once per method (CP ``cp_size``, the run's model) and priced on every profile of the study in
one call (:func:`flashcp.sim.cost.price_plans`, equal to pricing each plan on each profile);
the statistic is the method's speedup over ``llama3`` (ratio of mean ``total_ms``, as in
``summary.csv``).

Writes ``<results_dir>/<name>/``: ``sensitivity.csv`` (one row per draw, data variant, method, mode,
with the variant's provenance: ``dataset_variant``, ``dataset``, ``weighting``, ``dataset_path``,
``dataset_sha256``, ``dataset_cap``, ``overlong``), ``speedup_range.csv`` / ``.md`` (per variant and
method: calibrated speedup, one-at-a-time and joint ranges), ``ordering.csv`` / ``.md`` (per
variant, the share of joint draws in which method A is faster than method B, and whether the
ordering holds in at least 95% of them, ``at_95pct``), ``data_variants.csv`` / ``.md`` (per variant:
each method's speedup range over the joint draws and the orderings that hold in >= 95% of them)
and ``tornado.png``.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from experiments.common.entry import (
    CONF_DIR,
    ExperimentConfig,
    at_least,
    check_experiment_config,
    register_experiment,
    run_experiment,
)
from experiments.common.launch import launch
from flashcp.comm import AttnShape
from flashcp.config import (
    DatasetConfig,
    HardwareConfig,
    MethodOption,
    ModelConfig,
    Weighting,
    method_option,
)
from flashcp.data.datasets import DatasetName
from flashcp.data.distributions import WEIGHTINGS
from flashcp.results import markdown_table
from flashcp.sim.hardware import HardwareProfile
from flashcp.sim.network import topology_for
from flashcp.sim.perturb import (
    NETWORK_VARIED,
    OPTIONAL_VARIED,
    VARIED,
    joint_factors,
    perturb,
    varied_for,
)

log = logging.getLogger(__name__)

__all__ = [
    "GENERATORS",
    "OPTIONAL_VARIED",
    "VARIED",
    "DataVariant",
    "SensitivityConfig",
    "check_sensitivity_config",
    "cli",
    "data_variants",
    "dataset_override_problem",
    "joint_factors",
    "main",
    "perturb",
    "plot_tornado",
    "run_sensitivity",
]

#: the command (conf/sensitivity.yaml names it in hydra.callbacks.folder.prog; pyproject.toml's script)
PROG = "flashcp-sensitivity"


@dataclass
class SensitivityConfig(ExperimentConfig):
    """``flashcp-sensitivity`` (conf/sensitivity.yaml, :func:`experiments.sensitivity.run_sensitivity`):
    vary every overhead constant of the ``hardware`` profile and report the range of each method's
    speedup over llama3 and the share of draws in which each pairwise ordering holds."""

    name: str = "sensitivity"
    model: ModelConfig = field(default_factory=ModelConfig)
    #: the profile whose constants are varied (conf/hardware/*.yaml)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    #: N, number of CP ranks
    cp_size: int = 8
    #: the CP group on the profile's nodes (as flashcp-run's nodes / placement,
    #: docs/multinode.md); across nodes the inter-node constants are varied too (NETWORK_VARIED)
    nodes: int | None = None
    placement: str = "consecutive"
    #: C, tokens per packed sequence
    context_len: int = 131072
    #: train (forward + backward) and/or infer (forward only); the tornado plot shows the first
    modes: list[str] = field(default_factory=lambda: ["train"])
    #: seed of the sampler and of the Latin hypercube
    seed: int = 0
    #: sampled sequences per dataset (the same for every draw)
    num_sequences: int = 24
    #: Latin-hypercube draws of the joint study (>= 2)
    num_draws: int = 256
    #: each constant from value / factor to value * factor (> 1)
    factor: float = 2.0
    #: datasets studied, each under every weighting of ``weightings`` (the generators
    #: wlb_llm_synthetic and stress under documents only); not file (select it with
    #: dataset=file dataset.path=...)
    datasets: list[DatasetName] = field(
        default_factory=lambda: [
            DatasetName.wlb_llm, DatasetName.pile, DatasetName.redpajama,
            DatasetName.wlb_llm_synthetic,
        ]
    )  # fmt: skip
    #: weightings the datasets are studied under: documents | tokens (datasets/README.md)
    weightings: list[Weighting] = field(
        default_factory=lambda: [Weighting.documents, Weighting.tokens]
    )
    #: one more data variant, sampled as flashcp-run samples this dataset config (its name, path,
    #: weighting, cap, overlong): e.g. dataset=file dataset.path=lengths.txt (conf/dataset/)
    dataset: DatasetConfig | None = None
    #: methods compared (llama3, the reference of every speedup, among them): a registered
    #: method (its planner's defaults, the project's op) or an option of the method group
    #: (conf/method/<option>.yaml: its method, impl and options); by default the paper's five as
    #: the paper ran them (conf/method/*_paper.yaml, docs/paper_config.md)
    methods: list[str] = field(
        default_factory=lambda: [
            "llama3_paper", "per_doc_paper", "ring_paper", "zigzag_paper", "flashcp_paper",
        ]
    )  # fmt: skip
    #: the constants varied (null: VARIED, and NETWORK_VARIED across nodes); may add
    #: alltoall_busbw_gbps (OPTIONAL_VARIED), which otherwise follows allgather_busbw_gbps
    #: (conf/study/peers*.yaml vary it), and the inter-node constants (NETWORK_VARIED)
    constants: list[str] | None = None


#: datasets whose law is a generator's rule that draws documents: studied under documents only
GENERATORS = (DatasetName.wlb_llm_synthetic, DatasetName.stress)


@dataclass(frozen=True)
class DataVariant:
    """One data variant of the study: a dataset config, sampled as ``flashcp-run`` samples it.

    Attributes:
        label: ``<dataset>/<weighting>`` (then ``/cap<cap>`` and ``/<overlong>`` when not the
            defaults), the ``dataset_variant`` column.
        dataset: a :class:`flashcp.data.DatasetName` value.
        weighting: ``documents`` or ``tokens``.
        path: the lengths file (``file`` only), else None.
        cap: largest draw in tokens (None: 4 x context_len).
        overlong: ``split`` | ``cut`` | ``error`` (:class:`flashcp.data.OverlongDocs`).
    """

    label: str
    dataset: str
    weighting: str = "documents"
    path: str | None = None
    cap: int | None = None
    overlong: str = "split"


def _variant(dataset: str, weighting: str, path=None, cap=None, overlong="split") -> DataVariant:
    label = f"{dataset}/{weighting}"
    if cap is not None:
        label += f"/cap{int(cap)}"
    if overlong != "split":
        label += f"/{overlong}"
    cap = None if cap is None else int(cap)
    path = None if path is None else str(path)
    return DataVariant(label, str(dataset), str(weighting), path, cap, str(overlong))


def data_variants(cfg: Any) -> list[DataVariant]:
    """The data variants of a :class:`SensitivityConfig` (module docstring), in order: each of
    ``datasets`` under each of ``weightings`` (generators under documents only), then
    ``dataset`` if set (left out when it equals a listed variant)."""
    weightings = [str(w) for w in cfg.weightings]
    out = []
    for d in cfg.datasets:
        for w in ["documents"] if d in GENERATORS else weightings:
            out.append(_variant(str(d), w))
    ds = cfg.get("dataset")
    if ds is not None:
        v = _variant(
            str(ds.name), str(ds.weighting), ds.path if str(ds.name) == "file" else None,
            ds.cap, str(ds.overlong),
        )  # fmt: skip
        if v not in out:
            out.append(v)
    return out


def resolve_methods(entries) -> list[MethodOption]:
    """The study's ``methods``: a registered method name stands for itself (its planner's
    defaults, ``impl=ours``, no op options); any other entry is an option of the method group
    (:func:`flashcp.config.method_option`, e.g. ``llama3_paper``). Rows are labelled by the
    method each runs.

    Raises:
        ValueError: an entry that is neither (naming the known ones), two entries running one
            method, or none running llama3 (the reference of every speedup).
    """
    from flashcp.registry import method_names

    out = []
    for entry in entries:
        entry = str(entry)
        if entry in method_names():
            out.append(MethodOption(entry, entry, "ours", {}, {}))
        else:
            try:
                out.append(method_option(entry))
            except ValueError:
                raise ValueError(
                    f"methods: {entry!r} is neither a method ({', '.join(method_names())}) nor "
                    "an option of the method group (conf/method/<option>.yaml)"
                ) from None
    names = [m.method for m in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"methods = {list(entries)} run {', '.join(twice)} twice; list it once")
    if "llama3" not in names:
        raise ValueError(
            f"methods = {list(entries)} must include llama3, the reference of every speedup"
        )
    return out


def check_sensitivity_config(cfg: Any) -> None:
    """Check a :class:`SensitivityConfig` before any work: the checks every experiment gets
    (:func:`experiments.common.entry.check_experiment_config`), then the draws, the factor, the
    methods (registered, llama3 among them), the weightings and the data variants (at least one;
    ``file`` only through ``dataset``, with its path).

    Raises:
        ValueError: naming the bad value.
    """
    from flashcp.plan import check_context_len

    check_experiment_config(cfg, chunks_per_rank=2)  # llama3 among the methods: 2N chunks
    at_least(cfg, "num_draws", 2)
    at_least(cfg, "factor", 1.0, strict=True)
    resolve_methods(cfg.methods)  # ValueError naming a bad entry, or no llama3
    check_context_len(cfg.context_len, int(cfg.cp_size), 2)  # llama3: 2N equal chunks
    for k in cfg.get("constants") or ():
        if k not in (*VARIED, *OPTIONAL_VARIED, *NETWORK_VARIED):
            raise ValueError(
                f"constants: {k!r} is not a varied constant; choose from "
                f"{', '.join((*VARIED, *OPTIONAL_VARIED, *NETWORK_VARIED))}"
            )
    if DatasetName.file in cfg.datasets:
        raise ValueError(
            f"datasets = {[str(d) for d in cfg.datasets]}: file needs a path; select it with "
            "dataset=file dataset.path=<a file of lengths> (one more data variant)"
        )
    for w in cfg.weightings:
        if w not in WEIGHTINGS:
            raise ValueError(f"weightings: unknown weighting {w!r}; valid: {', '.join(WEIGHTINGS)}")
    if not cfg.weightings and any(d not in GENERATORS for d in cfg.datasets):
        raise ValueError(
            f"weightings = []: list at least one of {', '.join(WEIGHTINGS)} for the datasets"
        )
    ds = cfg.get("dataset")
    if ds is not None:
        if ds.name == "file" and ds.path is None:
            raise ValueError(
                "dataset=file needs dataset.path=<a file of lengths: text, CSV, Parquet, JSON or "
                ".npy>"
            )
        if ds.weighting not in WEIGHTINGS:
            raise ValueError(
                f"dataset.weighting = {ds.weighting!r}; valid: {', '.join(WEIGHTINGS)}"
            )
    if not data_variants(cfg):
        raise ValueError(
            "no data variant: list datasets (datasets=[pile]) or select one (dataset=file "
            "dataset.path=lengths.txt)"
        )


#: the provenance columns of a data variant in every output row (as flashcp-run records them)
VARIANT_COLUMNS = (
    "dataset_variant", "dataset", "weighting", "dataset_path", "dataset_sha256", "dataset_cap",
    "overlong",
)  # fmt: skip


def _variant_columns(v: DataVariant, context_len: int) -> dict[str, Any]:
    """The :data:`VARIANT_COLUMNS` of ``v`` (``dataset_sha256``: the file's hash, or ``-``)."""
    from experiments.common.rows import file_sha256

    return {
        "dataset_variant": v.label,
        "dataset": v.dataset,
        "weighting": v.weighting,
        "dataset_path": v.path if v.path is not None else "-",
        "dataset_sha256": file_sha256(v.path) if v.path is not None else "-",
        "dataset_cap": v.cap if v.cap is not None else 4 * int(context_len),
        "overlong": v.overlong,
    }


def _profiles(
    hw: HardwareProfile, factor: float, draws: int, seed: int, varied: tuple[str, ...] = VARIED
) -> list[dict]:
    """Every profile of the study, in order: the calibrated one, each constant at its low and
    high end, then the joint Latin-hypercube draws. Each: ``{"hw", "fields"}`` (the row fields
    ``kind``, ``draw``, ``constant``, ``factor`` and, for joint draws, ``f_<constant>``)."""
    out = [{"hw": hw, "fields": {"kind": "calibrated", "draw": 0, "constant": "", "factor": 1.0}}]
    for k in varied:
        for f in (1.0 / factor, factor):
            out.append({"hw": perturb(hw, {k: f}),
                        "fields": {"kind": "one_at_a_time", "draw": 0, "constant": k, "factor": f}})  # fmt: skip
    for i, fac in enumerate(joint_factors(draws, factor, seed, varied)):
        out.append({"hw": perturb(hw, fac),
                    "fields": {"kind": "joint", "draw": i + 1, "constant": "", "factor": float("nan"),
                               **{f"f_{k}": v for k, v in fac.items()}}})  # fmt: skip
    return out


def _topology_options(method: str, cfg: Any, hw: HardwareProfile) -> dict[str, Any]:
    """The run's topology as planner options, for a planner that takes them (``flashcp_node``:
    ``num_nodes``, ``placement``, ``gpus_per_node``), as conf/method/flashcp_node.yaml passes a
    run's; none for the others."""
    from flashcp.registry import option_names

    if "num_nodes" not in option_names(method):
        return {}
    nodes = cfg.get("nodes")
    return {
        "num_nodes": None if nodes is None else int(nodes),
        "placement": str(cfg.get("placement", "consecutive")),
        "gpus_per_node": hw.gpus_per_node,
    }


def run_sensitivity(cfg: DictConfig, out_dir: str | Path) -> pd.DataFrame:
    """Run the study described in the module docstring; return the per-draw table.

    Args:
        cfg: the fields of :class:`SensitivityConfig` (``hardware``, ``model``,
            ``cp_size``, ``context_len``, ``modes``, ``seed``, ``num_sequences``, ``num_draws``,
            ``factor``, ``datasets``, ``weightings`` (default both), ``dataset`` (optional),
            ``methods``).
        out_dir: folder of the outputs (created).
    Returns:
        The rows of ``sensitivity.csv``: per profile x data variant x mode x method,
        ``total_ms_mean`` and ``speedup_vs_llama3`` with the profile's and the variant's columns.
    Raises:
        ValueError: a bad option (factor <= 1, num_draws < 2, no llama3 among the methods, no
            data variant, a bad dataset or weighting).
    """
    from experiments.common.overrides import load_job_hardware
    from flashcp.data import overlong_note, sample_dataset
    from flashcp.registry import COMM_KIND
    from flashcp.sim.cost import PlanBatch, price_plans
    from flashcp.sim.impl import impl_plan
    from flashcp.sim.node_scoped import price_node_scoped, spans_nodes

    factor, draws = float(cfg.factor), int(cfg.num_draws)
    resolved = resolve_methods(cfg.methods)
    methods, modes = [m.method for m in resolved], list(cfg.modes)
    if "weightings" not in cfg:
        cfg = OmegaConf.merge(cfg, {"weightings": list(WEIGHTINGS)})
    variants = data_variants(cfg)
    if factor <= 1 or draws < 2 or "llama3" not in methods or not variants:
        raise ValueError(
            f"sensitivity needs factor > 1 (got {factor}), num_draws >= 2 (got {draws}), llama3 "
            f"among the methods (got {methods}) and a data variant (got none)"
        )
    # explicit constants win over the fitted ones
    hw_cfg = OmegaConf.to_container(cfg.hardware, resolve=True)
    hw, hw_columns = load_job_hardware(hw_cfg)
    m = cfg.model
    shape = AttnShape(int(m.num_heads), int(m.num_kv_heads), int(m.head_dim), str(m.dtype))
    n, c = int(cfg.cp_size), int(cfg.context_len)
    net = {"placement": str(cfg.get("placement", "consecutive")), "nodes": cfg.get("nodes")}
    topo = topology_for(hw, n, **net)  # a topology that does not fit: one line, before any work
    spans = topo is not None and topo.spans_nodes
    if spans:  # the inter-node constants are used, varied and recorded
        hw, hw_columns = load_job_hardware(hw_cfg, network=True)
        hw_columns = {**hw_columns, "nodes": topo.num_nodes, "placement": topo.placement}
    varied = tuple(cfg.get("constants") or varied_for(spans))
    profiles = _profiles(hw, factor, draws, int(cfg.seed), varied)
    hws = [p["hw"] for p in profiles]
    rows = []
    for v in variants:
        # flashcp-run's sampler, with this dataset config (listed variants: its defaults, cap
        # 4 x C and overlong split: <dataset>/documents are the sequences of Fig. 5 / 7)
        seqs, counts = sample_dataset(
            v.dataset, int(cfg.num_sequences), c, seed=int(cfg.seed), weighting=v.weighting,
            cap=v.cap, overlong=v.overlong, path=v.path,
        )  # fmt: skip
        note = overlong_note(counts, v.overlong, c, v.label)  # the line every command logs
        if note:
            (log.warning if v.overlong == "cut" else log.info)(note)
        prov = _variant_columns(v, c)
        mean_ms = {}  # method -> (P, M) mean total_ms over the sequences
        for m in resolved:
            opts = {**m.planner_options, **_topology_options(m.method, cfg, hw)}
            plans = [impl_plan(m.method, m.impl, d, n, **opts)[0] for d in seqs]
            if spans_nodes(plans):  # flashcp_node's two-scope gather
                tot = price_node_scoped(plans, shape, modes, hws, **net)["total_ms"]
            else:
                tot = price_plans(
                    PlanBatch(plans), [shape], modes, hws, comm_kind=COMM_KIND[m.method],
                    impl=m.impl, **m.op_options, **net,
                )["total_ms"][:, 0]  # fmt: skip
            mean_ms[m.method] = tot.mean(axis=-1)
        for i, prof in enumerate(profiles):
            for j, mode in enumerate(modes):
                ref = mean_ms["llama3"][i, j]
                for method in methods:
                    ms = float(mean_ms[method][i, j])
                    rows.append({**prov, "method": method, "mode": mode, "total_ms_mean": ms,
                                 "speedup_vs_llama3": float(ref) / ms, **prof["fields"]})  # fmt: skip
    df = pd.DataFrame(rows)
    for k, val in hw_columns.items():  # the profile varied, as flashcp-run records it
        df[k] = val
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "sensitivity.csv", index=False)

    keys = [*VARIANT_COLUMNS, "mode", "method"]
    base = df[df.kind == "calibrated"].set_index(keys)["speedup_vs_llama3"]
    oat = df[df.kind == "one_at_a_time"].groupby(keys, sort=False)["speedup_vs_llama3"]
    joint = df[df.kind == "joint"].groupby(keys, sort=False)["speedup_vs_llama3"]
    rng = pd.DataFrame({
        "calibrated": base, "one_at_a_time_min": oat.min(), "one_at_a_time_max": oat.max(),
        "joint_min": joint.min(), "joint_p5": joint.quantile(0.05), "joint_median": joint.median(),
        "joint_p95": joint.quantile(0.95), "joint_max": joint.max(),
    }).reset_index()  # fmt: skip
    rng = rng[rng.method != "llama3"]
    rng.to_csv(out / "speedup_range.csv", index=False)
    (out / "speedup_range.md").write_text(markdown_table(_short(rng), ".3f"))

    order_df = _orderings(df, base, methods)
    order_df.to_csv(out / "ordering.csv", index=False)
    (out / "ordering.md").write_text(markdown_table(_short(order_df), ".3f"))
    summary = _variant_summary(rng, order_df, methods)
    summary.to_csv(out / "data_variants.csv", index=False)
    (out / "data_variants.md").write_text(_variant_markdown(summary, order_df, methods, draws))
    plot_tornado(df, methods, [v.label for v in variants], modes[0], out / "tornado.png")
    return df


#: share of the joint draws at which an ordering counts as holding
ROBUST_SHARE = 0.95
#: relative difference of two speedups below which neither method counts as faster (a tie)
TIE_RTOL = 1e-9


def _orderings(df: pd.DataFrame, base: pd.Series, methods: list[str]) -> pd.DataFrame:
    """Per (variant, mode) and pair of methods: the faster one at the calibrated constants, the
    share of joint draws in which it is faster (``share_of_draws``; a tie within
    :data:`TIE_RTOL` counts for neither) and ``at_95pct``: ``holds`` (share >= 0.95),
    ``reversed`` (the slower one is faster in >= 95% of the draws) or ``uncertain``."""
    keys = [*VARIANT_COLUMNS, "mode"]
    jt = df[df.kind == "joint"].pivot_table(
        index=[*keys, "draw"], columns="method", values="speedup_vs_llama3", sort=False
    )
    order = []
    for key, g in jt.groupby(level=list(range(len(keys))), sort=False):
        for a, b in itertools.combinations(methods, 2):
            # strictly faster, beyond rounding (two methods may give the same plan: a tie)
            a_wins = float((g[a] > g[b] * (1.0 + TIE_RTOL)).mean())
            b_wins = float((g[b] > g[a] * (1.0 + TIE_RTOL)).mean())
            first = base[(*key, a)] >= base[(*key, b)]
            share, other = (a_wins, b_wins) if first else (b_wins, a_wins)
            verdict = (
                "holds" if share >= ROBUST_SHARE
                else "reversed" if other >= ROBUST_SHARE else "uncertain"
            )  # fmt: skip
            order.append({**dict(zip(keys, key, strict=True)), "faster": a if first else b,
                          "slower": b if first else a, "share_of_draws": share,
                          "at_95pct": verdict})  # fmt: skip
    return pd.DataFrame(order)


def _short(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` without the provenance columns that are the same in every row (for Markdown)."""
    drop = [c for c in VARIANT_COLUMNS[1:] if c in df and df[c].nunique() <= 1]
    return df.drop(columns=drop)


def _variant_summary(rng: pd.DataFrame, order: pd.DataFrame, methods: list[str]) -> pd.DataFrame:
    """Per (variant, mode, method other than llama3): the speedup range over the joint draws and
    the methods it beats / loses to in >= 95% of them (``;``-separated, llama3 included)."""
    keys = [*VARIANT_COLUMNS, "mode"]
    rows = []
    for _, r in rng.iterrows():
        sel = order[(order[keys] == r[keys]).all(axis=1)]
        held = sel[sel.at_95pct != "uncertain"]
        wins = [(f, s) if v == "holds" else (s, f)
                for f, s, v in zip(held.faster, held.slower, held.at_95pct, strict=True)]  # fmt: skip
        m = r["method"]
        rows.append({
            **{k: r[k] for k in keys}, "method": m, "calibrated": r["calibrated"],
            "joint_min": r["joint_min"], "joint_p5": r["joint_p5"], "joint_p95": r["joint_p95"],
            "joint_max": r["joint_max"],
            "beats_in_95pct": ";".join(s for f, s in wins if f == m),
            "loses_to_in_95pct": ";".join(f for f, s in wins if s == m),
        })  # fmt: skip
    return pd.DataFrame(rows)


def _variant_markdown(summary: pd.DataFrame, order: pd.DataFrame, methods, draws: int) -> str:
    """``data_variants.md``: one row per (variant, mode), per method ``calibrated (min..max)``
    over the joint draws, and the orderings that hold in >= 95% of them."""
    shown = [m for m in methods if m != "llama3"]
    lines = [
        f"Speedup over llama3: calibrated (min..max over {draws} joint draws of the constants); "
        f"the orderings that hold in >= {ROBUST_SHARE:.0%} of the draws (`a > b`: a is faster).",
        "",
        "| dataset_variant | mode | " + " | ".join(shown) + " | orderings in >= 95% of draws |",
        "|" + "---|" * (len(shown) + 3),
    ]
    for (variant, mode), g in summary.groupby(["dataset_variant", "mode"], sort=False):
        by = g.set_index("method")
        cells = [
            f"{by.at[m, 'calibrated']:.2f} ({by.at[m, 'joint_min']:.2f}..{by.at[m, 'joint_max']:.2f})"
            for m in shown
        ]
        sel = order[(order.dataset_variant == variant) & (order["mode"] == mode)]
        pairs = [
            f"{f} > {s}" if v == "holds" else f"{s} > {f}"
            for f, s, v in zip(sel.faster, sel.slower, sel.at_95pct, strict=True)
            if v != "uncertain"
        ]
        lines.append(f"| {variant} | {mode} | " + " | ".join(cells) + f" | {'; '.join(pairs)} |")
    return "\n".join(lines) + "\n"


def plot_tornado(df: pd.DataFrame, methods, datasets, mode: str, path: Path) -> Path:
    """Draw ``path`` (a PNG) from ``df`` (the rows of ``sensitivity.csv``): one panel per (method
    other than llama3, data variant: ``datasets`` lists ``dataset_variant`` values), the speedup over llama3 at each constant's low and high end of the
    one-at-a-time sweep, sorted by range, with the calibrated speedup marked. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [m for m in methods if m != "llama3"]
    fig, axes = plt.subplots(len(shown), len(datasets), figsize=(4.2 * len(datasets), 3.6 * len(shown)),
                             squeeze=False)  # fmt: skip
    for i, method in enumerate(shown):
        for j, dataset in enumerate(datasets):
            ax = axes[i][j]
            sel = (df.method == method) & (df.dataset_variant == dataset) & (df["mode"] == mode)
            base = float(df[sel & (df.kind == "calibrated")]["speedup_vs_llama3"].iloc[0])
            oat = df[sel & (df.kind == "one_at_a_time")]
            lo = oat.groupby("constant")["speedup_vs_llama3"].min()
            hi = oat.groupby("constant")["speedup_vs_llama3"].max()
            order = (hi - lo).sort_values().index
            y = np.arange(len(order))
            ax.barh(y, hi[order] - lo[order], left=lo[order], color="tab:blue", alpha=0.7)
            ax.axvline(base, color="k", lw=1)
            ax.axvline(1.0, color="tab:red", lw=0.8, ls="--")
            ax.set_yticks(y, order, fontsize=7)
            ax.set_title(f"{method} / {dataset} ({mode})", fontsize=9)
            ax.set_xlabel("speedup over llama3", fontsize=8)
    fig.suptitle(
        "One-at-a-time sensitivity (each constant x1/2 .. x2; black: calibrated)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _study(cfg: DictConfig) -> Path:
    out_dir = Path(str(cfg.results_dir)) / str(cfg.name)
    run_sensitivity(cfg, out_dir)
    return out_dir / "speedup_range.csv"


register_experiment("sensitivity", SensitivityConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="sensitivity")
def main(cfg: DictConfig) -> dict[str, Any]:
    """Hydra app of ``flashcp-sensitivity`` (conf/sensitivity.yaml, :class:`SensitivityConfig`): the sensitivity study into
    ``<results_dir>/<name>/``; returns the job's record
    (:func:`experiments.common.entry.run_experiment`)."""
    return run_experiment(cfg, _study, check_sensitivity_config)


def dataset_override_problem(argv: list[str]) -> str | None:
    """A ``dataset.<field>=...`` override without ``dataset=<name>``: the study has no dataset
    config unless the command line selects one (its fields would land on nothing)."""
    pairs = [(a, a.split("=", 1)[0].lstrip("+~")) for a in argv if "=" in a]
    field_ov = next((a for a, k in pairs if k.startswith("dataset.")), None)
    if field_ov is None or any(k == "dataset" for _, k in pairs):
        return None
    return (
        f"{field_ov}: the study samples a dataset config only when the command line selects one; "
        "add dataset=<name> (e.g. dataset=file dataset.path=lengths.txt)"
    )


def cli(argv: list[str] | None = None) -> None:
    """Console entry point ``flashcp-sensitivity``: :func:`main` with readable errors and clean
    Ctrl-C (:func:`experiments.common.launch.launch`); a ``dataset.<field>=`` override without
    ``dataset=<name>`` is one line (:func:`dataset_override_problem`), exit code 2."""
    import sys

    from experiments.common.launch import EXIT_USAGE

    problem = dataset_override_problem(list(sys.argv[1:] if argv is None else argv))
    if problem is not None:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)
    launch(main, PROG, argv)


if __name__ == "__main__":
    cli()
