"""The method registry: one :class:`MethodSpec` per CP method, the only list of methods.

A method is a planner (a pure function ``planner(doc_lens, cp_size, **options) -> Plan`` that never
touches a process group), the way it moves KV (:class:`~flashcp.kinds.CommKind`), the family of
real ops that runs its plans (:class:`~flashcp.kinds.OpFamily`, or an op of its own), the schema of
its planner options, and how plots and tables name and order it. Everything else reads this
registry: the CLI's and the Hydra app's method choices, the simulator's and the executors'
communication kind, the benchmarks' and the plots' method lists, orders, names and colours.

Where methods come from
-----------------------
This module names no method. Each method's :class:`MethodSpec` sits in its own module, beside its
planner (``baselines/llama3.py`` holds ``plan_llama3`` and ``METHOD``), and is declared in the
Python entry-point group ``flashcp.methods`` (:data:`ENTRY_POINT_GROUP`) as
``<name> = "<module>:<attribute>"``. The registry reads two declared lists, once, on first use:

1. this project's own, the ``[project.entry-points."flashcp.methods"]`` table of the
   ``pyproject.toml`` beside the imported ``flashcp`` package when that is a source checkout
   (:func:`flashcp.resources.source_root`; a checkout on ``PYTHONPATH``, never installed, still
   knows its methods, and an edited checkout's list wins over a stale install of it);
2. the entry points of every installed distribution (:func:`importlib.metadata.entry_points`):
   an installed ``flashcp`` wheel's own list (the same table, copied into its metadata), and any
   other package's methods. A third-party package adds a method with ``pip install``::

       # its pyproject.toml
       [project.entry-points."flashcp.methods"]
       my_cp = "my_pkg.my_cp:METHOD"

       # my_pkg/my_cp.py, beside plan_my_cp
       METHOD = MethodSpec(name="my_cp", display_name="My CP", order=80,
                           planner="my_pkg.my_cp:plan_my_cp",
                           comm_kind=CommKind.ALLGATHER_SHARDED)  # run by the all-gather op family

Discovery imports the modules that hold the specs (light: no torch, no solver); planners and ops
named ``"module:function"`` are imported only when first used, so importing :mod:`flashcp` imports
neither the baselines nor torch. :func:`register_method` adds a method at run time (tests,
notebooks). This module imports only the leaf modules :mod:`flashcp.kinds` and
:mod:`flashcp.resources`: the data model (:mod:`flashcp.plan`) does not read it, the method
modules import it without a circle (it imports them by name, after they are loaded), and the ops
read it (:func:`flashcp.ops.get_attn_op` binds a method's op family), never the other way.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from typing import TYPE_CHECKING, Any

import tomllib

from flashcp.kinds import CommKind, OpFamily
from flashcp.resources import source_root

if TYPE_CHECKING:
    from flashcp.plan import Plan

__all__ = [
    "COMM_KIND",
    "ENTRY_POINT_GROUP",
    "CommKind",
    "MethodSpec",
    "OpFamily",
    "check_options",
    "comm_kind_of",
    "get_method",
    "get_planner",
    "load_target",
    "make_plan_for",
    "method_names",
    "methods",
    "op_options",
    "option_names",
    "options_schema",
    "register_method",
    "split_options",
    "unregister_method",
]

#: the entry-point group a distribution declares its methods in (values: a :class:`MethodSpec`)
ENTRY_POINT_GROUP = "flashcp.methods"

_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
#: planner keyword arguments that are not method options: pad handling shared by every planner
#: (:func:`flashcp.plan.planner_entry`) and invariant checking
_NOT_OPTIONS = frozenset({"num_pad", "pad_to_multiple", "validate"})


#: the op family that runs a method's plans when its spec names none: by its comm kind
_DEFAULT_OP = {
    CommKind.ALLGATHER_FULL: OpFamily.ALLGATHER,
    CommKind.ALLGATHER_SHARDED: OpFamily.ALLGATHER,
    CommKind.P2P_RING: OpFamily.RING,
    CommKind.ALLTOALL: OpFamily.ULYSSES,
}
#: options of an op family's ops, not of any planner: ``name -> (type, default)``. A method run
#: by the family takes them among its options (``method.options.<name>``; :func:`options_schema`);
#: :func:`split_options` hands them to the op and the simulator, never to the planner
_OP_OPTIONS: dict[OpFamily, dict[str, tuple[type, Any]]] = {
    OpFamily.ALLGATHER: {
        "keep_gathered_kv": (bool, False),
        # the dK/dV reduce-scatter's dtype (flashcp.ops.collectives.resolve_grad_comm_dtype: a
        # name of flashcp.comm.DTYPE_BYTES; None: the model dtype promoted to at least float32)
        "grad_comm_dtype": (typing.Optional[str], None),  # noqa: UP045 (OmegaConf reads Optional)
    },
}
#: the comm kinds each op family runs
_FAMILY_KINDS = {
    OpFamily.ALLGATHER: (CommKind.ALLGATHER_FULL, CommKind.ALLGATHER_SHARDED),
    OpFamily.RING: (CommKind.P2P_RING,),
    OpFamily.ULYSSES: (CommKind.ALLTOALL,),
    OpFamily.HYBRID: (CommKind.P2P_RING, CommKind.ALLGATHER_SHARDED),
}


@dataclass(frozen=True)
class MethodSpec:
    """Everything the harness knows about one CP method.

    Attributes:
        name: the method's name in configs, rows and plans (lower case, ``[a-z][a-z0-9_]*``).
        display_name: its name in figures and tables.
        order: position in figures, tables and listings (ascending).
        planner: ``"module:function"`` (or the function) of the planner, declared with
            :func:`flashcp.plan.planner_entry`; imported on first use.
        comm_kind: how its plans move KV (:class:`~flashcp.kinds.CommKind`).
        op: the family of real ops that runs its plans (:class:`~flashcp.kinds.OpFamily`; the
            comm kind picks the variant inside it). None: the family of its comm kind (all-gather
            for ``allgather_*``, the ring for ``p2p_ring``, Ulysses for ``alltoall``); the
            head-parallel hybrids name ``OpFamily.HYBRID``.
        prepare, attn: an op of its own instead of a family: ``"module:function"`` (or the
            function) of its ``prepare(plan, rank) -> meta`` and ``attn(q, k, v, meta,
            group=None, *, softmax_scale, backend, counter, timer, grad_comm_dtype) -> out``
            (:mod:`flashcp.ops`); both or neither.
        color: its matplotlib colour in figures.
        options: dataclass of its planner options (fields: names, types, defaults). None: built
            from the planner's keyword-only parameters (:func:`options_schema`), so the planner's
            signature is the one place its options are written down.
        fast: the planner runs in milliseconds per 128K sequence (False for the ILP, which solves a
            MIP per sequence); quick sweeps and tests loop over the fast ones.
        paper: one of the five methods the paper compares (its Fig. 5).
        reports_solve: its plans carry a solver's outcome in ``Plan.info`` (the keys of
            :data:`flashcp.results.ILP_INFO_COLUMNS`), which rows report as ``ilp_<key>``.
        check_options: ``"module:function"`` (or the function) ``check(**options)`` raising
            ``ValueError`` on a bad option value without planning: what the harness runs before
            any work for a method that is not ``fast`` (a fast one is checked by planning one
            trial sequence instead). None: names and types only.
    Raises:
        ValueError: (at construction) a malformed name, target, kind or family, a family that
            does not run the comm kind, or only one of ``prepare`` and ``attn``.
    """

    name: str
    display_name: str
    order: int
    planner: str | Callable
    comm_kind: CommKind
    op: OpFamily | None = None
    prepare: str | Callable | None = None
    attn: str | Callable | None = None
    color: str = "#17becf"
    options: type | None = None
    fast: bool = True
    paper: bool = False
    reports_solve: bool = False
    check_options: str | Callable | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"method name must match [a-z][a-z0-9_]*, got {self.name!r}")
        for key in ("planner", "prepare", "attn", "check_options"):
            target = getattr(self, key)
            if key != "planner" and target is None:
                continue
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
        if (self.prepare is None) != (self.attn is None):
            raise ValueError(f"method {self.name!r}: give both prepare and attn, or neither")
        if self.prepare is not None:
            if self.op is not None:
                raise ValueError(
                    f"method {self.name!r}: an op of its own (prepare, attn) or op={self.op!r}, "
                    "not both"
                )
        else:
            try:
                family = _DEFAULT_OP[self.comm_kind] if self.op is None else OpFamily(self.op)
            except ValueError:
                raise ValueError(
                    f"method {self.name!r}: unknown op family {self.op!r}; choose one of "
                    f"{', '.join(OpFamily)}"
                ) from None
            if self.comm_kind not in _FAMILY_KINDS[family]:
                raise ValueError(
                    f"method {self.name!r}: the {family} op family runs comm kinds "
                    f"{', '.join(_FAMILY_KINDS[family])}, not {self.comm_kind}"
                )
            object.__setattr__(self, "op", family)
        if self.options is not None and not dataclasses.is_dataclass(self.options):
            raise ValueError(f"method {self.name!r}: options must be a dataclass type or None")


_REGISTRY: dict[str, MethodSpec] = {}
#: where each discovered method was declared (for error messages)
_SOURCES: dict[str, str] = {}
#: holds True once discovery has started (a method module that reads the registry while it is
#: imported by the discovery sees the methods loaded so far, and no second discovery starts)
_discovered: list[bool] = []


def _declared() -> list[tuple[metadata.EntryPoint, str]]:
    """Entry points of :data:`ENTRY_POINT_GROUP`, each with where it was declared: the source
    checkout's ``pyproject.toml`` first (when ``flashcp`` is imported from one), then every
    installed distribution but an installed ``flashcp`` that the checkout's list supersedes."""
    found: list[tuple[metadata.EntryPoint, str]] = []
    root = source_root()
    own = None
    if root is not None:
        project = tomllib.loads((root / "pyproject.toml").read_text()).get("project", {})
        if project.get("name") == "flashcp":
            own = project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {})
            where = str(root / "pyproject.toml")
            for name, value in own.items():
                found.append((metadata.EntryPoint(name, value, ENTRY_POINT_GROUP), where))
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "?"
        if own is not None and dist == "flashcp":
            continue
        found.append((ep, f"the installed distribution {dist!r}"))
    return found


