"""Hardware profiles for the analytic simulator (``executor=sim``).

A profile is a flat set of constants with units in their names, read from
``conf/hardware/<name>.yaml`` (a Hydra config group) or from a dict. Every constant's public source
is cited in the YAML file; docs/design.md §8 collects them. The free constants are fitted, within
their published ranges, by the calibration experiment (``experiments/calibration.py``) to public
kernel, collective and single-method targets only, and loaded over the YAML values.

Collective model (NCCL conventions, nccl-tests ``doc/PERFORMANCE.md``): a collective in which one
rank receives ``recv_bytes`` takes

    collective_latency_us + recv_bytes / (busbw * falloff(total_bytes))

because bus bandwidth is ``algbw * (n - 1) / n`` and a rank of an all-gather or reduce-scatter over
a total buffer of S bytes receives ``(n - 1) / n * S``. ``falloff`` is the small-message fraction of
peak bus bandwidth, taken from a published bus-bandwidth-vs-size curve after removing the latency
term (see :meth:`HardwareProfile.busbw_fraction`).

Per-size tables: a profile may name, for the all-gather and the reduce-scatter, a published
nccl-tests table of that very collective (``allgather_table`` / ``reducescatter_table``: a CSV in
``conf/hardware/nccl/``, :func:`read_collective_table`). That collective's falloff is then its own
table's: each published point (size S_i, bus bandwidth b_i, n ranks) takes
``t_i = (n - 1) / n * S_i / b_i``; removing the latency leaves ``B'_i = (n - 1) / n * S_i /
(t_i - collective_latency_us)``, and the fraction is ``B'_i / b_last`` (b_last: the published bus
bandwidth at the table's largest size), interpolated in log size and log fraction. With the
profile's bus bandwidth equal to b_last the table's times are reproduced exactly at its points;
another bus bandwidth scales the whole table. Below the table's smallest size the profile's
falloff curve continues it (scaled to meet the table there), and beyond its largest size the
fraction stays constant. A profile without a table prices both collectives as before.
"""

from __future__ import annotations

import copy
import functools
import math
from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, field, fields
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from flashcp.resources import resource_path
from flashcp.sim.nccl_tables import (
    TABLE_OPS,
    CollectiveTable,
    collective_table_dir,
    hardware_dir,
    list_hardware,
    read_collective_table,
)

__all__ = [
    "NETWORK_KEYS",
    "TABLE_OPS",
    "CollectiveTable",
    "HardwareProfile",
    "collective_table_dir",
    "fitted_path",
    "hardware_dir",
    "list_hardware",
    "load_hardware",
    "profile_changes",
    "read_collective_table",
    "read_fitted",
    "read_profile",
]


def _interp_loglog(xs: list[float], ys: list[float], value: float) -> float:
    """``exp`` of the piecewise-linear interpolation of ``ys`` over ``xs`` at ``log(value)``,
    constant beyond the ends (and for ``value <= 0``)."""
    if value <= 0:
        return math.exp(ys[0])
    x = math.log(value)
    i = bisect_right(xs, x)
    if i == 0:
        return math.exp(ys[0])
    if i == len(xs):
        return math.exp(ys[-1])
    w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return math.exp(ys[i - 1] + w * (ys[i] - ys[i - 1]))


def interp_loglog_v(xs, ys, values) -> np.ndarray:
    """:func:`_interp_loglog` elementwise: ``values`` any shape of numbers (bytes), returns float64
    of that shape. A table of one point (a one-point bandwidth curve, as ``h100_ib``'s) is that
    constant everywhere, with no division between neighbouring points (there are none)."""
    xs, ys = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    tb = np.asarray(values, dtype=np.float64)
    if xs.size == 1:
        return np.exp(np.full(tb.shape, ys[0]))
    pos = tb > 0
    x = np.log(np.where(pos, tb, 1.0))
    i = np.searchsorted(xs, x, side="right")
    j = np.minimum(np.maximum(i, 1), xs.size - 1)  # np.clip, without its wrapper's cost
    w = (x - xs[j - 1]) / (xs[j] - xs[j - 1])
    y = ys[j - 1] + w * (ys[j] - ys[j - 1])
    y = np.where(i == 0, ys[0], np.where(i == xs.size, ys[-1], y))
    return np.exp(np.where(pos, y, ys[0]))


