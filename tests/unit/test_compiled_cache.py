"""Where the compiled kernels are cached (:mod:`flashcp.compiled`): a folder keyed on every kernel
module's source, so an edit of one module's kernel reaches the kernels of the others that call it,
and no cache at all (with one notice, the same plans) where no folder can be written.

The subprocess tests run a copy of the package in a scratch folder, so that they can edit its
kernels or make it read-only without touching this checkout.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from flashcp import compiled
from flashcp.compiled import jit
from flashcp.compiled import warm as compile_cache

pytestmark = pytest.mark.skipif(not compiled.enabled(), reason="numba is not installed")

REPO = Path(__file__).resolve().parents[2]
NOTICE = "the compiled kernels cannot be cached"

#: a kernel appended to both modules: it calls plan_kernels._failed, which heuristic_compiled
#: imports from plan_kernels (as its flashcp_plan does); tiny, so that it compiles in a second
PROBE = "\n\n@njit(cache=True)\ndef probe(status):\n    return _failed(status)\n"
#: what each process prints: per module, the probe's result and its loads from the cache
PROBE_RUN = (
    "import json, sys\n"
    "from flashcp import compiled\n"
    "out = {}\n"
    "for name in sys.argv[1:]:\n"
    "    probe = compiled.load(name).probe\n"
    "    out[name] = [int(probe(3)[1]), sum(probe.stats.cache_hits.values())]\n"
    "print(json.dumps(out))\n"
)


def _copy(dest: Path, *packages: str) -> Path:
    for package in packages:
        shutil.copytree(
            REPO / package, dest / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    return dest


def _env(root: Path, home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME")}
    return {**env, "PYTHONPATH": str(root), "HOME": str(home), **extra}


def _probe(root: Path, home: Path, *names: str) -> dict[str, list[int]]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE_RUN, *names], capture_output=True, text=True, cwd=root,
        env=_env(root, home, FLASHCP_COMPILED="1"), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow  # compiles in two scratch processes
def test_an_edited_kernel_reaches_every_module_that_calls_it(tmp_path):
    """Edit plan_kernels' ``_failed`` (called by a kernel of plan_kernels and one of
    heuristic_compiled) after both were compiled and cached: both give the new result, whichever
    module runs first, and the next process loads both from the cache. (numba alone keys
    heuristic_compiled's cached code on heuristic_compiled.py, which did not change, and kept the
    old ``_failed`` compiled into it.)"""
    root = _copy(tmp_path / "src", "flashcp")
    for module in ("plan/kernels", "planners/flashcp/compiled"):
        with (root / "flashcp" / f"{module}.py").open("a") as f:
            f.write(PROBE)
    home = tmp_path / "home"
    assert _probe(root, home, "plan", "heuristic") == {"plan": [3, 0], "heuristic": [3, 0]}
    assert _probe(root, home, "heuristic", "plan") == {"plan": [3, 1], "heuristic": [3, 1]}
    kernels = root / "flashcp" / "plan" / "kernels.py"
    text = kernels.read_text()
    assert text.count("    out[1] = status\n") == 1
    kernels.write_text(text.replace("    out[1] = status\n", "    out[1] = status + 100\n"))
    got = _probe(root, home, "plan", "heuristic")
    assert {name: value for name, (value, _) in got.items()} == {"plan": 103, "heuristic": 103}
    assert _probe(root, home, "heuristic", "plan") == {"plan": [103, 1], "heuristic": [103, 1]}
    # one keyed folder per version of the sources, nothing cached beside the sources
    folders = sorted((root / "flashcp" / "__pycache__").glob("kernels-*"))
    assert len(folders) == 2 and not list((root / "flashcp" / "__pycache__").glob("*.nbi"))


def _writable(root: Path, writable: bool) -> None:
    """Make everything under ``root`` writable by its owner again, or read-only: a ``__pycache__``
    that is a file in every folder (so that not even root can cache beside the sources) and no
    write permission (for other users)."""
    if not writable:
        for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            (folder / "__pycache__").touch()
    write = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
    for path in [*root.rglob("*"), root]:
        mode = path.stat().st_mode
        path.chmod(mode | stat.S_IWUSR if writable else mode & ~write)


PLAN_ARGS = ["plan", "--cp-size", "4", "--doc-lens", "3000,1000,64,32", "--json"]
#: auto mode: past the warm-up's WARMUP_CALLS requests (the kernels would load), then one plan
AUTO_RUN = (
    "import sys\n"
    "from flashcp.cli import main\n"
    "from flashcp.registry import get_planner\n"
    "for i in range(600):\n"
    "    get_planner(sys.argv[1])([3000, 1000, 64, 32 + i], 4, pad_to_multiple=True)\n"
    "sys.exit(main(['plan', '--method', *sys.argv[1:]]))\n"
)


@pytest.mark.slow
def test_kernels_fall_back_where_no_cache_folder_can_be_written(tmp_path):
    """A read-only install whose home cannot be written either: ``flashcp plan`` exits 0 with the
    plan of a normal run, saying once (one line, no traceback) that the kernels are not cached;
    ``FLASHCP_COMPILED=1`` compiles them in the process, ``auto`` (past its warm-up) plans with
    the references."""
    root = _copy(tmp_path / "ro", "flashcp", "baselines")
    home = tmp_path / "home"
    home.write_text("")  # a file: no ~/.cache under it
    _writable(root, False)
    try:
        for method, mode in (("ring", "1"), ("flashcp", "auto"), ("zigzag", "auto")):
            normal = subprocess.run(
                [sys.executable, "-m", "flashcp", *PLAN_ARGS, "--method", method],
                capture_output=True, text=True, cwd=REPO, timeout=300,
                env={**os.environ, "PYTHONPATH": str(REPO), "FLASHCP_COMPILED": mode},
            )  # fmt: skip
            assert normal.returncode == 0 and not normal.stderr, normal.stderr[-3000:]
            command = ["-m", "flashcp", *PLAN_ARGS, "--method", method]
            if mode == "auto":
                command = ["-c", AUTO_RUN, method, *PLAN_ARGS[1:]]
            proc = subprocess.run(
                [sys.executable, *command], capture_output=True, text=True, cwd=tmp_path,
                env=_env(root, home, FLASHCP_COMPILED=mode), timeout=300,
            )  # fmt: skip
            assert proc.returncode == 0, (method, mode, proc.stderr[-3000:])
            lines = proc.stderr.splitlines()
            assert len(lines) == 1 and NOTICE in lines[0], (method, mode, proc.stderr[-3000:])
            assert json.loads(proc.stdout) == json.loads(normal.stdout), (method, mode)
    finally:
        _writable(root, True)
    assert not [p for p in root.rglob("*") if p.suffix in (".nbi", ".nbc", ".pyc")]


def test_the_cache_key_covers_every_kernel_source(monkeypatch, tmp_path):
    """The cache folder changes with any kernel module's source, and with none of them it is
    this checkout's ``__pycache__`` (then the user's cache, then nothing, with the reason)."""
    digests = jit._digests()
    assert set(digests) == {*jit.KERNEL_MODULES.values(), "flashcp.compiled.jit"}
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    folder, why = jit.cache_folder(digests)
    assert why == "" and folder.parent == REPO / "flashcp" / "__pycache__"
    assert re.fullmatch(r"kernels-[0-9a-f]{16}", folder.name)
    names = {folder.name}
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))  # the folders made below
    assert jit.cache_folder(digests)[0] == tmp_path / "numba" / "flashcp" / folder.name
    for module in digests:
        edited, _ = jit.cache_folder({**digests, module: "0" * 64})
        names.add(edited.name)
    assert len(names) == len(digests) + 1
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(blocked))
    monkeypatch.setattr(jit, "_cache_bases", lambda: [blocked / "a", blocked / "b"])
    assert jit.cache_folder(digests) == (
        None,
        f"none of {blocked / 'a'}, {blocked / 'b'} can be written",
    )
    assert jit.cache_folder({}) == (None, "the kernels' sources cannot be read")


def test_auto_mode_says_once_that_it_runs_the_references(monkeypatch, caplog):
    """``auto`` where nothing can be cached: no background compile, the references (load gives
    None), and one notice however often it looks."""
    monkeypatch.setenv("FLASHCP_COMPILED", "auto")
    monkeypatch.setattr(compiled, "_REQUESTS", iter(range(compiled.WARMUP_CALLS, 10**9)))
    monkeypatch.setattr(
        compiled, "_CACHE", {"ready": False, "since_look": 0, "spawned": False, "skip": False}
    )
    monkeypatch.setattr(jit, "_cache_bases", list)
    monkeypatch.setattr(compiled, "_spawn_warm_up", lambda marker: pytest.fail("spawned"))
    jit.say_once.cache_clear()
    assert compiled.marker() is None
    assert all(compiled.load("plan") is None for _ in range(3 * compiled.RECHECK_CALLS))
    assert not compile_cache.preload()
    notices = [r.getMessage() for r in caplog.records if NOTICE in r.getMessage()]
    assert len(notices) == 1 and "reference code" in notices[0]
    jit.say_once.cache_clear()


def test_only_the_keyed_modules_define_kernels():
    """Every numba kernel of the package goes through :func:`flashcp.compiled.jit.njit` (so its module
    is in the cache key): no other module imports numba's decorators, and ``njit`` refuses a
    function of another module."""
    uses = {
        str(p.relative_to(REPO))
        for p in (REPO / "flashcp").rglob("*.py")
        if re.search(r"^\s*(from numba\b|import numba\b)", p.read_text(), re.M)
    }
    assert uses == {"flashcp/compiled/jit.py"}
    kernels = {
        ".".join(p.relative_to(REPO).with_suffix("").parts)
        for p in (REPO / "flashcp").rglob("*.py")
        if re.search(r"^from flashcp\.compiled\.jit import njit$", p.read_text(), re.M)
    }
    assert kernels == set(jit.KERNEL_MODULES.values())

    def outside(x):
        return x

    with pytest.raises(ValueError, match=re.escape("outside: flashcp.compiled.jit.njit")):
        jit.njit(cache=True)(outside)


def test_prune_removes_only_this_checkouts_older_keys(monkeypatch, tmp_path):
    """``prune``: the other keys' folders (and the old layout's markers) in this checkout's
    ``flashcp/__pycache__`` go; a folder elsewhere (shared) is left alone."""
    own = tmp_path / "flashcp"
    (own / "__pycache__" / "kernels-new").mkdir(parents=True)
    (own / "__pycache__" / "kernels-old" / "flashcp_x").mkdir(parents=True)
    (own / "__pycache__" / "kernels-0123.ready").touch()
    (own / "__pycache__" / "plan.cpython-311.pyc").touch()
    monkeypatch.setattr(jit, "__file__", str(own / "compiled" / "jit.py"))
    shared = tmp_path / "shared"
    (shared / "kernels-old").mkdir(parents=True)
    assert compile_cache.prune(shared / "kernels-new") == []
    removed = compile_cache.prune(own / "__pycache__" / "kernels-new")
    assert [p.name for p in removed] == ["kernels-0123.ready", "kernels-old"]
    assert sorted(p.name for p in (own / "__pycache__").iterdir()) == [
        "kernels-new",
        "plan.cpython-311.pyc",
    ]
    assert (shared / "kernels-old").exists()


def test_every_kernel_is_cached_in_the_keyed_folder():
    """Every kernel of every compiled module (the planners', the plan model's, the pricing's) is
    cached in this process's keyed folder, none beside its source."""
    folder, _ = jit._compile_cache()
    assert folder is not None
    seen = 0
    for module in jit.KERNEL_MODULES.values():
        for name, kernel in vars(importlib.import_module(module)).items():
            if getattr(kernel, "__module__", None) == module and hasattr(kernel, "stats"):
                assert Path(kernel.stats.cache_path).parent == folder, (module, name)
                seen += 1
    assert seen == sum(
        jit._source(m).read_text().count("\n@njit(") for m in jit.KERNEL_MODULES.values()
    )
