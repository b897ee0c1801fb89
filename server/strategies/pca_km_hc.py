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

`basis: client` is the FLT authors' code instead of step 1: each client fits PCA (e axes)
on its own images, embeds them and sends k-means centroids in its own axes. Nothing goes
down but e, and no two clients share coordinates, so the distances between their centroid
sets compare unrelated axes (the paper: "the client-side linear dimensionality reduction
seems to be the bottleneck"). It is offered to measure that, not as a method to use.
The authors' whole step is `basis: client, k: 5, distance: matched, gamma: 1.095,
aggregation: case1`: A_ij the best one-to-one matching of the two clients' 5 centroids
(root mean squared distance), A~ = [A_ij^2 < 1.2], and each client averages its
neighbours' models (their code has no hierarchical step for this baseline); on CIFAR-10,
which they scaled to [-1, 1], the same cut is gamma 0.548 on our [0, 1] pixels.

Relatedness. By default FLT's 'set' pipeline (energy distance between the whitened,
share-weighted centroid sets, Ward linkage, C the finest real cut, refined), which has no
threshold, so the comparison with FLT isolates the encoder. With `relatedness: paper`
(closest pair, A~ = [A <= gamma], Ward on A~): PCA distances scale with the data's
variance, so a fixed gamma would mean nothing; with `gamma: null` (the default) gamma is
the `gamma_quantile` quantile of the off-diagonal entries of A: each client is linked to
about that fraction of the others, its nearest ones (0.2 = 1/C for the paper's C = 5
balanced clusters). A number for gamma is used as is.
"""

from __future__ import annotations

from flt.server.fcr_recipe import PCA_RECIPE
from flt.server.strategies.flt import FLT
from flt.server.strategies.params import PCA_KM_HC


class PCAKMHC(FLT):
    """FLT's orchestration with another recipe (server/fcr_recipe.py): nothing overridden."""

    name = "pca_km_hc"
    PARAMS = PCA_KM_HC  # server/strategies/params.py: every method's parameters, torch-free
    RECIPE = PCA_RECIPE
