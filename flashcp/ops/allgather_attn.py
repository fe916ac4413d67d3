"""Shared machinery of the all-gather CP family (``llama3``, ``per_doc``, ``flashcp``).

Every rank contributes a *send buffer* of its local KV rows, padded to the largest rank's, and
all-gathers the buffers; each local shard ``(doc, start, length)`` is then one causal varlen
segment with ``sq = length`` queries (its local rows) and ``sk = start + length`` keys (the prefix of
its document, then itself), aligned bottom-right. One varlen kernel call computes all segments of a
rank.

* ``llama3`` / ``per_doc`` send every local row (full all-gather; Eq. 4 of the FlashCP paper).
* ``flashcp`` sends only the rows of *non-last* shards: a shard's KV is needed by another rank only
  if a later shard of its document exists (Eq. 5). Documents kept whole are never communicated.

Keys are assembled with one index gather from ``source = [local KV (T rows); gathered buffers
(N * M rows)]``; a rank reads its own rows from the local part. Backward re-gathers the KV (nothing
is kept between passes), runs the kernel backward, scatter-adds dK/dV into a buffer shaped like
``source``, reduce-scatters the gathered part (so each owner receives the dK/dV of the rows it
sent) and adds it to the local part. Communicated volumes equal :func:`flashcp.comm.comm_volume`:
forward all-gather, backward all-gather again plus a reduce-scatter of the same size.

K and V travel together as one ``(rows, 2, Hkv, D)`` buffer in the model dtype; only KV heads move.

Pad tokens (``plan.pad``, the last rows of a rank's tensors) take no part: the op runs on each
rank's document rows only (metadata :meth:`AllGatherMeta.without_pad`), their KV is never sent,
and pad rows get output 0 and gradient 0. A rank holding no document token still joins every
collective, so all ranks issue the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from flashcp.ops.backends import VarlenBackend, get_backend
from flashcp.ops.collectives import (
    CommCounter,
    all_gather_into_tensor,
    check_same_plan,
    group_rank,
    group_size,
    reduce_scatter_tensor,
)
from flashcp.ops.timing import as_timer
from flashcp.plan import Plan

__all__ = [
    "AllGatherAttn",
    "AllGatherMeta",
    "allgather_attention",
    "allgather_attn_backward",
    "allgather_attn_forward",
    "build_allgather_meta",
    "check_inputs",
    "resolve_backend",
    "resolve_scale",
]


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

    # token-level view of the document tokens: shards are sorted by rank then local order, so the
    # concatenation of every shard holds rank r's document rows at real_off[r] .. real_off[r + 1]
    real = plan.doc_tokens_per_rank  # (N,)
    real_off = np.cumsum(real) - real
    n_tok = int(real.sum())
    length = plan.length
    shard_of = np.repeat(np.arange(plan.num_shards), length)  # (R,)
    seg_off = np.cumsum(length) - length
    within = np.arange(n_tok, dtype=np.int64) - seg_off[shard_of]
    doc_off = np.cumsum(plan.doc_lens) - plan.doc_lens
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
    k_off = np.cumsum(klen) - klen
    k_within = np.arange(int(klen.sum()), dtype=np.int64) - np.repeat(k_off, klen)
    key_tok = where[np.repeat(doc_off[doc], klen) + k_within]  # concatenation index of each key
    own = owner[key_tok] == rank
    if (~own & (slot[key_tok] < 0)).any():
        raise ValueError("plan inconsistency: a needed key is held by another rank but not sent")
    r_tok = int(real[rank])
    kv_index = np.where(own, local_row[key_tok], r_tok + owner[key_tok] * send_max + slot[key_tok])

    mine = slice(int(real_off[rank]), int(real_off[rank]) + r_tok)
    send_rows = np.flatnonzero(sends[mine])
    cu_q = np.concatenate([[0], np.cumsum(ln)])
    cu_k = np.concatenate([[0], np.cumsum(klen)])
    return AllGatherMeta(
        method=method,
        plan=plan,
        rank=rank,
        cp_size=n,
        tokens=t,
        doc_tokens=r_tok,
        send_max=send_max,
        send_rows=torch.from_numpy(send_rows.astype(np.int64)),
        kv_index=torch.from_numpy(kv_index.astype(np.int64)),
        cu_seqlens_q=torch.from_numpy(cu_q.astype(np.int32)),
        cu_seqlens_k=torch.from_numpy(cu_k.astype(np.int32)),
        max_seqlen_q=int(ln.max()) if ln.size else 0,
        max_seqlen_k=int(klen.max()) if klen.size else 0,
    )


def resolve_scale(softmax_scale, head_dim: int) -> float:
    """``softmax_scale`` or ``1 / sqrt(head_dim)``; raises ValueError unless finite and > 0."""
    scale = head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
    if not np.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale!r}")
    return scale


def resolve_backend(backend, device) -> VarlenBackend:
    """A :class:`VarlenBackend` from a name (see :func:`get_backend`) or an instance."""
    return backend if isinstance(backend, VarlenBackend) else get_backend(backend, device)


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
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(
                f"{name} must be a (tokens, heads, head_dim) tensor, got {getattr(x, 'shape', type(x))}"
            )
        if not x.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
        if x.shape[0] != meta.tokens:
            raise ValueError(
                f"{name} has {x.shape[0]} tokens but the plan gives rank {meta.rank} {meta.tokens}"
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head_dim of q ({q.shape[2]}) and k ({k.shape[2]}) differ")
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"num_heads = {q.shape[1]} is not a multiple of num_kv_heads = {k.shape[1]}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    n, r = group_size(group), group_rank(group)
    if n != meta.cp_size or r != meta.rank:
        raise ValueError(
            f"metadata is for rank {meta.rank} of {meta.cp_size} but this process is rank {r} of a "
            f"group of {n}"
        )


def _gather_kv(kv_local, meta, send_rows, group, counter, timer):
    """``source = [kv_local; all-gathered send buffers]``: (T + N*M, 2, Hkv, D)."""
    n, m = meta.cp_size, meta.send_max
    with timer.phase("others"):
        source = kv_local.new_empty((meta.tokens + n * m, *kv_local.shape[1:]))
        source[: meta.tokens] = kv_local
        send = kv_local.new_zeros((m, *kv_local.shape[1:]))
        send[: send_rows.numel()] = kv_local.index_select(0, send_rows)
    if m:
        with timer.phase("allgather"):
            all_gather_into_tensor(source[meta.tokens :], send, group, counter)
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
):
    """Forward of the all-gather family.

    Args:
        q: (T, H, D); k, v: (T, Hkv, D); validated by :func:`check_inputs`.
    Returns:
        out: (T, H, D) in q.dtype; lse: (H, T) float32.
    """
    timer = as_timer(timer)
    send_rows, kv_index, cu_q, cu_k = meta.tensors(q.device)
    source = _gather_kv(torch.stack((k, v), dim=1), meta, send_rows, group, counter, timer)
    with timer.phase("others"):
        k_seg, v_seg = source.index_select(0, kv_index).unbind(1)  # (Tk, Hkv, D) each
    with timer.phase("attn_fwd"):
        out, lse = backend.forward(
            q,
            k_seg,
            v_seg,
            cu_q,
            cu_k,
            meta.max_seqlen_q,
            meta.max_seqlen_k,
            causal=True,
            softmax_scale=scale,
        )
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
):
    """Backward of the all-gather family: re-gather KV, kernel backward, reduce-scatter dK/dV.

    Args:
        dout, out: (T, H, D); q: (T, H, D); k, v: (T, Hkv, D); lse: (H, T) float32.
    Returns:
        dq: (T, H, D); dk, dv: (T, Hkv, D); in the input dtypes.
    """
    timer = as_timer(timer)
    send_rows, kv_index, cu_q, cu_k = meta.tensors(q.device)
    source = _gather_kv(torch.stack((k, v), dim=1), meta, send_rows, group, counter, timer)
    with timer.phase("others"):
        k_seg, v_seg = source.index_select(0, kv_index).unbind(1)
    with timer.phase("attn_bwd"):
        dq, dk_seg, dv_seg = backend.backward(
            dout,
            q,
            k_seg,
            v_seg,
            out,
            lse,
            cu_q,
            cu_k,
            meta.max_seqlen_q,
            meta.max_seqlen_k,
            causal=True,
            softmax_scale=scale,
            grad_dtype=torch.float32,
        )
    with timer.phase("others"):
        # accumulate in float32; (T + N*M, 2, Hkv, D)
        dsource = torch.zeros(source.shape, dtype=torch.float32, device=q.device)
        dsource.index_add_(0, kv_index, torch.stack((dk_seg, dv_seg), dim=1))
        dlocal = dsource[: meta.tokens]
    if meta.send_max:
        with timer.phase("others"):
            rs_in = dsource[meta.tokens :].to(k.dtype)
            rs_out = rs_in.new_empty((meta.send_max, *rs_in.shape[1:]))
        with timer.phase("reducescatter"):
            reduce_scatter_tensor(rs_out, rs_in, group, counter)
        with timer.phase("others"):
            dlocal.index_add_(0, send_rows, rs_out[: send_rows.numel()].float())
    dk, dv = dlocal.to(k.dtype).unbind(1)
    return dq.to(q.dtype), dk, dv


class AllGatherAttn(torch.autograd.Function):
    """Autograd glue of the all-gather family: saves (q, k, v, out, lse) and the call's context,
    delegates both passes to :func:`allgather_attn_forward` / :func:`allgather_attn_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, meta, group, scale, backend, counter, timer):
        out, lse = allgather_attn_forward(q, k, v, meta, group, scale, backend, counter, timer)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = (meta, group, scale, backend, counter, timer)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = allgather_attn_backward(dout.contiguous(), q, k, v, out, lse, *ctx.call)
        return dq, dk, dv, None, None, None, None, None, None


def allgather_attention(
    q, k, v, meta: AllGatherMeta, group=None, *, method: str, softmax_scale=None,
    backend="auto", counter=None, timer=None,
):  # fmt: skip
    """CP attention of the all-gather family for this rank's tokens (document-masked causal).

    The public ops (``llama3_attn``, ``per_doc_attn``, ``flashcp_attn``) are thin wrappers that
    name their ``method``.

    Args:
        q: (T_local, num_heads, head_dim); k, v: (T_local, num_kv_heads, head_dim), laid out as the
            plan gives this rank (see :func:`flashcp.ops.sharding.shard_tensor`).
        meta: from the method's ``prepare_<method>(plan, rank)``; reuse it for every layer.
        group: process group of the CP ranks (default: the world); size ``cp_size``.
        method: the method whose metadata ``meta`` must be.
        softmax_scale: default ``head_dim ** -0.5``.
        backend: kernel backend name or instance (:func:`flashcp.ops.backends.get_backend`).
        counter: :class:`~flashcp.ops.collectives.CommCounter` receiving the bytes moved.
        timer: :class:`~flashcp.ops.timing.PhaseTimer` receiving per-phase times.
    Returns:
        out: (T_local, num_heads, head_dim), differentiable w.r.t. q, k, v.
    Raises:
        ValueError: bad metadata, shapes, dtypes or group (before any communication), or ranks
            holding different plans (checked once per group before the first collective).
    """
    check_inputs(q, k, v, meta, AllGatherMeta, method, group)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    kernel = resolve_backend(backend, q.device)
    meta.verify(group)
    if meta.doc_tokens == meta.tokens:
        return AllGatherAttn.apply(q, k, v, meta, group, scale, kernel, counter, timer)
    # pad rows (the last ones) take no part: output 0, gradient 0 through the slicing
    r = meta.doc_tokens
    out = AllGatherAttn.apply(
        q[:r], k[:r], v[:r], meta.without_pad(), group, scale, kernel, counter, timer
    )
    return torch.nn.functional.pad(out, (0, 0, 0, 0, 0, meta.tokens - r))
