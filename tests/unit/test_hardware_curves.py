"""A bandwidth curve of one point (``hardware=h100_ib``: one large-message point) prices without
NumPy warnings and to the numbers of the scalar interpolation, in both pricing paths."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from flashcp.comm import AttnShape
from flashcp.registry import make_plan_for
from flashcp.sim.cost import price_plans, simulate
from flashcp.sim.hardware import _interp_loglog, load_hardware

VALUES = np.array([0.0, -3.0, 1.0, 5e3, 2.7e5, 2.68435456e8, 1e9, 1e12])


@pytest.mark.parametrize(
    ("xs", "ys"),
    [([np.log(2.68435456e8)], [0.0]), ([1.0], [-0.3]), ([2.0, 9.0, 20.0], [-2.0, -0.5, 0.0])],
    ids=["h100_ib", "one", "three"],
)
def test_vector_interpolation_is_the_scalar_one_without_warnings(xs, ys):
    from flashcp.sim.hardware import interp_loglog_v

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = interp_loglog_v(xs, ys, VALUES)
    want = [_interp_loglog(xs, ys, float(v)) for v in VALUES]
    np.testing.assert_allclose(got, want, rtol=1e-15)
    assert interp_loglog_v(xs, ys, VALUES.reshape(2, 4)).shape == (2, 4)


def test_h100_ib_prices_without_warnings():
    hw = load_hardware("h100_ib")
    assert len(hw.busbw_curve_size_kib) == 1  # the one-point curve this test is about
    plans = [make_plan_for(m, [3000, 5000, 8384], 8) for m in ("flashcp", "llama3", "zigzag")]
    shape = AttnShape(32, 8, 128, "bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batched = price_plans(plans, [shape], ["train"], [hw])
        one = [simulate(p, shape, hw, "train")["total_ms"] for p in plans]
    np.testing.assert_allclose(batched["total_ms"][0, 0, 0], one, rtol=1e-12)
