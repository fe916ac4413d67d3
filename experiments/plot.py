"""Figures drawn from an experiment's CSV files alone (no re-running).

    python -m experiments.plot fig5 results/fig5

* ``fig5``: speedup of each method over ``llama3`` (summary.csv ``speedup_vs_llama3``), one panel
  per (mode, dataset), bars grouped by (heads, CP size) — the paper's Fig. 5.
* ``fig6``: stacked latency breakdown (AllGather, Attention FWD, Attention BWD, ReduceScatter, P2P,
  Others) per method, one panel per dataset, training (or the one mode the summary has, named in
  the title) — the paper's Fig. 6. A phase a bar lacks is marked on the bar, never drawn as 0.
* ``fig7``: speedup over ``llama3`` against context length, one line per method, training and
  inference panels — the paper's Fig. 7.
* ``fig3``: kernel efficiency (TFLOP/s per layout) from ``fig3.csv`` — the paper's Fig. 3.
* ``fig5_peers``: ``fig5`` with the head-parallel peers (``ulysses``, ``usp`` per
  ``ulysses_degree``, ``flashcp_ulysses``), bars grouped by (heads, KV heads, CP size).
* ``fig5_step``: ``fig5`` at two levels, the attention layer (``speedup_vs_llama3``, hatched)
  and the whole model's step (``step_speedup_vs_llama3``, solid; :mod:`flashcp.sim.step`), bars
  grouped by (model, CP size).
* ``scale``: CP across nodes (docs/scale.md): speedup over ``llama3`` against the CP size (its
  node count under each tick), one line per method, one panel per (context length, placement);
  one file per (dataset, mode), ``scale_<dataset>_<mode>.png``.

A figure that cannot be drawn faithfully raises ValueError saying why (two summary rows for one bar,
a grid the figure has no axis for); a bar or point without data is drawn as a marked gap ("n/a"),
never silently left out.

Where a bar or point is a mean over sequences, its error bar is the 95% interval over sequences from
the summary (``<value>_ci95_lo``/``_hi``, see :mod:`experiments.aggregate`); a summary written
without those columns is drawn without error bars and its title says so.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from flashcp.registry import get_method, method_names
from flashcp.results import IDENTITY_COLUMNS, read_rows

PHASES = (
    ("allgather_ms_mean", "AllGather"), ("attn_fwd_ms_mean", "Attention FWD"),
    ("attn_bwd_ms_mean", "Attention BWD"), ("reducescatter_ms_mean", "ReduceScatter"),
    ("p2p_ms_mean", "P2P (not hidden)"), ("others_ms_mean", "Others"),
)  # fmt: skip


def _methods(df: pd.DataFrame) -> list[str]:
    """Methods present in ``df``: registered ones in the registry's order, then any others."""
    present = set(df["method"])
    order = method_names()
    return [m for m in order if m in present] + sorted(present - set(order))


def _label(method: str) -> str:
    """A method's display name (its name if it is not registered)."""
    return get_method(method).display_name if method in method_names() else method


def _color(method: str) -> str | None:
    """A method's colour (matplotlib's next one if it is not registered)."""
    return get_method(method).color if method in method_names() else None


def _subtitle(df: pd.DataFrame, per: str = "bar") -> str:
    hw = ", ".join(sorted(set(map(str, df["hardware"])))) if "hardware" in df else "?"
    ex = ", ".join(sorted(set(map(str, df["executor"])))) if "executor" in df else "?"
    n = int(df["num_ok"].min()) if "num_ok" in df else 0
    return f"executor {ex}, hardware {hw}, >= {n} sequences per {per}"


