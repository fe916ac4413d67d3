"""Result-row schema shared by every executor (sim, dist, emulate).

One row per (run, sequence, mode); units are in the column names. Executors fill
:data:`PHASE_COLUMNS` and :data:`COMM_COLUMNS`; the harness adds plan metrics, the run's identity
(:data:`IDENTITY_COLUMNS`, hashed into ``run_id``) and provenance.

Every row file (a job's ``rows.parquet``, successful or failed, of any method; a sweep's merged
rows) has exactly the columns of :data:`ROW_SCHEMA`, in its order and with its types:
:func:`write_rows_atomic` adds an absent column as typed nulls (a failed job has no plan metrics,
a non-ILP run no ``ilp_*`` values) and refuses a column the schema does not name. So
``pyarrow.dataset.dataset(runs_folder)`` or ``pandas.read_parquet(list_of_files)`` sees one schema
whichever file comes first. Integer columns (:data:`INT_COLUMNS`) are pandas nullable ``Int64``: a
failed row's missing value is ``<NA>``, never a float that turns ``cp_size`` into ``4.0``. Write
rows with :func:`write_rows_atomic` and read them with :func:`read_rows` to keep those types.
Per-sequence tables (a run's rows, a sweep's merged rows: millions of rows at the paper's scale)
are Parquet files; summaries and small tables are CSV.
"""

from __future__ import annotations

import functools
from types import MappingProxyType

__all__ = [
    "COMM_COLUMNS",
    "DIST_COLUMNS",
    "IDENTITY_COLUMNS",
    "ILP_INFO_COLUMNS",
    "INT_COLUMNS",
    "PHASE_COLUMNS",
    "ROW_SCHEMA",
    "TEXT_COLUMNS",
    "arrow_row_schema",
    "check_output_dir",
    "code_version",
    "config_hash",
    "conform_rows",
    "identity_hash",
    "markdown_table",
    "provenance",
    "read_rows",
    "runs_table",
    "typed",
    "write_csv_atomic",
    "write_rows_atomic",
]

#: latency breakdown of one attention layer's CP step, milliseconds (slowest rank per phase).
#: ``others_ms`` holds data copies (gathering/scattering KV pieces), LSE merges and launch overheads.
PHASE_COLUMNS: tuple[str, ...] = (
    "allgather_ms",
    "attn_fwd_ms",
    "attn_bwd_ms",
    "reducescatter_ms",
    "p2p_ms",
    "alltoall_ms",
    "others_ms",
    "total_ms",
)

#: bytes one rank receives in the step (see :func:`flashcp.comm.comm_volume`).
COMM_COLUMNS: tuple[str, ...] = (
    "allgather_bytes",
    "reducescatter_bytes",
    "p2p_bytes",
    "alltoall_bytes",
    "comm_bytes",
)

#: what only ``executor=dist`` measures (null in other executors' rows): the bytes one rank
#: receives from ranks on its own node and from other nodes (the sums over kinds of
#: :meth:`flashcp.ops.collectives.CommCounter.by_link`, max over ranks; 0 across nodes on one
#: node) and a checksum of every rank's output (and, for ``train``, its gradients) of the last
#: timed step (:func:`flashcp.executors.dist.measure_step`).
DIST_COLUMNS: tuple[str, ...] = ("intra_node_bytes", "inter_node_bytes", "out_checksum")

#: every value that changes a run's results (docs/design.md §7). Two runs with equal values are the
#: same measurement; ``run_id`` = :func:`identity_hash` of them. Dict-valued fields (method and
#: executor options, hardware constants changed from their profile) are canonical JSON strings.
#: A new result-changing config field is one more name here and one more entry in
#: ``experiments.common.rows.run_identity``.
IDENTITY_COLUMNS: tuple[str, ...] = (
    "dataset", "dataset_path", "dataset_sha256", "weighting", "dataset_cap", "overlong",
    "method", "method_options", "impl", "cp_size", "context_len", "num_sequences", "seed", "modes",
    "model", "num_heads", "num_kv_heads", "head_dim", "dtype", "step_model",
    "executor", "executor_options", "hardware", "hardware_changes", "hardware_sha256",
    "code_version", "nodes", "placement",
)  # fmt: skip

