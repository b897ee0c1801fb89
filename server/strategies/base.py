"""What every strategy is: the server-side half of a federated method.

A strategy is pure server logic: it never touches sockets, the byte ledger or the file
system. Each round the server asks it what the selected clients should receive
(`train_tasks`), hands back what they returned (`aggregate`), and asks which model each
client is evaluated with (`eval_models`). One-off work before round 1 (FLT's FCR, IFCA's
warm-up) goes in `setup`, which may call what `FederationView` names and nothing else.
What it found that is worth a file (FCR's adjacency, its plots) it `emit`s as an
`Artifact`; the reporting layer (reports/writer.py) writes it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import numpy as np
import torch
from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

from flt.common.schema import ConfigError, Field, validate
from flt.reports.artifacts import Artifact
from flt.server.checkpoint import restore_vars
from flt.server.exchange import Call, Exchange, Reply
from flt.server.ops import EVALUATE, TRAIN, DeviceOp
from flt.server.strategies.params import METHODS

log = logging.getLogger("flt.server")


@dataclass
class Task:
    """One selected client's training task. `op` is the device operation that trains:
    the built-in TRAIN (one model in, one out) or the method's own (server/ops.py, run by
    devices/methods/<name>.py), declared in the method's DEVICE_OPS; a round may mix ops.
    `models` [K, P] is what travels (K > 1 only for an op that picks among candidates;
    None: nothing does)."""

    models: torch.Tensor | None
    meta: dict = field(default_factory=dict)
    op: DeviceOp = TRAIN


@dataclass
class Result:
    model: torch.Tensor | None  # [P] on the server's device; None for device-resident models
    n: int  # training samples
    meta: dict


def _no_public_images(source: dict) -> np.ndarray:
    raise ValueError("this federation has no public image set")


@dataclass
class Context:
    """What a strategy knows about the federation at construction time."""

    init: torch.Tensor  # [P] initial weights (same for every method of a run)
    n_clients: int
    n_train: np.ndarray  # [M] training samples per client
    device: torch.device  # where aggregation runs (CUDA when present)
    seed: int
    truth: np.ndarray  # [M] planted cluster per client, -1 where unknown
    train: dict  # the scenario's train section (epochs, lr, batch_size, ...)
    # uint8 [N, C, H, W] images no client trains on, for an encoder spec ({dataset, root}):
    # the held-out public slice or another dataset (server/encoder.py: image_source)
    public_images: Callable[[dict], np.ndarray] = _no_public_images
    in_shape: tuple[int, ...] = ()  # one image's shape (C, H, W)
    num_classes: int = 0


class FederationView(Protocol):
    """What a strategy may call on the federation (server/federation.py implements it).
    Every call is one exchange whose bytes are counted by kind. Training, embedding and a
    method's own ops are also priced on the emulated clock; `evaluate` is the emulator's
    measurement and is not. One-off exchanges (`embed`, `run`, `train` with a purpose) are
    reported as events of the round."""

    @property
    def present(self) -> np.ndarray:
        """Clients in the population now (arrivals included, lost devices' clients not)."""
        ...

    def train(
        self,
        rnd: int,
        tasks: dict[int, Task],
        delays: dict[int, float] | None = None,
        timeout_s: float | None = None,
        purpose: str | None = None,
    ) -> Exchange[Result]: ...

    def evaluate(
        self, rnd: int, clients: np.ndarray, models: torch.Tensor | None, rows: np.ndarray
    ) -> dict[int, dict]: ...

    def embed(
        self,
        rnd: int,
        clients: np.ndarray,
        tensors: dict[str, np.ndarray],
        meta: dict,
        purpose: str = "fcr",
        again: Collection[int] = (),
    ) -> Exchange[tuple[np.ndarray, np.ndarray, dict[str, np.ndarray] | None]]: ...  # centroids, shares, halves

    def run(
        self,
        op: DeviceOp,
        rnd: int,
        calls: dict[int, Call],
        purpose: str | None = None,
        *,
        timeout_s: float | None = None,
        again: Collection[int] = (),
    ) -> Exchange[Reply]:
        """Any device op the method declared (FLT's `choose`): one task per client, the
        replies checked by the op's check. `again`: clients asked once more what they left
        unanswered; their tasks are not billed (a broken device must not cost the method
        traffic)."""
        ...


class Strategy:
    name = "base"
    PARAMS: dict[str, Field] = {}
    # the device half: every operation the method's tasks name (server/ops.py; the device
    # runs devices/ops.py's or devices/methods/<name>.py); the run refuses any other
    DEVICE_OPS: tuple[DeviceOp, ...] = (TRAIN, EVALUATE)
    TRANSIENT = ("ctx", "artifacts", "notes")  # given at construction / written out every round

    def __init__(self, ctx: Context, **params: object):
        """`params`: the scenario's entry for this method; validated here against PARAMS
        (defaults filled, a wrong field named) and `check_params`, so a strategy built in
        code gets the same answers a scenario file does."""
        self.ctx = ctx
        self.params = validate(params, self.PARAMS, self.name)
        if problem := self.check_params(self.params):
            raise ConfigError(f"{self.name}: {problem}")
        self.artifacts: list[Artifact] = []
        self.notes: list[str] = []  # lines for the person at the terminal (`take_notes`)

    @classmethod
    def check_params(cls, params: dict) -> str | None:
        """Cross-field rules the schema cannot say (the registry's `check`, run by the
        scenario's validation too); returns the problem, or None."""
        check = METHODS[cls.name].check if cls.name in METHODS else None
        return check(params) if check else None

    def warn_if_warmup_fills_the_run(self, consequence: str) -> None:
        """A `warmup_rounds` of T or more leaves the method as FedAvg for the whole run
        (CFL's default 20 on a 20-round scenario); say so once, at the start."""
        warmup, total = int(self.params.get("warmup_rounds", 0)), int(self.ctx.train.get("rounds", 0))
        if total and warmup >= total:
            log.warning("%s: warmup_rounds %d >= train.rounds %d: %s", self.name, warmup, total, consequence)

    @classmethod
    def max_upload(cls, params: dict, in_shape: tuple[int, ...], num_classes: int) -> int:
        """Bytes of the largest reply the method's own device ops send, when that can
        exceed one model (the transport refuses anything larger than both, unread)."""
        return 0

    def watch_encoder(self) -> Call | None:
        """The encoder the devices test their clients' data changes with (devices/watch.py),
        given back to them on resume with what each tests against; None: no change test."""
        return None

    def setup(self, fed: FederationView) -> None:
        """One-off work before the first round."""

    def train_tasks(self, rnd: int, selected: np.ndarray) -> dict[int, Task]:
        raise NotImplementedError

    def aggregate(self, rnd: int, results: dict[int, Result]) -> None:
        raise NotImplementedError

    def eval_models(self, clients: np.ndarray) -> tuple[torch.Tensor | None, np.ndarray]:
        """(models [R, P], row of each client); models None means 'device-resident'."""
        raise NotImplementedError

    def observe(self, rnd: int, results: dict[int, Result]) -> None:
        """Every reply that arrived this round, before the clock drops stragglers: what a
        reply says about its client (FLT's change flag) counts even when it came late."""

    def on_arrival(self, rnd: int, clients: np.ndarray, fed: FederationView) -> dict | None:
        """Newcomers joined before this round (their devices are connected)."""
        return None

    def on_notice(self, rnd: int, clients: np.ndarray) -> None:
        """Devices reported, unprompted, that these clients' data moved (their own test,
        devices/watch.py; only a method whose device half watches gets any)."""

    def maintain(self, rnd: int, fed: FederationView) -> list[dict]:
        """After aggregation: periodic or triggered work (FLT's re-clustering); returns events."""
        return []

    def summary(self) -> dict:
        """Extra figures for summary.json (cluster quality, ...)."""
        return {}

    def expected_bytes(self, selections: int, model_bytes: int) -> dict | None:
        """The paper's analytical payload figure (its communication-complexity table:
        FLT M*W_enc + k*M*e + 2*rho*M*W_local*T, FedSEM 2*rho*M*W_local*T, IFCA
        rho*M*W_local*T*(C+1)), with rho*M*T taken
        as the number of client selections actually made over the run."""
        return None

    def state_dict(self) -> dict:
        """What the rounds changed, for a checkpoint: every attribute but TRANSIENT ones,
        so a new attribute is saved without a hand-written list. Values must be tensors,
        numpy arrays, random generators or plain Python values (server/checkpoint.py
        stores them without pickle and refuses, by name, anything else)."""
        return {k: v for k, v in vars(self).items() if k not in self.TRANSIENT}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()` on a freshly constructed strategy (setup skipped)."""
        restore_vars(self, state)

    def emit(self, artifact: Artifact) -> None:
        """Hand `artifact` to the reporter (written after this hook returns)."""
        self.artifacts.append(artifact)

    def take_artifacts(self) -> list[Artifact]:
        """The artifacts emitted since the last call (the server's reporter writes them)."""
        out, self.artifacts = self.artifacts, []
        return out

    def take_notes(self) -> list[str]:
        """Lines written since the last call (FLT: what each clustering found), which the
        round loop prints: a minutes-long set-up should end with what it found."""
        out, self.notes = self.notes, []
        return out

    # -- helpers shared by the strategies -------------------------------------------------
    def on(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.ctx.device)


def weighted_average(models: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_i w_i x_i / sum_i w_i as one matrix product: the result does not depend on the
    order in which clients finished (no in-place running average)."""
    w = weights.to(models.dtype)
    return (w / w.sum()) @ models


def cluster_average(
    models: torch.Tensor, n: torch.Tensor, responsibilities: torch.Tensor, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """The M-step of every clustered method: cluster c's model is
        W_c = sum_b r_cb n_b w_b / sum_b r_cb n_b
    over client models `models` [B, P] with sample counts `n` [B] and responsibilities
    [C, B], hard (one-hot columns, `one_hot`) or soft (columns summing to 1), as one
    matrix product. A cluster with no mass this round keeps its row of `keep` [C, P]
    (zeros without it)."""
    weights = responsibilities.to(models.dtype) * n.to(models.dtype)[None, :]  # [C, B]
    mass = weights.sum(1)
    hit = mass > 0
    out = (
        torch.zeros(len(weights), models.shape[1], dtype=models.dtype, device=models.device)
        if keep is None
        else keep.clone()
    )
    out[hit] = (weights[hit] / mass[hit, None]) @ models
    return out


def one_hot(labels: np.ndarray | list[int], clusters: int, like: torch.Tensor) -> torch.Tensor:
    """Hard responsibilities [C, B]: 1 where client b belongs to cluster labels[b]."""
    idx = torch.as_tensor(labels, device=like.device)
    r = torch.zeros(clusters, len(idx), dtype=like.dtype, device=like.device)
    r[idx, torch.arange(len(idx), device=like.device)] = 1
    return r


def stack(
    results: dict[int, Result], clients: Sequence[int] | np.ndarray, consume: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Models [n, P] and sample counts [n] of `clients`, in that order. `consume` pops
    each client's result from `results` once its row is copied, so that the replies and
    the stack are never both held whole (FedGroup's pre-training: 100 CNNs, 2.6 GB)."""
    missing = [c for c in clients if results[c].model is None]
    if missing:  # a device-resident model (Local) never reaches the server
        raise ValueError(f"clients {missing[:10]} returned no model: nothing to average")
    if not consume:
        models = torch.stack([cast(torch.Tensor, results[c].model) for c in clients])  # none is None: checked above
        return models, torch.tensor([float(results[c].n) for c in clients], device=models.device)
    first = cast(torch.Tensor, results[clients[0]].model)  # no model is None: checked above
    models = torch.empty(len(clients), first.numel(), dtype=first.dtype, device=first.device)
    n = torch.empty(len(clients), dtype=torch.float32)
    for i, c in enumerate(clients):
        result = results.pop(c)
        models[i], n[i] = cast(torch.Tensor, result.model), float(result.n)
    return models, n.to(models.device)


def agreement(found: np.ndarray, truth: np.ndarray) -> dict:
    """ARI and NMI of found clusters against the truth (clients with truth -1 excluded)."""
    known = truth >= 0
    if known.sum() < 2:
        return {}
    return {
        "ari": float(adjusted_rand_score(truth[known], found[known])),
        "nmi": float(normalized_mutual_info_score(truth[known], found[known])),
    }
