"""The method registry: one :class:`MethodSpec` per CP method, the only list of methods.

A method is a planner (a pure function ``planner(doc_lens, cp_size, **options) -> Plan`` that never
touches a process group), the way it moves KV (:class:`CommKind`), a real attention op (a
``prepare(plan, rank) -> meta`` and an ``attn(q, k, v, meta, group, ...) -> out``), the schema of
its planner options, and how plots and tables name and order it. Everything else reads this
registry: the CLI's and the Hydra app's method choices, the simulator's and the executors'
communication kind, the benchmarks' and the plots' method lists, orders, names and colours.

Adding a method is one module (its planner, and its op if no existing op runs its layout) and one
line::

    register_method(MethodSpec(
        name="my_cp", display_name="My CP", order=80, planner="my_pkg.my_cp:plan_my_cp",
        comm_kind=CommKind.ALLGATHER_SHARDED, prepare="flashcp.attn:prepare_flashcp",
        attn="flashcp.attn:flashcp_attn", color="#17becf",
    ))

Planners and ops are named ``"module:function"`` and imported only when first used, so importing
:mod:`flashcp` imports neither the baselines nor torch. This module imports nothing of the
project: :mod:`flashcp.plan` (the data model) reads it to price a plan's communication, never the
other way round.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flashcp.plan import Plan

__all__ = [
    "COMM_KIND",
    "CommKind",
    "MethodSpec",
    "check_options",
    "comm_kind_of",
    "get_attn_op",
    "get_method",
    "get_planner",
    "make_plan_for",
    "method_names",
    "methods",
    "options_schema",
    "register_method",
    "unregister_method",
]


class CommKind(StrEnum):
    """How a method moves KV between CP ranks (docs/design.md §3, §4).

    Members compare and hash equal to their string values, so CSV columns, Hydra values and
    existing comparisons with ``"allgather_sharded"`` keep working.
    """

    #: every rank all-gathers the whole KV, Eq. 4: ``(N - 1) C / N`` tokens per rank
    ALLGATHER_FULL = "allgather_full"
    #: sharding-aware all-gather of the non-last shards only, Eq. 5
    ALLGATHER_SHARDED = "allgather_sharded"
    #: ring point-to-point: N - 1 steps of one C / N block each
    P2P_RING = "p2p_ring"
    #: head-parallel all-to-all only (Ulysses over all N ranks): q, k, v in and the output back,
    #: no KV exchange between ranks (docs/design.md §3, "Methods beyond the paper")
    ALLTOALL = "alltoall"


_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
#: planner keyword arguments that are not method options: pad handling shared by every planner
#: (:func:`flashcp.plan.planner_entry`) and invariant checking
_NOT_OPTIONS = frozenset({"num_pad", "pad_to_multiple", "validate"})


@dataclass(frozen=True)
class MethodSpec:
    """Everything the harness knows about one CP method.

    Attributes:
        name: the method's name in configs, rows and plans (lower case, ``[a-z][a-z0-9_]*``).
        display_name: its name in figures and tables.
        order: position in figures, tables and listings (ascending).
        planner: ``"module:function"`` (or the function) of the planner, declared with
            :func:`flashcp.plan.planner_entry`; imported on first use.
        comm_kind: how its plans move KV (:class:`CommKind`).
        prepare, attn: ``"module:function"`` (or the function) of the real op's
            ``prepare(plan, rank) -> meta`` and ``attn(q, k, v, meta, group=None, *, softmax_scale,
            backend, counter, timer, grad_comm_dtype) -> out`` (:mod:`flashcp.ops`).
        color: its matplotlib colour in figures.
        options: dataclass of its planner options (fields: names, types, defaults). None: built
            from the planner's keyword-only parameters (:func:`options_schema`), so the planner's
            signature is the one place its options are written down.
        fast: the planner runs in milliseconds per 128K sequence (False for the ILP, which solves a
            MIP per sequence); quick sweeps and tests loop over the fast ones.
        paper: one of the five methods the paper compares (its Fig. 5).
    Raises:
        ValueError: (at construction) a malformed name, target or kind.
    """

    name: str
    display_name: str
    order: int
    planner: str | Callable
    comm_kind: CommKind
    prepare: str | Callable
    attn: str | Callable
    color: str = "#17becf"
    options: type | None = None
    fast: bool = True
    paper: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"method name must match [a-z][a-z0-9_]*, got {self.name!r}")
        for key in ("planner", "prepare", "attn"):
            target = getattr(self, key)
            if not callable(target) and not (isinstance(target, str) and _TARGET.match(target)):
                raise ValueError(
                    f"method {self.name!r}: {key} must be 'module:function' or a function, "
                    f"got {target!r}"
                )
        try:
            object.__setattr__(self, "comm_kind", CommKind(self.comm_kind))
        except ValueError:
            raise ValueError(
                f"method {self.name!r}: unknown comm_kind {self.comm_kind!r}; choose one of "
                f"{', '.join(CommKind)}"
            ) from None
        if self.options is not None and not dataclasses.is_dataclass(self.options):
            raise ValueError(f"method {self.name!r}: options must be a dataclass type or None")


_REGISTRY: dict[str, MethodSpec] = {}


def register_method(spec: MethodSpec, *, replace: bool = False) -> MethodSpec:
    """Add ``spec`` to the registry (and return it).

    Raises:
        ValueError: a method of that name is registered and ``replace`` is False.
    """
    if not isinstance(spec, MethodSpec):
        raise ValueError(f"register_method takes a MethodSpec, got {type(spec).__name__}")
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"method {spec.name!r} is already registered (pass replace=True)")
    _REGISTRY[spec.name] = spec
    _load.cache_clear()
    return spec


def unregister_method(name: str) -> MethodSpec:
    """Remove method ``name`` from the registry and return its spec.

    Raises:
        ValueError: unknown method.
    """
    spec = get_method(name)
    del _REGISTRY[name]
    _load.cache_clear()
    return spec


def methods(*, fast: bool | None = None, paper: bool | None = None) -> tuple[MethodSpec, ...]:
    """The registered methods in display order; ``fast`` / ``paper`` keep those with that flag."""
    specs = sorted(_REGISTRY.values(), key=lambda s: (s.order, s.name))
    return tuple(
        s for s in specs if (fast is None or s.fast == fast) and (paper is None or s.paper == paper)
    )


def method_names(*, fast: bool | None = None, paper: bool | None = None) -> tuple[str, ...]:
    """Names of :func:`methods` (same filters), in display order."""
    return tuple(s.name for s in methods(fast=fast, paper=paper))


def get_method(name: str) -> MethodSpec:
    """The spec of method ``name``.

    Raises:
        ValueError: unknown method (the message lists the known ones).
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown method {name!r}; choose one of {', '.join(method_names())}"
        ) from None


