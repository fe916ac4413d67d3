"""Published per-size nccl-tests tables of one collective (``conf/hardware/nccl/*.csv``) and
where the hardware profiles are found; read by :mod:`flashcp.sim.hardware` (its module docstring
gives the pricing they feed).
"""

from __future__ import annotations

import csv
import functools
import math
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np

from flashcp.resources import resource_path

__all__ = [
    "TABLE_OPS",
    "CollectiveTable",
    "collective_table_dir",
    "hardware_dir",
    "list_hardware",
    "read_collective_table",
]

#: collectives a profile may price from a per-size table -> the profile field naming the table
TABLE_OPS = {"all_gather": "allgather_table", "reduce_scatter": "reducescatter_table"}


@dataclass(frozen=True)
class CollectiveTable:
    """A published nccl-tests table of one collective: bus bandwidth by message size.

    Attributes:
        name: where it was read from (a file name); errors name it.
        collective: ``all_gather`` or ``reduce_scatter`` (a key of :data:`TABLE_OPS`).
        ranks: GPUs of the measured run (>= 2).
        size_bytes: (k,) strictly increasing whole-buffer sizes, bytes (nccl-tests' ``size``: the
            gathered output of an all-gather, the input of a reduce-scatter).
        busbw_gbps: (k,) positive out-of-place bus bandwidth, GB/s (1e9 B/s).
    Raises:
        ValueError: (at construction) an unknown collective, fewer than 2 ranks, an empty table,
            columns of different lengths, sizes that do not strictly increase or are not
            positive, or a non-positive or non-finite bandwidth; the message names the table.
    """

    name: str
    collective: str
    ranks: int
    size_bytes: tuple[float, ...]
    busbw_gbps: tuple[float, ...]

    def __post_init__(self) -> None:
        where = f"collective table {self.name!r}"
        if self.collective not in TABLE_OPS:
            raise ValueError(
                f"{where}: collective must be one of {', '.join(TABLE_OPS)}, got {self.collective!r}"
            )
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 2:
            raise ValueError(f"{where}: ranks must be an integer >= 2, got {self.ranks!r}")
        try:
            size = tuple(float(x) for x in self.size_bytes)
            bw = tuple(float(x) for x in self.busbw_gbps)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: sizes and bandwidths must be numbers") from None
        if not size or len(size) != len(bw):
            raise ValueError(
                f"{where}: needs at least one point and as many sizes ({len(size)}) as "
                f"bandwidths ({len(bw)})"
            )
        if not all(math.isfinite(x) and x > 0 for x in size):
            raise ValueError(f"{where}: sizes must be positive, got {list(size)}")
        bad = [(a, b) for a, b in pairwise(size) if not b > a]
        if bad:
            raise ValueError(
                f"{where}: sizes must strictly increase, but {bad[0][1]:.0f} B follows "
                f"{bad[0][0]:.0f} B"
            )
        if not all(math.isfinite(x) and x > 0 for x in bw):
            raise ValueError(f"{where}: bus bandwidths must be positive and finite, got {list(bw)}")
        object.__setattr__(self, "size_bytes", size)
        object.__setattr__(self, "busbw_gbps", bw)

    def times_us(self) -> np.ndarray:
        """The published times implied by the table, (k,) float64 µs: a rank receives
        ``(n - 1) / n`` of the buffer at the bus bandwidth (nccl-tests doc/PERFORMANCE.md)."""
        recv = np.asarray(self.size_bytes) * (self.ranks - 1) / self.ranks
        return recv / (np.asarray(self.busbw_gbps) * 1e3)


def collective_table_dir() -> Path:
    """``conf/hardware/nccl``: the per-size collective tables the profiles name."""
    return hardware_dir() / "nccl"


def _table_path(ref: str) -> Path:
    if not isinstance(ref, str) or not ref:
        raise ValueError(f"a collective table must be named by a non-empty string, got {ref!r}")
    own = Path(ref)
    if own.suffix == ".csv" and own.is_file():
        return own
    path = collective_table_dir() / (ref if ref.endswith(".csv") else f"{ref}.csv")
    if "/" in ref or not path.is_file():
        known = sorted(p.stem for p in collective_table_dir().glob("*.csv"))
        raise ValueError(
            f"unknown collective table {ref!r}: not a CSV file, nor one of {', '.join(known)} "
            "(conf/hardware/nccl/)"
        )
    return path


def read_collective_table(ref: str) -> CollectiveTable:
    """Read a per-size collective table: the name of a CSV in :func:`collective_table_dir`
    (without ``.csv``, e.g. ``h200_8x_all_gather_half``) or a path to a CSV file.

    The file holds ``# key: value`` comment lines naming at least ``collective`` and ``ranks``
    (its other comments cite the source), then a header row and one row per message size with
    at least the columns ``size_bytes`` and ``busbw_gbps`` (nccl-tests' out-of-place bus
    bandwidth). Read once per file version (cached on path and modification time).

    Raises:
        ValueError: an unknown name, a missing key or column, an unreadable number, or a bad
            table (:class:`CollectiveTable`); the message names the file.
    """
    path = _table_path(ref)
    return _read_table(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _read_table(path: str, mtime_ns: int) -> CollectiveTable:
    name = Path(path).name
    meta: dict[str, str] = {}
    rows: list[str] = []
    with open(path, newline="") as fh:
        for line in fh:
            if line.startswith("#"):
                key, sep, value = line[1:].partition(":")
                if sep and key.strip().isidentifier():
                    meta.setdefault(key.strip(), value.strip())
            elif line.strip():
                rows.append(line)
    for key in ("collective", "ranks"):
        if key not in meta:
            raise ValueError(f"collective table {name!r} has no '# {key}: ...' line")
    reader = csv.DictReader(rows)
    for col in ("size_bytes", "busbw_gbps"):
        if col not in (reader.fieldnames or []):
            raise ValueError(f"collective table {name!r} has no column {col!r}")
    size, bw = [], []
    for i, row in enumerate(reader, start=1):
        try:
            size.append(float(row["size_bytes"]))
            bw.append(float(row["busbw_gbps"]))
        except (TypeError, ValueError):
            raise ValueError(
                f"collective table {name!r}, data row {i}: size_bytes {row['size_bytes']!r} or "
                f"busbw_gbps {row['busbw_gbps']!r} is not a number"
            ) from None
    try:
        ranks = int(meta["ranks"])
    except ValueError:
        raise ValueError(
            f"collective table {name!r}: ranks {meta['ranks']!r} is not an integer"
        ) from None
    return CollectiveTable(name, meta["collective"], ranks, tuple(size), tuple(bw))


def hardware_dir() -> Path:
    """``conf/hardware`` (of the checkout, or packaged: :func:`flashcp.resources.resource_path`)."""
    return resource_path("conf") / "hardware"


def list_hardware() -> list[str]:
    """Names of the profiles in :func:`hardware_dir`, sorted."""
    return sorted(p.stem for p in hardware_dir().glob("*.yaml"))
