"""Merge the rows of finished runs into one per-sequence CSV and a per-run summary.

    python -m experiments.aggregate outputs/fig5

Reads the runs' rows files — the ones a sweep's jobs report (the Hydra callback), or every
``<exp_dir>/runs/*/rows.parquet`` on disk (the command line; ``rows.csv`` of older runs too) — and
writes ``<exp_dir>/rows.parquet`` (all rows, Parquet) and ``<exp_dir>/summary.csv``: one row per (run identity, mode), grouped by ``run_id`` and
every column of :data:`flashcp.results.IDENTITY_COLUMNS`, so runs that differ in anything that
changes results (method options, ``num_sequences``, dataset file content, hardware constants,
executor options, code version) are never averaged together. Each summary row has the count of
rows, ok rows and error rows (``error``: the first error message), the mean, median, p10 and p90
of ``total_ms`` with the 95% interval of its mean (``total_ms_ci95_lo``/``_hi``), the mean of every
phase and plan metric, plus ``speedup_vs_llama3`` = mean ``total_ms`` of ``llama3`` / mean
``total_ms`` of the method, paired only with the llama3 run of the same identity apart from the
method, its options and its implementation (``impl``: ring-flash-attention's rings beside the
all-gather op's llama3, as the paper ran them; the paper's Fig. 5 normalisation), its 95% interval over the sequences both runs share
(``speedup_vs_llama3_ci95_lo``/``_hi``), and ``speedup_vs_llama3_gmean``, the geometric mean of
per-sequence speedups. Where rows carry ``step_ms`` (a model with layers, :mod:`flashcp.sim.step`),
also ``step_ms_mean`` and ``step_speedup_vs_llama3``, the same ratio for the whole step.

The intervals are Student-t intervals over sequences: of a mean, ``mean ± t·s/√n``; of a ratio of
means ``R = ȳ/x̄`` over paired sequences (the same seed samples the same sequences for every
method), the delta-method (linearisation) standard error ``s(y − R·x) / (x̄·√n)`` (Cochran,
*Sampling Techniques*, 3rd ed., ch. 6). A run with fewer than two sequences has no interval (NaN).

The merge refuses (ValueError) rows it cannot keep apart: the same (run_id, seq_idx, mode) from two
rows files (the same run written twice, e.g. copied folders), or rows without identity.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pandas as pd

from flashcp.results import (
    COMM_COLUMNS,
    IDENTITY_COLUMNS,
    PHASE_COLUMNS,
    ROW_SCHEMA,
    read_rows,
    typed,
    write_csv_atomic,
    write_rows_atomic,
)

log = logging.getLogger(__name__)

#: a summary row per run identity and mode
RUN_KEYS = ("run_id", *IDENTITY_COLUMNS, "mode")
#: runs that differ only in these are compared with each other (speedup_vs_llama3)
PEER_KEYS = tuple(k for k in RUN_KEYS if k not in ("run_id", "method", "method_options", "impl"))
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


def _read_slim(path: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The columns :func:`summarise` reads from every row of a rows file (``run_id``, ``mode``,
    ``status``, ``seq_idx``, phases, plan metrics, bytes), and the identity columns once per run
    (the first row of each ``run_id``; text read dictionary-encoded, so a file of millions of rows
    costs what its measurements cost)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    per_row = {"run_id", "mode", "status", "seq_idx", *PHASE_COLUMNS, *METRICS, *COMM_COLUMNS}
    if path.suffix != ".parquet":
        df = read_rows(path)
        return df[[c for c in df if c in per_row]], df.drop_duplicates("run_id")
    schema = pq.read_schema(path)
    names = schema.names
    rows = read_rows(path, columns=[c for c in names if c in per_row])
    ident = [c for c in ("run_id", *IDENTITY_COLUMNS) if c in names]
    text = [c for c in ident if str(schema.field(c).type) in ("string", "large_string")]
    table = pq.read_table(path, columns=ident, read_dictionary=text)
    run_ids = pc.dictionary_encode(table.column("run_id")).combine_chunks().indices
    _, first = np.unique(run_ids.to_numpy(zero_copy_only=False), return_index=True)
    firsts = table.take(pa.array(np.sort(first)))
    idents = firsts.to_pandas()
    for c in text:
        idents[c] = idents[c].astype("string")
    return rows, typed(idents, strict=False)


def _columns(path: Path) -> list[str]:
    """The column names of a rows file (Parquet: from its schema, without reading the rows)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    return list(pd.read_csv(path, nrows=0).columns)


