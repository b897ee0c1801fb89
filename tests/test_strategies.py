"""Server-side strategy logic on synthetic results: no processes, no sockets."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import numpy as np
import pytest
import torch

from flt.common.schema import ConfigError, validate
from flt.emulator.population import Population
from flt.reports.summary import clustering
from flt.server import fcr
from flt.server.encoder import image_source
from flt.server.exchange import Exchange, Reply
from flt.server.fcr_recipe import gamma_from_quantile, pca_basis
from flt.server.ops import TRAIN, TRAIN_BEST, TRAIN_RESIDENT
from flt.server.strategies import STRATEGIES
from flt.server.strategies.base import Context, Result
from flt.server.strategies.cfl import CFL
from flt.server.strategies.fedavg import FedAvg
from flt.server.strategies.fedgroup import FedGroup
from flt.server.strategies.fedprox import FedProx
from flt.server.strategies.fedsem import FedSEM
from flt.server.strategies.ifca import IFCA
from flt.server.strategies.local import Local
from flt.server.strategies.oracle import Oracle
from flt.server.strategies.pacfl import PACFL, cross_angles, hierarchical, smallest_angles
from flt.server.strategies.pacfl import RETRIES as PACFL_RETRIES
from flt.server.strategies.params import METHODS
from flt.server.strategies.pca_km_hc import PCAKMHC

P = 12
DIGITS = {"dataset": "digits", "root": None}  # the data section of a scenario on scikit-learn's digits


def make_ctx(tmp_path, m=8, truth=None, n_train=None, seed=0) -> Context:
    g = torch.Generator().manual_seed(123)
    return Context(
        init=torch.randn(P, generator=g),
        n_clients=m,
        n_train=np.ones(m, dtype=np.int64) if n_train is None else np.asarray(n_train),
        device=torch.device("cpu"),
        seed=seed,
        truth=np.full(m, -1) if truth is None else np.asarray(truth),
        train={"local_epochs": 1, "batch_size": 10, "lr": 0.01},
        public_images=image_source(DIGITS, None),
    )


def result(model, n=1, **meta) -> Result:
    return Result(None if model is None else torch.as_tensor(model, dtype=torch.float32), n, {"n": n, **meta})


# -- Oracle ------------------------------------------------------------------------------
def test_oracle_averages_inside_each_planted_cluster(tmp_path):
    truth = np.array([2, 2, 7, 7, -1, 7])  # ids need not be 0..C-1; -1 is a group of its own
    ctx = make_ctx(tmp_path, m=6, truth=truth)
    oracle = Oracle(ctx)
    start = oracle.models.clone()
    tasks = oracle.train_tasks(1, np.array([0, 2, 4]))
    assert all(torch.equal(t.models[0], ctx.init) for t in tasks.values())
    back = {0: result(torch.full((P,), 1.0), n=1), 1: result(torch.full((P,), 3.0), n=3)}
    back |= {2: result(torch.full((P,), -2.0), n=2), 5: result(torch.full((P,), 4.0), n=2)}
    oracle.aggregate(1, back)
    got = oracle.eval_models(np.arange(6))
    rows = got[1]
    assert rows[0] == rows[1] and rows[2] == rows[3] == rows[5] and len(set(rows.tolist())) == 3
    assert torch.allclose(got[0][rows[0]], torch.full((P,), 2.5))  # (1 * 1 + 3 * 3) / 4
    assert torch.allclose(got[0][rows[2]], torch.full((P,), 1.0))  # (-2 * 2 + 4 * 2) / 4
    assert torch.equal(got[0][rows[4]], start[rows[4]])  # nobody of the -1 group came back
    ctx.truth[[0, 2]] = ctx.truth[[2, 0]]  # a swap of two clients' data swaps their truth
    assert oracle.rows(np.array([0, 2])).tolist() == [rows[2], rows[0]]
    assert oracle.summary()["ari"] == pytest.approx(1.0)


def test_oracle_pool_all_averages_every_members_latest_model(tmp_path):
    """The authors' `all_clients` inside each planted cluster: members not selected count
    with their latest row (the initial model until they first train), weighted by n."""
    ctx = make_ctx(tmp_path, m=5, truth=np.array([0, 0, 0, 1, 1]), n_train=np.arange(1, 6))
    pool, plain = Oracle(ctx, pool="all"), Oracle(ctx)
    ones, twos, init = torch.ones(P), 2 * torch.ones(P), ctx.init
    for s in (pool, plain):
        s.aggregate(1, {0: result(ones, n=1), 3: result(twos, n=4)})
    models, rows = pool.eval_models(np.arange(5))
    assert torch.allclose(models[rows[0]], (1 * ones + 2 * init + 3 * init) / 6)
    assert torch.allclose(models[rows[3]], (4 * twos + 5 * init) / 9)
    models, rows = plain.eval_models(np.arange(5))
    assert torch.allclose(models[rows[0]], ones) and torch.allclose(models[rows[3]], twos)
    pool.aggregate(2, {1: result(3 * ones, n=2)})  # client 0 keeps its round-1 row
    models, rows = pool.eval_models(np.arange(5))
    assert torch.allclose(models[rows[0]], (1 * ones + 2 * 3 * ones + 3 * init) / 6)
    assert torch.allclose(models[rows[3]], (4 * twos + 5 * init) / 9)  # nobody of cluster 1 came back
    with pytest.raises(ConfigError, match="pool"):
        Oracle(ctx, pool="everyone")


# -- FedProx / Local -------------------------------------------------------------------
def test_fedprox_sends_mu_and_averages(tmp_path):
    ctx = make_ctx(tmp_path)
    s = FedProx(ctx, mu=0.1)
    tasks = s.train_tasks(1, np.array([0, 3]))
    assert set(tasks) == {0, 3}
    for t in tasks.values():
        assert t.meta["prox_mu"] == pytest.approx(0.1)
        assert torch.equal(t.models[0], ctx.init)
    assert FedProx(ctx).mu == pytest.approx(0.01)  # documented default
    a, b = torch.ones(P), 3 * torch.ones(P)
    s.aggregate(1, {0: result(a, 1), 3: result(b, 3)})
    models, rows = s.eval_models(np.arange(4))
    assert torch.allclose(models[0], 2.5 * torch.ones(P)) and (rows == 0).all()
    assert s.expected_bytes(10, 100)["bytes"] == 2000


def test_fedavg_pool_all_averages_every_clients_latest_model(tmp_path):
    """The authors' `all_clients` aggregation: stale rows (and the initial model of clients
    never selected) count, weighted by n; the default averages only this round's returns."""
    n_train = np.arange(1, 5)
    ctx = make_ctx(tmp_path, m=4, n_train=n_train)
    pool, plain = FedAvg(ctx, pool="all"), FedAvg(ctx)
    ones, twos = torch.ones(P), 2 * torch.ones(P)
    for s in (pool, plain):
        s.aggregate(1, {0: result(ones, n=1), 2: result(twos, n=3)})
    expect = (1 * ones + 2 * ctx.init + 3 * twos + 4 * ctx.init) / n_train.sum()
    assert torch.allclose(pool.global_model, expect)
    assert torch.allclose(plain.global_model, (ones + 3 * twos) / 4)
    pool.aggregate(2, {1: result(3 * ones, n=2)})  # client 0 and 2 keep their round-1 rows
    assert torch.allclose(pool.global_model, (1 * ones + 2 * 3 * ones + 3 * twos + 4 * ctx.init) / n_train.sum())
    with pytest.raises(ConfigError, match="pool"):
        FedAvg(ctx, pool="everyone")


