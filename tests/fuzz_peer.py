"""A hostile peer on loopback, for tests/test_fuzz.py and benchmarks/bench_fuzz.py.

It waits until a run has written its first round (so the devices are in place), then
sends the server random frames, mutations of valid messages and the crafted cases of
issue 9, and writes what it sent and how the server must count it:

    python tests/fuzz_peer.py ENDPOINT REPORT.json --after RUN_DIR/fedavg/metrics.jsonl

Every message goes to the server from connections that never became devices, so the
server must reject each one; the report predicts the reason with the protocol's own
decoder. Frames larger than the server's inbound limit never reach it (ZeroMQ drops
them and the connection), so the report lists them apart as `not_counted`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flt.common.wire import MAX_HEADER_BYTES, VERSION, Message, ProtocolError, decode, encode

MB = 1 << 20


def _header(**fields) -> bytes:
    h = {"v": VERSION, "kind": "update", "run": "", "round": 1, "client": 0, "tensors": [], "meta": {}}
    return json.dumps({**h, **fields}).encode()


def _spec(shape) -> list:
    return [{"name": "model", "dtype": "float32", "shape": shape}]


def crafted() -> list[list[bytes]]:
    """The messages that ended a run before issue 9, and their relatives."""
    return [
        [b"[" * 100_000],  # RecursionError in json
        [b"{" * 50_000 + b"}" * 50_000],
        [_header(tensors=_spec([2**62, 4])), b"\0" * 16],  # OverflowError in np.prod
        [_header(tensors=_spec([2**70])), b"\0" * 16],
        [_header(tensors=_spec([1] * 65)), b"\0" * 4],  # ValueError in reshape
        [_header(tensors=_spec([-1])), b""],
        [_header(kind=["update"]), b""],  # unhashable kind
        [b'{"v": 1, "kind": "update", "round": ' + b"9" * 5000 + b"}"],  # int() digit limit
        [b'{"v": 1, "kind": "update", "client": 1e400}'],
        [_header(tensors=[{"name": "m", "dtype": {}, "shape": [1]}]), b"\0" * 4],
        [b"x" * (MAX_HEADER_BYTES - 10)],  # a header just under the cap
    ]


def templates(rng: np.random.Generator) -> list[list[bytes]]:
    """Valid messages a device sends (no hello: a stranger's hello is the gate's business)."""
    model = rng.standard_normal(16).astype(np.float32)
    msgs = [
        Message("update", 1, 3, tensors={"model": model}, meta={"n": 50, "steps": 10, "batch": 2}),
        Message("metrics", 1, 4, meta={"correct": 17.0, "total": 20.0, "batch": 3}),
        Message("centroids", 1, 5, tensors={"centroids": model.reshape(2, 8)}, meta={"n": 50, "batch": 4}),
        Message("ready", meta={"clients": [0, 1, 2]}),
        Message("error", 1, 2, meta={"reason": "boom", "batch": 1}),
    ]
    return [[bytes(f) for f in encode(m)] for m in msgs]


def mutate(frames: list[bytes], rng: np.random.Generator) -> list[bytes]:
    """Flip a few bytes of one frame, or drop, duplicate or truncate a frame."""
    frames = list(frames)
    i = int(rng.integers(len(frames)))
    op = rng.integers(4)
    if op == 0 and frames[i]:
        raw = bytearray(frames[i])
        for pos in rng.integers(0, len(raw), size=int(rng.integers(1, 5))):
            raw[pos] = int(rng.integers(256))
        frames[i] = bytes(raw)
    elif op == 1 and len(frames) > 1:
        del frames[i]
    elif op == 2:
        frames.insert(i, frames[i])
    else:
        frames[i] = frames[i][: int(rng.integers(len(frames[i]) + 1))]
    return frames


def predict(frames: list[bytes]) -> str | None:
    """The reason the server must give: malformed, or (valid, from a stranger) unknown
    device; None for a valid hello, which this peer does not send."""
    try:
        msg = decode(frames)
    except ProtocolError:
        return "malformed"
    return None if msg.kind == "hello" else "unknown device"


def plan(seed: int, n_random: int, n_mutated: int, n_unhosted: int, n_collision: int) -> dict:
    """Every message to send, by socket, with the reason the server must count."""
    rng = np.random.default_rng(seed)
    stranger: list[tuple[list[bytes], str]] = []
    for _ in range(n_random):
        stranger.append([rng.bytes(int(rng.integers(0, 300))) for _ in range(int(rng.integers(1, 4)))])
    base = templates(rng)
    stranger += [mutate(base[int(rng.integers(len(base)))], rng) for _ in range(n_mutated)]
    stranger += crafted()
    model = np.ones(16, np.float32)
    stranger += [
        [
            bytes(f)
            for f in encode(Message("update", 1, 10_000 + i, tensors={"model": model}, meta={"n": 50, "batch": 1}))
        ]
        for i in range(n_unhosted)
    ]
    planned = [(f, predict(f)) for f in stranger]
    # a connection that claims a running device's name, then speaks for its client (the
    # server, not the socket, names connections: the claim is in the hello)
    collision = [[bytes(f) for f in encode(Message("hello", meta={"name": "dev-0"}))]] + [
        [bytes(f) for f in encode(Message("update", 1, 0, tensors={"model": model}, meta={"n": 50, "batch": 1}))]
        for _ in range(n_collision)
    ]
    oversized = [
        [bytes(f) for f in encode(Message("hello", meta={"name": f"big-{i}", "pad": "x" * (50 * MB)}))]
        for i in range(3)
    ] + [[rng.bytes(2 * MB)] for _ in range(2)]
    return {"stranger": [(f, r) for f, r in planned if r], "collision": collision, "oversized": oversized}


def _socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.SNDHWM, 0)  # queue everything here: the server reads between its own work
    s.setsockopt(zmq.LINGER, 30_000)
    s.connect(endpoint)
    return s


def wait_for_round(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text().strip()):
        if time.monotonic() > deadline:
            raise SystemExit(f"fuzz peer: {path} got no round within {timeout_s:.0f} s")
        time.sleep(0.05)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("endpoint")
    p.add_argument("report", type=Path)
    p.add_argument("--after", type=Path, help="start once this metrics.jsonl has a round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random", type=int, default=3000)
    p.add_argument("--mutated", type=int, default=3000)
    p.add_argument("--unhosted", type=int, default=1000)
    p.add_argument("--collision", type=int, default=200)
    a = p.parse_args(argv)
    todo = plan(a.seed, a.random, a.mutated, a.unhosted, a.collision)
    if a.after:
        wait_for_round(a.after, 300)
    ctx = zmq.Context()
    socks = {name: _socket(ctx, a.endpoint) for name in ("stranger", "collision", "oversized")}
    tic = time.monotonic()
    for frames, _ in todo["stranger"]:
        socks["stranger"].send_multipart(frames)
    for frames in todo["collision"]:
        socks["collision"].send_multipart(frames)
    for frames in todo["oversized"]:
        socks["oversized"].send_multipart(frames)
    socks["oversized"].setsockopt(zmq.LINGER, 3000)  # each try ends in a disconnect: do not wait long
    report = {
        "expected": dict(Counter(r for _, r in todo["stranger"])),
        "collision": len(todo["collision"]),
        "not_counted": len(todo["oversized"]),
        "sent": len(todo["stranger"]) + len(todo["collision"]) + len(todo["oversized"]),
        "frames": sum(len(f) for f, _ in todo["stranger"])
        + sum(map(len, todo["collision"]))
        + sum(map(len, todo["oversized"])),
        "queued_s": time.monotonic() - tic,
    }
    tmp = a.report.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, a.report)  # queued: the run may end from here on, once these are delivered
    for s in socks.values():
        s.close()
    ctx.term()  # waits (LINGER) until the server has taken everything
    return 0


if __name__ == "__main__":
    sys.exit(main())