def comm_kind_of(method: str, default: CommKind | None = None) -> CommKind:
    """How ``method`` moves KV; ``default`` for an unregistered name when given.

    Raises:
        ValueError: unknown method and no default.
    """
    spec = _REGISTRY.get(method)
    if spec is not None:
        return spec.comm_kind
    if default is None:
        get_method(method)  # raises, naming the known methods
    return CommKind(default)


class _CommKindView(Mapping):
    """Read-only, live ``method -> CommKind`` view of the registry."""

    def __getitem__(self, method: str) -> CommKind:
        return _REGISTRY[method].comm_kind

    def __iter__(self) -> Iterator[str]:
        return iter(method_names())

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __repr__(self) -> str:
        return f"COMM_KIND({dict(self)})"


#: ``method -> CommKind`` of every registered method (a live view; missing names raise KeyError)
COMM_KIND: Mapping[str, CommKind] = _CommKindView()


def __getattr__(name: str) -> tuple[str, ...]:
    """``METHODS`` (every registered method) and ``FAST_METHODS`` (``fast`` ones), in display
    order, computed from the registry when read."""
    if name == "METHODS":
        return method_names()
    if name == "FAST_METHODS":
        return method_names(fast=True)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@cache
def _load(target: str | Callable) -> Callable:
    """Import ``"module:function"`` (cached; cleared when the registry changes)."""
    if callable(target):
        return target
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def get_planner(method: str) -> Callable[..., Plan]:
    """The planner of ``method``: ``planner(doc_lens, cp_size, *, num_pad=0,
    pad_to_multiple=False, **options) -> Plan``.

    Every planner takes zero-length documents and pad tokens (:func:`flashcp.plan.planner_entry`).
    It is the function itself (an unknown keyword is Python's TypeError); :func:`make_plan_for`
    and :func:`check_options` check option names first.

    Raises:
        ValueError: unknown method (the message lists the known ones), or a registered planner
            not declared with :func:`flashcp.plan.planner_entry`.
    """
    spec = get_method(method)
    planner = _load(spec.planner)
    if not getattr(planner, "is_planner_entry", False):
        raise ValueError(
            f"the planner of method {method!r} ({spec.planner!r}) must be declared with "
            "flashcp.plan.planner_entry (zero-length documents and pad tokens)"
        )
    return planner


