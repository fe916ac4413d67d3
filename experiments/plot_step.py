"""``fig5_step``: Fig. 5's speedup over ``llama3`` at both levels, the attention layer
(``speedup_vs_llama3``, hatched bars) and the whole model's step (``step_speedup_vs_llama3``,
solid bars; :mod:`flashcp.sim.step`), one panel per (mode, dataset), bars grouped by (model, CP
size). Drawn by :func:`experiments.plot.draw` (``python -m experiments.plot fig5_step DIR``).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from experiments.plot import (
    _bars_note,
    _color,
    _datasets,
    _label,
    _mark_missing,
    _methods,
    _one_per,
    _require,
    _subtitle,
    _yerr,
)


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
