"""The 95% intervals of the per-run summary (experiments/aggregate.py): of the mean ``total_ms`` and
of ``speedup_vs_llama3`` (a ratio of means over paired sequences)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from experiments.aggregate import summarise
from experiments.plot import _yerr
from flashcp.results import IDENTITY_COLUMNS, INT_COLUMNS


def _rows(llama3_ms: np.ndarray, method_ms: np.ndarray) -> pd.DataFrame:
    """Rows of a llama3 run and a flashcp run over the same sequences; ``*_ms``: (replicates, n)
    float64, one replicate per ``seed`` (a separate run identity)."""
    reps, n = llama3_ms.shape
    parts = []
    for method, ms in (("llama3", llama3_ms), ("flashcp", method_ms)):
        seed, seq = np.divmod(np.arange(reps * n), n)
        df = pd.DataFrame(
            {c: 1 if c in INT_COLUMNS else "x" for c in IDENTITY_COLUMNS}, index=range(reps * n)
        )
        df["method"], df["seed"], df["seq_idx"] = method, seed, seq
        df["run_id"] = [f"{method}-{s}" for s in seed]
        df["mode"], df["status"], df["total_ms"] = "train", "ok", ms.reshape(-1)
        parts.append(df)
    return pd.concat(parts, ignore_index=True)


def test_intervals_match_the_formulas():
    rng = np.random.default_rng(0)
    x = rng.gamma(2.0, 5.0, size=(1, 30))
    y = 1.5 * x * rng.gamma(20.0, 1 / 20.0, size=x.shape)
    s = summarise(_rows(y, x)).set_index("method")
    t = stats.t.ppf(0.975, 29)
    fl, ll = s.loc["flashcp"], s.loc["llama3"]
    half = t * x.std(ddof=1) / np.sqrt(30)
    assert fl["total_ms_ci95_lo"] == pytest.approx(x.mean() - half)
    assert fl["total_ms_ci95_hi"] == pytest.approx(x.mean() + half)
    assert fl["total_ms_p10"] == pytest.approx(np.quantile(x, 0.1))
    r = y.mean() / x.mean()
    half_r = t * (y - r * x).std(ddof=1) / (x.mean() * np.sqrt(30))
    assert fl["speedup_vs_llama3"] == pytest.approx(r)
    assert fl["speedup_vs_llama3_ci95_lo"] == pytest.approx(r - half_r)
    assert fl["speedup_vs_llama3_ci95_hi"] == pytest.approx(r + half_r)
    # llama3 against itself: exactly 1, no spread
    assert ll["speedup_vs_llama3_ci95_lo"] == ll["speedup_vs_llama3_ci95_hi"] == 1.0


def test_one_sequence_has_no_interval():
    s = summarise(_rows(np.array([[3.0]]), np.array([[2.0]])))
    assert s["total_ms_ci95_lo"].isna().all() and s["speedup_vs_llama3_ci95_hi"].isna().all()
    assert (s["num_ok"] == 1).all()


def test_intervals_cover_the_true_value_about_95_percent():
    """400 replicate runs of 40 paired sequences with known E[x] = 10 and E[y]/E[x] = 1.5."""
    rng = np.random.default_rng(1)
    x = rng.gamma(2.0, 5.0, size=(400, 40))
    y = 1.5 * x * rng.gamma(20.0, 1 / 20.0, size=x.shape)  # mean-one noise, independent of x
    s = summarise(_rows(y, x))
    fl = s[s["method"] == "flashcp"]
    assert len(fl) == 400
    mean_cover = ((fl["total_ms_ci95_lo"] <= 10.0) & (10.0 <= fl["total_ms_ci95_hi"])).mean()
    ratio_cover = (
        (fl["speedup_vs_llama3_ci95_lo"] <= 1.5) & (1.5 <= fl["speedup_vs_llama3_ci95_hi"])
    ).mean()
    # binomial sd of a 95% coverage over 400 replicates is 1.1 points
    assert 0.91 <= mean_cover <= 0.985, mean_cover
    assert 0.91 <= ratio_cover <= 0.985, ratio_cover


def test_figures_take_error_bars_from_the_interval_columns():
    s = summarise(_rows(np.array([[3.0, 4.0, 6.0]]), np.array([[2.0, 2.5, 3.0]])))
    below, above = _yerr(s, "speedup_vs_llama3")
    assert below == pytest.approx(list(s["speedup_vs_llama3"] - s["speedup_vs_llama3_ci95_lo"]))
    assert above == pytest.approx(list(s["speedup_vs_llama3_ci95_hi"] - s["speedup_vs_llama3"]))
    assert _yerr(s, "total_ms_mean", "total_ms")[1] == pytest.approx(
        list(s["total_ms_ci95_hi"] - s["total_ms_mean"])
    )
    # a summary from before the interval columns: no error bars (the title says so)
    assert _yerr(s.drop(columns=["speedup_vs_llama3_ci95_lo"]), "speedup_vs_llama3") is None
