"""Dynamic clustering with every FLT setting at its default: who recovers from what.

A grid of populations that change once, at round `--event` (15 by default), on MNIST and
Fashion-MNIST in S1's design (60 clients in 5 planted clusters of 2 classes, MLP, E = 1,
batch 10, lr 0.01, rho 0.2, T = 40):

- static            nothing happens (control: FLT must not re-cluster);
- resample 20 %     12 clients swap data with a client of their own cluster (control: the
                    data changes, its distribution does not; a re-clustering is a false alarm);
- arrive known      12 clients (3 of each of clusters 0-3) are withheld until the event;
- arrive unseen     cluster 4 (12 clients) is withheld until the event: nobody held it;
- drift 1 / 5 / 20 % 1, 3 or 12 clients swap data with clients of another cluster
                    (12: three of each of clusters 0-3, each to the next cluster).

Methods: FLT with defaults (only its encoder's pretraining set, the public slice, is
named), IFCA with C = 5 and FedSEM with 5 centers (told the true C), FedAvg, and the two
one-shot clustered baselines with their own defaults: PACFL (its angle threshold; a
newcomer joins the cluster at the smallest mean angle) and FedGroup (m = 5 groups, which
is C here; a newcomer cold-starts into the nearest group). Neither PACFL nor FedGroup
re-places a client whose data drifted (their papers have no such step), so their drift
cells measure what a one-shot clustering costs. Each cell is one `flt compare` run in a
fresh process. Per cell and method: the accuracy of the clients there before the event
(incumbents) just before it, its lowest after it, rounds until it is back within 1 point
(None: never), the newcomers' final accuracy, the final accuracy, the clusters and their
ARI at the end, the run's total bytes, FLT's bytes spent on re-clustering, and FLT's
re-clusterings (on the controls: false alarms; `moved`: how many of them changed a label).

    .venv/bin/python benchmarks/bench_dynamics.py                       # the whole grid (about 20 min)
    .venv/bin/python benchmarks/bench_dynamics.py --datasets mnist --cells static,arrive_unseen

Writes benchmarks/results/dynamics.json (change it with --out) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DATA = REPO.parent / "shared" / "data"
sys.path.insert(0, str(HERE))

from machine import machine_info  # noqa: E402

from flt.reports.summary import clustering, rounds_to_recover  # noqa: E402

METHODS = ("flt", "ifca", "fedsem", "fedavg", "pacfl", "fedgroup")
CLIENTS, CLUSTERS = 60, 5
PER = CLIENTS // CLUSTERS  # clients per planted cluster: contiguous id blocks


def block(cluster: int) -> list[int]:
    return list(range(cluster * PER, (cluster + 1) * PER))


def cells(event: int) -> dict[str, dict]:
    """Each cell's population section."""
    three_each = [(block(c)[:3], (c + 1) % 4) for c in range(4)]
    twelve = [c for m, _ in three_each for c in m]
    return {
        "static": {},
        "resample_20": {"drift": [{"round": event, "clients": twelve, "kind": "resample"}]},
        "arrive_known": {"newcomers": [{"round": event, "clients": twelve}]},
        "arrive_unseen": {"newcomers": [{"round": event, "cluster": 4}]},
        "drift_1": {"drift": [{"round": event, "clients": block(0)[:1], "to_cluster": 2}]},
        "drift_5": {"drift": [{"round": event, "clients": block(0)[:3], "to_cluster": 2}]},
        "drift_20": {"drift": [{"round": event, "clients": m, "to_cluster": to} for m, to in three_each]},
    }


def scenario(dataset: str, rounds: int) -> dict:
    return {
        "name": f"dynamics_{dataset}",
        "seed": 0,
        "data": {"dataset": dataset, "root": str(DATA)},
        "partition": {
            "kind": "clusters",
            "clients": CLIENTS,
            "clusters": CLUSTERS,
            "classes_per_cluster": 2,
            "samples_per_client": 600,
            "test_per_client": 100,
            "public_fraction": 0.05,
        },
        "model": "mlp",
        "train": {
            "rounds": rounds,
            "participation": 0.2,
            "local_epochs": 1,
            "batch_size": 10,
            "lr": 0.01,
            "eval_every": 1,
        },
        "devices": {"processes": 2},
        "methods": [
            "flt",
            {"name": "ifca", "clusters": CLUSTERS},
            {"name": "fedsem", "centers": CLUSTERS},
            "fedavg",
            "pacfl",
            "fedgroup",
        ],
    }


def measure_cell(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())["methods"]
    return {label: measure(out / label, m) for label, m in summary.items()}


def run_cell(base: Path, population: dict, out: Path, methods: str) -> dict:
    cmd = [sys.executable, "-m", "flt.emulator.cli", "compare", str(base), "--methods", methods, "--out", str(out)]
    if population:
        cmd += ["--set", "population=" + json.dumps(population)]
    tic = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        sys.exit(f"{out.name}: flt compare exited with {code}; see {out.with_suffix('.log')}")
    return {label: r | {"wall_s": time.perf_counter() - tic} for label, r in measure_cell(out).items()}


