"""The work the simulator prices equals the work the ops issue, item by item.

For every registered method and a few sampled plans (2 and 4 ranks, in-process emulation on
CPU), :func:`flashcp.executors.work_trace.trace_work` records what each rank's op really issues
(varlen kernel calls and their segments, memory-bound ATen ops and their bytes, collectives and
ring exchanges and their bytes, views, allocations and other dispatches), forward and backward,
and :func:`flashcp.sim.work.work_account` reads back what the step model prices for the same
plan. They must agree exactly, except for the differences listed in :data:`DIFFERENCES`: each is
a named rule that says, per pass, ring step and rank, how many ops more (or fewer) the op issues
than the model prices, and why. A difference that no rule explains fails the test; so does a
rule that no longer matches (the counts must come out equal after the listed corrections).

Kinds of listed difference:

* ``intended``: the model prices a GPU run in bfloat16 and the kernel as one launch; the CPU
  trace in float32 skips casts that are no-ops there, and kernel-internal launches (the
  FlashAttention-2 backward's GQA sum) are not ATen ops.
  A ring layout holding a document in non-adjacent pieces on a rank (none in the registry; one
  sample builds it by hand) is priced with one rectangle per (step, rank, document): the
  ``split_pieces`` rules, on those steps only.
* ``mismatch``: work the op issues and the model does not price (or the reverse), listed for the
  pricing to be fixed (docs/simulator.md, "Work the simulator prices"); none is left. When one
  is fixed, its rule's count goes to 0 and the rule must go.

Bytes (read + written) are held within the band of :data:`BYTE_BANDS` per family: the model
prices merges and accumulations with per-element constants of the hardware profile
(``merge_bytes_eager``, ``accum_bytes_eager``), not with each op's tensor sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np
import pytest

from flashcp.comm import AttnShape, comm_volume_by_link
from flashcp.executors.work_trace import trace_account, trace_work
from flashcp.plan import make_plan
from flashcp.registry import COMM_KIND, get_method, make_plan_for, method_names
from flashcp.sim.hardware import load_hardware
from flashcp.sim.work import work_account
from flashcp.topology import Topology

HW = load_hardware("h100_sxm")

#: (method, cp_size, doc_lens, planner options); 2 and 4 ranks, many and few documents
SAMPLES = (
    ("ring", 2, (12, 20, 8), {}),
    ("ring", 4, (40, 8, 24, 56), {}),
    ("zigzag", 2, (12, 20, 8), {}),
    ("zigzag", 4, (40, 8, 24, 56), {}),
    ("zigzag", 4, (128,), {}),
    # pad rows on every rank: the ring runs on blocks of 16 of the 20 local rows
    ("zigzag", 2, (12, 20), {"num_pad": 8}),
    # uneven pad (one rank's rows are part of the block at step 0) and a rank holding only pad
    ("zigzag", 2, (9, 18, 19, 35, 18), {"num_pad": 9}),
    ("ring", 4, (4, 14, 24), {"num_pad": 22}),
    ("llama3", 4, (40, 8, 24, 56), {}),
    ("per_doc", 4, (40, 8, 24, 56), {}),
    # the all-gather op's keep_gathered_kv (an op option, not a planner's): no backward gather
    ("llama3", 4, (40, 8, 24, 56), {"keep_gathered_kv": True}),
    ("flashcp", 4, (40, 8, 24, 56), {"keep_gathered_kv": True}),
    # and its dK/dV reduce-scatter in bf16: the send rows cast to it, the received rows back
    ("llama3", 4, (40, 8, 24, 56), {"keep_gathered_kv": True, "grad_comm_dtype": "bfloat16"}),
    ("flashcp", 4, (40, 8, 24, 56), {"grad_comm_dtype": "bfloat16"}),
    ("flashcp", 2, (12, 20, 8), {}),
    ("flashcp", 4, (40, 8, 24, 56), {}),
    ("flashcp_refined", 4, (40, 8, 24, 56), {}),
    # one node: flashcp's plan and op (two nodes: a two-scope gather the step model does not
    # price yet, docs/scale.md)
    ("flashcp_node", 4, (40, 8, 24, 56), {}),
    ("ilp", 2, (12, 20, 8), {}),
    ("ulysses", 4, (40, 8, 24, 56), {}),
    ("usp", 4, (40, 8, 24, 56), {"ulysses_degree": 2}),
    # groups of one rank (the inner ring alone), without and with pad rows on every rank
    ("usp", 2, (12, 20, 8), {"ulysses_degree": 1}),
    ("usp", 2, (12, 20), {"ulysses_degree": 1, "num_pad": 8}),
    ("usp", 4, (3, 9, 11), {"ulysses_degree": 2, "num_pad": 9}),
    # a hand-made ring layout (rank 0 holds two non-adjacent pieces of document 0): steps with
    # two kernel calls, and index rows
    (
        "ring",
        2,
        (16, 8),
        {
            "layout": (
                (0, 0, 0, 1, 1, 1),
                (0, 1, 0, 0, 0, 1),
                (0, 0, 8, 4, 12, 4),
                (4, 4, 4, 4, 4, 4),
            )
        },
    ),
    ("flashcp_ulysses", 4, (40, 8, 24, 56), {"ulysses_degree": 2}),
    # cp_size 1: every method's op is one plain varlen call (flashcp.ops.single_device), with
    # and without pad rows
    ("ring", 1, (12, 20, 8), {}),
    ("llama3", 1, (12, 20, 8), {}),
    ("flashcp", 1, (12, 20, 9), {"num_pad": 3}),
    ("ulysses", 1, (12, 20, 9), {"num_pad": 3}),
    # pad rows: super-rank 1 holds 34 of u T = 36 rows, so only its ranks pad their output
    ("flashcp_ulysses", 4, (40, 8, 22), {"ulysses_degree": 2, "pad_to_multiple": True}),
)
#: shapes: GQA with KV heads replicated over 4 Ulysses ranks (bf16: the casts of a GPU run), and
#: plain multi-head attention in float32
SHAPES = (AttnShape(4, 2, 16, "bfloat16"), AttnShape(4, 4, 8, "float32"))


# ---- the difference table ----------------------------------------------------------------------


@dataclass(frozen=True)
class Ctx:
    """What a rule may read: the plan's op metadata per rank, the model's ring masks, dtypes."""

    method: str
    family: str  # "ring", "allgather", "ulysses", "usp", "flashcp_ulysses"
    plan: object
    shape: AttnShape
    metas: tuple  # per rank: the op's metadata (RingMeta / AllGatherMeta / inner of a hybrid)
    masks: tuple | None  # the model's ring masks (launched, part_q, part_k), (steps, N) each
    cast: int  # 1 when the model dtype is not the compute dtype (a cast is a real op)
    steps: int
    n: int


@dataclass(frozen=True)
class Difference:
    """One listed difference: ``delta(ctx, phase)`` is the (steps, N) array of op - model."""

    name: str
    families: tuple[str, ...]
    phases: tuple[str, ...]
    item: str  # "mem_ops", "kernel_calls" or "host_ops" (dispatches that launch work)
    kind: str  # "intended" or "mismatch"
    reason: str
    delta: Callable


def _is_index(rows) -> bool:
    return not isinstance(rows, slice)


def _partial_slice(rows, total: int) -> bool:
    return isinstance(rows, slice) and (rows.stop - rows.start) < total


def _ring_table(ctx: Ctx, fn) -> np.ndarray:
    """(steps, N) array of ``fn(meta, s, calls, r)`` over the ring steps of every rank."""
    out = np.zeros((ctx.steps, ctx.n))
    for r, meta in enumerate(ctx.metas):
        for s, calls in enumerate(meta.steps):
            out[s, r] = fn(meta, s, calls, r)
    return out


def _inner_masks(ctx: Ctx):
    """The model's masks ``[t, r]`` for every rank r (hybrids: of its super-rank)."""
    u = ctx.plan.ulysses_degree if ctx.family == "usp" else 1
    idx = np.arange(ctx.n) // u
    return tuple(np.asarray(m, dtype=float)[:, idx] for m in ctx.masks)


