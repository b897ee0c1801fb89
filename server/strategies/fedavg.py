"""FedAvg (McMahan et al., 2017, "Communication-Efficient Learning of Deep Networks
from Decentralized Data", Algorithm 1).

Each round a fraction rho of clients receives the global model w_t, runs E epochs of
SGD with batch B on its own data, and returns w_{t+1}^k. The server sets
w_{t+1} = sum_k (n_k / n) w_{t+1}^k over the clients that returned.
"""

from __future__ import annotations

import numpy as np
import torch

from flt.server.strategies.base import Result, Strategy, Task, stack, weighted_average


class FedAvg(Strategy):
    name = "fedavg"

    def __init__(self, ctx, **params):
        super().__init__(ctx, **params)
        self.global_model = self.on(ctx.init.clone())

    def train_tasks(self, rnd: int, selected: np.ndarray) -> dict[int, Task]:
        models = self.global_model.cpu()[None]  # one buffer, shared by every message
        return {int(c): Task(models) for c in selected}

    def aggregate(self, rnd: int, results: dict[int, Result]) -> None:
        if results:
            models, n = stack(results, sorted(results))
            self.global_model = weighted_average(models, n)

    def eval_models(self, clients: np.ndarray) -> tuple[torch.Tensor | None, np.ndarray]:
        return self.global_model.cpu()[None], np.zeros(len(clients), dtype=np.int64)

    def expected_bytes(self, selections: int, model_bytes: int) -> dict:
        # 2 * rho * M * W_local * T, with rho * M * T = the selections actually made
        return {"formula": "2*rho*M*W_local*T", "bytes": 2 * selections * model_bytes}
