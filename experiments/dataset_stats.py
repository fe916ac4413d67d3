"""Per-sequence statistics of every dataset under every sampling variant, against the paper's words.

    python -m experiments.dataset_stats --out results/dataset_stats

The paper (§4) describes its data as "WLB-LLM is more skewed with extremely long documents, while
Pile and RedPajama contain more shorter sequences". Whether a sampled dataset matches that depends
on how sequences are packed (docs/design.md §5: ``documents`` or ``tokens`` weighting, or the
WLB-LLM code's own synthetic generator). This command samples each (dataset, variant) as
``flashcp-run`` does (:func:`flashcp.data.sample_dataset`, the same seed and defaults) and writes
``dataset_stats.csv`` and ``dataset_stats.md``: per variant, documents per sequence, the longest
document's share of the window, the causal work relative to one full-window document
(Σ d(d+1)/2 over C(C+1)/2, Eq. 3 summed), and the share of sequences holding a document longer
than half the window. The reading: datasets/README.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from flashcp.data import sample_dataset
from flashcp.results import check_output_dir, write_csv_atomic

#: (variant name, dataset, weighting): the variants the harness can sample for each named dataset
VARIANTS: tuple[tuple[str, str, str], ...] = (
    ("wlb_llm", "wlb_llm", "documents"),
    ("wlb_llm (tokens)", "wlb_llm", "tokens"),
    ("wlb_llm_synthetic", "wlb_llm_synthetic", "documents"),
    ("pile", "pile", "documents"),
    ("pile (tokens)", "pile", "tokens"),
    ("redpajama", "redpajama", "documents"),
    ("redpajama (tokens)", "redpajama", "tokens"),
)

COLUMNS = (
    "variant", "dataset", "weighting", "context_len", "num_sequences", "seed",
    "docs_per_seq_mean", "docs_per_seq_median", "longest_share_mean", "longest_share_median",
    "causal_work_rel_mean", "seqs_with_doc_over_half", "tokens_in_docs_under_half",
    "longest_share_max",
)  # fmt: skip


def sequence_stats(seqs: Sequence[np.ndarray], context_len: int) -> dict[str, float]:
    """Statistics of packed sequences.

    Args:
        seqs: per sequence an (n_docs,) integer array of document lengths summing to
            ``context_len`` (zero-length documents are not counted as documents).
        context_len: C, tokens per sequence (> 0).
    Returns:
        ``docs_per_seq_mean``/``_median`` (documents of length > 0), ``longest_share_mean``/
        ``_median`` (longest document / C), ``causal_work_rel_mean`` (Σ d(d+1)/2 / (C(C+1)/2):
        the document-masked causal work relative to one document filling the window, Eq. 3),
        ``seqs_with_doc_over_half`` (share of sequences with a document longer than C/2),
        ``tokens_in_docs_under_half`` (share of all tokens that sit in documents shorter than C/2:
        the WLB-LLM paper's "over 75%" for its production data), ``longest_share_max`` (the
        longest document of all / C).
    Raises:
        ValueError: no sequences, ``context_len`` < 1, or a sequence that does not sum to it.
    """
    c = int(context_len)
    if c < 1 or not len(seqs):
        raise ValueError(f"need sequences and context_len >= 1, got {len(seqs)} and {context_len}")
    docs, longest, work, over, under = [], [], [], [], 0
    full = c * (c + 1) / 2
    for i, s in enumerate(seqs):
        d = np.asarray(s, dtype=np.int64)
        if int(d.sum()) != c:
            raise ValueError(f"sequence {i} holds {int(d.sum())} tokens, not context_len = {c}")
        d = d[d > 0]
        docs.append(len(d))
        longest.append(d.max() / c)
        work.append(float((d * (d + 1) / 2).sum()) / full)
        over.append(bool((2 * d > c).any()))
        under += int(d[2 * d < c].sum())
    return {
        "docs_per_seq_mean": float(np.mean(docs)),
        "docs_per_seq_median": float(np.median(docs)),
        "longest_share_mean": float(np.mean(longest)),
        "longest_share_median": float(np.median(longest)),
        "causal_work_rel_mean": float(np.mean(work)),
        "seqs_with_doc_over_half": float(np.mean(over)),
        "tokens_in_docs_under_half": under / (c * len(seqs)),
        "longest_share_max": float(np.max(longest)),
    }


def dataset_stats(
    context_len: int = 131072,
    num_sequences: int = 1000,
    seed: int = 0,
    variants: Sequence[tuple[str, str, str]] = VARIANTS,
) -> pd.DataFrame:
    """One row of :func:`sequence_stats` per variant ``(name, dataset, weighting)``, each sampled
    by :func:`flashcp.data.sample_dataset` with ``flashcp-run``'s defaults (cap 4·C, overlong
    documents split). Raises what :func:`flashcp.data.sample_dataset` raises."""
    rows = []
    for name, dataset, weighting in variants:
        seqs = sample_dataset(dataset, num_sequences, context_len, seed=seed, weighting=weighting)[
            0
        ]
        rows.append(
            {
                "variant": name, "dataset": dataset, "weighting": weighting,
                "context_len": int(context_len), "num_sequences": int(num_sequences),
                "seed": int(seed), **sequence_stats(seqs, context_len),
            }
        )  # fmt: skip
    return pd.DataFrame(rows, columns=list(COLUMNS))


def to_markdown(df: pd.DataFrame) -> str:
    """The table of :func:`dataset_stats` as Markdown (three decimals, documents to one)."""
    head = (
        "| variant | docs / seq (mean, median) | longest doc / C (mean, median) "
        "| causal work / one full-window doc | seqs with a doc > C/2 | tokens in docs < C/2 "
        "| longest doc of all / C |\n|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r.variant} | {r.docs_per_seq_mean:.1f}, {r.docs_per_seq_median:.0f} "
        f"| {r.longest_share_mean:.3f}, {r.longest_share_median:.3f} "
        f"| {r.causal_work_rel_mean:.3f} | {r.seqs_with_doc_over_half:.3f} "
        f"| {r.tokens_in_docs_under_half:.3f} | {r.longest_share_max:.3f} |\n"
        for r in df.itertuples()
    )
    r0 = df.iloc[0]
    return (
        f"Sampled as `flashcp-run` samples (seed {r0.seed}, {r0.num_sequences} sequences of "
        f"{r0.context_len} tokens per variant): `python -m experiments.dataset_stats`.\n\n"
        + head
        + body
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.dataset_stats",
        description="Per-sequence statistics of every dataset under every sampling variant.",
    )
    ap.add_argument("--out", default="outputs/dataset_stats", help="folder to write (created)")
    ap.add_argument("--context-len", type=int, default=131072, help="C, tokens per sequence")
    ap.add_argument("--num-sequences", type=int, default=1000, help="sequences per variant")
    ap.add_argument("--seed", type=int, default=0, help="the sampler's seed (flashcp-run's)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    try:
        check_output_dir(out, f"--out {out}")  # before any work
        df = dataset_stats(args.context_len, args.num_sequences, args.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    write_csv_atomic(df, out / "dataset_stats.csv")
    md = to_markdown(df)
    (out / "dataset_stats.md").write_text(md)
    print(md, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
