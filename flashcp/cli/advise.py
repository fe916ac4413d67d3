"""``flashcp advise``: which CP method for my data? One table and one figure from the simulator.

Given document lengths (a user's length file, sampled as ``dataset=file`` samples it, or a named
dataset), a CP size, a model shape and a hardware profile (its calibrated constants, as
``executor=sim`` applies them), :func:`advise` plans every sampled sequence with every method
(the executors' fast row loop, :func:`flashcp.executors.rows.plan_sequences`), prices the plans
with the cost model (:func:`flashcp.sim.cost.price_plans`) and returns one row per method:

* ``step_ms_p50`` / ``step_ms_p90``: the predicted step time (``total_ms``: one attention layer's
  forward, and backward in training, with its communication), median and 90th percentile over
  the sequences;
* ``speedup_vs_llama3``: the median over sequences of llama3's step time over the method's, and
  ``speedup_min`` / ``speedup_max``: the range of that median over joint draws of the hardware
  constants' uncertainty (:func:`flashcp.sim.perturb.joint_factors` and
  :func:`flashcp.sim.perturb.perturb`: every overhead constant x1/2 .. x2 in a Latin
  hypercube), measured on the first ``draw_sequences`` sequences as factors on the nominal
  constants' median there, applied to the median over every sequence (the range always holds it);
* ``imbalance_ratio`` (median; workload of the busiest rank over the mean, docs/design.md §2) and
  ``comm_mib_per_rank`` (median MiB one rank receives in the step, every pass);
* the breakdown (means over the sequences, ms): ``ideal_ms`` plus five parts summing, for every
  sequence, to its ``total_ms`` (:data:`PARTS`, :func:`breakdown`).

The ideal is the total causal attention work ``sum_d d (d + 1) / 2`` query-key pairs per head,
divided by N, at the kernel's full-tile throughput (``fwd_tile_tflops``, and ``bwd_tile_tflops``
for the backward: :func:`flashcp.sim.kernel.tile_us` per ``block_q x block_k`` pairs).

Bad input (a missing or malformed length file, an unknown dataset, method, model or hardware
profile, ``cp_size`` < 1, a context length that is not a multiple of ``2 * cp_size``, documents
longer than the context under ``overlong="error"``, a bad method option value (checked before
any planning), a method that does not apply when named)
raises ValueError naming the value; the CLI prints it as one line and exits with status 2.
Documents longer than the context are split by default, as every command does
(:func:`flashcp.data.apply_overlong`); the CLI reports how many on stderr.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from flashcp.comm import AttnShape, check_mode
from flashcp.plan import check_cp_args

__all__ = [
    "HOST_CONSTANTS",
    "PARTS",
    "TABLE_COLUMNS",
    "advise",
    "breakdown",
    "format_report",
    "load_model",
    "plot_breakdown",
    "write_outputs",
]

#: the columns :func:`format_report` prints, in order
TABLE_COLUMNS: tuple[str, ...] = (
    "method", "step_ms_p50", "step_ms_p90", "speedup_vs_llama3", "speedup_min", "speedup_max",
    "imbalance_ratio", "comm_mib_per_rank",
)  # fmt: skip

#: the parts of a step's time above the ideal (ms), in the figure's order; with ``ideal_ms`` they
#: sum to ``total_ms``:
#:
#: * ``imbalance_ms``: the slowest rank's attention kernels over the mean rank's (summed per ring
#:   step: a ring waits for its slowest rank at every step);
#: * ``comm_ms``: communication not hidden (the all-gather, reduce-scatter, P2P and all-to-all
#:   phases) plus the slowdown of kernels running beside communication (``nccl_slowdown``);
#: * ``kernel_ms``: the mean rank's kernels over the ideal (partial tiles and CTA overheads of short
#:   segments, launches, the backward's pre/post kernels);
#: * ``copies_ms``: device time of copies, gathers, LSE merges and gradient accumulations;
#: * ``host_ms``: host dispatch the device waits for (the drop in ``total_ms`` when every host
#:   constant, :data:`HOST_CONSTANTS`, is zero).
PARTS: tuple[str, ...] = ("imbalance_ms", "comm_ms", "kernel_ms", "copies_ms", "host_ms")

#: hardware constants that are host (CPU) time, zeroed to price the step without host overhead
HOST_CONSTANTS: tuple[str, ...] = (
    "host_op_us", "collective_host_us", "ring_step_fwd_us", "ring_step_bwd_us", "doc_host_us",
)  # fmt: skip

_COMM_PHASES = ("allgather_ms", "reducescatter_ms", "p2p_ms", "alltoall_ms")
_COLORS = {
    "ideal_ms": "#bbbbbb", "imbalance_ms": "#d62728", "comm_ms": "#1f77b4",
    "kernel_ms": "#ff7f0e", "copies_ms": "#9467bd", "host_ms": "#8c564b",
}  # fmt: skip
_LABELS = {
    "ideal_ms": "ideal (work / N at peak)", "imbalance_ms": "load imbalance",
    "comm_ms": "exposed communication", "kernel_ms": "kernel inefficiency (short segments)",
    "copies_ms": "copies / merges", "host_ms": "host overhead",
}  # fmt: skip


def load_model(
    name: str | None = "h32",
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    dtype: str | None = None,
) -> AttnShape:
    """The attention shape of model ``name`` (``conf/model/<name>.yaml``), with any field given
    here replacing the file's.

    Args:
        name: a model config name (``h16``, ``h32``, ``h32kv8``, ...), or None for heads given
            here alone (``num_heads`` required; ``num_kv_heads`` defaults to it, ``head_dim`` to
            128, ``dtype`` to bfloat16).
    Raises:
        ValueError: an unknown model (listing the known ones), a model file that cannot be read
            or lacks a field (naming the file), or a bad shape (naming it, and the model file).
    """
    import yaml

    from flashcp.resources import resource_path

    fields: dict[str, Any] = {"head_dim": 128, "dtype": "bfloat16"}
    if name is not None:
        folder = resource_path("conf") / "model"
        known = sorted(p.stem for p in folder.glob("*.yaml"))
        if name not in known:
            raise ValueError(f"unknown model {name!r}; choose one of {', '.join(known)}")
        path = folder / f"{name}.yaml"
        try:
            with path.open() as fh:
                data = yaml.safe_load(fh) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise ValueError(f"{path}: cannot read as YAML: {exc}") from None
        keys = ("num_heads", "num_kv_heads", "head_dim", "dtype")
        lacks = [k for k in keys if not isinstance(data, dict) or k not in data]
        if lacks:
            raise ValueError(f"{path} has no {', '.join(lacks)}")
        fields.update({k: data[k] for k in keys})
        step_keys = ("num_layers", "hidden", "ffn", "vocab")  # the whole model (flashcp.sim.step)
        fields.update({k: data[k] for k in step_keys if data.get(k) is not None})
    elif num_heads is None:
        raise ValueError("give a model name or num_heads")
    given = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
             "dtype": dtype}  # fmt: skip
    fields.update({k: v for k, v in given.items() if v is not None})
    fields.setdefault("num_kv_heads", fields["num_heads"])
    try:
        return AttnShape(
            fields["num_heads"], fields["num_kv_heads"], fields["head_dim"], str(fields["dtype"]),
            *(fields.get(k) for k in ("num_layers", "hidden", "ffn", "vocab")),
        )  # fmt: skip
    except ValueError as exc:  # say where the shape came from: the file, and what replaced its
        if name is None:
            raise
        over = ", ".join(f"{k}={v}" for k, v in given.items() if v is not None)
        where = f"{path} with {over}" if over else str(path)
        raise ValueError(f"model {name!r} ({where}): {exc}") from None


#: advise()'s integer arguments -> the flashcp advise flag that sets each
_FLAGS = {"num_draws": "--draws"}


def _check_count(name: str, value: Any, least: int) -> None:
    """Raise ValueError unless ``value`` is an integer >= ``least`` (a float or bool is refused,
    not truncated); the message names the argument and the flashcp advise flag that sets it."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < least:
        flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
        raise ValueError(
            f"{name} (flashcp advise {flag}) must be an integer >= {least}, got {value!r}"
        )


