"""The all-gather CP op family (``llama3``, ``per_doc``: full; ``flashcp``, ``flashcp_refined``,
``ilp``: sharding-aware), for any plan of a method whose spec names it (:mod:`flashcp.ops.families`).

Every rank contributes a *send buffer* of its local KV rows, padded to the largest rank's, and
all-gathers the buffers; each local shard ``(doc, start, length)`` is then one causal varlen
segment with ``sq = length`` queries (its local rows) and ``sk = start + length`` keys (the prefix of
its document, then itself), aligned bottom-right. One varlen kernel call computes all segments of a
rank.

* ``llama3`` / ``per_doc`` send every local row (full all-gather; Eq. 4 of the FlashCP paper).
* ``flashcp`` (and every ``allgather_sharded`` method) sends only the rows of *non-last* shards: a shard's KV is needed by another rank only
  if a later shard of its document exists (Eq. 5). Documents kept whole are never communicated.

Keys are assembled with one index gather from ``source = [local KV (T rows); gathered buffers
(N * M rows)]``; a rank reads its own rows from the local part. Backward re-gathers the KV (nothing
is kept between passes; ``keep_gathered_kv=True`` keeps each head group's ``source`` from the
forward instead: one all-gather per layer and pass pair, at the memory
:func:`allgather_peak_bytes` states), runs the kernel backward, scatter-adds dK/dV into a buffer
shaped like ``source`` in ``compute_dtype`` (float32, float64 for float64 inputs;
:func:`flashcp.ops.backends.compute_dtype`), reduce-scatters the gathered part in
``grad_comm_dtype`` (default: the same, so every rank's partial sum is rounded once, at the end)
so each owner receives the dK/dV of the rows it sent, and adds it to the local part.
Communicated volumes equal :func:`flashcp.comm.comm_volume`: forward all-gather, backward
all-gather again (not with ``keep_gathered_kv``) plus a reduce-scatter of the same rows in
``grad_comm_dtype``.

K and V travel together as one ``(rows, 2, h, D)`` buffer in the model dtype; only KV heads move.
Both passes process the KV heads in groups of h (``heads_per_group``, the head stride of
``ring-flash-attn``'s llama3 variant), one all-gather (and one reduce-scatter) per group, so the
gathered KV and the gradient buffer hold h heads, not all Hkv: :func:`allgather_peak_bytes`
states the peak memory.

Pad tokens (``plan.pad``, the last rows of a rank's tensors) take no part: the op runs on each
rank's document rows only (metadata :meth:`AllGatherMeta.without_pad`), their KV is never sent,
and pad rows get output 0 and gradient 0. A rank holding no document token still joins every
collective, so all ranks issue the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from flashcp.ops.backends import (
    VarlenBackend,
    compute_dtype,
    get_backend,
    resolve_softmax_scale,
)
from flashcp.ops.collectives import (
    CommCounter,
    all_gather_into_tensor,
    check_qkv,
    check_same_plan,
    reduce_scatter_tensor,
    resolve_grad_comm_dtype,
    resolve_group,
)
from flashcp.ops.meta_index import allgather_index
from flashcp.ops.timing import as_timer
from flashcp.plan import Plan, cu_seqlens

__all__ = [
    "HEAD_GROUP_BUDGET_BYTES",
    "AllGatherAttn",
    "AllGatherMeta",
    "allgather_attention",
    "allgather_attn_backward",
    "allgather_attn_forward",
    "allgather_peak_bytes",
    "build_allgather_meta",
    "check_heads_per_group",
    "check_inputs",
    "check_keep_gathered_kv",
    "resolve_backend",
    "resolve_heads_per_group",
]

#: default byte budget of the backward's gradient buffer (T + N*M, 2, heads_per_group, D) in
#: ``compute_dtype``: ``heads_per_group=None`` picks the largest divisor of num_kv_heads that fits.
#: At 128K tokens on 8 ranks with head_dim 128 (T + N*M = 144K rows) one KV head needs 144 MiB in
#: float32, so the default takes 4 of 32 KV heads at a time there (8 all-gathers, reduce-scatters
#: and kernel calls per pass instead of 1; backward peak 1.5 GiB instead of 9.1 GiB in bf16 by
#: :func:`allgather_peak_bytes`); with 32 KV heads up to 16K tokens run in one group, as before.
HEAD_GROUP_BUDGET_BYTES = 2**30


@dataclass(eq=False)
class AllGatherMeta:
    """Per-rank metadata of one plan, built once per batch and reused by every layer.

    Attributes:
        method: the plan's method.
        plan: the plan (its digest is checked across ranks before the first collective).
        rank: this rank.
        cp_size: N.
        tokens: T = C / N local tokens, pad included.
        doc_tokens: this rank's document (non-pad) tokens, its first local rows; the kernels,
            ``kv_index`` and ``send_rows`` see only these.
        send_max: M, rows of the padded send buffer (max over ranks of rows sent).
        send_rows: (n_send,) int64, local rows this rank sends, in buffer order.
        kv_index: (Tk,) int64, rows of ``source = [local (T); gathered (N*M)]`` forming the keys of
            every segment, segment after segment.
        cu_seqlens_q, cu_seqlens_k: (n_seg + 1,) int32; segment i has ``length_i`` queries and
            ``start_i + length_i`` keys.
        max_seqlen_q, max_seqlen_k: longest segment.
    """

    method: str
    plan: Plan
    rank: int
    cp_size: int
    tokens: int
    doc_tokens: int
    send_max: int
    send_rows: torch.Tensor
    kv_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    _on_device: dict = field(default_factory=dict, repr=False)
    _verified: set = field(default_factory=set, repr=False)

    def tensors(self, device) -> tuple[torch.Tensor, ...]:
        """``(send_rows, kv_index, cu_seqlens_q, cu_seqlens_k)`` on ``device`` (cached)."""
        key = str(torch.device(device))
        if key not in self._on_device:
            self._on_device[key] = tuple(
                t.to(device)
                for t in (self.send_rows, self.kv_index, self.cu_seqlens_q, self.cu_seqlens_k)
            )
        return self._on_device[key]

    def without_pad(self) -> AllGatherMeta:
        """This metadata for the rank's document rows only (``tokens = doc_tokens``; cached)."""
        if self.doc_tokens == self.tokens:
            return self
        if "without_pad" not in self._on_device:
            self._on_device["without_pad"] = replace(
                self, tokens=self.doc_tokens, _on_device={}, _verified=self._verified
            )
        return self._on_device["without_pad"]

    def verify(self, group) -> None:
        """Check once per process group that every rank holds the same plan (see
        :func:`flashcp.ops.collectives.check_same_plan`)."""
        key = id(group)
        if key not in self._verified:
            check_same_plan(self.plan, group)
            self._verified.add(key)


