"""Per-phase timing of CP steps.

On CUDA each phase is bracketed by CUDA events (read after a synchronise in :meth:`PhaseTimer.as_ms`);
on CPU (or with ``use_events=False``) by ``time.perf_counter`` after synchronising the device.
Phases are added up over repeated entries; ops take ``timer=None`` and then time nothing.

Every CUDA call names the timed device: events are recorded on *that* device's current stream
(:func:`record_event`), not on the current device's, so a timer of ``cuda:1`` in a process whose
current device is ``cuda:0`` times the work of ``cuda:1``.
"""

from __future__ import annotations

import contextlib
import time

import torch

__all__ = ["NullTimer", "PhaseTimer", "as_timer", "record_event"]


def record_event(device: torch.device) -> torch.cuda.Event:
    """A timing CUDA event recorded now on the current stream of ``device`` (a CUDA device).

    ``torch.cuda.Event.record()`` without a stream records on the current *device*'s stream,
    which need not be the device of the timed tensors.
    """
    with torch.cuda.device(device):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(device))
    return ev


class PhaseTimer:
    """Accumulates wall time per named phase, in milliseconds.

    Args:
        device: where the timed work runs (CUDA device -> events; otherwise perf_counter).
        use_events: force events on/off (default: on for CUDA).
        sync: on the perf_counter path, synchronise the CUDA device around each phase.
    """

    def __init__(self, device=None, *, use_events: bool | None = None, sync: bool = True) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        cuda = self.device.type == "cuda"
        self.use_events = cuda if use_events is None else (use_events and cuda)
        self.sync = sync and cuda
        self._ms: dict[str, float] = {}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def _sync(self) -> None:
        if self.sync:
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the body as phase ``name`` (adds to earlier entries of the same phase)."""
        if self.use_events:
            start = record_event(self.device)
            try:
                yield
            finally:
                self._events.append((name, start, record_event(self.device)))
            return
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self._ms[name] = self._ms.get(name, 0.0) + (time.perf_counter() - t0) * 1e3

    def as_ms(self) -> dict[str, float]:
        """Milliseconds per phase so far (synchronises the device when events are pending)."""
        if self._events:
            torch.cuda.synchronize(self.device)
            for name, start, end in self._events:
                self._ms[name] = self._ms.get(name, 0.0) + start.elapsed_time(end)
            self._events.clear()
        return dict(self._ms)

    def reset(self) -> None:
        """Forget every recorded phase."""
        self._ms.clear()
        self._events.clear()


class NullTimer:
    """A timer that times nothing (the default when an op gets ``timer=None``)."""

    def phase(self, name: str):
        return contextlib.nullcontext()

    def as_ms(self) -> dict[str, float]:
        return {}

    def reset(self) -> None:
        pass


def as_timer(timer) -> PhaseTimer | NullTimer:
    """``timer`` itself, or a :class:`NullTimer` when it is None."""
    return NullTimer() if timer is None else timer
