"""Attention shapes and the communication volume a plan implies, per method family.

This is the one place that turns a plan into bytes: the simulator prices these bytes, and the real
ops' byte counters are tested against them.

Conventions (docs/design.md §2): volumes are the bytes **one rank receives** in one attention layer's
step, taking the largest rank (collectives are synchronous). KV bytes = tokens x 2 (K and V) x
``num_kv_heads`` x ``head_dim`` x bytes per element. KV buffers are in the model dtype; gradient
partial sums (dK/dV) cross ranks in ``grad_comm_dtype``, by default the model dtype promoted to at
least float32 (float32 for bfloat16 / float16 / float32, float64 for float64), as every op sends
them by default (:func:`flashcp.ops.collectives.resolve_grad_comm_dtype`).

* ``allgather_full`` (``llama3``, ``per_doc``; Eq. 4): forward all-gathers the whole KV,
  (N-1) C/N tokens. Training all-gathers it again in the backward (no KV kept between passes) and
  reduce-scatters dK/dV, the same tokens in ``grad_comm_dtype``. With ``keep_gathered_kv`` the
  backward uses the forward's gathered KV (no second all-gather): with ``grad_comm_dtype`` equal
  to the model dtype that is Eq. 4's ``4 x comm_tokens_full x Hkv x D`` elements exactly.
* ``allgather_sharded`` (``flashcp``; Eq. 5): the same with ``comm_tokens`` (each rank's
  contribution is padded to the largest rank's compact buffer).
* ``p2p_ring`` (``ring``, ``zigzag``): N-1 steps, each receiving one KV block of C/N tokens
  (forward; with pad tokens, the most document tokens any rank holds: pad rows are not sent);
  training passes the KV blocks around again and the dK/dV partial sums too, in
  ``grad_comm_dtype``: N-1 hops in the project's op (:mod:`flashcp.ops.ring_attn`), N in
  ring-flash-attn's (``impl="ring_flash_attn"``: its backward sends the partial sums at every
  step, the last hop taking each block's sum home; :func:`ring_grad_hops`).
* ``impl="ring_flash_attn"`` under ``allgather_full`` (its ``llama3_flash_attn_varlen_func``):
  the reduce-scatter runs on a dK/dV buffer of the model dtype (``dkv_buffer``), so it counts
  model-dtype bytes whatever ``grad_comm_dtype`` says.

* head-parallel plans (``ulysses``, ``alltoall``; any plan with ``ulysses_degree`` u > 1,
  docs/design.md §3): one all-to-all of a (T, h, D) tensor over a group of u ranks, T = C/N rows
  per rank (pad rows included: they travel in the equal-split all-to-all), makes one rank receive
  ``(u - 1) / u * T * h * D`` elements. The forward moves q (h = H), k and v (h = r Hkv each, r
  the KV replication of :func:`flashcp.plan.head_parallel.ulysses_heads`) in and the output (H) back;
  training moves dO (H) in and dQ (H), dK, dV (r Hkv) back: dQ, and dK / dV when r = 1, are whole
  gradients in the model dtype; replicated KV heads' gradients are partial sums, in
  ``grad_comm_dtype``. Communication across the N / u groups is the family above of
  ``comm_kind`` on the plan's :meth:`~flashcp.plan.Plan.group_plan`, for the r Hkv / u KV heads a
  rank holds (none for ``alltoall``, which needs u = N).

Reducing gradients in bfloat16 would round every rank's partial sum (or, around the ring, the
growing sum at every hop), so the dK/dV error would grow with cp_size.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import numpy as np

from flashcp.plan import Plan, kv_bytes

__all__ = [
    "DTYPE_BYTES",
    "IMPLS",
    "LINK_CLASSES",
    "LINK_KINDS",
    "MODES",
    "AttnShape",
    "alltoall_bytes",
    "check_keep_gathered_kv_kind",
    "comm_volume",
    "comm_volume_by_link",
    "grad_comm_bytes",
    "max_rank_link_bytes",
    "node_local_docs",
    "node_scope_rows",
    "node_scoped_comm_volume",
    "node_scoped_volume_by_link",
    "plan_topology",
    "ring_grad_hops",
    "uses_node_scope",
]

#: the two link classes of a two-level network: inside a node (NVLink) and across nodes (NICs)
LINK_CLASSES = ("intra", "inter")
#: the kinds of :func:`comm_volume_by_link` (those of :class:`flashcp.ops.collectives.CommCounter`)
LINK_KINDS = ("allgather", "reducescatter", "p2p", "alltoall")

DTYPE_BYTES = MappingProxyType({"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8})
MODES = ("train", "infer")
Mode = Literal["train", "infer"]
#: the implementations of a layout (``method.impl``; what each launches: :mod:`flashcp.sim.impl`)
IMPLS: tuple[str, ...] = ("ours", "ring_flash_attn")


@dataclass(frozen=True)
class AttnShape:
    """Shape of one attention layer.

    Attributes:
        num_heads: query heads H.
        num_kv_heads: KV heads (GQA), divides ``num_heads``.
        head_dim: D.
        dtype: element type of Q, K, V and of communicated buffers (a key of ``DTYPE_BYTES``).
        num_layers, hidden, ffn, vocab: the whole model around the layer, for the step model
            (:mod:`flashcp.sim.step`): layers, hidden size, MLP intermediate size, vocabulary;
            all None (the default: one attention layer, no step time) or all set.

    The sizes take Python or NumPy integers and are kept as Python ints.

    Raises:
        ValueError: a size that is not a positive integer, ``num_kv_heads`` not dividing
            ``num_heads``, an unknown dtype, or only some of the step model's sizes set.
    """

    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = 128
    dtype: str = "bfloat16"
    num_layers: int | None = None
    hidden: int | None = None
    ffn: int | None = None
    vocab: int | None = None

    def __post_init__(self) -> None:
        step = ("num_layers", "hidden", "ffn", "vocab")
        given = [n for n in step if getattr(self, n) is not None]
        if given and len(given) < len(step):
            raise ValueError(
                f"{', '.join(given)} set without {', '.join(n for n in step if n not in given)}: "
                "the step model needs num_layers, hidden, ffn and vocab together (or none)"
            )
        for name in ("num_heads", "num_kv_heads", "head_dim", *given):
            v = getattr(self, name)
            if isinstance(v, bool | np.bool_) or not isinstance(v, int | np.integer) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
            object.__setattr__(self, name, int(v))  # a NumPy integer kept as a Python int
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads = {self.num_heads} is not a multiple of num_kv_heads = {self.num_kv_heads}"
            )
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(
                f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPE_BYTES)}"
            )

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def kv_bytes(self, tokens):
        """Bytes of K and V for ``tokens`` tokens (all KV heads)."""
        return kv_bytes(tokens, self.num_kv_heads, self.head_dim, self.dtype_bytes)


def check_mode(mode: str) -> None:
    """Raise ValueError unless ``mode`` is ``train`` (forward + backward) or ``infer`` (forward)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")


