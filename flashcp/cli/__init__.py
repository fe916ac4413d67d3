"""Command-line tools outside the Hydra app: ``flashcp plan`` inspects one plan, ``flashcp
advise`` compares every method on a user's document lengths (:mod:`flashcp.cli.advise`).

Examples::

    flashcp plan --method per_doc --cp-size 2 --doc-lens 4,12 --json
    flashcp plan --method flashcp --cp-size 4 --doc-lens 9000,3000,500,4000 --context-len 16384 \\
        --target-imbalance 1.1
    flashcp plan --method llama3 --cp-size 8 --doc-lens-file lens.npy --context-len 131072
    flashcp plan --method flashcp --cp-size 4 --doc-lens 2999 --pad-to-multiple
    flashcp plan --method ring --cp-size 4 --doc-lens 16,24,0,0 --num-pad 24
    flashcp plan --method usp --cp-size 8 --doc-lens 4096 --option ulysses_degree=4 --num-heads 32 \\
        --num-kv-heads 8
    flashcp plan --method flashcp_refined --cp-size 4 --doc-lens 9000,3000,500,4000 \\
        --option num_candidates=4
    flashcp advise --lengths lens.txt --cp-size 8 --model h32kv8 --hardware h100_sxm
    flashcp advise --dataset pile --cp-size 4 --mode infer --methods flashcp,zigzag --out adv/

``--context-len C`` packs the lengths the way the sampler does (documents appended in order until
C tokens are full, the last one cut; fewer than C tokens in all is an error); a document longer
than C is first split into pieces of at most C tokens (``--overlong split``, the rule of every
command; ``cut`` or ``error`` on request), and how many is reported on stderr. Without it the
lengths are used as given and C is their sum. Zero-length documents (a repeated ``cu_seqlens``
offset) are skipped. ``--num-pad P`` adds P pad tokens after the last document and
``--pad-to-multiple`` the fewest the layout needs (N, or 2N for ``llama3``); pad tokens belong
to no document and cost no work (docs/design.md §2).

Bad input (non-integer or negative lengths, ``cp_size`` < 1, C not divisible as the layout needs
with padding off, an unknown method, an option the method does not take, with ``--num-heads`` a
Ulysses degree the heads do not allow) exits with status 2 and
one line on stderr naming the bad value. The checks themselves live in the library (``ValueError``);
this module only reports them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np

from flashcp.data import (
    DATASETS,
    OVERLONG_POLICIES,
    apply_overlong,
    overlong_note,
    read_lengths_file,
)
from flashcp.kinds import CommKind
from flashcp.plan import DivisibilityError, Plan, check_doc_lens
from flashcp.registry import (
    check_options,
    comm_kind_of,
    get_planner,
    method_names,
    options_schema,
    split_options,
)

__all__ = ["format_table", "main", "pack_doc_lens", "parse_doc_lens", "parse_options"]

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def parse_doc_lens(text: str) -> list[int]:
    """Parse ``"4,12"`` (items separated by commas, lengths within an item by whitespace: ``"4 12"``
    and ``"4, 12"`` too) into a list of ints.

    Raises:
        ValueError: an empty ``text`` (no document: ``--doc-lens 0`` plans an empty sequence), an
            empty item (``100,,200``, a trailing comma) or a token that is not an integer (named).
    """
    if not text.strip():
        raise ValueError("--doc-lens is empty: give the document lengths, e.g. --doc-lens 4,12")
    out = []
    for i, item in enumerate(text.split(",")):
        tokens = item.split()
        if not tokens:
            raise ValueError(
                f"--doc-lens {text!r}: item {i + 1} is empty (two commas in a row, or a comma at "
                "an end); give one length between commas"
            )
        for token in tokens:
            try:
                out.append(int(token))
            except ValueError:
                raise ValueError(f"--doc-lens: {token!r} is not an integer") from None
    return out


def pack_doc_lens(
    doc_lens,
    context_len: int,
    *,
    overlong: str = "split",
    source: str | None = None,
    num_pad: int = 0,
) -> tuple[np.ndarray, dict[str, int]]:
    """Pack documents into one sequence of exactly ``context_len - num_pad`` tokens (``num_pad``
    pad tokens complete ``context_len``, which counts pad as the planners do), as the sampler
    does.

    Documents longer than ``context_len`` are first handled by the ``overlong`` rule every
    command applies (:func:`flashcp.data.apply_overlong`: ``split`` into pieces of at most C
    tokens, ``cut`` to C, or ``error``). Then documents are taken in order until ``context_len``
    tokens are full; the last one taken is cut to fit, and later ones are dropped.

    Args:
        doc_lens: (n,) int, document lengths (validated by the library).
        context_len: C >= 1.
        overlong: ``split`` | ``cut`` | ``error`` (``flashcp plan --overlong``).
        source: where the lengths came from, for messages.
        num_pad: pad tokens after the documents (``flashcp plan --num-pad``), 0 <= P < C.
    Returns:
        packed: (k,) int64, the packed lengths, summing to ``context_len - num_pad``;
        counts: ``{"overlong_docs", "overlong_tokens_cut"}`` in the packed sequence: documents
        (pieces under ``split``) from a document longer than C, and tokens the ``cut`` discarded.
    Raises:
        ValueError: bad lengths, ``context_len`` < 1, ``num_pad`` outside ``[0, C)``, lengths
            summing to less than ``C - num_pad`` (the message names the ``--num-pad`` that fills
            the sequence, and leaving out ``--context-len``), an unknown ``overlong`` rule, or
            ``overlong = "error"`` with a document longer than C.
    """
    d = check_doc_lens(doc_lens)
    if context_len < 1:
        raise ValueError(f"context_len must be >= 1, got {context_len}")
    if not 0 <= num_pad < context_len:
        raise ValueError(
            f"--num-pad {num_pad} must be >= 0 and leave room for documents in --context-len "
            f"{context_len} (pad counts in it)"
        )
    d, long, cut, _ = apply_overlong(d, context_len, overlong, option="--overlong", source=source)
    cu = np.cumsum(d)
    docs = context_len - num_pad  # the document tokens of the sequence
    if d.size == 0 or cu[-1] < docs:
        have = int(d.sum())
        less = f" less num_pad = {num_pad}" if num_pad else ""
        raise ValueError(
            f"{f'{source}: ' if source else ''}doc_lens sum to {have}, fewer than "
            f"context_len = {context_len}{less}: not enough tokens to fill the sequence; pad "
            f"the rest with --num-pad {context_len - have} (pad counts in --context-len), or "
            f"leave out --context-len (C = their sum, {have})"
        )
    k = int(np.searchsorted(cu, docs))  # first document that reaches C - num_pad
    packed = d[: k + 1].copy()
    packed[k] -= int(cu[k]) - docs
    counts = {
        "overlong_docs": int(long[: k + 1].sum()),
        "overlong_tokens_cut": int(cut[: k + 1].sum()),
    }
    return packed, counts


def _shard_text(doc: int, start: int, length: int) -> str:
    return f"{doc}:{start}+{length}"


def _comm_kind(plan: Plan) -> CommKind:
    """How ``plan``'s method moves KV (sharding-aware for a method the registry does not know)."""
    return comm_kind_of(plan.method, default=CommKind.ALLGATHER_SHARDED)


