"""Client side of FCR: embed the client's own data, summarise it with k-means.

Three encoders can arrive over the wire (message kind "encoder"):
- "onnx": the frozen ConvAE encoder as ONNX bytes, run with onnxruntime (Enc1);
- "autoencoder": the whole ConvAE as a flat float32 vector; each client fine-tunes its
  own copy for J epochs on its own data (Enc2), then embeds with it in eval mode;
- "linear": a shared PCA basis (components, mean) for the PCA+kM+HC baseline;
- "own_pca": no encoder, only e: each client fits PCA on its own data (PCA+kM+HC as the
  FLT authors' code runs it, `basis: client`).
Only summaries leave the device: k x e centroids of all the client's data and of each of two
halves of it (what the server tests its clusters on), with their shares.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from sklearn.cluster import KMeans
from sklearn.decomposition import PCA
from sklearn.metrics import silhouette_score
from torch.func import functional_call, vmap

from flt.devices.trainer import CohortTrainer, TrainConfig, _pad
from flt.models.autoencoder import PAPER_CHANNELS, ConvAE, onnx_embed, onnx_session
from flt.models.flat import param_spec

if TYPE_CHECKING:
    from onnxruntime import InferenceSession

_SESSIONS: dict[int, InferenceSession] = {}


def embed_onnx(onnx_bytes: np.ndarray, xs: list[torch.Tensor]) -> list[np.ndarray]:
    """Run the ONNX encoder on every client's data in one onnxruntime call."""
    key = hash(onnx_bytes.tobytes())
    if key not in _SESSIONS:  # the same encoder arrives once per client: build one session
        _SESSIONS.clear()
        _SESSIONS[key] = onnx_session(onnx_bytes.tobytes())
    flat = onnx_embed(_SESSIONS[key], torch.cat(xs).numpy())
    return np.split(flat, np.cumsum([len(x) for x in xs])[:-1])


def embed_linear(components: np.ndarray, mean: np.ndarray, xs: list[torch.Tensor]) -> list[np.ndarray]:
    flat = (torch.cat(xs).flatten(1).numpy() - mean) @ components.T
    return np.split(flat.astype(np.float32), np.cumsum([len(x) for x in xs])[:-1])


def embed_own_pca(xs: list[torch.Tensor], latent: int, seeds: list[int]) -> list[np.ndarray]:
    """Each client's data in the first `latent` principal axes of its own data (the
    shard's [0, 1] pixels, flattened), as the FLT authors' PCA+kM+HC does. A client
    with fewer samples than `latent` has fewer axes; the rest are zero columns (the authors
    repeat the samples to fit `latent` axes, whose extra ones carry no variance either).
    One scikit-learn PCA per client: its axes are its own, shared with no one."""
    out = []
    for x, seed in zip(xs, seeds, strict=True):
        flat = x.flatten(1).numpy().astype(np.float64)
        e = min(latent, len(flat), flat.shape[1])
        z = np.zeros((len(flat), latent), dtype=np.float32)
        if e > 0:
            z[:, :e] = PCA(n_components=e, random_state=seed).fit_transform(flat)
        out.append(z)
    return out


def embed_finetuned(
    weights: np.ndarray,
    meta: dict,
    xs: list[torch.Tensor],
    gens: list[torch.Generator],
    chunk: int = 64,
    clients_per_pass: int | None = None,
) -> list[np.ndarray]:
    """Each client fine-tunes its own copy of the autoencoder (vectorized), then embeds;
    gens[i] is client i's own generator (its batch order). Clients go through in groups,
    else a device hosting 1,200 clients holds 1,200 autoencoders with their gradients and
    Adam moments at once (23 GB of PSS at M = 2,400). On a CPU a group is one client
    trained by the plain loop (faster there for convolutions), so a client's embedding is
    bit for bit the same whichever clients share its device; on a GPU, 32 clients vmapped
    (vmapped convolutions round differently with the group's size)."""
    dev = xs[0].device  # the device's accelerator: its shards live there
    ae = ConvAE(tuple(meta["in_shape"]), meta["latent"], meta.get("channels", PAPER_CHANNELS)).to(dev)
    spec = param_spec(ae)
    ft = meta["finetune"]
    cfg = TrainConfig(
        epochs=ft["epochs"], batch_size=ft["batch_size"], lr=ft["lr"], loss="mse", optimizer="adam", vectorize="auto"
    )
    clients_per_pass = clients_per_pass or (32 if dev.type == "cuda" else 1)
    init = torch.from_numpy(np.array(weights, dtype=np.float32)).to(dev)
    out: list[np.ndarray] = []
    for lo in range(0, len(xs), clients_per_pass):
        group = xs[lo : lo + clients_per_pass]
        out += _finetune_and_embed(ae, spec, cfg, init, group, gens[lo : lo + clients_per_pass], chunk)
    return out


