"""Executors that run plans for real (docs/design.md §4). The analytic ``sim`` executor lives with the
simulator; :mod:`flashcp.executors.dist` runs real ops over torch.distributed. Submodules import
torch lazily from the caller's point of view: import them explicitly."""
