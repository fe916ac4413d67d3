"""A non-editable install (``pip install .``) runs the default experiment from another directory.

The wheel is built offline (``--no-build-isolation``: the ``dev`` extra provides the build backend)
into a throwaway virtual environment that sees this interpreter's packages (a ``.pth`` file naming
its site-packages; ``--no-deps``), so only the harness itself is installed. The checkout is kept off
the import path (no ``PYTHONPATH``; ``.pth`` files of the parent environment, such as an editable
install's, are not processed), so the run can only use what the wheel carries: configs, length
tables, fitted constants. Also: the README's layout table names what the repository holds.
"""

import os
import site as site_module
import subprocess
import venv
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180


def _run(cmd: list, cwd: Path, env: dict) -> str:
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.slow
def test_wheel_install_runs_default_experiment(tmp_path):
    env_dir, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=work, env=os.environ).strip())  # fmt: skip
    (site / "_parent_env.pth").write_text("\n".join(site_module.getsitepackages()) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    pip = [python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    _run([*pip, REPO], cwd=work, env=env)

    where = _run(
        [python, "-c", "import flashcp, flashcp.resources as r; "
         "print(flashcp.__file__); print(r.source_root()); print(r.resource_path('conf'))"],
        cwd=work, env=env,
    ).split()  # fmt: skip
    assert Path(where[0]).is_relative_to(site), f"imported {where[0]}, not the wheel in {site}"
    assert where[1] == "None"  # not a checkout
    assert Path(where[2]) == site / "flashcp" / "_data" / "conf"

    _run(
        [env_dir / "bin" / "flashcp-run", "num_sequences=2", "context_len=16384", "progress=false"],
        cwd=work, env=env,
    )  # fmt: skip
    runs = list((work / "outputs" / "default" / "runs").glob("*/rows.parquet"))
    assert len(runs) == 1, f"expected one run under {work}/outputs/default/runs, found {runs}"
    rows = pd.read_parquet(runs[0])
    assert len(rows) == 4  # 2 sequences x (train, infer)
    assert (rows["status"] == "ok").all(), rows["status"].tolist()
    assert (rows["total_ms"] > 0).all()
    # provenance of a wheel: no checkout, so no git commit; the package version instead
    assert rows["code_version"].str.startswith("flashcp==").all(), set(rows["code_version"])
    # an experiment with its own entry config (conf/fig3.yaml in the wheel) and console script
    _run([env_dir / "bin" / "flashcp-fig3"], cwd=work, env=env)
    fig3 = work / "outputs" / "fig3"
    assert (fig3 / "fig3.csv").stat().st_size > 0 and (fig3 / "fig3.png").stat().st_size > 0
    assert len(list(fig3.glob("runs/fig3-*/.hydra/config.yaml"))) == 1  # its log and config
    assert not (fig3 / ".sweep.lock").exists()  # the folder is released
    assert not (site / "results").exists() and not (site / "flashcp" / "results").exists()


def test_a_checkout_reads_its_own_files():
    from flashcp.resources import RESOURCES, resource_path, source_root

    assert source_root() == REPO
    for name, rel in RESOURCES.items():
        assert resource_path(name) == REPO / rel and resource_path(name).exists()
    with pytest.raises(ValueError, match="unknown resource 'configs'"):
        resource_path("configs")


def test_readme_lists_the_layout():
    """README's "What is here" names every tracked top-level folder, every module and subpackage
    of flashcp/ (and flashcp/ops/, flashcp/sim/), every kernel backend and every experiments/ script."""
    readme = (REPO / "README.md").read_text()
    start = readme.index("## What is here")
    section = readme[start : readme.index("\n## ", start + 1)]
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, timeout=60
    ).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    names = {p.split("/")[0] + "/" for p in tracked if "/" in p}
    for folder in ("flashcp", "flashcp/ops", "flashcp/sim", "flashcp/ops/backends", "experiments"):
        for p in tracked:
            parent, _, leaf = p.rpartition("/")
            rest = p[len(folder) + 1 :]
            if parent == folder and leaf.endswith(".py") and leaf != "__init__.py":
                names.add(leaf)
            elif p.startswith(folder + "/") and rest.count("/") == 1 and folder == "flashcp":
                names.add(f"flashcp/{rest.split('/')[0]}/")
    missing = sorted(
        n
        for n in names
        if f"`{n}" not in section and f"/{n}`" not in section and f" {n}" not in section
    )
    assert not missing, f'README "What is here" does not name {missing}'
