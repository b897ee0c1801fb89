"""Device side of dynamic FLT: does a client's data still look like the data it embedded?

FLT re-clusters a client whose distribution changed (the paper's flag delta). Nobody
tells a device that its distribution changed: it only sees its data store change. A
store that gains or loses samples from the same distribution needs no re-clustering,
so the device tests before it raises the flag:

- when a client embeds for FCR, the device keeps the embeddings of a fixed, seeded
  sample of its images (at most REFERENCE images) and the encoder (ONNX session or PCA
  basis: both cheap to run again);
- when the client's data store changes, its next task embeds a sample of the same size
  of the new data and runs the nearest-neighbour two-sample test (Schilling 1986) with
  PERMUTATIONS seeded permutations; p < ALPHA raises the flag.

The test is scale-free (a permutation test needs no threshold in the embedding's units)
and costs nothing while the data does not change. It sees images only: a client that
embedded with an encoder the device does not keep (Enc2's fine-tuned autoencoder), or
whose centroids depend on its labels (`k: labels`, made for concept shift, which changes
no image), is not tested: any change of its store raises the flag, and the server's
placement decides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.spatial.distance import pdist, squareform

REFERENCE = 64  # images per client kept as the reference (64 x e floats: 32 KB at e = 128)
PERMUTATIONS = 199
ALPHA = 0.01
NEIGHBOURS = 5

Embedder = Callable[[np.ndarray], np.ndarray]  # float32 [N, C, H, W] -> [N, e]


@dataclass
class Reference:
    embedding: np.ndarray | None  # [n, e] of the sampled images; None: no encoder kept
    version: int  # the data-store version it was taken from
    seed: int  # which images are sampled, and the permutations


def sample_index(n: int, seed: int, size: int = REFERENCE) -> np.ndarray:
    """The images a client's reference and its checks embed (sorted, seeded)."""
    if n <= size:
        return np.arange(n)
    return np.sort(np.random.default_rng([seed, 0x7A7C]).choice(n, size, replace=False))


def knn_pvalue(a: np.ndarray, b: np.ndarray, seed: int, k: int = NEIGHBOURS, permutations: int = PERMUTATIONS) -> float:
    """Permutation p-value of the nearest-neighbour two-sample test (Schilling 1986):
    how many of the pooled points' k nearest neighbours come from their own sample. Data
    of other classes falls in other modes of the embedding, so the test sees it in small
    samples where a global distance (energy, MMD) is diluted by the dimensions that do
    not depend on the class. The graph is fixed; every permutation is one matrix product."""
    n, m = len(a), len(b)
    if n < 2 or m < 2:
        return 1.0
    d = squareform(pdist(np.concatenate([a, b]).astype(np.float64)))
    np.fill_diagonal(d, np.inf)
    k = min(k, n + m - 1)
    graph = np.zeros_like(d)
    np.put_along_axis(graph, np.argsort(d, axis=1)[:, :k], 1.0, axis=1)
    rng = np.random.default_rng([seed, 0xE1E])
    order = np.argsort(rng.random((permutations, n + m)), axis=1)
    g = np.zeros((permutations + 1, n + m))
    g[0, :n] = 1.0  # row 0: the observed split
    np.put_along_axis(g[1:], order[:, :n], 1.0, axis=1)
    h = 1.0 - g
    same = ((g @ graph) * g).sum(1) + ((h @ graph) * h).sum(1)  # neighbour pairs within a sample
    return float((1 + (same[1:] >= same[0]).sum()) / (permutations + 1))


class Watch:
    """One device's references and data-store versions, per client."""

    def __init__(self) -> None:
        self.embedder: Embedder | None = None  # the encoder of the last FCR exchange
        self.refs: dict[int, Reference] = {}
        self.version: dict[int, int] = {}  # bumped whenever a client's store changes
        self.tests: list[tuple[int, float]] = []  # (client, p) of every test run, for the log

    def clear(self) -> None:
        self.embedder = None
        self.refs.clear()
        self.version.clear()
        self.tests.clear()

    def remember(self, client: int, embedding: np.ndarray, seed: int, kept: bool) -> None:
        """The client embedded all its images as `embedding` [n, e]; `kept`: whether the
        device keeps that encoder (else a change of its store raises the flag untested)."""
        sample = embedding[sample_index(len(embedding), seed)].astype(np.float32) if kept else None
        self.refs[client] = Reference(sample, self.version.get(client, 0), seed)

    def forgotten(self, client: int) -> None:
        """A resumed device: the client embedded before the restart, its reference did not
        survive; a change of its store raises the flag untested."""
        self.refs[client] = Reference(None, self.version.get(client, 0), 0)

    def changed(self, client: int) -> None:
        self.version[client] = self.version.get(client, 0) + 1

    def watched(self, client: int) -> bool:
        return client in self.refs

    def pending(self, client: int) -> bool:
        """Its store changed since its reference was taken (or last tested)."""
        ref = self.refs.get(client)
        return ref is not None and ref.version != self.version.get(client, 0)

    def moved(self, client: int, images: np.ndarray) -> bool:
        """Test a pending client's current images (all of them; the sample is taken here)
        against its reference. Passing tests advance the reference's version, so the same
        store is tested once."""
        ref = self.refs[client]
        ref.version = self.version.get(client, 0)
        if ref.embedding is None or self.embedder is None:
            return True
        now = self.embedder(images[sample_index(len(images), ref.seed)])
        p = knn_pvalue(ref.embedding, now, ref.seed)
        self.tests.append((client, p))
        return p < ALPHA
