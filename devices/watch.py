"""Device side of dynamic FLT: does a client's data still look like the data it embedded?

FLT re-clusters a client whose distribution changed (the paper's flag delta). Nobody
tells a device that its distribution changed: it only sees its data store change. A
store that gains or loses samples from the same distribution needs no re-clustering,
so the device tests before it raises the flag:

- when a client embeds for FCR, the device keeps what it embedded (the shard: indices
  into the images the device holds anyway, a few KB) and the encoder (ONNX session or
  PCA basis: both cheap to run again);
- when the client's data store changes, the device embeds a fixed, seeded sample of at
  most SAMPLE images of the old data and as many of the new, and runs the
  nearest-neighbour two-sample test (Schilling 1986) with PERMUTATIONS seeded
  permutations; p < ALPHA raises the flag. benchmarks/bench_watch.py measures its false
  alarms and misses on MNIST, Fashion-MNIST and CIFAR-10 (SAMPLE and NEIGHBOURS come
  from there: 64 images missed a third of CIFAR-10's moves).

A checkpoint keeps each reference's embedded sample when data changes after its round,
and a resumed device gets it back with the encoder (`restored`), so it tests as before.

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

SAMPLE = 256  # images of each side a test embeds
PERMUTATIONS = 199
ALPHA = 0.01
NEIGHBOURS = 10

Embedder = Callable[[np.ndarray], np.ndarray]  # float32 [N, C, H, W] -> [N, e]
Images = Callable[[], np.ndarray]  # a client's images as it embedded them, float32 [N, C, H, W]


@dataclass
class Reference:
    images: Images | None  # what the client embedded; None: not testable (any change flags)
    version: int  # the data-store version it was taken from
    seed: int  # which images are sampled, and the permutations
    # (embedder, its embedding of the sampled images): what a test compares with, kept once
    # computed for a checkpoint, or given back by one on resume (`images` then None)
    sample: tuple[Embedder | None, np.ndarray] | None = None


def sample_index(n: int, seed: int, size: int = SAMPLE) -> np.ndarray:
    """The images of n that a test embeds (sorted, seeded)."""
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

    def remember(self, client: int, images: Images, seed: int, testable: bool) -> None:
        """The client embedded `images()`; `testable`: the device keeps that encoder and
        the embedding depends on the images alone (else a change raises the flag untested)."""
        self.refs[client] = Reference(images if testable else None, self.version.get(client, 0), seed)

    def forgotten(self, client: int) -> None:
        """A resumed device: the client embedded before the restart and its checkpoint kept
        no reference (not testable, or no data change was to come); a change of its store
        raises the flag untested."""
        self.refs[client] = Reference(None, self.version.get(client, 0), 0)

    def reference_sample(self, client: int) -> np.ndarray | None:
        """The embedded sample of what the client embedded, which a test compares its new
        data with: what a checkpoint keeps so that a resumed device tests as this one
        would. None when its change is not tested."""
        ref = self.refs.get(client)
        return None if ref is None else self._then(ref)

    def restored(self, client: int, sample: np.ndarray, seed: int) -> None:
        """A resumed device: the client's reference as a checkpoint kept it (its embedded
        sample; the encoder comes back apart, as `embedder`)."""
        self.refs[client] = Reference(None, self.version.get(client, 0), seed, (None, sample))

    def _then(self, ref: Reference) -> np.ndarray | None:
        """The reference's embedded sample under the current encoder (computed once per
        encoder; a restored one was computed before the restart, under the same encoder)."""
        if ref.sample is not None and (ref.images is None or ref.sample[0] is self.embedder):
            return ref.sample[1]
        if ref.images is None or self.embedder is None:
            return None
        old = ref.images()
        ref.sample = (self.embedder, self.embedder(old[sample_index(len(old), ref.seed)]))
        return ref.sample[1]

    def changed(self, client: int) -> None:
        self.version[client] = self.version.get(client, 0) + 1

    def watched(self, client: int) -> bool:
        return client in self.refs

    def pending(self, client: int) -> bool:
        """Its store changed since its reference was taken (or last tested)."""
        ref = self.refs.get(client)
        return ref is not None and ref.version != self.version.get(client, 0)

    def moved(self, client: int, images: np.ndarray) -> bool:
        """Test a pending client's current images against what it embedded. The reference
        stays (it is what the server knows); its version advances, so one store is tested
        once."""
        ref = self.refs[client]
        ref.version = self.version.get(client, 0)
        then = self._then(ref)
        if then is None or self.embedder is None:
            return True
        now = self.embedder(images[sample_index(len(images), ref.seed + 1)])
        p = knn_pvalue(then, now, ref.seed)
        self.tests.append((client, p))
        return p < ALPHA
