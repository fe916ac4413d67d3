"""``executor=emulate``: replayed ranks compute the float64 reference's outputs, count the bytes
``sim`` and ``dist`` count, and price communication with the simulator's model."""

from __future__ import annotations

import math

import pytest
import torch
from mp_utils import run_ranks

from flashcp.comm import AttnShape, comm_volume
from flashcp.executors.dist import init_from_env, measure_step
from flashcp.executors.emulate import (
    CommCall,
    ReplayGroup,
    compose_comm,
    emulate_ranks,
    emulate_step,
    seeded_inputs,
)
from flashcp.executors.emulate_memory import available_memory_bytes, record_memory_bytes
from flashcp.executors.emulate_record import record
from flashcp.ops.reference import reference_attention
from flashcp.ops.sharding import shard_tensor
from flashcp.registry import COMM_KIND, make_plan_for
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS
from flashcp.sim import load_hardware, simulate
from flashcp.sim.calibration import free_constants

METHODS = ("llama3", "per_doc", "ring", "zigzag", "flashcp")
LENS = [5, 40, 3, 60, 1, 19]  # C = 128
SHAPE = AttnShape(4, 2, 8, "float32")
HW = load_hardware("h100_sxm")


@pytest.mark.parametrize("method", METHODS)
def test_replayed_ranks_equal_the_float64_reference(method):
    n = 4
    plan = make_plan_for(method, LENS, n)
    reps = emulate_ranks(
        plan, SHAPE, "train", HW, backend="cpu", warmup=0, iters=1, seed=5, ranks=[0, 3]
    )
    # the full tensors the replay drew (seeded_inputs), rebuilt in packed order for the reference
    gen = torch.Generator().manual_seed(5)
    full = [torch.randn(128, h, 8, generator=gen) for h in (4, 2, 2, 4)]
    leaves = [x.double().requires_grad_() for x in full[:3]]
    ref = reference_attention(*leaves, LENS)
    ref.backward(full[3].double())
    want = [ref.detach(), *(x.grad for x in leaves)]
    assert [r.rank for r in reps] == [0, 3]
    # the record pass (all ranks together) computed the same outputs as the replay (one alone)
    inputs = seeded_inputs(plan, SHAPE, "train", 5, torch.device("cpu"))
    rec = record(plan, "train", inputs, backend="cpu", keep=[0, 3], keep_outputs=True)
    for rep in reps:
        for got, recorded in zip(rep.outputs, rec.outputs[rep.rank], strict=True):
            torch.testing.assert_close(got, recorded)
    for rep in reps:
        for what, got, w in zip(("out", "dq", "dk", "dv"), rep.outputs, want, strict=True):
            exp = shard_tensor(w, plan, rep.rank)
            assert got.dtype == torch.float32
            err = float((got.double() - exp).abs().max())
            assert err < 1e-5, f"{method} rank {rep.rank} {what}: max error {err}"


def _dist_rows(rank, n, methods):
    group = init_from_env(30)
    return {
        (m, mode): measure_step(
            make_plan_for(m, LENS, n), SHAPE, mode, group=group, backend="cpu", iters=1, seed=3
        )
        for m in methods
        for mode in ("train", "infer")
    }


def test_agrees_with_sim_and_dist():
    """Same columns as sim and dist; the same counted bytes; the same collective model as sim."""
    n = 2
    dist_rows = run_ranks(_dist_rows, n, METHODS, timeout_s=120)[0]
    for m in METHODS:
        plan = make_plan_for(m, LENS, n)
        for mode in ("train", "infer"):
            row = emulate_step(plan, SHAPE, mode, HW, backend="cpu", warmup=0, iters=1, seed=3)
            sim = simulate(plan, SHAPE, HW, mode)
            # dist adds the checksum of its outputs (flashcp.results.DIST_COLUMNS)
            assert set(row) == set(sim) == set(dist_rows[m, mode]) - {"out_checksum"}
            assert set(row) == set(PHASE_COLUMNS) | set(COMM_COLUMNS)
            bytes_ = {k: row[k] for k in COMM_COLUMNS}
            assert bytes_ == {k: sim[k] for k in COMM_COLUMNS}
            assert bytes_ == {k: dist_rows[m, mode][k] for k in COMM_COLUMNS}
            assert bytes_ == comm_volume(plan, COMM_KIND[m], SHAPE, mode)
            # blocking collectives are priced by the simulator's own formula on the same bytes
            assert row["allgather_ms"] == pytest.approx(sim["allgather_ms"], rel=1e-9)
            assert row["reducescatter_ms"] == pytest.approx(sim["reducescatter_ms"], rel=1e-9)
            assert row["attn_fwd_ms"] > 0 and row["total_ms"] > 0
            assert (row["attn_bwd_ms"] > 0) == (mode == "train")
            assert row["p2p_ms"] >= 0  # exposed ring transfer time (0 when compute hides it)
            if COMM_KIND[m] != "p2p_ring":
                assert row["p2p_ms"] == 0.0
            measured = sum(row[c] for c in PHASE_COLUMNS if c != "total_ms")
            assert row["total_ms"] >= 0.5 * measured  # phases are parts of the step


