"""Ulysses attention (DeepSpeed-Ulysses, Jacobs et al., 2023): head-parallel CP over all-to-alls.

Layout: the ``ulysses`` plan (:mod:`baselines.ulysses`): N contiguous chunks of T = C/N tokens,
chunk r on rank r. With u = N ranks in the group and r the KV replication of
:func:`flashcp.plan.head_parallel.ulysses_heads`:

Forward: one all-to-all moves q, k, v together (per destination rank j: query heads
``j H/u .. (j+1) H/u`` and KV heads ``j h_kv .. (j+1) h_kv`` of the KV heads replicated r times,
h_kv = r Hkv / u), so every rank holds the whole packed sequence (C rows, in packed order because
chunk j comes from rank j) for its heads; one varlen kernel call attends over every document with
the document mask (``cu_seqlens`` of the non-empty documents; pad rows, the last ones, take no
part and get output 0); one all-to-all brings the output back to (T, H, D).

Backward: dO travels like q; the kernel backward runs on the saved head-parallel q, k, v, out and
LSE (nothing is re-communicated); dQ travels back in the model dtype, and dK / dV with it: whole
gradients when r = 1, while the r replicas of a KV head are partial sums, which travel in
``grad_comm_dtype`` (:func:`~flashcp.ops.collectives.resolve_grad_comm_dtype`) and are added on
the owning rank. Bytes per rank equal :func:`flashcp.comm.comm_volume` for ``alltoall``
(:func:`flashcp.comm.alltoall_bytes` per tensor).

Memory per rank beyond q, k, v (e = element size, a = ``compute_dtype``): the head-parallel q, k,
v, out and LSE kept for the backward, C (H + 2 h_kv) D / u e + C H/u a, the size of the local
tensors (times r for the KV when heads are replicated), plus the all-to-all staging buffers of the
same size. No term grows with N.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from flashcp.ops.backends import VarlenBackend, compute_dtype, get_backend, resolve_softmax_scale
from flashcp.ops.collectives import (
    all_to_all_single,
    check_qkv,
    check_same_plan,
    resolve_grad_comm_dtype,
    resolve_group,
)
from flashcp.ops.timing import as_timer
from flashcp.plan import Plan, cu_seqlens
from flashcp.plan.head_parallel import UlyssesHeads, ulysses_heads

__all__ = [
    "UlyssesAttnFunction",
    "UlyssesMeta",
    "fold_kv_grads",
    "gather_heads",
    "prepare_ulysses",
    "scatter_heads",
    "ulysses_attn",
    "ulysses_backward",
    "ulysses_forward",
]


@dataclass(eq=False)
class UlyssesMeta:
    """Per-batch metadata of one rank (build with :func:`prepare_ulysses`; reuse it per layer).

    Attributes:
        method: the plan's method (``ulysses``).
        plan: the plan (its digest is checked across ranks before the first collective).
        rank: this rank; cp_size: N (= the Ulysses degree u).
        tokens: T = C / N local rows, pad included.
        doc_rows: R, document rows of the packed sequence (its first rows; the rest are pad).
        cu_seqlens: (n_docs + 1,) int32 over the R rows, one segment per non-empty document.
        max_seqlen: the longest document.
    """

    method: str
    plan: Plan
    rank: int
    cp_size: int
    tokens: int
    doc_rows: int
    cu_seqlens: torch.Tensor
    max_seqlen: int
    _on_device: dict = field(default_factory=dict, repr=False)
    _verified: set = field(default_factory=set, repr=False)

    def cu_on(self, device) -> torch.Tensor:
        """``cu_seqlens`` on ``device`` (cached)."""
        key = str(torch.device(device))
        if key not in self._on_device:
            self._on_device[key] = self.cu_seqlens.to(device)
        return self._on_device[key]

    def verify(self, group) -> None:
        """Check once per process group that every rank holds the same plan."""
        if id(group) not in self._verified:
            check_same_plan(self.plan, group)
            self._verified.add(id(group))


def prepare_ulysses(plan: Plan, rank: int, *, method: str = "ulysses") -> UlyssesMeta:
    """Metadata of ``rank`` for :func:`ulysses_attn` (pure: no process group).

    Args:
        plan: a plan of ``method``; rank: 0 <= rank < cp_size.
        method: the method whose plans this runs (the Ulysses op family,
            :mod:`flashcp.ops.families`).
    Raises:
        ValueError: ``plan`` is not a plan of ``method`` (or not a :class:`~flashcp.plan.Plan`),
            ``rank`` is out of range.
    """
    if not isinstance(plan, Plan):
        raise ValueError(f"prepare_{method} needs a Plan, got {type(plan).__name__}")
    if plan.method != method:
        raise ValueError(f"prepare_{method} needs a {method!r} plan, got one for {plan.method!r}")
    n = plan.cp_size
    if isinstance(rank, bool) or not isinstance(rank, int | np.integer) or not 0 <= rank < n:
        raise ValueError(f"rank must be an integer in [0, {n}), got {rank!r}")
    lens = plan.doc_lens[plan.doc_lens > 0]
    return UlyssesMeta(
        method=method,
        plan=plan,
        rank=int(rank),
        cp_size=n,
        tokens=plan.context_len // n,
        doc_rows=int(lens.sum()),
        cu_seqlens=cu_seqlens(lens, device="cpu"),
        max_seqlen=int(lens.max()) if lens.size else 0,
    )


# ---- the all-to-alls ------------------------------------------------------------------------------


def scatter_heads(parts, degree: int, group, counter, timer) -> list[torch.Tensor]:
    """Tokens to heads: one all-to-all of every tensor of ``parts`` (same rows, dtype, head_dim).

    Args:
        parts: tensors (T, h_i, D), each h_i divisible by ``degree`` = u (the group's size); part j
            of each tensor's heads goes to rank j.
    Returns:
        tensors (u T, h_i / u, D): this rank's heads of every rank's rows, rank 0's rows first.
    """
    t, d = parts[0].shape[0], parts[0].shape[2]
    widths = [x.shape[1] // degree for x in parts]
    with timer.phase("others"):
        # (u, T, sum h_i / u, D): destination rank first, its heads of every tensor side by side
        send = torch.cat(
            [x.reshape(t, degree, w, d) for x, w in zip(parts, widths, strict=True)], 2
        )
        send = send.transpose(0, 1).contiguous()
        recv = torch.empty_like(send)
    with timer.phase("alltoall"):
        all_to_all_single(recv, send, group, counter)
    with timer.phase("others"):
        return [x.contiguous() for x in recv.reshape(degree * t, sum(widths), d).split(widths, 1)]


def gather_heads(x: torch.Tensor, degree: int, group, counter, timer) -> torch.Tensor:
    """Heads to tokens, the inverse of :func:`scatter_heads` for one tensor.

    Args:
        x: (u T, h, D), this rank's h heads of every rank's rows.
    Returns:
        (T, u h, D): every head of this rank's rows.
    """
    ut, h, d = x.shape
    t = ut // degree
    with timer.phase("others"):
        send = x.reshape(degree, t, h, d).contiguous()
        recv = torch.empty_like(send)
    with timer.phase("alltoall"):
        all_to_all_single(recv, send, group, counter)
    with timer.phase("others"):
        return recv.transpose(0, 1).reshape(t, degree * h, d)


# ---- forward and backward -------------------------------------------------------------------------


def ulysses_forward(q, k, v, meta: UlyssesMeta, heads: UlyssesHeads, group, backend, scale, counter,
                    timer):  # fmt: skip
    """Ulysses forward (algorithm in the module docstring).

    Args:
        q: (T, H, D); k, v: (T, Hkv, D); checked by :func:`ulysses_attn`.
        heads: :func:`~flashcp.plan.head_parallel.ulysses_heads` of the shapes and the group size.
        backend: varlen kernel backend; scale: softmax scale; counter, timer: as the op's.
    Returns:
        out: (T, H, D) in q.dtype; saved: ``(q_h, k_h, v_h, out_h, lse_h)``, the head-parallel
        tensors of the document rows the backward needs: (R, H/u, D), (R, h_kv, D) twice,
        (R, H/u, D) and (H/u, R) in ``compute_dtype(q.dtype)``.
    """
    u, r, rows = heads.degree, heads.kv_replication, meta.doc_rows
    with timer.phase("others"):
        if r > 1:
            k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    q_h, k_h, v_h = (x[:rows] for x in scatter_heads([q, k, v], u, group, counter, timer))
    if rows:
        with timer.phase("attn_fwd"):
            out_h, lse_h = backend.forward(
                q_h, k_h, v_h, meta.cu_on(q.device), meta.cu_on(q.device), meta.max_seqlen,
                meta.max_seqlen, causal=True, softmax_scale=scale,
            )  # fmt: skip
    else:
        out_h = q_h.new_zeros(q_h.shape)
        lse_h = q_h.new_empty((q_h.shape[1], 0), dtype=compute_dtype(q.dtype))
    with timer.phase("others"):
        full = torch.nn.functional.pad(out_h, (0, 0, 0, 0, 0, u * meta.tokens - rows))
    out = gather_heads(full, u, group, counter, timer)
    return out, (q_h, k_h, v_h, out_h, lse_h)


def ulysses_backward(dout, saved, meta: UlyssesMeta, heads: UlyssesHeads, group, backend, scale,
                     counter, timer, grad_comm_dtype=None):  # fmt: skip
    """Ulysses backward (algorithm in the module docstring).

    Args:
        dout: (T, H, D); saved: the forward's head-parallel tensors (:func:`ulysses_forward`).
        grad_comm_dtype: dtype of replicated KV heads' gradients on the way back (default
            ``compute_dtype``); unused when KV heads are not replicated.
    Returns:
        dq: (T, H, D) in q's dtype; dk, dv: (T, Hkv, D) in k's dtype.
    """
    q_h, k_h, v_h, out_h, lse_h = saved
    u, r, rows, t = heads.degree, heads.kv_replication, meta.doc_rows, meta.tokens
    acc = compute_dtype(q_h.dtype)
    (do_h,) = scatter_heads([dout], u, group, counter, timer)
    if rows:
        with timer.phase("attn_bwd"):
            cu = meta.cu_on(q_h.device)
            dq_h, dk_h, dv_h = backend.backward(
                do_h[:rows], q_h, k_h, v_h, out_h, lse_h, cu, cu, meta.max_seqlen,
                meta.max_seqlen, causal=True, softmax_scale=scale, grad_dtype=acc,
            )  # fmt: skip
    else:
        dq_h, dk_h, dv_h = (x.new_zeros(x.shape, dtype=acc) for x in (q_h, k_h, v_h))
    kv_dtype = resolve_grad_comm_dtype(grad_comm_dtype, k_h.dtype) if r > 1 else k_h.dtype
    with timer.phase("others"):
        pad = (0, 0, 0, 0, 0, u * t - rows)
        dq_h = torch.nn.functional.pad(dq_h.to(q_h.dtype), pad)
        dkv_h = torch.nn.functional.pad(torch.cat([dk_h, dv_h], 1).to(kv_dtype), pad)
    dq = gather_heads(dq_h, u, group, counter, timer)
    dkv = gather_heads(dkv_h, u, group, counter, timer)  # (T, 2 u h_kv, D): dk heads, dv heads
    with timer.phase("others"):
        dk, dv = fold_kv_grads(dkv, heads, acc, k_h.dtype)
    return dq, dk, dv


def fold_kv_grads(
    dkv: torch.Tensor, heads: UlyssesHeads, acc: torch.dtype, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered K and V gradients of a Ulysses group back to the KV heads' layout.

    Args:
        dkv: (T, 2 u h_kv, D), the u ranks' blocks of (h_kv dk heads, h_kv dv heads) as
            :func:`gather_heads` returns them (h_kv = ``heads.kv_heads_per_rank``).
        heads: the head split; with ``kv_replication`` r > 1 the r replicas of a KV head are
            adjacent and summed in ``acc``, rounded once to ``dtype``.
        acc: the accumulation dtype of that sum; dtype: of the returned gradients.
    Returns:
        dk, dv: (T, Hkv, D) each, in ``dtype``.
    """
    t, hd, u, r = dkv.shape[0], dkv.shape[2], heads.degree, heads.kv_replication
    dkv = dkv.reshape(t, u, 2, heads.kv_heads_per_rank, hd).transpose(1, 2)
    dkv = dkv.reshape(t, 2, r * heads.num_kv_heads, hd)
    if r > 1:
        dkv = dkv.to(acc).reshape(t, 2, heads.num_kv_heads, r, hd).sum(3)
    dk, dv = dkv.to(dtype).unbind(1)
    return dk, dv


