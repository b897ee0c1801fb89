"""Emulated time: task durations on device profiles, round closing, the emulated clock.

FedScale's model is the reference:

* compute time  = 3 * batch_size * steps * ms_per_sample / 1000  (the 3 = forward +
  backward, ms_per_sample being the inference latency per sample);
* transfer time = bytes / bandwidth (+ our one-way latency per message);
* a client whose availability window closes before it finishes drops out;
* over-commitment samples ``ceil(target * factor)`` clients and keeps the fastest
  ``target``;
* the emulated clock advances by each (synchronous) round's duration.

Everything is vectorized numpy over the clients of a round; nothing here does I/O or
talks to processes.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

if TYPE_CHECKING:
    from typing_extensions import NotRequired, TypedDict, Unpack

    from flt.emulator.profiles.windows import Profiles

    class TaskLoad(TypedDict):
        """task_times' keywords, as task_seconds passes them on."""

        batch_size: ArrayLike
        steps: ArrayLike
        bytes_down: ArrayLike
        bytes_up: ArrayLike
        forward_samples: NotRequired[ArrayLike]
        measured_compute_s: NotRequired[ArrayLike | None]
        reference_ms_per_sample: NotRequired[ArrayLike | None]


__all__ = [
    "AUGMENTATION_FACTOR",
    "EmulatedClock",
    "RoundOutcome",
    "TaskTimes",
    "close_round",
    "compute_seconds",
    "overcommit_count",
    "task_seconds",
    "task_times",
    "transfer_seconds",
]

AUGMENTATION_FACTOR = 3.0  # FedScale: backward pass ~2x forward


def compute_seconds(
    ms_per_sample: ArrayLike, batch_size: ArrayLike, steps: ArrayLike, *, factor: float = AUGMENTATION_FACTOR
) -> np.ndarray:
    """FedScale's local-training time: ``factor * batch * steps * ms_per_sample / 1000``.

    All arguments broadcast (per-client ``steps`` for clients with different data sizes).
    """
    ms = np.asarray(ms_per_sample, dtype=np.float64)
    return np.asarray(
        factor * np.asarray(batch_size, dtype=np.float64) * np.asarray(steps, dtype=np.float64) * ms / 1000.0
    )


def transfer_seconds(n_bytes: ArrayLike, bps: ArrayLike, latency_s: ArrayLike = 0.0) -> np.ndarray:
    """Time to move ``n_bytes`` at ``bps`` **bytes**/s plus one-way latency.

    A transfer of 0 bytes is no message at all and takes 0 s (no latency).
    """
    nb = np.asarray(n_bytes, dtype=np.float64)
    bw = np.asarray(bps, dtype=np.float64)
    lat = np.asarray(latency_s, dtype=np.float64)
    if np.any(nb < 0):
        raise ValueError("transfer_seconds: n_bytes must be >= 0")
    if np.any(~(bw > 0)):
        raise ValueError("transfer_seconds: bandwidth must be > 0 bytes/s")
    with np.errstate(invalid="ignore"):
        t = nb / bw + lat
    return np.asarray(np.where(nb > 0, t, 0.0))


@dataclass(frozen=True)
class TaskTimes:
    """Per-client breakdown of one round's task (seconds, arrays aligned with clients)."""

    down_s: np.ndarray
    compute_s: np.ndarray
    up_s: np.ndarray

    @property
    def total_s(self) -> np.ndarray:
        return self.down_s + self.compute_s + self.up_s


def task_times(
    profiles: Profiles,
    clients: ArrayLike,
    *,
    batch_size: ArrayLike,
    steps: ArrayLike,
    bytes_down: ArrayLike,
    bytes_up: ArrayLike,
    forward_samples: ArrayLike = 0,
    measured_compute_s: ArrayLike | None = None,
    reference_ms_per_sample: ArrayLike | None = None,
) -> TaskTimes:
    """Download + local work + upload for each of ``clients`` (see task_seconds).

    ``forward_samples`` adds inference-only work (embedding a shard with an encoder): one
    forward pass per sample, ``ms_per_sample`` each, where a trained sample costs three.
    """
    c = np.asarray(clients, dtype=np.int64).reshape(-1)
    n = c.size
    ms = profiles.ms_per_sample[c]
    down = transfer_seconds(
        np.broadcast_to(np.asarray(bytes_down, np.float64), (n,)), profiles.down_bps[c], profiles.latency_s[c]
    )
    up = transfer_seconds(
        np.broadcast_to(np.asarray(bytes_up, np.float64), (n,)), profiles.up_bps[c], profiles.latency_s[c]
    )
    if measured_compute_s is None:
        comp = compute_seconds(ms, batch_size, np.broadcast_to(np.asarray(steps, np.float64), (n,)))
    else:
        if reference_ms_per_sample is None:
            raise ValueError(
                "task_seconds: measured_compute_s needs reference_ms_per_sample "
                "(the speed of the machine the measurement was taken on)"
            )
        ref = np.asarray(reference_ms_per_sample, dtype=np.float64)
        if np.any(~(ref > 0)):
            raise ValueError("task_seconds: reference_ms_per_sample must be > 0")
        meas = np.broadcast_to(np.asarray(measured_compute_s, dtype=np.float64), (n,))
        if np.any(~(meas >= 0)):
            raise ValueError("task_seconds: measured_compute_s must be >= 0")
        comp = meas * (ms / ref)
    fwd = np.broadcast_to(np.asarray(forward_samples, np.float64), (n,))
    if np.any(fwd > 0):
        comp = comp + compute_seconds(ms, 1, fwd, factor=1.0)
    return TaskTimes(np.asarray(down, np.float64), np.asarray(comp, np.float64), np.asarray(up, np.float64))