def _na(value, fmt: str = "{}") -> str:
    """A summary metric as text: ``n/a`` where it does not apply (None)."""
    return "n/a" if value is None else fmt.format(value)


def format_table(plan: Plan) -> str:
    """A readable view of a plan: its metrics, then per rank tokens, workload and shards.

    Shards are written ``doc:start+length`` in the order the rank holds them, then ``pad:P`` for
    a rank's pad tokens.
    """
    s = plan.summary(_comm_kind(plan))
    lines = [
        f"method {s['method']}  cp_size {s['cp_size']}  context_len {s['context_len']}  "
        f"docs {s['num_docs']}  num_pad {s['num_pad']}  status {s['status']}",
        f"imbalance_ratio {s['imbalance_ratio']:.4f}  comm_tokens {_na(s['comm_tokens'])}  "
        f"comm_tokens_full {_na(s['comm_tokens_full'])}  "
        f"comm_saving {_na(s['comm_saving'], '{:.1%}')}  "
        f"num_pieces {s['num_pieces']}",
    ]
    tok, wl = plan.tokens_per_rank, plan.workload_per_rank
    wl_width = max(len("workload"), len(str(int(wl.max()))))
    tok_width = max(len("tokens"), len(str(int(tok.max()))))
    lines.append(
        f"{'rank':>4}  {'tokens':>{tok_width}}  {'workload':>{wl_width}}  shards (doc:start+len)"
    )
    for r, shards in enumerate(plan.ranks()):
        text = " ".join(_shard_text(*sh) for sh in shards)
        if plan.pad[r]:
            text = f"{text} pad:{int(plan.pad[r])}".lstrip()
        lines.append(f"{r:>4}  {int(tok[r]):>{tok_width}}  {int(wl[r]):>{wl_width}}  {text}")
    return "\n".join(lines)


