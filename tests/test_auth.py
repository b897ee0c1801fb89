"""Authentication and identity, over real sockets between real processes on loopback.

CURVE keys are real (made by `flt keys`); peers are separate Python processes, either the
real device program or a few lines of pyzmq playing a stranger."""

import json
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import zmq
from flt_command import flt, flt_popen, free_port  # tests/ is on sys.path under pytest

from flt.common import keys
from flt.common.wire import Message
from flt.server.auth import Gate, gate_for, is_loopback, security_problem
from flt.server.transport import Transport

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "scenarios" / "quickstart.yaml"


def peer(
    endpoint: str,
    hellos: list[dict],
    secret: bytes | None = None,
    server: bytes | None = None,
    hold_s: float = 0.5,
    handshake: bool = True,
) -> subprocess.Popen:
    """A stranger: connects (with CURVE keys if given), sends hellos, waits for its handshake
    (`handshake`: one is expected), stays `hold_s` seconds, prints every message it got
    (strangers should get none), leaves."""
    curve = (
        ""
        if secret is None
        else (
            f"s.curve_secretkey = {secret!r}; s.curve_publickey = "
            f"zmq.curve_public({secret!r}); s.curve_serverkey = {server!r}"
        )
    )
    code = textwrap.dedent(f"""
        import time, zmq
        from flt.common.wire import Message, encode
        s = zmq.Context().socket(zmq.DEALER); s.linger = 2000
        {curve}
        mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        s.connect({endpoint!r})
        for meta in {hellos!r}:
            s.send_multipart(encode(Message("hello", meta=meta)))
        if {handshake!r} and not mon.poll(120_000):
            print("NO HANDSHAKE", flush=True)
        end = time.monotonic() + {hold_s}
        while time.monotonic() < end:
            if s.poll(50):
                print("GOT", s.recv_multipart()[:1], flush=True)
    """)
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)


def hellos_until(server: Transport, names: set, timeout_s: float = 90) -> None:
    # a device process imports torch before its hello: over 20 s on a loaded 2-core machine
    deadline = time.monotonic() + timeout_s
    while not names <= set(server.devices) and time.monotonic() < deadline:
        if got := server.recv(0.2):
            server._hello(*got)


@pytest.fixture
def key_dir(tmp_path) -> Path:
    res = flt("keys", str(tmp_path / "keys"), "--devices", "2")
    assert res.returncode == 0, res.stderr
    assert "secret-key" not in res.stdout + res.stderr  # a secret is never printed
    return tmp_path / "keys"