def _sample(
    lengths, dataset, context_len: int, num_sequences: int, seed: int, overlong: str
) -> tuple[list[np.ndarray], list[dict[str, int]], str]:
    """The sequences to advise on, their overlong counts (per sequence ``{"overlong_docs",
    "overlong_tokens_cut"}``) and a label of their source."""
    from flashcp.data import DATASETS, check_overlong_policy, sample_dataset

    if (lengths is None) == (dataset is None):
        raise ValueError("give a length file or a dataset name, not both or neither")
    check_overlong_policy(overlong, "overlong (flashcp advise --overlong)")
    if lengths is not None:
        seqs, counts = sample_dataset(
            "file", num_sequences, context_len, seed=seed, path=str(lengths), overlong=overlong,
            option="--overlong",
        )  # fmt: skip
        return seqs, counts, f"file {Path(lengths).name}"
    named = [str(x) for x in DATASETS if str(x) != "file"]
    if str(dataset) not in named:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(named)}")
    seqs, counts = sample_dataset(
        str(dataset), num_sequences, context_len, seed=seed, overlong=overlong, option="--overlong"
    )
    return seqs, counts, f"dataset {dataset}"


def _price(batch: Any, shape: AttnShape, mode: str, profiles: list, net: dict | None) -> dict:
    """:func:`flashcp.sim.cost.price_plans`' output, (P, 1, 1, S) per column, for ``batch`` on P
    ``profiles``; a ``flashcp_node`` batch whose op gathers in two scopes is priced by
    :func:`flashcp.sim.node_scoped.price_node_scoped`, as ``executor=sim`` prices it (docs/scale.md).
    """
    from flashcp.sim.cost import price_plans
    from flashcp.sim.node_scoped import price_node_scoped, spans_nodes

    net = net or {}
    if spans_nodes(batch.plans):
        out = price_node_scoped(batch.plans, shape, [mode], profiles, **net)  # (P, 1, S)
        return {c: v[:, None] for c, v in out.items()}
    return price_plans(batch, [shape], [mode], profiles, **net)


