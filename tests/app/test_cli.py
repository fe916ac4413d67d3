"""Tests of the ``flashcp plan`` command line (run in-process, plus one real ``python -m flashcp``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flashcp.cli import main, pack_doc_lens
from flashcp.registry import COMM_KIND, make_plan_for
from flashcp.registry import FAST_METHODS as METHODS

REPO = Path(__file__).resolve().parents[2]
DEFAULTS = (("--method", "per_doc"), ("--cp-size", "2"))  # used where a bad-input case omits them
RING = "plan --method ring --cp-size 2 --doc-lens-file".split()


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run ``flashcp`` in-process; return (exit status, stdout, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys, *argv: str) -> dict:
    code, out, err = run_cli(capsys, "plan", *argv, "--json")
    assert code == 0, err
    assert err == ""
    return json.loads(out)


def assert_json_matches_plan(data: dict, plan) -> None:
    """The JSON carries the plan's metrics and every rank's shards in local order."""
    assert data["method"] == plan.method
    assert data["cp_size"] == plan.cp_size
    assert data["context_len"] == plan.context_len
    assert data["imbalance_ratio"] == pytest.approx(plan.imbalance_ratio)
    # what the method moves: Eq. 5 for sharding-aware methods, the full KV (Eq. 4) otherwise
    # (a head-parallel plan moves KV only across its groups: the metrics of its group plan)
    sharded = COMM_KIND[plan.method] == "allgather_sharded"
    across = plan.group_plan()
    moved = across.comm_tokens if sharded else across.comm_tokens_full
    if plan.moves_kv_tokens:
        assert data["comm_tokens"] == moved
        assert data["comm_tokens_sharded"] == across.comm_tokens
        assert data["comm_tokens_full"] == across.comm_tokens_full
        full = across.comm_tokens_full
        assert data["comm_saving"] == pytest.approx(1 - moved / full if full else 0.0)
        if not sharded:
            assert data["comm_saving"] == 0.0
    else:  # all-to-alls only (ulysses): the KV-token metrics do not apply
        kv_tokens = ("comm_tokens", "comm_tokens_full", "comm_saving", "comm_tokens_sharded")
        assert all(data[k] is None for k in kv_tokens)
    assert [r["rank"] for r in data["ranks"]] == list(range(plan.cp_size))
    assert data["num_pieces"] == across.num_pieces and data["num_pad"] == plan.num_pad
    for r, shards in enumerate(plan.ranks()):
        entry = data["ranks"][r]
        assert entry["tokens"] == int(plan.tokens_per_rank[r])
        assert entry["pad"] == int(plan.pad[r])
        assert entry["workload"] == int(plan.workload_per_rank[r])
        assert [(s["doc"], s["start"], s["length"]) for s in entry["shards"]] == [
            tuple(s) for s in shards
        ]


def test_issue_example_per_doc_json(capsys):
    data = plan_json(capsys, "--method", "per_doc", "--cp-size", "2", "--doc-lens", "4,12")
    # every document in 2N = 4 chunks; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert data["method"] == "per_doc" and data["cp_size"] == 2 and data["context_len"] == 16
    assert data["ranks"] == [
        {
            "rank": 0,
            "tokens": 8,
            "pad": 0,
            "workload": 44,
            "shards": [
                {"doc": 0, "start": 0, "length": 1},
                {"doc": 0, "start": 3, "length": 1},
                {"doc": 1, "start": 0, "length": 3},
                {"doc": 1, "start": 9, "length": 3},
            ],
        },
        {
            "rank": 1,
            "tokens": 8,
            "pad": 0,
            "workload": 44,
            "shards": [{"doc": 0, "start": 1, "length": 2}, {"doc": 1, "start": 3, "length": 6}],
        },
    ]
    assert data["imbalance_ratio"] == 1.0
    assert data["comm_tokens"] == data["comm_tokens_full"] == 8
    assert data["comm_saving"] == 0.0


@pytest.mark.parametrize("method", METHODS)
def test_json_matches_the_library_plan(capsys, method):
    lens = [300, 1, 1, 77, 1200, 5, 464]  # C = 2048
    data = plan_json(
        capsys, "--method", method, "--cp-size", "4", "--doc-lens", ",".join(map(str, lens))
    )
    assert_json_matches_plan(data, make_plan_for(method, lens, 4))


def test_llama3_json(capsys):
    data = plan_json(capsys, "--method", "llama3", "--cp-size", "2", "--doc-lens", "4, 12")
    assert [[tuple(s.values()) for s in r["shards"]] for r in data["ranks"]] == [
        [(0, 0, 4), (1, 8, 4)],
        [(1, 0, 8)],
    ]
    assert [r["workload"] for r in data["ranks"]] == [52, 36]


def test_context_len_packs_and_cuts(capsys):
    # 4 + 12 + 9 -> cut to 20: [4, 12, 4]; the document after the cut is dropped
    data = plan_json(
        capsys, *"--method ring --cp-size 2 --doc-lens 4,12,9,30 --context-len 20".split()
    )
    assert data["context_len"] == 20
    assert data["doc_lens"] == [4, 12, 4]
    assert_json_matches_plan(data, make_plan_for("ring", [4, 12, 4], 2))
    # exactly full: nothing cut
    data = plan_json(
        capsys, *"--method ring --cp-size 2 --doc-lens 4,12,9 --context-len 16".split()
    )
    assert data["doc_lens"] == [4, 12]


def test_pack_doc_lens():
    none = {"overlong_docs": 0, "overlong_tokens_cut": 0}
    for lens, c, packed, counts in [
        ([5, 5, 5], 12, [5, 5, 2], none),
        ([1, 1, 1], 3, [1, 1, 1], none),
        ([50], 8, [8], {"overlong_docs": 1, "overlong_tokens_cut": 0}),  # split: one piece taken
        ([3, 20, 2], 12, [3, 9], {"overlong_docs": 1, "overlong_tokens_cut": 0}),
    ]:
        got, n = pack_doc_lens(lens, c)
        np.testing.assert_array_equal(got, packed)
        assert n == counts
    got, n = pack_doc_lens([3, 20, 2], 12, overlong="cut")
    np.testing.assert_array_equal(got, [3, 9])
    assert n == {"overlong_docs": 1, "overlong_tokens_cut": 8}


def test_context_len_counts_num_pad(capsys):
    """``--context-len C --num-pad P`` packs C - P document tokens, so the remedy the shortfall
    message names (``--num-pad``) works beside ``--context-len``."""
    data = plan_json(
        capsys, *"--method ring --cp-size 2 --doc-lens 4,12 --context-len 20 --num-pad 4".split()
    )
    assert data["doc_lens"] == [4, 12] and data["num_pad"] == 4 and data["context_len"] == 20
    data = plan_json(
        capsys, *"--method ring --cp-size 2 --doc-lens 4,12,9 --context-len 20 --num-pad 2".split()
    )
    assert data["doc_lens"] == [4, 12, 2] and data["context_len"] == 20


def test_target_imbalance_is_passed_to_flashcp(capsys):
    args = ["--method", "flashcp", "--cp-size", "2", "--doc-lens", "12,4"]
    loose = plan_json(capsys, *args, "--target-imbalance", "2.0")
    assert loose["info"]["target_imbalance"] == 2.0
    assert loose["info"]["per_doc_docs"] == []
    assert_json_matches_plan(loose, make_plan_for("flashcp", [12, 4], 2, target_imbalance=2.0))
    default = plan_json(capsys, *args)
    assert default["info"]["target_imbalance"] == 1.05
    assert default["info"]["per_doc_docs"] == [0]
    assert default["status"] == "ok" and default["imbalance_ratio"] <= 1.05
    # the flag and the option may both be given when they agree
    both = plan_json(capsys, *args, "--target-imbalance", "2", "--option", "target_imbalance=2.0")
    assert both == loose


def test_table_output(capsys):
    code, out, err = run_cli(
        capsys, "plan", "--method", "per_doc", "--cp-size", "2", "--doc-lens", "4,12"
    )
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert "per_doc" in lines[0] and "cp_size 2" in lines[0] and "context_len 16" in lines[0]
    assert "imbalance_ratio 1.0000" in lines[1] and "comm_tokens 8" in lines[1]
    assert lines[2].split()[:3] == ["rank", "tokens", "workload"]
    assert lines[3].split() == ["0", "8", "44", "0:0+1", "0:3+1", "1:0+3", "1:9+3"]
    assert lines[4].split() == ["1", "8", "44", "0:1+2", "1:3+6"]
    assert len(lines) == 5


@pytest.mark.parametrize(
    ("suffix", "content"),
    [
        (".txt", "# lengths\n4\n12\n"),
        (".csv", "4\n12\n"),
        (".csv", "doc_len\n4\n12\n"),
        (".csv", "seq,doc_len,source\n0,4,pile\n0,12,pile\n"),
    ],
)
def test_doc_lens_file(capsys, tmp_path, suffix, content):
    path = tmp_path / f"lens{suffix}"
    path.write_text(content)
    data = plan_json(capsys, "--method", "per_doc", "--cp-size", "2", "--doc-lens-file", str(path))
    assert data["doc_lens"] == [4, 12]


def test_doc_lens_file_npy(capsys, tmp_path):
    path = tmp_path / "lens.npy"
    np.save(path, np.array([3000, 1, 1, 5000, 200], dtype=np.int32))
    args = ["--method", "flashcp", "--cp-size", "8", "--context-len", "4096"]
    code, out, err = run_cli(capsys, "plan", *args, "--doc-lens-file", str(path), "--json")
    assert code == 0 and "1 pieces of documents longer than context_len = 4096" in err
    data = json.loads(out)
    assert data["doc_lens"] == [3000, 1, 1, 1094]  # the 5000-token document's first piece, cut
    assert_json_matches_plan(data, make_plan_for("flashcp", [3000, 1, 1, 1094], 8))


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--doc-lens", "4,x"], "'x'"),
        (["--doc-lens", "4.5,11.5"], "'4.5'"),
        (["--doc-lens", "", "--context-len", "4"], "--doc-lens is empty"),
        (["--doc-lens", ""], "--doc-lens is empty"),
        (["--doc-lens", " "], "--doc-lens is empty"),
        (["--doc-lens", "100,,200"], "--doc-lens '100,,200': item 2 is empty"),
        (["--doc-lens", "4,12,"], "item 3 is empty"),
        (["--doc-lens", ",4,12"], "item 1 is empty"),
        (["--doc-lens", "4,12", "--num-pad", "-1"], "--num-pad must be >= 0, got -1"),
        (["--doc-lens", "4,11"], "--num-pad 1, or --pad-to-multiple)"),
        (["--doc-lens", "4,11", "--num-pad", "2"], "--num-pad 3, or --pad-to-multiple)"),
        (["--doc-lens", "4,-12"], "doc_lens[1] = -12"),
        (["--doc-lens", "4,12", "--context-len", "20"], "context_len = 20"),
        # too few tokens: the message names the remedies
        (
            ["--doc-lens", "4,12", "--context-len", "20"],
            "--num-pad 4 (pad counts in --context-len), or leave out --context-len (C = their sum, 16)",
        ),
        (
            ["--doc-lens", "4,12", "--context-len", "24", "--num-pad", "2"],
            "context_len = 24 less num_pad = 2: not enough tokens to fill the sequence; pad the rest with --num-pad 8",
        ),
        (
            ["--doc-lens", "4,12", "--context-len", "8", "--num-pad", "8"],
            "--num-pad 8 must be >= 0 and leave room",
        ),
        (["--doc-lens", "4,12", "--context-len", "0"], "context_len must be >= 1, got 0"),
        (["--doc-lens", "4,12", "--context-len", "15"], "context_len = 15"),
        (["--doc-lens", "4,13"], "context_len = 17"),
        (["--doc-lens", "4,12", "--cp-size", "0"], "cp_size must be >= 1, got 0"),
        (["--doc-lens", "4,12", "--cp-size", "-2"], "got -2"),
        (["--doc-lens", "4,12", "--cp-size", "3"], "cp_size = 3"),
        (["--doc-lens", "4,12", "--cp-size", "two"], "'two'"),
        (["--doc-lens", "6,12", "--method", "llama3"], "2 * cp_size = 4"),
        (["--doc-lens", "4,12", "--method", "striped"], "'striped'"),
        (["--doc-lens", "4,12", "--target-imbalance", "1.1"], "'per_doc'"),
        (["--doc-lens", "4,12", "--method", "flashcp", "--target-imbalance", "0.5"], "0.5"),
        (["--doc-lens", "4,12", "--method", "flashcp", "--target-imbalance", "x"], "'x'"),
        (
            [
                "--doc-lens",
                "4,12",
                "--method",
                "flashcp",
                "--target-imbalance",
                "1.1",
                "--option",
                "target_imbalance=1.3",
            ],
            "disagree",
        ),
        (
            [
                "--doc-lens",
                "4,12",
                "--method",
                "flashcp_refined",
                "--target-imbalance",
                "2",
                "--option",
                "target_imbalance=1.05",
            ],
            "--option target_imbalance=1.05 disagree",
        ),
        (["--doc-lens", "4,12", "--doc-lens-file", "lens.txt"], "--doc-lens-file"),
        ([], "--doc-lens"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, argv, names):
    defaults = [x for opt in DEFAULTS if opt[0] not in argv for x in opt]
    code, out, err = run_cli(capsys, "plan", *defaults, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith("flashcp")
    assert "error" in err and names in err, err
    assert "Traceback" not in err


def test_bad_doc_lens_file(capsys, tmp_path):
    missing = tmp_path / "nope.txt"
    code, _, err = run_cli(capsys, *RING, str(missing))
    assert code == 2 and "nope.txt" in err and err.count("\n") == 1
    bad = tmp_path / "bad.txt"
    bad.write_text("4\n12\nseven\n")
    code, _, err = run_cli(capsys, *RING, str(bad))
    assert code == 2 and "bad.txt:3" in err and "'seven'" in err and err.count("\n") == 1
    header = tmp_path / "header.csv"
    header.write_text("name,source\na,b\n")
    code, _, err = run_cli(capsys, *RING, str(header))
    assert code == 2 and "no column named doc_len" in err and err.count("\n") == 1
    floats = tmp_path / "lens.npy"
    np.save(floats, np.array([4.5, 11.5]))
    code, _, err = run_cli(capsys, *RING, str(floats))
    assert code == 2 and "4.5" in err and err.count("\n") == 1


def test_help_exits_0(capsys):
    assert main(["plan", "--help"]) == 0
    assert "--doc-lens" in capsys.readouterr().out


def test_advise_help_lists_every_named_dataset(capsys):
    """``flashcp advise --help`` lists the datasets --dataset takes: every DatasetName but file
    (a file is --lengths)."""
    from flashcp.data import DatasetName

    assert main(["advise", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    named = ", ".join(str(x) for x in DatasetName if x != DatasetName.file)
    assert f"a named dataset: {named}" in out, out
    assert "wlb_llm_synthetic" in named and "stress" in named


def test_python_dash_m_entry_point():
    """``python -m flashcp`` runs the same CLI in a fresh interpreter: JSON out, exit 2 on bad input."""
    argv = "-m flashcp plan --method per_doc --cp-size 2 --doc-lens 4,12 --json".split()
    ok = subprocess.run(
        [sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert ok.returncode == 0, ok.stderr
    data = json.loads(ok.stdout)
    assert data["method"] == "per_doc" and [r["tokens"] for r in data["ranks"]] == [8, 8]


@pytest.mark.parametrize("method", METHODS)
def test_zero_length_documents_and_empty_input(capsys, method):
    data = plan_json(capsys, "--method", method, "--cp-size", "2", "--doc-lens", "16,24,0,0")
    assert data["doc_lens"] == [16, 24, 0, 0]
    assert_json_matches_plan(data, make_plan_for(method, [16, 24], 2))
    for text in ("0", "0,0"):  # an empty sequence is written as zero-length documents
        data = plan_json(capsys, "--method", method, "--cp-size", "2", "--doc-lens", text)
        assert [r["shards"] for r in data["ranks"]] == [[], []] and data["num_pieces"] == 0


@pytest.mark.parametrize("method", METHODS)
def test_pad_flags(capsys, method):
    args = ["--method", method, "--cp-size", "4", "--doc-lens", "2999"]
    data = plan_json(capsys, *args, "--pad-to-multiple")
    assert data["num_pad"] == 1 and data["context_len"] == 3000
    assert_json_matches_plan(data, make_plan_for(method, [2999], 4, pad_to_multiple=True))
    data = plan_json(capsys, *args, "--num-pad", "9")
    assert data["num_pad"] == 9 and [r["tokens"] for r in data["ranks"]] == [752] * 4
    code, out, _ = run_cli(capsys, "plan", *args, "--num-pad", "1")
    assert code == 0 and "num_pad 1" in out and "pad:1" in out and "num_pieces" in out
