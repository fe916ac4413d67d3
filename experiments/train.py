"""Training steps with context parallelism: ``flashcp-train`` (or ``python -m experiments.train``;
conf/train.yaml, :class:`TrainConfig`).

``steps`` AdamW steps of the small Llama-style model of :mod:`flashcp.training.model` on packed
sequences sampled as ``flashcp-run`` samples them (:func:`flashcp.data.sample_dataset`, every
field of the ``dataset`` group), planned and sharded by any registered method
(:func:`flashcp.training.plan_and_shard`'s steps, timed apart), the loss from
:func:`flashcp.training.cp_cross_entropy` and the gradients from
:func:`flashcp.training.allreduce_grads`. Under ``torchrun`` the world is CP groups of
``cp_size`` consecutive ranks times data parallelism over the rest (gloo on CPU, NCCL on GPU);
without it one process is CP 1. The tokens are synthetic (no tokenizer, no corpus): each document
is an arithmetic progression modulo the vocabulary, ``t_i = (t_0 + i s) mod V`` with its own
random ``t_0`` and ``s``, so the loss falls as the model learns to read ``s`` off the document's
earlier tokens.

Output (rank 0): ``<results_dir>/<name>/train_rows.csv``, one row per step, the columns of
:data:`TRAIN_ROW_SCHEMA`: the loss of the step (the one-device loss of all replicas' sequences),
tokens/s and the step's phases in ms (the slowest rank's), the setup and provenance.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf

from experiments.common.entry import (
    CONF_DIR,
    ExperimentConfig,
    at_least,
    check_experiment_config,
    register_experiment,
    run_experiment,
)
from experiments.common.launch import launch, register_value_check
from flashcp.config import DatasetConfig, MethodConfig

__all__ = [
    "PHASES",
    "TRAIN_ROW_SCHEMA",
    "LlamaSizes",
    "TrainConfig",
    "check_train_config",
    "cli",
    "main",
    "run_train",
    "synthetic_tokens",
]

log = logging.getLogger(__name__)

#: the command (conf/train.yaml names it in hydra.callbacks.folder.prog; pyproject.toml's script)
PROG = "flashcp-train"

#: the phases of a step, ms, each the slowest rank's: ``plan`` the planner on the CP group's rank
#: 0, ``plan_bcast`` the plan's broadcast to the group, ``shard`` this rank's tokens, labels,
#: positions and op metadata (:func:`flashcp.training.shard_batch`), ``forward`` the model and the
#: loss (its valid-token count all-reduced), ``backward``, ``allreduce`` the gradients' SUM
#: all-reduce, ``optimizer`` the AdamW step; ``step`` the whole step on this rank
PHASES: tuple[str, ...] = (
    "plan", "plan_bcast", "shard", "forward", "backward", "allreduce", "optimizer", "step",
)  # fmt: skip

#: columns of ``train_rows.csv``, in file order, and their types (as
#: :data:`flashcp.results.ROW_SCHEMA`'s: int, float, bool, text)
TRAIN_ROW_SCHEMA = MappingProxyType({
    "name": "text", "step": "int", "seq_idx": "text", "num_docs": "int", "max_doc_len": "int",
    "tokens": "int", "valid_tokens": "int", "loss": "float", "tokens_per_s": "float",
    **{f"{p}_ms": "float" for p in PHASES},
    "dataset": "text", "dataset_path": "text", "weighting": "text", "dataset_cap": "int",
    "overlong": "text", "method": "text", "method_options": "text", "cp_size": "int",
    "dp_size": "int", "world_size": "int", "context_len": "int", "steps": "int", "seed": "int",
    "lr": "float", "dtype": "text", "vocab_size": "int", "hidden_size": "int",
    "num_layers": "int", "num_heads": "int", "num_kv_heads": "int", "intermediate_size": "int",
    "device": "text", "dist_backend": "text", "attn_backend": "text",
    "git_commit": "text", "git_dirty": "bool", "flashcp_version": "text", "torch_version": "text",
    "code_version": "text", "config_hash": "text",
})  # fmt: skip


@dataclass
class LlamaSizes:
    """Sizes of the model (:class:`flashcp.training.model.LlamaConfig`)."""

    #: tokens of the synthetic vocabulary
    vocab_size: int = 64
    hidden_size: int = 32
    num_layers: int = 2
    #: query heads (a Ulysses method needs them, and the KV heads, divisible by its degree)
    num_heads: int = 4
    num_kv_heads: int = 2
    #: SwiGLU width
    intermediate_size: int = 64


@dataclass
class TrainConfig(ExperimentConfig):
    """``flashcp-train`` (conf/train.yaml, :func:`experiments.train.run_train`): ``steps`` CP
    training steps of a small Llama-style model on sampled packed sequences."""

    name: str = "train"
    #: the dataset the documents' lengths are sampled from (conf/dataset/), as flashcp-run
    #: samples it (flashcp.data.sample_dataset; dataset=file dataset.path=lengths.txt, ...)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    #: the CP method (conf/method/: any registered method, method.options its planner's options)
    method: MethodConfig = field(default_factory=MethodConfig)
    #: N, ranks of a CP group: torchrun's world size, or a divisor of it (data parallel over the
    #: world / N groups); 1 without torchrun
    cp_size: int = 1
    #: C, tokens per packed sequence (one per CP group and step)
    context_len: int = 2048
    #: optimizer steps (each on world / cp_size new sequences)
    steps: int = 10
    #: seed of the sampler, the tokens and the model's initialisation
    seed: int = 0
    #: AdamW learning rate
    lr: float = 1e-3
    #: parameter dtype: float32 | float64
    dtype: str = "float32"
    llama: LlamaSizes = field(default_factory=LlamaSizes)
    #: the ops' kernel backend: auto | cpu | reference (float64 end to end) | flash (CUDA)
    attn_backend: str = "auto"
    #: seconds each collective may take before the run fails
    timeout_s: float = 300.0
    #: a tqdm bar of the steps on rank 0 while a terminal watches
    progress: bool = True


def _world_size() -> int:
    """torchrun's world size (``WORLD_SIZE``), 1 without torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_train_config(cfg: Any) -> None:
    """Check a :class:`TrainConfig` before any process group or collective: the checks every
    experiment gets, ``cp_size`` against torchrun's world size, ``steps``, ``lr``, ``dtype``, the
    model's sizes, the method (registered, its options, ``method.impl=ours``, the heads its
    Ulysses degree needs) and the dataset.

    Raises:
        ValueError: naming the bad value.
    """
    from flashcp.config import (
        check_dataset_config,
        check_impl_config,
        check_method_heads,
        check_method_options,
    )
    from flashcp.registry import method_names
    from flashcp.training.model import LlamaConfig

    at_least(cfg, "cp_size", 1)
    world = _world_size()
    if world % int(cfg.cp_size):
        how = (
            "torchrun --nproc-per-node" if "WORLD_SIZE" in os.environ else "no torchrun: 1 process"
        )
        raise ValueError(
            f"cp_size = {cfg.cp_size} must be the world size ({world}, {how}) or a divisor of it "
            "(CP groups of cp_size ranks, data parallel over the rest)"
        )
    check_experiment_config(cfg)
    at_least(cfg, "steps", 1)
    at_least(cfg, "lr", 0.0, strict=True)
    at_least(cfg, "timeout_s", 0.0, strict=True)
    if cfg.dtype not in ("float32", "float64"):
        raise ValueError(f"dtype must be float32 or float64, got {cfg.dtype!r}")
    LlamaConfig(**OmegaConf.to_container(cfg.llama))
    name = str(cfg.method.name)
    if name not in method_names():
        raise ValueError(f"unknown method {name!r}; registered: {', '.join(method_names())}")
    check_impl_config(name, str(cfg.method.impl), "dist")
    trial = check_method_options(name, cfg.method.options, int(cfg.context_len), int(cfg.cp_size))
    check_method_heads(
        name, cfg.method.options, int(cfg.cp_size), int(cfg.llama.num_heads),
        int(cfg.llama.num_kv_heads), trial,
    )  # fmt: skip
    check_dataset_config(cfg.dataset, int(cfg.context_len))