def _types_ok(part: pd.DataFrame) -> bool:
    """Whether one file's rows pass :func:`flashcp.results.typed` (strict)."""
    try:
        typed(part.drop(columns="_source"))
    except ValueError:
        return False
    return True


def merge_rows(exp_dir: str | Path, rows_paths: list[Path] | None = None) -> pd.DataFrame | None:
    """Concatenate ``rows_paths`` (default: :func:`run_rows_paths`).

    Returns:
        the rows with integer columns as ``Int64``, or None when there are none.
    Raises:
        ValueError: a file lacks the identity columns (written by an older harness: rerun it),
            has a column :data:`flashcp.results.ROW_SCHEMA` lacks or a value its column's type
            refuses, or two files hold the same (run_id, seq_idx, mode); the message names the
            files.
    """
    return _merge(exp_dir, rows_paths, slim=False)[0]


def _merge(
    exp_dir: str | Path, rows_paths: list[Path] | None, slim: bool
) -> tuple[pd.DataFrame | None, pd.DataFrame | None]:
    """:func:`merge_rows`; with ``slim``, only what :func:`summarise` needs of every row
    (:func:`_read_slim`) and the identity columns once per run (one row per ``run_id``, the
    second value; None without ``slim``)."""
    paths = run_rows_paths(exp_dir) if rows_paths is None else list(rows_paths)
    paths = [Path(p) for p in dict.fromkeys(paths) if Path(p).exists()]
    if not paths:
        log.warning("no finished runs under %s", exp_dir)
        return None, None
    parts, ident_parts = [], []
    for k, p in enumerate(paths):
        try:
            df, idents = _read_slim(p) if slim else (read_rows(p), None)
            columns = _columns(p)
        except (OSError, ValueError) as exc:  # a corrupt or unreadable file: name it
            raise ValueError(
                exc if str(p) in str(exc) else f"{p}: cannot read rows: {exc}"
            ) from None
        missing = [
            c for c in ("run_id", *IDENTITY_COLUMNS) if c not in (df if idents is None else idents)
        ]
        if missing:
            raise ValueError(
                f"{p} has no {', '.join(missing[:3])} columns (an older harness wrote it); rerun it"
            )
        unknown = [c for c in columns if c not in ROW_SCHEMA]
        if unknown:  # the merged rows are written in ROW_SCHEMA, which would refuse them
            runs = ", ".join(map(str, pd.unique((df if idents is None else idents)["run_id"])[:3]))
            raise ValueError(
                f"{p} (run {runs}) has column(s) {unknown} that flashcp.results.ROW_SCHEMA lacks "
                "(another version of the harness wrote it): rerun that run, or move its rows file "
                "out of the folder"
            )
        parts.append(df.assign(_source=np.int32(k)))
        if idents is not None:
            ident_parts.append(idents)
    rows = pd.concat(parts, ignore_index=True)
    key = ["run_id", "seq_idx", "mode"]
    dup = rows[rows["seq_idx"].notna() & rows.duplicated(key, keep=False)]
    if len(dup) and ident_parts:
        named = pd.concat(ident_parts).drop_duplicates("run_id")
        dup = dup.merge(named[["run_id", "method", "dataset", "cp_size"]], on="run_id")
    if len(dup):
        files = sorted({str(paths[k]) for k in dup["_source"]})
        raise ValueError(
            f"run {dup['run_id'].iloc[0]} ({dup['method'].iloc[0]}, {dup['dataset'].iloc[0]}, "
            f"cp_size {dup['cp_size'].iloc[0]}) is in several files: {', '.join(files)}; "
            "remove all but one"
        )
    try:
        rows = typed(rows.drop(columns="_source"))
    except ValueError as exc:  # name the file that holds the bad value
        bad = next((paths[k] for k, part in enumerate(parts) if not _types_ok(part)), None)
        raise ValueError(f"{bad or ', '.join(map(str, paths))}: {exc}") from None
    if not ident_parts:
        return rows, None
    return rows, pd.concat(ident_parts, ignore_index=True).drop_duplicates("run_id")


def _t95(n) -> np.ndarray:
    """Two-sided 95% Student-t quantile for ``n`` samples (NaN where ``n < 2``).

    ``scipy.special.stdtrit`` is the inverse of Student's t distribution function, what
    ``scipy.stats.t.ppf`` evaluates (the same numbers), without importing ``scipy.stats`` (about
    a second, more than the rest of a small merge)."""
    from scipy.special import stdtrit

    n = np.asarray(n, dtype="float64")
    return np.where(n >= 2, stdtrit(np.maximum(n - 1, 1), 0.975), np.nan)


