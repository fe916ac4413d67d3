"""The step model (:mod:`flashcp.sim.step`): one plan's whole-model step time computed by hand,
term by term; linear in tokens; a step speedup below the attention speedup when attention is a
share of the step; attention-only shapes unchanged (no step time, the same attention price)."""

from __future__ import annotations

import numpy as np
import pytest

from flashcp.comm import AttnShape
from flashcp.registry import make_plan_for
from flashcp.sim import load_hardware, simulate
from flashcp.sim.step import GEMM_EFFICIENCY, nonattn_ms, step_ms

# a small model: 2 layers, hidden 256, 4 heads of 64, 2 KV heads, MLP 512, vocabulary 1,000
SMALL = AttnShape(4, 2, 64, "bfloat16", num_layers=2, hidden=256, ffn=512, vocab=1000)
DOCS = [3000, 1096]  # C = 4,096 on 2 ranks: 2,048 tokens each


@pytest.fixture(scope="module")
def hw():
    return load_hardware("h100_sxm")


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_step_by_hand(hw, mode):
    plan = make_plan_for("flashcp", DOCS, 2)
    t = int(plan.tokens_per_rank.max())
    assert t == 2048
    attn = simulate(plan, SMALL, hw, mode=mode)["total_ms"]
    h, hd, f, v, b = 256, 64, 512, 1000, 2
    # forward GEMM FLOPs per layer: QKV (4 + 2*2 heads of 64), output, SwiGLU's 3 GEMMs
    flops = 2 * t * h * (4 + 2 * 2) * hd + 2 * t * (4 * hd) * h + 3 * 2 * t * h * f
    # forward element-wise bytes per layer: 2 norms, RoPE on Q and K, SwiGLU gate, 2 residuals
    nbytes = t * b * (2 * 2 * h + 2 * (4 + 2) * hd + 3 * f + 2 * 3 * h)
    head_flops = 2 * t * h * v  # LM head
    head_bytes = t * b * (2 * h + 2 * h + 2 * v)  # embedding, final norm, softmax of the loss
    fwd_bwd = 3 if mode == "train" else 1  # backward: 2x the forward GEMMs and bytes
    gemm_per_ms = hw.peak_tflops * 795 / 989 * 1e9
    bytes_per_ms = hw.copy_bw_gbps * 1e6
    layer = fwd_bwd * (flops / gemm_per_ms + nbytes / bytes_per_ms)
    head = fwd_bwd * (head_flops / gemm_per_ms + head_bytes / bytes_per_ms)
    want = 2 * (attn + layer) + head
    got = float(step_ms(SMALL, hw, attn, t, mode))
    assert got == pytest.approx(want, rel=1e-12)
    got_layer, got_head = nonattn_ms(SMALL, hw, t, mode)
    assert float(got_layer) == pytest.approx(layer, rel=1e-12)
    assert float(got_head) == pytest.approx(head, rel=1e-12)
    assert GEMM_EFFICIENCY == pytest.approx(795 / 989)


def test_linear_in_tokens(hw):
    for mode in ("train", "infer"):
        layer, head = nonattn_ms(SMALL, hw, np.array([1000, 2000, 3000]), mode)
        np.testing.assert_allclose(layer, layer[0] * np.array([1, 2, 3]), rtol=1e-12)
        np.testing.assert_allclose(head, head[0] * np.array([1, 2, 3]), rtol=1e-12)
        assert float(nonattn_ms(SMALL, hw, 0, mode)[0]) == 0.0


def test_step_speedup_below_attention_speedup(hw):
    """Same tokens per rank for both methods: the work outside attention is equal, so the step's
    speedup lies strictly between 1 and the attention layer's."""
    docs = [2048] * 6 + [8192] * 2 + [16384] * 2  # 61,440 tokens... padded below
    docs = [*docs, 65536 - sum(docs)]
    base = simulate(make_plan_for("llama3", docs, 4), SMALL, hw, mode="train")["total_ms"]
    fast = simulate(make_plan_for("flashcp", docs, 4), SMALL, hw, mode="train")["total_ms"]
    attn_speedup = base / fast
    assert attn_speedup > 1.0
    t = 65536 // 4
    step_speedup = float(
        step_ms(SMALL, hw, base, t, "train") / step_ms(SMALL, hw, fast, t, "train")
    )
    assert 1.0 < step_speedup < attn_speedup


def test_attention_only_shape_unchanged(hw):
    plan = make_plan_for("flashcp", DOCS, 2)
    plain = AttnShape(4, 2, 64, "bfloat16")
    assert simulate(plan, plain, hw, mode="train") == simulate(plan, SMALL, hw, mode="train")
    with pytest.raises(ValueError, match="num_layers"):
        step_ms(plain, hw, 1.0, 2048, "train")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_layers": 2}, "hidden, ffn, vocab"),
        ({"num_layers": 0, "hidden": 8, "ffn": 8, "vocab": 8}, "num_layers must be a positive"),
        ({"num_layers": 2, "hidden": 8, "ffn": 8, "vocab": 1.5}, "vocab must be a positive"),
    ],
)
def test_bad_step_sizes_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttnShape(4, 2, 64, "bfloat16", **kwargs)


def test_unknown_mode_is_refused(hw):
    with pytest.raises(ValueError, match="unknown mode 'bwd'"):
        step_ms(SMALL, hw, 1.0, 2048, "bwd")


def test_advise_reports_both_levels():
    from flashcp.cli.advise import advise, format_report

    kw = dict(cp_size=2, dataset="pile", context_len=8192, num_sequences=3, num_draws=1,
              draw_sequences=1, methods=["flashcp"])  # fmt: skip
    df = advise(model="small_1b", **kw).set_index("method")
    assert df.loc["llama3", "model_step_speedup_vs_llama3"] == 1.0
    assert (df["model_step_ms_p50"] > 32 * df["step_ms_p50"]).all()  # 16 layers, fwd + bwd
    assert "Whole model (16 layers" in format_report(df.reset_index())
    plain = advise(model="h16", **kw)
    assert "model_step_ms_p50" not in plain and "Whole model" not in format_report(plain)


def test_fig5_step_figure_draws_both_levels_or_refuses(tmp_path):
    """The committed fig5_step summary draws; an attention-only summary (fig5) is refused in one
    ValueError naming the missing column, not drawn as empty bars."""
    import shutil
    from pathlib import Path

    from experiments.plot import draw

    repo = Path(__file__).resolve().parents[2]
    for name in ("fig5_step", "fig5"):
        (tmp_path / name).mkdir()
        shutil.copy(repo / "results" / name / "summary.csv", tmp_path / name / "summary.csv")
    assert draw("fig5_step", tmp_path / "fig5_step").stat().st_size > 0
    with pytest.raises(ValueError, match="step_speedup_vs_llama3"):
        draw("fig5_step", tmp_path / "fig5")
