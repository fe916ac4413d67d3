"""Loaded at interpreter start-up when this folder leads ``PYTHONPATH``
(``tests/device_image/as-device-image``): the interpreter then sees the packages of the lent GPU
machine's image only. Hydra, OmegaConf (and its parser runtime), PuLP, HiGHS, submitit,
flash-attn, ring-flash-attn and numba (so the planners run their reference code) fail to import, and an editable install of this project is taken
off ``sys.path``, so ``python -m ...`` from the checkout's root imports the checkout, uninstalled,
as on that machine."""

import os
import sys

#: top-level packages the GPU machine's image does not have
ABSENT = frozenset(
    {"hydra", "hydra_plugins", "omegaconf", "antlr4", "pulp", "highspy", "submitit",
     "flash_attn", "ring_flash_attn", "numba", "llvmlite"}
)  # fmt: skip


class _Absent:
    """A meta-path finder that refuses :data:`ABSENT` as a missing module."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the GPU machine's image)")
        return None


sys.meta_path.insert(0, _Absent())
_checkout = os.environ.get("FLASHCP_CHECKOUT")
if _checkout:  # the editable install's path entry (the checkout itself) goes; "" (cwd) stays
    sys.path[:] = [p for p in sys.path if not p or os.path.abspath(p) != os.path.abspath(_checkout)]