def _ratio_halfwidth(per_seq: pd.DataFrame, keys: list[str]) -> pd.Series:
    """Half-width of the 95% interval of ``R = mean(_ref) / mean(total_ms)`` per group of ``keys``
    over paired per-sequence rows: ``t · s(ref − R·x) / (x̄·√n)``, the delta-method standard error
    of a ratio of means (Cochran, *Sampling Techniques*, 3rd ed., ch. 6)."""
    d = per_seq[keys].copy()
    d["_y"] = per_seq["_ref"].astype("float64")
    d["_x"] = per_seq["total_ms"].astype("float64")
    g = d.groupby(keys, dropna=False)
    d["_resid"] = d["_y"] - g["_y"].transform("mean") / g["_x"].transform("mean") * d["_x"]
    st = d.groupby(keys, dropna=False).agg(
        n=("_x", "size"), x_mean=("_x", "mean"), s=("_resid", "std")
    )
    return _t95(st["n"]) * st["s"] / (st["x_mean"] * np.sqrt(st["n"]))


def summarise(rows: pd.DataFrame, idents: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per (run identity, mode) statistics of ``rows`` (see the module docstring).

    Rows are grouped by (``run_id``, ``mode``); ``run_id`` is the hash of the identity columns,
    which are then attached once per run (grouping millions of rows by ~25 text columns is what
    made the merge slow), from ``idents`` (one row per ``run_id``) when given, else from ``rows``.
    """
    source = rows if idents is None else idents  # identity columns once per run (slim merge)
    ident_cols = [k for k in RUN_KEYS if k in source and k not in ("run_id", "mode")]
    idents = source.drop_duplicates("run_id")[["run_id", *ident_cols]]
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
    out["total_ms_p10"] = tot.quantile(0.1)
    out["total_ms_p90"] = tot.quantile(0.9)
    half = _t95(tot.count()) * tot.std() / np.sqrt(tot.count())
    out["total_ms_ci95_lo"] = out["total_ms_mean"] - half
    out["total_ms_ci95_hi"] = out["total_ms_mean"] + half
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
        _peer=ok["run_id"].map(peer_of).to_numpy(),
        _llama3=ok["run_id"]
        .map(idents.set_index("run_id")["method"] == "llama3")
        .to_numpy(dtype=bool),
    )
    ref = seq.loc[seq["_llama3"], ["_peer", "mode", "seq_idx", "total_ms"]]
    ref = ref.rename(columns={"total_ms": "_ref"})
    per_seq = seq.merge(ref, on=["_peer", "mode", "seq_idx"], how="inner", validate="many_to_one")
    per_seq["_log_speedup"] = np.log(
        per_seq["_ref"].astype("float64") / per_seq["total_ms"].astype("float64")
    )
    gm = per_seq.groupby(gkeys, dropna=False)["_log_speedup"].mean().apply(np.exp)
    out = out.merge(gm.rename("speedup_vs_llama3_gmean").reset_index(), on=gkeys, how="left")
    half = _ratio_halfwidth(per_seq, gkeys).rename("_half").reset_index()
    out = out.merge(half, on=gkeys, how="left")
    out["speedup_vs_llama3_ci95_lo"] = out["speedup_vs_llama3"] - out["_half"]
    out["speedup_vs_llama3_ci95_hi"] = out["speedup_vs_llama3"] + out["_half"]
    out = _step_speedup(out, ok, gkeys)
    out = out.drop(columns=["llama3_total_ms_mean", "_peer", "_half"])
    # readable, stable order (run_id is a hash: sorting by it reorders the file after every commit)
    order = ("dataset", "context_len", "cp_size", "model", "mode", "method", "run_id")
    out = out.sort_values([c for c in order if c in out], kind="stable", ignore_index=True)
    return typed(out)


def _step_speedup(out: pd.DataFrame, ok: pd.DataFrame, gkeys: list[str]) -> pd.DataFrame:
    """``step_ms_mean`` and ``step_speedup_vs_llama3`` (mean step time of llama3 over the method's:
    the whole model, :mod:`flashcp.sim.step`) where the rows carry ``step_ms``; null for an
    attention-only model. Added only when some row has a step time (attention-only summaries keep
    their columns)."""
    if "step_ms" not in ok or not ok["step_ms"].notna().any():
        return out
    mean = ok.groupby(gkeys, dropna=False)["step_ms"].mean().rename("step_ms_mean").reset_index()
    out = out.merge(mean, on=gkeys, how="left", validate="one_to_one")
    base = out.loc[out["method"] == "llama3", ["_peer", "mode", "step_ms_mean"]]
    base = base.rename(columns={"step_ms_mean": "_llama3_step"})
    out = out.merge(base, on=["_peer", "mode"], how="left", validate="many_to_one")
    out["step_speedup_vs_llama3"] = out["_llama3_step"] / out["step_ms_mean"]
    return out.drop(columns=["_llama3_step"])


def aggregate(
    exp_dir: str | Path, rows_paths: list[Path] | None = None, write_rows: bool = True
) -> pd.DataFrame | None:
    """Merge ``rows_paths`` (default: every run's rows under ``exp_dir/runs/``) into
    ``exp_dir/rows.parquet`` (unless ``write_rows`` is false: then a merged file left by an earlier
    merge is removed, as it would not match the summary) and ``exp_dir/summary.csv``; return the
    summary (None when there are no rows).

    Raises:
        ValueError: as :func:`merge_rows`.
    """
    t0 = time.perf_counter()
    exp_dir = Path(exp_dir)
    rows, idents = _merge(exp_dir, rows_paths, slim=not write_rows)
    if rows is None:
        return None
    if write_rows:
        write_rows_atomic(rows, exp_dir / ROWS_FILE)
    else:
        (exp_dir / ROWS_FILE).unlink(missing_ok=True)
    summary = summarise(rows, idents)
    write_csv_atomic(summary, exp_dir / "summary.csv")
    log.info(
        "%d rows, %d summary rows -> %s in %.1f s (merge)",
        len(rows), len(summary), exp_dir, time.perf_counter() - t0,
    )  # fmt: skip
    return summary


#: identity columns in which a rerun of a committed experiment differs from it by design
VERSION_COLUMNS = ("run_id", "code_version")
#: what :func:`compare` reports per run
COMPARED = ("total_ms_mean", "speedup_vs_llama3")


def compare(ref_dir: str | Path, new_dir: str | Path) -> pd.DataFrame:
    """Match the runs of two experiment folders (their ``summary.csv``) by run identity apart from
    :data:`VERSION_COLUMNS`, e.g. the committed reference ``results/fig5`` and a fresh
    ``outputs/fig5``.

    Returns:
        one row per (run identity, mode) found in either: the identity, ``<metric>_ref`` and
        ``<metric>_new`` for each of :data:`COMPARED`, ``total_ms_rel_change`` (new / ref - 1),
        ``speedup_change`` (new - ref) and ``found``: ``both`` | ``ref_only`` | ``new_only``.
    Raises:
        ValueError: a folder has no ``summary.csv``, or one without a compared column (named).
    """
    frames = []
    for d in (ref_dir, new_dir):
        path = Path(d) / "summary.csv"
        if not path.exists():
            raise ValueError(f"{path} does not exist; run or aggregate the experiment first")
        frames.append(read_rows(path))
        lacks = [c for c in ("mode", *COMPARED) if c not in frames[-1]]
        if lacks:
            raise ValueError(f"{path} has no column(s) {lacks}; aggregate that folder again")
    ref, new = frames
    keys = [k for k in RUN_KEYS if k not in VERSION_COLUMNS and k in ref and k in new]
    out = ref[[*keys, *COMPARED]].merge(
        new[[*keys, *COMPARED]], on=keys, how="outer", suffixes=("_ref", "_new"), indicator="found"
    )
    found = {"both": "both", "left_only": "ref_only", "right_only": "new_only"}
    out["found"] = out["found"].astype(str).map(found)
    out["total_ms_rel_change"] = out["total_ms_mean_new"] / out["total_ms_mean_ref"] - 1
    out["speedup_change"] = out["speedup_vs_llama3_new"] - out["speedup_vs_llama3_ref"]
    return out


#: relative change of a compared value below which a run counts as unchanged (float noise)
CHANGE_RTOL = 1e-9
#: columns naming a run in the lines of :func:`compare_report`
_NAMED = ("dataset", "cp_size", "model", "mode", "method")


def _run_name(row: pd.Series, table: pd.DataFrame) -> str:
    """``dataset=... cp_size=... model=... mode=... method=...`` plus every other identity column
    whose value varies in ``table`` (e.g. ``method_options``), so the line names one run."""
    cols = [c for c in _NAMED if c in row.index]
    cols += [
        k for k in RUN_KEYS
        if k in table and k not in cols and k not in VERSION_COLUMNS
        and table[k].astype("string").nunique(dropna=False) > 1
    ]  # fmt: skip
    return " ".join(f"{k}={row[k]}" for k in cols)


def _changed(ref: Any, new: Any) -> bool:
    ref, new = float(ref), float(new)
    if ref != ref or new != new:
        return (ref != ref) != (new != new)  # a value appeared or disappeared
    return abs(new - ref) > CHANGE_RTOL * max(abs(ref), abs(new), 1e-300)


def compare_report(table: pd.DataFrame) -> list[str]:
    """How two folders differ (see :func:`compare`): a count line, one line per run (identity
    and mode) whose ``total_ms_mean`` or ``speedup_vs_llama3`` changed (beyond
    :data:`CHANGE_RTOL`, relative), one per run found in one folder only, and the largest change
    of each compared value."""
    both = table[table["found"] == "both"]
    n_ref, n_new = ((table["found"] == f).sum() for f in ("ref_only", "new_only"))
    lines = [
        f"{len(both)} runs in both, {n_ref} only in the reference, {n_new} only in the new folder"
    ]
    n_changed = 0
    for _, r in both.iterrows():
        if not any(_changed(r[f"{m}_ref"], r[f"{m}_new"]) for m in COMPARED):
            continue
        n_changed += 1
        lines.append(
            f"changed: {_run_name(r, table)}: total_ms_mean {r['total_ms_mean_ref']:.6g} -> "
            f"{r['total_ms_mean_new']:.6g} ({r['total_ms_rel_change']:+.3%}), speedup_vs_llama3 "
            f"{r['speedup_vs_llama3_ref']:.6g} -> {r['speedup_vs_llama3_new']:.6g} "
            f"({r['speedup_change']:+.4g})"
        )
    for found, where in (("ref_only", "only in the reference"), ("new_only", "only in the new")):
        for _, r in table[table["found"] == found].iterrows():
            lines.append(f"{where}: {_run_name(r, table)}")
    lines.insert(1, f"{n_changed} of {len(both)} runs in both changed")
    for col in ("total_ms_rel_change", "speedup_change"):
        change = both[col].astype("float64").abs()
        if change.notna().any():
            worst = both.loc[change.idxmax()]
            lines.append(f"largest {col}: {worst[col]:+.4g} ({_run_name(worst, table)})")
    return lines


def _cli(argv: list[str] | None = None) -> None:
    """``python -m experiments.aggregate DIR``: merge every run of DIR; a missing folder, no runs
    or a bad rows file is one line on stderr and exit code 2."""
    import argparse
    import signal

    ap = argparse.ArgumentParser(
        prog="python -m experiments.aggregate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "exp_dir",
        metavar="RESULTS_DIR/NAME",
        help="experiment folder whose runs/*/rows.parquet (or rows.csv) to merge",
    )
    ap.add_argument(
        "--compare",
        metavar="REF_DIR",
        help="do not merge: compare the summary of RESULTS_DIR/NAME with that of REF_DIR (e.g. the "
        "committed results/fig5); exit code 1 when a run of REF_DIR is missing",
    )
    args = ap.parse_args(argv)

    def fail(message: str) -> NoReturn:  # a bad folder or file: one line, exit code 2
        print(f"{ap.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    for folder in (args.exp_dir, args.compare):
        if folder is not None and not Path(folder).is_dir():
            fail(
                f"{folder}: no such folder"
                if not Path(folder).exists()
                else f"{folder} is a file, not a folder"
            )
    if hasattr(signal, "SIGPIPE"):  # `... | head` ends the report quietly, as a Unix tool does
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    if args.compare:
        try:
            table = compare(args.compare, args.exp_dir)
        except ValueError as exc:
            fail(str(exc))
        print("\n".join(compare_report(table)))
        sys.exit(1 if (table["found"] == "ref_only").any() else 0)
    if not any(Path(p).exists() for p in run_rows_paths(args.exp_dir)):
        fail(f"no finished runs under {args.exp_dir}/runs (no runs/*/rows.parquet or rows.csv)")
    try:
        s = aggregate(args.exp_dir)
    except ValueError as exc:
        fail(str(exc))
    if s is None:
        fail(f"no finished runs under {args.exp_dir}/runs")
    print(f"wrote {args.exp_dir}/{ROWS_FILE} and summary.csv ({len(s)} summary rows)")


if __name__ == "__main__":
    _cli()
