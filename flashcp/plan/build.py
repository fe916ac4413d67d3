"""How planners build plans: :func:`planner_entry` (zero-length documents and pad tokens for
every planner), and the compiled planners' fast paths (:func:`fused_args`, :func:`fused_plan`,
:func:`buffer_plan`, :func:`packed_plan`) (:mod:`flashcp.plan`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from flashcp import compiled
from flashcp.plan.checks import MAX_CP_SIZE, MAX_TOKENS, check_cp_args, check_doc_lens, json_value
from flashcp.plan.model import Plan, _int64_arrays, _RankSums, make_plan


def fused_plan(
    kernel: str,
    method: str,
    doc_lens: Any,
    cp_size: Any,
    num_pad: Any,
    pad_to_multiple: Any,
    validate: Any,
) -> Plan | None:
    """A baseline's plan from one compiled call that checks the arguments, lays out the shards,
    merges, validates and sums them (:func:`flashcp.plan.kernels.ring_plan` and the like), with its
    metrics and digest buffer attached; or None, and the caller takes the general path (which
    plans the same, or raises the error naming the bad value): kernels off, arguments of other
    types, a zero-length document, a total not divisible as the layout needs, ...

    Args:
        kernel: name of the fused kernel in :mod:`flashcp.plan.kernels`.
        method: planner name stored in the plan.
        doc_lens: (n_docs,) int64 ndarray (anything else: None).
        cp_size, num_pad: Python ints, >= 1 and >= 0.
        pad_to_multiple, validate: Python bools.
    Returns:
        the :class:`Plan` ``planner_entry`` gives for these arguments (same arrays, digest,
        metrics), or None.
    """
    if not fused_args(doc_lens, cp_size, num_pad, pad_to_multiple, validate):
        return None
    kernels = compiled.load("plan")
    if kernels is None:
        return None
    buf = getattr(kernels, kernel)(doc_lens, cp_size, num_pad, pad_to_multiple, validate)
    if buf[-1]:
        return None
    return buffer_plan(buf, method, cp_size, doc_lens.size, "ok", {})


def fused_args(
    doc_lens: Any, cp_size: Any, num_pad: Any, pad_to_multiple: Any, validate: Any
) -> bool:
    """Whether a fused kernel takes these planner arguments as they are: ``doc_lens`` a 1-D
    C-contiguous int64 ndarray, ``cp_size`` and ``num_pad`` Python ints in range (1 to
    :data:`MAX_CP_SIZE`, >= 0 and below 2^30: with the kernels' at most 2^26 document tokens, within
    :data:`MAX_TOKENS`), ``pad_to_multiple`` and ``validate`` Python bools (anything else
    takes the general path, which converts it or raises the error naming it)."""
    return (
        _int64_arrays(doc_lens)
        and type(cp_size) is int
        and type(num_pad) is int
        and type(pad_to_multiple) is bool
        and type(validate) is bool
        and 1 <= cp_size <= MAX_CP_SIZE
        and 0 <= num_pad < 1 << 30
    )


def buffer_plan(buf: np.ndarray, method: str, n: int, nd: int, status: str, info: dict) -> Plan:
    """The :class:`Plan` a fused kernel's buffer holds (:func:`flashcp.plan.kernels.finish_plan`
    describes it; status 0), its arrays views of the buffer, with its metrics and digest bytes;
    ``info`` already JSON-clean (:func:`json_value`)."""
    doc_tokens, num_pad, max_tokens, max_send, max_work, total_work, any_work = buf[-11:-4].tolist()
    num_split, max_shards, m, _ = buf[-4:].tolist()
    o = 1 + nd
    end = o + 4 * m + n
    sums = _RankSums(
        buf[end : end + 3 * n], buf[end + 3 * n : end + 4 * n], max_tokens, max_send, max_work,
        total_work, any_work, num_split, max_shards,
    )  # fmt: skip
    # the fields as Plan.__init__ would set them (an int, int64 arrays, JSON-clean info), without
    # its checks and copies (a few microseconds), plus what the kernel computed with the plan
    plan = Plan.__new__(Plan)
    plan.__dict__.update(
        method=method, cp_size=n, doc_lens=buf[1:o], rank=buf[o : o + m],
        doc=buf[o + m : o + 2 * m], start=buf[o + 2 * m : o + 3 * m],
        length=buf[o + 3 * m : o + 4 * m], status=status, info=info, pad=buf[end - n : end],
        _rank_sums=sums, _packed=buf[:end], num_pad=num_pad, context_len=doc_tokens + num_pad,
    )  # fmt: skip
    return plan


def packed_plan(
    method: str,
    cp_size: int,
    doc_lens: np.ndarray,
    cols: np.ndarray,
    pad: np.ndarray,
    *,
    status: str = "ok",
    info: dict | None = None,
    validate: bool = True,
) -> Plan:
    """``make_plan(method, cp_size, doc_lens, *cols, status=status, info=info, pad=pad,
    validate=validate)`` in one compiled call (:func:`flashcp.plan.kernels.finish_plan`: the
    merge, the validation, the per-rank sums and the metrics), for a compiled planner's output:
    the same plan (arrays, digest, metrics), with its metrics and digest bytes attached as a
    fused planner's. Where the kernel does not take the input (kernels off, other dtypes, a
    context over :data:`flashcp.plan.kernels.EXACT_TOKENS` tokens) or finds it invalid,
    :func:`make_plan` builds the plan (and raises its error).

    Args:
        method, cp_size, status, info, validate: as :func:`make_plan`.
        doc_lens: (n_docs,) int64. cols: (4, n) int64, the pieces' rank, doc, start, length in
            each rank's local order. pad: (cp_size,) int64.
    Raises:
        ValueError: when ``validate`` and an invariant is violated (:meth:`Plan.validate`).
    """
    kernels = compiled.load("plan")
    if (
        kernels is not None
        and type(cp_size) is int
        and _int64_arrays(doc_lens, pad)
        and type(cols) is np.ndarray
        and cols.dtype == np.int64
        and cols.ndim == 2
        and cols.shape[0] == 4
        and cols.flags.c_contiguous
        and pad.size == cp_size
    ):
        buf = kernels.finish_plan(
            doc_lens, cp_size, cols[0], cols[1], cols[2], cols[3], pad, bool(validate)
        )
        if not buf[-1]:
            clean = json_value(dict(info or {}), "plan.info")
            return buffer_plan(buf, method, cp_size, doc_lens.size, status, clean)
    return make_plan(
        method, cp_size, doc_lens, *cols, status=status, info=info, pad=pad, validate=validate
    )


def _check_pad_args(num_pad: Any, pad_to_multiple: Any) -> int:
    """``num_pad`` as an int; raises ValueError naming a bad ``num_pad`` or ``pad_to_multiple``."""
    if isinstance(num_pad, bool) or not isinstance(num_pad, int | np.integer) or num_pad < 0:
        raise ValueError(f"num_pad must be an integer >= 0, got {num_pad!r}")
    if not isinstance(pad_to_multiple, bool | np.bool_):
        raise ValueError(f"pad_to_multiple must be True or False, got {pad_to_multiple!r}")
    return int(num_pad)


def _restore_docs(plan: Plan, doc_lens: np.ndarray, kept: np.ndarray, pad_doc: bool) -> Plan:
    """Map a plan of ``doc_lens[kept]`` (plus, when ``pad_doc``, one trailing pseudo-document of
    pad tokens) back to the caller's documents; the pseudo-document's shards become pad."""
    if not pad_doc and kept.size == doc_lens.size:
        return plan
    rank, doc, pad = plan.rank, plan.doc, plan.pad
    keep = doc < kept.size
    if pad_doc:
        pad = pad + np.bincount(
            rank[~keep], weights=plan.length[~keep], minlength=plan.cp_size
        ).astype(np.int64)
    info = {
        key: [int(kept[i]) for i in val if i < kept.size]
        if key.endswith("_docs") and isinstance(val, list | tuple)
        else val
        for key, val in plan.info.items()
    }
    return Plan(
        plan.method, plan.cp_size, doc_lens, rank[keep], kept[doc[keep]], plan.start[keep],
        plan.length[keep], plan.status, info, pad,
    )  # fmt: skip


def planner_entry(
    method: str, *, chunks_per_rank: int = 1, fused: str | Callable[..., Plan | None] | None = None
):
    """Decorator giving a planner the input handling every planner shares (docs/design.md §2).

    The decorated planner ``planner(doc_lens, cp_size, *, num_pad=0, pad_to_multiple=False,
    **options) -> Plan``:

    * accepts zero-length documents: they are removed before ``func`` plans the others and the
      plan's document indices (shards, and ``info`` lists under keys ending in ``_docs``) are
      mapped back, so the plan is the one without them; all-empty input (no document, or only
      zero-length ones) gives a plan with no shard and the pad spread evenly, without calling
      ``func``;
    * takes ``num_pad`` pad tokens after the last document, and with ``pad_to_multiple`` adds the
      fewest more that make the total divisible by ``chunks_per_rank * cp_size``. A ``func`` with
      a ``num_pad`` parameter places pad itself; for any other the pad is planned as one trailing
      pseudo-document whose shards then become pad (``func``'s own objective counts its
      ``P (P + 1) / 2`` pairs, negligible for the ``P < cp_size`` of ``pad_to_multiple``; the
      returned plan's metrics never count pad).

    Args:
        method: the method name (stored in the all-empty plan).
        chunks_per_rank: equal chunks per rank the layout needs (2 for ``llama3``), so that the
            total must divide by ``chunks_per_rank * cp_size``.
        fused: name of a kernel of :mod:`flashcp.plan.kernels` that computes the whole plan of
            ``func`` in one call (:func:`fused_plan`): tried first when the compiled kernels are
            on, for the common case (an int64 array of lengths >= 1, plain ints and bools, no
            option but ``validate``); every other case takes the path described here. Or a
            function ``fused(doc_lens, cp_size, num_pad, pad_to_multiple, options) -> Plan |
            None`` (``options`` the planner's keyword options) that plans the cases it takes as
            ``func`` would and returns None for the others.
    Raises (from the decorated planner):
        ValueError: a negative or non-integer length, a bad ``cp_size``, ``num_pad`` or
            ``pad_to_multiple``, or (padding off) a total not divisible as the layout needs; the
            message names the value and the multiple needed.
    """

    def wrap(func):
        sig = inspect.signature(func)
        native_pad = "num_pad" in sig.parameters

        @functools.wraps(func)
        def planner(doc_lens, cp_size, *, num_pad=0, pad_to_multiple=False, **options):
            if callable(fused):
                plan = fused(doc_lens, cp_size, num_pad, pad_to_multiple, options)
                if plan is not None:
                    return plan
            elif fused is not None and (not options or options.keys() == {"validate"}):
                validate = options.get("validate", True)
                plan = fused_plan(
                    fused, method, doc_lens, cp_size, num_pad, pad_to_multiple, validate
                )
                if plan is not None:
                    return plan
            d = check_doc_lens(doc_lens)
            num_pad = _check_pad_args(num_pad, pad_to_multiple)
            check_cp_args(0, cp_size)  # cp_size itself
            cp_size = int(cp_size)  # a NumPy integer (np.uint8 too) as a Python int from here on
            if pad_to_multiple:
                num_pad += -(int(d.sum()) + num_pad) % (chunks_per_rank * int(cp_size))
            if int(d.sum()) + num_pad > MAX_TOKENS:
                raise ValueError(
                    f"{int(d.sum())} document tokens and num_pad = {num_pad} make "
                    f"{int(d.sum()) + num_pad} tokens; a packed sequence holds at most "
                    f"MAX_TOKENS = 2**31 = {MAX_TOKENS}"
                )
            check_cp_args(int(d.sum()) + num_pad, cp_size, chunks_per_rank)
            if d.size and d.all():  # no zero-length document: nothing to restore
                if native_pad:
                    return func(d, cp_size, num_pad=num_pad, **options)
                if not num_pad:
                    return func(d, cp_size, **options)
            kept = np.flatnonzero(d)
            if kept.size == 0:
                pad = np.full(int(cp_size), num_pad // int(cp_size), dtype=np.int64)
                return make_plan(method, cp_size, d, [], [], [], [], pad=pad)
            if native_pad:
                plan = func(d[kept], cp_size, num_pad=num_pad, **options)
            elif num_pad:
                plan = func(np.append(d[kept], num_pad), cp_size, **options)
            else:
                plan = func(d[kept], cp_size, **options)
            restored = _restore_docs(plan, d, kept, pad_doc=num_pad > 0 and not native_pad)
            if restored is not plan and options.get("validate", True):
                restored.validate()
            return restored

        params = [
            p for p in sig.parameters.values() if p.name not in ("num_pad", "pad_to_multiple")
        ]
        extra = [
            inspect.Parameter("num_pad", inspect.Parameter.KEYWORD_ONLY, default=0),
            inspect.Parameter("pad_to_multiple", inspect.Parameter.KEYWORD_ONLY, default=False),
        ]
        var_kw = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
        params = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
        planner.__signature__ = sig.replace(parameters=[*params, *extra, *var_kw])
        planner.is_planner_entry = True
        planner.chunks_per_rank = chunks_per_rank  # what check_context_len needs of a method
        return planner

    return wrap
