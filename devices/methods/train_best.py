"""`train_best`: IFCA's client step (Ghosh et al. 2020, Algorithm 2, model averaging).

The task carries the C cluster models theta_1..theta_C as tensor "model" [C, P]. Client m
estimates its cluster identity
    j_m = argmin_j F_m(theta_j)            (loss on its own training data)
runs E local epochs of SGD from theta_{j_m}, and replies ("result", billed as model
traffic) with the trained model [P] and j_m in meta "choice". `choose` is the first half
alone, for a method that assigns clients without training them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flt.common.wire import Message
from flt.devices.ops import candidate_losses, register, sent_models, shard_data, train_from

if TYPE_CHECKING:
    from flt.devices.device import Device


@register("train_best")
def train_best(device: Device, batch: list[Message]) -> list[Message]:
    candidates = sent_models(batch)
    choice = [int(loss.argmin()) for loss in candidate_losses(device, candidates, *shard_data(device, batch))]
    start = torch.stack([c[k] for c, k in zip(candidates, choice, strict=True)])
    trained, metas = train_from(device, batch, start)
    return [
        Message(
            "result",
            m.round,
            m.client,
            tensors={"model": w.numpy()},
            meta={**meta, "choice": k, "op": "train_best", "traffic": "model"},
        )
        for m, w, meta, k in zip(batch, trained, metas, choice, strict=True)
    ]
