"""Starting, watching and stopping the device processes on this machine.

By default (`devices.start: forkserver`) device processes are forked from one zygote
process that has already imported torch, onnxruntime and the device program: the pages
those imports filled (about 350 MB per process with a CUDA build of torch) are then
shared copy-on-write instead of being filled again by every device (emulator/zygote.py). `exec` starts each
device as a fresh `python -m flt.devices`, as a device on another host is started.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from flt.common.errors import DeviceError
from flt.common.interrupts import deferred_interrupt
from flt.emulator.zygote import Zygote, preload
from flt.server.transport import Transport

START_METHODS = ("forkserver", "exec")
_zygote: Zygote | None = None


def fork_here() -> None:
    """Make this process the template of its devices: import what a device needs, then
    fork the zygote now, before the run starts any thread (the `flt` command calls it
    first thing). Without it, the first fleet spawns a fresh zygote."""
    global _zygote
    if _zygote is None and hasattr(os, "fork"):
        with deferred_interrupt():  # a KeyboardInterrupt inside torch's C++ import aborts the process
            preload()
        _zygote = Zygote.fork_here()
        atexit.register(_zygote.close)


def prepare_zygote(devices: dict) -> None:
    """Start the device zygote now, for a run whose local devices fork from one
    (`devices.start: forkserver`) and that has none yet (the `flt` command forked its own):
    a fresh interpreter then imports torch while the server loads its data."""
    local = devices["launcher"] == "local" and devices["processes"] != 0  # None: one per core
    if local and devices["start"] == "forkserver" and hasattr(os, "fork"):
        zygote()


def zygote() -> Zygote:
    global _zygote
    if _zygote is None or _zygote.ended:
        _zygote = Zygote.spawn()
        atexit.register(_zygote.close)
    return _zygote


class ForkedDevice:
    """A device forked by the zygote, with the part of Popen's interface the fleet uses."""

    def __init__(self, parent: Zygote, pid: int, name: str):
        self.parent, self.pid, self.name = parent, pid, name

    @property
    def returncode(self) -> int | None:
        return self.parent.exit_code(self.pid)

    def poll(self) -> int | None:
        return self.parent.exit_code(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        code = self.parent.exit_code(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"device {self.name}", timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` from /proc (Linux), else None. Ticks of
    1/100 s: only a window of a second or more tells computing from waiting."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name, in parentheses, may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class DeviceFleet:
    """Device processes on this machine, one log file each: forked from the fork server,
    or launched with `python -m flt.devices` (`start`)."""

    def __init__(
        self,
        endpoint: str,
        log_dir: Path,
        threads: int = 1,
        crash: dict | None = None,
        enroll: Callable[[str], dict[str, str]] = lambda name: {},
        start: str = "forkserver",
    ):
        if start not in START_METHODS:
            raise ValueError(f"devices.start must be one of {', '.join(START_METHODS)}, not {start!r}")
        self.endpoint, self.log_dir, self.threads = endpoint, log_dir, threads
        self.enroll = enroll  # name -> the credentials (env vars) that alone get that name
        self.crash = crash or {}  # device index -> round at which it dies (fault injection)
        self.forks = zygote() if start == "forkserver" and hasattr(os, "fork") else None
        self.procs: dict[str, subprocess.Popen | ForkedDevice] = {}
        self.retired: dict[str, int | None] = {}
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, n: int, prefix: str = "dev") -> list[str]:
        first = len(self.procs)
        names = [f"{prefix}-{first + i}" for i in range(n)]
        for i, name in enumerate(names):
            self.procs[name] = self.spawn(name, self.crash.get(first + i))
        return names

    def spawn(self, name: str, crash_at_round: int | None = None) -> subprocess.Popen | ForkedDevice:
        argv = ["--connect", self.endpoint, "--name", name, "--threads", str(self.threads)]
        argv += ["--parent-pid", str(os.getpid())]  # a device exits when the emulator has gone
        argv += ["--run", self.log_dir.parent.name]  # the run folder (logs/ is in it): for its process title
        if crash_at_round is not None:
            argv += ["--crash-at-round", str(crash_at_round)]
        # secrets by environment (same user only), never on the command line (`ps` shows it)
        env = {"OMP_NUM_THREADS": str(self.threads), **self.enroll(name)}
        log = self.log_dir / f"{name}.log"
        if self.forks is not None:
            return ForkedDevice(self.forks, self.forks.start(argv, env, str(log)), name)
        # the child keeps its own copy of the log's descriptor; ours closes when the block ends
        with open(log, "w") as logf:
            # own process group: Ctrl-C reaches the emulator, which shuts devices down in order
            return subprocess.Popen(
                [sys.executable, "-m", "flt.devices", *argv],
                stdout=logf,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,
            )

    def alive(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is None or proc.poll() is None  # devices started by hand: assume alive

    def cpu_seconds(self, name: str) -> float | None:
        """CPU time the device's process has used so far, or None where it cannot be read
        (a device started by hand, a Ray actor, one that exited, a system without /proc)."""
        proc = self.procs.get(name)
        pid = getattr(proc, "pid", None)  # a Ray actor has none here: it may run on another node
        return process_cpu_seconds(pid) if proc is not None and pid is not None and proc.poll() is None else None

    def wait(self, transport: Transport, timeout_s: float) -> list[str]:
        """Wait for every started device's hello; a device that exits early is named."""
        import time

        deadline = time.monotonic() + timeout_s
        while len(set(transport.devices) & set(self.procs)) < len(self.procs):
            # one lost mid-run said hello long ago: only a device yet to connect can fail here
            dead = [n for n, p in self.procs.items() if n not in transport.devices and p.poll() is not None]
            if dead:
                raise DeviceError(
                    f"device process {dead[0]} exited with code "
                    f"{self.procs[dead[0]].returncode} before connecting:\n{self.tail(dead[0])}"
                )
            if time.monotonic() > deadline:
                raise DeviceError(f"device processes did not connect within {timeout_s:g} s")
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
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
        self.retired[name] = proc.returncode

    def exit_codes(self) -> dict[str, int | None]:
        return {**self.retired, **{n: p.poll() for n, p in self.procs.items()}}