def test_local_sends_init_once_then_nothing(tmp_path):
    ctx = make_ctx(tmp_path)
    s = Local(ctx)
    first = s.train_tasks(1, np.array([1, 2]))
    for t in first.values():
        assert t.op is TRAIN_RESIDENT and not t.op.model_back and t.meta == {}
        assert t.models.shape == (1, P) and torch.equal(t.models[0], ctx.init)
    s.aggregate(1, {1: result(None), 2: result(None)})
    second = s.train_tasks(2, np.array([2, 5]))
    assert second[2].models is None and second[2].op is TRAIN_RESIDENT
    assert second[5].models is not None and second[5].op is TRAIN_RESIDENT
    models, rows = s.eval_models(np.arange(ctx.n_clients))
    assert models is None and len(rows) == ctx.n_clients
    assert s.expected_bytes(4, 100)["bytes"] == 3 * 100  # clients 1, 2, 5: once each


# -- IFCA --------------------------------------------------------------------------------
def test_ifca_tasks_carry_all_cluster_models(tmp_path):
    ctx = make_ctx(tmp_path)
    s = IFCA(ctx, clusters=3)
    tasks = s.train_tasks(1, np.array([0, 4, 6]))
    for t in tasks.values():
        assert t.models.shape == (3, P) and t.op is TRAIN_BEST  # the device picks, then trains
        assert torch.equal(t.models[0], ctx.init)
    assert IFCA(ctx, clusters=3, warmup_rounds=1).train_tasks(1, np.array([0]))[0].op is TRAIN
    m = tasks[0].models
    assert not torch.equal(m[1], m[2]) and not torch.equal(m[0], m[1])
    assert (m[1:] - ctx.init).std() == pytest.approx(0.01, rel=0.5)
    # same seed, same models
    assert torch.equal(IFCA(ctx, clusters=3).train_tasks(1, np.array([0]))[0].models, m)
    # no client has picked (none returned before the deadline): every client is evaluated
    # with model 0, and the table says 1 cluster, not 0
    _, rows = s.eval_models(np.arange(4))
    assert (rows == 0).all() and clustering(s.summary())[0] == 1


def test_ifca_warns_when_it_has_more_cluster_models_than_clients(tmp_path, caplog):
    ctx = make_ctx(tmp_path)
    IFCA(ctx, clusters=ctx.n_clients)
    assert "never chosen" not in caplog.text
    IFCA(ctx, clusters=ctx.n_clients + 3)
    assert f"at least 3 are never chosen, yet every selected client downloads all {ctx.n_clients + 3}" in caplog.text


def test_a_warmup_as_long_as_the_run_is_named_at_the_start(tmp_path, caplog):
    """CFL's default warmup of 20 rounds on a 20-round scenario: it never splits."""
    ctx = make_ctx(tmp_path)
    ctx.train["rounds"] = 20
    IFCA(ctx, warmup_rounds=19)
    assert "warmup_rounds" not in caplog.text
    CFL(ctx)
    assert "cfl: warmup_rounds 20 >= train.rounds 20: it never splits" in caplog.text
    IFCA(ctx, warmup_rounds=25)
    assert "ifca: warmup_rounds 25 >= train.rounds 20: its cluster models are never spawned" in caplog.text


def test_ifca_averages_per_chosen_cluster(tmp_path):
    ctx = make_ctx(tmp_path)
    s = IFCA(ctx, clusters=3, reinit_empty=False)
    before = s.train_tasks(1, np.arange(4))[0].models.clone()
    w = {c: torch.full((P,), float(c + 1)) for c in range(4)}
    results = {
        0: result(w[0], 1, choice=2),
        1: result(w[1], 3, choice=0),
        2: result(w[2], 1, choice=2),
        3: result(w[3], 1, choice=0),
    }
    s.aggregate(1, results)
    models, rows = s.eval_models(np.arange(6))
    assert torch.allclose(models[0], (3 * w[1] + 1 * w[3]) / 4)
    assert torch.allclose(models[2], (w[0] + w[2]) / 2)
    assert torch.equal(models[1], before[1])  # nobody chose it: unchanged
    assert rows[:4].tolist() == [2, 0, 2, 0]
    assert rows[4] == rows[5] == 0  # never chose: the largest cluster (tie -> 0)
    summary = s.summary()
    assert summary["found_clusters"][:4] == [2, 0, 2, 0] and summary["found_clusters"][4] == -1


