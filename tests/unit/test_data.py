"""Tests of the document-length distributions and the sequence sampler (flashcp/data/).

Statistical checks compare large samples with values computed *here* from the tables (not from the
class under test) and from docs/design.md §5. Tolerances are Z standard errors of the estimate, with the
standard error derived from the sample size and the law's analytic spread; with Z = 5 a correct
sampler fails with probability < 1e-6 per check (and the seeds are fixed, so runs are repeatable).
"""

from __future__ import annotations

import csv
import importlib.util
import itertools
import math
import re
from pathlib import Path

import numpy as np
import pytest

from flashcp.data import (
    DATASETS,
    BinnedDistribution,
    LengthDistribution,
    LogNormalMixture,
    default_data_dir,
    load_distribution,
    read_lengths_file,
    sample_packed,
    sample_sequences,
)

Z = 5.0
N = 1_000_000  # documents per large sample


def phi(x: float) -> float:
    """Standard normal CDF."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def mean_tol(sd: float, n: int) -> float:
    return Z * sd / math.sqrt(n)


def frac_tol(p: float, n: int) -> float:
    return Z * math.sqrt(p * (1.0 - p) / n)


def read_csv(name: str) -> list[dict[str, str]]:
    with (default_data_dir() / name).open(newline="") as f:
        return list(csv.DictReader(f))


def lognormal_table(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = read_csv(f"{name}.csv")
    return (
        np.array([float(r["docs"]) for r in rows]),
        np.array([float(r["mean_tokens"]) for r in rows]),
        np.array([float(r["sigma"]) for r in rows]),
    )


# ---------------------------------------------------------------------------------------------
# the data files


def test_datasets_folder_is_data_only():
    d = default_data_dir()
    assert d.is_dir()
    assert not list(d.glob("*.py")), "datasets/ must not be a Python package (it shadows HF's)"
    assert {"wlb_llm.csv", "pile.csv", "redpajama.csv", "README.md"} <= {
        p.name for p in d.iterdir()
    }


def test_tables_hold_design_values():
    wlb = read_csv("wlb_llm.csv")
    assert len(wlb) == 17
    assert sum(float(r["doc_pct"]) for r in wlb) == pytest.approx(99.997, abs=1e-9)
    assert (wlb[0]["lo_tokens"], wlb[0]["hi_tokens"], wlb[0]["doc_pct"]) == ("1", "6272", "97.254")
    assert int(wlb[-1]["hi_tokens"]) - 1 == 124_913  # DESIGN max length, last bin closed
    # bins tile [1, 124913] without gaps
    assert all(int(a["hi_tokens"]) == int(b["lo_tokens"]) for a, b in itertools.pairwise(wlb))
    pile = {r["component"]: r for r in read_csv("pile.csv")}
    assert len(pile) == 22
    assert (pile["Books3"]["docs"], pile["Books3"]["mean_tokens"]) == ("277655", "136552")
    assert pile["Pile-CC"]["docs"] == "52440000"
    rp = {r["source"]: r for r in read_csv("redpajama.csv")}
    assert len(rp) == 7
    assert (rp["Books"]["docs"], rp["Books"]["mean_tokens"], rp["Books"]["sigma"]) == (
        "205744",
        "126371",
        "0.75",
    )


# ---------------------------------------------------------------------------------------------
# WLB-LLM


def wlb_bins() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = read_csv("wlb_llm.csv")
    lo = np.array([int(r["lo_tokens"]) for r in rows])
    hi = np.array([int(r["hi_tokens"]) for r in rows])
    p = np.array([float(r["doc_pct"]) for r in rows])
    return lo, hi, p / p.sum()


def test_wlb_llm_model_matches_design():
    dist = load_distribution("wlb_llm")
    lo, hi, p = wlb_bins()
    mean = float(np.sum(p * (lo + hi - 1) / 2))  # uniform integers in [lo, hi)
    assert dist.mean() == pytest.approx(mean, rel=1e-12)
    # DESIGN: mean 3,962 and median 3,227 of the underlying data; uniform-within-bin moves the mean
    # by the within-bin shape only (the data's first bin averages 3,131.6, uniform gives 3,136)
    assert dist.mean() == pytest.approx(3962, rel=0.005)
    assert abs(dist.median() - 3227) <= 5
    assert abs(float(dist.cdf(3227)) - 0.5) < 1e-3


def test_wlb_llm_samples():
    dist = load_distribution("wlb_llm")
    lo, hi, p = wlb_bins()
    x = dist.sample(np.random.default_rng(1), N)
    assert x.dtype == np.int64 and x.shape == (N,)
    assert x.min() >= 1 and x.max() <= 124_913
    assert abs(x.mean() - dist.mean()) < mean_tol(dist.std(), N)
    # bin shares
    counts = np.histogram(x, bins=np.append(lo, hi[-1]))[0] / N
    for c, q in zip(counts, p, strict=True):
        assert abs(c - q) < frac_tol(q, N)
    # median: the empirical CDF at DESIGN's median is 1/2
    assert abs(np.mean(x <= 3227) - 0.5) < frac_tol(0.5, N) + 1e-3
    # uniform inside the first bin: its mean is (1 + 6271) / 2
    first = x[x < 6272]
    assert abs(first.mean() - 3136) < mean_tol(6271 / math.sqrt(12), len(first))


def test_wlb_llm_tokens_weighting():
    dist = load_distribution("wlb_llm")
    lo, hi, p = wlb_bins()
    m1 = m2 = m3 = 0.0
    for a, b, q in zip(lo, hi, p, strict=True):
        k = np.arange(a, b, dtype=np.float64)
        m1, m2, m3 = m1 + q * k.mean(), m2 + q * (k**2).mean(), m3 + q * (k**3).mean()
    tmean, tsd = m2 / m1, math.sqrt(m3 / m1 - (m2 / m1) ** 2)
    assert dist.mean("tokens") == pytest.approx(tmean, rel=1e-12)
    x = dist.sample(np.random.default_rng(2), N, weighting="tokens")
    assert abs(x.mean() - tmean) < mean_tol(tsd, N)
    assert x.mean() > 4 * dist.mean()
    # bin probabilities ∝ share × bin mean; inside a bin ∝ d: first-bin mean = Σk²/Σk = (2·6271+1)/3
    bin_mean = (lo + hi - 1) / 2
    q = p * bin_mean / np.sum(p * bin_mean)
    counts = np.histogram(x, bins=np.append(lo, hi[-1]))[0] / N
    for c, qq in zip(counts, q, strict=True):
        assert abs(c - qq) < frac_tol(qq, N)
    first = x[x < 6272].astype(np.float64)
    k = np.arange(1, 6272, dtype=np.float64)
    sd_first = math.sqrt(np.sum(k**3) / np.sum(k) - (np.sum(k**2) / np.sum(k)) ** 2)
    assert abs(first.mean() - (2 * 6271 + 1) / 3) < mean_tol(sd_first, len(first))


@pytest.mark.parametrize("weighting", ["documents", "tokens"])
def test_binned_exact_pmf(weighting):
    """Small bins: every integer of [lo, hi) and nothing else, with the exact probabilities."""
    dist = BinnedDistribution("t", lo=[1, 3, 10], hi=[3, 4, 13], share=[1, 1, 2])
    pmf = {1: 1 / 8, 2: 1 / 8, 3: 1 / 4, 10: 1 / 6, 11: 1 / 6, 12: 1 / 6}
    if weighting == "tokens":
        z = sum(d * q for d, q in pmf.items())
        pmf = {d: d * q / z for d, q in pmf.items()}
    n = 400_000
    x = dist.sample(np.random.default_rng(12), n, weighting=weighting)
    values, counts = np.unique(x, return_counts=True)
    assert values.tolist() == sorted(pmf)
    for v, c in zip(values.tolist(), counts, strict=True):
        assert abs(c / n - pmf[v]) < frac_tol(pmf[v], n), v
    m1 = sum(
        d * q for d, q in {1: 1 / 8, 2: 1 / 8, 3: 1 / 4, 10: 1 / 6, 11: 1 / 6, 12: 1 / 6}.items()
    )
    assert dist.mean() == pytest.approx(m1)
    assert dist.mean(weighting) == pytest.approx(sum(d * q for d, q in pmf.items()))


# ---------------------------------------------------------------------------------------------
# Pile and RedPajama


@pytest.mark.parametrize(("name", "design_mean"), [("pile", 1755), ("redpajama", 1299)])
def test_mixture_mean_and_median(name, design_mean):
    dist = load_distribution(name)
    docs, m, s = lognormal_table(name)
    w = docs / docs.sum()
    mean = float(np.sum(w * m))  # the source is drawn ∝ document count
    sd = math.sqrt(float(np.sum(w * m**2 * np.exp(s**2))) - mean**2)
    assert mean == pytest.approx(design_mean, abs=1.0)
    assert dist.mean() == pytest.approx(mean, rel=1e-12)
    x = dist.sample(np.random.default_rng(3), N)
    assert x.min() >= 1
    assert abs(x.mean() - mean) < mean_tol(sd, N)
    # median of the mixture: P(round(X) <= t) = Σ w Φ((ln(t + 1/2) - mu) / σ), from the table
    mu = np.log(m) - s**2 / 2
    t = dist.median()
    p_t = float(np.sum(w * [phi((math.log(t + 0.5) - a) / b) for a, b in zip(mu, s, strict=True)]))
    assert 0.5 <= p_t < 0.5 + 0.01
    assert abs(np.mean(x <= t) - p_t) < frac_tol(p_t, N)


def test_redpajama_tokens_in_long_documents():
    """About 30% of RedPajama's tokens sit in documents longer than 4K (docs/design.md §5)."""
    dist = load_distribution("redpajama")
    docs, m, s = lognormal_table("redpajama")
    w = docs / docs.sum()
    mu = np.log(m) - s**2 / 2
    # E[X; X > t] / E[X] for a log-normal = 1 - Φ((ln t - mu - σ²) / σ)
    t = 4096
    tail = [1 - phi((math.log(t) - a - b * b) / b) for a, b in zip(mu, s, strict=True)]
    frac = float(np.sum(w * m * tail) / np.sum(w * m))
    assert abs(frac - 0.30) < 0.05
    x = dist.sample(np.random.default_rng(4), N).astype(np.float64)
    a = np.where(x > t, x, 0.0)
    est = a.sum() / x.sum()
    se = np.std(a - est * x) / (math.sqrt(N) * x.mean())  # delta method for a ratio of means
    assert abs(est - frac) < Z * se


