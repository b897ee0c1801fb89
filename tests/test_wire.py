"""The wire protocol: encoding, validation of malformed frames, and a real socket."""

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq

from flt.common.interrupts import Terminated, stop_on_sigterm
from flt.common.wire import VERSION, Message, ProtocolError, decode, encode, frame_bytes, receive
from flt.server.transport import DeviceLost, Transport


def _header(**over):
    h = {
        "v": VERSION,
        "kind": "update",
        "run": "",
        "round": 1,
        "client": 3,
        "tensors": [{"name": "model", "dtype": "float32", "shape": [4]}],
        "meta": {},
    }
    h.update(over)
    return json.dumps(h).encode()


def test_roundtrip_keeps_tensors_and_meta():
    msg = Message(
        "train",
        7,
        12,
        tensors={"model": np.arange(6, dtype=np.float32).reshape(2, 3), "idx": np.array([1, 2], dtype=np.int64)},
        meta={"lr": 0.01},
    )
    frames = encode(msg)
    out = decode([bytes(f) for f in frames])
    assert (out.kind, out.round, out.client, out.meta) == ("train", 7, 12, {"lr": 0.01})
    np.testing.assert_array_equal(out.tensors["model"], msg.tensors["model"])
    assert out.tensors["idx"].dtype == np.int64
    payload, header = frame_bytes(frames)
    assert payload == 6 * 4 + 2 * 8 and header == len(frames[0])


@pytest.mark.parametrize(
    "frames, what",
    [
        ([], "empty"),
        ([b"\xff\xfe not json"], "not JSON"),
        ([b"[1, 2]"], "not a JSON object"),
        ([_header(v=99), b"\0" * 16], "version"),
        ([_header(kind="steal"), b"\0" * 16], "unknown message kind"),
        ([_header(client="3"), b"\0" * 16], "client"),
        ([_header(), b"\0" * 15], "expected 16"),
        ([_header()], "0 frames"),
        ([_header(tensors=[{"name": "m", "dtype": "object", "shape": [1]}]), b"\0" * 8], "dtype"),
        ([_header(tensors=[{"name": "m", "dtype": "float32", "shape": [-1]}]), b""], "shape"),
    ],
)
def test_malformed_messages_are_rejected_with_a_reason(frames, what):
    with pytest.raises(ProtocolError, match=what):
        decode(frames)


def test_oversized_message_is_rejected(monkeypatch):
    import flt.common.wire as wire

    monkeypatch.setattr(wire, "MAX_MESSAGE_BYTES", 64)
    with pytest.raises(ProtocolError, match="cap"):
        decode([_header(tensors=[{"name": "m", "dtype": "float32", "shape": [32]}]), b"\0" * 128])


@pytest.mark.slow
def test_server_socket_survives_garbage_from_a_real_peer():
    """A peer process sends malformed frames, then a valid message: the server counts
    the bad ones, keeps running and still receives the good one."""
    server = Transport()
    peer = f"""
import zmq, json, numpy as np
from flt.common.wire import Message, encode
s = zmq.Context().socket(zmq.DEALER); s.setsockopt(zmq.IDENTITY, b"peer"); s.connect({server.endpoint!r})
s.send_multipart([b"garbage"])
s.send_multipart([json.dumps({{"v": 1, "kind": "update", "round": 1, "client": 0,
    "tensors": [{{"name": "m", "dtype": "float32", "shape": [1000]}}], "meta": {{}}}}).encode(), b"short"])
s.send_multipart(encode(Message("hello", meta={{"name": "peer"}})))
s.close(linger=2000)
"""
    proc = subprocess.Popen([sys.executable, "-c", peer])
    try:
        got = server.recv(timeout_s=20)
        assert got is not None
        ident, msg = got
        assert (ident, msg.kind) == ("peer", "hello")
        assert server.ledger.rejected == 2
    finally:
        proc.wait(timeout=20)
        server.sock.close(linger=0)


@pytest.mark.slow
def test_message_for_a_client_the_device_does_not_host_is_rejected():
    server = Transport()
    server.client_device[5] = "dev-a"
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.connect(server.endpoint)
    try:
        s.send_multipart(encode(Message("hello", meta={"name": "dev-b"})))
        server._hello(*server.recv(timeout_s=10))
        s.send_multipart(encode(Message("update", 1, 5, tensors={"model": np.zeros(3, np.float32)})))
        assert server.recv(timeout_s=2, kinds=("update",)) is None
        assert server.ledger.rejections.by_reason["wrong client"][0] == 1
    finally:
        s.close(linger=0)
        server.sock.close(linger=0)


