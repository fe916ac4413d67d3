"""One rule for documents longer than the context in every command: ``flashcp plan
--context-len``, ``flashcp advise``, ``flashcp-run`` and ``flashcp-table2`` take the same
``overlong`` rule (``--overlong`` / ``dataset.overlong``: split | cut | error, default split,
:func:`flashcp.data.apply_overlong`) and report how many documents it split or cut."""

from __future__ import annotations

import inspect
import json

import numpy as np
import pandas as pd
import pytest

from flashcp.cli import build_parser, main
from flashcp.data import OVERLONG_POLICIES, sample_dataset

C = 4096  # context of the command tests: a 4097-token document is one token too long


def test_apply_overlong_split_cut_error():
    from flashcp.data import apply_overlong

    d = [5, 23, 0, 10]
    out, long, cut, doc = apply_overlong(d, 10, "split")
    assert out.tolist() == [5, 10, 10, 3, 0, 10]  # 23 -> 10 + 10 + 3, no token lost
    assert long.tolist() == [False, True, True, True, False, False]
    assert doc.tolist() == [0, 1, 1, 1, 2, 3] and not cut.any()
    out, long, cut, doc = apply_overlong(d, 10, "cut")
    assert out.tolist() == [5, 10, 0, 10] and cut.tolist() == [0, 13, 0, 0]
    assert long.tolist() == [False, True, False, False]
    with pytest.raises(ValueError, match=r"f\.txt: document 1 has 23 tokens, longer than "
                       r"context_len = 10 \(1 of 4 documents are\) and --overlong error"):  # fmt: skip
        apply_overlong(d, 10, "error", option="--overlong", source="f.txt")
    with pytest.raises(ValueError, match="--overlong = 'truncate'; choose one of split, cut"):
        apply_overlong(d, 10, "truncate", option="--overlong")
    with pytest.raises(ValueError, match=r"must be integers, got \[4\.5"):
        apply_overlong([4.5, 12.0], 10, "split")
    with pytest.raises(ValueError, match="document 1 has a negative length -3"):
        apply_overlong([4, -3], 10, "cut")


def test_note_says_what_the_rule_did():
    from flashcp.data import overlong_note

    assert overlong_note([{"overlong_docs": 0, "overlong_tokens_cut": 0}], "split", 10, "x") is None
    two = [{"overlong_docs": 1, "overlong_tokens_cut": 0}] * 2
    assert "x: 2 pieces of documents longer than context_len = 10 (--overlong split" in (
        overlong_note(two, "split", 10, "x", "--overlong")
    )
    cut = {"overlong_docs": 1, "overlong_tokens_cut": 13}
    assert overlong_note(cut, "cut", 10, "x").startswith(
        "x: 1 documents longer than context_len = 10 cut to it, 13 tokens discarded"
    )


def test_every_command_takes_the_rule_with_the_same_default():
    from experiments.table2 import Table2Config, run_table2
    from flashcp.cli.advise import advise
    from flashcp.config import DatasetConfig

    sub = build_parser()._subparsers._group_actions[0].choices
    for name in ("plan", "advise"):
        (act,) = [a for a in sub[name]._actions if a.dest == "overlong"]
        assert act.default == "split" and tuple(act.choices) == OVERLONG_POLICIES, name
    assert str(DatasetConfig.overlong) == "split"  # flashcp-run, flashcp-sensitivity
    assert str(Table2Config().dataset.overlong) == "split"
    assert inspect.signature(advise).parameters["overlong"].default == "split"
    assert inspect.signature(run_table2).parameters["overlong"].default == "split"
    assert inspect.signature(sample_dataset).parameters["overlong"].default == "split"


@pytest.fixture
def long_file(tmp_path):
    """Lengths with one document one token longer than C (a book longer than the window)."""
    path = tmp_path / "lens.txt"
    path.write_text("100\n" + f"{C + 1}\n" + "300\n" * 30)
    return path