@pytest.mark.parametrize("name", ["pile", "redpajama"])
def test_every_component_mean_and_median(name):
    """Each source alone is log-normal with mean m and median m·exp(-σ²/2)."""
    dist = load_distribution(name)
    _, m, s = lognormal_table(name)
    assert isinstance(dist, LogNormalMixture)
    n = 100_000
    rng = np.random.default_rng(5)
    for comp, mi, si in zip(dist.components, m, s, strict=True):
        x = dist.component(comp).sample(rng, n)
        sd = mi * math.sqrt(math.expm1(si**2))
        assert abs(x.mean() - mi) < mean_tol(sd, n) + 0.5, comp  # +0.5: rounding to integers
        med = mi * math.exp(-(si**2) / 2)
        t = math.floor(med)
        p_t = phi((math.log(t + 0.5) - math.log(med)) / si)  # P(round(X) <= floor(median))
        assert abs(np.mean(x <= t) - p_t) < frac_tol(p_t, n), comp


@pytest.mark.parametrize("name", ["pile", "redpajama"])
def test_every_component_tokens_weighting(name):
    """Length-biased log-normal(mu, σ) is log-normal(mu + σ², σ): check the mean of ln d."""
    dist = load_distribution(name)
    _, m, s = lognormal_table(name)
    n = 200_000
    rng = np.random.default_rng(13)
    for comp, mi, si in zip(dist.components, m, s, strict=True):
        x = dist.component(comp).sample(rng, n, weighting="tokens")
        want = math.log(mi) + si**2 / 2  # mu + σ² with mu = ln m - σ²/2
        # rounding to integers moves ln d by at most 0.5 / d; d > 100 here in all but ~1e-4 of draws
        assert abs(np.log(x).mean() - want) < mean_tol(si, n) + 0.005, comp


