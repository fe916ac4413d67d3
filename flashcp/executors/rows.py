"""The row loop every executor runs (sim, dist, emulate; docs/design.md §4, §7).

An executor differs from another only in how it *measures* a plan: the simulator prices a batch of
plans with the cost model, ``dist`` runs one on the process group, ``emulate`` replays its ranks on
one device. Everything around that is here, once:

1. :func:`plan_sequences`: plan every sequence of a run (:func:`flashcp.sim.impl.impl_plan`, the
   plan the run's ``impl`` really runs), timed (``plan_ms``, the planner's wall time); a planner
   that raises makes the sequence's rows ``status = "error: ..."`` (:func:`error_status`), and a
   ``share`` callback lets one rank of a process group plan and give every rank its plan or its
   failure before any step.
2. :func:`measure_rows`: call the executor's ``measure(plans, mode)`` on batches of the planned
   sequences and build the rows column by column: a row is one (sequence, mode) with the
   sequence's columns (:data:`SEQ_COLUMNS`), the plan's (:data:`PLAN_COLUMNS`, the ILP's solve in
   :data:`ILP_COLUMNS`), ``mode``, ``status`` and every phase (ms) and byte column of
   :data:`flashcp.results.PHASE_COLUMNS` / :data:`flashcp.results.COMM_COLUMNS`. With
   ``catch=True`` a batch that raises is measured again one plan at a time, and a plan that still
   raises is error rows (a failure is a row, not a crash).
3. :func:`finish_rows`: one frame with exactly :data:`ROW_COLUMNS`, in that order, each of the
   type :data:`flashcp.results.ROW_SCHEMA` gives it (``run_idx``: int64): the same columns and
   dtypes from every executor by construction.

Shared checks live here too: :func:`check_comm` (counted bytes against the plan's prediction).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from flashcp.kinds import CommKind
from flashcp.plan import Plan
from flashcp.results import (
    COMM_COLUMNS,
    DIST_COLUMNS,
    ILP_INFO_COLUMNS,
    PHASE_COLUMNS,
    ROW_SCHEMA,
)

__all__ = [
    "ILP_COLUMNS",
    "PLAN_COLUMNS",
    "ROW_COLUMNS",
    "SEQ_COLUMNS",
    "Planned",
    "check_comm",
    "error_status",
    "finish_rows",
    "measure_rows",
    "plan_metrics",
    "plan_one",
    "plan_sequences",
]

log = logging.getLogger(__name__)

#: columns of a sequence: its index in the job, its documents and its longest document (tokens)
SEQ_COLUMNS: tuple[str, ...] = ("seq_idx", "num_docs", "max_doc_len")

#: plan columns of a row (:func:`plan_metrics` plus the planner's status, time and padding)
PLAN_COLUMNS: tuple[str, ...] = (
    "plan_status", "plan_ms", "pad_tokens", "imbalance_ratio", "comm_tokens", "comm_tokens_full",
    "comm_saving", "comm_tokens_sharded", "num_split_docs", "num_pieces", "max_shards_per_rank",
)  # fmt: skip

#: the ILP's solve (:data:`flashcp.results.ILP_INFO_COLUMNS`), null in a non-ILP row
ILP_COLUMNS: tuple[str, ...] = tuple(f"ilp_{k}" for k in ILP_INFO_COLUMNS)

#: every column of an executor's rows, in order (the harness adds identity and provenance)
ROW_COLUMNS: tuple[str, ...] = (
    "run_idx", *SEQ_COLUMNS, *PLAN_COLUMNS, "mode", "status", *PHASE_COLUMNS, "step_ms",
    *COMM_COLUMNS, *DIST_COLUMNS, *ILP_COLUMNS,
)  # fmt: skip

_DTYPES = {"int": "Int64", "float": "float64", "bool": "boolean", "text": "string"}

#: what an executor measures: ``measure(plans, mode)`` -> (len(plans),) values per column of
#: PHASE_COLUMNS (ms) and COMM_COLUMNS (bytes)
Measure = Callable[[list[Plan], str], dict[str, Any]]


def error_status(exc: BaseException) -> str:
    """``status`` of a failed row: ``"error: <type>: <message>"``."""
    return f"error: {type(exc).__name__}: {exc}"


def plan_metrics(plan: Plan) -> dict[str, Any]:
    """Plan columns of a row (from :meth:`flashcp.plan.Plan.summary`).

    ``comm_tokens`` is what the method really moves: KV tokens one rank receives per pass, per K or
    V, per KV head — Eq. 4 of the paper for full all-gather and for the ring, Eq. 5 for
    sharding-aware all-gather — and ``comm_saving`` = 1 - comm_tokens / comm_tokens_full.
    ``comm_tokens_sharded`` is Eq. 5 on the method's layout: what sharding-aware communication
    would move for it. Plans of a method whose :class:`~flashcp.registry.MethodSpec`
    ``reports_solve`` (the ILP) add the solve's outcome, ``ilp_<key>`` for every key of
    :data:`flashcp.results.ILP_INFO_COLUMNS` (status, gap, objective, best bound, threads,
    warm-start flags, fallback heuristic).
    """
    spec = _method_spec(plan.method)
    s = plan.summary(spec.comm_kind if spec is not None else CommKind.ALLGATHER_SHARDED)
    out = {k: s[k] for k in _METRIC_COLUMNS}
    if spec is not None and spec.reports_solve:  # e.g. the ILP's
        for k in ILP_INFO_COLUMNS:
            out[f"ilp_{k}"] = plan.info.get(k)
    return out


#: the plan columns :func:`plan_metrics` reads from the summary
_METRIC_COLUMNS = PLAN_COLUMNS[3:]


def _method_spec(method: str) -> Any:
    """The registry's spec of ``method``, or None for a name it does not hold."""
    from flashcp.registry import get_method

    try:
        return get_method(method)
    except ValueError:
        return None


