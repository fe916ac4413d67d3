"""Hydra entry point of the harness: sample sequences, plan them, run the plans, write rows.

    flashcp-run                                   # one run (defaults in conf/config.yaml)
    flashcp-run -m experiment=fig5                # the paper's main comparison, simulated
    flashcp-run -m method=flashcp,llama3 dataset=pile cp_size=4,8 model=h16,h32 name=my_sweep
    torchrun --nproc-per-node 4 -m experiments.run executor=dist cp_size=4 ...   # real ranks

One run is one (dataset, method, cp_size, model, context_len) over ``num_sequences`` sampled
sequences and every mode in ``modes``. It writes ``rows.csv`` (one row per sequence and mode) into
its own folder ``${results_dir}/${name}/runs/${run_key}`` atomically at the end, next to Hydra's
``.hydra/``; a run whose ``rows.csv`` exists with the same config hash is skipped, so an
interrupted sweep resumes where it stopped. When a sweep ends, :mod:`experiments.callbacks` merges
every run of ``${results_dir}/${name}`` into ``rows.csv`` / ``summary.csv`` and draws ``plots``.
"""

from __future__ import annotations

import logging
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from flashcp.comm import AttnShape
from flashcp.config import check_config, register_configs
from flashcp.plan import Plan
from flashcp.registry import COMM_KIND, get_planner
from flashcp.results import COMM_COLUMNS, PHASE_COLUMNS, config_hash, provenance, write_csv_atomic

log = logging.getLogger(__name__)
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")

#: columns that identify a run (the summary groups by them)
RUN_COLUMNS = (
    "name", "dataset", "weighting", "method", "cp_size", "context_len", "model", "num_heads",
    "num_kv_heads", "head_dim", "dtype", "executor", "hardware", "seed", "config_hash",
)  # fmt: skip


def attn_shape(cfg: DictConfig) -> AttnShape:
    m = cfg.model
    return AttnShape(int(m.num_heads), int(m.num_kv_heads), int(m.head_dim), str(m.dtype))


def sample(cfg: DictConfig) -> list[np.ndarray]:
    """The run's sequences: (n_docs,) int64 document lengths, each summing to ``context_len``."""
    from flashcp.data import load_distribution, sample_sequences

    dist = load_distribution(
        cfg.dataset.name, context_len=int(cfg.context_len), path=cfg.dataset.path
    )
    return sample_sequences(
        dist,
        int(cfg.num_sequences),
        int(cfg.context_len),
        seed=int(cfg.seed),
        weighting=str(cfg.dataset.weighting),
        cap=cfg.dataset.cap,
    )


def plan_metrics(plan: Plan) -> dict[str, Any]:
    """Plan columns of a row (from :meth:`flashcp.plan.Plan.summary`).

    ``comm_tokens`` is what the method really moves: KV tokens one rank receives per pass, per K or
    V, per KV head — Eq. 4 for full all-gather and for the ring, Eq. 5 for sharding-aware
    all-gather — and ``comm_saving`` = 1 - comm_tokens / comm_tokens_full. ``comm_tokens_sharded``
    is Eq. 5 on the method's layout: what sharding-aware communication would move for it. ILP
    plans add ``ilp_solver_status``, ``ilp_gap``, ``ilp_warm_start_given`` and
    ``ilp_warm_start_accepted``.
    """
    s = plan.summary()
    keys = ("imbalance_ratio", "comm_tokens", "comm_tokens_full", "comm_saving",
            "comm_tokens_sharded", "num_split_docs", "num_pieces",
            "max_shards_per_rank")  # fmt: skip
    out = {k: s[k] for k in keys}
    if plan.method == "ilp":  # the solver's outcome (flashcp.ilp.plan_ilp's info)
        for k in ("solver_status", "gap", "warm_start_given", "warm_start_accepted"):
            out[f"ilp_{k}"] = plan.info.get(k)
    return out


