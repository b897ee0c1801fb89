"""One CSV row per `flt relate` run folder: what FCR found, and how well the clients'
centroids separate the planted groups (measures that use the planted labels, which FCR
never sees).

    .venv/bin/python benchmarks/relate_table.py runs/relate/*/ > relate.csv

Columns: clusters and ARI from the run's relate.json; knn as in bench_fcr_quality.py (each
centroid's 5 nearest centroids of other clients vote for their owner's planted group);
weakest_planted_split, the lowest `fcr.split_score` over every pair of planted groups split
exactly as planted (FCR's default keeps a split that scores `min_split` = 2.25 or more, so
below it no cut of that embedding can give the planted groups); the encoder's bytes, FCR's
bytes on the wire, and the encoder's pretraining loss on its last batch.
"""

from __future__ import annotations

import csv
import json
import sys
from itertools import combinations
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fcr_quality import knn_accuracy

from flt.server.fcr import split_score


def row(run: Path) -> dict:
    report = json.loads((run / "relate.json").read_text())
    with np.load(run / report["method"] / "fcr.npz") as z:
        adj = z["adjacency"].astype(np.float64) ** 2  # saved as the root of the energy distance
        truth, owner, cents = z["truth"], z["owner"], z["centroids"]
    sets = [cents[owner == c] for c in range(len(truth))]
    pairs = combinations(range(int(truth.max()) + 1), 2)
    weakest = min(split_score(adj, np.flatnonzero(truth == a), np.flatnonzero(truth == b), truth) for a, b in pairs)
    config = (run / "config.yaml").read_text()
    return {
        "run": run.name,
        "scenario": next(line.split(": ", 1)[1] for line in config.splitlines() if line.startswith("name: ")),
        "clients": report["n_clients"],
        "method": report["method"],
        "clusters": report["clusters"],
        "ari": round(report["ari"], 3),
        "knn": round(knn_accuracy(sets, truth), 3),
        "weakest_planted_split": round(weakest, 2),
        "encoder_bytes": report.get("encoder_bytes"),
        "fcr_mb": round(report["fcr_bytes"] / 1e6, 2),
        "encoder_last_batch_mse": round(report["encoder_final_mse"], 4) if "encoder_final_mse" in report else None,
    }


def main() -> None:
    runs = [Path(p) for p in sys.argv[1:]]
    if not runs:
        sys.exit(__doc__)
    rows = [row(r) for r in runs]
    out = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]))
    out.writeheader()
    out.writerows(rows)


if __name__ == "__main__":
    main()
