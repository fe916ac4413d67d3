"""Reading length tables and users' document-length files (with pandas).

* :func:`read_table`: the distribution tables under ``datasets/`` (CSV: a label column, then
  numeric columns; sources of every number in ``datasets/README.md``).
* :func:`read_lengths_file`: a user's document lengths, as ``.npy``, CSV, Parquet, JSON / JSON
  Lines, or plain text with one length per line.

Units: every length is in tokens; arrays of lengths are int64.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from flashcp.plan import MAX_TOKENS
from flashcp.resources import resource_path

__all__ = ["LENGTH_FILE_FORMATS", "default_data_dir", "read_lengths_file", "read_table"]

LENGTH_FILE_FORMATS = (".npy", ".csv", ".parquet", ".json", ".jsonl", ".txt")
"""Suffixes :func:`read_lengths_file` recognises (any other suffix is read as text or CSV)."""


def default_data_dir() -> Path:
    """The ``datasets/`` folder (of the checkout, or packaged: :func:`flashcp.resources.resource_path`)."""
    return resource_path("datasets")


def read_table(path: Path, columns: Sequence[str]) -> tuple[list[str], dict[str, np.ndarray]]:
    """Read a CSV length table: the first column holds row labels, plus the named ``columns``.

    Args:
        path: the CSV file (with a header row).
        columns: names of the numeric columns to return.
    Returns:
        labels: the first column, as strings; values: ``{column: (n_rows,) float64}``, parsed
        exactly as Python's ``float`` does.
    Raises:
        ValueError: the file is missing or empty, lacks a column, or holds a non-numeric value in
            one of ``columns`` (the message names the file, the column and the value).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"length table {path} not found (set data_dir to the datasets/ folder)")
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    except pd.errors.EmptyDataError:
        raise ValueError(f"length table {path} has no rows") from None
    if frame.empty:
        raise ValueError(f"length table {path} has no rows")
    header = list(frame.columns)
    missing = [c for c in columns if c not in header]
    if missing:
        raise ValueError(f"length table {path} lacks column(s) {missing}; has {header}")
    out: dict[str, np.ndarray] = {}
    for c in columns:
        try:
            out[c] = np.array([float(x) for x in frame[c]], dtype=np.float64)
        except ValueError as e:
            raise ValueError(f"length table {path}: non-numeric value in column {c!r}: {e}") from e
    return frame[header[0]].tolist(), out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except (TypeError, ValueError):
        return False
    return True


def _parse_length(text, where: str) -> int:
    """Parse one document length (an integer, or an integral float such as ``12.0``), >= 0."""
    if not isinstance(text, str):
        raise ValueError(f"{where}: missing document length")
    s = text.strip()
    try:
        v = int(s)
    except ValueError:
        try:
            f = float(s)
        except ValueError:
            raise ValueError(f"{where}: document length {s!r} is not an integer") from None
        if not math.isfinite(f) or f != round(f):
            raise ValueError(f"{where}: document length {s!r} is not an integer") from None
        v = int(f)
    if not 0 <= v <= MAX_TOKENS:
        raise ValueError(
            f"{where}: document length must be in [0, MAX_TOKENS = 2**31 = {MAX_TOKENS}], got {s!r}"
        )
    return v


def _check_array(arr: np.ndarray, p: Path) -> np.ndarray:
    """A 1-D numeric array of integral values >= 0 as int64; else ValueError naming ``p``."""
    arr = np.asarray(arr)
    if arr.ndim == 2 and 1 in arr.shape:
        arr = arr.reshape(-1)
    if arr.ndim != 1:
        raise ValueError(f"length file {p}: expected a 1-D array, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"length file {p} holds no document lengths")
    if arr.dtype.kind not in "iuf":
        raise ValueError(
            f"length file {p}: document lengths must be integers, got dtype {arr.dtype}"
        )
    with np.errstate(invalid="ignore"):
        bad = (arr < 0) | (arr > MAX_TOKENS)
        if arr.dtype.kind == "f":
            bad |= ~np.isfinite(arr) | (arr != np.round(arr))
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"length file {p}: entry {i} = {arr[i].item()!r} is not an integer in "
            f"[0, MAX_TOKENS = 2**31 = {MAX_TOKENS}]"
        )
    return arr.astype(np.int64)


def _is_numeric_column(values: pd.Series) -> bool:
    dtype = values.dtype
    return pd.api.types.is_numeric_dtype(dtype) and not pd.api.types.is_bool_dtype(dtype)


def _column_of(frame: pd.DataFrame, p: Path, numeric) -> str:
    """The ``doc_len`` column (any case), else the only numeric column; several numeric columns
    and no ``doc_len`` is an error (never a guess: an id column would be read as lengths)."""
    names = [str(c).lower() for c in frame.columns]
    if "doc_len" in names:
        return frame.columns[names.index("doc_len")]
    cols = [c for c in frame.columns if numeric(frame[c])]
    if len(cols) == 1:
        return cols[0]
    have = [str(c) for c in frame.columns]
    if not cols:
        raise ValueError(
            f"length file {p}: no column named doc_len and no numeric column in {have}"
        )
    raise ValueError(
        f"length file {p}: no column named doc_len and several numeric columns {have}: "
        f"rename the column of lengths to doc_len"
    )


