"""Layout building blocks shared by the planners: cutting the packed sequence into equal chunks,
and cutting documents into 2N chunks (the Per-Doc layout) with remainders spread over ranks.

Both return shard columns ``(rank, doc, start, length)`` in each rank's local order, ready for
:func:`flashcp.plan.make_plan`.
"""

from __future__ import annotations

import numpy as np

from flashcp import compiled
from flashcp.plan import cu_seqlens

__all__ = ["MAX_PER_DOC_CHUNKS", "per_doc_chunk_sizes", "per_doc_columns", "split_packed"]

#: the most chunks :func:`per_doc_chunk_sizes` cuts (documents x 2 * cp_size; its (documents,
#: 2N) int64 sizes then take at most 1 GiB): 2**27. The fused per-document kernels
#: (:mod:`flashcp.plan.kernels`) hold only the non-empty chunks and do not need it
MAX_PER_DOC_CHUNKS = 2**27


def split_packed(doc_lens: np.ndarray, num_chunks: int, num_pad: int = 0) -> tuple[np.ndarray, ...]:
    """Cut the packed sequence (documents, then ``num_pad`` pad tokens) into equal chunks.

    Args:
        doc_lens: (n_docs,) int64, C - num_pad tokens in all, C divisible by ``num_chunks``.
        num_chunks: number of equal chunks.
        num_pad: pad tokens after the last document (docs/design.md §2).
    Returns:
        ``(chunk, doc, start, length, chunk_pad)``: the first four (n_pieces,) int64 each, pieces
        in packed order, a piece being the intersection of one chunk with one document;
        ``chunk_pad`` (num_chunks,) int64, pad tokens of each chunk (the last chunks hold them).
    """
    kernels = compiled.load("plan")
    if kernels is not None and type(doc_lens) is np.ndarray and doc_lens.dtype == np.int64:
        total = int(doc_lens.sum()) + int(num_pad)
        if total >= num_chunks and total % num_chunks == 0:  # the planners' case
            cols, chunk_pad = kernels.split_packed(doc_lens, int(num_chunks), int(num_pad))
            return (*cols, chunk_pad)
    cu = cu_seqlens(doc_lens)
    real = int(cu[-1])
    size = (real + int(num_pad)) // num_chunks
    bounds = np.arange(num_chunks + 1, dtype=np.int64) * size
    cuts = np.union1d(cu, bounds[bounds < real])  # sorted, unique, within the documents
    pos, length = cuts[:-1], np.diff(cuts)
    chunk = pos // size if size else pos
    doc = np.searchsorted(cu, pos, side="right") - 1
    chunk_pad = bounds[1:] - np.clip(bounds[:-1], real, None)
    return chunk, doc, pos - cu[doc], length, np.clip(chunk_pad, 0, None)


def per_doc_chunk_sizes(
    doc_lens: np.ndarray, cp_size: int, cursor: int = 0
) -> tuple[np.ndarray, int]:
    """Chunk sizes of the Per-Doc layout: every document cut into 2N contiguous chunks.

    Rank r holds chunks r and 2N-1-r of every document. A document of length d gives every chunk
    ``d // 2N`` tokens; its ``d % 2N`` remainder tokens go one per rank, round-robin over ranks with
    a cursor that carries over from document to document. A rank with two extra tokens in a
    document puts one in each of its chunks; a single extra token goes to its front chunk r and
    its back chunk 2N-1-r in turn, counted over the rank's extra tokens so far. When the remainders of all documents sum
    to a multiple of N (always true when the documents fill a context divisible by N) every rank
    ends with exactly the same number of tokens, with no padding. When every length divides by 2N
    the workload is perfectly balanced (WLB-LLM's Per-Doc sharding; docs/design.md §3).

    Args:
        doc_lens: (n_docs,) int64.
        cp_size: N.
        cursor: rank that receives the next remainder token.
    Returns:
        ``(sizes, cursor)``: sizes is (n_docs, 2N) int64, the length of chunk j of each document
        (possibly 0 for documents shorter than 2N); cursor is the rank after the last extra token.
    Raises:
        ValueError: n_docs x 2N above :data:`MAX_PER_DOC_CHUNKS`.
    """
    n = cp_size
    d = np.asarray(doc_lens, dtype=np.int64)
    if d.size * 2 * n > MAX_PER_DOC_CHUNKS:
        raise ValueError(
            f"a Per-Doc layout cuts each of these {d.size} documents into 2 * cp_size = {2 * n} "
            f"chunks: {d.size * 2 * n} chunks, above MAX_PER_DOC_CHUNKS = 2**27 = "
            f"{MAX_PER_DOC_CHUNKS} (1 GiB per int64 column); use a smaller cp_size or fewer "
            "documents per sequence"
        )
    kernels = compiled.load("plan")
    if kernels is not None and d.ndim == 1 and n >= 1:
        return kernels.per_doc_sizes(d, int(n), int(cursor))
    base, rem = d // (2 * n), d % (2 * n)
    first = (cursor + cu_seqlens(rem)[:-1]) % n  # (n_docs,) rank of each first extra token
    r = np.arange(n)
    # extra tokens of rank r for doc i: count of k in [0, rem_i) with (first_i + k) % n == r
    extra = rem[:, None] // n + (((r[None, :] - first[:, None]) % n) < (rem[:, None] % n))
    # a rank's single extra token alternates between its front and back chunk from one document to
    # the next, so short documents do not always give rank 0 the cheap first token
    prior = np.cumsum(extra, axis=0) - extra
    front = (extra + (prior % 2 == 0)) // 2
    back = extra - front
    sizes = np.empty((d.size, 2 * n), dtype=np.int64)
    sizes[:, :n] = base[:, None] + front
    sizes[:, n:] = base[:, None] + back[:, ::-1]  # chunk 2N-1-r belongs to rank r
    new_cursor = int((cursor + rem.sum()) % n) if d.size else cursor
    return sizes, new_cursor


def per_doc_columns(
    doc_ids: np.ndarray, sizes: np.ndarray, cp_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Shard columns of the Per-Doc layout for documents ``doc_ids`` with chunk ``sizes``.

    Args:
        doc_ids: (k,) int64, document indices, in the order each rank should hold them.
        sizes: (k, 2N) int64, from :func:`per_doc_chunk_sizes`.
        cp_size: N.
    Returns:
        ``(rank, doc, start, length)``, (N * k * 2,) int64 each, rank-major; within a rank, per
        document, chunk r then chunk 2N-1-r. Zero-length chunks are kept (``make_plan`` drops them).
    """
    n = cp_size
    starts = np.cumsum(sizes, axis=1) - sizes  # (k, 2N)
    r = np.arange(n)
    cols = np.stack([r, 2 * n - 1 - r], axis=1)  # (N, 2): the two chunks of rank r
    length = sizes[:, cols].transpose(1, 0, 2)  # (N, k, 2)
    start = starts[:, cols].transpose(1, 0, 2)
    k = len(doc_ids)
    rank = np.broadcast_to(r[:, None, None], (n, k, 2))
    doc = np.broadcast_to(np.asarray(doc_ids, dtype=np.int64)[None, :, None], (n, k, 2))
    return rank.ravel(), doc.ravel(), start.ravel(), length.ravel()
