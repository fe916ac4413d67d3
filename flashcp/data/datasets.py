"""The named datasets: each name to its length distribution (docs/design.md §5).

* ``wlb_llm``: :class:`~flashcp.data.distributions.BinnedDistribution` over the table
  ``datasets/wlb_llm.csv`` (WLB-LLM production profile, 128K window, as binned in the public
  DistCA simulator data).
* ``pile``, ``redpajama``: :class:`~flashcp.data.distributions.LogNormalMixture` over the tables
  ``datasets/pile.csv`` and ``datasets/redpajama.csv``.
* ``wlb_llm_synthetic``: :class:`~flashcp.data.distributions.WlbSyntheticNormal`, the synthetic
  generator of the public WLB-LLM code (Normal(C/2, C/2) lengths; needs ``context_len``).
* ``stress``: :class:`~flashcp.data.distributions.StressNormal` (needs ``context_len``).
* ``file``: :class:`~flashcp.data.distributions.EmpiricalDistribution` over a user's file of
  lengths (:func:`~flashcp.data.files.read_lengths_file`).

Sources of every number are in ``datasets/README.md``.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from types import MappingProxyType

from flashcp.data.distributions import (
    BinnedDistribution,
    EmpiricalDistribution,
    LengthDistribution,
    LogNormalMixture,
    StressNormal,
    WlbSyntheticNormal,
)
from flashcp.data.files import default_data_dir, read_lengths_file, read_table

__all__ = ["DATASETS", "DatasetName", "load_distribution"]


class DatasetName(StrEnum):
    """The dataset names, the one list of them: :func:`load_distribution` accepts these, and the
    config schemas type ``dataset.name`` (and Table 2's and the sensitivity study's datasets) with
    it, so a bad name fails when Hydra composes the config, listing these."""

    #: WLB-LLM production profile (binned table)
    wlb_llm = "wlb_llm"
    #: the Pile (log-normal mixture)
    pile = "pile"
    #: RedPajama (log-normal mixture)
    redpajama = "redpajama"
    #: the WLB-LLM code's synthetic generator, trunc(Normal(C/2, C/2)), needs context_len
    wlb_llm_synthetic = "wlb_llm_synthetic"
    #: Normal(0.5 C, 0.5 C), needs context_len
    stress = "stress"
    #: a user's file of lengths (needs a path)
    file = "file"


DATASETS: tuple[DatasetName, ...] = tuple(DatasetName)
"""Names accepted by :func:`load_distribution` (members of :class:`DatasetName`, equal to their
string values)."""

_TABLE_FILES = MappingProxyType(
    {"wlb_llm": "wlb_llm.csv", "pile": "pile.csv", "redpajama": "redpajama.csv"}
)


def load_distribution(
    name: str,
    *,
    context_len: int | None = None,
    path: str | Path | None = None,
    data_dir: str | Path | None = None,
) -> LengthDistribution:
    """Load one of :data:`DATASETS`.

    Args:
        name: ``wlb_llm``, ``pile``, ``redpajama`` (tables under ``data_dir``),
            ``wlb_llm_synthetic`` or ``stress`` (need ``context_len``) or ``file`` (needs
            ``path``, see :func:`read_lengths_file`).
        context_len: C in tokens, for ``wlb_llm_synthetic`` and ``stress``; ignored otherwise.
        path: the lengths file, for ``file``.
        data_dir: folder holding the tables; default :func:`default_data_dir`.
    Raises:
        ValueError: unknown name (the message lists the valid ones), a missing argument, or a bad
            table or file, naming the bad value.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid: {', '.join(DATASETS)}")
    if name == "stress":
        if context_len is None:
            raise ValueError("dataset 'stress' needs context_len (Normal(0.5 C, 0.5 C))")
        return StressNormal(context_len)
    if name == "wlb_llm_synthetic":
        if context_len is None:
            raise ValueError(
                "dataset 'wlb_llm_synthetic' needs context_len (lengths trunc(Normal(C/2, C/2)))"
            )
        return WlbSyntheticNormal(context_len)
    if name == "file":
        if path is None:
            raise ValueError(
                "dataset 'file' needs path (a file of lengths: text, CSV, Parquet, JSON or .npy)"
            )
        return EmpiricalDistribution(read_lengths_file(path), name="file", source=str(path))
    table = Path(data_dir) if data_dir is not None else default_data_dir()
    table = table / _TABLE_FILES[name]
    if name == "wlb_llm":
        _, t = read_table(table, ["lo_tokens", "hi_tokens", "doc_pct"])
        return BinnedDistribution(name, t["lo_tokens"], t["hi_tokens"], t["doc_pct"])
    labels, t = read_table(table, ["docs", "mean_tokens", "sigma"])
    return LogNormalMixture(name, labels, t["docs"], t["mean_tokens"], t["sigma"])