def _finetune_and_embed(ae, spec, cfg, init, xs, gens, chunk) -> list[np.ndarray]:
    dev = init.device
    start = init.expand(len(xs), -1)
    tuned, _ = CohortTrainer(ae, spec).train(start, xs, [torch.zeros(len(x), device=dev) for x in xs], cfg, gens)
    ae.eval()  # no dropout/BN in the ConvAE, but embed in eval mode regardless
    offsets = np.cumsum((0, *spec.numel))
    enc = {
        n[len("encoder.") :]: tuned[:, offsets[i] : offsets[i + 1]].view(len(xs), *spec.shapes[i])
        for i, n in enumerate(spec.names)
        if n.startswith("encoder.")
    }
    xpad, lengths = _pad(xs)
    fwd = vmap(lambda p, x: functional_call(ae.encoder, p, (x,)))
    with torch.no_grad():  # in slices of samples: the conv activations of a whole cohort's
        # data at once took 14 GB for 50 clients of 1,500 images
        z = torch.cat([fwd(enc, xpad[:, lo : lo + chunk]).cpu() for lo in range(0, xpad.shape[1], chunk)], 1)
    return [z[i, : int(n)].numpy() for i, n in enumerate(lengths)]


def centroids(emb: np.ndarray, k: int | Literal["auto"], seed: int, k_max: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """k-means centroids of one client's embeddings (seeded), and each one's share of the
    client's samples. The shares make the k points a summary of the client's distribution:
    without them, two clients of one distribution whose k-means happened to put 3 of 5
    centroids on one class and 2 on the other look as different as two class mixtures.

    k = "auto" picks k in 2..k_max by silhouette score of the client's own embeddings
    (never from labels)."""
    n = len(emb)
    if k == "auto":
        k = _auto_k(emb, seed, min(k_max, n - 1))
    count = max(1, min(int(k), n))
    km = KMeans(n_clusters=count, n_init=10, random_state=seed).fit(emb)
    return km.cluster_centers_.astype(np.float32), _shares(km.labels_, count)


def split_halves(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two disjoint random halves of a client's n samples (seeded): the server draws its
    clusters on summaries of the first and tests them on the second (server/fcr.py
    HeldOut), so both must come from the same client's data, never shared."""
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[: n // 2]), np.sort(order[n // 2 :])


def label_means(emb: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Label-conditioned centroids: the mean embedding of each class the client holds,
    as rows [mean, class] (k x (e + 1)), and each class's share of the client's samples;
    the server compares clients class by class, so two clients whose labels mean
    different things (concept shift) are far apart."""
    classes, inverse = np.unique(y, return_inverse=True)
    sums = np.zeros((len(classes), emb.shape[1]), np.float64)
    np.add.at(sums, inverse, emb)
    means = sums / np.bincount(inverse)[:, None]
    return np.hstack([means, classes[:, None]]).astype(np.float32), _shares(inverse, len(classes))


def _shares(labels: np.ndarray, k: int) -> np.ndarray:
    return (np.bincount(labels, minlength=k) / len(labels)).astype(np.float32)


def _auto_k(emb: np.ndarray, seed: int, k_max: int) -> int:
    if k_max < 2:
        return 1
    scores: dict[int, float] = {}
    for k in range(2, k_max + 1):
        labels = KMeans(n_clusters=k, n_init=4, random_state=seed).fit_predict(emb)
        if len(set(labels)) > 1:
            scores[k] = silhouette_score(emb, labels, random_state=seed)
    return max(scores, key=scores.__getitem__) if scores else 1