@pytest.mark.slow
def test_flt_keys_makes_private_key_pairs_and_never_overwrites(key_dir):
    names = sorted(p.name for p in key_dir.iterdir())
    assert names == [
        "edge-0.key",
        "edge-0.key_secret",
        "edge-1.key",
        "edge-1.key_secret",
        "server.key",
        "server.key_secret",
    ]
    for p in key_dir.glob("*.key_secret"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
        public, secret = keys.read_key(p, secret=True)
        assert zmq.curve_public(secret) == public
    assert stat.S_IMODE(key_dir.stat().st_mode) == 0o700
    assert keys.make_keys(key_dir, 1) == ["edge-2"]  # adds, keeps the server's pair
    with pytest.raises(keys.KeyFileError, match="already exists"):
        keys.write_keypair(key_dir, "edge-0")
    with pytest.raises(keys.KeyFileError, match=r"needs its NAME\.key_secret"):
        keys.read_key(key_dir / "edge-0.key", secret=True)
    res = flt(
        "device",
        "--connect",
        "tcp://127.0.0.1:1",
        "--key",
        str(key_dir / "nope.key_secret"),
        "--server-key",
        str(key_dir / "server.key"),
    )
    assert res.returncode == 2 and "nope.key_secret" in res.stderr and "Traceback" not in res.stderr


def test_a_token_only_device_cannot_secure_a_socket_with_curve():
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    try:
        with pytest.raises(keys.KeyFileError, match="token-only device"):
            keys.Credentials(token="t").secure(sock)
    finally:
        sock.close(0)


@pytest.mark.slow
def test_curve_is_the_default_off_loopback_and_needs_keys_for_external_devices(key_dir):
    assert is_loopback("tcp://127.0.0.1:*") and is_loopback("tcp://[::1]:5555")
    assert not is_loopback("tcp://0.0.0.0:5555") and not is_loopback("tcp://10.1.2.3:5555")
    assert "not loopback" in security_problem("tcp://0.0.0.0:5555", "none", None, 0)
    assert "flt keys" in security_problem("tcp://0.0.0.0:5555", "auto", None, 2)
    assert security_problem("tcp://0.0.0.0:5555", "auto", str(key_dir), 2) is None
    assert "server.key_secret" in security_problem("tcp://0.0.0.0:5555", "auto", str(key_dir / "nope"), 2)
    gate = gate_for("tcp://127.0.0.1:*", "auto", None, 0)
    assert not gate.curve


@pytest.mark.slow
def test_scenario_with_unsafe_security_is_refused_before_anything_starts(tmp_path):
    res = flt(
        "run",
        str(QUICKSTART),
        "--set",
        "devices.bind=tcp://0.0.0.0:0",
        "--set",
        "devices.security=none",
        "--out",
        str(tmp_path / "run"),
    )
    assert res.returncode == 2 and "devices.security" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
def test_an_allowed_key_names_the_device_and_a_wrong_key_gets_nothing(key_dir, tmp_path):
    """The real device program: one with an allowed key joins under its key's name (not the
    name it claims); one with a key that is not on the allowlist is refused, counted, and
    exits with a clear message instead of retrying for ever."""
    server = Transport(gate=Gate.from_dir(key_dir, seats=2))
    keys.write_keypair(tmp_path, "rogue")  # a well-formed key the server never allowed
    dev = [
        sys.executable,
        "-m",
        "flt.devices",
        "--connect",
        server.endpoint,
        "--server-key",
        str(key_dir / "server.key"),
    ]
    good = subprocess.Popen(
        [*dev, "--key", str(key_dir / "edge-1.key_secret"), "--name", "dev-0"],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    rogue = subprocess.Popen(
        [*dev, "--key", str(tmp_path / "rogue.key_secret")], cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    try:
        hellos_until(server, {"edge-1"})
        assert list(server.devices) == ["edge-1"]  # named by its key, not by --name dev-0
        code, err = ended(rogue)
        assert code == 2 and "refused this device's key" in err, (code, err)
        assert server.gate.denied_keys >= 1 and "rogue" not in server.devices
    finally:
        server.close()  # tells edge-1 to shut down
        assert good.wait(timeout=30) == 0
        rogue.kill()


def ended(device: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    """A device process's exit code and stderr, read while it runs (a full pipe would block
    it); the stderr is what a failed assertion shows (a start under load can be slow)."""
    _, err = device.communicate(timeout=timeout)
    return device.returncode, err


@pytest.mark.slow
def test_a_device_with_a_wrong_server_key_gives_up_with_a_hint(key_dir, tmp_path):
    server = Transport(gate=Gate.from_dir(key_dir))
    keys.write_keypair(tmp_path, "impostor")  # what the device wrongly believes is the server's key
    dev = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flt.devices",
            "--connect",
            server.endpoint,
            "--key",
            str(key_dir / "edge-0.key_secret"),
            "--server-key",
            str(tmp_path / "impostor.key"),
        ],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.recv(3.0) is None
        code, err = ended(dev)
        assert code == 2 and "--server-key" in err and not server.devices, (code, err)
        assert server.gate.failed_handshakes >= 1
    finally:
        dev.kill()
        server.close()


@pytest.mark.slow
def test_a_device_without_keys_at_a_curve_server_says_it_needs_them(key_dir):
    server = Transport(gate=Gate.from_dir(key_dir))
    dev = subprocess.Popen(
        [sys.executable, "-m", "flt.devices", "--connect", server.endpoint], cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    try:
        code, err = ended(dev)
        assert code == 2 and "pass --key and --server-key" in err, (code, err)
    finally:
        dev.kill()
        server.close()


def test_a_device_whose_connection_libzmq_dropped_says_why_instead_of_blocking_on_its_hello():
    """After a protocol error (a device without keys at a CURVE server) libzmq may drop the
    connection for good before the hello is queued (6 of 30 probes), and a DEALER's send
    blocks while it has no connection: the test above then hung silent, 1 run in 15 to 30.
    Here the connection is dropped on purpose and the watch reports the refusal."""
    from flt.devices.device import Device

    endpoint = "tcp://127.0.0.1:9"  # nothing listens
    dev = Device(endpoint, name="dev-x")
    dev.sock.disconnect(endpoint)  # no connection left, as libzmq leaves it
    dev.handshakes.refused = lambda: "the handshake with the server failed (protocol error)"
    code: list[int] = []
    runner = threading.Thread(target=lambda: code.append(dev.run()), daemon=True)
    try:
        runner.start()
        runner.join(10)
        assert code == [2]
    finally:
        if not runner.is_alive():
            dev.sock.close(linger=0)


@pytest.mark.slow
def test_a_client_without_curve_cannot_reach_a_curve_server(key_dir):
    server = Transport(gate=Gate.from_dir(key_dir))
    stranger = peer(server.endpoint, [{"name": "edge-0"}], hold_s=1.5, handshake=False)
    try:
        assert server.recv(2.0) is None and not server.devices
        out, _ = stranger.communicate(timeout=30)
        assert "GOT" not in out
        assert server.gate.failed_handshakes >= 1
    finally:
        server.close()


@pytest.mark.slow  # key_dir runs `flt keys`
def test_closing_a_curve_server_is_bounded_when_its_context_hangs(key_dir, monkeypatch, caplog):
    """libzmq can hang in zmq_ctx_term after CURVE handshakes under load (zeromq/libzmq#2733),
    which held a finished run open before its summary was written. It cannot be triggered on
    demand, so the context's term blocks here until the test releases it."""
    server = Transport(gate=Gate.from_dir(key_dir))
    gate, release = server.gate, threading.Event()
    real_term = gate.ctx.term
    monkeypatch.setattr(gate.ctx, "term", lambda: release.wait(30) and real_term())
    monkeypatch.setattr("flt.server.auth.TERM_WAIT_S", 0.5)
    start = time.monotonic()
    server.close()
    assert time.monotonic() - start < 5  # not the 30 s the stuck term would take
    assert "did not end" in caplog.text
    release.set()  # the context still ends once libzmq lets it


@pytest.mark.slow
def test_without_curve_only_the_process_holding_the_token_gets_a_local_name():
    """Loopback without CURVE: a stranger that says hello first as dev-0 does not get
    dev-0; the enrolled process does; a second connection with dev-0's token is refused
    as a duplicate; a device the run does not expect gets no seat."""
    server = Transport(gate=Gate(curve=False, seats=0))
    token = server.gate.enroll("dev-0")[keys.ENV_TOKEN]
    try:
        first = peer(server.endpoint, [{"name": "dev-0"}, {"name": "dev-0", "token": "0" * 32}], hold_s=3)
        time.sleep(1.0)  # the stranger speaks first
        real = peer(server.endpoint, [{"name": "dev-0", "token": token}], hold_s=3)
        hellos_until(server, {"dev-0"})
        twin = peer(server.endpoint, [{"name": "dev-0", "token": token}, {"name": "edge-9"}], hold_s=1)
        server.broadcast(Message("reset"))  # reaches the real dev-0 only
        deadline = time.monotonic() + 10
        while sum(server.gate.refusals.values()) < 4 and time.monotonic() < deadline:
            server.recv(0.2)
        assert dict(server.gate.refusals) == {"wrong token": 2, "duplicate identity": 1, "unexpected device": 1}
        assert server.rejections.by_reason["wrong token"][0] == 2
        assert list(server.devices) == ["dev-0"]
        outs = [p.communicate(timeout=30)[0] for p in (first, real, twin)]
        assert "GOT" not in outs[0] and "GOT" not in outs[2]
        assert outs[1].count("GOT") == 1
    finally:
        server.close()


@pytest.mark.slow
def test_curve_frames_up_to_the_inbound_limit_still_arrive(key_dir):
    """ZeroMQ's size limit applies to the CURVE-wrapped frame: a model of exactly the
    limit must not be dropped."""
    import numpy as np

    from flt.common.wire import encode

    server = Transport(gate=Gate.from_dir(key_dir), max_inbound=2 << 20)
    _, secret = keys.read_key(key_dir / "edge-0.key_secret", secret=True)
    s = zmq.Context.instance().socket(zmq.DEALER)
    keys.Credentials(secret=secret, server=server.gate.public).secure(s)
    s.connect(server.endpoint)
    try:
        s.send_multipart(encode(Message("hello", meta={"name": "x"})))
        s.send_multipart(encode(Message("ready", tensors={"m": np.zeros((2 << 20) // 4, np.float32)})))
        hellos_until(server, {"edge-0"})
        got = server.recv(10)
        assert got is not None and got[1].tensors["m"].nbytes == 2 << 20
    finally:
        s.close(linger=0)
        server.close()


# -- whole runs --------------------------------------------------------------------------
def _accuracies(run_dir: Path) -> list:
    rows = (run_dir / "fedavg" / "metrics.jsonl").read_text().splitlines()
    return [(r["round"], r.get("acc_mean")) for r in map(json.loads, rows)]


RUN = ["--set", "methods=[fedavg]", "--set", "train.rounds=3"]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("clean")
    res = flt("run", str(QUICKSTART), *RUN, "--set", "devices.processes=2", "--out", str(out), timeout=300)
    assert res.returncode == 0, res.stderr
    return out


@pytest.mark.slow
def test_strangers_during_start_up_cannot_fail_the_run_or_take_a_name(clean_run, tmp_path):
    """Loopback without CURVE (the default there): a stranger claims dev-0 before the real
    dev-0 starts, another claims a free name, both stay or leave; the run finishes with the
    clean run's accuracies and counts exactly those refusals."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    squatter = peer(endpoint, [{"name": "dev-0"}], hold_s=60)
    hit_and_run = peer(endpoint, [{"name": "intruder", "pid": 1}], hold_s=0.0)
    res = flt(
        "run",
        str(QUICKSTART),
        *RUN,
        "--set",
        "devices.processes=2",
        "--set",
        f"devices.bind={endpoint}",
        "--out",
        str(tmp_path),
        timeout=300,
    )
    squatter.kill()
    assert res.returncode == 0, res.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["security"] == {
        "mechanism": "none",
        "denied_keys": 0,
        "failed_handshakes": 0,
        "refused_hellos": {"wrong token": 1, "unexpected device": 1},
    }
    assert summary["timing"]["device_exit_codes"] == {"dev-0": 0, "dev-1": 0}
    assert _accuracies(tmp_path) == _accuracies(clean_run)
    assert "GOT" not in squatter.stdout.read() + hit_and_run.communicate(timeout=30)[0]


@pytest.mark.slow
def test_a_run_over_curve_admits_only_allowed_keys_and_matches_the_clean_run(clean_run, key_dir, tmp_path):
    """devices.security: curve on loopback: one local device (fresh per-run key) and one
    started by hand with edge-0's key; a second process with edge-0's key is refused as a
    duplicate, a rogue key is denied, a client without CURVE fails its handshake."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    keys.write_keypair(tmp_path, "rogue")
    dev = [
        sys.executable,
        "-m",
        "flt.emulator.cli",
        "device",
        "--connect",
        endpoint,
        "--server-key",
        str(key_dir / "server.key"),
    ]
    # held until the run is over (killed below): under load the server may bind after 30 s,
    # and a peer gone by then never fails its handshake
    plain = peer(endpoint, [{"name": "dev-0"}], hold_s=600, handshake=False)
    rogue = subprocess.Popen(
        [*dev, "--key", str(tmp_path / "rogue.key_secret")], cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    run = flt_popen(
        "run",
        str(QUICKSTART),
        *RUN,
        "--set",
        "devices.processes=1",
        "--set",
        "devices.external=1",
        "--set",
        f"devices.bind={endpoint}",
        "--set",
        "devices.security=curve",
        "--set",
        f"devices.keys={key_dir}",
        "--out",
        str(tmp_path / "run"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    edge = subprocess.Popen(
        [*dev, "--key", str(key_dir / "edge-0.key_secret")], cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    edge_log = ""
    while "hosting" not in edge_log and (line := edge.stderr.readline()):
        edge_log += line
    _, secret = keys.read_key(key_dir / "edge-0.key_secret", secret=True)
    server_key, _ = keys.read_key(key_dir / "server.key")
    twin = peer(endpoint, [{"name": "edge-0"}], secret=secret, server=server_key, hold_s=1)
    try:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
        assert edge.wait(timeout=60) == 0 and "hosting 10 clients" in edge_log
        assert rogue.wait(timeout=60) == 2
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        sec = summary["security"]
        assert sec["mechanism"] == "curve" and sec["denied_keys"] >= 1 and sec["failed_handshakes"] >= 1
        assert sec["refused_hellos"] == {"duplicate identity": 1}
        assert "GOT" not in twin.communicate(timeout=30)[0]
        assert _accuracies(tmp_path / "run") == _accuracies(clean_run)
        logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").iterdir())
        assert "secret-key" not in out + err + logs
    finally:
        for p in (plain, rogue, edge, twin, run):
            p.kill()
