"""FedGroup's cold start: the server's extra memory and time for its EDC features.

FedGroup describes each pre-trained client by the cosines of its update with the m top
singular directions of all the updates (n of them, P parameters each) and groups those
features with k-means. The reference is the form used before 2026-12-06: a float64 copy
of the [n, P] updates, sklearn's TruncatedSVD of its transpose and sklearn's
cosine_similarity. FedGroup now takes the same features from the n x n Gram matrix
(`server/strategies/fedgroup.py`, `edc_features`). Each form runs in a process of its own
on the same seeded updates (n clients in `--groups` planted groups plus noise), so each
peak RSS is its own; the table prints both, their ratio, the largest difference between
the two feature matrices (up to each column's sign) and whether k-means groups alike.

    .venv/bin/python benchmarks/bench_fedgroup_edc.py                   # S3 CNN size: 100 x 6.6 M
    .venv/bin/python benchmarks/bench_fedgroup_edc.py --params 200000   # a small model, in seconds
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from forms import LEAF_CNN_FEMNIST, child_options, peak_gb, report, run_forms
from sklearn.cluster import KMeans
from sklearn.decomposition import TruncatedSVD
from sklearn.metrics.pairwise import cosine_similarity

from flt.server.strategies.fedgroup import edc_features


def reference(updates: torch.Tensor, k: int, seed: int) -> np.ndarray:
    """The features before 2026-12-06: an SVD of a float64 copy of the updates."""
    dw = updates.double().cpu().numpy()
    directions = TruncatedSVD(n_components=k, random_state=seed).fit_transform(dw.T)  # [P, k]
    return cosine_similarity(dw, directions.T)


def updates_for(clients: int, groups: int, params: int) -> torch.Tensor:
    """Seeded updates: each client its group's direction, scaled, plus noise of the same size."""
    g = torch.Generator().manual_seed(0)
    member = torch.arange(clients) % groups
    updates = torch.randn(clients, params, generator=g)  # the noise
    for j in range(groups):  # one direction at a time: no [groups, P] block beside the updates
        updates[member == j] += 2.0 * torch.randn(params, generator=g)
    return updates


def one(form: str, clients: int, groups: int, params: int, out: Path) -> None:
    """Run one form; save its features and k-means groups, print time and extra peak."""
    updates = updates_for(clients, groups, params)
    before = peak_gb()
    tic = time.perf_counter()
    k = min(groups, clients - 1, params - 1)
    features = reference(updates, k, 0) if form == "reference" else edc_features(updates, k)
    seconds = time.perf_counter() - tic
    labels = KMeans(n_clusters=groups, init="k-means++", n_init=10, random_state=0).fit_predict(features)
    np.savez(out.with_suffix(".npz"), features=features, labels=labels)
    report(seconds, before)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=100, help="pre-trained clients (FedGroup's alpha x m)")
    ap.add_argument("--groups", type=int, default=5)
    ap.add_argument("--params", type=int, default=LEAF_CNN_FEMNIST)
    child_options(ap, ("reference", "gram"))
    args = ap.parse_args()
    if args.one:
        return one(args.one, args.clients, args.groups, args.params, args.save)
    updates_gb = args.clients * args.params * 4 / 2**30
    print(f"FedGroup EDC features: {args.clients} updates of P {args.params:,} ({updates_gb:.2f} GB), m {args.groups}")
    size_args = ["--clients", str(args.clients), "--groups", str(args.groups), "--params", str(args.params)]
    runs = run_forms(__file__, ("reference", "gram"), size_args, lambda save: dict(np.load(save.with_suffix(".npz"))))
    figures, saved = {f: r[:2] for f, r in runs.items()}, {f: r[2] for f, r in runs.items()}
    for form, (seconds, extra) in figures.items():
        print(f"  {form:9s}  {seconds:8.2f} s  peak RSS +{extra:6.2f} GB ({extra / updates_gb:.2f} x the updates)")
    (t_ref, m_ref), (t_new, m_new) = figures["reference"], figures["gram"]
    ref, new = saved["reference"]["features"], saved["gram"]["features"]
    signs = np.sign((ref * new).sum(0))
    diff = float(np.abs(ref - new * signs).max())
    same = bool((saved["reference"]["labels"] == saved["gram"]["labels"]).all())
    print(f"  gram / reference: time {t_new / t_ref:.2f}, extra memory {m_new / max(m_ref, 1e-9):.2f}")
    print(f"  largest difference between the features (up to sign): {diff:.2e}; same k-means groups: {same}")


if __name__ == "__main__":
    main()
