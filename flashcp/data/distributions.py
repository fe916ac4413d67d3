"""Document-length distributions (docs/design.md §5): seeded samplers with analytic moments.

* :class:`BinnedDistribution` (``wlb_llm``): pick a bin by its document share, then a length
  uniformly among the integers inside it.
* :class:`LogNormalMixture` (``pile``, ``redpajama``): pick a source with probability proportional
  to its *document count*, then a log-normal length with that source's mean m and shape σ
  (log-mean ``mu = ln m - σ²/2``, so that the mean is m and the median ``m exp(-σ²/2)``), rounded
  to the nearest integer and raised to at least 1.
* :class:`StressNormal` (``stress``): ``max(1, round(X))`` with ``X ~ Normal(0.5 C, 0.5 C)``
  (Normal(0.5·C, 0.5·C), cut to ≥1); about 16% of its documents have length 1.
* :class:`WlbSyntheticNormal` (``wlb_llm_synthetic``): the synthetic generator of the public
  WLB-LLM code, ``trunc(X·C)`` with ``X ~ Normal(0.5, 0.5)``, non-positive draws redrawn, at most C.
* :class:`EmpiricalDistribution` (``file``): resample a user's list of document lengths uniformly.

Weighting. ``weighting="documents"`` (default) draws a document as above. ``weighting="tokens"``
is length-biased: a document of length d is drawn with probability ∝ d·p(d) ("pick a random
training token and take its document"). Its mean is E[d²]/E[d]. How each class samples it is
stated in its docstring; all are exact for the law they name (no rejection, no approximation
beyond floating point), except :class:`StressNormal`, whose tokens law uses the normal density at
the integers (a midpoint rule, relative error O(1/σ²) ≈ 1e-10 at C = 128K).

Caps. ``cap`` truncates each draw to ``min(d, cap)`` *after* it is drawn (under either weighting:
the weighting applies to the source law, the cap to the drawn document). Analytic moments,
:meth:`LengthDistribution.cdf` and :meth:`LengthDistribution.median` ignore the cap.

Units: every length is in tokens; arrays of lengths are int64.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np

__all__ = [
    "WEIGHTINGS",
    "BinnedDistribution",
    "EmpiricalDistribution",
    "LengthDistribution",
    "LogNormalMixture",
    "StressNormal",
    "WlbSyntheticNormal",
]

WEIGHTINGS = ("documents", "tokens")
"""Values of the ``weighting`` option (see the module docstring)."""
# Largest length a float draw is clipped to before the int64 cast (exactly representable).
_MAX_LEN = 2**53

# --------------------------------------------------------------------------------------------
# argument checks


def _check_int(value: Any, what: str, minimum: int) -> int:
    """Return ``value`` as an int if it is an integer >= ``minimum``; else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return int(value)


def _check_weighting(weighting: Any) -> str:
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown weighting {weighting!r}; valid: {', '.join(WEIGHTINGS)}")
    return weighting


def _check_cap(cap: Any) -> int | None:
    return None if cap is None else _check_int(cap, "cap", 1)


# --------------------------------------------------------------------------------------------
# standard normal helpers (no scipy dependency)

_erfc = np.frompyfunc(math.erfc, 1, 1)


def _norm_cdf(x: Any) -> np.ndarray:
    """Φ(x) elementwise, float64 (via ``math.erfc``; meant for small arrays)."""
    x = np.asarray(x, dtype=np.float64)
    return np.asarray(0.5 * _erfc(-x / math.sqrt(2.0)), dtype=np.float64)


def _norm_pdf(x: Any) -> np.ndarray:
    """φ(x) elementwise, float64."""
    x = np.asarray(x, dtype=np.float64)
    return np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


# --------------------------------------------------------------------------------------------
# distributions


