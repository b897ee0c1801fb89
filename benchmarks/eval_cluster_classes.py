"""A finished run's global model under two test protocols, to measure what the protocol
alone does to a reported accuracy.

- **ours** (what `flt run` reports): the mean over clients of the accuracy on each
  client's own test shard, drawn in the proportions of its training classes.
- **the FLT authors' code** (their `base_fed_learning` evaluation): one client per planted
  cluster, each tested on every test image of its cluster's classes, averaged over the
  clusters. With S2's rings a shared class is in two clusters, so it weighs 2 / 15 and an
  unshared one 1 / 15 (CIFAR-10's test set has 1,000 images of each class).

Both use the same weights (the strategy's `global_model` in the run's last checkpoint:
FedAvg, FedProx), so the difference is the protocol. The run's own final accuracy is
printed beside the recomputed "ours" as a check that the model was loaded right.

    python benchmarks/eval_cluster_classes.py RUN_DIR/METHOD_LABEL
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import yaml

from flt.models.flat import load_flat
from flt.models.nets import build_model
from flt.scenarios.datasets import load_dataset
from flt.scenarios.partition import Partition, cluster_classes
from flt.server import checkpoint


def predictions(method_dir: Path) -> tuple[np.ndarray, np.ndarray, dict, Partition]:
    """The global model's predicted class for every test image, the labels, the config
    and the partition of the run."""
    ckpt = method_dir / "checkpoint.npz"
    if not ckpt.is_file():
        raise SystemExit(f"{ckpt}: no checkpoint (give a method's folder inside a finished run)")
    state = checkpoint.load(ckpt)["strategy"]
    if "global_model" not in state:
        raise SystemExit(f"{ckpt}: the checkpoint holds no single global model (FedAvg or FedProx only)")
    run = method_dir.parent
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    if cfg["partition"]["kind"] != "clusters":
        raise SystemExit(f"{run}: partition kind {cfg['partition']['kind']!r}; the protocol needs planted 'clusters'")
    test = load_dataset(cfg["data"]["dataset"], cfg["data"]["root"], train=False)
    model = build_model(cfg["model"], test.x.shape[1:], test.num_classes, cfg["train"]["inputs"])
    load_flat(model, state["global_model"].float())
    model.eval()
    with torch.no_grad():
        batches = np.array_split(test.x, max(1, len(test.x) // 256))
        pred = torch.cat([model(torch.from_numpy(b).float() / 255).argmax(1) for b in batches])
    return pred.numpy(), test.y, cfg, Partition.load(run / "partition.npz")


def evaluate(method_dir: Path) -> dict:
    """Both protocols' accuracy (%) of the run's final global model, and its per-class accuracy."""
    pred, y, cfg, part = predictions(method_dir)
    hit = pred == y
    per_class = np.bincount(y, weights=hit, minlength=int(y.max()) + 1) / np.bincount(y)
    p = cfg["partition"]
    layout = cluster_classes(p["clusters"], p["classes_per_cluster"], len(per_class), p["shared_classes"])
    authors = float(np.mean([per_class[cls].mean() for cls in layout])) * 100
    ours = float(np.mean([hit[idx].mean() for idx in part.test if len(idx)])) * 100
    final = json.loads((method_dir / "metrics.jsonl").read_text().splitlines()[-1]).get("acc_mean")
    return {
        "run": str(method_dir),
        "reported_final": final,
        "ours_recomputed": ours,
        "authors_protocol": authors,
        "difference": authors - ours,
        "per_class": [float(a) * 100 for a in per_class],
        "layout": layout,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("method_dir", type=Path, help="a method's folder inside a finished run (holds checkpoint.npz)")
    got = evaluate(ap.parse_args().method_dir)
    print(json.dumps({k: [round(a, 2) for a in v] if k == "per_class" else v for k, v in got.items()}, indent=2))


if __name__ == "__main__":
    main()