def _spec(shape, dtype="float32"):
    return [{"name": "m", "dtype": dtype, "shape": shape}]


@pytest.mark.parametrize(
    "frames, what",
    [
        ([b"[" * 100_000], "deeper"),  # RecursionError before
        ([b'{"v": 1, "kind": ' + b"[" * 40 + b"]" * 40 + b"}"], "deeper"),
        ([_header(tensors=_spec([2**62, 4])), b"\0" * 16], "bad shape"),  # OverflowError before
        ([_header(tensors=_spec([2**20, 2**20])), b"\0" * 16], "cap"),
        ([_header(tensors=_spec([2**70])), b"\0" * 16], "bad shape"),
        ([_header(tensors=_spec([1] * 65)), b"\0" * 4], "at most 8"),  # ValueError in reshape before
        ([_header(tensors=_spec([True, 4])), b"\0" * 16], "bad shape"),
        ([_header(tensors=_spec(4)), b"\0" * 16], "shape must be a list"),
        ([_header(tensors=_spec([4], dtype=["float32"])), b"\0" * 16], "dtype"),  # unhashable
        ([_header(kind=["update"]), b"\0" * 16], "unknown message kind"),
        ([_header(round=2**70), b"\0" * 16], "round"),
        ([_header(v=True), b"\0" * 16], "version"),
        ([_header(meta=[]), b"\0" * 16], "meta"),
        ([_header(run=5), b"\0" * 16], "run"),
        ([b'{"v": 1, "round": ' + b"9" * 5000 + b"}"], "not JSON"),  # int() digit limit
        ([_header(tensors=_spec([4]) * 2), b"\0" * 16, b"\0" * 16], "twice"),
        ([b"x" * (2 << 20)], "header of"),
        ([_header(tensors=[])] + [b""] * 17, "at most 16"),
    ],
)
def test_crafted_messages_raise_only_protocol_error(frames, what):
    with pytest.raises(ProtocolError, match=what):
        decode(frames)


def test_random_and_mutated_frames_raise_only_protocol_error():
    """Decoding random bytes and single-byte mutations of valid messages either yields a
    message or raises ProtocolError: never another exception."""
    rng = np.random.default_rng(0)
    valid = encode(Message("update", 3, 7, tensors={"model": np.ones((2, 3), np.float32)}, meta={"n": 50, "batch": 4}))
    header = bytes(valid[0])
    for _ in range(2000):
        raw = bytearray(header)
        for pos in rng.integers(0, len(raw), size=rng.integers(1, 4)):
            raw[pos] = rng.integers(0, 256)
        for frames in ([bytes(raw), bytes(valid[1])], [rng.bytes(int(rng.integers(0, 64)))]):
            with contextlib.suppress(ProtocolError):
                decode(frames)


