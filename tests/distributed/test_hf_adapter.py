"""The flashcp attention inside a Hugging Face ``transformers`` Llama (randomly initialised tiny
``LlamaConfig``, no download): on one device it equals transformers' own SDPA attention run per
document; on gloo ranks at CP 2, every method's loss, per-token losses, gradients and parameters
after an AdamW step equal the one-device run within 1e-10 (float64)."""

from __future__ import annotations

import functools

import pytest
import torch
from mp_utils import run_ranks

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.masking_utils")

from flashcp.ops.sharding import unshard  # noqa: E402
from flashcp.registry import method_names  # noqa: E402
from flashcp.training import (  # noqa: E402
    CPAttention,
    OneDeviceAttention,
    allreduce_grads,
    cp_cross_entropy,
    doc_positions,
    plan_and_shard,
    shift_labels,
)
from flashcp.training.hf import ATTENTION_KWARG, register_hf_attention  # noqa: E402

C = 64
LENS = [3, 40, 1, 0, 13]  # + 7 pad; a document over both ranks, a 1-token and an empty one
TOL = 1e-10
METHODS = [m for m in method_names() if m != "ilp"]  # the ILP's op is flashcp's: covered there


def _model(attn: str):
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float64)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _ids():
    return torch.randint(0, 64, (C,), generator=torch.Generator().manual_seed(5))


def _logits(model, ids, positions, attention):
    out = model(
        input_ids=ids[None],
        position_ids=positions[None],
        use_cache=False,
        **{ATTENTION_KWARG: attention},
    )
    return out.logits[0]


def test_one_device_matches_transformers_sdpa_per_document():
    register_hf_attention()
    ours, _ = _model("context_parallel")
    sdpa, _ = _model("sdpa")
    ids = _ids()
    got = _logits(ours, ids, doc_positions(LENS, C), OneDeviceAttention(LENS, C))
    start = 0
    for n in LENS:
        if n:
            doc = ids[start : start + n]
            want = sdpa(input_ids=doc[None], use_cache=False).logits[0]
            torch.testing.assert_close(got[start : start + n], want, atol=1e-12, rtol=0)
        start += n
    with pytest.raises(ValueError, match=ATTENTION_KWARG):
        ours(input_ids=ids[None], use_cache=False)


@functools.cache
def _one_device():
    register_hf_attention()
    model, opt = _model("context_parallel")
    ids = _ids()
    logits = _logits(model, ids, doc_positions(LENS, C), OneDeviceAttention(LENS, C))
    loss, tok = cp_cross_entropy(logits, shift_labels(ids, LENS), [], return_per_token=True)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return (
        float(loss.detach()),
        tok.detach(),
        grads,
        {n: p.detach().clone() for n, p in model.named_parameters()},
    )


def _rank(rank, n, methods):
    register_hf_attention()
    out = {}
    for m in methods:
        model, opt = _model("context_parallel")
        batch = plan_and_shard(_ids(), LENS, m)
        logits = _logits(
            model, batch.input_ids, batch.positions, CPAttention(batch, backend="reference")
        )
        loss, tok = cp_cross_entropy(logits, batch.labels, return_per_token=True)
        loss.backward()
        allreduce_grads(model)
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        params = {k: p.detach().clone() for k, p in model.named_parameters()}
        out[m] = (float(loss.detach()), tok.detach(), grads, params, batch.plan)
    return out


def test_every_method_in_transformers_matches_one_device_at_cp2():
    ref_loss, ref_tok, ref_grads, ref_params = _one_device()
    results = run_ranks(_rank, 2, METHODS, timeout_s=180)
    errs = {}
    for m in METHODS:
        r0, r1 = results[0][m], results[1][m]
        tok = unshard([r0[1], r1[1]], r0[4])
        errs[m] = max(
            abs(r0[0] + r1[0] - ref_loss),
            float((tok - ref_tok).abs().max()),
            max(float((r0[2][k] - ref_grads[k]).abs().max()) for k in ref_grads),
            max(float((r1[3][k] - ref_params[k]).abs().max()) for k in ref_params),
        )
    assert max(errs.values()) <= TOL, errs
