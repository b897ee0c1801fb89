"""Figures and scores of a clustering: adjacency (raw and reordered), dendrogram,
UMAP scatter, and agreement with the planted clusters when they are known."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np


def plot_fcr(
    out_dir: Path,
    adj: np.ndarray,
    graph: np.ndarray,
    z: np.ndarray,
    order: np.ndarray,
    points: list[np.ndarray],
    labels: np.ndarray,
    truth: np.ndarray | None = None,
    tag: str = "",
) -> list[Path]:
    """adjacency{tag}.png (A, A~, A~ in dendrogram order), dendrogram{tag}.png and
    centroids{tag}.png (the clients' centroids in 2-D, coloured by found and true cluster)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from scipy.cluster.hierarchy import dendrogram

    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for ax, mat, title in (
        (axes[0], adj, "A (distance between centroid sets)"),
        (axes[1], graph, "A~ (client graph)"),
        (axes[2], graph[np.ix_(order, order)], "A~ reordered by the dendrogram"),
    ):
        im = ax.imshow(mat, cmap="viridis_r" if mat is adj else "Greys", interpolation="nearest")
        ax.set(title=title, xlabel="client", ylabel="client")
        if mat is adj:
            fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    paths.append(out_dir / f"adjacency{tag}.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    if len(z):
        fig, ax = plt.subplots(figsize=(max(6, len(labels) * 0.08), 4))
        with warnings.catch_warnings():  # every merge at height 0 (identical clients): scipy sets
            # the axis to [0, 0], matplotlib widens it and warns on the user's terminal
            warnings.filterwarnings("ignore", "Attempting to set identical low and high ylims")
            dendrogram(z, ax=ax, no_labels=len(labels) > 60, color_threshold=None)
        ax.set(title="dendrogram of the clients", ylabel="merge height")
        fig.tight_layout()
        paths.append(out_dir / f"dendrogram{tag}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    paths.append(scatter(out_dir / f"centroids{tag}.png", points, labels, truth, "2-D"))
    return paths


def scatter(path: Path, points: list[np.ndarray], labels: np.ndarray, truth: np.ndarray | None, space: str) -> Path:
    """Every client's centroids as 2-D points, coloured by found (and true) cluster."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = np.concatenate(points)
    panels = [("found cluster", labels)] + ([("true cluster", truth)] if truth is not None else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 5), squeeze=False)
    for ax, (title, owner_labels) in zip(axes[0], panels, strict=True):
        owner = np.repeat(owner_labels, [len(p) for p in points])
        if pts.shape[1] >= 2:
            sc = ax.scatter(pts[:, 0], pts[:, 1], c=owner, cmap="tab10" if owner.max() < 10 else "tab20", s=12)
            ax.legend(*sc.legend_elements(), title=title, fontsize=7, loc="best")
        ax.set(title=f"client centroids ({space}), coloured by {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timeline(path: Path, rounds: np.ndarray, labels: np.ndarray) -> Path:
    """Clusters over rounds: one row per client (ordered by its first cluster), one band
    per clustering from its round to the next; white where a client has no cluster (not
    arrived, or no embedding). A dot marks each client that moved at that clustering."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.ticker import MaxNLocator

    first = (labels >= 0).argmax(0)  # the first clustering that placed each client
    start = labels[first, np.arange(labels.shape[1])]
    order = np.lexsort((np.arange(labels.shape[1]), start))
    grid = np.ma.masked_less(labels[:, order].T.astype(float), 0)  # [clients, clusterings]
    edges = np.append(rounds, rounds[-1] + max(1, int(np.diff(rounds).max()) if len(rounds) > 1 else 1))
    cmap = ListedColormap(plt.get_cmap("tab20")(np.arange(max(2, int(labels.max()) + 1)) % 20))
    fig, ax = plt.subplots(figsize=(8, max(3.0, min(12.0, 0.05 * labels.shape[1] + 2))))
    mesh = ax.pcolormesh(edges, np.arange(labels.shape[1] + 1), grid, cmap=cmap, vmin=-0.5, vmax=cmap.N - 0.5)
    moved = (labels[1:] != labels[:-1]) & (labels[:-1] >= 0) & (labels[1:] >= 0)  # [clusterings-1, clients]
    k, c = np.nonzero(moved[:, order])
    ax.scatter(rounds[k + 1], c + 0.5, s=10, c="k", marker="o", label="moved")
    ax.set(xlabel="round", ylabel="client (by first cluster)", title="clusters over rounds")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.colorbar(mesh, ax=ax, label="cluster", ticks=range(cmap.N))
    if len(k):
        ax.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
