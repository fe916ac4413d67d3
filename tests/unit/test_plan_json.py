"""Every plan is JSON-clean: ``json.dumps(plan.to_dict())`` works and ``Plan.from_dict`` reads it
back to an equal plan, for every method of the registry, from Python or NumPy inputs."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from flashcp.plan import Plan, json_value, make_plan
from flashcp.registry import make_plan_for, method_names

# a short ILP solve: a worker process, a few pieces
_OPTIONS = {"ilp": {"time_limit_s": 1, "block_size": 512}}


def _pile_lens():
    """What the sampler hands every planner: an int64 array."""
    from flashcp.data import load_distribution, sample_sequences

    return sample_sequences(load_distribution("pile", context_len=8192), 1, 8192, seed=3)[0]


def _roundtrip(plan: Plan) -> Plan:
    text = json.dumps(plan.to_dict())  # the standard module, no custom encoder
    back = Plan.from_dict(json.loads(text))
    assert back == plan and back.digest() == plan.digest()
    assert json.dumps(back.to_dict()) == text
    return back


@pytest.mark.parametrize(
    "method", [pytest.param(m, marks=pytest.mark.slow) if m == "ilp" else m for m in method_names()]
)
def test_every_plan_roundtrips_through_json(method):
    lens = [300, 40, 1200, 7, 500, 2049]  # 4096 tokens
    inputs = {
        "list": (lens, 4),
        "int64": (np.array(lens, dtype=np.int64), np.int64(4)),
        "int32": (np.array(lens, dtype=np.int32), np.int32(4)),
        "sampler": (_pile_lens(), np.int64(4)),
    }
    for kind, (doc_lens, cp) in inputs.items():
        plan = make_plan_for(method, doc_lens, cp, **_OPTIONS.get(method, {}))
        assert isinstance(plan.cp_size, int), kind
        _roundtrip(plan)


def test_ilp_fallback_and_padded_plans_roundtrip():
    lens = np.array([0, 300, 40, 0, 1200, 7, 500, 2041], dtype=np.int64)  # zero-length docs
    for method in ("flashcp", "ring", "llama3"):
        _roundtrip(make_plan_for(method, lens, np.int64(4), pad_to_multiple=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        killed = make_plan_for(
            "ilp", lens, np.int64(4), num_pad=8, time_limit_s=0.01, watchdog_grace_s=0.0
        )
    assert killed.status == "fallback"
    _roundtrip(killed)


def test_numpy_values_in_info_become_plain_json_at_construction():
    info = {
        "count": np.int64(3),
        "ratio": np.float32(1.5),
        "flag": np.bool_(True),
        "docs": np.arange(3),
        "pair": (np.int32(1), 2.5),
        "nested": {"k": [np.int64(7), None, "x"]},
    }
    plan = make_plan("flashcp", np.int64(2), np.array([3, 4]), [0, 1], [0, 1], [0, 0], [3, 4],
                     info=info, pad=np.array([1, 0]))  # fmt: skip
    assert plan.info == {
        "count": 3, "ratio": 1.5, "flag": True, "docs": [0, 1, 2], "pair": [1, 2.5],
        "nested": {"k": [7, None, "x"]},
    }  # fmt: skip
    assert type(plan.info["count"]) is int and type(plan.info["flag"]) is bool
    _roundtrip(plan)
    with pytest.raises(ValueError, match=r"plan.info\['bad'\] = .*object"):
        make_plan("flashcp", 1, [4], [0], [0], [0], [4], info={"bad": object()})
    with pytest.raises(ValueError, match="key 1 that is not a string"):
        json_value({1: "a"})
    from flashcp.registry import CommKind

    assert (
        type(json_value(CommKind.P2P_RING)) is str and json_value(CommKind.P2P_RING) == "p2p_ring"
    )


def test_from_dict_rejects_what_to_dict_never_writes():
    d = make_plan_for("per_doc", [4, 12], 2).to_dict()
    with pytest.raises(ValueError, match="ranks"):
        Plan.from_dict({k: v for k, v in d.items() if k != "ranks"})
    with pytest.raises(ValueError, match=r"ranks 0\.\.1 in order"):
        Plan.from_dict({**d, "ranks": d["ranks"][::-1]})
    with pytest.raises(ValueError, match="doc, start and length"):
        Plan.from_dict({**d, "ranks": [{"rank": 0, "shards": [{"doc": 0}]}, d["ranks"][1]]})
    lost = json.loads(json.dumps(d))
    lost["ranks"][0]["shards"].pop()
    with pytest.raises(ValueError):
        Plan.from_dict(lost)  # a token held by no rank: validate() says so
    other = make_plan_for("per_doc", [4, 12], 2)
    assert other == Plan.from_dict(d) and other != make_plan_for("ring", [4, 12], 2)
