"""CFL: Clustered Federated Learning (Sattler, Müller, Samek, 2020, "Clustered Federated
Learning: Model-Agnostic Distributed Multitask Optimization under Privacy Constraints",
Algorithm 1; thresholds and split rule as in the authors' code, felisat/
clustered-federated-learning).

Clients start in one cluster. Each round, for every cluster c and its clients i that
returned (each was sent theta_c):
    dW_i = W_i - theta_c,      dW_c = sum_i n_i dW_i / sum_i n_i
If, after `warmup_rounds`, ||dW_c|| < eps1 (the cluster's joint objective is near a
stationary point) and max_i ||dW_i|| > eps2 (some clients are still far from theirs) and
more than `min_cluster_size` of its clients returned, c is bipartitioned with the cosine
similarities alpha_ij = <dW_i, dW_j> / (||dW_i|| ||dW_j||): AgglomerativeClustering
(precomputed, complete linkage) of -alpha into 2 parts, as in the authors' code (an
approximation of the paper's argmin_{c1, c2} max_{i in c1, j in c2} alpha_ij). Each part
starts from the parent's model theta_c and then takes its own members' weighted mean
update; a cluster that does not split does theta_c += dW_c.

Clients that were not selected in the round of a split (the paper assumes full
participation; with rho = 0.2 most of a cluster is absent) are sorted with the paper's
parameter tree, its mechanism for clients that arrive after a split: the server caches,
per split, the parent model theta_c and each part's mean unit update. Such a client
is "pending" at that split: the next time it is selected it receives the cached parent
model (still one model down, one up), and its update dW = W - theta_c sends it to the
part whose cached direction is the more cosine-similar; if that part has split since, it
becomes pending at that later split, and so on down the tree. A pending client's update
is relative to an old model, so it is used for sorting only, not averaged. Until it is
sorted it is evaluated with the larger part's model (by returned clients; part 0 on a tie).

Other choices:
- The criterion and the similarities use the cluster's clients that returned this round
  (as the authors' code does with all of them); alpha is one matrix product of the
  row-normalised updates.
- `min_cluster_size` = 2 reproduces the authors' `len(idc) > 2`: a cluster needs at least
  3 returned clients to be split.
- Updates are weighted by the clients' sample counts (the paper's |D_i| / |D_c|; the
  authors' code uses equal weights, identical when shards are equal).
At most one split per cluster per round, as in the authors' code.

Traffic: one model down and one up per selection, 2*rho*M*W_local*T.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.cluster import AgglomerativeClustering

from flt.server.strategies.base import Result, Strategy, Task, agreement, stack, weighted_average
from flt.server.strategies.params import CFL as CFL_PARAMS


def cosine_similarity(updates: torch.Tensor) -> torch.Tensor:
    """alpha_ij for rows of updates [s, P] (one matrix product)."""
    unit = updates / updates.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return unit @ unit.T


def bipartition(similarity: np.ndarray) -> np.ndarray:
    """Labels 0/1: complete-linkage agglomerative clustering of -similarity into two."""
    return (
        AgglomerativeClustering(n_clusters=2, metric="precomputed", linkage="complete")
        .fit(-similarity)
        .labels_.astype(np.int64)
    )


class CFL(Strategy):
    name = "cfl"
    PARAMS = CFL_PARAMS  # server/strategies/params.py: every method's parameters, torch-free

    def __init__(self, ctx, **params):
        super().__init__(ctx, **params)
        p = self.params
        self.eps1, self.eps2 = float(p["eps1"]), float(p["eps2"])
        self.warmup, self.min_size = int(p["warmup_rounds"]), int(p["min_cluster_size"])
        self.warn_if_warmup_fills_the_run("it never splits, and every round is FedAvg")
        self.models = self.on(ctx.init.clone())[None]  # [clusters, P]
        self.labels = np.zeros(ctx.n_clients, dtype=np.int64)  # cluster (provisional if pending)
        self.pending = np.full(ctx.n_clients, -1, dtype=np.int64)  # split a client waits at, or -1
        self.sent: dict[int, tuple[str, int]] = {}  # client -> ("cluster"|"split", id)
        self.splits: list[dict] = []  # report, one per split
        self.tree: list[dict] = []  # per split: parent model, part dirs
        self.norms: list[dict] = []  # per round and cluster
        self.sorted_late = 0  # pending clients sorted so far

    def train_tasks(self, rnd: int, selected: np.ndarray) -> dict[int, Task]:
        host = self.models.cpu()
        tasks, self.sent = {}, {}
        for c in map(int, selected):
            s = int(self.pending[c])
            if s >= 0:  # not sorted since that split: the cached parent model
                self.sent[c] = ("split", s)
                tasks[c] = Task(self.tree[s]["parent"].cpu()[None])
            else:
                self.sent[c] = ("cluster", int(self.labels[c]))
                tasks[c] = Task(host[self.labels[c]][None])
        return tasks

    def aggregate(self, rnd: int, results: dict[int, Result]) -> None:
        settled = [c for c in sorted(results) if self.sent.get(c, ("", -1))[0] == "cluster"]
        waiting = [c for c in sorted(results) if self.sent.get(c, ("", -1))[0] == "split"]
        if settled:
            self._cluster_round(rnd, settled, results)
        if waiting:
            self._sort_pending(waiting, results)

    def _cluster_round(self, rnd, clients, results) -> None:
        models, n = stack(results, clients)
        sent = np.array([self.sent[c][1] for c in clients], dtype=np.int64)
        updates = models - self.models[torch.as_tensor(sent, device=models.device)]  # dW_i
        norms = updates.norm(dim=1)
        similarity = None
        new_models = list(self.models.clone())
        for k in np.unique(sent):
            idx = np.flatnonzero(sent == k)
            sub = torch.as_tensor(idx, device=models.device)
            mean_update = weighted_average(updates[sub], n[sub])
            mean_norm, max_norm = float(mean_update.norm()), float(norms[sub].max())
            self.norms.append(
                {
                    "round": int(rnd),
                    "cluster": int(k),
                    "mean_norm": mean_norm,
                    "max_norm": max_norm,
                    "returned": int(len(idx)),
                }
            )
            if rnd > self.warmup and mean_norm < self.eps1 and max_norm > self.eps2 and len(idx) > self.min_size:
                if similarity is None:
                    similarity = cosine_similarity(updates).cpu().numpy()
                part = bipartition(similarity[np.ix_(idx, idx)])
                new_models.append(self._split(rnd, int(k), idx, part, clients, updates, n, new_models))
            else:
                new_models[k] = self.models[k] + mean_update
        self.models = torch.stack(new_models)

    def _split(self, rnd, k, idx, part, clients, updates, n, new_models) -> torch.Tensor:
        """Split cluster k: part 0 keeps index k, part 1 becomes a new cluster. Returns the
        new cluster's model and sets cluster k's; absent members become pending."""
        new_k = len(new_models)
        parent = self.models[k]
        returned = np.asarray(clients)[idx]
        absent = np.setdiff1d(np.flatnonzero((self.labels == k) & (self.pending < 0)), returned)
        larger = new_k if np.sum(part == 1) > np.sum(part == 0) else k
        self.labels[returned[part == 1]] = new_k
        self.labels[absent] = larger
        self.pending[absent] = len(self.tree)
        out, dirs = [], []
        for p in (0, 1):
            sub = torch.as_tensor(idx[part == p], device=updates.device)
            out.append(parent + weighted_average(updates[sub], n[sub]))
            d = (updates[sub] / updates[sub].norm(dim=1, keepdim=True).clamp_min(1e-12)).mean(0)
            dirs.append(d / d.norm().clamp_min(1e-12))
        new_models[k] = out[0]
        self.tree.append(
            {"round": int(rnd), "cluster": k, "parts": (k, new_k), "parent": parent.clone(), "dirs": torch.stack(dirs)}
        )
        self.splits.append(
            {
                "round": int(rnd),
                "cluster": k,
                "new_cluster": new_k,
                "returned_sizes": [int((part == 0).sum()), int((part == 1).sum())],
                "pending": int(len(absent)),
                "sizes": [int((self.labels == k).sum()), int((self.labels == new_k).sum())],
            }
        )
        return out[1]

    def _sort_pending(self, clients, results) -> None:
        """Parameter tree: each waiting client goes down the split it waited at, by the
        cosine similarity of its update (against the cached parent) to each part's."""
        for c in clients:
            s = self.sent[c][1]
            node = self.tree[s]
            update = results[c].model - node["parent"]
            side = int((node["dirs"] @ update).argmax())  # dirs are unit rows: argmax of cosine
            target = node["parts"][side]
            later = next((j for j in range(s + 1, len(self.tree)) if self.tree[j]["cluster"] == target), None)
            self.labels[c] = target
            if later is None:
                self.pending[c] = -1
                self.sorted_late += 1
            else:  # that part has split since: wait at the later split
                self.pending[c] = later
                kept, new = self.tree[later]["parts"]
                rs = self.splits[later]["returned_sizes"]
                self.labels[c] = new if rs[1] > rs[0] else kept

    def eval_models(self, clients: np.ndarray) -> tuple[torch.Tensor | None, np.ndarray]:
        return self.models.cpu(), self.labels[np.asarray(clients, dtype=np.int64)].copy()

    def summary(self) -> dict:
        return {
            "splits": self.splits,
            "clusters": int(len(self.models)),
            "found_clusters": self.labels.tolist(),
            "cluster_sizes": np.bincount(self.labels, minlength=len(self.models)).tolist(),
            "pending_clients": int((self.pending >= 0).sum()),
            "sorted_after_split": self.sorted_late,
            "update_norms": self.norms,
            **agreement(self.labels, self.ctx.truth),
        }

    def expected_bytes(self, selections: int, model_bytes: int) -> dict:
        return {"formula": "2*rho*M*W_local*T", "bytes": 2 * selections * model_bytes}
