"""The server's socket: a ZeroMQ ROUTER that devices connect to, with byte accounting.

Every message that crosses the socket, either way, is counted here by round, client,
direction and traffic class (model, embedding, encoder, evaluation, control), split
into tensor payload and protocol overhead (header + routing frames). Malformed or
unexpected messages are rejected, counted by reason with their bytes (apart from every
method's traffic), logged at a bounded rate and dropped at once; they never stop the
server.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet

import numpy as np
import zmq

from flt.common.errors import DeviceError, FltError, short
from flt.common.interrupts import deferred_interrupt
from flt.common.wire import (
    MAX_HEADER_BYTES,
    TRAFFIC_CLASSES,
    Message,
    ProtocolError,
    decode,
    encode,
    frame_bytes,
    receive,
)
from flt.server.auth import Gate, Refused
from flt.server.routing import spread

log = logging.getLogger("flt.server")


class DeviceLost(RuntimeError):
    pass


SETUP_KINDS = ("hello", "ready", "error")  # what a device sends outside a task
PINNING_KINDS = ("drift", "state")  # what gives a client's host more than the shard the others hold
LOG_FIRST, LOG_EVERY_S = 5, 10.0  # rejections logged one by one, then summarised
# ZeroMQ queues about 2,000 messages for a peer (its send and receive high-water marks), then a
# send blocks until the peer reads: a device that stops reading would hang the server. A live
# device reads every task as it comes (it computes only once a batch is whole), so a queue
# still full after this long means the device is stuck: it is lost, the run goes on.
SEND_TIMEOUT_S = 30.0
# A connection that answers no ping for HEARTBEAT_S[1] seconds (pinged every HEARTBEAT_S[0])
# is closed: its device is frozen or its host is gone without closing the connection (libzmq
# answers pings in its own thread, so a device busy computing still does). The next send
# to it finds it lost, so a vanished device stops costing every exchange a timeout. A
# shorter stop only makes a device late (Transport._resend).
HEARTBEAT_S = (10.0, 60.0)
# A gather's timeout is a liveness guard: a device on this machine still using CPU when it
# runs out is waited for, window after window, up to PATIENCE timeouts in all. Windows under
# MIN_JUDGED_S are cut as before: /proc counts CPU time in 1/100 s ticks.
PATIENCE = 30
MIN_JUDGED_S = 1.0
# A method's batch ids: 16 digits each for the first nine million methods of a run, a
# billion ids each (a round takes one or a few)
FIRST_METHOD_BATCH, METHOD_BATCHES = 10**15, 10**9


class Rejections:
    """Messages the server read but did not accept, and their bytes, by reason."""

    def __init__(self):
        self.by_reason: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # reason -> [messages, bytes]

    def add(self, reason: str, nbytes: int) -> int:
        """Count one message; returns how many of this reason so far."""
        row = self.by_reason[reason]
        row[0] += 1
        row[1] += nbytes
        return row[0]

    @property
    def messages(self) -> int:
        return sum(n for n, _ in self.by_reason.values())

    def summary(self) -> dict:
        return {
            "rejected_messages": self.messages,
            "rejected_bytes": sum(b for _, b in self.by_reason.values()),
            "rejected_reasons": {r: {"messages": n, "bytes": b} for r, (n, b) in sorted(self.by_reason.items())},
        }


class Ledger:
    """Bytes on the wire: totals per (round, direction, class) and per client. Rejected
    messages are kept apart (`rejections`): they are never a method's traffic."""

    def __init__(self):
        self.rows: dict[tuple[int, str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
        self.per_client: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        self.rejections = Rejections()

    @property
    def rejected(self) -> int:
        return self.rejections.messages

    def add(self, rnd: int, client: int, direction: str, traffic: str, payload: int, overhead: int) -> None:
        row = self.rows[(rnd, direction, traffic)]
        row[0] += payload
        row[1] += overhead
        row[2] += 1
        if client >= 0:
            self.per_client[client][direction == "up"] += payload + overhead

    def totals(self, since_round: int | None = None) -> dict:
        """{'up': {'model': {'payload': b, 'overhead': b, 'messages': n}, ...}, 'down': ...}"""
        out = {d: {k: {"payload": 0, "overhead": 0, "messages": 0} for k in TRAFFIC_CLASSES} for d in ("up", "down")}
        for (rnd, direction, traffic), (pay, over, n) in self.rows.items():
            if since_round is None or rnd >= since_round:
                cell = out[direction][traffic]
                cell["payload"] += pay
                cell["overhead"] += over
                cell["messages"] += n
        return out

    def reset(self) -> None:
        self.rows.clear()
        self.per_client.clear()
        self.rejections = Rejections()


class Transport:
    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:*",
        gate: Gate | None = None,
        max_inbound: int = MAX_HEADER_BYTES,
        send_timeout_s: float = SEND_TIMEOUT_S,
        heartbeat_s: tuple[float, float] = HEARTBEAT_S,
    ):
        self.gate = gate or Gate(curve=False)  # who may connect, under which name (server/auth.py)
        self.ctx = self.gate.ctx
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone device raises, not drops
        self.sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))  # zmq.Again: it stopped reading
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s[0] * 1000))  # before bind, as CURVE's
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_s[1] * 1000))
        self.gate.secure(self.sock)  # CURVE must be set before bind
        self._limit_inbound(max_inbound)  # so must the size limit: the listener copies it
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError as exc:  # a typo in the address, or a port another program holds
            self.sock.close()
            raise FltError(f"devices.bind: cannot listen on {short(endpoint)}: {exc.strerror}") from None
        # the server names each connection (routing ids are libzmq's, never the device's choice)
        self.routes: dict[str, bytes] = {}  # device name -> routing id
        self.names: dict[bytes, str] = {}  # routing id -> device name
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ledger = Ledger()
        self.devices: dict[str, dict] = {}  # name -> hello meta
        self.client_device: dict[int, str] = {}  # client id -> device name (its host)
        self.holders: dict[int, tuple[str, ...]] = {}  # client id -> devices holding its shard
        self.pinned: set[int] = set()  # clients whose host now holds more than the shard (routing.py)
        self.sent_to: dict[int, str] = {}  # client id -> device its latest task went to, if not its host
        self.moved = 0  # tasks run by a device other than their client's host, over the run
        self.resent = 0  # tasks sent again, unbilled, because their device was late (_resend, `again`)
        self.lost_devices: set[str] = set()
        self.late: set[str] = set()  # owed replies when an exchange timed out; until they next send (routing.py)
        self._was_late: set[str] = set()  # late at least once this run (warned)
        self.lost_why: dict[str, str] = {}  # device -> why it was lost, for the run's last error
        self.batches = itertools.count(1)  # set-up's; each method takes its own range (start_method)
        # the emulator's own exchanges (checkpoint snapshots) count down from -2, apart from
        # the method's ids (-1 marks an error reply without one): how often a run checkpoints
        # must not shift the ids, whose digits are in every billed header
        self.own_batches = itertools.count(-2, -1)
        self.alive: Callable[[str], bool] = lambda name: True
        self.cpu_seconds: Callable[[str], float | None] = lambda name: None  # the fleet's, where it can tell
        self.rejections = Rejections()  # the whole run's; the ledger's are per method
        self._logged_at: dict[str, float] = {}  # reason -> when its last summary line was logged
        # the batch, clients and devices of a gather that an interrupt (Ctrl-C, SIGTERM) cut
        # short: their replies still come, expected, while the run closes
        self._owed: tuple[int, set[int], dict[int, str]] | None = None
        # replies due to a wait that may be interrupted (`expecting`): (kind, from which devices)
        self._due: list[tuple[str, set[str] | None]] = []

    # -- raw send / receive -----------------------------------------------------------
    def send(self, device: str, msg: Message, billed: bool = True) -> None:
        frames = encode(msg)
        payload, header = frame_bytes(frames)
        ident = self.routes.get(device)
        if ident is None:
            raise DeviceLost(f"device {device!r} never connected")
        with deferred_interrupt():  # whole or not at all, and billed when sent (common/interrupts.py)
            try:
                self.sock.send_multipart([ident, *frames], copy=False)
            except zmq.Again:  # raised before any frame is queued: the socket stays clean
                raise DeviceLost(f"device {device!r} stopped reading (its queue stayed full)") from None
            except zmq.ZMQError as exc:
                raise DeviceLost(f"device {device!r} is not connected ({exc})") from None
            if billed:
                self.ledger.add(msg.round, msg.client, "down", msg.traffic, payload, header + len(ident))
        if msg.kind in PINNING_KINDS and (msg.kind == "drift" or msg.tensors or msg.meta.get("flag")):
            self.pinned.add(msg.client)  # its data moved, or its host keeps a model or flag for it

    def _limit_inbound(self, largest_message: int) -> None:
        """ZeroMQ drops a frame larger than the run's largest legitimate inbound frame (a
        model, or a header at its cap) and disconnects its peer, before the server reads or
        allocates it."""
        limit = int(max(largest_message, MAX_HEADER_BYTES)) + self.gate.frame_overhead  # CURVE's wrapping
        self.sock.setsockopt(zmq.MAXMSGSIZE, limit)

    def recv(
        self,
        timeout_s: float,
        kinds: Collection[str] = SETUP_KINDS,
        awaited: Callable[[str], bool] = lambda device: True,
    ) -> tuple[str, Message] | None:
        """Next valid message of one of `kinds` from an `awaited` device, counted in the
        ledger, or None after the timeout. Anything else is rejected, counted by reason and
        dropped: never billed."""
        deadline = time.monotonic() + timeout_s
        while (got := self._next(deadline)) is not None:
            ident, msg, size = got
            if msg.kind not in kinds:
                self.reject("unexpected kind", ident, size, f"{msg.kind} (client {msg.client})")
            elif not awaited(ident):
                self.reject("not awaited", ident, size, f"{msg.kind} from a device no wait is for")
            else:
                self._account(msg, size)
                return ident, msg
        return None

    def _next(self, deadline: float) -> tuple[str, Message, tuple[int, int]] | None:
        """Next message that decodes, comes from a device that said hello (or is a hello)
        and, if it names a client, from the device hosting it; not yet accounted.
        Returns (device, message, (payload, overhead bytes))."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                return None
            frames, user_id = receive(self.sock, user_id=self.gate.curve)
            rid = bytes(frames[0])
            ident = self.names.get(rid) or _peer(rid)
            try:
                msg = decode(frames[1:])
            except ProtocolError as exc:
                self.reject("malformed", ident, (sum(len(f) for f in frames), 0), str(exc))
                continue
            payload, header = frame_bytes(frames[1:])
            size = (payload, header + len(frames[0]))
            if msg.kind == "hello" and rid not in self.names:
                admitted = self._admit(rid, user_id, msg, size)
                if admitted is None:
                    continue
                ident = admitted
            if msg.kind != "hello" and ident not in self.devices:
                self.reject("unknown device", ident, size, f"{msg.kind} (client {msg.client})")
                continue
            if ident in self.late:  # anything it sends, a stale reply too: it is back
                self.late.discard(ident)
                log.info("%s answers again: it takes moved tasks again", ident)
            if msg.client >= 0 and ident not in (self.client_device.get(msg.client), self.sent_to.get(msg.client)):
                self.reject("wrong client", ident, size, self._whose(msg))
            else:
                return ident, msg, size

    def _mark_late(self, devices: set[str]) -> None:
        """Devices that left replies owed at a timeout: until they next send anything,
        their movable tasks run on other holders of the shards, and none is moved to them."""
        for device in sorted(devices - self.late - self.lost_devices):
            log.log(
                logging.INFO if device in self._was_late else logging.WARNING,  # warned once a run: a short
                # timeout can make a device late at every exchange
                "%s is late: until it answers again, its clients' movable tasks (training, evaluation of a "
                "sent model) run on other devices holding their shards",
                device,
            )
        self.late |= devices - self.lost_devices
        self._was_late |= self.late

    def _whose(self, msg: Message) -> str:
        host, sent = self.client_device.get(msg.client), self.sent_to.get(msg.client)
        return f"{msg.kind} for client {msg.client}, hosted by {host!r}" + (f", task sent to {sent!r}" if sent else "")

    def _account(self, msg: Message, size: tuple[int, int]) -> None:
        self.ledger.add(msg.round, msg.client, "up", msg.traffic, *size)

    def reject(self, reason: str, ident: str, size: tuple[int, int], detail: str, quiet: bool = False) -> None:
        """Count a message the server will not use, apart from every method's traffic, and
        log it (unless `quiet`: the caller says it in its own line): the first few of each
        reason one by one, then one line per reason at most every LOG_EVERY_S seconds (a
        flood must not flood the log)."""
        nbytes = sum(size)
        self.ledger.rejections.add(reason, nbytes)
        n = self.rejections.add(reason, nbytes)
        now = time.monotonic()
        if quiet:
            return
        if n <= LOG_FIRST:
            log.warning("rejected (%s) from %s: %s", reason, short(ident, 40), short(detail, 300))
        elif now - self._logged_at.get(reason, 0.0) >= LOG_EVERY_S:
            log.warning(
                "rejected %d messages so far for %s (latest from %s: %s)",
                n,
                reason,
                short(ident, 40),
                short(detail, 120),
            )
        else:
            return
        self._logged_at[reason] = now

    # -- devices ----------------------------------------------------------------------
    def _admit(self, rid: bytes, user_id: str | None, msg: Message, size: tuple[int, int]) -> str | None:
        """A new connection's hello: the gate names it (its CURVE key's name, or a name with
        the right token) or refuses it; a refused hello gets no answer and is counted."""
        try:
            name = self.gate.admit(msg.meta, user_id, taken=self.routes)
        except Refused as exc:
            claim = user_id or short(msg.meta.get("name"), 70)  # with CURVE, the key's name
            self.reject(str(exc), _peer(rid), size, f"hello claiming {claim}")
            return None
        self.routes[name], self.names[rid] = rid, name
        msg.meta.pop("token", None)  # checked; kept nowhere
        return name

    @contextlib.contextmanager
    def expecting(self, kind: str, devices: Collection[str] | None = None) -> Iterator[None]:
        """Replies of `kind` (or an error in their place) are due while the block waits for
        them: one from each of `devices`, or (None) a hello from each device still starting
        (launched, or awaited from other hosts). An interrupt in the block leaves them still
        to come while the run closes: `drain` counts them as the run's own, apart, not as a
        stray peer's."""
        due = (kind, None if devices is None else set(devices))
        self._due.append(due)
        stopped = False
        try:
            yield
        except KeyboardInterrupt:
            stopped = True
            raise
        finally:
            if not stopped:
                self._due.remove(due)

    def _was_due(self, ident: str, msg: Message) -> bool:
        """Whether `msg` is a reply an interrupted `expecting` block was owed (used up)."""
        for kind, devices in self._due:
            if msg.kind in (kind, "error") and (ident not in self.devices if devices is None else ident in devices):
                if devices is not None:
                    devices.discard(ident)  # one each: a second one is stale
                return True
        return False

    def wait_devices(self, n: int, timeout_s: float) -> list[str]:
        """Block until n devices said hello; raise naming how many came."""
        deadline = time.monotonic() + timeout_s
        with self.expecting("hello"):
            while len(self.devices) < n:
                got = self.recv(max(0.0, deadline - time.monotonic()))
                if got is None:
                    raise DeviceError(f"only {len(self.devices)} of {n} devices connected within {timeout_s:g} s")
                self._hello(*got)
        return list(self.devices)

    def _hello(self, ident: str, msg: Message) -> None:
        if msg.kind != "hello":
            log.warning("ignored %s from %r before its hello", msg.kind, ident)
            return
        self.devices[ident] = msg.meta
        log.info("device %s connected (pid %s)", ident, msg.meta.get("pid"))

    def broadcast(self, msg: Message, devices: Iterable[str] | None = None) -> None:
        for d in devices or self.active_devices():
            self.deliver(d, msg)

    def deliver(self, device: str, msg: Message) -> bool:
        """`send` to a device that may be gone: a lost device is skipped, and one found gone
        now is lost; the run goes on without it. Whether the message went."""
        if device in self.lost_devices:
            return False
        try:
            self.send(device, msg)
        except DeviceLost as exc:
            self.lose(device, str(exc))
            return False
        return True

    def active_devices(self) -> list[str]:
        return [d for d in self.devices if d not in self.lost_devices]

    # -- tasks ------------------------------------------------------------------------
    def gather(
        self,
        tasks: dict[int, Message],
        reply: str | Mapping[int, str],
        timeout_s: float,
        on_reply: Callable[[int, Message], None] | None = None,
        check: Callable[[int, Message], tuple[str, str] | None] | None = None,
        own: bool = False,
        movable: Collection[int] = (),
        cost: Callable[[int], float] | None = None,
        strict: bool = False,
        again: Collection[int] = (),
    ) -> dict[int, Message]:
        """Send one message per client, collect one reply per client (of kind `reply`, or
        `reply[client]` when the clients were asked different things).

        The header marks each device's last message ("last": 0/1, the same size
        whatever the split), so it can process its clients in one call. Returns the replies
        that came before the deadline; clients whose device died or timed out are logged
        and left out. `check(client, reply)` returns (reason, detail) for a reply whose
        content the server knows is wrong: it is rejected like a malformed one, and its
        client left out. `own`: an exchange of the emulator's, not of the method (its batch
        ids come from a sequence of their own). `movable`: clients whose task may run on any
        live device holding their shard (server/routing.py), spread by `cost` (1 each by
        default); every other task goes to the client's host.

        `timeout_s` is a liveness guard, not a deadline: while a device on this machine that
        owes replies is still using CPU, the wait goes on (up to `PATIENCE` times
        `timeout_s`), so a slow or busy machine drops no client and changes no result. A
        device that still owes replies when it runs out is late (`_mark_late`): its movable
        tasks go once more, unbilled, to other holders of their shards (`_resend`), and the
        wait goes on for them. `strict`: cut at `timeout_s` whatever the devices do
        (real-time mode's deadline). `again`: clients whose task repeats one they left
        unanswered (a method asking a late client once more): sent unbilled too, their
        replies billed as any."""
        batch = next(self.own_batches if own else self.batches)
        home = {c: self.client_device[c] for c in tasks}
        movable = [c for c in movable if c in tasks and c not in self.pinned]
        dest = home
        if movable:
            dest = spread(home, movable, self.holders, self.active_devices(), cost or (lambda c: 1.0), self.late)
        waiting: set[int] = set()
        # owed from the first send on, not only once the wait starts: a checkpoint's gather
        # follows the round's record at once, so an interrupt timed by that record falls here
        self._owed = (batch, waiting, dest)  # stays only if an interrupt ends the gather
        self._send_tasks(tasks, dest, batch, waiting, again=frozenset(again))
        results: dict[int, Message] = {}
        start = time.monotonic()
        deadline = start + timeout_s
        marks = None if strict or timeout_s < MIN_JUDGED_S else self._cpu_marks({dest[c] for c in waiting})
        resent = 0
        while waiting:
            got = self._next(min(time.monotonic() + 0.5, deadline))
            if got is None:
                self._drop_dead(waiting, dest)
                if time.monotonic() >= deadline:
                    if marks is not None and self._still_computing(waiting, dest, marks, timeout_s, start):
                        deadline = time.monotonic() + timeout_s
                        continue
                    if not strict:  # a real-time deadline's stragglers are the emulation, not a fault
                        self._mark_late({dest[c] for c in waiting})
                        if not resent and (resent := self._resend(tasks, waiting, dest, movable, batch, cost)):
                            deadline = time.monotonic() + timeout_s
                            marks = marks and self._cpu_marks({dest[c] for c in waiting})
                            continue
                    log.error(
                        "%s: %d clients did not answer within %.1f s (timeout %g s): %s",
                        reply if isinstance(reply, str) else "/".join(sorted(set(reply.values()))),
                        len(waiting),
                        time.monotonic() - start,
                        timeout_s,
                        sorted(waiting)[:20],
                    )
                    break
                continue
            ident, msg, size = got
            # its host, when the task went elsewhere (a late host's answer to an older
            # exchange's task is stale: `_unwanted` says so)
            if msg.client in waiting and ident != dest[msg.client] and msg.meta.get("batch") == batch:
                self.reject("wrong client", ident, size, self._whose(msg))
                continue
            expected = reply if isinstance(reply, str) else reply.get(msg.client, "")
            unwanted = self._unwanted(msg, batch, waiting, expected)
            if unwanted:
                self.reject(unwanted[0], ident, size, f"{msg.kind} for client {msg.client}: {unwanted[1]}")
                if msg.kind == "hello" and ident not in self.devices:
                    self.forget(ident)  # named on arrival, never a device: keep nothing of it
                continue
            wrong = check(msg.client, msg) if check and msg.kind == expected else None
            if wrong:
                self.reject(wrong[0], ident, size, f"{msg.kind} for client {msg.client}: {wrong[1]}")
                waiting.discard(msg.client)  # its one reply was wrong: no other will come
                continue
            self._account(msg, size)
            waiting.discard(msg.client)
            if msg.kind == "error":
                log.error("client %d on %s failed: %s", msg.client, ident, short(msg.meta.get("reason"), 300))
                continue
            results[msg.client] = msg
            if on_reply:
                on_reply(msg.client, msg)
        self._owed = None
        return results

    def _send_tasks(
        self,
        tasks: dict[int, Message],
        dest: Mapping[int, str],
        batch: int,
        waiting: set[int],
        billed: bool = True,
        again: AbstractSet[int] = frozenset(),
    ) -> None:
        """Send the tasks of the clients in `dest` to their devices, as `batch`, each
        device's last one marked, unbilled where `billed` is False or the client is in
        `again`; a device found gone is lost and its clients are no longer awaited."""
        by_device: dict[str, list[int]] = defaultdict(list)
        for cid, device in dest.items():
            by_device[device].append(cid)
        for device, cids in by_device.items():
            if device in self.lost_devices:
                continue
            try:
                for i, cid in enumerate(cids):
                    msg = tasks[cid]
                    msg.meta = {**msg.meta, "batch": batch, "last": int(i == len(cids) - 1)}
                    waiting.add(cid)  # before the send: an interrupt held back through it comes right after
                    self.send(device, msg, billed and cid not in again)
                    self.resent += cid in again
                    if device == self.client_device[cid]:
                        self.sent_to.pop(cid, None)
                    else:
                        self.sent_to[cid] = device
                        self.moved += 1
            except DeviceLost as exc:
                waiting.difference_update(cids)
                self.lose(device, str(exc))

    def _resend(
        self,
        tasks: dict[int, Message],
        waiting: set[int],
        dest: dict[int, str],
        movable: list[int],
        batch: int,
        cost: Callable[[int], float] | None,
    ) -> int:
        """At a timeout, once per exchange: the awaited movable tasks of devices now late,
        sent again to other devices holding the shards, so that a frozen device costs no
        update (a task's result does not depend on where it runs). Not billed: a broken
        device must not cost the method traffic. How many tasks went again."""
        stuck = {c: dest[c] for c in sorted(waiting.intersection(movable))}
        again = spread(stuck, stuck, self.holders, self.active_devices(), cost or (lambda c: 1.0), self.late)
        moved = {c: d for c, d in again.items() if d != stuck[c]}
        if not moved:
            return 0
        log.warning(
            "%d tasks sent again to other devices holding their shards (clients %s)", len(moved), sorted(moved)[:20]
        )
        dest.update(moved)  # before the sends: an interrupt expects their replies from there
        self._send_tasks(tasks, moved, batch, waiting, billed=False)
        self.resent += len(moved)
        return len(moved)

    @staticmethod
    def _unwanted(msg: Message, batch: int, waiting: set[int], reply: str) -> tuple[str, str] | None:
        """Why a message from a valid device is not a reply this gather wants, or None."""
        if msg.kind == "hello":  # devices join only while the emulator waits for them
            return "hello mid-run", "not waiting for devices"
        if msg.meta.get("batch") != batch or msg.client not in waiting:
            return "stale", f"batch {short(msg.meta.get('batch'), 20)}, now {batch}"
        if msg.kind not in (reply, "error"):
            return "unexpected kind", f"expected {reply}"
        return None

    def drain(self, quiet_s: float = 0.2, max_s: float = 2.0) -> None:
        """Read what is still queued when the run ends, so that every message that arrived
        is counted (no task waits for any of it), for at most `max_s`: a flood cannot
        hold the run open. The replies that an interrupted gather was owed, each from the
        device its task went to, and those an interrupted `expecting` block waited for
        (hellos of devices still starting, devices' `ready`), are expected: counted apart
        and logged in one line."""
        batch, owed, dest = self._owed or (None, set(), {})
        late, end = 0, time.monotonic() + max_s
        while (got := self._next(min(end, time.monotonic() + quiet_s))) is not None:
            ident, msg, size = got
            replied = msg.meta.get("batch") == batch and msg.client in owed and dest[msg.client] == ident
            if replied:
                owed.discard(msg.client)  # one reply each: a second one is stale
            if replied or self._was_due(ident, msg):
                self.reject("after the interrupt", ident, size, "", quiet=True)
                late += 1
                continue
            self.reject(
                "hello mid-run" if msg.kind == "hello" else "stale",
                ident,
                size,
                f"{msg.kind} for client {msg.client} after the last task",
            )
        if late:
            log.info("%d replies to the interrupted round's tasks or wait for devices came after it stopped", late)

    def _cpu_marks(self, devices: set[str]) -> dict[str, float]:
        """Each device's CPU seconds now, where they can be read (processes on this machine)."""
        return {d: t for d in devices if (t := self.cpu_seconds(d)) is not None}

    def _still_computing(
        self, waiting: set[int], dest: Mapping[int, str], marks: dict[str, float], window_s: float, start: float
    ) -> bool:
        """Whether a device that owes replies used a tenth of a core or more since its mark
        (an idle device polls its socket: almost none), before PATIENCE timeouts have gone
        by; the marks move on to now."""
        if time.monotonic() - start >= PATIENCE * window_s:
            return False
        now = self._cpu_marks({dest[c] for c in waiting})
        busy = sorted(d for d, t in now.items() if d in marks and t - marks[d] >= 0.1 * window_s)
        marks.update(now)
        if busy:
            waited, who = time.monotonic() - start, ", ".join(busy)
            log.warning("%s still computing after %.0f s (timeout %g s): waiting for it", who, waited, window_s)
        return bool(busy)

    def _drop_dead(self, waiting: set[int], dest: Mapping[int, str]) -> None:
        for device in {dest[c] for c in waiting}:
            if not self.alive(device):
                self.lose(device, "process exited")
                waiting.difference_update(c for c in list(waiting) if dest[c] == device)

    def lose(self, device: str, why: str) -> None:
        """Go on without `device`: its clients get no more requests, and say so once."""
        if device in self.lost_devices:
            return
        self.lost_devices.add(device)
        self.lost_why[device] = why
        lost = sorted(c for c, d in self.client_device.items() if d == device)
        log.error("device %s lost (%s); continuing without its %d clients %s", device, why, len(lost), _ranges(lost))

    def require_hosts(self, after_round: int) -> None:
        """Stop the run (DeviceError) once every device that hosts a client is lost: no
        client is left to train, and a lost device never rejoins mid-run."""
        hosts = set(self.client_device.values())
        if not hosts or hosts - self.lost_devices:
            return
        why = "; ".join(f"{d}: {self.lost_why.get(d, 'lost')}" for d in sorted(hosts)[:4])
        raise DeviceError(
            f"every device is lost ({why}{'; ...' if len(hosts) > 4 else ''}): no client is left to "
            f"train, so the run stops after round {after_round}; the rounds so far are in the run folder"
        )

    def forget(self, device: str) -> None:
        """A device that left on purpose (a method's newcomers): its clients are unhosted."""
        self.devices.pop(device, None)
        self.names.pop(self.routes.pop(device, b""), None)
        for c in [c for c, d in self.client_device.items() if d == device]:
            del self.client_device[c]
            self.holders.pop(c, None)
        for c in [c for c, d in self.sent_to.items() if d == device]:
            del self.sent_to[c]

    @contextlib.contextmanager
    def unbilled(self) -> Iterator[Ledger]:
        """Exchanges of the emulator's own (checkpoint snapshots, drift delivery) count in
        a ledger of their own, never the method's; yields the method's, which stays in
        force again afterwards."""
        billed, self.ledger = self.ledger, Ledger()
        try:
            yield billed
        finally:
            self.ledger = billed

    def start_method(self, index: int) -> None:
        """The `index`-th method of the run takes batch ids from a range of its own, all of
        one width: a late reply of an earlier method is never taken for its own, and, ids
        being in every billed header, its bytes do not depend on the methods run before it."""
        self.batches = itertools.count(FIRST_METHOD_BATCH + index * METHOD_BATCHES)

    def next_batch(self) -> int:
        """The batch id the method's next exchange will take (peeked, not consumed)."""
        batch = next(self.batches)
        self.batches = itertools.count(batch)
        return batch

    def lost_clients(self) -> np.ndarray:
        return np.array(sorted(c for c, d in self.client_device.items() if d in self.lost_devices), dtype=np.int64)

    def close(self) -> None:
        self.drain()
        self.sock.setsockopt(zmq.SNDTIMEO, 0)  # a device that stopped reading gets no shutdown, and no wait
        for d in self.devices:  # lost ones too: one that still listens (a late or rogue device) should go
            with contextlib.suppress(DeviceLost):
                self.send(d, Message("shutdown"))
        self.gate.close(self.sock)


def _peer(rid: bytes) -> str:
    """How logs name a connection that has no device name (yet)."""
    return f"peer-{rid.hex()[:16]}"


def _ranges(ids: list[int]) -> str:
    if not ids:
        return "[]"
    return f"[{ids[0]}..{ids[-1]}]" if ids == list(range(ids[0], ids[-1] + 1)) else str(ids[:20])