def make_plan_for(method: str, doc_lens, cp_size: int, **options) -> Plan:
    """Plan ``doc_lens`` over ``cp_size`` ranks with ``method`` (options go to the planner).

    ``doc_lens`` may hold zero-length documents (skipped; the plan is the one without them, with
    the caller's document indices); ``num_pad=P`` adds P pad tokens after the last document and
    ``pad_to_multiple=True`` the fewest the layout needs (:func:`flashcp.plan.planner_entry`).

    Raises:
        ValueError: unknown method, an option the planner does not take (named, with the valid
            ones), or what the planner raises.
    """
    planner = get_planner(method)
    unknown = (
        set(options) - _NOT_OPTIONS - {f.name for f in dataclasses.fields(options_schema(method))}
    )
    if unknown:
        _unknown_option(method, sorted(unknown)[0])
    return planner(doc_lens, cp_size, **options)


def get_attn_op(method: str) -> tuple[Callable, Callable]:
    """``(prepare_fn, attn_fn)`` of ``method``'s real op (:mod:`flashcp.ops`).

    Raises:
        ValueError: unknown method (the message lists the known ones).
    """
    spec = get_method(method)
    return _load(spec.prepare), _load(spec.attn)


# ---- planner options -----------------------------------------------------------------------------


def options_schema(method: str) -> type:
    """The dataclass of ``method``'s planner options (a field per option: name, type, default).

    ``MethodSpec.options`` when given; otherwise built from the planner's keyword-only parameters
    other than ``num_pad``, ``pad_to_multiple`` and ``validate`` (with their annotations and
    defaults), named ``<Method>Options``.

    Raises:
        ValueError: unknown method.
    """
    spec = get_method(method)
    return spec.options if spec.options is not None else _derived_schema(spec.planner)


@cache
def _derived_schema(target: str | Callable) -> type:
    planner = _load(target)
    func = inspect.unwrap(planner)
    hints = typing.get_type_hints(func)
    fields = [
        (p.name, hints.get(p.name, Any), dataclasses.field(default=p.default))
        for p in inspect.signature(func).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in _NOT_OPTIONS
    ]
    name = "".join(part.title() for part in func.__name__.removeprefix("plan_").split("_"))
    return dataclasses.make_dataclass(f"{name}Options", fields, frozen=True)


def _unknown_option(method: str, key: str) -> typing.NoReturn:
    valid = [f.name for f in dataclasses.fields(options_schema(method))]
    raise ValueError(
        f"method {method!r} has no option {key!r}; its options: {', '.join(valid) or 'none'}"
    )