def build_allgather_meta(plan: Plan, rank: int, method: str, sharding_aware: bool) -> AllGatherMeta:
    """Build :class:`AllGatherMeta` for ``rank`` (pure; no process group).

    Args:
        plan: a valid plan whose ``method`` is ``method``.
        rank: 0 <= rank < cp_size.
        method: expected ``plan.method``.
        sharding_aware: send only non-last shards (FlashCP) instead of every local row.
    Raises:
        ValueError: wrong method, rank out of range, or ranks holding unequal token counts
            (pad included).
    """
    if plan.method != method:
        raise ValueError(f"this op runs {method!r} plans, got a plan for {plan.method!r}")
    n = plan.cp_size
    if isinstance(rank, bool) or not 0 <= int(rank) < n:
        raise ValueError(f"rank {rank!r} out of range for cp_size = {n}")
    rank = int(rank)
    tok = plan.tokens_per_rank
    if (tok != tok[0]).any():
        raise ValueError(f"every rank must hold the same number of tokens, got {tok.tolist()}")
    t = int(tok[0])
    index = allgather_index(plan, rank, sharding_aware)  # from the shards: the same arrays
    if index is None:  # shards that do not tile the documents: the token-level reference
        index = allgather_index_reference(plan, rank, sharding_aware)
    send_max, send_rows, kv_index = index
    _, start, ln = plan.rank_shards(rank)
    klen = start + ln
    r_tok = int(plan.doc_tokens_per_rank[rank])
    return AllGatherMeta(
        method=method,
        plan=plan,
        rank=rank,
        cp_size=n,
        tokens=t,
        doc_tokens=r_tok,
        send_max=send_max,
        send_rows=torch.from_numpy(send_rows),
        kv_index=torch.from_numpy(kv_index),
        cu_seqlens_q=cu_seqlens(ln, device="cpu"),
        cu_seqlens_k=cu_seqlens(klen, device="cpu"),
        max_seqlen_q=int(ln.max()) if ln.size else 0,
        max_seqlen_k=int(klen.max()) if klen.size else 0,
    )