class UlyssesAttnFunction(torch.autograd.Function):
    """Autograd glue: saves the forward's head-parallel tensors and the call's context, and
    delegates to :func:`ulysses_forward` / :func:`ulysses_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, meta, heads, group, backend, scale, counter, timer, grad_comm_dtype):
        out, saved = ulysses_forward(q, k, v, meta, heads, group, backend, scale, counter, timer)
        ctx.save_for_backward(*saved)
        ctx.args = (meta, heads, group, backend, scale, counter, timer, grad_comm_dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = ulysses_backward(dout.contiguous(), ctx.saved_tensors, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None, None


# ---- checks and the public entry point ------------------------------------------------------------


def _check_inputs(q, k, v, meta, method, group, grad_comm_dtype) -> UlyssesHeads:
    """Raise ValueError on inconsistent inputs, before any communication; the head split."""
    if not isinstance(meta, UlyssesMeta) or meta.method != method:
        raise ValueError(
            f"{method}_attn needs the metadata of prepare_{method}(plan, rank), got "
            f"{type(meta).__name__}"
        )
    check_qkv(q, k, v, tokens=meta.tokens, rank=meta.rank, cp_size=meta.cp_size, group=group)
    heads = ulysses_heads(q.shape[1], k.shape[1], meta.cp_size)
    resolve_grad_comm_dtype(grad_comm_dtype, k.dtype)  # raises on a bad value
    return heads


def ulysses_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: UlyssesMeta,
    group=None,
    *,
    softmax_scale: float | None = None,
    backend="auto",
    counter=None,
    timer=None,
    grad_comm_dtype: torch.dtype | str | None = None,
    method: str = "ulysses",
) -> torch.Tensor:
    """Ulysses context-parallel attention of this rank's tokens (document-masked, causal).

    Args:
        q: (C/N, num_heads, head_dim); k, v: (C/N, num_kv_heads, head_dim): rank r's contiguous
            chunk of the packed sequence. Any float dtype; float64 end to end with
            ``backend="reference"``.
        meta: from :func:`prepare_ulysses`; group: the N CP ranks (None: the default group; a
            process group or 1-D ``DeviceMesh``: :func:`~flashcp.ops.collectives.resolve_group`).
        softmax_scale: default ``1 / sqrt(head_dim)``; backend: kernel backend name or object;
        counter: ``CommCounter`` (received ``alltoall`` bytes); timer: ``PhaseTimer`` (phases
            ``alltoall``, ``attn_fwd``, ``attn_bwd``, ``others``).
        grad_comm_dtype: dtype of the gradients of replicated KV heads (num_kv_heads < N) on the
            way back, which are partial sums (default float32, float64 for float64 inputs).
        method: the method ``meta`` was prepared for (:func:`prepare_ulysses`).
    Returns:
        out: (C/N, num_heads, head_dim) in q.dtype, differentiable w.r.t. q, k and v; pad rows 0.
    Raises:
        ValueError: bad inputs or metadata, heads that N does not divide (naming the valid
            degrees), a bad ``softmax_scale`` (all before any communication), or ranks holding
            different plans.
    """
    group = resolve_group(group)
    heads = _check_inputs(q, k, v, meta, method, group, grad_comm_dtype)
    scale = resolve_softmax_scale(softmax_scale, q.shape[2])
    be = (
        backend
        if isinstance(backend, VarlenBackend)
        else get_backend(backend, q.device, dtype=q.dtype, head_dim=q.shape[2])
    )
    if meta.cp_size > 1:
        meta.verify(group)
    return UlyssesAttnFunction.apply(
        q, k, v, meta, heads, group, be, scale, counter, as_timer(timer), grad_comm_dtype
    )
