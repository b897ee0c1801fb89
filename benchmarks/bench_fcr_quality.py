"""FCR quality suite: does client relatedness find the planted clusters, on data it was
never tuned for, with no per-dataset setting?

For every case (a partition of real data + an encoder + a seed) it runs FCR's client
side exactly as `flt relate` does (device processes over ZeroMQ, the ONNX encoder or
per-client fine-tuning, seeded k-means), keeps the clients' centroids, then re-clusters
those same centroids offline with every server-side variant below and reports ARI, NMI,
clusters found against planted, and seconds.

Separability of the embedding itself (is a failure the encoder's or the clustering's?),
two measures that use the planted labels, which FCR never sees:
- knn: each centroid's 5 nearest centroids of *other* clients (plain Euclidean distance
  in the encoder's space) vote for their owners' planted cluster; a client takes the
  majority of its centroids' votes. This is the geometry any unsupervised clustering
  must work with. A case with knn >= 0.9 "separates" its clusters: there the target is
  ARI >= 0.9, and a miss is the clustering's fault.
- probe: a client-level linear probe (logistic regression on the centroids, GroupKFold
  by client, a client's prediction sums its centroids' log-probabilities). A probe can
  succeed where distances do not (it learns which directions matter), so a high probe
  with a low knn says the information is in the embedding but not in its distances.

Defaults are chosen by the worst case over the suite, not the mean.

Run (needs the real data in ../shared/data, or $FLT_DATA; the first run pretrains encoders, cached):
    .venv/bin/python benchmarks/bench_fcr_quality.py              # the whole suite
    .venv/bin/python benchmarks/bench_fcr_quality.py --only mnist  # cases whose name matches
    .venv/bin/python benchmarks/bench_fcr_quality.py --only rotate,labels --keep-others  # re-run some, keep the rest
    .venv/bin/python benchmarks/bench_fcr_quality.py --only cifar10 --encoder channels=16 --out x.json  # other encoder
Writes benchmarks/results/fcr_quality.json and prints the tables. Centroids are cached
under benchmarks/.cache/fcr_quality (delete it to re-embed).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import yaml  # noqa: E402
from machine import machine_info  # noqa: E402
from sklearn.linear_model import LogisticRegression  # noqa: E402
from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score  # noqa: E402
from sklearn.model_selection import GroupKFold  # noqa: E402

DATA = Path(os.environ.get("FLT_DATA", REPO.parent / "shared" / "data")).resolve()
CACHE = REPO / "benchmarks" / ".cache" / "fcr_quality"
CACHE_VERSION = 3

# -- the suite ---------------------------------------------------------------------------
S1 = {"kind": "clusters", "clusters": 5, "classes_per_cluster": 2, "shared_classes": 0}
S2 = {"kind": "clusters", "clusters": 5, "classes_per_cluster": 3, "shared_classes": 1}
ENC_FEMNIST = {"dataset": "femnist", "root": str(DATA / "femnist"), "epochs": 10}
ENC_PUBLIC = {"dataset": "public", "epochs": 10}
ENC2_FMNIST = {"dataset": "fashion_mnist", "root": str(DATA), "epochs": 10, "finetune_epochs": 5}
ENC2_MNIST = {"dataset": "mnist", "root": str(DATA), "epochs": 10, "finetune_epochs": 5}


@dataclass
class Case:
    name: str
    dataset: str
    partition: dict
    encoder: dict
    seeds: tuple = (0,)
    root: str | None = str(DATA)
    public_fraction: float = 0.0
    note: str = ""
    flt: dict | None = None  # FLT parameters besides the encoder (k: labels)


def structured(c: int) -> dict:
    # S4's sampler on FEMNIST's pooled writers: C clusters of 8 classes (62 // C apart),
    # 10 clients per cluster, power-law sizes with a floor of 20 samples per client
    return {
        "kind": "structured",
        "clusters": c,
        "classes_per_cluster": 8,
        "clients": 10 * c,
        "alpha": 20.0,
        "delta": 0.5,
        "test_per_client": 20,
    }


def dirichlet(
    name: str, dataset: str, alpha: float, clients: int, samples: int, encoder: dict, seeds=(0,), **kw
) -> Case:
    """Label skew without planted clusters; alpha 100 is IID, where one cluster is right."""
    part = {"kind": "dirichlet", "clients": clients, "alpha": alpha, "samples_per_client": samples}
    note = "no structure: one cluster is right" if alpha >= 100 else "no planted clusters"
    return Case(name, dataset, part, encoder, seeds, note=note, **kw)


def shaped(name: str, dataset: str, c: int, classes: int, clients: int, seeds, samples: int = 500) -> Case:
    """C clusters of ``classes`` disjoint classes each, encoder learnt on a public slice."""
    part = {"kind": "clusters", "clusters": c, "classes_per_cluster": classes, "shared_classes": 0}
    part |= {"clients": clients, "samples_per_client": samples}
    root = DATA / "cifar10-jpg" if dataset == "cifar10_jpg" else DATA
    return Case(name, dataset, part, ENC_PUBLIC, seeds, root=str(root), public_fraction=0.1)


SUITE = [
    Case(
        "digits-s1-m20",
        "digits",
        {**S1, "clients": 20, "samples_per_client": 50, "test_per_client": 20},
        {"dataset": "public", "epochs": 100},
        (0, 1, 2),
        None,
        0.2,
    ),
    Case("mnist-s1-m100-enc1", "mnist", {**S1, "clients": 100, "samples_per_client": 600}, ENC_FEMNIST, (0, 1)),
    Case("mnist-s2-m100-enc1", "mnist", {**S2, "clients": 100, "samples_per_client": 600}, ENC_FEMNIST, (0, 1)),
    Case("mnist-s1-m50-enc2", "mnist", {**S1, "clients": 50, "samples_per_client": 600}, ENC2_FMNIST),
    Case("mnist-s1-m600-enc1", "mnist", {**S1, "clients": 600, "samples_per_client": 90}, ENC_FEMNIST),
    Case(
        "fmnist-s1-m100-enc1",
        "fashion_mnist",
        {**S1, "clients": 100, "samples_per_client": 500},
        ENC_PUBLIC,
        (0, 1),
        public_fraction=0.1,
    ),
    Case(
        "fmnist-s2-m100-enc1",
        "fashion_mnist",
        {**S2, "clients": 100, "samples_per_client": 500},
        ENC_PUBLIC,
        (0, 1),
        public_fraction=0.1,
    ),
    Case("fmnist-s2-m50-enc2", "fashion_mnist", {**S2, "clients": 50, "samples_per_client": 500}, ENC2_MNIST),
    # CIFAR-10's S1 clusters nest (two vehicle pairs, three animal pairs): the coarse cut
    # must not win when the finer one is separated; M 50 / 200 change the samples per client
    *[
        Case(
            f"cifar10-{tag}-m{m}-enc1",
            "cifar10_jpg",
            {**part, "clients": m, "samples_per_client": 45_000 // m},
            ENC_PUBLIC,
            seeds,
            root=str(DATA / "cifar10-jpg"),
            public_fraction=0.1,
        )
        for tag, part, m, seeds in (
            ("s1", S1, 100, (0, 1, 2)),
            ("s1", S1, 50, (0, 1)),
            ("s1", S1, 200, (0, 1)),
            ("s2", S2, 100, (0, 1)),
        )
    ],
    # the CIFAR-10 grid's M = 500 (scenarios/ablation_cifar10): 66 images a client, all there is
    Case(
        "cifar10-s2-m500-enc1",
        "cifar10_jpg",
        {**S2, "clients": 500, "samples_per_client": 66},
        ENC_PUBLIC,
        (0, 1),
        root=str(DATA / "cifar10-jpg"),
        public_fraction=0.1,
    ),
    # the same with the FLT authors' layout (their code, as the paper's grid ran): 99 images
    # a client, 33 of each class, a shared class's images the same in both clusters holding it
    Case(
        "cifar10-s2-m500-share-enc1",
        "cifar10_jpg",
        {**S2, "clients": 500, "samples_per_client": 99, "on_short": "share"},
        ENC_PUBLIC,
        (0, 1),
        root=str(DATA / "cifar10-jpg"),
        public_fraction=0.1,
    ),
    *[
        Case(
            f"femnist-structured-c{c}",
            "femnist",
            structured(c),
            ENC_PUBLIC,
            (0, 1),
            root=str(DATA / "femnist"),
            public_fraction=0.1,
        )
        for c in (3, 5, 10)
    ],
    # few samples per client: the ablation's M = 500 (87 images each), and IID clients of
    # every dataset, where one cluster is right (k-means artefacts are all there is)
    Case("mnist-s2-m500-enc1", "mnist", {**S2, "clients": 500, "samples_per_client": 87}, ENC_FEMNIST),
    dirichlet("mnist-iid-m500", "mnist", 100.0, 500, 87, ENC_FEMNIST),
    dirichlet("fmnist-iid-a100", "fashion_mnist", 100.0, 100, 500, ENC_PUBLIC, public_fraction=0.1),
    dirichlet(
        "cifar10-iid-a100",
        "cifar10_jpg",
        100.0,
        100,
        450,
        ENC_PUBLIC,
        root=str(DATA / "cifar10-jpg"),
        public_fraction=0.1,
    ),
    dirichlet("mnist-dirichlet-a0.1", "mnist", 0.1, 100, 500, ENC_FEMNIST),
    dirichlet("mnist-dirichlet-a1", "mnist", 1.0, 100, 500, ENC_FEMNIST),
    dirichlet("mnist-iid-a100", "mnist", 100.0, 100, 500, ENC_FEMNIST, seeds=(0, 1)),
    # feature shift (the same labels, transformed inputs) and concept shift (the same inputs,
    # other labels): clusters are partition.shift groups, each the whole split under its transform
    *[
        Case(
            f"{ds_short}-{kind}{c}-{'skew-' if part == 'dirichlet' else ''}m{m}",  # not "iid": no control
            ds,
            {
                "kind": part,
                "clients": m,
                "clusters": c,
                "samples_per_client": n,
                "alpha": 0.5,
                "shift": {"kind": kind},
            },
            ENC_PUBLIC,
            (0, 1),
            root=root,
            public_fraction=0.1,
            note=f"{kind} shift" + (", Dirichlet(0.5) label skew inside" if part == "dirichlet" else ""),
        )
        for ds_short, ds, root, kind, c, part, m, n in (
            ("mnist", "mnist", str(DATA), "rotate", 4, "iid", 200, 100),
            ("mnist", "mnist", str(DATA), "invert", 2, "dirichlet", 100, 300),
            ("mnist", "mnist", str(DATA), "noise", 3, "iid", 90, 200),
            ("fmnist", "fashion_mnist", str(DATA), "blur", 3, "iid", 90, 200),
            ("fmnist", "fashion_mnist", str(DATA), "rotate", 2, "dirichlet", 60, 500),
            ("cifar10", "cifar10_jpg", str(DATA / "cifar10-jpg"), "rotate", 2, "iid", 100, 450),
        )
    ],
    *[
        Case(
            f"mnist-labels4-m40{tag}",
            "mnist",
            {"kind": "iid", "clients": 40, "clusters": 4, "samples_per_client": 500, "shift": {"kind": "labels"}},
            ENC_PUBLIC,
            (0, 1),
            public_fraction=0.1,
            note="concept shift: input-only centroids cannot see it" if not flt else "concept shift, k: labels",
            flt=flt,
        )
        for tag, flt in (("", None), ("-bylabel", {"k": "labels"}))
    ],
    Case(
        "femnist-writers",
        "femnist",
        {"kind": "writers", "clients": 105},
        ENC_PUBLIC,
        root=str(DATA / "femnist"),
        public_fraction=0.1,
        note="natural clients, no planted clusters",
    ),
    # other shapes than five clusters of 20 (added 2026-12-04, with seeds none of the cases
    # above use): 2, 3 and 10 clusters, two to four clients a cluster, small clients
    shaped("mnist-c10-m100-enc1", "mnist", 10, 1, 100, (3, 4)),
    shaped("mnist-c2-m40-enc1", "mnist", 2, 5, 40, (3, 4)),
    shaped("mnist-c3-m30-n100-enc1", "mnist", 3, 3, 30, (3, 4), samples=100),
    shaped("mnist-s1-m20-enc1", "mnist", 5, 2, 20, (3, 4, 5)),
    shaped("fmnist-s1-m20-enc1", "fashion_mnist", 5, 2, 20, (3, 4, 5, 6)),
    shaped("fmnist-s1-m10-enc1", "fashion_mnist", 5, 2, 10, (3, 4, 5)),
    shaped("cifar10-s1-m20-enc1", "cifar10_jpg", 5, 2, 20, (3, 4)),
    shaped("cifar10-c2-m60-enc1", "cifar10_jpg", 2, 5, 60, (5,)),
    Case(
        "digits-s2-m30",
        "digits",
        {**S2, "clients": 30, "samples_per_client": 40, "test_per_client": 10},
        {"dataset": "public", "epochs": 100},
        (3, 4),
        None,
        0.2,
    ),
    dirichlet("fmnist-dirichlet-a0.3", "fashion_mnist", 0.3, 100, 400, ENC_PUBLIC, (3,), public_fraction=0.1),
]


# -- the server-side variants compared on the same centroids -----------------------------
def variants():
    """Every Ward variant refines its cut as the default does since 2026-11-29 (fcr.refine_ward),
    except the one named 'the cut as it is'; every variant built on Relatedness() checks its
    cut on the held-out halves as the default does (confirming finer cuts where noise
    dominates, vetoing unconfirmed splits elsewhere), except the split rule alone and the
    one named 'no held-out veto'."""
    from flt.server import fcr

    R = fcr.Relatedness
    old = fcr.PRESETS["chamfer"]
    return {
        "paper (umap, min, gamma 1, ward A~, gap)": fcr.PRESETS["paper"],
        "paper, gamma 0.5": R(space="umap", distance="min", linkage="ward_graph", choose="gap", gamma=0.5),
        "umap, chamfer, average, silhouette": replace(old, space="umap"),
        "embedding, min, average, silhouette": replace(old, distance="min"),
        "embedding, chamfer, average, gap": replace(old, choose="gap"),
        "chamfer: embedding, chamfer, average, silhouette, separation 0.16 (the default until Dec 2026)": old,
        "whitened, chamfer, average, silhouette": replace(old, space="whitened"),
        "whitened, energy, ward, silhouette": replace(old, space="whitened", distance="energy", linkage="ward"),
        "embedding, energy, ward, splits": R(space="embedding"),
        "whitened, energy, ward, splits, unweighted": R(),
        "whitened, energy, ward, splits 2.0": R(min_split=2.0),
        "whitened, energy, ward, splits 2.75": R(min_split=2.75),
        "whitened, energy, ward, splits 2.25 (the split rule alone, the default until 2026-11-29 but refined)": R(
            choose="splits"
        ),
        "whitened, energy, ward, splits 2.25 or held-out halves 4": R(min_heldout=4.0),
        "whitened, energy, ward, splits 2.25 or held-out halves 6": R(min_heldout=6.0),
        "whitened, energy, ward, splits 2.25 or held-out halves 5, veto below 3, the cut as it is": (
            replace(fcr.PRESETS["set"], refine=False)
        ),
        "whitened, energy, ward, splits 2.25 or held-out halves 5, refined, no held-out veto": (
            replace(fcr.PRESETS["set"], min_heldout_keep=float("-inf"))
        ),
        "set: whitened, energy, ward, splits 2.25 or held-out halves 5, veto below 3, refined (default)": fcr.PRESETS[
            "set"
        ],
    }


UNWEIGHTED = {  # as if clients sent no shares (they did not before Dec 2026)
    "whitened, energy, ward, splits, unweighted",
    "chamfer: embedding, chamfer, average, silhouette, separation 0.16 (the default until Dec 2026)",
}


# -- running FCR's client side once per case and seed ---------------------------------------
def scenario(case: Case, seed: int) -> dict:
    part = {"test_per_client": 100, "public_fraction": case.public_fraction, **case.partition}
    return {
        "name": f"fcrq-{case.name}",
        "seed": seed,
        "data": {"dataset": case.dataset, "root": case.root},
        "partition": part,
        "model": "mlp",
        "devices": {"processes": 2, "round_timeout_s": 1800},
        "methods": [{"name": "flt", "encoder": case.encoder, **(case.flt or {})}],
    }


def centroids_for(case: Case, seed: int, fresh: bool = False) -> dict:
    from flt.emulator.config import resolve
    from flt.emulator.relate import relate_scenario

    raw = scenario(case, seed)
    # CACHE_VERSION: what the clients send changed (2: each centroid's share of the samples;
    # 3: the same summary of two halves of their data)
    key = hashlib.sha256(json.dumps({**raw, "cache": CACHE_VERSION}, sort_keys=True).encode()).hexdigest()[:16]
    out = CACHE / f"{case.name}-s{seed}-{key}"
    npz = out / "flt" / "fcr.npz"
    if fresh or not npz.exists():
        tic = time.perf_counter()
        relate_scenario(resolve(copy.deepcopy(raw)), str(out), progress=lambda *_: None, umap=False)
        (out / "embed_seconds.txt").write_text(f"{time.perf_counter() - tic:.2f}")
    with np.load(npz) as z:
        owner, cents, truth, shares = z["owner"], z["centroids"], z["truth"], z["shares"]
        classes = z.get("classes")
        halves = {k: z[k] for k in ("halves", "half_shares", "half_owner", "half_side") if k in z}
    clients = np.unique(owner)
    return {
        "sets": [cents[owner == c] for c in clients],
        "shares": [shares[owner == c] for c in clients],
        "classes": None if classes is None else [classes[owner == c] for c in clients],
        "halves": halves or None,
        "clients": clients,
        "truth": truth,
        "embed_s": float((out / "embed_seconds.txt").read_text()),
    }


def halves_for(case: Case, clients: np.ndarray, saved: dict | None, labelled: bool):
    """fcr.Halves from fcr.npz's arrays, projected as FLT projects them (FLT._halves_of)."""
    from flt.server import fcr

    if saved is None:
        return None
    have = np.flatnonzero(np.isin(clients, saved["half_owner"]))
    pick = [(saved["half_owner"] == clients[i]) & (saved["half_side"] == side) for side in (0, 1) for i in have]
    rows, shares = [saved["halves"][p] for p in pick], [saved["half_shares"][p] for p in pick]
    classes = [r[:, -1].astype(np.int64) for r in rows] if labelled else None
    rows = [np.ascontiguousarray(r[:, :-1]) for r in rows] if labelled else rows
    if "finetune_epochs" not in case.encoder:  # one whitening for both halves, as FLT does
        rows = fcr.whiten(rows, shares)
    n = len(have)
    a, b, a_w, b_w = rows[:n], rows[n:], shares[:n], shares[n:]
    a_c, b_c = (None, None) if classes is None else (classes[:n], classes[n:])
    return fcr.Halves(have, a, b, a_w, b_w, a_c, b_c)


