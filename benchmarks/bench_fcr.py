"""FCR server side at scale: UMAP, min-distance adjacency, Ward clustering.

For M = 100, 600, 2400 clients, each sending k = 5 centroids of e = 128 dimensions
(random, drawn around C = 5 planted cluster centres so the pipeline has structure to
find), times the server functions of server/fcr.py exactly as FLT calls them:

  umap_project            all M*k centroids -> 2-d (seeded; numba's one-off JIT
                          compilation is timed separately, on a tiny warm-up input)
  min_distance_adjacency  A_ij = min_{r,s} ||u_ir - u_js||, vectorized (torch.cdist in
                          row chunks), on the UMAP points (u = 2, what FLT does) and on
                          the raw 128-d centroids (a heavier input)
  naive reference         (M = 100 only, unless --naive-max is raised) a Python double
                          loop over all ordered client pairs, scipy cdist per pair; the
                          ratio naive / vectorized is printed and the results compared
  paper pipeline          Ward on the rows of A~ = [A <= gamma] of the UMAP points, C at
                          the largest dendrogram gap (relatedness: paper)
  default pipeline        energy distance between the clients' 128-d centroid sets
                          (FLT whitens them first; the synthetic ones here are not),
                          Ward linkage, C by the split rule and the report's cut with
                          one cluster more: no UMAP (relatedness: set; no held-out
                          halves here, so no held-out test)

Run:
    .venv/bin/python benchmarks/bench_fcr.py            # M = 100, 600, 2400
    .venv/bin/python benchmarks/bench_fcr.py --quick    # M = 100 only (smoke test)

Writes a JSON file (default benchmarks/results/fcr.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from machine import TORCH_DEFAULT_THREADS, machine_info  # noqa: E402


def centroids(m: int, k: int, e: int, n_clusters: int, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """k x e float32 centroids per client: a planted cluster centre, a per-client offset,
    and per-centroid noise."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 1.0, size=(n_clusters, k, e)).astype(np.float32)
    truth = np.arange(m) % n_clusters
    out = [centres[c] + 0.15 * rng.normal(size=(1, e)) + 0.1 * rng.normal(size=(k, e)) for c in truth]
    return [c.astype(np.float32) for c in out], truth


def naive_adjacency(points: list[np.ndarray]) -> np.ndarray:
    """The textbook reference: all ordered pairs, one scipy cdist each."""
    from scipy.spatial.distance import cdist

    m = len(points)
    out = np.empty((m, m))
    for i in range(m):
        for j in range(m):
            out[i, j] = cdist(points[i], points[j]).min()
    return out


