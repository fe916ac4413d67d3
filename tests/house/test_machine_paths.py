"""No file the harness writes for committing, and no committed file, holds an absolute path of the
machine that made it: Hydra's records (``.hydra/hydra.yaml``, ``multirun.yaml``) are rewritten
when a job and a sweep end (:func:`experiments.common.callbacks.scrub_machine_paths`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("hydra")
from experiments.common.callbacks import scrub_machine_paths

REPO = Path(__file__).resolve().parents[2]
#: the keys under which Hydra records absolute paths
HYDRA_ABS = re.compile(r"^\s*-?\s*(cwd|output_dir|path): /", re.MULTILINE)


def test_scrub_rewrites_the_machine_paths_only(tmp_path):
    rec = tmp_path / "hydra.yaml"
    home = str(Path.home())
    rec.write_text(
        f"  runtime:\n    cwd: {tmp_path}\n    config_sources:\n"
        f"    - path: {REPO / 'conf'}\n      schema: file\n"
        f"    output_dir: {tmp_path}/results/x/runs/a-1\n"
        f"  sweep:\n    dir: {home}/elsewhere\n  job:\n    name: run\n"
        f"    other: {tmp_path}x/not-under-cwd\n"
    )
    assert scrub_machine_paths(rec, cwd=tmp_path)
    text = rec.read_text()
    assert "cwd: .\n" in text
    assert "- path: <flashcp>/conf\n" in text
    assert "output_dir: results/x/runs/a-1\n" in text
    assert "dir: ~/elsewhere\n" in text
    assert "name: run\n" in text
    # a sibling whose name only starts like the working directory is not under it
    assert f"other: {tmp_path}x/not-under-cwd" in text
    assert not scrub_machine_paths(rec, cwd=tmp_path)  # nothing left to do
    assert not scrub_machine_paths(tmp_path / "missing.yaml")


@pytest.mark.slow  # a whole flashcp-run sweep in a subprocess (the app tier's kind of test);
# test_scrub_rewrites_the_machine_paths_only covers the scrub in the fast loop
def test_a_sweep_run_from_elsewhere_records_no_machine_path(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [
            sys.executable, "-m", "experiments.run", "-m", "method=llama3,per_doc", "cp_size=2",
            "num_sequences=1", "context_len=4096", "name=p", "results_dir=out", "progress=false",
        ],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [tmp_path / "out/p/multirun.yaml", *tmp_path.glob("out/p/runs/*/.hydra/hydra.yaml")]
    assert len(records) == 3 and all(r.is_file() for r in records)
    for rec in records:
        text = rec.read_text()
        for root in {str(tmp_path), str(tmp_path.resolve()), str(REPO), str(Path.home())}:
            assert root not in text, (rec, root)
        assert not HYDRA_ABS.search(text), rec
        assert "cwd: .\n" in text


def test_no_committed_file_holds_a_machine_path():
    try:
        files = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
        ).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    roots = {str(REPO), str(Path.home())} - {"/"}
    bad = []
    for name in filter(None, files):
        path = REPO / name.decode()
        if path.suffix in (".png", ".parquet", ".npy") or not path.is_file():
            continue  # binary
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if any(root in text for root in roots) or (
            path.suffix == ".yaml" and HYDRA_ABS.search(text)
        ):
            bad.append(name.decode())
    assert not bad, bad