def probe_accuracy(sets: list[np.ndarray], truth: np.ndarray, seed: int = 0) -> float | None:
    """Client-level linear probe of the planted cluster, cross-validated by client."""
    if (truth < 0).any() or len(np.unique(truth)) < 2:
        return None
    x = np.concatenate(sets)
    owner = np.repeat(np.arange(len(sets)), [len(s) for s in sets])
    y = truth[owner]
    correct = 0
    for train, test in GroupKFold(n_splits=5).split(x, y, owner):
        clf = LogisticRegression(max_iter=2000, C=1.0, random_state=seed).fit(x[train], y[train])
        logp = clf.predict_log_proba(x[test])
        clients, inv = np.unique(owner[test], return_inverse=True)
        per_client = np.zeros((len(clients), logp.shape[1]))
        np.add.at(per_client, inv, logp)
        pred = clf.classes_[per_client.argmax(1)]
        correct += int((pred == truth[clients]).sum())
    return correct / len(sets)


def knn_accuracy(sets: list[np.ndarray], truth: np.ndarray, k: int = 5) -> float | None:
    """Client-level vote of each centroid's k nearest centroids of other clients."""
    if (truth < 0).any() or len(np.unique(truth)) < 2:
        return None
    from scipy.spatial.distance import cdist

    x = np.concatenate(sets)
    owner = np.repeat(np.arange(len(sets)), [len(s) for s in sets])
    d = cdist(x, x)
    d[owner[:, None] == owner[None, :]] = np.inf  # a client never votes for itself
    near = np.argpartition(d, k, axis=1)[:, :k]
    votes = np.zeros((len(sets), int(truth.max()) + 1))
    np.add.at(votes, (np.repeat(owner, k), truth[owner[near]].ravel()), 1)
    return float((votes.argmax(1) == truth).mean())


