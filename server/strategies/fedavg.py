"""FedAvg (McMahan et al., 2017, "Communication-Efficient Learning of Deep Networks
from Decentralized Data", Algorithm 1).

Each round a fraction rho of clients receives the global model w_t, runs E epochs of
SGD with batch B on its own data, and returns w_{t+1}^k. The server sets
w_{t+1} = sum_k (n_k / n) w_{t+1}^k over the clients that returned.

`pool: all` is the FLT authors' code instead (github.com/hjraad/FLT: `all_clients: True` in
its configurations for the paper's scenarios, FedAvg and FLT alike): the server keeps every
client's latest model (the initial one until the client first trains), replaces the rows
of the clients that returned, and averages all M rows weighted by n_k. The clients not selected this round thus hold the
global model back: in effect a server step of about rho per round. It is not the paper's
text (its Algorithm 1 averages the selected clients), so it is an option, off by default.
"""

from __future__ import annotations

import numpy as np
import torch

from flt.server.strategies.base import Result, Strategy, Task, stack, weighted_average
from flt.server.strategies.params import FEDAVG


class FedAvg(Strategy):
    name = "fedavg"
    PARAMS = FEDAVG  # server/strategies/params.py: every method's parameters, torch-free

    def __init__(self, ctx, **params):
        super().__init__(ctx, **params)
        self.global_model = self.on(ctx.init.clone())
        # pool 'all': [M, P], every client's latest model (module docstring)
        self.latest = self.global_model.repeat(ctx.n_clients, 1) if self.params["pool"] == "all" else None

    def train_tasks(self, rnd: int, selected: np.ndarray) -> dict[int, Task]:
        models = self.global_model.cpu()[None]  # one buffer, shared by every message
        return {int(c): Task(models) for c in selected}

    def aggregate(self, rnd: int, results: dict[int, Result]) -> None:
        if not results:
            return
        clients = sorted(results)
        models, n = stack(results, clients)
        if self.latest is None:
            self.global_model = weighted_average(models, n)
            return
        self.latest[torch.as_tensor(clients, device=self.latest.device)] = models
        self.global_model = weighted_average(self.latest, self.on(torch.as_tensor(self.ctx.n_train)))

    def eval_models(self, clients: np.ndarray) -> tuple[torch.Tensor | None, np.ndarray]:
        return self.global_model.cpu()[None], np.zeros(len(clients), dtype=np.int64)

    def expected_bytes(self, selections: int, model_bytes: int) -> dict:
        # 2 * rho * M * W_local * T, with rho * M * T = the selections actually made
        return {"formula": "2*rho*M*W_local*T", "bytes": 2 * selections * model_bytes}
