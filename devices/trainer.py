"""Local training and evaluation of a whole cohort of clients in one call.

Batch-10 SGD on a small model is overhead-bound, so a device trains all of its
selected clients at once: their parameters are stacked into one [B, P] tensor and
every SGD step runs over the whole cohort. Clients with fewer samples than the largest
one get zero-weight padding, so their extra steps change nothing. A plain stack of
layers (the MLP: Flatten, Linear, ReLU, dropout) with cross-entropy and SGD takes a
hand-written backward pass on the CPU (`_StackSGD`); any other model, loss or optimizer
takes `torch.func.vmap(grad(...))`. `vectorize=False` runs the textbook per-client loop
with the same batches; it is the reference the benchmark and the tests compare against.

Every random draw (batch order, dropout masks) comes from the client's own generator,
and padding changes nothing, so a client's result does not depend on which device or
cohort it shares: reruns with another number of device processes give the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeGuard

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from flt.models.flat import ParamSpec, unflatten

# (params, anchor, x, y, w, noise) -> (loss, loss detached): one client's loss, `grad`-able in params
_LossFn = Callable[
    [
        dict[str, torch.Tensor],
        dict[str, torch.Tensor],
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        dict[str, torch.Tensor],
    ],
    tuple[torch.Tensor, torch.Tensor],
]
# (x, y, w, noise) -> each client's loss [B]: one SGD step of the whole cohort, in place
_StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 1
    batch_size: int = 10
    lr: float = 0.01
    prox_mu: float = 0.0  # FedProx proximal coefficient (0 = plain SGD)
    momentum: float = 0.0  # SGD momentum (torch's: buf = momentum * buf + g; w -= lr * buf)
    loss: str = "ce"  # "ce" for classifiers, "mse" for autoencoder reconstruction
    optimizer: str = "sgd"  # "sgd" or "adam" (autoencoder fine-tuning)
    vectorize: bool | str = True  # or "auto": see use_vmap


def _pad(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack variable-length per-client tensors into [B, Nmax, ...] plus their lengths."""
    lengths = torch.tensor([len(t) for t in tensors])
    nmax = int(lengths.max())
    out = tensors[0].new_zeros((len(tensors), nmax, *tuple(tensors[0].shape[1:])))
    for i, t in enumerate(tensors):  # one copy per client, not per sample
        out[i, : len(t)] = t
    return out, lengths


# how much of the cohort's weights _StackSGD updates in one pass over the steps: groups of
# 4 to 6 MLP clients (2.5 - 3.8 MB) ran 20 clients 25 - 40 % faster than all 20 at once
# (12.7 MB) on the 2-core development machine (benchmarks/README.md); each group costs its
# own per-step overhead, so the largest of those
STACK_CACHE_BYTES = 4 << 20


def _aligned_rows(start: torch.Tensor) -> torch.Tensor:
    """A float32 copy of the stacked models [B, P] whose rows start every 64 bytes (a row
    stride padded to 16 floats). The weights are views into it, and a batched product
    that writes into weights at an odd row stride ran 6 to 8 times slower on a CPU (the
    MLP's P = 159,010: 8 bytes off per client)."""
    b, p = start.shape
    rows = torch.empty((b, p + (-p % 16)), dtype=torch.float32, device=start.device)
    flat = rows[:, :p]
    flat.copy_(start)
    return flat


def _floats(x: torch.Tensor) -> torch.Tensor:
    """Images as the model takes them: a device's shards arrive as stored (uint8, scaled
    here per batch: x.float() / 255, the values the whole shard would have had), or
    already float (a feature shift made them)."""
    return x.float().div_(255) if x.dtype == torch.uint8 else x


