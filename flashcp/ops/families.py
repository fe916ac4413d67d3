"""The op families: one ``(prepare, attn)`` pair per method, built from its spec's family and comm
kind (:class:`flashcp.kinds.OpFamily`), so a method needs no op module of its own.

Every family's code takes the method's name (its metadata records it, and the op checks that a
call's metadata is the method's own); this module binds that name, and the variant the comm kind
picks, into the two functions :func:`flashcp.ops.get_attn_op` returns. At cp_size 1 every
family's ``attn`` runs :func:`flashcp.ops.single_device.single_device_attention` instead (no CP
work). The family modules are imported on first use (this module imports no torch).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

from flashcp.kinds import CommKind, OpFamily

__all__ = ["family_op"]


def _named(
    prepare: Callable, attn: Callable, method: str, family: str
) -> tuple[Callable, Callable]:
    prepare.__name__ = prepare.__qualname__ = f"prepare_{method}"
    attn.__name__ = attn.__qualname__ = f"{method}_attn"
    prepare.__doc__ = (
        f"Metadata of ``rank`` for a {method!r} plan, built once per batch (pure: no process "
        f"group); the {family} op family (:mod:`flashcp.ops.families`)."
    )
    attn.__doc__ = (
        f"CP attention of this rank's tokens for method {method!r}: the {family} op family's "
        "entry point with the method's name bound (arguments, shapes and errors there)."
    )
    return prepare, attn


def _allgather(method: str, kind: CommKind) -> tuple[Callable, Callable]:
    from flashcp.ops.allgather_attn import (
        allgather_attention,
        build_allgather_meta,
        check_heads_per_group,
        check_keep_gathered_kv,
    )
    from flashcp.ops.single_device import single_device_attention, takes_single_device_path

    sharded = kind is CommKind.ALLGATHER_SHARDED

    def prepare(plan, rank):
        return build_allgather_meta(plan, rank, method, sharding_aware=sharded)

    def attn(
        q, k, v, meta, group=None, *, softmax_scale=None, backend="auto", counter=None,
        timer=None, grad_comm_dtype=None, heads_per_group=None, keep_gathered_kv=False,
    ):  # fmt: skip
        if takes_single_device_path(meta):  # cp_size 1: no CP work (flashcp.ops.single_device)
            check_heads_per_group(heads_per_group)
            check_keep_gathered_kv(keep_gathered_kv)
            return single_device_attention(
                q, k, v, meta, group, method=method, softmax_scale=softmax_scale, backend=backend,
                timer=timer, grad_comm_dtype=grad_comm_dtype,
            )  # fmt: skip
        return allgather_attention(
            q, k, v, meta, group, method=method, softmax_scale=softmax_scale, backend=backend,
            counter=counter, timer=timer, grad_comm_dtype=grad_comm_dtype,
            heads_per_group=heads_per_group, keep_gathered_kv=keep_gathered_kv,
        )  # fmt: skip

    return _named(prepare, attn, method, "flashcp.ops.allgather_attn.allgather_attention")


def _ring(method: str, kind: CommKind) -> tuple[Callable, Callable]:
    from flashcp.ops.ring_attn import prepare_ring_meta, ring_attention
    from flashcp.ops.single_device import single_device_attention, takes_single_device_path

    def prepare(plan, rank):
        return prepare_ring_meta(plan, rank, method)

    def attn(
        q, k, v, meta, group=None, *, softmax_scale=None, backend="auto", counter=None,
        timer=None, grad_comm_dtype=None,
    ):  # fmt: skip
        if takes_single_device_path(meta):  # cp_size 1: no CP work (flashcp.ops.single_device)
            return single_device_attention(
                q, k, v, meta, group, method=method, softmax_scale=softmax_scale, backend=backend,
                timer=timer, grad_comm_dtype=grad_comm_dtype,
            )  # fmt: skip
        return ring_attention(
            q, k, v, meta, group, method=method, softmax_scale=softmax_scale, backend=backend,
            counter=counter, timer=timer, grad_comm_dtype=grad_comm_dtype,
        )  # fmt: skip

    return _named(prepare, attn, method, "flashcp.ops.ring_attn.ring_attention")


def _ulysses(method: str, kind: CommKind) -> tuple[Callable, Callable]:
    from flashcp.ops.single_device import single_device_attention, takes_single_device_path
    from flashcp.ops.ulysses_attn import prepare_ulysses, ulysses_attn

    def prepare(plan, rank):
        return prepare_ulysses(plan, rank, method=method)

    def attn(
        q, k, v, meta, group=None, *, softmax_scale=None, backend="auto", counter=None,
        timer=None, grad_comm_dtype=None,
    ):  # fmt: skip
        if takes_single_device_path(meta):  # cp_size 1: no CP work (flashcp.ops.single_device)
            return single_device_attention(
                q, k, v, meta, group, method=method, softmax_scale=softmax_scale, backend=backend,
                timer=timer, grad_comm_dtype=grad_comm_dtype,
            )  # fmt: skip
        return ulysses_attn(
            q, k, v, meta, group, softmax_scale=softmax_scale, backend=backend, counter=counter,
            timer=timer, grad_comm_dtype=grad_comm_dtype, method=method,
        )  # fmt: skip

    return _named(prepare, attn, method, "flashcp.ops.ulysses_attn.ulysses_attn")


def _hybrid(method: str, kind: CommKind) -> tuple[Callable, Callable]:
    from flashcp.ops.hybrid_attn import hybrid_attention, prepare_hybrid
    from flashcp.ops.single_device import single_device_attention, takes_single_device_path

    def prepare(plan, rank):
        return prepare_hybrid(plan, rank, method, kind)

    def attn(
        q, k, v, meta, group=None, *, softmax_scale=None, backend="auto", counter=None,
        timer=None, grad_comm_dtype=None,
    ):  # fmt: skip
        if takes_single_device_path(meta):  # cp_size 1: no CP work (flashcp.ops.single_device)
            return single_device_attention(
                q, k, v, meta, group, method=method, softmax_scale=softmax_scale, backend=backend,
                timer=timer, grad_comm_dtype=grad_comm_dtype,
            )  # fmt: skip
        return hybrid_attention(
            q, k, v, meta, group, method=method, softmax_scale=softmax_scale, backend=backend,
            counter=counter, timer=timer, grad_comm_dtype=grad_comm_dtype,
        )  # fmt: skip

    return _named(prepare, attn, method, "flashcp.ops.hybrid_attn.hybrid_attention")


_FAMILIES = {
    OpFamily.ALLGATHER: _allgather,
    OpFamily.RING: _ring,
    OpFamily.ULYSSES: _ulysses,
    OpFamily.HYBRID: _hybrid,
}


@cache
def family_op(method: str, family: OpFamily, comm_kind: CommKind) -> tuple[Callable, Callable]:
    """``(prepare, attn)`` of ``method`` run by op ``family`` in its ``comm_kind`` variant.

    ``prepare(plan, rank) -> meta`` (pure) accepts plans of ``method`` only; ``attn(q, k, v, meta,
    group=None, *, softmax_scale=None, backend="auto", counter=None, timer=None,
    grad_comm_dtype=None) -> out`` (the all-gather family also takes ``heads_per_group``) takes
    only metadata of that ``prepare``. Shapes, dtypes and errors: the family's entry point
    (:func:`flashcp.ops.allgather_attn.allgather_attention`,
    :func:`flashcp.ops.ring_attn.ring_attention`, :func:`flashcp.ops.ulysses_attn.ulysses_attn`,
    :func:`flashcp.ops.hybrid_attn.hybrid_attention`).

    Raises:
        ValueError: unknown family or comm kind.
    """
    try:
        build = _FAMILIES[OpFamily(family)]
    except ValueError:
        raise ValueError(
            f"unknown op family {family!r}; choose one of {', '.join(OpFamily)}"
        ) from None
    return build(method, CommKind(comm_kind))
