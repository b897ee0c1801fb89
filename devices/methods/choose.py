"""`choose`: which of K candidate models fits this client's own data best, without training.

The client step of IFCA's cluster-identity estimate (Ghosh et al. 2020, Algorithm 2,
line 6: j_m = argmin_j F_m(theta_j)) on its own, for a method that assigns clients before
(or instead of) training them. The task carries the candidates as tensor "model" [K, P];
the reply ("result") carries the index in meta "choice" and the K losses as tensor
"losses", so the server can also form soft responsibilities from them.
"""

from __future__ import annotations

from flt.devices.ops import candidate_losses, register, start_models
from flt.models.wire import Message


@register("choose")
def choose(device, batch: list[Message]) -> list[Message]:
    shards = [device.shards[m.client] for m in batch]
    losses = candidate_losses(device, start_models(device, batch), [s.x for s in shards], [s.y for s in shards])
    return [
        Message(
            "result",
            m.round,
            m.client,
            tensors={"losses": loss.numpy()},
            meta={"batch": m.meta["batch"], "op": "choose", "choice": int(loss.argmin()), "n": len(s.y)},
        )
        for m, s, loss in zip(batch, shards, losses, strict=True)
    ]
