"""A finished run's models under two test protocols, to measure what the protocol alone
does to a reported accuracy.

- **ours** (what `flt run` reports): the mean over clients of the accuracy of the model
  each client is evaluated with on the client's own test shard, drawn in the proportions
  of its training classes.
- **the FLT authors' code** (`cluster_testdata_dict` and `evaluate_performance` in their
  `src/optim/flt.py`): every client tested on every test image of its planted cluster's
  classes, so each class of the cluster weighs the same. Their FedAvg tests one client
  per cluster, their FLT every client; with their equal-sized clusters both are the mean
  over clusters of the mean over its clients, which is what is computed here. With S2's
  rings and one global model a shared class weighs 2 / 15 and an unshared one 1 / 15
  (CIFAR-10's test set has 1,000 images of each class).

The models are those the run evaluated, from its last checkpoint: the strategy is rebuilt
from the saved config, its state loaded, and its own `eval_models` says which model each
client is tested with (FedAvg's global model; FLT's, the oracle's, FedSEM's, IFCA's
cluster models ...). Methods whose models stay on the devices (Local) cannot be re-tested.
The run's own final accuracy is printed beside the recomputed "ours" as a check that the
models were loaded right.

    python benchmarks/eval_cluster_classes.py RUN_DIR/METHOD_LABEL [RUN_DIR/METHOD_LABEL ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import yaml

from flt.models.flat import flatten, load_flat
from flt.models.nets import build_model
from flt.scenarios.datasets import load_dataset
from flt.scenarios.partition import Partition, cluster_classes
from flt.server import checkpoint
from flt.server.strategies import STRATEGIES
from flt.server.strategies.base import Context


def client_models(
    method_dir: Path, cfg: dict, part: Partition, model: torch.nn.Module
) -> tuple[torch.Tensor, np.ndarray]:
    """([R, P] models, the row each client is evaluated with), from the method's strategy
    rebuilt with the run's config and restored from its last checkpoint."""
    specs = [m for m in cfg["methods"] if m["label"] == method_dir.name]
    if not specs:
        raise SystemExit(f"{method_dir}: no method labelled {method_dir.name!r} in the run's config.yaml")
    name, params = specs[0]["name"], {k: v for k, v in specs[0].items() if k not in ("name", "label")}
    ctx = Context(
        init=flatten(model),
        n_clients=part.n_clients,
        n_train=np.array([len(t) for t in part.train]),
        device=torch.device("cpu"),
        seed=cfg["seed"],
        truth=part.cluster.copy(),
        train=cfg["train"],
    )
    strategy = STRATEGIES[name](ctx, **params)
    strategy.load_state_dict(checkpoint.load(method_dir / "checkpoint.npz")["strategy"])
    models, rows = strategy.eval_models(np.arange(part.n_clients))
    if models is None:
        raise SystemExit(f"{method_dir}: {name} keeps its models on the devices; the checkpoint cannot re-test them")
    return models.float(), np.asarray(rows, dtype=np.int64)


