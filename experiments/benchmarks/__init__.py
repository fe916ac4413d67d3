"""Benchmark scripts (argparse, not Hydra apps): planner speed, ILP time to gap, op memory peaks,
the refined heuristic against Algorithm 1. Run one with ``python -m experiments.benchmarks.<name>``
(or ``python experiments/benchmarks/<name>.py``); each module's docstring gives its command."""