def breakdown(
    batch: Any, shape: AttnShape, mode: str, hw: Any, *, priced: dict | None = None
) -> dict[str, np.ndarray]:
    """Split each plan's step time into the ideal and the parts of :data:`PARTS`.

    Every part is read from what the cost model prices: the phases of
    :func:`flashcp.sim.cost.price_plans` on ``hw`` and on ``hw`` with every host constant
    zero, and the per-rank attention kernels of :func:`flashcp.sim.cost.attention_balance`.
    With A the attention phases, E the communication phases and O ``others_ms``:
    ``imbalance = slowest - mean``, ``kernel = mean - ideal``, ``comm = E + (A - slowest)``,
    ``host = total - total(no host)``, ``copies = O - host``; so ``ideal + parts = A + E + O =
    total_ms``.

    Args:
        batch: a :class:`flashcp.sim.cost.PlanBatch` of S plans of one method.
        shape: the attention shape; mode: ``train`` or ``infer``; hw: the profile.
        priced: :func:`price_plans`' output for ``[hw, hw without host]`` if already computed.
    Returns:
        (S,) float64 ms per key: ``total_ms``, ``ideal_ms``, every part, and ``comm_bytes``
        (int64, bytes one rank receives).
    """
    from flashcp.plan import doc_workload
    from flashcp.sim.cost import attention_balance
    from flashcp.sim.kernel import tile_us

    if priced is None:
        nohost = dataclasses.replace(hw, **dict.fromkeys(HOST_CONSTANTS, 0.0))
        priced = _price(batch, shape, mode, [hw, nohost], None)
    cal = {c: v[0, 0, 0] for c, v in priced.items()}
    total_nohost = priced["total_ms"][1, 0, 0]
    bal = attention_balance(batch, shape, mode, hw)
    attn = cal["attn_fwd_ms"] + cal["attn_bwd_ms"]
    comm = sum(cal[c] for c in _COMM_PHASES)
    slowest, mean = bal["slowest_us"] / 1e3, bal["mean_us"] / 1e3
    # ideal: total causal work / N at the kernel's full-tile throughput (ms per pair and head)
    work = np.array([float(doc_workload(p.doc_lens).sum()) for p in batch.plans])
    per_pair = tile_us(hw, shape.head_dim, False) / (hw.fwd_block_q * hw.fwd_block_k)
    if mode == "train":
        per_pair += tile_us(hw, shape.head_dim, True) / (hw.bwd_block_q * hw.bwd_block_k)
    ideal = work / batch.n * shape.num_heads * per_pair / hw.num_sms / 1e3
    host = cal["total_ms"] - total_nohost
    return {
        "total_ms": cal["total_ms"],
        "ideal_ms": ideal,
        "imbalance_ms": slowest - mean,
        "comm_ms": comm + (attn - slowest),
        "kernel_ms": mean - ideal,
        "copies_ms": cal["others_ms"] - host,
        "host_ms": host,
        "comm_bytes": cal["comm_bytes"],
    }


