"""Partitioners: disjointness, class layouts, shortages, determinism, persistence."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flt.scenarios.partition import (
    Partition,
    PartitionError,
    _fair_shares,
    cluster_classes,
    over_class_cap,
    partition_clusters,
    partition_dirichlet,
    partition_groups,
    partition_structured,
)

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def labels(per_class_train=700, per_class_test=200, k=10, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.permutation(np.repeat(np.arange(k), per_class_train)),
        rng.permutation(np.repeat(np.arange(k), per_class_test)),
    )


def assert_disjoint(p: Partition, n_train: int, n_test: int) -> None:
    """No training (or test) sample appears twice, within or across clients."""
    for shards, n in ((p.train, n_train), (p.test, n_test)):
        allx = np.concatenate(shards)
        assert allx.dtype == np.int64
        assert len(np.unique(allx)) == len(allx), "duplicate sample"
        assert len(allx) == 0 or (allx.min() >= 0 and allx.max() < n)


def assert_test_classes_within_train(p, y_tr, y_te):
    for m in range(p.n_clients):
        assert set(y_te[p.test[m]].tolist()) <= set(y_tr[p.train[m]].tolist()), f"client {m}: test class leak"


def s1(y_tr, y_te, seed=0, **kw):
    args = dict(
        n_clients=20,
        n_clusters=5,
        classes_per_cluster=2,
        shared_classes=0,
        samples_per_client=200,
        test_per_client=40,
        rng=np.random.default_rng(seed),
    )
    args.update(kw)
    return partition_clusters(y_tr, y_te, **args)


def test_more_clusters_than_clients_names_both_scenario_fields():
    y_tr, y_te = labels()
    with pytest.raises(PartitionError, match=r"partition\.clusters must be between 1 and partition\.clients"):
        s1(y_tr, y_te, n_clients=3)


# ----------------------------------------------------------------------------- layouts


def test_cluster_classes_layouts():
    assert cluster_classes(5, 2, 10, 0) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert cluster_classes(5, 3, 10, 1) == [[0, 1, 2], [2, 3, 4], [4, 5, 6], [6, 7, 8], [8, 9, 0]]
    with pytest.raises(PartitionError, match="repeat"):
        cluster_classes(2, 11, 10, 0)
    with pytest.raises(PartitionError):
        cluster_classes(5, 2, 10, 2)


def test_fair_shares_water_fills():
    np.testing.assert_array_equal(_fair_shares(np.array([3, 3]), 10), [3, 3])
    np.testing.assert_array_equal(_fair_shares(np.array([5, 5, 5]), 10), [4, 3, 3])
    np.testing.assert_array_equal(_fair_shares(np.array([1, 9, 9]), 10), [1, 5, 4])
    np.testing.assert_array_equal(_fair_shares(np.array([0, 4]), 2), [0, 2])


# ----------------------------------------------------------------------------- S1 / S2


def test_s1_disjoint_clusters_exact_classes():
    y_tr, y_te = labels()
    p = s1(y_tr, y_te)
    layout = cluster_classes(5, 2, 10, 0)
    np.testing.assert_array_equal(p.cluster, np.repeat(np.arange(5), 4))
    for m in range(p.n_clients):
        assert set(y_tr[p.train[m]].tolist()) == set(layout[p.cluster[m]])
        assert np.bincount(y_tr[p.train[m]], minlength=10)[layout[p.cluster[m]]].tolist() == [100, 100]
        assert len(p.test[m]) == 40
    assert_disjoint(p, len(y_tr), len(y_te))
    assert_test_classes_within_train(p, y_tr, y_te)
    assert p.notes == []


def test_s2_rings_share_one_class_with_neighbours():
    y_tr, y_te = labels()
    p = s1(y_tr, y_te, classes_per_cluster=3, shared_classes=1, samples_per_client=150)
    cls = {
        c: set(y_tr[np.concatenate([p.train[m] for m in np.flatnonzero(p.cluster == c)])].tolist()) for c in range(5)
    }
    for c in range(5):
        assert len(cls[c]) == 3
        assert len(cls[c] & cls[(c + 1) % 5]) == 1  # neighbours share exactly one class
        assert len(cls[c] & cls[(c + 2) % 5]) == 0
    assert_disjoint(p, len(y_tr), len(y_te))
    assert_test_classes_within_train(p, y_tr, y_te)


def test_short_class_takes_what_exists_or_fails():
    y_tr, y_te = labels()
    y_tr = y_tr[~((y_tr == 3) & (np.cumsum(y_tr == 3) > 350))]  # class 3 keeps 350 of 700
    p = s1(y_tr, y_te, samples_per_client=400)  # 4 clients x 200 = 800 of class 3 asked
    got3 = [int((y_tr[p.train[m]] == 3).sum()) for m in np.flatnonzero(p.cluster == 1)]
    assert sorted(got3) == [87, 87, 88, 88]  # fair share of 350, no duplicates
    assert any("class 3" in n and "350" in n for n in p.notes)
    assert_disjoint(p, len(y_tr), len(y_te))
    with pytest.raises(PartitionError, match="class 3"):
        s1(y_tr, y_te, samples_per_client=400, on_short="fail")


def test_share_gives_a_short_shared_class_to_each_cluster_whole():
    """on_short='share' (the FLT authors' S2 sampler): every client gets its full ask; a
    shared class too short for its 8 holders is split within each of its two clusters
    from the same images, so clients of different clusters share images, never of one."""
    y_tr, y_te = labels(per_class_train=600)  # S2 below asks 8 x 100 = 800 of a shared class
    kw = dict(shared_classes=1, classes_per_cluster=3, samples_per_client=300)
    take, share = s1(y_tr, y_te, **kw), s1(y_tr, y_te, **kw, on_short="share")
    assert min(len(t) for t in take.train) < 300  # shared classes split 8 ways: 75 each
    assert all(len(t) == 300 for t in share.train)  # 100 of each of the three classes
    assert any("shared" in n for n in share.notes)
    for c in range(5):  # within a cluster: no image twice
        mine = np.concatenate([share.train[m] for m in np.flatnonzero(share.cluster == c)])
        assert len(np.unique(mine)) == len(mine)
    a, b = np.flatnonzero(share.cluster == 0), np.flatnonzero(share.cluster == 1)  # they share class 2
    common = set(np.concatenate([share.train[m] for m in a]).tolist()) & set(
        np.concatenate([share.train[m] for m in b]).tolist()
    )
    assert len(common) == 400 and set(y_tr[list(common)].tolist()) == {2}  # 4 clients x 100 of class 2
    assert set(share.train[a[0]].tolist()) & set(share.train[b[0]].tolist())  # client i of one, i of the other
    assert_test_classes_within_train(share, y_tr, y_te)
    assert s1(y_tr, y_te, **kw, on_short="share").train[3].tolist() == share.train[3].tolist()  # seeded


def test_mnist_s1_class5_short():
    mnist = SHARED / "mnist"
    if not mnist.exists():
        pytest.skip(f"real MNIST not available offline here: {mnist} is missing")
    from flt.scenarios.datasets import load_dataset

    tr, te = load_dataset("mnist", mnist, train=True), load_dataset("mnist", mnist, train=False)
    kw = dict(
        n_clients=100,
        n_clusters=5,
        classes_per_cluster=2,
        shared_classes=0,
        samples_per_client=600,
        test_per_client=100,
    )
    p = partition_clusters(tr.y, te.y, rng=np.random.default_rng(0), **kw)
    holders5 = np.flatnonzero(p.cluster == 2)
    got5 = np.array([(tr.y[p.train[m]] == 5).sum() for m in holders5])
    assert got5.sum() == 5421 and got5.min() >= 271 and got5.max() <= 272
    assert any(n.startswith("class 5:") and "6000" in n and "5421" in n for n in p.notes)
    assert_disjoint(p, len(tr.y), len(te.y))
    assert_test_classes_within_train(p, tr.y, te.y)
    with pytest.raises(PartitionError, match="class 5"):
        partition_clusters(tr.y, te.y, rng=np.random.default_rng(0), on_short="fail", **kw)


def test_test_shards_capped_and_noted():
    y_tr, y_te = labels(per_class_test=30)
    p = s1(y_tr, y_te, test_per_client=40)  # 4 clients x 20 of each class > 30
    assert all(len(t) < 40 for t in p.test)
    assert any(n.startswith("test class") for n in p.notes)
    assert_disjoint(p, len(y_tr), len(y_te))


def test_exclude_mask_and_indices():
    y_tr, y_te = labels()
    held = np.arange(0, len(y_tr), 3)
    mask = np.zeros(len(y_tr), bool)
    mask[held] = True
    for ex in (held, mask):
        p = s1(y_tr, y_te, exclude=ex)
        assert not np.isin(np.concatenate(p.train), held).any()
        assert_disjoint(p, len(y_tr), len(y_te))


def test_same_seed_same_partition_and_roundtrip(tmp_path):
    y_tr, y_te = labels()
    a, b, c = s1(y_tr, y_te, seed=7), s1(y_tr, y_te, seed=7), s1(y_tr, y_te, seed=8)
    assert a == b and a != c
    path = tmp_path / "run" / "partition.npz"
    a.save(path)
    assert path.exists() and Partition.load(path) == a
    with np.load(path, allow_pickle=False) as z:  # plain arrays only
        assert "train_offsets" in z.files


def test_roundtrip_with_notes_and_groups(tmp_path):
    p = Partition(train=[[3, 1], []], test=[[0], [1, 2]], cluster=[-1, -1], notes=["class 1: short"], groups=[4, 9])
    p.save(tmp_path / "p.npz")
    q = Partition.load(tmp_path / "p.npz")
    assert q == p and q.notes == ["class 1: short"] and q.n_clients == 2
    assert q.train[1].dtype == np.int64 and len(q.train[1]) == 0
    with pytest.raises(PartitionError):
        Partition(train=[[1]], test=[], cluster=[0])


# ----------------------------------------------------------------------------- Dirichlet


def test_dirichlet_no_duplicates_exact_sizes():
    y_tr, y_te = labels()
    kw = dict(n_clients=30, alpha=0.1, samples_per_client=200, test_per_client=30)
    p = partition_dirichlet(y_tr, y_te, rng=np.random.default_rng(0), **kw)
    assert [len(t) for t in p.train] == [200] * 30  # 6,000 of 7,000: classes run short, redrawn
    assert (p.cluster == -1).all()
    assert_disjoint(p, len(y_tr), len(y_te))
    assert_test_classes_within_train(p, y_tr, y_te)
    top = np.mean([np.bincount(y_tr[t], minlength=10).max() / 200 for t in p.train])
    assert top > 0.5  # alpha 0.1: strongly skewed label mixes
    assert partition_dirichlet(y_tr, y_te, rng=np.random.default_rng(0), **kw) == p
    assert partition_dirichlet(y_tr, y_te, rng=np.random.default_rng(1), **kw) != p
    with pytest.raises(PartitionError, match="available"):
        partition_dirichlet(
            y_tr, y_te, rng=np.random.default_rng(0), n_clients=40, alpha=1.0, samples_per_client=200, test_per_client=0
        )


# ----------------------------------------------------------------------------- S4


def test_structured_sizes_sum_and_skew():
    y_tr, y_te = labels(per_class_train=600)
    kw = dict(n_clients=100, n_clusters=10, classes_per_cluster=5, alpha=2, delta=0.6, test_per_client=10)
    p = partition_structured(y_tr, y_te, rng=np.random.default_rng(0), **kw)
    assert_disjoint(p, len(y_tr), len(y_te))
    assert_test_classes_within_train(p, y_tr, y_te)
    # Step 1 over 10 classes: every class is in 5 clusters, so all 6,000 images are used,
    # each class split equally over its 5 clusters (120 each), 600 per cluster.
    sizes = np.array([len(t) for t in p.train])
    assert sizes.sum() == len(y_tr)
    for c in range(10):
        members = np.flatnonzero(p.cluster == c)
        s = sizes[members]
        assert s.sum() == 600
        assert (np.diff(s) >= 0).all() and s.max() > 3 * s.min()  # quantity skew
        assert s.min() >= 2  # alpha is a floor
        held = set(y_tr[np.concatenate([p.train[m] for m in members])].tolist())
        assert held == {(c + j) % 10 for j in range(5)}
    assert partition_structured(y_tr, y_te, rng=np.random.default_rng(0), **kw) == p
    assert partition_structured(y_tr, y_te, rng=np.random.default_rng(1), **kw) != p


def test_structured_disjoint_clusters_and_exclude():
    y_tr, y_te = labels(per_class_train=100, per_class_test=20, k=62)
    ex = np.arange(0, len(y_tr), 5)
    p = partition_structured(
        y_tr,
        y_te,
        n_clients=20,
        n_clusters=10,
        classes_per_cluster=5,
        alpha=1,
        delta=1.0,
        test_per_client=5,
        rng=np.random.default_rng(0),
        exclude=ex,
    )
    assert not np.isin(np.concatenate(p.train), ex).any()
    assert_disjoint(p, len(y_tr), len(y_te))
    # 62 classes, 10 clusters: step 6, clusters disjoint, so a cluster gets every
    # non-excluded image of its 5 classes.
    kept = np.ones(len(y_tr), bool)
    kept[ex] = False
    for c in range(10):
        members = np.flatnonzero(p.cluster == c)
        own = np.isin(y_tr, np.arange(6 * c, 6 * c + 5)) & kept
        assert sum(len(p.train[m]) for m in members) == own.sum()
    with pytest.raises(PartitionError):
        partition_structured(
            y_tr,
            y_te,
            n_clients=20,
            n_clusters=10,
            classes_per_cluster=5,
            alpha=500,
            delta=1.0,
            test_per_client=5,
            rng=np.random.default_rng(0),
        )


def test_class_cap_balances_a_skewed_set_and_spares_the_held_out():
    rng = np.random.default_rng(3)
    y = rng.permutation(np.repeat(np.arange(4), [500, 80, 30, 200]))  # skewed, as FEMNIST's digits
    held = np.arange(0, len(y), 7)  # the public slice: never counted, never touched
    drop = over_class_cap(y, 60, np.random.default_rng(0), exclude=held)
    assert not np.isin(drop, held).any() and len(np.unique(drop)) == len(drop)
    kept = np.setdiff1d(np.arange(len(y)), np.union1d(drop, held))
    before = np.bincount(np.delete(y, held), minlength=4)
    assert np.bincount(y[kept], minlength=4).tolist() == np.minimum(before, 60).tolist()
    assert np.array_equal(drop, over_class_cap(y, 60, np.random.default_rng(0), exclude=held))
    other = over_class_cap(y, 60, np.random.default_rng(1), exclude=held)
    assert not np.array_equal(drop, other)  # which images stay is a seeded draw, not the first ones
    assert len(over_class_cap(y, 10_000, np.random.default_rng(0))) == 0


def test_a_scenarios_class_cap_reaches_the_partition_and_leaves_the_public_slice():
    from flt.emulator.config import load
    from flt.emulator.run import build_partition, hold_out_public, load_data

    quickstart = Path(__file__).resolve().parents[1] / "scenarios" / "quickstart.yaml"
    over = ["partition.kind=structured", "partition.clusters=2", "partition.classes_per_cluster=5"]
    cfg = load(quickstart, [*over, "partition.public_fraction=0.1", "partition.max_per_class=40"])
    train, test = load_data(cfg)
    public = hold_out_public(cfg, len(train.y))
    p = build_partition(cfg, train, test, public)
    used = np.concatenate(p.train)
    assert np.bincount(train.y[used]).max() == 40 and not np.isin(used, public).any()
    assert len(used) == 40 * 10  # digits has 160-180 images a class; ten classes, two clusters of five
    uncapped = build_partition(load(quickstart, [*over, "partition.public_fraction=0.1"]), train, test, public)
    assert len(np.concatenate(uncapped.train)) > 3 * len(used)
    assert build_partition(cfg, train, test, public) == p  # the same seed, the same draw


# ----------------------------------------------------------------------------- S3


def test_groups_natural_clients():
    rng = np.random.default_rng(0)
    g_tr, g_te = rng.integers(0, 12, 500), rng.integers(0, 12, 80)
    p = partition_groups(g_tr, g_te, rng=np.random.default_rng(0))
    assert p.n_clients == 12 and (p.cluster == -1).all()
    for m, g in enumerate(p.groups):
        assert (g_tr[p.train[m]] == g).all() and len(p.train[m]) == (g_tr == g).sum()
        assert (g_te[p.test[m]] == g).all() and len(p.test[m]) == (g_te == g).sum()
    assert_disjoint(p, 500, 80)
    sub = partition_groups(g_tr, g_te, n_clients=5, rng=np.random.default_rng(3))
    assert sub.n_clients == 5 and set(sub.groups.tolist()) <= set(range(12))
    assert sub == partition_groups(g_tr, g_te, n_clients=5, rng=np.random.default_rng(3))
    assert sub != partition_groups(g_tr, g_te, n_clients=5, rng=np.random.default_rng(4))
    with pytest.raises(PartitionError):
        partition_groups(g_tr, g_te, n_clients=13, rng=np.random.default_rng(0))
