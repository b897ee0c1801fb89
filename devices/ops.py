"""Device-side operations: what a device does with one cohort of tasks, by name.

A method declares the operations its tasks name as `DeviceOp`s in its `DEVICE_OPS`
(server/ops.py: wire kinds, billing, pricing, reply checks); this module is the device
half's registry of what each one runs. An operation is a function `(device, batch) ->
replies`: `batch` holds one task per client of this device's cohort that names the op
(same round and batch id; a cohort that mixes ops is split by op), and it returns one
reply message per client.

The built-in operations keep their historical wire kinds (train, evaluate, encoder,
snapshot: their headers are part of every result's byte counts); any other travels as
the kind "task" naming it in meta "op", and answers "result". An operation that is not
registered here is looked up as the module `devices.methods.<op>`, which registers it
when imported, so a method with a new client step adds one module there and never
touches this file or device.py. A run checks at start-up that every declared op exists.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from flt.common.wire import Message
from flt.devices import embedding
from flt.devices.seeds import client_generator, client_seed
from flt.devices.trainer import CohortTrainer, TrainConfig

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
    return [client_generator(m.meta.get("seed", 0), m.client) for m in batch]


def shard_data(device: Device, batch: list[Message]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each client's training images (as stored, uint8, unless a feature shift made them
    float: the trainer takes either) and labels, in the batch's order."""
    shards = [device.shards[m.client] for m in batch]
    return [s.pixels for s in shards], [s.y for s in shards]


def sent_models(batch: list[Message]) -> list[torch.Tensor]:
    """The models [K, P] each task carries as tensor "model" (K candidates for an op that
    picks one of them): views of the message's own copy (common/wire.py receive), read
    only here; the ops that train stack them into a tensor of their own."""
    missing = [m.client for m in batch if "model" not in m.tensors]
    if missing:
        raise ValueError(f"clients {missing[:10]}: the {op_name(batch[0])!r} task carries no tensor 'model'")
    return [torch.from_numpy(np.asarray(m.tensors["model"], dtype=np.float32)) for m in batch]


def resident_model(device: Device, msg: Message) -> torch.Tensor:
    """[P]: the model this device keeps for msg's client (Local's), created on first use
    from the model the task carries, else from the run's initial weights (sent with reset)."""
    c = msg.client
    if c not in device.resident:
        sent = msg.tensors.get("model")
        if sent is not None:
            device.resident[c] = torch.from_numpy(np.array(sent[0], dtype=np.float32))
        elif device.init is not None:
            device.resident[c] = device.init.clone()
        else:
            raise RuntimeError(f"client {c}: no model sent and no initial weights (reset)")
    return device.resident[c]