#: the constants of the links between nodes (docs/multinode.md)
NETWORK_KEYS = ("gpus_per_node", "nics_per_node", "nic_bw_gbps", "inter_latency_us")


@dataclass(frozen=True)
class HardwareProfile:
    """Constants of one GPU type and its interconnect (units in the names).

    Attributes:
        name: profile name (the YAML file stem).
        peak_tflops: dense bf16 peak of one GPU, TFLOP/s (an upper bound the fitted rates must obey).
        num_sms: streaming multiprocessors (a kernel's CTAs run over them).
        launch_us: fixed cost of one kernel launch, µs.
        copy_bw_gbps: device-memory copy bandwidth counting read + write bytes, GB/s (1e9 B/s);
            prices every memory-bound step (KV gathers, LSE merges, backward pre/post kernels).
        fwd_block_q, fwd_block_k: FlashAttention forward tile (query rows x key columns); one CTA
            per (segment, query block, head). ``fwd_block_q`` must be a multiple of ``fwd_block_k``.
        bwd_block_q, bwd_block_k: backward tile; one CTA per (segment, key block, head).
            ``bwd_block_k`` must be a multiple of ``bwd_block_q``.
        fwd_tile_tflops, bwd_tile_tflops: steady-state rate of full tiles over the whole GPU,
            TFLOP/s (fitted).
        fwd_cta_overhead_us, bwd_cta_overhead_us: fixed SM time per CTA (prologue/epilogue:
            loading Q, writing O and LSE, or writing dK/dV), µs (fitted).
        bwd_extra_kernels: memory-bound kernels a FlashAttention-2 backward launches besides the
            main one (dot(dO, O) with dQ-accumulator clearing; dQ conversion).
        collective_latency_us: fixed latency of one all-gather / reduce-scatter, µs.
        allgather_busbw_gbps, reducescatter_busbw_gbps: large-message bus bandwidth, GB/s; with
            a per-size table for that collective, the bus bandwidth at the table's largest size
            (the table is scaled by this value over its own; equal, it is reproduced exactly).
        busbw_curve_size_kib, busbw_curve_gbps: a published bus-bandwidth-vs-message-size curve
            (increasing sizes); only its shape is used, as the small-message falloff.
        busbw_curve_ranks: ranks of the published curve's run.
        busbw_curve_algbw_factor: bytes moved per rank / message size of the curve's collective
            (2 (n-1)/n for all-reduce), used to turn its bus bandwidth back into time.
        p2p_latency_us, p2p_bw_gbps: latency and one-way bandwidth of a send/recv pair, µs, GB/s
            (NCCL send/recv, separate from the collectives' bus bandwidth).
        host_op_us: host (CPU) time to dispatch one eager PyTorch op (Python, dispatcher, launch
            call), µs; charged per copy, merge op and accumulation an implementation issues,
            separately from the device-side ``launch_us``.
        collective_host_us: host time of one eager collective call (``all_gather_into_tensor``,
            ``reduce_scatter_tensor``), µs.
        ring_step_fwd_us, ring_step_bwd_us: host time per step of a ring pass besides its ops
            (posting and waiting for the send/recv batch, the step's Python), µs; the backward
            step posts two exchanges (KV and dK/dV).
        doc_host_us: host time per document where an implementation loops over documents in
            Python (with a device sync per iteration), µs.
        merge_bytes_fused, merge_bytes_scripted, merge_bytes_eager: bytes read + written per
            element of the output (``T x H x D``) by one LSE merge: fused into one kernel, as a
            TorchScript function (partly fused by its fuser), or as eager fp32 ops.
        accum_bytes_fused, accum_bytes_eager: bytes read + written per gradient element by one
            accumulation ``acc += block`` (fp32 accumulator, model-dtype block), fused or eager.
        nccl_slowdown: factor by which an attention kernel runs slower while NCCL kernels run
            beside it (SMs and HBM bandwidth taken by NCCL); 1 means no contention.
        overlap_fraction: share of a communication meant to hide behind compute that really
            overlaps it; the rest is exposed (1 means perfect overlap).
        allgather_table, reducescatter_table: a published per-size nccl-tests table of that
            collective (:func:`read_collective_table`: a name in ``conf/hardware/nccl/`` or a CSV
            path), priced in place of the falloff curve (module docstring); ``""``: none.
        alltoall_busbw_gbps: large-message bus bandwidth of an all-to-all (nccl-tests' busbw:
            the bytes a rank receives per second), GB/s; None (the default, and ``null`` in a
            profile): ``allgather_busbw_gbps``, resolved at construction (derivation in
            :meth:`alltoall_us`). Its own constant so that it can be set and varied apart.
        gpus_per_node: GPUs of one node, linked by the fabric of the constants above (NVLink +
            NVSwitch); None (the default): a flat network, every rank on that fabric whatever
            the cp_size (``h100_ib``: each rank behind its own NIC). Two-level network
            (docs/multinode.md): the constants below price the links between nodes.
        nics_per_node: network adapters (NICs) of one node.
        nic_bw_gbps: one-way bandwidth one NIC reaches under NCCL, GB/s.
        inter_latency_us: latency of a collective or send/recv step that crosses nodes, µs.
    Raises:
        ValueError: (at construction) a non-positive or non-finite constant, block sizes that do
            not divide, a fitted rate above ``peak_tflops``, a malformed bandwidth curve, a bad
            or unknown collective table (named), a table of the other collective, or a
            ``collective_latency_us`` not below the smallest time of the curve or of a table.
    """

    name: str
    peak_tflops: float
    num_sms: int
    launch_us: float
    copy_bw_gbps: float
    fwd_block_q: int
    fwd_block_k: int
    bwd_block_q: int
    bwd_block_k: int
    fwd_tile_tflops: float
    fwd_cta_overhead_us: float
    bwd_tile_tflops: float
    bwd_cta_overhead_us: float
    bwd_extra_kernels: int
    collective_latency_us: float
    allgather_busbw_gbps: float
    reducescatter_busbw_gbps: float
    busbw_curve_size_kib: tuple[float, ...]
    busbw_curve_gbps: tuple[float, ...]
    busbw_curve_ranks: int
    busbw_curve_algbw_factor: float
    p2p_latency_us: float
    p2p_bw_gbps: float
    host_op_us: float
    collective_host_us: float
    ring_step_fwd_us: float
    ring_step_bwd_us: float
    doc_host_us: float
    merge_bytes_fused: float
    merge_bytes_scripted: float
    merge_bytes_eager: float
    accum_bytes_fused: float
    accum_bytes_eager: float
    nccl_slowdown: float
    overlap_fraction: float
    allgather_table: str = ""
    reducescatter_table: str = ""
    alltoall_busbw_gbps: float | None = None
    gpus_per_node: int | None = None
    nics_per_node: int = 8
    nic_bw_gbps: float = 47.0
    inter_latency_us: float = 25.0
    #: (log sizes, log fractions) of the falloff table, derived at construction
    _falloff: tuple = field(init=False, repr=False, compare=False, default=())
    #: collective (a key of TABLE_OPS) -> (log sizes, log fractions) from its own table
    _tables: dict = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"hardware name must be a non-empty string, got {self.name!r}")
        if self.alltoall_busbw_gbps is None:  # unset: the all-gather's (alltoall_us)
            object.__setattr__(self, "alltoall_busbw_gbps", self.allgather_busbw_gbps)
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "name" or not f.init:
                continue
            if f.name in TABLE_OPS.values():
                if not isinstance(v, str):
                    raise ValueError(
                        f"{f.name} must name a collective table (or be empty), got {v!r}"
                    )
                continue
            if f.name == "gpus_per_node":
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                    raise ValueError(f"gpus_per_node must be a positive integer or null, got {v!r}")
                continue
            if f.name.startswith("busbw_curve_") and f.type.startswith("tuple"):
                try:
                    arr = tuple(float(x) for x in v)
                except TypeError:
                    raise ValueError(f"{f.name} must be a list of numbers, got {v!r}") from None
                object.__setattr__(self, f.name, arr)
                continue
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"hardware constant {f.name} must be a finite number, got {v!r}")
            if f.type == "int":
                if int(v) != v:
                    raise ValueError(f"hardware constant {f.name} must be an integer, got {v!r}")
                object.__setattr__(self, f.name, int(v))
            zero_ok = f.name in (
                "bwd_extra_kernels",
                "host_op_us",
                "collective_host_us",
                "ring_step_fwd_us",
                "ring_step_bwd_us",
                "doc_host_us",
                "fwd_cta_overhead_us",
                "bwd_cta_overhead_us",
                "launch_us",
                "collective_latency_us",
                "p2p_latency_us",
            )
            if v < 0 or (v == 0 and not zero_ok):
                raise ValueError(f"hardware constant {f.name} must be > 0, got {v!r}")
        if self.fwd_block_q % self.fwd_block_k:
            raise ValueError(
                f"fwd_block_q = {self.fwd_block_q} must be a multiple of fwd_block_k = {self.fwd_block_k}"
            )
        if self.bwd_block_k % self.bwd_block_q:
            raise ValueError(
                f"bwd_block_k = {self.bwd_block_k} must be a multiple of bwd_block_q = {self.bwd_block_q}"
            )
        if self.nccl_slowdown < 1:
            raise ValueError(
                f"nccl_slowdown must be >= 1 (1 = no contention), got {self.nccl_slowdown}"
            )
        if self.overlap_fraction > 1:
            raise ValueError(f"overlap_fraction must be in (0, 1], got {self.overlap_fraction}")
        for key in ("fwd_tile_tflops", "bwd_tile_tflops"):
            if getattr(self, key) > self.peak_tflops:
                raise ValueError(
                    f"{key} = {getattr(self, key)} exceeds peak_tflops = {self.peak_tflops}"
                )
        size, bw = self.busbw_curve_size_kib, self.busbw_curve_gbps
        if len(size) < 1 or len(size) != len(bw):
            raise ValueError(
                "busbw_curve_size_kib and busbw_curve_gbps must be non-empty and equally long"
            )
        if any(b <= a for a, b in pairwise(size)) or min(size) <= 0 or min(bw) <= 0:
            raise ValueError("busbw_curve_size_kib must increase and both curves must be positive")
        # The curve was measured by nccl-tests, which calls NCCL from C with no framework on the
        # host, so its smallest time bounds NCCL's own latency (19 us for the h100_sxm curve).
        # The 20-30 us that an eager PyTorch call adds is host time, modelled apart
        # (collective_host_us), so this bound does not cap it.
        if min(self._curve_seconds()) <= self.collective_latency_us * 1e-6:
            raise ValueError(
                f"collective_latency_us = {self.collective_latency_us} is not below the smallest time "
                "of the published bandwidth curve (which includes NCCL's latency); put host-side "
                "call overhead in collective_host_us instead"
            )
        sizes, frac = self.busbw_fraction_table()
        object.__setattr__(self, "_falloff", (np.log(sizes).tolist(), np.log(frac).tolist()))
        tables = {}
        for op, key in TABLE_OPS.items():
            ref = getattr(self, key)
            if not ref:
                continue
            table = read_collective_table(ref)
            if table.collective != op:
                raise ValueError(
                    f"{key} = {ref!r} holds a {table.collective} table, not a {op} one"
                )
            tables[op] = self._table_falloff(table)
        object.__setattr__(self, "_tables", tables)

    def _table_falloff(self, table: CollectiveTable) -> tuple[list[float], list[float]]:
        """(log sizes, log fractions) of one collective from its own table (module docstring),
        the profile's falloff curve continuing it below the table's smallest size."""
        t = table.times_us()
        lat = self.collective_latency_us
        if t.min() <= lat:
            i = int(t.argmin())
            raise ValueError(
                f"collective_latency_us = {lat} is not below the smallest time of collective "
                f"table {table.name!r} ({t[i]:.2f} us at {table.size_bytes[i]:.0f} B, which "
                "includes NCCL's latency); put host-side call overhead in collective_host_us"
            )
        size = np.asarray(table.size_bytes)
        recv = size * (table.ranks - 1) / table.ranks
        bw = recv / (t - lat)  # latency-free bandwidth, bytes per µs
        x = np.log(size).tolist()
        y = np.log(bw / (table.busbw_gbps[-1] * 1e3)).tolist()
        xf, yf = self._falloff
        shift = y[0] - math.log(_interp_loglog(xf, yf, size[0]))
        below = [(a, b + shift) for a, b in zip(xf, yf, strict=True) if a < x[0]]
        return [a for a, _ in below] + x, [b for _, b in below] + y

    def falloff_table(self, op: str | None = None) -> tuple[list[float], list[float]]:
        """``(log sizes in bytes, log fractions)`` interpolated by :meth:`busbw_fraction`: the
        table of collective ``op`` (a key of :data:`TABLE_OPS`) where the profile has one, else
        the falloff curve's (``op`` None: always the curve's; p2p and curve-priced calls).

        Raises:
            ValueError: an unknown ``op``.
        """
        if op is None:
            return self._falloff
        if op not in TABLE_OPS:
            raise ValueError(f"unknown collective {op!r}; choose one of {', '.join(TABLE_OPS)}")
        return self._tables.get(op, self._falloff)

    # ---- collectives -------------------------------------------------------------------------
    def _curve_seconds(self) -> list[float]:
        """Times implied by the published curve: factor * size / busbw, seconds."""
        return [
            self.busbw_curve_algbw_factor * s * 1024 / (b * 1e9)
            for s, b in zip(self.busbw_curve_size_kib, self.busbw_curve_gbps, strict=True)
        ]

    def busbw_fraction_table(self) -> tuple[np.ndarray, np.ndarray]:
        """The falloff table ``(sizes_bytes, fraction)`` derived from the published curve.

        For each published point (size S_i, bus bandwidth B_i) the time is
        ``t_i = factor * S_i / B_i``; removing the latency L leaves the bandwidth term
        ``B'_i = factor * S_i / (t_i - L)``; the fraction is ``B'_i / B'_last`` (1 at the largest
        published size). Returns two (k,) float64 arrays.
        """
        sizes = np.asarray(self.busbw_curve_size_kib, dtype=np.float64) * 1024
        t = np.asarray(self._curve_seconds()) - self.collective_latency_us * 1e-6
        bw = self.busbw_curve_algbw_factor * sizes / t
        return sizes, np.minimum(bw / bw[-1], 1.0)

    def busbw_fraction(self, total_bytes: float, op: str | None = None) -> float:
        """Fraction of peak bus bandwidth reached by a collective over ``total_bytes`` bytes:
        log-log interpolation of :meth:`falloff_table` (collective ``op``'s own table where the
        profile has one, else :meth:`busbw_fraction_table`), constant beyond its ends.

        Raises:
            ValueError: an unknown ``op``.
        """
        xs, ys = self.falloff_table(op)
        return _interp_loglog(xs, ys, total_bytes)

    def collective_us(
        self, recv_bytes: float, total_bytes: float, busbw_gbps: float, op: str | None = None
    ) -> float:
        """Time of one all-gather / reduce-scatter in which a rank receives ``recv_bytes`` out of a
        ``total_bytes`` buffer: ``latency + recv_bytes / (busbw * falloff(total_bytes))``, µs,
        the falloff of collective ``op`` (:meth:`busbw_fraction`; None: the profile's curve).
        Zero bytes cost nothing (the call is skipped). :meth:`allgather_us` and
        :meth:`reducescatter_us` name the collective and its bus bandwidth.

        Raises:
            ValueError: an unknown ``op``.
        """
        if recv_bytes <= 0:
            return 0.0
        bw = busbw_gbps * 1e3 * self.busbw_fraction(total_bytes, op)  # bytes per µs
        return self.collective_latency_us + recv_bytes / bw

    def allgather_us(self, recv_bytes: float, total_bytes: float) -> float:
        """One all-gather (:meth:`collective_us` at ``allgather_busbw_gbps``, its own table where
        the profile has one): a rank receives ``recv_bytes`` of the ``total_bytes`` gathered
        buffer, µs."""
        return self.collective_us(recv_bytes, total_bytes, self.allgather_busbw_gbps, "all_gather")

    def reducescatter_us(self, recv_bytes: float, total_bytes: float) -> float:
        """One reduce-scatter (:meth:`collective_us` at ``reducescatter_busbw_gbps``, its own
        table where the profile has one): a rank receives ``recv_bytes`` of the ``total_bytes``
        input buffer, µs."""
        return self.collective_us(
            recv_bytes, total_bytes, self.reducescatter_busbw_gbps, "reduce_scatter"
        )

    def alltoall_us(self, recv_bytes: float, total_bytes: float) -> float:
        """Time of one all-to-all in which a rank receives ``recv_bytes`` (``(n - 1) / n`` of its
        ``total_bytes`` buffer), µs: :meth:`collective_us` at ``alltoall_busbw_gbps`` (by
        default the all-gather bus bandwidth, for the reasons below).

        An all-to-all's bus bandwidth (nccl-tests: algbw x (n-1)/n, the bytes a rank receives per
        second) is bound by the same per-rank link as the all-gather's: NVLink into the NVSwitch
        in one node, the NIC with one rank per node. alltoall_perf on 4x H100 in one node reaches
        335 GB/s at 500 MiB (NVIDIA/nccl issue #2169), 8% below the 365 GB/s of ``h100_sxm``'s
        all-gather; with one GPU per node an all-to-all runs at the NIC's rate (nccl-tests issues
        #130, #267). No 8-rank H100 all-to-all table is public, so the profile's all-gather bus
        bandwidth, latency and falloff are used (docs/design.md §8; optimistic by up to ~8%):
        :meth:`allgather_us`, with the all-gather's own per-size table where the profile has one.
        """
        return self.collective_us(
            recv_bytes, total_bytes, self.alltoall_busbw_gbps, op="all_gather"
        )

    def p2p_us(self, nbytes: float) -> float:
        """Time of one send/recv step moving ``nbytes`` each way, µs (falloff as for collectives)."""
        if nbytes <= 0:
            return 0.0
        return self.p2p_latency_us + nbytes / (self.p2p_bw_gbps * 1e3 * self.busbw_fraction(nbytes))

    def copy_us(self, nbytes_read_plus_write: float) -> float:
        """Bandwidth term of a memory-bound operation moving the given bytes (read + write), µs."""
        return nbytes_read_plus_write / (self.copy_bw_gbps * 1e3)

    @property
    def nic_gpu_gbps(self) -> float:
        """One GPU's share of its node's NICs, GB/s: ``nic_bw_gbps x min(1, nics_per_node /
        gpus_per_node)`` (a GPU's traffic leaves by the NIC of its PCIe switch; one peer gets one
        NIC, nccl-tests issue #267). Raises ValueError on a flat profile."""
        if self.gpus_per_node is None:
            raise ValueError(f"hardware profile {self.name!r} is flat (gpus_per_node null)")
        return self.nic_bw_gbps * min(1.0, self.nics_per_node / self.gpus_per_node)

    def to_dict(self, network: bool = True) -> dict[str, Any]:
        """Flat dict of the constants (lists for the curves), as in the YAML file; ``network``
        False leaves out :data:`NETWORK_KEYS` (a run on one node does not use them)."""
        out = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.init and (network or f.name not in NETWORK_KEYS)
        }
        out["busbw_curve_size_kib"] = list(self.busbw_curve_size_kib)
        out["busbw_curve_gbps"] = list(self.busbw_curve_gbps)
        return out


