"""FedGroup's cold start: the server's extra memory and time for its EDC features, and
for the whole cold start once the pre-trained models have arrived.

FedGroup describes each pre-trained client by the cosines of its update with the m top
singular directions of all the updates (n of them, P parameters each) and groups those
features with k-means. The reference is the form used before 2026-12-06: a float64 copy
of the [n, P] updates, sklearn's TruncatedSVD of its transpose and sklearn's
cosine_similarity. FedGroup now takes the same features from the n x n Gram matrix
(`server/strategies/fedgroup.py`, `edc_features`).

The second part runs `FedGroup.setup` on n decoded replies held as a real exchange holds
them (one tensor a client), against the cold start of 211f91e (`setup_before`: the same
features, but the replies, their stack and the updates all held at once).

Each form runs in a process of its own on the same seeded updates (n clients in
`--groups` planted groups plus noise), so each peak RSS is its own; the tables print both
forms, their ratio, and whether they agree (the features up to each column's sign and the
k-means groups; the cold start's groups, group models and directions, bit for bit).

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

from flt.server.exchange import Exchange
from flt.server.strategies.base import Context, Result, cluster_average, one_hot, stack
from flt.server.strategies.fedgroup import FedGroup, edc_features

FEATURES, COLD_START = ("reference", "gram"), ("setup_before", "setup")


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


class Pretrained:
    """The federation as FedGroup's cold start sees it: every client present, and the
    pre-training answered with the given replies (decoded, one tensor a client)."""

    def __init__(self, replies: dict[int, Result]):
        self.present = np.array(sorted(replies))
        self.replies = replies

    def train(self, rnd, tasks, delays=None, timeout_s=None, purpose=None) -> Exchange[Result]:
        replies, self.replies = self.replies, {}  # the exchange is now their only holder
        return Exchange(replies, sorted(replies), {})


def replies_for(clients: int, groups: int, params: int, init: torch.Tensor) -> dict[int, Result]:
    """Client c's model: w^0 + its group's direction (scaled) + noise, built one client at a
    time so that no [n, P] block exists before the measured call."""
    g = torch.Generator().manual_seed(0)
    directions = 2.0 * torch.randn(groups, params, generator=g)
    return {c: Result(init + directions[c % groups] + torch.randn(params, generator=g), 1, {}) for c in range(clients)}


def setup_before(strategy: FedGroup, fed: Pretrained) -> None:
    """FedGroup.setup as of 211f91e (every client answered), for its memory."""
    results = fed.train(0, {}).results
    clients = sorted(results)
    models, n = stack(results, clients)
    updates = models - strategy.init
    k = min(strategy.m, len(clients) - 1, updates.shape[1] - 1)
    found = KMeans(n_clusters=strategy.m, init="k-means++", n_init=10, random_state=int(strategy.ctx.seed))
    labels = found.fit_predict(edc_features(updates, k)).astype(np.int64)
    r = one_hot(labels, strategy.m, models)
    ones = torch.ones_like(n)
    strategy.models = cluster_average(models, ones, r, keep=strategy.models)
    strategy.directions = cluster_average(updates, ones, r, keep=strategy.directions)
    strategy.group[clients] = labels


def cold_start(form: str, clients: int, groups: int, params: int, out: Path) -> None:
    """Run one cold start; save its groups, group models and directions."""
    init = torch.randn(params, generator=torch.Generator().manual_seed(1))
    ctx = Context(init, clients, np.ones(clients, dtype=np.int64), torch.device("cpu"), 0, np.full(clients, -1), {})
    strategy = FedGroup(ctx, groups=groups)
    fed = Pretrained(replies_for(clients, groups, params, init))
    before = peak_gb()
    tic = time.perf_counter()
    strategy.setup(fed) if form == "setup" else setup_before(strategy, fed)
    seconds = time.perf_counter() - tic
    np.savez(out.with_suffix(".npz"), groups=strategy.group, models=strategy.models, directions=strategy.directions)
    report(seconds, before)


def one(form: str, clients: int, groups: int, params: int, out: Path) -> None:
    """Run one form; save its features and k-means groups, print time and extra peak."""
    if form in COLD_START:
        return cold_start(form, clients, groups, params, out)
    updates = updates_for(clients, groups, params)
    before = peak_gb()
    tic = time.perf_counter()
    k = min(groups, clients - 1, params - 1)
    features = reference(updates, k, 0) if form == "reference" else edc_features(updates, k)
    seconds = time.perf_counter() - tic
    labels = KMeans(n_clusters=groups, init="k-means++", n_init=10, random_state=0).fit_predict(features)
    np.savez(out.with_suffix(".npz"), features=features, labels=labels)
    report(seconds, before)


def print_forms(figures: dict, updates_gb: float) -> tuple[float, float]:
    """Each form's line; returns the second form's time and extra memory over the first's."""
    for form, (seconds, extra) in figures.items():
        print(f"  {form:12s}  {seconds:8.2f} s  peak RSS +{extra:6.2f} GB ({extra / updates_gb:.2f} x the updates)")
    (t_ref, m_ref), (t_new, m_new) = figures.values()
    return t_new / t_ref, m_new / max(m_ref, 1e-9)