def grad_comm_bytes(shape: AttnShape, grad_comm_dtype: str | None = None) -> int:
    """Bytes per element of the dK/dV partial sums that cross ranks.

    Args:
        shape: gives the model dtype.
        grad_comm_dtype: a key of :data:`DTYPE_BYTES`, or None for the ops' default (the model
            dtype promoted to at least float32).
    Raises:
        ValueError: unknown ``grad_comm_dtype``.
    """
    if grad_comm_dtype is None:
        return max(shape.dtype_bytes, DTYPE_BYTES["float32"])
    if grad_comm_dtype not in DTYPE_BYTES:
        raise ValueError(
            f"unknown grad_comm_dtype {grad_comm_dtype!r}; choose one of {', '.join(DTYPE_BYTES)}"
        )
    return DTYPE_BYTES[grad_comm_dtype]


def ring_grad_hops(cp_size: int, impl: str = "ours") -> int:
    """dK/dV hops one rank receives in a ring backward of ``cp_size`` ranks (0 for one rank).

    ``ours`` (:mod:`flashcp.ops.ring_attn`): N - 1; the partial sum of a block starts one hop after
    its KV and its owner keeps its own step-0 contribution. ``ring_flash_attn``
    (``ring_flash_attn_varlen_backward`` and ``zigzag_ring_flash_attn_varlen_backward`` of
    ring-flash-attn 0.1.8): N; its loop calls ``d_kv_comm.send_recv_kv(dk, dv)`` at every one of
    its N steps, the last returning each block's sum to its owner.

    Raises:
        ValueError: an unknown ``impl``.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown method.impl {impl!r}; choose one of {', '.join(IMPLS)}")
    if cp_size <= 1:
        return 0
    return int(cp_size) if impl == "ring_flash_attn" else int(cp_size) - 1


def check_keep_gathered_kv_kind(plan: Plan, comm_kind: str, keep_gathered_kv) -> None:
    """Raise ValueError unless ``keep_gathered_kv`` is a bool, and False where the op that runs
    ``plan`` under ``comm_kind`` has no such option (only the all-gather family, without head
    parallelism, keeps the gathered KV)."""
    if not isinstance(keep_gathered_kv, bool | np.bool_):
        raise ValueError(f"keep_gathered_kv must be True or False, got {keep_gathered_kv!r}")
    if keep_gathered_kv and (
        comm_kind not in ("allgather_full", "allgather_sharded") or plan.ulysses_degree > 1
    ):
        raise ValueError(
            f"keep_gathered_kv=True is an option of the all-gather op family; a "
            f"{plan.method} plan (comm_kind {comm_kind}, ulysses_degree {plan.ulysses_degree}) "
            "is not run by it"
        )


def alltoall_bytes(tokens: int, heads: int, head_dim: int, dtype_bytes: int, degree: int) -> int:
    """Bytes one rank receives in one Ulysses all-to-all of a (tokens, heads, head_dim) tensor over
    ``degree`` ranks: ``(u - 1) / u * tokens * heads * head_dim * dtype_bytes`` (it keeps its own
    1/u). ``heads`` must divide by ``degree`` (:func:`flashcp.plan.head_parallel.ulysses_heads`)."""
    return (degree - 1) * tokens * (heads // degree) * head_dim * dtype_bytes


def comm_volume(
    plan: Plan,
    comm_kind: str,
    shape: AttnShape,
    mode: Mode,
    grad_comm_dtype: str | None = None,
    keep_gathered_kv: bool = False,
    impl: str = "ours",
) -> dict[str, int]:
    """Bytes one rank receives per attention-layer step, by kind of communication.

    Args:
        plan: the plan.
        comm_kind: ``allgather_full``, ``allgather_sharded``, ``p2p_ring`` or ``alltoall``
            (:data:`flashcp.registry.COMM_KIND`); for a head-parallel plan, the kind across its
            groups.
        shape: attention shape (KV heads, head_dim, dtype).
        mode: ``train`` or ``infer``.
        grad_comm_dtype: dtype of the dK/dV reduce-scatter (all-gather family) or ring hops
            (ring family), a key of :data:`DTYPE_BYTES`; None: the ops' default, the model dtype
            promoted to at least float32 (see :func:`grad_comm_bytes`).
        keep_gathered_kv: the all-gather op's option
            (:func:`flashcp.ops.allgather_attn.allgather_attention`): the forward's all-gather is
            counted once, the backward issues none.
        impl: ``ours`` or ``ring_flash_attn`` (:mod:`flashcp.sim.impl`): which code runs the
            plan; ring-flash-attn's ring backward takes N dK/dV hops (:func:`ring_grad_hops`) and
            its llama3 reduce-scatters in the model dtype.
    Returns:
        ``{"allgather_bytes", "reducescatter_bytes", "p2p_bytes", "alltoall_bytes",
        "comm_bytes"}`` (ints; ``comm_bytes`` is their sum).
    Raises:
        ValueError: unknown ``comm_kind``, ``mode`` or ``grad_comm_dtype``; heads that the plan's
            Ulysses degree does not allow (:func:`flashcp.plan.head_parallel.ulysses_heads`), or
            ``alltoall`` for a plan whose degree is not its cp_size; ``keep_gathered_kv`` not a
            bool, or True for a kind other than ``allgather_*`` or a head-parallel plan (no op of
            theirs keeps the KV); an unknown ``impl``.
    """
    from flashcp.plan.head_parallel import ulysses_heads

    check_mode(mode)
    kinds = ("allgather_full", "allgather_sharded", "p2p_ring", "alltoall")
    if comm_kind not in kinds:
        raise ValueError(f"unknown comm_kind {comm_kind!r}; choose {', '.join(kinds)}")
    check_keep_gathered_kv_kind(plan, comm_kind, keep_gathered_kv)
    train = mode == "train"
    grad_elem = grad_comm_bytes(shape, grad_comm_dtype)
    ring_grad_hops(plan.cp_size, impl)  # checks impl
    u = plan.cp_size if comm_kind == "alltoall" else plan.ulysses_degree
    if comm_kind == "alltoall" and plan.ulysses_degree not in (1, u):
        raise ValueError(
            f"comm_kind alltoall is Ulysses over all {u} ranks, but the plan's ulysses_degree is "
            f"{plan.ulysses_degree}"
        )
    a2a = 0
    kv_heads = shape.num_kv_heads
    if u > 1:
        heads = ulysses_heads(shape.num_heads, shape.num_kv_heads, u)
        kv_heads = heads.kv_heads_per_rank
        t, d, e = plan.context_len // plan.cp_size, shape.head_dim, shape.dtype_bytes
        q_or_o = alltoall_bytes(t, shape.num_heads, d, e, u)
        kv = alltoall_bytes(t, heads.kv_replication * shape.num_kv_heads, d, e, u)
        a2a = 2 * q_or_o + 2 * kv  # fwd: q, k, v in, out back
        if train:  # bwd: dO in, dQ back (model dtype); dK, dV back, partial sums if replicated
            dkv_elem = e if heads.kv_replication == 1 else grad_elem
            a2a += 2 * q_or_o + 2 * kv // e * dkv_elem
    across = plan.group_plan() if u == plan.ulysses_degree else None
    ag = rs = p2p = 0
    if comm_kind in ("allgather_full", "allgather_sharded"):
        tokens = across.comm_tokens_full if comm_kind == "allgather_full" else across.comm_tokens
        one = kv_bytes(tokens, kv_heads, shape.head_dim, shape.dtype_bytes)
        ag = 2 * one if train and not keep_gathered_kv else one
        # bwd: dK/dV of the same rows, reduce-scattered in grad_comm_dtype
        if impl == "ring_flash_attn":  # its dkv_buffer has the model dtype
            grad_elem = shape.dtype_bytes
        rs = kv_bytes(tokens, kv_heads, shape.head_dim, grad_elem) if train else 0
    elif comm_kind == "p2p_ring":
        # blocks leave out pad rows
        block = int(across.doc_tokens_per_rank.max())
        tokens = (across.cp_size - 1) * block
        one = kv_bytes(tokens, kv_heads, shape.head_dim, shape.dtype_bytes)
        # fwd KV; bwd KV again + dK/dV partial sums in grad_comm_dtype, one block per hop
        hops = ring_grad_hops(across.cp_size, impl)
        grad = kv_bytes(hops * block, kv_heads, shape.head_dim, grad_elem)
        p2p = 2 * one + grad if train else one
    return {
        "allgather_bytes": int(ag),
        "reducescatter_bytes": int(rs),
        "p2p_bytes": int(p2p),
        "alltoall_bytes": int(a2a),
        "comm_bytes": int(ag + rs + p2p + a2a),
    }


def _ring_preds(node: np.ndarray, members: np.ndarray, collective: bool) -> np.ndarray:
    """The CP rank each member of one ring receives from.

    Args:
        node: (N,) int64 node of every CP rank (:attr:`flashcp.topology.Topology.node_of`).
        members: (G,) int64 CP ranks of the ring's process group, in group-rank order.
        collective: True for NCCL's ring of an all-gather / reduce-scatter, which visits the
            members node by node, by group rank inside a node
            (:attr:`~flashcp.topology.Topology.collective_ring`); False for the ring attention
            ring, group rank g receiving from g - 1 (:class:`flashcp.ops.ring_comm.RingComm`).
    Returns:
        (G,) int64: the predecessor (a CP rank) of ``members[g]``.
    """
    g = np.arange(members.size, dtype=np.int64)
    order = np.lexsort((g, node[members])) if collective else g
    pred = np.empty(members.size, dtype=np.int64)
    pred[order] = np.roll(order, 1)
    return members[pred]


def comm_volume_by_link(
    plan: Plan,
    comm_kind: str,
    shape: AttnShape,
    mode: Mode,
    topology=None,
    grad_comm_dtype: str | None = None,
    keep_gathered_kv: bool = False,
) -> dict[str, dict[str, np.ndarray]]:
    """Bytes each rank receives per attention-layer step, by link class and kind of communication.

    The split of :func:`comm_volume`'s bytes over a two-level network (docs/multinode.md): a
    byte is ``inter`` when the rank it comes from is on another node of ``topology``, else
    ``intra``. Every rank receives :func:`comm_volume`'s bytes of each kind (all-gather buffers
    are padded to the largest rank's, ring blocks cut to the most document tokens any rank holds,
    all-to-all splits equal), so for every rank r and kind k, ``intra[k][r] + inter[k][r]`` is
    ``comm_volume(...)[f"{k}_bytes"]``, and the sum over kinds and classes is its
    ``comm_bytes``. Which rank sends what:

    * ``allgather`` / ``reducescatter``: NCCL's ring over the process group, node by node
      (:attr:`flashcp.topology.Topology.collective_ring`): a rank receives its whole share, the
      (G - 1) / G of the buffer, from its ring predecessor; ``inter`` where that predecessor is
      on another node (:attr:`~flashcp.topology.Topology.collective_pred_crosses` for the whole
      CP group).
    * ``p2p``: the ring attention ring (:class:`flashcp.ops.ring_comm.RingComm`): every KV block
      and every dK/dV partial sum a rank receives comes from its predecessor in group-rank order,
      CP rank r - 1 (:attr:`~flashcp.topology.Topology.p2p_ring_crosses`).
    * ``alltoall``: a rank receives one equal chunk from each of the u - 1 other members of its
      Ulysses group; each chunk is ``inter`` when its sender is on another node.
    * head-parallel plans (u > 1; :func:`flashcp.ops.hybrid_attn.hybrid_groups`): the Ulysses
      group of rank r is CP ranks ``g u .. g u + u - 1`` (g = r // u), and the communication
      across groups (the ring or the all-gather / reduce-scatter above) runs over the cross group
      of CP ranks ``j, j + u, ..., j + (G - 1) u`` (j = r % u), whose own ring order applies: the
      ring's predecessor of rank ``g u + j`` is ``((g - 1) mod G) u + j``, NCCL's ring visits
      the cross group's members node by node.

    Args:
        plan, comm_kind, shape, mode, grad_comm_dtype, keep_gathered_kv: as :func:`comm_volume`.
        topology: a :class:`flashcp.topology.Topology` with ``cp_size == plan.cp_size``; None:
            every rank on one node (all bytes ``intra``).
    Returns:
        ``{"intra": {kind: arr}, "inter": {kind: arr}}``, kind in ``allgather``,
        ``reducescatter``, ``p2p``, ``alltoall`` (the kinds of
        :class:`flashcp.ops.collectives.CommCounter`), each arr (cp_size,) int64 bytes.
    Raises:
        ValueError: as :func:`comm_volume`; a topology whose cp_size is not the plan's.
    """
    from flashcp.topology import Topology

    vol = comm_volume(plan, comm_kind, shape, mode, grad_comm_dtype, keep_gathered_kv)
    n = int(plan.cp_size)
    if topology is None:
        topology = Topology.single_node(n)
    if topology.cp_size != n:
        raise ValueError(
            f"topology cp_size {topology.cp_size} does not match the plan's cp_size {n}"
        )
    node = topology.node_of
    ranks = np.arange(n, dtype=np.int64)
    u = n if comm_kind == "alltoall" else int(plan.ulysses_degree)
    out = {c: {k: np.zeros(n, dtype=np.int64) for k in LINK_KINDS} for c in LINK_CLASSES}
    if u > 1:  # one equal chunk from each other member of the Ulysses group
        members = (ranks // u * u)[:, None] + np.arange(u, dtype=np.int64)[None, :]
        n_inter = (node[members] != node[:, None]).sum(axis=1)
        chunk = vol["alltoall_bytes"] // (u - 1)
        assert chunk * (u - 1) == vol["alltoall_bytes"]  # every term is (u - 1) x a chunk
        out["inter"]["alltoall"] = n_inter * chunk
        out["intra"]["alltoall"] = (u - 1 - n_inter) * chunk
    groups = n // u
    if groups > 1:
        pred = np.empty(n, dtype=np.int64)
        collective = comm_kind != "p2p_ring"
        for j in range(u):  # the cross group of position j: CP ranks j, j + u, ...
            members = ranks[j::u]
            pred[members] = _ring_preds(node, members, collective)
        inter = node[pred] != node
        kinds = ("allgather", "reducescatter") if collective else ("p2p",)
        for kind in kinds:
            total = vol[f"{kind}_bytes"]
            out["inter"][kind] = np.where(inter, total, 0).astype(np.int64)
            out["intra"][kind] = np.where(inter, 0, total).astype(np.int64)
    return out


# ---- node-aware FlashCP's two-scope all-gather (flashcp_node; docs/scale.md) ------------------
# A separate account: its op (flashcp.ops.node_allgather_attn) gathers the non-last shards of
# documents kept on one node over that node's ranks only, and the others over the whole group.


def plan_topology(plan: Plan):
    """The :class:`flashcp.topology.Topology` a plan was made for: its ``info["num_nodes"]``
    and ``info["placement"]`` (``flashcp_node`` plans; one node when absent), with
    ``gpus_per_node`` = the ranks per node (a plan does not depend on a node's other GPUs)."""
    from flashcp.topology import Topology

    nodes = int(plan.info.get("num_nodes", 1))
    placement = str(plan.info.get("placement", "consecutive"))
    return Topology(plan.cp_size, plan.cp_size // nodes, placement, nodes)


def node_local_docs(plan: Plan, node_of) -> np.ndarray:
    """(n_docs,) bool: the documents whose shards all lie on one node (whole ones, and those
    without shards, included).

    Args:
        plan: any plan; node_of: (cp_size,) int, the node of each rank.
    """
    nodes = np.asarray(node_of, dtype=np.int64)[plan.rank]
    lo = np.full(plan.doc_lens.size, np.iinfo(np.int64).max)
    hi = np.full(plan.doc_lens.size, -1)
    np.minimum.at(lo, plan.doc, nodes)
    np.maximum.at(hi, plan.doc, nodes)
    return lo >= hi


def uses_node_scope(plan: Plan) -> bool:
    """Whether a plan's op gathers in two scopes: its topology spans nodes and its planner chose
    the node scope (``info["node_scope"]``: the group scope's buffer is then smaller than the
    one-scope gather's; else the one-scope gather of FlashCP's op runs it, whose buffer is no
    larger)."""
    return bool(plan.info.get("node_scope", False)) and plan_topology(plan).spans_nodes


def node_scope_rows(plan: Plan, node_of=None) -> tuple[int, int]:
    """``(Mn, Mg)``: rows of the largest node-scope and group-scope send buffer over the ranks
    (non-last shards of node-local documents, and of the others; Eq. 5's per-rank sends split by
    scope) for the nodes ``node_of``. None: the plan's own gather (:func:`uses_node_scope`);
    a one-scope gather gives ``(0, max non-last rows)``, FlashCP's op."""
    if node_of is None:
        topo = plan_topology(plan)
        if not uses_node_scope(plan):
            sent = plan.send_tokens_per_rank
            return 0, int(sent.max()) if sent.size else 0
        node_of = topo.node_of
    local = node_local_docs(plan, node_of)[plan.doc]
    sent = np.where(plan.is_last, 0, plan.length)
    n = plan.cp_size
    mn = np.bincount(plan.rank, weights=np.where(local, sent, 0), minlength=n).max()
    mg = np.bincount(plan.rank, weights=np.where(local, 0, sent), minlength=n).max()
    return int(mn), int(mg)


def node_scoped_comm_volume(
    plan: Plan, shape: AttnShape, mode: Mode, grad_comm_dtype: str | None = None
) -> dict[str, int]:
    """Bytes one rank receives per attention-layer step under the two-scope all-gather, by scope.

    The node scope all-gathers ``Mn`` rows over the R ranks of a node, the group scope ``Mg``
    rows over all N (:func:`node_scope_rows`): the forward receives ``(R - 1) Mn + (N - 1) Mg``
    rows of K and V; training gathers them again in the backward and reduce-scatters their dK/dV
    in ``grad_comm_dtype`` (the conventions of :func:`comm_volume`, Eq. 5 per scope). A plan on
    one node gives :func:`comm_volume`'s ``allgather_sharded`` bytes.

    Returns:
        :func:`comm_volume`'s keys plus ``node_scope_bytes`` (all inside a node) and
        ``group_scope_bytes`` (over the whole CP group).
    Raises:
        ValueError: an unknown mode or ``grad_comm_dtype``.
    """
    check_mode(mode)
    train = mode == "train"
    topo = plan_topology(plan)
    mn, mg = node_scope_rows(plan)
    rows = {"node": (topo.ranks_per_node - 1) * mn, "group": (plan.cp_size - 1) * mg}
    grad_elem = grad_comm_bytes(shape, grad_comm_dtype)
    out = dict.fromkeys(
        ("allgather_bytes", "reducescatter_bytes", "p2p_bytes", "alltoall_bytes"), 0
    )
    for scope, r in rows.items():
        one = kv_bytes(r, shape.num_kv_heads, shape.head_dim, shape.dtype_bytes)
        ag, rs = (
            (2 * one, kv_bytes(r, shape.num_kv_heads, shape.head_dim, grad_elem))
            if train
            else (one, 0)
        )
        out["allgather_bytes"] += int(ag)
        out["reducescatter_bytes"] += int(rs)
        out[f"{scope}_scope_bytes"] = int(ag + rs)
    out["comm_bytes"] = out["allgather_bytes"] + out["reducescatter_bytes"]
    return out


def node_scoped_volume_by_link(
    plan: Plan, shape: AttnShape, mode: Mode, grad_comm_dtype: str | None = None
) -> dict[str, dict[str, np.ndarray]]:
    """:func:`comm_volume_by_link` of the two-scope all-gather on the plan's own topology
    (:func:`plan_topology`): node-scope bytes are all ``intra``; group-scope bytes come, as any
    all-gather / reduce-scatter over the group, from the rank's predecessor on NCCL's node-by-node
    ring (``inter`` where it is on another node; docs/multinode.md).

    Returns:
        ``{"intra": {kind: arr}, "inter": {kind: arr}}`` as :func:`comm_volume_by_link`; for
        every rank intra + inter of a kind is :func:`node_scoped_comm_volume`'s.
    """
    check_mode(mode)
    topo = plan_topology(plan)
    n = plan.cp_size
    mn, mg = node_scope_rows(plan)
    train = mode == "train"
    grad_elem = grad_comm_bytes(shape, grad_comm_dtype)
    kvb = shape.num_kv_heads * shape.head_dim * 2  # elements of K and V per row

    def per(rows: int) -> dict[str, int]:
        ag = rows * kvb * shape.dtype_bytes * (2 if train else 1)
        return {"allgather": ag, "reducescatter": rows * kvb * grad_elem if train else 0}

    node = per((topo.ranks_per_node - 1) * mn)
    group = per((n - 1) * mg)
    crosses = _ring_preds(topo.node_of, np.arange(n, dtype=np.int64), True)
    inter = topo.node_of[crosses] != topo.node_of
    out = {c: {k: np.zeros(n, dtype=np.int64) for k in LINK_KINDS} for c in LINK_CLASSES}
    for kind in ("allgather", "reducescatter"):
        out["intra"][kind] = np.where(inter, 0, group[kind]) + node[kind]
        out["inter"][kind] = np.where(inter, group[kind], 0).astype(np.int64)
    return out


def max_rank_link_bytes(
    plan: Plan, comm_kind: str, shape: AttnShape, mode: Mode, topology=None
) -> tuple[int, int]:
    """The largest rank's ``(inter, intra)`` bytes of one attention-layer step (int, bytes; each
    maximum taken over the ranks on its own): :func:`comm_volume_by_link` summed over kinds, or
    :func:`node_scoped_volume_by_link` for a ``flashcp_node`` plan whose op gathers in two scopes
    (docs/multinode.md, docs/scale.md).

    Raises:
        ValueError: as :func:`comm_volume_by_link` (a bad ``mode`` or ``comm_kind``).
    """
    if plan.method == "flashcp_node" and uses_node_scope(plan):
        links = node_scoped_volume_by_link(plan, shape, mode)
    else:
        links = comm_volume_by_link(plan, comm_kind, shape, mode, topology)
    inter = sum(links["inter"].values())
    intra = sum(links["intra"].values())
    return int(np.max(inter)), int(np.max(intra))