def check_comm(result: dict, plan: Plan, shape, mode: str, op_options=None) -> dict[str, int]:
    """Compare counted bytes (``result[COMM_COLUMNS]``) with the plan's prediction
    (:func:`flashcp.comm.comm_volume` under the method's communication kind).

    Args:
        result: a step's result with every key of :data:`flashcp.results.COMM_COLUMNS` (bytes).
        plan: the plan the step ran; shape: its :class:`flashcp.comm.AttnShape`; mode: ``train``
            or ``infer``; op_options: the op's options that change its bytes
            (``keep_gathered_kv``; :func:`flashcp.registry.split_options`).
    Returns:
        the predicted ``comm_volume`` dict.
    Raises:
        ValueError: any of the byte columns differs (the message gives both).
    """
    from flashcp.comm import comm_volume
    from flashcp.registry import COMM_KIND

    if plan.method == "flashcp_node":  # its two-scope gather (one node: Eq. 5's bytes)
        from flashcp.comm import node_scoped_comm_volume

        full = node_scoped_comm_volume(plan, shape, mode)
        expect = {k: full[k] for k in COMM_COLUMNS}
    else:
        expect = comm_volume(plan, COMM_KIND[plan.method], shape, mode, **(op_options or {}))
    got = {k: int(result[k]) for k in COMM_COLUMNS}
    if got != expect:
        raise ValueError(f"{plan.method}: counted bytes {got} differ from the plan's {expect}")
    return expect


@dataclass
class Planned:
    """The plans of one run's sequences (shared by every run with the same
    :attr:`flashcp.executors.RunSpec.plan_key`).

    Attributes:
        seq: (S,) int64 arrays per column of :data:`SEQ_COLUMNS`, one entry per sequence.
        ok: positions (into ``seq``) of the planned sequences, ascending.
        plans: the plans of ``ok``, in its order.
        metrics: (len(ok),) arrays per plan column (:data:`PLAN_COLUMNS`, ``ilp_*`` for ILP plans).
        errors: position -> ``status`` of each sequence whose planning failed.
    """

    seq: dict[str, np.ndarray]
    ok: list[int] = field(default_factory=list)
    plans: list[Plan] = field(default_factory=list)
    metrics: dict[str, np.ndarray] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)


#: one sequence's planning: ``(plan, pad_tokens, plan_ms, error)``, plan None and error the
#: ``status`` (:func:`error_status`) when the planner raised
Planning = tuple[Plan | None, int, float, str | None]