#: ``plan.info`` keys of an ILP plan (:func:`flashcp.planners.ilp.plan_ilp`) that every row carries as
#: ``ilp_<key>``: the solve's status, relative gap, objective (of the returned plan), best bound,
#: solver threads asked for (null: the solver's default), whether a warm start was given and
#: accepted, and the heuristic whose plan a fallback returned (null: no fallback)
ILP_INFO_COLUMNS: tuple[str, ...] = (
    "solver_status", "gap", "objective", "best_bound", "threads", "warm_start_given",
    "warm_start_accepted", "fallback_method",
)  # fmt: skip

_ILP_KINDS = {
    "solver_status": "text", "gap": "float", "objective": "float", "best_bound": "float",
    "threads": "int", "warm_start_given": "bool", "warm_start_accepted": "bool",
    "fallback_method": "text",
}  # fmt: skip

#: every column of a row file, in file order, and its type: ``int`` (pandas ``Int64``, Parquet
#: int64), ``float`` (float64), ``bool`` (pandas ``boolean``) or ``text`` (pandas ``string``);
#: each may be null. Groups: the job, the run identity (:data:`IDENTITY_COLUMNS`), the sequence
#: and its plan, the mode and status, the step's phases and bytes, the dataset's overlong
#: documents, provenance, the ILP's solve. A new row column is one more entry here.
ROW_SCHEMA = MappingProxyType({
    "name": "text", "sweep_id": "text", "job_num": "int", "overrides": "text", "launcher": "text",
    "run_id": "text",
    "dataset": "text", "dataset_path": "text", "dataset_sha256": "text", "weighting": "text",
    "dataset_cap": "int", "overlong": "text", "method": "text", "method_options": "text",
    "impl": "text", "cp_size": "int", "context_len": "int", "num_sequences": "int", "seed": "int",
    "modes": "text", "model": "text", "num_heads": "int", "num_kv_heads": "int", "head_dim": "int",
    "dtype": "text", "step_model": "text", "executor": "text", "executor_options": "text", "hardware": "text",
    "hardware_changes": "text", "hardware_sha256": "text", "code_version": "text",
    "nodes": "int", "placement": "text",
    "seq_idx": "int", "num_docs": "int", "max_doc_len": "int", "plan_status": "text",
    "plan_ms": "float", "pad_tokens": "int", "imbalance_ratio": "float", "comm_tokens": "int",
    "comm_tokens_full": "int", "comm_saving": "float", "comm_tokens_sharded": "int",
    "num_split_docs": "int", "num_pieces": "int", "max_shards_per_rank": "int",
    "mode": "text", "status": "text",
    **dict.fromkeys(PHASE_COLUMNS, "float"), "step_ms": "float",
    **dict.fromkeys(COMM_COLUMNS, "int"),
    "intra_node_bytes": "int", "inter_node_bytes": "int", "out_checksum": "text",
    "overlong_docs": "int", "overlong_tokens_cut": "int",
    "git_commit": "text", "git_dirty": "bool", "flashcp_version": "text", "torch_version": "text",
    "config_hash": "text",
    **{f"ilp_{k}": _ILP_KINDS[k] for k in ILP_INFO_COLUMNS},
})  # fmt: skip

#: integer-valued columns (stored as pandas ``Int64``; missing = ``<NA>``): those of
#: :data:`ROW_SCHEMA` and the summaries' counts
INT_COLUMNS: tuple[str, ...] = (
    *(c for c, kind in ROW_SCHEMA.items() if kind == "int"),
    "num_rows",
    "num_ok",
    "num_error",
)

#: columns that are text even when every value looks like a number (hashes, ids, JSON)
TEXT_COLUMNS: tuple[str, ...] = (
    "run_id", "config_hash", "sweep_id", "git_commit", "code_version", "dataset_path",
    "dataset_sha256", "hardware_sha256", "method_options", "executor_options", "hardware_changes",
    "modes", "overrides", "launcher", "status", "error", "out_checksum",
)  # fmt: skip


def identity_hash(identity: dict) -> str:
    """``run_id``: sha256 (first 12 hex digits) of the :data:`IDENTITY_COLUMNS` values of a run.

    Raises:
        ValueError: ``identity`` lacks one of :data:`IDENTITY_COLUMNS` (naming it).
    """
    missing = [k for k in IDENTITY_COLUMNS if k not in identity]
    if missing:
        raise ValueError(f"run identity lacks {', '.join(missing)}")
    # an attention-only model ("-") hashes as before the step model existed: run_ids unchanged
    keys = [k for k in IDENTITY_COLUMNS if not (k == "step_model" and identity[k] == "-")]
    return config_hash({k: identity[k] for k in keys})