def allgather_index_reference(
    plan: Plan, rank: int, sharding_aware: bool
) -> tuple[int, np.ndarray, np.ndarray]:
    """``(send_max, send_rows, kv_index)`` of :class:`AllGatherMeta` token by token (the readable
    reference of :func:`flashcp.ops.meta_index.allgather_index`, which gives the same arrays from
    the shards).

    Raises:
        ValueError: a needed key is held by another rank but not sent.
    """
    n = plan.cp_size
    # token-level view of the document tokens: shards are sorted by rank then local order, so the
    # concatenation of every shard holds rank r's document rows at real_off[r] .. real_off[r + 1]
    real = plan.doc_tokens_per_rank  # (N,)
    real_off = cu_seqlens(real)[:-1]
    n_tok = int(real.sum())
    length = plan.length
    shard_of = np.repeat(np.arange(plan.num_shards), length)  # (R,)
    seg_off = cu_seqlens(length)[:-1]
    within = np.arange(n_tok, dtype=np.int64) - seg_off[shard_of]
    doc_off = cu_seqlens(plan.doc_lens)[:-1]
    packed = doc_off[plan.doc[shard_of]] + plan.start[shard_of] + within  # (R,) packed position
    where = np.empty(n_tok, dtype=np.int64)
    where[packed] = np.arange(n_tok)  # packed position -> concatenation index
    owner = np.repeat(np.arange(n), real)  # (R,)
    local_row = np.arange(n_tok, dtype=np.int64) - real_off[owner]
    sends = ~plan.is_last[shard_of] if sharding_aware else np.ones(n_tok, dtype=bool)
    # position of each token in its owner's send buffer (-1: not sent)
    cs = np.cumsum(sends)
    sent_upto = np.concatenate([[0], cs])[real_off]  # (N,) tokens sent before rank r's first
    slot = np.where(sends, cs - 1 - sent_upto[owner], -1)
    send_max = int(np.bincount(owner, weights=sends, minlength=n).max()) if n_tok else 0

    # keys of this rank's segments: prefix + itself of each shard's document
    doc, start, ln = plan.rank_shards(rank)
    klen = start + ln
    k_off = cu_seqlens(klen)[:-1]
    k_within = np.arange(int(klen.sum()), dtype=np.int64) - np.repeat(k_off, klen)
    key_tok = where[np.repeat(doc_off[doc], klen) + k_within]  # concatenation index of each key
    own = owner[key_tok] == rank
    if (~own & (slot[key_tok] < 0)).any():
        raise ValueError("plan inconsistency: a needed key is held by another rank but not sent")
    r_tok = int(real[rank])
    kv_index = np.where(own, local_row[key_tok], r_tok + owner[key_tok] * send_max + slot[key_tok])

    mine = slice(int(real_off[rank]), int(real_off[rank]) + r_tok)
    send_rows = np.flatnonzero(sends[mine])
    return send_max, send_rows.astype(np.int64), kv_index.astype(np.int64)


def resolve_backend(backend, device, *, dtype=None, head_dim=None) -> VarlenBackend:
    """A :class:`VarlenBackend` from a name (see :func:`get_backend`, which ``dtype`` and
    ``head_dim`` of the inputs inform) or an instance."""
    if isinstance(backend, VarlenBackend):
        return backend
    return get_backend(backend, device, dtype=dtype, head_dim=head_dim)


def check_inputs(q, k, v, meta, meta_type, method: str, group) -> None:
    """Validate an op call before any communication.

    Args:
        q: (T, H, D); k, v: (T, Hkv, D) with ``T == meta.tokens``, ``H % Hkv == 0``, one floating
            dtype and one device.
        meta: built by the method's ``prepare_*`` for this rank.
    Raises:
        ValueError: naming the first problem (wrong metadata type or method, shapes, dtypes, heads,
            process-group size or rank).
    """
    if not isinstance(meta, meta_type) or getattr(meta, "method", None) != method:
        raise ValueError(
            f"{method}_attn needs metadata from prepare_{method}(plan, rank), got {type(meta).__name__}"
        )
    check_qkv(q, k, v, tokens=meta.tokens, rank=meta.rank, cp_size=meta.cp_size, group=group)


