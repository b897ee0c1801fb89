"""Device-side operations: what a device does with one cohort of tasks, by name.

A method's server half (server/strategies/<name>.py) names the operations it needs in
`DEVICE_OPS`; this module is the device half's registry. An operation is a function
`(device, batch) -> replies`: `batch` holds one task message per client of this device's
cohort (same kind, round and batch id), and it returns one reply message per client.

The built-in operations keep their own message kinds on the wire (train, evaluate,
encoder, snapshot: their headers are part of every result's byte counts). Any other
operation travels as the generic kind "task" with its name in meta "op", and answers
with "result". An operation that is not registered here is looked up as the module
`devices.methods.<op>`, which registers it when imported, so a method with a new client
step adds one module there and never touches this file or device.py.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from flt.devices import embedding
from flt.devices.trainer import CohortTrainer, TrainConfig
from flt.models.wire import Message

if TYPE_CHECKING:
    from flt.devices.device import Device

Op = Callable[["Device", list[Message]], list[Message]]
OPS: dict[str, Op] = {}
KIND_OPS = {"train": "train", "evaluate": "evaluate", "encoder": "embed", "snapshot": "snapshot"}
TASK_KINDS = frozenset(KIND_OPS) | {"task"}  # what a device collects into cohorts
_OP_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")


class UnknownOp(KeyError):
    """A task names an operation this device does not have."""

    def __str__(self) -> str:
        return str(self.args[0])


def register(name: str) -> Callable[[Op], Op]:
    """Decorator: make `fn` the device operation `name` (a name is registered once)."""
    if not _OP_NAME.fullmatch(name):
        raise ValueError(f"device op name {name!r}: lower-case letters, digits and _ only")

    def add(fn: Op) -> Op:
        if name in OPS and OPS[name] is not fn:
            raise ValueError(f"device op {name!r} is registered twice ({OPS[name].__module__}, {fn.__module__})")
        OPS[name] = fn
        return fn

    return add


def op_name(msg: Message) -> str:
    """The operation a task message asks for: its kind, or meta "op" for a generic task."""
    if msg.kind in KIND_OPS:
        return KIND_OPS[msg.kind]
    op = msg.meta.get("op")
    return op if isinstance(op, str) else repr(op)


def lookup(name: str) -> Op:
    """The registered operation `name`, importing `devices.methods.<name>` on first use;
    UnknownOp (naming the operation and those registered) when there is none."""
    if name not in OPS and _OP_NAME.fullmatch(name):
        try:
            importlib.import_module(f"flt.devices.methods.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"flt.devices.methods.{name}":  # the module exists but its import failed
                raise
    if name not in OPS:
        raise UnknownOp(f"unknown device op {name[:40]!r} (this device has: {', '.join(sorted(OPS))})")
    return OPS[name]


# -- helpers shared by operations ------------------------------------------------------
def trainer(device: Device) -> CohortTrainer:
    if device.trainer is None:
        raise RuntimeError(f"{device.name}: a task came before the server assigned clients")
    return device.trainer


def generators(batch: list[Message]) -> list[torch.Generator]:
    from flt.devices.device import client_generator  # device.py imports this module

    return [client_generator(m.meta.get("seed", 0), m.client) for m in batch]


def start_models(device: Device, batch: list[Message]) -> list[torch.Tensor]:
    """Candidate models [K, P] per message: the ones sent, or the device's own copy."""
    rows = []
    for m in batch:
        if m.meta.get("resident"):  # Local: the client's own model lives on the device
            if m.client not in device.resident:
                sent = m.tensors.get("model")
                if sent is not None:
                    device.resident[m.client] = torch.from_numpy(np.array(sent[0], dtype=np.float32))
                elif device.init is not None:
                    device.resident[m.client] = device.init.clone()
                else:
                    raise RuntimeError(f"client {m.client}: no model sent and no initial weights (reset)")
            rows.append(device.resident[m.client][None])
        else:
            rows.append(torch.from_numpy(np.array(m.tensors["model"], dtype=np.float32)))
    return rows


def candidate_losses(device: Device, candidates: list[torch.Tensor], xs, ys) -> list[torch.Tensor]:
    """Each client's loss [K] under each of its candidate models, on its own training data;
    one vectorized pass when the whole cohort got the same candidates (IFCA's case)."""
    first = candidates[0]
    if all(c.shape == first.shape and torch.equal(c, first) for c in candidates[1:]):
        return list(trainer(device).losses_of(first.to(device.accel), xs, ys).cpu())
    return [
        trainer(device).losses_of(c.to(device.accel), [x], [y])[0].cpu()
        for c, x, y in zip(candidates, xs, ys, strict=True)
    ]