def typed(df, strict: bool = True):
    """``df`` with :data:`INT_COLUMNS` as ``Int64`` and :data:`TEXT_COLUMNS` as text (in place).

    Args:
        strict: raise on an integer column holding a non-integer value; otherwise leave it as is.
    Raises:
        ValueError: (strict) an integer column holds a non-integer value, naming the column.
    """
    import pandas as pd

    for col in INT_COLUMNS:
        if col in df and df[col].dtype != "Int64":
            try:
                df[col] = pd.to_numeric(df[col]).astype("Int64")
            except (TypeError, ValueError) as exc:
                if strict:
                    raise ValueError(f"column {col!r} must hold integers: {exc}") from None
    for col in TEXT_COLUMNS:
        if col in df:
            df[col] = df[col].astype("string")
    return df


def read_rows(path, columns=None):
    """Read a rows or summary table written by the harness (``.parquet`` or ``.csv``), with
    integer columns as ``Int64`` and hashes/ids as text (a plain ``pd.read_csv`` turns an integer
    column with a missing value into floats and a hex hash like ``1e5`` into a number).

    Args:
        path: a ``.parquet`` or ``.csv`` file.
        columns: read only these columns (default: all).
    Raises:
        ValueError: another suffix, or a file that is missing, unreadable or holds a value its
            column's type refuses; the message names the file.
    """
    import pandas as pd

    suffix = str(path).rsplit(".", 1)[-1]
    if suffix not in ("parquet", "csv"):
        raise ValueError(f"{path}: rows are .parquet or .csv files")
    try:
        if suffix == "parquet":
            return typed(pd.read_parquet(path, columns=columns), strict=False)
        head = pd.read_csv(path, nrows=0).columns
        dtypes = {c: "Int64" for c in INT_COLUMNS if c in head}
        dtypes.update({c: "string" for c in TEXT_COLUMNS if c in head})
        return pd.read_csv(path, dtype=dtypes, usecols=columns)
    except (OSError, ValueError, TypeError) as exc:  # pyarrow's errors are ValueError or OSError
        raise ValueError(f"{path}: cannot read rows: {exc}") from None


def provenance(repo_dir: str | None = None) -> dict[str, object]:
    """Where a row comes from: git commit and dirty flag of the harness (tracked files outside
    ``results/`` differ from the commit), package versions.

    Versions are read from installed package metadata (torch is not imported). Missing git, or an
    installed wheel (no checkout: :func:`flashcp.resources.source_root`), gives
    ``git_commit = "unknown"``.
    """
    import subprocess
    from importlib import metadata
    from pathlib import Path

    from flashcp.resources import source_root

    root = Path(repo_dir) if repo_dir else source_root()  # None: an installed wheel, no git

    def git(*args: str) -> str | None:
        if root is None:
            return None
        try:
            out = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "not installed"

    commit = git("rev-parse", "HEAD")
    # results/ is the output, not the code: rewriting it does not make the harness dirty
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results")
    diff = git("diff", "HEAD", "--", ".", ":(exclude)results") if status else ""
    prov = {
        "git_commit": commit or "unknown",
        "git_dirty": bool(status) if status is not None else None,
        "flashcp_version": version("flashcp"),
        "torch_version": version("torch"),
    }
    prov["code_version"] = code_version(prov, diff)
    return prov


def code_version(prov: dict, diff: str | None) -> str:
    """The code a row was computed with, part of the run identity: the git commit, plus
    ``+dirty.<hash of the uncommitted diff>`` when tracked files outside ``results/`` differ from it
    (two different uncommitted states never share a version); ``flashcp==<version>`` without git.
    """
    commit = prov.get("git_commit", "unknown")
    if commit == "unknown":
        return f"flashcp=={prov.get('flashcp_version', 'unknown')}"
    if not prov.get("git_dirty"):
        return str(commit)
    import hashlib

    return f"{commit}+dirty.{hashlib.sha256((diff or '').encode()).hexdigest()[:8]}"


