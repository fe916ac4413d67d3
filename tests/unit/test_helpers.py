"""The shared helpers every planner and op uses (Eq. 3 workload, cu_seqlens, softmax scale) and
the split modules' public names (one class per kernel backend; ring metadata vs runtime)."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch

from flashcp.ops.backends import (
    BACKEND_CLASSES,
    CpuBackend,
    ReferenceBackend,
    VarlenBackend,
    backend_class,
    get_backend,
    resolve_softmax_scale,
)
from flashcp.plan import cu_seqlens, doc_workload, shard_workload


def _pairs(p: int, s: int) -> int:
    """Causal query-key pairs of a shard counted one by one: query i (0-based in the shard) sees
    the p prefix keys and keys 0..i of the shard."""
    return sum(p + i + 1 for i in range(s))


def test_shard_workload_counts_the_visible_pairs():
    for p in range(0, 9):
        for s in range(0, 9):
            assert shard_workload(p, s) == _pairs(p, s)
            assert isinstance(shard_workload(p, s), int)
    start = np.array([0, 3, 7, 100])
    length = np.array([5, 1, 0, 64])
    got = shard_workload(start, length)
    assert got.dtype == np.int64
    assert got.tolist() == [_pairs(int(p), int(s)) for p, s in zip(start, length, strict=True)]
    # shards of one document add up to the whole document (d (d + 1) / 2)
    assert shard_workload(0, 10) + shard_workload(10, 7) == doc_workload(17) == 17 * 18 // 2
    assert doc_workload([3, 4]).tolist() == [6, 10]
    # Python ints stay exact beyond int64
    big = 2**40
    assert shard_workload(big, big) == (3 * big + 1) * big // 2


def test_cu_seqlens():
    cu = cu_seqlens([3, 0, 5])
    assert cu.dtype == np.int64
    assert cu.tolist() == [0, 3, 3, 8]
    assert cu_seqlens([]).tolist() == [0]
    t = cu_seqlens(np.array([2, 4], dtype=np.int32), device="cpu")
    assert t.dtype == torch.int32 and t.device.type == "cpu"
    assert t.tolist() == [0, 2, 6]
    with pytest.raises(ValueError, match="1-D"):
        cu_seqlens([[1, 2]])
    with pytest.raises(ValueError, match="int32"):
        cu_seqlens([2**31], device="cpu")


def test_softmax_scale_rule():
    for d in (1, 8, 64, 96, 128, 256):
        assert resolve_softmax_scale(None, d) == 1.0 / math.sqrt(d)
    assert resolve_softmax_scale(0.25, 128) == 0.25
    assert resolve_softmax_scale(None, np.int64(64)) == 0.125  # a NumPy head_dim works too
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softmax_scale"):
            resolve_softmax_scale(bad, 64)
    with pytest.raises(ValueError, match="head_dim"):
        resolve_softmax_scale(None, 0)


def test_one_class_per_backend():
    assert set(BACKEND_CLASSES) == {"flash_attn", "torch_cuda", "cpu", "reference"}
    assert type(get_backend("cpu")) is CpuBackend
    assert type(get_backend("reference")) is ReferenceBackend
    # backend_class(name)(**options) builds that backend's class
    be = backend_class("cpu")(kernel_min=1)
    assert type(be) is CpuBackend and be.kernel_min == 1
    assert pickle.loads(pickle.dumps(be)) == be
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        backend_class("nope")
    with pytest.raises(ValueError, match="'cpu' backend, not 'reference'"):
        CpuBackend("reference")


@pytest.mark.parametrize("name", ["cpu", "reference", "nope"])
def test_the_base_backend_class_cannot_be_built(name):
    """The interface has no kernel: building it is an error that says what to call instead
    (before, ``VarlenBackend("cpu")`` built an object whose first call failed)."""
    for call in (lambda: VarlenBackend(name), lambda: VarlenBackend(name=name)):
        with pytest.raises(TypeError, match=r"get_backend\(.*backend_class\("):
            call()
    with pytest.raises(TypeError, match="get_backend"):
        VarlenBackend()
    # a subclass of one's own still builds (as the tests' stand-in kernels do)
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Mine(VarlenBackend):
        name: str = "mine"

    assert Mine().name == "mine"


def test_ring_metadata_and_runtime_share_one_set_of_names():
    import flashcp.ops.ring_attn as runtime
    import flashcp.ops.ring_meta as meta

    for name in ("BlockCall", "RingMeta", "prepare_ring_meta"):
        assert getattr(runtime, name) is getattr(meta, name)
