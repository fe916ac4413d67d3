"""Merge the rows of finished runs into one per-sequence CSV and a per-run summary.

    python -m experiments.aggregate results/fig5

Reads the runs' rows files — the ones a sweep's jobs report (the Hydra callback), or every
``<exp_dir>/runs/*/rows.parquet`` on disk (the command line; ``rows.csv`` of older runs too) — and
writes ``<exp_dir>/rows.parquet`` (all rows, Parquet) and ``<exp_dir>/summary.csv``: one row per (run identity, mode), grouped by ``run_id`` and
every column of :data:`flashcp.results.IDENTITY_COLUMNS`, so runs that differ in anything that
changes results (method options, ``num_sequences``, dataset file content, hardware constants,
executor options, code version) are never averaged together. Each summary row has the count of
rows, ok rows and error rows (``error``: the first error message), the mean, median and p90 of
``total_ms``, the mean of every phase and plan metric, plus ``speedup_vs_llama3`` = mean
``total_ms`` of ``llama3`` / mean ``total_ms`` of the method, paired only with the llama3 run of
the same identity apart from the method (the paper's Fig. 5 normalisation), and
``speedup_vs_llama3_gmean``, the geometric mean of per-sequence speedups.

The merge refuses (ValueError) rows it cannot keep apart: the same (run_id, seq_idx, mode) from two
rows files (the same run written twice, e.g. copied folders), or rows without identity.
"""

from __future__ import annotations

import logging
import sys
import time
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
    write_rows_atomic,
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


#: a merged per-sequence table (Parquet); the per-run summary is ``summary.csv``
ROWS_FILE = "rows.parquet"


def run_rows_paths(exp_dir: str | Path) -> list[Path]:
    """Every run's rows under ``exp_dir/runs/*/``: ``rows.parquet``, or ``rows.csv`` where an
    older harness wrote that instead."""
    out = []
    for d in sorted(p for p in Path(exp_dir).glob("runs/*") if p.is_dir()):
        for name in (ROWS_FILE, "rows.csv"):
            if (d / name).is_file():
                out.append(d / name)
                break
    return out


def merge_rows(exp_dir: str | Path, rows_paths: list[Path] | None = None) -> pd.DataFrame | None:
    """Concatenate ``rows_paths`` (default: :func:`run_rows_paths`).

    Returns:
        the rows with integer columns as ``Int64``, or None when there are none.
    Raises:
        ValueError: a file lacks the identity columns (written by an older harness: rerun it), or
            two files hold the same (run_id, seq_idx, mode); the message names the files.
    """
    paths = run_rows_paths(exp_dir) if rows_paths is None else list(rows_paths)
    paths = [Path(p) for p in dict.fromkeys(paths) if Path(p).exists()]
    if not paths:
        log.warning("no finished runs under %s", exp_dir)
        return None
    parts = []
    for k, p in enumerate(paths):
        df = read_rows(p)
        missing = [c for c in ("run_id", *IDENTITY_COLUMNS) if c not in df]
        if missing:
            raise ValueError(
                f"{p} has no {', '.join(missing[:3])} columns (an older harness wrote it); rerun it"
            )
        parts.append(df.assign(_source=np.int32(k)))
    rows = pd.concat(parts, ignore_index=True)
    key = ["run_id", "seq_idx", "mode"]
    dup = rows[rows["seq_idx"].notna() & rows.duplicated(key, keep=False)]
    if len(dup):
        files = sorted({str(paths[k]) for k in dup["_source"]})
        raise ValueError(
            f"run {dup['run_id'].iloc[0]} ({dup['method'].iloc[0]}, {dup['dataset'].iloc[0]}, "
            f"cp_size {dup['cp_size'].iloc[0]}) is in several files: {', '.join(files)}; "
            "remove all but one"
        )
    return typed(rows.drop(columns="_source"))


