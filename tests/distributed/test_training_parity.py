"""A CP training step equals the one-device step: every method, CP 2 and 4, on gloo ranks.

A tiny Llama-style model (:mod:`flashcp.training.model`) takes 3 AdamW steps on 3 packed batches
built to hit the faults of lifting CP into training (a document cut exactly at a rank boundary, a
1-token document, zero-length documents, pad, one document over every rank): on every rank the
labels, positions and metadata come from :mod:`flashcp.training.batch`, the loss from
:func:`flashcp.training.cp_cross_entropy` and the gradients from
:func:`flashcp.training.allreduce_grads`. Per-token losses, the loss, every parameter's gradient
at every step and the parameters after the 3 steps must equal a one-device run of the same model
(the float64 document-masked reference as its attention) within 1e-10 in float64. Two broken
variants (labels shifted after sharding; the loss averaged per rank; positions restarted per
shard; gradients averaged over CP), each on one method per op family, must miss it, so the check
can fail. One launch per CP size runs every method and variant.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from mp_utils import run_ranks

from flashcp.ops.sharding import unshard
from flashcp.registry import make_plan_for, method_names
from flashcp.training import (
    IGNORE_INDEX,
    CPAttention,
    OneDeviceAttention,
    allreduce_grads,
    cp_cross_entropy,
    doc_positions,
    plan_and_shard,
    shard_batch,
    shift_labels,
)
from flashcp.training.model import LlamaConfig, TinyLlama

C = 64
TOL64 = 1e-10
#: float32 (losses ~4, grads ~1e-2): the same sums in other orders (the ops' blocks, the
#: all-reduce) vs a float64 one-device attention; measured up to 1.6e-5
TOL32 = 1e-4
#: batches (doc_lens, pad): C = 64 (divisible by 2N for N = 2, 4)
BATCHES = (
    # documents ending at 16 and 32 (rank boundaries of Ulysses' contiguous C / N chunks at
    # CP 2 and 4), zero-length docs, a 1-token doc, 7 pad
    ([16, 0, 16, 1, 24, 0], 7),
    # one document over every rank, a 1-token doc, a zero-length doc, 4 pad
    ([3, 50, 1, 0, 6], 4),
    # mostly pad: ranks that hold only pad (no gradient of their own, yet in every collective)
    ([1, 9, 0, 6], 48),
)
METHODS = method_names()  # every registered method, ILP included
PLANNED_HERE = ("ilp",)  # time-limited solver: planned once here, handed to the ranks
VARIANTS = ("ok", "labels_after_shard", "loss_per_rank", "positions_per_shard", "grads_averaged")
#: one method per op family: all-gather (full, sharding-aware), ring, Ulysses, hybrid
BROKEN_ON = ("llama3", "flashcp", "zigzag", "ulysses", "usp")


def _input_ids(step: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (C,), generator=torch.Generator().manual_seed(100 + step))


def _model(dtype):
    model = TinyLlama(LlamaConfig(), seed=0, dtype=dtype)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@functools.cache
def _one_device(dtype):
    """Per step: per-token losses (C,), loss, grads; then the parameters after STEPS steps."""
    model, opt = _model(dtype)
    steps = []
    for s, (lens, _pad) in enumerate(BATCHES):
        ids = _input_ids(s, model.config.vocab_size)
        attn = OneDeviceAttention(lens, C)
        logits = model(ids, doc_positions(lens, C), attn)
        loss, per_tok = cp_cross_entropy(logits, shift_labels(ids, lens), [], return_per_token=True)
        opt.zero_grad()
        loss.backward()
        steps.append((per_tok.detach(), float(loss.detach()), _grads(model)))
        opt.step()
    return steps, _params(model)


def _broken_labels(batch):
    """The fault: labels shifted on the rank's local tokens (after sharding); doc ends and pad
    still ignored, so only the tokens before a shard cut get another target."""
    local = torch.cat([batch.input_ids[1:], batch.input_ids.new_full((1,), IGNORE_INDEX)])
    return torch.where(batch.labels == IGNORE_INDEX, batch.labels, local)


def _rank_steps(rank, n, method, plans, dtype, variant):
    model, opt = _model(dtype)
    backend = "reference" if dtype == torch.float64 else "cpu"
    steps = []
    for s, (lens, _pad) in enumerate(BATCHES):
        ids = _input_ids(s, model.config.vocab_size)
        if method in PLANNED_HERE:
            batch = shard_batch(ids, lens, plans[method, s], rank)
        else:
            batch = plan_and_shard(ids, lens, method)
        labels = _broken_labels(batch) if variant == "labels_after_shard" else batch.labels
        positions = batch.positions
        if variant == "positions_per_shard":  # restart at 0 at every shard of the rank
            _, start, length = batch.plan.rank_shards(rank)
            restart = torch.from_numpy(np.repeat(start, length))
            positions = positions.clone()
            positions[: restart.numel()] -= restart
        logits = model(batch.input_ids, positions, CPAttention(batch, backend=backend))
        if variant == "loss_per_rank":  # mean over this rank's tokens, grads averaged over CP
            per_tok = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
            loss = per_tok.sum() / max((labels != IGNORE_INDEX).sum(), 1) / n
        else:
            loss, per_tok = cp_cross_entropy(logits, labels, return_per_token=True)
        opt.zero_grad()
        loss.backward()
        allreduce_grads(model)
        if (
            variant == "grads_averaged"
        ):  # the loss already over the group's tokens: N times too small
            for p in model.parameters():
                p.grad /= n
        steps.append((per_tok.detach(), float(loss.detach()), _grads(model), batch.plan))
        opt.step()
    return steps, _params(model)


def _run(rank, n, cases, plans):
    return {(m, dt, v): _rank_steps(rank, n, m, plans, dt, v) for m, dt, v in cases}


def _maxdiff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _errors(results, key):
    """Largest deviation from the one-device run: per-token losses, loss, grads, params;
    and between ranks (their parameters must stay one model)."""
    ref_steps, ref_params = _one_device(key[1])
    ranks = [r[key] for r in results]
    err = {"per_token": 0.0, "loss": 0.0, "grad": 0.0, "param": 0.0, "ranks_differ": 0.0}
    for s, (ref_tok, ref_loss, ref_grads) in enumerate(ref_steps):
        plan = ranks[0][0][s][3]
        tok = unshard([r[0][s][0] for r in ranks], plan)
        err["per_token"] = max(
            err["per_token"], float((tok.double() - ref_tok.double()).abs().max())
        )
        loss = sum(r[0][s][1] for r in ranks)
        err["loss"] = max(err["loss"], abs(loss - ref_loss))
        err["grad"] = max(err["grad"], _maxdiff(ranks[0][0][s][2], ref_grads))
        for r in ranks[1:]:
            err["ranks_differ"] = max(err["ranks_differ"], _maxdiff(r[0][s][2], ranks[0][0][s][2]))
    err["param"] = _maxdiff(ranks[0][1], ref_params)
    return err


@functools.cache
def _launch(n: int, dtypes: tuple, variants: tuple, methods: tuple):
    plans = {
        (m, s): make_plan_for(m, lens, n, num_pad=pad)
        for m in PLANNED_HERE
        if m in methods
        for s, (lens, pad) in enumerate(BATCHES)
    }
    cases = [
        (m, dt, v)
        for dt in dtypes
        for v in variants
        for m in methods
        if v == "ok" or m in BROKEN_ON
    ]
    results = run_ranks(_run, n, cases, plans, timeout_s=240)
    return {key: _errors(results, key) for key in cases}


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_method_matches_one_device_float64(n):
    errs = _launch(n, (torch.float64,), VARIANTS, METHODS)
    bad = {m: e for (m, _, v), e in errs.items() if v == "ok" and max(e.values()) > TOL64}
    assert not bad, f"CP {n}: training step differs from one device (> {TOL64}): {bad}"


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("variant", VARIANTS[1:])
def test_broken_variants_fail_the_parity_check(n, variant):
    """Each broken variant misses the tolerance by orders of magnitude on every op family: the
    parity check can fail, and fails on exactly these faults."""
    errs = _launch(n, (torch.float64,), VARIANTS, METHODS)
    passed = {m: e for (m, _, v), e in errs.items() if v == variant and e["grad"] <= 1e3 * TOL64}
    assert not passed, f"CP {n}: {variant} was not caught: {passed}"
    assert sum(v == variant for (_, _, v) in errs) == len(BROKEN_ON)
    if variant == "labels_after_shard":  # only shard-boundary tokens move: per-token losses show it
        assert all(e["per_token"] > 1e-3 for (m, _, v), e in errs.items() if v == variant)


@pytest.mark.slow  # the float64 parity at n = 2 runs the same steps in the fast loop
def test_float32_matches_one_device():
    """float32 (the cpu kernels, float32 sums): every method at CP 2 within TOL32."""
    errs = _launch(2, (torch.float32,), ("ok",), METHODS)
    bad = {m: e for (m, _, _), e in errs.items() if max(e.values()) > TOL32}
    assert not bad, f"float32 training step differs from one device (> {TOL32}): {bad}"
    assert max(max(e.values()) for e in errs.values()) > 0  # float32: not bitwise, so compared


def test_batches_hit_the_faults():
    """The batches hold what the test claims: a document ending exactly at a rank boundary
    (Ulysses' contiguous chunks), 1-token and zero-length documents, pad, a document on every
    rank, a rank with only pad."""
    assert all(sum(lens) + pad == C for lens, pad in BATCHES)  # pad = C - sum(doc_lens)
    lens0 = BATCHES[0][0]
    assert 1 in lens0 and 0 in lens0 and BATCHES[0][1] > 0
    for n in (2, 4):
        plan = make_plan_for("ulysses", BATCHES[0][0], n, num_pad=BATCHES[0][1])
        doc, start, length = plan.rank_shards(0)
        assert start[-1] + length[-1] == BATCHES[0][0][doc[-1]]  # rank 0 ends a document
        assert plan.rank_shards(1)[1][0] == 0  # and rank 1 starts the next one
        plan = make_plan_for("zigzag", BATCHES[1][0], n, num_pad=BATCHES[1][1])
        assert set(plan.rank[plan.doc == 1].tolist()) == set(range(n))
        plan = make_plan_for("llama3", BATCHES[2][0], n, num_pad=BATCHES[2][1])
        assert set(plan.rank.tolist()) != set(range(n))  # some rank holds no shard: only pad


DP_METHODS = ("zigzag", "flashcp")


def _dp_run(rank, world, methods):
    """World 4 = DP 2 x CP 2: CP groups {0, 1}, {2, 3} (one sequence each), DP groups {0, 2},
    {1, 3}; the loss's count and the gradients are reduced over both."""
    import torch.distributed as dist

    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    cp, dp = cp_groups[rank // 2], dp_groups[rank % 2]
    out = {}
    for m in methods:
        model, opt = _model(torch.float64)
        for s in range(len(BATCHES)):
            lens, _ = BATCHES[(s + rank // 2) % len(BATCHES)]  # replicas hold other batches
            ids = _input_ids(s + 10 * (rank // 2), model.config.vocab_size)
            batch = plan_and_shard(ids, lens, m, cp)
            logits = model(
                batch.input_ids, batch.positions, CPAttention(batch, cp, backend="reference")
            )
            loss = cp_cross_entropy(logits, batch.labels, [cp, dp])
            opt.zero_grad()
            loss.backward()
            allreduce_grads(model, [cp, dp])
            opt.step()
        out[m] = _params(model)
    return out


def test_data_parallel_times_cp_matches_one_device():
    """DP 2 x CP 2: the step equals one device's step on both replicas' sequences together
    (cross-entropy summed over both, divided by their valid tokens together)."""
    model, opt = _model(torch.float64)
    for s in range(len(BATCHES)):
        total, n_valid = 0, 0
        for replica in (0, 1):
            lens, _ = BATCHES[(s + replica) % len(BATCHES)]
            ids = _input_ids(s + 10 * replica, model.config.vocab_size)
            labels = shift_labels(ids, lens)
            logits = model(ids, doc_positions(lens, C), OneDeviceAttention(lens, C))
            total = total + torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
            n_valid += int((labels != IGNORE_INDEX).sum())
        opt.zero_grad()
        (total / n_valid).backward()
        opt.step()
    ref = _params(model)
    results = run_ranks(_dp_run, 4, DP_METHODS, timeout_s=120)
    errs = {(r, m): _maxdiff(res[m], ref) for r, res in enumerate(results) for m in DP_METHODS}
    assert max(errs.values()) <= TOL64, errs


def _bad_label_on_one_rank(rank, world):
    logits = torch.zeros(4, 8, dtype=torch.float64)
    labels = torch.tensor([1, 2, 99 if rank == 1 else 3, -100])
    try:
        cp_cross_entropy(logits, labels)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_bad_labels_on_one_rank_fail_every_rank_at_once():
    """A rank's bad input is a ValueError on every rank (the count's all-reduce carries a flag),
    not a peer left waiting in the next collective."""
    msgs = run_ranks(_bad_label_on_one_rank, 2, timeout_s=30)
    assert "label 99 out of range" in msgs[1] and "peer rank" in msgs[0], msgs


def _different_models(rank, world):
    model = torch.nn.Linear(2, 3 if rank == 1 else 2)
    try:
        allreduce_grads(model)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ranks_with_different_parameters_fail_every_rank():
    msgs = run_ranks(_different_models, 2, timeout_s=30)
    assert all("parameters differ: 6 to 9 elements" in m for m in msgs), msgs
