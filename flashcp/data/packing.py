"""Packing documents into sequences: the seeded sequence sampler (docs/design.md §5).

A training sequence of ``context_len`` (C) tokens is built by drawing documents i.i.d. from a
length distribution (:mod:`flashcp.data.distributions`) and appending them until C is full; the
last one is cut to fit. The remainder of a cut document is discarded: the next sequence starts
with a fresh draw.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from flashcp.data.distributions import LengthDistribution, _check_int, _check_weighting

__all__ = ["sample_packed", "sample_sequences"]

# Chunk sizes (documents per draw) used by the sequence sampler: they grow from the first to the
# last value and then stay there. They do not depend on how many sequences are asked for, so the
# first k sequences of a request are the same for every request of k or more sequences.
_FIRST_CHUNK = 1 << 12
_LAST_CHUNK = 1 << 20


def _check_seq_args(
    num_sequences: Any, context_len: Any, seed: Any, weighting: Any, cap: Any
) -> tuple[int, int, int, str, int]:
    n = _check_int(num_sequences, "num_sequences", 0)
    c = _check_int(context_len, "context_len", 1)
    s = _check_int(seed, "seed", 0)
    w = _check_weighting(weighting)
    cap = 4 * c if cap is None else _check_int(cap, "cap", 1)
    return n, c, s, w, cap


def sample_packed(
    dist: LengthDistribution,
    num_sequences: int,
    context_len: int,
    *,
    seed: int,
    weighting: str = "documents",
    cap: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Sample sequences and return them packed in two flat arrays (the fast form).

    Documents are drawn i.i.d. (``dist.sample(..., weighting, cap)``; ``cap`` defaults to
    ``4 * context_len``) in one stream from ``np.random.default_rng(seed)`` and appended to the
    current sequence until it holds ``context_len`` tokens; the last one is cut to fit and its rest
    is discarded. The stream is drawn in chunks whose sizes do not depend on ``num_sequences``, so a
    request for k sequences returns the first k of any longer request with the same arguments.

    Args:
        dist: the length distribution.
        num_sequences: number of sequences, >= 0.
        context_len: C, tokens per sequence, >= 1.
        seed: random seed, >= 0.
        weighting: ``"documents"`` or ``"tokens"``.
        cap: largest single draw in tokens (before cutting); default ``4 * context_len``.
    Returns:
        doc_lens: (total_docs,) int64, every sequence's document lengths in packed order.
        offsets: (num_sequences + 1,) int64; sequence i is ``doc_lens[offsets[i]:offsets[i+1]]``,
            which sums to exactly ``context_len``.
    Raises:
        ValueError: a bad argument, naming it.
    """
    n, c, seed, weighting, cap = _check_seq_args(num_sequences, context_len, seed, weighting, cap)
    rng = np.random.default_rng(seed)
    pieces: list[np.ndarray] = []
    counts: list[np.ndarray] = []
    pending = np.zeros(0, dtype=np.int64)  # draws not yet used (a started sequence)
    chunk, done = _FIRST_CHUNK, 0
    while done < n:
        buf = np.concatenate([pending, dist.sample(rng, chunk, weighting=weighting, cap=cap)])
        chunk = min(2 * chunk, _LAST_CHUNK)
        cs = np.cumsum(buf)  # (m,) tokens up to and including each draw
        cs_list = cs.tolist()
        m = len(cs_list)
        starts: list[int] = []
        ends: list[int] = []
        s, base = 0, 0  # base = tokens before draw s
        while done < n:
            e = bisect.bisect_left(cs_list, base + c, s)  # first draw reaching C tokens
            if e == m:
                break
            starts.append(s)
            ends.append(e)
            done += 1
            s = e + 1
            base = cs_list[e]
        pending = buf[s:]
        if not starts:
            continue
        st = np.asarray(starts, dtype=np.int64)
        en = np.asarray(ends, dtype=np.int64)
        # sequences are consecutive in the stream: draws st[0] .. en[-1]; cut each last draw
        seg = buf[st[0] : en[-1] + 1].copy()
        # tokens of each sequence before its last draw: cs[e-1] - cs[s-1]
        before_last = (cs[en] - buf[en]) - (cs[st] - buf[st])
        seg[en - st[0]] = c - before_last
        pieces.append(seg)
        counts.append(en - st + 1)
    doc_lens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    if counts:
        np.cumsum(np.concatenate(counts), out=offsets[1:])
    return doc_lens, offsets


def sample_sequences(
    dist: LengthDistribution,
    num_sequences: int,
    context_len: int,
    *,
    seed: int,
    weighting: str = "documents",
    cap: int | None = None,
) -> list[np.ndarray]:
    """Sample ``num_sequences`` packed sequences of exactly ``context_len`` tokens.

    Same arguments and semantics as :func:`sample_packed`.

    Returns:
        list of ``num_sequences`` arrays, each (n_docs,) int64 document lengths in packed order,
        each >= 1 and summing to exactly ``context_len``.
    """
    doc_lens, offsets = sample_packed(
        dist, num_sequences, context_len, seed=seed, weighting=weighting, cap=cap
    )
    if len(offsets) == 1:
        return []
    return np.split(doc_lens, offsets[1:-1])