def _config_note(df: pd.DataFrame) -> str:
    """``"\nring, zigzag on ring_flash_attn; llama3, flashcp: KV kept, dK/dV in bfloat16"``: a
    title line naming the implementations and op options the summary's runs set
    (``experiment=fig5`` runs the paper's configuration, docs/paper_config.md); empty when every
    run is the project's op at its defaults."""
    import json

    order = list(dict.fromkeys(map(str, df["method"]))) if "method" in df else []
    parts = []
    if "impl" in df:
        for impl in sorted(set(map(str, df["impl"])) - {"ours"}):
            ms = [m for m in order if impl in set(map(str, df.loc[df["method"] == m, "impl"]))]
            parts.append(f"{', '.join(ms)} on {impl}")
    ops: dict[str, list[str]] = {}
    for m, opts in zip(df.get("method", []), df.get("method_options", []), strict=False):
        o = json.loads(opts) if isinstance(opts, str) and opts.startswith("{") else {}
        what = ["KV kept"] if o.get("keep_gathered_kv") else []
        if o.get("grad_comm_dtype"):
            what.append(f"dK/dV in {o['grad_comm_dtype']}")
        if what and str(m) not in ops.setdefault(", ".join(what), []):
            ops[", ".join(what)].append(str(m))
    parts += [f"{', '.join(ms)}: {what}" for what, ms in ops.items()]
    return "\n" + "; ".join(parts) if parts else ""


def _require(df: pd.DataFrame, fig: str, **needs: int) -> None:
    """Raise ValueError unless ``df`` has at least ``needs[col]`` distinct values of each column
    (a figure drawn from data it cannot show would silently mislead)."""
    for col, k in needs.items():
        got = df[col].nunique() if col in df else 0
        if got < k:
            raise ValueError(f"{fig} needs >= {k} distinct {col} in the summary, found {got}")
    if fig in ("fig5", "fig7") and "llama3" not in set(df["method"]):
        raise ValueError(f"{fig} plots speedup over llama3, but the summary has no llama3 runs")


def _one_per(df: pd.DataFrame, fig: str, keys: list[str]) -> None:
    """Raise ValueError if two summary rows share ``keys`` (one bar or point): the runs differ in
    something the figure has no axis for; the message names the differing columns and values."""
    dup = df[df.duplicated(keys, keep=False)]
    if dup.empty:
        return
    first = dup.groupby(keys, dropna=False).get_group(tuple(dup[keys].iloc[0]))
    differ = [
        c for c in (*IDENTITY_COLUMNS, "name") if c in first and first[c].nunique(dropna=False) > 1
    ]
    what = (
        "; ".join(f"{c} {', '.join(sorted(map(str, first[c].unique())))}" for c in differ)
        or "nothing"
    )
    at = ", ".join(f"{k}={v}" for k, v in zip(keys, dup[keys].iloc[0], strict=True))
    raise ValueError(
        f"{fig} has {len(first)} summary rows for one bar ({at}); they differ in {what}"
    )


def _yerr(
    df: pd.DataFrame, value: str, interval: str | None = None
) -> tuple[list[float], list[float]] | None:
    """Error bar lengths ``(below, above)`` of ``df[value]`` from the 95% interval columns
    ``<interval>_ci95_lo``/``_hi`` (``interval`` defaults to ``value``), NaN where a row has none;
    None when the summary has no such columns (written before they existed)."""
    lo, hi = f"{interval or value}_ci95_lo", f"{interval or value}_ci95_hi"
    if lo not in df or hi not in df:
        return None
    v = df[value].astype("float64")
    return list(v - df[lo].astype("float64")), list(df[hi].astype("float64") - v)


def _bars_note(has_intervals: bool, on: str = "") -> str:
    """Title note saying what the error bars are (or that the summary has none)."""
    if not has_intervals:
        return "no intervals: summary written by an older harness"
    return f"error bars{on}: 95% interval over sequences"


def _mark_missing(ax, x: float) -> None:
    """Mark a bar without data at ``x`` (data coordinates) so a gap is never read as a value."""
    ax.text(x, 0.02, "n/a", rotation=90, ha="center", va="bottom", fontsize=6, color="#b00000",
            transform=ax.get_xaxis_transform())  # fmt: skip


DATASET_ORDER = ("wlb_llm", "pile", "redpajama")


def _datasets(df: pd.DataFrame) -> list[str]:
    present = set(df["dataset"])
    return [d for d in DATASET_ORDER if d in present] + sorted(present - set(DATASET_ORDER))


