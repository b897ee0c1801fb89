"""The wire protocol shared by the server and the devices.

A message is a ZeroMQ multipart: one JSON header frame, then one raw frame per tensor.
No pickle ever crosses the socket. The header says what the tensors are, so the
receiver can check every frame before touching it:

    {"v": 1, "kind": "train", "run": "...", "round": 3, "client": 17,
     "tensors": [{"name": "model", "dtype": "float32", "shape": [159010]}],
     "meta": {...small JSON-able values...}}

`decode` validates version, kind, frame count, dtype, shape against the frame's byte
size and a size cap, and raises `ProtocolError` (never anything else) on a bad
message, so a receiver can log it, count it and go on.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

VERSION = 1
MAX_HEADER_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 1 << 30  # one message; a 2,400-client ASSIGN of indices is far below

# kind -> the traffic class it is billed under in the byte counts
KINDS = {
    "hello": "control",       # device -> server: I am here, these are my capabilities
    "assign": "control",      # server -> device: dataset spec and client shards (indices only)
    "ready": "control",       # device -> server: shards loaded
    "reset": "control",       # server -> device: forget per-method state
    "train": "model",         # server -> client: model(s) to train
    "update": "model",        # client -> server: trained model
    "evaluate": "evaluation", # server -> client: model to evaluate on its test shard
    "metrics": "evaluation",  # client -> server: correct / total
    "encoder": "encoder",     # server -> client: ONNX encoder (or autoencoder weights)
    "centroids": "embedding", # client -> server: k x e centroids of its embeddings
    "drift": "control",       # server -> device: change a client's data (emulated drift)
    "error": "control",       # device -> server: a task failed, with the reason
    "shutdown": "control",    # server -> device: exit
}
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
        return KINDS[self.kind]


def encode(msg: Message) -> list:
    """Header + one contiguous buffer per tensor (zero-copy where possible)."""
    if msg.kind not in KINDS:
        raise ProtocolError(f"unknown message kind {msg.kind!r}")
    specs, frames = [], []
    for name, arr in msg.tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype.name not in DTYPES:
            raise ProtocolError(f"tensor {name!r}: dtype {arr.dtype} cannot travel")
        specs.append({"name": name, "dtype": arr.dtype.name, "shape": list(arr.shape)})
        frames.append(memoryview(arr).cast("B") if arr.size else b"")
    header = {"v": VERSION, "kind": msg.kind, "run": msg.run, "round": int(msg.round),
              "client": int(msg.client), "tensors": specs, "meta": msg.meta}
    return [json.dumps(header, separators=(",", ":")).encode()] + frames


def decode(frames: list) -> Message:
    """Parse and validate a multipart message; raise ProtocolError on anything wrong."""
    if not frames:
        raise ProtocolError("empty message")
    raw = bytes(frames[0])
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    if header.get("v") != VERSION:
        raise ProtocolError(f"protocol version {header.get('v')!r}, expected {VERSION}")
    kind = header.get("kind")
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}")
    for key in ("round", "client"):
        if not isinstance(header.get(key), int):
            raise ProtocolError(f"header field {key!r} must be an integer")
    specs, meta = header.get("tensors"), header.get("meta", {})
    if not isinstance(specs, list) or not isinstance(meta, dict):
        raise ProtocolError("header fields 'tensors' (list) and 'meta' (object) are required")
    if len(specs) != len(frames) - 1:
        raise ProtocolError(f"header lists {len(specs)} tensors but {len(frames) - 1} frames came")
    tensors, total = {}, len(raw)
    for spec, frame in zip(specs, frames[1:]):
        name, arr = _tensor(spec, frame)
        total += arr.nbytes
        if total > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"message exceeds the {MAX_MESSAGE_BYTES}-byte cap")
        tensors[name] = arr
    return Message(kind=kind, round=header["round"], client=header["client"],
                   tensors=tensors, meta=meta, run=str(header.get("run", "")))


def _tensor(spec, frame) -> tuple[str, np.ndarray]:
    if not isinstance(spec, dict):
        raise ProtocolError("tensor spec is not an object")
    name, dtype, shape = spec.get("name"), spec.get("dtype"), spec.get("shape")
    if not isinstance(name, str) or dtype not in DTYPES:
        raise ProtocolError(f"tensor {name!r}: bad name or dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ProtocolError(f"tensor {name!r}: bad shape {shape!r}")
    buf = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
    expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if buf.nbytes != expected:
        raise ProtocolError(f"tensor {name!r}: {buf.nbytes} bytes for shape {shape} {dtype} "
                            f"(expected {expected})")
    return name, np.frombuffer(buf, dtype=dtype).reshape(shape)


def frame_bytes(frames: list) -> tuple[int, int]:
    """(payload bytes, header bytes) of an encoded message as it crosses the socket."""
    header = len(frames[0])
    payload = sum(memoryview(f.buffer if hasattr(f, "buffer") else f).nbytes for f in frames[1:])
    return payload, header
