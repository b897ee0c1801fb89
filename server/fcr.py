"""Server side of FCR (form client relatedness): from every client's k centroids (and
each centroid's share of the client's samples) to a client graph A~ and C disjoint clusters.

Named pipelines, and every stage a validated choice (`Relatedness`):

set     (the default: no threshold, no per-dataset knob)
    the centroids whitened with their pooled covariance (`whiten`; FLT skips it for
    per-client fine-tuned encoders), A_ij = the energy distance between the clients'
    share-weighted sets (a squared distance between their kernel mean embeddings), Ward
    linkage on its root, and C = the finest cut whose every split is real
    (`split_clusters`: each merge above the cut scores `split_score` >= `min_split`,
    against the spread inside the final clusters, so nested groups do not hide a finer
    cut), checked on held-out data (`HeldOut`: clients also summarise two random halves
    of their data; the dendrogram of one half is cut where every merge separates the
    other halves, `heldout_z`): every split of the cut must also separate the clients'
    halves (z >= `min_heldout_keep`: pieces of one group, or a few clients of one
    population split off by chance, do not), and where sampling noise hides the clients'
    differences, a finer cut that the halves confirm (z >= `min_heldout`) wins; neither
    rule finding a split: C = 1 (unless clients that lie alone far off, `outlying`, hid
    the structure of the rest: then they are set aside, the rest related again, and each
    joins its nearest cluster). The clusters are that cut, then
    refined by Lloyd's iterations on Ward's own objective (`refine_ward`: each client
    moves to the nearest cluster mean until none moves; C stays). Everything is
    invariant to scaling the centroids.
chamfer (the default until Dec 2026)
    A_ij = symmetric Chamfer distance between the raw centroid sets:
    (mean_r min_s d_rs + mean_s min_r d_rs) / 2; average linkage; C by the silhouette of
    A (near-ties within `silhouette_slack` go to the finer cut; a lone client joins its
    nearest cluster), kept only when that cut's clusters are `min_separation` apart
    (below); else C = 1.
paper   (the FLT paper's Algorithm 2, steps 3-4)
    centroids --UMAP--> u-dim points, A_ij = min_{r,s} ||u_ir - u_js|| (the single
    closest pair), A~ = [A <= gamma], Ward on the rows of A~, C at the largest gap
    between successive merge heights.

The separation of a cut (the chamfer pipeline's test, and reported for every cut) is
    (mean A between clusters - mean A within clusters) / median distance between two centroids,
how far apart the clusters' clients are, in units of the typical distance between two
of the encoder's modes (mostly different classes).

Clients may send different numbers of centroids (k: auto); padding is masked, never
counted. Everything is vectorized (torch.cdist in row chunks): 2,400 clients of 5 centroids
in 128 dimensions took 46 s on a loaded 2-core machine, 145 s with the held-out test.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from scipy.cluster.hierarchy import fcluster, leaves_list, linkage
from scipy.spatial.distance import pdist, squareform
from scipy.stats import norm
from sklearn.metrics import silhouette_score

# the pipelines' knobs and presets are FLT's parameters: they live with them, torch-free (and
# stay importable from here: a checkpoint written before the move names flt.server.fcr:Relatedness)
from flt.server.strategies.params import CHOOSERS, DISTANCES, LINKAGES, MAX_MATCHED, PRESETS, SPACES, Relatedness  # noqa: F401

log = logging.getLogger("flt.server")


@dataclass
class Clustering:
    labels: np.ndarray  # [M] 0..C-1, in order of first appearance
    distance: np.ndarray  # [M, M] A
    graph: np.ndarray  # [M, M] A~ (0/1, self-loops)
    linkage: np.ndarray  # scipy linkage matrix
    n_clusters: int
    silhouette: float | None  # of the chosen cut on A (None for C = 1)
    separation: float | None = None  # of the best cut, whether it was kept or not (module docstring)
    chosen_by: str | None = None  # which rule set C under choose 'halves': "splits" or "halves"
    next_cut: dict | None = None  # why not one more cluster (`next_cut`); None unless C was chosen by splits/halves


@dataclass
class Halves:
    """Each client's summary of two disjoint random halves of its data, in the same form
    (and space) as its whole-data summary: `a[i]`, `b[i]` belong to client `members[i]`
    (an index into the clients related; a client with fewer than two samples sends none)."""

    members: np.ndarray
    a: list[np.ndarray]
    b: list[np.ndarray]
    a_weights: list[np.ndarray]
    b_weights: list[np.ndarray]
    a_classes: list[np.ndarray] | None = None
    b_classes: list[np.ndarray] | None = None


def umap_project(
    centroids: list[np.ndarray],
    n_components: int = 2,
    n_neighbors: int = 15,
    min_dist: float = 0.1,
    metric: str = "euclidean",
    seed: int = 0,
) -> list[np.ndarray]:
    """Seeded UMAP over all clients' centroids together; returns each client's points.

    Initialised from PCA, not UMAP's default spectral layout: when the kNN graph falls
    apart into more than 2 x n_components pieces (planted clusters do that), the spectral
    layout places the pieces with scikit-learn's SpectralEmbedding of a disconnected
    affinity, whose eigenvectors differ from call to call whatever the seed, so the same
    centroids and seed gave another projection each time. PCA initialisation is also
    what Kobak and Linderman (Nature Biotechnology, 2021) recommend for keeping UMAP's
    global structure."""
    import umap  # imported here: numba compilation is paid only by pipelines that use it

    points = np.concatenate(centroids).astype(np.float32)
    n_neighbors = max(2, min(n_neighbors, len(points) - 1))
    n_components = min(n_components, *points.shape)  # the PCA initialisation's bound: the points span no more
    if len(points) < 3:  # UMAP's kNN graph needs three points; PCA keeps two points' distance exactly
        centred = points - points.mean(0)
        u, s, _ = np.linalg.svd(centred, full_matrices=False)  # scikit-learn's PCA warns on one point
        proj = (u * s)[:, :n_components]
    else:
        reducer = umap.UMAP(
            n_components=n_components,
            n_neighbors=n_neighbors,
            min_dist=min_dist,
            metric=metric,
            random_state=seed,
            n_jobs=1,
            init="pca",
        )
        proj = reducer.fit_transform(points)
    return np.split(proj, np.cumsum([len(c) for c in centroids])[:-1])


def pad(points: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, kmax, u] points and a [M, kmax] validity mask."""
    kmax, dim = max(len(p) for p in points), points[0].shape[1]
    out = torch.zeros(len(points), kmax, dim, dtype=torch.float64)
    mask = torch.zeros(len(points), kmax, dtype=torch.bool)
    for i, p in enumerate(points):  # one copy per client
        out[i, : len(p)] = torch.as_tensor(p, dtype=torch.float64)
        mask[i, : len(p)] = True
    return out, mask