def _split_entries(ctx: Ctx) -> np.ndarray:
    """(steps, N) 1.0 where the step's local or source block holds a document in non-adjacent
    pieces (:func:`_split_ranks`), else 0.0."""
    split = _split_ranks(ctx.plan)
    out = np.zeros((ctx.steps, ctx.n))
    for r in range(ctx.n):
        for s in range(ctx.steps):
            out[s, r] = r in split or (r - s) % ctx.n in split
    return out


def _d_calls(ctx, phase):
    launched, _, _ = _inner_masks(ctx)
    return (_ring_table(ctx, lambda m, s, calls, r: len(calls)) - launched) * _split_entries(ctx)


def _d_merge_per_call(ctx, phase):
    per = (11 + ctx.cast) if phase == "fwd" else 3
    extra = _ring_table(ctx, lambda m, s, calls, r: len(calls)) - (ctx.q_work)
    return per * extra * _split_entries(ctx)


def _d_dtype_casts(ctx, phase):
    out = np.zeros((ctx.steps, ctx.n))
    if ctx.cast:
        return out
    if phase == "fwd":  # the merge's block_out.to(fp32) per merge, out.to(q.dtype) at the end
        out -= ctx.q_work
        out[-1] -= 1
    else:  # the last step's dk/dv and dq casts (the model prices 3 ops there: the op's add of
        # the returned partial sum and these two casts)
        out[-1] -= 2
    return out


