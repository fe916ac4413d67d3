"""Merge the runs of an experiment folder into one per-sequence CSV and a per-run summary.

    python -m experiments.aggregate results/fig5

Reads ``<exp_dir>/runs/*/rows.csv`` (the Hydra callback passes only the runs of its sweep) and writes ``<exp_dir>/rows.csv`` (all rows) and
``<exp_dir>/summary.csv``: one row per (run, mode) with the count of rows, the mean, median and
p90 of ``total_ms`` and the mean of every phase and plan metric, plus ``speedup_vs_llama3`` =
mean ``total_ms`` of ``llama3`` / mean ``total_ms`` of the method on the same (dataset, weighting,
cp_size, context_len, model, mode, executor, hardware, seed) — the paper's Fig. 5 normalisation —
and ``speedup_vs_llama3_gmean``, the geometric mean of per-sequence speedups.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS, write_csv_atomic

log = logging.getLogger(__name__)

RUN_KEYS = (
    "name", "dataset", "weighting", "method", "cp_size", "context_len", "model", "num_heads",
    "num_kv_heads", "head_dim", "dtype", "executor", "hardware", "seed", "mode",
)  # fmt: skip
#: runs that differ only in the method are compared with each other
PEER_KEYS = tuple(k for k in RUN_KEYS if k not in ("method", "name"))
METRICS = (
    "imbalance_ratio", "comm_saving", "comm_tokens", "comm_tokens_full", "comm_tokens_sharded", "plan_ms",
    "num_split_docs", "num_pieces", "max_shards_per_rank",
)  # fmt: skip


def merge_rows(exp_dir: Path, run_dirs: list[Path] | None = None) -> pd.DataFrame | None:
    """Concatenate the rows.csv of ``run_dirs`` (default: every run under ``exp_dir/runs``) that
    exist; None if there are none."""
    dirs = sorted(Path(exp_dir).glob("runs/*")) if run_dirs is None else run_dirs
    parts = [Path(d) / "rows.csv" for d in dirs if (Path(d) / "rows.csv").exists()]
    if not parts:
        log.warning("no finished runs under %s", exp_dir)
        return None
    text = {"config_hash": str, "git_commit": str}  # hex strings that may look like numbers
    return pd.concat([pd.read_csv(p, dtype=text) for p in parts], ignore_index=True)


def summarise(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (run, mode) statistics of ``rows`` (see the module docstring)."""
    keys = [k for k in RUN_KEYS if k in rows]
    ok = rows[rows["status"] == "ok"]
    g = ok.groupby(keys, dropna=False, sort=True)
    out = g.size().rename("num_ok").to_frame()
    out["num_rows"] = rows.groupby(keys, dropna=False).size()
    tot = g["total_ms"]
    out["total_ms_mean"] = tot.mean()
    out["total_ms_median"] = tot.median()
    out["total_ms_p90"] = tot.quantile(0.9)
    for col in PHASE_COLUMNS:
        if col != "total_ms" and col in ok:
            out[f"{col}_mean"] = g[col].mean()
    for col in (*METRICS, *COMM_COLUMNS):
        if col in ok:
            out[f"{col}_mean"] = g[col].mean()
    if "imbalance_ratio" in ok:
        out["imbalance_ratio_p90"] = g["imbalance_ratio"].quantile(0.9)
    out = out.reset_index()

    peers = [k for k in PEER_KEYS if k in out]
    base = out[out["method"] == "llama3"][[*peers, "total_ms_mean"]]
    base = base.rename(columns={"total_ms_mean": "llama3_total_ms_mean"})
    out = out.merge(base, on=peers, how="left")
    out["speedup_vs_llama3"] = out["llama3_total_ms_mean"] / out["total_ms_mean"]
    # geometric mean of per-sequence speedups
    seq_keys = [*[k for k in PEER_KEYS if k in ok], "seq_idx"]
    ref = ok[ok["method"] == "llama3"][[*seq_keys, "total_ms"]].rename(columns={"total_ms": "_ref"})
    per_seq = ok.merge(ref, on=seq_keys, how="inner")
    per_seq["_log_speedup"] = np.log(per_seq["_ref"] / per_seq["total_ms"])
    gm = per_seq.groupby(keys, dropna=False)["_log_speedup"].mean().apply(np.exp)
    out = out.merge(gm.rename("speedup_vs_llama3_gmean").reset_index(), on=keys, how="left")
    return out.drop(columns=["llama3_total_ms_mean"])


def aggregate(exp_dir: str | Path, run_dirs: list[Path] | None = None) -> pd.DataFrame | None:
    """Merge runs (``run_dirs``, default all under ``exp_dir/runs``) into ``exp_dir/rows.csv`` and
    ``exp_dir/summary.csv``; return the summary (None when no run has finished)."""
    exp_dir = Path(exp_dir)
    rows = merge_rows(exp_dir, run_dirs)
    if rows is None:
        return None
    write_csv_atomic(rows, exp_dir / "rows.csv")
    summary = summarise(rows)
    write_csv_atomic(summary, exp_dir / "summary.csv")
    log.info("%d rows, %d summary rows -> %s", len(rows), len(summary), exp_dir)
    return summary


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m experiments.aggregate RESULTS_DIR/NAME")
    s = aggregate(sys.argv[1])
    if s is None:
        sys.exit(f"no runs found under {sys.argv[1]}/runs")
    print(f"wrote {sys.argv[1]}/rows.csv and summary.csv ({len(s)} summary rows)")
