"""Server side of FCR (form client relatedness): from every client's k centroids to a
client graph A~ and C disjoint clusters.

Two named pipelines, and every stage a validated choice (`Relatedness`):

paper   (the FLT paper's Algorithm 2, steps 3-4)
    centroids --UMAP--> u-dim points, A_ij = min_{r,s} ||u_ir - u_js|| (the single
    closest pair), A~ = [A <= gamma], Ward on the rows of A~, C at the largest gap
    between successive merge heights.
set     (the default: no threshold, no per-dataset knob)
    A_ij = symmetric Chamfer distance between the two clients' centroid *sets* in the
    encoder's own e-dim space:  (mean_r min_s d_rs + mean_s min_r d_rs) / 2;
    average linkage on A; C by the silhouette of A (near-ties, within
    `silhouette_slack`, go to the finer cut; a lone client joins its nearest cluster,
    since a cluster of one would train alone); C = 1 unless that cut's clusters are
    `min_separation` apart (below). Average linkage, the silhouette and the separation
    are invariant to scaling A, so nothing depends on the data's units; a whole-set
    distance is not fooled by one shared class the way the closest pair is.

Is there structure at all? The separation of a cut is
    (mean A between clusters - mean A within clusters) / median distance between two centroids,
how far apart the clusters' clients are, in units of the typical distance between two
of the encoder's modes (mostly different classes). Clients of different planted groups
differ by whole classes; clients drawn from one distribution differ only by k-means
artefacts (which classes one client's k centroids merge) and sampling noise. A
silhouette floor mixes up the two when clients hold few samples: noise lowers the
silhouette of real clusters (0.24 with 87 images per client) while artefacts give IID
clients 0.34 to 0.44. The separation does not: 0.07 to 0.13 for IID clients of four
datasets, 0.20 and more for every planted grouping the embedding separates
(benchmarks/bench_fcr_quality.py).

Clients may send different numbers of centroids (k: auto); padding is masked, never
counted. Everything is vectorized (torch.cdist in row chunks): 2,400 clients take seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from scipy.cluster.hierarchy import fcluster, leaves_list, linkage
from scipy.spatial.distance import pdist, squareform
from sklearn.metrics import silhouette_score

# the pipelines' knobs and presets are FLT's parameters: they live with them, torch-free (and
# stay importable from here: a checkpoint written before the move names flt.server.fcr:Relatedness)
from flt.server.strategies.params import CHOOSERS, DISTANCES, LINKAGES, PRESETS, SPACES, Relatedness  # noqa: F401


@dataclass
class Clustering:
    labels: np.ndarray  # [M] 0..C-1, in order of first appearance
    distance: np.ndarray  # [M, M] A
    graph: np.ndarray  # [M, M] A~ (0/1, self-loops)
    linkage: np.ndarray  # scipy linkage matrix
    n_clusters: int
    silhouette: float | None  # of the chosen cut on A (None for C = 1)
    separation: float | None = None  # of the best cut, whether it was kept or not (module docstring)


def umap_project(
    centroids: list[np.ndarray],
    n_components: int = 2,
    n_neighbors: int = 15,
    min_dist: float = 0.1,
    metric: str = "euclidean",
    seed: int = 0,
) -> list[np.ndarray]:
    """Seeded UMAP over all clients' centroids together; returns each client's points."""
    import umap  # imported here: numba compilation is paid only by pipelines that use it

    points = np.concatenate(centroids).astype(np.float32)
    n_neighbors = max(2, min(n_neighbors, len(points) - 1))
    reducer = umap.UMAP(
        n_components=n_components,
        n_neighbors=n_neighbors,
        min_dist=min_dist,
        metric=metric,
        random_state=seed,
        n_jobs=1,
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
) -> np.ndarray:
    """A_ij between client i's and client j's point sets:
    min: min_{r,s} d_rs (the paper); chamfer: (mean_r min_s d_rs + mean_s min_r d_rs) / 2;
    hausdorff: max(max_r min_s d_rs, max_s min_r d_rs).

    With `classes` (one class per point), d_rs between points of different classes gains
    the sets' diameter bound (twice the largest norm), so a point's nearest point in the
    other set is of its own class whenever that set holds it, and a class the other
    client lacks costs more than any match."""
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
    counts = mask.sum(1).to(u.dtype)  # [M]
    out = torch.empty(m, m, dtype=torch.float64, device=u.device)
    for lo in range(0, m, chunk):
        rows_valid = mask[lo : lo + chunk]  # [c, k]
        d = torch.cdist(u[lo : lo + chunk].reshape(-1, dim), flat)
        d = d.view(len(rows_valid), k, m, k)
        if cls is not None:
            other = cls[lo : lo + chunk].view(-1, k, 1, 1) != cls.view(1, 1, m, k)
            d = d + other * penalty
        d = d.masked_fill(~valid.view(1, 1, m, k), torch.inf).masked_fill(~rows_valid.view(-1, k, 1, 1), torch.inf)
        if kind == "min":
            out[lo : lo + chunk] = d.amin(dim=(1, 3))
            continue
        near_ij = d.amin(dim=3)  # [c, k, M]: each r to j's set
        near_ji = d.amin(dim=1)  # [c, M, k]: each s to i's set
        if kind == "chamfer":
            a = near_ij.masked_fill(~rows_valid[:, :, None], 0).sum(1) / counts[lo : lo + chunk, None]
            b = near_ji.masked_fill(~valid.view(1, m, k), 0).sum(2) / counts[None, :]
            out[lo : lo + chunk] = (a + b) / 2
        else:
            a = near_ij.masked_fill(~rows_valid[:, :, None], -torch.inf).amax(1)
            b = near_ji.masked_fill(~valid.view(1, m, k), -torch.inf).amax(2)
            out[lo : lo + chunk] = torch.maximum(a, b)
    dist = out.cpu().numpy()
    dist = (dist + dist.T) / 2  # exact symmetry (float rounding of the two halves)
    np.fill_diagonal(dist, 0.0)
    return dist


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
) -> Clustering:
    """Steps 3-4 of FCR on already projected points (UMAP is the caller's: it is seeded
    and slow, and the embedding-space pipeline skips it); `classes` (label-conditioned
    centroids) makes the set distance match points of the same class."""
    m = len(points)
    adj = set_distance(points, how.distance, device=device, classes=classes)
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
    gap = None
    if n_clusters != "auto":
        c = max(1, min(int(n_clusters), m))
    elif how.choose == "gap":
        c = gap_clusters(z, cap)
    else:
        c = silhouette_clusters(z, adj, cap, how.min_silhouette, how.silhouette_slack)
    cut = fcluster(z, c, criterion="maxclust") - 1
    if n_clusters == "auto" and how.choose == "silhouette" and c > 1:
        cut = fold_singletons(cut, adj)
        gap = separation(adj, cut, points) if cut.max() > 0 else 0.0
        cut = cut if gap >= how.min_separation else np.zeros(m, np.int64)
    labels = _canonical(cut)
    c = int(labels.max() + 1)
    if graph is None:
        graph = cluster_graph(labels)
    return Clustering(labels, adj, graph, z, c, _silhouette(adj, labels), gap)


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
