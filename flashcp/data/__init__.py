"""Document lengths: distributions, length files, and the seeded sampler that packs sequences.

A training sequence of ``context_len`` (C) tokens is built by drawing documents i.i.d. from a
length distribution and appending them until C is full; the last one is cut to fit
(docs/design.md §5). The package has three parts:

* :mod:`flashcp.data.distributions`: the length laws (:class:`BinnedDistribution`,
  :class:`LogNormalMixture`, :class:`StressNormal`, :class:`WlbSyntheticNormal`,
  :class:`EmpiricalDistribution`), each with
  both weightings (``documents``, ``tokens``), a cap, and analytic moments;
* :mod:`flashcp.data.files`: reading the distribution tables and users' length files (pandas:
  CSV, Parquet, JSON; also ``.npy`` and plain text), and :mod:`flashcp.data.datasets`, which maps
  each dataset name (:data:`DATASETS`) to its distribution (:func:`load_distribution`);
* :mod:`flashcp.data.packing`: :func:`sample_packed` and :func:`sample_sequences`;
* :mod:`flashcp.data.overlong`: documents longer than the context, the one rule of every command
  (:func:`apply_overlong`, :class:`OverlongDocs`, :func:`overlong_note`) and
  :func:`sample_dataset`, the sampler of every experiment (``flashcp-run``, ``flashcp-table2``,
  ``flashcp-sensitivity``: the same dataset, seed and context give the same sequences).

Every public name is importable from :mod:`flashcp.data` itself. Units: every length is in
tokens; arrays of lengths are int64.
"""

from __future__ import annotations

from flashcp.data.datasets import DATASETS, DatasetName, load_distribution
from flashcp.data.distributions import (
    WEIGHTINGS,
    BinnedDistribution,
    EmpiricalDistribution,
    LengthDistribution,
    LogNormalMixture,
    StressNormal,
    WlbSyntheticNormal,
)
from flashcp.data.files import (
    LENGTH_FILE_FORMATS,
    default_data_dir,
    read_lengths_file,
    read_table,
)
from flashcp.data.overlong import (
    OVERLONG_POLICIES,
    OverlongDocs,
    apply_overlong,
    check_overlong_policy,
    overlong_note,
    sample_dataset,
)
from flashcp.data.packing import sample_packed, sample_sequences

__all__ = [
    "DATASETS",
    "LENGTH_FILE_FORMATS",
    "OVERLONG_POLICIES",
    "WEIGHTINGS",
    "BinnedDistribution",
    "DatasetName",
    "EmpiricalDistribution",
    "LengthDistribution",
    "LogNormalMixture",
    "OverlongDocs",
    "StressNormal",
    "WlbSyntheticNormal",
    "apply_overlong",
    "check_overlong_policy",
    "default_data_dir",
    "load_distribution",
    "overlong_note",
    "read_lengths_file",
    "read_table",
    "sample_dataset",
    "sample_packed",
    "sample_sequences",
]
