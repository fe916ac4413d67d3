"""Hydra callback that merges a sweep's runs and draws its figures when the sweep (or run) ends."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)


class AggregateResults(Callback):
    """On the end of a run or multirun: ``experiments.aggregate.aggregate`` over
    ``${results_dir}/${name}``, then the figures named in ``plots``."""

    def _finish(self, config: DictConfig) -> None:
        if config.get("task", "main") != "main" or os.environ.get("RANK", "0") != "0":
            return  # other tasks write their own tables; under torchrun only rank 0 aggregates
        from experiments.aggregate import aggregate
        from experiments.plot import draw

        exp_dir = Path(config.results_dir) / config.name
        summary = aggregate(exp_dir)
        if summary is None:
            return
        for fig in config.get("plots", []):
            path = draw(fig, exp_dir)
            log.info("figure %s -> %s", fig, path)

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._finish(config)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._finish(config)