def set_distance(
    points: list[np.ndarray],
    kind: str = "chamfer",
    chunk: int = 256,
    device: torch.device | None = None,
    classes: list[np.ndarray] | None = None,
    weights: list[np.ndarray] | None = None,
) -> np.ndarray:
    """A_ij between client i's and client j's point sets:
    min: min_{r,s} d_rs (the paper); chamfer: (mean_r min_s d_rs + mean_s min_r d_rs) / 2;
    hausdorff: max(max_r min_s d_rs, max_s min_r d_rs);
    matched: sqrt(min_pi mean_r d_{r pi(r)}^2) over the one-to-one matchings pi of the
    smaller set into the larger (the FLT authors' code, `min_matching_distance`, which
    thresholds its square; every matching is tried, so k is at most MAX_MATCHED);
    energy: 2 mean_{r,s} d_rs - mean_{r,r'} d_rr' - mean_{s,s'} d_ss' (Szekely's energy
    distance between the two sets as samples: 0 only for equal sets, and every point
    counts, so it compares whole distributions rather than nearest matches).

    With `classes` (one class per point), d_rs between points of different classes gains
    the sets' diameter bound (twice the largest norm), so a point's nearest point in the
    other set is of its own class whenever that set holds it, and a class the other
    client lacks costs more than any match.

    `weights` (each point's share of its client's samples) make chamfer's and energy's
    means weighted ones: the sets are then the clients' distributions, summarised."""
    if kind not in DISTANCES:
        raise ValueError(f"distance: {kind!r} is not one of {', '.join(DISTANCES)}")
    u, mask = pad(points)
    u, mask = u.to(device or "cpu"), mask.to(device or "cpu")
    m, k, dim = u.shape
    cls = None
    if classes is not None:
        cls = torch.full((m, k), -1, dtype=torch.int64, device=u.device)
        for i, c in enumerate(classes):  # M small rows, once: not a per-pair loop
            cls[i, : len(c)] = torch.as_tensor(c, dtype=torch.int64)
        penalty = 2 * float(u.norm(dim=2).max())
    flat, valid = u.reshape(m * k, dim), mask.reshape(m * k)
    w = _point_weights(weights, mask, u.dtype).to(u.device)  # [M, k], each row sums to 1
    matchings = one_to_one(k, u.device) if kind == "matched" else None
    out = torch.empty(m, m, dtype=torch.float64, device=u.device)
    for lo in range(0, m, chunk):
        rows_valid = mask[lo : lo + chunk]  # [c, k]
        d = torch.cdist(u[lo : lo + chunk].reshape(-1, dim), flat)
        d = d.view(len(rows_valid), k, m, k)
        if cls is not None:
            other = cls[lo : lo + chunk].view(-1, k, 1, 1) != cls.view(1, 1, m, k)
            d = d + other * penalty
        if matchings is not None:
            out[lo : lo + chunk] = matched_distance(d, rows_valid, mask, matchings)
            continue
        d = d.masked_fill(~valid.view(1, 1, m, k), torch.inf).masked_fill(~rows_valid.view(-1, k, 1, 1), torch.inf)
        if kind == "min":
            out[lo : lo + chunk] = d.amin(dim=(1, 3))
            continue
        wi = w[lo : lo + chunk]  # [c, k]
        if kind == "energy":  # the weighted mean over all (r, s) pairs; energy follows below
            d = d.masked_fill(~(rows_valid[:, :, None, None] & valid.view(1, 1, m, k)), 0)
            out[lo : lo + chunk] = torch.einsum("arbs,ar,bs->ab", d, wi, w)
            continue
        near_ij = d.amin(dim=3)  # [c, k, M]: each r to j's set
        near_ji = d.amin(dim=1)  # [c, M, k]: each s to i's set
        if kind == "chamfer":
            a = (near_ij.masked_fill(~rows_valid[:, :, None], 0) * wi[:, :, None]).sum(1)
            b = (near_ji.masked_fill(~valid.view(1, m, k), 0) * w[None]).sum(2)
            out[lo : lo + chunk] = (a + b) / 2
        else:
            a = near_ij.masked_fill(~rows_valid[:, :, None], -torch.inf).amax(1)
            b = near_ji.masked_fill(~valid.view(1, m, k), -torch.inf).amax(2)
            out[lo : lo + chunk] = torch.maximum(a, b)
    dist = out.cpu().numpy()
    if kind == "energy":  # 2 E|X - Y| - E|X - X'| - E|Y - Y'|, >= 0 (the V-statistic)
        own = np.diag(dist).copy()
        dist = np.maximum(2 * dist - own[:, None] - own[None, :], 0.0)
    dist = (dist + dist.T) / 2  # exact symmetry (float rounding of the two halves)
    np.fill_diagonal(dist, 0.0)
    return dist


def one_to_one(k: int, device: torch.device) -> torch.Tensor:
    """[k!, k]: every permutation of k centroids, for `matched_distance`."""
    if k > MAX_MATCHED:
        raise ValueError(
            f"distance 'matched' tries every one-to-one matching of two clients' centroids: "
            f"at most {MAX_MATCHED} centroids a client, got {k} (lower k)"
        )
    return torch.as_tensor(list(itertools.permutations(range(k))), dtype=torch.int64, device=device)


