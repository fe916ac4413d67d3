"""``flashcp advise`` (:mod:`flashcp.cli.advise`): its table, its breakdown of the step time, and its
one-line errors; and the cost model's per-rank attention account it reads
(:func:`flashcp.sim.cost.attention_balance`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flashcp.cli import main
from flashcp.cli.advise import HOST_CONSTANTS, PARTS, TABLE_COLUMNS, advise
from flashcp.comm import AttnShape
from flashcp.registry import get_planner, method_names
from flashcp.sim.cost import PlanBatch, attention_balance, price_plans
from flashcp.sim.hardware import load_hardware

CONTEXT = 16384
SMALL = dict(context_len=CONTEXT, num_sequences=20, num_draws=4, draw_sequences=6)


@pytest.fixture(scope="module")
def lengths_file(tmp_path_factory):
    """A text file of 400 document lengths: many short documents, a few long ones."""
    rng = np.random.default_rng(7)
    d = np.concatenate([rng.integers(1, 2000, 380), rng.integers(4000, CONTEXT, 20)])
    path = tmp_path_factory.mktemp("advise") / "lens.txt"
    np.savetxt(path, rng.permutation(d), fmt="%d")
    return path


@pytest.fixture(scope="module")
def table(lengths_file):
    return advise(lengths=lengths_file, cp_size=4, mode="train", **SMALL)


def test_table_has_every_applicable_method_and_its_columns(table):
    assert set(TABLE_COLUMNS) <= set(table.columns)
    # every fast registered method applies at cp_size 4 with 32 heads; the ILP is left out
    assert list(table["method"]) == list(method_names(fast=True))
    assert "ilp" not in set(table["method"])
    assert table.attrs["skipped"] == {}
    assert (table["num_sequences"] == 20).all()
    assert (table["step_ms_p90"] >= table["step_ms_p50"]).all()
    assert (table["speedup_min"] <= table["speedup_max"]).all()
    # the range is measured on the first draw_sequences sequences but holds the median over all
    assert (table["speedup_min"] <= table["speedup_vs_llama3"] * (1 + 1e-12)).all()
    assert (table["speedup_vs_llama3"] <= table["speedup_max"] * (1 + 1e-12)).all()
    assert (table["imbalance_ratio"] >= 1.0).all()
    assert (table["comm_mib_per_rank"] > 0).all()


def test_speedup_of_llama3_is_one(table):
    ref = table.set_index("method").loc["llama3"]
    assert ref["speedup_vs_llama3"] == 1.0
    assert ref["speedup_min"] == ref["speedup_max"] == 1.0
    rows = table.attrs["rows"]
    assert (rows[rows.method == "llama3"]["speedup_vs_llama3"] == 1.0).all()


def test_breakdown_sums_to_total(table):
    rows = table.attrs["rows"]
    assert len(rows) == 20 * len(table)
    parts = rows["ideal_ms"] + sum(rows[p] for p in PARTS)
    np.testing.assert_allclose(parts, rows["total_ms"], rtol=1e-9, atol=0)
    # every part is a share of the time, none negative (to rounding)
    for p in ("ideal_ms", *PARTS):
        assert (rows[p] >= -1e-9 * rows["total_ms"]).all(), p
    means = table["ideal_ms"] + sum(table[p] for p in PARTS)
    np.testing.assert_allclose(means, table["total_ms_mean"], rtol=1e-9, atol=0)
    by = table.set_index("method")
    assert by.loc["ulysses", "imbalance_ms"] == pytest.approx(0.0, abs=1e-12)  # same work per rank
    assert by.loc["ring", "imbalance_ms"] > by.loc["zigzag", "imbalance_ms"]  # causal ring skew
    assert (by["ideal_ms"] == by.loc["llama3", "ideal_ms"]).all()  # one ideal per sequence set


@pytest.mark.parametrize(
    ("shape", "context"),
    [(AttnShape(32, 8, 128), 8192), (AttnShape(128, 128, 128), 8192)],  # 2nd: 2 head groups
)
def test_attention_balance_is_the_step_models_attention(shape, context):
    """The accessor's slowest rank is the step's attention phases when no kernel is slowed by
    communication; zero host constants change neither attention nor communication phases (so
    the host part lies in ``others_ms``)."""
    from flashcp.data import sample_dataset

    seqs, _ = sample_dataset("pile", 3, context, seed=3)
    hw = load_hardware("h100_sxm")
    flat = dataclasses.replace(hw, nccl_slowdown=1.0)
    nohost = dataclasses.replace(hw, **dict.fromkeys(HOST_CONSTANTS, 0.0))
    for method in method_names(fast=True):
        batch = PlanBatch([get_planner(method)(d, 4) for d in seqs])
        for mode in ("train", "infer"):
            out = price_plans(batch, [shape], [mode], [flat, hw, nohost])
            attn = (out["attn_fwd_ms"] + out["attn_bwd_ms"])[:, 0, 0] * 1e3
            bal = attention_balance(batch, shape, mode, hw)
            np.testing.assert_allclose(bal["slowest_us"], attn[0], rtol=1e-12, err_msg=method)
            assert (bal["mean_us"] <= bal["slowest_us"] * (1 + 1e-12)).all()
            for col in ("attn_fwd_ms", "attn_bwd_ms", "allgather_ms", "reducescatter_ms",
                        "p2p_ms", "alltoall_ms"):  # fmt: skip
                np.testing.assert_array_equal(out[col][1], out[col][2], err_msg=f"{method} {col}")


def test_cli_prints_one_table_and_writes_outputs(capsys, lengths_file, tmp_path):
    out_dir = tmp_path / "adv"
    args = ["advise", "--lengths", str(lengths_file), "--cp-size", "2", "--context-len",
            str(CONTEXT), "--num-sequences", "4", "--draws", "2", "--draw-sequences", "2",
            "--mode", "infer", "--methods", "flashcp,zigzag", "--out", str(out_dir)]  # fmt: skip
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert err == ""
    header = "| " + " | ".join(TABLE_COLUMNS) + " |"
    assert out.count(header) == 1
    body = [ln for ln in out.splitlines() if ln.startswith("| ") and ln != header]
    assert [ln.split(" | ")[0][2:] for ln in body] == ["llama3", "zigzag", "flashcp"]
    for name in ("advise.csv", "rows.csv", "breakdown.png"):
        assert (out_dir / name).stat().st_size > 0


def test_an_out_folder_that_cannot_be_written_is_refused_before_any_work(
    capsys, lengths_file, tmp_path, monkeypatch
):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setattr(
        "flashcp.cli.advise.advise", lambda **kw: pytest.fail("advise ran before --out was checked")
    )
    args = ["advise", "--lengths", str(lengths_file), "--cp-size", "2", "--context-len",
            str(CONTEXT), "--out", str(blocker / "sub")]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{blocker} is a file, not a folder" in err[0]


@pytest.mark.parametrize(
    ("content", "extra", "needle"),
    [
        ("12\nabc\n", [], "'abc' is not an integer"),
        (None, [], "not found"),
        ("100\n99999\n", ["--overlong", "error"], "longer than context_len = 16384"),
        ("100\n", ["--methods", "nope"], "unknown method 'nope'"),
        ("100\n", ["--model", "nope"], "unknown model 'nope'"),
        ("100\n", ["--hardware", "nope"], "unknown hardware profile 'nope'"),
        ("100\n", ["--cp-size", "0"], "cp_size (flashcp advise --cp-size) must be an integer >= 1"),
        ("100\n", ["--draws", "0"], "num_draws (flashcp advise --draws) must be an integer >= 1"),
        ("100\n", ["--draw-sequences", "0"], "draw_sequences (flashcp advise --draw-sequences)"),
        ("100\n", ["--num-sequences", "0"], "num_sequences (flashcp advise --num-sequences)"),
        ("100\n", ["--seed", "-1"], "seed (flashcp advise --seed) must be an integer >= 0"),
        ("100\n", ["--cp-size", "3"], "multiple of 2 * cp_size = 6: llama3"),
        ("100\n", ["--cp-size", "3"], "use context_len = 16380 or 16386"),
        ("100\n", ["--option", "time_limit_s=5"], "--option takes METHOD.KEY=VALUE"),
        ("100\n", ["--nodes", "3"], "cp_size 4 does not split evenly over num_nodes 3"),
        ("100\n", ["--nodes", "0"], "nodes (flashcp advise --nodes) must be an integer >= 1"),
        ("100\n", ["--hardware", "h100_ib", "--nodes", "2"], "flat network"),
        ("100\n", ["--gpus-per-node", "2", "--nodes", "1"], "use at least 2 nodes"),
        (
            "100\n",
            ["--option", "ilp.time_limit_s=5"],
            "method_options (flashcp advise --option ilp.KEY=VALUE) for 'ilp', which this",
        ),
        ("100\n", ["--methods", "ilp", "--option", "ilp.nope=1"], "has no option 'nope'"),
        # option values are checked before any planning (not one failure line per sequence)
        (
            "100\n",
            ["--methods", "flashcp", "--option", "flashcp.target_imbalance=0.9"],
            "for 'flashcp': target_imbalance must be a number >= 1, got 0.9",
        ),
        (
            "100\n",
            ["--methods", "ilp", "--option", "ilp.time_limit_s=-1"],
            "for 'ilp': time_limit_s",
        ),
    ],
)
def test_bad_input_is_one_line(capsys, tmp_path, content, extra, needle):
    path = tmp_path / "lens.txt"
    if content is not None:
        path.write_text(content)
    args = ["advise", "--lengths", str(path), "--cp-size", "4", "--context-len", str(CONTEXT),
            "--out", str(tmp_path / "out"), *extra]  # fmt: skip
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("flashcp advise: error: "), err
    assert needle in err
    assert not (tmp_path / "out").exists()


def test_method_options_reach_the_planner():
    """``method_options`` plan a method with the given options (here a looser target: more
    imbalance, never less), the others with their defaults."""
    kw = dict(cp_size=4, dataset="wlb_llm", context_len=16384, num_sequences=8, num_draws=1,
              draw_sequences=1, methods=["flashcp"])  # fmt: skip
    base = advise(**kw).set_index("method")
    loose = advise(**kw, method_options={"flashcp": {"target_imbalance": 3.0}}).set_index("method")
    assert loose.loc["llama3", "step_ms_p50"] == base.loc["llama3", "step_ms_p50"]
    assert loose.loc["flashcp", "imbalance_ratio"] > base.loc["flashcp", "imbalance_ratio"]


@pytest.mark.parametrize("key", ["num_sequences", "context_len", "num_draws", "draw_sequences"])
def test_a_float_count_is_refused_not_truncated(key):
    kwargs = {"num_sequences": 2, "context_len": 16384, key: 2.5}
    with pytest.raises(ValueError, match=rf"{key} \(flashcp advise --[a-z-]+\) must be an integer"):
        advise(cp_size=2, dataset="pile", **kwargs)


def test_nodes_price_the_two_level_network(lengths_file):
    """--nodes / --gpus-per-node / --placement reach the pricing: CP 4 on one node is the default;
    spread over 2 or 4 nodes (1 GPU per node on the flat-by-default h100_ib: 4 nodes) the ring's
    hops cross nodes and zigzag's step grows, while the setup names the topology."""
    kw = dict(lengths=lengths_file, cp_size=4, methods=["zigzag"], context_len=CONTEXT,
              num_sequences=4, num_draws=2, draw_sequences=2)  # fmt: skip
    one = advise(**kw)
    two = advise(**kw, nodes=2)
    spread = advise(**kw, hardware="h100_ib", gpus_per_node=1)
    assert one.attrs["setup"]["topology"] is None
    assert two.attrs["setup"]["topology"].startswith("4 ranks, 2 nodes x 2")
    assert spread.attrs["setup"]["topology"].startswith("4 ranks, 4 nodes x 1")
    zig = {k: t.set_index("method").loc["zigzag", "comm_ms"] for k, t in
           (("one", one), ("two", two))}  # fmt: skip
    assert zig["two"] > zig["one"]
