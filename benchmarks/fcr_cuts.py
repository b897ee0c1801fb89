"""Why FCR's default cut one case of the quality suite where it did: for each cut of the
dendrogram into C = 2..7 clusters, its sizes, its ARI against the planted clusters, and
each of its merges' split score (the bar: Relatedness.min_split) and held-out z on the two
halves (for the merge's nearest pair of clusters, as the veto tests it). With --exact,
also each merge's exact permutation rank among all relabellings of that pair (only for
small pairs: the count grows as a binomial coefficient; with sides of equal size a split
and its mirror both count, so the most extreme of 70 relabellings has rank 2 / 70).

    .venv/bin/python benchmarks/fcr_cuts.py cifar10-s1-m20-enc1 3
    .venv/bin/python benchmarks/fcr_cuts.py cifar10-s1-m20-enc1 3 --exact

Reads (or, the first time, computes) the case's cached centroids as bench_fcr_quality.py
does; needs the real data in ../shared/data or $FLT_DATA.
"""

from __future__ import annotations

import argparse
import itertools
import math

import numpy as np
from bench_fcr_quality import SUITE, centroids_for, halves_for
from scipy.cluster.hierarchy import fcluster
from sklearn.metrics import adjusted_rand_score

from flt.server import fcr


def exact_rank(squared: np.ndarray, left: np.ndarray, right: np.ndarray) -> tuple[float, int]:
    """The share of all relabellings of left + right (sizes kept) whose d2 (split_score's
    between-means distance) reaches the observed one, and their count."""
    idx = np.concatenate([left, right])
    n, nl = len(idx), len(left)
    sides = np.zeros((math.comb(n, nl), n))
    for row, chosen in enumerate(itertools.combinations(range(n), nl)):
        sides[row, list(chosen)] = 1
    d2 = fcr.relabelled_d2(squared[np.ix_(idx, idx)], sides)
    return float((d2 >= d2[0] - 1e-12).mean()), len(d2)  # row 0 is the observed split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", help="a case name of bench_fcr_quality.SUITE")
    ap.add_argument("seed", type=int)
    ap.add_argument("--exact", action="store_true", help="exact permutation ranks (pairs of 16 clients or fewer)")
    args = ap.parse_args()

    case = next(c for c in SUITE if c.name == args.case)
    got = centroids_for(case, args.seed)
    truth, shares = got["truth"], got["shares"]
    halves = halves_for(case, got["clients"], got["halves"], got["classes"] is not None)
    how = fcr.PRESETS["set"]
    points = got["sets"] if "finetune_epochs" in case.encoder else fcr.whiten(got["sets"], shares)
    found = fcr.relate(points, how, weights=shares, halves=halves)
    ari = adjusted_rand_score(truth, found.labels)
    print(f"default: {found.n_clusters} clusters (by {found.chosen_by}), ARI {ari:.3f}")
    print(f"next cut: {found.next_cut}")
    squared = fcr.set_distance(points, how.distance, weights=shares)  # energy: already squared
    held = fcr.HeldOut(halves, how.distance, len(points)) if halves is not None else None
    if held is not None:
        confirmed = held.clusters(how.min_heldout, how, 20)
        print(f"noise dominates: {held.noise_dominates}; cut the halves confirm: {confirmed}")
    print(f"bars: split score {how.min_split}, held-out z to keep {how.min_heldout_keep}, to confirm {how.min_heldout}")
    m, z = len(points), found.linkage
    members = fcr._members(z, m, 7)
    for c in range(2, min(7, m - 1) + 1):
        final = fcluster(z, c, criterion="maxclust") - 1
        print(f"C = {c}: sizes {np.bincount(final).tolist()}, ARI {adjusted_rand_score(truth, final):.3f}")
        for node in range(2 * m - c, 2 * m - 1):
            left, right = members[node]
            score = fcr.split_score(squared, left, right, final)
            a, b = fcr.nearest_clusters(squared, left, right, final)
            zs = held.z_scores(a, b) if held is not None else None
            line = f"   merge {len(left)} + {len(right)}: score {score:.2f}; nearest pair {len(a)} + {len(b)}"
            line += "" if zs is None else f", held-out z {zs[0]:.2f} / {zs[1]:.2f}"
            if args.exact and held is not None and len(a) + len(b) <= 16:
                ranks = [exact_rank(half, *held._rows(a, b)) for half in held._halves]
                line += ", exact rank " + " / ".join(f"{share:.3f} of {n}" for share, n in ranks)
            print(line)


if __name__ == "__main__":
    main()