def measure(folder: Path, m: dict) -> dict:
    """The figures of one method in one cell (module docstring)."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    event = next((e for r in rows for e in r.get("events", []) if e["kind"] in ("arrival", "drift")), None)
    key = "acc_incumbents" if event and event["kind"] == "arrival" else "acc_mean"
    change = rounds_to_recover(rows, event["round"], key=key) if event else {}  # as the summary's `changes`
    recl = m.get("fcr_reports", [])[1:]
    clusters, ari = clustering(m)  # at the end, against the clients' planted clusters then
    out = {
        "final": m["final_accuracy"],
        "total_mb": (m["bytes_up"] + m["bytes_down"]) / 1e6,
        "before": change.get("before"),
        "lowest": change.get("lowest"),
        "rounds_to_recover": change.get("rounds_to_recover"),
        "newcomers_final": rows[-1].get("acc_newcomers"),
        "clusters": clusters,
        "ari": ari,
    }
    drift = next((e for r in rows for e in r.get("events", []) if e["kind"] == "drift"), None)
    if drift is not None:
        out |= {"changed": len(drift["clients"]), "noticed": len(drift.get("noticed", []))}
    if m["method"] == "flt":
        moves = [(r["round"], e) for r in rows for e in r.get("events", []) if e["kind"] == "recluster"]
        if drift is not None and moves:
            out["placed_after"] = moves[0][0] - drift["round"]  # rounds from the drift to its re-placement
        out |= {
            "reclusterings": len(recl),
            "moved": sum(len(r.get("moved", [])) for r in recl),
            "opened": sum(len(r.get("opened", [])) for r in recl),
            "recluster_mb": sum(r.get("fcr_bytes", 0) for r in recl) / 1e6,
            "clusters_final": len(set(m["found_clusters"]) - {-1}),
        }
    return out


def table(results: dict) -> str:
    head = (
        f"{'dataset':<14}{'cell':<14}{'method':<10}{'before':>7}{'lowest':>7}{'recover':>8}{'new fin':>8}"
        f"{'final':>7}{'ARI':>6}{'MB':>8}{'recl':>5}{'moved':>6}{'recl MB':>8}"
    )
    lines = [head, "-" * len(head)]
    for ds, by_cell in results.items():
        for cell, by_method in by_cell.items():
            for label, r in by_method.items():
                lines.append(
                    f"{ds:<14}{cell:<14}{label:<10}{_f(r['before'])}{_f(r['lowest'])}"
                    f"{_f(r['rounds_to_recover'], 8, 0)}{_f(r['newcomers_final'], 8)}"
                    f"{_f(r['final'])}{_f(r.get('ari'), 6, 2)}"
                    f"{_f(r['total_mb'], 8, 0)}{_f(r.get('reclusterings'), 5, 0)}{_f(r.get('moved'), 6, 0)}"
                    f"{_f(r.get('recluster_mb'), 8, 2)}"
                )
    return "\n".join(lines)


def markdown(results: dict) -> str:
    """One row per dataset and cell; per method: final accuracy, and for a change: the
    incumbents' level before it -> lowest after it, rounds to recover; FLT's re-clusterings."""
    lines = [
        "| dataset | cell | " + " | ".join(METHODS) + " | FLT re-clusterings (moved clients), MB |",
        "| --- | --- | " + " | ".join("---" for _ in METHODS) + " | --- |",
    ]
    for ds, by_cell in results.items():
        for cell, by_method in by_cell.items():
            cells = []
            for name in METHODS:
                r = by_method.get(name)
                if r is None:
                    cells.append("")
                    continue
                text = f"{r['final']:.2f}"
                if r["before"] is not None:
                    rec = "never" if r["rounds_to_recover"] is None else str(r["rounds_to_recover"])
                    text += f" ({r['before']:.1f} → {r['lowest']:.1f}, {rec})"
                if r["newcomers_final"] is not None:
                    text += f", new {r['newcomers_final']:.1f}"
                cells.append(text + f", {r['total_mb']:,.0f} MB")
            f = by_method.get("flt", {})
            extra = f"{f.get('reclusterings')} ({f.get('moved')}), {f.get('recluster_mb', 0):.2f}" if f else ""
            lines.append(f"| {ds} | {cell} | " + " | ".join(cells) + f" | {extra} |")
    return "\n".join(lines)


def _f(x, width: int = 7, digits: int = 1) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", default="mnist,fashion_mnist")
    ap.add_argument("--cells", default=",".join(cells(15)), help="comma-separated cell names")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--event", type=int, default=15, help="the round of each cell's one change")
    ap.add_argument("--out", default=str(HERE / "results" / "dynamics.json"))
    ap.add_argument("--keep", help="keep every cell's run folder under this folder (default: a temporary one)")
    ap.add_argument("--remeasure", help="no runs: measure the cells kept in this folder (a --keep of before)")
    args = ap.parse_args()
    if args.remeasure:
        kept = Path(args.remeasure)
        results: dict[str, dict] = {}
        for folder in sorted(p for p in kept.iterdir() if (p / "summary.json").is_file()):
            ds, cell = folder.name.split("-", 1)
            results.setdefault(ds, {})[cell] = measure_cell(folder)
        print(table(results) + "\n\n" + markdown(results))
        doc = {"machine": machine_info(), "args": vars(args), "results": results}
        Path(args.out).write_text(json.dumps(doc, indent=1))
        print(f"\nwrote {args.out}")
        return
    if not DATA.is_dir():
        sys.exit(f"{DATA}: the shared data folder is missing (see its README)")
    grid = cells(args.event)
    unknown = set(args.cells.split(",")) - set(grid)
    if unknown:
        sys.exit(f"--cells: unknown {sorted(unknown)}; choose from {', '.join(grid)}")
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for ds in args.datasets.split(","):
            base = Path(tmp) / f"{ds}.yaml"
            base.write_text(yaml.safe_dump(scenario(ds, args.rounds)))
            results[ds] = {}
            for cell in args.cells.split(","):
                print(f"{ds} {cell} ...", flush=True)
                results[ds][cell] = run_cell(base, grid[cell], Path(tmp) / f"{ds}-{cell}", args.methods)
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(
                    json.dumps({"machine": machine_info(), "args": vars(args), "results": results}, indent=1)
                )
    print(table(results))
    print("\n" + markdown(results))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
