"""DeepSpeed-Ulysses (Jacobs et al., 2023): head-parallel context parallelism.

Layout: the packed sequence cut into N contiguous chunks, chunk r on rank r (as ``ring``).
Communication: an all-to-all turns every rank's (C/N tokens, H heads) of q, k, v into (C tokens,
H/N heads); each rank attends over the whole packed sequence, with the document mask, for its
heads; a second all-to-all brings the output back (:mod:`flashcp.ops.ulysses_attn`). Every rank
computes every document for H/N heads, so the plan is balanced by construction
(:attr:`flashcp.plan.Plan.workload_per_rank`) and documents stay whole for the kernel.
"""

from __future__ import annotations

from flashcp.kinds import CommKind, OpFamily
from flashcp.plan import Plan, check_cp_args, check_doc_lens, make_plan, planner_entry
from flashcp.planners.layout import split_packed
from flashcp.registry import MethodSpec


@planner_entry("ulysses")
def plan_ulysses(doc_lens, cp_size: int, *, num_pad: int = 0, validate: bool = True) -> Plan:
    """Plan the Ulysses layout: N contiguous chunks of C/N tokens, one head-parallel group of all
    N ranks (``info["ulysses_degree"] = cp_size``).

    Heads are checked by the op and by :func:`flashcp.comm.comm_volume`
    (:func:`flashcp.plan.head_parallel.ulysses_heads`), which know them.

    Raises:
        ValueError: bad lengths, ``cp_size`` < 1, or C (pad included) not divisible by N.
    """
    d = check_doc_lens(doc_lens)
    check_cp_args(int(d.sum()) + num_pad, cp_size)
    chunk, doc, start, length, pad = split_packed(d, cp_size, num_pad)
    return make_plan(
        "ulysses", cp_size, d, chunk, doc, start, length, pad=pad, validate=validate,
        info={"ulysses_degree": int(cp_size)},
    )  # fmt: skip


#: the method's entry in the registry (declared in pyproject.toml's ``flashcp.methods`` entry points)
METHOD = MethodSpec(
    name="ulysses", display_name="Ulysses", order=62, planner=plan_ulysses,
    comm_kind=CommKind.ALLTOALL, op=OpFamily.ULYSSES, color="#e377c2",
)  # fmt: skip
