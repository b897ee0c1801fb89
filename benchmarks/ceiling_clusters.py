"""The centralised ceiling of a planted-cluster scenario: one model per planted cluster,
trained on all of the cluster's distinct training images pooled in one place, with the
scenario's model, batch size, learning rate, momentum and input scaling.

It is what any clustered method (FLT, the oracle, IFCA ...) could reach on this data and
model if federation cost nothing: no averaging of client drift, no partial
participation. If a paper's figure lies above this ceiling, no federated method run on
this data can reach it, and the gap is in the data or the model, not in the federation.

The default budget gives each cluster as many passes over its data as the federation
makes: rho * E passes a round (rho * M clients a round, E epochs each, over M shards that
cover the data once), so T * rho * E epochs in all. Accuracy is printed every few epochs
under both test protocols (`eval_cluster_classes.py`): ours (each client's test shard,
through its cluster's model) and the FLT authors' (every test image of a cluster's
classes). The structured sampler (S4) has no ring of classes for the authors' protocol:
its clusters are scored ours alone, per cluster as well. The momentum buffer restarts at
every evaluation, as a client's does at every round.

`--eval-every` may be a fraction of a pass (0.5: every half pass), to compare with a
federation that makes fewer SGD steps than one pass: each pass then draws a seeded order
of the cluster's images and trains one consecutive slice of it at a time (the momentum
buffer restarts at each slice).

    python benchmarks/ceiling_clusters.py SCENARIO.yaml [--set k=v ...] [--epochs N] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from eval_cluster_classes import hits, scores

from flt.devices.trainer import CohortTrainer, TrainConfig
from flt.emulator import config
from flt.emulator.run import build_partition, hold_out_public, initial_weights, load_data
from flt.models.flat import param_spec
from flt.models.nets import build_model


def cluster_data(train, part, clusters) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each of `clusters`' distinct training images (uint8) and labels, pooled."""
    xs, ys = [], []
    for k in clusters:
        members = np.flatnonzero(part.cluster == k)
        idx = np.unique(np.concatenate([part.train[c] for c in members]).astype(np.int64))
        xs.append(torch.from_numpy(np.ascontiguousarray(train.x[idx])))
        ys.append(torch.from_numpy(train.y[idx].astype(np.int64)))
    return xs, ys


def plot(result: dict, path: Path) -> None:
    """The ceiling's curve under both protocols, and each cluster's (the authors' protocol)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in result["curve"]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(epochs, [r["ours"] for r in result["curve"]], "k-o", ms=3, label="mean, our protocol")
    authors = result["final"]["authors_protocol"] is not None
    if authors:
        ax.plot(epochs, [r["authors_protocol"] for r in result["curve"]], "k--", label="mean, the authors' protocol")
    # each cluster under the authors' protocol where the class layout is known, else ours
    key = "per_cluster" if authors else "ours_per_cluster"
    if all(key in r for r in result["curve"]):
        for i, k in enumerate(result["clusters"]):
            ax.plot(epochs, [r[key][i] for r in result["curve"]], lw=0.8, label=f"cluster {k}")
    ax.set(xlabel="epochs over each cluster's pooled data", ylabel="test accuracy (%)")
    ax.set_title("centralised ceiling: one model per planted cluster", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def slices(done: float, step: float) -> list[tuple[int, float, float]]:
    """The span [done, done + step] (in passes) cut at whole passes: (pass, start, end),
    start and end as fractions of that pass."""
    out, lo, hi = [], done, done + step
    while hi - lo > 1e-9:
        p = math.floor(lo + 1e-9)
        end = min(hi, p + 1.0)
        out.append((p, lo - p, end - p))
        lo = end
    return out


def sgd(t: dict, epochs: int) -> TrainConfig:
    """The scenario's SGD settings for `epochs` passes."""
    return TrainConfig(epochs, t["batch_size"], t["lr"], momentum=t["momentum"], vectorize=t["vectorize"])


def train_slices(trainer, models, xs, ys, t, gens, done, step, orders):
    """Train `step` passes from pass position `done` (fractions allowed): each pass's
    images in a seeded order drawn when the pass starts, one consecutive slice a call."""
    tc = sgd(t, 1)
    for _, start, end in slices(done, step):
        if start < 1e-9:  # a new pass: a new order for each cluster
            orders = [torch.randperm(len(x), generator=g) for x, g in zip(xs, gens, strict=True)]
        cut = [o[round(start * len(o)) : round(end * len(o))] for o in orders]
        sub_x = [x[c] for x, c in zip(xs, cut, strict=True)]
        sub_y = [y[c] for y, c in zip(ys, cut, strict=True)]
        models, _ = trainer.train(models, sub_x, sub_y, tc, gens)
    return models, orders