def _dealer(endpoint: str, name: str, hello: bool = True):
    """A DEALER socket connected to the server, with routing id `name`; it says hello as
    `name` unless told not to."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IDENTITY, name.encode())
    s.connect(endpoint)
    if hello:
        s.send_multipart(encode(Message("hello", meta={"name": name})))
    return s


@pytest.mark.parametrize("frozen", [True, False])
def test_a_frozen_device_is_found_lost_once_it_answers_no_heartbeat(frozen):
    """A device stopped for good (SIGSTOP; a host powered off looks the same) kept its
    connection: each exchange that only it could answer waited out the round timeout, for
    the rest of the run. A connection that answers no ping is now closed, and the next send
    finds the device lost; an idle device that answers pings stays."""
    server = Transport(heartbeat_s=(0.2, 1.0))
    code = (
        "import time, zmq; from flt.common.wire import Message, encode; "
        f"s = zmq.Context().socket(zmq.DEALER); s.connect({server.endpoint!r}); "
        "s.send_multipart(encode(Message('hello', meta={'name': 'dev-a'}))); time.sleep(60)"
    )
    device = subprocess.Popen([sys.executable, "-c", code])
    try:
        server.wait_devices(1, timeout_s=60)
        if frozen:
            device.send_signal(signal.SIGSTOP)
        time.sleep(2.5)  # two ping intervals and the timeout, with room
        if frozen:
            with pytest.raises(DeviceLost, match="not connected"):
                server.send("dev-a", Message("evaluate", 0, 0))
        else:
            server.send("dev-a", Message("evaluate", 0, 0))  # still there
    finally:
        device.kill()
        device.wait()
        server.sock.close(linger=0)


def test_a_set_up_message_from_a_device_no_wait_is_for_is_rejected_not_billed():
    """While a newcomer loads its clients (the method's traffic is billed), another device's
    stray `ready` was counted in the ledger and dropped: a broken device billed the method."""
    from flt.emulator.session import _await_ready

    server = Transport()
    old, new = _dealer(server.endpoint, "dev-old"), _dealer(server.endpoint, "dev-new")
    try:
        server.wait_devices(2, timeout_s=10)
        old.send_multipart(encode(Message("ready", meta={"clients": [9]})))
        time.sleep(0.3)  # queued at the server before the wait starts
        # the newcomer's own ready ends the wait: sent once the wait has read the stray one
        # (a socket fair-queues its peers, so two queued messages may be read in either order)
        later = threading.Timer(0.5, lambda: new.send_multipart(encode(Message("ready", meta={"clients": [0]}))))
        later.start()
        assert _await_ready(server, {"dev-new": [0]}, 10) == {}
        later.join()
        reasons = {r: v["messages"] for r, v in server.rejections.summary()["rejected_reasons"].items()}
        assert reasons == {"not awaited": 1}
        up = server.ledger.totals()["up"]
        assert sum(cell["messages"] for cell in up.values()) == 3  # the two hellos and the newcomer's ready
    finally:
        old.close()
        new.close()
        server.sock.close(linger=0)


def test_rejections_are_counted_by_reason_and_their_bytes_kept_out_of_the_traffic():
    server = Transport()
    dev, stranger = _dealer(server.endpoint, "dev-a"), _dealer(server.endpoint, "stranger", hello=False)
    server.wait_devices(1, timeout_s=10)
    server.client_device[5] = "dev-a"
    sent = {
        "malformed": (dev, [b"garbage", b"x"]),
        "wrong client": (dev, encode(Message("update", 1, 6, tensors={"model": np.zeros(3, np.float32)}))),
        "unexpected kind": (dev, encode(Message("train", 1, 5))),
        "unknown device": (stranger, encode(Message("update", 1, 5, tensors={"model": np.zeros(9, np.float32)}))),
    }
    try:
        for sock, frames in sent.values():
            sock.send_multipart(frames)
        dev.send_multipart(encode(Message("ready")))
        ident, msg = server.recv(timeout_s=10)
        assert (ident, msg.kind) == ("dev-a", "ready")
        # the stranger's frame comes over another connection: ZeroMQ may queue it after 'ready'
        deadline = time.monotonic() + 10
        while server.rejections.messages < len(sent) and time.monotonic() < deadline:
            assert server.recv(timeout_s=0.2) is None  # nothing valid is left to arrive
        expected = {
            r: {"messages": 1, "bytes": len(sock.IDENTITY) + sum(len(bytes(f)) for f in fr)}
            for r, (sock, fr) in sent.items()
        }
        assert server.rejections.summary()["rejected_reasons"] == expected
        assert server.ledger.rejections.summary() == server.rejections.summary()
        totals = server.ledger.totals()
        assert totals["up"]["control"]["messages"] == 2  # the hello and 'ready'
        assert sum(c["messages"] for d in totals.values() for c in d.values()) == 2
    finally:
        dev.close()
        stranger.close()
        server.sock.close(linger=0)


def test_a_frame_over_the_inbound_limit_never_reaches_the_server():
    """ZeroMQ drops a frame larger than the run's largest legitimate message (and
    disconnects its peer) before the server allocates it; others carry on."""
    server = Transport(max_inbound=4096)  # below the header cap (1 MiB): the cap wins
    big = _dealer(server.endpoint, "big", hello=False)
    try:
        big.send_multipart(encode(Message("hello", meta={"name": "big", "pad": "x" * (3 << 20)})))
        time.sleep(0.2)
        good = _dealer(server.endpoint, "good")
        ident, _ = server.recv(timeout_s=10)
        assert ident == "good" and server.recv(timeout_s=0.5) is None
        assert server.rejections.messages == 0
    finally:
        big.close()
        good.close()
        server.sock.close(linger=0)


def _serve(endpoint: str, name: str, answer, stop: threading.Event):
    """A device in a thread: answers every task with answer(task) (a list of messages)."""
    s = _dealer(endpoint, name)
    while not stop.is_set():
        if s.poll(50):
            for reply in answer(decode(s.recv_multipart())):
                s.send_multipart(encode(reply))
    s.close()


@contextlib.contextmanager
def _serving(server: Transport, answer, clients: range):
    """A device thread, dev-a, hosting `clients` and answering each task with
    answer(task), while the body runs."""
    stop = threading.Event()
    thread = threading.Thread(target=_serve, args=(server.endpoint, "dev-a", answer, stop))
    thread.start()
    try:
        server.wait_devices(1, timeout_s=10)
        server.client_device.update(dict.fromkeys(clients, "dev-a"))
        yield
    finally:
        stop.set()
        thread.join()


def _drained(server: Transport, caplog) -> tuple[dict[str, int], list[str]]:
    """What `drain` rejected, by reason, and the warnings it logged."""
    with caplog.at_level("INFO", logger="flt.server"):
        server.drain()
    reasons = {r: v["messages"] for r, v in server.rejections.summary()["rejected_reasons"].items()}
    return reasons, [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_gather_rejects_stale_mid_run_hello_and_checked_replies_and_keeps_the_good_ones():
    server = Transport()
    stop = threading.Event()

    def answer(task):
        batch = task.meta["batch"]
        n = {0: 50, 1: 7}.get(task.client, 50)  # client 1 claims a wrong sample count
        return [
            Message("metrics", 0, task.client, meta={"batch": batch - 1}),  # stale
            Message("hello", meta={"name": "dev-a"}),  # mid-run hello
            Message("metrics", 0, task.client, meta={"batch": batch, "n": n}),
        ]

    thread = threading.Thread(target=_serve, args=(server.endpoint, "dev-a", answer, stop))
    thread.start()
    try:
        server.wait_devices(1, timeout_s=10)
        server.client_device.update({0: "dev-a", 1: "dev-a"})
        stranger = _dealer(server.endpoint, "stranger")
        time.sleep(0.3)
        got = server.gather(
            {c: Message("evaluate", 0, c) for c in (0, 1)},
            "metrics",
            10,
            check=lambda c, m: ("wrong sample count", "n") if m.meta["n"] != 50 else None,
        )
        assert list(got) == [0]
        reasons = {r: v["messages"] for r, v in server.rejections.summary()["rejected_reasons"].items()}
        assert reasons == {"stale": 2, "hello mid-run": 3, "wrong sample count": 1}
        assert server.ledger.totals()["up"]["evaluation"]["messages"] == 1
        assert "stranger" not in server.devices  # a stranger's hello mid-run is not kept
    finally:
        stop.set()
        thread.join()
        stranger.close()
        server.sock.close(linger=0)


def _stop_reading_cpu_time(server: Transport) -> None:
    def interrupt(name):
        raise KeyboardInterrupt

    server.cpu_seconds = interrupt


def _stop_after_the_last_send(server: Transport) -> None:
    send = server.send

    def send_then_stop(device, msg, billed=True):
        send(device, msg, billed)
        if msg.meta["last"]:
            raise KeyboardInterrupt

    server.send = send_then_stop  # type: ignore[method-assign]


@pytest.mark.parametrize("stop", [_stop_reading_cpu_time, _stop_after_the_last_send])
def test_replies_to_a_gather_interrupted_before_its_wait_are_expected_too(caplog, stop):
    """An interrupt timed by a round's record (a scheduler, the sweep's kills) meets the
    checkpoint's gather just after its tasks went out, before the wait: the replies to
    them were warned of as stale messages of a peer. The signal is raised here where it
    fell: in the reading of the devices' CPU time between the sends and the wait, or right
    after a send (a stop that comes while a message is half sent is held back to the end
    of the send, common/interrupts.py; the seed-8 sweep: a SIGTERM during a checkpoint's
    gather of Local's device state), where the clients just sent to were not yet owed."""
    server = Transport()
    answer = lambda task: [Message("metrics", 0, task.client, meta={"batch": task.meta["batch"]})]  # noqa: E731
    with _serving(server, answer, range(3)):
        stop(server)
        with pytest.raises(KeyboardInterrupt):
            server.gather({c: Message("evaluate", 0, c) for c in range(3)}, "metrics", 10)
        time.sleep(0.3)  # the three answer after the interrupt
        assert _drained(server, caplog) == ({"after the interrupt": 3}, [])


def test_hellos_of_devices_still_starting_when_an_interrupt_ends_the_wait_are_expected(caplog):
    """Ctrl-C while the device processes start: those that say hello after the wait
    stopped are the run's own, so they are counted apart, not warned of as hellos mid-run
    (an interrupted run's summary listed them as rejected). A second hello of a device
    that had joined still is a stray one."""
    server = Transport()
    first = _dealer(server.endpoint, "dev-0")

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)  # while dev-1 has not said hello yet
    try:
        with pytest.raises(KeyboardInterrupt):
            server.wait_devices(2, timeout_s=10)
        assert list(server.devices) == ["dev-0"]
        late = _dealer(server.endpoint, "dev-1")  # the slow one's hello, now the run closes
        first.send_multipart(encode(Message("hello", meta={"name": "dev-0"})))
        time.sleep(0.3)
        reasons, warned = _drained(server, caplog)
        assert reasons == {"after the interrupt": 1, "hello mid-run": 1}
        assert len(warned) == 1 and "dev-0" in warned[0]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        first.close()
        if "late" in locals():
            late.close()
        server.close()


