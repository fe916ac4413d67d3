"""The peer's own code on CPU: ``ring-flash-attn`` 0.1.8 (PyPI, pure Python) over gloo ranks.

The FlashCP paper ran ``ring_flash_attn_varlen_func``, ``zigzag_ring_flash_attn_varlen_func`` and
``llama3_flash_attn_varlen_func`` as its Ring, Zigzag and Llama3 baselines; the simulator prices
them as ``method.impl=ring_flash_attn`` (:mod:`flashcp.sim.impl`). This module imports the
installed package unchanged, in a forked rank only (:func:`import_peer`):

* its ``from flash_attn.flash_attn_interface import ...`` gets the stand-in flash-attn 2.8.3
  (:func:`standins.flash_attn_pkg.make_flash_attn`): the two varlen entry points are
  ``torch.library`` custom ops with the real argument names, defaults and return tuples, on the
  float64 kernel emulation (bfloat16 / float16 in and out, as FlashAttention-2 requires);
* ``import ring_flash_attn`` runs its ``adapters`` (the Hugging Face patch, which the harness never
  calls), and they import ``transformers`` at module level, including a name transformers 5
  removed. So a module named ``transformers`` with the one attribute the adapter reads at import
  (``modeling_flash_attention_utils.is_flash_attn_greater_or_equal_2_10``) is put in
  ``sys.modules`` of the rank's process, whether or not transformers is installed, so that the
  package's own ``__init__`` runs; calling the adapter would fail on it.

:func:`peer_rows` and :func:`peer_cu_seqlens` give each function's own layout;
:class:`PeerRecorder` records what the package issues (kernel calls, ATen ops, P2P exchanges and
collectives, per ring step) as :class:`flashcp.executors.work_trace.RankTrace` events, so that
:func:`flashcp.executors.work_trace.trace_account` sums them as it sums the project's ops.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types

import numpy as np
import torch
import torch.distributed as dist

from flashcp.executors.work_trace import RankTrace, WorkEvent, _Recorder
from standins.flash_attn_pkg import make_flash_attn

#: the flash-attn generation the peer runs on here (its custom-op entry points)
FA_VERSION = "2.8.3"
KERNELS = {"_flash_attn_varlen_forward": "forward", "_flash_attn_varlen_backward": "backward"}


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def peer_installed() -> bool:
    """Whether the ``ring-flash-attn`` package can be found (it is installed ``--no-deps``)."""
    return _installed("ring_flash_attn")


def import_peer(namespace: str) -> types.ModuleType:
    """Import ``ring_flash_attn`` in this process on the stand-in flash-attn (module docstring).

    Call it in a forked rank only: it changes ``sys.modules`` for the rest of the process.

    Args:
        namespace: ``torch.library`` namespace of the stand-in's custom ops.
    Returns:
        the ``ring_flash_attn`` package.
    """
    pkg = make_flash_attn(FA_VERSION, namespace)
    sys.modules["flash_attn"] = pkg
    sys.modules["flash_attn.flash_attn_interface"] = pkg.flash_attn_interface
    # the rank's process only: shadow any installed transformers (see the module docstring)
    tf = types.ModuleType("transformers")
    tf.__path__ = []
    tf.__version__ = "0.0-stub"
    utils = types.ModuleType("transformers.modeling_flash_attention_utils")
    utils.is_flash_attn_greater_or_equal_2_10 = lambda: True
    tf.modeling_flash_attention_utils = utils
    sys.modules["transformers"] = tf
    sys.modules["transformers.modeling_flash_attention_utils"] = utils
    import ring_flash_attn

    return ring_flash_attn


def peer_rows(method: str, doc_lens, n: int, rank: int) -> np.ndarray:
    """Packed positions of ``rank``'s local rows, in the order the package expects them.

    ``ring``: chunk r of N equal chunks of every document; ``zigzag``: chunks r and 2N-1-r of 2N
    of every document; ``llama3``: chunk r of N contiguous chunks of the packed sequence.
    """
    if method == "llama3":
        t = sum(doc_lens) // n
        return np.arange(rank * t, (rank + 1) * t)
    rows, start = [], 0
    for d in doc_lens:
        if method == "ring":
            c = d // n
            rows.append(np.arange(start + rank * c, start + (rank + 1) * c))
        else:
            c = d // (2 * n)
            for j in (rank, 2 * n - 1 - rank):
                rows.append(np.arange(start + j * c, start + (j + 1) * c))
        start += d
    return np.concatenate(rows)


def peer_cu_seqlens(doc_lens, n: int) -> tuple[torch.Tensor, int]:
    """The ring and zigzag functions' local ``cu_seqlens`` (every document contributes d / N rows
    to every rank, the same on all ranks) and ``max_seqlen``."""
    d = np.asarray(doc_lens, dtype=np.int64)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(d // n)]), dtype=torch.int32)
    return cu, int(d.max()) // n


class PeerRecorder(_Recorder):
    """The work recorder of :mod:`flashcp.executors.work_trace` for the package's code.

    * the stand-in's ``_flash_attn_varlen_forward`` / ``_backward`` custom ops (one
      FlashAttention-2 launch each on a GPU) become ``kernel`` events with their segments and
      causal flag; the emulation inside them is not recorded;
    * :meth:`patched` wraps ``torch.distributed.batch_isend_irecv`` (one ``p2p`` exchange: the
      bytes of its receives), ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` as
      ``comm`` events, and counts ring steps: the first ``RingComm`` a pass creates carries the
      KV blocks, and each of its ``wait`` calls starts the next ring step; each ``commit`` and
      its ``wait`` bound one exchange of :attr:`~flashcp.executors.work_trace.RankTrace.exchanges`
      (``kv`` on that first ``RingComm``, ``grad`` on the dK/dV one).
    """

    def __init__(self, trace: RankTrace, group_size: int) -> None:
        super().__init__(trace)
        self.group_size = group_size
        self.comms_made = 0

    def start_backward(self) -> None:
        self.phase, self.step, self.comms_made = "bwd", 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if self.paused or name not in KERNELS:
            return super().__torch_dispatch__(func, types, args, kwargs)
        bound = {a.name: v for a, v in zip(func._schema.arguments, args, strict=False)}
        bound.update(kwargs)
        q = bound["q"]
        seg = [tuple(int(x) for x in np.diff(bound[c].tolist())) for c in ("cu_seqlens_q",
                                                                             "cu_seqlens_k")]  # fmt: skip
        self.add(WorkEvent("kernel", self.phase, self.step, KERNELS[name], elements=q.shape[0],
                           q_lens=seg[0], k_lens=seg[1], causal=bool(bound["causal"]),
                           heads=q.shape[1]))  # fmt: skip
        return func(*args, **kwargs)

    def _comm(self, kind: str, nbytes: int) -> None:
        self.add(WorkEvent("comm", self.phase, self.step, kind, nbytes=int(nbytes),
                           group_size=self.group_size))  # fmt: skip

    @contextlib.contextmanager
    def patched(self, peer: types.ModuleType):
        """Wrap the package's communication for the duration (module-level names restored)."""
        rec = self
        n = self.group_size
        orig = {
            name: getattr(dist, name)
            for name in ("batch_isend_irecv", "all_gather_into_tensor", "reduce_scatter_tensor")
        }

        def batch_isend_irecv(ops):
            recv = sum(
                o.tensor.numel() * o.tensor.element_size() for o in ops if o.op is dist.irecv
            )
            rec._comm("p2p", recv)
            with rec.pause():
                return orig["batch_isend_irecv"](ops)

        def all_gather_into_tensor(output, inp, *a, **kw):
            rec._comm("allgather", (n - 1) * inp.numel() * inp.element_size())
            with rec.pause():
                return orig["all_gather_into_tensor"](output, inp, *a, **kw)

        def reduce_scatter_tensor(output, inp, *a, **kw):
            rec._comm("reducescatter", (n - 1) * output.numel() * output.element_size())
            with rec.pause():
                return orig["reduce_scatter_tensor"](output, inp, *a, **kw)

        base = peer.utils.RingComm

        class CountedRingComm(base):
            def __init__(self, process_group):
                super().__init__(process_group)
                self.carries_kv = rec.comms_made == 0
                rec.comms_made += 1

            def commit(self):
                super().commit()
                kind = "kv" if self.carries_kv else "grad"
                self.entry = [rec.phase, kind, len(rec.trace.events), -1]
                rec.trace.exchanges.append(self.entry)

            def wait(self):
                with rec.pause():
                    super().wait()
                self.entry[3] = len(rec.trace.events)
                if self.carries_kv:
                    rec.step += 1

        mods = [peer.ring_flash_attn_varlen, peer.zigzag_ring_flash_attn_varlen]
        try:
            dist.batch_isend_irecv = batch_isend_irecv
            dist.all_gather_into_tensor = all_gather_into_tensor
            dist.reduce_scatter_tensor = reduce_scatter_tensor
            for m in mods:
                m.RingComm = CountedRingComm
            yield self
        finally:
            for name, fn in orig.items():
                setattr(dist, name, fn)
            for m in mods:
                m.RingComm = base


__all__ = [
    "FA_VERSION",
    "PeerRecorder",
    "import_peer",
    "peer_cu_seqlens",
    "peer_installed",
    "peer_rows",
]