def evaluate(case, sets, truth, how, seed: int, umap_points, classes=None, shares=None, halves=None) -> dict:
    """One pipeline on one case's centroids, as FLT runs it (the space, then relate)."""
    from flt.server import fcr

    tic = time.perf_counter()
    if how.space == "umap":
        points = umap_points
    elif how.space == "whitened" and "finetune_epochs" not in case.encoder:  # as FLT.project
        points = fcr.whiten(sets, shares)
    else:
        points = sets
    found = fcr.relate(points, how, classes=classes, weights=shares, halves=halves)
    out = {"clusters": found.n_clusters, "seconds": time.perf_counter() - tic}
    if (truth >= 0).all():
        planted = len(np.unique(truth))
        given = fcr.relate(points, how, n_clusters=planted, classes=classes, weights=shares)
        out |= {
            "ari": adjusted_rand_score(truth, found.labels),
            "nmi": normalized_mutual_info_score(truth, found.labels),
            "ari_true_c": adjusted_rand_score(truth, given.labels),
            "planted": planted,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="run only cases whose name contains this (comma-separated: any of)")
    ap.add_argument(
        "--keep-others",
        action="store_true",
        help="keep the rows of cases not run now from the --out file: its tables and worst case cover the whole suite",
    )
    ap.add_argument("--fresh", action="store_true", help="re-embed even when cached")
    ap.add_argument(
        "--encoder",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override an encoder setting in every case (e.g. channels=16), to measure another encoder",
    )
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fcr_quality.json"))
    args = ap.parse_args()
    if not DATA.is_dir():
        sys.exit(f"the real data folder {DATA} is missing (see ../shared/data/README.md)")
    from flt.server import fcr

    chosen = [c for c in SUITE if any(part in c.name for part in args.only.split(","))]
    if args.encoder:
        over = {k: yaml.safe_load(v) for k, _, v in (e.partition("=") for e in args.encoder)}  # as --set parses
        chosen = [replace(c, encoder={**c.encoder, **over}) for c in chosen]
    rows = []
    for case in chosen:
        for seed in case.seeds:
            print(f"== {case.name} seed {seed}", flush=True)
            got = centroids_for(case, seed, args.fresh)
            sets, truth = got["sets"], got["truth"]
            tic = time.perf_counter()
            umap_points = fcr.umap_project(sets, seed=seed)
            umap_s = time.perf_counter() - tic
            row = {
                "case": case.name,
                "seed": seed,
                "clients": len(sets),
                "note": case.note,
                "embed_s": got["embed_s"],
                "umap_s": umap_s,
                "probe": probe_accuracy(sets, truth, seed),
                "knn": knn_accuracy(sets, truth),
                "variants": {},
            }
            halves = halves_for(case, got["clients"], got["halves"], got["classes"] is not None)
            for name, how in variants().items():
                shares = None if name in UNWEIGHTED else got["shares"]
                row["variants"][name] = evaluate(
                    case, sets, truth, how, seed, umap_points, got["classes"], shares, halves
                )
            rows.append(row)
            print(_row_line(row), flush=True)
    if args.keep_others and Path(args.out).is_file():
        ran = {c.name for c in chosen}
        kept = [r for r in json.loads(Path(args.out).read_text())["rows"] if r["case"] not in ran]
        print(f"kept {len(kept)} rows of cases not run now from {args.out}")
        rows = kept + rows
        chosen = [c for c in SUITE if c.name in {r["case"] for r in rows}]
    result = {
        "machine": machine_info(),
        "cases": [asdict(c) for c in chosen],
        "rows": rows,
        "worst": worst_case(rows),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=float))
    print(table(rows))
    print(f"\nwrote {args.out}")


