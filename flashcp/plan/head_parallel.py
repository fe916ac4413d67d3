"""Head-parallel (Ulysses) context parallelism: the pure pieces shared by its planners, its op, the
communication volumes and the simulator (docs/design.md §3, "Methods beyond the paper").

DeepSpeed-Ulysses (Jacobs et al., 2023) splits the *heads*, not the tokens, for attention: an
all-to-all inside a group of ``u`` ranks turns each rank's (T tokens, H heads) into (u T tokens,
H / u heads), every rank attends over all of its group's tokens for its heads, and a second
all-to-all turns the output back. ``u`` is the Ulysses degree: ``u = N`` for ``ulysses``; hybrids
use groups of ``u`` consecutive ranks and another scheme across the ``N / u`` groups.

A head-parallel plan is an ordinary :class:`~flashcp.plan.Plan` of the N ranks' tokens whose
``info["ulysses_degree"]`` is ``u``; ranks ``g u .. g u + u - 1`` form group g. Its
:meth:`~flashcp.plan.Plan.group_plan` is the plan of the ``N / u`` groups as super-ranks (each
holding its ranks' shards), which is what the attention kernels and any cross-group
communication see.

Heads (:func:`ulysses_heads`): the degree must divide the query heads, and either divide the KV
heads or be a multiple of them; in the latter case (``num_kv_heads < u``) every KV head is
replicated ``u / num_kv_heads`` times before the all-to-all, so that each rank receives the one KV
head its query heads use, and the replicas' gradients are summed on the way back.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "UlyssesHeads",
    "check_ulysses_degree",
    "one_group_documents",
    "split_groups",
    "ulysses_heads",
    "valid_ulysses_degrees",
]


class UlyssesHeads(NamedTuple):
    """How heads are split over a Ulysses group of ``degree`` ranks.

    Attributes:
        degree: u, ranks of the group.
        num_heads, num_kv_heads: H and Hkv of the model.
        kv_replication: r, copies of each KV head sent (1 unless ``num_kv_heads < degree``).
        heads_per_rank: H / u query heads each rank attends with.
        kv_heads_per_rank: r Hkv / u KV heads each rank receives.
    """

    degree: int
    num_heads: int
    num_kv_heads: int
    kv_replication: int
    heads_per_rank: int
    kv_heads_per_rank: int


def _is_valid(degree: int, num_heads: int, num_kv_heads: int) -> bool:
    return num_heads % degree == 0 and (num_kv_heads % degree == 0 or degree % num_kv_heads == 0)


def valid_ulysses_degrees(num_heads: int, num_kv_heads: int) -> list[int]:
    """Every Ulysses degree u that ``num_heads`` query and ``num_kv_heads`` KV heads allow: u divides
    ``num_heads`` and either divides ``num_kv_heads`` or is a multiple of it (ascending)."""
    return [u for u in range(1, num_heads + 1) if _is_valid(u, num_heads, num_kv_heads)]


def _check_positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def ulysses_heads(num_heads: int, num_kv_heads: int, degree: int) -> UlyssesHeads:
    """Split ``num_heads`` query and ``num_kv_heads`` KV heads over a Ulysses group of ``degree``.

    Args:
        num_heads: H >= 1; num_kv_heads: Hkv >= 1 dividing H; degree: u >= 1.
    Returns:
        :class:`UlyssesHeads`.
    Raises:
        ValueError: a non-positive value, ``H % Hkv != 0``, or a degree the heads do not allow:
            the one-line message names H, Hkv and u and the nearest valid degrees.
    """
    h = _check_positive("num_heads", num_heads)
    hkv = _check_positive("num_kv_heads", num_kv_heads)
    u = _check_positive("ulysses degree", degree)
    if h % hkv:
        raise ValueError(f"num_heads = {h} is not a multiple of num_kv_heads = {hkv}")
    if not _is_valid(u, h, hkv):
        valid = valid_ulysses_degrees(h, hkv)
        below = [x for x in valid if x < u]
        above = [x for x in valid if x > u]
        near = ", ".join(str(x) for x in (below[-1:] + above[:1]))
        why = (
            f"does not divide num_heads = {h}"
            if h % u
            else f"neither divides nor is a multiple of num_kv_heads = {hkv}"
        )
        raise ValueError(
            f"ulysses degree {u} {why} (with {h} query and {hkv} KV heads the valid degrees are "
            f"{', '.join(map(str, valid))}; nearest: {near})"
        )
    r = 1 if hkv % u == 0 else u // hkv
    return UlyssesHeads(u, h, hkv, r, h // u, r * hkv // u)


def check_ulysses_degree(degree, cp_size: int) -> int:
    """Check a Ulysses degree against the CP size (heads are checked later, by
    :func:`ulysses_heads`, where they are known).

    Args:
        degree: u >= 1 dividing ``cp_size``, or None: the largest divisor of ``cp_size`` not
            above its square root (a square-ish grid of groups: 1 up to 3 ranks, 2 for 4 to 8,
            4 for 16).
    Returns:
        the degree as an int.
    Raises:
        ValueError: ``degree`` is not a positive integer dividing ``cp_size`` (naming both and the
            valid degrees).
    """
    if degree is None:
        return max(x for x in range(1, int(cp_size**0.5) + 1) if cp_size % x == 0)
    u = _check_positive("ulysses_degree", degree)
    if cp_size % u:
        divisors = [x for x in range(1, cp_size + 1) if cp_size % x == 0]
        raise ValueError(
            f"ulysses_degree = {u} does not divide cp_size = {cp_size}; choose one of "
            f"{', '.join(map(str, divisors))}"
        )
    return u


def split_groups(group_plan, degree: int, method: str, validate: bool = True):
    """The plan of ``N = G u`` ranks whose groups of ``u`` consecutive ranks hold the super-ranks of
    ``group_plan`` (G ranks): super-rank g's local rows (its shards in order, then its pad) cut
    into u consecutive pieces of C/N rows, piece j on rank ``g u + j`` (so a group's all-to-all
    puts the super-rank's rows back in order). ``info`` is the group plan's plus
    ``ulysses_degree = u``; :meth:`~flashcp.plan.Plan.group_plan` gives the super-ranks back.

    Args:
        group_plan: a valid plan of G super-ranks (pad rows last on each, as every plan has).
        degree: u >= 1.
        method: the method stored in the result.
    Returns:
        a :class:`~flashcp.plan.Plan` of ``G u`` ranks.
    Raises:
        ValueError: the super-ranks' rows do not divide by u (C not divisible by N).
    """
    import numpy as np

    from flashcp.plan import cu_seqlens, make_plan

    g_n, u = group_plan.cp_size, int(degree)
    rows = group_plan.context_len // g_n if g_n else 0
    if rows % u:
        raise ValueError(
            f"context_len = {group_plan.context_len} is not divisible by cp_size = {g_n * u}"
        )
    t = rows // u
    rank, doc, start, length = [], [], [], []
    for g in range(g_n):
        d, s, ln = group_plan.rank_shards(g)
        off = cu_seqlens(ln)  # local row of each shard's first token, then the document rows
        # cut every shard at the piece boundaries inside it
        cuts = np.union1d(off, np.arange(0, int(off[-1]), t, dtype=np.int64)) if t else off
        pos = cuts[:-1]
        which = np.searchsorted(off, pos, side="right") - 1  # shard of each piece
        rank.append(g * u + pos // t if t else np.full(pos.size, g * u))
        doc.append(d[which])
        start.append(s[which] + pos - off[which])
        length.append(np.diff(cuts))
    real = np.concatenate([np.asarray(x, dtype=np.int64) for x in length]) if length else []
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)  # noqa: E731
    rank_c = cat(rank)
    doc_rows = np.bincount(rank_c, weights=real, minlength=g_n * u).astype(np.int64)
    pad = t - doc_rows
    info = {**group_plan.info, "ulysses_degree": u}
    return make_plan(
        method, g_n * u, group_plan.doc_lens, rank_c, cat(doc), cat(start), cat(length),
        status=group_plan.status, info=info, pad=pad, validate=validate,
    )  # fmt: skip


def one_group_documents(plan):
    """The documents of a head-parallel plan with one group (``ulysses_degree`` u = N > 1), when
    its one super-rank holds every document whole: their lengths in the group's row order, the
    ``cu_seqlens`` of plain Ulysses over the group; None for any other plan (u < N, N = 1, or a
    document in pieces). Such a plan is plain Ulysses, and its op and its price are Ulysses'.

    Args:
        plan: a :class:`~flashcp.plan.Plan`.
    Returns:
        (n_docs,) int64 lengths of the non-empty documents, or None.
    """
    import numpy as np

    if not 1 < plan.cp_size == plan.ulysses_degree:
        return None
    doc, start, length = plan.group_plan().rank_shards(0)
    keep = length > 0
    doc, start, length = doc[keep], start[keep], length[keep]
    whole = (start == 0) & (length == plan.doc_lens[doc])
    return length.astype(np.int64) if bool(whole.all()) else None
