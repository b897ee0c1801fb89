"""FedSEM / FeSEM: multi-center federated learning (Xie, Long, Zhou, Jiang, Jiang, Zhang,
2020, "Multi-Center Federated Learning", Algorithm 1, stochastic expectation maximisation).

The server keeps K centre models W~_1..W~_K and an assignment r_m of clients to centres.
Each round, for the selected clients:
  1. client m receives its centre W~_{r_m}, runs E local epochs of SGD and returns W_m;
  2. E-step (re-assignment): r_m = argmin_k ||W_m - W~_k||_2   (L2 in parameter space);
  3. M-step (centre update): W~_k = sum_{m: r_m = k} n_m W_m / sum_{m: r_m = k} n_m
     over this round's returned clients; a centre with no returned member keeps its value.
Both steps are vectorized: one torch.cdist [s, K] and one [K, s] x [s, P] product.

Choices made where the paper leaves room:
- Initialisation ("random_clients"): the paper initialises the centres from randomly
  chosen clients' models. Until the first round in which at least K clients return, the
  method is plain FedAvg on one model w^0 (nothing to pick from yet); in that round the K
  centres are picked among the returned models k-means++-style (first uniformly, then
  proportional to the squared distance to the nearest pick), with a numpy Generator
  seeded from the run's seed; steps 2-3 then run on that same round's models.
- `reassign_every` = r: every returned model is re-assigned in rounds r, 2r, ...; in other
  rounds a client keeps its centre (clients never assigned before are always assigned).
  r = 1 (default) is the paper's algorithm: the assignment is revisited every round.
- A selected client never assigned yet receives the centre nearest to the global
  average, i.e. to sum_k N_k W~_k / sum_k N_k with N_k the training samples of the
  clients assigned to k: the centre that best represents the population as a whole.
  The same centre is its evaluation model until it is assigned.

`pool: all` is the FLT authors' code instead (github.com/hjraad/FLT, base_fed_learning/
main_fed.py: `multi_center` with `all_clients: True`), offered to measure how far their
FedSEM figures owe to it; off by default. Every client holds a latest model: the initial
one until the first round, then its centre. Each round the returned models replace their
clients' rows, and k-means runs over all M rows (the first time k-means++ with 20 seeded
restarts, then warm-started from the current centres, one start); every client, selected
or not, is assigned, and each centre becomes its members' sample-weighted average of those
M rows, so the clients not selected this round hold their centre back (a server step of
about rho, as in FedAvg's `pool: all`). Not copied: their average is updated in place
client by client, so a client later in the list averages its predecessors' averages; here
each centre is one weighted average of the rows as they were.

Traffic: one model down and one up per selection, 2*rho*M*W_local*T.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from sklearn.cluster import KMeans

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
from flt.server.strategies.params import FEDSEM

log = logging.getLogger(__name__)


class FedSEM(Strategy):
    name = "fedsem"
    PARAMS = FEDSEM  # server/strategies/params.py: every method's parameters, torch-free

    def __init__(self, ctx, **params):
        super().__init__(ctx, **params)
        self.k = int(self.params["centers"])
        self.every = int(self.params["reassign_every"])
        self.rng = np.random.default_rng(int(ctx.seed))
        self.global_model = self.on(ctx.init.clone())  # before the centres exist
        self.centres: torch.Tensor | None = None  # [K, P]
        self.assign = np.full(ctx.n_clients, -1, dtype=np.int64)
        self.init_round: int | None = None
        self.moves = 0  # re-assignments that changed centre
        self.waited = False  # said that the centres wait for a round with K returned models
        self.pool_all = self.params.get("pool") == "all"  # FeSEM (soft) has no pool: the paper's steps

    # -- helpers ------------------------------------------------------------------------
    def kmeanspp(self, models: torch.Tensor) -> torch.Tensor:
        """K rows of models picked k-means++-style (seeded)."""
        n = len(models)
        picks = [int(self.rng.integers(n))]
        d2 = torch.cdist(models, models[picks[0]][None]).squeeze(1).double() ** 2
        for _ in range(1, self.k):
            total = float(d2.sum())
            if total > 0:
                p = (d2 / total).cpu().numpy()
                nxt = int(self.rng.choice(n, p=p / p.sum()))
            else:  # all remaining models coincide with a pick
                rest = np.setdiff1d(np.arange(n), picks)
                nxt = int(self.rng.choice(rest)) if len(rest) else picks[-1]
            picks.append(nxt)
            d2 = torch.minimum(d2, torch.cdist(models, models[nxt][None]).squeeze(1).double() ** 2)
        return models[picks].clone()

    def placed(self) -> torch.Tensor:
        """The centres, which exist from the first round in which K clients returned on."""
        if self.centres is None:
            raise RuntimeError(f"{self.name}: the centres were used before they were initialised")
        return self.centres

    def nearest(self, models: torch.Tensor) -> np.ndarray:
        return torch.cdist(models, self.placed()).argmin(1).cpu().numpy()

    def default_centre(self) -> int:
        """The centre nearest to the sample-weighted average of the centres."""
        known = self.assign >= 0
        mass = np.bincount(self.assign[known], weights=self.ctx.n_train[known], minlength=self.k).astype(np.float64)
        if mass.sum() == 0:
            mass = np.ones(self.k)
        centres = self.placed()
        avg = weighted_average(centres, torch.as_tensor(mass, device=centres.device))
        return int(self.nearest(avg[None])[0])

    def wait_for_centres(self, returned: int) -> None:
        """The centres are K distinct models of one round: until a round returns K, FedSEM
        averages what came (FedAvg). Said once, as a cohort smaller than K never places them."""
        if not self.waited:
            log.warning(
                "%s: %d centres need a round in which %d clients return; round models averaged (FedAvg) "
                "until one does (%d returned; with fewer selected a round than K it never clusters)",
                self.name,
                self.k,
                self.k,
                returned,
            )
            self.waited = True

    # -- rounds -------------------------------------------------------------------------
    def train_tasks(self, rnd: int, selected: np.ndarray) -> dict[int, Task]:
        if self.centres is None:
            host = self.global_model.cpu()[None]
            return {int(c): Task(host) for c in selected}
        host = self.centres.cpu()
        fallback = self.default_centre()
        rows = {int(c): int(self.assign[c]) if self.assign[c] >= 0 else fallback for c in selected}
        return {c: Task(host[r][None]) for c, r in rows.items()}

    def aggregate(self, rnd: int, results: dict[int, Result]) -> None:
        if not results:
            return
        clients = sorted(results)
        models, n = stack(results, clients)  # [s, P], [s]
        if self.pool_all:
            self.aggregate_pool(rnd, clients, models)
            return
        if self.centres is None:
            if len(clients) < self.k:
                self.wait_for_centres(len(clients))
                self.global_model = weighted_average(models, n)
                return
            self.centres = self.kmeanspp(models)
            self.init_round = int(rnd)
        # M-step: per-centre sample-weighted average of this round's members
        self.centres = cluster_average(models, n, self.e_step(rnd, clients, models), keep=self.centres)

    def aggregate_pool(self, rnd: int, clients: list[int], models: torch.Tensor) -> None:
        """`pool: all` (module docstring): k-means over every client's latest model."""
        m = self.ctx.n_clients
        if self.centres is None:
            latest = self.global_model[None].expand(m, -1).clone()
        else:
            latest = self.centres[torch.as_tensor(self.assign, device=self.centres.device)]
        latest[torch.as_tensor(clients, device=latest.device)] = models
        old = self.assign.copy()
        if self.centres is None:
            self.init_round = int(rnd)
        if self.centres is None or rnd % self.every == 0:
            self.assign = self.kmeans(latest.detach().cpu().numpy())
        self.moves += int(((old >= 0) & (self.assign != old)).sum())
        n_all = self.on(torch.as_tensor(self.ctx.n_train))
        keep = self.centres if self.centres is not None else latest[torch.arange(self.k) % m]
        self.centres = cluster_average(latest, n_all, one_hot(self.assign, self.k, latest), keep=keep)

    def kmeans(self, rows: np.ndarray) -> np.ndarray:
        """Cluster labels of the M latest models: seeded k-means++ with 20 restarts the
        first time, then one run warm-started from the current centres."""
        k = min(self.k, len(rows))  # below K only with fewer clients than centres
        if self.centres is None:
            km = KMeans(k, init="k-means++", n_init=20, random_state=int(self.rng.integers(2**31 - 1)))
        else:
            km = KMeans(k, init=self.centres[:k].detach().cpu().numpy().astype(rows.dtype), n_init=1)
        return km.fit(rows).labels_.astype(np.int64)

    def e_step(self, rnd: int, clients: list[int], models: torch.Tensor) -> torch.Tensor:
        """Responsibilities [K, s] of this round's models; every client's centre becomes
        its most responsible one. Outside re-assignment rounds an assigned client keeps its
        centre (one-hot)."""
        old = self.assign[clients]
        redo = (old < 0) | (rnd % self.every == 0)
        resp = self.responsibilities(models)
        new = np.where(redo, resp.argmax(0).cpu().numpy(), old)
        self.moves += int(((old >= 0) & (new != old)).sum())
        self.assign[clients] = new
        return torch.where(torch.as_tensor(redo, device=models.device)[None], resp, one_hot(new, self.k, models))

    def responsibilities(self, models: torch.Tensor) -> torch.Tensor:
        """The paper's hard E-step: nearest centre in L2 parameter distance, one-hot [K, s]."""
        return one_hot(self.nearest(models), self.k, models)

    def eval_models(self, clients: np.ndarray) -> tuple[torch.Tensor | None, np.ndarray]:
        clients = np.asarray(clients, dtype=np.int64)
        if self.centres is None:
            return self.global_model.cpu()[None], np.zeros(len(clients), dtype=np.int64)
        rows = self.assign[clients].copy()
        rows[rows < 0] = self.default_centre()
        return self.centres.cpu(), rows

    def summary(self) -> dict:
        truth = self.ctx.truth.copy()
        truth[self.assign < 0] = -1  # score only assigned clients
        sizes = np.bincount(self.assign[self.assign >= 0], minlength=self.k)
        return {
            "found_clusters": self.assign.tolist(),
            "cluster_sizes": sizes.tolist(),
            "init_round": self.init_round,
            "reassignments": self.moves,
            **agreement(self.assign, truth),
        }

    def expected_bytes(self, selections: int, model_bytes: int) -> dict:
        return {"formula": "2*rho*M*W_local*T", "bytes": 2 * selections * model_bytes}
