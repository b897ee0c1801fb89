"""Oracle: FedAvg inside each planted cluster, the clusters told by the scenario.

Not a federated method (no server knows its clients' groups): the upper reference that
clustered-FL evaluations often call the oracle, against which a clustered method's
clustering is measured. Each round the selected clients train
their own cluster's model, and cluster c's model becomes
    W_c = sum_{m in c, returned} n_m w_m / sum_{m in c, returned} n_m
(a cluster with no client back this round keeps its model). It costs what FedAvg costs,
2 * rho * M * W_local * T. Where a method with the same training reaches the oracle, its
clustering lost nothing; the gap between them is what its clustering costs. Clients
without a planted cluster (truth -1) form one group of their own, so on a scenario that
plants none (Dirichlet, the FEMNIST writers) the oracle is FedAvg.

`pool: all`, as FedAvg's, is the FLT authors' code (`all_clients: True`, which their FLT
runs use too): the server keeps every client's latest model, and W_c averages all of
cluster c's rows, those of the clients not selected this round included, so they hold the
cluster's model back (a server step of about rho).
"""

from __future__ import annotations

import numpy as np
import torch

from flt.server.strategies.base import Result, Strategy, Task, agreement, cluster_average, one_hot, stack
from flt.server.strategies.params import FEDAVG


class Oracle(Strategy):
    name = "oracle"
    PARAMS = FEDAVG  # FedAvg's `pool`: the oracle is FedAvg inside each cluster

    def __init__(self, ctx, **params):
        super().__init__(ctx, **params)
        # the planted ids; each client's is read live (a scenario that swaps two clients'
        # data swaps their truth)
        self.groups = np.unique(np.asarray(ctx.truth))
        self.models = self.on(ctx.init.clone())[None].repeat(len(self.groups), 1)
        # pool 'all': [M, P], every client's latest model (module docstring)
        self.latest = self.models[0].repeat(ctx.n_clients, 1) if self.params["pool"] == "all" else None

    def rows(self, clients: np.ndarray) -> np.ndarray:
        """Each client's row of self.models: its planted cluster's."""
        return np.searchsorted(self.groups, np.asarray(self.ctx.truth)[np.asarray(clients, dtype=np.int64)])

    def train_tasks(self, rnd: int, selected: np.ndarray) -> dict[int, Task]:
        host = self.models.cpu()
        return {int(c): Task(host[r][None]) for c, r in zip(selected, self.rows(selected), strict=True)}

    def aggregate(self, rnd: int, results: dict[int, Result]) -> None:
        if not results:
            return
        clients = sorted(results)
        models, n = stack(results, clients)
        if self.latest is not None:
            self.latest[torch.as_tensor(clients, device=self.latest.device)] = models
            clients, models = list(range(len(self.latest))), self.latest
            n = self.on(torch.as_tensor(self.ctx.n_train))
        hard = one_hot(self.rows(np.array(clients)), len(self.groups), like=models)
        self.models = cluster_average(models, n, hard, keep=self.models)

    def eval_models(self, clients: np.ndarray) -> tuple[torch.Tensor | None, np.ndarray]:
        return self.models.cpu(), self.rows(clients)

    def expected_bytes(self, selections: int, model_bytes: int) -> dict:
        return {"formula": "2*rho*M*W_local*T", "bytes": 2 * selections * model_bytes}

    def summary(self) -> dict:
        rows = self.rows(np.arange(self.ctx.n_clients))
        return {"found_clusters": rows.tolist(), **agreement(rows, np.asarray(self.ctx.truth))}
