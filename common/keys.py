"""CURVE key files and a device's credentials, shared by `flt keys`, the server and devices.

Key files use pyzmq's certificate format (`zmq.auth.load_certificate` reads them):
`NAME.key` holds the public key, `NAME.key_secret` the public and the secret key, and is
created with mode 0600 (never readable by other users, not even for an instant).
A device's name on the server is the name of its key file (`edge-1.key` -> `edge-1`).

Local device processes get their credentials from the emulator through the environment
(readable only by the same user), never on the command line, which `ps` shows to all.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import zmq
import zmq.auth

from flt.common.errors import FltError
from flt.common.files import make_folder

SERVER = "server"  # DIR/server.key, DIR/server.key_secret
ENV_SECRET = "FLT_DEVICE_SECRET_KEY"  # z85 secret key of a local device (CURVE)
ENV_SERVER = "FLT_SERVER_KEY"  # z85 public key of the server (CURVE)
ENV_TOKEN = "FLT_DEVICE_TOKEN"  # per-device secret on loopback without CURVE
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class KeyFileError(FltError):
    """A key file that is missing, unreadable or not a CURVE certificate."""


def write_keypair(directory: Path, name: str) -> tuple[Path, Path]:
    """A fresh CURVE key pair as DIR/NAME.key (0644) and DIR/NAME.key_secret (0600).
    Refuses to overwrite: replacing a key silently would lock a device out."""
    if not NAME.fullmatch(name):
        raise KeyFileError(f"key name {name[:64]!r}: use letters, digits, '.', '_' or '-' (at most 64)")
    public, secret = zmq.curve_keypair()
    directory.mkdir(parents=True, exist_ok=True)
    pub_path, sec_path = directory / f"{name}.key", directory / f"{name}.key_secret"
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    body = f'curve\n    public-key = "{public.decode()}"\n'
    _create(
        sec_path,
        f"#   ZeroMQ CURVE **Secret** Certificate for {name} ({stamp}); keep it private\n"
        f'metadata\n{body}    secret-key = "{secret.decode()}"\n',
        0o600,
    )
    _create(pub_path, f"#   ZeroMQ CURVE Public Certificate for {name} ({stamp})\nmetadata\n{body}", 0o644)
    return pub_path, sec_path


def _create(path: Path, text: str, mode: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise KeyFileError(f"{path}: already exists; not overwritten") from None
    with os.fdopen(fd, "w") as f:
        f.write(text)


def read_key(path: str | Path, secret: bool = False) -> tuple[bytes, bytes | None]:
    """(public, secret) z85 keys from a key file; `secret=True` requires the secret key."""
    path = Path(path)
    if secret and path.suffix == ".key":
        raise KeyFileError(f"{path}: a public key file; a device needs its NAME.key_secret")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"{path}: not a readable CURVE key file ({exc})") from None
    if not public or len(public) != 40 or (secret and (not secret_key or len(secret_key) != 40)):
        raise KeyFileError(
            f"{path}: " + ("no secret key in it (use NAME.key_secret)" if secret else "no valid public key in it")
        )
    return public, secret_key


def key_name(path: str | Path) -> str:
    """`DIR/edge-1.key_secret` -> `edge-1`."""
    name = Path(path).name
    return name[: -len(".key_secret")] if name.endswith(".key_secret") else Path(name).stem


@dataclass
class Credentials:
    """What a device presents: CURVE keys (server key + own key pair), or a token."""

    secret: bytes | None = None
    server: bytes | None = None
    token: str | None = None
    name: str | None = None  # from the key file's name, when keys came from files

    @property
    def curve(self) -> bool:
        return self.secret is not None

    @classmethod
    def load(
        cls,
        key_file: str | None = None,
        server_key_file: str | None = None,
        env: MutableMapping[str, str] | None = None,
    ) -> Credentials:
        """From `--key`/`--server-key` files, else from the environment the emulator set
        (removed from it, so nothing this process starts inherits a secret)."""
        env = os.environ if env is None else env
        if key_file or server_key_file:
            if not (key_file and server_key_file):
                raise KeyFileError(
                    "--key and --server-key go together: this device's NAME.key_secret and the server's server.key"
                )
            _, secret = read_key(key_file, secret=True)
            server, _ = read_key(server_key_file)
            return cls(secret=secret, server=server, name=key_name(key_file))
        env_secret, env_server = env.pop(ENV_SECRET, None), env.pop(ENV_SERVER, None)
        token = env.pop(ENV_TOKEN, None)
        if bool(env_secret) != bool(env_server):
            raise KeyFileError(f"{ENV_SECRET} and {ENV_SERVER} must both be set, or neither")
        return cls(
            secret=env_secret.encode() if env_secret else None,
            server=env_server.encode() if env_server else None,
            token=token,
        )

    def secure(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE client of the server whose public key we hold."""
        if self.secret is None or self.server is None:
            raise KeyFileError(
                "CURVE needs this device's key pair and the server's public key; "
                "a token-only device cannot secure its socket"
            )
        sock.curve_secretkey = self.secret
        sock.curve_publickey = zmq.curve_public(self.secret)
        sock.curve_serverkey = self.server


HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
)
GIVE_UP_AFTER = 5  # failed handshakes in a row (a wrong server key never succeeds)


class HandshakeWatch:
    """Reads a device socket's handshake events, so a device the server refuses can say
    why and exit instead of retrying for ever."""

    def __init__(self, sock: zmq.Socket, curve: bool):
        self.monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS)
        self.failures, self.curve = 0, curve

    def refused(self) -> str | None:
        """Why the server will never talk to us, once that is certain; else None. libzmq
        gives up by itself after a protocol error (a CURVE client at a plain server or the
        reverse); a wrong server key just fails again and again."""
        from zmq.utils.monitor import recv_monitor_message

        hint = (
            "is --server-key the server's key, and does the server use CURVE?"
            if self.curve
            else "the server probably requires CURVE: pass --key and --server-key (see `flt keys`)"
        )
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return "the server refused this device's key (it is not on the server's allowlist)"
            if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                return f"the handshake with the server failed (protocol error): {hint}"
            self.failures = 0 if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else self.failures + 1
        if self.failures >= GIVE_UP_AFTER:
            return f"{self.failures} handshakes with the server failed: {hint}"
        return None


def make_keys(directory: Path, devices: int = 0, prefix: str = "edge") -> list[str]:
    """`flt keys DIR`: the server's key pair (kept if it exists) and `devices` new device
    key pairs, numbered after those already there. Returns the new device names."""
    if devices < 0:
        raise KeyFileError(f"--devices: {devices} is negative")
    make_folder(directory, "flt keys DIR", mode=0o700)
    if not (directory / f"{SERVER}.key_secret").exists():
        write_keypair(directory, SERVER)
    taken = {p.stem for p in directory.glob(f"{prefix}-*.key")}
    names: list[str] = []
    i = 0
    while len(names) < devices:
        name = f"{prefix}-{i}"
        if name not in taken:
            write_keypair(directory, name)
            names.append(name)
        i += 1
    return names
