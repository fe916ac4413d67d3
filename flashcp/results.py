"""Result-row schema shared by every executor (sim, dist, emulate).

One row per (run, sequence, mode); units are in the column names. Executors fill
:data:`PHASE_COLUMNS` and :data:`COMM_COLUMNS`; the harness adds plan metrics, the run's identity
(:data:`IDENTITY_COLUMNS`, hashed into ``run_id``) and provenance.

Integer columns (:data:`INT_COLUMNS`) are pandas nullable ``Int64``: a failed row's missing value
is ``<NA>``, never a float that turns ``cp_size`` into ``4.0``. Write rows with
:func:`write_rows_atomic` and read them with :func:`read_rows` to keep those types. Per-sequence
tables (a run's rows, a sweep's merged rows: millions of rows at the paper's scale) are Parquet
files; summaries and small tables are CSV.
"""

from __future__ import annotations

__all__ = [
    "COMM_COLUMNS",
    "IDENTITY_COLUMNS",
    "INT_COLUMNS",
    "PHASE_COLUMNS",
    "TEXT_COLUMNS",
    "code_version",
    "config_hash",
    "identity_hash",
    "markdown_table",
    "provenance",
    "read_rows",
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

#: every value that changes a run's results (docs/design.md §7). Two runs with equal values are the
#: same measurement; ``run_id`` = :func:`identity_hash` of them. Dict-valued fields (method and
#: executor options, hardware constants changed from their profile) are canonical JSON strings.
#: A new result-changing config field is one more name here and one more entry in
#: ``experiments.run.run_identity``.
IDENTITY_COLUMNS: tuple[str, ...] = (
    "dataset", "dataset_path", "dataset_sha256", "weighting", "dataset_cap", "overlong",
    "method", "method_options", "impl", "cp_size", "context_len", "num_sequences", "seed", "modes",
    "model", "num_heads", "num_kv_heads", "head_dim", "dtype",
    "executor", "executor_options", "hardware", "hardware_changes", "hardware_sha256",
    "code_version",
)  # fmt: skip

#: integer-valued columns (stored as pandas ``Int64``; missing = ``<NA>``)
INT_COLUMNS: tuple[str, ...] = (
    "job_num", "cp_size", "context_len", "num_sequences", "seed", "dataset_cap", "num_heads",
    "num_kv_heads", "head_dim", "seq_idx", "num_docs", "max_doc_len", "overlong_docs",
    "overlong_tokens_cut", "comm_tokens", "comm_tokens_full", "comm_tokens_sharded",
    "num_split_docs", "num_pieces", "max_shards_per_rank", *COMM_COLUMNS, "num_rows", "num_ok",
    "num_error",
)  # fmt: skip

#: columns that are text even when every value looks like a number (hashes, ids, JSON)
TEXT_COLUMNS: tuple[str, ...] = (
    "run_id", "config_hash", "sweep_id", "git_commit", "code_version", "dataset_path",
    "dataset_sha256", "hardware_sha256", "method_options", "executor_options", "hardware_changes",
    "modes", "overrides", "status", "error",
)  # fmt: skip


def identity_hash(identity: dict) -> str:
    """``run_id``: sha256 (first 12 hex digits) of the :data:`IDENTITY_COLUMNS` values of a run.

    Raises:
        ValueError: ``identity`` lacks one of :data:`IDENTITY_COLUMNS` (naming it).
    """
    missing = [k for k in IDENTITY_COLUMNS if k not in identity]
    if missing:
        raise ValueError(f"run identity lacks {', '.join(missing)}")
    return config_hash({k: identity[k] for k in IDENTITY_COLUMNS})


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
        ValueError: another suffix.
    """
    import pandas as pd

    suffix = str(path).rsplit(".", 1)[-1]
    if suffix == "parquet":
        return typed(pd.read_parquet(path, columns=columns), strict=False)
    if suffix != "csv":
        raise ValueError(f"{path}: rows are .parquet or .csv files")
    head = pd.read_csv(path, nrows=0).columns
    dtypes = {c: "Int64" for c in INT_COLUMNS if c in head}
    dtypes.update({c: "string" for c in TEXT_COLUMNS if c in head})
    return pd.read_csv(path, dtype=dtypes, usecols=columns)


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


def markdown_table(df, float_format: str = ".4g") -> str:
    """``df`` as a GitHub Markdown table (floats with ``float_format``, NaN as an empty cell).

    Written here rather than with ``DataFrame.to_markdown`` so the harness needs no ``tabulate``.
    """
    import math

    def cell(v) -> str:
        if isinstance(v, float):  # numpy floating scalars subclass float
            return "" if math.isnan(v) else format(v, float_format)
        return str(v)

    cols = [str(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def write_rows_atomic(df, path) -> None:
    """Write rows to ``path`` (``.parquet``, or ``.csv`` through :func:`write_csv_atomic`) through
    a temporary file and an atomic rename. Parquet keeps the column types (``Int64`` with
    missing values, text) exactly.

    Raises:
        ValueError: ``path`` is neither ``.parquet`` nor ``.csv``.
    """
    import os
    from pathlib import Path

    path = Path(path)
    if path.suffix == ".csv":
        write_csv_atomic(df, path)
        return
    if path.suffix != ".parquet":
        raise ValueError(f"{path}: rows are written as .parquet or .csv files")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    typed(df.copy(), strict=False).to_parquet(tmp, index=False)
    os.replace(tmp, path)