def ceiling(cfg: dict, epochs: float, every: float, only: list[int] | None) -> dict:
    """Train each planted cluster's model on its pooled data; the curve every `every` epochs."""
    t = cfg["train"]
    train, test = load_data(cfg)
    part = build_partition(cfg, train, test, hold_out_public(cfg, len(train.y)))
    planted = np.unique(part.cluster[part.cluster >= 0])
    unknown = sorted(set(only or []) - set(planted.tolist()))
    if unknown:
        raise SystemExit(f"--clusters: no planted cluster {unknown} (the scenario plants {planted.tolist()})")
    clusters = np.array(only) if only else planted
    init, spec = initial_weights(cfg, train)
    model = build_model(cfg["model"], tuple(spec["in_shape"]), spec["num_classes"], t["inputs"])
    trainer = CohortTrainer(model, param_spec(model))
    xs, ys = cluster_data(train, part, clusters)
    print(f"{len(xs)} clusters of {[len(x) for x in xs]} distinct images; {epochs} epochs, evaluated every {every}")
    models = init[None].repeat(len(xs), 1)
    gens = [torch.Generator().manual_seed(int(cfg["seed"]) * 1000 + int(k)) for k in clusters]  # by id: subsets repeat
    rows = np.searchsorted(clusters, part.cluster).clip(0, len(clusters) - 1)  # a client's model (if scored)
    curve, done, tic = [], 0.0, time.perf_counter()
    whole = float(every).is_integer() and float(epochs).is_integer()
    orders: list[torch.Tensor] = []
    while done < epochs - 1e-9:
        step = min(every, epochs - done)
        if whole:
            models, _ = trainer.train(models, xs, ys, sgd(t, int(step)), gens)
        else:
            models, orders = train_slices(trainer, models, xs, ys, t, gens, done, step, orders)
        done += step
        got = scores(hits(model, models, test.x, test.y), test.y, rows, part, cfg["partition"], clusters)
        point = {k: got[k] for k in ("ours", "authors_protocol", "ours_per_cluster")}
        if got["per_cluster_classes"] is not None:  # a 'clusters' layout: the authors' protocol per cluster
            point["per_cluster"] = np.mean(got["per_cluster_classes"], axis=1).tolist()
        curve.append({"epoch": round(done, 6), **point})
        authors = "" if got["authors_protocol"] is None else f"authors' {got['authors_protocol']:6.2f}  "
        print(f"epoch {done:4g}  ours {got['ours']:6.2f}  {authors}({time.perf_counter() - tic:.0f} s)", flush=True)
    return {
        "epochs": epochs,
        "clusters": clusters.tolist(),
        "cluster_images": [len(x) for x in xs],
        "final": curve[-1],
        "best": max(curve, key=lambda r: r["ours"]),
        "per_cluster_classes": got["per_cluster_classes"],
        "layout": got["layout"],
        "curve": curve,
        "wall_s": time.perf_counter() - tic,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario")
    ap.add_argument("--set", action="append", default=[], help="override a field, as flt run's --set")
    ap.add_argument("--epochs", type=float, help="passes over each cluster's data (default: T * rho * E)")
    ap.add_argument(
        "--eval-every", type=float, help="passes between evaluations; fractions allowed (default: epochs / 20)"
    )
    ap.add_argument("--clusters", type=int, nargs="+", help="planted clusters to train (default: all)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: beside other runs)")
    ap.add_argument("--out", type=Path, help="write the curve and the final figures here (JSON; a PNG beside it)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = config.load(args.scenario, args.set)
    if cfg["partition"]["kind"] not in ("clusters", "structured"):
        raise SystemExit(f"{args.scenario}: partition kind {cfg['partition']['kind']!r}; needs planted clusters")
    t = cfg["train"]
    epochs = args.epochs or max(1, round(t["rounds"] * t["participation"] * t["local_epochs"]))
    result = ceiling(cfg, epochs, args.eval_every or max(1, epochs // 20), args.clusters)
    print(json.dumps({k: result[k] for k in ("epochs", "cluster_images", "final", "best")}))
    if args.out:
        # the resolved scenario travels with the figures, as with every run
        args.out.write_text(json.dumps({"scenario": args.scenario, "set": args.set, **result, "config": cfg}, indent=1))
        plot(result, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
