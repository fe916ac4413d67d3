"""Where the harness finds the files it ships next to its code.

The repository keeps them at the top level (the README's layout): the Hydra configs in ``conf/``, the
document-length tables in ``datasets/``, and the simulator's fitted constants in
``results/calibration/fitted_constants.yaml``. A wheel (``pip install .``) carries copies of them
inside the package, under ``flashcp/_data/`` (the build's ``force-include`` in ``pyproject.toml``),
read here with :mod:`importlib.resources`.

A source checkout (an editable install, or the repository on ``PYTHONPATH``) uses its own top-level
files, so an edit to ``conf/`` or a new calibration takes effect at once; an installed wheel uses
its packaged copies. Outputs never go to either place: they go under ``results_dir`` (relative to
the current directory).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["RESOURCES", "resource_path", "source_root"]

#: name -> path relative to the repository root (and, in a wheel, to ``flashcp/_data/``)
RESOURCES: dict[str, str] = {
    "conf": "conf",
    "datasets": "datasets",
    "fitted_constants": "results/calibration/fitted_constants.yaml",
}


def source_root() -> Path | None:
    """The repository checkout this package is imported from, or None for an installed wheel.

    A checkout is recognised by ``pyproject.toml`` and ``conf/`` next to the ``flashcp`` package.
    """
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "conf").is_dir() else None


def resource_path(name: str) -> Path:
    """Filesystem path of the shipped resource ``name`` (a key of :data:`RESOURCES`).

    Returns:
        ``<checkout>/<RESOURCES[name]>`` in a source checkout, else the packaged copy
        ``flashcp/_data/<RESOURCES[name]>``. The path may not exist (e.g. fitted constants not yet
        computed); callers say what to run.
    Raises:
        ValueError: ``name`` is not a key of :data:`RESOURCES`, or the package is installed in a
            form without files on disk (a zip), which Hydra cannot read configs from.
    """
    if name not in RESOURCES:
        raise ValueError(f"unknown resource {name!r}; choose one of {', '.join(RESOURCES)}")
    root = source_root()
    if root is not None:
        return root / RESOURCES[name]
    packaged = resources.files("flashcp").joinpath("_data", *RESOURCES[name].split("/"))
    if not isinstance(packaged, Path):
        raise ValueError(
            f"flashcp is installed without files on disk ({packaged}); install it unzipped "
            "(pip install .)"
        )
    return packaged
