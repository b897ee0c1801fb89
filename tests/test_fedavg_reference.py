"""FedAvg against FedAvg by hand: the emulator over real device processes, and the
one-process reference loop of benchmarks/bench_fedavg_s1.py that it is measured against.

The reference once started every client from the client before it (torch's
vector_to_parameters made the model's parameters views of the global vector, so training
wrote into it), which learned far faster than FedAvg in the first rounds (S1 at T = 10:
79.5 % against the emulator's 67.5 %). Both halves are checked here against the same
definition: every selected client trains from the global model, and the new global model
is the sample-weighted average of what they return.
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flt_command import QUICKSTART, flt  # tests/ is on sys.path under pytest

from flt.devices.seeds import client_generator
from flt.devices.trainer import CohortTrainer, TrainConfig
from flt.emulator import config
from flt.emulator.population import Population
from flt.emulator.run import initial_weights
from flt.models.flat import flatten, load_flat, param_spec
from flt.models.nets import build_model
from flt.scenarios.datasets import load_dataset
from flt.scenarios.partition import Partition
from flt.server import checkpoint
from flt.server.federation import Federation
from flt.server.strategies.base import weighted_average

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmark scripts are not a package
import bench_fedavg_s1 as bench  # noqa: E402


def by_hand(start: torch.Tensor, trained_from) -> torch.Tensor:
    """FedAvg's aggregate of `trained_from(start)` -> (models [B, P], samples [B])."""
    models, n = trained_from(start)
    return weighted_average(models, torch.as_tensor(n))


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_reference_trains_every_client_from_the_global_model(one_thread):
    g = torch.Generator().manual_seed(0)
    shards = [(torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)) for n in (30, 50, 20)]
    torch.manual_seed(0)
    model = build_model("mlp", (1, 28, 28), 10)
    start = flatten(model)
    kept = start.clone()

    fresh = build_model("mlp", (1, 28, 28), 10)  # built here: building draws from torch's stream

    def each_from_start(w):
        rows = []
        for x, y in shards:
            load_flat(fresh, w)
            bench.train_client(fresh, x, y, 0.05, 10, 1)
            rows.append(flatten(fresh))
        return torch.stack(rows), [len(y) for _, y in shards]

    torch.manual_seed(1)  # the same batch order and dropout masks for both
    expected = by_hand(start, each_from_start)
    torch.manual_seed(1)
    got = bench.reference_round(model, start, shards, 0.05, 10, 1)
    assert torch.equal(start, kept)  # training must not write into the global model
    assert torch.allclose(got, expected, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_two_emulator_fedavg_rounds_equal_fedavg_by_hand(tmp_path, one_thread):
    """Two rounds over two real device processes: the server's global model after round 2
    and the accuracy it reported equal FedAvg computed here from the same clients, the
    same initial weights and the devices' own batch streams."""
    overrides = ["methods=[fedavg]", "train.rounds=2", "devices.processes=2"]
    res = flt("run", str(QUICKSTART), "--out", str(tmp_path), *[a for o in overrides for a in ("--set", o)])
    assert res.returncode == 0, res.stderr
    cfg = config.load(QUICKSTART, overrides, methods=["fedavg"])
    t = cfg["train"]
    train, test = load_dataset("digits", None, train=True), load_dataset("digits", None, train=False)
    part = Partition.load(tmp_path / "partition.npz")
    shard = lambda x, idx: torch.from_numpy(x[idx]).float().div_(255)  # noqa: E731  as devices do
    xs = [shard(train.x, i) for i in part.train]
    ys = [torch.from_numpy(train.y[i]).long() for i in part.train]
    init, spec = initial_weights(cfg, train)
    model = build_model(spec["name"], tuple(spec["in_shape"]), spec["num_classes"])
    trainer = CohortTrainer(model, param_spec(model))
    step = TrainConfig(epochs=t["local_epochs"], batch_size=t["batch_size"], lr=t["lr"], vectorize=False)
    population, everyone = Population(len(xs), t["participation"], cfg["seed"]), np.arange(len(xs))
    server = SimpleNamespace(seed=cfg["seed"])  # Federation._seed: the per-round seed sent with every task
    w = init
    for rnd in (1, 2):
        sel = population.select(rnd, everyone).tolist()
        seed = Federation._seed(server, rnd)  # type: ignore[arg-type]

        def trained(start, sel=sel, seed=seed):
            gens = [client_generator(seed, c) for c in sel]
            out, _ = trainer.train(start.expand(len(sel), -1), [xs[c] for c in sel], [ys[c] for c in sel], step, gens)
            return out, [len(ys[c]) for c in sel]

        w = by_hand(w, trained)
    got = checkpoint.load(tmp_path / "fedavg" / "checkpoint.npz")["strategy"]["global_model"]
    assert float((got - w).abs().max()) < 1e-5
    load_flat(model, w)
    model.eval()
    with torch.no_grad():
        acc = [100.0 * float((model(shard(test.x, i)).argmax(1).numpy() == test.y[i]).mean()) for i in part.test]
    last = (tmp_path / "fedavg" / "metrics.jsonl").read_text().splitlines()[-1]
    assert json.loads(last)["acc_mean"] == pytest.approx(np.mean(acc), abs=1e-9)