def timed(fn, reps: int):
    times, result = [], None
    for _ in range(reps):
        tic = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - tic)
    return float(statistics.median(times)), times, result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100,600,2400", help="client counts M (default 100,600,2400)")
    p.add_argument("--quick", action="store_true", help="M = 100 only")
    p.add_argument("-k", type=int, default=5, help="centroids per client (default 5)")
    p.add_argument("-e", type=int, default=128, help="embedding dimension (default 128)")
    p.add_argument("--clusters", type=int, default=5, help="planted clusters (default 5)")
    p.add_argument("--gamma", type=float, default=0.5, help="A~ threshold in UMAP units (S1 uses 0.5)")
    p.add_argument("--reps", type=int, default=3, help="timed repeats of adjacency and Ward (median)")
    p.add_argument("--naive-max", type=int, default=100, help="run the naive loop for M up to this")
    p.add_argument(
        "--threads",
        type=int,
        default=TORCH_DEFAULT_THREADS,
        help=f"torch threads (default {TORCH_DEFAULT_THREADS}: torch's default)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fcr.json"))
    args = p.parse_args(argv)
    sizes = [100] if args.quick else [int(s) for s in args.sizes.split(",") if s.strip()]
    torch.set_num_threads(args.threads)

    from dataclasses import replace

    from sklearn.metrics import adjusted_rand_score

    from flt.server.fcr import PRESETS, min_distance_adjacency, relate, umap_project

    info = machine_info()
    print(
        f"machine: {info['cpu_model'] or '?'}; os.cpu_count={info['os_cpu_count']}, "
        f"affinity={info['sched_affinity']}, torch {info['torch']} ({args.threads} threads set, default "
        f"{TORCH_DEFAULT_THREADS}), device={info['device']}, loadavg={info['loadavg_start']}"
    )
    print(f"k={args.k}, e={args.e}, planted clusters={args.clusters}, gamma={args.gamma}")

    # numba JIT of umap/pynndescent: a one-off per process, kept out of the per-M figures
    warm, _ = centroids(20, args.k, args.e, args.clusters, args.seed + 1)
    tic = time.perf_counter()
    umap_project(warm, seed=args.seed)
    jit_s = time.perf_counter() - tic
    print(f"umap import + numba JIT warm-up (M=20): {jit_s:.2f} s")

    rows = []
    for m in sizes:
        print(f"M = {m} ...", flush=True)
        cents, truth = centroids(m, args.k, args.e, args.clusters, args.seed)
        row: dict = {"M": m, "k": args.k, "e": args.e, "points": m * args.k}
        tic = time.perf_counter()
        proj = umap_project(cents, seed=args.seed)
        row["umap_s"] = time.perf_counter() - tic
        row["adjacency_u2_s"], row["adjacency_u2_all_s"], adj = timed(partial(min_distance_adjacency, proj), args.reps)
        row["adjacency_e_s"], row["adjacency_e_all_s"], adj_e = timed(partial(min_distance_adjacency, cents), args.reps)
        if m <= args.naive_max:
            row["naive_u2_s"], _, ref = timed(partial(naive_adjacency, proj), 1)
            row["naive_u2_max_abs_diff"] = float(np.abs(ref - adj).max())
            row["naive_over_vectorized_u2"] = row["naive_u2_s"] / row["adjacency_u2_s"]
            row["naive_e_s"], _, ref_e = timed(partial(naive_adjacency, cents), 1)
            row["naive_e_max_abs_diff"] = float(np.abs(ref_e - adj_e).max())
            row["naive_over_vectorized_e"] = row["naive_e_s"] / row["adjacency_e_s"]
        paper = replace(PRESETS["paper"], gamma=args.gamma)
        row["ward_s"], row["ward_all_s"], found = timed(partial(relate, proj, paper), args.reps)
        row["clusters_found"] = int(found.n_clusters)
        row["ari_vs_planted"] = float(adjusted_rand_score(truth, found.labels))
        row["fcr_server_total_s"] = row["umap_s"] + row["ward_s"]
        row["default_s"], row["default_all_s"], found = timed(partial(relate, cents, PRESETS["set"]), args.reps)
        row["default_clusters_found"] = int(found.n_clusters)
        row["default_ari_vs_planted"] = float(adjusted_rand_score(truth, found.labels))
        rows.append(row)
        print(
            f"    paper: umap {row['umap_s']:.2f} s, adjacency + Ward {row['ward_s'] * 1e3:.1f} ms, "
            f"C={found.n_clusters}, ARI={row['ari_vs_planted']:.3f}; default (no UMAP): "
            f"{row['default_s']:.2f} s, C={row['default_clusters_found']}, "
            f"ARI={row['default_ari_vs_planted']:.3f}"
        )

    print()
    print(f"FCR server side (k={args.k}, e={args.e}); seconds (median of {args.reps} for adjacency and Ward)")
    head = (
        f"  {'M':>5} {'UMAP':>8} {'adj u=2':>9} {'naive u=2':>10} {'ratio':>8} "
        f"{'adj e=' + str(args.e):>9} {'naive e':>9} {'ratio':>8} {'Ward':>8} {'total':>8} {'C':>3} {'ARI':>6}"
        f" {'default':>8} {'C':>3} {'ARI':>6}"
    )
    print(head)
    for r in rows:

        def f(key, w=8, d=4, r=r):  # r bound now, not looked up later
            v = r.get(key)
            return "-".rjust(w) if v is None else f"{v:{w}.{d}f}"

        ratio_u = "-".rjust(7) if "naive_over_vectorized_u2" not in r else f"{r['naive_over_vectorized_u2']:6.0f}x"
        ratio_e = "-".rjust(7) if "naive_over_vectorized_e" not in r else f"{r['naive_over_vectorized_e']:6.0f}x"
        print(
            f"  {r['M']:>5} {f('umap_s', 8, 2)} {f('adjacency_u2_s', 9)} {f('naive_u2_s', 10)} {ratio_u:>8} "
            f"{f('adjacency_e_s', 9)} {f('naive_e_s', 9)} {ratio_e:>8} {f('ward_s')} "
            f"{f('fcr_server_total_s', 8, 2)} {r['clusters_found']:>3} {r['ari_vs_planted']:6.3f}"
            f" {f('default_s', 8, 2)} {r['default_clusters_found']:>3} {r['default_ari_vs_planted']:6.3f}"
        )
    for r in rows:
        if "naive_u2_max_abs_diff" in r:
            print(
                f"  M={r['M']}: vectorized vs naive max |diff|: u=2 {r['naive_u2_max_abs_diff']:.2e}, "
                f"e={args.e} {r['naive_e_max_abs_diff']:.2e}"
            )
    print(
        "  (paper total = UMAP + adjacency u=2 + Ward; default = energy distance in e-dim + Ward + the split "
        "rule, the server side of FCR's default pipeline without halves; the authors' 38 min one-off FCR "
        "also included client-side embedding and k-means, not timed here)"
    )

    info["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"benchmark": "fcr", "machine": info, "args": vars(args), "umap_jit_warmup_s": jit_s, "results": rows},
            indent=2,
        )
        + "\n"
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