def test_compose_comm_collectives_are_replaced_by_the_model():
    b = 64 << 20
    calls = [CommCall("allgather", b, 2.0, 3.0), CommCall("reducescatter", b // 2, 6.0, 6.5)]
    got = compose_comm(10.0, calls, HW, 8)
    ag = HW.allgather_us(b, b * 8 / 7) / 1e3  # each collective at its own per-size bandwidth
    rs = HW.reducescatter_us(b // 2, b / 2 * 8 / 7) / 1e3
    assert got["allgather_ms"] == pytest.approx(ag)
    assert got["reducescatter_ms"] == pytest.approx(rs)
    assert got["comm_measured_ms"] == pytest.approx(1.5)
    assert got["total_ms"] == pytest.approx(10.0 - 1.5 + ag + rs)
    assert got["p2p_ms"] == 0.0


def test_compose_comm_ring_transfers_hide_behind_compute_or_stall():
    small, big = 1 << 10, 1 << 30
    t_big = HW.p2p_us(big) / 1e3
    # hidden: 4.9 ms of compute between post and wait, a ~µs transfer
    hidden = [CommCall("post", small, 0.0, 0.1, 0), CommCall("wait", 0, 5.0, 5.1, 0)]
    got = compose_comm(6.0, hidden, HW, 4)
    assert got["p2p_ms"] == 0.0 and got["total_ms"] == pytest.approx(5.8)
    # exposed: the wait stalls until the transfer ends (post cut out: it ends at 0.0 virtually)
    exposed = [CommCall("post", big, 0.0, 0.1, 0), CommCall("wait", 0, 1.1, 1.2, 0)]
    got = compose_comm(2.0, exposed, HW, 4)
    assert got["p2p_ms"] == pytest.approx(t_big - 1.0)
    assert got["total_ms"] == pytest.approx(2.0 - 0.2 + t_big - 1.0)
    # two transfers posted together share the link: the second ends after both
    both = [
        CommCall("post", big, 0.0, 0.0, 0),
        CommCall("post", big, 0.0, 0.0, 1),
        CommCall("wait", 0, 1.0, 1.0, 0),
        CommCall("wait", 0, 1.0, 1.0, 1),
    ]
    got = compose_comm(1.0, both, HW, 4)
    assert got["p2p_ms"] == pytest.approx(2 * t_big - 1.0)
    with pytest.raises(ValueError, match="without a post"):
        compose_comm(1.0, [CommCall("wait", 0, 0.0, 0.0, 7)], HW, 4)
    with pytest.raises(ValueError, match="kind"):
        compose_comm(1.0, [CommCall("broadcast", 1, 0.0, 0.0)], HW, 4)


def test_ring_stall_grows_when_the_link_is_slow():
    """A million times slower P2P link leaves ring transfers exposed; collectives are unaffected."""
    plan = make_plan_for("ring", LENS, 4)
    slow = load_hardware({**HW.to_dict(), "p2p_bw_gbps": HW.p2p_bw_gbps / 1e6})
    fast = emulate_step(plan, SHAPE, "infer", HW, backend="cpu", warmup=0, iters=1)
    crawl = emulate_step(plan, SHAPE, "infer", slow, backend="cpu", warmup=0, iters=1)
    per_block = (128 // 4) * 2 * 2 * 8 * 4  # KV bytes of one block
    assert crawl["p2p_ms"] > 3 * slow.p2p_us(per_block) / 1e3 * 0.9
    assert crawl["p2p_ms"] > 100 * max(fast["p2p_ms"], 1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ranks": [4]}, "out of range"),
        ({"ranks": [0, 0]}, "distinct"),
        ({"ranks": []}, "distinct"),
        ({"iters": 0}, "iters"),
        ({"nccl_traffic": True}, "CUDA"),
    ],
)
def test_bad_arguments_fail_before_any_work(kwargs, match):
    plan = make_plan_for("flashcp", LENS, 4)
    with pytest.raises(ValueError, match=match):
        emulate_step(plan, SHAPE, "train", HW, backend="cpu", **kwargs)
    with pytest.raises(ValueError, match="mode"):
        emulate_step(plan, SHAPE, "eval", HW, backend="cpu")


def test_a_failing_rank_fails_the_record_pass_without_hanging():
    plan = make_plan_for("llama3", LENS, 4)
    inputs = seeded_inputs(plan, SHAPE, "train", 0, torch.device("cpu"))
    inputs[2] = (inputs[2][0][:-1], *inputs[2][1:])  # one rank's q loses a row
    with pytest.raises(RuntimeError, match="rank 2") as info:
        record(plan, "train", inputs, backend="cpu", timeout_s=20)
    assert isinstance(info.value.__cause__, ValueError)


def test_replay_refuses_another_plan_and_a_diverging_call():
    plan = make_plan_for("flashcp", LENS, 2)
    inputs = seeded_inputs(plan, SHAPE, "infer", 0, torch.device("cpu"))
    rec = record(plan, "infer", inputs, backend="cpu", keep=[1])
    from flashcp.executors.emulate import _Clock

    group = ReplayGroup(1, 2, rec, _Clock(torch.device("cpu")), nccl_traffic=False)
    with pytest.raises(ValueError, match="digests differ"):
        group.check_same_plan(make_plan_for("flashcp", [64, 64], 2))
    with pytest.raises(RuntimeError, match="diverged"):
        group.reduce_scatter_tensor(torch.empty(3), torch.empty(6))
    with pytest.raises(ValueError, match="not kept"):
        ReplayGroup(0, 2, rec, _Clock(torch.device("cpu")), nccl_traffic=False)


def test_timing_of_each_rank_is_finite_and_repeatable_in_shape():
    plan = make_plan_for("zigzag", LENS, 4)
    reps = emulate_ranks(plan, SHAPE, "train", HW, backend="cpu", warmup=1, iters=2)
    assert [r.rank for r in reps] == [0, 1, 2, 3]
    for r in reps:
        assert all(math.isfinite(v) and v >= 0 for v in r.phases.values())
        assert r.comm_measured_ms >= 0
        assert r.comm == comm_volume(plan, "p2p_ring", SHAPE, "train")


def test_flashcp_run_executor_emulate(tmp_path):
    """``flashcp-run executor=emulate`` writes the rows sim writes, for the same sequences."""
    import pandas as pd
    from hydra import compose, initialize_config_dir

    from experiments.run import CONF_DIR, run
    from flashcp.config import register_configs
    from flashcp.results import read_rows

    register_configs()
    common = [
        f"results_dir={tmp_path}", "cp_size=4", "context_len=256", "num_sequences=1",
        "dataset=pile", "method=zigzag", "model.num_heads=4", "model.num_kv_heads=2",
        "model.head_dim=8", "model.dtype=float32", "progress=false",
    ]  # fmt: skip
    frames = {}
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        for ex in ("sim", "emulate"):
            extra = ["executor.backend=cpu", "executor.iters=1", "executor.ranks=[1,2]"]
            cfg = compose(
                "config", overrides=[*common, f"name={ex}", f"executor={ex}"]
                + (extra if ex == "emulate" else [])
            )  # fmt: skip
            frames[ex] = read_rows(run(cfg))
        with pytest.raises(ValueError, match="out of range"):
            run(compose("config", overrides=[*common, "executor=emulate", "executor.ranks=[4]"]))
    sim, emu = frames["sim"], frames["emulate"]
    assert list(sim.columns) == list(emu.columns)
    assert (emu["status"] == "ok").all() and set(emu["executor"]) == {"emulate"}
    # the profile prices emulate's communication and the replayed ranks change its rows: both
    # belong to the run's identity
    assert set(emu["hardware"]) == {"h100_sxm"}
    assert all('"ranks": [1, 2]' in o for o in emu["executor_options"])
    same = ["seq_idx", "mode", "num_docs", "imbalance_ratio", "comm_tokens", *COMM_COLUMNS]
    pd.testing.assert_frame_equal(sim[same], emu[same])


# ---- experiments/gpu_check.py: the same code path as the GPU run, tiny and on the CPU ------------


def test_gpu_check_quick_replays_fits_and_reports(tmp_path):
    import pandas as pd

    import flashcp.sim.calibration  # noqa: F401  the real fit: a failed import fails this test
    from experiments import gpu_check

    code = gpu_check.main([
        "--quick", "--out", str(tmp_path), "--datasets", "pile", "--methods", "flashcp,zigzag",
        "--skip", "kernels,dist,pytest", "--warmup", "0", "--iters", "1",
    ])  # fmt: skip
    assert code == 0
    emu = pd.read_csv(tmp_path / "emulate.csv")
    assert list(emu["method"]) == ["flashcp", "zigzag"] and (emu["status"] == "ok").all()
    # the simulated columns are the simulator on the very plan that was replayed
    shape = AttnShape(4, 4, 16, "float32")
    seq = gpu_check.sample_sequences(
        gpu_check.load_distribution("pile", context_len=1024), 1, 1024, seed=0
    )[0]
    for _, row in emu.iterrows():
        plan = make_plan_for(row["method"], seq, 8)
        sim = simulate(plan, shape, HW, "train")
        assert row["sim_attn_fwd_ms"] == pytest.approx(sim["attn_fwd_ms"])
        assert math.isfinite(row["fit_others_ms"])  # the simulator under the fitted profile
        assert {k: int(row[k]) for k in COMM_COLUMNS} == comm_volume(
            plan, COMM_KIND[row["method"]], shape, "train"
        )
    table = pd.read_csv(tmp_path / "calibration_fit.csv")
    assert len(table) == 2 * 3  # (method) x (attn_fwd, attn_bwd, others)
    assert table["name"].str.startswith("emulate/pile/seq0/").all()
    consts = pd.read_csv(tmp_path / "fitted_constants.csv")
    assert set(consts["constant"]) == set(free_constants(None, HW))
    md = (tmp_path / "summary.md").read_text()
    assert "Measured vs simulated" in md and "| emulate | ok |" in md and "| fit | ok |" in md


def test_gpu_check_free_constants_are_checked():
    parse_free = free_constants  # the GPU check's --free

    default = parse_free(None, HW)  # the replay's constants this profile has
    assert {"fwd_tile_tflops", "bwd_tile_tflops", "launch_us"} <= set(default)
    assert all(lo <= getattr(HW, k) <= hi for k, (lo, hi) in default.items())
    free = parse_free("launch_us=1:40,fwd_tile_tflops", HW)
    assert free["launch_us"] == (1.0, 40.0)
    assert free["fwd_tile_tflops"] == (pytest.approx(0.1 * HW.fwd_tile_tflops), HW.peak_tflops)
    with pytest.raises(ValueError, match="not a numeric hardware constant"):
        parse_free("warp_speed", HW)
    with pytest.raises(ValueError, match="outside its bounds"):
        parse_free("launch_us=10:20", HW)


# ---- on a GPU (run by experiments/gpu_check.py) ---------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("nccl_traffic", [False, True])
def test_emulate_on_cuda(method, nccl_traffic):
    """CUDA record pass (threads, autograd nodes driven directly), timed replay with events and,
    optionally, the concurrent copy stream: outputs near the float64 reference, bytes as planned."""
    n, lens = 4, [300, 1200, 77, 2000, 519]  # C = 4096
    shape = AttnShape(8, 2, 64, "bfloat16")
    plan = make_plan_for(method, lens, n)
    dev = torch.device("cuda")
    reps = emulate_ranks(
        plan, shape, "train", HW, device=dev, backend="auto", warmup=1, iters=2, seed=1,
        nccl_traffic=nccl_traffic, timeout_s=60,
    )  # fmt: skip
    gen = torch.Generator(device=dev).manual_seed(1)
    full = [torch.randn(4096, h, 64, generator=gen, device=dev, dtype=torch.bfloat16)
            for h in (8, 2, 2, 8)]  # fmt: skip
    leaves = [x.double().requires_grad_() for x in full[:3]]
    ref = reference_attention(*leaves, lens)
    ref.backward(full[3].double())
    want = [ref.detach(), *(x.grad for x in leaves)]
    for rep in reps:
        assert rep.comm == comm_volume(plan, COMM_KIND[method], shape, "train")
        assert all(math.isfinite(v) and v >= 0 for v in rep.phases.values())
        assert rep.phases["attn_fwd_ms"] > 0 and rep.phases["attn_bwd_ms"] > 0
        for what, got, w in zip(("out", "dq", "dk", "dv"), rep.outputs, want, strict=True):
            exp = shard_tensor(w, plan, rep.rank)
            err = float((got.double() - exp).abs().max())
            # bf16 inputs: a few bf16 ulps of the largest value (a wrong block is O(1) off)
            assert err <= 0.03 * float(exp.abs().max()) + 1e-3, f"{method} {what}: {err}"


@pytest.mark.parametrize("method", METHODS)
def test_padded_plans_with_zero_length_documents(method):
    """Pad rows and empty documents: the op slices and pads around its Function; the record pass
    drives that graph itself and the replay reproduces it."""
    plan = make_plan_for(method, [5, 0, 40, 3, 0], 2, num_pad=8, pad_to_multiple=True)
    inputs = seeded_inputs(plan, SHAPE, "train", 2, torch.device("cpu"))
    rec = record(plan, "train", inputs, backend="cpu", keep_outputs=True)
    reps = emulate_ranks(plan, SHAPE, "train", HW, backend="cpu", warmup=0, iters=1, seed=2)
    for rep in reps:
        assert rep.comm == comm_volume(plan, COMM_KIND[method], SHAPE, "train")
        for got, recorded in zip(rep.outputs, rec.outputs[rep.rank], strict=True):
            torch.testing.assert_close(got, recorded)


# ---- CUDA streams and events name the tensors' device (checked on CPU through torch.cuda) -------


class _FakeCuda:
    """Stand-ins for the ``torch.cuda`` calls of the timers and the replay, logging the device
    each call names (None: the *current* device, which need not be the tensors')."""

    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []
        fake = self

        class Stream:
            def __init__(self, device=None, _current=False):
                self.device = device
                if not _current:
                    fake.log.append(("Stream", device))

            def wait_stream(self, other):
                fake.log.append(("wait_stream", other.device))

            def wait_event(self, event):
                fake.log.append(("wait_event", self.device))

            def record_event(self):
                ev = Event()
                ev.record(self)
                return ev

        class Event:
            def __init__(self, enable_timing=False):
                self.stream = None

            def record(self, stream=None):
                fake.log.append(("record", None if stream is None else stream.device))

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return 1.0

        self.Stream, self.Event = Stream, Event

    def install(self, monkeypatch) -> None:
        import contextlib

        log = self.log
        monkeypatch.setattr(torch.cuda, "Stream", self.Stream)
        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        monkeypatch.setattr(
            torch.cuda,
            "current_stream",
            lambda device=None: (
                log.append(("current_stream", device)) or self.Stream(device, _current=True)
            ),
        )
        monkeypatch.setattr(
            torch.cuda, "synchronize", lambda device=None: log.append(("synchronize", device))
        )
        monkeypatch.setattr(
            torch.cuda,
            "device",
            lambda device: log.append(("device", device)) or contextlib.nullcontext(),
        )
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)


def test_timers_and_side_stream_use_the_tensors_device(monkeypatch):
    """A timer, a replay clock, the copy stream and the GPU check's kernel timer of cuda:1 (current
    device: 0) record their events on cuda:1's stream, synchronise cuda:1 and create the side
    stream on cuda:1."""
    from flashcp.executors.emulate import _Clock
    from flashcp.executors.emulate_record import Recording
    from flashcp.ops.timing import PhaseTimer

    fake = _FakeCuda()
    fake.install(monkeypatch)
    dev = torch.device("cuda", 1)
    timer = PhaseTimer(dev)
    with timer.phase("attn_fwd"):
        pass
    assert timer.as_ms() == {"attn_fwd": 1.0}
    clock = _Clock(dev)
    rec = Recording("digest", {0: [("p2p", [torch.ones(3)])]})
    group = ReplayGroup(0, 2, rec, clock, nccl_traffic=True)
    clock.mark()
    got = group.ring_wait(group.ring_post([torch.zeros(3)], tag=0))
    assert torch.equal(got[0], torch.ones(3))
    assert [c.kind for c in group.timeline()] == ["post", "wait"]
    from flashcp.executors.kernels import _time_ms  # the GPU check's kernel timer

    assert _time_ms(lambda: None, dev, warmup=0, iters=2) == 1.0
    kinds = {k for k, _ in fake.log}
    assert {"record", "synchronize", "Stream", "wait_stream", "wait_event"} <= kinds
    assert all(d == dev for _, d in fake.log), [e for e in fake.log if e[1] != dev]


# ---- memory: refused before the record pass -------------------------------------------------------


def test_record_memory_estimate_counts_every_ranks_traffic():
    """inputs + outputs + (cp_size + kept) x one rank's comm_bytes, from independent sizes."""
    plan = make_plan_for("zigzag", LENS, 4)  # C = 128, 4 heads, 2 KV heads, head_dim 8, fp32
    comm = {m: comm_volume(plan, "p2p_ring", SHAPE, m)["comm_bytes"] for m in ("train", "infer")}
    train_io = 2 * 128 * (4 + 2 + 2 + 4) * 8 * 4  # q, k, v, dout and out, dq, dk, dv
    infer_io = 128 * (4 + 2 + 2) * 8 * 4 + 128 * 4 * 8 * 4  # q, k, v and out
    assert record_memory_bytes(plan, SHAPE, "train") == train_io + 8 * comm["train"]
    assert record_memory_bytes(plan, SHAPE, "train", [0]) == train_io + 5 * comm["train"]
    assert record_memory_bytes(plan, SHAPE, "infer", [1, 2]) == infer_io + 6 * comm["infer"]
    have = available_memory_bytes("cpu")
    assert isinstance(have, int) and have > 0


def test_too_large_for_memory_is_refused_before_the_record_pass(monkeypatch, tmp_path):
    from hydra import compose, initialize_config_dir

    from experiments.run import CONF_DIR, run
    from flashcp.config import register_configs
    from flashcp.executors import emulate, emulate_memory

    plan = make_plan_for("ring", LENS, 4)
    need = record_memory_bytes(plan, SHAPE, "train", [0])
    monkeypatch.setattr(emulate_memory, "available_memory_bytes", lambda device: need - 1)
    with pytest.raises(ValueError, match=r"needs about .* GiB on cpu.*executor.ranks=\[0\]"):
        emulate_step(plan, SHAPE, "train", HW, backend="cpu", ranks=[0])
    # the estimate for one kept rank fits in exactly that much; skipping the check runs it
    monkeypatch.setattr(emulate_memory, "available_memory_bytes", lambda device: need)
    assert emulate_step(plan, SHAPE, "train", HW, backend="cpu", ranks=[0], iters=1)["comm_bytes"]
    monkeypatch.setattr(emulate_memory, "available_memory_bytes", lambda device: 1)
    emulate_step(plan, SHAPE, "infer", HW, backend="cpu", iters=1, check_memory=False)

    def no_record(*args, **kwargs):
        raise AssertionError("the record pass started")

    monkeypatch.setattr(emulate, "record", no_record)
    register_configs()
    common = [
        f"results_dir={tmp_path}", "cp_size=4", "context_len=256", "num_sequences=2",
        "dataset=pile", "method=zigzag", "model.num_heads=4", "model.num_kv_heads=2",
        "model.head_dim=8", "model.dtype=float32", "progress=false", "executor=emulate",
    ]  # fmt: skip
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        with pytest.raises(ValueError, match="GiB is available"):
            run(compose("config", overrides=common))