def _row_line(row) -> str:
    v = row["variants"]
    best = max(v, key=lambda k: v[k].get("ari", -1))
    probe = "-" if row["probe"] is None else f"{row['probe']:.2f}"
    knn = "-" if row["knn"] is None else f"{row['knn']:.2f}"
    return f"   knn {knn}  probe {probe}  best: {best} ARI {v[best].get('ari', float('nan')):.3f}"


def _attainable(row) -> bool:
    return max(v.get("ari", 0.0) for v in row["variants"].values()) >= 0.9


def worst_case(rows) -> dict:
    """Per variant: the lowest ARI over the cases whose embedding separates the clusters
    (knn >= 0.9), the mean, the lowest over the attainable cases (planted clusters that
    some variant recovers at ARI >= 0.9: a variant that drops a case the knn filter leaves
    out shows there), and how many cases it found the planted C in."""
    out = {}
    for name in variants():
        sep = [r["variants"][name] for r in rows if r["knn"] is not None and r["knn"] >= 0.9]
        planted = [r["variants"][name] for r in rows if r["probe"] is not None]
        attainable = [r["variants"][name] for r in rows if r["probe"] is not None and _attainable(r)]
        if not planted:
            continue
        out[name] = {
            "worst_ari_separable": min((v["ari"] for v in sep), default=None),
            "mean_ari_separable": float(np.mean([v["ari"] for v in sep])) if sep else None,
            "worst_ari_attainable": min(v["ari"] for v in attainable),
            "right_c": sum(v["clusters"] == v["planted"] for v in planted),
            "cases": len(planted),
            "iid_clusters": [r["variants"][name]["clusters"] for r in rows if "iid" in r["case"]],
        }
    return out


