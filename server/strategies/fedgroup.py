"""FedGroup (Duan, Li, Zhong, Zhang, Liang, Hu, 2021, "FedGroup: Efficient Clustered Federated
Learning via Decomposed Data-Driven Measure"), Algorithms 1-2 with the EDC measure.

Group cold start, before round 1: alpha x m clients (at most M) pre-train from the common
initial weights w^0 and send their models back; their updates dw_i = w_i - w^0 form the
matrix dW [n, P]. A truncated SVD of dW^T gives m directions V = [v_1..v_m] [P, m], and
each client is described by its decomposed cosine similarities
    x_i = (cos(dw_i, v_1), ..., cos(dw_i, v_m))
(the Euclidean distance between two such rows is the paper's EDC measure; computed
exactly from the n x n Gram matrix dW dW^T, `edc_features`). K-means++ (m groups,
seeded) clusters the rows; group g starts from the mean of its members' models and keeps
the mean of their updates as its direction u_g, a step from w^0 like every cold-start
update (the authors' code: the group's `opt_updates`, set once). Fewer pre-trained
replies than m (fewer clients than groups, or devices lost) make m that number, with a
warning.

Rounds: each selected client trains from its group's model; each group averages its
members' models (weighted by samples). With `inter_group_lr` eta > 0, each group model
also moves eta times the mean of the other groups' round updates (FedGroup's optional
inter-group aggregation; 0 by default).

Client cold start: a client with no group (not among the pre-trained, or a newcomer)
trains, the first time it is selected, from w^0; its update dw joins the group with the
smallest cosine dissimilarity to u_g (the authors' `client_cold_start`: from w^0, against
`opt_updates`; a group's latest round step, which their code compares only when a client
is redone, points elsewhere once the group has trained). Since the client did not start
from that group's model it is not averaged into it that round. (FedGroup's code pre-trains
a newcomer and then trains it with its group in the same round; here the cold-start
training is that round's work, so the client trains once per selection like every other.)

Evaluation: a client with a group is evaluated with its group's model, one without with
the mean of the group models (FedGroup's auxiliary global model).

Traffic: 2 W per pre-trained client, then 2 W per selection, as FedAvg.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from sklearn.cluster import KMeans

from flt.common.errors import DeviceError
from flt.server.strategies.base import (
    FederationView,
    Result,
    Strategy,
    Task,
    agreement,
    cluster_average,
    one_hot,
    stack,
)
from flt.server.strategies.params import FEDGROUP

log = logging.getLogger(__name__)


class FedGroup(Strategy):
    name = "fedgroup"
    PARAMS = FEDGROUP  # server/strategies/params.py: every method's parameters, torch-free

    def __init__(self, ctx, **params):
        super().__init__(ctx, **params)
        self.m = int(self.params["groups"])
        self.eta = float(self.params["inter_group_lr"])
        self.init = self.on(ctx.init.clone())
        self.models = self.init[None].repeat(self.m, 1)  # [m, P], set by the cold start
        self.directions = torch.zeros_like(self.models)  # u_g: each group's cold-start update from w^0
        self.group = np.full(ctx.n_clients, -1, dtype=np.int64)
        self.rng = np.random.default_rng(int(ctx.seed))
        self.pretrained = 0
        self.cold_starts: list[dict] = []  # per round: clients placed by cold start

    # -- group cold start ---------------------------------------------------------------
    def setup(self, fed: FederationView) -> None:
        present = np.asarray(fed.present, dtype=np.int64)
        size = min(len(present), self.m * int(self.params["pretrain_scale"]))
        chosen = np.sort(self.rng.choice(present, size=size, replace=False))
        host = self.init.cpu()[None]
        ex = fed.train(0, {int(c): Task(host) for c in chosen}, purpose="pretrain")
        results = ex.results  # every reply counts: the pre-training has no deadline
        if not results:
            raise DeviceError(f"fedgroup: none of the {size} pre-training clients answered")
        if len(results) < self.m:  # too few clients (or devices lost): one group per client answered
            log.warning(
                "fedgroup: %d groups asked for, but %d of %d pre-training clients answered (of %d present): %d groups",
                self.m,
                len(results),
                size,
                len(present),
                len(results),
            )
            self.m = len(results)
            self.models, self.directions = self.models[: self.m], self.directions[: self.m]
        self.pretrained = len(results)
        clients = sorted(results)
        models, n = stack(results, clients, consume=True)  # replies leave `results` as stacked: one copy
        labels = self.edc_groups(models)
        r = one_hot(labels, self.m, models)
        ones = torch.ones_like(n)  # FedGroup's group initialisation is a plain mean
        self.models = cluster_average(models, ones, r, keep=self.models)
        updates = models.sub_(self.init)  # in place: the models are not needed again
        self.directions = cluster_average(updates, ones, r, keep=self.directions)
        self.group[clients] = labels

    def edc_groups(self, models: torch.Tensor) -> np.ndarray:
        """K-means++ groups of the clients' decomposed cosine similarities to the m top
        singular directions of their updates dw_i = w_i - w^0 (from their models [n, P])."""
        n, p = models.shape
        k = min(self.m, n - 1, p - 1)
        if k < 1:
            return np.zeros(n, dtype=np.int64)
        seed = int(self.ctx.seed)
        found = KMeans(n_clusters=min(self.m, n), init="k-means++", n_init=10, random_state=seed)
        return found.fit_predict(edc_features(models, k, origin=self.init)).astype(np.int64)

    # -- rounds -------------------------------------------------------------------------
    def train_tasks(self, rnd: int, selected: np.ndarray) -> dict[int, Task]:
        host = self.models.cpu()  # one buffer; each task carries its group's row
        start = self.init.cpu()[None]
        tasks = {}
        for c in np.asarray(selected, dtype=np.int64).tolist():
            g = int(self.group[c])
            tasks[c] = Task(host[g : g + 1]) if g >= 0 else Task(start)  # no group yet: cold start from w^0
        return tasks

    def aggregate(self, rnd: int, results: dict[int, Result]) -> None:
        warm = [c for c in sorted(results) if self.group[c] >= 0]  # before the cold start places the rest
        cold = [c for c in sorted(results) if self.group[c] < 0]
        if cold:
            self.cold_start(rnd, cold, results)
        if not warm:
            return
        models, n = stack(results, warm)
        old = self.models
        new = cluster_average(models, n, one_hot(self.group[warm], self.m, models), keep=old)
        if self.eta > 0 and self.m > 1:  # each group moves towards the others' mean round update
            delta = new - old
            others = (delta.sum(0, keepdim=True) - delta) / (self.m - 1)
            new = new + self.eta * others
        self.models = new

    def cold_start(self, rnd: int, clients: list[int], results: dict[int, Result]) -> None:
        """Each client joins the group whose cold-start update from w^0 is the most like its own."""
        models, _ = stack(results, clients)
        updates = models - self.init
        dissimilarity = 1 - torch.nn.functional.cosine_similarity(
            updates[:, None, :], self.directions[None, :, :], dim=2
        )  # [c, m]
        self.group[clients] = dissimilarity.argmin(1).cpu().numpy()
        self.cold_starts.append({"round": int(rnd), "clients": len(clients)})

    def eval_models(self, clients: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        clients = np.asarray(clients, dtype=np.int64)
        rows = self.group[clients].copy()
        models = torch.cat([self.models, self.models.mean(0, keepdim=True)])  # last row: the auxiliary model
        rows[rows < 0] = self.m
        return models.cpu(), rows

    def summary(self) -> dict:
        truth = self.ctx.truth.copy()
        truth[self.group < 0] = -1  # score only clients that have a group
        return {
            "found_clusters": self.group.tolist(),
            "cluster_sizes": np.bincount(self.group[self.group >= 0], minlength=self.m).tolist(),
            "pretrained_clients": self.pretrained,
            "cold_starts": self.cold_starts,
            **agreement(self.group, truth),
        }

    def expected_bytes(self, selections: int, model_bytes: int) -> dict:
        return {
            "formula": "2*W*(alpha*m pre-trained + rho*M*T)",
            "bytes": 2 * model_bytes * (self.pretrained + selections),
        }


def edc_features(updates: torch.Tensor, k: int, origin: torch.Tensor | None = None) -> np.ndarray:
    """x_ij = cos(dw_i, v_j) for the k top singular directions v_j of dW^T [P, n], from the
    n x n Gram matrix G = dW dW^T alone: with dW = A S V^T, dw_i . v_j = s_j A_ij, so
    x_ij = s_j A_ij / |dw_i|, where G = A S^2 A^T gives A and s exactly and |dw_i|^2 = G_ii.
    No [P, n] float64 copy or SVD of it: on S3 with the LEAF CNN (100 updates of 6.6 M
    parameters) those took the server to 20 GB. With `origin` [P] the rows are models and
    dw_i = w_i - origin, subtracted a block at a time (no [n, P] copy either). The columns'
    signs are arbitrary, which k-means does not see (a reflection keeps every distance)."""
    gram = gram_matrix(updates, origin=origin)
    values, vectors = np.linalg.eigh(gram)  # ascending
    top = np.argsort(values, kind="stable")[::-1][:k]
    sigma = np.sqrt(np.clip(values[top], 0.0, None))
    norms = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    zero = norms == 0
    norms[zero] = 1.0
    features = vectors[:, top] * sigma / norms[:, None]
    features[zero] = 0.0  # a zero update has cosine 0 with everything, as sklearn's; eigh leaves ~1e-18
    return features


def gram_matrix(rows: torch.Tensor, block: int = 1 << 20, origin: torch.Tensor | None = None) -> np.ndarray:
    """D @ D.T in float64 for D = rows - origin (rows itself without one), summed over
    column blocks so that neither D nor a float64 copy of it exists whole (one block of
    n x 2^20 at a time; the subtraction is the same float32 one as on the whole matrix)."""
    gram = torch.zeros(rows.shape[0], rows.shape[0], dtype=torch.float64, device=rows.device)
    for start in range(0, rows.shape[1], block):
        part = rows[:, start : start + block]
        if origin is not None:
            part = part - origin[start : start + block]
        part = part.double()
        gram += part @ part.T
    return gram.cpu().numpy()
