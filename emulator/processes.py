"""Starting, watching and stopping the device processes on this machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from flt.scenarios.errors import DeviceError
from flt.server.transport import Transport


class DeviceFleet:
    """Device processes launched with `python -m flt.devices`, one log file each."""

    def __init__(
        self,
        endpoint: str,
        log_dir: Path,
        threads: int = 1,
        crash: dict | None = None,
        enroll: Callable[[str], dict[str, str]] = lambda name: {},
    ):
        self.endpoint, self.log_dir, self.threads = endpoint, log_dir, threads
        self.enroll = enroll  # name -> the credentials (env vars) that alone get that name
        self.crash = crash or {}  # device index -> round at which it dies (fault injection)
        self.procs: dict[str, subprocess.Popen] = {}
        self.retired: dict[str, int | None] = {}
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, n: int, prefix: str = "dev") -> list[str]:
        first = len(self.procs)
        names = [f"{prefix}-{first + i}" for i in range(n)]
        for i, name in enumerate(names):
            self.procs[name] = self.spawn(name, self.crash.get(first + i))
        return names

    def spawn(self, name: str, crash_at_round: int | None = None) -> subprocess.Popen:
        cmd = [
            sys.executable,
            "-m",
            "flt.devices",
            "--connect",
            self.endpoint,
            "--name",
            name,
            "--threads",
            str(self.threads),
            "--parent-pid",
            str(os.getpid()),
        ]
        if crash_at_round is not None:
            cmd += ["--crash-at-round", str(crash_at_round)]
        # secrets by environment (same user only), never on the command line (`ps` shows it)
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), **self.enroll(name)}
        # the child keeps its own copy of the log's descriptor; ours closes when the block ends
        with open(self.log_dir / f"{name}.log", "w") as logf:
            # own process group: Ctrl-C reaches the emulator, which shuts devices down in order
            return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def alive(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is None or proc.poll() is None  # devices started by hand: assume alive

    def wait(self, transport: Transport, timeout_s: float) -> list[str]:
        """Wait for every started device's hello; a device that exits early is named."""
        import time

        deadline = time.monotonic() + timeout_s
        while len(set(transport.devices) & set(self.procs)) < len(self.procs):
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise DeviceError(
                    f"device process {dead[0]} exited with code "
                    f"{self.procs[dead[0]].returncode} before connecting:\n{self.tail(dead[0])}"
                )
            if time.monotonic() > deadline:
                raise DeviceError(f"device processes did not connect within {timeout_s:.0f} s")
            got = transport.recv(0.5)
            if got:
                transport._hello(*got)
        # in start order, not hello order: which device hosts which clients must not race
        return [n for n in self.procs if n in transport.devices]

    def tail(self, name: str, lines: int = 15) -> str:
        text = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, grace_s: float = 5.0) -> None:
        for p in self.procs.values():
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                p.kill()

    def retire(self, name: str, grace_s: float = 10.0) -> None:
        """Wait for a device told to shut down; keep its exit code."""
        proc = self.procs.pop(name)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self.retired[name] = proc.returncode

    def exit_codes(self) -> dict[str, int | None]:
        return {**self.retired, **{n: p.poll() for n, p in self.procs.items()}}


def make_fleet(devices: dict, endpoint: str, log_dir: Path, enroll: Callable[[str], dict[str, str]]) -> DeviceFleet:
    """The launcher the scenario's `devices.launcher` names: processes here, or Ray actors."""
    if devices["launcher"] == "ray":
        from flt.emulator.ray_launcher import RayFleet

        return RayFleet(endpoint, log_dir, devices["threads"], devices["crash"], enroll, address=devices["ray_address"])
    return DeviceFleet(endpoint, log_dir, devices["threads"], devices["crash"], enroll=enroll)
