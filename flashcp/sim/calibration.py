"""Calibration of the simulator's free constants against public measurements (docs/design.md §8).

A :class:`CalibTarget` is one published (or measured) number with the model's prediction of it
under a candidate :class:`~flashcp.sim.hardware.HardwareProfile`; :func:`fit_constants` fits named
profile fields, within bounds, by bounded least squares (``scipy.optimize.least_squares``) on the
errors divided by their bands, so every target weighs by how tightly it must be met.

:func:`public_targets` builds every public target the simulator relies on; the calibration
experiment (``experiments/calibration.py``) fits and writes ``results/calibration/``. Never a
target: any method's end-to-end speedup over another (Fig. 5/6/7 are predictions).

Measured targets: :func:`fit_replays` fits the constants a one-device replay measures
(``executor=emulate``'s phases, :data:`REPLAY_FREE`) to replayed sequences, and
:func:`flashcp.executors.kernels.measure_kernels` times single varlen kernel calls against the
kernel model (the simulator runs nothing itself); the GPU check (``experiments/gpu_check.py``)
drives both.

Targets (all from docs/design.md §8 and the original source named there):

* ``fa2_*``: FlashAttention-2 on one H100 SXM, causal, head_dim 128, 16 heads, 16K tokens per
  batch, TFLOP/s forward and forward + backward (FLOPs = 4 s² d h / 2; backward 2.5x forward).
* ``magi_*``: MagiAttention's document-causal / causal FLOP/s ratio at 1K..32K total tokens (FA3
  kernel; packed log-normal documents capped at 1/4 of the total, GQA 64:8, head_dim 128).
* ``rfa_theoretic_*``: ring-flash-attn's single-GPU ``flash_attn_varlen`` iterations per second
  on its benchmark (``benchmark/benchmark_varlen_kvpacked_func.py``: 8K tokens per GPU, 32 heads,
  8 KV heads, head_dim 128, bf16, cycling over four ``cu_seqlens``), 8x H800 and 8x A100.
* ``rfa_eff_*``: its ring / zigzag / llama3 varlen efficiencies on that benchmark: 8 x
  (flash_attn time) / (method time), summed over the four cases; the global documents are the
  local ``cu_seqlens`` x N (ring/zigzag hold 1/N or 2 x 1/2N of every document; llama3's
  ``cu_seqlens * world_size``).
* ``nccl_*``: all-gather bus bandwidth of a 1 GiB buffer on 8x H100 (nccl-tests; 360-370 GB/s);
  NCCL send/recv bandwidth between two H100s (nccl-tests issue #268: 80-180 GB/s); the time of
  one all-to-all of a 500 MiB buffer on 4x H100 in one node (``nccl_alltoall_*``, NVIDIA/nccl
  issue #2169), *reported, not fitted* (below).
* ``nccl_{allgather,reducescatter}_busbw_8xh200_*``: the bus bandwidth of both collectives at a
  few message sizes on 8x H200 (nccl-tests tables published in hao-ai-lab/DistCA, stored in
  ``conf/hardware/nccl/`` with their source and commit), predicted on ``h200_sxm`` with the
  candidate's kernel, software and latency constants; *reported, not fitted*: that profile prices
  both collectives from these very tables, so the rows check that it reproduces them (at any
  latency) and cannot inform a fit.
* ``fig3_*``: the FlashCP paper's Fig. 3: attention latency (forward + backward kernels, Zigzag
  with its merges as ring-flash-attn runs them) normalised to Whole-Doc on one device.

**Reported-only targets** (``CalibTarget.fitted = False``) are predicted and listed with the
others but left out of the least-squares fit; why the all-to-all point is one: docs/calibration.md,
section "Why the all-to-all point is reported, not fitted".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from flashcp.comm import AttnShape
from flashcp.plan import doc_workload
from flashcp.sim.hardware import HardwareProfile, load_hardware, read_collective_table

__all__ = [
    "REPLAY_BOUNDS",
    "REPLAY_FREE",
    "REPLAY_PHASES",
    "SHARED_FIELDS",
    "CalibTarget",
    "FitResult",
    "fit_constants",
    "fit_replays",
    "free_constants",
    "measured_vs_model",
    "public_targets",
    "replay_targets",
    "rfa_benchmark_us",
]

#: software and overlap constants shared by every profile (same PyTorch, NCCL and kernels)
SHARED_FIELDS = (
    "host_op_us",
    "collective_host_us",
    "ring_step_fwd_us",
    "ring_step_bwd_us",
    "doc_host_us",
    "merge_bytes_scripted",
    "nccl_slowdown",
    "overlap_fraction",
)
#: kernel constants of the H100 die (H800 is the same die)
KERNEL_FIELDS = ("fwd_tile_tflops", "fwd_cta_overhead_us", "bwd_tile_tflops", "bwd_cta_overhead_us")


@dataclass(frozen=True)
class CalibTarget:
    """One number the model must reproduce.

    Attributes:
        name: unique, e.g. ``fa2_fwd_causal_h100_4k``.
        predict: the model's prediction under a candidate profile.
        measured: the public (or measured) value.
        unit: ``TFLOP/s``, ``GB/s``, ``us``, ``ms``, ``fraction``, ``iter/s``...
        band: ``("rel", 0.10)`` for ±10 %, or ``("abs", 0.05)`` for ±0.05 (±5 points).
        source: the public source, or ``measured: <where>``.
        fitted: False: reported with the others (its row in the table) but left out of the
            least-squares fit (module docstring, *reported-only targets*).
    """

    name: str
    predict: Callable[[HardwareProfile], float]
    measured: float
    unit: str
    band: tuple[str, float]
    source: str
    fitted: bool = True

    def error(self, predicted: float) -> float:
        """Relative error (``rel`` band) or difference (``abs`` band) of a prediction."""
        if self.band[0] == "rel":
            return predicted / self.measured - 1.0
        return predicted - self.measured


@dataclass(frozen=True)
class FitResult:
    """Outcome of :func:`fit_constants`.

    Attributes:
        constants: fitted value per free profile field.
        table: one row per target: name, unit, measured, predicted, error, band_kind, band,
            within_band, fitted, source.
        success: the optimiser converged; message: its message.
    """

    constants: dict[str, float]
    table: pd.DataFrame
    success: bool
    message: str


def _table(targets: Sequence[CalibTarget], hw: HardwareProfile) -> pd.DataFrame:
    rows = []
    for t in targets:
        pred = float(t.predict(hw))
        err = t.error(pred)
        rows.append({
            "name": t.name, "unit": t.unit, "measured": t.measured, "predicted": pred,
            "error": err, "band_kind": t.band[0], "band": t.band[1],
            "within_band": bool(abs(err) <= t.band[1] + 1e-12), "fitted": bool(t.fitted),
            "source": t.source,
        })  # fmt: skip
    return pd.DataFrame(rows)


def fit_constants(
    targets: Sequence[CalibTarget],
    profile: HardwareProfile,
    free: Mapping[str, tuple[float, float]],
    max_nfev: int | None = None,
) -> FitResult:
    """Least-squares fit (``scipy.optimize.least_squares``, bounded) of the named profile fields.

    Minimises ``sum_i rho((error_i / band_i)^2)`` over the fitted targets (``fitted=True``; the
    others are only evaluated, in the table) and the free fields, each within its
    ``(low, high)`` bounds, starting from the profile's values (clipped into the bounds).
    ``rho`` is SciPy's robust ``soft_l1`` loss (quadratic within one band, linear beyond), so a
    target the model cannot represent does not drag every other target out of its band.

    Args:
        targets: the targets; predictions use the candidate profile.
        profile: start profile; fields not in ``free`` stay as they are.
        free: field name -> (low, high).
        max_nfev: cap on the optimiser's function evaluations (None: SciPy's default).
    Returns:
        A :class:`FitResult` (its table evaluated at the fitted constants).
    Raises:
        ValueError: no target, free fields but no fitted target, an unknown or non-numeric field,
            or empty bounds.
    """
    from scipy.optimize import least_squares

    if not targets:
        raise ValueError("fit_constants needs at least one target")
    names = list(free)
    fitted = [t for t in targets if t.fitted]
    if names and not fitted:
        raise ValueError(
            f"fit_constants needs at least one fitted target to fit {', '.join(names)}; every "
            f"target given is reported-only (fitted=False)"
        )
    known = {f.name for f in dataclasses.fields(HardwareProfile) if f.init}
    for k in names:
        if k not in known or k == "name":
            raise ValueError(f"unknown hardware field {k!r} in free constants")
        lo, hi = free[k]
        if not lo < hi:
            raise ValueError(f"bounds of {k!r} must satisfy low < high, got {free[k]}")
    lo = np.array([free[k][0] for k in names], dtype=float)
    hi = np.array([free[k][1] for k in names], dtype=float)
    x0 = np.clip([float(getattr(profile, k)) for k in names], lo, hi)
    ints = {f.name for f in dataclasses.fields(HardwareProfile) if f.type == "int"}

    def make(x) -> HardwareProfile:
        vals = {k: (round(v) if k in ints else float(v)) for k, v in zip(names, x, strict=True)}
        return dataclasses.replace(profile, **vals)

    def resid(x) -> np.ndarray:
        hw = make(x)
        return np.array([t.error(float(t.predict(hw))) / t.band[1] for t in fitted])

    if names:
        res = least_squares(
            resid, x0, bounds=(lo, hi), x_scale=np.maximum(hi - lo, 1e-9), diff_step=1e-3,
            loss="soft_l1", f_scale=1.0, max_nfev=max_nfev,
        )  # fmt: skip
        x, ok, msg = res.x, bool(res.success), str(res.message)
    else:
        x, ok, msg = x0, True, "nothing to fit"
    hw = make(x)
    return FitResult(
        constants={k: float(getattr(hw, k)) for k in names},
        table=_table(targets, hw),
        success=ok,
        message=msg,
    )


# ---- public targets -------------------------------------------------------------------------------
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
FA2_FWD_CAUSAL = (191, 260, 298, 319, 333, 335)
FA2_FWDBWD_CAUSAL = (163, 221, 265, 294, 308, 328)
MAGI_TOTALS = (1024, 2048, 4096, 8192, 16384, 32768)
MAGI_FWD_RATIO = (0.21, 0.37, 0.54, 0.73, 0.81, 0.86)
MAGI_BWD_RATIO = (0.25, 0.32, 0.45, 0.62, 0.67, 0.73)
#: ring-flash-attn benchmark: local cu_seqlens cycled by the benchmark (8K tokens per GPU)
RFA_CASES = ((8192,), (256, 7392, 544), (4096, 4096), (3104, 3200, 1600, 160, 128))
RFA_SHAPE = AttnShape(num_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
#: its README's performance table (varlen api): flash_attn iter/s and % of it per method
RFA_PUBLISHED = {
    "h800_sxm": {
        "theoretic": (852.4, 225.4),
        "ring": (0.491, 0.511),
        "zigzag": (0.702, 0.759),
        "llama3": (0.570, 0.581),
    },
    "a100_sxm": {
        "theoretic": (532.3, 133.8),
        "ring": (0.498, 0.521),
        "zigzag": (0.720, 0.802),
        "llama3": (0.516, 0.580),
    },
}
FIG3 = {("1x128K", "per_doc"): 1.03, ("1x128K", "zigzag"): 1.06,
        ("16x8K", "per_doc"): 1.21, ("16x8K", "zigzag"): 1.41}  # fmt: skip
_SRC_FA2 = "docs/design.md §8; FlashAttention-2 paper / Dao-AILab/flash-attention assets"
_SRC_MAGI = "docs/design.md §8; MagiAttention docs/source/blog/cp_benchmark.md (±2%)"
_SRC_RFA = "docs/design.md §8; zhuzilin/ring-flash-attention README + benchmark/"
#: NVIDIA/nccl issue #2169: alltoall_perf, 4x H100 80GB HBM3 in one node (NCCL 2.30.4), 524288000 B
#: per rank's buffer, out of place: 1174.14 µs (algbw 446.53, busbw 334.90 GB/s)
A2A_BYTES, A2A_US = 524288000, 1174.14
_SRC_A2A = (
    "docs/design.md §8; NVIDIA/nccl issue #2169 (alltoall_perf, 4x H100 80GB HBM3 in one node, "
    "500 MiB out of place: busbw 334.9 GB/s); reported, not fitted"
)
_SRC_FIG3 = "FlashCP paper (arXiv 2606.08476) Fig. 3, read from the figure (±0.02)"
#: 8x H200 per-size tables (conf/hardware/nccl/<name>.csv) and the sizes reported from each, MiB
H200_TABLES = {
    "allgather": ("h200_8x_all_gather_half", "allgather_us"),
    "reducescatter": ("h200_8x_reduce_scatter_half", "reducescatter_us"),
}
H200_TABLE_MIB = (8, 32, 128, 512)
_SRC_H200 = (
    "docs/design.md §8; hao-ai-lab/DistCA distca/profiling/data/network-prof-nccl/"
    "{op}-8-half.perf.txt @ 2afd2192 (nccl-tests, 8x H200, fp16, out of place); reported, not "
    "fitted (h200_sxm prices from this table)"
)
#: constants h200_sxm takes from the candidate (calibrated together with h100_sxm's)
H200_FROM_CANDIDATE = (*KERNEL_FIELDS, *SHARED_FIELDS, "collective_latency_us", "p2p_latency_us")


def _fa2_tflops(hw: HardwareProfile, seqlen: int, backward: bool, cache) -> float:
    """Modelled TFLOP/s of the FA2 benchmark call: 16K/seqlen causal sequences, 16 heads."""
    shape = AttnShape(num_heads=16, num_kv_heads=16, head_dim=128)
    q = np.full(16384 // seqlen, seqlen)
    for bwd in (False, True):
        if (seqlen, bwd) not in cache:
            cache[(seqlen, bwd)] = _call_stats(q, hw, bwd)
    flops = 4 * seqlen**2 * 128 * 16 / 2 * q.size
    t = _call_ms(cache[(seqlen, False)], 16384, shape, hw, False)
    if backward:
        return 3.5 * flops / ((t + _call_ms(cache[(seqlen, True)], 16384, shape, hw, True)) * 1e9)
    return flops / (t * 1e9)


def _magi_docs(total: int) -> list[np.ndarray]:
    """20 packed log-normal document sets (median total/16, sigma 1, capped at total/4), seed 0."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(20):
        docs, left = [], total
        while left > 0:
            d = int(min(max(1, rng.lognormal(math.log(total / 16), 1.0)), total // 4, left))
            docs.append(d)
            left -= d
        out.append(np.array(docs))
    return out


def _call_stats(q: np.ndarray, hw: HardwareProfile, backward: bool):
    """Tile statistics of one causal varlen call over segments ``(q, q)`` (profile-independent
    but for the tile shapes)."""
    from flashcp.sim.kernel import TileStats, bwd_tile_counts, fwd_tile_counts

    c = np.ones(q.size, dtype=bool)
    if backward:
        ctas, tiles, mx = bwd_tile_counts(q, q, c, hw.bwd_block_q, hw.bwd_block_k)
    else:
        ctas, tiles, mx = fwd_tile_counts(q, q, c, hw.fwd_block_q, hw.fwd_block_k)
    return TileStats(ctas.sum(), tiles.sum(), mx.max())


def _call_ms(stats, q_rows: int, shape: AttnShape, hw: HardwareProfile, backward: bool) -> float:
    """Time of one varlen call from its tile statistics (as ``attention_kernel_ms``), ms."""
    from flashcp.sim.kernel import bwd_extra_us, kernel_us

    us = float(kernel_us(stats, shape.num_heads, shape.head_dim, hw, backward))
    if backward:
        us += float(bwd_extra_us(q_rows, q_rows, shape, hw))
    return us / 1e3


def _magi_ratio(hw: HardwareProfile, total: int, backward: bool, docs, cache) -> float:
    """Mean over the document sets of useful FLOP/s of the packed call over that of one causal
    sequence of the same total length (MagiAttention's shape: GQA 64:8, head_dim 128)."""
    shape = AttnShape(num_heads=64, num_kv_heads=8, head_dim=128)
    one = np.array([total])
    key = (total, backward)
    if key not in cache:
        cache[key] = (_call_stats(one, hw, backward), [_call_stats(d, hw, backward) for d in docs])
    s_one, s_docs = cache[key]
    t_one = _call_ms(s_one, total, shape, hw, backward)
    vals = []
    for d, st in zip(docs, s_docs, strict=True):
        useful = float(doc_workload(d).sum()) / doc_workload(total)  # Eq. 3 pairs vs one doc
        vals.append(useful * t_one / _call_ms(st, total, shape, hw, backward))
    return float(np.mean(vals))


def rfa_benchmark_us(
    hw: HardwareProfile, method: str | None, train: bool, cp_size: int = 8, costs=None
) -> float:
    """Modelled time of ring-flash-attn's varlen benchmark, summed over its four cases, µs.

    Args:
        hw: profile; method: ``ring``, ``zigzag``, ``llama3`` (ring-flash-attn, CP ``cp_size``) or
            None for the single-GPU ``flash_attn_varlen`` call on the local 8K tokens.
        train: forward + backward (else forward only).
        costs: optional dict to cache the cases' ``PlanCost`` in (keyed by method and case).
    """
    from flashcp.registry import COMM_KIND
    from flashcp.sim.cost import PlanCost
    from flashcp.sim.impl import impl_plan

    total = 0.0
    for case in RFA_CASES:
        c = np.array(case)
        if method is None:
            stats = {}
            for bwd in (False, True):
                key = (None, case, bwd)
                if costs is None or key not in costs:
                    stats[bwd] = _call_stats(c, hw, bwd)
                    if costs is not None:
                        costs[key] = stats[bwd]
                else:
                    stats[bwd] = costs[key]
            ms = _call_ms(stats[False], int(c.sum()), RFA_SHAPE, hw, False)
            if train:
                ms += _call_ms(stats[True], int(c.sum()), RFA_SHAPE, hw, True)
            total += ms * 1e3
            continue
        key = (method, case, cp_size)
        if costs is not None and key in costs:
            cost = costs[key].with_hardware(hw)
        else:
            plan, _ = impl_plan(method, "ring_flash_attn", c * cp_size, cp_size)
            cost = PlanCost(plan, hw, COMM_KIND[method], "ring_flash_attn")
            if costs is not None:
                costs[key] = cost
        total += cost.step(RFA_SHAPE, "train" if train else "infer")["total_ms"] * 1e3
    return total


def derive(hw: HardwareProfile, base: HardwareProfile, fields: Sequence[str]) -> HardwareProfile:
    """Profile ``base`` with ``fields`` taken from ``hw``."""
    return dataclasses.replace(base, **{k: getattr(hw, k) for k in fields})


def public_targets(gpu: str = "h100") -> list[CalibTarget]:
    """Every public target of docs/design.md §8 predicted from a candidate profile.

    Args:
        gpu: ``h100`` (the candidate is an H100 SXM profile; H800 targets use ``h800_sxm`` with
            the candidate's kernel and shared constants) or ``a100`` (the candidate is an A100 SXM
            profile).
    Raises:
        ValueError: unknown gpu.
    """
    from flashcp.sim.fig3 import FIG3_CASES, fig3_cost, fig3_latency_ratio

    # plans and tile counts do not depend on the fitted constants: built once per target list
    base = load_hardware("h100_sxm", calibrated=False)
    rfa_costs: dict = {}
    magi_cache: dict = {}
    fa2_cache: dict = {}
    targets: list[CalibTarget] = []
    if gpu == "h100":
        for i, s in enumerate(SEQLENS):
            for bwd, pub, tag in (
                (False, FA2_FWD_CAUSAL[i], "fwd"),
                (True, FA2_FWDBWD_CAUSAL[i], "fwdbwd"),
            ):
                targets.append(CalibTarget(
                    f"fa2_{tag}_causal_h100_{s // 1024 or 0.5}k".replace("0.5k", "512"),
                    lambda hw, s=s, bwd=bwd: _fa2_tflops(hw, s, bwd, fa2_cache),
                    float(pub), "TFLOP/s", ("rel", 0.10), _SRC_FA2,
                ))  # fmt: skip
        for i, tot in enumerate(MAGI_TOTALS):
            docs = _magi_docs(tot)
            for bwd, pub, tag in (
                (False, MAGI_FWD_RATIO[i], "fwd"),
                (True, MAGI_BWD_RATIO[i], "bwd"),
            ):
                targets.append(CalibTarget(
                    f"magi_{tag}_doc_over_causal_{tot // 1024}k",
                    lambda hw, tot=tot, bwd=bwd, docs=docs: _magi_ratio(hw, tot, bwd, docs, magi_cache),
                    float(pub), "fraction", ("rel", 0.10), _SRC_MAGI,
                ))  # fmt: skip
        targets.append(CalibTarget(
            "nccl_allgather_busbw_8xh100_1gib",
            lambda hw: (2**30 * 7 / 8) / hw.allgather_us(2**30 * 7 / 8, 2**30) / 1e3,
            365.0, "GB/s", ("rel", 0.10),
            "docs/design.md §8; NCCL maintainers (nccl-tests #212/#326), stas00/ml-engineering",
        ))  # fmt: skip
        targets.append(CalibTarget(
            "nccl_sendrecv_bw_2xh100_256mib",
            lambda hw: 2**28 / hw.p2p_us(2**28) / 1e3,
            130.0, "GB/s", ("abs", 50.0),
            "docs/design.md §8; nccl-tests issue #268 (80-180 GB/s: midpoint ± half-range)",
        ))  # fmt: skip
        targets.append(CalibTarget(
            "nccl_alltoall_time_4xh100_500mib",
            lambda hw: hw.alltoall_us(A2A_BYTES * 3 / 4, A2A_BYTES),
            A2A_US, "us", ("rel", 0.10), _SRC_A2A, fitted=False,
        ))  # fmt: skip
        for (case, layout), pub in FIG3.items():
            lens = FIG3_CASES[case]
            costs = (fig3_cost(base, lens, layout), fig3_cost(base, lens, "whole"))
            targets.append(CalibTarget(
                f"fig3_{case}_{layout}",
                lambda hw, lens=lens, layout=layout, costs=costs: fig3_latency_ratio(hw, lens, layout, costs=costs),
                pub, "fraction", ("abs", 0.05), _SRC_FIG3,
            ))  # fmt: skip
        h200 = load_hardware("h200_sxm", calibrated=False)
        for op, (table_name, price) in H200_TABLES.items():
            table = read_collective_table(table_name)
            published = dict(zip(table.size_bytes, table.busbw_gbps, strict=True))
            for mib in H200_TABLE_MIB:
                size = float(mib * 2**20)
                targets.append(CalibTarget(
                    f"nccl_{op}_busbw_8xh200_{mib}mib",
                    lambda hw, size=size, price=price: (
                        size * 7 / 8
                        / getattr(derive(hw, h200, H200_FROM_CANDIDATE), price)(size * 7 / 8, size)
                        / 1e3
                    ),
                    published[size], "GB/s", ("rel", 0.10),
                    _SRC_H200.format(op=table.collective), fitted=False,
                ))  # fmt: skip
        h800 = load_hardware("h800_sxm", calibrated=False)
        profiles = {"h800_sxm": lambda hw: derive(hw, h800, (*KERNEL_FIELDS, *SHARED_FIELDS))}
    elif gpu == "a100":
        profiles = {"a100_sxm": lambda hw: hw}
    else:
        raise ValueError(f"unknown gpu {gpu!r}; choose h100 or a100")
    for prof, to_hw in profiles.items():
        pub = RFA_PUBLISHED[prof]
        for train, idx, tag in ((False, 0, "fwd"), (True, 1, "fwdbwd")):
            targets.append(CalibTarget(
                f"rfa_theoretic_{tag}_{prof}",
                lambda hw, to_hw=to_hw, train=train: 4e6 / rfa_benchmark_us(to_hw(hw), None, train, costs=rfa_costs),
                pub["theoretic"][idx], "iter/s", ("rel", 0.10), _SRC_RFA,
            ))  # fmt: skip
            for method in ("ring", "zigzag", "llama3"):
                targets.append(CalibTarget(
                    f"rfa_eff_{method}_{tag}_{prof}",
                    lambda hw, to_hw=to_hw, train=train, m=method: (
                        8 * rfa_benchmark_us(to_hw(hw), None, train, costs=rfa_costs)
                        / rfa_benchmark_us(to_hw(hw), m, train, costs=rfa_costs)
                    ),
                    pub[method][idx], "fraction", ("abs", 0.05), _SRC_RFA,
                ))  # fmt: skip
    return targets


# ---- measured targets: one device's replays (executor=emulate) and kernel calls -----------------

#: measured phases a replay gives as targets (its communication phases come from the profile)
REPLAY_PHASES = ("attn_fwd_ms", "attn_bwd_ms", "others_ms")
#: constants a one-device replay measures, fitted by default where the profile has them: kernel
#: rates up to the peak, per-CTA, launch and per-op host costs, copy bandwidth, ring step
#: overheads (not the network, nor NCCL's contention: the replay has no NCCL)
REPLAY_FREE = (
    "fwd_tile_tflops", "bwd_tile_tflops", "fwd_cta_overhead_us", "bwd_cta_overhead_us",
    "launch_us", "copy_bw_gbps", "host_op_us", "ring_step_fwd_us", "ring_step_bwd_us",
)  # fmt: skip
#: their bounds (widened to hold the starting profile's value): an eager PyTorch op costs
#: 5-25 µs of host time, a kernel launch about 5 µs (docs/design.md §8)
REPLAY_BOUNDS = {
    "fwd_cta_overhead_us": (0.0, 20.0),
    "bwd_cta_overhead_us": (0.0, 20.0),
    "launch_us": (0.0, 50.0),
    "copy_bw_gbps": (300.0, 6000.0),
    "host_op_us": (1.0, 50.0),
    "ring_step_fwd_us": (0.0, 200.0),
    "ring_step_bwd_us": (0.0, 400.0),
}


def free_constants(spec: str | None, hw: HardwareProfile) -> dict[str, tuple[float, float]]:
    """Free profile fields and bounds: ``name`` (default bounds) or ``name=lo:hi``, comma-separated.

    Without ``spec``: the fields of :data:`REPLAY_FREE` the profile has. Default bounds:
    :data:`REPLAY_BOUNDS` (widened to hold the profile's value), rates ``(0.1 * value,
    peak_tflops)``, otherwise ``(0.25 * value, 4 * value)``.

    Raises:
        ValueError: a name that is not a numeric profile field, or bounds that do not hold the
            profile's value.
    """
    numeric = {
        f.name for f in dataclasses.fields(HardwareProfile) if f.init and f.type in ("float", "int")
    }
    if spec:
        names = tuple(s.strip() for s in spec.split(",") if s.strip())
    else:
        names = tuple(n for n in REPLAY_FREE if n in numeric)
    free = {}
    for item in names:
        name, _, rng = item.partition("=")
        if name not in numeric:
            raise ValueError(
                f"--free: {name!r} is not a numeric hardware constant; choose from "
                f"{', '.join(sorted(numeric))}"
            )
        value = float(getattr(hw, name))
        if rng:
            lo, _, hi = rng.partition(":")
            bounds = (float(lo), float(hi))
        elif name in REPLAY_BOUNDS:
            lo, hi = REPLAY_BOUNDS[name]
            bounds = (min(lo, value), max(hi, value))
        elif name.endswith("_tflops"):
            bounds = (0.1 * value, float(hw.peak_tflops))
        else:
            bounds = (0.25 * value, 4.0 * value)
        if not bounds[0] <= value <= bounds[1]:
            raise ValueError(f"--free: {name} = {value} lies outside its bounds {bounds}")
        free[name] = bounds
    return free


def replay_targets(
    replays: Sequence[tuple[str, object, np.ndarray, Mapping[str, float]]],
    *,
    source: str,
    phases: Sequence[str] = REPLAY_PHASES,
    band: tuple[str, float] = ("rel", 0.10),
) -> list[CalibTarget]:
    """One target per replay and phase of ``phases`` measured above zero: measured = the
    replay's time of that phase, predict = the simulator's on the same plan, phase and mode under
    the candidate profile (one simulation per plan and candidate).

    Args:
        replays: ``(name, run, doc_lens, row)``: a unique name, the run replayed (a
            :class:`flashcp.executors.RunSpec`: its method, impl, cp_size, options, shape and
            first mode), the sequence's (n_docs,) document lengths and its measured row (ms per
            phase; ``executor=emulate`` with every rank replayed: the simulator's phases are the
            slowest rank's).
        source: where the measurements come from (each target's ``source``).
    Raises:
        ValueError: what the run's planner raises for its sequence.
    """
    from flashcp.sim.cost import simulate
    from flashcp.sim.impl import impl_plan

    targets = []
    for name, run, lens, row in replays:
        plan, _ = impl_plan(run.method, run.impl, lens, run.cp_size, **dict(run.options))
        mode, last = run.modes[0], {}

        def sim(hw: HardwareProfile, plan=plan, run=run, mode=mode, last=last) -> dict:
            if last.get("hw") is not hw:
                last["hw"], last["row"] = hw, simulate(plan, run.shape, hw, mode, impl=run.impl)
            return last["row"]

        for phase in phases:
            if not float(row[phase]) > 0:
                continue
            targets.append(CalibTarget(
                f"{name}/{phase}", lambda hw, ph=phase, f=sim: float(f(hw)[ph]),
                float(row[phase]), "ms", band, source,
            ))  # fmt: skip
    return targets


def fit_replays(
    replays: Sequence[tuple[str, object, np.ndarray, Mapping[str, float]]],
    hw: HardwareProfile,
    free: Mapping[str, tuple[float, float]],
    *,
    source: str,
    max_nfev: int | None = None,
) -> tuple[FitResult, pd.DataFrame, HardwareProfile]:
    """Fit the ``free`` constants of ``hw`` to measured replays (:func:`replay_targets`,
    :func:`fit_constants`; by default at most 40 evaluations per free constant, each simulating
    every replayed plan).

    Returns:
        ``(result, constants, fitted)``: the fit; one row per free constant (``constant``,
        ``before``, ``fitted``, ``lower``, ``upper``); ``hw`` with the fitted values.
    Raises:
        ValueError: no replay with a measured phase above zero, or what :func:`fit_constants`
            raises.
    """
    targets = replay_targets(replays, source=source)
    if not targets:
        raise ValueError("no replayed phase to fit")
    res = fit_constants(
        targets, hw, free, max_nfev=40 * len(free) if max_nfev is None else max_nfev
    )
    fitted = load_hardware({**hw.to_dict(), **res.constants})
    consts = pd.DataFrame([
        {"constant": k, "before": getattr(hw, k), "fitted": res.constants.get(k), "lower": lo,
         "upper": hi}
        for k, (lo, hi) in free.items()
    ])  # fmt: skip
    return res, consts, fitted


def measured_vs_model(rows: pd.DataFrame, phases: Sequence[str]) -> pd.DataFrame:
    """Median over a method's rows of measured vs simulated time per phase: ``measured``,
    ``sim`` (column ``sim_<phase>``), the median ratio ``measured_over_sim`` and, where the rows
    have ``fit_<phase>``, ``fitted_sim`` and ``measured_over_fitted``. Phases zero on both sides
    for a method are left out.

    Args:
        rows: rows with ``method``, ``status`` and per phase ``<phase>`` and ``sim_<phase>`` (ms);
            only ``status == "ok"`` rows count.
    """
    df = rows[rows["status"] == "ok"]
    out = []
    for method, g in df.groupby("method", sort=False):
        for phase in phases:
            if not (g[phase].abs().sum() or g[f"sim_{phase}"].abs().sum()):
                continue
            rec = {"method": method, "phase": phase, "units": len(g), "measured": g[phase].median(),
                   "sim": g[f"sim_{phase}"].median(),
                   "measured_over_sim": (g[phase] / g[f"sim_{phase}"]).median()}  # fmt: skip
            if f"fit_{phase}" in g:
                rec["fitted_sim"] = g[f"fit_{phase}"].median()
                rec["measured_over_fitted"] = (g[phase] / g[f"fit_{phase}"]).median()
            out.append(rec)
    return pd.DataFrame(out)