def summarise(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (run identity, mode) statistics of ``rows`` (see the module docstring).

    Rows are grouped by (``run_id``, ``mode``); ``run_id`` is the hash of the identity columns,
    which are then attached once per run (grouping millions of rows by ~25 text columns is what
    made the merge slow).
    """
    ident_cols = [k for k in RUN_KEYS if k in rows and k not in ("run_id", "mode")]
    idents = rows.drop_duplicates("run_id")[["run_id", *ident_cols]]
    gkeys = ["run_id", "mode"]
    ok = rows[rows["status"] == "ok"]
    g = ok.groupby(gkeys, dropna=False, sort=True)
    out = rows.groupby(gkeys, dropna=False, sort=True).size().rename("num_rows").to_frame()
    out["num_ok"] = g.size().reindex(out.index, fill_value=0)
    out["num_error"] = out["num_rows"] - out["num_ok"]
    errors = rows[rows["status"] != "ok"].groupby(gkeys, dropna=False)["status"].first()
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
    out = out.reset_index().merge(idents, on="run_id", how="left", validate="many_to_one")
    keys = [k for k in RUN_KEYS if k in out]
    out = out[[*keys, *[c for c in out if c not in keys]]]

    # runs compared with each other: equal in every identity column but the method (peer_id)
    peers = [k for k in PEER_KEYS if k in idents]
    idents = idents.assign(_peer=idents.groupby(peers, dropna=False, sort=False).ngroup())
    peer_of = idents.set_index("run_id")["_peer"]
    out["_peer"] = out["run_id"].map(peer_of).to_numpy()
    is_ref = out["method"] == "llama3"
    base = out.loc[is_ref, ["_peer", "mode", "total_ms_mean"]]
    base = base.rename(columns={"total_ms_mean": "llama3_total_ms_mean"})
    out = out.merge(base, on=["_peer", "mode"], how="left", validate="many_to_one")
    out["speedup_vs_llama3"] = out["llama3_total_ms_mean"] / out["total_ms_mean"]
    # geometric mean of per-sequence speedups
    seq = ok[["run_id", "mode", "seq_idx", "total_ms"]].assign(
        _peer=ok["run_id"].map(peer_of).to_numpy(), _llama3=(ok["method"] == "llama3").to_numpy()
    )
    ref = seq.loc[seq["_llama3"], ["_peer", "mode", "seq_idx", "total_ms"]]
    ref = ref.rename(columns={"total_ms": "_ref"})
    per_seq = seq.merge(ref, on=["_peer", "mode", "seq_idx"], how="inner", validate="many_to_one")
    per_seq["_log_speedup"] = np.log(
        per_seq["_ref"].astype("float64") / per_seq["total_ms"].astype("float64")
    )
    gm = per_seq.groupby(gkeys, dropna=False)["_log_speedup"].mean().apply(np.exp)
    out = out.merge(gm.rename("speedup_vs_llama3_gmean").reset_index(), on=gkeys, how="left")
    out = out.drop(columns=["llama3_total_ms_mean", "_peer"])
    # readable, stable order (run_id is a hash: sorting by it reorders the file after every commit)
    order = ("dataset", "context_len", "cp_size", "model", "mode", "method", "run_id")
    out = out.sort_values([c for c in order if c in out], kind="stable", ignore_index=True)
    return typed(out)


def aggregate(exp_dir: str | Path, rows_paths: list[Path] | None = None) -> pd.DataFrame | None:
    """Merge ``rows_paths`` (default: every run's rows under ``exp_dir/runs/``) into
    ``exp_dir/rows.parquet`` and ``exp_dir/summary.csv``; return the summary (None when there
    are no rows).

    Raises:
        ValueError: as :func:`merge_rows`.
    """
    t0 = time.perf_counter()
    exp_dir = Path(exp_dir)
    rows = merge_rows(exp_dir, rows_paths)
    if rows is None:
        return None
    write_rows_atomic(rows, exp_dir / ROWS_FILE)
    summary = summarise(rows)
    write_csv_atomic(summary, exp_dir / "summary.csv")
    log.info(
        "%d rows, %d summary rows -> %s in %.1f s (merge)",
        len(rows), len(summary), exp_dir, time.perf_counter() - t0,
    )  # fmt: skip
    return summary


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] in ("-h", "--help"):
        print("usage: python -m experiments.aggregate RESULTS_DIR/NAME\n\n" + __doc__.strip())
        sys.exit(0)
    if len(sys.argv) != 2:
        sys.exit("usage: python -m experiments.aggregate RESULTS_DIR/NAME")
    try:
        s = aggregate(sys.argv[1])
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    if s is None:
        sys.exit(f"no runs found under {sys.argv[1]}/runs")
    print(f"wrote {sys.argv[1]}/{ROWS_FILE} and summary.csv ({len(s)} summary rows)")