def _speedup_draws(
    plans: dict[str, list], shape, mode, hw, num_draws: int, factor: float, seed: int, k: int,
    net: dict | None = None, spans: bool = False,
) -> dict[str, np.ndarray]:  # fmt: skip
    """Per method, how far the constants move its speedup: for each of ``num_draws`` joint draws
    of the constants (the inter-node ones too when ``spans``; ``net``: placement and nodes for
    :func:`price_plans`), the median over the first ``k`` sequences of llama3's step time over
    its own, divided by the same median at the nominal constants: (num_draws,) factors, which
    the caller applies to the median over every sequence (so the range is centred on what the
    table reports, whatever the first ``k`` sequences' median)."""
    from flashcp.sim.cost import PlanBatch
    from flashcp.sim.perturb import joint_factors, perturb, varied_for

    varied = varied_for(spans)
    profiles = [hw, *(perturb(hw, f) for f in joint_factors(num_draws, factor, seed, varied))]
    totals = {
        m: _price(PlanBatch(p[:k]), shape, mode, profiles, net)["total_ms"][:, 0, 0]
        for m, p in plans.items()
    }  # (1 + num_draws, k) each, the nominal profile first
    medians = {m: np.median(totals["llama3"] / t, axis=1) for m, t in totals.items()}
    return {m: med[1:] / med[0] for m, med in medians.items()}


