"""Documents longer than the context, and the one sampler every experiment uses.

The ``overlong`` rule (:data:`OVERLONG_POLICIES`, default ``split``) is one function,
:func:`apply_overlong`, used by every command: ``flashcp-run``, ``flashcp-table2`` and
``flashcp-sensitivity`` (``dataset.overlong``) through :func:`sample_dataset`, ``flashcp advise``
(``--overlong``) through the same sampler, and ``flashcp plan --context-len`` (``--overlong``) on
the file's documents in order. Each command reports what the rule did with
:func:`overlong_note` (one line) and the counts ``overlong_docs`` / ``overlong_tokens_cut`` in its
rows or JSON.

:func:`sample_dataset` is how the experiments sample their sequences, so the same dataset, seed
and context give the same sequences in every table and figure. Each draw is capped at ``cap``
tokens (default 4 x C) and then, when still longer than the context C, handled by the rule
(:class:`OverlongDocs`); the tokens the cap and the rule discard are counted per sequence
(``overlong_tokens_cut``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

__all__ = [
    "OVERLONG_POLICIES",
    "OverlongDocs",
    "apply_overlong",
    "check_overlong_policy",
    "overlong_note",
    "sample_dataset",
]

#: what happens to a document longer than the context (:class:`flashcp.config.Overlong`)
OVERLONG_POLICIES = ("split", "cut", "error")


def check_overlong_policy(policy: Any, option: str = "dataset.overlong") -> str:
    """``policy`` as a string if it is one of :data:`OVERLONG_POLICIES`.

    Args:
        option: the setting's name in the calling command, for the message (``dataset.overlong``
            in the Hydra commands, ``--overlong`` on ``flashcp plan`` / ``flashcp advise``).
    Raises:
        ValueError: an unknown policy, naming it and the valid ones.
    """
    if str(policy) not in OVERLONG_POLICIES:
        raise ValueError(f"{option} = {policy!r}; choose one of {', '.join(OVERLONG_POLICIES)}")
    return str(policy)


def apply_overlong(
    doc_lens: Any, context_len: int, policy: str, *, option: str = "dataset.overlong", source=None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The overlong rule on documents in order: each document of d > C = ``context_len`` tokens

    * ``split``: becomes ceil(d / C) consecutive documents (C tokens each, the rest last), as a
      training data loader that streams documents into sequences does;
    * ``cut``: is cut to C tokens, the rest discarded;
    * ``error``: is refused (ValueError naming it, before any work).

    Args:
        doc_lens: (n,) int document lengths, >= 0.
        context_len: C >= 1, tokens.
        policy: ``split`` | ``cut`` | ``error``.
        option, source: the setting's name and where the lengths came from (a file), for messages.
    Returns:
        lengths: (m,) int64, each <= C (m >= n under ``split``, m = n otherwise);
        long: (m,) bool, the documents (pieces under ``split``) that came from a document longer
        than C; cut: (m,) int64 tokens each one lost to the rule (``cut`` only, else zeros);
        doc: (m,) int64 index in ``doc_lens`` of the document each one came from.
    Raises:
        ValueError: an unknown policy, ``context_len`` < 1, a length that is not an integer >= 0,
            or ``error`` with a document longer than C (its index and length, and ``source``).
    """
    policy = check_overlong_policy(policy, option)
    c = int(context_len)
    if c < 1:
        raise ValueError(f"context_len must be >= 1, got {context_len}")
    where = f"{source}: " if source is not None else ""
    raw = np.asarray(doc_lens).reshape(-1)
    if raw.dtype.kind not in "iu" and (
        raw.dtype.kind != "f" or not np.isfinite(raw).all() or (raw != np.round(raw)).any()
    ):
        raise ValueError(f"{where}document lengths must be integers, got {raw[:5].tolist()}...")
    d = raw.astype(np.int64)
    if d.size and d.min() < 0:
        i = int(np.argmin(d))
        raise ValueError(f"{where}document {i} has a negative length {int(d[i])}")
    over = d > c
    if policy == "error" and over.any():
        i = int(np.argmax(over))
        raise ValueError(
            f"{where}document {i} has {int(d[i])} tokens, longer than context_len = {c} "
            f"({int(over.sum())} of {d.size} documents are) and {_setting(option, 'error')}; "
            f"use {_setting(option, 'split')} (the default) or cut, or a larger context length"
        )
    if policy != "split":
        out = np.minimum(d, c)
        return out, over, d - out, np.arange(d.size)
    pieces = np.maximum(-(-d // c), 1)  # a zero-length document stays one (empty) document
    doc = np.repeat(np.arange(d.size), pieces)
    src = d[doc]
    first = np.cumsum(pieces) - pieces  # index of each document's first piece
    k = np.arange(src.size) - first[doc]  # piece number inside its document
    out = np.minimum(c, src - k * c)
    return out, src > c, np.zeros(out.size, np.int64), doc


def overlong_note(
    counts: Iterable[Mapping[str, int]] | Mapping[str, int], policy: str, context_len: int,
    source: str, option: str = "dataset.overlong",
) -> str | None:  # fmt: skip
    """The one line a command reports about documents longer than the context, or None when
    there were none.

    Args:
        counts: per sequence ``{"overlong_docs", "overlong_tokens_cut"}``
            (:meth:`OverlongDocs.per_sequence`, :func:`sample_dataset`), or one such dict.
        policy: the rule applied; context_len: C; source: what was read (a dataset or file);
        option: the setting's name in the command (``dataset.overlong`` or ``--overlong``).
    """
    counts = [counts] if isinstance(counts, Mapping) else list(counts)
    n = sum(int(x["overlong_docs"]) for x in counts)
    lost = sum(int(x["overlong_tokens_cut"]) for x in counts)
    if not n and not lost:
        return None
    c = int(context_len)
    if policy == "cut":
        return (
            f"{source}: {n} documents longer than context_len = {c} cut to it, {lost} tokens "
            f"discarded (overlong_tokens_cut; {_setting(option, 'split')} keeps them as "
            "consecutive documents)"
        )
    text = (
        f"{source}: {n} pieces of documents longer than context_len = {c} "
        f"({_setting(option, policy)}: split into pieces of at most {c} tokens)"
    )
    if lost:
        text += f"; {lost} tokens over the cap discarded (overlong_tokens_cut)"
    return text


def _setting(option: str, value: str) -> str:
    """``--overlong cut`` on a command line, ``dataset.overlong=cut`` in a Hydra override."""
    return f"{option} {value}" if option.startswith("-") else f"{option}={value}"


class OverlongDocs:
    """A length distribution whose draws are capped at ``cap`` and whose draws longer than
    ``context_len`` (C) are handled by ``policy`` (:func:`apply_overlong`: ``split``, ``cut``,
    or ``error``, which :meth:`check` raises before any work when the dataset has such documents).

    :meth:`sample` has the signature of :meth:`flashcp.data.LengthDistribution.sample` (its
    ``cap`` argument is the one given here; it draws the same random numbers as ``dist.sample``)
    and records, behind every length it returns, whether it came from a draw longer than C and
    the tokens its draw lost, so :meth:`per_sequence` can count the documents each sequence split
    or cut and the tokens the cap and the cut discarded.

    Args:
        dist: a :class:`flashcp.data.LengthDistribution`.
        context_len: C, tokens.
        policy: ``split`` | ``cut`` | ``error``.
        cap: largest single draw, tokens (None: 4 x C).
        option: the policy's setting in the calling command, for messages.
    Raises:
        ValueError: an unknown policy.
    """

    def __init__(
        self, dist: Any, context_len: int, policy: str, cap: int | None = None,
        option: str = "dataset.overlong",
    ):  # fmt: skip
        self.policy = check_overlong_policy(policy, option)
        self.dist, self.context_len, self.option = dist, int(context_len), option
        self.cap = 4 * self.context_len if cap is None else int(cap)
        self.name = dist.name
        self._long: list[np.ndarray] = []  # behind each returned length: from a draw > C
        self._lost: list[np.ndarray] = []  # tokens its draw lost (cap and cut), at its first piece

    def check(self) -> None:
        """Raise ValueError (policy ``error``) if a document can be longer than ``context_len``."""
        c = self.context_len
        share = 1.0 - float(self.dist.cdf(c))
        if self.policy == "error" and self.cap > c and share > 0:
            src = getattr(self.dist, "source", None)
            what = f"length file {src}" if src else f"dataset {self.name!r}"
            raise ValueError(
                f"{what} has documents longer than context_len = {c} "
                f"({100 * share:.3g}% of its documents) and {_setting(self.option, 'error')}; "
                f"use {_setting(self.option, 'split')} (the default) or cut"
                + (", or dataset.cap" if self.option == "dataset.overlong" else "")
            )

    def sample(
        self, rng: np.random.Generator, size: int, *, weighting: str, cap: int | None = None
    ) -> np.ndarray:
        """(m,) int64 lengths <= context_len (m >= size under ``split``). ``cap`` is ignored:
        the cap given at construction applies (the packer passes the same one)."""
        raw = self.dist.sample(rng, size, weighting=weighting, cap=None)
        d = np.minimum(raw, self.cap)
        out, long, cut, doc = apply_overlong(d, self.context_len, self.policy, option=self.option)
        first = np.ones(doc.size, bool)
        first[1:] = doc[1:] != doc[:-1]
        # the tokens a draw lost to the cap are counted once, at its first piece
        self._long.append(long)
        self._lost.append(cut + np.where(first, (raw - d)[doc], 0))
        return out

    def per_sequence(self, offsets: np.ndarray) -> list[dict[str, int]]:
        """Per sequence (``offsets``: (num_sequences + 1,) int64 of :func:`sample_packed`):

        * ``overlong_docs``: documents, or pieces of documents under ``split``, that came from a
          draw longer than context_len (after the cap);
        * ``overlong_tokens_cut``: tokens of its drawn documents discarded, by the cap (every
          policy: a 100,000-token draw at C = 16,384 keeps 4 x C = 65,536 under ``split``, losing
          34,464) and by cutting to C (``cut``: the same draw loses 83,616). The cut of each
          sequence's last document to fit is not counted (its rest is not a lost document).
        """
        n = int(offsets[-1])
        if not n:
            return [{"overlong_docs": 0, "overlong_tokens_cut": 0} for _ in offsets[:-1]]
        long = np.concatenate(self._long)[:n]
        lost = np.concatenate(self._lost)[:n]
        n_long = np.add.reduceat(long.astype(np.int64), offsets[:-1])
        n_cut = np.add.reduceat(lost, offsets[:-1])
        return [
            {"overlong_docs": int(a), "overlong_tokens_cut": int(b)}
            for a, b in zip(n_long, n_cut, strict=True)
        ]


def sample_dataset(
    dataset: str,
    num_sequences: int,
    context_len: int,
    *,
    seed: int,
    weighting: str = "documents",
    cap: int | None = None,
    overlong: str = "split",
    path: str | None = None,
    option: str = "dataset.overlong",
) -> tuple[list[np.ndarray], list[dict[str, int]]]:
    """The sequences of an experiment: ``num_sequences`` packed sequences of ``context_len``
    tokens from ``dataset`` (:func:`flashcp.data.load_distribution`; ``path`` for ``file``),
    each draw capped at ``cap`` (None: 4 x context_len) and handled by ``overlong``
    (:class:`OverlongDocs`). The defaults are ``flashcp-run``'s (:class:`flashcp.config.DatasetConfig`);
    ``option`` names the overlong setting of the calling command in messages.

    Returns:
        seqs: ``num_sequences`` arrays of (n_docs,) int64 document lengths, each summing to
            ``context_len``.
        counts: per sequence ``{"overlong_docs", "overlong_tokens_cut"}`` (:meth:`OverlongDocs.per_sequence`).
    Raises:
        ValueError: a bad dataset or argument, or ``overlong = "error"`` with a dataset that has
            documents longer than ``context_len``.
    """
    from flashcp.data.datasets import load_distribution
    from flashcp.data.packing import sample_packed

    c = int(context_len)
    check_overlong_policy(overlong, option)  # before reading any file
    dist = load_distribution(dataset, context_len=c, path=path)
    over = OverlongDocs(dist, c, overlong, cap, option=option)
    over.check()
    doc_lens, offsets = sample_packed(
        over, int(num_sequences), c, seed=int(seed), weighting=str(weighting), cap=over.cap
    )
    if len(offsets) == 1:
        return [], []
    return np.split(doc_lens, offsets[1:-1]), over.per_sequence(offsets)