def _fwd_gathers(meta, s, calls, r):
    n = 0
    for c in calls:
        if _is_index(c.q_rows):
            n += 1 + 4  # q rows, then the merge's index_select x 2 and index_copy_ x 2
        if _is_index(c.k_rows):
            n += 2  # k and v rows
    return n


def _bwd_gathers(meta, s, calls, r):
    t = meta.block_tokens
    n = 0
    for c in calls:
        if _is_index(c.q_rows):
            n += 4  # dout, q, out, lse rows
        elif _partial_slice(c.q_rows, t):
            n += 1  # lse[:, rows].contiguous()
        if _is_index(c.k_rows):
            n += 2
    return n


def _d_row_gathers(ctx, phase):
    """The op's row gathers per call (index rows only; a contiguous row range is a view) less the
    model's per step (:func:`flashcp.sim.cost.ring._gather_masks`: one run of visible shards
    is a slice), on the split entries only."""
    _, part_q, _ = _inner_masks(ctx)
    q_gather, k_gather = ctx.gathers
    if phase == "fwd":
        op, model = _ring_table(ctx, _fwd_gathers), 5 * q_gather + 2 * k_gather
    else:
        op = _ring_table(ctx, _bwd_gathers)
        model = 4 * q_gather + (part_q * (1 - q_gather)) + 2 * k_gather
    return (op - model) * _split_entries(ctx)


def _split_ranks(plan) -> set[int]:
    """Ranks holding some document in non-adjacent pieces (in their local order)."""
    out = set()
    for r in range(plan.cp_size):
        docs = plan.rank_shards(r)[0].tolist()
        runs = [d for i, d in enumerate(docs) if i == 0 or docs[i - 1] != d]
        if len(runs) != len(set(runs)):
            out.add(r)
    return out


