"""Dynamic FCR: where clients with fresh centroids go (newcomers, clients whose data moved).

The server holds every client's centroids; some are fresh. FCR's static rule (server/fcr.py:
set distance, average linkage, C by silhouette, the separation floor) re-runs over everyone
on the server alone (no incumbent re-embeds), which gives the *re-run* clustering. Two
candidates are then compared by the silhouette of the same distance matrix A:

- **kept**: the incumbents keep their clusters; each fresh client follows the re-run. If
  its re-run cluster holds incumbents, it joins the nearest (mean A) of the old clusters
  those incumbents belong to; a re-run cluster of fresh clients only opens a new cluster
  (a cluster nobody held before: novelty). Joining "the nearest cluster" is a special case.
- **re-run**: the re-run clustering itself, matched to the old clusters.

The re-run wins only when its silhouette beats kept's by more than the static rule's
`silhouette_slack`, so a population whose structure did not change keeps its clusters (and
their models). Novelty needs no threshold of its own: a group of fresh clients is new when
the same rule that found the initial clusters separates it from every incumbent; a lone
fresh client is never a cluster (fold_singletons), it joins the nearest.

Matching (Hungarian on the overlap of incumbents) keeps a cluster's id, and with it its
model, wherever most of its members stay together.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment

from flt.server import fcr


def mean_distance_to_clusters(adj: np.ndarray, labels: np.ndarray, members: np.ndarray) -> np.ndarray:
    """[M, C]: each client's mean A to the `members` of each cluster (inf where a cluster
    has no member); C = labels.max() + 1."""
    c = int(labels[members].max()) + 1 if len(members) else 0
    onehot = np.zeros((len(members), c))
    onehot[np.arange(len(members)), labels[members]] = 1.0
    sizes = onehot.sum(0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = (adj[:, members] @ onehot) / sizes
    out[:, sizes == 0] = np.inf
    return out


def kept_candidate(adj: np.ndarray, old: np.ndarray, fresh: np.ndarray, rerun: np.ndarray, next_id: int) -> np.ndarray:
    """Incumbents keep `old`; fresh clients follow `rerun` (module docstring). New
    clusters are numbered from `next_id`."""
    out = old.copy()
    incumbent = np.flatnonzero(~fresh & (old >= 0))
    if not len(incumbent):  # nobody to keep (everyone re-embedded): the re-run, matched
        return match_labels(old, rerun, next_id)
    near = mean_distance_to_clusters(adj, old, incumbent)  # [M, C_old]
    for j in np.unique(rerun[fresh]):  # one pass per re-run cluster (a handful)
        mine = np.flatnonzero(fresh & (rerun == j))
        held = np.unique(old[incumbent[rerun[incumbent] == j]])
        if len(held):
            out[mine] = held[near[np.ix_(mine, held)].argmin(1)]
        else:
            out[mine] = next_id
            next_id += 1
    return out


def match_labels(old: np.ndarray, new: np.ndarray, next_id: int) -> np.ndarray:
    """`new` renumbered so that a new cluster holding most of an old cluster's members
    takes its id; unmatched clusters are numbered from `next_id` (> every old id)."""
    known = (old >= 0) & (new >= 0)
    ids = np.unique(new[new >= 0])
    overlap = np.zeros((len(ids), max(next_id, 1)))
    np.add.at(overlap, (np.searchsorted(ids, new[known]), old[known]), 1)
    rows, cols = linear_sum_assignment(-overlap)
    remap = np.full(len(ids), -1, dtype=np.int64)
    hit = overlap[rows, cols] > 0
    remap[rows[hit]] = cols[hit]
    unmatched = np.flatnonzero(remap < 0)
    remap[unmatched] = next_id + np.arange(len(unmatched))
    out = np.full_like(new, -1)
    out[new >= 0] = remap[np.searchsorted(ids, new[new >= 0])]
    return out


def settle(
    adj: np.ndarray, old: np.ndarray, fresh: np.ndarray, rerun: np.ndarray, slack: float, next_id: int
) -> tuple[np.ndarray, str]:
    """Labels for everyone (ids continuing old's; new clusters from `next_id`, above every
    old id) and which candidate won: "kept" or "rerun"."""
    kept = kept_candidate(adj, old, fresh, rerun, next_id)
    s_kept, s_rerun = fcr.silhouette_or_zero(adj, kept), fcr.silhouette_or_zero(adj, rerun)
    if s_rerun > s_kept + slack:
        return match_labels(old, rerun, next_id), "rerun"
    return kept, "kept"
