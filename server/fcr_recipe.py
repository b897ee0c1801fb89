"""What distinguishes one one-shot clustering method from another inside FLT's FCR: the
encoder the server sends (its payload), the relatedness pipeline, and how the pipeline's
threshold gamma is found for the points that came back. FLT and PCA+kM+HC share the FCR
orchestration (server/strategies/flt.py) and differ only in the `Recipe` they hand it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from sklearn.decomposition import PCA

from flt.models.autoencoder import bottleneck_channels, export_encoder_onnx
from flt.models.flat import flatten
from flt.server import encoder as enc
from flt.server import fcr
from flt.server.strategies.base import Context
from flt.server.strategies.params import flt_pipeline

# (ctx, params) -> (tensors sent to every client, their meta, a report of the encoder)
Payload = Callable[[Context, dict], "tuple[dict[str, np.ndarray], dict, dict]"]
# (the pipeline, the clients' projected centroid sets, params, device) -> the pipeline with gamma
Threshold = Callable[[fcr.Relatedness, "list[np.ndarray]", dict, torch.device], fcr.Relatedness]


@dataclass(frozen=True)
class Recipe:
    payload: Payload
    pipeline: Callable[[dict], fcr.Relatedness]
    threshold: Threshold


# -- FLT: the ConvAE encoder, pretrained on the public images --------------------------------
def convae_payload(ctx: Context, params: dict) -> tuple[dict[str, np.ndarray], dict, dict]:
    """What travels down for FCR: ONNX bytes (Enc1, frozen) or the autoencoder's weights
    (Enc2, fine-tuned on each client for J epochs)."""
    e = params["encoder"]
    images = ctx.public_images(e)
    channels = bottleneck_channels(e["channels"], images.shape[1])
    settings = {k: e[k] for k in ("epochs", "lr", "batch_size", "latent")} | {"channels": channels, "seed": ctx.seed}
    ae, info = enc.pretrained_autoencoder(images, settings, ctx.device)
    meta = {"k": params["k"], "latent": e["latent"], "channels": channels, "in_shape": list(images.shape[1:])}
    info = {"encoder_" + k: v for k, v in info.items()} | {"encoder_channels": channels, "public_images": len(images)}
    if e["finetune_epochs"] == 0:
        onnx = np.frombuffer(export_encoder_onnx(ae, tuple(images.shape[1:])), dtype=np.uint8)
        return {"onnx": onnx}, meta | {"format": "onnx"}, info
    meta |= {
        "format": "autoencoder",
        "finetune": {"epochs": e["finetune_epochs"], "lr": e["finetune_lr"], "batch_size": e["finetune_batch"]},
    }
    return {"weights": flatten(ae).numpy()}, meta, info


def as_given(how: fcr.Relatedness, points: list[np.ndarray], params: dict, device: torch.device) -> fcr.Relatedness:
    """The pipeline's own gamma (FLT: a preset's, or the scenario's)."""
    return how


# -- PCA+kM+HC: one PCA basis of the public images ------------------------------------------
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


def pca_payload(ctx: Context, params: dict) -> tuple[dict[str, np.ndarray], dict, dict]:
    if params["basis"] == "client":  # nothing to send but e: each client fits its own PCA
        d = int(np.prod(ctx.in_shape))
        e = max(1, min(int(params["components"]), d))
        return {}, {"format": "own_pca", "k": params["k"], "latent": e}, {"pca_components": e, "pca_basis": "client"}
    images = ctx.public_images(params["encoder"])
    components, mean, info = pca_basis(images, params["components"], ctx.seed)
    meta = {
        "format": "linear",
        "k": params["k"],
        "latent": int(components.shape[0]),
        "in_shape": list(images.shape[1:]),
    }
    return {"components": components, "mean": mean}, meta, info | {"public_images": int(len(images))}


def pca_pipeline(params: dict) -> fcr.Relatedness:
    """No UMAP: distances in PCA space; the preset's gamma (in UMAP units) never applies."""
    return replace(flt_pipeline({**params, "space": "embedding"}), gamma=params["gamma"])


def by_quantile(how: fcr.Relatedness, points: list[np.ndarray], params: dict, device: torch.device) -> fcr.Relatedness:
    """A pipeline that thresholds (ward_graph) with no gamma given takes the
    `gamma_quantile` quantile of A: PCA distances scale with the data's variance."""
    if how.gamma is not None or how.linkage != "ward_graph":
        return how
    adj = fcr.set_distance(points, how.distance, device=device)
    return replace(how, gamma=gamma_from_quantile(adj, params["gamma_quantile"]))


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


FLT_RECIPE = Recipe(convae_payload, flt_pipeline, as_given)
PCA_RECIPE = Recipe(pca_payload, pca_pipeline, by_quantile)
