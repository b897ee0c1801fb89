"""PCA+kM+HC: FLT's pipeline with a linear encoder and no UMAP (the FLT paper's ablation
baseline, after the "PCA + k-means + hierarchical clustering" clustered-FL heuristics).

One-off relatedness, as FLT's FCR but:
  1. the encoder is one PCA basis shared by all clients, fitted by the server on the
     same public images FLT's ConvAE is pretrained on (never client data), on pixels
     flattened and scaled to [0, 1]:  z = (x - mean) V^T,  V = top-e principal axes
     (e = `components`, capped by the public set size and the pixel count);
  2. client m embeds its own data with it, runs k-means and sends its k centroids;
  3. the server skips UMAP: distances between the clients' centroid sets are taken in
     PCA space, then FLT's clustering and Case I / II training.

Relatedness. By default FLT's 'set' pipeline (Chamfer distance between centroid sets,
average linkage, C by silhouette), which has no threshold, so the comparison with FLT
isolates the encoder. With `relatedness: paper` (closest pair, A~ = [A <= gamma], Ward on
A~): PCA distances scale with the data's variance, so a fixed gamma would mean nothing;
with `gamma: null` (the default) gamma is the `gamma_quantile` quantile of the off-diagonal
entries of A: each client is linked to about that fraction of the others, its nearest
ones (0.2 = 1/C for the paper's C = 5 balanced clusters). A number for gamma is used as is.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from sklearn.decomposition import PCA

from flt.server import fcr
from flt.server.strategies.flt import FLT
from flt.server.strategies.params import PCA_KM_HC


def pca_basis(images: np.ndarray, components: int, seed: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """One PCA basis of uint8 images [N, C, H, W]: components float32 [e, d] (orthonormal
    rows), mean float32 [d], and a report. e = min(components, N, d)."""
    x = images.reshape(len(images), -1).astype(np.float32) / 255.0
    e = max(1, min(int(components), x.shape[0], x.shape[1]))
    pca = PCA(n_components=e, svd_solver="full" if e == min(x.shape) else "auto", random_state=seed).fit(x)
    info = {
        "pca_components": e,
        "pca_explained_variance": float(pca.explained_variance_ratio_.sum()),
        "pca_requested": int(components),
    }
    return pca.components_.astype(np.float32), pca.mean_.astype(np.float32), info


class PCAKMHC(FLT):
    name = "pca_km_hc"
    PARAMS = PCA_KM_HC  # server/strategies/params.py: every method's parameters, torch-free

    def __init__(self, ctx, **params):
        super().__init__(ctx, **params)
        self.gamma_used: float | None = self.params["gamma"]

    def encoder_payload(self) -> tuple[dict, dict, dict]:
        images = self.ctx.public_images(self.params["encoder"])
        components, mean, info = pca_basis(images, self.params["components"], self.ctx.seed)
        meta = {
            "format": "linear",
            "k": self.params["k"],
            "latent": int(components.shape[0]),
            "in_shape": list(images.shape[1:]),
        }
        return {"components": components, "mean": mean}, meta, info | {"public_images": int(len(images))}

    @classmethod
    def pipeline(cls, params: dict) -> fcr.Relatedness:
        """No UMAP: distances in PCA space; the preset's gamma (in UMAP units) never applies."""
        return replace(super().pipeline({**params, "space": "embedding"}), gamma=params["gamma"])

    def threshold(self, points: list[np.ndarray]) -> fcr.Relatedness:
        if self.how.gamma is not None or self.how.linkage != "ward_graph":
            self.gamma_used = self.how.gamma
            return self.how
        adj = fcr.set_distance(points, self.how.distance, device=self.ctx.device)
        self.gamma_used = gamma_from_quantile(adj, self.params["gamma_quantile"])
        return replace(self.how, gamma=self.gamma_used)

    def summary(self) -> dict:
        return super().summary() | {"gamma": self.gamma_used}


def gamma_from_quantile(adj: np.ndarray, q: float) -> float:
    """The q-quantile of A_ij over pairs i < j (a strictly positive threshold)."""
    m = len(adj)
    if m < 2:
        return 1.0
    upper = adj[np.triu_indices(m, 1)]
    gamma = float(np.quantile(upper, q))
    if gamma <= 0:  # identical clients: any positive threshold links them
        positive = upper[upper > 0]
        gamma = float(positive.min()) if positive.size else 1.0
    return gamma