def task_seconds(profiles: Profiles, clients: ArrayLike, **times: Unpack[TaskLoad]) -> np.ndarray:
    """Seconds each client needs for a round: download + compute + upload.

    Takes task_times' keywords (``batch_size``, ``steps``, ``bytes_down``, ``bytes_up``,
    optionally ``forward_samples``, ``measured_compute_s`` with ``reference_ms_per_sample``); scalars or
    per-client arrays. Compute is FedScale's formula, or a real measurement on the host
    rescaled to each device's speed (``measured * ms_per_sample / reference``).
    """
    return task_times(profiles, clients, **times).total_s


@dataclass(frozen=True)
class RoundOutcome:
    """How a synchronous round ended.

    kept:       client ids whose results count, in finishing order.
    stragglers: finished, but not counted: after the deadline, or (over-commitment)
                after the K-th finisher; in finishing order.
    dropouts:   went offline before finishing; in input order.
    duration_s: emulated round duration.
    """

    kept: np.ndarray
    stragglers: np.ndarray
    dropouts: np.ndarray
    duration_s: float


def close_round(
    clients: ArrayLike,
    durations: ArrayLike,
    *,
    start_s: float,
    deadline_s: float | None = None,
    keep: int | None = None,
    online_until: ArrayLike | None = None,
) -> RoundOutcome:
    """Decide who counts in a synchronous round and how long it lasted.

    ``clients`` [n] ids, ``durations`` [n] task seconds, ``online_until`` [n] absolute
    end of each client's availability (``Profiles.online_until(clients, start_s)``).

    * A client with ``online_until < start_s + duration`` is a dropout (its window closed
      mid-task; one already offline at ``start_s`` has ``online_until == start_s``).
    * The others finish at ``start_s + duration``; those past ``start_s + deadline_s`` are
      stragglers.  With ``keep=K`` the K earliest in-time finishers are kept (ties broken
      by input order) and later finishers are stragglers too.
    * Duration: the K-th finish when K were kept; else the deadline when some client was
      still running at it; else the slowest kept finish.  With no one kept: the deadline
      if there is one, else until the last dropout went offline (0 with no clients).
      Dropouts never lengthen a round that kept someone (FedScale removes them).
    """
    ids = np.asarray(clients).reshape(-1)
    dur = np.asarray(durations, dtype=np.float64).reshape(-1)
    n = ids.size
    if dur.shape != (n,):
        raise ValueError(f"close_round: {n} clients but {dur.size} durations")
    if np.any(np.isnan(dur)) or np.any(dur < 0):
        raise ValueError("close_round: durations must be >= 0")
    start = float(start_s)
    if deadline_s is not None:
        deadline_s = float(deadline_s)
        if not deadline_s > 0:
            raise ValueError(f"close_round: deadline_s must be > 0, got {deadline_s!r}")
    if keep is not None:
        if isinstance(keep, bool) or not isinstance(keep, numbers.Integral) or keep < 1:
            raise ValueError(f"close_round: keep must be an integer >= 1, got {keep!r}")
        keep = int(keep)

    finish = start + dur
    if online_until is None:
        dropped = np.zeros(n, dtype=bool)
        until = np.full(n, np.inf)
    else:
        until = np.broadcast_to(np.asarray(online_until, dtype=np.float64), (n,))
        dropped = until < finish
    done = ~dropped
    late = done & (finish > start + deadline_s) if deadline_s is not None else np.zeros(n, bool)
    order = np.argsort(finish, kind="stable")
    in_time = order[(done & ~late)[order]]
    kept = in_time if keep is None else in_time[:keep]
    extra = in_time[kept.size :]
    straggler_mask = late.copy()
    straggler_mask[extra] = True
    stragglers = order[straggler_mask[order]]

    if keep is not None and kept.size == keep:
        end = finish[kept[-1]]
    elif deadline_s is not None and late.any():  # only a deadline makes anyone late
        end = start + deadline_s
    elif kept.size:
        end = finish[kept[-1]]
    elif deadline_s is not None:
        end = start + deadline_s
    elif dropped.any():
        end = max(start, float(np.max(until[dropped])))
    else:
        end = start
    return RoundOutcome(
        kept=ids[kept],
        stragglers=ids[stragglers],
        dropouts=ids[np.flatnonzero(dropped)],
        duration_s=float(end - start),
    )


@dataclass
class EmulatedClock:
    """Emulated wall clock in seconds; only moves forward."""

    now_s: float = 0.0

    def advance(self, seconds: float) -> float:
        s = float(seconds)
        if math.isnan(s) or s < 0:
            raise ValueError(f"EmulatedClock.advance: seconds must be >= 0, got {seconds!r}")
        self.now_s += s
        return self.now_s

    def state_dict(self) -> dict[str, Any]:
        return {"now_s": self.now_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.now_s = float(state["now_s"])


def overcommit_count(target: int, factor: float) -> int:
    """Clients to sample for ``target`` results with over-commitment ``factor`` (>= 1).

    ``ceil(target * factor)``, with the product rounded to 9 decimals first so that
    float noise (10 * 1.3 = 13.000000000000002) does not add a client.
    """
    if isinstance(target, bool) or not isinstance(target, numbers.Integral) or target < 0:
        raise ValueError(f"overcommit_count: target must be an integer >= 0, got {target!r}")
    f = float(factor)
    if not (f >= 1.0 and math.isfinite(f)):
        raise ValueError(f"overcommit_count: factor must be >= 1, got {factor!r}")
    return int(math.ceil(round(int(target) * f, 9)))