def test_ifca_reinit_empty_from_largest(tmp_path):
    ctx = make_ctx(tmp_path)
    s = IFCA(ctx, clusters=3, reinit_empty=True, init_scale=1e-3)
    s.train_tasks(1, np.arange(3))
    s.aggregate(1, {c: result(torch.full((P,), 5.0), 1, choice=1) for c in range(3)})
    models, _ = s.eval_models(np.arange(3))
    assert torch.allclose(models[1], torch.full((P,), 5.0))
    for k in (0, 2):  # empty clusters: perturbed copies of cluster 1
        assert torch.allclose(models[k], models[1], atol=1e-2) and not torch.equal(models[k], models[1])
    assert s.summary()["reinits"][0]["clusters"] == [0, 2]


def test_ifca_expected_bytes_counts_warmup_and_clusters(tmp_path):
    ctx = make_ctx(tmp_path)
    s = IFCA(ctx, clusters=4, warmup_rounds=2)
    for rnd in (1, 2):
        tasks = s.train_tasks(rnd, np.arange(3))
        assert all(t.models.shape == (1, P) for t in tasks.values())
        s.aggregate(rnd, {c: result(torch.full((P,), float(rnd)), 1) for c in range(3)})
    tasks = s.train_tasks(3, np.arange(5))
    assert all(t.models.shape == (4, P) for t in tasks.values())
    assert torch.allclose(tasks[0].models[0], torch.full((P,), 2.0))  # spawned from the warm-up model
    exp = s.expected_bytes(11, 100)
    assert exp["bytes"] == (6 * 2 + 5 * (4 + 1)) * 100
    s2 = IFCA(ctx, clusters=4)
    s2.train_tasks(1, np.arange(7))
    assert s2.expected_bytes(7, 10)["bytes"] == 7 * 10 * (4 + 1)


# -- FedSEM ------------------------------------------------------------------------------
def test_fedsem_separates_two_far_groups(tmp_path):
    m = 12
    truth = np.array([0] * 6 + [1] * 6)
    n_train = np.arange(1, m + 1)
    ctx = make_ctx(tmp_path, m=m, truth=truth, n_train=n_train, seed=3)
    s = FedSEM(ctx, centers=2)
    g = torch.Generator().manual_seed(0)
    points = {0: torch.zeros(P), 1: torch.full((P,), 10.0)}
    rng = np.random.default_rng(1)
    for rnd in range(1, 5):
        sel = np.sort(rng.choice(m, 8, replace=False))
        tasks = s.train_tasks(rnd, sel)
        assert all(t.models.shape == (1, P) for t in tasks.values())
        results = {int(c): result(points[truth[c]] + 0.1 * torch.randn(P, generator=g), int(n_train[c])) for c in sel}
        s.aggregate(rnd, results)
        # centres are the sample-weighted means of this round's members
        for k in range(2):
            members = [c for c in results if s.assign[c] == k]
            if members:
                w = torch.tensor([float(results[c].n) for c in members])
                mean = (w[:, None] * torch.stack([results[c].model for c in members])).sum(0) / w.sum()
                assert torch.allclose(s.centres[k], mean, atol=1e-5)
    rest = np.setdiff1d(np.arange(m), np.flatnonzero(s.assign >= 0))
    if len(rest):  # make sure everyone has returned once
        s.aggregate(5, {int(c): result(points[truth[c]], 1) for c in rest})
    summary = s.summary()
    assert summary["ari"] == pytest.approx(1.0)
    assert sorted(summary["cluster_sizes"]) == [6, 6]
    models, rows = s.eval_models(np.arange(m))
    assert models.shape == (2, P)
    assert (models[rows[:6]] - points[0]).abs().max() < 1 and (models[rows[6:]] - points[1]).abs().max() < 1


def test_fedsem_unassigned_client_gets_centre_nearest_global_average(tmp_path):
    ctx = make_ctx(tmp_path, m=6, n_train=[1, 1, 1, 1, 1, 1])
    s = FedSEM(ctx, centers=2)
    far, near = torch.full((P,), 10.0), torch.zeros(P)
    s.aggregate(1, {0: result(far), 1: result(near), 2: result(near), 3: result(near)})
    tasks = s.train_tasks(2, np.array([5]))
    nearest_to_zero = int(torch.cdist(torch.zeros(1, P), s.centres).argmin())
    assert torch.equal(tasks[5].models[0], s.centres[nearest_to_zero])


def test_fedsem_waits_for_k_models_before_init(tmp_path, caplog):
    """...and says so once: with fewer clients a round than K it never clusters (it ran
    as FedAvg without a word, 'clusters 0' in the table)."""
    ctx = make_ctx(tmp_path)
    s = FedSEM(ctx, centers=3)
    with caplog.at_level("WARNING", logger="flt.server.strategies.fedsem"):
        s.aggregate(1, {0: result(torch.ones(P)), 1: result(3 * torch.ones(P))})
        s.aggregate(2, {0: result(torch.ones(P)), 1: result(3 * torch.ones(P))})
    assert s.centres is None
    assert torch.allclose(s.train_tasks(3, np.array([4]))[4].models[0], 2 * torch.ones(P))
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "3 centres need a round in which 3 clients return" in warning and "2 returned" in warning
    assert clustering(s.summary()) == (1, None)  # the table: one model, not 'clusters 0'