def config_hash(cfg_dict: dict) -> str:
    """sha256 (first 12 hex digits) of a resolved config as canonical JSON."""
    import hashlib
    import json

    blob = json.dumps(cfg_dict, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def write_csv_atomic(df, path) -> None:
    """Write a pandas DataFrame to ``path`` through a temporary file and an atomic rename, so an
    interrupted run never leaves a half-written CSV where a finished one is expected. Columns of
    :data:`INT_COLUMNS` that hold only integers are written as integers (no ``4.0``)."""
    import os
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    typed(df.copy(), strict=False).to_csv(tmp, index=False)
    os.replace(tmp, path)


def check_output_dir(path, what: str = "output folder") -> None:
    """Check, before anything is written, that the folder ``path`` can be created (where missing)
    and written: every existing part of it is a folder, and its nearest existing ancestor takes a
    new entry (probed with an empty folder made and removed at once, so that permissions, ACLs,
    a read-only file system and root's rights all count as the writes would). Leaves nothing
    behind.

    Args:
        path: the folder (absolute or relative to the working directory).
        what: how the message names it (e.g. ``results_dir=outputs``, ``--out x``).
    Raises:
        ValueError: one line naming ``what``, ``path`` and the part that blocks it.
    """
    import os
    import tempfile
    from pathlib import Path

    target = Path(path)
    probe = target
    while not probe.exists() and not probe.is_symlink() and probe.parent != probe:
        probe = probe.parent  # the nearest existing ancestor
    if probe.exists() and not probe.is_dir():
        blocker = "it is" if probe == target else f"{probe} is"
        raise ValueError(
            f"{what}: cannot write the folder {target}: {blocker} a file, not a folder"
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=probe))
    except OSError as exc:
        raise ValueError(
            f"{what}: cannot write the folder {target}: {probe} takes no new entry "
            f"({exc.strerror or exc})"
        ) from None


def markdown_table(df, float_format: str = ".4g") -> str:
    """``df`` as a GitHub Markdown table (floats with ``float_format``; NaN, ``<NA>`` and None,
    a value that is missing or does not apply, as an empty cell).

    Written here rather than with ``DataFrame.to_markdown`` so the harness needs no ``tabulate``.
    """
    import math

    import pandas as pd

    def cell(v) -> str:
        if v is None or v is pd.NA:  # a typed null (an Int64 column's)
            return ""
        if isinstance(v, float):  # numpy floating scalars subclass float
            return "" if math.isnan(v) else format(v, float_format)
        return str(v)

    cols = [str(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


_PANDAS_DTYPES = {"int": "Int64", "float": "float64", "bool": "boolean", "text": "string"}


def conform_rows(df):
    """``df`` as a row table of :data:`ROW_SCHEMA`: its columns in the schema's order, each of
    the schema's type, an absent one all nulls (a new DataFrame; ``df`` is not modified).

    Args:
        df: rows (a pandas DataFrame) whose columns are all named in :data:`ROW_SCHEMA`.
    Raises:
        ValueError: a column the schema does not name, or a value that does not fit its column's
            type (e.g. a fraction in an integer column); the message names the column.
    """
    import pandas as pd

    _check_known(df.columns)
    cols = {}
    for col, kind in ROW_SCHEMA.items():
        if col not in df:
            cols[col] = pd.Series(None, index=df.index, dtype=_PANDAS_DTYPES[kind])
            continue
        cols[col] = _conformed(df[col], col, kind)
    return pd.DataFrame(cols, index=df.index)


def arrow_row_schema():
    """:data:`ROW_SCHEMA` as a ``pyarrow.Schema`` (int64, float64, bool, string; all nullable)."""
    import pyarrow as pa

    types = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "text": pa.string()}
    return pa.schema([pa.field(c, types[kind]) for c, kind in ROW_SCHEMA.items()])


def _check_known(columns) -> None:
    """Raise ValueError naming the ``columns`` :data:`ROW_SCHEMA` does not name."""
    unknown = [c for c in columns if c not in ROW_SCHEMA]
    if unknown:
        raise ValueError(
            f"row columns {unknown} are not in flashcp.results.ROW_SCHEMA (add them there, with "
            "their type, so every row file keeps one schema)"
        )


def _conformed(s, col: str, kind: str):
    """One column ``s`` (a pandas Series) as :func:`conform_rows` gives it."""
    import pandas as pd

    try:
        if kind in ("int", "float"):
            s = pd.to_numeric(s)
        return s.astype(_PANDAS_DTYPES[kind])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"row column {col!r} must hold {kind} values: {exc}") from None


