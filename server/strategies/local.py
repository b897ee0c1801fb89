"""Local training: every client trains its own model and nothing is ever averaged.

The reference point "no collaboration" of McMahan et al. (2017) and of the FLT paper's
tables: client m minimises its own empirical risk, w_m^{t+1} = SGD_E(w_m^t; D_m), starting
from the common initial weights w^0. There is no communication after initialisation.

Over the wire: its tasks name the device op `train_resident`
(devices/methods/train_resident.py). The first time a client is selected its Task
carries w^0; the device keeps that client's model from then on, trains it in every round
the client is selected (the same participation draws as every other method) and replies
without a model tensor. Later Tasks carry no model at all. Evaluation is device-resident
as well (`eval_models` returns models None).
"""

from __future__ import annotations

import numpy as np
import torch

from flt.server.ops import EVALUATE, TRAIN_RESIDENT
from flt.server.strategies.base import Result, Strategy, Task


class Local(Strategy):
    name = "local"
    PARAMS: dict = {}
    DEVICE_OPS = (TRAIN_RESIDENT, EVALUATE)

    def __init__(self, ctx, **params):
        super().__init__(ctx, **params)
        self.init_host = ctx.init.detach().cpu()[None]  # [1, P], one buffer for every first Task
        self.initialised = np.zeros(ctx.n_clients, dtype=bool)  # the device holds w^0 for m
        self.trained = np.zeros(ctx.n_clients, dtype=np.int64)  # rounds each client trained

    def train_tasks(self, rnd: int, selected: np.ndarray) -> dict[int, Task]:
        tasks = {}
        for c in map(int, selected):
            # Marked when the Task is sent: the device stores w^0 before it trains, so even a
            # client whose update is later dropped (straggler, offline) already holds it.
            tasks[c] = Task(None if self.initialised[c] else self.init_host, op=TRAIN_RESIDENT)
            self.initialised[c] = True
        return tasks

    def aggregate(self, rnd: int, results: dict[int, Result]) -> None:
        for c in results:  # nothing to average: only bookkeeping
            self.trained[c] += 1

    def eval_models(self, clients: np.ndarray) -> tuple[torch.Tensor | None, np.ndarray]:
        return None, np.zeros(len(clients), dtype=np.int64)

    def summary(self) -> dict:
        return {"clients_initialised": int(self.initialised.sum()), "rounds_trained_per_client": self.trained.tolist()}

    def expected_bytes(self, selections: int, model_bytes: int) -> dict:
        # M * W_local at most: w^0 once per client that was ever selected, nothing up
        return {"formula": "M*W_local (w0 once per client)", "bytes": int(self.initialised.sum()) * model_bytes}
