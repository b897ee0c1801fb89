"""Partitioners: who holds which samples, for the paper's scenarios.

Every partitioner returns a :class:`Partition`: per-client int64 index arrays into the
train and test splits, the true cluster of each client (-1 when there is none) and
human-readable notes about anything that did not go as asked (a class running short,
a test shard capped). Shared rules:

* **No duplicates.** A training sample goes to at most one client, once; so does a test
  sample. When a class cannot give every holder what it asked for, holders get a fair
  (water-filled) share of what exists and a note says so; nothing is ever padded with
  repeats or with other classes (two of the mistakes in the authors' code).
* **Deterministic.** Every random choice comes from the ``rng`` passed in, in a fixed
  order, so one seed gives one partition.
* **Vectorized.** Work is per class / per cluster / per client, never per sample.
* **Test shards** come from the test split, only from classes the client holds, in
  proportion to its training class counts (largest-remainder rounding), each class's
  test images split without duplication among its holders and capped by what exists.
* ``exclude`` (boolean mask over the train split, or an index array) removes samples
  from every client, e.g. a public set held out for encoder pretraining.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike

from flt.common.errors import FltError
from flt.common.files import save_npz_atomic
from flt.scenarios.shift import ShiftPlan

__all__ = [
    "Partition",
    "PartitionError",
    "cluster_classes",
    "partition_clusters",
    "partition_dirichlet",
    "partition_groups",
    "partition_iid",
    "partition_structured",
]

_FORMAT_VERSION = 1


class PartitionError(FltError, ValueError):
    """A partition cannot be built as asked (bad arguments, or data too short with on_short='fail')."""


@dataclass(eq=False)
class Partition:
    """Client shards: ``train[m]``/``test[m]`` index the train/test Dataset.

    ``cluster[m]`` is client m's true cluster (-1 when unknown); ``groups[m]``, when set,
    is the natural group (e.g. FEMNIST writer index) the client stands for.
    """

    train: list[np.ndarray]
    test: list[np.ndarray]
    cluster: np.ndarray
    notes: list[str] = field(default_factory=list)
    groups: np.ndarray | None = None
    # each client's feature/concept shift (scenarios.shift.ShiftPlan); rebuilt from the
    # scenario, never saved: the partition file stays indices only
    shift: ShiftPlan | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        self.train = [np.asarray(a, dtype=np.int64).reshape(-1) for a in self.train]
        self.test = [np.asarray(a, dtype=np.int64).reshape(-1) for a in self.test]
        self.cluster = np.asarray(self.cluster, dtype=np.int64).reshape(-1)
        self.notes = [str(n) for n in self.notes]
        if self.groups is not None:
            self.groups = np.asarray(self.groups, dtype=np.int64).reshape(-1)
        n = len(self.train)
        if len(self.test) != n or len(self.cluster) != n or (self.groups is not None and len(self.groups) != n):
            raise PartitionError(
                f"inconsistent partition: {n} train shards, {len(self.test)} test shards, "
                f"{len(self.cluster)} cluster labels" + ("" if self.groups is None else f", {len(self.groups)} groups")
            )

    @property
    def n_clients(self) -> int:
        return len(self.train)

    @property
    def train_sizes(self) -> np.ndarray:
        """[M]: each client's number of training samples."""
        return np.array([len(t) for t in self.train], dtype=np.int64)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Partition) or self.n_clients != other.n_clients:
            return False
        same_groups = (self.groups is None and other.groups is None) or (
            self.groups is not None and other.groups is not None and np.array_equal(self.groups, other.groups)
        )
        return (
            same_groups
            and np.array_equal(self.cluster, other.cluster)
            and self.notes == other.notes
            and all(np.array_equal(a, b) for a, b in zip(self.train, other.train, strict=True))
            and all(np.array_equal(a, b) for a, b in zip(self.test, other.test, strict=True))
        )

    def save(self, path: str | os.PathLike) -> None:
        """Write one .npz (exactly at ``path``): offsets + concatenated indices, no pickle.

        Written under a temporary name and renamed, so device processes reading the run
        folder never see a half-written file.
        """
        path = Path(path)
        arrays = {
            "version": np.array(_FORMAT_VERSION, dtype=np.int64),
            "train_offsets": _offsets(self.train),
            "train_idx": _concat(self.train),
            "test_offsets": _offsets(self.test),
            "test_idx": _concat(self.test),
            "cluster": self.cluster,
            "notes": np.array(self.notes, dtype=str) if self.notes else np.zeros(0, dtype="<U1"),
        }
        if self.groups is not None:
            arrays["groups"] = self.groups
        path.parent.mkdir(parents=True, exist_ok=True)
        save_npz_atomic(path, **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Partition:
        """A saved partition (a run folder's partition.npz); a damaged file is a
        PartitionError naming it, not numpy's traceback."""
        try:
            with np.load(path, allow_pickle=False) as z:
                version = int(z["version"])
                if version != _FORMAT_VERSION:
                    raise PartitionError(f"{path}: partition format {version}, expected {_FORMAT_VERSION}")
                return cls(
                    train=_split(z["train_idx"], z["train_offsets"]),
                    test=_split(z["test_idx"], z["test_offsets"]),
                    cluster=z["cluster"],
                    notes=[str(n) for n in z["notes"]],
                    groups=z["groups"] if "groups" in z.files else None,
                )
        except PartitionError:
            raise
        except (OSError, ValueError, KeyError, zipfile.BadZipFile):
            raise PartitionError(f"{path}: not a readable partition file (damaged, or not written by flt)") from None


def _offsets(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def _split(flat: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    return [flat[offsets[i] : offsets[i + 1]].copy() for i in range(len(offsets) - 1)]


# ----------------------------------------------------------------------------- class layouts


def cluster_classes(
    n_clusters: int, classes_per_cluster: int, num_classes: int, shared_classes: int
) -> list[list[int]]:
    """Classes of each cluster: cluster c holds ``(c*step + j) % num_classes`` for
    ``j < classes_per_cluster``, with ``step = classes_per_cluster - shared_classes``.

    ``shared_classes=0`` gives disjoint blocks (S1: {0,1},{2,3},...); ``1`` makes
    neighbours share one class (S2, rings of three: {0,1,2},{2,3,4},...,{8,9,0}); a
    negative value leaves gaps between clusters.
    """
    k = classes_per_cluster
    if n_clusters < 1 or k < 1 or num_classes < 1:
        raise PartitionError(
            f"need n_clusters, classes_per_cluster, num_classes >= 1 (got {n_clusters}, {k}, {num_classes})"
        )
    if shared_classes >= k:
        raise PartitionError(f"shared_classes={shared_classes} must be < classes_per_cluster={k}")
    if k > num_classes:  # before building any list: a huge k must not allocate
        raise PartitionError(
            f"partition.classes_per_cluster: {k} classes per cluster would repeat a "
            f"class; the dataset has {num_classes}"
        )
    step = k - shared_classes
    out = [[(c * step + j) % num_classes for j in range(k)] for c in range(n_clusters)]
    for c, cls in enumerate(out):
        if len(set(cls)) != k:
            raise PartitionError(
                f"cluster {c} would repeat a class ({cls}): {k} classes per cluster exceed {num_classes} classes"
            )
    return out


# ----------------------------------------------------------------------------- shared machinery


def _labels(y: ArrayLike | None, what: str) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise PartitionError(f"{what} labels must be a 1-D integer array (got {y.dtype} {y.shape})")
    if len(y) and y.min() < 0:
        raise PartitionError(f"{what} labels must be >= 0")
    return y.astype(np.int64, copy=False)


def _num_classes(y_train: np.ndarray, y_test: np.ndarray, num_classes: int | None) -> int:
    seen = int(max(y_train.max(initial=-1), y_test.max(initial=-1))) + 1
    if num_classes is None:
        return seen
    if num_classes < seen:
        raise PartitionError(f"num_classes={num_classes} but labels go up to {seen - 1}")
    return int(num_classes)


def _exclude_mask(exclude: ArrayLike | None, n: int) -> np.ndarray:
    mask = np.zeros(n, dtype=bool)
    if exclude is None:
        return mask
    ex = np.asarray(exclude)
    if ex.dtype == bool:
        if ex.shape != (n,):
            raise PartitionError(f"exclude mask has shape {ex.shape}, expected ({n},)")
        return ex.copy()
    if not np.issubdtype(ex.dtype, np.integer):
        raise PartitionError("exclude must be a boolean mask or an integer index array")
    if ex.size and (ex.min() < 0 or ex.max() >= n):
        raise PartitionError(f"exclude indices must lie in [0, {n})")
    mask[ex] = True
    return mask


def _fair_shares(need: np.ndarray, avail: int) -> np.ndarray:
    """Give each holder ``need[i]`` if the class has enough, else water-fill: everyone
    gets ``min(need, L)`` for the largest level L that fits, and the remainder goes one
    by one to the first holders still below their need."""
    need = np.asarray(need, dtype=np.int64)
    if need.sum() <= avail:
        return need.copy()
    lo, hi = 0, int(need.max())  # sum(min(need, lo)) <= avail < sum(min(need, hi))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if np.minimum(need, mid).sum() <= avail:
            lo = mid
        else:
            hi = mid
    give = np.minimum(need, lo)
    left = int(avail - give.sum())
    give[np.flatnonzero(need > lo)[:left]] += 1
    return give


def _describe(need: np.ndarray, give: np.ndarray, avail: int, c: int, what: str) -> str:
    h = need > 0
    n_need, g = need[h], give[h]
    each = f"{n_need.min()}" if n_need.min() == n_need.max() else f"{n_need.min()}-{n_need.max()}"
    got = f"{g.min()}" if g.min() == g.max() else f"{g.min()}-{g.max()}"
    return (
        f"class {c}: {h.sum()} clients need {n_need.sum()} {what} images ({each} each), "
        f"only {avail} available; each got {got} (no duplicates)"
    )


def _take(
    y: np.ndarray,
    need: np.ndarray,
    rng: np.random.Generator,
    mask_out: np.ndarray,
    what: str,
    share_groups: np.ndarray | None = None,
):
    """Draw ``need[m, c]`` samples of class c for every client m, without duplication.

    Per class: shuffle the available indices, cap the requests fairly, and hand out
    consecutive slices. With ``share_groups`` (a group id per client), a class too short
    for all its holders is handed out once per group instead, every group from the same
    shuffled images: holders in one group never share an image, holders in different
    groups do. Returns (owner ids, indices, given counts [M, K], shortage notes).
    """
    n_clients, k = need.shape
    owners, idx, notes = [], [], []
    given = np.zeros_like(need)
    for c in range(k):
        col = need[:, c]
        if not col.any():
            continue
        pool = rng.permutation(np.flatnonzero((y == c) & ~mask_out))
        short = col.sum() > len(pool)
        groups = [np.arange(n_clients)]
        if short and share_groups is not None:
            groups = [np.flatnonzero(share_groups == g) for g in np.unique(share_groups[col > 0])]
        give = np.zeros_like(col)
        for members in groups:
            give[members] = _fair_shares(col[members], len(pool))
            owners.append(np.repeat(members, give[members]))
            idx.append(pool[: give[members].sum()])
        if give.sum() < col.sum():
            notes.append(_describe(col, give, len(pool), c, what))
        elif short:
            notes.append(
                f"class {c}: {int((col > 0).sum())} clients need {col.sum()} {what} images, only {len(pool)} "
                f"available; the {len(groups)} clusters holding it each split the same {len(pool)} (shared)"
            )
        given[:, c] = give
    return owners, idx, given, notes


def _assemble(
    owners: list[np.ndarray], idx: list[np.ndarray], n_clients: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Group (owner, index) pairs into one array per client, in random order inside it."""
    if not owners:
        return [np.zeros(0, np.int64) for _ in range(n_clients)]
    own, ix = np.concatenate(owners), np.concatenate(idx).astype(np.int64)
    perm = rng.permutation(len(ix))
    own, ix = own[perm], ix[perm]
    order = np.argsort(own, kind="stable")
    bounds = np.cumsum(np.bincount(own, minlength=n_clients))[:-1]
    return [a.copy() for a in np.split(ix[order], bounds)]


def _proportional(weights: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Row-wise largest-remainder rounding: integer [M, K] rows summing to ``totals``
    (0 for rows without weight), proportional to ``weights``."""
    w = weights.astype(np.float64)
    s = w.sum(1, keepdims=True)
    totals = np.where(s[:, 0] > 0, totals, 0)
    quota = np.divide(w * totals[:, None], s, out=np.zeros_like(w), where=s > 0)
    base = np.floor(quota).astype(np.int64)
    rem = np.maximum(totals - base.sum(1), 0)  # >= 0 up to float rounding
    # rank of each entry's fractional part inside its row, largest first (ties: lower class)
    rank = np.argsort(np.argsort(-(quota - base), axis=1, kind="stable"), axis=1, kind="stable")
    return base + (rank < rem[:, None])


def _test_shards(y_test, train_counts, test_per_client, rng):
    """Test shard per client: its own classes, in proportion to its train counts."""
    n_clients, k = train_counts.shape
    if test_per_client <= 0:
        return [np.zeros(0, np.int64) for _ in range(n_clients)], []
    # Classes present only in the train split cannot give test samples: widen K.
    kt = max(k, int(y_test.max(initial=-1)) + 1)
    counts = np.zeros((n_clients, kt), np.int64)
    counts[:, :k] = train_counts
    need = _proportional(counts, np.full(n_clients, int(test_per_client)))
    owners, idx, _, notes = _take(y_test, need, rng, np.zeros(len(y_test), bool), "test")
    notes = [f"test {n}" for n in notes]
    return _assemble(owners, idx, n_clients, rng), notes


def _check_counts(n_clients: int, n_clusters: int | None = None) -> None:
    if n_clients < 1:
        raise PartitionError(f"partition.clients must be >= 1 (got {n_clients})")
    if n_clusters is not None and not 1 <= n_clusters <= n_clients:
        raise PartitionError(
            f"partition.clusters must be between 1 and partition.clients (got {n_clusters} clusters "
            f"for {n_clients} clients)"
        )


def _check_sizes(
    n_clients: int, n_avail: int, n_test: int, test_per_client: int, samples_per_client: int | None = None
) -> None:
    """Refuse what the data cannot give before anything is allocated per client: more
    clients than training samples, or one client's shard larger than a whole split."""
    if n_clients > n_avail:
        raise PartitionError(
            f"partition.clients: {n_clients} clients, but the train split has only "
            f"{n_avail} samples for clients (each client needs at least one)"
        )
    if samples_per_client is not None and samples_per_client > n_avail:
        raise PartitionError(
            f"partition.samples_per_client: {samples_per_client} per client, but the "
            f"train split has only {n_avail} samples for clients"
        )
    if test_per_client > n_test:
        raise PartitionError(
            f"partition.test_per_client: {test_per_client} per client, but the test split has only {n_test} samples"
        )


def _cluster_of(n_clients: int, n_clusters: int) -> np.ndarray:
    """Contiguous blocks: client m is in cluster m * C // M."""
    return (np.arange(n_clients) * n_clusters // n_clients).astype(np.int64)


# ----------------------------------------------------------------------------- S1 / S2


def partition_clusters(
    y_train: ArrayLike,
    y_test: ArrayLike,
    *,
    n_clients: int,
    n_clusters: int,
    classes_per_cluster: int,
    shared_classes: int,
    samples_per_client: int,
    test_per_client: int,
    rng: np.random.Generator,
    on_short: str = "take",
    exclude: ArrayLike | None = None,
    num_classes: int | None = None,
) -> Partition:
    """Clustered label skew (paper's S1 and S2).

    Clients form ``n_clusters`` contiguous blocks (client m in cluster ``m*C//M``);
    cluster c holds the classes of :func:`cluster_classes`. Each client asks for
    ``samples_per_client`` training images split evenly over its cluster's classes
    (the first classes take the remainder). A class's images are shuffled and split
    without duplication among every client (of every cluster) holding it.

    If a class has fewer images than its holders ask for (MNIST class 5 has 5,421; S1
    with 100 clients x 600 asks 20 x 300 = 6,000), ``on_short="take"`` gives each holder
    an equal share of what exists (so those clients have fewer samples) and adds a note;
    ``on_short="fail"`` raises :class:`PartitionError` with the same message.
    ``on_short="share"`` is the FLT authors' sampler: the clusters holding a short class
    (S2's shared classes) each split all of its images among their own clients, so a
    client of one cluster holds the same images as one client of the other.
    """
    if on_short not in ("take", "fail", "share"):
        raise PartitionError(f"on_short must be 'take', 'fail' or 'share' (got {on_short!r})")
    _check_counts(n_clients, n_clusters)
    y_train, y_test = _labels(y_train, "train"), _labels(y_test, "test")
    mask = _exclude_mask(exclude, len(y_train))
    _check_sizes(n_clients, int((~mask).sum()), len(y_test), test_per_client, samples_per_client)
    k_all = _num_classes(y_train, y_test, num_classes)
    layout = cluster_classes(n_clusters, classes_per_cluster, k_all, shared_classes)
    cluster = _cluster_of(n_clients, n_clusters)

    per_class = np.full(classes_per_cluster, samples_per_client // classes_per_cluster, np.int64)
    per_class[: samples_per_client % classes_per_cluster] += 1
    need = np.zeros((n_clients, k_all), np.int64)
    for c, cls in enumerate(layout):
        need[np.ix_(cluster == c, np.array(cls))] = per_class

    share = cluster if on_short == "share" else None
    owners, idx, given, notes = _take(y_train, need, rng, mask, "training", share_groups=share)
    if notes and on_short == "fail":
        raise PartitionError("; ".join(notes))
    train = _assemble(owners, idx, n_clients, rng)
    test, tnotes = _test_shards(y_test, given, test_per_client, rng)
    return Partition(train=train, test=test, cluster=cluster, notes=notes + tnotes)


# ----------------------------------------------------------------------------- Dirichlet


def partition_dirichlet(
    y_train: ArrayLike,
    y_test: ArrayLike,
    *,
    n_clients: int,
    alpha: float,
    samples_per_client: int,
    test_per_client: int,
    rng: np.random.Generator,
    exclude: ArrayLike | None = None,
    num_classes: int | None = None,
) -> Partition:
    """Classic label skew: client m's class mix p_m ~ Dirichlet(alpha * 1).

    Counts are drawn as Multinomial(samples_per_client, p_m). Where a class is asked
    for more than it has, its holders are water-filled down to what exists and each
    client's shortfall is redrawn from classes that still have room, in proportion to
    its own p_m (uniformly if its p_m is zero on all of them); this repeats until no
    class is oversubscribed (at most K+1 rounds), so every client ends with exactly
    ``samples_per_client`` distinct samples. Raises if the clients ask for more than the
    whole (non-excluded) train split. ``cluster`` is -1 for everyone.
    """
    _check_counts(n_clients)
    if alpha <= 0:
        raise PartitionError(f"alpha must be > 0 (got {alpha})")
    y_train, y_test = _labels(y_train, "train"), _labels(y_test, "test")
    mask = _exclude_mask(exclude, len(y_train))
    _check_sizes(n_clients, int((~mask).sum()), len(y_test), test_per_client, samples_per_client)
    k = _num_classes(y_train, y_test, num_classes)
    avail = np.bincount(y_train[~mask], minlength=k).astype(np.int64)
    total = n_clients * samples_per_client
    if total > avail.sum():
        raise PartitionError(
            f"dirichlet: {n_clients} clients x {samples_per_client} = {total} samples asked, "
            f"only {avail.sum()} training samples available"
        )
    p = rng.dirichlet(np.full(k, float(alpha)), size=n_clients)
    p = np.nan_to_num(p)  # tiny alpha can underflow to NaN rows
    p_safe = np.where(p.sum(1, keepdims=True) > 0, p, 1.0)
    need = rng.multinomial(samples_per_client, p_safe / p_safe.sum(1, keepdims=True))
    redrawn = 0
    for _ in range(k + 1):
        over = np.flatnonzero(need.sum(0) > avail)
        if over.size == 0:
            break
        for c in over:
            need[:, c] = _fair_shares(need[:, c], int(avail[c]))
        deficit = samples_per_client - need.sum(1)
        redrawn += int(deficit.sum())
        open_ = (avail - need.sum(0)) > 0
        q = p * open_
        q = np.where(q.sum(1, keepdims=True) > 0, q, open_.astype(np.float64))
        need = need + rng.multinomial(deficit, q / q.sum(1, keepdims=True))
    notes = []
    if redrawn:
        notes.append(f"dirichlet: classes ran short; {redrawn} client-samples were redrawn from classes with room")
    owners, idx, given, short = _take(y_train, need, rng, mask, "training")
    assert not short, short  # the loop above leaves no class oversubscribed
    train = _assemble(owners, idx, n_clients, rng)
    test, tnotes = _test_shards(y_test, given, test_per_client, rng)
    return Partition(train=train, test=test, cluster=np.full(n_clients, -1), notes=notes + tnotes)


def partition_iid(
    y_train: ArrayLike,
    y_test: ArrayLike,
    *,
    n_clients: int,
    samples_per_client: int,
    test_per_client: int,
    rng: np.random.Generator,
    exclude: ArrayLike | None = None,
    num_classes: int | None = None,
    groups: np.ndarray | None = None,
) -> Partition:
    """No label skew: every client gets a uniform random draw of the (non-excluded) train
    split. ``groups`` (one id per client) lets each group draw from the whole split on its
    own, as the rotated- and label-swapped-MNIST benchmarks (IFCA, CFL) build their
    clusters: each cluster is the dataset under its own transform, so an image may recur
    in two groups (differently rotated or labelled), never twice within one group. Where
    a group asks for more than exists, its clients get an equal share and a note says so.
    ``cluster`` is -1 for everyone (a shift, if any, plants the clusters)."""
    _check_counts(n_clients)
    y_train, y_test = _labels(y_train, "train"), _labels(y_test, "test")
    mask = _exclude_mask(exclude, len(y_train))
    pool = np.flatnonzero(~mask)
    groups = np.zeros(n_clients, np.int64) if groups is None else np.asarray(groups, np.int64)
    _check_sizes(int(np.bincount(groups).max()), len(pool), len(y_test), test_per_client)
    k = _num_classes(y_train, y_test, num_classes)
    train: list[np.ndarray] = [np.zeros(0, np.int64)] * n_clients
    test: list[np.ndarray] = [np.zeros(0, np.int64)] * n_clients
    notes: list[str] = []
    for g in np.unique(groups):
        members = np.flatnonzero(groups == g)
        each = min(samples_per_client, len(pool) // len(members))
        if each < samples_per_client:
            notes.append(
                f"iid: {len(members)} clients x {samples_per_client} = {len(members) * samples_per_client} samples "
                f"asked{'' if len(np.unique(groups)) == 1 else f' in group {g}'}, only {len(pool)} available; "
                f"each got {each} (no duplicates)"
            )
        drawn = rng.permutation(pool)[: len(members) * each].reshape(len(members), each)
        counts = np.zeros((len(members), k), np.int64)
        np.add.at(counts, (np.repeat(np.arange(len(members)), each), y_train[drawn].reshape(-1)), 1)
        shards, tnotes = _test_shards(y_test, counts, test_per_client, rng)
        for i, m in enumerate(members):
            train[m], test[m] = drawn[i], shards[i]
        notes += tnotes
    return Partition(train=train, test=test, cluster=np.full(n_clients, -1), notes=notes)


# ----------------------------------------------------------------------------- S4


def _skew_sizes(n: int, total: int, alpha: float, delta: float) -> tuple[np.ndarray, float]:
    """Integer sizes ``alpha + exp(beta * j**delta)``, j = 1..n, summing to ``total``."""
    from scipy.optimize import brentq

    if n * alpha >= total:
        raise PartitionError(f"{n} clients with alpha={alpha} need more than the {total} samples available")
    j = np.arange(1, n + 1, dtype=np.float64) ** delta

    def f(beta: float) -> float:
        return n * alpha + np.exp(beta * j).sum() - total

    f0 = f(0.0)
    if f0 == 0:
        beta = 0.0
    elif f0 < 0:  # grow: the last client alone reaches total at hi
        beta = brentq(f, 0.0, np.log(total) / j[-1])
    else:  # total lies between n*alpha and n*(alpha+1): shrink below 1
        lo = np.log((total - n * alpha) / (2.0 * n))
        beta = brentq(f, lo, 0.0)
    real = alpha + np.exp(beta * j)
    sizes = _proportional(real[None], np.array([total]))[0]
    return sizes, float(beta)


def over_class_cap(
    y_train: ArrayLike, limit: int, rng: np.random.Generator, exclude: ArrayLike | None = None
) -> np.ndarray:
    """Indices of the training images to leave out so that no class keeps more than
    ``limit`` of its non-excluded images (a seeded, uniform choice of which to keep):
    a class-balanced set, as EMNIST-balanced is cut from a skewed EMNIST."""
    y = _labels(y_train, "train")
    candidates = np.flatnonzero(~_exclude_mask(exclude, len(y)))
    shuffled = rng.permutation(candidates)
    order = shuffled[np.argsort(y[shuffled], kind="stable")]  # by class, random inside a class
    labels = y[order]
    first = np.searchsorted(labels, labels, side="left")  # each image's class starts here
    rank = np.arange(len(order)) - first
    return np.sort(order[rank >= limit])


def partition_structured(
    y_train: ArrayLike,
    y_test: ArrayLike,
    *,
    n_clients: int,
    n_clusters: int,
    classes_per_cluster: int,
    alpha: float,
    delta: float,
    test_per_client: int,
    rng: np.random.Generator,
    exclude: ArrayLike | None = None,
    num_classes: int | None = None,
) -> Partition:
    """Structured non-IID (paper's S4): clustered classes plus quantity skew.

    1. Cluster c holds ``classes_per_cluster`` classes starting at ``c * step`` (mod K)
       with ``step = max(1, K // n_clusters)``: C=10 clusters of 5 over 10 classes
       overlap (step 1, each class in 5 clusters); over FEMNIST's 62 they are disjoint.
    2. Each class's (non-excluded) training images are shuffled and split evenly,
       without duplication, among the clusters holding it; a cluster's pool is the
       union of its shares.
    3. Clients form contiguous blocks (client m in cluster ``m*C//M``). Inside a cluster
       of n clients, the j-th (j = 1..n) gets ``alpha + exp(beta * j**delta)`` samples,
       beta solved with brentq so the sizes sum to the pool (largest-remainder
       rounding). ``alpha`` is a floor on every client's size, ``delta`` >= 0 shapes
       the skew (0 = equal sizes). The pool is shuffled and cut into those sizes, so a
       client holds a random mix of its cluster's classes.

    Every client must end with at least one sample, else PartitionError.
    """
    _check_counts(n_clients, n_clusters)
    if alpha < 0 or delta < 0:
        raise PartitionError(f"alpha and delta must be >= 0 (got {alpha}, {delta})")
    y_train, y_test = _labels(y_train, "train"), _labels(y_test, "test")
    mask = _exclude_mask(exclude, len(y_train))
    _check_sizes(n_clients, int((~mask).sum()), len(y_test), test_per_client)
    k_all = _num_classes(y_train, y_test, num_classes)
    step = max(1, k_all // n_clusters)
    layout = cluster_classes(n_clusters, classes_per_cluster, k_all, classes_per_cluster - step)
    cluster = _cluster_of(n_clients, n_clusters)

    # Step 2: class c's images split among the clusters holding it.
    pools: list[list[np.ndarray]] = [[] for _ in range(n_clusters)]
    for c in range(k_all):
        holders = [cl for cl, cls in enumerate(layout) if c in cls]
        if not holders:
            continue
        pool = rng.permutation(np.flatnonzero((y_train == c) & ~mask))
        for cl, piece in zip(holders, np.array_split(pool, len(holders)), strict=True):
            pools[cl].append(piece)

    # Step 3: quantity-skewed cuts inside each cluster.
    train: list[np.ndarray] = [np.zeros(0, np.int64)] * n_clients
    notes = []
    for cl in range(n_clusters):
        members = np.flatnonzero(cluster == cl)
        pool = rng.permutation(np.concatenate(pools[cl]) if pools[cl] else np.zeros(0, np.int64))
        sizes, beta = _skew_sizes(len(members), len(pool), alpha, delta)
        if sizes.min() < 1:
            raise PartitionError(
                f"cluster {cl}: {len(pool)} samples over {len(members)} clients leaves some empty "
                f"(alpha={alpha}, delta={delta}); use alpha >= 1 or fewer clients"
            )
        for m, piece in zip(members, np.split(pool, np.cumsum(sizes)[:-1]), strict=True):
            train[m] = piece.astype(np.int64)
        notes.append(
            f"cluster {cl}: classes {layout[cl]}, {len(pool)} samples over {len(members)} clients, "
            f"beta={beta:.4g}, sizes {sizes.min()}..{sizes.max()}"
        )

    given = np.zeros((n_clients, k_all), np.int64)
    for client in range(n_clients):
        given[client] = np.bincount(y_train[train[client]], minlength=k_all)
    test, tnotes = _test_shards(y_test, given, test_per_client, rng)
    return Partition(train=train, test=test, cluster=cluster, notes=notes + tnotes)


# ----------------------------------------------------------------------------- S3


def partition_groups(
    groups_train: ArrayLike | None,
    groups_test: ArrayLike | None,
    *,
    n_clients: int | None = None,
    rng: np.random.Generator,
) -> Partition:
    """Natural clients (S3, FEMNIST writers): each group with training samples is one
    client holding all its train and test samples.

    With ``n_clients``, a seeded random subset of that many groups is kept (the first
    ``n_clients`` of ``rng.permutation``); clients are then ordered by group id, and
    ``Partition.groups`` records each client's group. ``cluster`` is -1. Groups of None
    (a dataset without writers) are a PartitionError.
    """
    g_tr = _labels(groups_train, "train group")
    g_te = _labels(groups_test, "test group")
    ids = np.unique(g_tr)
    order = rng.permutation(len(ids))
    if n_clients is not None:
        if not 1 <= n_clients <= len(ids):
            raise PartitionError(f"n_clients={n_clients}: only {len(ids)} groups have training data")
        order = order[:n_clients]
    chosen = np.sort(ids[order])

    def shards(g: np.ndarray) -> list[np.ndarray]:
        srt = np.argsort(g, kind="stable")
        lo = np.searchsorted(g[srt], chosen, side="left")
        hi = np.searchsorted(g[srt], chosen, side="right")
        return [srt[a:b].astype(np.int64) for a, b in zip(lo, hi, strict=True)]

    return Partition(train=shards(g_tr), test=shards(g_te), cluster=np.full(len(chosen), -1), notes=[], groups=chosen)