def _d_split_pieces(item):
    """Kernel statistics of a step whose local or source block holds a document in non-adjacent
    pieces: the model's segment of a (step, rank, document) is one rectangle (step 0: one causal
    segment over the rank's tokens of it), exact when the pieces are adjacent, as in every
    registry layout (zigzag's two pieces fuse); the op issues a segment per piece and key range
    (a causal and a full call at step 0), so other CTAs, tiles, query / key rows and largest
    CTA."""
    from flashcp.sim.kernel import bwd_tile_counts, fwd_tile_counts

    def delta(ctx, phase):
        out = np.zeros((ctx.steps, ctx.n))
        counts = fwd_tile_counts if phase == "fwd" else bwd_tile_counts
        bq, bk = (
            (HW.fwd_block_q, HW.fwd_block_k) if phase == "fwd" else (HW.bwd_block_q, HW.bwd_block_k)
        )
        model = ctx.acc.per_step[(phase, item)]
        split = _split_ranks(ctx.plan)
        for r in range(ctx.n):
            for s, calls in enumerate(ctx.metas[r].steps):
                if r not in split and (r - s) % ctx.n not in split:
                    continue
                v = 0.0
                for c in calls:
                    ql, kl = np.diff(c.cu_seqlens_q.numpy()), np.diff(c.cu_seqlens_k.numpy())
                    stats = counts(ql, kl, np.full(ql.size, c.causal), bq, bk)
                    v += {"ctas": stats[0].sum(), "tiles": stats[1].sum(), "q_rows": ql.sum(),
                          "kv_rows": kl.sum()}[item]  # fmt: skip
                out[s, r] = v - model[s, r]
        return out

    return delta


def _a2a_pads(ctx) -> np.ndarray:
    """Per rank, 1 where the forward pads the inner op's output before gathering heads: always
    for Ulysses; for a hybrid when its super-rank's rows fall short of u T (pad in the group)."""
    if ctx.family == "ulysses":
        return np.ones(ctx.n)
    from flashcp.kinds import CommKind
    from flashcp.ops.hybrid_attn import prepare_hybrid

    kind = CommKind.P2P_RING if ctx.family == "usp" else CommKind.ALLGATHER_SHARDED
    t = ctx.plan.context_len // ctx.n
    return np.array([
        float(prepare_hybrid(ctx.plan, r, ctx.plan.method, kind).rows < ctx.degree * t)
        for r in range(ctx.n)
    ])  # fmt: skip


def _a2a_pad_slowest(ctx, phase):
    """A hybrid's forward pads the inner op's output before gathering heads only on the ranks
    whose super-rank's rows fall short of u T; the model prices the all-to-all stage once for
    the plan (its slowest rank), with the pad when any rank pads."""
    pads = _a2a_pads(ctx)
    return (pads - pads.max())[None, :]


DIFFERENCES: tuple[Difference, ...] = (
    # ring family (ring, zigzag; the inner ring of usp), per ring step and rank
    Difference("split_pieces_calls", ("ring", "usp"), ("fwd", "bwd"), "kernel_calls", "intended",
               "a step whose block holds a document in non-adjacent pieces calls one kernel per "
               "causal flag and per non-adjacent key range; the model prices one call per step "
               "with work (exact when the pieces are adjacent, as in every registry layout)",
               _d_calls),
    Difference("split_pieces_merges", ("ring", "usp"), ("fwd", "bwd"), "mem_ops", "intended",
               "each of those calls is merged (forward) or accumulated (backward) on its own; "
               "the model merges once per step", _d_merge_per_call),
    Difference("split_pieces_gathers", ("ring", "usp"), ("fwd", "bwd"), "mem_ops", "intended",
               _d_row_gathers.__doc__, _d_row_gathers),
    Difference("dtype_casts", ("ring", "usp"), ("fwd", "bwd"), "mem_ops", "intended",
               "float32 inputs: the merge's cast of each block output, and the final casts of "
               "out (forward), dq, dk/dv (backward), are no-ops; the model prices bf16",
               _d_dtype_casts),
    *(
        Difference(f"split_pieces_{item}", ("ring",), ("fwd", "bwd"), item, "intended",
                   _d_split_pieces.__doc__, _d_split_pieces(item))
        for item in ("ctas", "tiles", "q_rows", "kv_rows")
    ),
    # Ulysses and the hybrids' all-to-alls
    Difference("alltoall_pad_slowest", ("usp", "flashcp_ulysses"), ("fwd",), "mem_ops",
               "intended", _a2a_pad_slowest.__doc__, _a2a_pad_slowest),
)  # fmt: skip