def candidate_losses(
    device: Device, candidates: list[torch.Tensor], xs: list[torch.Tensor], ys: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Each client's loss [K] under each of its candidate models, on its own training data;
    one vectorized pass when the whole cohort got the same candidates (IFCA's case)."""
    first = candidates[0]
    if all(c.shape == first.shape and torch.equal(c, first) for c in candidates[1:]):
        return list(trainer(device).losses_of(first.to(device.accel), xs, ys).cpu())
    return [
        trainer(device).losses_of(c.to(device.accel), [x], [y])[0].cpu()
        for c, x, y in zip(candidates, xs, ys, strict=True)
    ]


def train_from(device: Device, batch: list[Message], start: torch.Tensor) -> tuple[torch.Tensor, list[dict]]:
    """E local epochs of SGD for every client of the cohort, each from its row of `start`
    [B, P] (epochs, batch size, lr and FedProx's mu from the task): the trained models
    [B, P] on the host, and each reply's meta (samples, loss, steps, change flag)."""
    xs, ys = shard_data(device, batch)
    m0 = batch[0].meta
    cfg = TrainConfig(
        epochs=m0["epochs"],
        batch_size=m0["batch_size"],
        lr=m0["lr"],
        prox_mu=m0.get("prox_mu", 0.0),
        momentum=m0.get("momentum", 0.0),
        vectorize=m0.get("vectorize", True),
    )
    trained, losses = (t.cpu() for t in trainer(device).train(start.to(device.accel), xs, ys, cfg, generators(batch)))
    # the flag stays up until the client re-embeds: an update the server drops (a
    # straggler) must not lose it
    metas = [
        {
            "batch": m.meta["batch"],
            "n": len(x),
            "loss": float(loss),
            "flag": int(device.change_flag(m.client)),
            "steps": -(-len(x) // cfg.batch_size) * cfg.epochs,
        }
        for m, x, loss in zip(batch, xs, losses, strict=True)
    ]
    return trained, metas


# -- the built-in operations -----------------------------------------------------------
@register("train")
def train(device: Device, batch: list[Message]) -> list[Message]:
    """E local epochs from the one model [1, P] each task carries; the reply carries the
    trained model. A method that picks among candidates (IFCA: devices/methods/train_best.py)
    or keeps the model on the device (Local: train_resident.py) names its own op."""
    models = sent_models(batch)
    several = [(m.client, len(w)) for m, w in zip(batch, models, strict=True) if len(w) != 1]
    if several:
        c, k = several[0]
        raise ValueError(
            f"client {c}: 'train' takes one model, the task carries {k} (an op that picks among "
            "candidates, e.g. train_best, names itself)"
        )
    trained, metas = train_from(device, batch, torch.cat(models))
    return [
        # "choice" 0 keeps the update's header (and so its billed bytes) what it always was
        Message("update", m.round, m.client, tensors={"model": w.numpy()}, meta={**meta, "choice": 0})
        for m, w, meta in zip(batch, trained, metas, strict=True)
    ]


def eval_models(device: Device, batch: list[Message]) -> torch.Tensor:
    """[B, P]: the model each client is evaluated with, in one copy of the sent frames
    (a copy per message, then the stack, held 3 GB per device at M = 2,400); the
    device's own (`resident_model`) when the server sent none."""
    if any(m.meta.get("resident") for m in batch):
        return torch.stack([resident_model(device, m) for m in batch])
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
    """FCR: embed the client's data with the encoder sent (ONNX, a PCA basis, an
    autoencoder to fine-tune first, or none: a PCA basis of its own), then send k seeded
    k-means centroids and each one's share of the client's samples (or, with k = "labels",
    one mean per class it holds, its class in a last column, and the class's share)."""
    meta, t = batch[0].meta, batch[0].tensors
    xs = [device.shards[m.client].x for m in batch]
    if meta["format"] != "autoencoder":  # onnxruntime and numpy read host memory
        xs = [x.cpu() for x in xs]
    if meta["format"] == "onnx":
        embs = embedding.embed_onnx(np.asarray(t["onnx"]), xs)
        device.watch.embedder = watch_embedder("onnx", t)
    elif meta["format"] == "linear":
        embs = embedding.embed_linear(np.asarray(t["components"]), np.asarray(t["mean"]), xs)
        device.watch.embedder = watch_embedder("linear", t)
    elif meta["format"] == "own_pca":  # each client's own PCA basis: not kept either
        embs = embedding.embed_own_pca(xs, int(meta["latent"]), [client_seed(meta["seed"], m.client) for m in batch])
    else:  # each client's own fine-tuned encoder: not kept (devices/watch.py)
        embs = embedding.embed_finetuned(t["weights"], meta, xs, generators(batch))
    out = []
    for m, e in zip(batch, embs, strict=True):
        y = device.shards[m.client].y.cpu().numpy() if meta["k"] == "labels" else None
        tensors, half_k = _summaries(e, y, meta["k"], client_seed(meta["seed"], m.client))
        device.flags.discard(m.client)
        # the image test sees neither a fine-tuned encoder it does not keep nor a label
        # change (k: labels): then any change of the store raises the flag
        testable = meta["format"] in ("onnx", "linear") and meta["k"] != "labels"
        device.watch.remember(m.client, _images_of(device.shards[m.client]), client_seed(0, m.client), testable)
        out.append(
            Message(
                "centroids",
                m.round,
                m.client,
                tensors=tensors,
                meta={"batch": m.meta["batch"], "n": len(e)} | ({"half_k": half_k} if half_k else {}),
            )
        )
    return out


def watch_embedder(fmt: str, t: dict[str, np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    """The encoder an FCR task carries (ONNX, or a PCA basis), as the change test keeps it:
    images [N, C, H, W] -> embeddings [N, e]. Copies: a message's frames are not ours to hold."""
    if fmt == "onnx":
        onnx = np.array(t["onnx"])
        return lambda x: embedding.embed_onnx(onnx, [torch.from_numpy(x)])[0]
    components, mean = np.array(t["components"]), np.array(t["mean"])
    return lambda x: embedding.embed_linear(components, mean, [torch.from_numpy(x)])[0]


def _summaries(e: np.ndarray, y: np.ndarray | None, k, seed: int) -> tuple[dict[str, np.ndarray], int]:
    """The client's summary of all its data (k centroids and their shares, or its class
    means) and the same summary of each of two disjoint halves of it, stacked ("halves",
    "half_shares"; the first half_k rows are the first half's). A client with fewer than
    two samples has no halves (half_k 0)."""

    def summary(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if k == "labels":  # y: the client's labels, read only then
            assert y is not None
            return embedding.label_means(e[idx], y[idx])
        return embedding.centroids(e[idx], k, seed=seed)

    c, shares = summary(np.arange(len(e)))
    tensors = {"centroids": c, "shares": shares}
    if len(e) < 2:
        return tensors, 0
    (ca, sa), (cb, sb) = (summary(h) for h in embedding.split_halves(len(e), seed))
    return tensors | {"halves": np.concatenate([ca, cb]), "half_shares": np.concatenate([sa, sb])}, len(ca)


def _images_of(shard) -> Callable[[], np.ndarray]:
    """The images a shard holds now (a drifted client gets a new shard: this one stays)."""
    return lambda: shard.x.cpu().numpy()


@register("snapshot")
def snapshot(device: Device, batch: list[Message]) -> list[Message]:
    """What this device keeps for each client (Local's model, the change flag and, when
    asked, the embedded sample its change test compares with), for the server's
    checkpoint: a resumed run gets it back with Device.on_state."""
    out = []
    for m in batch:
        tensors = {"model": device.resident[m.client].numpy()} if m.client in device.resident else {}
        # what its next change is tested against, when the server says data changes later
        sample = device.watch.reference_sample(m.client) if m.meta.get("references") else None
        if sample is not None:
            tensors["reference"] = sample
        out.append(
            Message(
                "state",
                m.round,
                m.client,
                tensors=tensors,
                meta={
                    "batch": m.meta["batch"],
                    "flag": int(device.change_flag(m.client)),
                    "watched": int(device.watch.watched(m.client)),
                },
            )
        )
    return out