class LengthDistribution(ABC):
    """A law of document lengths (integers >= 1, in tokens).

    Subclasses implement :meth:`_sample` (both weightings), :meth:`moment` and :meth:`cdf`.

    Attributes:
        name: the dataset name (one of :data:`flashcp.data.DATASETS`).
    """

    name: str

    def sample(
        self,
        rng: np.random.Generator,
        size: int,
        *,
        weighting: str = "documents",
        cap: int | None = None,
    ) -> np.ndarray:
        """Draw ``size`` i.i.d. document lengths.

        Args:
            rng: the random generator (consumed).
            size: number of documents, >= 0.
            weighting: ``"documents"`` or ``"tokens"`` (length-biased), see the module docstring.
            cap: if given (>= 1), each draw is truncated to ``min(d, cap)``.
        Returns:
            (size,) int64 lengths, each >= 1 (and <= cap).
        Raises:
            ValueError: bad ``size``, ``weighting`` or ``cap``, naming the value.
        """
        size = _check_int(size, "size", 0)
        tokens = _check_weighting(weighting) == "tokens"
        cap = _check_cap(cap)
        out = self._sample(rng, size, tokens)
        if cap is not None:
            np.minimum(out, cap, out=out)
        return out

    @abstractmethod
    def _sample(self, rng: np.random.Generator, size: int, tokens: bool) -> np.ndarray:
        """(size,) int64 lengths >= 1, uncapped; length-biased when ``tokens``."""

    @abstractmethod
    def moment(self, k: int) -> float:
        """Raw moment E[d^k] of the (uncapped) documents-weighted law, for k = 1, 2, 3."""

    @abstractmethod
    def cdf(self, x: Any) -> np.ndarray:
        """P(d <= x) under documents weighting (uncapped), elementwise; float64, shape of x."""

    def mean(self, weighting: str = "documents") -> float:
        """Analytic mean document length in tokens, uncapped.

        ``documents``: E[d]; ``tokens`` (length-biased): E[d²] / E[d].
        """
        if _check_weighting(weighting) == "documents":
            return self.moment(1)
        return self.moment(2) / self.moment(1)

    def std(self, weighting: str = "documents") -> float:
        """Analytic standard deviation in tokens, uncapped (tokens: from E[d³]/E[d])."""
        if _check_weighting(weighting) == "documents":
            var = self.moment(2) - self.moment(1) ** 2
        else:
            var = self.moment(3) / self.moment(1) - self.mean("tokens") ** 2
        return math.sqrt(max(var, 0.0))

    def quantile(self, q: float) -> int:
        """Smallest integer length x with P(d <= x) >= q (documents weighting, uncapped)."""
        if not 0.0 < q <= 1.0:
            raise ValueError(f"quantile q must be in (0, 1], got {q!r}")
        lo, hi = 1, 1
        while float(self.cdf(hi)) < q:
            lo, hi = hi + 1, 2 * hi
            if hi > _MAX_LEN:
                raise ValueError(f"quantile {q} of {self.name} is beyond {_MAX_LEN} tokens")
        while lo < hi:
            mid = (lo + hi) // 2
            if float(self.cdf(mid)) >= q:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def median(self) -> int:
        """Median document length in tokens (documents weighting, uncapped)."""
        return self.quantile(0.5)

    def info(self) -> dict[str, Any]:
        """Summary for logs and result rows: name, kind and analytic statistics (tokens)."""
        return {
            "name": self.name,
            "kind": type(self).__name__,
            "mean_tokens": self.mean("documents"),
            "mean_tokens_tokens_weighted": self.mean("tokens"),
            "median_tokens": self.median(),
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, mean={self.mean():.1f})"


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _pick(rng: np.random.Generator, weights: np.ndarray, size: int) -> np.ndarray:
    """(size,) int64 indices drawn with probability ∝ ``weights`` (inverse CDF, one uniform each)."""
    cum = np.cumsum(weights / weights.sum())
    cum[-1] = 1.0
    idx = np.searchsorted(cum, rng.random(size), side="right")
    return np.minimum(idx, len(weights) - 1).astype(np.int64)