def _discover() -> None:
    """Load and register every declared method (:func:`_declared`); run once, on first use.

    Raises:
        ValueError: an entry point that does not load, is not a :class:`MethodSpec`, or names a
            method other than its own name; two declarations of one method name.
    """
    for ep, where in _declared():
        if ep.name in _SOURCES:
            if _SOURCES[ep.name] == where:
                continue
            raise ValueError(
                f"method {ep.name!r} is declared twice ({ENTRY_POINT_GROUP} entry points): in "
                f"{_SOURCES[ep.name]} and in {where}"
            )
        try:
            spec = ep.load()
        except Exception as exc:
            raise ValueError(
                f"method {ep.name!r} ({ep.value!r}, declared in {where}) does not load: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(spec, MethodSpec) or spec.name != ep.name:
            raise ValueError(
                f"entry point {ep.name} = {ep.value!r} (declared in {where}) must be the "
                f"MethodSpec of method {ep.name!r}, got {spec!r}"
            )
        _SOURCES[ep.name] = where
        if ep.name not in _REGISTRY:  # a method registered at run time keeps its spec
            _REGISTRY[ep.name] = spec
    _load.cache_clear()


def _specs() -> dict[str, MethodSpec]:
    """The registry, with the declared methods discovered on first use."""
    if not _discovered:
        _discovered.append(True)
        try:
            _discover()
        except BaseException:
            _discovered.clear()
            raise
    return _REGISTRY


def register_method(spec: MethodSpec, *, replace: bool = False) -> MethodSpec:
    """Add ``spec`` to the registry (and return it).

    Raises:
        ValueError: a method of that name is registered (or declared) and ``replace`` is False.
    """
    if not isinstance(spec, MethodSpec):
        raise ValueError(f"register_method takes a MethodSpec, got {type(spec).__name__}")
    registry = _specs()
    if spec.name in registry and not replace:
        raise ValueError(f"method {spec.name!r} is already registered (pass replace=True)")
    registry[spec.name] = spec
    _load.cache_clear()
    return spec


def unregister_method(name: str) -> MethodSpec:
    """Remove method ``name`` from the registry and return its spec.

    Raises:
        ValueError: unknown method.
    """
    spec = get_method(name)
    del _specs()[name]
    _load.cache_clear()
    return spec


def methods(*, fast: bool | None = None, paper: bool | None = None) -> tuple[MethodSpec, ...]:
    """The registered methods in display order; ``fast`` / ``paper`` keep those with that flag."""
    specs = sorted(_specs().values(), key=lambda s: (s.order, s.name))
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
        return _specs()[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown method {name!r}; choose one of {', '.join(method_names())}"
        ) from None


def comm_kind_of(method: str, default: CommKind | None = None) -> CommKind:
    """How ``method`` moves KV; ``default`` for an unregistered name when given.

    Raises:
        ValueError: unknown method and no default.
    """
    spec = _specs().get(method)
    if spec is not None:
        return spec.comm_kind
    if default is None:
        get_method(method)  # raises, naming the known methods
    return CommKind(default)


class _CommKindView(Mapping):
    """Read-only, live ``method -> CommKind`` view of the registry."""

    def __getitem__(self, method: str) -> CommKind:
        return _specs()[method].comm_kind

    def __iter__(self) -> Iterator[str]:
        return iter(method_names())

    def __len__(self) -> int:
        return len(_specs())

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


def load_target(target: str | Callable) -> Callable:
    """The function a spec names: ``"module:function"`` imported (cached), or the function itself.

    Raises:
        ImportError, AttributeError: the module or the function does not exist.
    """
    return _load(target)


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
    """Plan ``doc_lens`` over ``cp_size`` ranks with ``method`` (options go to the planner; op
    options (:func:`op_options`) are accepted and do not change the plan).

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
    return planner(doc_lens, cp_size, **split_options(method, options)[0])


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
    schema = spec.options if spec.options is not None else _derived_schema(spec.planner)
    return _with_op_options(schema, spec.op if spec.prepare is None else None)


def op_options(method: str) -> dict[str, tuple[type, Any]]:
    """``{name: (type, default)}`` of the options of the op family that runs ``method`` (e.g.
    ``keep_gathered_kv`` of the all-gather family), which are method options but not planner
    options.

    Raises:
        ValueError: unknown method.
    """
    spec = get_method(method)
    return dict(_OP_OPTIONS.get(spec.op, {})) if spec.prepare is None else {}


def split_options(method: str, options: Mapping[str, Any] | None) -> tuple[dict, dict]:
    """``(planner options, op options)`` of ``method``'s ``options`` (:func:`op_options` names
    the second; values as given).

    Raises:
        ValueError: unknown method.
    """
    ops = op_options(method)
    given = dict(options or {})
    return (
        {k: v for k, v in given.items() if k not in ops},
        {k: v for k, v in given.items() if k in ops},
    )


@cache
def _with_op_options(schema: type, family: OpFamily | None) -> type:
    """``schema`` with the fields of ``family``'s op options added (itself when none)."""
    extra = _OP_OPTIONS.get(family, {})
    names = {f.name for f in dataclasses.fields(schema)}
    fields = [
        (name, typ, dataclasses.field(default=default))
        for name, (typ, default) in extra.items()
        if name not in names
    ]
    if not fields:
        return schema
    frozen = schema.__dataclass_params__.frozen
    return dataclasses.make_dataclass(schema.__name__, fields, bases=(schema,), frozen=frozen)


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


def option_names(method: str) -> tuple[str, ...]:
    """The options ``method``'s planner takes (the fields of its :func:`options_schema`).

    Raises:
        ValueError: unknown method.
    """
    return tuple(f.name for f in dataclasses.fields(options_schema(method)))


def _unknown_option(method: str, key: str) -> typing.NoReturn:
    valid = option_names(method)
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
