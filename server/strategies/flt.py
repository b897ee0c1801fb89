"""FLT: Federated Learning with Taskonomy (Jamali-Rad, Abdizadeh, Singh), Algorithms 2-3.

One-off FCR (form client relatedness):
  1. the server sends the ConvAE encoder G (ONNX bytes: Enc1, frozen; or the whole
     autoencoder: Enc2, which every client fine-tunes for J epochs on its own data);
  2. client m embeds its data, E_m = G(D_m) (e = 128), runs k-means and sends up
     M_m = {mu_1..mu_k};
  3. the server runs UMAP on all k*M centroids, sets A_ij = min_{r,s} ||u_ir - u_js||,
     thresholds A~ = [A <= gamma], and clusters A~ with Ward into C clusters.
Training (Algorithm 3), T rounds:
  Case I  (graph, personalized): W^{t+1} = W_bar^{t+1} A~ diag(p_m / ||A~_m||_0)
  Case II (disjoint clusters):   FedAvg inside each cluster.

Case I with partial participation: column j of W_bar holds client j's model as it came
back this round if j was selected; a client that was not selected contributes nothing
that round (its column gets weight zero), so client m's next model is the p-weighted
average of the models of its *selected* neighbours (p_j = n_j), and a client none of
whose neighbours trained keeps its model. With A~ = all ones this is exactly FedAvg;
with A~ = I it is Local training.

Dynamic FLT: clients raise a flag delta when their data changed; when more than lambda
flags are up (`recluster_flags`) or every tau rounds (`recluster_every`), the flagged
clients re-embed and steps 3-4 re-run. A newcomer joins the cluster whose mean embedding
is nearest, or triggers the re-run (`newcomers`).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from models.autoencoder import export_encoder_onnx
from models.flat import flatten
from scenarios.schema import Field, section
from server import encoder as enc
from server import fcr
from server.fcr_report import agreement, plot_fcr
from server.strategies.base import Result, Strategy, Task, stack, weighted_average


def _fcr_bytes(fed) -> int:
    """Encoder + embedding bytes on the wire so far (to price a re-clustering)."""
    t = fed.transport.ledger.totals()
    return sum(t[d][k]["payload"] + t[d][k]["overhead"] for d in t for k in ("encoder", "embedding"))


ENCODER = {
    "dataset": Field(str, "public", "pretraining set: 'public' (held-out slice of the train split) "
                     "or another dataset's name (Enc2, e.g. fashion_mnist for mnist)"),
    "root": Field(str, None, "data root of that dataset (default: the scenario's)", nullable=True),
    "epochs": Field(int, 10, "pretraining epochs", min=1),
    "lr": Field(float, 1e-3, "Adam learning rate", min=0, open_min=True),
    "batch_size": Field(int, 64, "pretraining batch", min=1),
    "latent": Field(int, 128, "embedding size e", min=1),
    "finetune_epochs": Field(int, 0, "J: clients fine-tune the autoencoder this many epochs "
                             "(0 = frozen encoder sent as ONNX)", min=0),
    "finetune_lr": Field(float, 1e-3, "clients' Adam learning rate for fine-tuning", min=0, open_min=True),
    "finetune_batch": Field(int, 32, "clients' fine-tuning batch", min=1),
}
UMAP = {
    "n_components": Field(int, 2, "u, the UMAP dimension", min=1),
    "n_neighbors": Field(int, 15, "UMAP n_neighbors", min=2),
    "min_dist": Field(float, 0.1, "UMAP min_dist", min=0),
    "metric": Field(str, "euclidean", "UMAP metric"),
}


def positive_or_auto(value) -> str | None:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return None
    return "a positive integer or 'auto'"


class FLT(Strategy):
    name = "flt"
    PARAMS = {
        "encoder": section(ENCODER, "the ConvAE encoder"),
        "k": Field((int, str), 5, "k-means centroids per client, or 'auto' (silhouette, per client)",
                   rule=positive_or_auto),
        "umap": section(UMAP, "UMAP projection of the centroids"),
        "gamma": Field(float, 1.0, "adjacency threshold", min=0, open_min=True),
        "adjacency": Field(str, "hard", "hard threshold or soft distance weights", choices=("hard", "soft")),
        "aggregation": Field(str, "case2", "case1: personalized graph; case2: FedAvg per cluster",
                             choices=("case1", "case2")),
        "clusters": Field((int, str), "auto", "C for Ward clustering, or 'auto' (largest dendrogram gap)",
                          rule=positive_or_auto),
        "max_clusters": Field(int, 10, "upper bound when clusters is 'auto'", min=1),
        "newcomers": Field(str, "nearest", "place a newcomer in the cluster with the nearest mean "
                           "embedding, or re-run FCR over everyone", choices=("nearest", "recluster")),
        "recluster_flags": Field(int, None, "lambda: re-run FCR when more than this many clients raised "
                                 "their data-change flag (null: never)", nullable=True, min=0),
        "recluster_every": Field(int, None, "tau: re-run FCR every tau rounds (null: never)",
                                 nullable=True, min=1),
        "monitor_cosine": Field(float, None, "server-side monitor (case2): flag a client whose update's "
                                "cosine similarity to its cluster's mean update is below this "
                                "(null: off)", nullable=True, min=-1.0, max=1.0),
    }

    def __init__(self, ctx, **params):
        super().__init__(ctx, **params)
        m = ctx.n_clients
        self.fcr_report: dict = {}
        self.labels = np.zeros(m, dtype=np.int64)    # before FCR: everyone in one cluster
        self.graph = np.ones((m, m), dtype=np.float32)
        case2 = params["aggregation"] == "case2"
        self.models = self.on(ctx.init.clone())[None].expand(1 if case2 else m, -1).clone()
        self.centroids: dict[int, np.ndarray] = {}
        self.flagged: set[int] = set()      # clients whose data changed since the last FCR
        self.monitored: set[int] = set()    # of those, flagged by the server-side monitor
        self.payload_bytes, self.centroids_sent, self.encoders_sent, self.reclusterings = 0, 0, 0, []

    # -- FCR ----------------------------------------------------------------------------
    def setup(self, fed) -> None:
        tic = time.perf_counter()
        self.payload, self.payload_meta, info = self.encoder_payload()
        self.payload_bytes = sum(t.nbytes for t in self.payload.values())
        self.embed(fed, fed.present, rnd=0, strict=True)
        self.relate(fed.present)
        self.fcr_report.update(info)
        self.fcr_report.update({"seconds": time.perf_counter() - tic, "encoder_bytes": self.payload_bytes,
                                "latent": int(next(iter(self.centroids.values())).shape[1])})

    def embed(self, fed, clients, rnd: int, strict: bool = False) -> None:
        """Send the encoder to `clients`, keep the k x e centroids they send back."""
        got = fed.embed(rnd, np.asarray(clients), self.payload, self.payload_meta)
        self.encoders_sent += len(clients)
        missing = sorted(set(np.asarray(clients).tolist()) - set(got))
        if missing and strict:
            raise RuntimeError(f"FCR: clients {missing[:20]} sent no centroids")
        self.centroids.update(got)
        self.centroids_sent += sum(len(c) for c in got.values())
        self.fcr_report["centroids_sent"] = self.centroids_sent

    def encoder_payload(self) -> tuple[dict, dict, dict]:
        """What travels down for FCR: ONNX bytes (frozen) or the autoencoder (fine-tune)."""
        e = self.params["encoder"]
        images = enc.public_images(e, self.ctx.scenario, self.ctx.public)
        settings = {k: e[k] for k in ("epochs", "lr", "batch_size", "latent")} | {"seed": self.ctx.seed}
        ae, info = enc.pretrained_autoencoder(images, settings, self.ctx.device)
        meta = {"k": self.params["k"], "latent": e["latent"], "in_shape": list(images.shape[1:])}
        info = {"encoder_" + k: v for k, v in info.items()} | {"public_images": int(len(images))}
        if e["finetune_epochs"] == 0:
            onnx = np.frombuffer(export_encoder_onnx(ae, tuple(images.shape[1:])), dtype=np.uint8)
            return {"onnx": onnx}, meta | {"format": "onnx"}, info
        meta |= {"format": "autoencoder", "finetune": {"epochs": e["finetune_epochs"],
                 "lr": e["finetune_lr"], "batch_size": e["finetune_batch"]}}
        return {"weights": flatten(ae).numpy()}, meta, info

    def project(self, points: list[np.ndarray]) -> list[np.ndarray]:
        u = self.params["umap"]
        return fcr.umap_project(points, u["n_components"], u["n_neighbors"], u["min_dist"],
                                u["metric"], seed=self.ctx.seed)

    def gamma(self, adj: np.ndarray) -> float:
        return self.params["gamma"]

    def relate(self, clients, tag: str = "") -> dict:
        """Steps 3-4 of FCR over `clients`; models carry over from the old clustering."""
        tic = time.perf_counter()
        clients = np.array(sorted(c for c in np.asarray(clients).tolist() if c in self.centroids))
        points = self.project([self.centroids[c] for c in clients])
        adj = fcr.min_distance_adjacency(points, device=self.ctx.device)
        gamma = self.gamma(adj)
        hard = fcr.hard_threshold(adj, gamma)
        sub, z, c = fcr.ward_clusters(hard, self.params["clusters"], self.params["max_clusters"])
        labels = np.full(self.ctx.n_clients, -1, dtype=np.int64)
        labels[clients] = sub
        graph = np.eye(self.ctx.n_clients, dtype=np.float32)
        graph[np.ix_(clients, clients)] = hard if self.params["adjacency"] == "hard" else fcr.soft_weights(adj, gamma)
        self._carry_models(labels, graph, c)
        old = self.labels
        self.labels, self.graph = labels, graph
        order = fcr.leaf_order(z, len(hard))
        report = {"server_seconds": time.perf_counter() - tic, "clusters": c, "gamma": gamma,
                  "cluster_sizes": np.bincount(sub).tolist(), "mean_degree": float(hard.sum(1).mean()),
                  **agreement(labels[clients], self.ctx.truth[clients])}
        self.fcr_report.update(report)
        np.savez(self.ctx.run_dir / f"fcr{tag}.npz", clients=clients, adjacency=adj, graph=hard,
                 labels=sub, old_labels=old[clients], linkage=z, order=order,
                 points=np.concatenate(points), owner=np.repeat(clients, [len(p) for p in points]),
                 centroids=np.concatenate([self.centroids[c] for c in clients]))
        plot_fcr(self.ctx.run_dir, adj, hard, z, order, points, sub, tag)
        return report

    def _carry_models(self, labels: np.ndarray, graph: np.ndarray, n_clusters: int) -> None:
        """A new cluster starts from the sample-weighted mean of its members' old cluster
        models (a cluster of newcomers only: from the mean of all); in Case I a newcomer
        starts from the mean of its neighbours' models."""
        n = torch.as_tensor(self.ctx.n_train, dtype=self.models.dtype, device=self.models.device)
        if self.params["aggregation"] == "case1":
            fresh = np.flatnonzero((labels >= 0) & (self.labels < 0))
            old = torch.as_tensor(self.labels >= 0, device=n.device)
            for c in fresh:  # newcomers only: a handful of rows
                w = torch.as_tensor(graph[c], device=n.device) * n * old
                if w.sum() > 0:
                    self.models[c] = weighted_average(self.models, w)
            return
        known = self.labels >= 0
        everyone = weighted_average(self.models[self.labels[known]], n[known]) if known.any() else self.models[0]
        new = everyone[None].expand(n_clusters, -1).clone()
        for j in range(n_clusters):
            members = np.flatnonzero((labels == j) & known)
            if len(members):
                new[j] = weighted_average(self.models[self.labels[members]], n[members])
        self.models = new

    # -- a changing population (dynamic FLT) --------------------------------------------
    def on_arrival(self, rnd: int, clients: np.ndarray, fed) -> dict:
        """Newcomers embed their data; they join the cluster whose mean embedding is nearest
        (`newcomers: nearest`), or FCR's server side re-runs over everyone (`recluster`)."""
        tic, before = time.perf_counter(), _fcr_bytes(fed)
        self.embed(fed, clients, rnd)
        if self.params["newcomers"] == "recluster":
            report = self.relate(fed.present, tag=f"-round{rnd}")
        else:
            report = self._place_nearest(clients)
        return {"placement": self.params["newcomers"], "seconds": time.perf_counter() - tic,
                "fcr_bytes": _fcr_bytes(fed) - before, **report}

    def _place_nearest(self, clients: np.ndarray) -> dict:
        placed = np.array([c for c in clients.tolist() if c in self.centroids], dtype=np.int64)
        known = np.flatnonzero(self.labels >= 0)
        means = np.stack([self.centroids[c].mean(0) for c in known])
        cluster_means = np.stack([means[self.labels[known] == j].mean(0) for j in range(self.labels.max() + 1)])
        mine = np.stack([self.centroids[c].mean(0) for c in placed])
        nearest = np.linalg.norm(mine[:, None] - cluster_means[None], axis=-1).argmin(1)
        labels = self.labels.copy()
        labels[placed] = nearest
        graph = self.graph.copy()
        same = labels[:, None] == labels[None, :]
        graph[placed] = same[placed]
        graph[:, placed] = same[:, placed]
        if self.params["aggregation"] == "case1":
            self._carry_models(labels, graph, 0)
        self.labels, self.graph = labels, graph
        present = np.flatnonzero(labels >= 0)
        return {"assigned": nearest.tolist(), **agreement(labels[present], self.ctx.truth[present])}

    def maintain(self, rnd: int, fed) -> list[dict]:
        """Re-run FCR when the flags delta raised since the last run add up to more than
        lambda, or every tau rounds; only flagged clients re-embed (everyone, for tau)."""
        lam, tau = self.params["recluster_flags"], self.params["recluster_every"]
        cause = None
        if lam is not None and len(self.flagged) > lam:
            cause = "monitor" if self.flagged <= self.monitored else "flags"
            who = np.array(sorted(self.flagged))
        elif tau and rnd % tau == 0:
            cause, who = "period", fed.present
        if cause is None:
            return []
        tic, before, old = time.perf_counter(), _fcr_bytes(fed), self.labels.copy()
        self.embed(fed, who, rnd)
        report = self.relate(fed.present, tag=f"-round{rnd}")
        self.flagged.clear()
        self.monitored.clear()
        event = {"kind": "recluster", "round": rnd, "cause": cause, "clients": who.tolist(),
                 "seconds": time.perf_counter() - tic, "fcr_bytes": _fcr_bytes(fed) - before,
                 "old_labels": old.tolist(), "new_labels": self.labels.tolist(), **report}
        self.reclusterings.append({k: v for k, v in event.items() if k not in ("old_labels", "new_labels")})
        return [event]

    # -- training -----------------------------------------------------------------------
    def row(self, client: int) -> int:
        return int(self.labels[client]) if self.params["aggregation"] == "case2" else int(client)

    def train_tasks(self, rnd, selected):
        host = self.models.cpu()
        return {int(c): Task(host[self.row(c)][None]) for c in selected}

    def observe(self, rnd, results: dict[int, Result]) -> None:
        self.flagged.update(c for c, r in results.items() if r.meta.get("flag"))

    def aggregate(self, rnd, results: dict[int, Result]) -> None:
        if not results:
            return
        if self.params["aggregation"] == "case2":
            self._aggregate_clusters(results)
        else:
            self._aggregate_graph(results)

    def _aggregate_clusters(self, results):
        new = self.models.clone()
        for c in np.unique(self.labels[sorted(results)]):
            members = [m for m in sorted(results) if self.labels[m] == c]
            models, n = stack(results, members)
            new[c] = weighted_average(models, n)
            self._monitor(members, models - self.models[c], new[c] - self.models[c])
        self.models = new

    def _monitor(self, members: list[int], updates: torch.Tensor, mean_update: torch.Tensor) -> None:
        """Server-side change monitor: a client whose update points away from its cluster's
        (cosine below `monitor_cosine`) is flagged as if it had raised delta itself."""
        threshold = self.params["monitor_cosine"]
        if threshold is None or len(members) < 2:
            return
        cos = torch.nn.functional.cosine_similarity(updates, mean_update[None], dim=1)
        odd = [m for m, c in zip(members, cos.tolist()) if c < threshold]
        self.flagged.update(odd)
        self.monitored.update(odd)

    def _aggregate_graph(self, results):
        """W^{t+1} = W_bar A~ diag(.) as one matrix product over the selected clients."""
        sel = sorted(results)
        models, n = stack(results, sel)                               # [s, P], [s]
        graph = torch.as_tensor(self.graph[sel], device=models.device)  # [s, M]
        weights = graph * (n / n.sum())[:, None]
        mass = weights.sum(0)
        touched = mass > 0
        new = self.models.clone()
        new[touched] = (weights[:, touched] / mass[touched]).T @ models
        self.models = new

    def eval_models(self, clients):
        rows = np.array([self.row(c) for c in clients], dtype=np.int64)
        return self.models.cpu(), rows

    def summary(self) -> dict:
        return {"fcr": self.fcr_report, "found_clusters": self.labels.tolist(),
                "reclusterings": self.reclusterings}

    def expected_bytes(self, selections, model_bytes):
        # M*W_enc counts one encoder per client; re-clustering sends it again to re-embedders
        k_e = self.centroids_sent * self.fcr_report.get("latent", 0) * 4
        return {"formula": "M*W_enc + k*M*e + 2*rho*M*W_local*T",
                "bytes": self.encoders_sent * self.payload_bytes + k_e + 2 * selections * model_bytes}
