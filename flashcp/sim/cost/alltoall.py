"""The head-parallel all-to-all family of the step model (``ulysses``) and the hybrids over
head groups (``usp``, ``flashcp_ulysses``): the per-plan step (:class:`AllToAllCost`) and the
phases shared with the batch (:func:`_alltoall_phases`); docs/simulator.md.
"""

from __future__ import annotations

import numpy as np

from flashcp.comm import AttnShape, grad_comm_bytes
from flashcp.results import PHASE_COLUMNS
from flashcp.sim.cost.units import _collective_us_v, _op_us, _stats
from flashcp.sim.hardware import HardwareProfile
from flashcp.sim.kernel import (
    TileStats,
    bwd_extra_us,
    bwd_tile_counts,
    fwd_tile_counts,
    kernel_us,
)
from flashcp.sim.network import FLAT, Links, alltoall_us, alltoall_us_v


class AllToAllCost:
    """The head-parallel all-to-all family's per-plan step (``ulysses``) and the hybrids
    (``usp``, ``flashcp_ulysses``), a part of :class:`~flashcp.sim.cost.base.PlanCost`."""

    # ---- head-parallel all-to-all (Ulysses) ---------------------------------------------------
    def _init_alltoall(self) -> None:
        """Ulysses (:mod:`flashcp.ops.ulysses_attn`): every rank runs one varlen call over every
        non-empty document, whole (q_len = kv_len = d, causal), for its H/N heads; the same call
        on every rank, so (N,) arrays of equal entries."""
        plan, hw, n = self.plan, self.hw, self.n
        d = plan.doc_lens[plan.doc_lens > 0]
        one = np.zeros(d.size, dtype=np.int64)
        causal = np.ones(d.size, dtype=bool)
        f = _stats(one, 1, *fwd_tile_counts(d, d, causal, hw.fwd_block_q, hw.fwd_block_k))
        b = _stats(one, 1, *bwd_tile_counts(d, d, causal, hw.bwd_block_q, hw.bwd_block_k))
        self.fwd = TileStats(*(np.repeat(x, n) for x in f))
        self.bwd = TileStats(*(np.repeat(x, n) for x in b))
        rows = float(d.sum())
        self.q_rows = self.kv_rows = np.full(n, rows)

    def _alltoall_heads(self, shape: AttnShape):
        from flashcp.plan.head_parallel import ulysses_heads

        heads = ulysses_heads(shape.num_heads, shape.num_kv_heads, self.n)
        local = AttnShape(
            heads.heads_per_rank, heads.kv_heads_per_rank, shape.head_dim, shape.dtype
        )
        return heads, local

    def _alltoall_kernels_us(self, shape: AttnShape, train: bool):
        """(N,) forward and backward kernel µs of the Ulysses call (H/N heads, whole documents)."""
        _, local = self._alltoall_heads(shape)
        d = shape.head_dim
        fwd = kernel_us(self.fwd, local.num_heads, d, self.hw, False)
        if not train:
            return fwd, np.zeros_like(fwd)
        bwd = kernel_us(self.bwd, local.num_heads, d, self.hw, True) + bwd_extra_us(
            self.q_rows, self.kv_rows, local, self.hw
        )
        return fwd, bwd

    def _hybrid_shape(self, shape: AttnShape) -> AttnShape:
        """The heads one rank of a head-parallel group attends with: H/u and r Hkv/u."""
        from flashcp.plan.head_parallel import ulysses_heads

        heads = ulysses_heads(shape.num_heads, shape.num_kv_heads, self.u)
        return AttnShape(heads.heads_per_rank, heads.kv_heads_per_rank, shape.head_dim, shape.dtype)

    def _step_hybrid(self, shape: AttnShape, mode: str) -> dict[str, float]:
        """A hybrid (``usp``, ``flashcp_ulysses``): the inner method's step on the group plan for
        H/u heads (its kernels, copies and cross-group communication), plus the all-to-alls of
        the u-rank groups around it (:meth:`_alltoall_phases` without kernels)."""
        out = self.inner.step(self._hybrid_shape(shape), mode)
        a2a = self._alltoall_phases(shape, mode == "train", self.u, 0.0, 0.0, kernels=False)
        return {c: out[c] + a2a[c] for c in PHASE_COLUMNS if c != "total_ms"}

    def _step_alltoall(
        self, shape: AttnShape, train: bool, vol: dict[str, int]
    ) -> dict[str, float]:
        """Ulysses on one rank (all ranks do the same work: the slowest is any of them):
        :meth:`_alltoall_phases` of the N-rank group around the kernels of
        :meth:`_alltoall_kernels_us`."""
        fwd_k, bwd_k = (float(x[0]) for x in self._alltoall_kernels_us(shape, train))
        return self._alltoall_phases(shape, train, self.n, fwd_k, bwd_k)

    def _alltoall_phases(
        self,
        shape: AttnShape,
        train: bool,
        degree: int,
        fwd_k: float,
        bwd_k: float,
        *,
        kernels: bool = True,
    ) -> dict[str, float]:
        """The all-to-alls of a head-parallel group of u = ``degree`` ranks around kernels of
        ``fwd_k`` / ``bwd_k`` µs (the same on every rank).

        Forward: KV heads replicated when num_kv_heads < u (two copies), q, k, v packed into one
        send buffer (a cat and its transposed copy), one all-to-all of T (H + 2 r Hkv) D
        elements, the received buffer split into q, k, v (three copies), the kernels, the output
        padded (one copy: Ulysses; a hybrid where a super-rank's rows fall short of u T), one
        all-to-all of T H D elements back and transposed into place (a copy when H/u > 1).
        Backward: dO packed (cat, transposed copy) and sent, the kernels, dQ cast (Ulysses:
        its kernel returns the compute dtype) and padded, dK/dV concatenated, cast to the send
        dtype where it differs and padded, two all-to-alls back (dQ, then dK/dV in their
        ``comm_volume`` dtype), the gathered dQ (H/u > 1) and dK/dV transposed into place, the
        fold's reshape (r Hkv/u > 1), the replicas summed and cast (r > 1). ``kernels``: the
        kernels run here (Ulysses; a hybrid's are its inner op's, priced there). An all-to-all of a rank's S-byte
        buffer receives (u-1)/u S bytes (:meth:`HardwareProfile.alltoall_us`). Copies move read +
        written bytes at ``copy_bw_gbps``; every op costs ``host_op_us`` on the host, every
        all-to-all ``collective_host_us``; T = C / N.
        """
        t = self.plan.context_len / self.plan.cp_size
        pad = 1 if kernels else self._hybrid_pad()
        out = _alltoall_phases(self.hw, shape, train, degree, t, fwd_k, bwd_k, kernels=kernels,
                               pad=pad, links=self.links)  # fmt: skip
        return {k: float(v) for k, v in out.items()}

    def _hybrid_pad(self) -> int:
        """1 when a hybrid's forward pads its output before gathering heads: the inner op's rows
        fall short of u T (the all-gather inner op runs on each super-rank's document rows, so
        some super-rank's; the ring on the block's, the most any super-rank holds)."""
        inner = self.inner
        if inner is None:
            return 0
        t = self.plan.context_len // self.plan.cp_size
        if inner.comm_kind == "p2p_ring":
            return int(inner.q_rows[0].max() < self.u * t)
        return int((inner.q_rows < self.u * t).any())


