"""`choose`: which of K candidate models fits this client's own data best, without training.

The client step of IFCA's cluster-identity estimate (Ghosh et al. 2020, Algorithm 2,
line 6: j_m = argmin_j F_m(theta_j)) on its own, for a method that assigns clients before
(or instead of) training them. The task carries the candidates as tensor "model" [K, P];
the reply ("result") carries the index in meta "choice" and the K losses as tensor
"losses", so the server can also form soft responsibilities from them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flt.common.wire import Message
from flt.devices.ops import candidate_losses, register, sent_models, shard_data

if TYPE_CHECKING:
    from flt.devices.device import Device


@register("choose")
def choose(device: Device, batch: list[Message]) -> list[Message]:
    xs, ys = shard_data(device, batch)
    losses = candidate_losses(device, sent_models(batch), xs, ys)
    return [
        Message(
            "result",
            m.round,
            m.client,
            tensors={"losses": loss.numpy()},
            meta={"batch": m.meta["batch"], "op": "choose", "choice": int(loss.argmin()), "n": len(y)},
        )
        for m, y, loss in zip(batch, ys, losses, strict=True)
    ]
