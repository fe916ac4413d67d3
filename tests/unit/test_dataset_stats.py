"""The dataset statistics (``python -m experiments.dataset_stats``): the formulas by hand, bad
input named, and the committed table reproduced from the sampler."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from experiments.dataset_stats import dataset_stats, main, sequence_stats

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "results" / "dataset_stats" / "dataset_stats.csv"


def test_sequence_stats_by_hand():
    # C = 8: [8] is one full-window document; [3, 0, 5] has a document over half; [2, 2, 4] has not
    got = sequence_stats([np.array([8]), np.array([3, 0, 5]), np.array([2, 2, 4])], 8)
    assert got["docs_per_seq_mean"] == pytest.approx((1 + 2 + 3) / 3)
    assert got["docs_per_seq_median"] == 2
    assert got["longest_share_mean"] == pytest.approx((1 + 5 / 8 + 4 / 8) / 3)
    full = 36.0  # 8 * 9 / 2
    work = [1.0, (6 + 15) / full, (3 + 3 + 10) / full]
    assert got["causal_work_rel_mean"] == pytest.approx(np.mean(work))
    assert got["seqs_with_doc_over_half"] == pytest.approx(2 / 3)
    # tokens in documents shorter than C/2 = 4: 3 of [3, 0, 5], 2 + 2 of [2, 2, 4] (4 is not < 4)
    assert got["tokens_in_docs_under_half"] == pytest.approx((3 + 4) / 24)
    assert got["longest_share_max"] == 1.0


@pytest.mark.parametrize(
    ("seqs", "c", "needle"),
    [([np.array([3, 4])], 8, "sequence 0 holds 7 tokens"), ([], 8, "need sequences"),
     ([np.array([1])], 0, "context_len >= 1")],
)  # fmt: skip
def test_bad_input_is_named(seqs, c, needle):
    with pytest.raises(ValueError, match=needle):
        sequence_stats(seqs, c)


def test_committed_table_is_what_the_sampler_gives():
    committed = pd.read_csv(COMMITTED)
    r0 = committed.iloc[0]
    again = dataset_stats(int(r0.context_len), int(r0.num_sequences), int(r0.seed))
    pd.testing.assert_frame_equal(again, committed, check_dtype=False, rtol=1e-12)


@pytest.mark.parametrize("below", ["", "sub"])
def test_out_that_cannot_be_written_is_one_line(tmp_path, capsys, below):
    f = tmp_path / "f"
    f.write_text("")
    assert main(["--out", str(f / below), "--num-sequences", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a file, not a folder" in err[0]
