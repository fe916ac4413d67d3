"""Merge the rows of finished runs into one per-sequence CSV and a per-run summary.

    python -m experiments.aggregate outputs/fig5

Reads ``rows.csv`` files — the ones a sweep's jobs report (the Hydra callback), or every
``<exp_dir>/runs/*/rows.csv`` on disk (the command line) — and writes ``<exp_dir>/rows.csv`` (all
rows) and ``<exp_dir>/summary.csv``: one row per (run identity, mode), grouped by ``run_id`` and
every column of :data:`flashcp.results.IDENTITY_COLUMNS`, so runs that differ in anything that
changes results (method options, ``num_sequences``, dataset file content, hardware constants,
executor options, code version) are never averaged together. Each summary row has the count of
rows, ok rows and error rows (``error``: the first error message), the mean, median and p90 of
``total_ms``, the mean of every phase and plan metric, plus ``speedup_vs_llama3`` = mean
``total_ms`` of ``llama3`` / mean ``total_ms`` of the method, paired only with the llama3 run of
the same identity apart from the method (the paper's Fig. 5 normalisation), and
``speedup_vs_llama3_gmean``, the geometric mean of per-sequence speedups.

The merge refuses (ValueError) rows it cannot keep apart: the same (run_id, seq_idx, mode) from two
``rows.csv`` files (the same run written twice, e.g. copied folders), or rows without identity.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from flashcp.results import (
    COMM_COLUMNS,
    IDENTITY_COLUMNS,
    PHASE_COLUMNS,
    read_rows,
    typed,
    write_csv_atomic,
)

log = logging.getLogger(__name__)

#: a summary row per run identity and mode
RUN_KEYS = ("run_id", *IDENTITY_COLUMNS, "mode")
#: runs that differ only in these are compared with each other (speedup_vs_llama3)
PEER_KEYS = tuple(k for k in RUN_KEYS if k not in ("run_id", "method", "method_options"))
METRICS = (
    "imbalance_ratio", "comm_saving", "comm_tokens", "comm_tokens_full", "comm_tokens_sharded", "plan_ms",
    "num_split_docs", "num_pieces", "max_shards_per_rank", "overlong_docs", "overlong_tokens_cut",
)  # fmt: skip


def merge_rows(exp_dir: str | Path, rows_paths: list[Path] | None = None) -> pd.DataFrame | None:
    """Concatenate ``rows_paths`` (default: every ``exp_dir/runs/*/rows.csv`` on disk).

    Returns:
        the rows with integer columns as ``Int64``, or None when there are none.
    Raises:
        ValueError: a file lacks the identity columns (written by an older harness: rerun it), or
            two files hold the same (run_id, seq_idx, mode); the message names the files.
    """
    paths = (
        sorted(Path(exp_dir).glob("runs/*/rows.csv")) if rows_paths is None else list(rows_paths)
    )
    paths = [Path(p) for p in dict.fromkeys(paths) if Path(p).exists()]
    if not paths:
        log.warning("no finished runs under %s", exp_dir)
        return None
    parts = []
    for p in paths:
        df = read_rows(p)
        missing = [c for c in ("run_id", *IDENTITY_COLUMNS) if c not in df]
        if missing:
            raise ValueError(
                f"{p} has no {', '.join(missing[:3])} columns (an older harness wrote it); rerun it"
            )
        parts.append(df.assign(_source=str(p)))
    rows = pd.concat(parts, ignore_index=True)
    key = ["run_id", "seq_idx", "mode"]
    dup = rows[rows.duplicated(key, keep=False) & rows["seq_idx"].notna()]
    if len(dup):
        files = sorted(set(dup["_source"]))
        raise ValueError(
            f"run {dup['run_id'].iloc[0]} ({dup['method'].iloc[0]}, {dup['dataset'].iloc[0]}, "
            f"cp_size {dup['cp_size'].iloc[0]}) is in several files: {', '.join(files)}; "
            "remove all but one"
        )
    return typed(rows.drop(columns="_source"))


