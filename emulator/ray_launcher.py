"""`devices.launcher: ray`: device processes as Ray actors, placed by Ray on a cluster's nodes.

Each actor runs the same device loop as `flt device --connect` and connects back to the
server over ZeroMQ like a device started by hand; Ray only places and stops it. Its
credentials (a fresh CURVE key pair per actor, or a loopback token) travel as the actor's
constructor arguments, never on a command line. An actor's log comes back with its result
and is written to `logs/NAME.log` in the run folder, as a local process's is.

Shutdown: the server's `shutdown` message ends the device loop; the actors are non-detached,
so Ray kills them when the server (their owner) exits or dies, even by SIGKILL. A device
process checks that its parent is alive; an actor's parent is Ray's worker pool, so fate
sharing is what ends an orphan here. An actor that dies is a lost device, as a dead process is.
Ray's own control traffic (which carries those constructor arguments) is encrypted only
when the cluster runs with Ray's TLS.
"""

from __future__ import annotations

import logging
import re
import signal
import subprocess
from collections.abc import Callable
from io import StringIO
from pathlib import Path
from typing import Any

from flt.common.errors import DeviceError
from flt.common.schema import ConfigError
from flt.emulator.processes import DeviceFleet
from flt.server.auth import is_loopback
from flt.server.transport import Transport

INSTALL = "pip install 'flt-emulator[ray]' (or pip install 'ray>=2.9')"
ANY_HOST = re.compile(r"(tcp://)(0\.0\.0\.0|\*|\[::\]|\[\*\])(:\d+)$")


