"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, 2020, "Federated Optimization in
Heterogeneous Networks", Algorithm 2).

Identical to FedAvg on the server: w^{t+1} = sum_k (n_k / n) w_k^{t+1} over the clients
that returned. Each selected client k instead (approximately) minimises the proximal
objective
    h_k(w; w^t) = F_k(w) + (mu / 2) ||w - w^t||^2
by E epochs of SGD started from w^t. The server sends mu with the model (meta
"prox_mu"); the device's trainer adds the proximal term. mu = 0 is FedAvg.

The paper's device-side partial work (stragglers doing fewer epochs) is the emulator's
business (deadlines drop late clients); the aggregation keeps every returned update.
"""

from __future__ import annotations

import numpy as np

from flt.server.strategies.base import Task
from flt.server.strategies.fedavg import FedAvg
from flt.server.strategies.params import FEDPROX


class FedProx(FedAvg):
    name = "fedprox"
    PARAMS = FEDPROX  # server/strategies/params.py: every method's parameters, torch-free

    def __init__(self, ctx, **params):
        super().__init__(ctx, **params)
        self.mu = float(self.params["mu"])

    def train_tasks(self, rnd: int, selected: np.ndarray) -> dict[int, Task]:
        models = self.global_model.cpu()[None]  # one buffer, shared by every message
        return {int(c): Task(models, {"prox_mu": self.mu}) for c in selected}
