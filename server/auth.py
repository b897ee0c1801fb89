"""Who may talk to the server, and under which name.

- **CURVE** (ZeroMQ's encryption and authentication, on by default for every bind that is
  not loopback and for every run that admits devices started by hand, `devices.external`,
  even on loopback: such a device is a stranger, and a token cannot vouch for it): pyzmq's
  ZAP handler admits a connection only if its public key is on the
  allowlist, and stamps the key's name on every message of that connection as its
  "User-Id". The server takes a device's name from there, never from what the device says.
  A key that is not allowed gets nothing; such attempts, and handshakes that fail (a
  client without CURVE, a wrong server key), are counted.
- **Loopback without CURVE**: the emulator gives each local device process a random
  token; a hello that claims a local device's name must carry its token.

Either way a name already held by another connection is refused, and devices that were
not enrolled (started by hand) get only `devices.external` seats. Refusals are counted
by reason and reported in summary.json.
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
import threading
from collections import Counter
from collections.abc import Container
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from flt.common import keys
from flt.common.errors import FltError

log = logging.getLogger("flt.auth")

LOOPBACK = re.compile(r"(ipc|inproc)://.*|tcp://(127\.\d+\.\d+\.\d+|localhost|\[::1\])(:.*)?")
SECURITY = ("auto", "curve", "none")
# CURVE wraps each frame in a MESSAGE command (name, nonce, MAC, flags): 33 bytes on the
# wire, and ZeroMQ's maximum message size applies to the wrapped frame
CURVE_FRAME_OVERHEAD = 64
TERM_WAIT_S = 10.0  # how long closing waits for the CURVE context to end


class Refused(Exception):
    """A hello the server will not answer; the text is the reason counted."""


def is_loopback(endpoint: str) -> bool:
    return LOOPBACK.fullmatch(endpoint) is not None


def uses_curve(bind: str, security: str, external: int = 0) -> bool:
    """auto: CURVE unless every device is a local process of ours on a loopback bind."""
    return security == "curve" or (security == "auto" and (external > 0 or not is_loopback(bind)))


def security_problem(bind: str, security: str, keys_dir: str | None, external: int) -> str | None:
    """Why these devices.* settings are unsafe or incomplete (checked before anything
    starts), or None."""
    if security == "none" and not is_loopback(bind):
        return (
            f"devices.security: none on {bind}, which is not loopback: anyone who reaches the "
            "port could join; leave it at auto (CURVE)"
        )
    if not uses_curve(bind, security, external):
        return None
    if keys_dir and not (Path(keys_dir).expanduser() / f"{keys.SERVER}.key_secret").is_file():
        return f"devices.keys: no {keys.SERVER}.key_secret in {keys_dir} (make keys with `flt keys {keys_dir}`)"
    if external and not keys_dir:
        return (
            f"devices.keys: {external} external device(s) over CURVE need keys: make them with "
            "`flt keys DIR --devices N` and set devices.keys: DIR (devices.security: auto turns CURVE on "
            "whenever devices.external > 0; on a loopback bind, devices.security: none admits any local "
            "process instead)"
        )
    return None


def gate_for(bind: str, security: str = "auto", keys_dir: str | None = None, external: int = 0) -> Gate:
    """The gate a run's server socket uses (config fields devices.bind, security, keys, external)."""
    problem = security_problem(bind, security, keys_dir, external)
    if problem:
        raise FltError(problem)
    if not uses_curve(bind, security, external):
        return Gate(curve=False, seats=external)
    if keys_dir:
        return Gate.from_dir(Path(keys_dir).expanduser(), seats=external)
    return Gate(curve=True, seats=external)


