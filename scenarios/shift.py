"""Feature shift and concept shift: clusters that differ by how their inputs look or by
what their labels mean, not (only) by which labels they hold.

A scenario's ``partition.shift`` splits the clients into ``partition.clusters`` groups
(contiguous blocks of client ids, the same blocks as the planted clusters of the
``clusters`` kind) and gives each group one transform:

========  =========================================  ===============================
kind      what a client of group g sees              default levels (G groups)
========  =========================================  ===============================
rotate    images rotated by levels[g] degrees        360 * g / G (0, 90, 180, 270)
invert    1 - x where levels[g] is 1                 0, 1, 0, 1, ...
noise     x + N(0, levels[g]^2) clipped to [0, 1]    0 .. 0.6, evenly spaced
blur      Gaussian blur with sigma levels[g] pixels  0 .. 2, evenly spaced
labels    label l read as perm_g[l]                  group 0 unchanged, every other
                                                     group a seeded derangement
========  =========================================  ===============================

Transforms run on the device, on the float copy a task makes of a client's images
(see devices/device.py ``Shard``): the shared uint8 dataset is never copied per
client. Rotations by multiples of 90 degrees are exact (``torch.rot90``); other angles
use bilinear interpolation with black corners. Noise is the client's own: drawn once
per access from a stream seeded by (run seed, client, split), so the same client sees
the same noisy images in every round and on every device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

if TYPE_CHECKING:  # torch is imported only on the device side, inside the functions that use it
    import torch

KINDS = ("rotate", "invert", "noise", "blur", "labels")


def default_levels(kind: str, groups: int) -> list[float]:
    g = np.arange(groups, dtype=np.float64)
    span = max(groups - 1, 1)
    if kind == "rotate":
        return (360.0 * g / groups).tolist()
    if kind == "invert":
        return (g % 2).tolist()
    if kind == "noise":
        return (0.6 * g / span).tolist()
    if kind == "blur":
        return (2.0 * g / span).tolist()
    return [0.0] * groups  # labels: a group's level is unused, its permutation is seeded


def level_problem(kind: str, levels: list, groups: int) -> str | None:
    """What is wrong with `levels` for `kind` and `groups` (None when nothing is)."""
    if kind == "labels":
        return "levels: not used with kind 'labels' (each group's permutation is seeded)"
    if len(levels) != groups:
        return f"levels: {len(levels)} levels for {groups} groups (partition.clusters); give one per group"
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) for v in levels):
        return f"levels: expected numbers, got {levels!r:.80}"
    if kind == "invert" and any(v not in (0, 1) for v in levels):
        return "levels: kind 'invert' takes 0 (as is) or 1 (inverted) per group"
    if kind in ("noise", "blur") and any(v < 0 for v in levels):
        return f"levels: kind {kind!r} takes levels >= 0"
    if kind == "blur" and max(levels) > 10:
        return "levels: blur sigma above 10 pixels leaves nothing of the image; give sigmas <= 10"
    return None


def group_of(n_clients: int, groups: int) -> np.ndarray:
    """Contiguous blocks: client m is in group m * G // M (the clusters kind's blocks)."""
    return (np.arange(n_clients) * groups // n_clients).astype(np.int64)


def derangements(groups: int, num_classes: int, seed: int) -> np.ndarray:
    """[G, K] label maps: row 0 the identity, every other row a seeded permutation that
    moves every class (a derangement), so no class keeps its meaning across groups."""
    rng = np.random.default_rng([seed, 0x5A1F])
    perms = [np.arange(num_classes)]
    while len(perms) < groups:
        p = rng.permutation(num_classes)
        if num_classes < 2 or not (p == np.arange(num_classes)).any():
            perms.append(p)
    return np.stack(perms).astype(np.int64)


@dataclass
class ShiftPlan:
    """Every client's transform, server side: what the devices are told at assign and
    after a drift (a client that takes another cluster's data takes its transform too)."""

    kind: str
    level: np.ndarray  # float64 [M]
    perm: np.ndarray | None  # int64 [M, K] for kind labels
    seed: int

    @classmethod
    def build(cls, spec: dict, n_clients: int, groups: int, num_classes: int, seed: int) -> ShiftPlan:
        group = group_of(n_clients, groups)
        levels = spec.get("levels") or default_levels(spec["kind"], groups)
        perm = derangements(groups, num_classes, seed)[group] if spec["kind"] == "labels" else None
        return cls(spec["kind"], np.asarray(levels, np.float64)[group], perm, seed)

    def describe(self, group: np.ndarray) -> dict:
        """What the run folder records (shift.json): the transform of each group."""
        out: dict = {"kind": self.kind, "groups": []}
        for g in np.unique(group):
            first = int(np.flatnonzero(group == g)[0])
            entry: dict = {"group": int(g), "clients": int((group == g).sum())}
            if self.perm is None:
                entry["level"] = float(self.level[first])
            else:
                entry["label_map"] = self.perm[first].tolist()
            out["groups"].append(entry)
        return out

    def swap(self, a: int, b: int) -> None:
        self.level[[a, b]] = self.level[[b, a]]
        if self.perm is not None:
            self.perm[[a, b]] = self.perm[[b, a]]

    def meta(self) -> dict:
        return {"kind": self.kind, "seed": self.seed}

    def tensors(self, clients: ArrayLike) -> dict[str, np.ndarray]:
        """Per-client levels (and label maps) for the devices hosting `clients`."""
        clients = np.asarray(clients, dtype=np.int64)
        out = {"shift_level": self.level[clients]}
        if self.perm is not None:
            out["shift_perm"] = self.perm[clients]
        return out


@dataclass(frozen=True)
class ClientShift:
    """One client's transform, device side (torch is imported only here)."""

    kind: str
    level: float
    seed: int  # the client's own noise stream
    perm: np.ndarray | None = None

    def images(self, x: torch.Tensor, split: int = 0) -> torch.Tensor:
        """x: float32 [n, C, H, W] in [0, 1], transformed in place where possible."""
        import torch

        if self.kind == "rotate":
            return rotate(x, self.level)
        if self.kind == "invert":
            return x.neg_().add_(1.0) if self.level else x
        if self.kind == "noise" and self.level > 0:
            gen = torch.Generator().manual_seed(int(np.random.SeedSequence([self.seed, split]).generate_state(1)[0]))
            noise = torch.randn(x.shape, generator=gen).mul_(self.level).to(x.device)
            return x.add_(noise).clamp_(0.0, 1.0)
        if self.kind == "blur" and self.level > 0:
            return blur(x, self.level)
        return x

    def labels(self, y: torch.Tensor) -> torch.Tensor:
        """y: int64 labels; the client's label map applied (identity for image kinds)."""
        import torch

        if self.perm is None:
            return y
        return torch.as_tensor(self.perm, dtype=y.dtype, device=y.device)[y]


def rotate(x: torch.Tensor, degrees: float) -> torch.Tensor:
    """Counter-clockwise rotation of [n, C, H, W] images about their centre: exact for
    multiples of 90 (torch.rot90), else bilinear with black corners (torch's grid_sample;
    torchvision's transforms would be imported into every device process for this)."""
    import torch
    import torch.nn.functional as F

    quarter = degrees / 90.0
    if float(quarter).is_integer():
        return torch.rot90(x, int(quarter) % 4, dims=(-2, -1))
    t = np.deg2rad(degrees)
    h, w = x.shape[-2:]
    # output pixel p samples the input at R(-t) p, in pixel units about the centre
    theta = torch.tensor(
        [[np.cos(t), -np.sin(t) * h / w, 0.0], [np.sin(t) * w / h, np.cos(t), 0.0]], dtype=x.dtype, device=x.device
    )
    grid = F.affine_grid(theta.expand(len(x), 2, 3), list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Gaussian blur of [n, C, H, W] images, sigma in pixels: one separable kernel of
    2 * ceil(3 sigma) + 1 taps (at most the image's size), reflected at the borders."""
    import torch
    import torch.nn.functional as F

    half = min(int(np.ceil(3 * sigma)), (min(x.shape[-2:]) - 1) // 2)
    taps = torch.arange(-half, half + 1, dtype=x.dtype, device=x.device)
    g = torch.exp(-(taps**2) / (2 * sigma**2))
    g = g / g.sum()
    c = x.shape[1]
    x = F.pad(x, (half, half, half, half), mode="reflect")
    x = F.conv2d(x, g.view(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)  # along rows
    return F.conv2d(x, g.view(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)  # along columns


def client_shifts(meta: dict | None, tensors: dict, clients: ArrayLike) -> dict[int, ClientShift]:
    """Rebuild each client's ClientShift from an assign or drift message."""
    if not meta:
        return {}
    clients = np.asarray(clients).reshape(-1)
    levels = np.asarray(tensors["shift_level"], dtype=np.float64).reshape(-1)
    perms = tensors.get("shift_perm")
    seed = int(meta["seed"])
    # what came over the wire is checked before it indexes anything
    if meta["kind"] not in KINDS or len(levels) != len(clients) or not np.isfinite(levels).all():
        raise ValueError(f"malformed shift: kind {meta['kind']!r:.20}, {len(levels)} levels for {len(clients)} clients")
    if perms is not None:
        perms = np.asarray(perms)
        k = perms.shape[-1] if perms.ndim == 2 else 0
        if perms.shape != (len(clients), k) or (np.sort(perms, axis=1) != np.arange(k)).any():
            raise ValueError(f"malformed shift: label maps of shape {perms.shape} are not permutations")
    return {
        int(c): ClientShift(
            str(meta["kind"]),
            float(levels[i]),
            int(np.random.SeedSequence([seed, int(c)]).generate_state(1)[0]),
            None if perms is None else np.asarray(perms[i], dtype=np.int64),
        )
        for i, c in enumerate(clients)
    }