def plan_one(run: Any, doc_lens: np.ndarray) -> Planning:
    """Plan one sequence of ``run`` (:func:`flashcp.sim.impl.impl_plan`), timed; a planner that
    raises gives ``(None, 0, plan_ms, error_status(exc))`` (a failure is a row, not a crash)."""
    from flashcp.sim.impl import impl_plan

    t0 = time.perf_counter()
    try:
        options = dict(run.options)
        plan, pad_tokens = impl_plan(run.method, run.impl, doc_lens, run.cp_size, **options)
        err = None
    except Exception as exc:  # a failure is a row, not a crash (docs/design.md §7)
        plan, pad_tokens, err = None, 0, error_status(exc)
    return plan, int(pad_tokens), (time.perf_counter() - t0) * 1e3, err


def plan_sequences(
    run: Any,
    seqs: Sequence[np.ndarray],
    *,
    first_idx: int = 0,
    share: Callable[[int, Callable[[], Planning]], Planning] | None = None,
) -> Planned:
    """Plan every sequence of ``run``.

    Args:
        run: a :class:`flashcp.executors.RunSpec` (its method, impl, cp_size and options).
        seqs: (n_docs,) int64 document lengths per sequence.
        first_idx: ``seq_idx`` of ``seqs[0]``.
        share: ``share(seq_idx, plan) -> Planning``, called for every sequence in order with the
            function that plans it (:func:`plan_one`); ``executor=dist`` calls it on one rank
            of the CP group and broadcasts its outcome, the plan or the failure, so every rank
            holds the same plan or the same error. None: plan here.
    Returns:
        a :class:`Planned`; ``plan_ms`` is the planner's wall time, ``pad_tokens`` the tokens its
        impl pads (:func:`flashcp.sim.impl.impl_plan`).
    """
    planned = Planned(
        seq={
            "seq_idx": np.arange(first_idx, first_idx + len(seqs), dtype=np.int64),
            "num_docs": np.array([d.size for d in seqs], dtype=np.int64),
            "max_doc_len": np.array([d.max() for d in seqs], dtype=np.int64),
        }
    )
    metrics: list[dict[str, Any]] = []
    for k, d in enumerate(seqs):
        here = functools.partial(plan_one, run, d)
        plan, pad_tokens, plan_ms, err = here() if share is None else share(first_idx + k, here)
        if err is not None:
            log.warning("sequence %d failed (%s): %s", first_idx + k, run.method, err)
            planned.errors[k] = err
            continue
        planned.ok.append(k)
        planned.plans.append(plan)
        metrics.append({
            "plan_status": plan.status, "plan_ms": plan_ms, "pad_tokens": pad_tokens,
            **plan_metrics(plan),
        })  # fmt: skip
    if metrics:
        planned.metrics = {k: np.array(v) for k, v in pd.DataFrame(metrics).items()}
    return planned


def measure_rows(
    run: Any,
    planned: Planned,
    measure: Measure,
    *,
    run_idx: int = 0,
    batch: int | None = None,
    catch: bool = True,
) -> pd.DataFrame:
    """Rows of one run: ``measure`` every planned sequence in every mode of ``run.modes``.

    Args:
        run: the run (its ``modes`` and ``method``).
        planned: its plans (:func:`plan_sequences`).
        measure: ``measure(plans, mode)`` -> (len(plans),) values per PHASE_COLUMNS (ms) and
            COMM_COLUMNS (bytes) column.
        run_idx: the run's position in the job.
        batch: plans per ``measure`` call (None: all at once); batches are measured in sequence
            order, each in every mode before the next.
        catch: a batch that raises is measured again one plan at a time and a plan that still
            raises becomes error rows (False: the exception propagates).
    Returns:
        rows in (sequence, mode) order, ``run_idx`` set (not yet typed: :func:`finish_rows`).
    """
    modes = tuple(run.modes)
    step = max(1, len(planned.plans) if batch is None else int(batch))
    parts: list[pd.DataFrame] = []
    errors = dict(planned.errors)  # position -> status
    for lo in range(0, len(planned.plans), step):
        idx = list(range(lo, min(lo + step, len(planned.plans))))
        try:
            parts.append(
                _measured(run, planned, idx, {m: measure(_at(planned, idx), m) for m in modes})
            )
            continue
        except Exception as exc:
            if not catch:
                raise
            if len(idx) == 1:
                _failed(run, planned, idx[0], exc, errors)
                continue
        for j in idx:  # find the plans that fail: one at a time
            try:
                parts.append(
                    _measured(run, planned, [j], {m: measure(_at(planned, [j]), m) for m in modes})
                )
            except Exception as exc:
                _failed(run, planned, j, exc, errors)
    if errors:
        pos = np.array(sorted(errors), dtype=np.int64)
        cols = {c: np.repeat(v[pos], len(modes)) for c, v in planned.seq.items()}
        cols["mode"] = np.tile(np.array(modes, dtype=object), len(pos))
        cols["status"] = np.repeat(np.array([errors[p] for p in pos], dtype=object), len(modes))
        parts.append(pd.DataFrame(cols))
    df = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["seq_idx"])
    if errors and len(parts) > 1:
        df = df.sort_values("seq_idx", kind="stable", ignore_index=True)
    return df.assign(run_idx=run_idx)