def advise(
    *,
    cp_size: int,
    lengths: str | Path | None = None,
    dataset: str | None = None,
    context_len: int = 131072,
    num_sequences: int = 1000,
    seed: int = 0,
    model: str | AttnShape | None = "h32",
    hardware: Any = "h100_sxm",
    mode: str = "train",
    methods: Sequence[str] | None = None,
    method_options: Mapping[str, Mapping[str, Any]] | None = None,
    num_draws: int = 16,
    draw_sequences: int = 64,
    factor: float = 2.0,
    overlong: str = "split",
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    placement: str = "consecutive",
) -> pd.DataFrame:
    """Predict every method's step time on the given lengths (module docstring).

    Args:
        cp_size: N >= 1, CP ranks.
        lengths: a length file (text, CSV, Parquet, JSON or .npy: :func:`flashcp.data.read_lengths_file`),
            sampled as ``dataset=file`` samples it; or ``dataset``: a dataset name (not ``file``).
        context_len: C, tokens per packed sequence.
        num_sequences: sequences sampled (seeded by ``seed``).
        model: a model config name or an :class:`~flashcp.comm.AttnShape`.
        hardware: a profile name (its calibrated constants applied), mapping or
            :class:`~flashcp.sim.HardwareProfile`.
        mode: ``train`` (forward + backward) or ``infer``.
        methods: methods to compare (llama3, the reference, is added); None: every registered
            ``fast`` method (the ILP is not) that plans and prices at this cp_size and shape.
        method_options: planner options per compared method (e.g. ``{"ilp": {"time_limit_s":
            5}}``: the ILP's default limit is 60 s per sequence), checked against the method's
            schema (:func:`flashcp.registry.check_options`); the others keep their defaults.
        num_draws, draw_sequences, factor: the sensitivity range: joint draws, sequences priced
            per draw (the first ones), each constant from value / factor to value * factor.
        overlong: a document longer than C: ``split`` (default), ``cut`` or ``error``, the rule
            of every command (:func:`flashcp.data.apply_overlong`; ``flashcp advise --overlong``).
        nodes, gpus_per_node, placement: the CP group on the profile's nodes
            (docs/multinode.md; :func:`flashcp.sim.network.topology_for`): nodes None: as few
            as the placement allows; gpus_per_node None: the profile's (a number replaces it,
            e.g. on the flat ``h100_ib``). The sensitivity draws vary the inter-node constants
            too when the group spans nodes (:func:`flashcp.sim.perturb.varied_for`).
    Returns:
        One row per method (display order): :data:`TABLE_COLUMNS`, ``inter_mib_per_rank`` (the
        largest rank's MiB from other nodes, median; 0 on one node), ``total_ms_mean``,
        ``ideal_ms`` and every part of :data:`PARTS` (means over sequences, ms), ``num_sequences``,
        ``overlong`` and its counts over the sequences (``overlong_docs``: documents, or pieces
        under ``split``, from a document longer than C; ``overlong_tokens_cut``).
        ``attrs``: ``rows`` (per (method, sequence): :func:`breakdown`'s columns,
        ``imbalance_ratio``, ``speedup_vs_llama3``, the sequence's overlong counts), ``skipped``
        (method -> why it does not apply), ``setup`` (a dict describing the run, with the overlong
        counts), ``seconds`` (wall time of planning and pricing, and of the sensitivity draws).
    Raises:
        ValueError: bad input (module docstring).
    """
    from flashcp.comm import max_rank_link_bytes
    from flashcp.config import check_method_options
    from flashcp.executors import RunSpec
    from flashcp.executors.rows import plan_sequences
    from flashcp.registry import COMM_KIND, check_options, get_method, method_names, option_names
    from flashcp.sim.cost import PlanBatch
    from flashcp.sim.hardware import load_hardware
    from flashcp.sim.network import topology_for

    check_mode(mode)
    for name, value, least in (
        ("cp_size", cp_size, 1),
        ("context_len", context_len, 1),
        ("num_sequences", num_sequences, 1),
        ("seed", seed, 0),
        ("num_draws", num_draws, 1),
        ("draw_sequences", draw_sequences, 1),
    ):
        _check_count(name, value, least)
    n = int(cp_size)
    check_cp_args(0, n)  # 1 <= cp_size <= MAX_CP_SIZE
    step = 2 * n  # llama3, the reference of every comparison, cuts the sequence in 2N chunks
    if context_len % step:
        lo = context_len // step * step
        near = f"{lo} or {lo + step}" if lo else f"{step}"
        raise ValueError(
            f"context_len = {context_len} is not a multiple of 2 * cp_size = {step}: llama3, "
            f"the reference every method is compared with, gives each rank 2 of 2 * cp_size "
            f"equal chunks (paper §2.3); use context_len = {near}"
        )
    shape = model if isinstance(model, AttnShape) else load_model(model)
    hw = load_hardware(hardware)
    if gpus_per_node is not None:
        _check_count("gpus_per_node", gpus_per_node, 1)
        hw = dataclasses.replace(hw, gpus_per_node=int(gpus_per_node))
    if nodes is not None:
        _check_count("nodes", nodes, 1)
    topo = topology_for(hw, n, placement, None if nodes is None else int(nodes))
    net = {"placement": placement, "nodes": None if nodes is None else int(nodes)}
    explicit = methods is not None
    if explicit:
        if isinstance(methods, str):
            raise ValueError(
                f"methods must be a sequence of method names (e.g. {methods.split(',')}), got the "
                f"string {methods!r}"
            )
        for m in methods:
            get_method(m)  # ValueError naming the known methods
        wanted = [m for m in method_names() if m == "llama3" or m in set(methods)]
    else:
        wanted = list(method_names(fast=True))
    opts: dict[str, dict[str, Any]] = {}
    for m, o in dict(method_options or {}).items():
        if m not in wanted:
            raise ValueError(
                f"method_options (flashcp advise --option {m}.KEY=VALUE) for {m!r}, which this "
                f"comparison does not run (it runs {', '.join(wanted)}); add it to methods "
                "(--methods)"
            )
        opts[m] = check_options(m, o)
        try:  # the values too (planning one trial sequence), before any sampling or planning
            check_method_options(m, opts[m], int(context_len), n)
        except ValueError as exc:
            raise ValueError(
                f"method_options (flashcp advise --option {m}.KEY=VALUE) for {m!r}: {exc}"
            ) from None
    seqs, counts, source = _sample(
        lengths, dataset, int(context_len), int(num_sequences), int(seed), overlong
    )
    over = pd.DataFrame(counts, columns=["overlong_docs", "overlong_tokens_cut"])

    t0 = time.perf_counter()
    nohost = dataclasses.replace(hw, **dict.fromkeys(HOST_CONSTANTS, 0.0))
    parts: dict[str, dict[str, np.ndarray]] = {}
    plans: dict[str, list] = {}
    ratios: dict[str, np.ndarray] = {}
    inter: dict[str, np.ndarray] = {}
    skipped: dict[str, str] = {}
    for m in wanted:
        # a planner that takes the topology (flashcp_node) plans for this one, as flashcp-run's
        # conf/method/flashcp_node.yaml passes a run's; --option values win
        topo_opts = (
            {"num_nodes": net["nodes"], "placement": placement, "gpus_per_node": hw.gpus_per_node}
            if "num_nodes" in option_names(m)
            else {}
        )
        run = RunSpec(
            method=m,
            cp_size=n,
            shape=shape,
            modes=(mode,),
            options={**topo_opts, **opts.get(m, {})},
            hardware=hw,
        )
        planned = plan_sequences(run, seqs)
        try:
            if planned.errors:
                raise ValueError(next(iter(planned.errors.values())).removeprefix("error: "))
            batch = PlanBatch(planned.plans)
            priced = _price(batch, shape, mode, [hw, nohost], net)
        except ValueError as exc:
            if explicit or m == "llama3":
                raise ValueError(f"method {m} does not apply at cp_size = {n}: {exc}") from None
            skipped[m] = str(exc)
            continue
        parts[m] = breakdown(batch, shape, mode, hw, priced=priced)
        plans[m] = planned.plans
        ratios[m] = np.asarray(planned.metrics["imbalance_ratio"], dtype=np.float64)
        if topo is not None and topo.spans_nodes:  # the largest rank's bytes from other nodes
            inter[m] = np.array(
                [max_rank_link_bytes(p, COMM_KIND[m], shape, mode, topo)[0] for p in plans[m]]
            )
    t1 = time.perf_counter()
    k = min(int(draw_sequences), len(seqs))
    draws = _speedup_draws(
        plans, shape, mode, hw, int(num_draws), float(factor), int(seed), k, net=net,
        spans=topo is not None and topo.spans_nodes,
    )  # fmt: skip
    t2 = time.perf_counter()

    ref = parts["llama3"]["total_ms"]
    whole = _whole_step(shape, hw, mode, parts, plans)  # {} for an attention-only model
    rows, table = [], []
    for m, p in parts.items():
        speedup = ref / p["total_ms"]
        rows.append(pd.DataFrame({
            "method": m, "seq_idx": np.arange(len(seqs)), **p,
            "imbalance_ratio": ratios[m], "speedup_vs_llama3": speedup,
            "overlong_docs": over["overlong_docs"], "overlong_tokens_cut": over["overlong_tokens_cut"],
        }))  # fmt: skip
        table.append(
            {
                "method": m,
                "step_ms_p50": float(np.median(p["total_ms"])),
                "step_ms_p90": float(np.quantile(p["total_ms"], 0.9)),
                "speedup_vs_llama3": float(np.median(speedup)),
                "speedup_min": float(np.median(speedup) * min(draws[m].min(), 1.0)),
                "speedup_max": float(np.median(speedup) * max(draws[m].max(), 1.0)),
                "imbalance_ratio": float(np.median(ratios[m])),
                "comm_mib_per_rank": float(np.median(p["comm_bytes"])) / 2**20,
                "inter_mib_per_rank": float(np.median(inter.get(m, 0))) / 2**20,
                "total_ms_mean": float(np.mean(p["total_ms"])),
                "ideal_ms": float(np.mean(p["ideal_ms"])),
                **{c: float(np.mean(p[c])) for c in PARTS},
                "num_sequences": len(seqs),
                "overlong": str(overlong),
                "overlong_docs": int(over["overlong_docs"].sum()),
                "overlong_tokens_cut": int(over["overlong_tokens_cut"].sum()),
                **whole.get(m, {}),
            }
        )
    df = pd.DataFrame(table)
    df.attrs["rows"] = pd.concat(rows, ignore_index=True)
    df.attrs["skipped"] = skipped
    df.attrs["setup"] = {
        "source": source, "num_sequences": len(seqs), "context_len": int(context_len),
        "seed": int(seed), "cp_size": n, "shape": shape, "hardware": hw.name, "mode": mode,
        "topology": topo.describe() if topo is not None and topo.spans_nodes else None,
        "num_draws": int(num_draws), "draw_sequences": k, "factor": float(factor),
        "overlong": str(overlong), "overlong_docs": int(over["overlong_docs"].sum()),
        "overlong_tokens_cut": int(over["overlong_tokens_cut"].sum()),
    }  # fmt: skip
    df.attrs["seconds"] = {"plan_price_s": t1 - t0, "draws_s": t2 - t1}
    return df


