"""Which device process runs each client's task: the cohort's work spread evenly.

Every device process of the initial fleet loads the shard indices of all the clients it
was started with (a few hundred kB for a whole partition; the images are one shared
memory map), and *hosts* a block of them: what a client keeps on its device (Local's
model, its change flag, what it embedded, its drifted data) lives on its host alone.
Blocks are dealt by training samples (`host_blocks`), not by id: partitions number their
clients group by group, so contiguous id blocks can give one device most of the data
(S4 on FEMNIST: 10,813 of 12,773 training images on the first of two devices), and a
round of device-resident work (Local's training and evaluation, embedding) waits for it.
A round selects clients at random, so the hosts' shares of the cohort are uneven (20 of
100 clients on 2 devices: the larger share is 1.16x the even one on average), and the
round waits for the largest. A task whose op reads nothing but the client's shard and
what the task carries (`DeviceOp.movable`: training or evaluation of a sent model) may run
on any device that holds the shard, and does, where that evens the work.

Where a task runs never changes its result: each client trains with its own random
streams, alone in its row of the cohort's stacked models (devices/trainer.py), so a
cohort's make-up is invisible in its bytes. The server accepts a client's reply only from
the device it sent that client's task to (server/transport.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import numpy as np


def host_blocks(clients: np.ndarray, samples: np.ndarray, n: int) -> list[np.ndarray]:
    """`clients` split among `n` hosts, equal in count (to one) and close in training
    `samples` (within the largest client's): the clients, heaviest first (ties by id), are
    dealt in snake order (0..n-1, n-1..0, ...). Each block is sorted by id."""
    clients = np.asarray(clients, dtype=np.int64)
    order = clients[np.lexsort((clients, -np.asarray(samples)))]
    lap, seat = np.divmod(np.arange(len(order)), n)
    host = np.where(lap % 2 == 0, seat, n - 1 - seat)
    return [np.sort(order[host == d]) for d in range(n)]


def spread(
    home: Mapping[int, str],
    movable: Collection[int],
    holders: Mapping[int, Collection[str]],
    live: Collection[str],
    cost: Callable[[int], float],
    late: Collection[str] = (),
) -> dict[int, str]:
    """The device each client's task goes to. Every task starts on its client's `home`;
    then, while the most loaded live device (by `cost`: a client's training samples) has a
    `movable` task that another live device holding its shard could take and so lower that
    peak, the move that lowers it most is made. An even cohort stays where it is hosted,
    and a client whose home is not live stays there (lost with its device).

    A `late` device (live, but it left replies owed when an exchange timed out: frozen,
    or cut off) takes no moved task, and its own movable tasks go first to the least
    loaded other holder: sent to it, they would wait out the timeout and be lost, and
    where a task runs does not change its result."""
    dest = dict(home)
    load = dict.fromkeys(sorted(set(live) - set(late)), 0.0)
    for c, d in home.items():
        if d in load:
            load[d] += cost(c)
    by_cost = sorted(movable, key=lambda c: (-cost(c), c))
    for c in (c for c in by_cost if home[c] in late):
        if spare := [d for d in holders.get(c, ()) if d in load]:
            dest[c] = min(spare, key=lambda d: (load[d], d))
            load[dest[c]] += cost(c)
    free = [c for c in by_cost if dest[c] in load]
    while (move := _best_move(dest, free, holders, load, cost)) is not None:
        c, d = move
        load[dest[c]] -= cost(c)
        load[d] += cost(c)
        dest[c] = d
    return dest


def _best_move(
    dest: dict[int, str],
    free: list[int],
    holders: Mapping[int, Collection[str]],
    load: dict[str, float],
    cost: Callable[[int], float],
) -> tuple[int, str] | None:
    """(client, device): the move off the most loaded device that lowers its load's peak
    the most, or None when none does. Each move lowers the sum of squared loads: the
    loop ends."""
    if not free:  # nothing to move (every device that could take a task is late, or none is live)
        return None
    top = max(load, key=lambda d: (load[d], d))
    best: tuple[float, str, int] | None = None
    for c in free:
        if dest[c] != top:
            continue
        for d in holders.get(c, ()):
            if d == top or d not in load:
                continue
            peak = max(load[top] - cost(c), load[d] + cost(c))
            if peak < load[top] and (best is None or (peak, d, c) < best):
                best = (peak, d, c)
    return None if best is None else (best[2], best[1])
