"""Dynamic FLT: what FLT does when its population changes (newcomers arrive, data drifts).

A device tests its data against what it embedded when its store changes and says so (the
change flag delta, devices/watch.py); the server's monitor may flag a client whose update
points away from its cluster's. Any flag (more than lambda = `recluster_flags`, 0 by
default; or one waiting `flag_patience` rounds; or every tau rounds) has the flagged
clients re-embed, as newcomers do on arrival. FCR's server side then re-runs over
everyone with the fresh centroids, and the clusters settle (server/placement.py): kept
(fresh clients join the nearest old cluster, or open a new one where the re-run separates
them from everyone) or the re-run, by silhouette. A cluster that continues keeps its id
and its model; a new one starts from its nearest old cluster's model or the global one,
whichever has the lower loss on its members' data (the `choose` op).

`Reclustering` is FLT's dynamic half; server/strategies/flt.py builds FLT on it and
supplies FCR itself (embed, relate) and the cluster models.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from flt.reports.fcr_text import describe_clustering
from flt.server import fcr, placement
from flt.server.exchange import Call, Exchange
from flt.server.ops import CHOOSE
from flt.server.strategies.base import Artifact, FederationView, Result, Strategy, agreement


class Reclustering(Strategy):
    """Flags, placement of fresh centroids, new clusters' start models, the timeline."""

    # kept by FLT (server/strategies/flt.py)
    labels: np.ndarray  # [M] cluster of each client, -1: none
    graph: np.ndarray  # [M, M] A~
    models: torch.Tensor  # cluster (Case II) or personal (Case I) models
    centroids: dict[int, np.ndarray]
    how: fcr.Relatedness
    fcr_reports: list[dict]
    flag_round: dict[int, int]  # outstanding data-change flags: client -> round first seen
    monitored: set[int]  # of those, flagged by the server-side monitor
    embed_misses: dict[int, int]  # embedding requests a client left unanswered in a row
    opened: dict[int, int]  # clusters the last placement opened -> their nearest old one
    timeline: list[tuple[int, np.ndarray]]  # (round, labels) at every clustering
    candidates_sent: int  # start-model candidates sent down (counted for expected_bytes)

    def embed(self, fed: FederationView, clients: np.ndarray, rnd: int, purpose: str = "fcr") -> Exchange:
        raise NotImplementedError  # FLT: send the encoder, keep the centroids

    def note_clustering(self, report: dict) -> None:
        """What a clustering found, in words, for the terminal (the round loop prints notes)."""
        lines = describe_clustering(report)
        if not lines:
            return
        first, *rest = lines
        when = f"round {report['round']} ({report['cause']})" if report.get("round") else "set-up"
        placement = {"kept": ", clusters kept", "rerun": ", re-run taken"}.get(str(report.get("placement")), "")
        if missing := report.get("unassigned"):  # the set-up's: FLT._ask_again asks them again
            rest.append(f"no centroids came from clients {missing}: asked again after round 1 (global model till then)")
        self.notes += [f"FCR at {when}{placement}: {first}", *(f"  {line}" for line in rest)]

    def relate(self, clients: np.ndarray, tag: str = "", fresh: np.ndarray | None = None) -> dict:
        raise NotImplementedError  # FLT: FCR's server side over `clients`

    def _global_model(self) -> torch.Tensor:
        raise NotImplementedError

    def _carry_models(self, labels: np.ndarray, graph: np.ndarray, n_clusters: int) -> None:
        raise NotImplementedError

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
            self.candidates_sent += len(members) * len(candidates)
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
        # a periodic re-run re-measures everyone, so every clustered client is an incumbent
        # (whether it answered or, its device late, keeps its last centroids): the clusters
        # stay unless the re-run is better by the slack, as for any placement
        fresh = np.array(sorted(ex.results), dtype=np.int64)
        if cause == "period":
            fresh = fresh[self.labels[fresh] < 0]
        report = self.relate(fed.present, tag=f"-round{rnd}", fresh=fresh)
        report.update(round=rnd, cause=cause, clients_embedded=np.asarray(who).tolist(), **fcr_cost(ex))
        report.update(self.start_models(rnd, fed, purpose="recluster"))
        report["fcr_bytes"] += report.get("start_bytes", 0)
        self.fcr_reports.append(report)
        self.timeline.append((rnd, self.labels.copy()))
        self.note_clustering(report)
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
        # clients that left their last embedding request unanswered (FLT._ask_again): asked
        # again whatever lambda says
        unanswered = [c for c in flagged.tolist() if c in self.embed_misses]
        if not (periodic or waited or unanswered or (lam is not None and len(flagged) > lam)):
            return []
        if periodic:
            cause = "period"
        elif len(unanswered) == len(flagged):
            cause = "retry"
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

    def observe(self, rnd: int, results: dict[int, Result]) -> None:
        for c, r in results.items():
            if r.meta.get("flag"):
                self.flag_round.setdefault(c, rnd)

    def on_notice(self, rnd: int, clients: np.ndarray) -> None:
        for c in clients.tolist():  # re-placed at the end of this round, like a flag in an update
            self.flag_round.setdefault(int(c), rnd)

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


EVENT_KEYS = ("clusters", "cluster_sizes", "placement", "moved", "opened", "start_models", "ari", "nmi")


def fcr_cost(*exchanges: Exchange) -> dict:
    """FCR exchanges' cost for their report: bytes, and emulated seconds with profiles."""
    timed = [ex.report["duration_s"] for ex in exchanges if "duration_s" in ex.report]
    return {"fcr_bytes": sum(ex.bytes for ex in exchanges), **({"emulated_s": sum(timed)} if timed else {})}
