"""IFCA: Iterative Federated Clustering Algorithm (Ghosh, Chung, Yin, Ramchandran, 2020,
"An Efficient Framework for Clustered Federated Learning", Algorithm 2, model averaging).

The server keeps C cluster models theta_1..theta_C. Each round every selected client m
receives all C of them, estimates its cluster identity
    j_m = argmin_j F_m(theta_j)            (loss on its own training data)
runs E local epochs of SGD from theta_{j_m} and returns the result with j_m. The server
averages per cluster over the clients that chose it:
    theta_j <- sum_{m: j_m = j} n_m w_m / sum_{m: j_m = j} n_m,
and a cluster nobody chose this round keeps its model.

Choices made where the paper leaves room:
- Initial models: theta_1 = w^0 (the run's common init) and theta_j = w^0 + N(0, s^2)
  for j > 1, s = `init_scale`, drawn from a torch.Generator seeded with the run's seed
  (the paper draws C random initialisations; perturbing one shared init keeps every
  method of a run starting from the same w^0 and makes the C models differ).
- Warm-up (`warmup_rounds`, the paper's remark on FedAvg pre-training): the first rounds
  are plain FedAvg with one model; then the C models are spawned from the warm-up model
  as above.
- `reinit_empty`: after aggregation, a cluster that no client currently belongs to (by
  each client's latest choice) is re-drawn as a perturbed copy of the largest cluster's
  model, so that it can take over part of that cluster instead of staying dead.
- Evaluation: client m is evaluated with the model of the cluster it chose last; a client
  that has never chosen is evaluated with the largest cluster's model (the model trained
  on the most clients; cluster 0 while nobody has chosen yet).
Optional weight sharing of the paper (shared lower layers) is not implemented.

Device side: the pick and the training are the op `train_best`
(devices/methods/train_best.py); warm-up rounds use the plain `train`.

Traffic: C models down and one up per selection after warm-up, rho*M*W*T*(C+1);
2 W per selection during warm-up.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from flt.server.ops import EVALUATE, TRAIN, TRAIN_BEST
from flt.server.strategies.base import (
    Result,
    Strategy,
    Task,
    agreement,
    cluster_average,
    one_hot,
    stack,
    weighted_average,
)
from flt.server.strategies.params import IFCA as IFCA_PARAMS

log = logging.getLogger("flt.server")


class IFCA(Strategy):
    name = "ifca"
    DEVICE_OPS = (TRAIN, TRAIN_BEST, EVALUATE)
    PARAMS = IFCA_PARAMS  # server/strategies/params.py: every method's parameters, torch-free

    def __init__(self, ctx, **params):
        super().__init__(ctx, **params)
        self.c = int(self.params["clusters"])
        if self.c > ctx.n_clients:  # a scenario's C written for more clients than this run has
            log.warning(
                "ifca: %d cluster models for %d clients: at least %d are never chosen, yet every "
                "selected client downloads all %d",
                self.c,
                ctx.n_clients,
                self.c - ctx.n_clients,
                self.c,
            )
        self.warmup = int(self.params["warmup_rounds"])
        self.warn_if_warmup_fills_the_run("its cluster models are never spawned, and every round is FedAvg")
        self.scale = float(self.params["init_scale"])
        self.gen = torch.Generator().manual_seed(int(ctx.seed))
        self.global_model = self.on(ctx.init.clone())  # used during warm-up
        self.models: torch.Tensor | None = None  # [C, P] once clustering starts
        self.choice = np.full(ctx.n_clients, -1, dtype=np.int64)  # latest cluster per client
        self.sel_warmup = 0
        self.sel_cluster = 0
        self.reinits: list[dict] = []
        if self.warmup == 0:
            self._spawn(self.global_model)

    # -- models -------------------------------------------------------------------------
    def _noise(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        z = torch.randn(rows, like.numel(), generator=self.gen, dtype=torch.float32)
        return (self.scale * z).to(like.device, like.dtype)

    def _spawn(self, base: torch.Tensor) -> torch.Tensor:
        """theta_1 = base, theta_j = base + noise for j > 1 (they become self.models)."""
        models = base[None].repeat(self.c, 1)
        if self.c > 1:
            models[1:] += self._noise(self.c - 1, base)
        self.models = models
        return models

    def clustering(self, rnd: int) -> bool:
        return rnd > self.warmup

    # -- rounds -------------------------------------------------------------------------
    def train_tasks(self, rnd: int, selected: np.ndarray) -> dict[int, Task]:
        if not self.clustering(rnd):
            self.sel_warmup += len(selected)
            host = self.global_model.cpu()[None]
            return {int(c): Task(host) for c in selected}
        models = self._spawn(self.global_model) if self.models is None else self.models
        self.sel_cluster += len(selected)
        host = models.cpu()  # [C, P], one buffer shared by every message
        return {int(c): Task(host, op=TRAIN_BEST) for c in selected}

    def aggregate(self, rnd: int, results: dict[int, Result]) -> None:
        if not results:
            return
        if not self.clustering(rnd):
            models, n = stack(results, sorted(results))
            self.global_model = weighted_average(models, n)
            return
        clients = sorted(results)
        choice = np.array([int(results[c].meta.get("choice", 0)) for c in clients], dtype=np.int64)
        bad = (choice < 0) | (choice >= self.c)
        if bad.any():
            log.error(
                "ifca: round %d: ignored %d results with a cluster choice outside 0..%d",
                rnd,
                int(bad.sum()),
                self.c - 1,
            )
            clients = [c for c, b in zip(clients, bad, strict=True) if not b]
            choice = choice[~bad]
            if not clients:
                return
        models, n = stack(results, clients)  # [s, P], [s]
        # per-cluster FedAvg; a cluster nobody chose keeps its model
        self.models = cluster_average(models, n, one_hot(choice, self.c, models), keep=self.models)
        self.choice[clients] = choice
        if self.params["reinit_empty"]:
            self._reinit_empty(rnd)

    def _reinit_empty(self, rnd: int) -> None:
        sizes = self.sizes()
        empty = np.flatnonzero(sizes == 0)
        models = self.models
        if len(empty) == 0 or sizes.sum() == 0 or models is None:
            return
        largest = int(sizes.argmax())
        base = models[largest]
        models[torch.as_tensor(empty, device=models.device)] = base[None] + self._noise(len(empty), base)
        self.reinits.append({"round": int(rnd), "clusters": empty.tolist(), "from": largest})

    def sizes(self) -> np.ndarray:
        """Clients whose latest choice is each cluster."""
        return np.bincount(self.choice[self.choice >= 0], minlength=self.c)

    def eval_models(self, clients: np.ndarray) -> tuple[torch.Tensor | None, np.ndarray]:
        clients = np.asarray(clients, dtype=np.int64)
        if self.models is None:
            return self.global_model.cpu()[None], np.zeros(len(clients), dtype=np.int64)
        rows = self.choice[clients].copy()
        rows[rows < 0] = int(self.sizes().argmax())  # never chose: the largest cluster (0 if none)
        return self.models.cpu(), rows

    def summary(self) -> dict:
        truth = self.ctx.truth.copy()
        truth[self.choice < 0] = -1  # score only clients that have chosen
        return {
            "found_clusters": self.choice.tolist(),
            "cluster_sizes": self.sizes().tolist(),
            "reinits": self.reinits,
            **agreement(self.choice, truth),
        }

    def expected_bytes(self, selections: int, model_bytes: int) -> dict:
        # rho*M*T*(C+1) W after warm-up (C down, 1 up); 2 W per selection during warm-up
        return {
            "formula": "rho*M*W_local*T*(C+1) (+ 2*W_local per warm-up selection)",
            "bytes": (self.sel_cluster * (self.c + 1) + 2 * self.sel_warmup) * model_bytes,
            "warmup_selections": self.sel_warmup,
            "cluster_selections": self.sel_cluster,
        }
