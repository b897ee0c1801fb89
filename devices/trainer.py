"""Local training and evaluation of a whole cohort of clients in one call.

Batch-10 SGD on a small model is overhead-bound, so a device trains all of its
selected clients at once: their parameters are stacked into one [B, P] tensor and
every SGD step runs `torch.func.vmap` over the cohort. Clients with fewer samples
than the largest one get zero-weight padding, so their extra steps change nothing.
`vectorize=False` runs the textbook per-client loop with the same batches; it is the
reference the benchmark and the tests compare against.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from models.flat import ParamSpec, unflatten


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 1
    batch_size: int = 10
    lr: float = 0.01
    prox_mu: float = 0.0        # FedProx proximal coefficient (0 = plain SGD)
    loss: str = "ce"            # "ce" for classifiers, "mse" for autoencoder reconstruction
    optimizer: str = "sgd"      # "sgd" or "adam" (autoencoder fine-tuning)
    vectorize: bool = True


def _pad(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack variable-length per-client tensors into [B, Nmax, ...] plus their lengths."""
    lengths = torch.tensor([len(t) for t in tensors])
    nmax = int(lengths.max())
    out = tensors[0].new_zeros((len(tensors), nmax) + tuple(tensors[0].shape[1:]))
    for i, t in enumerate(tensors):  # one copy per client, not per sample
        out[i, : len(t)] = t
    return out, lengths


def epoch_batches(lengths: torch.Tensor, batch_size: int, gen: torch.Generator):
    """Per-client shuffled sample order for one epoch, cut into steps.

    Returns order [B, S, batch] (indices into each client's padded data) and
    weight [B, S, batch] (1 for a real sample, 0 for padding)."""
    b, nmax = len(lengths), int(lengths.max())
    steps = math.ceil(nmax / batch_size)
    keys = torch.rand(b, nmax, generator=gen)
    keys[torch.arange(nmax)[None, :] >= lengths[:, None]] = 2.0  # padding sorts last
    order = keys.argsort(dim=1)
    pad = steps * batch_size - nmax
    order = F.pad(order, (0, pad))
    pos = torch.arange(steps * batch_size)[None, :]
    # a client with n samples uses ceil(n/batch) steps: its last batch may be short
    weight = (pos < lengths[:, None]).float()
    return order.view(b, steps, batch_size), weight.view(b, steps, batch_size)


def _sample_loss(out, x, y, kind):
    if kind == "ce":
        return F.cross_entropy(out, y, reduction="none")
    return ((out - x) ** 2).flatten(1).mean(1)


