"""PACFL (Vahidian, Morafah, Wang, Kungurtsev, Chen, Shah, Lin, AAAI 2023, "Efficient
Distribution Similarity Identification in Clustered Federated Learning via Principal
Angles Between Client Data Subspaces"), Algorithm 1.

One shot, before round 1: client k sends, for every class j it holds, the first p left
singular vectors of its data matrix D_kj [d, n_kj] (pixels flattened):
U_k = [U_k1 .. U_kJ] [d, p*J] (the `subspace` op, devices/methods/subspace.py). The server
forms the proximity matrix of the smallest angles between the clients' bases,
    A_ij = min_{r, s} arccos(|u_ir . u_js|)   (degrees),
and clusters it hierarchically: merge the two closest clusters while their distance is
at most the threshold beta (`threshold`), updating the merged row as the authors' code does
(`linkage` average: the mean of the two rows, i.e. WPGMA; maximum; minimum). Each cluster
then runs FedAvg; a client is evaluated with its cluster's model.

Where this differs from the authors' code: the angle takes |u . v| (a singular vector's
sign is arbitrary; principal angles are defined on the lines), and `clusters` may give C
instead of beta (cut the same tree into C clusters). The authors' scripts also size p per
class from a client's class shares under Dirichlet partitions; here p is one number.

Newcomers: a client that arrives sends its basis and joins the cluster at the smallest
mean angle to its members (the authors' unseen-clients experiment). A client whose basis
did not come at set-up (its device late or failing) is asked again at the end of the
next round and placed the same way, up to RETRIES times in a row.

Traffic: p*J*d*4 bytes up per client once (J: the classes it holds), then 2 W per
selection as FedAvg.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.spatial.distance import squareform

from flt.common.errors import DeviceError
from flt.server.exchange import Call
from flt.server.ops import EVALUATE, SUBSPACE, TRAIN
from flt.server.strategies.base import (
    FederationView,
    Result,
    Strategy,
    Task,
    agreement,
    cluster_average,
    log,
    one_hot,
    stack,
)
from flt.server.strategies.params import PACFL as PACFL_PARAMS

# How many times a client whose subspace did not come is asked again, in the rounds after.
RETRIES = 3
# the authors' row update after a merge, as scipy names it
LINKAGES = {"average": "weighted", "maximum": "complete", "minimum": "single"}


def _stack(bases: list[np.ndarray], rows: int) -> torch.Tensor:
    """[M, rows, d]: each client's unit rows, padded with zero rows (which never win the
    maximum |cosine|)."""
    stacked = np.zeros((len(bases), rows, bases[0].shape[1]), dtype=np.float64)
    for i, b in enumerate(bases):  # one copy per client, no pairs
        stacked[i, : len(b)] = b
    return torch.from_numpy(stacked)


def cross_angles(a: list[np.ndarray], b: list[np.ndarray], budget: int = 2**24) -> np.ndarray:
    """[len(a), len(b)]: the smallest angle (degrees) between any basis vector of a's
    client i and any of b's client j, as batched products over slices of a's clients
    (each slice's [n, len(b), r, r] cosines stay under `budget` numbers)."""
    rows = max(len(x) for x in [*a, *b])
    ta, tb = _stack(a, rows), _stack(b, rows)
    step = max(1, budget // (len(b) * rows * rows))
    cos = torch.cat(
        [torch.einsum("ird,jsd->ijrs", ta[lo : lo + step], tb).abs().amax(dim=(2, 3)) for lo in range(0, len(a), step)]
    )
    return torch.rad2deg(torch.arccos(cos.clamp(max=1.0))).numpy()


def smallest_angles(bases: list[np.ndarray]) -> np.ndarray:
    """A [M, M] of `cross_angles` among the clients, zero on the diagonal and exactly
    symmetric (for scipy)."""
    angles = cross_angles(bases, bases)
    np.fill_diagonal(angles, 0.0)
    return (angles + angles.T) / 2


def hierarchical(adjacency: np.ndarray, how: str, threshold: float, clusters: int | None) -> np.ndarray:
    """Cluster labels 0..C-1: merge while the closest pair is within `threshold` (or cut
    into `clusters`), with the authors' linkage update."""
    if len(adjacency) == 1:
        return np.zeros(1, dtype=np.int64)
    tree = linkage(squareform(adjacency, checks=False), method=LINKAGES[how])
    found = (
        fcluster(tree, t=clusters, criterion="maxclust")
        if clusters
        else fcluster(tree, t=threshold, criterion="distance")
    )
    _, labels = np.unique(found, return_inverse=True)
    return labels.astype(np.int64)


class PACFL(Strategy):
    name = "pacfl"
    DEVICE_OPS = (TRAIN, EVALUATE, SUBSPACE)
    PARAMS = PACFL_PARAMS  # server/strategies/params.py: every method's parameters, torch-free

    @classmethod
    def max_upload(cls, params: dict, in_shape: tuple[int, ...], num_classes: int) -> int:
        return int(params["basis"]) * max(num_classes, 1) * int(np.prod(in_shape or (1,))) * 4 + 4096

    def __init__(self, ctx, **params):
        super().__init__(ctx, **params)
        self.p = int(self.params["basis"])
        self.labels = np.full(ctx.n_clients, -1, dtype=np.int64)
        self.bases: dict[int, np.ndarray] = {}
        self.models = self.on(ctx.init.clone())[None]  # [C, P] after setup
        self.adjacency = np.zeros((0, 0))
        self.basis_bytes = 0
        self.misses: dict[int, int] = {}  # subspace requests a client left unanswered in a row

    # -- the one-shot clustering ---------------------------------------------------------
    def setup(self, fed: FederationView) -> None:
        got = self.collect(fed, np.asarray(fed.present, dtype=np.int64), 0, "pacfl")
        if not got:
            raise DeviceError("pacfl: no client sent its subspace (see the device logs)")
        clients = np.array(sorted(got), dtype=np.int64)
        self.adjacency = smallest_angles([self.bases[c] for c in clients.tolist()])
        labels = hierarchical(self.adjacency, self.params["linkage"], self.params["threshold"], self.params["clusters"])
        self.labels[clients] = labels
        self.models = self.on(self.ctx.init.clone())[None].repeat(int(labels.max()) + 1, 1)

    def collect(self, fed: FederationView, clients: np.ndarray, rnd: int, purpose: str) -> dict[int, np.ndarray]:
        """Each client's class bases [p*J, d], kept for newcomers to be compared with (a
        request repeated to a client that left the last one unanswered is not billed)."""
        meta = {"basis": self.p, "dim": int(np.prod(self.ctx.in_shape))} if self.ctx.in_shape else {"basis": self.p}
        calls = {int(c): Call({}, meta) for c in clients.tolist()}
        ex = fed.run(SUBSPACE, rnd, calls, purpose, again=[c for c in calls if self.misses.get(c, 0)])
        got = {c: r.tensors["basis"].astype(np.float64) for c, r in ex.results.items()}
        self.bases.update(got)
        self.basis_bytes += sum(int(b.size) * 4 for b in got.values())
        for c in got:
            self.misses.pop(c, None)
        for c in sorted(set(clients.tolist()) - set(got)):
            self.misses[c] = self.misses.get(c, 0) + 1
            if self.misses[c] > RETRIES:
                log.warning("pacfl: client %d left %d subspace requests unanswered; it keeps the mean", c, RETRIES + 1)
        return got

    def maintain(self, rnd: int, fed: FederationView) -> list[dict]:
        """Clients whose subspace did not come (their device late or failing, their reply
        rejected) are asked again at the end of the round and placed as newcomers are, up
        to RETRIES times in a row: left out, they would train the clusters' mean model for
        the rest of the run."""
        again = [c for c in np.asarray(fed.present).tolist() if 0 < self.misses.get(c, 0) <= RETRIES]
        if not again:
            return []
        return [{"kind": "retry", "round": rnd, "clients": again, **self.place(rnd, np.array(again), fed, "retry")}]

    def on_arrival(self, rnd: int, clients: np.ndarray, fed: FederationView) -> dict:
        return self.place(rnd, clients, fed, "arrival")

    def place(self, rnd: int, clients: np.ndarray, fed: FederationView, purpose: str) -> dict:
        """`clients` send their bases and join the cluster at the smallest mean angle."""
        got = self.collect(fed, clients, rnd, purpose)
        known = np.flatnonzero(self.labels >= 0)
        if not got or not len(known):
            return {"assigned": []}
        new = np.array(sorted(got), dtype=np.int64)
        angles = cross_angles([self.bases[c] for c in new.tolist()], [self.bases[c] for c in known.tolist()])
        means = np.stack([angles[:, self.labels[known] == j].mean(1) for j in range(len(self.models))], axis=1)
        self.labels[new] = means.argmin(1)
        return {"assigned": self.labels[new].tolist()}

    # -- rounds: FedAvg inside each cluster -------------------------------------------------
    def train_tasks(self, rnd: int, selected: np.ndarray) -> dict[int, Task]:
        host = self.models.cpu()
        everyone = host.mean(0, keepdim=True)  # a client without a subspace: the clusters' mean
        return {
            int(c): Task(host[self.labels[c]][None] if self.labels[c] >= 0 else everyone)
            for c in np.asarray(selected).tolist()
        }

    def aggregate(self, rnd: int, results: dict[int, Result]) -> None:
        clustered = [c for c in sorted(results) if self.labels[c] >= 0]  # the others trained the mean
        if not clustered:
            return
        models, n = stack(results, clustered)
        r = one_hot(self.labels[clustered], len(self.models), models)
        self.models = cluster_average(models, n, r, keep=self.models)

    def eval_models(self, clients: np.ndarray) -> tuple[torch.Tensor | None, np.ndarray]:
        rows = self.labels[np.asarray(clients, dtype=np.int64)].copy()
        models = torch.cat([self.models, self.models.mean(0, keepdim=True)]).cpu()
        rows[rows < 0] = len(models) - 1
        return models, rows

    def summary(self) -> dict:
        truth = self.ctx.truth.copy()
        truth[self.labels < 0] = -1
        found = self.labels[self.labels >= 0]
        return {
            "found_clusters": self.labels.tolist(),
            "clusters": int(len(np.unique(found))),
            "cluster_sizes": np.bincount(found, minlength=len(self.models)).tolist(),
            "basis_bytes": self.basis_bytes,
            **agreement(self.labels, truth),
        }

    def expected_bytes(self, selections: int, model_bytes: int) -> dict:
        return {
            "formula": "sum_k p*J_k*d*4 + 2*rho*M*W_local*T",
            "bytes": self.basis_bytes + 2 * selections * model_bytes,
        }