def test_replies_owed_to_an_interrupted_gather_are_expected_not_warned(caplog):
    """Ctrl-C or SIGTERM stops a gather while devices still train: their replies to its
    tasks come while the run closes. They are counted apart, in one line, not as a peer's
    stale messages; a second reply for the same client, or another batch's, still is one."""
    server = Transport()

    def answer(task):
        batch = task.meta["batch"]
        out = [Message("metrics", 0, task.client, meta={"batch": batch})]
        if task.client == 3:  # a duplicate and another batch's reply
            out += [Message("metrics", 0, 3, meta={"batch": b}) for b in (batch, batch - 5)]
        return out

    def interrupt(client, msg):
        raise KeyboardInterrupt

    try:
        with _serving(server, answer, range(4)):
            with pytest.raises(KeyboardInterrupt):
                server.gather({c: Message("evaluate", 0, c) for c in range(4)}, "metrics", 10, on_reply=interrupt)
            time.sleep(0.3)  # the three other clients answer after the interrupt
            reasons, warned = _drained(server, caplog)
            assert reasons == {"after the interrupt": 3, "stale": 2}
            assert len(warned) == 2 and all("client 3" in w for w in warned)
            assert any("3 replies to the interrupted round" in r.getMessage() for r in caplog.records)
            assert server.ledger.totals()["up"]["evaluation"]["messages"] == 1  # only the reply before the interrupt
    finally:
        server.sock.close(linger=0)