def plot_fig5(summary: pd.DataFrame, out: Path) -> Path:
    """Fig. 5-style speedup bars normalised to llama3."""
    _require(summary, "fig5")
    _one_per(summary, "fig5", ["mode", "dataset", "method", "num_heads", "cp_size"])
    modes = [m for m in ("train", "infer") if m in set(summary["mode"])]
    datasets = _datasets(summary)
    methods = _methods(summary)
    groups = (
        summary[["num_heads", "cp_size"]].drop_duplicates().sort_values(["num_heads", "cp_size"])
    )
    groups = list(groups.itertuples(index=False, name=None))
    fig, axes = plt.subplots(
        len(modes), len(datasets), figsize=(max(7.5, 4.2 * len(datasets)), 3.2 * len(modes)),
        squeeze=False, sharey="row",
    )  # fmt: skip
    width = 0.8 / len(methods)
    for i, mode in enumerate(modes):
        for j, ds in enumerate(datasets):
            ax = axes[i][j]
            sub = summary[(summary["mode"] == mode) & (summary["dataset"] == ds)]
            for k, method in enumerate(methods):
                m = sub[sub["method"] == method].set_index(["num_heads", "cp_size"])
                m = m.reindex(pd.MultiIndex.from_tuples(groups, names=["num_heads", "cp_size"]))
                vals = list(m["speedup_vs_llama3"].astype("float64"))
                yerr = _yerr(m, "speedup_vs_llama3")
                xs = [g + (k - (len(methods) - 1) / 2) * width for g in range(len(groups))]
                ax.bar(xs, vals, width, label=_label(method), color=_color(method), yerr=yerr,
                       error_kw={"elinewidth": 0.8, "capsize": 1.5})  # fmt: skip
                for x, v in zip(xs, vals, strict=True):
                    if v != v:  # NaN: no run, a failed run, or no llama3 run to compare with
                        _mark_missing(ax, x)
            ax.axhline(1.0, color="black", lw=0.8, ls="--")
            ax.set_xticks(
                range(len(groups)), [f"{int(h)}h, CP{int(cp)}" for h, cp in groups], fontsize=8
            )
            ax.set_title(f"{ds} — {'training' if mode == 'train' else 'inference'}", fontsize=10)
            if j == 0:
                ax.set_ylabel("speedup over llama3")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(methods), fontsize=8, frameon=False)
    note = _bars_note(_yerr(summary, "speedup_vs_llama3") is not None)
    fig.suptitle(f"Attention-layer speedup over Llama3 CP\n({_subtitle(summary)}; {note})"
                 f"{_config_note(summary)}", fontsize=10)  # fmt: skip
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def _mark_missing_phases(ax, x: float, bottom: float, top: float, phases: list[str]) -> None:
    """Mark the part of a stacked bar at ``x`` whose phases are missing (``phases``: their
    labels): a hatched box from the known phases' sum ``bottom`` to the bar's total ``top`` (when
    above it) and the missing phases named, so a missing phase is never read as 0."""
    boxed = top == top and top > bottom
    if boxed:
        ax.bar([x], [top - bottom], bottom=[bottom], fill=False, hatch="///", edgecolor="#b00000",
               linewidth=0.6, label="missing phase")  # fmt: skip
    ax.text(x, (bottom + top) / 2 if boxed else bottom, "no " + ", ".join(phases), rotation=90,
            ha="center", va="center" if boxed else "bottom", fontsize=7, color="#b00000",
            backgroundcolor="white")  # fmt: skip


def _variant(row) -> tuple[str, str]:
    """``(method, ulysses_degree or "")`` of a summary row: the series of ``fig5_peers``."""
    import json

    opts = row.get("method_options")
    opts = json.loads(opts) if isinstance(opts, str) and opts else {}
    u = opts.get("ulysses_degree")
    return str(row["method"]), "" if u is None else str(u)


def _variant_label(method: str, degree: str) -> str:
    return _label(method) + (f", u={degree}" if degree else "")