def test_fedsem_pool_all_clusters_every_clients_latest_model(tmp_path):
    """The authors' multi_center: k-means over all M latest models (the initial model, then
    the client's centre, for clients not selected), every client assigned, each centre
    the n-weighted mean of its members' rows; the paper's default sees only the returns."""
    m = 8
    truth = np.array([0] * 4 + [1] * 4)
    n_train = np.arange(1, m + 1)
    ctx = make_ctx(tmp_path, m=m, truth=truth, n_train=n_train, seed=2)
    pool, paper = FedSEM(ctx, centers=2, pool="all"), FedSEM(ctx, centers=2)
    far = torch.full((P,), 10.0)
    returned = {0: result(ctx.init + 0.01, 1), 5: result(far, 6), 6: result(far + 0.02, 7)}
    for s in (pool, paper):
        s.aggregate(1, returned)
    assert (paper.assign[[1, 2, 3, 4, 7]] == -1).all()  # the paper: only returned clients are assigned
    assert (pool.assign >= 0).all()  # pooled: the six still at the initial model are clustered too
    first = (pool.assign.copy(), pool.centres.clone())
    near, away = pool.assign[0], pool.assign[5]
    assert near != away and pool.assign[6] == away and (pool.assign[[1, 2, 3, 4, 7]] == near).all()
    rows = torch.stack([ctx.init + 0.01 if c == 0 else ctx.init for c in (0, 1, 2, 3, 4, 7)])
    w = torch.tensor([1.0, 2, 3, 4, 5, 8])
    assert torch.allclose(pool.centres[near], (w[:, None] * rows).sum(0) / w.sum(), atol=1e-5)
    assert torch.allclose(pool.centres[away], (6 * far + 7 * (far + 0.02)) / 13, atol=1e-5)
    # round 2: client 1 jumps to the far group; the others hold their centres' rows
    before = pool.centres.clone()
    pool.aggregate(2, {1: result(far, 2)})
    assert pool.assign[1] == away
    mass = 6 + 7 + 2
    expect = (6 * before[away] + 7 * before[away] + 2 * far) / mass
    assert torch.allclose(pool.centres[away], expect, atol=1e-5)
    models, rows_of = pool.eval_models(np.arange(m))
    assert torch.equal(models[rows_of[1]], pool.centres[away])
    again = FedSEM(ctx, centers=2, pool="all")  # seeded k-means: the same clustering
    again.aggregate(1, returned)
    assert np.array_equal(again.assign, first[0]) and torch.equal(again.centres, first[1])
    with pytest.raises(ConfigError, match="pool"):
        FedSEM(ctx, pool="everyone")


# -- CFL ---------------------------------------------------------------------------------
def run_cfl(s, updates_for, rounds, m, rng, frac=1.0, start=1):
    for rnd in range(start, start + rounds):
        sel = np.sort(rng.choice(m, max(1, int(frac * m)), replace=False))
        tasks = s.train_tasks(rnd, sel)
        s.aggregate(rnd, {int(c): result(tasks[int(c)].models[0] + updates_for(int(c)), 1) for c in sel})


def test_cfl_splits_two_opposed_tasks(tmp_path):
    m = 10
    truth = np.array([0] * 5 + [1] * 5)
    ctx = make_ctx(tmp_path, m=m, truth=truth)
    s = CFL(ctx, warmup_rounds=3)
    g = torch.Generator().manual_seed(0)
    v = torch.zeros(P)
    v[0] = 2.0  # ||v|| = 2 > eps2; mean of +v and -v ~ 0 < eps1

    def updates(c):
        sign = 1.0 if truth[c] == 0 else -1.0
        return sign * v + 0.02 * torch.randn(P, generator=g)

    run_cfl(s, updates, 3, m, np.random.default_rng(0))
    assert len(s.splits) == 0  # warm-up
    run_cfl(s, updates, 1, m, np.random.default_rng(1), start=4)
    summary = s.summary()
    assert summary["clusters"] == 2 and len(summary["splits"]) == 1
    assert summary["ari"] == pytest.approx(1.0)
    assert summary["splits"][0]["sizes"] == [5, 5]
    # after the split each part moves along its own task; no further split
    parent = s.splits[0]
    run_cfl(s, updates, 5, m, np.random.default_rng(2), start=5)
    assert s.summary()["clusters"] == 2
    models, rows = s.eval_models(np.arange(m))
    assert models[rows[0]][0] > models[rows[9]][0]
    assert parent["round"] == 4


def test_cfl_partial_participation_sorts_absent_clients_down_the_tree(tmp_path):
    m = 10
    truth = np.array([0] * 5 + [1] * 5)
    ctx = make_ctx(tmp_path, m=m, truth=truth)
    s = CFL(ctx, warmup_rounds=0, eps1=0.5)  # mean update = (3v - 2v) / 5, norm 0.4
    v = torch.zeros(P)
    v[1] = 2.0
    sel = np.array([0, 1, 2, 5, 6])  # 3 of group A, 2 of group B
    tasks = s.train_tasks(1, sel)
    s.aggregate(1, {int(c): result(tasks[int(c)].models[0] + (v if truth[c] == 0 else -v), 1) for c in sel})
    assert len(s.splits) == 1 and s.splits[0]["pending"] == 5
    big = s.labels[0]
    assert s.labels[[0, 1, 2]].tolist() == [big] * 3 and s.labels[5] == s.labels[6] != big
    assert (s.labels[[3, 4, 7, 8, 9]] == big).all()  # absent: provisionally the larger part
    # both parts start from the parent and take their own mean update
    assert torch.allclose(s.models[big], ctx.init + v)
    assert torch.allclose(s.models[s.labels[5]], ctx.init - v)
    # absent clients get the cached parent model next time, and are sorted by their update
    sel = np.array([3, 7, 8])
    tasks = s.train_tasks(2, sel)
    for c in sel:
        assert torch.equal(tasks[int(c)].models[0], ctx.init)
    before = s.models.clone()
    s.aggregate(2, {int(c): result(ctx.init + (v if truth[c] == 0 else -v), 1) for c in sel})
    assert torch.equal(s.models, before)  # used for sorting only
    assert s.labels[3] == big and s.labels[7] == s.labels[8] == s.labels[5]
    assert s.pending.tolist() == [-1, -1, -1, -1, 0, -1, -1, -1, -1, 0]
    assert s.summary()["sorted_after_split"] == 3


def test_cfl_iid_population_never_splits(tmp_path):
    m = 10
    ctx = make_ctx(tmp_path, m=m, truth=np.zeros(m, dtype=np.int64))
    s = CFL(ctx, warmup_rounds=2)
    g = torch.Generator().manual_seed(1)
    u = torch.full((P,), 0.05)

    def updates(c):
        return u + 0.01 * torch.randn(P, generator=g)

    run_cfl(s, updates, 15, m, np.random.default_rng(0), frac=0.5)
    assert s.summary()["clusters"] == 1 and s.splits == []
    # the cluster model accumulated the mean updates
    assert (s.models[0] - ctx.init).mean() == pytest.approx(15 * 0.05, rel=0.05)


