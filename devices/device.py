"""A device process: hosts many virtual clients and serves the server's tasks.

It connects a DEALER socket to the server's ROUTER, says hello, receives its clients'
shard indices (never their data), loads the data itself from its own data root, and
then answers tasks until told to shut down. Tasks of one kind and round arrive one
message per client (so bytes are counted per client, as on real edge devices); the
header marks the last one of this device's cohort (a 0/1 flag, so a header's size does
not depend on how clients are spread over devices), and the device processes the whole
cohort in one vectorized call once it is in.

Run by hand on another host:  flt device --connect tcp://SERVER:5555 --data-root DIR
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zmq

from flt.common.determinism import deterministic_kernels
from flt.common.heap import limit_heap_retention, skip_triton, working_heap
from flt.common.interrupts import deferred_interrupt
from flt.common.keys import Credentials, HandshakeWatch
from flt.common.wire import Message, ProtocolError, decode, encode, receive
from flt.devices import ops
from flt.devices.trainer import CohortTrainer
from flt.devices.watch import Watch
from flt.models.flat import param_spec
from flt.models.nets import build_model
from flt.scenarios.datasets import load_shared
from flt.scenarios.shift import ClientShift, client_shifts

log = logging.getLogger("flt.device")
# malformed messages, none valid, before a device gives up on its --connect address: an flt
# server sends none, but libzmq reads any byte stream that does not open with ZMTP 3's
# greeting as ZMTP 1.0 frames, so a port of another program fed it garbage for ever
NOT_A_SERVER = 20


@dataclass
class Shard:
    """One client's data: indices into the device's shared uint8 splits, and its own
    labels (drift may swap them). ``x`` and ``x_test`` are float32 [n, C, H, W] in [0, 1],
    made on each access for the task at hand: no float copy outlives its cohort."""

    images: Images
    idx: torch.Tensor  # int64 [n] into images
    y: torch.Tensor  # int64 [n]
    test_images: Images
    idx_test: torch.Tensor
    y_test: torch.Tensor
    shift: ClientShift | None = None  # feature shift, applied to each float copy

    @property
    def x(self) -> torch.Tensor:
        x = self.images.floats(self.idx)
        return x if self.shift is None else self.shift.images(x, split=0)

    @property
    def pixels(self) -> torch.Tensor:
        """The training images as stored (uint8, a quarter of x's bytes), for the trainer,
        which scales each batch as x would have been (devices/trainer.py); x itself when a
        feature shift transforms them."""
        return self.images.raw(self.idx) if self.shift is None else self.x

    @property
    def x_test(self) -> torch.Tensor:
        x = self.test_images.floats(self.idx_test)
        return x if self.shift is None else self.shift.images(x, split=1)


def process_gone(pid: int) -> bool:
    """Whether the emulator that started us has ended. It is not always our parent (a
    forked device's parent is the fork server), so its pid is checked, not getppid()."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # it exists, as another user
    try:  # killed but not yet reaped by its own parent: a zombie
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False  # no /proc (macOS): os.kill said it exists


class Images:
    """One split's uint8 images, held once per device process: on the CPU a read-only
    memory map that the host's device processes share (scenarios.datasets.load_shared),
    on a GPU one copy in its memory."""

    def __init__(self, x: np.ndarray, device: torch.device):
        if x.dtype != np.uint8:  # every loader's promise (scenarios/datasets.py); raw() relies on it
            raise TypeError(f"images must be uint8, not {x.dtype}")
        self.device = device
        self.host = x if device.type == "cpu" else None
        if self.host is None:
            with warnings.catch_warnings():  # the map is read-only; torch only copies from it here
                warnings.simplefilter("ignore", UserWarning)
                self.gpu = torch.from_numpy(x).to(device)

    def raw(self, idx: torch.Tensor) -> torch.Tensor:
        """The images at idx as stored: uint8, a copy."""
        return self.gpu[idx] if self.host is None else torch.from_numpy(np.take(self.host, idx.numpy(), axis=0))

    def floats(self, idx: torch.Tensor) -> torch.Tensor:
        """The images at idx as float32 in [0, 1] (x.float() / 255, the same values whenever made)."""
        return self.raw(idx).float().div_(255)


class Device:
    def __init__(
        self,
        endpoint: str,
        name: str | None = None,
        data_root: str | None = None,
        threads: int = 1,
        parent_pid: int | None = None,
        crash_at_round: int | None = None,
        credentials: Credentials | None = None,
    ):
        self.credentials = credentials or Credentials()
        self.name = self.credentials.name or name or f"{socket.gethostname()}-{os.getpid()}"
        if name and self.credentials.name and name != self.credentials.name:
            log.warning("the server names this device by its key file: %s, not %s", self.name, name)
        self.data_root, self.parent_pid, self.endpoint = data_root, parent_pid, endpoint
        torch.set_num_threads(max(1, threads))
        self.ctx: zmq.Context = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)  # no routing id of our own: the server names us
        self.sock.setsockopt(zmq.LINGER, 2000)
        if self.credentials.curve:
            self.credentials.secure(self.sock)
        self.handshakes = HandshakeWatch(self.sock, self.credentials.curve)  # refused: say why, exit
        self.sock.connect(endpoint)
        self.shards: dict[int, Shard] = {}  # every client this device may train (server/routing.py)
        self.hosted: set[int] = set()  # those whose state (drift, flags, Local's model) lives here
        self.resident: dict[int, torch.Tensor] = {}  # per-client models kept on the device (Local)
        self.init: torch.Tensor | None = None  # the run's initial weights (sent with reset)
        self.flags: set[int] = set()  # clients whose data moved since they last embedded
        self.watch = Watch()  # what each client embedded, to notice its data moving (devices/watch.py)
        self.pending: dict[int, list[Message]] = {}  # batch id -> messages of an incomplete cohort
        self.datasets: dict[tuple, tuple] = {}
        self.trainer: CohortTrainer | None = None
        self.accel = torch.device("cpu")  # where cohorts train: set by the run's assign
        self.rejected = 0
        self.heard = False  # any message that decoded: the other end speaks our protocol
        self.crash_at_round = crash_at_round  # fault injection: die mid-round, as a real device can

    # -- loop -----------------------------------------------------------------------
    def run(self) -> int:
        # no pid: a newcomer's hello is billed, and its size must not vary between reruns
        hello = {"name": self.name, "threads": torch.get_num_threads()}
        if self.credentials.token:  # loopback without CURVE: only we can claim our name
            hello["token"] = self.credentials.token
        log.info("%s: connecting to %s (waiting for the server)", self.name, self.endpoint)
        if (code := self.greet(Message("hello", meta=hello))) is not None:
            return code
        handlers = {"assign": self.on_assign, "reset": self.on_reset, "drift": self.on_drift, "state": self.on_state}
        while True:
            if not self.sock.poll(1000):
                if (code := self.cannot_go_on()) is not None:
                    return code
                continue
            frames, _ = receive(self.sock)  # Ctrl-C held back while it is read (common/wire.py)
            try:
                msg = decode(frames)
            except ProtocolError as exc:
                self.rejected += 1
                log.error("%s: rejected malformed message (%d so far): %s", self.name, self.rejected, exc)
                if not self.heard and self.rejected >= NOT_A_SERVER:
                    log.error(
                        "%s: %s sent %d malformed messages and no flt message: not an flt server (a wrong "
                        "--connect address?); exiting",
                        self.name,
                        self.endpoint,
                        self.rejected,
                    )
                    return 2
                continue
            self.heard = True
            if msg.kind == "shutdown":
                log.info("%s: shutdown", self.name)
                return 0
            if msg.kind in handlers:
                self._guard(handlers[msg.kind], msg)
            elif msg.kind in ops.TASK_KINDS:
                self.collect(msg)
            else:
                self.rejected += 1
                log.error("%s: unexpected message kind %r from server", self.name, msg.kind)

    def greet(self, hello: Message) -> int | None:
        """Queue the hello; None once it is, else the exit code. A DEALER's send blocks while
        it has no connection, and after a protocol error (a device without keys at a CURVE
        server) libzmq may drop the connection for good: a blocking hello then waited for
        ever, before the refusal could be read."""
        frames = encode(hello)
        while True:
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
                return None
            except zmq.Again:
                if (code := self.cannot_go_on()) is not None:
                    return code
                time.sleep(0.1)

    def cannot_go_on(self) -> int | None:
        """The exit code when the emulator that started us is gone (1) or the server will
        never talk to us (2, with why); None while waiting still makes sense."""
        if self.parent_pid and process_gone(self.parent_pid):  # orphaned
            log.warning("%s: parent process %s is gone; exiting", self.name, self.parent_pid)
            return 1
        if why := self.handshakes.refused():
            log.error("%s: %s; exiting", self.name, why)
            return 2
        return None

    def send(self, msg: Message) -> None:
        # a zero-copy send frees a zmq.Frame, whose check for signals would drop a Ctrl-C
        # raised there (common/wire.py receive): held back until the send returns
        with deferred_interrupt():
            self.sock.send_multipart(encode(msg), copy=False)

    def _guard(self, fn, msg: Message) -> None:
        try:
            fn(msg)
        except Exception as exc:  # report, never die: the server decides what to do
            log.error("%s: %s failed:\n%s", self.name, msg.kind, traceback.format_exc())
            self.send(
                Message(
                    "error",
                    msg.round,
                    msg.client,
                    meta={
                        "reason": f"{type(exc).__name__}: {exc}",
                        "for": msg.kind,
                        "batch": msg.meta.get("batch", -1),
                    },
                )
            )

    # -- set-up ---------------------------------------------------------------------
    def on_assign(self, msg: Message) -> None:
        spec, t = msg.meta, msg.tensors
        self.accel = accelerator(spec.get("accelerator", "cpu"), self.name)
        root = self.data_root or spec["dataset"].get("root")
        train = self._dataset(spec["dataset"]["name"], root, True, spec["dataset"].get("download", False))
        test = self._dataset(spec["dataset"]["name"], root, False, spec["dataset"].get("download", False))
        self.splits = (train, test)
        shifts = client_shifts(spec.get("shift"), t, t["clients"])
        for cid, tr, te in zip(t["clients"], _split(t, "train"), _split(t, "test"), strict=True):
            self.shards[int(cid)] = _shard(train, test, tr, te, shifts.get(int(cid)))
        hosted = [int(c) for c in t.get("hosted", t["clients"])]
        self.hosted.update(hosted)
        m = spec["model"]
        model = build_model(m["name"], tuple(m["in_shape"]), m["num_classes"], m.get("inputs", "unit"))
        self.trainer = CohortTrainer(model.to(self.accel), param_spec(model))
        log.info("%s: hosting %d clients (shards of %d) on %s", self.name, len(hosted), len(t["clients"]), self.accel)
        self.send(Message("ready", meta={"clients": hosted}))

    def _dataset(self, name, root, train, download):
        key = (name, root, train)
        if key not in self.datasets:
            ds = load_shared(name, root, train=train, download=download)
            # labels are small: a private copy; images stay shared (or go to the GPU once)
            self.datasets[key] = (Images(ds.x, self.accel), torch.from_numpy(np.array(ds.y)).to(self.accel))
        return self.datasets[key]

    def on_reset(self, msg: Message) -> None:
        """A new method starts: forget per-client state; keep the run's initial weights."""
        self.init = torch.from_numpy(np.array(msg.tensors["init"], dtype=np.float32))
        self.resident.clear()
        self.flags.clear()
        self.watch.clear()
        self.pending.clear()

    def on_drift(self, msg: Message) -> None:
        """Emulated data drift: the client's shard is replaced (indices into the same
        dataset). Nothing tells the client whether its distribution moved: its store
        changed, and the device tests that at once if the client embedded (`change_flag`,
        devices/watch.py), answering with a notice when asked (meta "notice"). A replay
        (meta "flag" 0: the next method's undo) is no change."""
        if msg.client not in self.hosted:
            raise KeyError(f"drift for client {msg.client}, which {self.name} does not host")
        train, test = self.splits
        shifts = client_shifts(msg.meta.get("shift"), msg.tensors, [msg.client])
        shard = _shard(train, test, msg.tensors["train"], msg.tensors["test"], shifts.get(msg.client))
        if "label_swap" in msg.meta:  # concept shift: two classes trade labels
            i, j = msg.meta["label_swap"]
            old = self.shards[msg.client]
            for y, y_old in ((shard.y, old.y), (shard.y_test, old.y_test)):
                y.copy_(torch.where(y_old == i, j, torch.where(y_old == j, i, y_old)))
        self.shards[msg.client] = shard
        noticed = False
        if not msg.meta.get("flag", True):
            self.flags.discard(msg.client)
        elif self.watch.watched(msg.client):  # tested now: a moved client tells the server at once
            self.watch.changed(msg.client)
            noticed = self.change_flag(msg.client)
        else:  # it never embedded: its next update tells the server (its method places it)
            self.flags.add(msg.client)
        if msg.meta.get("notice"):
            meta = {"batch": msg.meta.get("batch", -1), "flag": int(noticed)}
            self.send(Message("notice", msg.round, msg.client, meta=meta))

    def change_flag(self, client: int) -> bool:
        """The flag delta a reply carries: up from a change until the client re-embeds.
        A store changed since the client embedded is tested first (devices/watch.py)."""
        if self.watch.pending(client):
            tested = len(self.watch.tests)
            moved = self.watch.moved(client, self.shards[client].x.cpu().numpy())
            why = f"p = {self.watch.tests[-1][1]:.3f}" if len(self.watch.tests) > tested else "untested"
            log.info("%s: client %d's data changed (%s): %s", self.name, client, why, "flag" if moved else "no flag")
            if moved:
                self.flags.add(client)
        return client in self.flags

    def on_state(self, msg: Message) -> None:
        """Resume: the state snapshot() gave for this client at the checkpoint."""
        if msg.client not in self.hosted:
            raise KeyError(f"state for client {msg.client}, which {self.name} does not host")
        if "model" in msg.tensors:
            self.resident[msg.client] = torch.from_numpy(np.array(msg.tensors["model"], dtype=np.float32))
        else:
            self.resident.pop(msg.client, None)
        (self.flags.add if msg.meta.get("flag") else self.flags.discard)(msg.client)
        if msg.meta.get("encoder") in ("onnx", "linear"):  # the change test's, once per device
            self.watch.embedder = ops.watch_embedder(msg.meta["encoder"], msg.tensors)
        if "reference" in msg.tensors:  # what its next change is tested against, as before the restart
            sample = np.array(msg.tensors["reference"], dtype=np.float32)
            self.watch.restored(msg.client, sample, ops.client_seed(0, msg.client))
        elif msg.meta.get("watched"):  # not testable (or its reference lost): any change counts
            self.watch.forgotten(msg.client)

    # -- cohorts --------------------------------------------------------------------
    def collect(self, msg: Message) -> None:
        batch_id = msg.meta.get("batch")
        if not isinstance(batch_id, int) or isinstance(batch_id, bool):  # a cohort's key: must hash
            self.rejected += 1
            log.error("%s: %s without an integer batch id rejected", self.name, msg.kind)
            return
        if msg.client not in self.shards:
            self.rejected += 1
            log.error("%s: task for unknown client %d rejected", self.name, msg.client)
            self.send(
                Message(
                    "error",
                    msg.round,
                    msg.client,
                    meta={
                        "reason": f"client {msg.client} is not hosted on {self.name}",
                        "for": msg.kind,
                        "batch": msg.meta.get("batch", -1),
                    },
                )
            )
            return
        # a method's own training op too; from that round on, so a device none of whose
        # clients are drawn in that round dies in the next round that gives it work
        crash = self.crash_at_round is not None and msg.round >= self.crash_at_round
        if msg.kind in ("train", "task") and crash:
            log.error("%s: injected crash in round %d (tasks received, no reply)", self.name, msg.round)
            os._exit(3)
        batch = self.pending.setdefault(msg.meta["batch"], [])
        batch.append(msg)
        if msg.meta.get("last"):
            del self.pending[msg.meta["batch"]]
            self._process(batch)

    def _process(self, batch: list[Message]) -> None:
        """Run the cohort's operations from the registry (devices/ops.py), one call per op
        (a round may ask some clients to train and others to pick a model)."""
        by_op: dict[str, list[Message]] = {}
        for msg in batch:
            by_op.setdefault(ops.op_name(msg), []).append(msg)
        for part in by_op.values():
            self._run_op(part)

    def _run_op(self, batch: list[Message]) -> None:
        """One op over its clients; any failure, an unknown operation included, is an error
        reply per client, naming the cause."""
        kind = batch[0].kind
        try:
            start = time.monotonic()
            with working_heap():  # a CNN's per-step buffers reused, not faulted in anew
                replies = ops.lookup(ops.op_name(batch[0]))(self, batch)
            delay = {m.client: m.meta.get("delay_s", 0.0) for m in batch}
            for reply in sorted(replies, key=lambda r: delay.get(r.client, 0.0)):
                wait = start + delay.get(reply.client, 0.0) - time.monotonic()
                if wait > 0:  # real-time mode: answer when this device would have finished
                    time.sleep(wait)
                self.send(reply)
        except Exception as exc:
            log.error("%s: %s cohort failed:\n%s", self.name, kind, traceback.format_exc())
            for m in batch:
                self.send(
                    Message(
                        "error",
                        m.round,
                        m.client,
                        meta={"reason": f"{type(exc).__name__}: {exc}", "for": kind, "batch": m.meta["batch"]},
                    )
                )


def accelerator(choice: str, name: str) -> torch.device:
    """The torch device for `devices.accelerator`: auto takes this host's GPU when it has one."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if choice not in ("cuda", "auto"):
        raise ValueError(f"devices.accelerator must be cpu, cuda or auto, not {choice!r}")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"devices.accelerator is cuda, but device {name} has no CUDA GPU "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})"
        )
    deterministic_kernels(torch.device("cuda"))
    return torch.device("cuda")


def _split(t: dict, name: str) -> list[np.ndarray]:
    return np.split(t[f"{name}_idx"], t[f"{name}_offsets"][1:-1])


def _shard(train, test, tr_idx, te_idx, shift: ClientShift | None = None) -> Shard:
    """A client's shard; a concept shift relabels its own label copies, once."""
    (x, y), (xt, yt) = train, test
    tr = torch.as_tensor(np.asarray(tr_idx, dtype=np.int64), device=x.device)
    te = torch.as_tensor(np.asarray(te_idx, dtype=np.int64), device=xt.device)
    y_tr, y_te = y[tr].long(), yt[te].long()
    if shift is not None:
        y_tr, y_te = shift.labels(y_tr), shift.labels(y_te)
        shift = shift if shift.kind != "labels" else None  # nothing left to do to the images
    return Shard(x, tr, y_tr, xt, te, y_te, shift)


def set_process_title(title: str) -> None:
    """What ps, top and /proc/PID/cmdline show for this process (setproctitle rewrites
    the argument area; the standard library can set only the 15-character comm name)."""
    try:
        import setproctitle
    except ImportError:  # cosmetic: a host without it still runs (it is a declared dependency)
        log.debug("setproctitle is not installed; the process keeps its command line as its title")
        return
    setproctitle.setproctitle(title)


def prepare_process() -> None:
    """What a device process sets before its Device: `flt device` by hand, or forked."""
    skip_triton()  # before the first vmap imports torch._dynamo (common/heap.py)
    limit_heap_retention()  # a device lives for the whole run: freed buffers go back to the system
    # force: a device forked from the emulator inherits its root logger (WARNING level), which
    # would silence this log
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s", force=True
    )


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="flt device", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--connect", required=True, help="server address, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--name", help="device id (default host-pid); must be unique per server")
    p.add_argument("--data-root", help="where this host keeps the dataset (overrides the scenario's)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for this device")
    p.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)  # the emulator's run folder, for the process title
    p.add_argument("--crash-at-round", type=int, help="fault injection: exit when round N's tasks arrive")
    p.add_argument("--key", help="this device's NAME.key_secret (from `flt keys`): CURVE")
    p.add_argument("--server-key", help="the server's server.key (from `flt keys`)")
    a = p.parse_args(argv)
    prepare_process()
    device = Device(
        a.connect, a.name, a.data_root, a.threads, a.parent_pid, a.crash_at_round, Credentials.load(a.key, a.server_key)
    )
    # forked devices would all read as the emulator's own `flt run ...` line in ps and top
    set_process_title(f"flt device {device.name} ({f'run {a.run}' if a.run else f'server {a.connect}'})")
    if folder := os.environ.get("FLT_PROFILE"):  # benchmarks/profile_round.py: where a round's time goes
        return _profiled(device, Path(folder) / f"{device.name}.prof")
    return device.run()


def _profiled(device: Device, path: Path) -> int:
    """Run the device under cProfile and write its statistics at shutdown."""
    import cProfile

    profiler = cProfile.Profile()
    try:
        return profiler.runcall(device.run)
    finally:
        profiler.dump_stats(path)


if __name__ == "__main__":
    sys.exit(main())
