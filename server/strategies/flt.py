"""FLT: Federated Learning with Taskonomy (Jamali-Rad, Abdizadeh, Singh), Algorithms 2-3.

One-off FCR (form client relatedness):
  1. the server sends the ConvAE encoder G (ONNX bytes: Enc1, frozen; or the whole
     autoencoder: Enc2, which every client fine-tunes for J epochs on its own data);
  2. client m embeds its data, E_m = G(D_m) (e = 128), runs k-means and sends up
     M_m = {mu_1..mu_k};
  3. the server relates the clients from their centroid sets and clusters them. The
     paper's pipeline (`relatedness: paper`): UMAP of all k*M centroids, A_ij =
     min_{r,s} ||u_ir - u_js||, A~ = [A <= gamma], Ward on A~ into C clusters. The
     default (`relatedness: set`) needs no gamma: A_ij is the symmetric Chamfer distance
     between the two centroid sets in the encoder's space, average linkage, and C by
     silhouette (server/fcr.py says why).
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
flags are outstanding (`recluster_flags`), when one has waited `flag_patience` rounds, or
every tau rounds (`recluster_every`), every flagged client (everyone, for tau) re-embeds
and step 3 re-runs. A newcomer joins the cluster whose mean embedding is nearest, or
triggers the re-run (`newcomers`). A client without a cluster (its embedding failed)
trains and is evaluated with the global model and never touches a cluster's model.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np
import torch

from flt.models.autoencoder import export_encoder_onnx
from flt.models.flat import flatten
from flt.scenarios.errors import DeviceError
from flt.server import encoder as enc
from flt.server import fcr
from flt.server.exchange import Exchange
from flt.server.fcr_report import agreement
from flt.server.strategies.base import (
    Artifact,
    FederationView,
    Result,
    Strategy,
    Task,
    cluster_average,
    one_hot,
    stack,
    weighted_average,
)
from flt.server.strategies.params import FLT as FLT_PARAMS
from flt.server.strategies.params import check_flt, flt_pipeline


class FLT(Strategy):
    name = "flt"
    DEVICE_OPS = ("train", "evaluate", "embed")  # embed: FCR's encoder and k-means (also PCA+kM+HC)
    PARAMS = FLT_PARAMS  # server/strategies/params.py: every method's parameters, torch-free

    @classmethod
    def check_params(cls, params: dict) -> str | None:
        return check_flt(params)

    @classmethod
    def pipeline(cls, params: dict) -> fcr.Relatedness:
        """The preset with the scenario's overrides applied."""
        return flt_pipeline(params)

    def __init__(self, ctx, **params):
        super().__init__(ctx, **params)
        m = ctx.n_clients
        self.how = self.pipeline(params)
        self.fcr_reports: list[dict] = []  # the initial FCR, then every re-clustering
        self.labels = np.zeros(m, dtype=np.int64)  # before FCR: everyone in one cluster
        self.graph = np.ones((m, m), dtype=np.float32)
        case2 = params["aggregation"] == "case2"
        self.models = self.on(ctx.init.clone())[None].expand(1 if case2 else m, -1).clone()
        self.centroids: dict[int, np.ndarray] = {}
        self.centroid_classes: dict[int, np.ndarray] = {}  # k: labels, the class of each centroid
        self.flag_round: dict[int, int] = {}  # outstanding data-change flags: client -> round first seen
        self.monitored: set[int] = set()  # of those, flagged by the server-side monitor
        self.payload_bytes, self.centroids_sent, self.encoders_sent = 0, 0, 0
        self.encoder_info: dict = {}

    # -- FCR ----------------------------------------------------------------------------
    def setup(self, fed: FederationView) -> None:
        tic = time.perf_counter()
        self.payload, self.payload_meta, self.encoder_info = self.encoder_payload()
        self.payload_bytes = sum(t.nbytes for t in self.payload.values())
        ex = self.embed(fed, fed.present, rnd=0, purpose="fcr")
        if not ex.results:
            raise DeviceError("FCR: no client sent centroids (see the device logs)")
        report = self.relate(fed.present)
        report.update(
            round=0,
            cause="initial",
            seconds=time.perf_counter() - tic,
            **_cost(ex),
            unassigned=sorted(set(np.asarray(fed.present).tolist()) - set(ex.results)),
        )
        self.fcr_reports.append(report)

    def embed(self, fed: FederationView, clients, rnd: int, purpose: str = "fcr") -> Exchange:
        """Send the encoder to `clients`, keep the k x e centroids they send back; a client
        that re-embedded has no outstanding flag any more. Returns the exchange (who
        answered, its bytes and emulated seconds), reported as `purpose`."""
        ex = fed.embed(rnd, np.asarray(clients), self.payload, self.payload_meta, purpose)
        got = ex.results
        if self.params["k"] == "labels":  # rows are [mean embedding, class]
            self.centroid_classes.update({c: v[:, -1].astype(np.int64) for c, v in got.items()})
            got = {c: np.ascontiguousarray(v[:, :-1]) for c, v in got.items()}
        self.encoders_sent += len(clients)
        self.centroids.update(got)
        self.centroids_sent += sum(len(c) for c in got.values())
        for c in got:
            self.flag_round.pop(c, None)
            self.monitored.discard(c)
        return ex

    def encoder_payload(self) -> tuple[dict, dict, dict]:
        """What travels down for FCR: ONNX bytes (frozen) or the autoencoder (fine-tune)."""
        e = self.params["encoder"]
        images = self.ctx.public_images(e)
        settings = {k: e[k] for k in ("epochs", "lr", "batch_size", "latent")} | {"seed": self.ctx.seed}
        ae, info = enc.pretrained_autoencoder(images, settings, self.ctx.device)
        meta = {"k": self.params["k"], "latent": e["latent"], "in_shape": list(images.shape[1:])}
        info = {"encoder_" + k: v for k, v in info.items()} | {"public_images": int(len(images))}
        if e["finetune_epochs"] == 0:
            onnx = np.frombuffer(export_encoder_onnx(ae, tuple(images.shape[1:])), dtype=np.uint8)
            return {"onnx": onnx}, meta | {"format": "onnx"}, info
        meta |= {
            "format": "autoencoder",
            "finetune": {"epochs": e["finetune_epochs"], "lr": e["finetune_lr"], "batch_size": e["finetune_batch"]},
        }
        return {"weights": flatten(ae).numpy()}, meta, info

    def project(self, points: list[np.ndarray]) -> list[np.ndarray]:
        if self.how.space == "embedding":
            return points
        u = self.params["umap"]
        return fcr.umap_project(
            points, u["n_components"], u["n_neighbors"], u["min_dist"], u["metric"], seed=self.ctx.seed
        )

    def threshold(self, points: list[np.ndarray]) -> fcr.Relatedness:
        """The pipeline for these points (PCA+kM+HC fills a scale-free gamma here)."""
        return self.how

    def relate(self, clients, tag: str = "") -> dict:
        """Steps 3-4 of FCR over `clients` that have centroids; models carry over from the
        old clustering. Returns the FCR report (also appended by the caller)."""
        tic = time.perf_counter()
        clients = np.array(sorted(c for c in np.asarray(clients).tolist() if c in self.centroids))
        points = self.project([self.centroids[c] for c in clients])
        how = self.threshold(points)
        classes = [self.centroid_classes[c] for c in clients] if self.centroid_classes else None
        found = fcr.relate(
            points, how, self.params["clusters"], self.params["max_clusters"], self.ctx.device, classes=classes
        )
        labels = np.full(self.ctx.n_clients, -1, dtype=np.int64)
        labels[clients] = found.labels
        graph = np.eye(self.ctx.n_clients, dtype=np.float32)
        graph[np.ix_(clients, clients)] = (
            found.graph
            if self.params["adjacency"] == "hard"
            else fcr.soft_weights(found.distance, how.gamma or _median_offdiagonal(found.distance))
        )
        self._carry_models(labels, graph, found.n_clusters)
        old = self.labels
        self.labels, self.graph = labels, graph
        order = fcr.leaf_order(found.linkage, len(clients))
        truth = self.ctx.truth[clients]
        report = {
            "server_seconds": time.perf_counter() - tic,
            "clusters": found.n_clusters,
            "gamma": how.gamma,
            "silhouette": found.silhouette,
            "separation": found.separation,
            "pipeline": asdict(how),
            "cluster_sizes": np.bincount(found.labels).tolist(),
            "mean_degree": float(found.graph.sum(1).mean()),
            "n_clients": int(len(clients)),
            "latent": int(points[0].shape[1])
            if self.how.space == "embedding"
            else int(next(iter(self.centroids.values())).shape[1]),
            "centroids_sent": self.centroids_sent,
            "encoder_bytes": self.payload_bytes,
            **self.encoder_info,
            **agreement(found.labels, truth),
        }
        arrays = {
            "clients": clients,
            "adjacency": found.distance,
            "graph": found.graph,
            "labels": found.labels,
            "truth": truth,
            "old_labels": old[clients],
            "linkage": found.linkage,
            "order": order,
            "points": np.concatenate(points),
            "owner": np.repeat(clients, [len(p) for p in points]),
            "centroids": np.concatenate([self.centroids[c] for c in clients]),
        }
        if classes is not None:  # k: labels, each centroid's class
            arrays["classes"] = np.concatenate(classes)
        self.emit(Artifact(f"fcr{tag}", arrays, plot="fcr"))
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
        everyone = self._global_model()
        new = everyone[None].expand(n_clusters, -1).clone()
        known = self.labels >= 0
        for j in range(n_clusters):
            members = np.flatnonzero((labels == j) & known)
            if len(members):
                new[j] = weighted_average(self.models[self.labels[members]], n[members])
        self.models = new

    def _global_model(self) -> torch.Tensor:
        """Sample-weighted mean of the clustered clients' models: what a client with no
        cluster (and no embedding to place it) trains and is evaluated with."""
        known = np.flatnonzero(self.labels >= 0)
        if not len(known):
            return self.models.mean(0)
        n = torch.as_tensor(self.ctx.n_train[known], dtype=self.models.dtype, device=self.models.device)
        return weighted_average(self.models[self.labels[known] if self.params["aggregation"] == "case2" else known], n)

    # -- a changing population (dynamic FLT) --------------------------------------------
    def on_arrival(self, rnd: int, clients: np.ndarray, fed: FederationView) -> dict:
        """Newcomers embed their data; they join the cluster whose mean embedding is nearest
        (`newcomers: nearest`), or FCR's server side re-runs over everyone (`recluster`),
        with every client whose flag is outstanding re-embedding too."""
        tic = time.perf_counter()
        if self.params["newcomers"] == "recluster":
            who = np.union1d(clients, self._outstanding(fed.present))
            ex = self.embed(fed, who, rnd, purpose="arrival")
            report = self.relate(fed.present, tag=f"-round{rnd}")
            report.update(round=rnd, cause="arrival", clients_embedded=who.tolist(), **_cost(ex))
            self.fcr_reports.append(report)
        else:
            ex = self.embed(fed, clients, rnd, purpose="arrival")
            report = self._place_nearest(clients)
        return {
            "placement": self.params["newcomers"],
            "seconds": time.perf_counter() - tic,
            "fcr_bytes": ex.bytes,
            **report,
        }

    def _place_nearest(self, clients) -> dict:
        """Put each client (with centroids) in the cluster whose mean embedding is nearest."""
        placed = np.array([c for c in np.asarray(clients).tolist() if c in self.centroids], dtype=np.int64)
        known = np.array(
            [c for c in np.flatnonzero(self.labels >= 0) if c in self.centroids and c not in placed], dtype=np.int64
        )
        if not len(placed) or not len(known):
            return {"assigned": []}
        means = np.stack([self.centroids[c].mean(0) for c in known])
        ids = np.unique(self.labels[known])
        cluster_means = np.stack([means[self.labels[known] == j].mean(0) for j in ids])
        mine = np.stack([self.centroids[c].mean(0) for c in placed])
        nearest = ids[np.linalg.norm(mine[:, None] - cluster_means[None], axis=-1).argmin(1)]
        labels = self.labels.copy()
        labels[placed] = nearest
        graph = self.graph.copy()
        same = (labels[:, None] == labels[None, :]) & (labels[:, None] >= 0)
        graph[placed] = same[placed]
        graph[:, placed] = same[:, placed]
        if self.params["aggregation"] == "case1":
            self._carry_models(labels, graph, 0)
        self.labels, self.graph = labels, graph
        present = np.flatnonzero(labels >= 0)
        return {"assigned": nearest.tolist(), **agreement(labels[present], self.ctx.truth[present])}

    def _outstanding(self, present) -> np.ndarray:
        return np.array(sorted(set(self.flag_round) & set(np.asarray(present).tolist())), dtype=np.int64)

    def maintain(self, rnd: int, fed: FederationView) -> list[dict]:
        """Re-run FCR when more than lambda flags are outstanding, when one has waited
        `flag_patience` rounds, or every tau rounds. Every client with an outstanding flag
        re-embeds; for tau, everyone does."""
        lam, tau = self.params["recluster_flags"], self.params["recluster_every"]
        flagged = self._outstanding(fed.present)
        periodic = bool(tau) and rnd % tau == 0
        waited = lam is not None and any(rnd - self.flag_round[c] >= self.params["flag_patience"] for c in flagged)
        if not (periodic or waited or (lam is not None and len(flagged) > lam)):
            return []
        if periodic:
            cause = "period"
        elif set(flagged.tolist()) <= self.monitored:
            cause = "monitor"
        else:
            cause = "flags" if len(flagged) > lam else "patience"
        who = np.asarray(fed.present) if periodic else flagged
        tic, old = time.perf_counter(), self.labels.copy()
        ex = self.embed(fed, who, rnd, purpose="recluster")
        report = self.relate(fed.present, tag=f"-round{rnd}")
        report.update(round=rnd, cause=cause, clients_embedded=who.tolist(), **_cost(ex))
        self.fcr_reports.append(report)
        event = {
            "kind": "recluster",
            "round": rnd,
            "cause": cause,
            "clients": who.tolist(),
            "seconds": time.perf_counter() - tic,
            "fcr_bytes": ex.bytes,
            "old_labels": old.tolist(),
            "new_labels": self.labels.tolist(),
            **{k: report[k] for k in ("clusters", "cluster_sizes", "ari", "nmi") if k in report},
        }
        return [event]

    # -- training -----------------------------------------------------------------------
    def row(self, client: int) -> int:
        """Client's row of self.models; -1: no cluster (it gets the global model)."""
        if self.params["aggregation"] == "case1":
            return int(client)
        return int(self.labels[client])

    def train_tasks(self, rnd, selected):
        stray = [c for c in np.asarray(selected).tolist() if self.labels[c] < 0 and c in self.centroids]
        if stray:  # an embedding that came late: place it now rather than train it on nothing
            self._place_nearest(stray)
        host = self.models.cpu()
        rows = {int(c): self.row(c) for c in selected}
        # the global model is an M x P product in Case I: only for a round that needs it
        fallback = self._global_model().cpu() if min(rows.values(), default=0) < 0 else None
        return {c: Task((host[r] if r >= 0 else fallback)[None]) for c, r in rows.items()}

    def observe(self, rnd, results: dict[int, Result]) -> None:
        for c, r in results.items():
            if r.meta.get("flag"):
                self.flag_round.setdefault(c, rnd)

    def aggregate(self, rnd, results: dict[int, Result]) -> None:
        # a client with no cluster trained the global model: it must not overwrite a cluster's
        results = {c: r for c, r in results.items() if self.row(c) >= 0}
        if not results:
            return
        if self.params["aggregation"] == "case2":
            self._aggregate_clusters(rnd, results)
        else:
            self._aggregate_graph(results)

    def _aggregate_clusters(self, rnd, results):
        """Case II: FedAvg inside each cluster; a cluster with no member back keeps its model."""
        sel = sorted(results)
        models, n = stack(results, sel)
        labels = self.labels[sel]
        new = cluster_average(models, n, one_hot(labels, len(self.models), models), keep=self.models)
        for c in np.unique(labels):
            mine = labels == c
            rows = torch.as_tensor(mine, device=models.device)
            self._monitor(rnd, np.asarray(sel)[mine].tolist(), models[rows] - self.models[c], new[c] - self.models[c])
        self.models = new

    def _monitor(self, rnd: int, members: list[int], updates: torch.Tensor, mean_update: torch.Tensor) -> None:
        """Server-side change monitor: a client whose update points away from its cluster's
        (cosine below `monitor_cosine`) is flagged as if it had raised delta itself."""
        threshold = self.params["monitor_cosine"]
        if threshold is None or len(members) < 2:
            return
        cos = torch.nn.functional.cosine_similarity(updates, mean_update[None], dim=1)
        odd = [m for m, c in zip(members, cos.tolist(), strict=True) if c < threshold]
        for m in odd:
            self.flag_round.setdefault(m, rnd)
        self.monitored.update(odd)

    def _aggregate_graph(self, results):
        """W^{t+1} = W_bar A~ diag(.) as one matrix product over the selected clients."""
        sel = sorted(results)
        models, n = stack(results, sel)  # [s, P], [s]
        graph = torch.as_tensor(self.graph[sel], device=models.device)  # [s, M]
        weights = graph * (n / n.sum())[:, None]
        mass = weights.sum(0)
        touched = mass > 0
        new = self.models.clone()
        new[touched] = (weights[:, touched] / mass[touched]).T @ models
        self.models = new

    def eval_models(self, clients):
        """Cluster (or personal) models, plus the global model as the last row for clients
        without a cluster."""
        rows = np.array([self.row(c) for c in clients], dtype=np.int64)
        if (rows >= 0).all():  # the usual case: no copy of every model with one more row
            return self.models.cpu(), rows
        models = torch.cat([self.models, self._global_model()[None]]).cpu()
        rows[rows < 0] = len(models) - 1
        return models, rows

    def summary(self) -> dict:
        recl = [{k: v for k, v in r.items() if k != "pipeline"} for r in self.fcr_reports[1:]]
        out = {
            "fcr": self.fcr_reports[0] if self.fcr_reports else {},
            "fcr_reports": self.fcr_reports,
            "found_clusters": self.labels.tolist(),
            "reclusterings": recl,
        }
        if self.fcr_reports and "emulated_s" in self.fcr_reports[0]:  # with device profiles
            out["fcr_emulated_s"] = self.fcr_reports[0]["emulated_s"]
            out["recluster_emulated_s"] = sum(r.get("emulated_s", 0.0) for r in recl)
        return out

    def expected_bytes(self, selections, model_bytes):
        # M*W_enc counts one encoder per client; re-clustering sends it again to re-embedders
        latent = self.fcr_reports[0]["latent"] if self.fcr_reports else 0
        return {
            "formula": "M*W_enc + k*M*e + 2*rho*M*W_local*T",
            "bytes": self.encoders_sent * self.payload_bytes
            + self.centroids_sent * latent * 4
            + 2 * selections * model_bytes,
        }


def _cost(ex: Exchange) -> dict:
    """An FCR exchange's cost for its report: bytes, and emulated seconds with profiles."""
    priced = {"emulated_s": ex.report["duration_s"]} if "duration_s" in ex.report else {}
    return {"fcr_bytes": ex.bytes, **priced}


def _median_offdiagonal(adj: np.ndarray) -> float:
    m = len(adj)
    off = adj[~np.eye(m, dtype=bool)]
    med = float(np.median(off)) if off.size else 1.0
    return med if med > 0 else 1.0
