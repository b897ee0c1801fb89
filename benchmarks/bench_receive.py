"""What reading a message with `wire.receive` costs against ZeroMQ's zero-copy frames.

`wire.receive` copies every message out of ZeroMQ's frames and frees them while Ctrl-C is
held back (a zmq.Frame freed later could swallow a KeyboardInterrupt: docs/architecture.md,
the wire protocol). The reference is the read it replaced: the frames kept, the model
then copied by its user (`np.copy` on the server, `np.array` on a device). Each side
reads one S1 round's messages (20 models of the MNIST MLP, 0.8 MB each) over a real TCP
socket, alternately, and prints the median over the repeats and the ratio to the reference.
Writes the figures and the machine to benchmarks/results/receive.json.

    .venv/bin/python benchmarks/bench_receive.py [--repeats 30] [--messages 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import zmq
from machine import machine_info

from flt.common.heap import limit_heap_retention
from flt.common.wire import Message, decode, encode, receive

MLP_PARAMS = 199_210  # the S1 MLP (784-200-200-10)
REPO = Path(__file__).resolve().parents[1]


def reads(sock: zmq.Socket) -> dict[str, Callable[[], torch.Tensor]]:
    """Each way of reading one model, as the server or a device used it."""

    def frames(copy: Callable[[np.ndarray], np.ndarray]) -> Callable[[], torch.Tensor]:
        return lambda: torch.from_numpy(copy(decode(sock.recv_multipart(copy=False)).tensors["model"]))

    def received() -> torch.Tensor:
        return torch.from_numpy(np.asarray(decode(receive(sock)[0]).tensors["model"], dtype=np.float32))

    return {
        "frames, then np.copy (the server's read)": frames(np.copy),
        "frames, then np.array (a device's read)": frames(lambda a: np.array(a, dtype=np.float32)),
        "wire.receive (both now)": received,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--messages", type=int, default=20, help="messages per round (S1: 20 clients)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "receive.json"))
    args = parser.parse_args()
    limit_heap_retention()  # as the server and the devices run
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}")
    frames = encode(Message("update", 1, 0, tensors={"model": np.ones(MLP_PARAMS, np.float32)}))
    ways = reads(pull)
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, read in ways.items():
            for _ in range(args.messages):
                push.send_multipart(frames)
            time.sleep(0.05)  # all of them queued: the read is timed, not the send
            tic = time.perf_counter()
            models = torch.stack([read() for _ in range(args.messages)])
            seconds[name].append(time.perf_counter() - tic)
            del models
    print(f"{args.messages} messages of {MLP_PARAMS * 4 / 1e6:.1f} MB, median of {args.repeats} repeats")
    median = {name: statistics.median(v) * 1000 for name, v in seconds.items()}
    new = median.pop("wire.receive (both now)")
    for name, ms in median.items():
        print(f"{name:42s} {ms:7.2f} ms")
    ratios = ", ".join(f"{new / ms:.2f}x" for ms in median.values())
    print(f"{'wire.receive (both now)':42s} {new:7.2f} ms ({ratios} the references)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figures = {"messages": args.messages, "repeats": args.repeats, "median_ms": {**median, "wire.receive": new}}
    out.write_text(json.dumps({"machine": machine_info(), **figures}, indent=1) + "\n")
    pull.close(linger=0)
    push.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main()
