"""Point-to-point exchange around a ring of ranks (Ring Attention, Liu et al. 2023).

Every rank sends a buffer to its successor ``(r + 1) mod N`` and receives one of the same shape and
dtype from its predecessor ``(r - 1) mod N``. The send and the receive are posted together with
``torch.distributed.batch_isend_irecv`` (one NCCL group, so two ranks that send to each other
cannot deadlock) and return at once; the caller computes on the current block and only then waits,
which overlaps the transfer with compute.

Every wait is bounded by the process group's timeout. On CPU (gloo) the wait passes that timeout
explicitly (read from the group's backend options; ``default_pg_timeout`` when the backend does not
expose it) and a late transfer raises ``RuntimeError``. On CUDA (NCCL) the wait only makes the
current stream wait for the transfer, so the host keeps queueing kernels; NCCL's watchdog aborts a
transfer that outlives the group's timeout (a host-blocking timed wait would serialise the
overlap).

With a :class:`flashcp.ops.collectives.LocalGroup` (``executor=emulate``) the exchange is
delegated to that group's ``ring_post`` / ``ring_wait``; counting stays here.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from flashcp.ops.collectives import LocalGroup

__all__ = ["RingComm", "group_timeout"]


def group_timeout(group, device: torch.device) -> datetime.timedelta:
    """The timeout of ``group`` (None: the default group) for collectives on ``device``."""
    pg = group if group is not None else dist.group.WORLD
    try:
        return pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return dist.distributed_c10d.default_pg_timeout


class _Pending:
    """A posted exchange: the works to wait on, the receive buffers, and the sent tensors (kept
    alive until the transfer completes)."""

    def __init__(self, works, recv: list[torch.Tensor], sent: list[torch.Tensor]):
        self.works = works
        self.recv = recv
        self.sent = sent


class RingComm:
    """Send to the next rank and receive from the previous one, asynchronously.

    Args:
        group: process group of the N CP ranks (None: the default group).
        device: device of the buffers (selects the backend whose timeout bounds the waits).
        counter: optional :class:`flashcp.ops.collectives.CommCounter`; every exchange adds the
            bytes this rank *receives* under kind ``"p2p"`` (by link class, from the
            predecessor's node, when the counter has a topology).
        timeout: bound on each wait (default: the group's own timeout).

    Usage::

        pending = comm.post([kv])      # send kv to r+1, receive the same shape from r-1
        ...compute on kv...
        (next_kv,) = comm.wait(pending)
    """

    def __init__(self, group=None, device=None, counter=None, timeout=None):
        self.group = group
        self.counter = counter
        if isinstance(group, LocalGroup):  # in-process stand-in: it does the exchange
            self.rank, self.world_size = group.rank(), group.size()
            self.timeout, self.host_wait = timeout, False
            self.next_rank = (self.rank + 1) % self.world_size
            self.prev_rank = (self.rank - 1) % self.world_size
            return
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.timeout = timeout if timeout is not None else group_timeout(group, dev)
        self.host_wait = dev.type != "cuda"
        n = self.world_size
        self.next_rank = self._global((self.rank + 1) % n)
        self.prev_rank = self._global((self.rank - 1) % n)

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def _count(self, buf: torch.Tensor) -> None:
        """Count ``buf``'s bytes as received from the predecessor (group rank r - 1)."""
        src = (self.rank - 1) % self.world_size
        self.counter.add_from("p2p", buf.numel() * buf.element_size(), self.group, src)

    def post(self, tensors: list[torch.Tensor], tag: int = 0) -> _Pending:
        """Start sending ``tensors`` to the next rank and receiving same-shaped buffers from the
        previous one. The sent tensors must not be modified until :meth:`wait` returns.

        Args:
            tensors: contiguous tensors (any shape/dtype; the peer sends the same shapes).
            tag: message tag (gloo matches on it; NCCL matches by posting order, which every
                rank keeps the same).
        Returns:
            a handle for :meth:`wait`.
        """
        if self.world_size == 1:
            raise ValueError("a ring exchange needs at least 2 ranks")
        if isinstance(self.group, LocalGroup):
            for t in tensors:
                if not t.is_contiguous():
                    raise ValueError("ring exchange buffers must be contiguous")
                if self.counter is not None:
                    self._count(t)
            return self.group.ring_post(list(tensors), tag)
        ops, recv = [], []
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError("ring exchange buffers must be contiguous")
            buf = torch.empty_like(t)
            ops.append(dist.P2POp(dist.isend, t, self.next_rank, self.group, tag))
            ops.append(dist.P2POp(dist.irecv, buf, self.prev_rank, self.group, tag))
            recv.append(buf)
            if self.counter is not None:
                self._count(buf)
        return _Pending(dist.batch_isend_irecv(ops), recv, list(tensors))

    def wait(self, pending: _Pending) -> list[torch.Tensor]:
        """Wait (at most the timeout per operation) for a posted exchange; return the received
        buffers, in the order given to :meth:`post`.

        Raises:
            RuntimeError: a transfer failed or timed out.
        """
        if isinstance(self.group, LocalGroup):
            return self.group.ring_wait(pending)
        for w in pending.works:
            if not self.host_wait:
                w.wait()  # stream wait; NCCL's watchdog enforces the group's timeout
            elif not w.wait(self.timeout):
                raise RuntimeError(f"ring exchange did not complete within {self.timeout}")
        pending.works, pending.sent = [], []
        return pending.recv