class Gate:
    """One server socket's admission policy: CURVE keys or tokens, names, seats, counts.
    `seats`: how many devices the emulator did not start may join (None: any)."""

    def __init__(
        self,
        curve: bool,
        server_secret: bytes | None = None,
        allowed: dict[bytes, str] | None = None,
        seats: int | None = None,
    ):
        self.curve = curve
        self.frame_overhead = CURVE_FRAME_OVERHEAD if curve else 0
        self.allowed: dict[bytes, str] = dict(allowed or {})  # z85 public key -> device name
        self.tokens: dict[str, str] = {}  # local device -> token (no CURVE)
        self.enrolled: set[str] = set()  # names the emulator started
        self.seats = seats  # devices started by hand still welcome
        self.refusals: Counter = Counter()
        self.denied_keys = 0
        self.failed_handshakes = 0
        self._watcher: threading.Thread | None = None
        self._stop = threading.Event()
        self.ctx = zmq.Context() if curve else zmq.Context.instance()  # one ZAP handler per context
        if curve:
            self.secret = server_secret or zmq.curve_keypair()[1]
            self.public = zmq.curve_public(self.secret)
            self.auth = _Authenticator(self)
            self.auth.start()
            self.auth.configure_curve_callback("*", self)

    @classmethod
    def from_dir(cls, directory: Path, seats: int | None = None) -> Gate:
        """DIR made by `flt keys`: server.key_secret, plus one NAME.key per allowed device."""
        _, secret = keys.read_key(directory / f"{keys.SERVER}.key_secret", secret=True)
        allowed = {keys.read_key(p)[0]: p.stem for p in sorted(directory.glob("*.key")) if p.stem != keys.SERVER}
        log.info("CURVE: %d device key(s) allowed from %s", len(allowed), directory)
        return cls(curve=True, server_secret=secret, allowed=allowed, seats=seats)

    # -- the server socket ----------------------------------------------------------
    def secure(self, sock: zmq.Socket) -> None:
        """Before bind: make `sock` a CURVE server and count its failed handshakes."""
        if not self.curve:
            return
        sock.curve_server = True
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self._watcher = threading.Thread(target=self._watch, args=(monitor,), daemon=True, name="flt-handshakes")
        self._watcher.start()

    def _watch(self, monitor: zmq.Socket) -> None:
        """Count failed handshakes until close() sets the stop flag; the monitor socket is
        closed here, in its own thread, or the context could never end."""
        try:
            while not self._stop.is_set():
                if monitor.poll(100):
                    event = recv_monitor_message(monitor)["event"]
                    self.failed_handshakes += 1
                    _rate_limited(
                        self.failed_handshakes,
                        "CURVE handshake failed (event %d): a client without CURVE or with a wrong server key",
                        event,
                    )
        finally:
            monitor.close(linger=0)

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP (the authenticator's thread): is this public key allowed?"""
        if key in self.allowed:
            return True
        self.denied_keys += 1
        _rate_limited(
            self.denied_keys,
            "refused a connection with a key not on the allowlist (%s...)",
            key[:8].decode(errors="replace"),
        )
        return False

    # -- devices --------------------------------------------------------------------
    def enroll(self, name: str) -> dict[str, str]:
        """Credentials for a local device process, as environment variables: a fresh key pair
        (CURVE) or a token. Only the process given them can take this name."""
        if name in self.allowed.values():
            raise FltError(
                f"devices.keys: a key file is named {name!r}, the name of a local device process; rename the key file"
            )
        self.enrolled.add(name)
        if not self.curve:
            self.tokens[name] = secrets.token_hex(16)
            return {keys.ENV_TOKEN: self.tokens[name]}
        public, secret = zmq.curve_keypair()
        self.allowed[public] = name
        return {keys.ENV_SECRET: secret.decode(), keys.ENV_SERVER: self.public.decode()}

    def admit(self, meta: dict, user_id: str | None, taken: Container[str]) -> str:
        """The name a hello's connection gets, or Refused. With CURVE the name is the one the
        allowlist gives the connection's key; `taken` holds the names already connected."""
        try:
            name = self._claimed(meta, user_id)
            if name in taken:
                raise Refused("duplicate identity")
            if name not in self.enrolled:
                if self.seats is not None and self.seats <= 0:
                    raise Refused("unexpected device")
                if self.seats is not None:
                    self.seats -= 1
            return name
        except Refused as exc:  # the transport logs it with the message's bytes
            self.refusals[str(exc)] += 1
            raise

    def _claimed(self, meta: dict, user_id: str | None) -> str:
        if self.curve:
            if not user_id:
                raise Refused("no authenticated key")
            return user_id
        name = meta.get("name")
        if not isinstance(name, str) or not keys.NAME.fullmatch(name):
            raise Refused("bad name")
        token = self.tokens.get(name)
        if token is not None and not hmac.compare_digest(str(meta.get("token", "")).encode(), token.encode()):
            raise Refused("wrong token")
        return name

    def report(self) -> dict:
        return {
            "mechanism": "curve" if self.curve else "none",
            "denied_keys": self.denied_keys,
            "failed_handshakes": self.failed_handshakes,
            "refused_hellos": dict(self.refusals),
        }

    def close(self, sock: zmq.Socket) -> None:
        """Close the server socket, stop the ZAP handler and the watcher, end our context."""
        if self._watcher is not None:
            self._stop.set()
            self._watcher.join()
            sock.disable_monitor()
        sock.close(linger=500)
        if self.curve:
            self.auth.stop()
            self._term(TERM_WAIT_S)

    def _term(self, wait_s: float) -> None:
        """End our context, waiting at most wait_s. Under load libzmq can hang in
        zmq_ctx_term after CURVE handshakes (zeromq/libzmq#2733); the run's summary is
        written after this, so a stuck term must not hold the run open."""
        ender = threading.Thread(target=self.ctx.term, daemon=True, name="flt-ctx-term")
        ender.start()
        ender.join(wait_s)
        if ender.is_alive():
            log.warning("the CURVE socket context did not end within %.0f s (a libzmq hang); left to exit", wait_s)


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler; the allowlist names each key, and that name is the User-Id."""

    def __init__(self, gate: Gate):
        super().__init__(gate.ctx, log=logging.getLogger("flt.auth.zap"))
        self.gate = gate

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.gate.allowed[z85.encode(client_public_key)]


def _rate_limited(count: int, fmt: str, *args: object) -> None:
    """Log the first few of a kind, then every 100th: a flood must not flood the log."""
    if count <= 5 or count % 100 == 0:
        log.warning(fmt + " [%d so far]", *args, count)
