"""Classifier networks used by the FL clients.

All models are BatchNorm-free on purpose: the trainer runs them with
``torch.func.functional_call`` under ``torch.func.vmap`` over stacked per-client
parameters, and BatchNorm's running-stat buffers (in-place updates) break that.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from flt.common.errors import FltError

MODEL_NAMES = ("mlp", "leaf_cnn", "cifar_cnn")


def _flat_dim(features: nn.Module, in_shape: tuple[int, int, int]) -> int:
    """Size after ``features`` for one input of ``in_shape`` (a dry run, so any H/W works)."""
    with torch.no_grad():
        return int(features(torch.zeros(1, *in_shape)).numel())


def _mlp(in_shape, num_classes) -> nn.Module:
    # Jamali-Rad et al. (FLT) MLP.
    c, h, w = in_shape
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(c * h * w, 200),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(200, num_classes),
    )


def _leaf_cnn(in_shape, num_classes) -> nn.Module:
    # LEAF FEMNIST CNN.
    c = in_shape[0]
    features = nn.Sequential(
        nn.Conv2d(c, 32, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    d = _flat_dim(features, in_shape)  # 64*(H/4)*(W/4)
    return nn.Sequential(
        *features,
        nn.Linear(d, 2048),
        nn.ReLU(),
        nn.Linear(2048, num_classes),
    )


def _cifar_cnn(in_shape, num_classes) -> nn.Module:
    # Classic McMahan / PyTorch-tutorial CIFAR CNN (400 = 16*5*5 for 32x32).
    c = in_shape[0]
    features = nn.Sequential(
        nn.Conv2d(c, 6, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    d = _flat_dim(features, in_shape)
    return nn.Sequential(
        *features,
        nn.Linear(d, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, num_classes),
    )


_BUILDERS = {"mlp": _mlp, "leaf_cnn": _leaf_cnn, "cifar_cnn": _cifar_cnn}
INPUTS = ("unit", "signed")


class SignedInputs(nn.Module):
    """Images in [0, 1] to [-1, 1] (2x - 1, torchvision's Normalize(0.5, 0.5) on every
    channel): what the FLT authors' code feeds its CIFAR-10 CNN. No parameters, so the
    model's flat weights are the same."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 - 1


def build_model(name: str, in_shape: tuple[int, int, int], num_classes: int, inputs: str = "unit") -> nn.Module:
    """Build classifier ``name`` for inputs ``[N, *in_shape]`` with ``num_classes`` logits.
    Images reach it in [0, 1]; ``inputs="signed"`` maps them to [-1, 1] first."""
    if inputs not in INPUTS:
        raise ValueError(f"unknown inputs {inputs!r}; valid: {', '.join(INPUTS)}")
    try:
        builder = _BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODEL_NAMES)}") from None
    shape = tuple(int(s) for s in in_shape)
    if len(shape) != 3:
        raise ValueError(f"in_shape must be (C, H, W), got {shape}")
    try:
        model = builder(shape, int(num_classes))
    except RuntimeError as exc:  # the dry run in _flat_dim: a kernel larger than what is left
        raise FltError(
            f"model: {name} cannot take {shape[1]} x {shape[2]} images ({str(exc).splitlines()[0]}); mlp takes any size"
        ) from None
    if inputs == "unit":
        return model
    # its layers keep their names ("0.weight", ...), so both variants share one ParamSpec
    return nn.Sequential(OrderedDict([("inputs", SignedInputs()), *model.named_children()]))
