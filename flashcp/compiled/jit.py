"""How the numba kernels compile and where they are cached (:mod:`flashcp.compiled` has the
policy of when they load): :func:`njit`, the kernel modules' decorator, and the cache folder keyed
on every kernel module's source (:func:`cache_folder`, :func:`marker`). The kernel modules import
this module and nothing else of the loader, so the loader can import them by name without a
circle.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import logging
import os
import sys
import tempfile
from pathlib import Path

__all__ = [
    "KERNEL_MODULES",
    "cache_folder",
    "marker",
    "njit",
    "numba_available",
    "numba_versions",
    "say_once",
]

log = logging.getLogger("flashcp.compiled")

#: modules of kernels, by the name callers ask for (:func:`flashcp.compiled.load`; only these may
#: use :func:`njit`)
KERNEL_MODULES = {
    "plan": "flashcp.plan.kernels",
    "heuristic": "flashcp.planners.flashcp.compiled",
    "refined": "flashcp.planners.flashcp_refined.compiled",
    "price": "flashcp.sim.cost.kernels",
    "ring": "flashcp.ops.ring_kernels",
}
#: the sources the cache key hashes: every kernel module and this one (it sets how they compile)
_KEYED = (*sorted(KERNEL_MODULES.values()), __name__)


@functools.cache
def numba_available() -> bool:
    """True when numba can be imported."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def _source(module: str) -> Path:
    """The source file of ``module`` (one of :data:`_KEYED`), in the ``flashcp`` package."""
    return _package_root().joinpath(*module.split(".")[1:]).with_suffix(".py")


def _package_root() -> Path:
    """The ``flashcp`` package folder this module is in."""
    return Path(__file__).resolve().parents[1]


def _digest(path: Path) -> str:
    """sha256 of the file's bytes (read again when its size or modification time changes).

    Raises:
        OSError: the file cannot be read.
    """
    st = path.stat()
    return _digest_of(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=64)
def _digest_of(path: Path, mtime_ns: int, size: int) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digests() -> dict[str, str] | None:
    """sha256 of the bytes of every source of :data:`_KEYED`, by module; None when one cannot be
    read (then nothing is cached)."""
    try:
        return {m: _digest(_source(m)) for m in _KEYED}
    except OSError:
        return None


def numba_versions() -> str | None:
    """The versions the compiled code depends on besides the sources; None without numba."""
    try:
        libs = [importlib.metadata.version(p) for p in ("numba", "llvmlite", "numpy")]
    except importlib.metadata.PackageNotFoundError:
        return None
    return "|".join([sys.version, *libs])


def _cache_bases() -> list[Path]:
    """Where a kernels cache folder may go, in order (module docstring)."""
    bases = []
    if os.environ.get("NUMBA_CACHE_DIR"):
        bases.append(Path(os.environ["NUMBA_CACHE_DIR"]) / "flashcp")
    bases.append(_package_root() / "__pycache__")
    user = os.environ.get("XDG_CACHE_HOME")
    if not user:
        try:
            user = str(Path.home() / ".cache")
        except (KeyError, RuntimeError):  # no home directory
            user = None
    if user:
        bases.append(Path(user) / "flashcp")
    return bases


def cache_folder(digests: dict[str, str] | None = None) -> tuple[Path | None, str]:
    """The folder numba caches the kernels in: ``kernels-<key>`` under the first writable folder
    of the module docstring's list, the key a sha256 of the Python, numba, llvmlite and NumPy
    versions and of every kernel module's source (an edit of any recompiles them all).

    Args:
        digests: the sources' hashes to key on (default: read now).
    Returns:
        ``(folder, why)``: the folder, created, and ``""``; or None and why nothing can be
        cached (numba is not installed, a source cannot be read, no folder can be written).
    """
    versions = numba_versions()
    if versions is None:
        return None, "numba is not installed"
    digests = _digests() if digests is None else digests
    if digests is None or set(digests) != set(_KEYED):
        return None, "the kernels' sources cannot be read"
    h = hashlib.sha256(versions.encode())
    for module in _KEYED:
        h.update(f"|{module}|{digests[module]}".encode())
    name = f"kernels-{h.hexdigest()[:16]}"
    bases = _cache_bases()
    for base in bases:
        try:
            (base / name).mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=base / name).close()  # as numba checks a cache folder
        except OSError:
            continue
        return base / name, ""
    return None, f"none of {', '.join(str(b) for b in bases)} can be written"


def marker() -> Path | None:
    """The ready marker of the kernels' cache (``<cache folder>/ready``), or None where nothing can
    be cached (:func:`cache_folder`)."""
    folder, _ = cache_folder()
    return None if folder is None else folder / "ready"


@functools.cache
def say_once(message: str) -> None:
    """Log ``message`` as a warning, once per process."""
    log.warning(message)


@functools.cache
def _compile_cache() -> tuple[Path | None, dict[str, str]]:
    """This process's kernels cache folder and the source hashes it is keyed on, fixed at the first
    kernel defined (:func:`njit`); None where nothing can be cached (said once)."""
    digests = _digests() or {}
    folder, why = cache_folder(digests)
    if folder is None:
        say_once(
            f"flashcp: the compiled kernels cannot be cached ({why}); they are compiled in "
            "this process (the same plans; NUMBA_CACHE_DIR=<a writable folder> caches them)"
        )
    return folder, digests


def njit(**options):
    """``numba.njit`` for the kernel modules (``from flashcp.compiled.jit import njit``): with
    ``cache=True`` the compiled code is cached in :func:`cache_folder`, keyed on every kernel
    module's source, instead of beside its own file (keyed on that file alone, numba would load a
    kernel compiled with another module's old kernels); where nothing can be cached, or the
    function's source changed since the key was taken, it is compiled in this process only.

    Args:
        options: numba.njit's (``cache``, ``inline``).
    Raises:
        ValueError: a function outside the modules of :data:`KERNEL_MODULES` (the key would miss it).
    """
    import numba
    from numba.core.caching import NullCache

    cache = options.pop("cache", False)

    def decorate(fn):
        if fn.__module__ not in KERNEL_MODULES.values():
            raise ValueError(
                f"{fn.__module__}.{fn.__qualname__}: flashcp.compiled.jit.njit keys its cache on the "
                f"modules {sorted(KERNEL_MODULES.values())} only; add the module there"
            )
        kernel = numba.njit(**options)(fn)
        if not cache or not hasattr(kernel, "enable_caching"):  # NUMBA_DISABLE_JIT: fn itself
            return kernel
        folder, digests = _compile_cache()
        try:
            now = _digest(Path(inspect.getfile(fn)))
        except OSError:
            now = None
        if folder is None or now != digests.get(fn.__module__):
            return kernel
        old = numba.config.CACHE_DIR
        numba.config.CACHE_DIR = str(folder)  # numba's NUMBA_CACHE_DIR locator, for this kernel
        try:
            kernel.enable_caching()
        except RuntimeError:  # no locator: compile in this process (the dispatcher's own default)
            kernel._cache = NullCache()
        finally:
            numba.config.CACHE_DIR = old
        path = kernel.stats.cache_path
        if path is None or Path(path).parent != folder:  # numba fell back to an unkeyed folder
            kernel._cache = NullCache()
        return kernel

    return decorate