def check_options(method: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validate planner ``options`` of ``method`` against its :func:`options_schema` and return
    them as a plain dict (the given keys only; values converted to the declared types, e.g. an
    int for a float option), ready for ``planner(doc_lens, cp_size, **options)``.

    Values the planner itself rejects (e.g. ``target_imbalance < 1``) are checked by the planner.

    Raises:
        ValueError: unknown method; an option the planner does not take (named, with the valid
            ones); a value of the wrong type (named).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = options_schema(method)
    given = dict(options or {})
    valid = {f.name for f in dataclasses.fields(schema)}
    for key in given:
        if key not in valid:
            _unknown_option(method, key)
    typed = OmegaConf.structured(schema)
    OmegaConf.set_readonly(typed, False)  # a frozen schema is read-only in OmegaConf
    for key, value in given.items():
        try:
            OmegaConf.update(typed, key, value, merge=False)
        except OmegaConfBaseException as exc:
            reason = str(exc).splitlines()[0]
            raise ValueError(
                f"method {method!r}: bad value {value!r} for option {key!r} ({reason})"
            ) from None
    out = OmegaConf.to_container(typed)
    return {key: out[key] for key in given}


# ---- the methods -------------------------------------------------------------------------------

_ALLGATHER_SHARDED_OP = {
    "prepare": "flashcp.attn:prepare_flashcp",
    "attn": "flashcp.attn:flashcp_attn",
}

register_method(MethodSpec(
    name="llama3", display_name="Llama3 CP", order=10, planner="baselines.llama3:plan_llama3",
    comm_kind=CommKind.ALLGATHER_FULL, prepare="baselines.llama3_attn:prepare_llama3",
    attn="baselines.llama3_attn:llama3_attn", color="#7f7f7f", paper=True,
))  # fmt: skip
register_method(MethodSpec(
    name="per_doc", display_name="Per-Doc CP", order=20, planner="baselines.per_doc:plan_per_doc",
    comm_kind=CommKind.ALLGATHER_FULL, prepare="baselines.per_doc_attn:prepare_per_doc",
    attn="baselines.per_doc_attn:per_doc_attn", color="#1f77b4", paper=True,
))  # fmt: skip
register_method(MethodSpec(
    name="ring", display_name="Ring", order=30, planner="baselines.ring:plan_ring",
    comm_kind=CommKind.P2P_RING, prepare="baselines.ring_attn:prepare_ring",
    attn="baselines.ring_attn:ring_attn", color="#ff7f0e", paper=True,
))  # fmt: skip
register_method(MethodSpec(
    name="zigzag", display_name="Zigzag ring", order=40, planner="baselines.zigzag:plan_zigzag",
    comm_kind=CommKind.P2P_RING, prepare="baselines.zigzag_attn:prepare_zigzag",
    attn="baselines.zigzag_attn:zigzag_attn", color="#2ca02c", paper=True,
))  # fmt: skip
register_method(MethodSpec(
    name="flashcp", display_name="FlashCP", order=50, planner="flashcp.heuristic:plan_flashcp",
    comm_kind=CommKind.ALLGATHER_SHARDED, **_ALLGATHER_SHARDED_OP, color="#d62728", paper=True,
))  # fmt: skip
register_method(MethodSpec(
    name="flashcp_refined", display_name="FlashCP (refined)", order=60,
    planner="flashcp.refined:plan_flashcp_refined", comm_kind=CommKind.ALLGATHER_SHARDED,
    **_ALLGATHER_SHARDED_OP, color="#9467bd",
))  # fmt: skip
register_method(MethodSpec(
    name="ilp", display_name="ILP", order=70, planner="flashcp.ilp:plan_ilp",
    comm_kind=CommKind.ALLGATHER_SHARDED, **_ALLGATHER_SHARDED_OP, color="#8c564b", fast=False,
))  # fmt: skip
register_method(MethodSpec(
    name="ulysses", display_name="Ulysses", order=62, planner="baselines.ulysses:plan_ulysses",
    comm_kind=CommKind.ALLTOALL, prepare="flashcp.ops.ulysses_attn:prepare_ulysses",
    attn="flashcp.ops.ulysses_attn:ulysses_attn", color="#e377c2",
))  # fmt: skip
register_method(MethodSpec(
    name="usp", display_name="USP (Ulysses x ring)", order=64, planner="baselines.usp:plan_usp",
    comm_kind=CommKind.P2P_RING, prepare="flashcp.ops.hybrid_attn:prepare_usp",
    attn="flashcp.ops.hybrid_attn:usp_attn", color="#bcbd22",
))  # fmt: skip
register_method(MethodSpec(
    name="flashcp_ulysses", display_name="FlashCP x Ulysses", order=66,
    planner="flashcp.hybrid:plan_flashcp_ulysses", comm_kind=CommKind.ALLGATHER_SHARDED,
    prepare="flashcp.ops.hybrid_attn:prepare_flashcp_ulysses",
    attn="flashcp.ops.hybrid_attn:flashcp_ulysses_attn", color="#17becf",
))  # fmt: skip