def _read_frame(p: Path, suffix: str) -> np.ndarray:
    """Lengths from a Parquet or JSON file: the ``doc_len`` column, else the only numeric one."""
    try:
        if suffix == ".parquet":
            frame = pd.read_parquet(p)
        else:
            frame = pd.read_json(p, lines=suffix == ".jsonl", typ="frame", dtype=False)
    except ImportError as e:
        raise ValueError(f"length file {p}: reading {suffix} needs an optional package: {e}") from e
    except (OSError, ValueError) as e:
        raise ValueError(f"length file {p}: cannot read as {suffix}: {e}") from e
    if frame.shape[0] == 0 or frame.shape[1] == 0:
        raise ValueError(f"length file {p} holds no document lengths")
    col = _column_of(frame, p, _is_numeric_column)
    values = frame[col]
    if values.isna().any():
        i = int(np.argmax(values.isna().to_numpy()))
        raise ValueError(f"length file {p}: column {col!r} has no value in row {i}")
    kind = np.dtype(getattr(values.dtype, "numpy_dtype", values.dtype)).kind
    dtype = {"f": np.float64, "u": np.uint64}.get(kind, np.int64)  # no value wraps round
    return _check_array(values.to_numpy(dtype=dtype), p)


def _read_text(p: Path) -> np.ndarray:
    """Lengths from a CSV or a plain text file (see :func:`read_lengths_file`); errors name the
    file and line (``path:line``)."""
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"length file {p}: cannot read: {e}") from e
    lines = [(i + 1, ln) for i, ln in enumerate(text.splitlines())]
    lines = [(n, ln) for n, ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise ValueError(f"length file {p} holds no document lengths")
    if not (p.suffix.lower() == ".csv" or "," in lines[0][1]):  # plain text: one per line
        return np.array([_parse_length(ln, f"{p}:{n}") for n, ln in lines], dtype=np.int64)
    try:
        rows = pd.read_csv(
            io.StringIO("\n".join(ln for _, ln in lines)),
            header=None,
            dtype=str,
            keep_default_na=False,
            skipinitialspace=True,
        )
    except pd.errors.ParserError as e:  # pandas counts the kept lines: name the file's own line
        msg = re.sub(r"line (\d+)", lambda m: f"line {lines[int(m[1]) - 1][0]}", str(e))
        raise ValueError(f"length file {p}: cannot parse as CSV: {msg}") from None
    start, col = 0, 0
    header = not all(_is_number(c) for c in rows.iloc[0] if isinstance(c, str))
    if not header and rows.shape[1] > 1:
        raise ValueError(
            f"length file {p}: {rows.shape[1]} columns and no header: add a header row naming "
            f"the column of lengths doc_len"
        )
    if header:
        start = 1
        frame = rows.iloc[1:].set_axis([str(c).strip() for c in rows.iloc[0]], axis=1)
        col = list(frame.columns).index(
            _column_of(frame, p, lambda s: all(isinstance(x, str) and _is_number(x) for x in s))
        )
    if len(rows) <= start:
        raise ValueError(f"length file {p} holds no document lengths (only a header)")
    values = rows.iloc[start:, col].tolist()
    return np.array(
        [_parse_length(v, f"{p}:{n}") for (n, _), v in zip(lines[start:], values, strict=True)],
        dtype=np.int64,
    )


def read_lengths_file(path: str | Path) -> np.ndarray:
    """Read a user's document lengths.

    Formats, by suffix (:data:`LENGTH_FILE_FORMATS`):

    * ``.npy``: a 1-D integer array, or floats with integral values.
    * ``.parquet`` (needs ``pyarrow``), ``.json`` (a list, or an object or records with columns),
      ``.jsonl`` (JSON Lines): the column named ``doc_len``, else the only numeric column.
    * CSV (``.csv``, or any file whose first data line has a comma), read with pandas: with a
      header, the column named ``doc_len``, else the only column whose every value is a number;
      without a header, a single column.

    A table with several numeric columns and none named ``doc_len`` (or several columns and no
    header) is refused: which column holds the lengths is never guessed.
    * otherwise plain text, one length per line.

    In CSV and text files blank lines and ``#`` comments are skipped.

    Returns:
        (n,) int64 lengths, each >= 0 (zero-length documents, e.g. from repeated ``cu_seqlens``
        offsets, are kept: planners skip them, :class:`~flashcp.data.EmpiricalDistribution`
        drops them).
    Raises:
        ValueError: the file is missing or unreadable, holds no lengths, or holds a value that is not
            an integer in ``[0, MAX_TOKENS]`` (:data:`flashcp.plan.MAX_TOKENS`), or the column of
            lengths is ambiguous; the message names the file, the line (or row) and the value, or
            the columns.
    """
    p = Path(path)
    if p.is_dir():
        raise ValueError(
            f"length file {str(path)!r} is a directory; give the file of lengths in it"
        )
    if not p.is_file():
        raise ValueError(f"length file {str(path)!r} not found")
    suffix = p.suffix.lower()
    if suffix == ".npy":
        try:
            arr = np.load(p, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ValueError(f"length file {p}: cannot read as .npy: {e}") from e
        return _check_array(arr, p)
    if suffix in (".parquet", ".json", ".jsonl"):
        return _read_frame(p, suffix)
    return _read_text(p)