def summarise(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (run identity, mode) statistics of ``rows`` (see the module docstring)."""
    keys = [k for k in RUN_KEYS if k in rows]
    ok = rows[rows["status"] == "ok"]
    g = ok.groupby(keys, dropna=False, sort=True)
    out = rows.groupby(keys, dropna=False, sort=True).size().rename("num_rows").to_frame()
    out["num_ok"] = g.size().reindex(out.index, fill_value=0)
    out["num_error"] = out["num_rows"] - out["num_ok"]
    errors = rows[rows["status"] != "ok"].groupby(keys, dropna=False)["status"].first()
    out["error"] = errors.reindex(out.index)
    tot = g["total_ms"]
    out["total_ms_mean"] = tot.mean()
    out["total_ms_median"] = tot.median()
    out["total_ms_p90"] = tot.quantile(0.9)
    for col in PHASE_COLUMNS:
        if col != "total_ms" and col in ok:
            out[f"{col}_mean"] = g[col].mean()
    for col in (*METRICS, *COMM_COLUMNS):
        if col in ok:
            out[f"{col}_mean"] = g[col].mean().astype("float64")
    if "imbalance_ratio" in ok:
        out["imbalance_ratio_p90"] = g["imbalance_ratio"].quantile(0.9)
    out = out.reset_index()

    peers = [k for k in PEER_KEYS if k in out]
    base = out[out["method"] == "llama3"][[*peers, "total_ms_mean"]]
    base = base.rename(columns={"total_ms_mean": "llama3_total_ms_mean"})
    out = out.merge(base, on=peers, how="left", validate="many_to_one")
    out["speedup_vs_llama3"] = out["llama3_total_ms_mean"] / out["total_ms_mean"]
    # geometric mean of per-sequence speedups
    seq_keys = [*[k for k in PEER_KEYS if k in ok], "seq_idx"]
    ref = ok[ok["method"] == "llama3"][[*seq_keys, "total_ms"]].rename(columns={"total_ms": "_ref"})
    per_seq = ok.merge(ref, on=seq_keys, how="inner", validate="many_to_one")
    per_seq["_log_speedup"] = np.log(
        per_seq["_ref"].astype("float64") / per_seq["total_ms"].astype("float64")
    )
    gm = per_seq.groupby(keys, dropna=False)["_log_speedup"].mean().apply(np.exp)
    out = out.merge(gm.rename("speedup_vs_llama3_gmean").reset_index(), on=keys, how="left")
    out = out.drop(columns=["llama3_total_ms_mean"])
    # readable, stable order (run_id is a hash: sorting by it reorders the file after every commit)
    order = ("dataset", "context_len", "cp_size", "model", "mode", "method", "run_id")
    out = out.sort_values([c for c in order if c in out], kind="stable", ignore_index=True)
    return typed(out)


def aggregate(exp_dir: str | Path, rows_paths: list[Path] | None = None) -> pd.DataFrame | None:
    """Merge ``rows_paths`` (default: every ``exp_dir/runs/*/rows.csv``) into ``exp_dir/rows.csv``
    and ``exp_dir/summary.csv``; return the summary (None when there are no rows).

    Raises:
        ValueError: as :func:`merge_rows`.
    """
    exp_dir = Path(exp_dir)
    rows = merge_rows(exp_dir, rows_paths)
    if rows is None:
        return None
    write_csv_atomic(rows, exp_dir / "rows.csv")
    summary = summarise(rows)
    write_csv_atomic(summary, exp_dir / "summary.csv")
    log.info("%d rows, %d summary rows -> %s", len(rows), len(summary), exp_dir)
    return summary


def _cli(argv: list[str] | None = None) -> None:
    """``python -m experiments.aggregate DIR``: merge every run of DIR; one line on error."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m experiments.aggregate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "exp_dir",
        metavar="RESULTS_DIR/NAME",
        help="experiment folder whose runs/*/rows.csv to merge",
    )
    args = ap.parse_args(argv)
    try:
        s = aggregate(args.exp_dir)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    if s is None:
        sys.exit(f"error: no runs found under {args.exp_dir}/runs")
    print(f"wrote {args.exp_dir}/rows.csv and summary.csv ({len(s)} summary rows)")


if __name__ == "__main__":
    _cli()
