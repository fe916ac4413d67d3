"""Executors: one interface, plans in, rows out (docs/design.md §4).

Every executor is called as ``execute(runs, seqs, ...) -> pandas.DataFrame`` with the runs of one
job (:class:`RunSpec`: method, options, cp_size, attention shape, modes, hardware, executor
options) and the job's sampled sequences. A row is one (run, sequence, mode): ``run_idx`` (the
run's position in ``runs``), ``seq_idx``, ``num_docs``, ``max_doc_len``, the plan columns, ``mode``,
``status`` (``"ok"`` or ``"error: ..."``; a sequence whose planner or step fails is a row, not a
crash), every :data:`flashcp.results.PHASE_COLUMNS` (ms) and :data:`flashcp.results.COMM_COLUMNS`
(bytes), and the ILP's solve (``ilp_*``, null for other methods): exactly
:data:`flashcp.executors.rows.ROW_COLUMNS`. The harness (``experiments/run.py``) adds the run
identity and provenance.

Every executor runs the same row loop (:mod:`flashcp.executors.rows`: plan each sequence, measure
the plans, build the rows), so they write the same columns, of the same types, by construction;
they differ only in how a plan is measured, and import that module and :mod:`flashcp.executors.spec`
(:class:`RunSpec`), never each other nor this package, which loads them by name.

* :mod:`flashcp.executors.sim`: the analytic cost model; plans each (sequence, method, options,
  cp_size) once and prices every run that shares the plan (several models, hardware profiles).
* :mod:`flashcp.executors.dist`: real ops over torch.distributed (one run per job, under torchrun).
* :mod:`flashcp.executors.emulate`: every rank's real ops replayed on one device (its record
  pass: :mod:`flashcp.executors.emulate_record`; its memory check:
  :mod:`flashcp.executors.emulate_memory`).

:func:`execute` picks the module by name and imports it (and torch, for dist and emulate) only then.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from flashcp.executors.spec import RunSpec

__all__ = ["EXECUTORS", "RunSpec", "execute"]

#: executor names (``executor.name`` in the config) -> module
EXECUTORS: dict[str, str] = {
    "sim": "flashcp.executors.sim",
    "dist": "flashcp.executors.dist",
    "emulate": "flashcp.executors.emulate",
}


def execute(executor: str, runs: Sequence[RunSpec], seqs: Sequence[Any], **kwargs: Any):
    """Run ``runs`` on ``seqs`` with the executor named ``executor``.

    Args:
        executor: ``sim``, ``dist`` or ``emulate``.
        runs: the job's runs (dist and emulate take exactly one).
        seqs: (n_docs,) int64 document lengths per sequence, each summing to ``context_len``.
        kwargs: the executor's own keywords (sim: ``workers``, ``progress``; emulate:
            ``progress``; dist: ``group``).
    Returns:
        A DataFrame of rows (see the module docstring); None on a dist rank other than 0.
    Raises:
        ValueError: unknown executor, or what the executor raises for bad input.
    """
    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}; choose one of {', '.join(EXECUTORS)}")
    if not runs:
        raise ValueError("no runs to execute")
    return importlib.import_module(EXECUTORS[executor]).execute(runs, seqs, **kwargs)
