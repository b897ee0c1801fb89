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

Dynamic FLT, with its defaults: a device tests its data against what it embedded when its
store changes and raises the flag delta when the test says it moved (devices/watch.py);
any flag (more than lambda = `recluster_flags`, 0 by default; or one waiting
`flag_patience` rounds; or every tau rounds) has the flagged clients re-embed, as
newcomers do on arrival. FCR's server side then re-runs over everyone with the fresh
centroids, and the clusters settle (server/placement.py): kept (fresh clients join the
nearest old cluster, or open a new one where the re-run separates them from everyone) or
the re-run, by silhouette. A cluster that continues keeps its id and its model; a new one
starts from its nearest old cluster's model or the global one, whichever has the lower
loss on its members' data. A client without a cluster (its embedding failed) trains and is
evaluated with the global model and never touches a cluster's model.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np
import torch

from flt.common.errors import DeviceError
from flt.server import fcr, placement
from flt.server.exchange import Call, Exchange
from flt.server.fcr_recipe import FLT_RECIPE
from flt.server.ops import CHOOSE, EMBED, EVALUATE, TRAIN
from flt.server.strategies.base import (
    Artifact,
    FederationView,
    Result,
    Strategy,
    Task,
    agreement,
    cluster_average,
    one_hot,
    stack,
    weighted_average,
)
from flt.server.strategies.params import FLT as FLT_PARAMS


