"""The Flower side of bench_flower.py: S1-MNIST FedAvg as a Flower ClientApp and ServerApp.

Imported only when `flwr` is installed (the optional `bench` extra). It lives in its own
module, importable by name, so that Ray's worker processes (Flower's client actors) unpickle
the ClientApp by reference and keep this module's shard cache across calls, as a Flower
user's module-level data loading would.

The workload is bench_fedavg_s1's reference loop: the run's partition.npz, the seeded
initial weights, the MLP from models/nets.py, and each selected client trained one after
another by an actor with bench_fedavg_s1.train_client (plain torch SGD, batch 10, E = 1).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from bench_fedavg_s1 import load_shards, train_client
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation
from torch.nn.utils import vector_to_parameters

from flt.models.nets import build_model

# per actor process: (config key) -> (shards, model spec), loaded on the first train call
_SHARD_CACHE: dict[tuple, tuple[list, dict]] = {}
_MODEL_CACHE: dict[tuple, torch.nn.Module] = {}

client_app = ClientApp()


def _client_data(config: ConfigRecord) -> tuple[list, dict]:
    key = (config["scenario"], config["seed"], config["data_root"], config["run_dir"])
    if key not in _SHARD_CACHE:
        ns = argparse.Namespace(scenario=config["scenario"], seed=config["seed"])
        _, shards, _, spec, _ = load_shards(ns, Path(str(config["data_root"])), Path(str(config["run_dir"])))
        _SHARD_CACHE[key] = (shards, spec)
    return _SHARD_CACHE[key]


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)  # one CPU per actor (client_resources num_cpus = 1)
    config = msg.content["config"]
    shards, spec = _client_data(config)
    cid = int(context.node_config["partition-id"])
    x, y = shards[cid][0], shards[cid][1]
    key = (spec["name"], tuple(spec["in_shape"]), spec["num_classes"])
    if key not in _MODEL_CACHE:
        _MODEL_CACHE[key] = build_model(*key)
    model = _MODEL_CACHE[key]
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    started = time.time()  # wall clock: comparable with the driver's across processes
    train_client(model, x, y, float(config["lr"]), int(config["batch_size"]), int(config["epochs"]))
    content = RecordDict(
        {
            "arrays": ArrayRecord.from_torch_state_dict(model.state_dict()),
            "metrics": MetricRecord({"num-examples": len(y), "train-start": started}),
        }
    )
    return Message(content=content, reply_to=msg)


class TimedFedAvg(FedAvg):
    """FedAvg that records when each round's training is configured and aggregated, so a
    round's seconds cover selection, client training and aggregation (as the emulator's
    train_s does), and when the first client of each round started training."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.round_start: dict[int, float] = {}
        self.round_end: dict[int, float] = {}
        self.first_train_start: dict[int, float] = {}  # wall clock (time.time)

    def configure_train(self, server_round, arrays, config, grid):
        self.round_start[server_round] = time.perf_counter()
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        starts = [float(m.content["metrics"]["train-start"]) for m in replies if not m.has_error()]
        if starts:
            self.first_train_start[server_round] = min(starts)
        out = super().aggregate_train(server_round, replies)
        self.round_end[server_round] = time.perf_counter()
        return out


def run_flower(
    cfg: dict, init: torch.Tensor, spec: dict, run_dir: Path, data_root: Path, scenario: str, seed: int, actors: int
) -> dict:
    """One Flower simulation of FedAvg; returns its timings and the final weights."""
    t = cfg["train"]
    n_clients = cfg["partition"]["clients"]
    model = build_model(spec["name"], tuple(spec["in_shape"]), spec["num_classes"])
    vector_to_parameters(init, model.parameters())
    strategy = TimedFedAvg(
        fraction_train=t["participation"], fraction_evaluate=0.0, min_available_nodes=n_clients, min_train_nodes=1
    )
    train_config = ConfigRecord(
        {
            "lr": float(t["lr"]),
            "batch_size": int(t["batch_size"]),
            "epochs": int(t["local_epochs"]),
            "scenario": scenario,
            "seed": seed,
            "data_root": str(data_root),
            "run_dir": str(run_dir),
        }
    )
    final: dict = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        result = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord.from_torch_state_dict(model.state_dict()),
            num_rounds=t["rounds"],
            train_config=train_config,
        )
        final["state"] = result.arrays.to_torch_state_dict()

    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": actors}}
    t0, t0_wall = time.perf_counter(), time.time()
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=n_clients, backend_config=backend)
    total = time.perf_counter() - t0
    rounds = sorted(strategy.round_end)
    per_round = [strategy.round_end[r] - strategy.round_start[r] for r in rounds]
    if not rounds or 1 not in strategy.first_train_start:
        raise RuntimeError("the Flower simulation finished no training round (see the log above)")
    # Flower starts its ServerApp before the backend: round 1 is configured at once and waits for
    # Ray and the actors. Start-up is therefore taken as the call to the moment the first client
    # of round 1 begins training (after its actor is up and has loaded its shards).
    startup = strategy.first_train_start[1] - t0_wall
    return {
        "rounds": len(rounds),
        "per_round_s": per_round,
        "round1_s": strategy.round_end[1] - t0 - startup,
        "startup_s": startup,
        "round1_configured_s": strategy.round_start[1] - t0,
        "total_s": total,
        "actors": actors,
        "final_state": final.get("state"),
    }