def test_rejections_are_logged_at_a_bounded_rate(caplog):
    from flt.server.transport import LOG_FIRST

    server = Transport()
    try:
        with caplog.at_level("WARNING", logger="flt.server"):
            for _ in range(500):
                server.reject("malformed", "peer", (10, 0), "garbage")
        assert server.rejections.by_reason["malformed"] == [500, 5000]
        assert len(caplog.records) == LOG_FIRST  # the summary line waits LOG_EVERY_S
    finally:
        server.sock.close(linger=0)


def test_a_device_rejects_a_task_without_an_integer_batch_id():
    from flt.devices.device import Device

    dev = Device("tcp://127.0.0.1:9", name="dev-x")  # nothing listens: the socket never sends
    try:
        for batch in ([1], None, "1", True):
            dev.collect(Message("train", 1, 3, meta={"batch": batch, "last": 1}))
        assert dev.rejected == 4 and not dev.pending
    finally:
        dev.sock.close(linger=0)


def _ctrl_c_after(calls: int, real, sig: int = signal.SIGINT):
    """`real` (a socket's send or recv), with a real SIGINT (or `sig`) raised in this
    process after its `calls`-th call: a Ctrl-C between two frames of one multipart message."""
    count = [0]

    def call(*args, **kwargs):
        out = real(*args, **kwargs)
        count[0] += 1
        if count[0] == calls:
            signal.raise_signal(sig)
        return out

    return call