def plan_rows(
    seqs: list[np.ndarray],
    first_idx: int,
    method: str,
    cp_size: int,
    options: dict[str, Any],
    shape: AttnShape,
    modes: list[str],
    hw: Any,
) -> list[dict[str, Any]]:
    """Plan and simulate sequences ``first_idx, first_idx + 1, ...``: one row per (sequence, mode).

    A sequence whose planner or simulation fails becomes rows with ``status = "error: ..."``.
    """
    from flashcp.sim import simulate_many

    planner = get_planner(method)
    comm_kind = COMM_KIND[method]
    rows: list[dict[str, Any]] = []
    for i, d in enumerate(seqs, start=first_idx):
        base = {"seq_idx": i, "num_docs": int(d.size), "max_doc_len": int(d.max())}
        try:
            t0 = time.perf_counter()
            plan = planner(d, cp_size, **options)
            plan_ms = (time.perf_counter() - t0) * 1e3
            sims = simulate_many(plan, [shape], modes, hw, comm_kind=comm_kind)
        except Exception as exc:  # a failure is a row, not a crash (STYLE.md §6)
            log.warning("sequence %d failed: %s", i, exc)
            rows.extend(
                {**base, "mode": mode, "status": f"error: {type(exc).__name__}: {exc}"}
                for mode in modes
            )
            continue
        metrics = {"plan_status": plan.status, "plan_ms": plan_ms, **plan_metrics(plan)}
        for mode, sim in zip(modes, sims, strict=True):
            rows.append({**base, **metrics, "mode": mode, "status": "ok", **sim})
    return rows


def _plan_rows_star(args: tuple) -> list[dict[str, Any]]:
    return plan_rows(*args)


def run_sim(cfg: DictConfig, seqs: list[np.ndarray]) -> list[dict[str, Any]]:
    """Plan + simulate every sequence, in ``cfg.workers`` processes, with a progress bar."""
    from tqdm import tqdm

    from flashcp.sim import load_hardware

    hw = load_hardware(OmegaConf.to_container(cfg.hardware, resolve=True))
    shape = attn_shape(cfg)
    modes = list(cfg.modes)
    options = OmegaConf.to_container(cfg.method.options, resolve=True)
    chunk = 64
    jobs = [
        (seqs[i : i + chunk], i, cfg.method.name, int(cfg.cp_size), options, shape, modes, hw)
        for i in range(0, len(seqs), chunk)
    ]
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=len(seqs), desc=cfg.run_key, unit="seq", disable=not (cfg.progress and sys.stderr.isatty()), leave=False)
    with bar:
        if int(cfg.workers) == 1:
            results = map(_plan_rows_star, jobs)
        else:
            pool = ProcessPoolExecutor(max_workers=int(cfg.workers))
            results = pool.map(_plan_rows_star, jobs)
        for job, part in zip(jobs, results, strict=True):
            rows.extend(part)
            bar.update(len(job[0]))
        if int(cfg.workers) > 1:
            pool.shutdown()
    return rows


def run_dist(cfg: DictConfig, seqs: list[np.ndarray]) -> list[dict[str, Any]] | None:
    """Run every plan for real on the torchrun process group; rows on rank 0, None elsewhere."""
    import torch
    import torch.distributed as dist

    from flashcp.executors.dist import init_from_env, measure_step

    group = init_from_env(float(cfg.executor.timeout_s))
    world = dist.get_world_size()
    if world != int(cfg.cp_size):
        raise ValueError(f"torchrun started {world} ranks but cp_size = {cfg.cp_size}; they must match")
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    planner = get_planner(cfg.method.name)
    options = OmegaConf.to_container(cfg.method.options, resolve=True)
    shape = attn_shape(cfg)
    rows: list[dict[str, Any]] = []
    for i, d in enumerate(seqs):
        base = {"seq_idx": i, "num_docs": int(d.size), "max_doc_len": int(d.max())}
        plan = planner(d, int(cfg.cp_size), **options)
        metrics = {"plan_status": plan.status, **plan_metrics(plan)}
        for mode in cfg.modes:
            res = measure_step(
                plan, shape, mode, group=group, device=device, backend=cfg.executor.backend,
                warmup=int(cfg.executor.warmup), iters=int(cfg.executor.iters), seed=int(cfg.seed) + i,
            )  # fmt: skip
            rows.append({**base, **metrics, "mode": mode, "status": "ok", **res})
    return rows if dist.get_rank() == 0 else None


