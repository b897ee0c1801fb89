"""`subspace`: PACFL's client step (Vahidian, Morafah, Wang, Kungurtsev, Chen, Shah, Lin,
AAAI 2023, "Efficient Distribution Similarity Identification in Clustered Federated
Learning via Principal Angles Between Client Data Subspaces").

For every class j the client holds, its images of that class form the data matrix
D_j [d, n_j] (pixels flattened, one column per image); the client sends the first p left
singular vectors of each, U = [U_1 .. U_J] (p x J unit vectors of the pixel space), as
tensor "basis" [p*J, d] in the reply ("result", billed as embedding traffic). p is the
task's meta "basis". Nothing else about the data leaves the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flt.common.wire import Message
from flt.devices.ops import register

if TYPE_CHECKING:
    from flt.devices.device import Device


def class_bases(x: torch.Tensor, y: torch.Tensor, p: int) -> torch.Tensor:
    """[p*J, d]: the top-p left singular vectors of each class's data matrix D_j = x_j^T
    (the right singular vectors of x_j [n_j, d]), classes in ascending order."""
    flat = x.reshape(len(x), -1).double()
    rows = [torch.linalg.svd(flat[y == j], full_matrices=False).Vh[:p] for j in torch.unique(y).tolist()]
    return torch.cat(rows).float() if rows else torch.zeros(0, flat.shape[1])


@register("subspace")
def subspace(device: Device, batch: list[Message]) -> list[Message]:
    p = int(batch[0].meta["basis"])
    replies = []
    for m in batch:  # one SVD per class of each client: a one-off step before round 1
        shard = device.shards[m.client]
        basis = class_bases(shard.x.cpu(), shard.y.cpu(), p)
        replies.append(
            Message(
                "result",
                m.round,
                m.client,
                tensors={"basis": basis.numpy()},
                meta={"batch": m.meta["batch"], "op": "subspace", "traffic": "embedding", "n": len(shard.y)},
            )
        )
    return replies