def synthetic_tokens(doc_lens, context_len: int, vocab_size: int, rng: np.random.Generator):
    """Tokens of one packed sequence: document d is ``(t0_d + i s_d) mod V`` for i < its length,
    ``t0_d`` in [0, V) and ``s_d`` in [1, V) drawn from ``rng``; pad (the rest of the context) is 0.

    Args:
        doc_lens: (n_docs,) int >= 0 summing to at most ``context_len``.
    Returns:
        (context_len,) int64 NumPy array.
    """
    lens = np.asarray(doc_lens, dtype=np.int64)
    t0 = rng.integers(0, vocab_size, size=lens.size)
    stride = rng.integers(1, max(vocab_size, 2), size=lens.size)
    starts = np.cumsum(lens) - lens
    i = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(starts, lens)
    ids = (np.repeat(t0, lens) + i * np.repeat(stride, lens)) % vocab_size
    return np.concatenate([ids, np.zeros(context_len - ids.size, dtype=np.int64)])


def _groups(world: int, cp_size: int, rank: int):
    """This rank's CP group (``cp_size`` consecutive ranks) and DP group (the ranks at its place
    in every CP group): None for the whole world; every rank makes every group, as torch asks."""
    import torch.distributed as dist

    dp_size = world // cp_size
    if dp_size == 1:
        return None, None
    cp = dp = None
    for g in range(dp_size):
        ranks = list(range(g * cp_size, (g + 1) * cp_size))
        pg = dist.new_group(ranks)
        cp = pg if rank in ranks else cp
    for j in range(cp_size):
        ranks = list(range(j, world, cp_size))
        pg = dist.new_group(ranks)
        dp = pg if rank in ranks else dp
    return cp, dp


