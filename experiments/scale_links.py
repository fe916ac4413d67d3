"""Bytes per link class of every method of ``experiment=scale`` (docs/scale.md): which of a
rank's KV bytes cross nodes and which stay on NVLink, beside each plan's imbalance.

    python -m experiments.scale_links results/scale        # writes links.csv and links.md there

Reads the experiment's ``summary.csv`` for its grid (datasets, context lengths, CP sizes,
placements, node counts, methods, sequences, seed, the model's heads), samples the same sequences
(:func:`flashcp.data.sample_dataset`, ``flashcp-run``'s sampler and defaults), plans them with each
method (``flashcp_node`` for the run's topology, as conf/method/flashcp_node.yaml passes it) and
accounts each plan's bytes by link class: :func:`flashcp.comm.comm_volume_by_link` for the
methods' own ops, :func:`flashcp.comm.node_scoped_volume_by_link` for ``flashcp_node``'s
two-scope gather. Per (dataset, context, cp_size, placement, method) and mode: the mean over
sequences of the largest rank's ``inter`` and ``intra`` bytes (MiB per attention layer and
step), and the mean imbalance ratio. The byte account needs no constant of the simulator.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from flashcp.comm import AttnShape, max_rank_link_bytes
from flashcp.data import sample_dataset
from flashcp.registry import COMM_KIND, make_plan_for, option_names
from flashcp.results import markdown_table
from flashcp.sim import load_hardware
from flashcp.sim.network import topology_for

__all__ = ["link_table", "main"]

MIB = 2.0**20


def _bytes(plan, method: str, shape: AttnShape, mode: str, topo) -> tuple[float, float]:
    """The largest rank's (inter, intra) bytes of ``plan`` in ``mode``."""
    inter, intra = max_rank_link_bytes(plan, COMM_KIND[method], shape, mode, topo)
    return float(inter), float(intra)


def link_table(summary: pd.DataFrame, hardware: str = "h100_sxm") -> pd.DataFrame:
    """Bytes per link class and imbalance for every (dataset, context, CP size, placement,
    method) of ``summary`` (module docstring); one row per mode.

    Raises:
        ValueError: a summary mixing several heads, seeds or sequence counts.
    """
    for col in ("num_heads", "num_kv_heads", "head_dim", "dtype", "seed", "num_sequences"):
        if summary[col].nunique() > 1:
            raise ValueError(f"the summary mixes several {col}; one link table per value")
    first = summary.iloc[0]
    shape = AttnShape(int(first["num_heads"]), int(first["num_kv_heads"]),
                      int(first["head_dim"]), str(first["dtype"]))  # fmt: skip
    hw = load_hardware(hardware)
    k, seed = int(first["num_sequences"]), int(first["seed"])
    modes = sorted(set(summary["mode"]))
    rows = []
    keys = ["dataset", "context_len", "cp_size", "placement", "nodes"]
    for (ds, ctx, n, place, nodes), sub in summary.groupby(keys, sort=True):
        seqs, _ = sample_dataset(str(ds), k, int(ctx), seed=seed)
        topo = topology_for(hw, int(n), str(place), int(nodes))
        for method in sorted(set(sub["method"])):
            opts = {}
            if "num_nodes" in option_names(method):
                opts = {"num_nodes": int(nodes), "placement": str(place),
                        "gpus_per_node": hw.gpus_per_node}  # fmt: skip
            plans = [make_plan_for(method, d, int(n), **opts) for d in seqs]
            for mode in modes:
                b = np.array([_bytes(p, method, shape, mode, topo) for p in plans])
                rows.append({
                    "dataset": ds, "context_len": int(ctx), "cp_size": int(n),
                    "placement": place, "nodes": int(nodes), "method": method, "mode": mode,
                    "inter_mib_max_rank": b[:, 0].mean() / MIB,
                    "intra_mib_max_rank": b[:, 1].mean() / MIB,
                    "imbalance_ratio": float(np.mean([p.imbalance_ratio for p in plans])),
                    "num_sequences": k,
                })  # fmt: skip
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> None:
    """``python -m experiments.scale_links DIR``: write DIR/links.csv and DIR/links.md."""
    ap = argparse.ArgumentParser(prog="python -m experiments.scale_links", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("exp_dir", help="the experiment's folder (its summary.csv)")
    ap.add_argument("--hardware", default="h100_sxm", help="profile whose nodes place the ranks")
    args = ap.parse_args(argv)
    exp = Path(args.exp_dir)
    try:
        summary = pd.read_csv(exp / "summary.csv")
        table = link_table(summary, args.hardware)
    except (OSError, ValueError) as exc:
        sys.exit(f"error: {exc}")
    table.to_csv(exp / "links.csv", index=False)
    train = table[table["mode"] == table["mode"].iloc[0]].drop(columns=["num_sequences"])
    (exp / "links.md").write_text(markdown_table(train, ".2f"))
    print(exp / "links.csv")


if __name__ == "__main__":
    main()