#: bytes (read + written) of memory-bound ops: op / model, per family (both passes); measured
#: 0.72-1.47 (ring: per-element merge and accumulation constants), 0.98-1.15 (all-gather),
#: 1.00-1.04 (Ulysses), 0.96-1.20 (usp: its ring steps), 0.95-1.00 (flashcp_ulysses), with about
#: 10% margin
BYTE_BANDS = {
    "ring": (0.65, 1.6),
    "allgather": (0.9, 1.25),
    "ulysses": (0.9, 1.15),
    "usp": (0.85, 1.35),
    "flashcp_ulysses": (0.9, 1.1),
    "single": (0.99, 1.01),  # cp_size 1: the pad copies, priced by their tensor sizes
}


# ---- running a sample --------------------------------------------------------------------------


def _family(method: str) -> str:
    if method == "flashcp_node":  # its own op, which on one node is the all-gather family's
        return "allgather"
    op = get_method(method).op.value
    if op == "hybrid":
        return method if method in ("usp", "flashcp_ulysses") else "usp"
    return {"ring": "ring", "allgather": "allgather", "ulysses": "ulysses"}[op]


@cache
def _sample(i: int, j: int):
    method, n, docs, opts = SAMPLES[i]
    shape = SHAPES[j]
    opts = dict(opts)
    keep = opts.pop("keep_gathered_kv", False)
    grad = opts.pop("grad_comm_dtype", None)
    if "layout" in opts:
        plan = make_plan(method, n, np.array(docs), *(np.array(c) for c in opts["layout"]))
    else:
        plan = make_plan_for(method, np.array(docs), n, **opts)
    op_options = {"keep_gathered_kv": True} if keep else {}
    if grad is not None:
        op_options["grad_comm_dtype"] = grad
    traces = trace_work(plan, shape, "train", op_options=op_options or None)
    acc = work_account(plan, shape, "train", HW, keep_gathered_kv=keep, grad_comm_dtype=grad)
    return plan, shape, trace_account(traces, HW, n), acc


def _ctx(method, plan, shape, acc) -> Ctx:
    from flashcp.ops import get_attn_op

    fam = _family(method)
    if fam == "usp" and plan.ulysses_degree == 1:  # groups of one rank: the inner ring alone
        fam = "ring"
    if plan.single_device_documents() is not None:  # cp_size 1: one plain call, no difference
        fam = "single"
    prepare, _ = get_attn_op(method)
    metas = tuple(prepare(plan, r) for r in range(plan.cp_size))
    if hasattr(metas[0], "inner"):  # a hybrid's metadata: its inner op's
        metas = tuple(m.inner for m in metas)
    masks = None
    steps = 1
    if fam in ("ring", "usp"):
        from flashcp.sim.cost import PlanCost

        cost = PlanCost(plan, HW, "p2p_ring")
        cost = cost.inner if cost.inner is not None else cost
        masks = cost.ring_masks()
        steps = cost.n
    cast = int(shape.dtype not in ("float32", "float64"))
    ctx = Ctx(method, fam, plan, shape, metas, masks, cast, steps, plan.cp_size)
    if masks is not None:
        u = plan.ulysses_degree if fam == "usp" else 1
        idx = np.arange(plan.cp_size) // u
        work = (cost.q_rows > 0).astype(float)[:, idx]
        object.__setattr__(ctx, "q_work", work)
        gathers = tuple(g.astype(float)[:, idx] for g in (cost.q_gather, cost.k_gather))
        object.__setattr__(ctx, "gathers", gathers)
    object.__setattr__(ctx, "acc", acc)
    object.__setattr__(ctx, "degree", plan.ulysses_degree if fam != "ulysses" else plan.cp_size)
    return ctx