def check_heads_per_group(heads_per_group) -> None:
    """Raise ValueError unless ``heads_per_group`` is None or an integer >= 1."""
    h = heads_per_group
    if h is not None and (isinstance(h, bool) or not isinstance(h, int | np.integer) or h < 1):
        raise ValueError(f"heads_per_group must be None or an integer >= 1, got {h!r}")


def check_keep_gathered_kv(keep_gathered_kv) -> None:
    """Raise ValueError unless ``keep_gathered_kv`` is a bool."""
    if not isinstance(keep_gathered_kv, bool | np.bool_):
        raise ValueError(f"keep_gathered_kv must be True or False, got {keep_gathered_kv!r}")


def resolve_heads_per_group(
    heads_per_group, meta: AllGatherMeta, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """KV heads processed together by :func:`allgather_attn_forward` and
    :func:`allgather_attn_backward`.

    Args:
        heads_per_group: an integer >= 1 (values above ``num_kv_heads`` mean all heads at once),
            or None: the largest divisor h of ``num_kv_heads`` whose gradient buffer
            ``(C/N + N*M) * 2 * h * head_dim`` elements of ``compute_dtype(dtype)`` fits in
            :data:`HEAD_GROUP_BUDGET_BYTES` (at least 1). It depends only on the plan and the
            shapes (C/N counts pad rows, which differ between ranks only in how many are pad),
            so every rank picks the same value: their collectives must match.
        meta: this rank's metadata (N = ``meta.cp_size``, M = ``meta.send_max``, C = its plan's
            ``context_len``).
    Returns:
        h, 1 <= h <= num_kv_heads.
    Raises:
        ValueError: ``heads_per_group`` is neither None nor an integer >= 1.
    """
    check_heads_per_group(heads_per_group)
    if heads_per_group is not None:
        return min(int(heads_per_group), num_kv_heads)
    # rank-independent: meta.tokens is this rank's document rows in the pad-free metadata
    rows = meta.plan.context_len // meta.cp_size + meta.cp_size * meta.send_max
    per_head = rows * 2 * head_dim * compute_dtype(dtype).itemsize
    fits = [h for h in range(1, num_kv_heads + 1) if num_kv_heads % h == 0]
    return max([h for h in fits if h * per_head <= HEAD_GROUP_BUDGET_BYTES] or [1])


def allgather_peak_bytes(
    meta: AllGatherMeta,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    heads_per_group=None,
    grad_comm_dtype=None,
    staged_collectives: bool = False,
    keep_gathered_kv: bool = False,
) -> dict[str, int]:
    """Peak bytes one rank's all-gather op allocates during its forward and its backward call
    (inputs excluded; outputs included from the moment they exist), kernel workspace excluded.

    With R = T + N*M rows of the gathered KV (T = the rank's document tokens: pad rows take no
    part, though with pad the op returns a zero-padded copy of out; M rows of the largest send
    buffer),
    Tk = keys of all local segments (``meta.kv_index`` rows), h = ``heads_per_group`` (resolved),
    G = H / Hkv, D = head_dim, e = element size of ``dtype``, a = of ``compute_dtype(dtype)``,
    c = of ``grad_comm_dtype`` (resolved), s = 1 when there are several head groups (the q / out /
    dout slices of a group are then copies and the forward's out is assembled), st = 1 for
    collectives that stage through a temporary of the gathered size (gloo does; NCCL writes in
    place), O_f = T H D e + H T a (out, lse) and O_b = T (H + 2 Hkv) D e (dq, dk, dv), the live
    bytes of each phase are::

        forward   gather   s O_f + 2hD (R + M + st N M) e       gathered KV, send buffer
                  keys     s O_f + 2hD (R + Tk) e               gathered KV, the segments' keys
                  kernel   O_f + 2hD Tk e + s GhT (2D e + a)    keys, q slice, group's out, lse
        backward  gather   O_b + 2hD (R + M + st N M) e
                  keys     O_b + 2hD (R + Tk) e
                  kernel   O_b + 2hD Tk (e + a) + GhTD (3 s e + a)   keys, their grads, slices, dq
                  scatter  O_b + 2hD (Tk + R) a                 key grads, gradient buffer
                  reduce   O_b + 2hD (R a + M c + max((st + [c != a]) N M c, [c != a] M a))

    and the peak is the largest phase. With ``keep_gathered_kv`` the gathered KV of every group,
    K = 2 Hkv D R e in all, stays alive from the forward to the end of the backward: the forward's
    gather and keys phases add the earlier groups' K - 2hDRe (the last group's are the largest),
    its kernel phase adds K; the backward has no gather phase, its keys phase is O_b + 2hD Tk e.
    K is allocated by the forward and held until the backward ends (``kept``): the backward's
    peak above counts, as for inputs, only what it allocates itself, so the rank's bytes at that
    peak are K more. Between the passes the op holds K (plus out, lse), nothing by default.

    Every term but O_f / O_b (and K) is proportional to h: grouping KV heads divides the extra
    memory by about Hkv / h. With one group (h = Hkv) the float32 gradient
    buffer alone is (T + N*M) x 2 x Hkv x D x 4 bytes: 4.5 GiB per layer at 128K tokens on 8 ranks
    with 32 KV heads and head_dim 128, 144 MiB per KV head. Kernel workspace comes on top (the
    FlashAttention backward keeps a float32 dq accumulator of the group's query heads).
    ``experiments/benchmarks/bench_memory.py`` measures the peaks.

    Args:
        meta: the rank's metadata; num_heads, num_kv_heads, head_dim, dtype: of q / k / v.
        heads_per_group, grad_comm_dtype, keep_gathered_kv: the op's options.
        staged_collectives: the process group's collectives stage through a temporary (gloo).
    Returns:
        ``{"forward": bytes, "backward": bytes, "kept": K}`` (K = 0 without ``keep_gathered_kv``:
        the op's own bytes held between the passes besides out and lse).
    """
    h = resolve_heads_per_group(heads_per_group, meta, num_kv_heads, head_dim, dtype)
    e = dtype.itemsize
    a = compute_dtype(dtype).itemsize
    c = resolve_grad_comm_dtype(grad_comm_dtype, dtype).itemsize
    t, m, n, d = meta.doc_tokens, meta.send_max, meta.cp_size, head_dim
    r, tk = t + n * m, int(meta.kv_index.numel())
    g = num_heads // num_kv_heads
    s, st, cast = int(h < num_kv_heads), int(staged_collectives), int(c != a)
    o_f = t * num_heads * (d * e + a)
    o_b = t * (num_heads + 2 * num_kv_heads) * d * e
    kv = 2 * h * d  # elements per row of a group's K and V
    gather = kv * (r + m + st * n * m) * e
    keys = kv * (r + tk) * e
    kept = 2 * num_kv_heads * d * r * e if keep_gathered_kv else 0  # K
    prev = kept - kv * r * e if keep_gathered_kv else 0  # earlier groups' gathered KV
    forward = max(
        s * o_f + gather + prev,
        s * o_f + keys + prev,
        o_f + kv * tk * e + s * g * h * t * (2 * d * e + a) + kept,
    )
    backward = o_b + max(
        kv * tk * e if keep_gathered_kv else max(gather, keys),
        kv * tk * (e + a) + g * h * t * d * (3 * s * e + a),
        kv * (tk + r) * a,
        kv * (r * a + m * c + max((st + cast) * n * m * c, cast * m * a)),
    )
    return {"forward": int(forward), "backward": int(backward), "kept": int(kept)}


def _head_groups(num_kv_heads: int, heads_per_group: int) -> list[tuple[int, int]]:
    """KV head ranges ``[h0, h1)`` of the groups."""
    return [
        (h0, min(h0 + heads_per_group, num_kv_heads))
        for h0 in range(0, num_kv_heads, heads_per_group)
    ]


def _heads(x: torch.Tensor, h0: int, h1: int) -> torch.Tensor:
    """Heads ``h0:h1`` of a (T, heads, D) tensor as a kernel input: contiguous, or ``x`` itself
    when that is all of its heads and its last dimension has unit stride (every varlen kernel
    needs that; a view such as ``x[..., ::2]`` is copied)."""
    if (h0, h1) == (0, x.shape[1]) and x.stride(-1) == 1:
        return x
    return x[:, h0:h1].contiguous()


def _gather_kv(k, v, meta, send_rows, group, counter, timer, kept=None):
    """``source = [local K/V; all-gathered send buffers]``: (T + N*M, 2, h, D) for k, v of
    shape (T, h, D) (views of one head group are fine: they are copied into ``source``).
    ``kept``: a list that receives ``source`` (``keep_gathered_kv``)."""
    n, m, t = meta.cp_size, meta.send_max, meta.tokens
    with timer.phase("others"):
        source = k.new_empty((t + n * m, 2, *k.shape[1:]))
        source[:t, 0] = k
        source[:t, 1] = v
        send = k.new_zeros((m, 2, *k.shape[1:]))
        torch.index_select(source[:t], 0, send_rows, out=send[: send_rows.numel()])
    if m:
        with timer.phase("allgather"):
            all_gather_into_tensor(source[t:], send, group, counter)
    if kept is not None:
        kept.append(source)
    return source


def allgather_attn_forward(
    q,
    k,
    v,
    meta: AllGatherMeta,
    group,
    scale: float,
    backend: VarlenBackend,
    counter: CommCounter | None,
    timer,
    *,
    heads_per_group: int | None = None,
    kept: list | None = None,
):
    """Forward of the all-gather family, one group of KV heads (and their query heads) at a time.

    Args:
        q: (T, H, D); k, v: (T, Hkv, D); validated by :func:`check_inputs`.
        heads_per_group: see :func:`resolve_heads_per_group`.
        kept: None, or an empty list that receives each group's gathered KV ``source``
            ((T + N*M, 2, h, D) in k.dtype, group after group) for the backward
            (``keep_gathered_kv``).
    Returns:
        out: (T, H, D) in q.dtype; lse: (H, T) in ``compute_dtype(q.dtype)``.
    """
    timer = as_timer(timer)
    send_rows, kv_index, cu_q, cu_k = meta.tensors(q.device)
    hkv, d = k.shape[1], k.shape[2]
    g = q.shape[1] // hkv  # query heads per KV head
    hpg = resolve_heads_per_group(heads_per_group, meta, hkv, d, k.dtype)
    groups = _head_groups(hkv, hpg)
    if len(groups) > 1:
        out = q.new_empty(q.shape)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=compute_dtype(q.dtype), device=q.device)
    for h0, h1 in groups:
        source = _gather_kv(k[:, h0:h1], v[:, h0:h1], meta, send_rows, group, counter, timer, kept)
        with timer.phase("others"):
            k_seg, v_seg = source.index_select(0, kv_index).unbind(1)  # (Tk, h, D) each
            del source
            q_g = _heads(q, h0 * g, h1 * g)
        with timer.phase("attn_fwd"):
            out_g, lse_g = backend.forward(
                q_g,
                k_seg,
                v_seg,
                cu_q,
                cu_k,
                meta.max_seqlen_q,
                meta.max_seqlen_k,
                causal=True,
                softmax_scale=scale,
            )
        del k_seg, v_seg, q_g
        if len(groups) == 1:
            return out_g, lse_g
        with timer.phase("others"):
            out[:, h0 * g : h1 * g] = out_g
            lse[h0 * g : h1 * g] = lse_g
    return out, lse


