"""The wire protocol shared by the server and the devices.

A message is a ZeroMQ multipart: one JSON header frame, then one raw frame per tensor.
No pickle ever crosses the socket. The header says what the tensors are, so the
receiver can check every frame before touching it:

    {"v": 1, "kind": "train", "run": "...", "round": 3, "client": 17,
     "tensors": [{"name": "model", "dtype": "float32", "shape": [159010]}],
     "meta": {...small JSON-able values...}}

`decode` validates version, kind, frame count, dtype, shape against the frame's byte
size and a size cap, and raises `ProtocolError` (never anything else, whatever the
bytes: header size, JSON depth and every shape's rank, dimensions and element count are
bounded before any parsing or arithmetic) on a bad message, so a receiver can log it,
count it and go on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TypeGuard

import numpy as np
import zmq

from flt.common.errors import short as _short
from flt.common.interrupts import deferred_interrupt

VERSION = 1
MAX_HEADER_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 1 << 30  # one message; a 2,400-client ASSIGN of indices is far below
MAX_JSON_DEPTH = 32  # headers nest 4 deep (header, tensors, spec, shape); see _bracket_depth
MAX_RANK = 8  # the widest tensor that travels is 2-D (candidates x parameters)
MAX_TENSORS = 16  # frames after the header (an ASSIGN has 5)
MAX_INDEX = 1 << 31  # rounds and client ids
_OPENERS = np.frombuffer(b"[{", dtype=np.uint8)
_CLOSERS = np.frombuffer(b"]}", dtype=np.uint8)

# kind -> the traffic class it is billed under in the byte counts
KINDS = {
    "hello": "control",  # device -> server: I am here, these are my capabilities
    "assign": "control",  # server -> device: dataset spec and client shards (indices only)
    "ready": "control",  # device -> server: shards loaded
    "reset": "control",  # server -> device: forget per-method state
    "train": "model",  # server -> client: model(s) to train
    "update": "model",  # client -> server: trained model
    "evaluate": "evaluation",  # server -> client: model to evaluate on its test shard
    "metrics": "evaluation",  # client -> server: correct / total
    "encoder": "encoder",  # server -> client: ONNX encoder (or autoencoder weights)
    "centroids": "embedding",  # client -> server: k x e centroids of its embeddings
    "drift": "control",  # server -> device: change a client's data (emulated drift)
    "notice": "control",  # client -> server: its own test found its data moved (flag 0/1)
    "error": "control",  # device -> server: a task failed, with the reason
    "shutdown": "control",  # server -> device: exit
    "snapshot": "control",  # server -> client: send what the device keeps for you (checkpoint)
    "state": "control",  # client -> server and back on resume: Local's model, change flag
    "task": "control",  # server -> client: a method's own device op, named in meta "op"
    "result": "control",  # client -> server: that op's answer
}
# a generic task or result is billed under its meta "traffic" (default control)
GENERIC_KINDS = ("task", "result")
TRAFFIC_CLASSES = ("model", "embedding", "encoder", "evaluation", "control")
DTYPES = {"float32", "float64", "int64", "int32", "uint8"}


class ProtocolError(ValueError):
    """A message that breaks the protocol; the text says which part."""


@dataclass
class Message:
    kind: str
    round: int = -1
    client: int = -1
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    run: str = ""

    @property
    def traffic(self) -> str:
        if self.kind in GENERIC_KINDS:
            return self.meta.get("traffic", "control")
        return KINDS[self.kind]


def encode(msg: Message) -> list:
    """Header + one contiguous buffer per tensor (zero-copy where possible)."""
    if msg.kind not in KINDS:
        raise ProtocolError(f"unknown message kind {msg.kind!r}")
    _check_generic(msg.kind, msg.meta)
    specs, frames = [], []
    for name, arr in msg.tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype.name not in DTYPES:
            raise ProtocolError(f"tensor {name!r}: dtype {arr.dtype} cannot travel")
        specs.append({"name": name, "dtype": arr.dtype.name, "shape": list(arr.shape)})
        frames.append(arr.data.cast("B") if arr.size else b"")
    header = {
        "v": VERSION,
        "kind": msg.kind,
        "run": msg.run,
        "round": int(msg.round),
        "client": int(msg.client),
        "tensors": specs,
        "meta": msg.meta,
    }
    return [json.dumps(header, separators=(",", ":")).encode(), *frames]


def decode(frames: list) -> Message:
    """Parse and validate a multipart message; raise ProtocolError on anything wrong.

    Whatever the bytes, nothing but ProtocolError escapes: the header's size and JSON
    depth are bounded, and every shape's rank, dimensions and element count are checked
    with Python integers before any array is built."""
    if not frames:
        raise ProtocolError("empty message")
    if len(frames) - 1 > MAX_TENSORS:
        raise ProtocolError(f"{len(frames) - 1} tensor frames, at most {MAX_TENSORS}")
    header, raw_len = _header(frames[0])
    kind = header.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ProtocolError(f"unknown message kind {_short(kind)}")
    _check_generic(kind, header.get("meta"))
    for key in ("round", "client"):
        value = header.get(key)
        if not _is_int(value) or not -1 <= value < MAX_INDEX:
            raise ProtocolError(f"header field {key!r} must be an integer in [-1, {MAX_INDEX}), not {_short(value)}")
    specs, meta, run = header.get("tensors"), header.get("meta", {}), header.get("run", "")
    if not isinstance(specs, list) or not isinstance(meta, dict) or not isinstance(run, str):
        raise ProtocolError("header fields 'tensors' (list), 'meta' (object) and 'run' (string) have the wrong type")
    if len(specs) != len(frames) - 1:
        raise ProtocolError(f"header lists {len(specs)} tensors but {len(frames) - 1} frames came")
    tensors, total = {}, raw_len
    for spec, frame in zip(specs, frames[1:], strict=True):
        name, arr = _tensor(spec, frame)
        if name in tensors:
            raise ProtocolError(f"tensor {_short(name)} appears twice")
        total += arr.nbytes
        if total > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"message exceeds the {MAX_MESSAGE_BYTES}-byte cap")
        tensors[name] = arr
    return Message(kind=kind, round=header["round"], client=header["client"], tensors=tensors, meta=meta, run=run)


def _check_generic(kind: str, meta) -> None:
    """A task or result names its op (a short string) and bills a known traffic class."""
    if kind not in GENERIC_KINDS:
        return
    op = meta.get("op") if isinstance(meta, dict) else None
    if not isinstance(op, str) or not 0 < len(op) <= 40:
        raise ProtocolError(f"a {kind} needs meta 'op', a string of 1 to 40 characters, not {_short(op)}")
    if meta.get("traffic", "control") not in TRAFFIC_CLASSES:
        raise ProtocolError(
            f"{kind} {op!r}: meta 'traffic' must be one of {', '.join(TRAFFIC_CLASSES)}, "
            f"not {_short(meta.get('traffic'))}"
        )


def _header(frame) -> tuple[dict, int]:
    """The header frame as a JSON object no deeper than MAX_JSON_DEPTH."""
    raw = bytes(frame)
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    if _bracket_depth(raw) > MAX_JSON_DEPTH:
        raise ProtocolError(f"header nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # also bad UTF-8 and over-long integers
        raise ProtocolError(f"header is not JSON: {_short(exc)}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    if not _is_int(header.get("v")) or header["v"] != VERSION:
        raise ProtocolError(f"protocol version {_short(header.get('v'))}, expected {VERSION}")
    return header, len(raw)


def _bracket_depth(raw: bytes) -> int:
    """An upper bound on the JSON nesting depth (brackets inside strings count too), in
    one vectorized pass: json.loads would recurse once per level."""
    b = np.frombuffer(raw, dtype=np.uint8)
    step = np.isin(b, _OPENERS).astype(np.int32) - np.isin(b, _CLOSERS).astype(np.int32)
    return int(np.cumsum(step).max(initial=0))


def _tensor(spec, frame) -> tuple[str, np.ndarray]:
    if not isinstance(spec, dict):
        raise ProtocolError("tensor spec is not an object")
    name, dtype, shape = spec.get("name"), spec.get("dtype"), spec.get("shape")
    if not isinstance(name, str) or len(name) > 64:
        raise ProtocolError(f"tensor name {_short(name)} is not a short string")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ProtocolError(f"tensor {name!r}: bad dtype {_short(dtype)}")
    count = _element_count(name, shape)
    buf = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
    expected = count * np.dtype(dtype).itemsize
    if buf.nbytes != expected:
        raise ProtocolError(f"tensor {name!r}: {buf.nbytes} bytes for shape {shape} {dtype} (expected {expected})")
    return name, np.frombuffer(buf, dtype=dtype).reshape(shape)


def _element_count(name: str, shape) -> int:
    """Elements of `shape`, checked (rank, each dimension, the product) in Python integers,
    so no shape can overflow numpy's int64 or exceed its rank limit."""
    if not isinstance(shape, list) or len(shape) > MAX_RANK:
        raise ProtocolError(
            f"tensor {name!r}: shape must be a list of at most {MAX_RANK} dimensions, not {_short(shape)}"
        )
    count = 1
    for d in shape:
        if not _is_int(d) or not 0 <= d <= MAX_MESSAGE_BYTES:
            raise ProtocolError(f"tensor {name!r}: bad shape {_short(shape)}")
        count *= d
        if count > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"tensor {name!r}: shape {_short(shape)} exceeds the {MAX_MESSAGE_BYTES}-byte cap")
    return count


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def receive(sock: zmq.Socket, user_id: bool = False) -> tuple[list[bytes | bytearray], str | None]:
    """The next multipart message, copied out of ZeroMQ's frames (the first as bytes, the
    rest writable), with Ctrl-C and SIGTERM held back until it is read whole and those
    frames are freed. A zmq.Frame checks for signals when it is freed; a KeyboardInterrupt
    raised there cannot leave its destructor, and Python prints it and drops it: a run
    went on after its Ctrl-C. So no frame may outlive this call. With `user_id`, also the
    User-Id the ZAP handler stamped on the message (a CURVE key's name), else None."""
    with deferred_interrupt():  # a tail left unread would also pass for a message of its own
        received = sock.recv_multipart(copy=False)
        stamp = _user_id(received) if user_id else None
        frames: list[bytes | bytearray] = [received[0].bytes, *(bytearray(f.buffer) for f in received[1:])]
        del received  # each frame's check for signals happens here, where it only records one
    return frames, stamp