def compare(i: int, j: int, account=None) -> list[str]:
    """Every unexplained difference of sample ``i`` on shape ``j`` (empty: all equal)."""
    method, n, docs, _ = SAMPLES[i]
    plan, shape, tr, acc = _sample(i, j)
    acc = account if account is not None else acc
    ctx = _ctx(method, plan, shape, acc)
    fam = ctx.family
    per = tr["per_step"]
    bad = []
    for phase in ("fwd", "bwd"):
        rules = {
            item: [
                d for d in DIFFERENCES if fam in d.families and phase in d.phases and d.item == item
            ]
            for item in ("mem_ops", "kernel_calls", "ctas", "tiles", "q_rows", "kv_rows")
        }
        # kernels: calls and the tiles of their segments (ring: per step and rank)
        for item in ("kernel_calls", "ctas", "tiles", "q_rows", "kv_rows", "max_tiles"):
            op = per[(phase, item)]
            sim = acc.per_step[(phase, item)]
            if fam in ("ring", "usp"):
                sim = sim[:, acc.inner_rank]
                fix = sum((d.delta(ctx, phase) for d in rules.get(item, ())), np.zeros_like(op))
                if item == "max_tiles":  # the largest CTA of a step's calls
                    ok = np.array_equal(op, sim) or bool(_split_ranks(plan))
                else:
                    ok = np.array_equal(op, sim + fix)
                if not ok:
                    bad.append(f"{phase} {item} per [step, rank]: op {op.tolist()} != model "
                               f"{sim.tolist()} + listed {fix.tolist()}")  # fmt: skip
            else:
                op_t = op.max(0) if item == "max_tiles" else op.sum(0)
                sim_t = sim[0, acc.inner_rank]
                if not np.allclose(op_t, sim_t, atol=1e-6):
                    bad.append(f"{phase} {item}: op {op_t.tolist()} != model {sim_t.tolist()}")
        # memory-bound ops
        op = per[(phase, "mem_ops")]
        fix = [d.delta(ctx, phase) for d in rules["mem_ops"]]
        if fam == "ring":
            sim = acc.per_step[(phase, "mem_ops")]
            want = sim + sum(fix, np.zeros_like(sim))
            if not np.allclose(op, want, atol=1e-6):
                bad.append(f"{phase} mem_ops per [step, rank]: op {op.tolist()} != model "
                           f"{np.round(sim, 6).tolist()} + listed {sum(fix).tolist()}")  # fmt: skip
        else:
            total = op.sum(0)
            if fam == "usp":
                sim = acc.per_step[(phase, "mem_ops")][:, acc.inner_rank].sum(0)
                sim = sim + acc.rank_max[(phase, "a2a_mem_ops")]
                want = sim + sum(f.sum(axis=0) for f in fix)  # ring steps, then the a2a stage
            else:
                sim = acc.rank_max[(phase, "mem_ops")] + acc.rank_max.get((phase, "a2a_mem_ops"), 0)
                want = sim + sum(f[0] for f in fix)
            if not np.allclose(total, want, atol=1e-6):
                bad.append(f"{phase} mem_ops per rank: op {total.tolist()} != model "
                           f"{np.round(sim, 6).tolist()} + listed {np.round(want - sim, 6).tolist()}")  # fmt: skip
        # host dispatches that launch work (kernels, memory-bound ops): the model's host_op_us
        # terms, with the same listed corrections; views, allocations and other dispatches are
        # not priced per op (reported, not compared)
        fix_m = sum((d.delta(ctx, phase) for d in rules["mem_ops"]), 0.0)
        fix_k = sum((d.delta(ctx, phase) for d in rules["kernel_calls"]), 0.0)
        fix_h = sum((d.delta(ctx, phase) for d in DIFFERENCES
                     if fam in d.families and phase in d.phases and d.item == "host_ops"), 0.0)  # fmt: skip
        op_h = per[(phase, "mem_ops")] + per[(phase, "kernel_calls")]
        if fam == "ring":
            sim_h = acc.per_step[(phase, "host_ops")]
            if not np.allclose(op_h, sim_h + fix_m + fix_k + fix_h, atol=1e-6):
                bad.append(f"{phase} host dispatches per [step, rank]: op {op_h.tolist()} != model "
                           f"{np.round(sim_h, 6).tolist()} + listed")  # fmt: skip
        else:
            if fam == "usp":
                sim_h = acc.per_step[(phase, "host_ops")][:, acc.inner_rank].sum(0)
                sim_h = sim_h + acc.rank_max[(phase, "a2a_host_ops")]
                listed = sum(
                    (d.delta(ctx, phase).sum(axis=0) for d in DIFFERENCES
                     if fam in d.families and phase in d.phases),
                    np.zeros(ctx.n),
                )  # fmt: skip
            else:
                sim_h = acc.rank_max[(phase, "host_ops")] + acc.rank_max.get(
                    (phase, "a2a_host_ops"), 0
                )
                listed = sum(f[0] for f in (fix_m, fix_k, fix_h) if np.ndim(f))
            got = op_h.sum(0)
            if not np.allclose(got, sim_h + listed, atol=1e-6):
                bad.append(f"{phase} host dispatches per rank: op {got.tolist()} != model "
                           f"{np.round(sim_h, 6).tolist()} + listed {np.round(listed, 6).tolist()}")  # fmt: skip
        # bytes within the family's band
        lo, hi = BYTE_BANDS[fam]
        op_b = per[(phase, "mem_bytes")].sum(0)
        if fam in ("ring", "usp"):
            sim_b = acc.per_step[(phase, "mem_bytes")][:, acc.inner_rank].sum(0)
            sim_b = sim_b + acc.rank_max.get((phase, "a2a_mem_bytes"), 0.0)
            ratio = op_b / sim_b
        else:
            sim_b = acc.rank_max[(phase, "mem_bytes")] + acc.rank_max.get(
                (phase, "a2a_mem_bytes"), 0
            )
            # no memory-bound op on either side (cp_size 1 without pad): equal
            ratio = np.array([op_b.max() / sim_b if sim_b or op_b.max() else 1.0])
        if not ((ratio >= lo) & (ratio <= hi)).all():
            bad.append(f"{phase} mem_bytes op / model {np.round(ratio, 3).tolist()} outside "
                       f"[{lo}, {hi}]")  # fmt: skip
        # communication: calls and bytes per kind
        for (ph, kind), (calls, per_call) in acc.comm.items():
            if ph != phase:
                continue
            key = "p2p" if kind.startswith("p2p") else kind
            got = tr["comm"].get((phase, key), [])
            if kind.startswith("p2p"):
                want_calls = sum(c for (p2, k2), (c, _) in acc.comm.items()
                                 if p2 == phase and k2.startswith("p2p"))  # fmt: skip
                want_bytes = sum(c * b for (p2, k2), (c, b) in acc.comm.items()
                                 if p2 == phase and k2.startswith("p2p"))  # fmt: skip
            else:
                want_calls, want_bytes = calls, calls * per_call
            if len(got) != want_calls or not np.isclose(sum(got), want_bytes):
                bad.append(f"{phase} {kind}: op {len(got)} calls, {sum(got)} B != model "
                           f"{want_calls} calls, {want_bytes} B")  # fmt: skip
        for (ph, kind), got in tr["comm"].items():
            if ph == phase and not any(
                p2 == phase and (k2 == kind or (kind == "p2p" and k2.startswith("p2p")))
                for (p2, k2) in acc.comm
            ):
                bad.append(f"{phase} {kind}: {len(got)} op calls the model does not price")
    return [f"{method} N={n} docs={docs} {shape.dtype}: {b}" for b in bad]


