"""Who takes part, when, and for how long: the emulated population.

- Participation: each round a fraction rho of the clients present is drawn; the draw
  depends only on (seed, round, the clients present), so every method sees the same.
  `sampling: available` draws only among clients online at the round's start.
- Device clock: every kept client's task takes download + compute + upload time from
  its device profile (FedScale's model, emulator/clock.py); the round ends at the
  slowest kept client or at the deadline; stragglers and clients whose availability
  window closes mid-task are dropped (their bytes still count). Over-commitment draws
  ceil(k * factor) clients and keeps the k fastest. Every other exchange a method
  starts (FLT's FCR, a re-clustering) is priced the same way through `price`, so
  one-off work costs emulated time too.
- Arrivals and drift: scheduled newcomers (a planted cluster withheld until a round,
  joining as a new device process) and drifting clients (their data swaps with a client
  of another cluster; nothing tells the method: a device notices by itself, see
  devices/watch.py). The emulator supplies the two callbacks that touch processes;
  this class only decides what happens when.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike

from flt.common.schema import ConfigError
from flt.emulator.clock import EmulatedClock, close_round, overcommit_count, task_seconds
from flt.emulator.profiles import Profiles

log = logging.getLogger(__name__)


@dataclass
class Schedule:
    arrivals: dict[int, np.ndarray] = field(default_factory=dict)  # round -> clients joining
    # round -> changes: {"kind": "move", "client": a, "partner": b} (a and b swap their data;
    # a resample is a move inside a's own cluster)
    # or {"kind": "swap_labels", "client": c, "labels": [i, j]} (c's classes i and j trade labels)
    drift: dict[int, list[dict]] = field(default_factory=dict)


def _missing_callback(arg: str, kind: str) -> Callable:
    """Stands in for a callback that was not given: a schedule may hold events that a
    Population built without it never reaches, but reaching one is a bug, said plainly."""

    def fail(rnd: int, *_: object) -> None:
        raise RuntimeError(f"Population: a {kind} event at round {rnd} but no `{arg}` callback was given")

    return fail


class Population:
    def __init__(
        self,
        n_clients: int,
        rho: float,
        seed: int,
        profiles: Profiles | None = None,
        schedule: Schedule | None = None,
        sampling: str = "uniform",
        deadline_s: float | None = None,
        overcommit: float = 1.0,
        batch_size: int = 10,
        arrive: Callable | None = None,
        drift: Callable | None = None,
        realtime: float | None = None,
        n_train: np.ndarray | None = None,
        epochs: int = 1,
    ):
        self.n_clients, self.rho, self.seed = n_clients, rho, seed
        self.profiles, self.schedule = profiles, schedule or Schedule()
        self.sampling, self.deadline_s, self.overcommit = sampling, deadline_s, overcommit
        self.batch_size, self.epochs, self.n_train = batch_size, epochs, n_train
        self.realtime = realtime  # wall seconds per emulated second; None: no real waiting
        self.arrive_cb = arrive or _missing_callback("arrive", "newcomer")
        self.drift_cb = drift or _missing_callback("drift", "drift")
        late = np.concatenate(list(self.schedule.arrivals.values()) or [np.zeros(0, np.int64)])
        self.present = np.ones(n_clients, dtype=bool)
        self.present[late.astype(np.int64)] = False
        self.clock = EmulatedClock()
        self.target = 0
        self.said_deadline = False  # warned that a round's deadline kept nobody

    # -- who ----------------------------------------------------------------------------
    def newcomers(self) -> np.ndarray:
        """Every client the schedule withholds until a later round (whether arrived or not)."""
        return np.concatenate(list(self.schedule.arrivals.values()) or [np.zeros(0, np.int64)]).astype(np.int64)

    def candidates(self, rnd: int) -> np.ndarray:
        return np.flatnonzero(self.present)

    def select(self, rnd: int, candidates: np.ndarray) -> np.ndarray:
        if len(candidates) == 0:
            return candidates
        self.target = max(1, int(round(self.rho * len(candidates))))
        pool = candidates
        if self.sampling == "available" and self.profiles is not None:
            pool = candidates[self.profiles.online(candidates, self.clock.now_s)]
        k = min(len(pool), overcommit_count(self.target, self.overcommit))
        rng = np.random.default_rng([self.seed, rnd, 0xF1])
        return np.sort(rng.choice(pool, size=k, replace=False)) if k else pool[:0]

    # -- what changes -----------------------------------------------------------------
    def drift_after(self, rnd: int) -> bool:
        """Whether any client's data changes after round `rnd` (a checkpoint then keeps
        what FLT's change test compares with)."""
        return any(r > rnd for r in self.schedule.drift)

    def before_round(self, rnd: int) -> list[dict]:
        """Apply this round's drift and connect its newcomers; returns their events (the
        server loop then tells the strategy about the arrivals)."""
        events = []
        if rnd in self.schedule.drift:
            changes = self.schedule.drift[rnd]
            noticed = self.drift_cb(rnd, changes) or []  # what the devices' own tests found
            moved = {c[k] for c in changes for k in ("client", "partner") if k in c}
            events.append(
                {
                    "kind": "drift",
                    "round": rnd,
                    "clients": sorted(moved),
                    "changes": sorted({c["kind"] for c in changes}),
                    "noticed": [int(c) for c in noticed],
                }
            )
        if rnd in self.schedule.arrivals:
            clients = self.schedule.arrivals[rnd]
            self.arrive_cb(rnd, clients)
            self.present[clients] = True
            events.append({"kind": "arrival", "round": rnd, "clients": clients.tolist()})
        return events

    # -- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Who is present, the emulated clock, the last round's target. Participation is
        drawn from a generator seeded by (seed, round) alone and profiles are fixed, so
        no generator state is carried from round to round."""
        return {"present": self.present.copy(), "clock": self.clock.state_dict(), "target": self.target}

    def load_state_dict(self, state: dict, upto: int) -> None:
        """Resume after round `upto`: replay the process side of the arrivals and drift
        scheduled up to it, in order (newcomer device processes, changed shards), then
        take the saved state. The strategy's side of those events is in its own state."""
        for rnd in range(1, upto + 1):
            if rnd in self.schedule.drift:
                self.drift_cb(rnd, self.schedule.drift[rnd])
            if rnd in self.schedule.arrivals:
                self.arrive_cb(rnd, self.schedule.arrivals[rnd])
        present = np.asarray(state["present"], dtype=bool)
        if present.shape != self.present.shape:  # an altered checkpoint: the run's clients are fixed
            raise ValueError(f"population.present: expected {len(self.present)} clients, found {present.size}")
        self.present = present.copy()
        self.clock.load_state_dict(state["clock"])
        self.target = int(state["target"])

    # -- how long -----------------------------------------------------------------------
    def delays(self, rnd: int, tasks: dict) -> dict[int, float] | None:
        """Real-time mode: how long each device really waits before answering (its task's
        emulated duration, scaled), so the server's deadline drops stragglers for real."""
        if self.realtime is None or self.profiles is None or not tasks:
            return None
        clients = np.array(sorted(tasks), dtype=np.int64)
        down = np.array([0 if tasks[c].models is None else tasks[c].models.numel() * 4 for c in clients])
        up = np.array([0 if tasks[c].models is None else tasks[c].models[0].numel() * 4 for c in clients])
        if self.n_train is None:
            raise ValueError("Population: realtime mode with profiles needs n_train (samples per client)")
        steps = np.ceil(self.n_train[clients] / self.batch_size) * self.epochs
        secs = task_seconds(
            self.profiles, clients, batch_size=self.batch_size, steps=steps, bytes_down=down, bytes_up=up
        )
        return {int(c): float(t) * self.realtime for c, t in zip(clients, secs, strict=True)}

    def timeout(self, default_s: float) -> float:
        """The real wait for a round's replies: the scaled deadline in real-time mode."""
        if self.realtime is not None and self.deadline_s is not None:
            return self.deadline_s * self.realtime
        return default_s

    def price(
        self,
        kind: str,
        clients: ArrayLike,
        bytes_down: ArrayLike,
        bytes_up: ArrayLike,
        forward_samples: ArrayLike = 0,
        trained_samples: ArrayLike = 0,
    ) -> tuple[np.ndarray, dict]:
        """Put one exchange on the emulated clock: every answering client downloads, works
        (inference passes and trained samples, FedScale's arithmetic) and uploads.
        Returns (the clients whose replies count, the clock's report: `duration_s`, the
        clock after it as `emulated_s`, stragglers, dropouts); without profiles everyone
        counts and nothing is reported.

        A round (`train`) is synchronous: it ends at the slowest kept client or the
        deadline, drops stragglers and clients whose availability window closes mid-task,
        and with over-commitment keeps the fastest. Any other exchange (FCR's encoder and
        centroids, a re-embedding) waits for every reply: a client cut off there would be
        left without a cluster for the whole run."""
        ids = np.asarray(clients, dtype=np.int64).reshape(-1)
        if self.profiles is None:
            return ids, {}
        rounds = kind == "train"
        if rounds and not ids.size:  # nobody answered in time: the round lasted its deadline
            self.clock.advance(self.deadline_s or 0.0)
            return ids, {
                "duration_s": self.deadline_s or 0.0,
                "emulated_s": self.clock.now_s,
                "stragglers": 0,
                "dropouts": 0,
            }
        durations = task_seconds(
            self.profiles,
            ids,
            batch_size=1,
            steps=trained_samples,
            forward_samples=forward_samples,
            bytes_down=bytes_down,
            bytes_up=bytes_up,
        )
        if rounds:
            outcome = close_round(
                ids,
                durations,
                start_s=self.clock.now_s,
                deadline_s=self.deadline_s,
                keep=self.target if self.overcommit > 1.0 else None,
                online_until=self.profiles.online_until(ids, self.clock.now_s),
            )
        else:
            outcome = close_round(ids, durations, start_s=self.clock.now_s)
        if rounds and outcome.stragglers.size and not outcome.kept.size:
            self._say_deadline_kept_nobody(float(np.min(durations)))
        self.clock.advance(outcome.duration_s)
        return outcome.kept, {
            "duration_s": outcome.duration_s,
            "emulated_s": self.clock.now_s,
            "stragglers": int(len(outcome.stragglers)),
            "dropouts": int(len(outcome.dropouts)),
        }

    def _say_deadline_kept_nobody(self, fastest_s: float) -> None:
        """Once a method: a deadline no selected client met trains nobody that round, which
        the progress line shows only as '0/n returned'."""
        if self.said_deadline:
            return
        self.said_deadline = True
        log.warning(
            "population.deadline_s: no client of a round finished within %g emulated s (the fastest "
            "needed %.1f s to download, train and upload), so that round trained nobody",
            self.deadline_s,
            fastest_s,
        )


