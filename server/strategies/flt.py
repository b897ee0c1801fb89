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
from flt.server import fcr
from flt.server.exchange import Call, Exchange
from flt.server.fcr_recipe import FLT_RECIPE
from flt.server.ops import CHOOSE, EMBED, EVALUATE, TRAIN
from flt.server.replies import REFERENCE_ROWS
from flt.server.strategies.base import (
    Artifact,
    FederationView,
    Result,
    Task,
    agreement,
    cluster_average,
    log,
    one_hot,
    stack,
    weighted_average,
)
from flt.server.strategies.flt_dynamics import Reclustering, fcr_cost
from flt.server.strategies.params import FLT as FLT_PARAMS

# How many times a client whose centroids did not come is asked again, in the rounds after.
EMBED_RETRIES = 3
# Columns per block of Case I's product: its temporary is [M, 65536] floats, not [M, P].
_GRAPH_BLOCK = 1 << 16


class FLT(Reclustering):
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
        self.centroid_shares: dict[int, np.ndarray] = {}  # each centroid's share of its client's samples
        # each client's summaries of two halves of its data ("a", "a_shares", "b", "b_shares"):
        # what choose 'halves' draws the clusters on and tests them with (server/fcr.py)
        self.halves: dict[int, dict[str, np.ndarray]] = {}
        self.flag_round: dict[int, int] = {}  # outstanding data-change flags: client -> round first seen
        self.monitored: set[int] = set()  # of those, flagged by the server-side monitor
        self.embed_misses: dict[int, int] = {}  # embedding requests a client left unanswered in a row
        self.payload_bytes, self.centroids_sent, self.encoders_sent = 0, 0, 0
        self.candidates_sent = 0  # models sent for a new cluster's start-model choice
        self.encoder_info: dict = {}
        self.opened: dict[int, int] = {}  # clusters the last placement opened -> their nearest old one
        self.timeline: list[tuple[int, np.ndarray]] = []  # (round, labels) at every clustering

    # -- FCR ----------------------------------------------------------------------------
    def setup(self, fed: FederationView, retries: int = 0) -> None:
        """FCR over every present client. A client whose centroids did not come is asked
        again at the end of round 1 (`_ask_again`); `retries` > 0 asks it again here, up to
        that many times, before clustering (`flt relate`, which has no rounds to wait for)."""
        tic = time.perf_counter()
        self.payload, self.payload_meta, self.encoder_info = self.encoder_payload()
        self.payload_bytes = sum(t.nbytes for t in self.payload.values())
        exchanges = [self.embed(fed, fed.present, rnd=0, purpose="fcr")]
        if not exchanges[0].results:
            raise DeviceError(
                "FCR: no client sent valid centroids in time (embedding waits 4 x devices.round_timeout_s; "
                "the log above names late and rejected replies, the device logs any failure)"
            )
        for attempt in range(1, retries + 1):
            missed = self._outstanding(fed.present)
            if not len(missed):
                break
            log.warning(
                "%s: asking %d clients again for centroids (retry %d of %d)", self.name, len(missed), attempt, retries
            )
            exchanges.append(self.embed(fed, missed, rnd=0, purpose="fcr"))
        report = self.relate(fed.present)
        report.update(
            round=0,
            cause="initial",
            seconds=time.perf_counter() - tic,
            **fcr_cost(*exchanges),
            unassigned=sorted(set(np.asarray(fed.present).tolist()) - set(self.centroids)),
        )
        self.fcr_reports.append(report)
        self.timeline.append((0, self.labels.copy()))
        self.note_clustering(report)

    def embed(self, fed: FederationView, clients: np.ndarray, rnd: int, purpose: str = "fcr") -> Exchange:
        """Send the encoder to `clients`, keep the k x e centroids they send back; a client
        that re-embedded has no outstanding flag any more. Returns the exchange (who
        answered, its bytes and emulated seconds), reported as `purpose`. The encoder sent
        again to a client that left its last request unanswered is not billed."""
        again = [c for c in np.asarray(clients).tolist() if self.embed_misses.get(c, 0)]
        ex = fed.embed(rnd, np.asarray(clients), self.payload, self.payload_meta, purpose, again=again)
        got = {c: v[0] for c, v in ex.results.items()}
        self.centroid_shares.update({c: v[1] for c, v in ex.results.items()})
        for c, v in ex.results.items():  # a re-embedding replaces a client's halves, or drops them
            if v[2] is None:
                self.halves.pop(c, None)
            else:
                self.halves[c] = v[2]
        if self.params["k"] == "labels":  # rows are [mean embedding, class]
            self.centroid_classes.update({c: v[:, -1].astype(np.int64) for c, v in got.items()})
            got = {c: np.ascontiguousarray(v[:, :-1]) for c, v in got.items()}
        self.encoders_sent += len(clients) - len(again)
        self.centroids.update(got)
        self.centroids_sent += sum(len(c) for c in got.values())
        self.centroids_sent += sum(len(v[2]["a"]) + len(v[2]["b"]) for v in ex.results.values() if v[2] is not None)
        for c in got:
            self.flag_round.pop(c, None)
            self.monitored.discard(c)
            self.embed_misses.pop(c, None)
        self._ask_again(sorted(set(np.asarray(clients).tolist()) - set(got)), rnd)
        return ex

    def _ask_again(self, missed: list[int], rnd: int) -> None:
        """Clients whose centroids did not come (their device late or failing, their reply
        rejected) are flagged, so they embed again at the end of the round (`maintain`):
        a client left out of the set-up's FCR would train and be evaluated with the global
        model for the rest of the run. After EMBED_RETRIES unanswered requests in a row the
        server stops asking (a device that never answers must not cost an encoder a round).
        A client that has centroids and no outstanding flag (it missed a periodic
        re-embedding) keeps its last ones, and its cluster."""
        for c in missed:
            if c in self.centroids and c not in self.flag_round:
                continue
            self.embed_misses[c] = self.embed_misses.get(c, 0) + 1
            if self.embed_misses[c] <= EMBED_RETRIES:
                self.flag_round.setdefault(c, rnd)
            elif self.flag_round.pop(c, None) is not None:
                self.monitored.discard(c)
                placed = f"stays in cluster {self.labels[c]}" if self.labels[c] >= 0 else "keeps the global model"
                asked = EMBED_RETRIES + 1
                log.warning("%s: client %d left %d embedding requests unanswered; it %s", self.name, c, asked, placed)

    @classmethod
    def max_upload(cls, params: dict, in_shape: tuple[int, ...], num_classes: int) -> int:
        """A checkpoint's state reply carries the change test's reference: REFERENCE_ROWS
        embeddings of e floats (PCA+kM+HC: e = its components)."""
        width = int(params["components"]) if "components" in params else int(params["encoder"]["latent"])
        return REFERENCE_ROWS * width * 4 + 4096

    def watch_encoder(self) -> Call | None:
        """The frozen encoder (ONNX, or a PCA basis) the devices test data changes with."""
        meta = getattr(self, "payload_meta", {})
        if meta.get("format") not in ("onnx", "linear") or meta.get("k") == "labels":
            return None
        return Call(self.payload, {"format": meta["format"]})

    def _shares(self, client: int) -> np.ndarray:
        """A centroid's share of its client's samples (equal shares for centroids kept from
        before clients sent them)."""
        k = len(self.centroids[client])
        return self.centroid_shares.get(client, np.full(k, 1.0 / k))

    def encoder_payload(self) -> tuple[dict, dict, dict]:
        """What travels down for FCR (the recipe's payload: ONNX bytes, an autoencoder, a
        PCA basis), its meta and a report of the encoder."""
        return self.RECIPE.payload(self.ctx, self.params)

    def project(self, points: list[np.ndarray], weights: list[np.ndarray] | None = None) -> list[np.ndarray]:
        if self.how.space == "embedding":
            return points
        if self.how.space == "whitened":
            # each client fine-tuned its own copy of the encoder (Enc2) or fitted its own
            # PCA: no coordinates are shared, so pooled statistics would mix them
            if self.payload_meta.get("format") in ("autoencoder", "own_pca"):
                return points
            return fcr.whiten(points, weights)
        u = self.params["umap"]
        return fcr.umap_project(
            points, u["n_components"], u["n_neighbors"], u["min_dist"], u["metric"], seed=self.ctx.seed
        )

    def relate(self, clients: np.ndarray, tag: str = "", fresh: np.ndarray | None = None) -> dict:
        """Steps 3-4 of FCR over `clients` that have centroids. With `fresh` (the clients
        whose centroids are new since the last clustering) and disjoint clusters, the old
        clusters are kept or the re-run taken (server/placement.py), ids and models
        continuing; else models carry over from the old clustering. Returns the FCR
        report (also appended by the caller)."""
        tic = time.perf_counter()
        clients = np.array(sorted(c for c in np.asarray(clients).tolist() if c in self.centroids))
        shares = [self._shares(c) for c in clients]
        points = self.project([self.centroids[c] for c in clients], shares)
        how = self.RECIPE.threshold(self.how, points, self.params, self.ctx.device)
        self.gamma_used = how.gamma
        classes = [self.centroid_classes[c] for c in clients] if self.centroid_classes else None
        found = fcr.relate(
            points,
            how,
            self.params["clusters"],
            self.params["max_clusters"],
            self.ctx.device,
            classes=classes,
            weights=shares,
            halves=self._halves_of(clients) if how.choose == "halves" else None,
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
            "chosen_by": found.chosen_by,
            "next_cut": None if placed.get("placement") == "kept" else found.next_cut,  # of the re-run's cut
            "pipeline": asdict(how),
            "cluster_sizes": np.unique(chosen, return_counts=True)[1].tolist(),
            **placed,
            "mean_degree": float(graph[np.ix_(clients, clients)].sum(1).mean()),
            "n_clients": int(len(clients)),
            "latent": int(points[0].shape[1])
            if self.how.space != "umap"
            else int(next(iter(self.centroids.values())).shape[1]),
            "centroids_sent": self.centroids_sent,
            "encoder_bytes": self.payload_bytes,
            **self.encoder_info,
            **agreement(chosen, truth),
        }
        if "ari" in report:  # the clients' own planted clusters (-1: none planted)
            report["planted_clusters"] = int(len(np.unique(truth[truth >= 0])))
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
            "shares": np.concatenate(shares),
        }
        if classes is not None:  # k: labels, each centroid's class
            arrays["classes"] = np.concatenate(classes)
        arrays |= self._half_arrays(clients)
        # figures for a clustering that changed something (a re-placement that kept every
        # label gets its arrays only: drawing costs about a second per clustering)
        self.emit(Artifact(f"fcr{tag}", arrays, plot="fcr" if not tag or (old[clients] != chosen).any() else None))
        return report

    def _half_arrays(self, clients: np.ndarray) -> dict[str, np.ndarray]:
        """The halves as sent, for fcr.npz: rows, shares, owner and side (0: drew the
        held-out dendrogram, 1: tested it)."""
        parts = [(c, side) for c in clients.tolist() if c in self.halves for side in (0, 1)]
        if not parts:
            return {}
        rows = [self.halves[c]["ab"[side]] for c, side in parts]
        counts = [len(r) for r in rows]
        return {
            "halves": np.concatenate(rows),
            "half_shares": np.concatenate([self.halves[c]["ab"[side] + "_shares"] for c, side in parts]),
            "half_owner": np.repeat([c for c, _ in parts], counts),
            "half_side": np.repeat([side for _, side in parts], counts).astype(np.int8),
        }

    def _halves_of(self, clients: np.ndarray) -> fcr.Halves:
        """The half summaries of those of `clients` that sent them, projected together (the
        held-out test compares a client's two halves), as the whole summaries are."""
        have = np.array([i for i, c in enumerate(clients.tolist()) if c in self.halves], dtype=np.int64)
        sent = [self.halves[int(clients[i])] for i in have]
        rows = [h[side] for side in "ab" for h in sent]
        shares = [h[side + "_shares"] for side in "ab" for h in sent]
        classes = None
        if self.params["k"] == "labels":  # rows are [mean embedding, class]
            classes = [r[:, -1].astype(np.int64) for r in rows]
            rows = [np.ascontiguousarray(r[:, :-1]) for r in rows]
        points = self.project(rows, shares) if rows else rows
        n = len(have)
        a_c, b_c = (None, None) if classes is None else (classes[:n], classes[n:])
        return fcr.Halves(have, points[:n], points[n:], shares[:n], shares[n:], a_c, b_c)

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

    # -- training -----------------------------------------------------------------------
    def row(self, client: int) -> int:
        """Client's row of self.models; -1: no cluster (it gets the global model)."""
        if self.params["aggregation"] == "case1":
            return int(client)
        return int(self.labels[client])

    def train_tasks(self, rnd: int, selected: np.ndarray) -> dict[int, Task]:
        stray = [c for c in np.asarray(selected).tolist() if self.labels[c] < 0 and c in self.centroids]
        if stray:  # an embedding that came late: place it now rather than train it on nothing
            self._place_nearest(stray)
        host = self.models.cpu()
        rows = {int(c): self.row(c) for c in selected}
        # the global model is an M x P product in Case I: only for a round that needs it
        if min(rows.values(), default=0) >= 0:
            return {c: Task(host[r][None]) for c, r in rows.items()}
        fallback = self._global_model().cpu()
        return {c: Task((host[r] if r >= 0 else fallback)[None]) for c, r in rows.items()}

    def aggregate(self, rnd: int, results: dict[int, Result]) -> None:
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

    def _aggregate_graph(self, results):
        """W^{t+1} = W_bar A~ diag(.) as a matrix product over the selected clients, written
        into the M x P table block by block of columns: a copy of the table and a full
        [M, P] product (2.6 GB each for the LEAF CNN on 105 writers) took four times as long
        and 2.2 times the table's size in extra memory (benchmarks/bench_case1.py)."""
        sel = sorted(results)
        models, n = stack(results, sel)  # [s, P], [s]
        graph = torch.as_tensor(self.graph[sel], device=models.device)  # [s, M]
        weights = graph * (n / n.sum())[:, None]
        mass = weights.sum(0)
        rows = torch.nonzero(mass > 0).squeeze(1)
        mix = (weights[:, rows] / mass[rows]).T.contiguous()  # [touched, s]
        for a in range(0, models.shape[1], _GRAPH_BLOCK):
            self.models[rows, a : a + _GRAPH_BLOCK] = mix @ models[:, a : a + _GRAPH_BLOCK]

    def eval_models(self, clients: np.ndarray) -> tuple[torch.Tensor | None, np.ndarray]:
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

    def expected_bytes(self, selections: int, model_bytes: int) -> dict:
        # M*W_enc counts one encoder per client; re-clustering sends it again to re-embedders
        latent = self.fcr_reports[0]["latent"] if self.fcr_reports else 0
        return {
            # 3k: k centroids of the client's data and k of each of its halves; + 1: each one's share
            # + after a re-clustering that opens a cluster: 2 candidate models down to each of
            # its members (their 2 losses come back as control traffic, as metrics do)
            "formula": "M*W_enc + 3k*M*(e+1) + 2*rho*M*W_local*T (+ 2*W_local per member of an opened cluster)",
            "bytes": self.encoders_sent * self.payload_bytes
            + self.centroids_sent * (latent + (self.params["k"] == "labels") + 1) * 4  # class column, share
            + 2 * selections * model_bytes
            + self.candidates_sent * model_bytes,
        }


def _median_offdiagonal(adj: np.ndarray) -> float:
    m = len(adj)
    off = adj[~np.eye(m, dtype=bool)]
    med = float(np.median(off)) if off.size else 1.0
    return med if med > 0 else 1.0
