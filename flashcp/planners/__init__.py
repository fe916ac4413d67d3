"""The planners of this package, one module or package per method, named after its ``method=``
value: :mod:`.flashcp` (the paper's Algorithm 1), :mod:`.flashcp_refined`, :mod:`.flashcp_ulysses`
and :mod:`.ilp`; :mod:`.layout` holds the layout building blocks they and the baselines share.
A method's package picks its compiled or reference implementation (``compiled.py``,
``reference.py``). The baselines' planners are in the top-level ``baselines`` package.
"""