@pytest.mark.parametrize("name", ["pile", "redpajama"])
def test_mixture_tokens_weighting(name):
    dist = load_distribution(name)
    docs, m, s = lognormal_table(name)
    w = docs / docs.sum()
    m1 = np.sum(w * m)
    m2 = np.sum(w * m**2 * np.exp(s**2))
    m3 = np.sum(w * m**3 * np.exp(3 * s**2))
    tmean, tsd = m2 / m1, math.sqrt(m3 / m1 - (m2 / m1) ** 2)
    assert dist.mean("tokens") == pytest.approx(tmean, rel=1e-12)
    assert dist.mean("tokens") > 5 * dist.mean()
    x = dist.sample(np.random.default_rng(6), N, weighting="tokens")
    assert abs(x.mean() - tmean) < mean_tol(tsd, N)


# ---------------------------------------------------------------------------------------------
# stress and user files


def test_stress_shape():
    c = 8192
    dist = load_distribution("stress", context_len=c)
    x = dist.sample(np.random.default_rng(7), N)
    p1 = phi((1.5 - c / 2) / (c / 2))  # X < 1.5 rounds (and is cut) to 1
    assert p1 == pytest.approx(0.1587, abs=1e-3)
    assert abs(np.mean(x == 1) - p1) < frac_tol(p1, N)
    assert x.min() == 1
    assert abs(np.median(x) - c / 2) < 20  # median of N(C/2, C/2) is C/2; se ≈ 1.25σ/√N ≈ 5
    assert abs(np.mean(x <= c / 2) - phi(0.5 / (c / 2))) < frac_tol(0.5, N)
    assert abs(x.mean() - dist.mean()) < mean_tol(dist.std(), N)
    # mean of max(1, X): P(X < 1.5) + E[X; X >= 1.5], written out for the normal
    a = (1.5 - c / 2) / (c / 2)
    mean = p1 + (c / 2) * (1 - p1) + (c / 2) * math.exp(-a * a / 2) / math.sqrt(2 * math.pi)
    assert dist.mean() == pytest.approx(mean, rel=1e-9)
    xt = dist.sample(np.random.default_rng(8), N, weighting="tokens")
    assert abs(xt.mean() - dist.mean("tokens")) < mean_tol(dist.std("tokens"), N)
    assert abs(np.mean(xt == 1) - p1 / dist.mean()) < frac_tol(p1 / dist.mean(), N)


