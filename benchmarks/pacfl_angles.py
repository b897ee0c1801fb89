"""Why PACFL's principal angles do or do not separate a scenario's planted clusters.

PACFL (server/strategies/pacfl.py) measures two clients by the smallest angle between any
vector of one's class bases and any of the other's: the top p left singular vectors of each
class's raw pixel matrix, uncentred, as its authors' `main_pacfl.py` computes them. This
script builds the scenario's partition, computes every client's bases as the `subspace`
op does (devices/methods/subspace.py) and prints, for each pair kind,

- **same**: both clients in one planted cluster;
- **neighbour**: different clusters that share a class (S2's rings);
- **disjoint**: different clusters with no class in common,

the angle's 5th / 50th / 95th percentiles, and how often the pair's smallest angle is met
between two bases of one class (a class both clients hold) rather than of two classes.
Then the clusters PACFL cuts (its threshold, and told C) and their ARI, for the angles as
PACFL computes them and with each suspected cause removed:

- **no shared class**: each client keeps only the bases of classes that belong to its own
  planted cluster alone (uses the truth; a diagnostic, not a method; skipped where no
  class is shared);
- **centred**: each class's mean image is subtracted before the SVD, so the leading vector
  is a direction of variation, not the class's mean brightness pattern.

    .venv/bin/python benchmarks/pacfl_angles.py scenarios/s2_cifar10.yaml [--set ...] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from sklearn.metrics import adjusted_rand_score

from flt.devices.methods.subspace import class_bases
from flt.emulator import config
from flt.emulator.run import build_partition, hold_out_public, load_data
from flt.server.strategies.pacfl import _stack, hierarchical, smallest_angles
from flt.server.strategies.params import PACFL as PACFL_PARAMS


def client_bases(x: np.ndarray, y: np.ndarray, shards: list[np.ndarray], p: int, centred: bool, keep=None):
    """Each client's [rows, d] bases and the class of each row. `keep[m]`: the classes
    client m may use (all by default)."""
    bases, classes = [], []
    for m, idx in enumerate(shards):  # one SVD per class of each client, as the devices do
        xs = torch.from_numpy(x[idx]).double() / 255
        ys = torch.from_numpy(y[idx])
        if keep is not None:
            mask = torch.from_numpy(np.isin(y[idx], keep[m]))
            xs, ys = xs[mask], ys[mask]
        if centred:
            flat = xs.reshape(len(xs), -1)
            means = torch.stack([flat[ys == c].mean(0) for c in torch.unique(ys).tolist()])
            xs = flat - means[torch.searchsorted(torch.unique(ys), ys)]
        bases.append(class_bases(xs, ys, p).double().numpy())
        held, counts = np.unique(ys.numpy(), return_counts=True)
        classes.append(np.repeat(held, np.minimum(counts, p)))  # class j gives min(p, n_j) vectors
    return bases, classes


def pair_kinds(holds: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """[M, M] 0 same cluster, 1 neighbour (a class in common), 2 disjoint; -1 on the diagonal."""
    same = truth[:, None] == truth[None, :]
    shared = (holds.astype(int) @ holds.T.astype(int)) > 0
    kinds = np.where(same, 0, np.where(shared, 1, 2))
    np.fill_diagonal(kinds, -1)
    return kinds


def same_class_argmin(bases, classes) -> np.ndarray:
    """[M, M] whether the pair's smallest angle falls between two rows of one class."""
    rows = max(len(b) for b in bases)
    t = _stack(bases, rows)  # PACFL's own padding: zero rows never win
    label = np.full((len(bases), rows), -1)
    for i, c in enumerate(classes):  # one copy per client
        label[i, : len(c)] = c
    cos = torch.einsum("ird,jsd->ijrs", t, t).abs().reshape(len(bases), len(bases), -1)
    best = cos.argmax(-1).numpy()
    r, s = np.divmod(best, rows)
    return label[np.arange(len(bases))[:, None], r] == label[np.arange(len(bases))[None, :], s]


def describe(angles, kinds, same_class, truth, threshold, c) -> dict:
    got = {}
    for k, name in enumerate(("same", "neighbour", "disjoint")):
        sel = kinds == k
        if sel.any():
            q = np.percentile(angles[sel], [5, 50, 95])
            got[name] = {"p5": q[0], "median": q[1], "p95": q[2], "same_class_min": float(same_class[sel].mean())}
    for label, told in (("threshold", None), ("told_c", c)):
        labels = hierarchical(angles, "average", threshold, told)
        got[label] = {
            "clusters": int(labels.max()) + 1,
            "sizes": sorted(np.bincount(labels).tolist(), reverse=True)[:8],
            "ari": float(adjusted_rand_score(truth, labels)),
        }
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario")
    ap.add_argument("--set", action="append", default=[], help="scenario override, as flt run --set")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    cfg = config.load(args.scenario, args.set)
    train, test = load_data(cfg)
    part = build_partition(cfg, train, test, hold_out_public(cfg, len(train)))
    truth = part.cluster
    if (truth < 0).any():
        raise SystemExit(f"{args.scenario}: the pair kinds need a planted cluster for every client")
    holds = np.stack([np.bincount(train.y[t], minlength=train.num_classes) > 0 for t in part.train])
    # the classes held by one planted cluster alone
    cluster_holds = np.stack([holds[truth == k].any(0) for k in np.unique(truth)])
    own = [np.flatnonzero(cluster_holds[truth[m]] & (cluster_holds.sum(0) == 1)) for m in range(len(truth))]
    p, threshold = PACFL_PARAMS["basis"].default, PACFL_PARAMS["threshold"].default
    c = len(np.unique(truth))
    kinds = pair_kinds(holds, truth)
    report = {
        "scenario": cfg["name"],
        "overrides": args.set,
        "clients": len(truth),
        "p": p,
        "threshold": threshold,
        "variants": {},
    }
    for name, centred, keep in (("pacfl", False, None), ("no_shared_class", False, own), ("centred", True, None)):
        t0 = time.perf_counter()
        if keep is not None and all(len(k) == holds[m].sum() for m, k in enumerate(keep)):
            continue  # no class is shared: the same as PACFL's own angles
        bases, classes = client_bases(train.x, train.y, part.train, p, centred, keep)
        angles = smallest_angles(bases)
        report["variants"][name] = describe(angles, kinds, same_class_argmin(bases, classes), truth, threshold, c)
        print(f"{name} ({time.perf_counter() - t0:.0f} s): {json.dumps(report['variants'][name])}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
