"""``method=flashcp``: FlashCP's planner, the paper's Algorithm 1 (arXiv 2606.08476, §3.3;
docs/design.md §3). :func:`plan_flashcp` runs the compiled search (:mod:`.compiled`) when numba is
available and the readable reference (:mod:`.reference`, which explains the algorithm) otherwise,
with the same plans; :func:`plan_flashcp_reference` always runs the reference.
"""

from __future__ import annotations

import numpy as np

from flashcp import compiled as loader
from flashcp.kinds import CommKind, OpFamily
from flashcp.plan import (
    Plan,
    buffer_plan,
    check_cp_args,
    check_doc_lens,
    fused_args,
    make_plan,
    packed_plan,
    planner_entry,
)
from flashcp.planners.flashcp.reference import TARGET_IMBALANCE, _search
from flashcp.registry import MethodSpec

__all__ = ["METHOD", "TARGET_IMBALANCE", "plan_flashcp", "plan_flashcp_reference"]


def _plan(
    doc_lens, cp_size: int, target_imbalance: float, num_pad: int, validate: bool, compiled_ok: bool
) -> Plan:
    """:func:`plan_flashcp` with the compiled search (:mod:`flashcp.planners.flashcp.compiled`) when
    ``compiled_ok`` and it is available, else the reference search below."""
    d = check_doc_lens(doc_lens)
    n = cp_size
    check_cp_args(int(d.sum()) + num_pad, n)
    if not _target_ok(target_imbalance):
        raise ValueError(f"target_imbalance must be a number >= 1, got {target_imbalance!r}")
    tpr = (int(d.sum()) + num_pad) // n
    kernels = loader.load("heuristic") if compiled_ok else None
    if kernels is not None:
        ratio, per_doc, cols, pad = kernels.algorithm1(d, int(n), tpr, float(target_imbalance))
        per_doc = per_doc.tolist()
    else:
        ratio, per_doc, cols, pad = _search(d, n, tpr, target_imbalance)
    status = "ok" if ratio <= target_imbalance else "target_not_met"
    info = {
        "per_doc_docs": per_doc,
        "iterations": len(per_doc) + 1,
        "target_imbalance": float(target_imbalance),
    }
    if kernels is not None:  # the compiled search's columns: merged and summed in one call
        return packed_plan(
            "flashcp", int(n), d, cols, pad, status=status, info=info, validate=bool(validate)
        )
    return make_plan("flashcp", n, d, *cols, status=status, info=info, pad=pad, validate=validate)


_DOC = """Plan FlashCP's hybrid Whole-Doc / Per-Doc layout with the paper's heuristic{which}.

    Args:
        doc_lens: (n_docs,) int, document lengths in packed order (zero-length ones skipped,
            :func:`~flashcp.plan.planner_entry`).
        cp_size: N >= 1.
        target_imbalance: R >= 1, the imbalance ratio to reach (paper default 1.05).
        num_pad: pad tokens after the last document; C = sum(doc_lens) + num_pad must divide by
            N. Step 2b fills every rank up to C/N document tokens at most, and the ranks left
            short hold the pad (no workload, no communication).
        validate: check the plan's invariants.
    Returns:
        A :class:`~flashcp.plan.Plan` with ``method="flashcp"``; ``info`` holds ``per_doc_docs``
        (indices of Per-Doc documents), ``iterations`` and ``target_imbalance``. ``status`` is
        ``"ok"`` when the target was met, else ``"target_not_met"`` (then the plan is the best
        balanced of those tried, normally the all-Per-Doc one).
    Raises:
        ValueError: bad lengths, ``cp_size`` < 1, C not divisible by N, or ``target_imbalance`` < 1.
    """


def _target_ok(target_imbalance) -> bool:
    """``target_imbalance`` is a finite number >= 1."""
    try:
        return bool(np.isfinite(float(target_imbalance)) and float(target_imbalance) >= 1.0)
    except (TypeError, ValueError, OverflowError):
        return False


def _fused(doc_lens, cp_size, num_pad, pad_to_multiple, options: dict) -> Plan | None:
    """:func:`plan_flashcp` in one compiled call (:func:`flashcp.planners.flashcp.compiled.flashcp_plan`:
    the checks, Algorithm 1, the merge, validation and metrics) for the common case: the kernels
    on, arguments the fused kernels take as they are (:func:`~flashcp.plan.fused_args`), a float
    or int target >= 1, no other option, documents all of length >= 1, at most
    :data:`~flashcp.plan.kernels.EXACT_TOKENS` tokens. None for every other case, which
    :func:`_plan` plans the same way (or rejects)."""
    if not options.keys() <= {"validate", "target_imbalance"}:
        return None
    target = options.get("target_imbalance", TARGET_IMBALANCE)
    validate = options.get("validate", True)
    if type(target) not in (float, int) or not _target_ok(target):
        return None
    if not fused_args(doc_lens, cp_size, num_pad, pad_to_multiple, validate):
        return None
    kernels = loader.load("heuristic")
    if kernels is None:
        return None
    target = float(target)
    buf, ratio, per_doc = kernels.flashcp_plan(
        doc_lens, cp_size, num_pad, pad_to_multiple, validate, target
    )
    if buf[-1]:
        return None
    per_doc = per_doc.tolist()
    info = {"per_doc_docs": per_doc, "iterations": len(per_doc) + 1, "target_imbalance": target}
    status = "ok" if ratio <= target else "target_not_met"
    return buffer_plan(buf, "flashcp", cp_size, doc_lens.size, status, info)


@planner_entry("flashcp", fused=_fused)
def plan_flashcp(
    doc_lens,
    cp_size: int,
    *,
    target_imbalance: float = TARGET_IMBALANCE,
    num_pad: int = 0,
    validate: bool = True,
) -> Plan:
    return _plan(doc_lens, cp_size, target_imbalance, num_pad, validate, compiled_ok=True)


@planner_entry("flashcp")
def plan_flashcp_reference(
    doc_lens,
    cp_size: int,
    *,
    target_imbalance: float = TARGET_IMBALANCE,
    num_pad: int = 0,
    validate: bool = True,
) -> Plan:
    return _plan(doc_lens, cp_size, target_imbalance, num_pad, validate, compiled_ok=False)


plan_flashcp.__doc__ = _DOC.format(
    which=" (compiled, :mod:`flashcp.planners.flashcp.compiled`, when numba is available; else "
    ":func:`plan_flashcp_reference`, with the same plans)"
)


plan_flashcp_reference.__doc__ = _DOC.format(
    which=": the readable reference implementation (pure Python), the oracle of the compiled one"
)


#: the method's entry in the registry (declared in pyproject.toml's ``flashcp.methods`` entry points)
METHOD = MethodSpec(
    name="flashcp", display_name="FlashCP", order=50, planner=plan_flashcp,
    comm_kind=CommKind.ALLGATHER_SHARDED, op=OpFamily.ALLGATHER, color="#d62728", paper=True,
)  # fmt: skip
