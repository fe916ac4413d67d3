"""The harness's commands, in rooms: the Hydra plumbing they share (:mod:`experiments.common`),
one module per experiment with its schema beside it (``run.py`` is ``flashcp-run``; ``table2.py``,
``calibration.py``, ``sensitivity.py``, ``fig3.py`` one command each), the shared tools
(``aggregate.py``, ``plot.py``), the benchmark scripts (:mod:`experiments.benchmarks`) and the GPU
machine's check (``gpu_check.py``). How to add an experiment: :mod:`experiments.common`."""
