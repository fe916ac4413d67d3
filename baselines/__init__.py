"""The four baselines of the FlashCP paper (Llama3 CP, Per-Doc CP, Ring attention and Zigzag ring
attention) and the head-parallel ones (Ulysses, USP). Each ``<method>.py`` holds its planner (a
pure function of ``doc_lens`` and ``cp_size``) and its ``METHOD`` spec, which names the op family
that runs its plans (:class:`flashcp.kinds.OpFamily`); ``pyproject.toml`` declares the specs in
the ``flashcp.methods`` entry points, which :mod:`flashcp.registry` loads on first use, so
:mod:`flashcp` never imports this package at import time."""

from baselines.llama3 import plan_llama3
from baselines.per_doc import plan_per_doc
from baselines.ring import plan_ring
from baselines.zigzag import plan_zigzag

__all__ = ["plan_llama3", "plan_per_doc", "plan_ring", "plan_zigzag"]