# -- the built-in operations -----------------------------------------------------------
@register("train")
def train(device: Device, batch: list[Message]) -> list[Message]:
    """E local epochs from the client's model; with K > 1 candidates (IFCA) first pick the
    one with the lowest loss on the client's data. Resident models (Local) stay here."""
    gens = generators(batch)
    shards = [device.shards[m.client] for m in batch]
    xs, ys = [s.x for s in shards], [s.y for s in shards]
    candidates = start_models(device, batch)
    choice = [0] * len(batch)
    if any(len(c) > 1 for c in candidates):
        choice = [int(loss.argmin()) for loss in candidate_losses(device, candidates, xs, ys)]
    start = torch.stack([c[k] for c, k in zip(candidates, choice, strict=True)]).to(device.accel)
    m0 = batch[0].meta
    cfg = TrainConfig(
        epochs=m0["epochs"],
        batch_size=m0["batch_size"],
        lr=m0["lr"],
        prox_mu=m0.get("prox_mu", 0.0),
        vectorize=m0.get("vectorize", True),
    )
    trained, losses = (t.cpu() for t in trainer(device).train(start, xs, ys, cfg, gens))
    replies = []
    for i, m in enumerate(batch):
        meta = {
            "batch": m.meta["batch"],
            "n": len(xs[i]),
            "loss": float(losses[i]),
            "choice": choice[i],
            "flag": int(m.client in device.flags),
            "steps": -(-len(xs[i]) // cfg.batch_size) * cfg.epochs,
        }
        # the flag stays up until the client re-embeds: an update the server drops
        # (a straggler) must not lose it
        if m.meta.get("resident"):
            device.resident[m.client] = trained[i].clone()
            replies.append(Message("update", m.round, m.client, meta=meta))
        else:
            replies.append(Message("update", m.round, m.client, tensors={"model": trained[i].numpy()}, meta=meta))
    return replies


def eval_models(device: Device, batch: list[Message]) -> torch.Tensor:
    """[B, P]: the model each client is evaluated with, in one copy of the sent frames
    (a copy per message, then the stack, held 3 GB per device at M = 2,400)."""
    if any(m.meta.get("resident") for m in batch):
        return torch.stack([c[0] for c in start_models(device, batch)])
    return torch.from_numpy(np.stack([m.tensors["model"][0] for m in batch]).astype(np.float32, copy=False))


@register("evaluate")
def evaluate(device: Device, batch: list[Message], slice_size: int = 256) -> list[Message]:
    """Correct / total / loss of the client's model on its own test shard, in slices of
    clients: one slice's models and images at a time (a client's figures do not depend
    on the clients it is evaluated with)."""
    out = []
    for lo in range(0, len(batch), slice_size):
        part = batch[lo : lo + slice_size]
        models = eval_models(device, part).to(device.accel)
        shards = [device.shards[m.client] for m in part]
        correct, total, loss = trainer(device).evaluate(models, [s.x_test for s in shards], [s.y_test for s in shards])
        out += [
            Message(
                "metrics",
                m.round,
                m.client,
                meta={
                    "batch": m.meta["batch"],
                    "correct": float(correct[i]),
                    "total": float(total[i]),
                    "loss": float(loss[i]),
                },
            )
            for i, m in enumerate(part)
        ]
    return out


@register("embed")
def embed(device: Device, batch: list[Message]) -> list[Message]:
    """FCR: embed the client's data with the encoder sent (ONNX, a PCA basis, or an
    autoencoder to fine-tune first), then send k seeded k-means centroids."""
    from flt.devices.device import client_seed

    meta, t = batch[0].meta, batch[0].tensors
    xs = [device.shards[m.client].x for m in batch]
    if meta["format"] != "autoencoder":  # onnxruntime and numpy read host memory
        xs = [x.cpu() for x in xs]
    if meta["format"] == "onnx":
        embs = embedding.embed_onnx(t["onnx"], xs)
    elif meta["format"] == "linear":
        embs = embedding.embed_linear(t["components"], t["mean"], xs)
    else:
        embs = embedding.embed_finetuned(t["weights"], meta, xs, generators(batch))
    out = []
    for m, e in zip(batch, embs, strict=True):
        c = embedding.centroids(e, meta["k"], seed=client_seed(meta["seed"], m.client))
        device.flags.discard(m.client)
        out.append(
            Message(
                "centroids", m.round, m.client, tensors={"centroids": c}, meta={"batch": m.meta["batch"], "n": len(e)}
            )
        )
    return out


@register("snapshot")
def snapshot(device: Device, batch: list[Message]) -> list[Message]:
    """What this device keeps for each client (Local's model, the change flag), for the
    server's checkpoint: a resumed run gets it back with Device.on_state."""
    return [
        Message(
            "state",
            m.round,
            m.client,
            tensors={"model": device.resident[m.client].numpy()} if m.client in device.resident else {},
            meta={"batch": m.meta["batch"], "flag": int(m.client in device.flags)},
        )
        for m in batch
    ]