class FLT(Strategy):
    name = "flt"
    # embed: FCR's encoder and k-means (also PCA+kM+HC); choose: a new cluster's start model
    DEVICE_OPS = (TRAIN, EVALUATE, EMBED, CHOOSE)
    PARAMS = FLT_PARAMS  # server/strategies/params.py: every method's parameters, torch-free
    # the encoder sent, the relatedness pipeline and its threshold (server/fcr_recipe.py);
    # PCA+kM+HC is this class with another recipe
    RECIPE = FLT_RECIPE

    def __init__(self, ctx, **params):
        super().__init__(ctx, **params)
        m = ctx.n_clients
        self.how = self.RECIPE.pipeline(self.params)
        self.gamma_used: float | None = self.how.gamma  # the threshold the last clustering used
        self.fcr_reports: list[dict] = []  # the initial FCR, then every re-clustering
        self.labels = np.zeros(m, dtype=np.int64)  # before FCR: everyone in one cluster
        self.graph = np.ones((m, m), dtype=np.float32)
        case2 = self.params["aggregation"] == "case2"
        self.models = self.on(ctx.init.clone())[None].expand(1 if case2 else m, -1).clone()
        self.centroids: dict[int, np.ndarray] = {}
        self.centroid_classes: dict[int, np.ndarray] = {}  # k: labels, the class of each centroid
        self.flag_round: dict[int, int] = {}  # outstanding data-change flags: client -> round first seen
        self.monitored: set[int] = set()  # of those, flagged by the server-side monitor
        self.payload_bytes, self.centroids_sent, self.encoders_sent = 0, 0, 0
        self.encoder_info: dict = {}
        self.opened: dict[int, int] = {}  # clusters the last placement opened -> their nearest old one
        self.timeline: list[tuple[int, np.ndarray]] = []  # (round, labels) at every clustering

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
        self.timeline.append((0, self.labels.copy()))

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
        """What travels down for FCR (the recipe's payload: ONNX bytes, an autoencoder, a
        PCA basis), its meta and a report of the encoder."""
        return self.RECIPE.payload(self.ctx, self.params)

    def project(self, points: list[np.ndarray]) -> list[np.ndarray]:
        if self.how.space == "embedding":
            return points
        u = self.params["umap"]
        return fcr.umap_project(
            points, u["n_components"], u["n_neighbors"], u["min_dist"], u["metric"], seed=self.ctx.seed
        )

    def relate(self, clients, tag: str = "", fresh=None) -> dict:
        """Steps 3-4 of FCR over `clients` that have centroids. With `fresh` (the clients
        whose centroids are new since the last clustering) and disjoint clusters, the old
        clusters are kept or the re-run taken (server/placement.py), ids and models
        continuing; else models carry over from the old clustering. Returns the FCR
        report (also appended by the caller)."""
        tic = time.perf_counter()
        clients = np.array(sorted(c for c in np.asarray(clients).tolist() if c in self.centroids))
        points = self.project([self.centroids[c] for c in clients])
        how = self.RECIPE.threshold(self.how, points, self.params, self.ctx.device)
        self.gamma_used = how.gamma
        classes = [self.centroid_classes[c] for c in clients] if self.centroid_classes else None
        found = fcr.relate(
            points, how, self.params["clusters"], self.params["max_clusters"], self.ctx.device, classes=classes
        )
        labels = np.full(self.ctx.n_clients, -1, dtype=np.int64)
        graph = np.eye(self.ctx.n_clients, dtype=np.float32)
        old = self.labels
        placed: dict = {}
        if fresh is not None and self.params["aggregation"] == "case2":
            chosen, placed = self._settle(clients, np.isin(clients, fresh), found)
            labels[clients] = chosen
            graph[np.ix_(clients, clients)] = fcr.cluster_graph(chosen)
        else:
            chosen = found.labels
            labels[clients] = chosen
            graph[np.ix_(clients, clients)] = (
                found.graph
                if self.params["adjacency"] == "hard"
                else fcr.soft_weights(found.distance, how.gamma or _median_offdiagonal(found.distance))
            )
            self._carry_models(labels, graph, found.n_clusters)
        self.labels, self.graph = labels, graph
        order = fcr.leaf_order(found.linkage, len(clients))
        truth = self.ctx.truth[clients]
        report = {
            "server_seconds": time.perf_counter() - tic,
            "clusters": int(len(np.unique(chosen))),
            "gamma": how.gamma,
            "silhouette": fcr.silhouette_or_zero(found.distance, chosen) if placed else found.silhouette,
            "separation": found.separation,
            "pipeline": asdict(how),
            "cluster_sizes": np.unique(chosen, return_counts=True)[1].tolist(),
            **placed,
            "mean_degree": float(graph[np.ix_(clients, clients)].sum(1).mean()),
            "n_clients": int(len(clients)),
            "latent": int(points[0].shape[1])
            if self.how.space == "embedding"
            else int(next(iter(self.centroids.values())).shape[1]),
            "centroids_sent": self.centroids_sent,
            "encoder_bytes": self.payload_bytes,
            **self.encoder_info,
            **agreement(chosen, truth),
        }
        arrays = {
            "clients": clients,
            "adjacency": found.distance,
            "graph": graph[np.ix_(clients, clients)],
            "labels": chosen,
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
        # figures for a clustering that changed something (a re-placement that kept every
        # label gets its arrays only: drawing costs about a second per clustering)
        self.emit(Artifact(f"fcr{tag}", arrays, plot="fcr" if not tag or (old[clients] != chosen).any() else None))
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

    def _settle(self, clients: np.ndarray, fresh: np.ndarray, found: fcr.Clustering) -> tuple[np.ndarray, dict]:
        """Case II after fresh centroids: kept or re-run (server/placement.py). A cluster
        that continues keeps its model; a new one starts from the global model until
        `start_models` measures it against its nearest old cluster's. Returns the labels
        of `clients` and what the report says of the placement."""
        old = self.labels[clients]
        next_id = len(self.models)
        if self.params["newcomers"] == "recluster":
            chosen, how = placement.match_labels(old, found.labels, next_id), "rerun"
        else:
            chosen, how = placement.settle(found.distance, old, fresh, found.labels, self.how.silhouette_slack, next_id)
        opened = np.unique(chosen[chosen >= next_id])
        near = placement.mean_distance_to_clusters(found.distance, old, np.flatnonzero(~fresh & (old >= 0)))
        self.opened = {}
        for j in opened.tolist():  # each new cluster's nearest old one, by mean A of its members
            if near.shape[1]:
                self.opened[j] = int(near[chosen == j].mean(0).argmin())
        size = max(next_id, int(chosen.max()) + 1 if len(chosen) else 0)
        grown = self._global_model()[None].expand(size, -1).clone()
        grown[:next_id] = self.models
        self.models = grown  # rows of clusters gone stay: ids never change meaning
        moved = clients[(old >= 0) & (old != chosen)]
        return chosen, {"placement": how, "opened": opened.tolist(), "moved": moved.tolist()}

    def start_models(self, rnd: int, fed: FederationView, purpose: str) -> dict:
        """Each cluster opened by the last placement starts from its nearest old cluster's
        model or the global one, whichever has the lower loss on its members' own training
        data (the `choose` op, devices/methods/choose.py; IFCA's estimate, two candidates).
        Returns {cluster: "nearest" | "global"} and the exchange's bytes."""
        chosen: dict[int, str] = {}
        spent = 0
        present = set(np.asarray(fed.present).tolist())
        everyone = self._global_model()
        for j, k in self.opened.items():
            members = [c for c in np.flatnonzero(self.labels == j).tolist() if c in present]
            candidates = torch.stack([self.models[k], everyone]).cpu().numpy()
            ex = fed.run(CHOOSE, rnd, {c: Call({"model": candidates}) for c in members}, purpose)
            spent += ex.bytes
            loss = np.zeros(2)
            for c, r in ex.results.items():  # shapes checked (server/replies.py: choose_check)
                got = r.tensors["losses"].astype(np.float64)
                if np.isfinite(got).all():  # a diverged candidate's loss: not counted
                    loss += got * self.ctx.n_train[c]
            pick = int(loss[1] < loss[0])  # no usable reply: the nearest cluster's model
            chosen[j] = ("nearest", "global")[pick]
            if pick == 0:
                self.models[j] = self.models[k]
        self.opened = {}
        return {"start_models": chosen, "start_bytes": spent} if chosen else {}

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
        """Newcomers embed their data (with every client whose flag is outstanding), then
        they are placed (`newcomers`): `auto` keeps the clusters or takes FCR's re-run,
        whichever the silhouette prefers, opening a cluster for a group of newcomers
        unlike everyone (server/placement.py); `nearest` joins each to the nearest
        cluster; `recluster` always takes the re-run."""
        tic = time.perf_counter()
        if self.params["newcomers"] == "nearest":
            ex = self.embed(fed, clients, rnd, purpose="arrival")
            report = {"placement": "nearest", **self._place_nearest(clients)}
        else:
            who = np.union1d(clients, self._outstanding(fed.present))
            report = self.reconcile(rnd, fed, who, "arrival")
            ex = None
        return {
            "newcomers": self.params["newcomers"],
            "seconds": time.perf_counter() - tic,
            **({"fcr_bytes": ex.bytes} if ex else {}),
            **report,
        }

    def reconcile(self, rnd: int, fed: FederationView, who: np.ndarray, cause: str) -> dict:
        """`who` re-embed, FCR's server side re-runs over everyone present with their fresh
        centroids, the clusters settle (kept or re-run) and new clusters get their start
        models. Appends and returns the FCR report."""
        ex = self.embed(fed, who, rnd, purpose="recluster" if cause != "arrival" else "arrival")
        report = self.relate(fed.present, tag=f"-round{rnd}", fresh=np.array(sorted(ex.results), dtype=np.int64))
        report.update(round=rnd, cause=cause, clients_embedded=np.asarray(who).tolist(), **_cost(ex))
        report.update(self.start_models(rnd, fed, purpose="recluster"))
        report["fcr_bytes"] += report.get("start_bytes", 0)
        self.fcr_reports.append(report)
        self.timeline.append((rnd, self.labels.copy()))
        self.emit(Artifact("clusters_timeline", self._timeline_arrays(), plot="timeline"))
        return report

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
        """Re-run FCR when more than lambda flags are outstanding (lambda = 0 by default:
        any flag, at the end of the round it arrived in), when one has waited
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
        report = self.reconcile(rnd, fed, who, cause)
        event = {
            "kind": "recluster",
            "round": rnd,
            "cause": cause,
            "clients": who.tolist(),
            "seconds": time.perf_counter() - tic,
            "fcr_bytes": report["fcr_bytes"],
            "old_labels": old.tolist(),
            "new_labels": self.labels.tolist(),
            **{k: report[k] for k in EVENT_KEYS if k in report},
        }
        return [event]

    def _timeline_arrays(self) -> dict[str, np.ndarray]:
        rounds, labels = zip(*self.timeline, strict=True)
        return {"rounds": np.array(rounds, dtype=np.int64), "labels": np.stack(labels)}

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

    def on_notice(self, rnd: int, clients: np.ndarray) -> None:
        for c in clients.tolist():  # re-placed at the end of this round, like a flag in an update
            self.flag_round.setdefault(int(c), rnd)

    def aggregate(self, rnd, results: dict[int, Result]) -> None:
        # a client with no cluster trained the global model: it must not overwrite a cluster's;
        # a client whose data moved (flag outstanding) must not pull its old cluster along
        results = {c: r for c, r in results.items() if self.row(c) >= 0 and c not in self.flag_round}
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
            "gamma": self.gamma_used,
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


EVENT_KEYS = ("clusters", "cluster_sizes", "placement", "moved", "opened", "start_models", "ari", "nmi")


def _cost(ex: Exchange) -> dict:
    """An FCR exchange's cost for its report: bytes, and emulated seconds with profiles."""
    priced = {"emulated_s": ex.report["duration_s"]} if "duration_s" in ex.report else {}
    return {"fcr_bytes": ex.bytes, **priced}


def _median_offdiagonal(adj: np.ndarray) -> float:
    m = len(adj)
    off = adj[~np.eye(m, dtype=bool)]
    med = float(np.median(off)) if off.size else 1.0
    return med if med > 0 else 1.0
