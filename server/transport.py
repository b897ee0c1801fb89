"""The server's socket: a ZeroMQ ROUTER that devices connect to, with byte accounting.

Every message that crosses the socket, either way, is counted here by round, client,
direction and traffic class (model, embedding, encoder, evaluation, control), split
into tensor payload and protocol overhead (header + routing frames). Malformed or
unexpected messages are rejected, logged and counted; they never stop the server.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict
from typing import Callable

import numpy as np
import zmq

from models.wire import TRAFFIC_CLASSES, Message, ProtocolError, decode, encode, frame_bytes
from scenarios.errors import DeviceError

log = logging.getLogger("flt.server")


class DeviceLost(RuntimeError):
    pass


class Ledger:
    """Bytes on the wire: totals per (round, direction, class) and per client."""

    def __init__(self):
        self.rows: dict[tuple[int, str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
        self.per_client: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        self.rejected = 0

    def add(self, rnd: int, client: int, direction: str, traffic: str, payload: int, overhead: int):
        row = self.rows[(rnd, direction, traffic)]
        row[0] += payload
        row[1] += overhead
        row[2] += 1
        if client >= 0:
            self.per_client[client][direction == "up"] += payload + overhead

    def totals(self, since_round: int | None = None) -> dict:
        """{'up': {'model': {'payload': b, 'overhead': b, 'messages': n}, ...}, 'down': ...}"""
        out = {d: {k: {"payload": 0, "overhead": 0, "messages": 0} for k in TRAFFIC_CLASSES}
               for d in ("up", "down")}
        for (rnd, direction, traffic), (pay, over, n) in self.rows.items():
            if since_round is None or rnd >= since_round:
                cell = out[direction][traffic]
                cell["payload"] += pay
                cell["overhead"] += over
                cell["messages"] += n
        return out

    def reset(self):
        self.rows.clear()
        self.per_client.clear()


class Transport:
    def __init__(self, endpoint: str = "tcp://127.0.0.1:*"):
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone device raises, not drops
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ledger = Ledger()
        self.devices: dict[str, dict] = {}          # name -> hello meta
        self.client_device: dict[int, str] = {}     # client id -> device name
        self.lost_devices: set[str] = set()
        self.batches = itertools.count(1)
        self.alive: Callable[[str], bool] = lambda name: True
        self.backlog: list[tuple[str, Message]] = []  # hellos that arrive while waiting for other replies

    # -- raw send / receive -----------------------------------------------------------
    def send(self, device: str, msg: Message) -> None:
        frames = encode(msg)
        payload, header = frame_bytes(frames)
        ident = device.encode()
        try:
            self.sock.send_multipart([ident] + frames, copy=False)
        except zmq.ZMQError as exc:
            raise DeviceLost(f"device {device!r} is not connected ({exc})") from None
        self.ledger.add(msg.round, msg.client, "down", msg.traffic, payload, header + len(ident))

    def recv(self, timeout_s: float) -> tuple[str, Message] | None:
        """Next valid message, or None after timeout. Bad messages are counted and skipped."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                return None
            frames = self.sock.recv_multipart(copy=False)
            ident = bytes(frames[0]).decode(errors="replace")
            try:
                msg = decode(frames[1:])
            except ProtocolError as exc:
                self.ledger.rejected += 1
                log.error("rejected malformed message from %r: %s", ident, exc)
                continue
            if msg.client >= 0 and self.client_device.get(msg.client) not in (None, ident):
                self.ledger.rejected += 1
                log.error("rejected %s from %r for client %d it does not host", msg.kind, ident, msg.client)
                continue
            payload, header = frame_bytes(frames[1:])
            self.ledger.add(msg.round, msg.client, "up", msg.traffic, payload, header + len(frames[0]))
            return ident, msg

    # -- devices ----------------------------------------------------------------------
    def wait_devices(self, n: int, timeout_s: float) -> list[str]:
        """Block until n devices said hello; raise naming how many came."""
        deadline = time.monotonic() + timeout_s
        while len(self.devices) < n:
            got = self.recv(max(0.0, deadline - time.monotonic()))
            if got is None:
                raise DeviceError(f"only {len(self.devices)} of {n} devices connected within {timeout_s:.0f} s")
            self._hello(*got)
        return list(self.devices)

    def _hello(self, ident: str, msg: Message) -> None:
        if msg.kind != "hello":
            log.warning("ignored %s from %r before its hello", msg.kind, ident)
            return
        self.devices[ident] = msg.meta
        log.info("device %s connected (pid %s)", ident, msg.meta.get("pid"))

    def poll_hellos(self) -> list[str]:
        """Devices that connected since the last call (newcomers mid-run)."""
        new = []
        while (got := self.recv(0.0)) is not None:
            if got[1].kind == "hello":
                self._hello(*got)
                new.append(got[0])
        for ident, msg in self.backlog:
            self._hello(ident, msg)
            new.append(ident)
        self.backlog.clear()
        return new

    def broadcast(self, msg: Message, devices=None) -> None:
        for d in devices or self.active_devices():
            self.send(d, msg)

    def active_devices(self) -> list[str]:
        return [d for d in self.devices if d not in self.lost_devices]

    # -- tasks ------------------------------------------------------------------------
    def gather(self, tasks: dict[int, Message], reply: str, timeout_s: float,
               on_reply: Callable[[int, Message], None] | None = None) -> dict[int, Message]:
        """Send one message per client, collect one reply per client.

        Each device learns its cohort size from the header, so it can process its
        clients in one call. Returns the replies that came before the deadline; clients
        whose device died or timed out are logged and left out."""
        batch = next(self.batches)
        by_device: dict[str, list[int]] = defaultdict(list)
        for cid in tasks:
            by_device[self.client_device[cid]].append(cid)
        waiting: set[int] = set()
        for device, cids in by_device.items():
            if device in self.lost_devices:
                continue
            try:
                for cid in cids:
                    msg = tasks[cid]
                    msg.meta = {**msg.meta, "batch": batch, "cohort": len(cids)}
                    self.send(device, msg)
                waiting.update(cids)
            except DeviceLost as exc:
                self._lose(device, str(exc))
        results: dict[int, Message] = {}
        deadline = time.monotonic() + timeout_s
        while waiting:
            got = self.recv(min(0.5, max(0.0, deadline - time.monotonic())))
            if got is None:
                self._drop_dead(waiting)
                if time.monotonic() >= deadline:
                    log.error("%s: %d clients did not answer within %.0f s: %s", reply, len(waiting),
                              timeout_s, sorted(waiting)[:20])
                    break
                continue
            ident, msg = got
            if msg.kind == "hello":
                self.backlog.append((ident, msg))
            elif msg.meta.get("batch") != batch or msg.client not in waiting:
                log.warning("stale or unexpected %s from %r (client %d) ignored", msg.kind, ident, msg.client)
            elif msg.kind == "error":
                log.error("client %d on %s failed: %s", msg.client, ident, msg.meta.get("reason"))
                waiting.discard(msg.client)
            elif msg.kind != reply:
                self.ledger.rejected += 1
                log.error("expected %s from client %d, got %s", reply, msg.client, msg.kind)
            else:
                waiting.discard(msg.client)
                results[msg.client] = msg
                if on_reply:
                    on_reply(msg.client, msg)
        return results

    def _drop_dead(self, waiting: set[int]) -> None:
        for device in {self.client_device[c] for c in waiting}:
            if not self.alive(device):
                self._lose(device, "process exited")
                waiting.difference_update(c for c in list(waiting) if self.client_device[c] == device)

    def _lose(self, device: str, why: str) -> None:
        if device in self.lost_devices:
            return
        self.lost_devices.add(device)
        lost = sorted(c for c, d in self.client_device.items() if d == device)
        log.error("device %s lost (%s); continuing without its %d clients %s", device, why,
                  len(lost), _ranges(lost))

    def forget(self, device: str) -> None:
        """A device that left on purpose (a method's newcomers): its clients are unhosted."""
        self.devices.pop(device, None)
        for c in [c for c, d in self.client_device.items() if d == device]:
            del self.client_device[c]

    def lost_clients(self) -> np.ndarray:
        return np.array(sorted(c for c, d in self.client_device.items() if d in self.lost_devices), dtype=np.int64)

    def close(self) -> None:
        for d in self.active_devices():
            try:
                self.send(d, Message("shutdown"))
            except DeviceLost:
                pass
        self.sock.close(linger=500)


def _ranges(ids: list[int]) -> str:
    if not ids:
        return "[]"
    return f"[{ids[0]}..{ids[-1]}]" if ids == list(range(ids[0], ids[-1] + 1)) else str(ids[:20])
