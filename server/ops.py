"""Device operations as the server sees them: what a method may ask a client's device to do.

A method declares the operations its tasks name in `DEVICE_OPS`, next to its server logic
(server/strategies/<method>.py), as `DeviceOp`s. Each says what the device runs (its
registered name: devices/ops.py, or devices/methods/<name>.py for a method's own), how
its traffic is billed, what the emulated clock prices (`work`), and how the server checks
a reply against what it already knows (`check`, server/replies.py). Every op travels and
is dispatched the same way: `op.message` builds the task, the federation's `run` sends and
gathers it, and the device runs the function registered under `op.name`.

The four operations the emulator itself relies on (train, evaluate, embed, snapshot)
keep the wire kinds they always had (train/update, evaluate/metrics, encoder/centroids,
snapshot/state): their headers are part of every published byte count. Any other op
travels as the kind "task" naming it in meta "op", and answers "result".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from flt.common.wire import Message
from flt.server.exchange import Work
from flt.server.replies import (
    MAX_CLASSES,
    Check,
    ShardSizes,
    centroids_check,
    choose_check,
    metrics_check,
    subspace_check,
    update_check,
)

# (the tasks sent, the clients' shard sizes, the op) -> the check of each reply
CheckFor = Callable[[dict[int, Message], "ShardSizes | None", "DeviceOp"], Check]


@dataclass(frozen=True)
class DeviceOp:
    """One device operation. `name`: what the device runs. `traffic`: the byte-count class
    of a generic op's task and result (model, embedding, encoder, evaluation, control).
    `work`: (task, reply) -> (samples run forward, samples trained), what the clock prices
    (None: only the bytes). `check`: builds the reply check (None: any well-formed reply).
    `model_back` False: the op keeps the trained model on the device (Local), and a reply
    that carries one is rejected. `task_kind`/`reply_kind`: the wire kinds (the built-in
    four keep theirs; every other op is a "task" answered by a "result"). `movable`: the op
    reads nothing of the client's but its shard and the task (no state its host keeps), so
    any device holding the shard may run it, to even the cohort's work and to pass by a
    device that stopped answering (server/routing.py); a task of it marked `resident` reads
    the model its host keeps (Local's evaluation), and stays there."""

    name: str
    traffic: str = "control"
    work: Work | None = None
    check: CheckFor | None = None
    model_back: bool = True
    task_kind: str = "task"
    reply_kind: str = "result"
    movable: bool = False

    def reply_check(self, sent: dict[int, Message], sizes: ShardSizes | None) -> Check | None:
        """The check of this op's replies to `sent`; a training op's knows from `model_back`
        whether a reply must carry the model or must not."""
        return None if self.check is None else self.check(sent, sizes, self)

    def message(self, rnd: int, client: int, tensors: dict[str, np.ndarray], meta: dict) -> Message:
        """The task for one client: the op's own kind, or a generic task naming the op."""
        if self.task_kind != "task":
            return Message(self.task_kind, rnd, client, tensors=tensors, meta=meta)
        return Message("task", rnd, client, tensors=tensors, meta={**meta, "op": self.name, "traffic": self.traffic})


def trained(sent: Message, reply: Message) -> tuple[float, float]:
    """A training task: FedScale counts whole batches, batch_size x steps samples."""
    return 0.0, float(sent.meta["batch_size"] * reply.meta.get("steps", 0))


def embedded(sent: Message, reply: Message) -> tuple[float, float]:
    """An embedding: one forward pass over the shard, after J fine-tuning epochs (whole
    batches, as for training) when the encoder is fine-tuned (Enc2)."""
    n, tune = int(reply.meta["n"]), sent.meta.get("finetune")
    epochs = tune["epochs"] * -(-n // tune["batch_size"]) * tune["batch_size"] if tune else 0
    return float(n), float(epochs)


def forward(sent: Message, reply: Message) -> tuple[float, float]:
    """One forward pass over the client's training shard (its sample count `n`)."""
    return float(reply.meta.get("n", 0)), 0.0


def training(sent: dict[int, Message], sizes: ShardSizes | None, op: DeviceOp) -> Check:
    """A training op's replies: an update that carries the trained model, or (`model_back`
    False) none at all."""
    return update_check(sent, sizes, stays=() if op.model_back else sent)


def _embedding(sent: dict[int, Message], sizes: ShardSizes | None, op: DeviceOp) -> Check:
    meta = next(iter(sent.values())).meta if sent else {}
    k, latent = meta.get("k"), meta.get("latent")
    # "auto" picks k in 2..10 on the device; "labels": one row per class
    max_k = k if isinstance(k, int) else MAX_CLASSES if k == "labels" else 10
    return centroids_check(sizes, max_k, labelled=k == "labels", width=latent if isinstance(latent, int) else None)


# -- the built-in operations (devices/ops.py runs them) ----------------------------------
TRAIN = DeviceOp("train", "model", trained, training, task_kind="train", reply_kind="update", movable=True)
EVALUATE = DeviceOp(
    "evaluate",
    "evaluation",
    None,
    lambda sent, sizes, op: metrics_check(sizes),
    task_kind="evaluate",
    reply_kind="metrics",
    movable=True,  # the model it is evaluated with travels in the task, unless `resident`
)
EMBED = DeviceOp("embed", "embedding", embedded, _embedding, task_kind="encoder", reply_kind="centroids")
# a checkpoint's question (server/federation.py checks its replies with state_check)
SNAPSHOT = DeviceOp("snapshot", "control", None, None, task_kind="snapshot", reply_kind="state")

# -- operations of particular methods (devices/methods/<name>.py runs them) --------------
# IFCA's client step: the lowest-loss of the C models it carries, then E epochs from it
TRAIN_BEST = DeviceOp("train_best", "model", trained, training, movable=True)
# Local's client step: the model stays on the device between rounds
TRAIN_RESIDENT = DeviceOp("train_resident", "model", trained, training, model_back=False)
# which of K candidate models fits the client's own data best, without training
CHOOSE = DeviceOp("choose", "model", forward, lambda sent, sizes, op: choose_check(sent, sizes), movable=True)
# PACFL's one-shot step: the top left singular vectors of each class's data matrix
SUBSPACE = DeviceOp("subspace", "embedding", forward, lambda sent, sizes, op: subspace_check(sent, sizes), movable=True)