@functools.cache
def _arrow_pandas_schema():
    """:func:`arrow_row_schema` with the pandas metadata ``Table.from_pandas`` gives a
    :func:`conform_rows` frame (the column dtypes ``Int64``, ``string``...; no index), so a table
    built from arrays reads back through pandas as one written from a DataFrame does."""
    import pandas as pd
    import pyarrow as pa

    empty = conform_rows(pd.DataFrame(index=pd.RangeIndex(0)))
    return pa.Table.from_pandas(empty, schema=arrow_row_schema(), preserve_index=False).schema


def runs_table(rows, per_run, run_of_row):
    """The row table of several runs (the :data:`ROW_SCHEMA` table :func:`write_rows_atomic`
    writes), built from the runs' per-row columns and their per-run constants without
    repeating the constants as Python objects: each constant column is conformed once per run
    and expanded by index in Arrow.

    The result equals ``pyarrow.Table.from_pandas(conform_rows(df), schema=...)`` of the frame
    ``df`` holding ``rows``' columns and, on each row, its run's ``per_run`` values (its schema
    metadata included), in ``rows``' order.

    Args:
        rows: pandas DataFrame of R rows, the per-row columns (a :data:`ROW_SCHEMA` column each).
        per_run: pandas DataFrame of U rows, one per run, the columns constant within a run
            (job, identity, provenance); none of them also in ``rows``.
        run_of_row: (R,) integer array, each row's run: a position in ``per_run``, in [0, U).
    Returns:
        ``pyarrow.Table`` of R rows with the columns of :data:`ROW_SCHEMA` in its order; a column
        in neither frame is all nulls of its type.
    Raises:
        ValueError: a column :data:`ROW_SCHEMA` does not name, a column in both frames, a value
            that does not fit its column's type (naming the column, as :func:`conform_rows`), or
            ``run_of_row`` not R positions in [0, U).
    """
    import numpy as np
    import pyarrow as pa

    _check_known((*rows.columns, *per_run.columns))
    both = sorted(set(rows.columns) & set(per_run.columns))
    if both:
        raise ValueError(f"columns {both} are given both per row and per run")
    idx = np.asarray(run_of_row)
    if idx.shape != (len(rows),) or not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(
            f"run_of_row must be {len(rows)} integer positions (one per row); got shape "
            f"{idx.shape}, dtype {idx.dtype}"
        )
    if idx.size and (idx.min() < 0 or idx.max() >= len(per_run)):
        raise ValueError(
            f"run_of_row holds positions outside [0, {len(per_run)}): {idx.min()}..{idx.max()}"
        )
    schema = _arrow_pandas_schema()
    take = pa.array(idx.astype(np.int64, copy=False))
    arrays = []
    for field in schema:
        col, kind = field.name, ROW_SCHEMA[field.name]
        if col in rows:
            s = _conformed(rows[col], col, kind)
            arrays.append(pa.Array.from_pandas(s, type=field.type))
        elif col in per_run:
            s = _conformed(per_run[col], col, kind)
            arrays.append(pa.Array.from_pandas(s, type=field.type).take(take))
        else:
            arrays.append(pa.nulls(len(rows), type=field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def write_rows_atomic(df, path) -> None:
    """Write rows to ``path`` (``.parquet``, or ``.csv`` through :func:`write_csv_atomic`) through
    a temporary file and an atomic rename, in the one row schema (:func:`conform_rows`: every
    column of :data:`ROW_SCHEMA`, absent ones as typed nulls). Parquet keeps the column types
    (``Int64`` with missing values, text) exactly.

    Args:
        df: the rows, a pandas DataFrame, or a ``pyarrow.Table`` of :data:`ROW_SCHEMA`'s schema
            (:func:`runs_table`), written as it is.
    Raises:
        ValueError: ``path`` is neither ``.parquet`` nor ``.csv``, the rows do not fit
            :data:`ROW_SCHEMA` (:func:`conform_rows`), or a table has another schema.
    """
    import os
    from pathlib import Path

    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if path.suffix not in (".csv", ".parquet"):
        raise ValueError(f"{path}: rows are written as .parquet or .csv files")
    if isinstance(df, pa.Table):
        if df.schema != arrow_row_schema():
            raise ValueError(f"{path}: a row table must have flashcp.results.ROW_SCHEMA's schema")
        table, rows = df, None
    else:
        table, rows = None, conform_rows(df)
    if path.suffix == ".csv":
        write_csv_atomic(table.to_pandas() if rows is None else rows, path)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    if table is None:
        table = pa.Table.from_pandas(rows, schema=arrow_row_schema(), preserve_index=False)
    pq.write_table(table, tmp)
    os.replace(tmp, path)
