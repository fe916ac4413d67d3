"""Documents longer than the context, and the one sampler every experiment uses.

:func:`sample_dataset` is how ``flashcp-run``, ``flashcp-table2`` and ``flashcp-sensitivity``
sample their sequences, so the same dataset, seed and context give the same sequences in every
table and figure. Each draw is capped at ``cap`` tokens (default 4 x C) and then, when still longer
than the context C, handled by the ``overlong`` policy (:class:`OverlongDocs`); the tokens the cap
and the policy discard are counted per sequence (``overlong_tokens_cut``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["OVERLONG_POLICIES", "OverlongDocs", "sample_dataset"]

#: what happens to a draw longer than the context (:class:`flashcp.config.Overlong`)
OVERLONG_POLICIES = ("split", "cut", "error")


class OverlongDocs:
    """A length distribution whose draws are capped at ``cap`` and whose draws longer than
    ``context_len`` (C) are handled by ``policy``.

    * ``split``: a document of d > C tokens becomes ceil(d / C) consecutive documents (C tokens
      each, the rest last), as a training data loader that streams documents into sequences does.
    * ``cut``: it is cut to C tokens and the rest is discarded.
    * ``error``: :meth:`check` raises before any work when the dataset has such documents.

    :meth:`sample` has the signature of :meth:`flashcp.data.LengthDistribution.sample` (its
    ``cap`` argument is the one given here; it draws the same random numbers as ``dist.sample``)
    and records the drawn length behind every length it returns, so :meth:`per_sequence` can
    count the documents each sequence split or cut and the tokens the cap and the cut discarded.

    Args:
        dist: a :class:`flashcp.data.LengthDistribution`.
        context_len: C, tokens.
        policy: ``split`` | ``cut`` | ``error``.
        cap: largest single draw, tokens (None: 4 x C).
    Raises:
        ValueError: an unknown policy.
    """

    def __init__(self, dist: Any, context_len: int, policy: str, cap: int | None = None):
        if policy not in OVERLONG_POLICIES:
            raise ValueError(
                f"dataset.overlong = {policy!r}; choose one of {', '.join(OVERLONG_POLICIES)}"
            )
        self.dist, self.context_len, self.policy = dist, int(context_len), str(policy)
        self.cap = 4 * self.context_len if cap is None else int(cap)
        self.name = dist.name
        self._drawn: list[np.ndarray] = []  # uncapped draw behind each returned length
        self._capped: list[np.ndarray] = []  # the same, capped

    def check(self) -> None:
        """Raise ValueError (policy ``error``) if a document can be longer than ``context_len``."""
        c = self.context_len
        share = 1.0 - float(self.dist.cdf(c))
        if self.policy == "error" and self.cap > c and share > 0:
            raise ValueError(
                f"dataset {self.name!r} has documents longer than context_len = {c} "
                f"({100 * share:.3g}% of its documents) and dataset.overlong = error; "
                "use dataset.overlong=split or cut, or dataset.cap"
            )

    def sample(
        self, rng: np.random.Generator, size: int, *, weighting: str, cap: int | None = None
    ) -> np.ndarray:
        """(m,) int64 lengths <= context_len (m >= size under ``split``). ``cap`` is ignored:
        the cap given at construction applies (the packer passes the same one)."""
        raw = self.dist.sample(rng, size, weighting=weighting, cap=None)
        d = np.minimum(raw, self.cap)
        c = self.context_len
        if self.policy == "split":
            pieces = -(-d // c)
            src = np.repeat(d, pieces)
            first = np.cumsum(pieces) - pieces  # index of each draw's first piece
            k = np.arange(src.size) - np.repeat(first, pieces)  # piece number inside its draw
            out = np.minimum(c, src - k * c)
            # the tokens a draw lost are counted once, at its first piece
            drawn = np.where(k == 0, np.repeat(raw, pieces), src)
        else:
            src, out, drawn = d, np.minimum(d, c), raw
        self._drawn.append(drawn)
        self._capped.append(src)
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
        c, n = self.context_len, int(offsets[-1])
        if not self._drawn:
            zeros = np.zeros(0, np.int64)
            drawn, capped = zeros, zeros
        else:
            drawn = np.concatenate(self._drawn)[:n]
            capped = np.concatenate(self._capped)[:n]
        # under split a draw's loss to the cap is on its first piece (the others are whole)
        kept = np.minimum(capped, c) if self.policy == "cut" else capped
        lost = drawn - kept
        long = capped > c
        if not n:
            return [{"overlong_docs": 0, "overlong_tokens_cut": 0} for _ in offsets[:-1]]
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
) -> tuple[list[np.ndarray], list[dict[str, int]]]:
    """The sequences of an experiment: ``num_sequences`` packed sequences of ``context_len``
    tokens from ``dataset`` (:func:`flashcp.data.load_distribution`; ``path`` for ``file``),
    each draw capped at ``cap`` (None: 4 x context_len) and handled by ``overlong``
    (:class:`OverlongDocs`). The defaults are ``flashcp-run``'s (:class:`flashcp.config.DatasetConfig`).

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
    over = OverlongDocs(load_distribution(dataset, context_len=c, path=path), c, overlong, cap)
    over.check()
    doc_lens, offsets = sample_packed(
        over, int(num_sequences), c, seed=int(seed), weighting=str(weighting), cap=over.cap
    )
    if len(offsets) == 1:
        return [], []
    return np.split(doc_lens, offsets[1:-1]), over.per_sequence(offsets)