def _takes_target(method: str) -> bool:
    """Whether ``method``'s planner has a ``target_imbalance`` option (flashcp and its variants)."""
    return "target_imbalance" in {f.name for f in dataclasses.fields(options_schema(method))}


def parse_options(items: Sequence[str]) -> dict[str, Any]:
    """Parse ``--option KEY=VALUE`` arguments into a dict; a value is read as a YAML scalar
    (``1.1`` a float, ``null`` None, ``highs`` a string).

    Raises:
        ValueError: an item without ``=`` or with an empty key (named).
    """
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--option takes KEY=VALUE, got {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def _json_default(obj):
    """JSON for numpy scalars and arrays a planner may leave in ``Plan.info``."""
    if isinstance(obj, np.generic | np.ndarray):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def _plan_command(args: argparse.Namespace) -> int:
    """``flashcp plan``: build one plan and print it (JSON or table)."""
    planner = get_planner(args.method)
    if args.doc_lens_file is not None:
        doc_lens = read_lengths_file(args.doc_lens_file)
        source = f"length file {args.doc_lens_file}"
    else:
        doc_lens = parse_doc_lens(args.doc_lens)
        source = "--doc-lens"
    counts = {"overlong_docs": 0, "overlong_tokens_cut": 0}
    if args.num_pad < 0:
        raise ValueError(f"--num-pad must be >= 0, got {args.num_pad}")
    if args.context_len is not None:
        doc_lens, counts = pack_doc_lens(
            doc_lens, args.context_len, overlong=args.overlong, source=source,
            num_pad=args.num_pad,
        )  # fmt: skip
        note = overlong_note(counts, args.overlong, args.context_len, source, "--overlong")
        if note:
            print(f"flashcp plan: {note}", file=sys.stderr)
    options = check_options(args.method, parse_options(args.option))
    if args.target_imbalance is not None:
        if not _takes_target(args.method):
            takers = ", ".join(m for m in method_names() if _takes_target(m))
            raise ValueError(
                f"--target-imbalance applies only to {takers}, not to method {args.method!r}"
            )
        given = options.get("target_imbalance")
        if given is not None and float(given) != float(args.target_imbalance):
            raise ValueError(
                f"--target-imbalance {args.target_imbalance} and --option "
                f"target_imbalance={given} disagree; give one of them"
            )
        options["target_imbalance"] = args.target_imbalance
    try:
        plan = planner(
            doc_lens, args.cp_size, num_pad=args.num_pad, pad_to_multiple=args.pad_to_multiple,
            **split_options(args.method, options)[0],  # op options do not change the plan
        )  # fmt: skip
    except DivisibilityError as exc:  # name this command's options, not the planner's
        raise ValueError(
            exc.with_fix(
                f"pad to a multiple of {exc.multiple_text} = {exc.multiple}: --num-pad "
                f"{args.num_pad + exc.more_pad}, or --pad-to-multiple"
            )
        ) from None
    if args.num_kv_heads is not None and args.num_heads is None:
        raise ValueError("--num-kv-heads needs --num-heads (the query heads)")
    if args.num_heads is not None:  # a head-parallel method's degree against the heads
        from flashcp.config import check_method_heads

        hkv = args.num_heads if args.num_kv_heads is None else args.num_kv_heads
        check_method_heads(args.method, options, args.cp_size, args.num_heads, hkv, plan)
    if args.json:
        out = {**plan.to_dict(_comm_kind(plan)), "overlong": args.overlong, **counts}
        print(json.dumps(out, indent=2, default=_json_default))
    else:
        print(format_table(plan))
    return 0


def _advise_command(args: argparse.Namespace) -> int:
    """``flashcp advise``: every method's predicted step time on the given lengths; one table
    printed, the table, rows and breakdown figure written to ``--out``."""
    from flashcp.cli.advise import advise, format_report, load_model, write_outputs
    from flashcp.results import check_output_dir

    check_output_dir(args.out, f"--out {args.out}")  # before any work, not after it
    shape = load_model(
        args.model, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
    )  # fmt: skip
    methods = None
    if args.methods is not None:
        methods = [m for m in re.split(r"[,\s]+", args.methods.strip()) if m]
        if not methods:
            raise ValueError("--methods: give at least one method")
    method_options: dict[str, dict[str, Any]] = {}
    for key, value in parse_options(args.option).items():
        method, dot, name = key.partition(".")
        if not dot or not method or not name:
            raise ValueError(
                f"--option takes METHOD.KEY=VALUE (e.g. ilp.time_limit_s=5), got {key!r}"
            )
        method_options.setdefault(method, {})[name] = value
    df = advise(
        cp_size=args.cp_size, lengths=args.lengths, dataset=args.dataset,
        context_len=args.context_len, num_sequences=args.num_sequences, seed=args.seed,
        model=shape, hardware=args.hardware, mode=args.mode, methods=methods,
        method_options=method_options, num_draws=args.draws, draw_sequences=args.draw_sequences,
        overlong=args.overlong, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
        placement=args.placement,
    )  # fmt: skip
    s = df.attrs["setup"]
    note = overlong_note(s, args.overlong, args.context_len, s["source"], "--overlong")
    if note:
        print(f"flashcp advise: {note}", file=sys.stderr)
    paths = write_outputs(df, args.out)
    print(format_report(df))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _add_advise_parser(sub) -> None:
    """The ``advise`` subcommand's options."""
    a = sub.add_parser(
        "advise",
        help="predict every method's step time on your document lengths (one table, one figure)",
        description="Sample packed sequences from a length file or a dataset, plan them with "
        "every method and price them with the simulator: step time, speedup over llama3 with "
        "its range over the hardware constants' uncertainty, imbalance, bytes per rank, and a "
        "figure of where the time goes (docs/advise.md).",
    )
    src = a.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--lengths",
        metavar="PATH",
        help="file of document lengths (as dataset=file reads: text, CSV, Parquet, JSON, .npy)",
    )
    named = ", ".join(str(x) for x in DATASETS if str(x) != "file")  # file: that is --lengths
    src.add_argument("--dataset", metavar="NAME", help=f"a named dataset: {named}")
    a.add_argument("--cp-size", type=int, required=True, help="number of CP ranks N (>= 1)")
    a.add_argument("--context-len", type=int, default=131072, help="tokens per packed sequence")
    a.add_argument("--num-sequences", type=int, default=1000, help="sequences sampled")
    a.add_argument(
        "--overlong",
        choices=OVERLONG_POLICIES,
        default="split",
        help="a document longer than --context-len: split into pieces of at most that many "
        "tokens (default), cut to it, or error; how many is reported on stderr and in advise.csv",
    )
    a.add_argument("--seed", type=int, default=0, help="seed of the sampler and of the draws")
    a.add_argument("--model", default="h32", help="model config (conf/model: h16, h32, h32kv8)")
    a.add_argument("--num-heads", type=int, help="query heads (replaces the model's)")
    a.add_argument("--num-kv-heads", type=int, help="KV heads (replaces the model's)")
    a.add_argument("--head-dim", type=int, help="head dimension (replaces the model's)")
    a.add_argument(
        "--hardware", default="h100_sxm", help="hardware profile (conf/hardware), calibrated"
    )
    a.add_argument("--mode", choices=("train", "infer"), default="train", help="default train")
    a.add_argument(
        "--methods",
        help="comma-separated methods (llama3 is always added); default: every registered "
        "method that applies at this cp_size, the ILP excepted (too slow)",
    )
    a.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="METHOD.KEY=VALUE",
        help="a planner option of a compared method, repeatable (e.g. --methods ilp --option "
        "ilp.time_limit_s=5: the ILP takes up to 60 s per sequence by default)",
    )
    a.add_argument(
        "--nodes",
        type=int,
        help="nodes the CP group spans (default: as few as --placement allows; docs/multinode.md)",
    )
    a.add_argument(
        "--gpus-per-node", type=int, help="GPUs per node (default: the hardware profile's, 8)"
    )
    a.add_argument(
        "--placement",
        choices=("consecutive", "strided"),
        default="consecutive",
        help="CP rank r on node r // (N / nodes) (consecutive, default) or r %% nodes (strided)",
    )
    a.add_argument("--draws", type=int, default=16, help="joint draws of the hardware constants")
    a.add_argument(
        "--draw-sequences", type=int, default=64, help="sequences priced per draw (the first ones)"
    )
    a.add_argument("--out", default="advise", metavar="DIR", help="output folder (default advise/)")
    a.set_defaults(func=_advise_command)


