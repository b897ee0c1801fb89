"""Flat float32 parameter vectors: the unit that travels on the wire.

Layout is the order of ``module.named_parameters()``; buffers are not included
(none of our models has any that matter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ParamSpec:
    """Names, shapes and element counts of a module's parameters, in order."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    numel: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.numel)


def param_spec(module: nn.Module) -> ParamSpec:
    """Spec in ``module.named_parameters()`` order."""
    names, shapes, numel = [], [], []
    for n, p in module.named_parameters():
        names.append(n)
        shapes.append(tuple(p.shape))
        numel.append(p.numel())
    return ParamSpec(tuple(names), tuple(shapes), tuple(numel))


def flatten(module: nn.Module) -> torch.Tensor:
    """All parameters as one detached, contiguous, 1-D float32 CPU tensor (a copy)."""
    parts = [p.detach().reshape(-1).to("cpu", torch.float32) for p in module.parameters()]
    if not parts:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat(parts).contiguous()


def unflatten(vec: torch.Tensor, spec: ParamSpec) -> dict[str, torch.Tensor]:
    """Split ``vec`` into views with the spec's shapes.

    ``vec`` may be ``[total]`` or batched ``[..., total]`` (e.g. ``[B, total]``
    stacked clients), giving ``[..., *shape]`` views - the form
    ``torch.func.functional_call`` expects under ``torch.func.vmap``. Views (not
    copies) so gradients / in-place updates flow back to ``vec``.
    """
    if vec.dim() == 0 or vec.shape[-1] != spec.total:
        raise ValueError(f"expected last dim {spec.total}, got shape {tuple(vec.shape)}")
    batch = tuple(vec.shape[:-1])
    out: dict[str, torch.Tensor] = {}
    off = 0
    for name, shape, n in zip(spec.names, spec.shapes, spec.numel, strict=True):
        # Slicing the last dim keeps each row contiguous, so .view always succeeds.
        out[name] = vec[..., off : off + n].view(*batch, *shape)
        off += n
    return out


def load_flat(module: nn.Module, vec: torch.Tensor) -> None:
    """Copy flat ``vec`` into ``module``'s parameters in place (dtype/device converted)."""
    spec = param_spec(module)
    vec = torch.as_tensor(vec)
    if vec.dim() != 1:
        raise ValueError(f"load_flat expects a 1-D vector, got shape {tuple(vec.shape)}")
    views = unflatten(vec, spec)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(views[name])


def model_bytes(module: nn.Module) -> int:
    """Wire size of the module's flat float32 vector."""
    return 4 * param_spec(module).total