class BinnedDistribution(LengthDistribution):
    """Histogram law: a bin by its document share, then an integer uniformly inside the bin.

    Args:
        name: dataset name.
        lo: (n_bins,) int, first length of each bin (inclusive), >= 1.
        hi: (n_bins,) int, end of each bin (exclusive), > lo.
        share: (n_bins,) float, document share of each bin (any positive scale; normalised here,
            e.g. the WLB-LLM percentages sum to 99.997).

    Tokens weighting (exact): a bin with probability ∝ share × (sum of the integers in the bin),
    then an integer k in [lo, hi) with probability ∝ k by inverting its CDF in closed form
    (k = the smallest integer with k(k+1)/2 > (lo-1)lo/2 + u·S, S the bin's sum; computed in float64
    and corrected by exact integer comparisons).
    """

    def __init__(self, name: str, lo: Sequence[int], hi: Sequence[int], share: Sequence[float]):
        self.name = name
        self.lo = _readonly(np.asarray(lo, dtype=np.int64).copy())
        self.hi = _readonly(np.asarray(hi, dtype=np.int64).copy())
        self.share = _readonly(np.asarray(share, dtype=np.float64).copy())
        n = self.lo.shape
        if self.lo.ndim != 1 or n[0] == 0 or self.hi.shape != n or self.share.shape != n:
            raise ValueError(f"{name}: lo, hi and share must be equal-length non-empty 1-D lists")
        if (self.lo < 1).any():
            raise ValueError(f"{name}: bin starts must be >= 1, got {int(self.lo.min())}")
        if (self.hi <= self.lo).any():
            i = int(np.argmax(self.hi <= self.lo))
            raise ValueError(f"{name}: empty bin [{self.lo[i]}, {self.hi[i]})")
        if not np.isfinite(self.share).all() or (self.share < 0).any() or self.share.sum() <= 0:
            raise ValueError(f"{name}: bin shares must be finite, >= 0, not all 0: {self.share}")

    @property
    def _p(self) -> np.ndarray:
        return self.share / self.share.sum()

    def _power_sums(self, k: int) -> np.ndarray:
        """(n_bins,) float64: sum of j^k over the integers j in [lo, hi)."""
        return np.array(
            [
                np.sum(np.arange(a, b, dtype=np.float64) ** k)
                for a, b in zip(self.lo, self.hi, strict=True)
            ]
        )

    def moment(self, k: int) -> float:
        width = (self.hi - self.lo).astype(np.float64)
        return float(np.sum(self._p * self._power_sums(k) / width))

    def cdf(self, x: Any) -> np.ndarray:
        x = np.floor(np.asarray(x, dtype=np.float64))
        width = (self.hi - self.lo).astype(np.float64)
        inside = np.clip(x[..., None] - self.lo + 1, 0, width) / width  # (..., n_bins)
        return np.sum(inside * self._p, axis=-1)

    def _sample(self, rng: np.random.Generator, size: int, tokens: bool) -> np.ndarray:
        if not tokens:
            b = _pick(rng, self.share, size)
            return rng.integers(self.lo[b], self.hi[b])  # (size,) int64, uniform in [lo, hi)
        bin_mean = (self.lo + self.hi - 1).astype(np.float64) / 2.0
        sums = bin_mean * (self.hi - self.lo)  # sum of the integers in each bin
        b = _pick(rng, self.share * bin_mean, size)
        lo, hi = self.lo[b], self.hi[b]
        t = (lo - 1) * lo / 2.0 + rng.random(size) * sums[b]  # target in [tri(lo-1), tri(hi-1))
        k = np.ceil((np.sqrt(8.0 * t + 1.0) - 1.0) / 2.0).astype(np.int64)
        # exact fix-up: want tri(k-1) <= t < tri(k)
        k += (k * (k + 1) / 2.0 <= t).astype(np.int64)
        k -= ((k - 1) * k / 2.0 > t).astype(np.int64)
        return np.clip(k, lo, hi - 1)