# ---- tests --------------------------------------------------------------------------------------


def test_every_method_is_sampled():
    assert {s[0] for s in SAMPLES} == set(method_names())


@pytest.mark.parametrize("j", range(len(SHAPES)), ids=[s.dtype for s in SHAPES])
@pytest.mark.parametrize(
    "i",
    range(len(SAMPLES)),
    ids=[
        f"{s[0]}-N{s[1]}-{len(s[2])}docs"
        + ("-layout" if "layout" in s[3] else "")
        + ("-keepkv" if s[3].get("keep_gathered_kv") else "")
        + (f"-{s[3]['grad_comm_dtype']}" if s[3].get("grad_comm_dtype") else "")
        for s in SAMPLES
    ],
)
def test_work_equals(i, j):
    bad = compare(i, j)
    assert not bad, "\n".join(bad)


def test_perturbed_account_fails():
    """One merge fewer per ring step in the model's account is seen."""
    i = next(k for k, s in enumerate(SAMPLES) if s[0] == "zigzag" and s[1] == 4)
    _, _, _, acc = _sample(i, 0)
    worse = dataclasses.replace(acc, per_step=dict(acc.per_step))
    key = ("fwd", "mem_ops")
    worse.per_step[key] = acc.per_step[key] - (acc.per_step[key] > 0)
    assert not compare(i, 0)
    bad = compare(i, 0, worse)
    assert bad and all("fwd mem_ops" in b for b in bad)