def test_ctrl_c_between_two_frames_sent_never_glues_one_message_onto_the_next(monkeypatch):
    """A stopped run sends its devices `shutdown`. When Ctrl-C fell between two frames of the
    message before it, ZeroMQ appended the shutdown to the half-sent message: the device read
    one malformed message, never its shutdown, and was killed at the stop's deadline."""
    server = Transport()
    dev = _dealer(server.endpoint, "dev-a")
    try:
        server.wait_devices(1, timeout_s=10)
        server.client_device[0] = "dev-a"
        monkeypatch.setattr(server.sock, "send", _ctrl_c_after(2, server.sock.send))  # routing id, header
        task = Message("train", 1, 0, tensors={"model": np.arange(6, dtype=np.float32)})
        with pytest.raises(KeyboardInterrupt):
            server.send("dev-a", task)
        monkeypatch.undo()
        billed = server.ledger.totals()["down"]  # the interrupted message was sent whole, and billed
        server.send("dev-a", Message("shutdown"))
        got = [decode(dev.recv_multipart()) for _ in range(2) if dev.poll(5000)]
        assert [m.kind for m in got] == ["train", "shutdown"]
        assert np.array_equal(got[0].tensors["model"], task.tensors["model"])
        assert sum(c["messages"] for c in billed.values()) == 1
    finally:
        dev.close()
        server.sock.close(linger=0)


def test_sigterm_between_two_frames_is_delivered_after_the_whole_message(monkeypatch):
    """SIGTERM (kill, a scheduler's time limit) stops a run as Ctrl-C does, so it is held
    back the same way: the message goes whole, then Terminated (a KeyboardInterrupt)."""
    server = Transport()
    dev = _dealer(server.endpoint, "dev-a")
    before = signal.getsignal(signal.SIGTERM)
    try:
        stop_on_sigterm()
        server.wait_devices(1, timeout_s=10)
        server.client_device[0] = "dev-a"
        monkeypatch.setattr(server.sock, "send", _ctrl_c_after(2, server.sock.send, signal.SIGTERM))
        task = Message("train", 1, 0, tensors={"model": np.arange(6, dtype=np.float32)})
        with pytest.raises(Terminated):
            server.send("dev-a", task)
        monkeypatch.undo()
        server.send("dev-a", Message("shutdown"))
        got = [decode(dev.recv_multipart()) for _ in range(2) if dev.poll(5000)]
        assert [m.kind for m in got] == ["train", "shutdown"]
    finally:
        signal.signal(signal.SIGTERM, before)
        dev.close()
        server.sock.close(linger=0)


def test_ctrl_c_between_two_frames_read_leaves_no_tail_to_pass_for_a_message(monkeypatch):
    server = Transport()
    dev = _dealer(server.endpoint, "dev-a")
    try:
        server.wait_devices(1, timeout_s=10)
        server.client_device[0] = "dev-a"
        dev.send_multipart(encode(Message("update", 1, 0, tensors={"model": np.ones(3, np.float32)})))
        monkeypatch.setattr(server.sock, "recv", _ctrl_c_after(1, server.sock.recv))  # routing id only
        with pytest.raises(KeyboardInterrupt):
            server.recv(timeout_s=10, kinds=("update",))
        monkeypatch.undo()
        dev.send_multipart(encode(Message("ready")))
        ident, msg = server.recv(timeout_s=10)
        assert (ident, msg.kind) == ("dev-a", "ready")
        assert server.rejections.summary()["rejected_reasons"] == {}
    finally:
        dev.close()
        server.sock.close(linger=0)


def _free_with_interrupt_pending(messages: list) -> None:
    """Free `messages` in one C call that first makes a SIGINT pending: no Python code runs
    between, so the first check for signals is made while they are freed."""
    import ctypes
    import functools
    import operator

    trip = ctypes.pythonapi.PyErr_SetInterruptEx
    trip.argtypes = [ctypes.c_int]
    steps = [functools.partial(trip, signal.SIGINT), messages.clear]
    list(map(operator.methodcaller("__call__"), steps))