def allgather_attn_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    meta: AllGatherMeta,
    group,
    scale: float,
    backend: VarlenBackend,
    counter: CommCounter | None,
    timer,
    *,
    heads_per_group: int | None = None,
    grad_comm_dtype=None,
    kept: list | None = None,
):
    """Backward of the all-gather family, one group of h KV heads at a time: re-gather the
    group's KV, kernel backward, accumulate its dK/dV in ``compute_dtype`` into a buffer shaped
    like the gathered KV, reduce-scatter the gathered part in ``grad_comm_dtype`` to the rows'
    owners, add to the local part, round once to k.dtype.

    Peak memory: :func:`allgather_peak_bytes` (``backward``); the float32 gradient buffer is
    (T + N*M, 2, h, D) for h = ``heads_per_group`` KV heads instead of all of them.

    Args:
        dout, out: (T, H, D); q: (T, H, D); k, v: (T, Hkv, D); lse: (H, T) in
            ``compute_dtype(q.dtype)``.
        heads_per_group: see :func:`resolve_heads_per_group` (must equal the forward's).
        grad_comm_dtype: dtype of the reduce-scatter
            (:func:`~flashcp.ops.collectives.resolve_grad_comm_dtype`; default
            ``compute_dtype(k.dtype)``).
        kept: None (re-gather), or the forward's ``kept`` list: each group's gathered KV is
            taken from it and no all-gather is issued.
    Returns:
        dq: (T, H, D); dk, dv: (T, Hkv, D); in the input dtypes.
    """
    timer = as_timer(timer)
    send_rows, kv_index, cu_q, cu_k = meta.tensors(q.device)
    t, hkv, d = k.shape
    g = q.shape[1] // hkv
    acc = compute_dtype(q.dtype)
    gdt = resolve_grad_comm_dtype(grad_comm_dtype, k.dtype)
    hpg = resolve_heads_per_group(heads_per_group, meta, hkv, d, k.dtype)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for i, (h0, h1) in enumerate(_head_groups(hkv, hpg)):
        qh = slice(h0 * g, h1 * g)
        if kept is not None:  # gathered in the forward
            source = kept[i]
        else:
            source = _gather_kv(k[:, h0:h1], v[:, h0:h1], meta, send_rows, group, counter, timer)
        with timer.phase("others"):
            k_seg, v_seg = source.index_select(0, kv_index).unbind(1)  # (Tk, h, D) each
            rows = source.shape[0]
            del source
            args = [_heads(x, qh.start, qh.stop) for x in (dout, q)]
            args += [k_seg, v_seg, _heads(out, qh.start, qh.stop), lse[qh]]
        with timer.phase("attn_bwd"):
            dq_g, dk_seg, dv_seg = backend.backward(
                *args,
                cu_q,
                cu_k,
                meta.max_seqlen_q,
                meta.max_seqlen_k,
                causal=True,
                softmax_scale=scale,
                grad_dtype=acc,
            )
        del args, k_seg, v_seg
        with timer.phase("others"):
            dq[:, qh] = dq_g
            del dq_g
            dsource = torch.zeros((rows, 2, h1 - h0, d), dtype=acc, device=q.device)
            dsource[:, 0].index_add_(0, kv_index, dk_seg)
            dsource[:, 1].index_add_(0, kv_index, dv_seg)
            del dk_seg, dv_seg
            dlocal = dsource[:t]  # (T, 2, h, D)
        if meta.send_max:
            with timer.phase("others"):
                rs_in = dsource[t:].to(gdt)  # a view when gdt == acc
                rs_out = rs_in.new_empty((meta.send_max, *rs_in.shape[1:]))
            with timer.phase("reducescatter"):
                reduce_scatter_tensor(rs_out, rs_in, group, counter)
            with timer.phase("others"):
                del rs_in
                dlocal.index_add_(0, send_rows, rs_out[: send_rows.numel()].to(acc))
                del rs_out
        with timer.phase("others"):
            dk[:, h0:h1] = dlocal[:, 0]
            dv[:, h0:h1] = dlocal[:, 1]
        del dsource, dlocal
    return dq, dk, dv


