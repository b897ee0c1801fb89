"""The server's round loop and the calls a strategy may make on the population.

`Federation` turns strategy-level requests (train these clients from these models,
evaluate these models, embed with this encoder) into wire messages through the
transport, and turns replies back into tensors on the aggregation device.
`run_method` drives one method for T rounds and streams one JSON line per round.

The emulator plugs its behaviour in through a `population` object (participation
sampling, device clock, arrivals, drift); the server never imports the emulator.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

from models.wire import Message
from server.replies import ShardSizes, centroids_check, metrics_check, update_check
from server.strategies.base import Result, Strategy, Task
from server.transport import Transport

log = logging.getLogger("flt.server")


class Federation:
    def __init__(self, transport: Transport, train_cfg: dict, seed: int, timeout_s: float,
                 device: torch.device, shard_sizes: ShardSizes | None = None):
        self.transport, self.cfg, self.seed = transport, train_cfg, seed
        self.shard_sizes = shard_sizes  # replies' sample counts and totals are checked against it
        self.timeout_s, self.device = timeout_s, device
        self.method = ""
        self.present = np.zeros(0, dtype=np.int64)       # clients in the population now
        self.round_bytes: dict[int, tuple[int, int]] = {}  # client -> (down, up) payload this round

    def _seed(self, rnd: int, salt: int = 0) -> int:
        return (self.seed * 7919 + rnd * 104_729 + salt) % (2 ** 31)

    def train(self, rnd: int, tasks: dict[int, Task], delays: dict[int, float] | None = None,
              timeout_s: float | None = None) -> dict[int, Result]:
        """Train the selected clients; `delays` (real-time mode) makes each device wait
        that long before answering, and replies later than `timeout_s` are dropped."""
        base = {"epochs": self.cfg["local_epochs"], "batch_size": self.cfg["batch_size"],
                "lr": self.cfg["lr"], "vectorize": self.cfg["vectorize"], "seed": self._seed(rnd)}
        msgs = {}
        for c, t in tasks.items():
            tensors = {} if t.models is None else {"model": t.models.detach().cpu().numpy()}
            delay = {"delay_s": delays[c]} if delays else {}
            msgs[c] = Message("train", rnd, c, tensors=tensors, meta={**base, **t.meta, **delay})
        replies = self.transport.gather(msgs, "update", timeout_s or self.timeout_s,
                                        check=update_check(msgs, self.shard_sizes))
        self.round_bytes = {c: (sum(t.nbytes for t in msgs[c].tensors.values()),
                                sum(t.nbytes for t in r.tensors.values())) for c, r in replies.items()}
        return {c: Result(self._tensor(r, "model"), int(r.meta["n"]), r.meta) for c, r in replies.items()}

    def _tensor(self, msg: Message, name: str):
        if name not in msg.tensors:
            return None
        return torch.from_numpy(msg.tensors[name].copy()).to(self.device)

    def evaluate(self, rnd: int, clients: np.ndarray, models: torch.Tensor | None,
                 rows: np.ndarray) -> dict[int, dict]:
        """Evaluate client c with models[rows[i]] on its own test shard (on its device)."""
        host = None if models is None else models.detach().cpu().numpy()
        msgs = {}
        for c, r in zip(clients.tolist(), rows.tolist()):
            tensors = {} if host is None else {"model": host[r:r + 1]}
            msgs[c] = Message("evaluate", rnd, c, tensors=tensors, meta={"resident": host is None})
        replies = self.transport.gather(msgs, "metrics", self.timeout_s, check=metrics_check(self.shard_sizes))
        return {c: m.meta for c, m in replies.items()}

    def embed(self, rnd: int, clients, tensors: dict[str, np.ndarray], meta: dict) -> dict[int, np.ndarray]:
        """Send an encoder to each client (once per client, counted as 'encoder' bytes) and
        collect its k x e centroids."""
        msgs = {int(c): Message("encoder", rnd, int(c), tensors=tensors,
                                meta={**meta, "seed": self._seed(rnd, 1)}) for c in clients}
        k = meta.get("k")  # "auto" picks k in 2..10 on the device
        replies = self.transport.gather(msgs, "centroids", self.timeout_s * 4,
                                        check=centroids_check(self.shard_sizes, k if isinstance(k, int) else 10))
        return {c: m.tensors["centroids"].copy() for c, m in replies.items()}


def accuracy_stats(metrics: dict[int, dict]) -> dict:
    """Mean per-client test accuracy (%), its standard error, variance across clients."""
    if not metrics:
        return {"acc_mean": float("nan"), "acc_se": float("nan"), "acc_var": float("nan"), "n_eval": 0}
    acc = 100.0 * np.array([m["correct"] / max(m["total"], 1.0) for m in metrics.values()])
    se = acc.std(ddof=1) / np.sqrt(len(acc)) if len(acc) > 1 else 0.0
    return {"acc_mean": float(acc.mean()), "acc_se": float(se), "acc_var": float(acc.var()),
            "acc_min": float(acc.min()), "n_eval": int(len(acc))}


def run_method(strategy: Strategy, fed: Federation, population, rounds: int, eval_every: int,
               out_dir: Path, progress=print) -> list[dict]:
    """Setup, then T rounds of select / train / aggregate / evaluate. Each round's record
    is appended to out_dir/metrics.jsonl as soon as it exists (a crash loses nothing)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    transport, history = fed.transport, []
    fed.method = strategy.name
    tic = time.perf_counter()
    fed.present = population.candidates(0)
    strategy.setup(fed)
    setup_s = time.perf_counter() - tic
    with open(out_dir / "metrics.jsonl", "w") as sink:
        for rnd in range(1, rounds + 1):
            r_tic = time.perf_counter()
            events = population.before_round(rnd, fed, strategy)
            candidates = np.setdiff1d(population.candidates(rnd), transport.lost_clients())
            fed.present = candidates
            selected = population.select(rnd, candidates)
            tasks = strategy.train_tasks(rnd, selected)
            results = fed.train(rnd, tasks, population.delays(rnd, tasks), population.timeout(fed.timeout_s))
            strategy.observe(rnd, results)
            results, clock = population.close_round(rnd, results, fed)
            strategy.aggregate(rnd, results)
            events += strategy.maintain(rnd, fed)
            record = {"method": strategy.name, "round": rnd, "selected": int(len(selected)),
                      "returned": int(len(results)), "events": events, **clock}
            record["train_s"] = time.perf_counter() - r_tic  # selection, training, aggregation
            if rnd % eval_every == 0 or rnd == rounds:
                e_tic = time.perf_counter()
                present = np.setdiff1d(population.candidates(rnd), transport.lost_clients())
                models, rows = strategy.eval_models(present)
                record.update(accuracy_stats(fed.evaluate(rnd, present, models, rows)))
                record["eval_s"] = time.perf_counter() - e_tic
            record["wall_s"] = time.perf_counter() - tic
            record["setup_s"] = setup_s
            record["bytes"] = _bytes_so_far(transport)
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            history.append(record)
            progress(_line(record, rounds))
    return history


def _bytes_so_far(transport: Transport) -> dict:
    t = transport.ledger.totals()
    return {d: {k: v["payload"] + v["overhead"] for k, v in t[d].items()} for d in t}


def _line(r: dict, rounds: int) -> str:
    up = sum(r["bytes"]["up"].values()) / 1e6
    down = sum(r["bytes"]["down"].values()) / 1e6
    acc = f"acc {r['acc_mean']:6.2f} ± {r['acc_se']:4.2f}" if "acc_mean" in r else " " * 18
    return (f"[{r['method']}] round {r['round']:>3}/{rounds}  {acc}  "
            f"up {up:8.2f} MB  down {down:8.2f} MB  train {r['train_s']:.2f} s  "
            f"({r['returned']}/{r['selected']} returned)")