def assign_profiles(spec: dict | None, n_clients: int, seed: int) -> Profiles | None:
    """Device profiles for every client: from a trace file (reused cyclically when it has
    fewer clients), a FedScale pair of files, or seeded distributions."""
    from flt.emulator import profiles as prof

    if spec is None:
        return None
    if spec.get("trace"):
        base = prof.load_trace(spec["trace"])
    elif spec.get("fedscale_capacity"):
        base = prof.import_fedscale(spec["fedscale_capacity"], spec.get("fedscale_behave"))
    else:
        return prof.profiles_from_distribution(
            n_clients, spec.get("distribution") or {}, np.random.default_rng([seed, 0xDE])
        )
    return base.take(np.arange(n_clients) % len(base))


def schedule_from(cfg: dict, truth: np.ndarray, num_classes: int | None = None) -> Schedule:
    """Newcomers: the clients of a planted cluster (or listed ids) withheld until a round.
    Drift `move`: each listed client swaps its data with a client of the target cluster (a
    different one per drifting client), so no sample is duplicated. Drift `resample`: the
    same swap inside each client's own planted cluster (its store changes, its distribution
    does not: the control for a change test's false alarms). Drift `swap_labels`:
    the listed clients' classes i and j trade labels (a concept shift the images do not show).
    Checked against the partition (built before any process starts): a ConfigError names
    the event when its clients do not exist or cannot do what it asks."""
    pop = cfg.get("population") or {}
    sched = Schedule()
    for i, ev in enumerate(pop.get("newcomers") or []):
        sched.arrivals[ev["round"]] = _newcomers(ev, truth, sched, f"population.newcomers[{i}]")
    late = set(np.concatenate(list(sched.arrivals.values())).tolist()) if sched.arrivals else set()
    if len(late) >= len(truth):
        raise ConfigError("population.newcomers: every client arrives late; nobody would train in round 1")
    used: set[int] = set()
    for i, ev in enumerate(pop.get("drift") or []):
        where = f"population.drift[{i}]"
        movers, changes = list(ev["clients"]), sched.drift.setdefault(ev["round"], [])
        if max(movers) >= len(truth):
            raise ConfigError(f"{where}.clients: client {max(movers)} does not exist ({len(truth)} clients)")
        if ev.get("kind", "move") == "swap_labels":
            if num_classes is not None and max(ev["labels"]) >= num_classes:
                raise ConfigError(f"{where}.labels: {ev['labels']} but the dataset has classes 0..{num_classes - 1}")
            changes += [{"kind": "swap_labels", "client": int(c), "labels": list(ev["labels"])} for c in movers]
            continue
        if ev.get("kind", "move") == "resample":
            homeless = [int(c) for c in movers if truth[c] < 0]
            if homeless:
                raise ConfigError(f"{where}: clients {homeless[:10]} have no planted cluster to resample within")
            targets = truth[movers]
        elif (truth[movers] == ev["to_cluster"]).any():
            home = [int(c) for c in movers if truth[c] == ev["to_cluster"]]
            raise ConfigError(
                f"{where}: clients {home} are in cluster {ev['to_cluster']} already: a swap "
                "inside their own cluster changes no client's data distribution (kind: resample "
                "does that on purpose)"
            )
        else:
            targets = np.full(len(movers), ev["to_cluster"])
        for cluster in dict.fromkeys(targets.tolist()):  # each target cluster once, in order
            group = [c for c, t in zip(movers, targets.tolist(), strict=True) if t == cluster]
            swaps = _swaps(group, cluster, truth, late | used | set(movers), where)
            used.update(ch["partner"] for ch in swaps)
            changes += swaps
    return sched


