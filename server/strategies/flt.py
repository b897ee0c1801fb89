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
    }

    def __init__(self, ctx, **params):
        super().__init__(ctx, **params)
        self.fcr_report: dict = {}
        self.labels = np.zeros(ctx.n_clients, dtype=np.int64)
        self.graph = np.eye(ctx.n_clients, dtype=np.float32)
        self.models = self.on(ctx.init.clone())[None]  # one row per cluster (II) or client (I)
        self.payload_bytes = 0

    # -- FCR ----------------------------------------------------------------------------
    def setup(self, fed) -> None:
        tic = time.perf_counter()
        tensors, meta, info = self.encoder_payload()
        centroids = fed.embed(0, np.arange(self.ctx.n_clients), tensors, meta)
        missing = sorted(set(range(self.ctx.n_clients)) - set(centroids))
        if missing:
            raise RuntimeError(f"FCR: clients {missing[:20]} sent no centroids")
        self.payload_bytes = sum(t.nbytes for t in tensors.values())
        points = [centroids[c] for c in range(self.ctx.n_clients)]
        self.relate(points, fed)
        self.fcr_report.update(info)
        self.fcr_report["seconds"] = time.perf_counter() - tic
        self.fcr_report["centroids_sent"] = int(sum(len(p) for p in points))
        self.fcr_report["latent"] = int(points[0].shape[1])
        self.fcr_report["encoder_bytes"] = self.payload_bytes

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

    def relate(self, centroids: list[np.ndarray], fed=None) -> None:
        """Steps 3-4 of FCR, then one model per cluster (II) or per client (I)."""
        tic = time.perf_counter()
        points = self.project(centroids)
        adj = fcr.min_distance_adjacency(points, device=self.ctx.device)
        gamma = self.params["gamma"]
        hard = fcr.hard_threshold(adj, gamma)
        self.graph = hard if self.params["adjacency"] == "hard" else fcr.soft_weights(adj, gamma)
        self.labels, z, c = fcr.ward_clusters(hard, self.params["clusters"], self.params["max_clusters"])
        order = fcr.leaf_order(z, len(hard))
        self.fcr_report.update({"server_seconds": time.perf_counter() - tic, "clusters": c,
                                "cluster_sizes": np.bincount(self.labels).tolist(),
                                "mean_degree": float(hard.sum(1).mean())})
        self.fcr_report.update(agreement(self.labels, self.ctx.truth))
        np.savez(self.ctx.run_dir / "fcr.npz", adjacency=adj, graph=self.graph, labels=self.labels,
                 linkage=z, order=order, points=np.concatenate(points),
                 owner=np.repeat(np.arange(len(points)), [len(p) for p in points]))
        plot_fcr(self.ctx.run_dir, adj, hard, z, order, points, self.labels)
        rows = c if self.params["aggregation"] == "case2" else self.ctx.n_clients
        self.models = self.on(self.ctx.init.clone())[None].expand(rows, -1).clone()

    # -- training -----------------------------------------------------------------------
    def row(self, client: int) -> int:
        return int(self.labels[client]) if self.params["aggregation"] == "case2" else int(client)

    def train_tasks(self, rnd, selected):
        host = self.models.cpu()
        return {int(c): Task(host[self.row(c)][None]) for c in selected}

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
        self.models = new

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
        return {"fcr": self.fcr_report, "found_clusters": self.labels.tolist()}

    def expected_bytes(self, selections, model_bytes):
        m = self.ctx.n_clients
        k_e = self.fcr_report.get("centroids_sent", 0) * self.fcr_report.get("latent", 0) * 4
        return {"formula": "M*W_enc + k*M*e + 2*rho*M*W_local*T",
                "bytes": m * self.payload_bytes + k_e + 2 * selections * model_bytes}
