"""Server side of FCR (form client relatedness), the paper's Algorithm 2, steps 3-4.

centroids of every client  --UMAP-->  u-dim points  -->  A_ij = min_{r,s} ||u_ir - u_js||
-->  A~ = [A <= gamma]  -->  Ward hierarchical clustering of A~ into C clusters.

Clients may send different numbers of centroids (k: auto); they are padded with +inf
distances, so the min ignores padding. Everything is vectorized (torch.cdist in row
chunks), so 2,400 clients take seconds.
"""
from __future__ import annotations

import numpy as np
import torch
from scipy.cluster.hierarchy import fcluster, leaves_list, linkage


def umap_project(centroids: list[np.ndarray], n_components=2, n_neighbors=15, min_dist=0.1,
                 metric="euclidean", seed=0) -> list[np.ndarray]:
    """Seeded UMAP over all clients' centroids together; returns each client's points."""
    import umap  # imported here: numba compilation is paid only by methods that use it

    points = np.concatenate(centroids).astype(np.float32)
    n_neighbors = max(2, min(n_neighbors, len(points) - 1))
    reducer = umap.UMAP(n_components=n_components, n_neighbors=n_neighbors, min_dist=min_dist,
                        metric=metric, random_state=seed, n_jobs=1)
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


def min_distance_adjacency(points: list[np.ndarray], chunk: int = 256,
                           device: torch.device | None = None) -> np.ndarray:
    """A_ij = min over (r, s) of the distance between client i's point r and client j's point s."""
    u, mask = pad(points)
    u, mask = u.to(device or "cpu"), mask.to(device or "cpu")
    m, k, dim = u.shape
    flat, valid = u.reshape(m * k, dim), mask.reshape(m * k)
    out = torch.empty(m, m, dtype=torch.float64, device=u.device)
    for lo in range(0, m, chunk):
        rows = u[lo:lo + chunk].reshape(-1, dim)
        d = torch.cdist(rows, flat)
        d[~mask[lo:lo + chunk].reshape(-1)] = torch.inf
        d[:, ~valid] = torch.inf
        out[lo:lo + chunk] = d.view(-1, k, m, k).amin(dim=(1, 3))
    return out.cpu().numpy()


def hard_threshold(adj: np.ndarray, gamma: float) -> np.ndarray:
    """A~_ij = 1 if A_ij <= gamma (a client is always its own neighbour)."""
    out = (adj <= gamma).astype(np.float32)
    np.fill_diagonal(out, 1.0)
    return out


def soft_weights(adj: np.ndarray, gamma: float) -> np.ndarray:
    """Neighbour weights that decay with distance, exp(-(A_ij / gamma)^2): the paper's
    suggested soft alternative to the hard threshold."""
    return np.exp(-((adj / gamma) ** 2)).astype(np.float32)


def ward_clusters(graph: np.ndarray, n_clusters, max_clusters: int = 10) -> tuple[np.ndarray, np.ndarray, int]:
    """Ward (Müllner's algorithm in scipy) on the rows of A~; returns labels 0..C-1,
    the linkage matrix and C. n_clusters='auto' cuts where the merge heights jump most."""
    m = len(graph)
    if m < 2:
        return np.zeros(m, dtype=np.int64), np.zeros((0, 4)), 1
    z = linkage(graph.astype(np.float64), method="ward")
    c = auto_clusters(z, max_clusters) if n_clusters == "auto" else int(n_clusters)
    c = max(1, min(c, m))
    labels = fcluster(z, c, criterion="maxclust") - 1
    return _canonical(labels), z, int(labels.max() + 1)


def auto_clusters(z: np.ndarray, max_clusters: int) -> int:
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
