"""The device launcher a scenario's `devices.launcher` names: OS processes on this machine
(emulator/processes.py) or Ray actors on a cluster (emulator/ray_launcher.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from flt.emulator.processes import DeviceFleet


def make_fleet(devices: dict, endpoint: str, log_dir: Path, enroll: Callable[[str], dict[str, str]]) -> DeviceFleet:
    """The launcher the scenario's `devices.launcher` names: processes here, or Ray actors."""
    if devices["launcher"] == "ray":
        from flt.emulator.ray_launcher import RayFleet  # ray is optional: imported only when asked for

        return RayFleet(endpoint, log_dir, devices["threads"], devices["crash"], enroll, address=devices["ray_address"])
    return DeviceFleet(endpoint, log_dir, devices["threads"], devices["crash"], enroll=enroll, start=devices["start"])