def _at(planned: Planned, idx: list[int]) -> list[Plan]:
    return [planned.plans[j] for j in idx]


def _failed(run, planned: Planned, j: int, exc: BaseException, errors: dict[int, str]) -> None:
    pos = planned.ok[j]
    log.warning("sequence %d failed (%s): %s", planned.seq["seq_idx"][pos], run.method, exc)
    errors[pos] = error_status(exc)


def _measured(
    run, planned: Planned, idx: list[int], steps: dict[str, dict[str, Any]]
) -> pd.DataFrame:
    """Rows of the plans ``idx`` (positions in ``planned.plans``) measured as ``steps`` (per mode,
    (len(idx),) values per phase and byte column), in (sequence, mode) order."""
    modes = tuple(run.modes)
    m = len(modes)
    pos = np.array([planned.ok[j] for j in idx], dtype=np.int64)
    cols = {c: np.repeat(v[pos], m) for c, v in planned.seq.items()}
    cols.update({c: np.repeat(v[idx], m) for c, v in planned.metrics.items()})
    cols["mode"] = np.tile(np.array(modes, dtype=object), len(idx))
    cols["status"] = np.full(len(idx) * m, "ok", dtype=object)
    for col in (*PHASE_COLUMNS, *COMM_COLUMNS):
        per_mode = [np.asarray(steps[mode][col]).reshape(len(idx)) for mode in modes]
        cols[col] = np.stack(per_mode, axis=1).ravel()
    for col in ("step_ms", *DIST_COLUMNS):  # sim with a whole model (flashcp.sim.step); dist
        if col in steps[modes[0]]:
            per_mode = [np.asarray(steps[mode][col]).reshape(len(idx)) for mode in modes]
            cols[col] = np.stack(per_mode, axis=1).ravel()
    return pd.DataFrame(cols)


def finish_rows(parts: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """Concatenate an executor's row frames into its result: exactly :data:`ROW_COLUMNS`, in that
    order (an absent column all nulls), ordered by (``run_idx``, ``seq_idx``) keeping each
    sequence's mode order, each column of its :data:`flashcp.results.ROW_SCHEMA` type (pandas
    ``Int64``, ``float64``, ``boolean``, ``string``; ``run_idx`` int64).

    Raises:
        ValueError: a column that :data:`ROW_COLUMNS` does not name, or a value that does not fit
            its column's type (naming the column).
    """
    parts = [p for p in parts if len(p)]
    df = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    unknown = [c for c in df.columns if c not in ROW_COLUMNS]
    if unknown:
        raise ValueError(f"executor row columns {unknown} are not in ROW_COLUMNS")
    if len(df):
        df = df.sort_values(["run_idx", "seq_idx"], kind="stable", ignore_index=True)
    cols = {}
    for col in ROW_COLUMNS:
        kind = "run_idx" if col == "run_idx" else ROW_SCHEMA[col]
        dtype = "int64" if kind == "run_idx" else _DTYPES[kind]
        if col not in df:
            cols[col] = pd.Series(
                None, index=df.index, dtype="Int64" if dtype == "int64" else dtype
            )
            continue
        s = df[col]
        try:
            if kind in ("int", "float", "run_idx"):
                s = pd.to_numeric(s)
            cols[col] = s.astype(dtype)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"executor row column {col!r} must hold {kind} values: {exc}"
            ) from None
    return pd.DataFrame(cols, index=df.index)
