"""What a job's command line set, read from Hydra's overrides, for every command: the hardware
constants that win over the fitted ones, and the columns a row carries for its profile.

``flashcp-run`` (:mod:`experiments.run`), ``flashcp-fig3`` and ``flashcp-sensitivity`` load their
``hardware`` profile through :func:`load_job_hardware`, so an explicit ``hardware.<constant>=``
wins in each of them the same way and their rows name the same changes.
"""

from __future__ import annotations

import json
from typing import Any

from flashcp.results import config_hash


def json_text(value: Any) -> str:
    """``value`` as JSON with sorted keys (what a row's JSON columns hold)."""
    return json.dumps(value, sort_keys=True, default=str)


def hardware_changes(hw: dict[str, Any], explicit: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Constants of a composed hardware profile that differ from its file ``conf/hardware/<name>``
    (command-line overrides such as ``hardware.launch_us=10``), plus the ``explicit`` ones
    (:func:`explicit_hardware_keys`) even where equal to it; every constant if no such file.
    These win over the profile's fitted constants (:func:`flashcp.sim.hardware.load_hardware`)."""
    from flashcp.sim.hardware import profile_changes

    changes = profile_changes(hw)
    changes.update({k: hw[k] for k in sorted(explicit) if k in hw and k not in changes})
    return changes


def explicit_keys(group: str) -> list[str]:
    """The keys inside config group ``group`` that the command line sets (``<group>.<key>=...``,
    swept or not; dotted below the group, e.g. ``options.lns``), read from Hydra's overrides of
    this job; empty outside Hydra. A value equal to the option file's is explicit too."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not HydraConfig.initialized():
        return []
    task = list(HydraConfig.get().overrides.task)
    keys = (ov.key_or_group for ov in OverridesParser.create().parse_overrides(task))
    return [k.split(".", 1)[1] for k in keys if k.startswith(f"{group}.")]


def explicit_hardware_keys() -> frozenset[str]:
    """The hardware constants the command line sets (:func:`explicit_keys`): they win over the
    fitted values like any other override, even where equal to the profile file's value."""
    return frozenset(k for k in explicit_keys("hardware") if "." not in k)


def load_job_hardware(hw: dict[str, Any], network: bool = False) -> tuple[Any, dict[str, str]]:
    """A composed profile ``hw`` loaded with this job's explicit constants winning over the
    fitted ones (:func:`flashcp.sim.hardware.load_hardware`, :func:`explicit_hardware_keys`), and
    the columns flashcp-run's rows carry for it: ``hardware``, ``hardware_changes`` (JSON),
    ``hardware_sha256`` (of the constants used; the inter-node ones,
    :data:`flashcp.sim.hardware.NETWORK_KEYS`, when ``network``). For flashcp-fig3 and
    flashcp-sensitivity."""
    from flashcp.sim import load_hardware

    explicit = explicit_hardware_keys()
    loaded = load_hardware(hw, explicit=explicit)
    return loaded, {
        "hardware": loaded.name,
        "hardware_changes": json_text(hardware_changes(hw, explicit)),
        "hardware_sha256": config_hash(loaded.to_dict(network=network)),
    }