def _read_yaml(path: Path) -> Any:
    """``yaml.safe_load`` of ``path``, a fresh copy each call, parsed once per version of the file
    (a sweep loads the same profile and fitted constants for every job and run)."""
    st = path.stat()
    return copy.deepcopy(_parse_yaml(str(path), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=64)
def _parse_yaml(path: str, mtime_ns: int, size: int) -> Any:
    import yaml

    try:
        with open(path) as fh:
            return yaml.safe_load(fh)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: cannot read as YAML: {exc}") from None


def read_profile(name: str) -> dict[str, Any]:
    """The constants of ``conf/hardware/<name>.yaml`` as Hydra composes them (its ``calibration``
    key included, and the defaults of the constants it may leave out, e.g. no collective table),
    fitted values not applied.

    A profile may extend another one through Hydra's defaults list (``defaults: [h100_sxm,
    _self_]`` in ``h100_ib.yaml``): the profiles it names are read first, in order, and its own
    keys are laid over them where ``_self_`` stands (last when absent). ``base_hardware``, the
    typed schema (:mod:`flashcp.config`), adds no constant.

    Raises:
        ValueError: unknown profile name (listing the valid ones), a file that is not a mapping,
            or a defaults list that loops.
    """

    def read(name: str, seen: tuple[str, ...]) -> dict[str, Any]:
        path = hardware_dir() / f"{name}.yaml"
        if not isinstance(name, str) or not name or "/" in name or not path.is_file():
            raise ValueError(
                f"unknown hardware profile {name!r}; choose one of {', '.join(list_hardware())}"
            )
        if name in seen:
            raise ValueError(f"hardware profiles extend each other in a loop: {' -> '.join(seen)}")
        data = _read_yaml(path)
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a mapping of constants")
        defaults = data.pop("defaults", None) or []
        if "_self_" not in defaults:
            defaults = [*defaults, "_self_"]
        out: dict[str, Any] = {}
        for entry in defaults:
            if entry == "_self_":
                out.update(data)
            elif entry != "base_hardware":
                out.update(read(entry, (*seen, name)))
        return out

    defaults = {
        f.name: f.default for f in fields(HardwareProfile) if f.init and f.default is not MISSING
    }
    return {**defaults, **read(name, ())}


def fitted_path() -> Path:
    """``results/calibration/fitted_constants.yaml`` (of the checkout, or packaged:
    :func:`flashcp.resources.resource_path`): the constants the calibration experiment fitted, by
    section (``experiments/calibration.py``)."""
    return resource_path("fitted_constants")


def read_fitted(sections) -> dict[str, float]:
    """The fitted constants of the named sections of :func:`fitted_path`, later sections winning.

    Raises:
        ValueError: the file is missing or lacks a section (rerun the calibration experiment).
    """
    path = fitted_path()
    if not path.is_file():
        raise ValueError(
            f"{path} is missing: run `flashcp-calibration`, or load the profile with "
            "calibrated=False"
        )
    data = _read_yaml(path) or {}
    found = data.get("sections") if isinstance(data, dict) else None
    if not isinstance(found, dict):
        raise ValueError(f"{path} must hold a mapping 'sections: {{name: {{constant: value}}}}'")
    out: dict[str, float] = {}
    for sec in sections:
        if sec not in found:
            raise ValueError(f"{path} has no section {sec!r}; sections: {sorted(found)}")
        values = found[sec]
        if not isinstance(values, dict):
            raise ValueError(f"{path}: section {sec!r} must map constants to numbers")
        for key, v in values.items():
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"{path}: section {sec!r}: {key} = {v!r} is not a finite number")
        out.update(values)
    return out