class LogNormalMixture(LengthDistribution):
    """Mixture of log-normal sources, each with a document count, mean m and shape σ.

    A draw picks a source with probability ∝ its document count, then ``X = exp(mu + σ Z)`` with
    ``mu = ln m - σ²/2`` (so E[X] = m, median m·exp(-σ²/2)), and returns ``max(1, round(X))``.

    Tokens weighting (exact for the continuous law): a source with probability ∝ docs × m, then a
    log-normal with log-mean ``mu + σ²`` (the length-biased law of a log-normal). The rounding to an
    integer moves each draw by < 0.5 token.

    Args:
        name: dataset name.
        components: (n,) source names.
        docs: (n,) document counts (any positive scale).
        means: (n,) mean length m of each source, tokens, > 0.
        sigmas: (n,) shape σ of each source, >= 0.
    """

    def __init__(
        self,
        name: str,
        components: Sequence[str],
        docs: Sequence[float],
        means: Sequence[float],
        sigmas: Sequence[float],
    ):
        self.name = name
        self.components = tuple(str(c) for c in components)
        self.docs = _readonly(np.asarray(docs, dtype=np.float64).copy())
        self.means = _readonly(np.asarray(means, dtype=np.float64).copy())
        self.sigmas = _readonly(np.asarray(sigmas, dtype=np.float64).copy())
        n = (len(self.components),)
        if n[0] == 0 or self.docs.shape != n or self.means.shape != n or self.sigmas.shape != n:
            raise ValueError(
                f"{name}: components, docs, means, sigmas must be equal-length, non-empty"
            )
        for what, arr, ok in (
            ("docs", self.docs, self.docs >= 0),
            ("mean", self.means, self.means > 0),
            ("sigma", self.sigmas, self.sigmas >= 0),
        ):
            bad = ~(np.isfinite(arr) & ok)
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(f"{name}: bad {what} {arr[i]!r} for {self.components[i]!r}")
        if self.docs.sum() <= 0:
            raise ValueError(f"{name}: document counts are all zero")
        self.mus = _readonly(np.log(self.means) - self.sigmas**2 / 2.0)

    @property
    def weights(self) -> np.ndarray:
        """(n,) float64 probability of each source per document draw (∝ document count)."""
        return self.docs / self.docs.sum()

    def component(self, name: str) -> LogNormalMixture:
        """The single-source distribution of one named component."""
        if name not in self.components:
            raise ValueError(f"{self.name} has no component {name!r}; valid: {self.components}")
        i = self.components.index(name)
        return LogNormalMixture(
            f"{self.name}/{name}", [name], [1.0], [self.means[i]], [self.sigmas[i]]
        )

    def moment(self, k: int) -> float:
        # E[X^k] = exp(k mu + k² σ² / 2) for a log-normal
        return float(np.sum(self.weights * np.exp(k * self.mus + k * k * self.sigmas**2 / 2.0)))

    def cdf(self, x: Any) -> np.ndarray:
        # round(X) <= x  <=>  X < x + 1/2, for integer x >= 1 (the max(1, .) only lifts values < 1)
        x = np.floor(np.asarray(x, dtype=np.float64))
        with np.errstate(divide="ignore"):
            lx = np.log(np.maximum(x + 0.5, 0.0))[..., None]  # (..., 1)
        s = np.where(self.sigmas > 0, self.sigmas, 1.0)
        z = (lx - self.mus) / s
        point = np.where(lx > self.mus, 1.0, 0.0)  # σ = 0: a point mass at m
        per = np.where(self.sigmas > 0, _norm_cdf(z), point)
        out = np.sum(per * self.weights, axis=-1)
        return np.where(x >= 1, out, 0.0)

    def _sample(self, rng: np.random.Generator, size: int, tokens: bool) -> np.ndarray:
        if tokens:
            c = _pick(rng, self.docs * self.means, size)
            mu = self.mus[c] + self.sigmas[c] ** 2
        else:
            c = _pick(rng, self.docs, size)
            mu = self.mus[c]
        x = np.exp(mu + self.sigmas[c] * rng.standard_normal(size))
        return np.clip(np.rint(x), 1, _MAX_LEN).astype(np.int64)


class StressNormal(LengthDistribution):
    """Stress test: ``max(1, round(X))`` with ``X ~ Normal(0.5 C, 0.5 C)`` (a worst case, not a published profile).

    Documents weighting draws X directly. Tokens weighting draws from the integer law
    P(k) ∝ k·p(k) by inverse CDF over a table of k = 1 .. ceil(μ + 12σ), with p(1) = Φ((1.5-μ)/σ)
    and p(k) = φ((k-μ)/σ)/σ for k >= 2 (the density at the integers: a midpoint rule whose relative
    error is O(1/σ²)); the mass beyond μ + 12σ (< 1e-32) is dropped.

    Args:
        context_len: C in tokens, >= 1.
    """

    def __init__(self, context_len: int):
        self.name = "stress"
        self.context_len = _check_int(context_len, "context_len", 1)
        self.loc = 0.5 * self.context_len
        self.scale = 0.5 * self.context_len

    @cached_property
    def _tokens_table(self) -> np.ndarray:
        """(K,) float64 cumulative probability of k = 1..K under tokens weighting."""
        kmax = math.ceil(self.loc + 12.0 * self.scale)
        k = np.arange(1, kmax + 1, dtype=np.float64)
        p = _norm_pdf((k - self.loc) / self.scale) / self.scale
        p[0] = float(_norm_cdf((1.5 - self.loc) / self.scale))
        cum = np.cumsum(k * p)
        return _readonly(cum / cum[-1])

    def moment(self, k: int) -> float:
        # E[Y^k] = P(X < 1.5) + E[X^k; X >= 1.5]; partial moments of Z above a:
        # M_0 = 1 - Φ(a), M_1 = φ(a), M_j = a^(j-1) φ(a) + (j-1) M_(j-2)
        a = (1.5 - self.loc) / self.scale
        pa, fa = float(_norm_cdf(a)), float(_norm_pdf(a))
        m = [1.0 - pa, fa]
        for j in range(2, k + 1):
            m.append(a ** (j - 1) * fa + (j - 1) * m[j - 2])
        upper = sum(
            math.comb(k, j) * self.loc ** (k - j) * self.scale**j * m[j] for j in range(k + 1)
        )
        return pa + upper

    def cdf(self, x: Any) -> np.ndarray:
        x = np.floor(np.asarray(x, dtype=np.float64))
        return np.where(x >= 1, _norm_cdf((x + 0.5 - self.loc) / self.scale), 0.0)

    def _sample(self, rng: np.random.Generator, size: int, tokens: bool) -> np.ndarray:
        if tokens:
            cum = self._tokens_table
            idx = np.searchsorted(cum, rng.random(size), side="right")
            return np.minimum(idx, len(cum) - 1).astype(np.int64) + 1
        x = rng.normal(self.loc, self.scale, size)
        return np.clip(np.rint(x), 1, _MAX_LEN).astype(np.int64)


