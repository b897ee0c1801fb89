"""How often the devices' change test (devices/watch.py) cries wolf, and how often it
misses a real move, on real data with FLT's default encoder.

For each dataset an encoder is pretrained as FLT's default does (ConvAE, e = 128, 10
epochs of Adam on 3,000 training images no client below uses; cached like FLT's). A
"client" holds 600 images of two classes, as in S1 (classes 2j and 2j+1). Each trial
tests 64 of a client's images against 64 of new data:
- resample: 600 fresh images of the same two classes (its store changed, its distribution
  did not): a flag is a false alarm;
- move: 600 images of another S1 cluster's two classes (what drift does): a missing flag
  is a miss.
The test's level is alpha = 0.01, so about 1 % false alarms are expected by design.

    .venv/bin/python benchmarks/bench_watch.py              # MNIST, Fashion-MNIST, CIFAR-10
    .venv/bin/python benchmarks/bench_watch.py --trials 500

Writes benchmarks/results/watch.json (change it with --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DATA = REPO.parent / "shared" / "data"
sys.path.insert(0, str(HERE))

from machine import machine_info  # noqa: E402

from flt.devices import watch  # noqa: E402
from flt.models.autoencoder import bottleneck_channels  # noqa: E402
from flt.scenarios.datasets import load_shared  # noqa: E402
from flt.server.encoder import pretrained_autoencoder  # noqa: E402

ROOTS = {"cifar10_jpg": "cifar10-jpg"}  # folders of the shared data, where not the root itself
SETTINGS = {"epochs": 10, "lr": 1e-3, "batch_size": 64, "latent": 128, "seed": 0}  # FLT's encoder defaults


def calibrate(name: str, trials: int, seed: int = 0) -> dict:
    ds = load_shared(name, str(DATA / ROOTS.get(name, "")), train=True)
    x, y = np.asarray(ds.x), np.asarray(ds.y)
    rng = np.random.default_rng(seed)
    public = rng.choice(len(x), 3000, replace=False)
    settings = SETTINGS | {"channels": bottleneck_channels("auto", x.shape[1])}
    ae, _ = pretrained_autoencoder(x[public], settings, torch.device("cpu"))
    rest = np.setdiff1d(np.arange(len(x)), public)
    pool = {j: rest[np.isin(y[rest], [2 * j, 2 * j + 1])] for j in range(5)}  # S1's five clusters

    def embed(idx: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return ae.encoder(torch.from_numpy(x[idx].astype(np.float32) / 255.0)).numpy()

    out = {"false_alarms": 0, "misses": 0, "trials": trials}
    tic = time.perf_counter()
    for t in range(trials):
        a, b = rng.choice(5, 2, replace=False)
        mine = rng.permutation(pool[a])
        then, now = watch.sample_index(600, t), watch.sample_index(600, t + 1)  # what a device embeds
        ref = embed(mine[:600][then])
        same = embed(mine[600:1200][now])
        other = embed(rng.choice(pool[b], 600, replace=False)[now])
        out["false_alarms"] += watch.knn_pvalue(ref, same, t) < watch.ALPHA
        out["misses"] += watch.knn_pvalue(ref, other, t) >= watch.ALPHA
    out["seconds_per_test"] = (time.perf_counter() - tic) / (2 * trials)
    out["false_alarm_rate"] = out["false_alarms"] / trials
    out["miss_rate"] = out["misses"] / trials
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", default="mnist,fashion_mnist,cifar10_jpg")
    ap.add_argument("--trials", type=int, default=300)
    ap.add_argument("--out", default=str(HERE / "results" / "watch.json"))
    args = ap.parse_args()
    if not DATA.is_dir():
        sys.exit(f"{DATA}: the shared data folder is missing (see its README)")
    rows = {}
    print(f"{'dataset':<15}{'false alarms':>14}{'misses':>10}{'ms per test':>13}")
    for name in args.datasets.split(","):
        r = rows[name] = calibrate(name, args.trials)
        print(
            f"{name:<15}{r['false_alarms']:>8} / {r['trials']:<4}{r['misses']:>5} / {r['trials']:<4}"
            f"{1000 * r['seconds_per_test']:>12.1f}",
            flush=True,
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine_info(), "args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