def features_part(size_args: list[str], updates_gb: float) -> None:
    runs = run_forms(__file__, FEATURES, size_args, lambda save: dict(np.load(save.with_suffix(".npz"))))
    saved = {f: r[2] for f, r in runs.items()}
    time_ratio, memory_ratio = print_forms({f: r[:2] for f, r in runs.items()}, updates_gb)
    ref, new = saved["reference"]["features"], saved["gram"]["features"]
    signs = np.sign((ref * new).sum(0))
    diff = float(np.abs(ref - new * signs).max())
    same = bool((saved["reference"]["labels"] == saved["gram"]["labels"]).all())
    print(f"  gram / reference: time {time_ratio:.2f}, extra memory {memory_ratio:.2f}")
    print(f"  largest difference between the features (up to sign): {diff:.2e}; same k-means groups: {same}")


def cold_start_part(size_args: list[str], updates_gb: float) -> None:
    runs = run_forms(__file__, COLD_START, size_args, lambda save: dict(np.load(save.with_suffix(".npz"))))
    before, now = (runs[f][2] for f in COLD_START)
    time_ratio, memory_ratio = print_forms({f: r[:2] for f, r in runs.items()}, updates_gb)
    same = all(np.array_equal(before[key], now[key]) for key in ("groups", "models", "directions"))
    print(f"  setup / setup_before: time {time_ratio:.2f}, extra memory {memory_ratio:.2f}")
    print(f"  same groups, group models and directions, bit for bit: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=100, help="pre-trained clients (FedGroup's alpha x m)")
    ap.add_argument("--groups", type=int, default=5)
    ap.add_argument("--params", type=int, default=LEAF_CNN_FEMNIST)
    ap.add_argument("--parts", default="features,cold-start", help="which parts to run (comma-separated)")
    child_options(ap, FEATURES + COLD_START)
    args = ap.parse_args()
    if args.one:
        return one(args.one, args.clients, args.groups, args.params, args.save)
    updates_gb = args.clients * args.params * 4 / 2**30
    size_args = ["--clients", str(args.clients), "--groups", str(args.groups), "--params", str(args.params)]
    parts = args.parts.split(",")
    if "features" in parts:
        size = f"{args.clients} updates of P {args.params:,} ({updates_gb:.2f} GB), m {args.groups}"
        print(f"FedGroup EDC features: {size}")
        features_part(size_args, updates_gb)
    if "cold-start" in parts:
        print(f"FedGroup cold start once the {args.clients} pre-trained models ({updates_gb:.2f} GB) have arrived")
        cold_start_part(size_args, updates_gb)


if __name__ == "__main__":
    main()