def plot_fig5_peers(summary: pd.DataFrame, out: Path) -> Path:
    """Fig. 5's speedup bars over llama3 with the peers: one series per (method, ulysses_degree),
    bars grouped by (heads, KV heads, CP size), one panel per (mode, dataset)."""
    _require(summary, "fig5")
    summary = summary.copy()
    variants = [_variant(r) for _, r in summary.iterrows()]
    summary["_series"] = [f"{m}|{u}" for m, u in variants]
    _one_per(summary, "fig5_peers", ["mode", "dataset", "_series", "num_heads", "num_kv_heads",
                                     "cp_size"])  # fmt: skip
    order = {m: i for i, m in enumerate(_methods(summary))}
    series = sorted(set(variants), key=lambda v: (order[v[0]], int(v[1] or 0)))
    modes = [m for m in ("train", "infer") if m in set(summary["mode"])]
    datasets = _datasets(summary)
    keys = ["num_heads", "num_kv_heads", "cp_size"]
    groups = list(summary[keys].drop_duplicates().sort_values(keys).itertuples(index=False,
                                                                              name=None))  # fmt: skip
    fig, axes = plt.subplots(
        len(modes), len(datasets), figsize=(max(9.0, 6.0 * len(datasets)), 3.4 * len(modes)),
        squeeze=False, sharey="row",
    )  # fmt: skip
    width = 0.85 / len(series)
    shades = {}
    for i, mode in enumerate(modes):
        for j, ds in enumerate(datasets):
            ax = axes[i][j]
            sub = summary[(summary["mode"] == mode) & (summary["dataset"] == ds)]
            for k, (method, degree) in enumerate(series):
                m = sub[sub["_series"] == f"{method}|{degree}"].set_index(keys)
                m = m.reindex(pd.MultiIndex.from_tuples(groups, names=keys))
                vals = list(m["speedup_vs_llama3"].astype("float64"))
                xs = [g + (k - (len(series) - 1) / 2) * width for g in range(len(groups))]
                # variants of one method share its colour, told apart by hatching
                hatch = shades.setdefault((method, degree), ["", "//", "xx"][
                    sum(1 for mm, _ in shades if mm == method) % 3])  # fmt: skip
                ax.bar(xs, vals, width, label=_variant_label(method, degree), color=_color(method),
                       hatch=hatch, yerr=_yerr(m, "speedup_vs_llama3"),
                       error_kw={"elinewidth": 0.6, "capsize": 1.0})  # fmt: skip
                for x, v in zip(xs, vals, strict=True):
                    if v != v:
                        _mark_missing(ax, x)
            ax.axhline(1.0, color="black", lw=0.8, ls="--")
            ax.set_xticks(range(len(groups)),
                          [f"{int(h)}h/{int(kv)}kv, CP{int(cp)}" for h, kv, cp in groups],
                          fontsize=7, rotation=20)  # fmt: skip
            ax.set_title(f"{ds} — {'training' if mode == 'train' else 'inference'}", fontsize=10)
            if j == 0:
                ax.set_ylabel("speedup over llama3")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(series), 5), fontsize=8,
               frameon=False)  # fmt: skip
    note = _bars_note(_yerr(summary, "speedup_vs_llama3") is not None)
    fig.suptitle("Attention-layer speedup over Llama3 CP, with head-parallel peers\n"
                 f"({_subtitle(summary)}; {note})", fontsize=10)  # fmt: skip
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def plot_fig6(summary: pd.DataFrame, out: Path) -> Path:
    """Fig. 6-style stacked latency breakdown per method (one CP size and model per dataset), of
    training when the summary has it, else of the mode it has (the title says which). A bar
    without data is marked "n/a"; a phase a bar lacks (missing value or column) is marked on the
    bar (:func:`_mark_missing_phases`), never drawn as 0."""
    modes = set(summary["mode"])
    if "train" in modes:
        mode = "train"
    elif len(modes) == 1:
        mode = next(iter(modes))
    else:
        raise ValueError(f"fig6 draws one mode; this summary has modes {sorted(modes)}")
    sub = summary[summary["mode"] == mode]
    for col in ("cp_size", "num_heads"):
        many = sub.groupby("dataset")[col].nunique()
        if (many > 1).any():
            vals = ", ".join(str(v) for v in sorted(sub[col].dropna().unique()))
            raise ValueError(
                f"fig6 needs one cp_size and model per dataset; this sweep has {col} {vals}"
            )
    _one_per(sub, "fig6", ["dataset", "method"])
    datasets = _datasets(sub)
    methods = _methods(sub)
    fig, axes = plt.subplots(
        1, len(datasets), figsize=(max(7.5, 4.5 * len(datasets)), 3.6), squeeze=False
    )
    for j, ds in enumerate(datasets):
        ax = axes[0][j]
        d = sub[sub["dataset"] == ds].set_index("method").reindex(methods)
        d.index = [_label(m) for m in d.index]
        bottom = pd.Series(0.0, index=d.index)
        missing: list[list[str]] = [[] for _ in range(len(d))]
        totals = d["total_ms_mean"].astype("float64")
        for col, label in PHASES:
            raw = d[col].astype("float64") if col in d else pd.Series(float("nan"), index=d.index)
            for x, (v, total) in enumerate(zip(raw, totals, strict=True)):
                if v != v and total == total:  # the bar has a total but not this phase
                    missing[x].append(label)
            vals = raw.fillna(0.0)
            ax.bar(d.index, vals, bottom=bottom, label=label)
            bottom += vals
        for x, total in enumerate(totals):
            if total != total:  # no (ok) run of this method on this dataset
                _mark_missing(ax, x)
            elif missing[x]:
                _mark_missing_phases(ax, x, float(bottom.iloc[x]), float(total), missing[x])
        yerr = _yerr(d, "total_ms_mean", "total_ms")
        if yerr is not None:
            ax.errorbar(range(len(d)), d["total_ms_mean"].astype("float64"), yerr=yerr, fmt="none",
                        ecolor="black", elinewidth=0.8, capsize=2)  # fmt: skip
        ds_rows = sub[sub["dataset"] == ds]
        ax.set_title(f"{ds}, CP{int(ds_rows['cp_size'].iloc[0])}, {int(ds_rows['num_heads'].iloc[0])} heads",
                     fontsize=10)  # fmt: skip
        ax.set_ylabel("mean latency per layer step (ms)")
        ax.tick_params(axis="x", labelsize=8)
    # outside the panels: a legend inside hides the top of a stack
    handles: dict[str, object] = {}
    for ax in axes[0]:  # one legend entry per label (the missing-phase box may be in any panel)
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
    axes[0][-1].legend(handles.values(), handles.keys(), fontsize=7, loc="upper left",
                       bbox_to_anchor=(1.02, 1.0), frameon=False)  # fmt: skip
    note = _bars_note(_yerr(sub, "total_ms_mean", "total_ms") is not None, " on the total")
    what = "training" if mode == "train" else "inference" if mode == "infer" else mode
    fig.suptitle(f"Latency breakdown, {what}\n({_subtitle(sub)}; {note})"
                 f"{_config_note(sub)}", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def plot_fig7(summary: pd.DataFrame, out: Path) -> Path:
    """Fig. 7-style speedup over llama3 vs context length."""
    _require(summary, "fig7", context_len=2)
    for col in ("dataset", "cp_size", "num_heads"):
        if summary[col].nunique() > 1:
            raise ValueError(f"fig7 draws one line per method; the summary mixes several {col}")
    _one_per(summary, "fig7", ["mode", "method", "context_len"])
    modes = [m for m in ("train", "infer") if m in set(summary["mode"])]
    methods = _methods(summary)
    fig, axes = plt.subplots(
        1, len(modes), figsize=(max(7.5, 4.5 * len(modes)), 3.8), squeeze=False, sharey=True
    )
    for i, mode in enumerate(modes):
        ax = axes[0][i]
        sub = summary[summary["mode"] == mode]
        for method in methods:
            d = sub[sub["method"] == method].sort_values("context_len")
            x, y = (
                d["context_len"].astype("float64") / 1024,
                d["speedup_vs_llama3"].astype("float64"),
            )
            ax.errorbar(x, y, yerr=_yerr(d, "speedup_vs_llama3"), marker="o", label=_label(method),
                        color=_color(method), capsize=2, elinewidth=0.8)  # fmt: skip
            for xm in x[y.isna()]:
                _mark_missing(ax, xm)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xlabel("context length (K tokens)")
        ax.set_title("training" if mode == "train" else "inference", fontsize=10)
        if i == 0:
            ax.set_ylabel("speedup over llama3")
    # below the panels, as in Fig. 5: a legend inside a panel hid a point (refined at 64K)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(methods), 6), fontsize=7,
               frameon=False)  # fmt: skip
    ds, cp, h = summary["dataset"].iloc[0], summary["cp_size"].iloc[0], summary["num_heads"].iloc[0]
    note = _bars_note(_yerr(summary, "speedup_vs_llama3") is not None)
    fig.suptitle(f"Speedup vs context length: {ds}, CP{int(cp)}, {int(h)} heads\n"
                 f"({_subtitle(summary, 'point')}; {note}){_config_note(summary)}", fontsize=9)  # fmt: skip
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def plot_fig3(table: pd.DataFrame, out: Path) -> Path:
    """Fig. 3-style kernel efficiency bars from fig3.csv (columns case, layout, pass, tflops)."""
    cases = list(dict.fromkeys(table["case"]))
    passes = list(dict.fromkeys(table["pass"]))
    layouts = list(dict.fromkeys(table["layout"]))
    fig, axes = plt.subplots(
        1, len(passes), figsize=(4.5 * len(passes), 3.4), squeeze=False, sharey=True
    )
    width = 0.8 / len(layouts)
    for i, ps in enumerate(passes):
        ax = axes[0][i]
        for k, layout in enumerate(layouts):
            vals = []
            for case in cases:
                v = table[
                    (table["case"] == case) & (table["layout"] == layout) & (table["pass"] == ps)
                ]
                vals.append(float(v["tflops"].iloc[0]) if len(v) else float("nan"))
            xs = [c + (k - (len(layouts) - 1) / 2) * width for c in range(len(cases))]
            ax.bar(xs, vals, width, label=layout)
        ax.set_xticks(range(len(cases)), cases, fontsize=8)
        ax.set_title(ps, fontsize=10)
        if i == 0:
            ax.set_ylabel("attention TFLOP/s (useful FLOPs)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(layouts), fontsize=8, frameon=False)
    hw = ", ".join(sorted(set(map(str, table.get("hardware", ["?"])))))
    fig.suptitle(f"Kernel efficiency by layout (simulated, {hw})", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def plot_fig5_step(summary: pd.DataFrame, out: Path) -> Path:
    """Attention-level and step-level speedup bars normalised to llama3.

    Raises:
        ValueError: no llama3 runs, two summary rows for one bar, or no model with a step time
            (an attention-only summary has no ``step_speedup_vs_llama3``).
    """
    _require(summary, "fig5")
    if "step_speedup_vs_llama3" not in summary or summary["step_speedup_vs_llama3"].isna().all():
        raise ValueError(
            "fig5_step needs step_speedup_vs_llama3: run a model with num_layers set "
            "(e.g. model=llama3_8b)"
        )
    _one_per(summary, "fig5_step", ["mode", "dataset", "method", "model", "cp_size"])
    modes = [m for m in ("train", "infer") if m in set(summary["mode"])]
    datasets = _datasets(summary)
    methods = _methods(summary)
    keys = ["model", "num_heads", "cp_size"]
    groups = summary[keys].drop_duplicates().sort_values(["num_heads", "cp_size"])
    groups = list(groups.itertuples(index=False, name=None))
    fig, axes = plt.subplots(
        len(modes), len(datasets), figsize=(max(8.0, 5.0 * len(datasets)), 3.4 * len(modes)),
        squeeze=False, sharey="row",
    )  # fmt: skip
    width = 0.8 / (2 * len(methods))
    for i, mode in enumerate(modes):
        for j, ds in enumerate(datasets):
            ax = axes[i][j]
            sub = summary[(summary["mode"] == mode) & (summary["dataset"] == ds)]
            for k, method in enumerate(methods):
                m = sub[sub["method"] == method].set_index(keys)
                m = m.reindex(pd.MultiIndex.from_tuples(groups, names=keys))
                for level, (col, hatch, alpha) in enumerate(
                    [("speedup_vs_llama3", "//", 0.45), ("step_speedup_vs_llama3", None, 1.0)]
                ):
                    vals = list(m[col].astype("float64"))
                    off = (2 * k + level - (2 * len(methods) - 1) / 2) * width
                    xs = [g + off for g in range(len(groups))]
                    ax.bar(xs, vals, width, color=_color(method), alpha=alpha, hatch=hatch,
                           yerr=_yerr(m, col) if level == 0 else None,
                           label=_label(method) + (" (attention)" if level == 0 else " (step)"),
                           error_kw={"elinewidth": 0.8, "capsize": 1.5})  # fmt: skip
                    for x, v in zip(xs, vals, strict=True):
                        if v != v:  # NaN: no run, a failed run, or no llama3 run
                            _mark_missing(ax, x)
            ax.axhline(1.0, color="black", lw=0.8, ls="--")
            ax.set_xticks(
                range(len(groups)), [f"{name}, CP{int(cp)}" for name, _, cp in groups], fontsize=8
            )
            ax.set_title(f"{ds} — {'training' if mode == 'train' else 'inference'}", fontsize=10)
            if j == 0:
                ax.set_ylabel("speedup over llama3")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(methods), fontsize=7, frameon=False)
    note = _bars_note(_yerr(summary, "speedup_vs_llama3") is not None, on=" (attention)")
    fig.suptitle(
        "Speedup over Llama3 CP: attention layer (hatched) and whole step (solid)\n"
        f"({_subtitle(summary)}; {note})",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def plot_scale(summary: pd.DataFrame, out: Path) -> Path:
    """CP across nodes: one figure per (dataset, mode) (``scale_<dataset>_<mode>.png`` beside
    ``out``), speedup over llama3 vs CP size, a line per method, panels per (context, placement).
    Returns the first file written."""
    _require(summary, "scale", cp_size=2)
    if "llama3" not in set(summary["method"]):
        raise ValueError("scale plots speedup over llama3, but the summary has no llama3 runs")
    for col in ("num_heads", "hardware"):
        if summary[col].nunique() > 1:
            raise ValueError(f"scale draws one line per method; the summary mixes several {col}")
    keys = ["dataset", "mode", "context_len", "placement", "method", "cp_size"]
    _one_per(summary, "scale", keys)
    contexts = sorted(summary["context_len"].unique())
    placements = [p for p in ("consecutive", "strided") if p in set(summary["placement"])]
    methods = _methods(summary)
    written = []
    for ds in _datasets(summary):
        for mode in [m for m in ("train", "infer") if m in set(summary["mode"])]:
            sub = summary[(summary["dataset"] == ds) & (summary["mode"] == mode)]
            if sub.empty:
                continue
            fig, axes = plt.subplots(len(contexts), len(placements), squeeze=False, sharey=True,
                                     figsize=(4.6 * len(placements), 3.3 * len(contexts)))  # fmt: skip
            for i, ctx in enumerate(contexts):
                for j, place in enumerate(placements):
                    ax = axes[i][j]
                    panel = sub[(sub["context_len"] == ctx) & (sub["placement"] == place)]
                    cps = sorted(panel["cp_size"].unique())
                    for method in methods:
                        d = panel[panel["method"] == method].sort_values("cp_size")
                        if d.empty:
                            continue
                        x = d["cp_size"].astype("float64")
                        y = d["speedup_vs_llama3"].astype("float64")
                        ax.errorbar(x, y, yerr=_yerr(d, "speedup_vs_llama3"), marker="o",
                                    ms=3, label=_label(method), color=_color(method), capsize=2,
                                    elinewidth=0.7, lw=1.2)  # fmt: skip
                        for xm in x[y.isna()]:
                            _mark_missing(ax, xm)
                    nodes = panel.groupby("cp_size")["nodes"].first()
                    ax.set_xscale("log", base=2)
                    ax.set_xticks(cps)
                    ax.set_xticklabels([f"{int(c)}\n{int(nodes[c])} node" + ("s" if int(nodes[c]) > 1 else "")
                                        for c in cps], fontsize=7)  # fmt: skip
                    ax.axhline(1.0, color="black", lw=0.8, ls="--")
                    ax.set_title(f"{int(ctx) // 1024}K context, {place}", fontsize=9)
                    if j == 0:
                        ax.set_ylabel("speedup over llama3")
                    if i == len(contexts) - 1:
                        ax.set_xlabel("CP size (nodes)")
            handles, labels = axes[0][0].get_legend_handles_labels()
            fig.legend(handles, labels, loc="lower center", ncol=min(len(methods), 5),
                       fontsize=7, frameon=False)  # fmt: skip
            note = _bars_note(_yerr(sub, "speedup_vs_llama3") is not None)
            what = "training" if mode == "train" else "inference"
            fig.suptitle(f"CP across nodes: {ds}, {what}, {int(sub['num_heads'].iloc[0])} heads "
                         f"({int(sub['num_kv_heads'].iloc[0])} KV)\n({_subtitle(sub, 'point')}; "
                         f"{note})", fontsize=9)  # fmt: skip
            fig.tight_layout(rect=(0, 0.08, 1, 1))
            path = out.with_name(f"scale_{ds}_{mode}.png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written[0]


def draw(fig: str, exp_dir: str | Path) -> Path:
    """Draw figure ``fig`` (fig3 | fig5 | fig6 | fig7 | fig5_peers | fig5_step | scale) from the CSVs in
    ``exp_dir``.

    Raises:
        ValueError: unknown figure name, its CSV is missing or unreadable, or the data cannot be
            drawn faithfully (the message names the CSV and says why).
    """
    exp_dir = Path(exp_dir)
    plotters = {"fig5": plot_fig5, "fig6": plot_fig6, "fig7": plot_fig7, "fig3": plot_fig3,
                "fig5_peers": plot_fig5_peers, "fig5_step": plot_fig5_step,
                "scale": plot_scale}  # fmt: skip
    if fig not in plotters:
        raise ValueError(f"unknown figure {fig!r}; choose one of {', '.join(plotters)}")
    csv = exp_dir / ("fig3.csv" if fig == "fig3" else "summary.csv")
    if not csv.exists():
        raise ValueError(f"{csv} does not exist; run the experiment (and its aggregation) first")
    try:
        table = pd.read_csv(csv) if fig == "fig3" else read_rows(csv)
    except (OSError, ValueError) as exc:
        raise ValueError(exc if str(csv) in str(exc) else f"{csv}: {exc}") from None
    try:
        return plotters[fig](table, exp_dir / f"{fig}.png")
    except KeyError as exc:  # a column the figure needs
        raise ValueError(f"{csv} has no column {exc} that {fig} needs") from None
    except ValueError as exc:  # the data cannot be drawn faithfully: say which file
        raise ValueError(f"{csv}: {exc}") from None


def _cli(argv: list[str] | None = None) -> None:
    """``python -m experiments.plot FIG DIR``: draw FIG from DIR's CSV; one line on error."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m experiments.plot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("fig", choices=["fig3", "fig5", "fig6", "fig7", "fig5_peers", "fig5_step",
                                    "scale"],
                    help="figure to draw")  # fmt: skip
    ap.add_argument("exp_dir", metavar="RESULTS_DIR/NAME", help="experiment folder with its CSV")
    args = ap.parse_args(argv)
    try:
        print(draw(args.fig, args.exp_dir))
    except ValueError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    _cli()