def _user_id(frames: list[zmq.Frame]) -> str | None:
    if len(frames) < 2:
        return None
    try:
        return str(frames[1].get("User-Id"))  # pyzmq's stub types a property as int | str
    except zmq.ZMQError:  # no ZAP handler stamped it
        return None


def frame_bytes(frames: list) -> tuple[int, int]:
    """(payload bytes, header bytes) of an encoded message as it crosses the socket."""
    header = len(frames[0])
    payload = sum(memoryview(f.buffer if hasattr(f, "buffer") else f).nbytes for f in frames[1:])
    return payload, header


def endpoint_problem(endpoint: str, listen: bool) -> str | None:
    """What a ZeroMQ address must look like, or None: tcp://HOST:PORT with PORT 1..65535
    (ZeroMQ wraps a larger one round to another port without a word; `*` or 0, any free
    port, only where the server listens), or ipc://PATH."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return None
    m = re.fullmatch(r"tcp://([^:/]+|\[[0-9a-fA-F:.]+\]):(\*|[0-9]{1,5})", endpoint)
    if m and m[2] != "*" and 1 <= int(m[2]) <= 65535:
        return None
    if m and listen and (m[2] == "*" or int(m[2]) == 0):  # the system picks a free port
        return None
    return f"tcp://HOST:PORT (PORT 1..65535{', or * or 0 for any free one' if listen else ''}) or ipc://PATH"
