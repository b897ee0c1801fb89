"""SGD steps a FedAvg round makes on Scenario 4's layouts: the paper's and a run's.

FedAvg's update is the sample-weighted mean of its clients' updates, and client i's
update is E x ceil(n_i / B) SGD steps long, so to first order in the learning rate a round
moves the model by the n-weighted mean of those step counts. Under S4's quantity skew
(client j of a cluster's n gets alpha + exp(beta * j**delta) images) the large clients
dominate it, so it can be several times the median client's count.

The paper's layouts are drawn as the FLT authors' sampler draws them (EMNIST-balanced: nine
clusters of 12,000 images and one of 4,800, alpha = floor(pool / (2 n)), delta = 2), with
the project's own size rule (`scenarios.partition._skew_sizes`). A run's layout is read
from its `partition.npz`.

    python benchmarks/s4_steps.py [RUN ...] [--epochs 5 10 20 25] [--batch 10]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from flt.scenarios.partition import Partition, _skew_sizes

EMNIST_POOLS = [12_000] * 9 + [4_800]  # S4 on EMNIST-balanced: 2,400 images a class


def paper_sizes(clients: int) -> np.ndarray:
    """Client sizes of the authors' S4 sampler for M = `clients` over EMNIST-balanced."""
    per = clients // len(EMNIST_POOLS)
    return np.concatenate([_skew_sizes(per, pool, pool // (2 * per), 2.0)[0] for pool in EMNIST_POOLS])


def weighted_steps(sizes: np.ndarray, epochs: int, batch: int) -> float:
    """The n-weighted mean of E x ceil(n / B) over the clients."""
    n = sizes.astype(float)
    return float((n * epochs * np.ceil(n / batch)).sum() / n.sum())


def row(name: str, sizes: np.ndarray, epochs: int, batch: int) -> str:
    """One table line: sizes, the median client's steps and the n-weighted steps."""
    median = float(np.median(sizes))
    return (
        f"| {name} | {len(sizes)} | {sizes.min()} / {median:.0f} / {sizes.max()} "
        f"| {epochs} | {epochs * math.ceil(median / batch)} | {weighted_steps(sizes, epochs, batch):.0f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", type=Path, help="run folders holding partition.npz")
    ap.add_argument("--epochs", type=int, nargs="+", default=[5], help="E for the runs' rows")
    ap.add_argument("--batch", type=int, default=10)
    args = ap.parse_args()
    print("| layout | M | images a client: min / median / max | E | median client's steps | n-weighted steps |")
    print("| --- | --- | --- | --- | --- | --- |")
    layouts = [
        ("the paper's text, MLP (M = 2,400)", paper_sizes(2400), 5),
        ("the paper's text, CNN (M = 600, 60 a cluster)", paper_sizes(600), 5),
        ("the paper's text, CNN (100 a cluster)", paper_sizes(1000), 5),
        ("the authors' configs (M = 20, all a round)", paper_sizes(20), 1),
    ]
    for name, sizes, e in layouts:
        print(row(name, sizes, e, args.batch))
    for run in args.runs:
        sizes = Partition.load(run / "partition.npz").train_sizes
        for e in args.epochs:
            print(row(run.name, sizes, e, args.batch))


if __name__ == "__main__":
    main()