# -- PCA+kM+HC ---------------------------------------------------------------------------
def test_pca_basis_orthonormal_and_capped():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(40, 1, 6, 6), dtype=np.uint8)
    comps, mean, info = pca_basis(images, 128, seed=0)
    assert comps.shape == (36, 36) and mean.shape == (36,)  # capped by the pixel count
    comps, mean, info = pca_basis(images[:20], 128, seed=0)
    assert comps.shape == (20, 36) and info["pca_components"] == 20  # capped by N
    comps, _, _ = pca_basis(images, 8, seed=0)
    assert comps.dtype == np.float32
    np.testing.assert_allclose(comps @ comps.T, np.eye(8), atol=1e-5)


def test_pca_km_hc_payload_is_linear(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.public_images = image_source(DIGITS, np.arange(300))  # the held-out public slice
    s = PCAKMHC(ctx, components=16)
    tensors, meta, info = s.encoder_payload()
    assert meta["format"] == "linear" and meta["k"] == 5 and meta["latent"] == 16
    comps, mean = tensors["components"], tensors["mean"]
    assert comps.shape == (16, 28 * 28) and mean.shape == (28 * 28,)
    assert comps.dtype == np.float32 and mean.dtype == np.float32
    np.testing.assert_allclose(comps @ comps.T, np.eye(16), atol=1e-4)
    assert info["public_images"] == 300 and 0 < mean.max() <= 1.0  # pixels scaled to [0, 1]
    assert "umap" not in PCAKMHC.PARAMS and "gamma_quantile" in PCAKMHC.PARAMS
    assert [p.tolist() for p in s.project([np.ones((2, 3))])] == [np.ones((2, 3)).tolist()]


def test_pca_km_hc_client_basis_sends_only_the_axis_count(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.in_shape = (1, 6, 6)
    s = PCAKMHC(ctx, components=16, basis="client")  # the FLT authors' code: PCA on each client
    tensors, meta, info = s.encoder_payload()
    assert tensors == {} and meta == {"format": "own_pca", "k": 5, "latent": 16}
    assert info["pca_basis"] == "client"
    assert PCAKMHC(ctx, basis="client").encoder_payload()[1]["latent"] == 36  # capped by the pixels
    s.payload_meta = meta
    s.how = replace(s.how, space="whitened")  # pooled statistics would mix unrelated axes
    points = [np.arange(6.0).reshape(2, 3)]
    assert [p.tolist() for p in s.project(points)] == [points[0].tolist()]
    with pytest.raises(ConfigError, match="basis"):
        validate({"basis": "server"}, PCAKMHC.PARAMS, "methods[0]")


def test_pca_km_hc_relate_finds_planted_groups(tmp_path):
    m = 12
    truth = np.repeat(np.arange(3), 4)
    ctx = make_ctx(tmp_path, m=m, truth=truth)
    rng = np.random.default_rng(0)
    centres = 20 * rng.normal(size=(3, 16))
    points = [centres[t] + rng.normal(size=(5, 16)) for t in truth]
    default = PCAKMHC(ctx)  # FLT's threshold-free relatedness, in PCA space
    default.centroids = dict(enumerate(points))
    assert default.relate(np.arange(m))["ari"] == pytest.approx(1.0)
    assert default.gamma_used is None
    paper = PCAKMHC(ctx, relatedness="paper", gamma_quantile=0.25)  # closest pair, quantile gamma, Ward
    paper.centroids = dict(enumerate(points))
    assert paper.relate(np.arange(m))["ari"] == pytest.approx(1.0)
    assert paper.gamma_used == pytest.approx(gamma_from_quantile(fcr.min_distance_adjacency(points), 0.25))
    assert paper.params["gamma"] is None  # the resolved value does not overwrite the setting


# -- the round loop of server/federation.py with an in-process stand-in for the devices ----
class _Ledger:
    def __init__(self):
        self.bytes = {
            "up": {"model": 0, "encoder": 0, "embedding": 0},
            "down": {"model": 0, "encoder": 0, "embedding": 0},
        }

    def totals(self):
        return {d: {k: {"payload": v, "overhead": 0} for k, v in t.items()} for d, t in self.bytes.items()}


class _Transport:
    def __init__(self):
        self.ledger = _Ledger()

    def lost_clients(self):
        return np.zeros(0, dtype=np.int64)

    def require_hosts(self, after_round):
        pass  # in-process clients are never lost


class FakeFederation:
    """Does with a Task what devices/device.py does: resident models, IFCA's choice by
    the lowest loss on the client's own data, FedProx's damping. "Training" moves the
    model halfway to the client's target (loss ||w - target_m||^2)."""

    def __init__(self, targets: torch.Tensor, n: np.ndarray):
        self.targets, self.n = targets, n
        self.transport = _Transport()
        self.resident: dict[int, torch.Tensor] = {}
        self.method = ""
        self.timeout_s = 60.0
        self.events: list[dict] = []

    def declare(self, method, ops):
        self.method, self.ops = method, ops

    def take_events(self):
        events, self.events = self.events, []
        return events

    def _count(self, direction, kind, nbytes):
        self.transport.ledger.bytes[direction][kind] += int(nbytes)

    def state_dict(self, rnd, references=False):  # run_method checkpoints every round: no wire state here
        return {}

    def train(self, rnd, tasks, delays=None, timeout_s=None, purpose=None):
        out = {}
        for c, t in tasks.items():
            if t.models is not None:
                self._count("down", "model", t.models.numel() * 4)
            if not t.op.model_back:
                if c not in self.resident:
                    self.resident[c] = t.models[0].clone()
                cands = self.resident[c][None]
            else:
                cands = t.models
            k = int(((cands - self.targets[c]) ** 2).sum(1).argmin())
            step = 0.5 / (1 + t.meta.get("prox_mu", 0.0))
            w = cands[k] + step * (self.targets[c] - cands[k])
            meta = {"n": int(self.n[c]), "choice": k}
            if not t.op.model_back:
                self.resident[c] = w
                out[c] = Result(None, int(self.n[c]), meta)
            else:
                self._count("up", "model", w.numel() * 4)
                out[c] = Result(w.clone(), int(self.n[c]), meta)
        return Exchange(out, sorted(out), {"bytes": {}})  # no device profiles: everyone counts

    def evaluate(self, rnd, clients, models, rows):
        out = {}
        for c, r in zip(clients.tolist(), rows.tolist(), strict=True):
            w = self.resident.get(c, self.targets[c] * 0) if models is None else models[r]
            out[c] = {"correct": float(torch.exp(-((w - self.targets[c]) ** 2).mean())), "total": 1.0}
        return out

    def run(self, op, rnd, calls, purpose=None, **_):
        """PACFL's `subspace`: a client's class bases span the axes of its target's sign
        (3 of the first 6 coordinates of a 16-d pixel space), slightly tilted per client."""
        assert op.name == "subspace", op
        g = torch.Generator().manual_seed(11)
        out = {}
        for c, call in calls.items():
            first = 0 if float(self.targets[c][0]) > 0 else 3
            basis = torch.zeros(call.meta["basis"], 16, dtype=torch.float64)
            basis[:, first : first + 3] = torch.eye(3, dtype=torch.float64)[: call.meta["basis"]]
            basis += 0.01 * torch.randn(basis.shape, generator=g, dtype=torch.float64)
            basis /= basis.norm(dim=1, keepdim=True)
            out[int(c)] = Reply({"basis": basis.float().numpy()}, {"n": int(self.n[c])})
            self._count("up", "embedding", basis.numel() * 4)
        return Exchange(out, sorted(out), {"bytes": {}})

    def embed(self, rnd, clients, tensors, meta, purpose="fcr", again=()):
        self._count("down", "encoder", sum(t.nbytes for t in tensors.values()) * (len(clients) - len(again)))
        e = meta["latent"]
        g = torch.Generator().manual_seed(7)
        out = {}
        for c in clients:
            centre = float(self.targets[c][0]) * torch.ones(e)
            cents, shares = (
                (centre + 0.1 * torch.randn(meta["k"], e, generator=g)).numpy(),
                np.full(meta["k"], 0.2, np.float32),
            )
            out[int(c)] = (cents, shares, None)  # no halves: FCR's split rule alone
            self._count("up", "embedding", cents.nbytes + shares.nbytes)
        return Exchange(out, sorted(out), {"bytes": {}})


LOOP = {
    "local": (Local, {}),
    "fedprox": (FedProx, {"mu": 0.1}),
    "ifca": (IFCA, {"clusters": 2, "warmup_rounds": 2}),
    "fedsem": (FedSEM, {"centers": 2}),
    "cfl": (CFL, {"warmup_rounds": 3, "eps1": 1.5, "eps2": 4.0}),
    "fedgroup": (FedGroup, {"groups": 2, "pretrain_scale": 5}),  # 10 of 20 pre-train, the rest cold-start
    "pacfl": (PACFL, {}),  # the authors' threshold (4.9 degrees) separates the two planted subspaces
    "pca_km_hc": (PCAKMHC, {"components": 8, "clusters": 2}),
    "oracle": (Oracle, {}),
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "pca_km_hc" else n for n in sorted(LOOP)]
)  # pca_km_hc: about 1.7 s of CPU
def test_round_loop_and_byte_formula(tmp_path, name):
    from flt.server.federation import run_method

    m, rounds = 20, 12
    truth = np.repeat([0, 1], m // 2)
    ctx = make_ctx(tmp_path, m=m, truth=truth, n_train=np.full(m, 5))
    ctx.public_images = image_source(DIGITS, np.arange(200))
    targets = torch.where(torch.as_tensor(truth)[:, None] == 0, 3.0, -3.0) * torch.ones(m, P)
    cls, params = LOOP[name]
    strategy = cls(ctx, **params)
    assert strategy.name == name
    fed = FakeFederation(targets, ctx.n_train)
    history = run_method(
        strategy, fed, Population(m, 0.5, 0), rounds, eval_every=4, out_dir=tmp_path / name, progress=lambda s: None
    )
    assert len(history) == rounds and all("acc_mean" in history[r] for r in (3, 7, 11))
    selections = sum(r["selected"] for r in history)
    expected = strategy.expected_bytes(selections, P * 4)
    b = fed.transport.ledger.bytes
    measured = sum(b[d][k] for d in b for k in b[d])
    assert expected["bytes"] == measured, (expected, b)  # pca_km_hc: FLT's M*W_enc + k*M*e + 2*rho*M*W*T
    summary = strategy.summary()
    json.dumps(summary), json.dumps(expected)  # summary.json must be able to hold them
    if name in ("ifca", "fedsem", "cfl", "fedgroup", "pacfl", "oracle"):
        assert summary["ari"] == pytest.approx(1.0), summary
    if name == "fedgroup":
        assert summary["pretrained_clients"] == 10 and sum(c["clients"] for c in summary["cold_starts"]) > 0
    if name == "pca_km_hc":
        assert summary["fcr"]["ari"] == pytest.approx(1.0)
    if name != "fedprox":  # one model cannot serve two opposed targets
        assert history[-1]["acc_mean"] > 60.0, (name, history[-1])


def test_fedgroup_edc_features_are_the_cosines_to_the_top_singular_directions():
    """The Gram-matrix route gives FedGroup's EDC features as its definition does (cosines of
    each update with dW^T's k top left singular vectors), up to each column's sign, even
    when the column blocks split the parameters unevenly."""
    from flt.server.strategies.fedgroup import edc_features, gram_matrix

    g = torch.Generator().manual_seed(0)
    basis = torch.randn(3, 1000, generator=g, dtype=torch.float64)
    dw = (torch.randn(12, 3, generator=g, dtype=torch.float64) * torch.tensor([5.0, 2.0, 1.0])) @ basis
    dw = (dw + 0.1 * torch.randn(12, 1000, generator=g, dtype=torch.float64)).float()
    dw[4] = 0.0  # a client whose update is zero: cosine 0 with every direction
    ref = dw.double().numpy()
    u = np.linalg.svd(ref.T, full_matrices=False)[0]
    norms = np.linalg.norm(ref, axis=1)
    cosines = ref @ u[:, :3] / np.where(norms > 0, norms, 1.0)[:, None]  # [n, k], |u_j| = 1
    got = edc_features(dw, 3)
    assert got.shape == (12, 3)
    signs = np.sign((got * cosines).sum(0))
    np.testing.assert_allclose(got * signs, cosines, atol=1e-9)
    assert np.all(got[4] == 0)
    np.testing.assert_allclose(gram_matrix(dw, block=333), ref @ ref.T, rtol=1e-12)
    # from the models and w^0 (as FedGroup's cold start calls it): the very same features
    w0 = torch.randn(1000, generator=g).float()
    models = dw + w0
    assert np.array_equal(edc_features(models, 3, origin=w0), edc_features(models - w0, 3))


def test_stack_consume_gives_the_same_stack_and_empties_the_replies():
    """FedGroup's cold start stacks 100 CNNs with consume=True so that the replies and the
    stack are not both held whole: the rows and counts are those of the plain stack, in
    the clients' order, and each stacked reply has left the dict (the others stay)."""
    from flt.server.strategies.base import stack

    results = {c: Result(torch.full((4,), float(c)), 10 + c, {}) for c in (3, 1, 7)}
    plain, n_plain = stack(results, [7, 1])
    models, n = stack(results, [7, 1], consume=True)
    assert torch.equal(models, plain) and torch.equal(n, n_plain) and n.dtype == n_plain.dtype
    assert models[:, 0].tolist() == [7.0, 1.0] and n.tolist() == [17.0, 11.0]
    assert list(results) == [3]
    results[5] = Result(None, 4, {})
    with pytest.raises(ValueError, match=r"clients \[5\] returned no model"):
        stack(results, [3, 5], consume=True)
    assert list(results) == [3, 5]  # refused before anything was taken


def test_fedgroup_places_a_late_joiner_by_the_groups_cold_start_directions(tmp_path):
    """A client that joins after the groups have trained is compared, as FedGroup's authors
    do (`client_cold_start` against each group's `opt_updates`), with where each group's
    members went from w^0, like its own update, and not with the group's latest round step.
    Here each group's round step points along the other group's cold-start direction, as
    late steps of a trained model need not follow the first ones: by its latest step every
    joiner would land in the wrong group."""
    m = 6
    truth = np.array([0, 0, 0, 1, 1, 1])
    ctx = make_ctx(tmp_path, m=m, truth=truth, n_train=np.full(m, 5))
    way = torch.eye(P)[:2] * 3.0  # group 0 goes along e_0 from w^0, group 1 along e_1
    fed = FakeFederation(ctx.init + 2 * way[truth], ctx.n_train)  # training steps halfway there
    fed.present = np.arange(m)
    strategy = FedGroup(ctx, groups=2, pretrain_scale=2)  # 4 of the 6 pre-train
    strategy.setup(fed)
    warm = np.flatnonzero(strategy.group >= 0)
    joiners = np.flatnonzero(strategy.group < 0)
    assert len(warm) == 4 and len(joiners) == 2
    group_of = {int(truth[c]): int(strategy.group[c]) for c in warm}
    assert sorted(group_of.values()) == [0, 1]  # the cold start separated the two
    step = {int(c): result(strategy.models[strategy.group[c]] + 5 * way[1 - truth[c]]) for c in warm}
    strategy.aggregate(1, step)  # each group's round step: along the other group's way
    noise = 0.1 * torch.randn(m, P, generator=torch.Generator().manual_seed(5))
    joined = {int(c): result(ctx.init + way[truth[c]] + noise[c]) for c in joiners}
    strategy.aggregate(2, joined)
    assert [int(strategy.group[c]) for c in joiners] == [group_of[int(truth[c])] for c in joiners]
    assert strategy.summary()["ari"] == pytest.approx(1.0)


def test_fedgroup_with_more_groups_than_clients_keeps_one_group_a_client(tmp_path, caplog):
    """groups: 5 on 3 clients stopped the whole run (exit 3, "fewer than m = 5") after the
    methods before it; now it goes on with 3 groups and says so."""
    from flt.server.federation import run_method

    m = 3
    truth = np.arange(m)
    ctx = make_ctx(tmp_path, m=m, truth=truth, n_train=np.full(m, 5))
    targets = torch.as_tensor([-3.0, 0.0, 3.0])[:, None] * torch.ones(m, P)
    strategy = FedGroup(ctx, groups=5)
    with caplog.at_level("WARNING"):
        history = run_method(
            strategy, FakeFederation(targets, ctx.n_train), Population(m, 1.0, 0), 4, 2, tmp_path / "fg", lambda s: None
        )
    assert len(history) == 4 and strategy.m == 3 and strategy.models.shape[0] == 3
    assert "fedgroup: 5 groups asked for, but 3 of 3 pre-training clients answered" in caplog.text
    assert strategy.summary()["ari"] == pytest.approx(1.0)


@pytest.mark.parametrize("stop_at, summarized", [(3, 3), (6, 5)])
def test_a_stop_during_a_checkpoint_leaves_the_summary_with_the_last_record(tmp_path, monkeypatch, stop_at, summarized):
    """SIGTERM or Ctrl-C while a round's checkpoint was written left that round's record
    on disk and the summary one round behind (a flaky end-to-end test saw 5 records and a
    summary of 4). The summary now catches up, except after the last round, where its
    count marks the method finished and the checkpoint may be missing."""
    from flt.server.federation import CheckpointPacer, run_method

    monkeypatch.setattr(CheckpointPacer, "due", lambda self, final=False: True)  # every round, not by time
    m = 4
    ctx = make_ctx(tmp_path, m=m, truth=np.zeros(m, np.int64), n_train=np.full(m, 5))

    class StoppedMidCheckpoint(FakeFederation):
        def state_dict(self, rnd, references=False):
            if rnd == stop_at:
                raise KeyboardInterrupt
            return {}

    seen: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        run_method(
            FedAvg(ctx), StoppedMidCheckpoint(torch.ones(m, P), ctx.n_train), Population(m, 1.0, 0), 6, 1,
            tmp_path / "fa", lambda s: None, on_round=lambda history: seen.append(len(history)),
        )  # fmt: skip
    assert len((tmp_path / "fa" / "metrics.jsonl").read_text().splitlines()) == stop_at
    assert seen[-1] == summarized


# -- construction: every strategy validates its own parameters the same way -------------
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_fills_defaults_and_names_a_wrong_field(tmp_path, name):
    cls = STRATEGIES[name]
    built = cls(make_ctx(tmp_path))  # no parameters: the schema's defaults
    assert built.params == validate({}, METHODS[name].params)
    assert cls(make_ctx(tmp_path), **built.params).params == built.params  # validated params validate again
    with pytest.raises(ConfigError, match=rf"{name}\.no_such_field: unknown field"):
        cls(make_ctx(tmp_path), no_such_field=1)


def test_a_cross_field_rule_holds_in_code_as_in_a_scenario(tmp_path):
    with pytest.raises(ConfigError, match="flt: linkage 'ward_graph' clusters the thresholded graph"):
        STRATEGIES["flt"](make_ctx(tmp_path), linkage="ward_graph")
    assert PCAKMHC(make_ctx(tmp_path), linkage="ward_graph").params["gamma"] is None  # takes a quantile instead


# -- PACFL -------------------------------------------------------------------------------
def _plane(axes: list[int], d: int = 12, tilt: float = 0.0, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed)
    b = np.eye(d)[axes] + tilt * g.standard_normal((len(axes), d))
    return b / np.linalg.norm(b, axis=1, keepdims=True)


def test_pacfl_angles_are_the_smallest_between_any_two_basis_vectors():
    a, b, c = _plane([0, 1]), _plane([1, 2]), _plane([3, 4])
    angles = smallest_angles([a, b, c, -a])  # a sign flip of a singular vector changes nothing
    assert angles.shape == (4, 4) and (np.diag(angles) == 0).all() and np.allclose(angles, angles.T)
    assert angles[0, 1] == pytest.approx(0.0, abs=1e-5)  # they share axis 1
    assert angles[0, 2] == pytest.approx(90.0) and angles[0, 3] == pytest.approx(0.0, abs=1e-5)
    ragged = smallest_angles([a, _plane([1]), c])  # clients holding different numbers of classes
    assert ragged[0, 1] == pytest.approx(0.0, abs=1e-5) and ragged[1, 2] == pytest.approx(90.0)


def test_pacfl_merges_within_the_threshold_or_cuts_into_c():
    bases = [_plane([0, 1], tilt=0.02, seed=s) for s in range(3)] + [
        _plane([5, 6], tilt=0.02, seed=s) for s in range(3)
    ]
    a = smallest_angles(bases)
    two = hierarchical(a, "average", 4.9, None)
    assert len(set(two[:3])) == 1 and len(set(two[3:])) == 1 and two[0] != two[3]
    assert len(set(hierarchical(a, "average", 0.01, None))) == 6  # nothing is that close
    assert len(set(hierarchical(a, "maximum", 20.0, None))) == 2  # the authors' other linkages
    assert len(set(hierarchical(a, "minimum", 89.99, None))) == 1  # about 88-89 degrees apart
    assert len(set(hierarchical(a, "average", 4.9, 3))) == 3  # C given: the same tree, cut into 3


def test_pacfl_cross_angles_do_not_depend_on_the_slice_size():
    bases = [_plane([i % 6, (i + 1) % 6], tilt=0.05, seed=i) for i in range(7)]
    whole = cross_angles(bases[:3], bases)
    np.testing.assert_allclose(cross_angles(bases[:3], bases, budget=1), whole)  # one client per slice
    np.testing.assert_allclose(smallest_angles(bases)[:3], np.where(np.eye(3, 7, dtype=bool), 0.0, whole), atol=1e-9)


def test_pacfl_asks_a_client_whose_subspace_did_not_come_again_and_places_it(tmp_path, caplog):
    """A device frozen through PACFL's one-shot exchange: its clients would train the
    clusters' mean model for the rest of the run. They are asked again at the end of the
    next round and placed as newcomers are, RETRIES times at most."""
    m, truth = 8, np.repeat([0, 1], 4)
    ctx = make_ctx(tmp_path, m=m, truth=truth, n_train=np.full(m, 5))
    targets = torch.where(torch.as_tensor(truth)[:, None] == 0, 3.0, -3.0) * torch.ones(m, P)
    fed = FakeFederation(targets, ctx.n_train)
    fed.present = np.arange(m)
    unanswered = {2: 1, 6: 99}  # requests each leaves unanswered
    answer, again = fed.run, []

    def flaky(op, rnd, calls, purpose=None, **kw):
        again.append(sorted(kw.get("again", ())))
        ex = answer(op, rnd, calls, purpose)
        for c in list(ex.results):
            if unanswered.get(c, 0) > 0:
                unanswered[c] -= 1
                del ex.results[c]
        return ex

    fed.run = flaky
    s = PACFL(ctx)
    s.setup(fed)
    assert s.labels[2] == s.labels[6] == -1
    (event,) = s.maintain(1, fed)
    assert event["kind"] == "retry" and event["clients"] == [2, 6]
    assert again == [[], [2, 6]]  # asked once more: those requests are not billed
    assert s.labels[2] == s.labels[0] and s.labels[6] == -1
    with caplog.at_level(logging.WARNING, logger="flt.server"):
        later = [s.maintain(rnd, fed) for rnd in range(2, 6)]
    assert [len(events) for events in later] == [1] * (PACFL_RETRIES - 1) + [0] * (5 - PACFL_RETRIES)
    assert s.labels[6] == -1 and "client 6 left 4 subspace requests unanswered" in caplog.text