def _whole_step(shape, hw, mode, parts, plans) -> dict[str, dict[str, float]]:
    """Per method, the whole model's step (:func:`flashcp.sim.step.step_ms`) where ``shape`` has
    layers: ``model_step_ms_p50`` (median over sequences) and ``model_step_speedup_vs_llama3``
    (median over sequences of llama3's over the method's); ``{}`` for an attention-only shape."""
    if shape.num_layers is None:
        return {}
    from flashcp.sim.step import step_ms

    steps = {}
    for m, p in parts.items():
        tokens = np.array([pl.tokens_per_rank.max() for pl in plans[m]], dtype=np.int64)
        steps[m] = step_ms(shape, hw, p["total_ms"], tokens, mode)
    return {
        m: {
            "model_step_ms_p50": float(np.median(v)),
            "model_step_speedup_vs_llama3": float(np.median(steps["llama3"] / v)),
        }
        for m, v in steps.items()
    }


def format_report(df: pd.DataFrame) -> str:
    """The text ``flashcp advise`` prints: the setup, the table (:data:`TABLE_COLUMNS`, Markdown),
    and notes on the speedup range, skipped methods and the time taken."""
    from flashcp.results import markdown_table

    s = df.attrs["setup"]
    sh = s["shape"]
    cross = ["inter_mib_per_rank"] if s.get("topology") else []
    lines = [
        f"{s['source']}: {s['num_sequences']} sequences of {s['context_len']} tokens (seed "
        f"{s['seed']}); cp_size {s['cp_size']}; {sh.num_heads} heads, {sh.num_kv_heads} KV heads, "
        f"head_dim {sh.head_dim}, {sh.dtype}; hardware {s['hardware']} (calibrated); mode "
        f"{s['mode']}" + (f"; {s['topology']}" if s.get("topology") else ""),
        "",
        markdown_table(df[[*TABLE_COLUMNS, *cross]], ".3f").rstrip("\n"),
        "",
        "step_ms: one attention layer's step (simulated), median and p90 over the sequences. "
        "speedup_vs_llama3: median over sequences; speedup_min/max: its range over "
        f"{s['num_draws']} joint draws of the hardware constants (each x1/{s['factor']:g} .. "
        f"x{s['factor']:g}, the sensitivity study's Latin hypercube), measured on the first "
        f"{s['draw_sequences']} sequences relative to the nominal constants and applied to the "
        "median. imbalance_ratio, comm_mib_per_rank: medians."
        + (
            " inter_mib_per_rank: of it, the MiB the largest rank receives from other nodes "
            "(median; docs/multinode.md)."
            if cross
            else ""
        ),
    ]
    if "model_step_speedup_vs_llama3" in df:
        lines.append(
            f"Whole model ({sh.num_layers} layers, hidden {sh.hidden}, MLP {sh.ffn}, vocabulary "
            f"{sh.vocab}; docs/simulator.md, the step model): step ms (median) and speedup over "
            "llama3 (median over sequences): "
            + "; ".join(
                f"{r.method} {r.model_step_ms_p50:.1f} ms, {r.model_step_speedup_vs_llama3:.3f}x"
                for r in df.itertuples()
            )
        )
    if s["cp_size"] == 1:
        lines.append(
            "cp_size 1: no CP work, so every method runs the same single-device attention with "
            "no communication: the methods are identical here."
        )
    for m, why in df.attrs.get("skipped", {}).items():
        lines.append(f"skipped {m}: {why}")
    sec = df.attrs.get("seconds")
    if sec:
        lines.append(
            f"planned and priced in {sec['plan_price_s']:.1f} s, sensitivity draws "
            f"{sec['draws_s']:.1f} s"
        )
    return "\n".join(lines)


