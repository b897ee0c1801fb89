"""`train_resident`: Local's client step; the client's model never leaves its device.

Local training, the "no collaboration" reference point of McMahan et al. (2017): client m
minimises its own empirical risk, w_m^{t+1} = SGD_E(w_m^t; D_m), from the common initial
weights w^0. The device keeps w_m between rounds (`Device.resident`, which `snapshot`
reports for checkpoints): the client's first task carries w^0 as tensor "model" [1, P]
(or nothing, and the run's initial weights from `reset` are used), later ones carry
nothing. The reply ("result", billed as model traffic) carries no model, only the sample
count, loss, steps and change flag.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flt.common.wire import Message
from flt.devices.ops import register, resident_model, train_from

if TYPE_CHECKING:
    from flt.devices.device import Device


@register("train_resident")
def train_resident(device: Device, batch: list[Message]) -> list[Message]:
    start = torch.stack([resident_model(device, m) for m in batch])
    trained, metas = train_from(device, batch, start)
    replies = []
    for m, w, meta in zip(batch, trained, metas, strict=True):
        device.resident[m.client] = w.clone()
        replies.append(Message("result", m.round, m.client, meta={**meta, "op": "train_resident", "traffic": "model"}))
    return replies
