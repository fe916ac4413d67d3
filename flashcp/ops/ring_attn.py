"""Ring attention runtime over document-masked varlen blocks: the ring op family (``ring``,
``zigzag`` and any method whose spec names it; :mod:`flashcp.ops.families`).

Algorithm (Ring Attention, Liu et al. 2023; the varlen/zigzag scheduling of the ``ring-flash-attn``
package, re-derived here for arbitrary shard layouts). Which kernel calls each ring step makes
(step ``s`` holds the KV block of rank ``(r - s) mod N``; causal, full or skipped per shard pair)
is the metadata of :mod:`flashcp.ops.ring_meta`, built once per batch by
:func:`~flashcp.ops.ring_meta.prepare_ring_meta` (pure, no process group). This module walks those
calls: the point-to-point steps, the LSE merges and the autograd Function. Pad rows beyond
``RingMeta.block_tokens`` are never sent, and no kernel call touches a pad row, so pad outputs and
gradients are 0.

Memory per rank, beyond q, k, v (T = C/N rows, e = element size, a = ``compute_dtype`` element
size, c = ``grad_comm_dtype`` element size): the forward holds the KV block it computes on and the
one it receives, 2 x 2 T Hkv D e, and the merge accumulators T H D a + H T a (with each call's
query / key slices and kernel outputs); the backward holds the same two KV blocks, dq
(T H D a), this rank's partial dK/dV of the held block and of its own block (2 x 2 T Hkv D a), the
partial sum it sends and the one it receives (2 x 2 T Hkv D c). None of it grows with N;
``experiments/benchmarks/bench_memory.py`` measures it.

Forward: ``N - 1`` ring exchanges of the KV block (posted before the step's compute, waited after);
partial outputs merge by their LSE in ``compute_dtype`` of the inputs (float32, or float64 for
float64 inputs; :mod:`flashcp.ops.lse`).

Backward: the KV blocks travel around the ring again (``N - 1`` exchanges), dQ accumulates locally
in ``compute_dtype``, and the dK/dV partial sums of each block travel *with* the ring, one hop
behind the KV: rank ``src + 1`` starts the partial sum of block ``src`` (step 1), each following
rank adds its contribution and passes it on, and rank ``src - 1`` (step N-1) sends the sum home,
where the owner adds its own step-0 contribution, kept locally. That is ``N - 1`` dK/dV hops, so a
training step receives ``2 (N - 1)`` KV blocks of ``C/N`` tokens per rank plus ``N - 1`` dK/dV
blocks, exactly :func:`flashcp.comm.comm_volume` for ``p2p_ring``. The partial sums travel in
float32 by default (float64 for float64 inputs:
:func:`~flashcp.ops.collectives.resolve_grad_comm_dtype`), as :func:`~flashcp.comm.comm_volume`
counts and as the ``ring-flash-attn`` package does (it takes one hop more): summing in bfloat16
would round the growing sum at each hop, which at CP 8 puts dK/dV errors at up to ~3x a
single-device bfloat16 computation instead of within 2x. ``grad_comm_dtype=torch.bfloat16``
halves those bytes at that cost. Each block's gradients come from the backend backward fed with
the *global* merged ``out`` and ``lse`` (FlashAttention-2 backward, Dao 2023), which makes the
per-block contributions add up to the exact gradient.
"""

from __future__ import annotations

import torch

from flashcp.ops.backends import VarlenBackend, compute_dtype, get_backend, resolve_softmax_scale
from flashcp.ops.collectives import check_qkv, resolve_grad_comm_dtype, resolve_group
from flashcp.ops.lse import merge_lse_rows_, new_accumulator
from flashcp.ops.ring_comm import RingComm
from flashcp.ops.ring_meta import BlockCall, RingMeta, Rows, prepare_ring_meta
from flashcp.ops.timing import as_timer

__all__ = [
    "BlockCall",
    "RingAttnFunction",
    "RingMeta",
    "prepare_ring_meta",
    "ring_attention",
    "ring_backward",
    "ring_forward",
]

# ---- forward and backward -------------------------------------------------------------------------


def _take(x: torch.Tensor, rows: Rows, dim: int = 0) -> torch.Tensor:
    if isinstance(rows, slice):
        return x[rows] if dim == 0 else x[:, rows].contiguous()
    return x.index_select(dim, rows)


def _add_rows(acc: torch.Tensor, rows: Rows, val: torch.Tensor) -> None:
    if isinstance(rows, slice):
        acc[rows] += val
    else:
        acc.index_add_(0, rows, val)


