"""The plan data model's units and input checks: the workload of a shard (Eq. 3, the one copy
of the formula), ``cu_seqlens``, document lengths and CP sizes checked before any work, the
JSON form of a plan's values (:mod:`flashcp.plan`).
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

#: the most tokens a packed sequence may hold (documents and pad): Eq. 3 workloads, up to
#: C (C + 1) / 2 per rank, then stay below 2**62 and fit the int64 arrays they are kept in
MAX_TOKENS = 2**31


#: the most ranks one CP group may have: a guard against a typo (cp_size 10**9 allocated 7.5 GiB
#: per-rank arrays before any check), far above the largest CP groups reported in training
#: (hundreds of GPUs); a plan's per-rank arrays then stay below a few MB
MAX_CP_SIZE = 2**16


def shard_workload(start, length):
    """Eq. 3 of the paper: ``W = (2p + s + 1) * s / 2`` causal query-key pairs per head of a shard
    with prefix p and length s (exact integers). The one place the formula is written.

    Args:
        start: prefix length p of each shard: a Python int, or an (n,) int array.
        length: length s of each shard, >= 0: a Python int, or an (n,) int array.
    Returns:
        a Python int when both arguments are integers (exact, no overflow), else (n,) int64.
    """
    try:  # the planners' inner loops call this on scalars: keep that path cheap
        p, s = operator.index(start), operator.index(length)
    except TypeError:
        p, s = np.asarray(start, dtype=np.int64), np.asarray(length, dtype=np.int64)
    return (2 * p + s + 1) * s // 2


def doc_workload(doc_lens):
    """Workload of whole documents, ``d (d + 1) / 2`` (Eq. 3 with p = 0, s = d): a Python int for an
    int, else (n,) int64."""
    return shard_workload(0, doc_lens)


#: the most rows an int32 ``cu_seqlens`` holds (read once: ``np.iinfo`` costs microseconds a call)
_INT32_MAX = int(np.iinfo(np.int32).max)


def cu_seqlens(lengths, *, device=None):
    """Cumulative lengths ``[0, l_0, l_0 + l_1, ..., sum(l)]``: segment i is rows
    ``cu[i]:cu[i + 1]`` (FlashAttention's varlen ``cu_seqlens``). The one place it is derived;
    ``cu_seqlens(l)[:-1]`` are the segments' first rows.

    Args:
        lengths: (n,) ints >= 0 (a list or an array).
        device: None for a NumPy array; else a torch device, for the int32 tensor on it that the
            varlen kernels take.
    Returns:
        (n + 1,) int64 ndarray, or (n + 1,) torch.int32 tensor on ``device``.
    Raises:
        ValueError: ``lengths`` is not 1-D, or its total does not fit the int32 tensor.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {lengths.shape}")
    cu = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    if device is None:
        return cu
    import torch  # planners stay NumPy-only; only the ops ask for a tensor

    if cu[-1] > _INT32_MAX:
        raise ValueError(f"{int(cu[-1])} rows do not fit int32 cu_seqlens")
    return torch.from_numpy(cu.astype(np.int32)).to(device)


def check_doc_lens(doc_lens: Any, context_len: int | None = None) -> np.ndarray:
    """Validate document lengths and return them as a (n_docs,) int64 array.

    Zero-length documents and an empty list are valid (they hold no token); planners skip them
    (:func:`planner_entry`).

    Raises:
        ValueError: non-integer values, a negative length, more than :data:`MAX_TOKENS` tokens
            in all, or (when ``context_len`` is given) lengths that do not sum to
            ``context_len``. The message names the bad value.
    """
    if type(doc_lens) is np.ndarray and doc_lens.dtype == np.int64 and doc_lens.ndim == 1:
        arr = doc_lens.copy()  # the common case: nothing to convert
    else:
        if isinstance(doc_lens, str | bytes):
            raise ValueError(
                f"doc_lens must be a sequence of integers, got the string {doc_lens!r}"
            )
        arr = np.asarray(doc_lens)
        if arr.ndim != 1:
            raise ValueError(f"doc_lens must be one-dimensional, got shape {arr.shape}")
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind == "f":
            bad = arr[~np.isfinite(arr) | (arr != np.round(arr))]
            if bad.size:
                raise ValueError(f"doc_lens must be integers, got {bad[0]!r}")
        elif arr.dtype.kind == "O" and all(isinstance(v, int | np.integer) for v in arr.flat):
            big = max(arr.flat, key=abs)  # Python ints beyond int64
            raise ValueError(
                f"doc_lens must be integers in [0, MAX_TOKENS = 2**31], got {int(big)}"
            )
        elif arr.dtype.kind not in "iu":
            raise ValueError(
                f"doc_lens must be integers, got dtype {arr.dtype} (e.g. {arr.flat[0]!r})"
            )
        if arr.size and (arr.max() > MAX_TOKENS or arr.min() < -MAX_TOKENS):
            i = int(np.argmax((arr > MAX_TOKENS) | (arr < -MAX_TOKENS)))
            raise ValueError(
                f"doc_lens must be integers in [0, MAX_TOKENS = 2**31], got doc_lens[{i}] = "
                f"{arr[i].item()!r}"
            )
        arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        i = int(np.argmax(arr < 0))
        raise ValueError(f"doc_lens must be >= 0, got doc_lens[{i}] = {int(arr[i])}")
    if arr.size and (arr.max() > MAX_TOKENS or int(arr.sum()) > MAX_TOKENS):
        raise ValueError(
            f"doc_lens hold {int(arr.astype(object).sum())} tokens (longest {int(arr.max())}); a "
            f"packed sequence holds at most MAX_TOKENS = 2**31 = {MAX_TOKENS}"
        )
    if context_len is not None and int(arr.sum()) != int(context_len):
        raise ValueError(
            f"doc_lens sum to {int(arr.sum())} but context_len = {context_len}; "
            "pack or cut the documents to context_len first"
        )
    return arr


def check_cp_args(context_len: int, cp_size: int, chunks_per_rank: int = 1) -> None:
    """Check ``1 <= cp_size <= MAX_CP_SIZE`` and that ``context_len`` divides by
    ``chunks_per_rank * cp_size``.

    ``context_len`` counts pad tokens. The message names the multiple the layout needs and the
    number of pad tokens that would reach it.

    Raises:
        ValueError: naming the bad value.
    """
    if isinstance(cp_size, bool) or not isinstance(cp_size, int | np.integer):
        raise ValueError(f"cp_size must be an integer, got {cp_size!r}")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if cp_size > MAX_CP_SIZE:
        raise ValueError(
            f"cp_size = {cp_size} is above MAX_CP_SIZE = 2**16 = {MAX_CP_SIZE}, the most ranks "
            "of one CP group"
        )
    n = chunks_per_rank * cp_size
    multiple = "cp_size" if chunks_per_rank == 1 else f"{chunks_per_rank} * cp_size"
    if context_len % cp_size:
        raise DivisibilityError(
            f"context_len = {context_len} is not divisible by cp_size = {cp_size}: every rank must "
            f"hold exactly context_len / cp_size tokens",
            context_len, n, multiple,
        )  # fmt: skip
    if context_len % n:
        raise DivisibilityError(
            f"context_len = {context_len} is not divisible by {chunks_per_rank} * cp_size = {n}, "
            "which this layout needs",
            context_len, n, multiple, f"{chunks_per_rank} equal chunks per rank",
        )  # fmt: skip


def check_context_len(context_len: int, cp_size: int, chunks_per_rank: int = 1) -> None:
    """:func:`check_cp_args` for a command that has no pad option (``flashcp-table2``,
    ``flashcp-sensitivity``): a ``context_len`` the layout cannot divide is refused naming the
    nearest valid ones (:meth:`DivisibilityError.context_fix`), not the planners' ``num_pad``.

    Raises:
        ValueError: naming the bad value.
    """
    try:
        check_cp_args(int(context_len), cp_size, chunks_per_rank)
    except DivisibilityError as exc:
        raise ValueError(exc.context_fix()) from None


class DivisibilityError(ValueError):
    """:func:`check_cp_args`: ``context_len`` (pad included) not divisible as the layout needs.

    The message names the planners' arguments (``num_pad``, ``pad_to_multiple``); a command
    names its own options with :meth:`with_fix` (e.g. ``--num-pad`` for ``flashcp plan``,
    :meth:`context_fix` where only ``context_len`` can change). Attributes: ``context_len``,
    ``multiple`` (the number it must divide by), ``multiple_text`` (``cp_size`` or
    ``2 * cp_size``) and ``more_pad`` (the fewest pad tokens to add).
    """

    def __init__(
        self, reason: str, context_len: int, multiple: int, multiple_text: str, note: str = ""
    ):
        self.reason, self.note, self.context_len = reason, note, int(context_len)
        self.multiple, self.multiple_text = int(multiple), multiple_text
        self.more_pad = -self.context_len % self.multiple
        super().__init__(
            self.with_fix(
                f"pad to a multiple of {multiple_text} = {multiple}: num_pad = {self.more_pad}, "
                "or pad_to_multiple=True"
            )
        )

    def with_fix(self, fix: str) -> str:
        """The message with ``fix`` (the command's own remedy) in place of the planners'."""
        return f"{self.reason} ({self.note}; {fix})" if self.note else f"{self.reason} ({fix})"

    def context_fix(self, option: str = "context_len") -> str:
        """The message for a command whose only remedy is another ``option`` value: the
        nearest multiples of :attr:`multiple` (``use context_len = 16384 or 16392``)."""
        lo = self.context_len // self.multiple * self.multiple
        near = f"{lo} or {lo + self.multiple}" if lo else f"{self.multiple}"
        return self.with_fix(f"use {option} = {near}")


def kv_bytes(tokens: Any, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> Any:
    """Bytes of K and V for ``tokens`` tokens: tokens x 2 x num_kv_heads x head_dim x dtype_bytes.

    docs/design.md §2 ("bytes"). Training moves this twice per pass direction (forward all-gather
    of KV, backward reduce-scatter of dK/dV); callers apply that factor.
    """
    return tokens * 2 * num_kv_heads * head_dim * dtype_bytes


#: types :func:`json_value` returns as they are
_JSON_SCALARS = frozenset({type(None), bool, int, float, str})


def json_value(value: Any, where: str = "value") -> Any:
    """``value`` as plain JSON types, so that ``json.loads(json.dumps(v)) == v``.

    NumPy scalars become Python ``int`` / ``float`` / ``bool`` / ``str``, arrays and tuples
    become lists, ``str`` subclasses (enums) become ``str``; dicts and lists are converted
    recursively. :class:`Plan` passes its ``info`` through here, so every plan is JSON-clean
    whatever types its planner computed with (``numpy.int64`` from NumPy ``doc_lens``, ...).

    Args:
        value: None, bool, int, float, str, a NumPy scalar or array, or a list / tuple / dict
            (string keys) of those.
        where: the value's name in error messages.
    Returns:
        the converted value (a new container; ``value`` is not modified).
    Raises:
        ValueError: a dict key that is not a string, or a value of another type (names
            ``where`` and the type).
    """
    kind = type(value)
    if kind in _JSON_SCALARS:  # the common cases first: plans are built in hot loops
        return value
    if kind is list and all(type(v) in _JSON_SCALARS for v in value):
        return list(value)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, np.generic | np.ndarray):
        return json_value(value.tolist(), where)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str.__str__(value)  # the text itself, also of a str enum
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise ValueError(f"{where} has a key {key!r} that is not a string")
        return {str(k): json_value(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ValueError(f"{where} = {value!r} ({type(value).__name__}) is not a JSON value")