def import_ray() -> Any:
    """The ray module, or a ConfigError naming the field and the install command."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"devices.launcher: ray needs the ray package, which is not installed: {INSTALL}") from None
    return ray


class DeviceHost:
    """The Ray actor: one device loop (devices/device.py), started by `run`."""

    def __init__(
        self, endpoint: str, name: str, threads: int, credentials: dict[str, str], crash_at_round: int | None = None
    ):
        self.endpoint, self.name, self.threads = endpoint, name, threads
        self.credentials, self.crash_at_round = dict(credentials), crash_at_round

    def run(self) -> tuple[int, str]:
        """Serve the server until it says shutdown; (exit code, this device's log)."""
        from flt.common.keys import Credentials
        from flt.devices.device import Device

        log, handler = _capture_log()
        try:
            creds = Credentials.load(env=self.credentials)  # pops them: nothing else keeps a secret
            code = Device(
                self.endpoint, self.name, None, self.threads, None, self.crash_at_round, credentials=creds
            ).run()
        except Exception:
            logging.getLogger("flt.device").exception("%s: device loop failed", self.name)
            code = 1
        logging.getLogger("flt").removeHandler(handler)
        return code, log.getvalue()


def _capture_log() -> tuple[StringIO, logging.Handler]:
    """The device's log lines, kept for the run folder instead of Ray's worker stderr."""
    buf = StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    flt = logging.getLogger("flt")
    flt.addHandler(handler)
    flt.setLevel(logging.INFO)
    flt.propagate = False
    return buf, handler


class ActorProcess:
    """A device actor behind the part of subprocess.Popen that DeviceFleet uses
    (poll, wait, send_signal, kill, returncode), so start, wait, alive, retire and stop
    work unchanged. Its exit code: what the device loop returned, or -1 if the actor died."""

    def __init__(self, ray: Any, actor: Any, log_path: Path):
        self.ray, self.actor, self.log_path = ray, actor, log_path
        self.result = actor.run.remote()
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self.ray.wait([self.result], timeout=0)[0]:
            self._finish()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self.ray.wait([self.result], timeout=timeout)[0]:
                raise subprocess.TimeoutExpired(f"device actor {self.log_path.stem}", timeout or 0)
            self._finish()
        assert self.returncode is not None
        return self.returncode

    def _finish(self) -> None:
        """Keep the exit code and write the log; free the actor's CPUs on the cluster."""
        try:
            self.returncode, text = self.ray.get(self.result)
        except self.ray.exceptions.RayError as exc:  # the actor's process died (crash, kill, node lost)
            self.returncode, text = -1, f"device actor died: {exc}\n"
        self.log_path.write_text(text)
        self.ray.kill(self.actor)

    def send_signal(self, sig: int) -> None:
        """SIGTERM after the grace period: Ray ends the actor (a device loop has no handler to run)."""
        if sig == signal.SIGTERM:
            self.kill()

    def kill(self) -> None:
        self.ray.kill(self.actor, no_restart=True)


class RayFleet(DeviceFleet):
    """DeviceFleet whose device processes are Ray actors: `ray.init(address)` on the first
    start (None: a running cluster if there is one, else a local instance), one actor per
    device with `threads` CPUs, and `ray.shutdown()` after stop if this fleet connected."""

    def __init__(
        self,
        endpoint: str,
        log_dir: Path,
        threads: int = 1,
        crash: dict | None = None,
        enroll: Callable[[str], dict[str, str]] = lambda name: {},
        address: str | None = None,
    ):
        super().__init__(endpoint, log_dir, threads, crash, enroll)
        self.address = address
        self.ray: Any = None
        self.connected = False  # this fleet called ray.init, so it shuts Ray down

    def spawn(self, name: str, crash_at_round: int | None = None) -> Any:
        ray = self._connect()
        # non-detached (owned by this process, so it dies with it) and never restarted: lost is lost
        host = ray.remote(DeviceHost).options(num_cpus=self.threads, max_restarts=0)
        actor = host.remote(self.endpoint, name, self.threads, self.enroll(name), crash_at_round)
        return ActorProcess(ray, actor, self.log_dir / f"{name}.log")

    def _connect(self) -> Any:
        if self.ray is None:
            ray = import_ray()
            if not ray.is_initialized():  # a test or a notebook may have connected already
                try:
                    ray.init(address=self.address, log_to_driver=False, logging_level=logging.WARNING)
                except (ConnectionError, RuntimeError, ValueError) as exc:
                    where = self.address or "a running cluster or a new local instance"
                    raise DeviceError(f"devices.ray_address: could not start or reach Ray at {where}: {exc}") from None
                self.connected = True
            self.ray = ray
            self.endpoint = reachable(self.endpoint, ray)
        return self.ray

    def wait(self, transport: Transport, timeout_s: float) -> list[str]:
        try:
            return super().wait(transport, timeout_s)
        except DeviceError as exc:
            if "did not connect" not in str(exc):
                raise
            cpus = self.ray.cluster_resources().get("CPU", 0)
            raise DeviceError(
                f"{exc}: {len(self.procs)} Ray actors of {self.threads} CPU(s) each "
                f"(devices.threads) on a cluster of {cpus:g} CPUs; are the nodes able to "
                f"reach {self.endpoint} (devices.bind, firewall)?"
            ) from None

    def stop(self, grace_s: float = 5.0) -> None:
        super().stop(grace_s)
        for proc in self.procs.values():
            proc.poll()  # a stopped actor's log and exit code, while Ray still answers
        if self.connected:
            self.ray.shutdown()
            self.connected = False


def reachable(endpoint: str, ray: Any) -> str:
    """The address actors connect to: a wildcard bind becomes this node's address as the
    cluster knows it. A loopback bind is refused when the cluster has other nodes."""
    if ANY_HOST.match(endpoint):
        return ANY_HOST.sub(rf"\g<1>{ray.util.get_node_ip_address()}\g<3>", endpoint)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if is_loopback(endpoint) and len(nodes) > 1:
        raise ConfigError(
            f"devices.bind: {endpoint} is loopback, which the other {len(nodes) - 1} node(s) "
            "of the Ray cluster cannot reach; bind an address they can, e.g. "
            "devices.bind: tcp://0.0.0.0:5555"
        )
    return endpoint