def ring_forward(
    q, k, v, meta: RingMeta, comm: RingComm | None, backend: VarlenBackend, scale: float, timer
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention forward (algorithm in the module docstring).

    Args:
        q: (T_local, H, D); k, v: (T_local, Hkv, D); checked by :func:`ring_attention`.
        meta: this rank's metadata, on q's device.
        comm: the ring (None when ``cp_size == 1``).
        backend: varlen kernel backend; scale: softmax scale; timer: phase timer.
    Returns:
        out: (T_local, H, D) in q.dtype; lse: (H, T_local) in ``compute_dtype(q.dtype)``.
    """
    t, h, d = q.shape
    out, lse = new_accumulator(t, h, d, q.device, dtype=q.dtype)
    kv = torch.stack([k, v])  # (2, T_local, Hkv, D): one message per step
    n = meta.cp_size
    for s in range(n):
        pending = comm.post([kv]) if s + 1 < n else None
        for call in meta.steps[s]:
            with timer.phase("attn_fwd"):
                o, lse_c = backend.forward(
                    _take(q, call.q_rows),
                    _take(kv[0], call.k_rows),
                    _take(kv[1], call.k_rows),
                    call.cu_seqlens_q,
                    call.cu_seqlens_k,
                    call.max_seqlen_q,
                    call.max_seqlen_k,
                    causal=call.causal,
                    softmax_scale=scale,
                )
            with timer.phase("others"):
                merge_lse_rows_(out, lse, call.q_rows, o, lse_c)
        if pending is not None:
            with timer.phase("p2p"):
                (kv,) = comm.wait(pending)
    return out.to(q.dtype), lse


def ring_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    meta: RingMeta,
    comm: RingComm | None,
    backend,
    scale: float,
    timer,
    grad_comm_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ring attention backward (algorithm in the module docstring).

    Args:
        dout, out: (T_local, H, D); q: (T_local, H, D); k, v: (T_local, Hkv, D);
        lse: (H, T_local) in ``compute_dtype(q.dtype)``, the merged forward LSE. Others as in
        :func:`ring_forward`.
        grad_comm_dtype: dtype of the dK/dV partial sums sent around the ring
            (:func:`~flashcp.ops.collectives.resolve_grad_comm_dtype`; default
            ``compute_dtype(k.dtype)``).
    Returns:
        dq: (T_local, H, D) in q.dtype; dk, dv: (T_local, Hkv, D) in k.dtype.
    """
    n = meta.cp_size
    acc = compute_dtype(q.dtype)  # partial sums: round once, at the end
    gdt = resolve_grad_comm_dtype(grad_comm_dtype, k.dtype)
    dout = dout.contiguous()
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    own = None  # this rank's contribution to its own block's dK/dV (step 0), kept locally
    incoming = None  # posted exchange of a dK/dV partial sum
    for s in range(n):
        pending = comm.post([kv], tag=0) if s + 1 < n else None
        dkv = None  # (2, T_local, Hkv, D) in acc: this rank's share of the held block's dK/dV
        for call in meta.steps[s]:
            with timer.phase("attn_bwd"):
                dq_c, dk_c, dv_c = backend.backward(
                    _take(dout, call.q_rows),
                    _take(q, call.q_rows),
                    _take(kv[0], call.k_rows),
                    _take(kv[1], call.k_rows),
                    _take(out, call.q_rows),
                    _take(lse, call.q_rows, dim=1),
                    call.cu_seqlens_q,
                    call.cu_seqlens_k,
                    call.max_seqlen_q,
                    call.max_seqlen_k,
                    causal=call.causal,
                    softmax_scale=scale,
                    grad_dtype=acc,
                )
            with timer.phase("others"):
                if dkv is None:
                    dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
                _add_rows(dq, call.q_rows, dq_c)
                _add_rows(dkv[0], call.k_rows, dk_c)
                _add_rows(dkv[1], call.k_rows, dv_c)
        if s == 0:
            own = dkv
        else:
            with timer.phase("p2p"):
                partial = comm.wait(incoming)[0] if incoming is not None else None
            with timer.phase("others"):
                if partial is None:
                    send = dkv.to(gdt) if dkv is not None else torch.zeros_like(kv, dtype=gdt)
                elif dkv is not None:
                    send = (partial.to(acc) + dkv).to(gdt)
                else:
                    send = partial
            incoming = comm.post([send], tag=1)
        if pending is not None:
            with timer.phase("p2p"):
                (kv,) = comm.wait(pending)
    with timer.phase("p2p"):
        home = comm.wait(incoming)[0].to(acc) if incoming is not None else None
    with timer.phase("others"):
        if own is None:
            own = torch.zeros(kv.shape, dtype=acc, device=q.device)
        total = own if home is None else own + home
        dk, dv = total.to(k.dtype).unbind(0)
    return dq.to(q.dtype), dk, dv


class RingAttnFunction(torch.autograd.Function):
    """Autograd glue: saves what the backward needs and delegates to :func:`ring_forward` and
    :func:`ring_backward`. With pad (``meta.block_tokens`` < T rows) the ring runs on the first
    ``block_tokens`` rows (views); the output and the gradients get their pad rows back as 0."""

    @staticmethod
    def forward(ctx, q, k, v, meta, comm, backend, scale, timer, grad_comm_dtype):
        b = meta.block_tokens
        if b < q.shape[0]:
            q, k, v = q[:b], k[:b], v[:b]
        out, lse = ring_forward(q, k, v, meta, comm, backend, scale, timer)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (meta, comm, backend, scale, timer, grad_comm_dtype)
        return _pad_rows(out, meta.local_tokens)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        meta = ctx.args[0]
        dq, dk, dv = ring_backward(dout[: meta.block_tokens], q, k, v, out, lse, *ctx.args)
        t = meta.local_tokens
        return _pad_rows(dq, t), _pad_rows(dk, t), _pad_rows(dv, t), *(None,) * 6


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with zero rows appended up to ``rows`` (itself when it has them)."""
    if x.shape[0] == rows:
        return x
    return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, rows - x.shape[0]))


# ---- checks and the public entry point ------------------------------------------------------------


def _check_inputs(q, k, v, meta: RingMeta, method: str, group, grad_comm_dtype) -> None:
    """Raise ValueError on inconsistent inputs, before any communication."""
    if not isinstance(meta, RingMeta):
        raise ValueError(
            f"{method}_attn needs the metadata of prepare_{method}(plan, rank), got "
            f"{type(meta).__name__}"
        )
    if meta.method != method:
        raise ValueError(f"{method}_attn got metadata prepared for {meta.method!r}")
    check_qkv(q, k, v, tokens=meta.local_tokens, rank=meta.rank, cp_size=meta.cp_size,
              group=group)  # fmt: skip
    resolve_grad_comm_dtype(grad_comm_dtype, k.dtype)  # raises on a bad value


def ring_attention(
    q,
    k,
    v,
    meta: RingMeta,
    group=None,
    *,
    method: str,
    softmax_scale: float | None = None,
    backend="auto",
    counter=None,
    timer=None,
    grad_comm_dtype: torch.dtype | str | None = None,
) -> torch.Tensor:
    """Document-masked causal attention of this rank's tokens with ring P2P (``ring``/``zigzag``).

    Args:
        q: (T_local, num_heads, head_dim); k, v: (T_local, num_kv_heads, head_dim); laid out as
            the plan says (``flashcp.ops.sharding.shard_tensor``). Any float dtype.
        meta: from :func:`~flashcp.ops.ring_meta.prepare_ring_meta` for ``method``
            (``flashcp.ops.get_attn_op(method)`` binds both).
        group: process group of the N CP ranks (None: the default group; any subgroup of the
            job or a 1-D ``DeviceMesh``: :func:`~flashcp.ops.collectives.resolve_group`; the ring's
            peers are this group's neighbours, as global ranks).
        method: the plan's method, e.g. ``ring`` or ``zigzag`` (must match the metadata).
        softmax_scale: default ``1 / sqrt(head_dim)``
            (:func:`~flashcp.ops.backends.resolve_softmax_scale`).
        backend: a name for :func:`flashcp.ops.backends.get_backend` or a backend object.
        counter: optional ``CommCounter`` (adds received ``p2p`` bytes).
        timer: optional ``PhaseTimer`` (phases ``attn_fwd``, ``attn_bwd``, ``p2p``, ``others``).
        grad_comm_dtype: dtype of the dK/dV partial sums passed around the ring in the backward.
            Default (None): ``compute_dtype(k.dtype)`` (float32 for bf16/fp16/fp32, float64 for
            float64), which is what :func:`flashcp.comm.comm_volume` counts and keeps dK/dV
            within 2x of a single-device bfloat16 computation at CP 8. ``torch.bfloat16`` (or
            ``"bfloat16"``) halves those bytes but each of the N-1 hops then rounds the growing
            partial sum (up to ~3x the error at CP 8). Same option, default and validation as the
            all-gather ops (:func:`~flashcp.ops.collectives.resolve_grad_comm_dtype`).
    Returns:
        out: (T_local, num_heads, head_dim) in q.dtype, differentiable w.r.t. q, k, v.
    Raises:
        ValueError: inconsistent inputs or metadata, a ``softmax_scale`` that is not finite and
            > 0 (all before any communication), an unavailable backend, or ranks holding
            different plans (after one small all-gather of digests).
    """
    group = resolve_group(group)
    _check_inputs(q, k, v, meta, method, group, grad_comm_dtype)
    be = (
        get_backend(backend, q.device, dtype=q.dtype, head_dim=q.shape[2])
        if isinstance(backend, str)
        else backend
    )
    scale = resolve_softmax_scale(softmax_scale, q.shape[2])
    meta = meta.to(q.device)
    comm = None
    if meta.cp_size > 1:
        meta.check_plan_once(group)
        comm = RingComm(group, q.device, counter)
    # pad rows beyond meta.block_tokens take no part: output 0, gradient 0
    return RingAttnFunction.apply(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        meta,
        comm,
        be,
        scale,
        as_timer(timer),
        grad_comm_dtype,
    )
