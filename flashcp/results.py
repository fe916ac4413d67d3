"""Result-row schema shared by every executor (sim, dist, emulate).

One row per (run, sequence, mode); units are in the column names. Executors fill
:data:`PHASE_COLUMNS` and :data:`COMM_COLUMNS`; the harness adds plan metrics and provenance.
"""

from __future__ import annotations

__all__ = ["COMM_COLUMNS", "PHASE_COLUMNS", "config_hash", "provenance", "write_csv_atomic"]

#: latency breakdown of one attention layer's CP step, milliseconds (slowest rank per phase).
#: ``others_ms`` holds data copies (gathering/scattering KV pieces), LSE merges and launch overheads.
PHASE_COLUMNS: tuple[str, ...] = (
    "allgather_ms",
    "attn_fwd_ms",
    "attn_bwd_ms",
    "reducescatter_ms",
    "p2p_ms",
    "others_ms",
    "total_ms",
)

#: bytes one rank receives in the step (see :func:`flashcp.comm.comm_volume`).
COMM_COLUMNS: tuple[str, ...] = ("allgather_bytes", "reducescatter_bytes", "p2p_bytes", "comm_bytes")


def provenance(repo_dir: str | None = None) -> dict[str, object]:
    """Where a row comes from: git commit and dirty flag of the harness (tracked files outside
    ``results/`` differ from the commit), package versions.

    Versions are read from installed package metadata (torch is not imported). Missing git gives
    ``git_commit = "unknown"``.
    """
    import subprocess
    from importlib import metadata
    from pathlib import Path

    root = Path(repo_dir) if repo_dir else Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "not installed"

    commit = git("rev-parse", "HEAD")
    # results/ is the output, not the code: rewriting it does not make the harness dirty
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results")
    return {
        "git_commit": commit or "unknown",
        "git_dirty": bool(status) if status is not None else None,
        "flashcp_version": version("flashcp"),
        "torch_version": version("torch"),
    }


def config_hash(cfg_dict: dict) -> str:
    """sha256 (first 12 hex digits) of a resolved config as canonical JSON."""
    import hashlib
    import json

    blob = json.dumps(cfg_dict, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def write_csv_atomic(df, path) -> None:
    """Write a pandas DataFrame to ``path`` through a temporary file and an atomic rename, so an
    interrupted run never leaves a half-written CSV where a finished one is expected."""
    import os
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    df.to_csv(tmp, index=False)
    os.replace(tmp, path)