def epoch_batches(
    lengths: torch.Tensor, batch_size: int, gens: Sequence[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-client shuffled sample order for one epoch, cut into steps; client i's order
    is drawn from gens[i] alone.

    Returns order [B, S, batch] (indices into each client's padded data) and
    weight [B, S, batch] (1 for a real sample, 0 for padding)."""
    b, nmax = len(lengths), int(lengths.max())
    steps = math.ceil(nmax / batch_size)
    order = torch.zeros(b, steps * batch_size, dtype=torch.int64)
    for i, (n, g) in enumerate(zip(lengths.tolist(), gens, strict=True)):  # one draw per client
        order[i, :n] = torch.randperm(n, generator=g)
    pos = torch.arange(steps * batch_size)[None, :]
    # a client with n samples uses ceil(n/batch) steps: its last batch may be short
    weight = (pos < lengths[:, None]).float()
    return order.view(b, steps, batch_size), weight.view(b, steps, batch_size)


def _generators(gens: torch.Generator | Sequence[torch.Generator], b: int) -> list[torch.Generator]:
    """One generator per client; a single shared one (benchmarks) is drawn in client order."""
    return [gens] * b if isinstance(gens, torch.Generator) else list(gens)


class SeededDropout(torch.nn.Module):
    """Dropout whose uniform noise is an input (buffer `noise`, [batch, *features]) drawn
    from each client's own generator, instead of the global generator that vmap shares
    across the cohort."""

    noise: torch.Tensor  # the buffer registered below

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.register_buffer("noise", torch.zeros(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return x * (self.noise >= self.p).to(x.dtype) / (1.0 - self.p)


def _seed_dropouts(model: torch.nn.Module) -> list[str]:
    """Replace every nn.Dropout by SeededDropout; return their module names."""
    names = []
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if type(child) is torch.nn.Dropout:
                setattr(mod, child_name, SeededDropout(child.p))
                names.append(f"{name}.{child_name}" if name else child_name)
    return names


def _sample_loss(out: torch.Tensor, x: torch.Tensor, y: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "ce":
        return F.cross_entropy(out, y, reduction="none")
    return ((out - x) ** 2).flatten(1).mean(1)


def use_vmap(setting: bool | str, model: torch.nn.Module, device: torch.device) -> bool:
    """`train.vectorize`; "auto" takes what benchmarks/bench_cohort.py measured faster: the
    vmapped cohort on a GPU (8x to 27x over the loop on an H200) and for the MLP on a CPU
    (there the cohort takes _StackSGD, 3x the loop), the per-client loop for convolutional
    models on a CPU (1.3x to 1.6x faster there: vmapped convolutions lose their batched
    kernels)."""
    if setting != "auto":
        return bool(setting)
    if device.type == "cuda":
        return True
    return not any(isinstance(m, torch.nn.Conv2d) for m in model.modules())


class CohortTrainer:
    """Trains/evaluates stacked client models for one architecture."""

    def __init__(self, model: torch.nn.Module, spec: ParamSpec):
        self.model, self.spec = model, spec
        self.dropouts = _seed_dropouts(model)
        self._noise_shapes: dict[str, tuple] | None = None

    def _epoch_noise(
        self, lengths: torch.Tensor, steps: int, batch_size: int, gens: Sequence[torch.Generator], sample: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Uniform noise [B, S, batch, *features] for every dropout layer, client i's
        drawn from gens[i] (its padding steps get zeros and never train)."""
        out = {}
        for name, shape in self._dropout_shapes(sample).items():
            noise = torch.zeros((len(gens), steps * batch_size, *shape))
            for i, (n, g) in enumerate(zip(lengths.tolist(), gens, strict=True)):
                noise[i, :n].uniform_(generator=g)  # torch.rand's values, drawn in place
            out[f"{name}.noise"] = noise.view((len(gens), steps, batch_size, *shape))
        return out

    def _dropout_shapes(self, sample: torch.Tensor) -> dict[str, tuple]:
        """Feature shape at each dropout layer, from one dry forward of one sample."""
        if self._noise_shapes is None:
            shapes: dict[str, tuple] = {}
            hooks = [
                self.model.get_submodule(n).register_forward_pre_hook(
                    lambda mod, args, n=n: shapes.__setitem__(n, tuple(args[0].shape[1:]))
                )
                for n in self.dropouts
            ]
            try:
                with torch.no_grad():
                    self.model.eval()(_floats(sample[:1]))
            finally:
                for h in hooks:
                    h.remove()
            self._noise_shapes = shapes
        return self._noise_shapes

    # -- training -------------------------------------------------------------------
    def train(
        self,
        start: torch.Tensor,
        xs: list[torch.Tensor],
        ys: list[torch.Tensor],
        cfg: TrainConfig,
        gens: torch.Generator | Sequence[torch.Generator],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Train B clients from start [B, P]; return (trained [B, P], mean loss [B]).
        `xs`: each client's images, uint8 (scaled per batch) or float. `gens`: one
        torch.Generator per client (its batch order and dropout)."""
        per_client = _generators(gens, len(xs))
        if not use_vmap(cfg.vectorize, self.model, start.device):
            return self._train_loop(start, xs, ys, cfg, per_client)
        if start.device.type != "cpu" or not _StackSGD.fits(self.model, cfg):
            return self._train_vmap(start, xs, ys, cfg, per_client)
        # _StackSGD rewrites every client's weights each step: in groups whose weights fit
        # in a CPU's cache (results are the same: a client's arithmetic ignores its cohort)
        groups = min(len(xs), math.ceil(len(xs) * start.shape[1] * 4 / STACK_CACHE_BYTES))
        bounds = [(int(g[0]), int(g[-1]) + 1) for g in torch.arange(len(xs)).tensor_split(groups)]
        parts = [  # start[lo:hi] is a view: _aligned_rows makes the group's one copy
            self._train_vmap(start[lo:hi], xs[lo:hi], ys[lo:hi], cfg, per_client[lo:hi]) for lo, hi in bounds
        ]
        return torch.cat([w for w, _ in parts]), torch.cat([loss for _, loss in parts])

    def _loss_fn(self, cfg: TrainConfig) -> _LossFn:
        model, kind, mu = self.model, cfg.loss, cfg.prox_mu

        def loss(
            params: dict[str, torch.Tensor],
            anchor: dict[str, torch.Tensor],
            x: torch.Tensor,
            y: torch.Tensor,
            w: torch.Tensor,
            noise: dict[str, torch.Tensor],
        ) -> tuple[torch.Tensor, torch.Tensor]:
            per_sample = _sample_loss(functional_call(model, {**params, **noise}, (x,)), x, y, kind)
            active = w.sum()
            value = (per_sample * w).sum() / active.clamp(min=1.0)
            if mu > 0:  # FedProx: (mu/2)||w - w_global||^2, only on steps that train
                prox = sum(((params[k] - anchor[k]) ** 2).sum() for k in params)
                value = value + 0.5 * mu * prox * (active > 0)
            return value, value.detach()

        return loss

    def _train_vmap(
        self,
        start: torch.Tensor,
        xs: list[torch.Tensor],
        ys: list[torch.Tensor],
        cfg: TrainConfig,
        gens: list[torch.Generator],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        flat = _aligned_rows(start)
        params, anchor = unflatten(flat, self.spec), unflatten(start.float(), self.spec)
        if start.device.type == "cpu" and _StackSGD.fits(self.model, cfg):
            # the MLP on a CPU: the same SGD without a gradient the size of the cohort's models
            stack = _StackSGD(self.model, params, anchor, cfg)
            losses = self._cohort_sgd(xs, ys, cfg, gens, stack.step)
            return flat.contiguous(), losses  # after training: contiguous() copies
        # "error": any random op left in the model would draw from a generator the whole
        # cohort shares, and make a client's result depend on its cohort
        grads_of = vmap(grad(self._loss_fn(cfg), has_aux=True), randomness="error")
        opt = _StackedOptimizer(flat, cfg)

        def step(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, noise: dict[str, torch.Tensor]) -> torch.Tensor:
            grads, loss = grads_of(params, anchor, x, y, w, noise)
            opt.step(grads, params, w.sum(1) > 0)
            return loss

        losses = self._cohort_sgd(xs, ys, cfg, gens, step)
        return flat.contiguous(), losses

    def _cohort_sgd(
        self,
        xs: list[torch.Tensor],
        ys: list[torch.Tensor],
        cfg: TrainConfig,
        gens: list[torch.Generator],
        step: _StepFn,
    ) -> torch.Tensor:
        """Every SGD step of the cohort, `step(x [B, b, ...], y [B, b], w [B, b], noise)`
        training all clients in place; returns each client's mean loss [B]. Batches and
        dropout noise are drawn on the CPU from each client's generator (a GPU run draws the
        same) as _train_loop draws them; padding has weight 0. Each step's images are
        gathered into the same two buffers (a fresh batch per step cost a page fault per
        4 kB: large blocks come from mmap, common/heap.py)."""
        xpad, lengths = _pad(xs)
        ypad, _ = _pad(ys)
        dev = xpad.device  # the cohort's data decides: CPU, or the GPU it was moved to
        b, nmax, bs = len(xs), xpad.shape[1], cfg.batch_size
        xflat, yflat = xpad.flatten(0, 1), ypad.flatten(0, 1)
        first = torch.arange(b, device=dev)[:, None] * nmax  # each client's first row in xflat
        raw = xflat.new_empty((b * bs, *xflat.shape[1:]))
        x = raw if raw.is_floating_point() else torch.empty(raw.shape, device=dev)
        total, count = torch.zeros(b, device=dev), torch.zeros(b, device=dev)
        for _ in range(cfg.epochs):
            order, weight = (t.to(dev) for t in epoch_batches(lengths, bs, gens))
            noise = self._epoch_noise(lengths, order.shape[1], bs, gens, xs[0])
            noise = {k: v.to(dev) for k, v in noise.items()}
            self.model.train()  # after _epoch_noise, whose first call runs the model in eval mode
            trains = weight.sum(2) > 0  # [B, S]: which clients have a real sample in each step
            for s in range(order.shape[1]):
                at, w = (first + order[:, s]).view(-1), weight[:, s]
                torch.index_select(xflat, 0, at, out=raw)
                if x is not raw:
                    x.copy_(raw).div_(255)  # _floats, in place
                xb = x.view(b, bs, *x.shape[1:])
                loss = step(xb, yflat[at].view(b, bs), w, {k: v[:, s] for k, v in noise.items()})
                active = trains[:, s]
                total += loss * active
                count += active
        return total / count.clamp(min=1)

    def _train_loop(
        self,
        start: torch.Tensor,
        xs: list[torch.Tensor],
        ys: list[torch.Tensor],
        cfg: TrainConfig,
        gens: list[torch.Generator],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference: one client at a time, torch.optim, same batches and dropout masks
        as the vmap path."""
        out, losses = start.clone().float(), torch.zeros(len(xs))
        lengths, dev = torch.tensor([len(x) for x in xs]), xs[0].device
        orders = []
        for _ in range(cfg.epochs):  # the same draws, in the same order, as _train_vmap
            order, weight = epoch_batches(lengths, cfg.batch_size, gens)
            orders.append((order, weight, self._epoch_noise(lengths, order.shape[1], cfg.batch_size, gens, xs[0])))
        self.model.train()
        loss_fn = self._loss_fn(cfg)
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            params = {k: v.clone().requires_grad_(True) for k, v in unflatten(start[i].float(), self.spec).items()}
            anchor = {k: v.detach().clone() for k, v in params.items()}
            opt = (
                torch.optim.SGD(params.values(), lr=cfg.lr, momentum=cfg.momentum)
                if cfg.optimizer == "sgd"
                else torch.optim.Adam(params.values(), lr=cfg.lr)
            )
            seen = 0
            acc: torch.Tensor | float = 0.0  # a tensor after the first step
            for order, weight, noise in orders:
                for s in range(order.shape[1]):
                    n = int(weight[i, s].sum())
                    if n == 0:
                        continue
                    idx = order[i, s, :n].to(dev)
                    opt.zero_grad()
                    value, _ = loss_fn(
                        params,
                        anchor,
                        _floats(x[idx]),
                        y[idx],
                        torch.ones(n, device=dev),
                        {k: v[i, s, :n].to(dev) for k, v in noise.items()},
                    )
                    value.backward()
                    opt.step()
                    seen, acc = seen + 1, acc + value.detach()  # no GPU sync per step
            out[i] = torch.cat([params[k].detach().reshape(-1) for k in self.spec.names])
            losses[i] = float(acc) / max(seen, 1)
        return out, losses

    # -- evaluation -----------------------------------------------------------------
    @torch.no_grad()
    def evaluate(
        self,
        stacked: torch.Tensor,
        xs: list[torch.Tensor],
        ys: list[torch.Tensor],
        chunk: int = 256,
        vectorize: bool | str = "auto",
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-client (correct, total, mean loss) of model b on client b's data: one vmapped
        pass over the padded cohort, or client by client (`use_vmap` says no, or "auto" on a
        CPU, whatever the model).

        On a CPU a vmapped row's last bits can depend on the padded row count (on one 2-core
        Xeon, MKL's batched product gave other bits for 11 rows than for 32 in most
        models), so a client's loss would depend on the cohort's largest shard, that is on
        how its clients are split over devices; IFCA's and FLT's picks compare such losses.
        Client by client, a client's figures depend on its own data only, and the loop is
        as fast there (benchmarks/README.md, bench_pick.py)."""
        self.model.eval()
        on_cpu_auto = vectorize == "auto" and stacked.device.type != "cuda"
        if on_cpu_auto or not use_vmap(vectorize, self.model, stacked.device):
            return self._evaluate_loop(stacked, xs, ys, chunk)
        xpad, lengths = _pad(xs)
        ypad, _ = _pad(ys)
        params = unflatten(stacked.float(), self.spec)
        fwd = vmap(lambda p, x: functional_call(self.model, p, (x,)))
        correct = torch.zeros(len(xs), device=xpad.device)
        loss = torch.zeros(len(xs), device=xpad.device)
        for lo in range(0, xpad.shape[1], chunk):  # chunks bound memory on big test shards
            x, y = _floats(xpad[:, lo : lo + chunk]), ypad[:, lo : lo + chunk]
            logits = fwd(params, x)
            hit = (logits.argmax(-1) == y).float()
            ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(hit)
            # each client's sum over its own samples only: how much padding the cohort
            # needs must not change the rounding of a client's loss
            for i, n in enumerate((lengths - lo).clamp(0, x.shape[1]).tolist()):
                correct[i] += hit[i, :n].sum()
                loss[i] += ce[i, :n].sum()
        return correct.cpu(), lengths.float(), loss.cpu() / lengths.clamp(min=1)

    def _evaluate_loop(
        self, stacked: torch.Tensor, xs: list[torch.Tensor], ys: list[torch.Tensor], chunk: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`evaluate` one client at a time, unpadded. The padded pass computes every client
        on as many samples as the cohort's largest: on S4's writers (22 to 805 images)
        that is several times the work, and IFCA's pick does it once per cluster model
        (benchmarks/bench_pick.py). A client's figures depend on its own data only."""
        correct, loss = torch.zeros(len(xs)), torch.zeros(len(xs))
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            params = unflatten(stacked[i].float(), self.spec)
            for lo in range(0, len(x), chunk):
                logits = functional_call(self.model, params, (_floats(x[lo : lo + chunk]),))
                yb = y[lo : lo + chunk]
                correct[i] += (logits.argmax(-1) == yb).sum().item()
                loss[i] += F.cross_entropy(logits, yb, reduction="sum").item()
        lengths = torch.tensor([float(len(x)) for x in xs])
        return correct, lengths, loss / lengths.clamp(min=1)

    @torch.no_grad()
    def losses_of(
        self,
        candidates: torch.Tensor,
        xs: list[torch.Tensor],
        ys: list[torch.Tensor],
        vectorize: bool | str = "auto",
    ) -> torch.Tensor:
        """Loss of each of K candidate models on each client's data: [B, K] (IFCA)."""
        b = len(xs)
        cols = [
            self.evaluate(candidates[k].expand(b, -1), xs, ys, vectorize=vectorize)[2] for k in range(len(candidates))
        ]
        return torch.stack(cols, dim=1)


class _StackSGD:
    """One SGD step of a cohort of plain layer stacks, forward and backward by hand.

    With vmap(grad(...)), every step writes B weight gradients as large as the models
    and reads them again for the update; for batch-10 SGD on the MLP that memory traffic,
    not the arithmetic, is the cost. Here each Linear's update is one in-place batched
    product, W -= lr * dOut^T x, and no gradient of a weight is ever stored (about 1.7x
    the vmap path and 3x the per-client loop for the MLP on one CPU thread,
    benchmarks/README.md). The loss is the vmap path's: each client's weighted mean
    cross-entropy over its real samples, plus FedProx's proximal term."""

    LAYERS = (torch.nn.Flatten, torch.nn.Linear, torch.nn.ReLU, SeededDropout)

    @classmethod
    def fits(cls, model: torch.nn.Module, cfg: TrainConfig) -> TypeGuard[torch.nn.Sequential]:
        return (
            isinstance(model, torch.nn.Sequential)
            and all(type(m) in cls.LAYERS for m in model)
            and any(isinstance(m, torch.nn.Linear) for m in model)
            and not any(isinstance(m, torch.nn.Flatten) for m in list(model)[1:])
            and cfg.loss == "ce"
            and cfg.optimizer == "sgd"
            and not cfg.momentum  # a buffer per client is the gradient-sized memory this class avoids
        )

    def __init__(
        self,
        model: torch.nn.Sequential,
        params: dict[str, torch.Tensor],
        anchor: dict[str, torch.Tensor],
        cfg: TrainConfig,
    ):
        self.layers = list(model.named_children())
        # params: views of the cohort's stacked models, updated in place; anchor: where they started
        self.params, self.anchor, self.cfg = params, anchor, cfg
        # the first Linear needs no gradient for its input: nothing below it learns
        self.first_linear = next(i for i, (_, m) in enumerate(self.layers) if isinstance(m, torch.nn.Linear))

    @torch.no_grad()
    def step(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, noise: dict[str, torch.Tensor]) -> torch.Tensor:
        """Train on batch x [B, b, ...], labels y [B, b], sample weights w [B, b] (0 for
        padding); returns each client's loss [B] before the step."""
        p, h = self.params, x
        saved: list[torch.Tensor | None] = []  # per layer: its input (Linear) or its mask
        for name, layer in self.layers:  # forward, keeping what the backward pass needs
            if isinstance(layer, torch.nn.Flatten):
                h = h.flatten(2)
            elif isinstance(layer, torch.nn.Linear):
                saved.append(h)
                bias = p.get(f"{name}.bias")
                weight_t = p[f"{name}.weight"].transpose(1, 2)
                h = torch.bmm(h, weight_t) if bias is None else torch.baddbmm(bias.unsqueeze(1), h, weight_t)
            elif isinstance(layer, torch.nn.ReLU):
                h = torch.relu(h)
                saved.append(h > 0)
            else:  # SeededDropout: the client's own uniform noise decides what is kept
                rate = float(layer.p)  # type: ignore[arg-type]  # SeededDropout's p, a float
                keep = (noise[f"{name}.noise"] >= rate).to(h.dtype) / (1.0 - rate) if rate else None
                h = h if keep is None else h * keep
                saved.append(keep)
        logp = torch.log_softmax(h, -1)
        active = w.sum(1)
        per_client = w / active.clamp(min=1.0).unsqueeze(1)  # each client's mean over its real samples
        loss = -(logp.gather(-1, y.unsqueeze(-1)).squeeze(-1) * per_client).sum(1)
        grad = logp.exp_()  # d loss / d logits = (softmax - onehot(y)) * per-sample weight
        grad.scatter_add_(-1, y.unsqueeze(-1), torch.full((*y.shape, 1), -1.0, dtype=grad.dtype))
        grad.mul_(per_client.unsqueeze(-1))
        prox_value, prox_grads = self._proximal(active > 0)
        for i, (name, layer) in reversed(list(enumerate(self.layers))):
            if isinstance(layer, torch.nn.Linear):
                saved_in = saved.pop()
                assert saved_in is not None  # a Linear saved its input, never None
                weight = p[f"{name}.weight"]
                grad_in = torch.bmm(grad, weight) if i > self.first_linear else None  # before the weight moves
                weight.baddbmm_(grad.transpose(1, 2), saved_in, alpha=-self.cfg.lr)
                if f"{name}.bias" in p:
                    p[f"{name}.bias"].sub_(grad.sum(1), alpha=self.cfg.lr)
                if grad_in is None:
                    break
                grad = grad_in
            elif isinstance(layer, (torch.nn.ReLU, SeededDropout)):
                mask = saved.pop()
                grad = grad if mask is None else grad * mask
        for k, g in prox_grads.items():
            self.params[k].sub_(g, alpha=self.cfg.lr)
        return loss + prox_value

    def _proximal(self, active: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """FedProx: (mu/2)||w - w_global||^2 on the clients this step trains, and its
        gradient mu (w - w_global), from the weights before the step (applied after it)."""
        mu = self.cfg.prox_mu
        if mu <= 0:
            return torch.zeros(len(active)), {}
        on = active.to(torch.float32)
        value, grads = torch.zeros(len(active)), {}
        for k, v in self.params.items():
            diff = (v - self.anchor[k]) * on.view((-1,) + (1,) * (v.dim() - 1))
            value += (diff * diff).flatten(1).sum(1)
            grads[k] = diff.mul_(mu)
        return 0.5 * mu * value, grads


class _StackedOptimizer:
    """SGD or Adam applied in place to the stacked parameter views."""

    def __init__(self, flat: torch.Tensor, cfg: TrainConfig):
        self.cfg = cfg
        self.t: torch.Tensor | int = 0  # Adam: each client's step count [B], a tensor from the first step
        self.buf: dict[str, torch.Tensor] = {}  # SGD momentum: each client's buffer
        if cfg.optimizer == "adam":
            self.m: dict[str, torch.Tensor] = {}
            self.v: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor], params: dict[str, torch.Tensor], active: torch.Tensor) -> None:
        """`active` [B]: clients with a real sample in this step. A padding step has zero
        gradient, which leaves SGD unchanged, but Adam must skip it outright."""
        lr = self.cfg.lr
        if self.cfg.optimizer == "sgd" and not self.cfg.momentum:
            for k, g in grads.items():
                params[k].sub_(g, alpha=lr)  # no temporary the size of the stack
            return
        if self.cfg.optimizer == "sgd":  # momentum: a client without a sample this step skips it
            for k, g in grads.items():
                on = active.view((-1,) + (1,) * (g.dim() - 1))
                buf = self.buf.setdefault(k, torch.zeros_like(g))
                buf.copy_(torch.where(on, self.cfg.momentum * buf + g, buf))
                params[k].sub_(torch.where(on, lr * buf, 0.0))
            return
        steps = self.t + active.double()  # each client's own step count
        self.t = steps
        b1, b2, eps = 0.9, 0.999, 1e-8
        for k, g in grads.items():
            on = active.view((-1,) + (1,) * (g.dim() - 1))
            t = steps.clamp(min=1).view_as(on)
            m = self.m.setdefault(k, torch.zeros_like(g))
            v = self.v.setdefault(k, torch.zeros_like(g))
            m.copy_(torch.where(on, b1 * m + (1 - b1) * g, m))
            v.copy_(torch.where(on, b2 * v + (1 - b2) * g * g, v))
            mhat, vhat = m / (1 - b1**t).float(), v / (1 - b2**t).float()
            params[k].sub_(torch.where(on, lr * mhat / (vhat.sqrt() + eps), 0.0))
