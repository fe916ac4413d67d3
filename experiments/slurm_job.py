"""The Slurm job script of a multi-node ``executor=dist`` run, for a person to read and ``sbatch``.

    python -m experiments.slurm_job --nodes 2 --gpus-per-node 8 --partition gpu \\
        --out dist_h100.sbatch -- -m method=llama3,per_doc,flashcp dataset=pile num_sequences=20 \\
        name=dist_h100
    sbatch dist_h100.sbatch

The script asks Slurm for ``--nodes`` nodes with one task each (``--ntasks-per-node=1``) and
``--gpus-per-node`` GPUs; ``srun`` starts one ``torchrun`` per node, ``--nproc-per-node`` =
GPUs per node, which meet at a c10d rendezvous on the first node of the allocation
(``scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1``; the job id as the rendezvous
id), as in PyTorch's "torchrun (Elastic Launch)" documentation. Every torchrun runs
``python -m experiments.run executor=dist cp_size=<nodes x GPUs per node> nodes=<nodes>`` with
the given overrides: one CP group over the whole allocation, CP ranks node by node
(``placement=consecutive``, docs/multinode.md), rows written by rank 0 under ``results_dir``.
The run checks ``nodes`` against where torchrun put the ranks before any collective.

``hydra/launcher=slurm_dist`` (docs/sweeps.md, "Launchers") submits through submitit instead,
one task per GPU; this script is the plain ``sbatch`` route, with nothing between Slurm and
torchrun.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

__all__ = ["job_script", "main"]

#: keys the script sets from its options; an override of one is refused
_OWN_KEYS = ("executor", "cp_size", "nodes", "placement")


def job_script(
    overrides: list[str],
    *,
    nodes: int,
    gpus_per_node: int,
    partition: str | None = None,
    time_min: int = 120,
    cpus_per_gpu: int = 8,
    job_name: str = "flashcp-dist",
    port: int = 29500,
    python: str = "python",
    setup: tuple[str, ...] = (),
) -> str:
    """The text of the sbatch script (module docstring) for ``experiments.run overrides``.

    Args:
        overrides: ``experiments.run`` arguments (``-m`` and overrides), each one word as the
            shell would pass it; quoted in the script.
        nodes: Slurm nodes (``#SBATCH --nodes``), each one torchrun; gpus_per_node: GPUs and
            ranks per node (``--gpus-per-node``, ``--nproc-per-node``).
        partition: ``#SBATCH --partition`` (None: the cluster's default); time_min: the time
            limit, minutes; cpus_per_gpu: CPU cores per rank (``--cpus-per-task`` =
            ``cpus_per_gpu x gpus_per_node``, ``OMP_NUM_THREADS``); job_name: ``--job-name``.
        port: the rendezvous port on the first node; python: the interpreter on the nodes;
            setup: shell lines run before srun (e.g. ``source .venv/bin/activate``).
    Returns:
        the script, ending in a newline.
    Raises:
        ValueError: (one line) a count below 1, a port outside 1..65535, or an override of a
            key the script sets (``executor``, ``cp_size``, ``nodes``, ``placement``).
    """
    for name, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node),
                        ("time_min", time_min), ("cpus_per_gpu", cpus_per_gpu)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port must be in 1..65535, got {port!r}")
    for ov in overrides:  # executor options (executor.backend=...) are the user's
        if "=" in ov and ov.split("=", 1)[0].lstrip("+~") in _OWN_KEYS:
            raise ValueError(
                f"{ov}: the job script sets {', '.join(_OWN_KEYS)} from --nodes and "
                "--gpus-per-node; drop it"
            )
    n = nodes * gpus_per_node
    run = [python, "-m", "experiments.run", *overrides, "executor=dist", f"cp_size={n}",
           f"nodes={nodes}", "placement=consecutive"]  # fmt: skip
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        f"#SBATCH --cpus-per-task={cpus_per_gpu * gpus_per_node}",
        f"#SBATCH --time={time_min}",
        *([f"#SBATCH --partition={partition}"] if partition else []),
        "#SBATCH --output=%x-%j.out",
        "set -euo pipefail",
        *setup,
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"export OMP_NUM_THREADS={cpus_per_gpu}",
        "srun --kill-on-bad-exit=1 "
        + shlex.join([python, "-m", "torch.distributed.run"])
        + ' --nnodes "$SLURM_NNODES"'
        + f" --nproc-per-node {gpus_per_node}"
        + ' --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d'
        + f' --rdzv-endpoint "$head_node:{port}" \\',
        "    " + shlex.join(run[1:]),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments.slurm_job``: write (or print) the job script; exit 2 with one line
    on a bad option."""
    ap = argparse.ArgumentParser(
        prog="python -m experiments.slurm_job",
        description="Write the sbatch script of a multi-node executor=dist run "
        "(experiments.run overrides after --).",
    )
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--partition", default=None)
    ap.add_argument("--time-min", type=int, default=120)
    ap.add_argument("--cpus-per-gpu", type=int, default=8)
    ap.add_argument("--job-name", default="flashcp-dist")
    ap.add_argument("--port", type=int, default=29500, help="rendezvous port on the first node")
    ap.add_argument("--python", default="python", help="the interpreter on the nodes")
    ap.add_argument("--setup", action="append", default=[], help="a shell line before srun")
    ap.add_argument("--out", default=None, help="the script file (default: print it)")
    ap.add_argument("overrides", nargs="*", help="experiments.run arguments, after --")
    args = ap.parse_args(argv)
    try:
        text = job_script(
            args.overrides, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
            partition=args.partition, time_min=args.time_min, cpus_per_gpu=args.cpus_per_gpu,
            job_name=args.job_name, port=args.port, python=args.python, setup=tuple(args.setup),
        )  # fmt: skip
    except ValueError as exc:
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return 2
    if args.out is None:
        sys.stdout.write(text)
        return 0
    Path(args.out).write_text(text)
    print(f"wrote {args.out}; submit it with: sbatch {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