def test_ctrl_c_while_received_messages_are_freed_stops_the_server():
    """A run with 100,000 rounds went on after its Ctrl-C (CI, once): the server read
    messages into zmq.Frames, and a Frame checks for signals when it is freed. When that
    check was the first after the Ctrl-C, the KeyboardInterrupt was raised in the Frame's
    destructor, which cannot pass it on: Python printed it and dropped it. Received
    messages now hold copies, and the frames are freed while a signal is only recorded."""
    server = Transport()
    dev = _dealer(server.endpoint, "dev-a")
    try:
        server.wait_devices(1, timeout_s=10)
        server.client_device[0] = "dev-a"
        for _ in range(50):
            dev.send_multipart(encode(Message("update", 1, 0, tensors={"model": np.ones(30_000, np.float32)})))
        got = [server.recv(timeout_s=10, kinds=("update",)) for _ in range(50)]
        assert all(g is not None and g[1].tensors["model"].flags.writeable for g in got)
        with pytest.raises(KeyboardInterrupt):
            _free_with_interrupt_pending(got)
    finally:
        dev.close()
        server.sock.close(linger=0)


def test_ctrl_c_while_a_device_frees_what_it_received_stops_the_device():
    """The device's side of the same read (a device started by hand is stopped with Ctrl-C)."""
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://freed-with-ctrl-c")
        b.connect("inproc://freed-with-ctrl-c")
        for _ in range(50):
            a.send_multipart(encode(Message("train", 1, 0, tensors={"model": np.ones(30_000, np.float32)})))
        got = [decode(receive(b)[0]) for _ in range(50)]
        assert all(np.array_equal(m.tensors["model"], np.ones(30_000, np.float32)) for m in got)
        with pytest.raises(KeyboardInterrupt):
            _free_with_interrupt_pending(got)
    finally:
        a.close(linger=0)
        b.close(linger=0)


def test_a_device_that_stops_reading_is_lost_not_a_hung_server():
    """ZeroMQ queues a bounded number of messages for a peer, then blocks the sender: a
    device that stopped reading would hang the whole run. Its queue full for the send
    timeout, it is lost; the socket stays clean for the others and for itself."""
    server = Transport(send_timeout_s=2.0)
    stuck = zmq.Context.instance().socket(zmq.DEALER)
    stuck.setsockopt(zmq.LINGER, 0)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.IDENTITY, b"stuck")
    stuck.connect(server.endpoint)
    stuck.send_multipart(encode(Message("hello", meta={"name": "stuck"})))
    good = _dealer(server.endpoint, "good")
    task = Message("train", 1, 0, tensors={"model": np.arange(4, dtype=np.float32)})

    def fill() -> int:
        sent = 0
        with pytest.raises(DeviceLost, match=r"stuck.*stopped reading"):
            while sent < 100_000:
                server.send("stuck", task)
                sent += 1
        return sent

    try:
        server.wait_devices(2, timeout_s=10)
        sent = fill()
        assert sent < 100_000
        server.send("good", Message("shutdown"))
        assert good.poll(5000) and decode(good.recv_multipart()).kind == "shutdown"
        got = 0
        while stuck.poll(500):  # it reads again: every message it gets is whole
            assert decode(stuck.recv_multipart()).kind == "train"
            got += 1
        assert got == sent
        fill()
        tic = time.monotonic()
        server.close()  # every device is sent its shutdown: no wait on the one that stopped reading
        assert time.monotonic() - tic < 1.5
    finally:
        stuck.close()
        good.close()
        server.sock.close(linger=0)


@pytest.mark.slow  # a device process imports torch
def test_a_device_pointed_at_another_program_gives_up_in_one_line():
    """libzmq reads a byte stream that does not open with ZMTP 3's greeting as ZMTP 1.0
    frames: a device whose --connect named another program's port (here one that answers
    every connection with random bytes) rejected the garbage as malformed messages for ever."""
    import os
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def answer_with_garbage():
        listener.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = listener.accept()
                with conn:
                    conn.sendall(os.urandom(4096))
                    time.sleep(0.2)

    threading.Thread(target=answer_with_garbage, daemon=True).start()
    try:
        device = subprocess.run(
            [sys.executable, "-m", "flt.emulator.cli", "device", "--connect", f"tcp://127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        stop.set()
        listener.close()
    assert device.returncode == 2, device.stderr[-2000:]
    assert "Traceback" not in device.stderr
    assert f"tcp://127.0.0.1:{port} sent 20 malformed messages and no flt message: not an flt server" in device.stderr