# ---------------------------------------------------------------------------------------------
# wlb_llm_synthetic: the WLB-LLM code's generator (trunc(X C), X ~ Normal(0.5, 0.5), redraw <= 0)


def normal_partial_mean(mu: float, sd: float, a: float, b: float) -> float:
    """E[Y; a <= Y < b] for Y ~ Normal(mu, sd), written out (not from the class under test)."""
    za, zb = (a - mu) / sd, (b - mu) / sd
    dens = (math.exp(-za * za / 2) - math.exp(-zb * zb / 2)) / math.sqrt(2 * math.pi)
    return mu * (phi(zb) - phi(za)) + sd * dens


def test_wlb_llm_synthetic_law():
    c = 8192
    dist = load_distribution("wlb_llm_synthetic", context_len=c)
    mu = sd = c / 2
    z = 1 - phi((1 - mu) / sd)  # P(X C >= 1): the draws kept
    p_full = (1 - phi((c - mu) / sd)) / z  # a draw >= C is one whole context
    assert p_full == pytest.approx(0.1587 / 0.8413, abs=1e-3)
    # E[min(trunc(Y), C) | Y >= 1]: the partial mean of Y on [1, C), less 1/2 for the truncation
    # (to O(1/C)), plus C times the mass at C
    mean = (
        normal_partial_mean(mu, sd, 1, c)
        - 0.5 * (1 - phi((1 - mu) / sd) - (1 - phi((c - mu) / sd)))
    ) / z
    mean += c * p_full
    assert dist.mean() == pytest.approx(mean, abs=0.05)
    x = dist.sample(np.random.default_rng(21), N)
    assert x.min() >= 1 and x.max() == c
    assert abs(x.mean() - dist.mean()) < mean_tol(dist.std(), N)
    assert abs(np.mean(x == c) - p_full) < frac_tol(p_full, N)
    # non-positive draws are redrawn, not clipped: no mass piles up at length 1 (stress: 16%)
    p1 = (phi((2 - mu) / sd) - phi((1 - mu) / sd)) / z
    assert p1 < 1e-4 and np.mean(x == 1) < 1e-4
    assert (
        np.mean(load_distribution("stress", context_len=c).sample(np.random.default_rng(0), N) == 1)
        > 0.15
    )
    # below C the law is the normal's: P(d <= C/2) = P(1 <= Y < C/2 + 1) / Z
    q = (phi((c / 2 + 1 - mu) / sd) - phi((1 - mu) / sd)) / z
    assert float(dist.cdf(c // 2)) == pytest.approx(q, abs=1e-9)
    assert abs(np.mean(x <= c // 2) - q) < frac_tol(q, N)
    xt = dist.sample(np.random.default_rng(22), N, weighting="tokens")
    assert abs(xt.mean() - dist.mean("tokens")) < mean_tol(dist.std("tokens"), N)
    assert abs(np.mean(xt == c) - c * p_full / dist.mean()) < frac_tol(c * p_full / dist.mean(), N)


def test_wlb_llm_synthetic_moments_follow_the_normal():
    """With a narrow law (no draw near 0 or C) the moments are those of Normal(m C, s C)."""
    from flashcp.data import WlbSyntheticNormal

    c = 100_000
    dist = WlbSyntheticNormal(c, mean_frac=0.5, std_frac=0.05)
    assert dist.mean() == pytest.approx(0.5 * c - 0.5, abs=1e-6)  # trunc: 1/2 token less
    assert dist.std() == pytest.approx(math.sqrt((0.05 * c) ** 2 + 1 / 12), rel=1e-6)
    x = dist.sample(np.random.default_rng(3), N)
    assert abs(x.mean() - (0.5 * c - 0.5)) < mean_tol(0.05 * c, N)
    assert x.std() == pytest.approx(0.05 * c, rel=0.01)
    for kwargs, bad in [({"std_frac": 0}, "std_frac"), ({"mean_frac": float("nan")}, "nan")]:
        with pytest.raises(ValueError, match=bad):
            WlbSyntheticNormal(c, **kwargs)
    with pytest.raises(ValueError, match="context_len"):
        load_distribution("wlb_llm_synthetic")


def generator_sequence(rng: np.random.Generator, c: int) -> list[int]:
    """One sequence by the WLB-LLM code's rules, restated here literally (one draw at a time)."""
    lens: list[int] = []
    total = 0
    while total <= c:
        d = int(rng.normal(0.5, 0.5) * c)
        if d <= 0:
            continue
        lens.append(d)
        total += d
    if total > c:
        lens[-1] = c - sum(lens[:-1])
    if lens[-1] == 0:
        lens.pop()
    return lens


def test_wlb_llm_synthetic_sequences_are_the_generators():
    """flashcp-run's sampler (overlong split) gives the generator's sequence law: the same number of
    documents per sequence and the same first and last lengths, within sampling error."""
    from flashcp.data import sample_dataset

    c, n = 4096, 4000
    seqs, counts = sample_dataset("wlb_llm_synthetic", n, c, seed=5)
    assert all(int(s.sum()) == c and s.min() >= 1 for s in seqs)
    assert not any(x["overlong_docs"] or x["overlong_tokens_cut"] for x in counts)
    rng = np.random.default_rng(99)
    ref = [generator_sequence(rng, c) for _ in range(n)]
    for stat in (len, lambda s: s[0], lambda s: s[-1]):
        a = np.array([stat(list(s)) for s in seqs], dtype=np.float64)
        b = np.array([stat(s) for s in ref], dtype=np.float64)
        se = math.sqrt(a.var() / n + b.var() / n)
        assert abs(a.mean() - b.mean()) < Z * se
    # deterministic per seed; another seed gives other sequences
    again, _ = sample_dataset("wlb_llm_synthetic", n, c, seed=5)
    assert all(np.array_equal(a, b) for a, b in zip(seqs, again, strict=True))
    other, _ = sample_dataset("wlb_llm_synthetic", 50, c, seed=6)
    assert not all(np.array_equal(a, b) for a, b in zip(seqs[:50], other, strict=True))


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_user_file_formats(tmp_path):
    want = np.array([5, 10, 3, 7])
    files = [
        write(tmp_path, "a.txt", "5\n10\n\n# comment\n3\n7\n"),
        write(tmp_path, "b.csv", "name,doc_len\nx,5\ny,10\nz,3\nw,7\n"),
        write(tmp_path, "c.csv", "name,len\nx,5\ny,10\nz,3\nw,7\n"),  # the only numeric
        write(tmp_path, "d.csv", "id,doc_len,len\n0,5,1\n1,10,2\n2,3,3\n3,7,4\n"),  # doc_len
    ]
    np.save(tmp_path / "e.npy", want)
    np.save(tmp_path / "f.npy", want.astype(np.float32))
    files += [tmp_path / "e.npy", tmp_path / "f.npy"]
    for f in files:
        got = read_lengths_file(f)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want, err_msg=str(f))
        dist = load_distribution("file", path=str(f))
        assert dist.name == "file"
        assert dist.mean() == pytest.approx(want.mean())


def test_user_file_weightings(tmp_path):
    dist = load_distribution("file", path=write(tmp_path, "l.txt", "1\n9\n"))
    n = 200_000
    x = dist.sample(np.random.default_rng(9), n)
    assert set(np.unique(x)) == {1, 9}
    assert abs(np.mean(x == 9) - 0.5) < frac_tol(0.5, n)
    xt = dist.sample(np.random.default_rng(9), n, weighting="tokens")
    assert abs(np.mean(xt == 9) - 0.9) < frac_tol(0.9, n)  # ∝ length: 9 / (1 + 9)
    assert dist.mean("tokens") == pytest.approx((1 + 81) / 10)


@pytest.mark.parametrize(
    ("name", "text", "bad"),
    [
        ("empty.txt", "", "no document lengths"),
        ("comments.txt", "# only\n\n", "no document lengths"),
        ("word.txt", "5\nabc\n", "'abc'"),
        ("frac.txt", "5\n1.5\n", "'1.5'"),
        ("zeros.txt", "0\n0\n", "no document of length >= 1"),
        ("neg.txt", "-3\n", "'-3'"),
        ("header.csv", "doc_len\n", "only a header"),
        ("badcol.csv", "doc_len,x\n4,1\nfoo,2\n", "'foo'"),
        ("nonum.csv", "a,b\nx,y\n", "no column named doc_len"),
        ("ids.csv", "doc_id,length\n0,5000\n1,3000\n", "['doc_id', 'length']"),
        ("noheader.csv", "5,1\n10,2\n", "no header"),
    ],
)
def test_bad_user_files(tmp_path, name, text, bad):
    p = write(tmp_path, name, text)
    with pytest.raises(ValueError, match=re.escape(p.name)) as e:
        load_distribution("file", path=p)
    assert bad in str(e.value)


def test_user_frame_formats(tmp_path):
    """JSON, JSON Lines and Parquet length files (read with pandas): the doc_len column, else the
    only numeric one."""
    want = [5, 10, 3, 7]
    files = [
        write(tmp_path, "a.json", "[5, 10, 3, 7]"),
        write(tmp_path, "b.json", '{"name": ["w", "x", "y", "z"], "doc_len": [5, 10, 3, 7]}'),
        write(
            tmp_path,
            "c.jsonl",
            "".join(f'{{"id": "d{i}", "n": {d}}}\n' for i, d in enumerate(want)),
        ),
        write(tmp_path, "d.json", "[5.0, 10.0, 3.0, 7.0]"),
    ]
    if importlib.util.find_spec("pyarrow") is not None:
        import pandas as pd

        pd.DataFrame({"text": list("abcd"), "doc_len": want}).to_parquet(tmp_path / "e.parquet")
        files.append(tmp_path / "e.parquet")
    for f in files:
        got = read_lengths_file(f)
        assert got.dtype == np.int64, f
        assert got.tolist() == want, f
        assert load_distribution("file", path=f).mean() == pytest.approx(np.mean(want))


@pytest.mark.parametrize(
    ("name", "text", "bad"),
    [
        ("neg.json", "[3, -1]", "-1"),
        ("frac.json", '{"doc_len": [2, 2.5]}', "2.5"),
        ("null.json", '{"doc_len": [2, null]}', "no value in row 1"),
        ("words.json", '{"a": ["x", "y"]}', "no column named doc_len"),
        ("ids.jsonl", '{"id": 0, "n": 5}\n{"id": 1, "n": 7}\n', "rename the column"),
        ("empty.json", "[]", "no document lengths"),
        ("broken.json", "[1, 2", "cannot read"),
        ("rows.csv", "a,b\n1,2\n3,4,5\n", "cannot parse"),
    ],
)
def test_bad_user_frame_files(tmp_path, name, text, bad):
    p = write(tmp_path, name, text)
    with pytest.raises(ValueError, match=re.escape(p.name)) as e:
        read_lengths_file(p)
    assert bad in str(e.value)


@pytest.mark.parametrize(
    ("arr", "bad"),
    [
        (np.array([3, -1, 2]), "-1"),
        (np.array([2.0, 2.5]), "2.5"),
        (np.zeros(0, dtype=np.int64), "no document lengths"),
        (np.ones((2, 2), dtype=np.int64), "(2, 2)"),
        (np.array(["a", "b"]), "<U1"),
    ],
)
def test_bad_npy_files(tmp_path, arr, bad):
    p = tmp_path / "x.npy"
    np.save(p, arr)
    with pytest.raises(ValueError, match=r"x\.npy") as e:
        read_lengths_file(p)
    assert bad in str(e.value)


def test_bad_load_arguments(tmp_path):
    with pytest.raises(
        ValueError, match=r"'c4'.*wlb_llm, pile, redpajama, wlb_llm_synthetic, stress, file"
    ):
        load_distribution("c4")
    with pytest.raises(ValueError, match="context_len"):
        load_distribution("stress")
    with pytest.raises(ValueError, match="0"):
        load_distribution("stress", context_len=0)
    with pytest.raises(ValueError, match="path"):
        load_distribution("file")
    with pytest.raises(ValueError, match=r"nope\.txt"):
        load_distribution("file", path=tmp_path / "nope.txt")
    with pytest.raises(ValueError, match="not found"):
        load_distribution("pile", data_dir=tmp_path)
    assert DATASETS == ("wlb_llm", "pile", "redpajama", "wlb_llm_synthetic", "stress", "file")


def test_bad_sample_arguments():
    dist = load_distribution("pile")
    rng = np.random.default_rng(0)
    for kwargs, bad in [
        ({"weighting": "bytes"}, "'bytes'"),
        ({"cap": 0}, "0"),
        ({"cap": 2.5}, "2.5"),
    ]:
        with pytest.raises(ValueError, match=bad):
            dist.sample(rng, 10, **kwargs)
    for size in (-1, 1.5, True):
        with pytest.raises(ValueError, match=str(size)):
            dist.sample(rng, size)
    with pytest.raises(ValueError, match="'bytes'"):
        dist.mean("bytes")


# ---------------------------------------------------------------------------------------------
# packing into sequences


@pytest.mark.parametrize("name", ["wlb_llm", "pile", "redpajama", "wlb_llm_synthetic", "stress"])
@pytest.mark.parametrize("weighting", ["documents", "tokens"])
def test_sequences_sum_to_context_len(name, weighting):
    for c in (1, 1000, 131072):
        dist = load_distribution(name, context_len=c)
        seqs = sample_sequences(dist, 50, c, seed=11, weighting=weighting)
        assert len(seqs) == 50
        for s in seqs:
            assert s.dtype == np.int64 and s.ndim == 1
            assert int(s.sum()) == c and s.min() >= 1


def test_sequences_are_reproducible():
    dist = load_distribution("redpajama")
    a = sample_sequences(dist, 300, 32768, seed=5)
    b = sample_sequences(dist, 300, 32768, seed=5)
    c = sample_sequences(dist, 300, 32768, seed=6)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    # a shorter request gives the first sequences of a longer one
    short = sample_sequences(dist, 7, 32768, seed=5)
    assert all(np.array_equal(x, y) for x, y in zip(short, a[:7], strict=False))
    assert sample_sequences(dist, 0, 32768, seed=5) == []


class Recording(LengthDistribution):
    """A small uniform law that records every draw it hands out, in order."""

    name = "recording"

    def __init__(self, high: int):
        self.high = high
        self.draws: list[np.ndarray] = []

    def _sample(self, rng, size, tokens):
        x = rng.integers(1, self.high + 1, size)
        self.draws.append(x.copy())
        return x

    def moment(self, k):
        return float(np.mean(np.arange(1, self.high + 1, dtype=np.float64) ** k))

    def cdf(self, x):
        return np.clip(np.floor(np.asarray(x, dtype=np.float64)) / self.high, 0, 1)


@pytest.mark.parametrize(("high", "c"), [(50, 200), (300, 256), (5000, 4096), (9, 1)])
def test_sequences_pack_the_draw_stream_greedily(high, c):
    """Reference packer over the recorded stream: append draws until C is reached, cut the last."""
    dist = Recording(high)
    doc_lens, offsets = sample_packed(dist, 3000, c, seed=3, cap=10**9)
    stream = np.concatenate(dist.draws).tolist()
    ref, seq, total, n_seq = [], [], 0, 0
    for d in stream:
        if n_seq == 3000:
            break
        take = min(d, c - total)
        seq.append(take)
        total += take
        if total == c:
            ref.extend(seq)
            seq, total, n_seq = [], 0, n_seq + 1
    assert n_seq == 3000
    assert doc_lens.tolist() == ref
    assert len(offsets) == 3001 and offsets[-1] == len(ref)


@pytest.mark.parametrize(
    ("lengths", "c", "cap", "want"),
    [
        ("3", 10, None, [3, 3, 3, 1]),
        ("7", 10, None, [7, 3]),  # the cut rest is discarded: every sequence starts fresh
        ("25", 10, None, [10]),
        ("25", 10, 5, [5, 5]),
        ("100", 10, 3, [3, 3, 3, 1]),
    ],
)
def test_sequences_cut_and_cap(tmp_path, lengths, c, cap, want):
    dist = load_distribution("file", path=write(tmp_path, "l.txt", lengths))
    for s in sample_sequences(dist, 4, c, seed=0, cap=cap):
        assert s.tolist() == want


def test_sequences_default_cap_is_four_context_lengths(tmp_path):
    dist = load_distribution("file", path=write(tmp_path, "l.txt", "1000000\n"))
    assert dist.sample(np.random.default_rng(0), 3, cap=400).tolist() == [400, 400, 400]
    assert [s.tolist() for s in sample_sequences(dist, 2, 100, seed=0)] == [[100], [100]]


def test_bad_sequence_arguments():
    dist = load_distribution("wlb_llm")
    for kwargs, bad in [
        ({"num_sequences": -1}, "-1"),
        ({"num_sequences": 2.0}, "2.0"),
        ({"context_len": 0}, "0"),
        ({"context_len": "128K"}, "128K"),
        ({"seed": -4}, "-4"),
        ({"seed": None}, "None"),
        ({"weighting": "token"}, "'token'"),
        ({"cap": -1}, "-1"),
    ]:
        args = {"num_sequences": 2, "context_len": 1024, "seed": 0} | kwargs
        with pytest.raises(ValueError, match=bad):
            sample_sequences(
                dist,
                args.pop("num_sequences"),
                args.pop("context_len"),
                **args,
            )


def test_tokens_weighting_puts_more_long_documents_in_a_sequence():
    dist = load_distribution("pile")
    c = 131072
    docs = sample_packed(dist, 200, c, seed=1)[0]
    toks = sample_packed(dist, 200, c, seed=1, weighting="tokens")[0]
    assert len(toks) < len(docs) / 5  # far fewer, longer documents per sequence
