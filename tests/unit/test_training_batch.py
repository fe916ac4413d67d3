"""The training-side helpers in one process: labels shifted inside documents before sharding,
document positions across shard cuts, the loss's count, the gradient reduction's zero fill, and
the ValueErrors on bad input (before any collective)."""

from __future__ import annotations

import pytest
import torch

from flashcp.ops.sharding import unshard
from flashcp.registry import make_plan_for, method_names
from flashcp.training import (
    IGNORE_INDEX,
    OneDeviceAttention,
    allreduce_grads,
    cp_cross_entropy,
    doc_positions,
    shard_batch,
    shift_labels,
)
from flashcp.training.model import LlamaConfig, TinyLlama

LENS, PAD = [16, 0, 16, 1, 24, 0], 7  # C = 64


def _ids(c=64):
    return torch.arange(100, 100 + c, dtype=torch.int64)


def test_shift_labels_by_hand():
    ids = torch.tensor([10, 11, 12, 20, 30, 31, 0, 0])
    got = shift_labels(ids, [3, 0, 1, 2])
    assert got.tolist() == [11, 12, -100, -100, 31, -100, -100, -100]


def test_doc_positions_by_hand():
    assert doc_positions([3, 0, 1, 2], 8).tolist() == [0, 1, 2, 0, 0, 1, 0, 0]


@pytest.mark.parametrize("method", [m for m in method_names() if m != "ilp"])
@pytest.mark.parametrize("n", [2, 4])
def test_every_rank_gets_the_packed_targets_and_positions(method, n):
    """Unsharding the ranks' labels / positions / tokens gives the packed ones: in particular the
    token before every shard cut keeps its target in the next shard (on another rank)."""
    ids = _ids()
    plan = make_plan_for(method, LENS, n, num_pad=PAD)
    batches = [shard_batch(ids, LENS, plan, r) for r in range(n)]
    assert torch.equal(unshard([b.labels for b in batches], plan), shift_labels(ids, LENS))
    assert torch.equal(unshard([b.positions for b in batches], plan), doc_positions(LENS, 64))
    assert torch.equal(unshard([b.input_ids for b in batches], plan), ids)
    assert sum(b.num_valid for b in batches) == 64 - PAD - 4  # 4 non-empty documents


def test_shard_batch_refuses_a_plan_of_another_batch():
    ids = _ids()
    plan = make_plan_for("zigzag", LENS, 2, num_pad=PAD)
    with pytest.raises(ValueError, match="made for doc_lens"):
        shard_batch(ids, [16, 16, 1, 24], plan, 0)
    with pytest.raises(ValueError, match="context_len = 64"):
        shard_batch(_ids(72), LENS, plan, 0)
    with pytest.raises(ValueError, match="int64"):
        shard_batch(ids.to(torch.int32), LENS, plan, 0)
    with pytest.raises(ValueError, match="rank"):
        shard_batch(ids, LENS, plan, 2)
    with pytest.raises(ValueError, match="sum to 65"):
        shift_labels(ids, [65])
    with pytest.raises(ValueError):
        shift_labels(ids, [-1, 3])


def test_loss_is_the_mean_over_valid_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 5, generator=g, dtype=torch.float64)
    labels = torch.tensor([1, -100, 4, 0, -100, 2, 3, -100])
    loss, per_tok = cp_cross_entropy(logits, labels, [], return_per_token=True)
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(logits, labels), atol=1e-14)
    assert per_tok[labels == IGNORE_INDEX].abs().max() == 0
    with pytest.raises(ValueError, match="no token with a label"):
        cp_cross_entropy(logits, torch.full((8,), -100), [])
    with pytest.raises(ValueError, match="label 5 out of range"):
        cp_cross_entropy(logits, torch.tensor([5] * 8), [])
    with pytest.raises(ValueError, match="labels must be"):
        cp_cross_entropy(logits, labels[:4], [])


def test_allreduce_grads_fills_missing_grads():
    """A rank whose parameter got no gradient (e.g. only pad) still joins every collective: the
    gradient is zero-filled, not skipped (a skip would desynchronise the ranks)."""
    model = torch.nn.Linear(2, 2)
    allreduce_grads(model, [])
    assert all(p.grad is not None and p.grad.abs().max() == 0 for p in model.parameters())


def test_one_device_attention_zeroes_pad_and_model_checks_inputs():
    model = TinyLlama(LlamaConfig(), seed=1, dtype=torch.float64)
    lens = [3, 0, 2]
    logits = model(_ids(8) % 64, doc_positions(lens, 8), OneDeviceAttention(lens, 8))
    assert logits.shape == (8, 64) and logits.dtype == torch.float64
    with pytest.raises(ValueError, match="positions must be"):
        model(_ids(8) % 64, doc_positions(lens, 7), OneDeviceAttention(lens, 8))
    with pytest.raises(ValueError, match="token ids"):
        model(_ids(8), doc_positions(lens, 8), OneDeviceAttention(lens, 8))
    with pytest.raises(ValueError, match="dtype"):
        TinyLlama(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="num_kv_heads"):
        LlamaConfig(num_heads=4, num_kv_heads=3)


def test_plan_and_shard_without_torch_distributed_is_cp1():
    """No process group: one rank holds the whole batch (the loop runs unchanged on one device)."""
    from flashcp.training import plan_and_shard

    ids = torch.arange(8)
    b = plan_and_shard(ids, [3, 0, 4], "flashcp")
    assert b.plan.cp_size == 1 and torch.equal(b.input_ids, ids)
    assert b.labels.tolist() == [1, 2, -100, 4, 5, 6, -100, -100]
    assert b.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