def _alltoall_phases(
    hw: HardwareProfile,
    shape: AttnShape,
    train: bool,
    degree: int,
    t,
    fwd_k,
    bwd_k,
    *,
    kernels: bool = True,
    pad=1,
    links: Links = FLAT,
) -> dict:
    """:meth:`PlanCost._alltoall_phases` with T = ``t`` rows per rank and kernel times ``fwd_k``,
    ``bwd_k`` µs: scalars, or (S,) arrays for S plans (phase times in ms, ``total_ms`` left
    out). ``kernels``: the kernels run in this stage (Ulysses; a hybrid's are its inner op's);
    ``pad``: 1 where the forward pads the output before gathering heads (scalar or (S,));
    ``links``: which peers are on other nodes (:func:`flashcp.sim.network.alltoall_us`)."""
    from flashcp.plan.head_parallel import ulysses_heads

    u = degree
    heads = ulysses_heads(shape.num_heads, shape.num_kv_heads, u)
    e, d = shape.dtype_bytes, shape.head_dim
    r = heads.kv_replication
    rep_kv = r > 1
    qkv = t * (shape.num_heads + 2 * r * shape.num_kv_heads) * d * e  # send buffer, bytes
    o = t * shape.num_heads * d * e
    frac = (u - 1) / u

    def a2a(nbytes):
        if u == 1:
            return 0.0
        if links.a2a_inter_peers:  # some peers on other nodes: the two-level network
            if np.ndim(nbytes) == 0:
                return alltoall_us(hw, links, frac * nbytes, nbytes)
            return alltoall_us_v(hw, links, frac * nbytes, nbytes)
        if np.ndim(nbytes) == 0:
            return hw.alltoall_us(frac * nbytes, nbytes)
        return _collective_us_v(hw, frac * nbytes, nbytes, hw.alltoall_busbw_gbps, "all_gather")

    colls = hw.collective_host_us if u > 1 else 0.0
    kern = 1 if kernels else 0
    # KV heads replicated (two copies), q, k, v packed (a cat and its transposed copy: two passes
    # over the buffer) and split back (one copy per tensor), the output padded (``pad``) and,
    # when a rank holds several heads, the gathered output transposed into place
    many_q = int(heads.heads_per_rank > 1)
    rep = _op_us(hw, 2, 2 * t * shape.num_kv_heads * d * e * (1 + r)) if rep_kv else 0.0
    copies_f = rep + _op_us(hw, 5, 6 * qkv) + _op_us(hw, pad + many_q, (pad + many_q) * 2 * o)
    ops_f = 2 * rep_kv + 5 + pad + many_q
    comm_f = a2a(qkv) + a2a(o)
    host_f = (ops_f + kern) * hw.host_op_us + 2 * colls
    dev_f = copies_f + comm_f + fwd_k
    out = {
        "allgather_ms": 0.0,
        "attn_fwd_ms": fwd_k / 1e3,
        "attn_bwd_ms": 0.0,
        "reducescatter_ms": 0.0,
        "p2p_ms": 0.0,
        "alltoall_ms": comm_f / 1e3,
        "others_ms": (copies_f + np.maximum(host_f - dev_f, 0.0)) / 1e3,
    }
    if not train:
        return out
    acc = grad_comm_bytes(shape)  # compute dtype: whole gradients leave the kernel in it
    cast = int(acc != e)  # a dtype conversion is a real op (bf16 / fp16 in a float32 compute)
    # dK/dV send buffer: model dtype, or partial sums in grad_comm_dtype when replicated
    kvb = e if r == 1 else acc
    dkv = 2 * t * r * shape.num_kv_heads * d * kvb
    rows = u * t
    q_el = rows * heads.heads_per_rank * d  # this rank's dQ elements (every row of the group)
    kv_el = rows * 2 * heads.kv_heads_per_rank * d  # its dK/dV elements
    # the kernel's gradients: in the compute dtype from Ulysses' own kernel, in the model dtype
    # from a hybrid's inner op
    gb = acc if kernels else e
    # dO packed (cat, transposed copy); dq cast to the model dtype (Ulysses) and padded; dK, dV
    # concatenated, cast to the send dtype where it differs, padded
    dq_cast = cast if kernels else 0
    kv_cast = int(gb != kvb)
    copies_b = _op_us(hw, 2, 4 * o)
    copies_b += _op_us(hw, dq_cast, dq_cast * q_el * (acc + e)) + _op_us(hw, 1, 2 * q_el * e)
    copies_b += _op_us(hw, 1, 2 * kv_el * gb) + _op_us(hw, kv_cast, kv_cast * kv_el * (gb + kvb))
    copies_b += _op_us(hw, 1, 2 * kv_el * kvb)
    # the gathered dQ (several heads) and dK/dV transposed into place, the fold's reshape (several
    # KV heads), the replicas summed in the send dtype and cast once to the model dtype
    many_kv = int(heads.kv_heads_per_rank > 1)
    copies_b += _op_us(hw, many_q, many_q * 2 * o) + _op_us(
        hw, 1 + many_kv, (1 + many_kv) * 2 * dkv
    )
    out_kv = 2 * t * shape.num_kv_heads * d  # dk, dv elements returned
    if rep_kv:
        copies_b += _op_us(hw, 1, dkv + out_kv * kvb)
        copies_b += _op_us(hw, cast, cast * out_kv * (kvb + e))
    ops_b = 2 + dq_cast + 1 + 1 + kv_cast + 1 + many_q + 1 + many_kv + rep_kv * (1 + cast)
    comm_b = a2a(o) + a2a(o) + a2a(dkv)
    host_b = (ops_b + kern) * hw.host_op_us + 3 * colls
    dev_b = copies_b + comm_b + bwd_k
    out["attn_bwd_ms"] = bwd_k / 1e3
    out["alltoall_ms"] += comm_b / 1e3
    out["others_ms"] += (copies_b + np.maximum(host_b - dev_b, 0.0)) / 1e3
    return out