def table(rows) -> str:
    names = list(variants())
    lines = [
        "",
        "ARI with C chosen automatically (clusters found / planted); knn / probe: how well the "
        "embedding separates the planted clusters (see the docstring); C=n: clusters found where "
        "nothing is planted",
        "",
    ]
    short = {n: f"V{i + 1}" for i, n in enumerate(names)}
    lines += [f"  {short[n]} = {n}" for n in names] + [""]
    head = f"{'case':<28}{'seed':>5}{'knn':>6}{'probe':>7}" + "".join(f"{short[n]:>12}" for n in names)
    lines += [head, "-" * len(head)]
    for r in rows:
        cells = []
        for n in names:
            v = r["variants"][n]
            cells.append(f"{v['ari']:.2f} {v['clusters']}/{v['planted']}" if "ari" in v else f"C={v['clusters']}")
        probe = "-" if r["probe"] is None else f"{r['probe']:.2f}"
        knn = "-" if r["knn"] is None else f"{r['knn']:.2f}"
        lines.append(f"{r['case']:<28}{r['seed']:>5}{knn:>6}{probe:>7}" + "".join(f"{c:>12}" for c in cells))
    lines += [
        "",
        f"{'worst case over separable cases (knn >= 0.9)':<40}{'worst ARI':>10}{'mean ARI':>10}"
        f"{'worst, attainable':>19}{'right C':>9}",
    ]
    for n, w in worst_case(rows).items():
        wa = "-" if w["worst_ari_separable"] is None else f"{w['worst_ari_separable']:.3f}"
        ma = "-" if w["mean_ari_separable"] is None else f"{w['mean_ari_separable']:.3f}"
        lines.append(
            f"  {short[n]:<38}{wa:>10}{ma:>10}{w['worst_ari_attainable']:>19.3f}"
            f"{w['right_c']:>5}/{w['cases']}  iid C: {w['iid_clusters']}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