def plot_breakdown(df: pd.DataFrame, path: str | Path) -> Path:
    """Draw ``path`` (PNG): per method a horizontal bar of its mean step time split into the
    ideal and the parts of :data:`PARTS` (means over the sequences, ms). Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flashcp.registry import get_method

    path = Path(path)
    keys = ("ideal_ms", *PARTS)
    fig, ax = plt.subplots(figsize=(8.5, 0.45 * len(df) + 2.4))
    y = np.arange(len(df))[::-1]
    left = np.zeros(len(df))
    for key in keys:
        vals = df[key].to_numpy(dtype=np.float64)
        ax.barh(y, vals, left=left, color=_COLORS[key], label=_LABELS[key], height=0.7)
        left += vals
    names = []
    for m in df["method"]:
        try:
            names.append(get_method(m).display_name)
        except ValueError:
            names.append(m)
    ax.set_yticks(y, names, fontsize=8)
    ax.set_xlabel("mean step time per sequence, ms")
    s = df.attrs.get("setup", {})
    if s:
        ax.set_title(
            f"{s['source']}, cp_size {s['cp_size']}, {s['hardware']}, {s['mode']}: where the time "
            "goes",
            fontsize=9,
        )
    ax.set_xlim(0, 1.02 * float(left.max()) if len(df) else 1.0)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(df: pd.DataFrame, out_dir: str | Path) -> dict[str, Path]:
    """Write ``advise.csv`` (the table and the mean breakdown), ``rows.csv`` (per method and
    sequence) and ``breakdown.png`` into ``out_dir`` (created). Returns the paths by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"table": out / "advise.csv", "rows": out / "rows.csv", "figure": out / "breakdown.png"}
    df.to_csv(paths["table"], index=False)
    df.attrs["rows"].to_csv(paths["rows"], index=False)
    plot_breakdown(df, paths["figure"])
    return paths
