"""The reporter: writes what strategies emit (reports/artifacts.py: Artifact) into a
method's folder, NAME.npz and the figures its `plot` names."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sklearn.decomposition import PCA

from flt.reports.artifacts import Artifact
from flt.reports.figures import plot_fcr, plot_timeline


def write_artifacts(out_dir: Path, artifacts: list[Artifact]) -> list[Path]:
    """NAME.npz for each artifact, plus the figures its `plot` names; returns the paths.
    The method's folder is made if missing, but never its run's: a run folder deleted
    mid-run is not made again (the write fails, and the run stops naming it)."""
    if not artifacts:
        return []
    out_dir.mkdir(exist_ok=True)
    paths = []
    for art in artifacts:
        paths.append(out_dir / f"{art.name}.npz")
        np.savez(paths[-1], **art.arrays)  # type: ignore[arg-type]  # (numpy stubs: a key could be allow_pickle)
        if art.plot == "fcr":
            paths += draw_fcr(out_dir, art.arrays, art.name.removeprefix("fcr"))
        elif art.plot == "timeline":
            a = art.arrays
            paths.append(plot_timeline(out_dir / f"{art.name}.png", a["rounds"], a["labels"]))
        elif art.plot is not None:
            raise ValueError(f"artifact {art.name}: no drawing named {art.plot!r}")
    return paths


def draw_fcr(out_dir: Path, a: dict[str, np.ndarray], tag: str) -> list[Path]:
    """adjacency, dendrogram and centroid figures of one clustering, from its arrays
    (what FLT emits: distance, graph, linkage, order, points and their owners, labels, truth)."""
    _, counts = np.unique(a["owner"], return_counts=True)  # owners come in ascending client order
    points = np.split(a["points"], np.cumsum(counts)[:-1])
    return plot_fcr(
        out_dir,
        a["adjacency"],
        a["graph"],
        a["linkage"],
        a["order"],
        scatter_points(points),
        a["labels"],
        a["truth"],
        tag,
    )


def scatter_points(points: list[np.ndarray]) -> list[np.ndarray]:
    """2-D points to draw: UMAP's when it made 2-D points, else a deterministic PCA."""
    if points[0].shape[1] == 2:
        return points
    flat = np.concatenate(points)
    two = flat[:, :2] if flat.shape[1] < 2 else PCA(n_components=2, svd_solver="full").fit_transform(flat)
    return np.split(two, np.cumsum([len(p) for p in points])[:-1])
