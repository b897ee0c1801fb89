"""A broken or hostile external device, for tests/test_rogue_device.py.

It is the real device program (`flt device`), except that it answers the first request
(or the first `--times N`) of each kind it is told to spoil wrongly, in one of five ways:

- missing: no answer at all;
- malformed: a frame that does not decode;
- wrong: a well-formed answer with wrong content (a model of the wrong size, evaluation
  totals that are not the test shard's, 3-D centroids, a device state with a model of
  the wrong size, `ready` for clients it was not given);
- late: the right answer, after the server stopped waiting for it (held back until the
  device answers its next request, which the server sends only once it gave up);
- narrow: centroids one column narrower than the encoder's embedding (other replies as
  they are).

    python tests/rogue_device.py --connect ENDPOINT --name edge-1 --mode late \\
        --spoil update,metrics,centroids,state

Every other request is answered as a healthy device would, so the test can tell what the
server did with the spoiled ones.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flt.common.wire import Message
from flt.devices.device import Device
from flt.emulator.zygote import preload

REPLIES = ("ready", "update", "metrics", "centroids", "state")  # a reply to assign, train, evaluate, encoder, snapshot
MODES = ("missing", "malformed", "wrong", "late", "narrow", "huge")


def narrow(msg: Message) -> Message:
    """Centroids (and halves) one column narrower than the encoder's embedding: each
    client's summary is well-formed on its own, only the run's width tells it wrong."""
    tensors = {k: v[:, :-1] if k in ("centroids", "halves") else v for k, v in msg.tensors.items()}
    return Message(msg.kind, msg.round, msg.client, tensors=tensors, meta=dict(msg.meta), run=msg.run)


def huge(msg: Message) -> Message:
    """An update whose every weight is 1e37 (finite, of the right size and type, and past
    float32's range once the server weighs it by the client's sample count), or centroids
    of 1e37, which dwarf every honest client's in the server's whitening."""
    tensors = {k: np.full_like(v, 1e37) if k in ("model", "centroids", "halves") else v for k, v in msg.tensors.items()}
    return Message(msg.kind, msg.round, msg.client, tensors=tensors, meta=dict(msg.meta), run=msg.run)


def wrong(msg: Message) -> Message:
    """The same reply with its content spoiled in a way the server can know is wrong."""
    meta, tensors = dict(msg.meta), dict(msg.tensors)
    if msg.kind == "ready":
        meta["clients"] = [*meta["clients"], 10_000]
    elif msg.kind == "update":
        tensors["model"] = tensors["model"][:-1]
    elif msg.kind == "metrics":
        meta["total"] = meta["total"] + 1
    elif msg.kind == "centroids":
        tensors["centroids"] = tensors["centroids"][None]
    elif msg.kind == "state":
        tensors["model"] = np.zeros(3, dtype=np.float32)
    return Message(msg.kind, msg.round, msg.client, tensors=tensors, meta=meta, run=msg.run)


class RogueDevice(Device):
    def __init__(self, *args, mode: str, spoil: set[str], times: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.mode, self.spoil, self.times = mode, spoil, times
        self.spoiled: dict[str, list] = {}  # reply kind -> the batch ids spoiled (each kind's first `times`)
        self.held: list[Message] = []  # late answers, sent before the next request's

    def send(self, msg: Message) -> None:
        batch, spoiled = msg.meta.get("batch"), self.spoiled.setdefault(msg.kind, [])
        if batch not in spoiled and len(spoiled) < self.times:
            spoiled.append(batch)
        if msg.kind not in self.spoil or batch not in spoiled:
            if self.held and self.held[0].meta.get("batch") != batch:
                for late in self.held:
                    super().send(late)
                self.held.clear()
            return super().send(msg)
        logging.warning("rogue: %s %s for client %d", self.mode, msg.kind, msg.client)
        if self.mode == "malformed":
            self.sock.send_multipart([b'{"v": 1, "kind": "' + msg.kind.encode() + b'", "round": '])
        elif self.mode == "wrong":
            super().send(wrong(msg))
        elif self.mode == "narrow":
            super().send(narrow(msg) if msg.kind == "centroids" else msg)
        elif self.mode == "huge":
            super().send(huge(msg) if msg.kind in ("update", "centroids") else msg)
        elif self.mode == "late":
            self.held.append(msg)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--connect", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--spoil", required=True, help=f"comma-separated reply kinds among {', '.join(REPLIES)}")
    p.add_argument("--times", type=int, default=1, help="spoil the first N requests of each kind")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    spoil = set(a.spoil.split(","))
    if not spoil <= set(REPLIES):
        p.error(f"--spoil: unknown reply kinds {sorted(spoil - set(REPLIES))}")
    preload()  # what a forked device has imported already: its first training is no slower than theirs
    return RogueDevice(a.connect, a.name, mode=a.mode, spoil=spoil, times=a.times).run()


if __name__ == "__main__":
    sys.exit(main())
