"""FeSEM with soft assignment (server/strategies/fesem_soft.py) and the shared M-step
(cluster_average): the soft E-step's limit is FedSEM, a moderate temperature still
separates the clusters, and the method learns on the quickstart over real processes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flt_command import QUICKSTART, flt  # tests/ is on sys.path under pytest

from flt.common.schema import ConfigError
from flt.server.ops import EVALUATE, TRAIN
from flt.server.strategies import STRATEGIES
from flt.server.strategies.base import Context, Result, cluster_average, one_hot
from flt.server.strategies.fedsem import FedSEM
from flt.server.strategies.fesem_soft import FeSEMSoft

P, M = 12, 20


def ctx(tmp_path, truth) -> Context:
    g = torch.Generator().manual_seed(123)
    n = np.arange(M) % 4 + 3  # unequal sample counts: the weights matter
    return Context(
        init=torch.randn(P, generator=g),
        n_clients=M,
        n_train=n,
        device=torch.device("cpu"),
        seed=0,
        truth=truth,
        train={},
    )


def rounds(strategy, targets: torch.Tensor, n: np.ndarray, t: int = 12):
    """The round loop with 'training' that moves each model halfway to its client's
    target; the same participation draws for every strategy."""
    rng = np.random.default_rng(5)
    for rnd in range(1, t + 1):
        selected = np.sort(rng.choice(M, M // 2, replace=False))
        tasks = strategy.train_tasks(rnd, selected)
        results = {c: Result(t.models[0] + 0.5 * (targets[c] - t.models[0]), int(n[c]), {}) for c, t in tasks.items()}
        strategy.aggregate(rnd, results)
    return strategy


@pytest.fixture()
def problem(tmp_path):
    truth = np.repeat([0, 1], M // 2)
    targets = torch.where(torch.as_tensor(truth)[:, None] == 0, 3.0, -3.0) * torch.ones(M, P)
    targets += 0.3 * torch.randn(M, P, generator=torch.Generator().manual_seed(9))
    return ctx(tmp_path, truth), targets


def test_a_very_low_temperature_is_fedsems_hard_assignment(problem):
    c, targets = problem
    hard = rounds(FedSEM(c, centers=2), targets, c.n_train)
    soft = rounds(FeSEMSoft(c, centers=2, temperature=1e-9), targets, c.n_train)
    assert torch.equal(hard.centres, soft.centres)
    np.testing.assert_array_equal(hard.assign, soft.assign)
    assert soft.confidence[-1] == 1.0


def test_a_moderate_temperature_is_soft_and_still_finds_the_clusters(problem):
    c, targets = problem
    hard = rounds(FedSEM(c, centers=2), targets, c.n_train)
    soft = rounds(FeSEMSoft(c, centers=2, temperature=0.5), targets, c.n_train)
    assert 0.5 < soft.confidence[-1] < 1.0  # every centre got a share of every model
    assert soft.summary()["ari"] == pytest.approx(1.0)
    assert not torch.equal(hard.centres, soft.centres)
    gap = lambda s: float((s.centres[0] - s.centres[1]).norm())  # noqa: E731
    assert gap(soft) < gap(hard)  # soft shares pull the two centres towards each other
    json.dumps(soft.summary())


@pytest.mark.parametrize(
    "params, what",
    [
        ({"temperature": 0}, "temperature: 0"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": "warm"}, "temperature"),
        ({"temprature": 0.1}, "did you mean 'temperature'"),
    ],
)
def test_bad_parameters_are_refused_naming_the_field(problem, params, what):
    with pytest.raises(ConfigError, match=what):
        FeSEMSoft(problem[0], **params)


def test_registered_with_the_device_ops_of_fedsem():
    assert STRATEGIES["fesem_soft"] is FeSEMSoft and FeSEMSoft.DEVICE_OPS == (TRAIN, EVALUATE)


def test_cluster_average_with_hard_and_soft_responsibilities():
    g = torch.Generator().manual_seed(0)
    models, n = torch.randn(5, P, generator=g), torch.tensor([1.0, 2, 3, 4, 5])
    keep = torch.randn(3, P, generator=g)
    hard = cluster_average(models, n, one_hot([0, 0, 2, 2, 2], 3, models), keep=keep)
    torch.testing.assert_close(hard[0], (1 * models[0] + 2 * models[1]) / 3)
    torch.testing.assert_close(hard[2], (3 * models[2] + 4 * models[3] + 5 * models[4]) / 12)
    assert torch.equal(hard[1], keep[1])  # no member: kept
    soft = cluster_average(models, n, torch.full((2, 5), 0.5))
    torch.testing.assert_close(soft[0], (n @ models) / n.sum())  # equal shares: FedAvg in each
    torch.testing.assert_close(soft[1], soft[0])


@pytest.mark.slow
def test_fesem_soft_learns_on_the_quickstart(tmp_path):
    res = flt(
        "run",
        str(QUICKSTART),
        "--set",
        "methods=[fedavg, fesem_soft]",
        "--set",
        "train.rounds=10",
        "--set",
        "train.eval_every=10",
        "--out",
        str(tmp_path),
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    methods = json.loads((tmp_path / "summary.json").read_text())["methods"]
    soft, avg = methods["fesem_soft"], methods["fedavg"]
    assert soft["final_accuracy"] > 80 and soft["final_accuracy"] > avg["final_accuracy"] + 5, (soft, avg)