class AllGatherAttn(torch.autograd.Function):
    """Autograd glue of the all-gather family: saves (q, k, v, out, lse), with ``keep`` each
    head group's gathered KV too, and the call's context; delegates both passes to
    :func:`allgather_attn_forward` / :func:`allgather_attn_backward`."""

    @staticmethod
    def forward(
        ctx, q, k, v, meta, group, scale, backend, counter, timer, hpg, grad_comm_dtype, keep
    ):  # fmt: skip
        kept = [] if keep else None
        out, lse = allgather_attn_forward(
            q, k, v, meta, group, scale, backend, counter, timer, heads_per_group=hpg, kept=kept
        )
        ctx.save_for_backward(q, k, v, out, lse, *(kept or ()))
        ctx.call = (meta, group, scale, backend, counter, timer)
        ctx.options = {"heads_per_group": hpg, "grad_comm_dtype": grad_comm_dtype}
        ctx.keep = keep
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *kept = ctx.saved_tensors
        dq, dk, dv = allgather_attn_backward(
            dout.contiguous(), q, k, v, out, lse, *ctx.call, **ctx.options,
            kept=kept if ctx.keep else None,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def allgather_attention(
    q, k, v, meta: AllGatherMeta, group=None, *, method: str, softmax_scale=None,
    backend="auto", counter=None, timer=None, grad_comm_dtype=None, heads_per_group=None,
    keep_gathered_kv=False,
):  # fmt: skip
    """CP attention of the all-gather family for this rank's tokens (document-masked causal).

    Each method of the family gets it with its ``method`` bound from
    :func:`flashcp.ops.get_attn_op` (:mod:`flashcp.ops.families`).

    Args:
        q: (T_local, num_heads, head_dim); k, v: (T_local, num_kv_heads, head_dim), laid out as the
            plan gives this rank (see :func:`flashcp.ops.sharding.shard_tensor`). Any float dtype;
            float64 inputs are computed in float64 end to end with ``backend="reference"``.
        meta: from the method's ``prepare(plan, rank)`` (:func:`build_allgather_meta`); reuse it
            for every layer.
        group: process group of the CP ranks (default: the world; a subgroup of the job or a 1-D
            ``DeviceMesh``: :func:`~flashcp.ops.collectives.resolve_group`); size ``cp_size``.
        method: the method whose metadata ``meta`` must be.
        softmax_scale: default ``1 / sqrt(head_dim)``
            (:func:`~flashcp.ops.backends.resolve_softmax_scale`).
        backend: kernel backend name or instance (:func:`flashcp.ops.backends.get_backend`).
        counter: :class:`~flashcp.ops.collectives.CommCounter` receiving the bytes moved.
        timer: :class:`~flashcp.ops.timing.PhaseTimer` receiving per-phase times.
        grad_comm_dtype: dtype of the dK/dV reduce-scatter in the backward. Default (None):
            ``compute_dtype(k.dtype)`` (float32 for bf16/fp16/fp32, float64 for float64), what
            :func:`flashcp.comm.comm_volume` counts by default: every rank's partial sum is then
            rounded once, at the end, and the dK/dV error does not grow with cp_size. A 16-bit
            dtype halves the reduce-scatter bytes at that cost (same option, default and
            validation as the ring ops: :func:`~flashcp.ops.collectives.resolve_grad_comm_dtype`).
        heads_per_group: KV heads processed together (with their query heads) in both passes;
            bounds the extra memory of both passes (formula in :func:`allgather_peak_bytes`).
            Default (None): the largest divisor of num_kv_heads whose float32 gradient buffer
            fits :data:`HEAD_GROUP_BUDGET_BYTES` (:func:`resolve_heads_per_group`); the KV
            all-gather and the reduce-scatter are then issued once per group (same total bytes).
        keep_gathered_kv: keep each head group's gathered KV from the forward to the backward,
            which then issues no all-gather (one per layer and pass pair, as Eq. 4 / Eq. 5 of the
            FlashCP paper count): fewer bytes (:func:`flashcp.comm.comm_volume` with the same
            option) for (T + N*M) x 2 x Hkv x D elements of the model dtype held between the
            passes (:func:`allgather_peak_bytes`). Default False: re-gather in the backward.
    Returns:
        out: (T_local, num_heads, head_dim), differentiable w.r.t. q, k, v.
    Raises:
        ValueError: bad metadata, shapes, dtypes, options or group (before any communication), or
            ranks holding different plans (checked once per group before the first collective).
    """
    group = resolve_group(group)
    check_inputs(q, k, v, meta, AllGatherMeta, method, group)
    resolve_grad_comm_dtype(grad_comm_dtype, k.dtype)  # raises on a bad value
    check_heads_per_group(heads_per_group)
    check_keep_gathered_kv(keep_gathered_kv)
    keep = bool(keep_gathered_kv)
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    kernel = resolve_backend(backend, q.device, dtype=q.dtype, head_dim=q.shape[-1])
    meta.verify(group)
    if meta.doc_tokens == meta.tokens:
        return AllGatherAttn.apply(
            q,
            k,
            v,
            meta,
            group,
            scale,
            kernel,
            counter,
            timer,
            heads_per_group,
            grad_comm_dtype,
            keep,
        )
    # pad rows (the last ones) take no part: output 0, gradient 0 through the slicing
    r = meta.doc_tokens
    out = AllGatherAttn.apply(
        q[:r],
        k[:r],
        v[:r],
        meta.without_pad(),
        group,
        scale,
        kernel,
        counter,
        timer,
        heads_per_group,
        grad_comm_dtype,
        keep,
    )
    return torch.nn.functional.pad(out, (0, 0, 0, 0, 0, meta.tokens - r))
