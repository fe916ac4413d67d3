"""Bad input at the library's entry points is a ValueError naming the value, before any work:
lengths beyond :data:`flashcp.plan.MAX_TOKENS` (which would overflow the int64 workloads, or hang
a planner on a wrapped-round total), length files with values that do not fit, NumPy integers
where Python ints are expected (taken, as ints), strings where a sequence belongs, ILP options
of the wrong type or range. Small inputs only: every check runs before a solve."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from flashcp import compiled
from flashcp.comm import AttnShape
from flashcp.data.files import read_lengths_file
from flashcp.plan import MAX_TOKENS
from flashcp.registry import get_planner
from flashcp.sim.cost import price_plans, simulate, simulate_many
from flashcp.sim.kernel import attention_kernel_ms

DOCS = [3000, 5000, 192, 8192]
FAST = ("flashcp", "flashcp_refined", "llama3", "ring", "per_doc", "zigzag", "ulysses")


@pytest.mark.parametrize("method", FAST)
@pytest.mark.parametrize(
    ("doc_lens", "message"),
    [
        (np.array([2**62, 2**62], np.int64), "a packed sequence holds at most MAX_TOKENS"),
        ([2**62, 2**62], "got doc_lens[0] = 4611686018427387904"),
        ([2**63 - 1, 1], "got doc_lens[0] = 9223372036854775807"),
        ([2**64], "got 18446744073709551616"),
        (np.array([2**64 - 1], np.uint64), "got doc_lens[0] = 18446744073709551615"),
        (np.array([MAX_TOKENS, 8], np.int64), f"hold {MAX_TOKENS + 8} tokens"),
    ],
)
@pytest.mark.parametrize("kernels", ("1", "0"))
def test_lengths_beyond_max_tokens_are_refused(monkeypatch, kernels, method, doc_lens, message):
    """On the compiled path too (``FLASHCP_COMPILED=1``: a fused kernel summing the lengths in
    int64 wrapped round and then planned a huge sequence without end) and on the references."""
    if kernels == "1" and not compiled.enabled():
        pytest.skip("numba is not installed")
    monkeypatch.setenv("FLASHCP_COMPILED", kernels)
    with pytest.raises(ValueError, match="MAX_TOKENS") as info:
        get_planner(method)(doc_lens, 4)
    assert message in str(info.value)


@pytest.mark.parametrize("method", ("flashcp", "llama3", "zigzag"))
def test_pad_beyond_max_tokens_is_refused(method):
    with pytest.raises(ValueError, match=r"num_pad = 2305843009213693952 make .* MAX_TOKENS"):
        get_planner(method)(np.array(DOCS, np.int64), 4, num_pad=2**61)


def test_the_largest_sequence_plans_with_exact_workloads():
    d = np.array([2**30, 2**30 - 16], np.int64)  # MAX_TOKENS - 16 tokens
    plan = get_planner("llama3")(d, 8)
    work = plan.workload_per_rank
    assert (work > 0).all() and plan.context_len == MAX_TOKENS - 16
    # Eq. 3 of the whole sequence, summed in Python ints, equals the ranks' int64 sums
    exact = sum(x * (x + 1) // 2 for x in d.tolist())
    assert int(plan.shard_workload.sum()) == exact


@pytest.mark.parametrize("method", (*FAST, "usp", "flashcp_ulysses"))
def test_numpy_integer_cp_size_plans_as_the_int(method):
    plan = get_planner(method)(DOCS, np.uint8(4))
    assert type(plan.cp_size) is int
    assert plan.digest() == get_planner(method)(DOCS, 4).digest()


@pytest.mark.parametrize(
    ("name", "write", "message"),
    [
        ("u.npy", lambda p: np.save(p, np.array([1000, 2**64 - 1], np.uint64)), "entry 1 = 18446744073709551615"),
        ("f.npy", lambda p: np.save(p, np.array([1000.0, 1e30])), "entry 1 = 1e+30"),
        ("t.txt", lambda p: p.write_text("1000\n99999999999999999999\n"), "t.txt:2: document length"),
        ("e.txt", lambda p: p.write_text("1000\n1e30\n"), "e.txt:2: document length"),
        ("c.csv", lambda p: p.write_text("doc_len\n1000\n99999999999999999999\n"), "c.csv:3: document length"),
    ],
)  # fmt: skip
def test_length_file_values_beyond_max_tokens_name_the_entry(tmp_path, name, write, message):
    path = tmp_path / name
    write(path)
    with pytest.raises(ValueError, match="MAX_TOKENS") as info:
        read_lengths_file(path)
    assert message in str(info.value)


def test_uint64_parquet_lengths_do_not_wrap(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    path = tmp_path / "u.parquet"
    pd.DataFrame({"doc_len": np.array([5, 2**64 - 1], np.uint64)}).to_parquet(path)
    with pytest.raises(ValueError, match="entry 1 = 18446744073709551615"):
        read_lengths_file(path)
    pd.DataFrame({"doc_len": np.array([5, 7], np.uint64)}).to_parquet(path)
    assert read_lengths_file(path).tolist() == [5, 7]


def test_attn_shape_takes_numpy_integers_as_ints():
    shape = AttnShape(num_heads=np.int64(32), num_kv_heads=np.int32(8), head_dim=np.uint16(128))
    assert shape == AttnShape(32, 8, 128) and type(shape.num_heads) is int
    assert hash(shape) == hash(AttnShape(32, 8, 128))
    with pytest.raises(ValueError, match=r"num_heads must be a positive integer, got np\.True_"):
        AttnShape(num_heads=np.bool_(True))


def test_pricing_entry_points_name_a_wrong_argument():
    plan = get_planner("flashcp")(DOCS, 4)
    shape = AttnShape()
    with pytest.raises(ValueError, match=r"shapes must be flashcp.comm.AttnShape objects"):
        simulate(plan, (32, 32, 128, "bfloat16"), "h100_sxm", "train")
    with pytest.raises(
        ValueError, match=r"plans must be flashcp\.plan\.Plan objects, got NoneType"
    ):
        simulate(None, shape, "h100_sxm", "train")
    with pytest.raises(ValueError, match=r"modes must be a sequence \(e.g. \['train'\]\)"):
        price_plans([plan], [shape], "train", "h100_sxm")
    with pytest.raises(ValueError, match="modes must be a sequence"):
        simulate_many(plan, [shape], "train", "h100_sxm")
    with pytest.raises(ValueError, match="shapes must be a sequence"):
        price_plans([plan], shape, ["train"], "h100_sxm")
    # the right arguments still price, the same through every entry
    one = simulate(plan, shape, "h100_sxm", "train")["total_ms"]
    many = price_plans([plan], [shape], ["train"], "h100_sxm")["total_ms"]
    assert many.shape == (1, 1, 1, 1) and many[0, 0, 0, 0] == one


def test_kernel_time_takes_profile_names_and_refuses_fractions():
    shape = AttnShape()
    by_name = attention_kernel_ms([100], [100], True, shape, "h100_sxm", False)
    assert (
        by_name > 0
        and attention_kernel_ms([100.0], [100], True, shape, "h100_sxm", False) == by_name
    )
    with pytest.raises(ValueError, match=r"q_lens must be integers, got np.float64\(100.5\)"):
        attention_kernel_ms([100.5], [200], True, shape, "h100_sxm", False)
    with pytest.raises(ValueError, match="kv_lens must be integers, got dtype <U1"):
        attention_kernel_ms([100], ["x"], True, shape, "h100_sxm", False)


def test_advise_refuses_a_comma_string_of_methods():
    from flashcp.cli.advise import advise

    with pytest.raises(ValueError, match=r"e.g. \['flashcp', 'zigzag'\]\), got the string"):
        advise(dataset="pile", cp_size=8, methods="flashcp,zigzag")


def test_every_figure_name_is_one_draw_knows(tmp_path):
    pytest.importorskip("omegaconf", reason="the harness's entry points need omegaconf")
    from experiments.common.entry import FIGURES
    from experiments.plot import draw

    with pytest.raises(ValueError) as info:
        draw("nope", tmp_path)
    assert str(info.value).endswith(f"choose one of {', '.join(FIGURES)}")
    for fig in FIGURES:  # known: it gets as far as looking for its CSV
        with pytest.raises(ValueError, match="does not exist; run the experiment"):
            draw(fig, tmp_path)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"threads": -1}, "threads must be an integer >= 1 or None, got -1"),
        ({"threads": 0}, "threads must be an integer >= 1 or None, got 0"),
        ({"threads": 2.5}, "threads must be an integer >= 1 or None, got 2.5"),
        ({"threads": True}, "threads must be an integer >= 1 or None, got True"),
        ({"solver_path": "/nonexistent/cbc"}, "solver_path must be an executable file, got '/nonexistent/cbc'"),
        ({"solver": "highs", "solver_path": "/bin/sh"}, "solver_path is a CBC executable: it needs solver='cbc'"),
        ({"lp_rounding": "x"}, "lp_rounding must be True or False, got 'x'"),
        ({"validate": "x"}, "validate must be True or False, got 'x'"),
        ({"lns": "yes"}, "lns must be True, False or None, got 'yes'"),
        ({"lns": True, "warm_start": None}, "lns=True improves the warm start's plan: it needs warm_start"),
        ({"gap": 2}, "gap (relative) must be in [0, 1) or None, got 2"),
        ({"highs_options": ["x"]}, "highs_options must be a mapping of HiGHS option names to values"),
        ({"heuristic_target_imbalance": 0.5}, "heuristic_target_imbalance must be >= 1, got 0.5"),
    ],
)  # fmt: skip
def test_ilp_option_mistakes_are_refused_before_the_solve(options, message):
    pytest.importorskip("pulp")
    from flashcp.planners.ilp.planner import check_ilp_options, plan_ilp

    with pytest.raises(ValueError) as info:
        check_ilp_options(**options)
    assert message in str(info.value)
    with pytest.raises(ValueError) as info:  # the planner runs the same checks first
        plan_ilp(DOCS, 4, time_limit_s=1, **options)
    assert message in str(info.value)


def test_ilp_takes_a_real_cbc_path_and_numpy_threads(tmp_path):
    pytest.importorskip("pulp")
    from flashcp.planners.ilp.planner import check_ilp_options

    exe = tmp_path / "cbc"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    assert os.access(exe, os.X_OK)
    check_ilp_options(solver_path=str(exe), threads=np.int64(2), lp_rounding=np.bool_(False))
    not_exec = tmp_path / "plain"
    not_exec.write_text("")
    with pytest.raises(ValueError, match="solver_path must be an executable file"):
        check_ilp_options(solver_path=str(not_exec))


def test_a_directory_as_length_file_says_so(tmp_path):
    with pytest.raises(ValueError, match="is a directory; give the file of lengths in it"):
        read_lengths_file(tmp_path)


def test_hardware_round_trips_through_asdict():
    import dataclasses

    from flashcp.sim.hardware import load_hardware

    hw = load_hardware("h100_sxm")
    assert load_hardware(dataclasses.asdict(hw)) == hw
    with pytest.raises(ValueError, match="unknown hardware key 'peak_tflop'"):
        load_hardware({**hw.to_dict(), "peak_tflop": 1.0})


@pytest.mark.parametrize("method", (*FAST, "usp", "flashcp_ulysses"))
def test_cp_size_beyond_max_cp_size_is_refused(method):
    """cp_size 10**9 allocated 7.5 GiB per-rank arrays (and was killed for memory) before any
    check; now every planner refuses a cp_size above MAX_CP_SIZE, naming it."""
    from flashcp.plan import MAX_CP_SIZE

    with pytest.raises(ValueError, match=f"cp_size = {10**9} is above MAX_CP_SIZE"):
        get_planner(method)(np.full(4, 2**20), 10**9)
    get_planner("ring")(np.full(4, 2 * MAX_CP_SIZE), MAX_CP_SIZE)  # the limit itself plans


@pytest.mark.parametrize("method", ("per_doc", "zigzag"))
def test_per_doc_layout_past_max_chunks_is_refused(monkeypatch, method):
    """The NumPy Per-Doc layout refuses documents x 2 * cp_size chunks above MAX_PER_DOC_CHUNKS
    before it allocates its (documents, 2N) chunk sizes (the fused kernels hold only the non-empty
    chunks and need no such limit)."""
    from flashcp.planners import layout

    monkeypatch.setenv("FLASHCP_COMPILED", "0")
    monkeypatch.setattr(layout, "MAX_PER_DOC_CHUNKS", 63)  # 4 documents x 16 chunks = 64
    with pytest.raises(ValueError, match="4 documents into 2 \\* cp_size = 16 chunks: 64 chunks"):
        get_planner(method)(np.full(4, 256), 8)
    monkeypatch.setattr(layout, "MAX_PER_DOC_CHUNKS", 64)
    get_planner(method)(np.full(4, 256), 8)


@pytest.mark.parametrize("kernels", ("1", "0"))
@pytest.mark.parametrize("method", ("llama3", "ring", "per_doc", "zigzag", "flashcp"))
def test_fused_planners_refuse_cp_size_beyond_max_cp_size(monkeypatch, kernels, method):
    """A cp_size above MAX_CP_SIZE that divides a small sequence (which the fused kernels would
    plan) is refused on the compiled path as on the reference."""
    from flashcp.plan import MAX_CP_SIZE

    monkeypatch.setenv("FLASHCP_COMPILED", kernels)
    n = 2 * MAX_CP_SIZE
    with pytest.raises(ValueError, match=f"cp_size = {n} is above MAX_CP_SIZE"):
        get_planner(method)(np.array([4 * n], np.int64), n)