class WlbSyntheticNormal(LengthDistribution):
    """The synthetic document lengths of the public WLB-LLM code (``wlb_llm_synthetic``).

    Source: ``generate_doc_lens`` in ``utils.py`` of the WLB-LLM context-parallelism repository
    (github.com/Ash-Zheng/WLB-LLM-CP, commit 7e1d5d442710e4be91760fcf5b5fe6e33aad6550), called by
    its ``cp_performance_compare.py`` with ``avg_doc_len = std_doc_len = 0.5`` (fractions of the
    context). Its rules, restated for one sequence of C tokens:

    1. draw ``X ~ Normal(mean_frac, std_frac)`` and take ``d = int(X · C)`` (truncated toward
       zero, not rounded);
    2. a draw with ``d <= 0`` is thrown away and drawn again (not clipped to 1: unlike
       :class:`StressNormal`, the law has no mass piled up at length 1);
    3. documents are appended while the sequence holds at most C tokens, and the last one is cut
       so the sequence holds exactly C (a cut to zero tokens drops it); nothing carries over to the
       next sequence. (Its optional rounding of each length down to a multiple of the CP size,
       ``divide_cp``, is off in that script and not modelled.)

    Rule 3 is the packer's own (:func:`flashcp.data.sample_packed`). A draw longer than C is always
    the last document of its sequence and is cut there, so this law returns ``min(d, C)``: the
    same sequences, and no draw is left for the overlong policy
    (:class:`flashcp.data.OverlongDocs`) to split into a second sequence. The document law is
    thus, for k = 1 .. C - 1, ``P(k) = [Φ(((k+1)/C - m)/s) - Φ((k/C - m)/s)] / Z`` and
    ``P(C) = [1 - Φ((1 - m)/s)] / Z`` with ``Z = 1 - Φ((1/C - m)/s)`` (m = ``mean_frac``,
    s = ``std_frac``); at the defaults about 18.9% of documents are a whole context. The generator
    draws in float32 (its lengths move by < 0.01 token at C = 128K); this class draws in float64.

    Documents weighting draws as the generator does (rule 1 and 2, the redraws from the same
    random stream). Tokens weighting draws k with probability ∝ k·P(k) by inverse CDF over the
    table of k = 1 .. C (exact). Moments, :meth:`cdf` and the median are those of the table.

    Args:
        context_len: C in tokens, >= 1.
        mean_frac: mean of X, as a fraction of C (the generator's ``avg_doc_len``), > 0.
        std_frac: standard deviation of X, as a fraction of C (``std_doc_len``), > 0.
    Raises:
        ValueError: a bad argument, naming it.
    """

    def __init__(self, context_len: int, mean_frac: float = 0.5, std_frac: float = 0.5):
        self.name = "wlb_llm_synthetic"
        self.context_len = _check_int(context_len, "context_len", 1)
        for what, v in (("mean_frac", mean_frac), ("std_frac", std_frac)):
            if (
                isinstance(v, bool)
                or not isinstance(v, int | float)
                or not math.isfinite(v)
                or v <= 0
            ):
                raise ValueError(f"{what} must be a finite number > 0, got {v!r}")
        self.mean_frac, self.std_frac = float(mean_frac), float(std_frac)
        # P(d >= 1) must not vanish: at least one length can be drawn
        if float(_norm_cdf((1.0 / self.context_len - self.mean_frac) / self.std_frac)) >= 1.0:
            raise ValueError(
                f"mean_frac = {mean_frac}, std_frac = {std_frac}: no draw reaches one token"
            )

    @cached_property
    def _pmf(self) -> np.ndarray:
        """(C,) float64 probability of k = 1 .. C under documents weighting."""
        c = self.context_len
        k = np.arange(1, c + 2, dtype=np.float64)  # edges k/C for k = 1 .. C+1
        tail = 0.5 * np.asarray(  # 1 - Φ(z) = erfc(z/√2)/2, accurate in the upper tail
            _erfc((k / c - self.mean_frac) / (self.std_frac * math.sqrt(2.0))), dtype=np.float64
        )
        p = tail[:-1] - tail[1:]  # P(k <= X·C < k+1)
        p[-1] = tail[-2]  # k = C: every X >= 1
        return _readonly(p / tail[0])

    @cached_property
    def _cum(self) -> np.ndarray:
        cum = np.cumsum(self._pmf)
        cum[-1] = 1.0
        return _readonly(cum)

    @cached_property
    def _tokens_cum(self) -> np.ndarray:
        cum = np.cumsum(np.arange(1, self.context_len + 1) * self._pmf)
        return _readonly(cum / cum[-1])

    def moment(self, k: int) -> float:
        d = np.arange(1, self.context_len + 1, dtype=np.float64)
        return float(np.sum(self._pmf * d**k))

    def cdf(self, x: Any) -> np.ndarray:
        x = np.floor(np.asarray(x, dtype=np.float64))
        i = np.clip(x, 0, self.context_len).astype(np.int64)  # number of lengths <= x
        cum = np.concatenate([[0.0], self._cum])
        return cum[i]

    def _sample(self, rng: np.random.Generator, size: int, tokens: bool) -> np.ndarray:
        c = self.context_len
        if tokens:
            idx = np.searchsorted(self._tokens_cum, rng.random(size), side="right")
            return np.minimum(idx, c - 1).astype(np.int64) + 1
        out = np.empty(size, dtype=np.int64)
        todo = np.arange(size)
        while todo.size:  # rule 2: redraw every d <= 0, in order, from the same stream
            x = rng.normal(self.mean_frac, self.std_frac, todo.size) * c
            d = np.trunc(np.clip(x, -1.0, c)).astype(np.int64)  # min(d, C) before the cast
            ok = d >= 1
            out[todo[ok]] = d[ok]
            todo = todo[~ok]
        return out

    def info(self) -> dict[str, Any]:
        return {**super().info(), "mean_frac": self.mean_frac, "std_frac": self.std_frac}