def finish_rows(cfg: DictConfig, rows: list[dict[str, Any]], chash: str) -> pd.DataFrame:
    """Attach run identity and provenance to every row (STYLE.md §7) and order the columns."""
    m = cfg.model
    ident = {
        "name": cfg.name, "dataset": cfg.dataset.name, "weighting": cfg.dataset.weighting,
        "method": cfg.method.name, "cp_size": int(cfg.cp_size), "context_len": int(cfg.context_len),
        "model": m.name, "num_heads": int(m.num_heads), "num_kv_heads": int(m.num_kv_heads),
        "head_dim": int(m.head_dim), "dtype": m.dtype, "executor": cfg.executor.name,
        "hardware": cfg.hardware.get("name", "unknown") if cfg.executor.name == "sim" else "measured",
        "seed": int(cfg.seed), "config_hash": chash,
    }  # fmt: skip
    df = pd.DataFrame(rows)
    for k, v in reversed(list(ident.items())):
        df.insert(0, k, v)
    for k, v in provenance().items():
        df[k] = v
    for col in (*PHASE_COLUMNS, *COMM_COLUMNS):
        if col not in df:
            df[col] = np.nan
    return df


def run(cfg: DictConfig) -> Path | None:
    """Execute one run described by ``cfg``; return the path of its rows.csv (None off rank 0)."""
    check_config(cfg)
    if cfg.task == "kernel_efficiency":
        from experiments.fig3 import run_fig3

        out = run_fig3(cfg)
        log.info("kernel efficiency -> %s and fig3.png", out)
        return out
    if cfg.task == "table2":
        from experiments.table2 import run_table2

        out_dir = Path(cfg.results_dir) / cfg.name
        run_table2(
            out_dir=str(out_dir), seed=int(cfg.seed), dataset=cfg.dataset.name,
            cp_size=int(cfg.cp_size), context_len=int(cfg.context_len),
            **OmegaConf.to_container(cfg.table2, resolve=True),
        )  # fmt: skip
        log.info("Table 2 -> %s/table2.{csv,md,tex}", out_dir)
        return out_dir / "table2.csv"

    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved.pop("progress", None)  # cosmetic options do not change results
    resolved.pop("workers", None)
    chash = config_hash(resolved)
    out = Path(cfg.results_dir) / cfg.name / "runs" / cfg.run_key / "rows.csv"
    if out.exists():
        done = pd.read_csv(out, usecols=["config_hash"], nrows=1, dtype=str)
        if len(done) and done["config_hash"].iloc[0] == chash:
            log.info("%s: already done (config %s), skipping", cfg.run_key, chash)
            return out
    t0 = time.perf_counter()
    seqs = sample(cfg)
    rows = run_sim(cfg, seqs) if cfg.executor.name == "sim" else run_dist(cfg, seqs)
    if rows is None:
        return None
    df = finish_rows(cfg, rows, chash)
    write_csv_atomic(df, out)
    ok = (df["status"] == "ok").sum()
    log.info(
        "%s: %d rows (%d ok) in %.1f s -> %s", cfg.run_key, len(df), ok, time.perf_counter() - t0, out
    )
    return out


register_configs()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    """Console entry point ``flashcp-run`` (Hydra parses the command line).

    Bad configuration values end the process with one line on stderr and exit code 2.
    """
    import sys

    try:
        run(cfg)
    except ValueError as exc:
        print(f"flashcp-run: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
