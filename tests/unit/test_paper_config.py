"""The paper's configuration (``conf/method/*_paper.yaml``; docs/paper_config.md): each option
runs its method as the FlashCP paper ran it, and ``python -m experiments.paper_config`` reads them."""

from __future__ import annotations

import pytest

pytest.importorskip("omegaconf")

from flashcp.comm import AttnShape, comm_volume
from flashcp.config import method_option
from flashcp.sim.impl import impl_plan

AG = {"keep_gathered_kv": True, "grad_comm_dtype": "bfloat16"}


@pytest.mark.parametrize(
    ("option", "method", "impl", "ops"),
    [
        ("llama3_paper", "llama3", "ours", AG),
        ("per_doc_paper", "per_doc", "ours", AG),
        ("flashcp_paper", "flashcp", "ours", AG),
        ("flashcp_refined_paper", "flashcp_refined", "ours", AG),
        ("ring_paper", "ring", "ring_flash_attn", {}),
        ("zigzag_paper", "zigzag", "ring_flash_attn", {}),
    ],
)
def test_paper_options_run_the_method_as_the_paper_did(option, method, impl, ops):
    got = method_option(option)
    assert (got.method, got.impl, got.op_options) == (method, impl, ops)
    # planner options are the method's own file's (flashcp: target_imbalance 1.05)
    assert got.planner_options == method_option(method).planner_options


def test_paper_allgather_traffic_is_eq4_and_eq5():
    """With the paper's options the all-gather family moves 4 x tokens x Hkv x D model-dtype
    elements per rank (Eq. 4 for llama3 / per_doc, Eq. 5 for flashcp), half the project's default
    (a second all-gather, float32 reductions: 2 + 2 + 4 bytes against 2 + 2 per element pair)."""
    shape = AttnShape(num_heads=8, num_kv_heads=4, head_dim=64)
    docs = [40000, 30000, 20000, 10000, 31072]
    for method, kind in (("llama3", "allgather_full"), ("per_doc", "allgather_full"),
                         ("flashcp", "allgather_sharded")):  # fmt: skip
        m = method_option(f"{method}_paper")
        plan, _ = impl_plan(m.method, m.impl, docs, 4, **m.planner_options)
        vol = comm_volume(plan, kind, shape, "train", impl=m.impl, **m.op_options)
        tokens = plan.comm_tokens_full if kind == "allgather_full" else plan.comm_tokens
        assert vol["comm_bytes"] == 4 * tokens * 4 * 64 * 2, method
        ours = comm_volume(plan, kind, shape, "train")
        assert ours["comm_bytes"] == 2 * vol["comm_bytes"], method


def test_unknown_option_is_named():
    with pytest.raises(ValueError, match="no method option 'llama4_paper'; choose one of"):
        method_option("llama4_paper")


def test_table_command_runs(capsys):
    from experiments.paper_config import main

    assert main(["--num-sequences", "1", "--cp-size", "2", "--context-len", "16384"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n| ") == 6 and "| zigzag |" in out
    assert main(["--dataset", "nope", "--num-sequences", "1"]) == 2