def test_bad_arguments_are_one_line_errors():
    from flashcp.sim.work import probe_profile

    with pytest.raises(ValueError, match="unknown probe unit"):
        probe_profile(HW, launch_ms=1)
    plan = make_plan_for("ring", np.array([8, 8]), 2)
    with pytest.raises(ValueError, match=r"ranks must be in \[0, 2\)"):
        trace_work(plan, SHAPES[1], "train", ranks=[2])
    with pytest.raises(ValueError, match="mode"):
        work_account(plan, SHAPES[1], "fit", HW)
    llama3 = make_plan_for("llama3", np.array([8, 8]), 2)
    with pytest.raises(ValueError, match="only as a ring"):
        work_account(llama3, SHAPES[1], "train", HW, impl="ring_flash_attn")


# ---- bytes per link class ----------------------------------------------------------------------

#: 2 nodes of 2 ranks, CP rank order node by node or round-robin (docs/multinode.md)
TOPOLOGIES = {p: Topology(4, 2, p, 2) for p in ("consecutive", "strided")}
LINK_SAMPLES = [i for i, s in enumerate(SAMPLES) if s[1] == 4 and "layout" not in s[3]]


@pytest.mark.parametrize(
    "placement", ["consecutive", pytest.param("strided", marks=pytest.mark.slow)]
)  # the inner loop keeps one placement (about 6 s); CI runs both
@pytest.mark.parametrize("i", LINK_SAMPLES, ids=[f"{SAMPLES[i][0]}-{i}" for i in LINK_SAMPLES])
def test_link_bytes_equal_the_model(i, placement):
    """The bytes each rank's op receives from its own node and from the other node (the ops'
    CommCounter with the topology, in-process groups) equal
    :func:`flashcp.comm.comm_volume_by_link` per rank (the gloo ranks' counterpart:
    tests/distributed/test_link_bytes.py)."""
    method, n, docs, opts = SAMPLES[i]
    opts = dict(opts)
    keep = opts.pop("keep_gathered_kv", False)
    plan = make_plan_for(method, np.array(docs), n, **opts)
    shape, topo = SHAPES[1], TOPOLOGIES[placement]
    op_options = {"keep_gathered_kv": True} if keep else None
    traces = trace_work(plan, shape, "train", op_options=op_options, topology=topo)
    want = comm_volume_by_link(plan, COMM_KIND[method], shape, "train", topo, keep_gathered_kv=keep)
    for t in traces:
        assert t.links == {c: {k: int(v[t.rank]) for k, v in want[c].items()} for c in want}
