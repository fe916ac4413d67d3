"""Hydra callback that merges the runs of one invocation and draws its figures when it ends."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)


def release_process_group() -> None:
    """Under torchrun (executor=dist), tear the process group down on every rank together once the
    runs are over: a rank that exits while another still holds the group aborts the job. The
    group lives across the runs of a sweep because re-creating it on the same store hangs."""
    import sys

    if "torch.distributed" not in sys.modules:
        return  # never imported: no group (keeps the simulator free of torch)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class AggregateResults(Callback):
    """When a run or a sweep ends: merge the rows of the runs it executed (or skipped as already
    finished) into ``${results_dir}/${name}/rows.csv`` and ``summary.csv``
    (:func:`experiments.aggregate.aggregate`), then draw the figures named in ``plots``.

    Runs of earlier invocations with other configs stay in ``runs/`` but are not merged;
    ``python -m experiments.aggregate DIR`` merges every run of a folder.
    """

    def __init__(self) -> None:
        self.run_dirs: list[Path] = []

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        self.run_dirs.append(Path(job_return.hydra_cfg.hydra.runtime.output_dir))

    def _finish(self, config: DictConfig) -> None:
        release_process_group()
        if config.get("task", "main") != "main" or os.environ.get("RANK", "0") != "0":
            return  # other tasks write their own tables; under torchrun only rank 0 aggregates
        from experiments.aggregate import aggregate
        from experiments.plot import draw

        exp_dir = Path(config.results_dir) / config.name
        summary = aggregate(exp_dir, self.run_dirs)
        if summary is None:
            return
        for fig in config.get("plots", []):
            log.info("figure %s -> %s", fig, draw(fig, exp_dir))

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._finish(config)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._finish(config)
