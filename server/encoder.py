"""The encoder's life on the server: public data, pretraining, cache, export.

The ConvAE is pretrained (MSE, Adam) on a public set that holds none of the clients'
training images: either the scenario's own held-out public split
(`partition.public_fraction`) or another dataset (e.g. Fashion-MNIST for MNIST: Enc2).
Trained weights are cached under a key made of everything that determines them: the
exact image bytes, the architecture and every training hyperparameter.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

from flt.common.files import cache_dir, read_cache, write_cache
from flt.common.schema import ConfigError
from flt.models.autoencoder import ConvAE
from flt.reports.terminal import Progress, active, step
from flt.scenarios.datasets import load_dataset


def image_source(data: dict, public_idx: np.ndarray | None) -> Callable[[dict], np.ndarray]:
    """A strategy's `Context.public_images` for the scenario's `data` section and its
    held-out public slice: strategies get images, not the scenario."""
    return partial(public_images, data=data, public_idx=public_idx)


def public_images(source: dict, data: dict, public_idx: np.ndarray | None) -> np.ndarray:
    """uint8 [N, C, H, W] images the encoder may learn from (never client training data):
    `source` is an encoder spec ({dataset, root}), `data` the scenario's data section."""
    if source["dataset"] == "public":
        if public_idx is None or len(public_idx) == 0:
            raise ConfigError(
                "encoder.dataset: 'public' needs partition.public_fraction > 0 "
                "(a held-out slice of the train split no client receives)"
            )
        return load_dataset(data["dataset"], data["root"], train=True).x[public_idx]
    if source["dataset"] == data["dataset"]:
        raise ConfigError(
            f"encoder.dataset: {source['dataset']!r} is the clients' own dataset; "
            "use 'public' (the held-out slice) so no client training image is seen"
        )
    root = source.get("root") or data["root"]
    images = load_dataset(source["dataset"], root, train=True).x
    # the clients embed their own images: the encoder must take their shape (test split: smaller)
    return fit_shape(images, load_dataset(data["dataset"], data["root"], train=False).x.shape[1:], source["dataset"])


def fit_shape(images: np.ndarray, shape: tuple, name: str) -> np.ndarray:
    """Another dataset's uint8 [N, C, H, W] images in the clients' [C, H, W]: grey
    replicated to 3 channels (or colour averaged to grey), then bilinear resizing
    (e.g. Fashion-MNIST's 1x28x28 as CIFAR-10's 3x32x32, for Enc2)."""
    c, h, w = shape
    if tuple(images.shape[1:]) == (c, h, w):
        return images
    if images.shape[1] not in (1, c) and c != 1:
        raise ConfigError(
            f"encoder.dataset: {name!r} has {images.shape[1]}-channel images; the "
            f"clients' have {c} (only grey <-> colour can be converted)"
        )
    x = torch.from_numpy(images).float()
    x = x.mean(1, keepdim=True) if c == 1 else x.expand(-1, c, -1, -1)
    if x.shape[2:] != (h, w):
        x = torch.cat(
            [
                torch.nn.functional.interpolate(
                    x[i : i + 4096], size=(h, w), mode="bilinear", antialias=True, align_corners=False
                )
                for i in range(0, len(x), 4096)
            ]
        )
    return x.round().clamp(0, 255).to(torch.uint8).numpy()


def cache_key(images: np.ndarray, settings: dict) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(images).tobytes())
    h.update(json.dumps({**settings, "shape": list(images.shape), "arch": "ConvAE-v2"}, sort_keys=True).encode())
    return h.hexdigest()[:24]


def pretrained_autoencoder(
    images: np.ndarray, settings: dict, device: torch.device, progress: Progress | None = None
) -> tuple[ConvAE, dict]:
    """Load from cache or pretrain; returns the model (eval mode, CPU) and a report."""
    key = cache_key(images, settings)
    path = cache_dir() / "encoders" / f"convae-{key}.pt"

    def fresh() -> ConvAE:  # initial weights too: the key must determine the encoder
        torch.manual_seed(settings["seed"])
        return ConvAE(tuple(images.shape[1:]), settings["latent"], settings["channels"])

    # the final loss is kept beside the weights: a cache hit reports what a miss does
    # (apart from the timing fields), so reruns give the same summary
    facts = path.with_suffix(".json")
    ae = read_cache(path, partial(_load_weights, fresh))
    mse = read_cache(facts, _load_final_mse) if ae is not None else None
    if ae is not None and mse is not None:
        return ae.eval(), {"cache": str(path), "cached": True, "seconds": 0.0, "final_mse": mse}
    tic = time.perf_counter()
    ae = fresh()  # freshly seeded: a load that failed may have filled part of the last one
    loss = pretrain(ae, images, settings, device, progress)
    # each writer its own temporary file: runs sharing the cache may pretrain the same
    # encoder at once, and the second rename must not find the first one's file gone
    write_cache(facts, lambda f: f.write(json.dumps({"final_mse": loss}).encode()))
    write_cache(path, lambda f: torch.save(ae.state_dict(), f))
    return ae.eval(), {"cache": str(path), "cached": False, "seconds": time.perf_counter() - tic, "final_mse": loss}


def _load_weights(fresh: Callable[[], ConvAE], path: Path) -> ConvAE:
    ae = fresh()
    ae.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return ae


def _load_final_mse(path: Path) -> float:
    facts = json.loads(path.read_text())
    mse = facts.get("final_mse") if isinstance(facts, dict) else None
    if not isinstance(mse, float | int) or isinstance(mse, bool):
        raise ValueError("no final_mse number in it")
    return float(mse)


def pretrain(ae: ConvAE, images: np.ndarray, s: dict, device: torch.device, progress: Progress | None = None) -> float:
    progress = progress or active()  # the terminal's bar when the CLI drew one
    torch.manual_seed(s["seed"])
    gen = torch.Generator().manual_seed(s["seed"])
    ae.to(device).train()
    x = torch.from_numpy(images).to(device)
    opt = torch.optim.Adam(ae.parameters(), lr=s["lr"])
    loss = 0.0  # a float: the last batch's loss, detached (no graph kept, no warning)
    for epoch in range(s["epochs"]):
        order = torch.randperm(len(x), generator=gen).to(device)
        total = 0.0
        for lo in range(0, len(x), s["batch_size"]):
            batch = x[order[lo : lo + s["batch_size"]]].float() / 255
            batch_loss = torch.nn.functional.mse_loss(ae(batch), batch)
            opt.zero_grad()
            batch_loss.backward()
            opt.step()
            loss = float(batch_loss.detach())
            total += loss * len(batch)
        step(
            progress,
            epoch + 1,
            s["epochs"],
            f"  encoder pretraining epoch {epoch + 1}/{s['epochs']}: mse {total / len(x):.4f}",
            "epoch",
        )
    ae.cpu().eval()
    return loss