def _swaps(movers: list[int], cluster: int, truth: np.ndarray, busy: set[int], where: str) -> list[dict]:
    """Each mover swaps its data with a different client of `cluster` that is not busy (away
    at the start, drifting itself, or a partner already); the cluster's last free clients."""
    partners = [int(c) for c in np.flatnonzero(truth == cluster) if int(c) not in busy]
    if len(partners) < len(movers):
        raise ConfigError(
            f"{where}: cluster {cluster} has {len(partners)} clients free to "
            f"swap with (present from the start, not drifting), {len(movers)} needed"
        )
    pairs = zip(movers, partners[-len(movers) :], strict=True)
    return [{"kind": "move", "client": int(a), "partner": b} for a, b in pairs]


def _newcomers(ev: dict, truth: np.ndarray, sched: Schedule, where: str) -> np.ndarray:
    """The sorted ids one newcomer event withholds; each client arrives at most once."""
    if ev.get("cluster") is not None:
        ids = np.flatnonzero(truth == ev["cluster"])
        if len(ids) == 0:
            raise ConfigError(f"{where}.cluster: no client belongs to cluster {ev['cluster']}")
    else:
        ids = np.asarray(ev["clients"], dtype=np.int64)
        if ids.max() >= len(truth):
            raise ConfigError(f"{where}.clients: client {ids.max()} does not exist ({len(truth)} clients)")
    if ev["round"] in sched.arrivals or any(np.isin(ids, a).any() for a in sched.arrivals.values()):
        raise ConfigError(f"{where}: a round or a client appears in two newcomer events")
    return np.sort(ids)