def matched_distance(
    d: torch.Tensor, rows_valid: torch.Tensor, mask: torch.Tensor, matchings: torch.Tensor, budget: int = 1 << 24
) -> torch.Tensor:
    """[c, M] root mean squared distance of the best one-to-one matching between each of c
    clients' centroids (d: [c, k, M, k] distances) and every client's. The smaller set's
    points are all matched, each to a different point of the larger; the larger set's
    unmatched points cost nothing (padding included), so a pair's cost is the mean over
    the smaller set's points. Matchings are scanned in blocks to bound memory."""
    c, k, m, _ = d.shape
    sq = d.permute(0, 2, 1, 3) ** 2  # [c, M, r, s]
    r_valid, s_valid = rows_valid[:, None, :, None], mask[None, :, None, :]
    n_i, n_j = rows_valid.sum(1), mask.sum(1)
    i_smaller = (n_i[:, None] <= n_j[None, :])[:, :, None, None]
    # a point of the smaller set may not be left unmatched (matched to padding)
    forbidden = (r_valid & ~s_valid & i_smaller) | (~r_valid & s_valid & ~i_smaller)
    cost = torch.where(r_valid & s_valid, sq, torch.zeros((), dtype=sq.dtype, device=sq.device))
    cost = cost.masked_fill(forbidden, torch.inf)
    rows = torch.arange(k, device=d.device)
    best = torch.full((c, m), torch.inf, dtype=sq.dtype, device=sq.device)
    step = max(1, budget // max(1, c * m * k))
    for lo in range(0, len(matchings), step):  # blocks of matchings, not pairs of clients
        block = matchings[lo : lo + step]  # [b, k]
        total = cost[:, :, rows[None, :], block].sum(-1)  # [c, M, b]
        best = torch.minimum(best, total.amin(-1))
    pairs = torch.minimum(n_i[:, None], n_j[None, :]).clamp_min(1).to(sq.dtype)
    return (best / pairs).sqrt()


def _point_weights(weights: list[np.ndarray] | None, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[M, kmax] weights, each client's summing to 1 (equal when not given; 0 on padding)."""
    if weights is None:
        w = mask.to(dtype)
    else:
        w = torch.zeros(mask.shape, dtype=dtype)
        for i, wi in enumerate(weights):  # M short rows, once
            w[i, : len(wi)] = torch.as_tensor(wi, dtype=dtype)
    return w / w.sum(1, keepdim=True).clamp_min(1e-12)


def whiten(points: list[np.ndarray], weights: list[np.ndarray] | None = None, shrink: float = 0.1) -> list[np.ndarray]:
    """The clients' points in whitened coordinates: centred on the pooled mean and scaled
    by the inverse square root of the pooled covariance (each client weighing the same;
    within a client, by `weights`), shrunk towards its mean eigenvalue by `shrink` so
    that directions where the points hardly vary are not blown up into noise. An
    encoder's latent units are not in comparable scales (a few carry most of the
    variance: brightness and colour, for natural images); after whitening, every
    direction along which clients differ counts. Server side: it uses only the points.

    With one point per client (k = 1) the pooled covariance is the spread between the
    clients itself, and whitening by it makes every client about equally far from every
    other (the quickstart with k = 1: one cluster for five, ARI 0 against 1.0 unwhitened),
    so such points are only centred."""
    pooled = np.concatenate(points).astype(np.float64)
    if len(pooled) <= len(points):
        return [(np.asarray(p, np.float64) - pooled.mean(0)).astype(np.float32) for p in points]
    if weights is None:
        w = np.concatenate([np.full(len(p), 1.0 / len(p)) for p in points])
    else:
        w = np.concatenate([np.asarray(x, np.float64) / max(float(np.sum(x)), 1e-12) for x in weights])
    w = w / w.sum()
    mean = w @ pooled
    centred = pooled - mean
    cov = (centred * w[:, None]).T @ centred
    eig, vec = np.linalg.eigh(cov)
    eig = np.maximum(eig, 0.0) + shrink * max(float(eig.mean()), 1e-12)
    transform = vec / np.sqrt(eig)
    return [((p - mean) @ transform).astype(np.float32) for p in points]


def min_distance_adjacency(
    points: list[np.ndarray], chunk: int = 256, device: torch.device | None = None
) -> np.ndarray:
    """The paper's A_ij = min over (r, s) of ||u_ir - u_js||."""
    return set_distance(points, "min", chunk, device)


def hard_threshold(adj: np.ndarray, gamma: float) -> np.ndarray:
    """A~_ij = 1 if A_ij <= gamma (a client is always its own neighbour)."""
    out = (adj <= gamma).astype(np.float32)
    np.fill_diagonal(out, 1.0)
    return out


def soft_weights(adj: np.ndarray, gamma: float) -> np.ndarray:
    """Neighbour weights that decay with distance, exp(-(A_ij / gamma)^2): the paper's
    suggested soft alternative to the hard threshold."""
    return np.exp(-((adj / gamma) ** 2)).astype(np.float32)


def cluster_graph(labels: np.ndarray) -> np.ndarray:
    """A~_ij = 1 when i and j are in the same cluster (the graph when there is no gamma)."""
    return (labels[:, None] == labels[None, :]).astype(np.float32)


def relate(
    points: list[np.ndarray],
    how: Relatedness,
    n_clusters: int | Literal["auto"] = "auto",
    max_clusters: int = 20,
    device: torch.device | None = None,
    classes: list[np.ndarray] | None = None,
    weights: list[np.ndarray] | None = None,
    halves: Halves | None = None,
) -> Clustering:
    """Steps 3-4 of FCR on already projected points (UMAP is the caller's: it is seeded
    and slow, and the embedding-space pipeline skips it); `classes` (label-conditioned
    centroids) makes the set distance match points of the same class; `halves` (the
    clients' summaries of two halves of their data) is what choose 'halves' tests on,
    which is 'splits' without them.

    Outlying clients: a client farther from every other than the groups are from each
    other is split off alone at the top of the dendrogram, so every cut holds it as a
    cluster of one, which the split rule never keeps: one odd client (corrupted data, a
    device that lies) made C = 1 for everyone. Where that gives one cluster, the outlying
    clients (`outlying`) are set aside, the rest related again, and each set-aside client
    joins the cluster whose mean is nearest."""
    got = _relate(points, how, n_clusters, max_clusters, device, classes, weights, halves)
    automatic = n_clusters == "auto" and how.choose in ("splits", "halves")
    lone = outlying(got, len(points)) if automatic and got.n_clusters == 1 else np.zeros(0, np.int64)
    core = np.setdiff1d(np.arange(len(points)), lone)
    if not len(lone) or len(core) < 4:
        return got
    inner = relate(  # the rest, which may set aside clients of its own in turn
        [points[i] for i in core],
        how,
        n_clusters,
        max_clusters,
        device,
        classes=None if classes is None else [classes[i] for i in core],
        weights=None if weights is None else [weights[i] for i in core],
        halves=None if halves is None else subset_halves(halves, core),
    )
    if inner.n_clusters == 1:
        return got
    labels = np.zeros(len(points), np.int64)
    labels[core] = inner.labels
    labels[lone] = nearest_means(got.distance.astype(np.float64) ** 2, core, inner.labels, lone)  # A: a distance
    labels = _canonical(labels)
    log.info("FCR: %d outlying client(s) %s joined their nearest cluster", len(lone), lone.tolist()[:10])
    graph = got.graph if how.gamma is not None else cluster_graph(labels)  # A~ = [A <= gamma] stands
    return Clustering(
        labels, got.distance, graph, got.linkage, int(labels.max() + 1),
        _silhouette(got.distance, labels), inner.separation, inner.chosen_by, inner.next_cut,
    )  # fmt: skip


def outlying(got: Clustering, m: int) -> np.ndarray:
    """Clients set aside when one cluster came out: those the dendrogram splits off alone
    at its top (`peeled`), and those whose nearest other client is farther than Tukey's
    outer fence (Q3 + 3 IQR) of every client's nearest-neighbour distance (an odd client
    that splits off alone lower down, inside the cut that would hold the groups)."""
    if m < 4:
        return np.zeros(0, np.int64)
    gap = got.distance.astype(np.float64) + np.diag(np.full(m, np.inf))
    nearest = gap.min(1)
    q1, q3 = np.percentile(nearest, [25, 75])
    far = np.flatnonzero(nearest > q3 + 3 * (q3 - q1))
    return np.union1d(peeled(got.linkage, m), far).astype(np.int64)


def peeled(z: np.ndarray, m: int) -> np.ndarray:
    """The clients the dendrogram splits off one at a time from its root down (each top
    merge joining a single client to all the rest)."""
    lone, node = [], 2 * m - 2
    while node >= m:
        left, right = (int(x) for x in z[node - m, :2])
        if left >= m and right >= m:
            break
        if left < m and right < m:  # the last two clients: neither is an outlier of the other
            break
        leaf, node = (left, right) if left < m else (right, left)
        lone.append(leaf)
    return np.array(sorted(lone), np.int64)


def subset_halves(halves: Halves, core: np.ndarray) -> Halves:
    """The halves of the clients in `core`, indexed by their position in it."""
    position = np.full(int(max(core.max(), halves.members.max(initial=0))) + 1, -1, np.int64)
    position[core] = np.arange(len(core))
    keep = [i for i, c in enumerate(halves.members.tolist()) if c < len(position) and position[c] >= 0]

    def take(xs: list[np.ndarray] | None) -> list[np.ndarray] | None:
        return None if xs is None else [xs[i] for i in keep]

    return Halves(
        position[halves.members[keep]], [halves.a[i] for i in keep], [halves.b[i] for i in keep],
        [halves.a_weights[i] for i in keep], [halves.b_weights[i] for i in keep],
        take(halves.a_classes), take(halves.b_classes),
    )  # fmt: skip


def nearest_means(squared: np.ndarray, core: np.ndarray, labels: np.ndarray, lone: np.ndarray) -> np.ndarray:
    """For each client in `lone`, the cluster (of `core`'s `labels`) whose mean is nearest:
    ||x - mean_c||^2 = mean_{j in c} A_xj - sum_{c x c} A / (2 |c|^2), from squared
    distances alone (refine_ward's objective)."""
    member = (labels[:, None] == np.arange(labels.max() + 1)[None, :]).astype(np.float64)  # [core, C]
    size = member.sum(0)
    inner = squared[np.ix_(core, core)]
    spread = (member * (inner @ member)).sum(0) / (2 * size**2)
    to = squared[np.ix_(lone, core)] @ member / size - spread
    return to.argmin(1)


def _relate(
    points: list[np.ndarray],
    how: Relatedness,
    n_clusters: int | Literal["auto"],
    max_clusters: int,
    device: torch.device | None,
    classes: list[np.ndarray] | None,
    weights: list[np.ndarray] | None,
    halves: Halves | None,
) -> Clustering:
    m = len(points)
    # class-by-class matching (k: labels) needs a distance that matches points: the energy
    # distance compares the sets as wholes, and a label swap leaves the pooled points as
    # they were, so label-conditioned centroids are compared by Chamfer
    kind = "chamfer" if classes is not None and how.distance == "energy" else how.distance
    adj = set_distance(points, kind, device=device, classes=classes, weights=weights)
    squared = _squared(adj, kind)
    if kind == "energy":  # a squared distance: linkage, silhouette and A~ use its root
        adj = np.sqrt(adj)
    graph = hard_threshold(adj, how.gamma) if how.gamma is not None else None
    if m < 2:
        return Clustering(np.zeros(m, np.int64), adj, np.ones((m, m), np.float32), np.zeros((0, 4)), 1, None)
    if how.linkage == "ward_graph":
        if graph is None:
            raise ValueError("linkage 'ward_graph' clusters the thresholded graph A~: it needs gamma")
        z = linkage(graph.astype(np.float64), method="ward")
    else:
        z = linkage(squareform(adj, checks=False), method=how.linkage)
    cap = max(1, min(max_clusters, m - 1))
    gap, chosen_by, held, after = None, None, None, None
    if n_clusters != "auto":
        if int(n_clusters) > m:  # a scenario's C written for more clients than came
            log.warning("%d clusters asked for %d clients: every client is a cluster of its own", n_clusters, m)
        c = max(1, min(int(n_clusters), m))
    elif how.choose == "gap":
        c = gap_clusters(z, cap)
    elif how.choose in ("splits", "halves"):
        c = split_clusters(z, squared, cap, how.min_split)
        if how.choose == "halves" and halves is not None and len(halves.members) >= 4:
            held = HeldOut(halves, kind, m, device)
            c, chosen_by = choose_with_halves(c, held, z, squared, how, cap)
        after = next_cut(z, squared, c, held) if c < cap else None
    else:
        c = silhouette_clusters(z, adj, cap, how.min_silhouette, how.silhouette_slack)
    cut = fcluster(z, c, criterion="maxclust") - 1
    if how.refine and how.linkage == "ward" and c > 1:
        cut = refine_ward(cut, squared)
    if n_clusters == "auto" and how.choose in ("splits", "halves") and c > 1:
        # reported: how far apart the chosen clusters are (module docstring)
        gap = separation(squared if kind == "energy" else adj, cut, points)
    if n_clusters == "auto" and how.choose == "silhouette" and c > 1:
        cut = fold_singletons(cut, adj)
        gap = separation(adj, cut, points) if cut.max() > 0 else 0.0
        cut = cut if gap >= how.min_separation else np.zeros(m, np.int64)
    labels = _canonical(cut)
    c = int(labels.max() + 1)
    if graph is None:
        graph = cluster_graph(labels)
    return Clustering(labels, adj, graph, z, c, _silhouette(adj, labels), gap, chosen_by, after)


def next_cut(z: np.ndarray, squared: np.ndarray, c: int, held: HeldOut | None) -> dict:
    """Why the chosen cut has C clusters and not C + 1, for the report: the cut C + 1's
    smallest cluster, its weakest merge by `split_score` (every one must reach min_split),
    and how far the clients' held-out halves separate the merge that cut adds (`heldout_z`
    on each half, for the nearest pair of clusters; None without halves). A weakest score
    just under the bar with a large z is a split the data may hold but the rule could not
    tell from pieces of one group."""
    m = len(squared)
    members = _members(z, m, c)
    nodes = range(2 * m - c - 1, 2 * m - 1)
    # the C + 1 subtrees under the top C merges (fcluster would give fewer on tied heights)
    final = np.empty(m, np.int64)
    below = [
        side for n in nodes for side, child in zip(members[n], z[n - m, :2], strict=True) if int(child) not in nodes
    ]
    for i, side in enumerate(below):
        final[side] = i
    scores = [split_score(squared, *members[node], final) for node in nodes]
    added = members[2 * m - c - 1]
    return {
        "clusters": c + 1,
        "smallest_cluster": int(np.bincount(final).min()),
        "weakest_split_score": float(min(scores)),
        "added_split_score": float(scores[0]),
        "added_sizes": [len(added[0]), len(added[1])],
        "heldout_z": None if held is None else held.z_scores(*nearest_clusters(squared, *added, final)),
    }


def separation(adj: np.ndarray, labels: np.ndarray, points: list[np.ndarray], sample: int = 2000) -> float:
    """(mean A between clusters - mean A within) / the median distance between two of all
    clients' points (every n-th point when there are more than `sample`: deterministic)."""
    same = labels[:, None] == labels[None, :]
    np.fill_diagonal(same, False)
    differ = labels[:, None] != labels[None, :]
    within = adj[same].mean() if same.any() else 0.0
    pooled = np.concatenate(points)
    pooled = pooled[:: max(1, len(pooled) // sample)]
    scale = float(np.median(pdist(pooled.astype(np.float64)))) if len(pooled) > 1 else 0.0
    return float((adj[differ].mean() - within) / scale) if scale > 0 else 0.0


def _silhouette(adj: np.ndarray, labels: np.ndarray) -> float | None:
    c = len(np.unique(labels))
    if c < 2 or c >= len(labels):
        return None
    return float(silhouette_score(adj, labels, metric="precomputed"))


def silhouette_or_zero(adj: np.ndarray, labels: np.ndarray) -> float:
    """The silhouette of a labelling on A; 0 (no structure) where it is undefined (one
    cluster, or one client per cluster)."""
    score = _silhouette(adj, labels)
    return 0.0 if score is None else score


def refine_ward(labels: np.ndarray, squared: np.ndarray, max_steps: int = 100) -> np.ndarray:
    """Lloyd's iterations on the objective Ward's linkage approximates: the sum of the
    clients' squared distances to their cluster's mean. Ward's merges are greedy, and a
    client merged early keeps its first partners even when, once the clusters have
    formed, another cluster's mean is nearer; with few samples a client, noise decides
    many early merges (CIFAR-10 at M = 500: ARI 0.67 as cut, 0.94 refined). Each step
    moves every client to the nearest mean, computed from the squared distances alone
    (kernel k-means): ||x_i - mean_c||^2 = mean_{j in c} A_ij - s_c, with
    s_c = sum_{c x c} A / (2 |c|^2). A step is kept only if it lowers the objective and
    empties no cluster, so the C the cut chose stays, and it stops when nothing moves."""

    def cost(lab: np.ndarray) -> tuple[np.ndarray, float]:
        member = np.eye(c)[lab]  # [M, C]
        sizes = member.sum(0)
        to = squared @ member / sizes  # mean A from each client to each cluster
        spread = (member * to).sum(0) / (2 * sizes)  # s_c
        return to - spread, float((sizes * spread).sum())

    c = int(labels.max()) + 1
    distances, total = cost(labels)
    for _ in range(max_steps):
        moved = distances.argmin(1)
        if (moved == labels).all() or len(np.unique(moved)) < c:
            break
        distances, new_total = cost(moved)
        if new_total >= total:
            break
        labels, total = moved, new_total
    return labels


def silhouette_clusters(z: np.ndarray, adj: np.ndarray, max_clusters: int, floor: float, slack: float = 0.0) -> int:
    """The largest C in 2..max_clusters whose silhouette of A is within `slack` of the
    best; 1 when no cut reaches `floor`. Near-ties go to the finer cut because merging two
    different clusters costs both their accuracy, while splitting one only costs it some data."""
    scores = {}
    for c in range(2, max_clusters + 1):
        score = _silhouette(adj, fcluster(z, c, criterion="maxclust") - 1)
        if score is not None:
            scores[c] = score
    if not scores or max(scores.values()) < floor:
        return 1
    best = max(scores.values())
    return max(c for c, score in scores.items() if score >= best - slack)


def fold_singletons(labels: np.ndarray, adj: np.ndarray) -> np.ndarray:
    """A cluster of one client is an outlier, not a group: alone it would train on its own
    data only (Local), which is what federating is for avoiding. Each lone client joins the
    cluster whose members are nearest on average, as a newcomer does."""
    sizes = np.bincount(labels)
    groups = np.flatnonzero(sizes > 1)
    lone = sizes[labels] == 1
    if not lone.any() or len(groups) == 0:
        return labels
    member = (labels[:, None] == groups[None, :]).astype(adj.dtype)  # [M, groups]
    mean_to = (adj @ member) / sizes[groups]
    out = labels.copy()
    out[lone] = groups[mean_to[lone].argmin(1)]
    return np.unique(out, return_inverse=True)[1]


def split_clusters(
    z: np.ndarray,
    adj: np.ndarray,
    max_clusters: int,
    min_split: float,
    min_size: int = 2,
    held: Callable[[np.ndarray, np.ndarray, np.ndarray], bool] | None = None,
) -> int:
    """The finest cut of the dendrogram whose every split is real: the largest C in
    2..max_clusters (1 when there is none) whose clusters all have `min_size` clients and
    whose C - 1 merges above them each score `split_score` >= `min_split`. A cut finer
    than the truth holds a merge of two pieces of one group, which scores like noise;
    nested groups (two vehicle classes apart from three animal ones) do not hide a finer
    cut, because each merge is judged against the spread inside the final clusters, not
    inside the merged halves. `held(left, right, final)`: a further test every split must
    pass (choose_with_halves)."""

    def real(node: int, left: np.ndarray, right: np.ndarray, final: np.ndarray) -> bool:
        if split_score(adj, left, right, final) < min_split:
            return False
        return held is None or held(left, right, final)

    return finest_cut(z, len(adj), max_clusters, real, min_size)


def finest_cut(
    z: np.ndarray,
    m: int,
    max_clusters: int,
    passes: Callable[[int, np.ndarray, np.ndarray, np.ndarray], bool],
    min_size: int = 2,
) -> int:
    """The largest C in 2..max_clusters (1 when there is none) whose clusters all have
    `min_size` clients and whose C - 1 merges above them all `passes(node, left, right,
    final)` (node: the merge's id in the linkage, m + its row)."""
    members = _members(z, m, max_clusters)
    for c in range(min(max_clusters, m - 1), 1, -1):
        final = fcluster(z, c, criterion="maxclust") - 1
        if np.bincount(final).min() < min_size:
            continue
        nodes = range(2 * m - c, 2 * m - 1)  # the C - 1 highest merges, smallest first: fail fast
        if all(passes(node, *members[node], final) for node in nodes):
            return c
    return 1


class HeldOut:
    """Tests of splits on the clients' held-out halves (`heldout_z`: how far apart two groups
    of clients are on halves of their data, against random relabellings of them).

    `noise_dominates`: whether sampling noise hides the clients' differences. There the
    whole-data split score cannot see groups, and `clusters` may confirm a finer cut: the
    dendrogram of one half of every client's data, cut where every merge above the cut
    separates the same clients' other halves. The other halves played no part in drawing
    the split, so a split of one homogeneous group scores like noise (about 0) however the
    dendrogram chose it, while a real one grows with the number of clients on each side.
    Both ways round (drawn on the first halves and tested on the second, and the reverse):
    a half is noisier than the whole, and one draw of its dendrogram can put a group's
    clients on the wrong side.

    Where clients differ by more than noise, a held-out test confirms any split of a
    continuum of clients too (FEMNIST's writers), so it can only veto: `separates` tests a
    split of the whole-data dendrogram on each half. That split was drawn on data that
    includes the half, so a noise split scores somewhat above 0 (at most 2.5 on the
    quality suite; real splits 5.5 and more): the veto errs towards keeping a split."""

    def __init__(self, halves: Halves, kind: str, n_clients: int, device: torch.device | None = None):
        n = len(halves.a)
        classes = None if halves.a_classes is None else halves.a_classes + (halves.b_classes or [])
        both = set_distance(
            halves.a + halves.b, kind, device=device, classes=classes, weights=halves.a_weights + halves.b_weights
        )
        both = _squared(both, kind)
        self._halves = (both[:n, :n], both[n:, n:])
        self.noise_dominates = noise_dominates(both[:n, n:])
        self._row = np.full(n_clients, -1, np.int64)  # client -> its row in the halves (-1: sent none)
        self._row[halves.members] = np.arange(n)
        self._verdicts: dict[tuple[bytes, bytes, float], bool] = {}

    def clusters(self, min_z: float, how: Relatedness, max_clusters: int) -> int:
        """The finer of the two halves' dendrograms' finest cuts whose every merge separates
        the other halves by z >= min_z (1: none)."""
        method = "ward" if how.linkage == "ward_graph" else how.linkage
        drawn_on_a = self._confirmed_cut(*self._halves, min_z, method, max_clusters)
        return max(drawn_on_a, self._confirmed_cut(*self._halves[::-1], min_z, method, max_clusters))

    @staticmethod
    def _confirmed_cut(drawn: np.ndarray, tested: np.ndarray, min_z: float, method: str, max_clusters: int) -> int:
        z = linkage(squareform(np.sqrt(drawn), checks=False), method=method)
        scores: dict[int, float] = {}  # merge node -> z: a merge recurs in every coarser cut

        def confirmed(node: int, left: np.ndarray, right: np.ndarray, _final: np.ndarray) -> bool:
            if node not in scores:
                scores[node] = heldout_z(tested, left, right)
            return scores[node] >= min_z

        return finest_cut(z, len(drawn), max_clusters, confirmed)

    def separates(self, left: np.ndarray, right: np.ndarray, min_z: float) -> bool:
        """Whether two groups of clients (whole-data indices) are min_z apart on each half;
        a side none of whose clients sent halves cannot be tested, and passes. Verdicts
        are kept: a pair of clusters recurs in every coarser cut."""
        left, right = self._rows(left, right)
        if not len(left) or not len(right) or not can_reach(len(left), len(right), min_z):
            return True
        key = (left.tobytes(), right.tobytes(), min_z)
        if key not in self._verdicts:
            self._verdicts[key] = all(heldout_z(half, left, right) >= min_z for half in self._halves)
        return self._verdicts[key]

    def z_scores(self, left: np.ndarray, right: np.ndarray) -> list[float] | None:
        """`heldout_z` of two groups of clients (whole-data indices) on each half; None when a
        side has no client that sent halves."""
        left, right = self._rows(left, right)
        if not len(left) or not len(right):
            return None
        return [heldout_z(half, left, right) for half in self._halves]

    def _rows(self, left: np.ndarray, right: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        left, right = self._row[left], self._row[right]
        return left[left >= 0], right[right >= 0]


def can_reach(n_left: int, n_right: int, min_z: float) -> bool:
    """Whether a permutation test of a split of n_left against n_right clients has the room
    to put a real split min_z standard deviations out. Over N distinct relabellings the
    observed one is at most about sqrt(N - 1) out (it alone extreme, the rest equal), and
    real nulls spread, so the test needs sqrt(N - 1) >= 1.5 min_z. Two against three
    clients have N = 10 (z at most 3): there a veto would merge real groups of two or three
    clients (10 clients in 5 groups gave one cluster), so the split rule's verdict stands."""
    n = math.comb(n_left + n_right, n_left) // (2 if n_left == n_right else 1)  # L, R swapped: the same split
    return n - 1 >= (1.5 * min_z) ** 2


def choose_with_halves(
    c_splits: int, held: HeldOut, z: np.ndarray, squared: np.ndarray, how: Relatedness, cap: int
) -> tuple[int, str]:
    """C under choose 'halves', from the split rule's C and the held-out halves (HeldOut):
    the finest cut whose every split both passes the split rule and separates the held-out
    halves (`min_heldout_keep`): the split score judges a split against the spread inside
    the final clusters, so pieces of one group that vary along one direction can pass it on
    their own thinness, and where noise dominates a few clients of one population can
    pass it by chance (20 IID clients: 3 of 20 draws split). Where noise dominates, a
    finer cut that the halves confirm (`min_heldout`) wins."""

    def separates(left: np.ndarray, right: np.ndarray, final: np.ndarray) -> bool:
        return held.separates(*nearest_clusters(squared, left, right, final), how.min_heldout_keep)

    kept = 1 if c_splits == 1 else split_clusters(z, squared, cap, how.min_split, held=separates)
    chosen = (kept, "halves") if kept < c_splits else (c_splits, "splits")
    if held.noise_dominates:
        finer = held.clusters(how.min_heldout, how, cap)
        if finer > kept:
            return finer, "halves"
    return chosen


def nearest_clusters(
    squared: np.ndarray, left: np.ndarray, right: np.ndarray, final: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The members of the final cluster in `left` and the one in `right` whose means are
    nearest (split_score's d2 between them): the pair the held-out veto tests for a merge.
    Testing the merge's two sides as wholes put a side's own groups into the permutation
    null (relabellings that pick another real group score as high as the split), so a
    pair of clients against three other pairs scored 2.4 and real groups were merged; if
    the two sides differ at all, their nearest clusters must, and pieces of one group
    are each other's nearest."""
    idx = np.concatenate([left, right])
    sub, labels = squared[np.ix_(idx, idx)], final[idx]
    a_ids, b_ids = np.unique(final[left]), np.unique(final[right])
    a = (labels[:, None] == a_ids[None, :]).astype(sub.dtype)  # [both sides' clients, clusters in left]
    b = (labels[:, None] == b_ids[None, :]).astype(sub.dtype)
    na, nb = a.sum(0), b.sum(0)
    to_b = sub @ b
    s_a = (a * (sub @ a)).sum(0) / (2 * na**2)  # each cluster's own spread, s_S of split_score
    s_b = (b * to_b).sum(0) / (2 * nb**2)
    d2 = (a.T @ to_b) / np.outer(na, nb) - s_a[:, None] - s_b[None, :]
    i, j = np.unravel_index(np.argmin(d2), d2.shape)
    return np.flatnonzero(final == a_ids[i]), np.flatnonzero(final == b_ids[j])


def noise_dominates(cross: np.ndarray) -> bool:
    """Whether the sampling noise of the clients' whole-data summaries exceeds their
    genuine differences, from squared distances between first halves (rows) and second
    halves (columns). The two halves of one client differ by noise alone, so
    mean_i cross_ii / 2 is the noise variance of a half summary (half that of a whole
    one); noise is independent across halves, so the centred cross products
    <a_i - mean a, b_i - mean b> average to the genuine variance between clients."""
    n = len(cross)
    centred = cross - cross.mean(0, keepdims=True) - cross.mean(1, keepdims=True) + cross.mean()
    genuine = -0.5 * np.trace(centred) / n
    noise = np.trace(cross) / (2 * n)
    return genuine < noise / 2


def _squared(dist: np.ndarray, kind: str) -> np.ndarray:
    """energy already is a squared distance (in a Hilbert space, where the held-out
    statistics are exact); the others are squared here."""
    return dist if kind == "energy" else dist**2


def heldout_z(adj: np.ndarray, left: np.ndarray, right: np.ndarray, permutations: int = 200) -> float:
    """How far apart two groups of clients are on held-out data, in standard deviations of
    the same statistic over random relabellings of their clients (a permutation test):
    d2 = mean_{L x R} A - s_L - s_R, A squared distances (split_score's d2). Seeded, so
    the same clients give the same z."""
    idx = np.concatenate([left, right])
    n, nl = len(idx), len(left)
    rng = np.random.default_rng(0)
    sides = np.zeros((permutations + 1, n))
    sides[0, :nl] = 1
    sides[1:] = rng.random((permutations, n)).argsort(1) < nl  # each row: a random L of size nl
    d2 = relabelled_d2(adj[np.ix_(idx, idx)], sides)
    null = d2[1:]
    spread = float(null.std())
    return float((d2[0] - null.mean()) / spread) if spread > 0 else 0.0


def relabelled_d2(sub: np.ndarray, sides: np.ndarray) -> np.ndarray:
    """split_score's d2 = mean_{L x R} A - s_L - s_R for each row of `sides` (1 marks L;
    every row the same size of L), from the squared distances `sub` of those clients."""
    nl = sides[0].sum()
    nr = sides.shape[1] - nl
    to = sides @ sub
    ll = (to * sides).sum(1)
    lr = (to * (1 - sides)).sum(1)
    rr = sub.sum() - ll - 2 * lr
    return lr / (nl * nr) - ll / (2 * nl**2) - rr / (2 * nr**2)


def split_score(adj: np.ndarray, left: np.ndarray, right: np.ndarray, final: np.ndarray) -> float:
    """How far apart the mean points of two groups of clients are, against what splitting
    one homogeneous group of their size would give. `adj` holds squared distances between
    the clients' summaries (energy distance: a squared distance between their kernel mean
    embeddings), so means and spreads follow from it without coordinates:
        d2   = mean_{L x R} A - s_L - s_R,     s_S = sum_{S x S} A / (2 |S|^2)
        null = lambda_1 * (pdf(z_q) / (q (1 - q)))^2,   q = |L| / (|L| + |R|)
    where lambda_1 is the largest variance of the clients around their own final cluster's
    mean (kernel PCA of the doubly centred A), and the factor is the squared distance
    between the two parts' means when a Gaussian is cut at its q-quantile along that
    direction. Noise scores about 1 to 2 (the quality suite: at most 1.8 where nothing is
    planted); a real split scores higher. lambda_1 leaves out the far-out clients (a
    squared distance to their cluster's mean above Tukey's outer fence, Q3 + 3 IQR): a
    largest variance is the statistic one odd client moves most, and one client with its
    data 5 noise sd off lowered every score below the bar (C = 1 for five groups)."""
    both = np.concatenate([left, right])
    gram = _centred_gram(adj[np.ix_(both, both)], final[both])
    deviation = np.diag(gram)
    q1, q3 = np.percentile(deviation, [25, 75])
    usual = deviation <= q3 + 3 * (q3 - q1)
    gram = gram[np.ix_(usual, usual)]
    top = float(np.linalg.eigvalsh(gram)[-1]) if len(gram) <= 400 else _top_eigenvalue(gram)
    lam = max(top / len(gram), 1e-12)
    s_l = adj[np.ix_(left, left)].sum() / (2 * len(left) ** 2)
    s_r = adj[np.ix_(right, right)].sum() / (2 * len(right) ** 2)
    d2 = adj[np.ix_(left, right)].mean() - s_l - s_r
    q = len(left) / len(both)
    return float(d2 / (lam * (norm.pdf(norm.ppf(q)) / (q * (1 - q))) ** 2))


def _centred_gram(adj: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """<x_i - mean of i's group, x_j - mean of j's group> from squared distances."""
    _, inv = np.unique(groups, return_inverse=True)
    mean_of = np.eye(inv.max() + 1)[inv]
    mean_of /= mean_of.sum(0)  # [n, g]: column g averages group g
    to_group = adj @ mean_of  # [n, g]: mean A from i to group g
    between = mean_of.T @ to_group  # [g, g]
    own = to_group[:, inv]
    return -0.5 * (adj - own - own.T + between[np.ix_(inv, inv)])


def _top_eigenvalue(gram: np.ndarray) -> float:
    from scipy.sparse.linalg import eigsh

    return float(eigsh(gram, k=1, which="LA", return_eigenvectors=False, v0=np.ones(len(gram)))[0])


def _members(z: np.ndarray, m: int, top: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """The two sides of each of the `top` highest merges, as client index arrays."""

    def leaves(node: int) -> np.ndarray:
        out, stack = [], [node]
        while stack:  # a stack, not recursion: a chain of M merges is M deep
            n = stack.pop()
            if n < m:
                out.append(n)
            else:
                stack += [int(z[n - m, 0]), int(z[n - m, 1])]
        return np.sort(np.array(out, dtype=np.int64))

    return {m + i: (leaves(int(z[i, 0])), leaves(int(z[i, 1]))) for i in range(max(0, len(z) - top), len(z))}


def gap_clusters(z: np.ndarray, max_clusters: int) -> int:
    """C with the largest gap between the merge that would join C clusters into C-1 and
    the one before it (the classic 'longest vertical line' dendrogram cut)."""
    heights = z[:, 2]
    m = len(heights) + 1
    best, best_gap = 1, -1.0
    for c in range(2, min(max_clusters, m) + 1):
        gap = heights[m - c] - heights[m - c - 1] if m - c - 1 >= 0 else heights[m - c]
        if gap > best_gap:
            best, best_gap = c, gap
    return best


def _canonical(labels: np.ndarray) -> np.ndarray:
    """Relabel clusters in order of first appearance (stable across runs)."""
    _, first = np.unique(labels, return_index=True)
    order = np.argsort(first)
    remap = np.empty(order.size, dtype=np.int64)
    remap[order] = np.arange(order.size)
    return remap[np.searchsorted(np.unique(labels), labels)]


def leaf_order(z: np.ndarray, m: int) -> np.ndarray:
    return leaves_list(z) if len(z) else np.arange(m)