def profile_changes(hw: dict[str, Any]) -> dict[str, Any]:
    """Constants of a composed profile ``hw`` that differ from its file
    ``conf/hardware/<hw["name"]>.yaml`` (:func:`read_profile`): the values set on top of the
    file, e.g. on the command line (``hardware.launch_us=10``). Every key when ``hw`` names no
    profile file. A ``defaults`` key is ignored. A value equal to the file's is not a change, so
    ``hardware.fwd_tile_tflops=<the file's value>`` still gets the fitted value.

    Returns:
        ``{constant: value}`` of the changed keys (the ``calibration`` key included when changed).
    """
    name = hw.get("name")
    base = read_profile(name) if isinstance(name, str) and name in list_hardware() else {}
    return {k: v for k, v in hw.items() if k != "defaults" and base.get(k) != v}


def load_hardware(
    name_or_dict: str | dict | HardwareProfile,
    calibrated: bool = True,
    explicit: Iterable[str] = (),
) -> HardwareProfile:
    """Load a profile by name (``conf/hardware/<name>.yaml``, :func:`read_profile`) or build it
    from a flat dict.

    A ``calibration`` key (a list of section names of
    ``results/calibration/fitted_constants.yaml``) overrides the listed constants with their
    fitted values, unless ``calibrated`` is False (the calibration experiment starts from the
    YAML's own values). A constant set explicitly over the profile's file (a mapping whose value
    differs from ``conf/hardware/<name>.yaml``, :func:`profile_changes`: a command-line override
    such as ``hardware.fwd_tile_tflops=150``) wins over its fitted value.

    Args:
        name_or_dict: a profile name, a mapping of constants (e.g. Hydra's composed
            ``hardware`` group; a Hydra ``defaults`` key is ignored), or a profile (returned as is).
        calibrated: apply the fitted constants named by ``calibration``.
        explicit: constants set explicitly even where equal to the file's value (the command
            line's ``hardware.<key>=...``); they win over the fitted values too.
    Returns:
        The validated :class:`HardwareProfile`.
    Raises:
        ValueError: unknown profile name (listing the valid ones), unknown key (naming it), a
            missing key, an invalid constant, or missing fitted constants.
    """
    if isinstance(name_or_dict, HardwareProfile):
        return name_or_dict
    if isinstance(name_or_dict, str):
        data = read_profile(name_or_dict)  # an unknown name or an unreadable file: named there
        try:
            return load_hardware(data, calibrated, explicit)
        except ValueError as exc:  # a bad constant: say which file holds it
            where = f"{hardware_dir() / name_or_dict}.yaml"
            if calibrated and data.get("calibration"):
                where += f", calibrated from {fitted_path()}"
            raise ValueError(f"hardware profile {name_or_dict!r} ({where}): {exc}") from None
    try:
        data = dict(name_or_dict)
    except (TypeError, ValueError):
        raise ValueError(
            f"hardware must be a profile name or a mapping, got {type(name_or_dict).__name__}"
        ) from None
    data.pop("defaults", None)
    sections = data.pop("calibration", None) or []
    if calibrated and sections:
        fitted = read_fitted(list(sections))
        unknown = sorted(set(fitted) - {f.name for f in fields(HardwareProfile) if f.init})
        if unknown:
            raise ValueError(
                f"{fitted_path()}: fitted constants name unknown hardware key(s): "
                f"{', '.join(unknown)}"
            )
        mine = set(profile_changes(data)) | set(explicit)
        data.update({k: v for k, v in fitted.items() if k not in mine})
    known = {f.name for f in fields(HardwareProfile) if f.init}
    for key in [f.name for f in fields(HardwareProfile) if not f.init]:
        data.pop(key, None)  # derived state (e.g. from dataclasses.asdict): rebuilt from the rest
    for key in data:
        if key not in known:
            raise ValueError(
                f"unknown hardware key {key!r}; valid keys: {', '.join(sorted(known))}"
            )
    optional = {f.name for f in fields(HardwareProfile) if f.init and f.default is not MISSING}
    missing = sorted(known - optional - set(data))
    if missing:
        raise ValueError(f"hardware profile is missing key(s): {', '.join(missing)}")
    return HardwareProfile(**data)
