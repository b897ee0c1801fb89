"""FLT Case I's graph aggregation: the server's extra memory and time for one round.

Case I keeps one model per client, an M x P table (2.6 GB for the LEAF CNN on the 105
FEMNIST writers of S3), and mixes the selected clients' models into it each round. The
reference is the form used before 2026-12-02: a copy of the table, then one [M, P]
product. FLT now writes the product into the table block by block of columns
(`server/strategies/flt.py`, `_aggregate_graph`). Each form runs in a process of its own,
so each peak RSS is its own; the table prints both, their ratio, and the largest
difference between the two results (the blocks must not change a result).

    .venv/bin/python benchmarks/bench_case1.py                    # S3 CNN size: M 105, 21 selected
    .venv/bin/python benchmarks/bench_case1.py --params 200000    # a small model, in seconds
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from forms import LEAF_CNN_FEMNIST, child_options, peak_gb, report, run_forms

from flt.server.strategies.base import Result, stack
from flt.server.strategies.flt import FLT


def reference(state, results) -> None:
    """Case I's aggregation before 2026-12-02: a copy of the table and a full product."""
    sel = sorted(results)
    models, n = stack(results, sel)
    graph = torch.as_tensor(state.graph[sel], device=models.device)
    weights = graph * (n / n.sum())[:, None]
    mass = weights.sum(0)
    touched = mass > 0
    new = state.models.clone()
    new[touched] = (weights[:, touched] / mass[touched]).T @ models
    state.models = new


def one(form: str, clients: int, selected: int, params: int, out: Path) -> None:
    """Run one form on a seeded table and graph; save the result, print time and peak."""
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    graph = (rng.random((clients, clients)) < 0.5).astype(np.float32)
    np.fill_diagonal(graph, 1.0)
    state: Any = SimpleNamespace(models=torch.randn(clients, params, generator=g), graph=graph)
    chosen = rng.choice(clients, selected, replace=False)
    results = {int(c): Result(torch.randn(params, generator=g), int(rng.integers(50, 300)), {}) for c in chosen}
    before = peak_gb()
    tic = time.perf_counter()
    (reference if form == "reference" else FLT._aggregate_graph)(state, results)
    seconds = time.perf_counter() - tic
    np.save(out.with_suffix(".npy"), state.models[:: max(1, clients // 8)].numpy())  # a sample of rows
    report(seconds, before)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=105)
    ap.add_argument("--selected", type=int, default=21)
    ap.add_argument("--params", type=int, default=LEAF_CNN_FEMNIST)
    child_options(ap, ("reference", "blocks"))
    args = ap.parse_args()
    if args.one:
        return one(args.one, args.clients, args.selected, args.params, args.save)
    table_gb = args.clients * args.params * 4 / 2**30
    size = f"M {args.clients}, {args.selected} selected, P {args.params:,} ({table_gb:.2f} GB table)"
    print(f"Case I aggregation: {size}")
    size_args = ["--clients", str(args.clients), "--selected", str(args.selected), "--params", str(args.params)]
    runs = run_forms(__file__, ("reference", "blocks"), size_args, lambda save: np.load(save.with_suffix(".npy")))
    figures, rows = {f: r[:2] for f, r in runs.items()}, {f: r[2] for f, r in runs.items()}
    for form, (seconds, extra) in figures.items():
        print(f"  {form:9s}  {seconds:8.2f} s  peak RSS +{extra:6.2f} GB ({extra / table_gb:.2f} tables)")
    (t_ref, m_ref), (t_new, m_new) = figures["reference"], figures["blocks"]
    diff = float(np.abs(rows["reference"] - rows["blocks"]).max())
    print(f"  blocks / reference: time {t_new / t_ref:.2f}, extra memory {m_new / max(m_ref, 1e-9):.2f}")
    print(f"  largest difference between the two results: {diff:.2e}")


if __name__ == "__main__":
    main()