def test_plan_splits_by_default_and_reports_it(capsys, long_file):
    base = ["plan", "--method", "per_doc", "--cp-size", "2", "--doc-lens-file", str(long_file),
            "--context-len", str(C), "--json"]  # fmt: skip
    assert main(base) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["doc_lens"] == [100, C - 100]  # the first piece of the long document, packed
    assert (data["overlong"], data["overlong_docs"], data["overlong_tokens_cut"]) == ("split", 1, 0)
    assert err.count("\n") == 1 and f"{long_file}: 1 pieces of documents longer than" in err
    assert main([*base, "--overlong", "cut"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["overlong_tokens_cut"] == 1 and "cut to it, 1 tokens discarded" in err
    assert main([*base, "--overlong", "error"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert f"document 1 has {C + 1} tokens, longer than context_len = {C}" in err
    assert str(long_file) in err and "--overlong split" in err


def test_plan_without_long_documents_reports_nothing(capsys):
    argv = ["plan", "--method", "ring", "--cp-size", "2", "--doc-lens", "4,12,9", "--context-len",
            "20", "--json"]  # fmt: skip
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert err == "" and json.loads(out)["overlong_docs"] == 0


def test_advise_lengths_splits_a_document_longer_than_the_context(capsys, long_file, tmp_path):
    """The whole file is no longer refused for one document of C + 1 tokens."""
    argv = ["advise", "--lengths", str(long_file), "--cp-size", "2", "--context-len", str(C),
            "--num-sequences", "6", "--draws", "1", "--draw-sequences", "1", "--methods",
            "per_doc", "--out", str(tmp_path / "a")]  # fmt: skip
    assert main(argv) == 0
    _, err = capsys.readouterr()
    table = pd.read_csv(tmp_path / "a" / "advise.csv")
    rows = pd.read_csv(tmp_path / "a" / "rows.csv")
    n = int(table["overlong_docs"].iloc[0])
    assert n >= 1 and (table["overlong"] == "split").all()
    assert rows[rows.method == "llama3"]["overlong_docs"].sum() == n
    assert err.count("\n") == 1 and f"{n} pieces of documents longer than context_len" in err
    assert main([*argv, "--overlong", "error"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("flashcp advise: error: length file ")
    assert "--overlong error; use --overlong split" in err


def test_advise_dataset_reports_what_it_split(capsys, tmp_path):
    """``--dataset`` splits as before, and now says so (stress: about 16% of its draws > C)."""
    argv = ["advise", "--dataset", "stress", "--cp-size", "2", "--context-len", str(C),
            "--num-sequences", "6", "--draws", "1", "--draw-sequences", "1", "--methods",
            "per_doc", "--out", str(tmp_path / "a")]  # fmt: skip
    assert main(argv) == 0
    _, err = capsys.readouterr()
    assert "dataset stress: " in err and "pieces of documents longer than" in err
    assert main([*argv, "--overlong", "cut"]) == 0
    _, err = capsys.readouterr()
    assert "cut to it" in err
    assert pd.read_csv(tmp_path / "a" / "advise.csv")["overlong_tokens_cut"].iloc[0] > 0


def test_table2_reads_a_length_file_and_counts_overlong(tmp_path, long_file, caplog):
    """``flashcp-table2 dataset=file dataset.path=...`` samples the file as flashcp-run does and
    its rows carry the overlong counts of their sequence."""
    from hydra import compose, initialize_config_dir

    from experiments.common.entry import CONF_DIR
    from experiments.table2 import check_table2_config, table2_from_config
    from flashcp.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("table2", overrides=[
            "dataset=file", f"dataset.path={long_file}", f"context_len={C}", "cp_size=2",
            "num_sequences=3", "time_limit_s=2", "block_size=512", f"results_dir={tmp_path}",
        ])  # fmt: skip
    check_table2_config(cfg)
    with caplog.at_level("INFO", logger="experiments.table2"):
        table2_from_config(cfg)
    rows = pd.read_csv(tmp_path / "table2" / "table2_rows.csv")
    seqs, counts = sample_dataset("file", 3, C, seed=0, path=str(long_file))
    want = [counts[s]["overlong_docs"] for s in rows["seq"]]
    assert rows["overlong_docs"].tolist() == want and sum(want) >= 1
    assert (rows["dataset_path"] == str(long_file)).all() and (rows["overlong"] == "split").all()
    assert rows.groupby("seq")["num_docs"].max().tolist() == [len(s) for s in seqs]
    assert "pieces of documents longer than context_len" in caplog.text
    np.testing.assert_array_equal(rows["dataset"].unique(), ["file"])


def test_run_and_sensitivity_log_the_same_line(caplog, tmp_path):
    """flashcp-run (:func:`experiments.run.sample`) and flashcp-sensitivity log what the rule
    did with the same line (:func:`flashcp.data.overlong_note`) as the other commands print."""
    from omegaconf import OmegaConf

    from experiments.run import sample
    from experiments.sensitivity import run_sensitivity
    from flashcp.data import overlong_note

    ds = {"name": "stress", "path": None, "weighting": "documents", "cap": None, "overlong": "cut"}
    cfg = OmegaConf.create({"context_len": C, "num_sequences": 4, "seed": 0, "dataset": ds})
    with caplog.at_level("INFO"):
        _, counts = sample(cfg)
    line = overlong_note(counts, "cut", C, "stress")
    assert line and "cut to it" in line and line in caplog.text
    hw = OmegaConf.to_container(OmegaConf.load("conf/hardware/h100_sxm.yaml"))
    model = {"num_heads": 8, "num_kv_heads": 8, "head_dim": 64, "dtype": "bfloat16"}
    study = OmegaConf.create({
        "hardware": hw, "model": model, "cp_size": 2, "context_len": C, "seed": 0,
        "modes": ["train"], "num_sequences": 4, "num_draws": 2, "factor": 2.0, "datasets": [],
        "weightings": [], "dataset": ds, "methods": ["llama3", "per_doc"],
    })  # fmt: skip
    caplog.clear()
    with caplog.at_level("INFO", logger="experiments.sensitivity"):
        run_sensitivity(study, tmp_path)
    assert "documents longer than context_len = 4096 cut to it" in caplog.text
