"""Implementations of a layout (``method.impl``): what each one really launches (docs/design.md §4).

The same layout can be run by different code. ``ours`` is this project's ops (``flashcp.ops``);
``ring_flash_attn`` is the ``ring-flash-attn`` package (zhuzilin/ring-flash-attention, v0.1.7),
whose functions the FlashCP paper ran as its Ring, Zigzag and Llama3 baselines. The simulator
prices each from the ops it issues, read from its source:

``ring_flash_attn`` (``ring_flash_attn/*.py``):

* ``ring`` = ``ring_flash_attn_varlen_func``: every rank holds the r-th of N equal chunks of
  *every document* (its ``cu_seqlens`` are local and identical on all ranks), so every document
  length must be a multiple of N; at step t it runs attention only if ``t <= rank`` (causal only at
  t = 0) and merges the block's output with ``update_out_and_lse`` (eager fp32 ops).
* ``zigzag`` = ``zigzag_ring_flash_attn_varlen_func``: every document in 2N chunks (lengths a
  multiple of 2N); at step ``1 <= t <= rank`` the whole local query block against the *front*
  halves of the source's documents (``k[half_index0]``, ``v[half_index0]``: boolean-mask gathers),
  at ``t > rank`` the *back* halves of the local queries (``q[half_index1]``) against the whole
  source block, merged into ``out[half_index1]`` (gather, merge, scatter). Its backward builds the
  back-half LSE with a Python loop over documents (``get_half_lse``, two ``.item()`` per document),
  accumulates ``dq[half_index1] +=`` / ``dk[half_index0] +=`` (gather, add, scatter), and sends
  dK/dV partial sums in fp32. Its masks live on the host (``get_half_index`` builds them with
  ``torch.zeros`` and no device), so every gather or scatter by a mask copies indices to the device
  and synchronises the stream. With *one* document its ``get_half_index`` returns slices instead of
  masks: the halves of q, k, v, dout and out are views (no gather), the accumulations into half a
  buffer run in place on the view, and a back-half merge only copies its result into
  ``out[half]`` (no gather of out).
* ``llama3`` = ``llama3_flash_attn_varlen_func``: the packed sequence in N contiguous chunks (not
  the paper's 2N); KV all-gathered ``heads_k_stride`` KV heads at a time (K and V separately,
  the next group's gather overlapping this group's attention), outputs concatenated; backward
  gathers again, zeroes a dK/dV buffer the size of the gathered KV, reduce-scatters dK and dV per
  head group after its attention (not overlapped) and copies them into place.

Padding: ``ring``/``zigzag`` of ``ring_flash_attn`` need every document length divisible by N / 2N;
:func:`impl_plan` pads each document up to the next multiple (the padding joins its document, as
a user padding each sample would do) and reports the padding tokens.

``ours``: the layouts of :mod:`flashcp.registry` with no padding; the ring ops
(:mod:`flashcp.ops.ring_attn`) run one varlen call per step on the step's fused segments, gather
query/KV rows by index where a step uses part of the local block, merge with
:func:`flashcp.ops.lse.merge_lse_rows_` (eager fp32) and accumulate gradients with one eager add per
tensor; the all-gather ops copy each shard's KV prefix out of the gathered buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from flashcp.comm import IMPLS
from flashcp.plan import Plan, check_doc_lens, make_plan

__all__ = [
    "AG_GROUP_BUDGET_BYTES",
    "IMPLS",
    "IMPL_METHODS",
    "ImplOps",
    "check_impl",
    "impl_ops",
    "impl_plan",
]

#: methods each implementation can run (``ours`` runs every method of the registry)
IMPL_METHODS = MappingProxyType({"ring_flash_attn": ("ring", "zigzag", "llama3")})

#: byte budget of the project's all-gather op's fp32 gradient buffer, which sets its head groups
#: (``flashcp.ops.allgather_attn.HEAD_GROUP_BUDGET_BYTES``; a test keeps the two equal)
AG_GROUP_BUDGET_BYTES = 2**30

#: KV heads per all-gather of ring-flash-attn's llama3 (its varlen benchmark,
#: ``benchmark/benchmark_varlen_kvpacked_func.py``: ``heads_k_stride=4``)
RFA_HEADS_K_STRIDE = 4


@dataclass(frozen=True)
class ImplOps:
    """Eager ops one implementation issues, per ring step or per call (counts read from source).

    Attributes:
        merge_ops: element-wise ops (kernels) of one LSE merge over the merged rows.
        merge_bytes: the profile field giving its bytes per output element
            (``merge_bytes_eager``, ``merge_bytes_scripted`` or ``merge_bytes_fused``).
        half_gather_ops: gathers a step issues to pick part of a block (index ops, each reading and
            writing the gathered rows), for a step that uses only part of either block.
        accum_ops: accumulations ``acc += block`` per backward step (dQ, dK, dV).
        indexed_accum_ops: extra gather + scatter per accumulation into part of a buffer.
        per_doc_host: the implementation loops over documents in Python once per backward call.
        skip_after_rank: no kernel at ring step ``t > rank`` (ring-flash-attn's ring).
        one_doc_views: with a single document the halves of a block are slices (views), not
            index gathers: no gather of a half, accumulations into half a buffer in place, and a
            merge into half of out writes its result back with one copy (ring-flash-attn's zigzag).
        mask_syncs: its half-block gathers and scatters index a CUDA tensor with a *CPU* boolean
            mask: PyTorch turns the mask into indices on the host and copies them to the device
            from pageable memory, a blocking copy that waits for the stream; the device then idles
            while the host dispatches the next op (one ``host_op_us`` per such gather or scatter).
    """

    merge_ops: int
    merge_bytes: str
    half_gather_ops: int
    accum_ops: int
    indexed_accum_ops: int
    per_doc_host: bool
    skip_after_rank: bool
    one_doc_views: bool = False
    mask_syncs: bool = False


#: ring-flash-attn's ``_update_out_and_lse`` is ``@torch.jit.script``: TorchScript's fuser joins
#: its element-wise chain (to(fp32), out - block, sigmoid, mul, sub on out; logsigmoid, sub on lse)
#: into a few kernels after warm-up; we count 2 launches and price its bytes with
#: ``merge_bytes_scripted`` (between fully fused and fully eager). Ours ``merge_lse_`` is eager:
#: logaddexp, isneginf, where, 2 x (sub, exp), mul_, float, mul, add_, copy_ (lse.py).
_OPS = MappingProxyType(
    {
        ("ring_flash_attn", "ring"): ImplOps(2, "merge_bytes_scripted", 0, 3, 0, False, True),
        ("ring_flash_attn", "zigzag"): ImplOps(
            2, "merge_bytes_scripted", 2, 3, 2, True, False, True, True
        ),
    }
)
#: the project's ring op family (:mod:`flashcp.ops.ring_attn`): the same code for every layout
_OURS_RING = ImplOps(12, "merge_bytes_eager", 2, 3, 0, False, False)


def check_impl(method: str, impl: str) -> None:
    """Raise ValueError unless ``impl`` is known and can run ``method``."""
    if impl not in IMPLS:
        raise ValueError(f"unknown method.impl {impl!r}; choose one of {', '.join(IMPLS)}")
    allowed = IMPL_METHODS.get(impl)
    if allowed is not None and method not in allowed:
        raise ValueError(
            f"method.impl={impl!r} implements only {', '.join(allowed)}, not method {method!r}"
        )


def impl_ops(impl: str, method: str) -> ImplOps:
    """The ring-family op counts of ``impl`` running ``method`` as a ring.

    Raises:
        ValueError: as :func:`check_impl` (``ring_flash_attn`` runs only ``ring`` and ``zigzag``
            as rings).
    """
    if impl == "ring_flash_attn" and method not in ("ring", "zigzag"):
        raise ValueError(f"ring-flash-attn has no ring implementation of method {method!r}")
    check_impl(method, impl)
    if impl == "ours":  # the project's ring op runs any layout as a ring
        return _OURS_RING
    return _OPS[(impl, method)]


def _per_doc_chunks(d: np.ndarray, cp_size: int, chunks: int) -> tuple[np.ndarray, ...]:
    """Columns of the layout with every document (length divisible by ``chunks``) in ``chunks``
    equal pieces; piece j of a document goes to rank j (chunks = N) or to ranks j and 2N-1-j
    (chunks = 2N, zigzag)."""
    n_docs = d.size
    piece = d // chunks
    j = np.arange(chunks)
    owner = j if chunks == cp_size else np.where(j < cp_size, j, 2 * cp_size - 1 - j)
    rank = np.tile(owner, n_docs)
    doc = np.repeat(np.arange(n_docs), chunks)
    start = (np.repeat(piece, chunks) * np.tile(j, n_docs)).astype(np.int64)
    length = np.repeat(piece, chunks)
    return rank, doc, start, length


def impl_plan(method: str, impl: str, doc_lens, cp_size: int, **options) -> tuple[Plan, int]:
    """The plan ``impl`` really runs for ``method`` on ``doc_lens``, and its padding tokens.

    Args:
        method: a registry method; impl: ``ours`` or ``ring_flash_attn``.
        doc_lens: (n_docs,) int document lengths, in packed order.
        cp_size: N. options: planner options (``ours`` only).
    Returns:
        ``(plan, pad_tokens)``: for ``ours`` the registry planner's plan and 0; for
        ``ring_flash_attn`` ``ring`` / ``zigzag``, the per-document N / 2N-chunk layout of the
        documents padded to a multiple of N / 2N (``pad_tokens`` = tokens added; the plan's
        context is ``C + pad_tokens``), and for ``llama3`` the N-contiguous-chunk layout and 0.
    Raises:
        ValueError: unknown impl, a method the impl does not run, options given to a
            ring-flash-attn layout, or what the planner raises.
    """
    from flashcp.registry import get_planner, split_options

    check_impl(method, impl)
    if impl == "ours":
        return get_planner(method)(doc_lens, cp_size, **split_options(method, options)[0]), 0
    if options:
        raise ValueError(f"method.impl=ring_flash_attn takes no planner options, got {options}")
    d = check_doc_lens(doc_lens)
    if method == "llama3":
        plan = get_planner("ring")(d, cp_size)
        return make_plan("llama3", cp_size, d, plan.rank, plan.doc, plan.start, plan.length), 0
    chunks = cp_size if method == "ring" else 2 * cp_size
    padded = -(-d // chunks) * chunks
    cols = _per_doc_chunks(padded, cp_size, chunks)
    return make_plan(method, cp_size, padded, *cols), int((padded - d).sum())
