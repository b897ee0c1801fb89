"""Each client's own random streams, from (the server's per-task seed, client id): a
client's result does not depend on which device or cohort it shares."""

from __future__ import annotations

import numpy as np
import torch


def client_generator(seed: int, client: int) -> torch.Generator:
    """The client's own stream for one task, from (the server's per-round seed, client):
    its result does not depend on which device or cohort it shares."""
    return torch.Generator().manual_seed(client_seed(seed, client))


def client_seed(seed: int, client: int) -> int:
    """A 32-bit seed mixed from (seed, client) (sklearn's k-means takes 32 bits)."""
    return int(np.random.SeedSequence([int(seed), int(client)]).generate_state(1)[0])