class CohortTrainer:
    """Trains/evaluates stacked client models for one architecture."""

    def __init__(self, model: torch.nn.Module, spec: ParamSpec):
        self.model, self.spec = model, spec

    # -- training -------------------------------------------------------------------
    def train(self, start: torch.Tensor, xs: list[torch.Tensor], ys: list[torch.Tensor],
              cfg: TrainConfig, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Train B clients from start [B, P]; return (trained [B, P], mean loss [B])."""
        if cfg.vectorize:
            return self._train_vmap(start, xs, ys, cfg, gen)
        return self._train_loop(start, xs, ys, cfg, gen)

    def _loss_fn(self, cfg: TrainConfig):
        model, kind, mu = self.model, cfg.loss, cfg.prox_mu

        def loss(params, anchor, x, y, w):
            per_sample = _sample_loss(functional_call(model, params, (x,)), x, y, kind)
            active = w.sum()
            value = (per_sample * w).sum() / active.clamp(min=1.0)
            if mu > 0:  # FedProx: (mu/2)||w - w_global||^2, only on steps that train
                prox = sum(((params[k] - anchor[k]) ** 2).sum() for k in params)
                value = value + 0.5 * mu * prox * (active > 0)
            return value, value.detach()

        return loss

    def _train_vmap(self, start, xs, ys, cfg, gen):
        self.model.train()
        flat = start.clone().float()
        params, anchor = unflatten(flat, self.spec), unflatten(start.float(), self.spec)
        xpad, lengths = _pad(xs)
        ypad, _ = _pad(ys)
        rows = torch.arange(len(xs))[:, None]
        step = vmap(grad(self._loss_fn(cfg), has_aux=True), randomness="different")
        opt = _StackedOptimizer(flat, cfg)
        total, count = torch.zeros(len(xs)), torch.zeros(len(xs))
        for _ in range(cfg.epochs):
            order, weight = epoch_batches(lengths, cfg.batch_size, gen)
            for s in range(order.shape[1]):
                idx, w = order[:, s], weight[:, s]
                grads, loss = step(params, anchor, xpad[rows, idx], ypad[rows, idx], w)
                opt.step(grads, params)
                active = w.sum(1) > 0
                total += loss * active
                count += active
        return flat, total / count.clamp(min=1)

    def _train_loop(self, start, xs, ys, cfg, gen):
        """Reference: one client at a time, torch.optim, same batches as the vmap path."""
        self.model.train()
        out, losses = start.clone().float(), torch.zeros(len(xs))
        lengths = torch.tensor([len(x) for x in xs])
        orders = [epoch_batches(lengths, cfg.batch_size, gen) for _ in range(cfg.epochs)]
        loss_fn = self._loss_fn(cfg)
        for i, (x, y) in enumerate(zip(xs, ys)):
            params = {k: v.clone().requires_grad_(True)
                      for k, v in unflatten(start[i].float(), self.spec).items()}
            anchor = {k: v.detach().clone() for k, v in params.items()}
            opt = (torch.optim.SGD if cfg.optimizer == "sgd" else torch.optim.Adam)(
                params.values(), lr=cfg.lr)
            seen, acc = 0, 0.0
            for order, weight in orders:
                for s in range(order.shape[1]):
                    n = int(weight[i, s].sum())
                    if n == 0:
                        continue
                    idx = order[i, s, :n]
                    opt.zero_grad()
                    value, _ = loss_fn(params, anchor, x[idx], y[idx], torch.ones(n))
                    value.backward()
                    opt.step()
                    seen, acc = seen + 1, acc + float(value.detach())
            out[i] = torch.cat([params[k].detach().reshape(-1) for k in self.spec.names])
            losses[i] = acc / max(seen, 1)
        return out, losses

    # -- evaluation -----------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, stacked: torch.Tensor, xs, ys, chunk: int = 256):
        """Per-client (correct, total, mean loss) of model b on client b's data."""
        self.model.eval()
        xpad, lengths = _pad(xs)
        ypad, _ = _pad(ys)
        params = unflatten(stacked.float(), self.spec)
        fwd = vmap(lambda p, x: functional_call(self.model, p, (x,)))
        correct = torch.zeros(len(xs))
        loss = torch.zeros(len(xs))
        for lo in range(0, xpad.shape[1], chunk):  # chunks bound memory on big test shards
            x, y = xpad[:, lo:lo + chunk], ypad[:, lo:lo + chunk]
            logits = fwd(params, x)
            valid = (torch.arange(lo, lo + x.shape[1])[None, :] < lengths[:, None]).float()
            correct += ((logits.argmax(-1) == y).float() * valid).sum(1)
            ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
            loss += (ce.view_as(valid) * valid).sum(1)
        return correct, lengths.float(), loss / lengths.clamp(min=1)

    @torch.no_grad()
    def losses_of(self, candidates: torch.Tensor, xs, ys) -> torch.Tensor:
        """Loss of each of K candidate models on each client's data: [B, K] (IFCA)."""
        b = len(xs)
        cols = [self.evaluate(candidates[k].expand(b, -1), xs, ys)[2] for k in range(len(candidates))]
        return torch.stack(cols, dim=1)


class _StackedOptimizer:
    """SGD or Adam applied in place to the stacked parameter views."""

    def __init__(self, flat: torch.Tensor, cfg: TrainConfig):
        self.cfg, self.t = cfg, 0
        if cfg.optimizer == "adam":
            self.m, self.v = {}, {}

    @torch.no_grad()
    def step(self, grads: dict, params: dict):
        lr = self.cfg.lr
        if self.cfg.optimizer == "sgd":
            for k, g in grads.items():
                params[k].sub_(g, alpha=lr)  # no temporary the size of the stack
            return
        self.t += 1
        b1, b2, eps = 0.9, 0.999, 1e-8
        for k, g in grads.items():
            m = self.m.setdefault(k, torch.zeros_like(g)).mul_(b1).add_(g, alpha=1 - b1)
            v = self.v.setdefault(k, torch.zeros_like(g)).mul_(b2).addcmul_(g, g, value=1 - b2)
            mhat, vhat = m / (1 - b1 ** self.t), v / (1 - b2 ** self.t)
            params[k].sub_(lr * mhat / (vhat.sqrt() + eps))