def hits(model: torch.nn.Module, models: torch.Tensor, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """[R, N] whether model row r classifies test image n right."""
    out = np.zeros((len(models), len(y)), dtype=bool)
    batches = np.array_split(np.arange(len(y)), max(1, len(y) // 256))
    with torch.no_grad():
        for r, weights in enumerate(models):
            load_flat(model, weights)
            model.eval()
            pred = torch.cat([model(torch.from_numpy(x[b]).float() / 255).argmax(1) for b in batches])
            out[r] = pred.numpy() == y
    return out


def scores(hit: np.ndarray, y: np.ndarray, rows: np.ndarray, part: Partition, partition_cfg: dict, only=None) -> dict:
    """Both protocols' accuracy (%) from `hit` [R, N] (model row r right on test image n)
    and the row each client is tested with; per planted cluster and class too. `only`:
    the planted clusters to score (their clients alone), all by default. The authors'
    protocol needs the class layout of a 'clusters' partition: for any other planted
    partition (the structured sampler) it is None, and clusters are scored ours alone."""
    keep = np.isin(part.cluster, only) if only is not None else np.ones(part.n_clients, dtype=bool)
    classes = int(y.max()) + 1
    per_class = (hit.astype(np.float64) @ np.eye(classes)[y]) / np.maximum(np.bincount(y, minlength=classes), 1)
    # ours: each client's test shard, through its own model row (one gather, no loop)
    lens = np.array([len(t) for t in part.test])
    owner = np.repeat(np.arange(part.n_clients), lens)
    shard_hit = hit[rows[owner], np.concatenate(part.test).astype(np.int64)]
    tested = (lens > 0) & keep
    client_acc = np.bincount(owner, shard_hit, minlength=part.n_clients) / np.maximum(lens, 1)
    truth = part.cluster
    planted = np.flatnonzero((truth >= 0) & keep)
    clusters = np.unique(truth[planted])
    scored = tested & (truth >= 0)
    at = np.searchsorted(clusters, truth[scored])  # each scored client's cluster, as a row of `clusters`
    sizes = np.maximum(np.bincount(at, None, len(clusters)), 1)
    per_cluster = np.bincount(at, client_acc[scored], len(clusters)) / sizes
    got = {
        "ours": float(np.mean(client_acc[tested])) * 100,
        "ours_per_cluster": (per_cluster * 100).tolist(),
        "per_class": (per_class[0] * 100).tolist() if len(hit) == 1 else None,
        "clusters": clusters.tolist(),
        "authors_protocol": None,
        "per_cluster_classes": None,
        "layout": None,
    }
    p = partition_cfg
    if p["kind"] != "clusters":
        return got
    # the authors': each planted client on every test image of its cluster's classes
    layout = np.array(cluster_classes(p["clusters"], p["classes_per_cluster"], classes, p["shared_classes"]))
    client_classes = per_class[rows[planted, None], layout[truth[planted]]]  # [clients, classes of the cluster]
    by_cluster = np.stack([client_classes[truth[planted] == k].mean(0) for k in clusters])
    got.update(
        authors_protocol=float(by_cluster.mean()) * 100,
        per_cluster_classes=(by_cluster * 100).tolist(),
        layout=layout[clusters].tolist(),
    )
    return got


def load_run(run: Path) -> tuple[dict, Partition]:
    """A finished run's config and partition; refuses one without planted clusters."""
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    if cfg["partition"]["kind"] != "clusters":
        raise SystemExit(f"{run}: partition kind {cfg['partition']['kind']!r}; the protocol needs planted 'clusters'")
    return cfg, Partition.load(run / "partition.npz")


def evaluate(method_dir: Path) -> dict:
    """Both protocols' accuracy (%) of the run's final models, per planted cluster and class."""
    run = method_dir.parent
    for need in (method_dir / "checkpoint.npz", run / "config.yaml"):
        if not need.is_file():
            raise SystemExit(f"{need}: missing (give a method's folder inside a finished run)")
    cfg, part = load_run(run)
    test = load_dataset(cfg["data"]["dataset"], cfg["data"]["root"], train=False)
    model = build_model(cfg["model"], test.x.shape[1:], test.num_classes, cfg["train"]["inputs"])
    models, rows = client_models(method_dir, cfg, part, model)
    got = scores(hits(model, models, test.x, test.y), test.y, rows, part, cfg["partition"])
    final = json.loads((method_dir / "metrics.jsonl").read_text().splitlines()[-1]).get("acc_mean")
    ours = got.pop("ours")
    return {
        "run": str(method_dir),
        "models": len(models),
        "reported_final": final,
        "ours_recomputed": ours,
        "difference": got["authors_protocol"] - ours,
        **got,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("method_dir", type=Path, nargs="+", help="a method's folder in a finished run")
    for method_dir in ap.parse_args().method_dir:
        got = evaluate(method_dir)
        rounded = {k: np.round(v, 2).tolist() if k.startswith("per_") and v is not None else v for k, v in got.items()}
        print(json.dumps(rounded, indent=2))


if __name__ == "__main__":
    main()