def build_parser() -> argparse.ArgumentParser:
    """The ``flashcp`` argument parser (subcommands ``plan`` and ``advise``)."""
    parser = _Parser(prog="flashcp", description="FlashCP harness tools.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser(
        "plan",
        help="plan one packed sequence and print the shards of every rank",
        description="Plan one packed sequence with one method and print the plan.",
    )
    p.add_argument(
        "--method",
        required=True,
        choices=method_names(),
        metavar="METHOD",
        help=f"planner: one of {', '.join(method_names())}",
    )
    p.add_argument("--cp-size", type=int, required=True, help="number of CP ranks N (>= 1)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--doc-lens", help="document lengths in tokens, comma-separated, e.g. 4,12")
    src.add_argument(
        "--doc-lens-file",
        metavar="PATH",
        help="file of document lengths: .npy, text (one per line), CSV, Parquet or JSON (column doc_len)",
    )
    p.add_argument(
        "--context-len",
        type=int,
        help="pack the documents into exactly this many tokens, --num-pad included (the last "
        "one cut); default: use the lengths as given (C = their sum, plus --num-pad)",
    )
    p.add_argument(
        "--overlong",
        choices=OVERLONG_POLICIES,
        default="split",
        help="with --context-len, a document longer than it: split into pieces of at most C "
        "tokens (default), cut to C, or error; how many is reported on stderr and in --json",
    )
    p.add_argument(
        "--target-imbalance",
        type=float,
        help="flashcp and flashcp_refined: imbalance ratio to reach (default 1.05; 1.02 refined)",
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a planner option, repeatable (e.g. --option num_candidates=8); an option the method "
        "does not take is an error that lists the ones it does",
    )
    p.add_argument(
        "--num-pad",
        type=int,
        default=0,
        metavar="P",
        help="pad tokens after the last document (no document's; no work, never sent); with "
        "--context-len they count in it",
    )
    p.add_argument(
        "--pad-to-multiple",
        action="store_true",
        help="add the fewest pad tokens that make C divisible as the layout needs "
        "(N; 2N for llama3)",
    )
    p.add_argument(
        "--num-heads",
        type=int,
        metavar="H",
        help="query heads of the model: a head-parallel method (ulysses, usp, flashcp_ulysses) "
        "whose Ulysses degree they do not allow is refused, naming the nearest valid degrees",
    )
    p.add_argument(
        "--num-kv-heads",
        type=int,
        metavar="HKV",
        help="KV heads of the model (default: --num-heads); needs --num-heads",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_plan_command)
    _add_advise_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``flashcp`` console script.

    Returns:
        0 on success, 2 on bad input (one line on stderr).
    """
    try:
        parser = build_parser()  # lists the registered methods: a bad declaration raises here
    except ValueError as exc:
        print(f"flashcp: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors (status 2) and --help (status 0)
        return int(exc.code or 0)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"flashcp {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # output piped into e.g. `head`, which closed early: not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