class EmpiricalDistribution(LengthDistribution):
    """Resample a list of observed document lengths.

    Documents weighting: each listed document with probability 1/n. Tokens weighting (exact): a
    uniform integer token index in [0, Σd), and the document holding it (probability d_i / Σd).

    Args:
        lengths: (n,) int document lengths >= 0 (checked by ``flashcp.plan.check_doc_lens``);
            zero-length entries (a repeated ``cu_seqlens`` offset) hold no document and are
            dropped, so a draw is always a document of at least one token.
        name: dataset name (default ``"file"``).
        source: where the lengths came from (for :meth:`info`).
    Raises:
        ValueError: a bad length, or no length >= 1.
    """

    def __init__(self, lengths: Any, name: str = "file", source: str | None = None):
        from flashcp.plan import check_doc_lens

        self.name = name
        self.source = source
        d = check_doc_lens(lengths)
        if not d.any():
            raise ValueError(
                f"{source or name}: no document of length >= 1 among {d.size} lengths to draw from"
            )
        self.lengths = _readonly(d[d > 0].copy())
        self._cum = _readonly(np.cumsum(self.lengths))
        self._sorted = _readonly(np.sort(self.lengths))

    def moment(self, k: int) -> float:
        return float(np.mean(self.lengths.astype(np.float64) ** k))

    def cdf(self, x: Any) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        return np.searchsorted(self._sorted, x, side="right") / len(self._sorted)

    def _sample(self, rng: np.random.Generator, size: int, tokens: bool) -> np.ndarray:
        if tokens:
            idx = np.searchsorted(
                self._cum, rng.integers(0, int(self._cum[-1]), size), side="right"
            )
        else:
            idx = rng.integers(0, len(self.lengths), size)
        return self.lengths[idx].copy()

    def info(self) -> dict[str, Any]:
        return {**super().info(), "source": self.source, "num_lengths": len(self.lengths)}