def run_train(cfg: DictConfig) -> Path:
    """Run the steps of a :class:`TrainConfig` on this process's rank; rank 0 writes
    ``<results_dir>/<name>/train_rows.csv`` and returns its path (the other ranks return it too).

    Raises:
        ValueError: a bad value (:func:`check_train_config`), on every rank before any collective.
        flashcp.ops.collectives.PlanningFailed: the planner raised (on every rank of the group).
    """
    import pandas as pd
    import torch
    import torch.distributed as dist

    from flashcp.data import overlong_note, sample_dataset
    from flashcp.executors.dist import init_from_env
    from flashcp.executors.progress import progress_bar
    from flashcp.ops.collectives import plan_on_one_rank
    from flashcp.registry import make_plan_for
    from flashcp.results import config_hash, provenance, write_csv_atomic
    from flashcp.training import CPAttention, allreduce_grads, cp_cross_entropy, shard_batch
    from flashcp.training.model import LlamaConfig, TinyLlama

    check_train_config(cfg)
    opts = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    ds, method = opts["dataset"], opts["method"]
    c, n, steps = int(cfg.context_len), int(cfg.cp_size), int(cfg.steps)
    world = _world_size()
    dp_size = world // n
    # sampled (and tokens drawn) the same on every rank: no broadcast of the data
    seqs, counts = sample_dataset(
        ds["name"], steps * dp_size, c, seed=int(cfg.seed), weighting=ds["weighting"],
        cap=ds["cap"], overlong=ds["overlong"], path=ds["path"],
    )  # fmt: skip
    note = overlong_note(counts, ds["overlong"], c, str(ds["name"]))
    if note and os.environ.get("RANK", "0") == "0":
        log.info(note)

    init_from_env(timeout_s=float(cfg.timeout_s))
    rank = dist.get_rank()
    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    )
    device = device or torch.device("cpu")
    cp, dp = _groups(world, n, rank)
    groups = [cp] if dp is None else [cp, dp]
    replica = rank // n

    dtype = getattr(torch, str(cfg.dtype))
    model = TinyLlama(LlamaConfig(**opts["llama"]), seed=int(cfg.seed), dtype=dtype).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=float(cfg.lr))
    method_opts = dict(method["options"] or {})
    vocab = int(cfg.llama.vocab_size)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    label = f"train {method['name']} CP {n}" if cfg.progress and rank == 0 else None
    rows = []
    with progress_bar(steps, label, unit="step") as bar:
        for step in range(steps):
            idx = step * dp_size + replica
            lens = seqs[idx]
            rng = np.random.default_rng([int(cfg.seed), idx])
            ids = torch.from_numpy(synthetic_tokens(lens, c, vocab, rng)).to(device)
            num_pad = c - int(lens.sum())
            t: dict[str, float] = {}
            sync()
            t_start = time.perf_counter()

            def planner(lens=lens, num_pad=num_pad, t=t):
                t0 = time.perf_counter()
                plan = make_plan_for(method["name"], lens, n, num_pad=num_pad, **method_opts)
                t["plan"] = time.perf_counter() - t0
                return plan

            plan = plan_on_one_rank(planner, cp)
            t.setdefault("plan", 0.0)  # planned on another rank of the group
            t["plan_bcast"] = time.perf_counter() - t_start - t["plan"]
            t0 = time.perf_counter()
            batch = shard_batch(ids, lens, plan, dist.get_rank(cp))
            t["shard"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            attn = CPAttention(batch, cp, backend=str(cfg.attn_backend))
            logits = model(batch.input_ids, batch.positions, attn)
            loss = cp_cross_entropy(logits, batch.labels, groups)
            sync()
            t["forward"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            opt.zero_grad()
            loss.backward()
            sync()
            t["backward"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            allreduce_grads(model, groups)
            sync()
            t["allreduce"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            opt.step()
            sync()
            t["optimizer"] = time.perf_counter() - t0
            t["step"] = time.perf_counter() - t_start
            # outside the timed step: the loss and valid tokens summed, the phases' max
            valid = torch.tensor(batch.num_valid, dtype=torch.float64, device=device)
            total = torch.stack([loss.detach().double(), valid])
            times = torch.tensor([t[p] for p in PHASES], dtype=torch.float64, device=device)
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            ms = {f"{p}_ms": 1e3 * float(v) for p, v in zip(PHASES, times.tolist(), strict=True)}
            step_lens = [seqs[step * dp_size + r] for r in range(dp_size)]
            rows.append({
                "step": step + 1,
                "seq_idx": " ".join(str(step * dp_size + r) for r in range(dp_size)),
                "num_docs": sum(int((x > 0).sum()) for x in step_lens),
                "max_doc_len": max(int(x.max(initial=0)) for x in step_lens),
                "tokens": c * dp_size, "valid_tokens": int(total[1]),
                "loss": float(total[0]), "tokens_per_s": c * dp_size / (ms["step_ms"] / 1e3),
                **ms,
            })  # fmt: skip
            bar.update(1)

    out = Path(str(cfg.results_dir)) / str(cfg.name) / "train_rows.csv"
    if rank == 0:
        prov = provenance()
        setup = {
            "name": str(cfg.name), "dataset": str(ds["name"]),
            "dataset_path": "-" if ds["path"] is None else str(ds["path"]),
            "weighting": str(ds["weighting"]),
            "dataset_cap": 4 * c if ds["cap"] is None else int(ds["cap"]),
            "overlong": str(ds["overlong"]), "method": str(method["name"]),
            "method_options": json.dumps(method_opts, sort_keys=True), "cp_size": n,
            "dp_size": dp_size, "world_size": world, "context_len": c, "steps": steps,
            "seed": int(cfg.seed), "lr": float(cfg.lr), "dtype": str(cfg.dtype),
            **{k: int(v) for k, v in opts["llama"].items()},
            "device": device.type, "dist_backend": dist.get_backend(),
            "attn_backend": str(cfg.attn_backend),
            **{k: prov[k] for k in ("git_commit", "git_dirty", "flashcp_version",
                                    "torch_version", "code_version")},
            "config_hash": config_hash({
                k: v for k, v in opts.items() if k not in ("name", "results_dir", "run_key", "progress")
            }),
        }  # fmt: skip
        df = pd.DataFrame([{**setup, **r} for r in rows], columns=list(TRAIN_ROW_SCHEMA))
        write_csv_atomic(df, out)
        last = rows[-1]
        log.info(
            "%d steps: loss %.4f -> %.4f, %.0f tokens/s (last step)",
            steps, rows[0]["loss"], last["loss"], last["tokens_per_s"],
        )  # fmt: skip
    return out


register_experiment("train", TrainConfig)
# a bad value is refused before the job starts (no folder written, no process group made)
register_value_check(PROG, check_train_config)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> dict[str, Any]:
    """Hydra app of ``flashcp-train`` (conf/train.yaml, :class:`TrainConfig`): the steps into
    ``<results_dir>/<name>/train_rows.csv``; returns the job's record
    (:func:`experiments.common.entry.run_experiment`)."""
    return run_experiment(cfg, run_train)  # run_train checks every field first


def cli(argv: list[str] | None = None) -> None:
    """Console entry point ``flashcp-train``: :func:`main` with readable errors and clean
    Ctrl-C (:func:`experiments.common.launch.launch`)."""
    launch(main, PROG, argv)


if __name__ == "__main__":
    cli()
