"""Random scenario shapes, each run end to end: what the repository's scenario files never try.

A probe for a maintainer, not a test (each shape is a 3-5 round `flt run` of 5 s to a few
minutes; 40 shapes with the real datasets took 23 minutes on 2 cores), beside
tests/odd_settings.py, which varies one setting of the quickstart at a time where this
varies all of them at once.

Draws COUNT scenarios from a seeded generator: partition kind (planted clusters with or
without shared classes and shifts, Dirichlet, IID, structured), 2 to 30 clients, 1 to 5
planted clusters, shard sizes of 10 to 60 images, participation 0.1 to 1, batch 5 to 64,
momentum, the MLP or a CNN, 1 to 3 device processes, three methods with their parameters
(FLT's `k: labels`, `relatedness: paper`, fine-tuning and Case I; IFCA, CFL, FedSEM's
`pool: all`, FedGroup, PACFL told C, ...), newcomers, drift (new images, or labels
swapped), device profiles with a deadline (a multiple of a median task) and over-commitment, and a device crash. Each
is a fresh `flt run` process on scikit-learn's digits; with --data-root also on MNIST,
Fashion-MNIST, the CIFAR-10 JPEGs and the FEMNIST writers found there. Rounds are 3 to 5: the sweep looks for runs
that break, not for accuracy.

A run passes when it either
- exits 0 and every method's summary holds together: a finite final accuracy, bytes equal
  to its byte formula (`bytes_vs_formula` 1 to 1e-9; at most 1 where a device was lost)
  and, for a clustering method, at least one cluster in the table; or
- exits 2 with one `error:` line (a refused scenario, named by field or file).
Anything else (a traceback, exit 1 or 3, a timeout, an inconsistent summary) is a finding.

With --kill-resume every shape that ran is run a second time and stopped (SIGKILL or
SIGTERM, drawn) once a drawn method has recorded a drawn number of rounds, or at a drawn
moment of the first run's duration (one time in three: set-up and encoders too), then
`flt run --resume`d: a resume that fails, or whose records and summary differ from the
uninterrupted run's (wall-clock fields aside), is a finding too; one stopped before its run
folder was made must be refused with one line. That doubles the time.

    .venv/bin/python tests/shape_sweep.py                     # 30 shapes on digits
    .venv/bin/python tests/shape_sweep.py --count 40 --seed 1 --data-root ../shared/data
    .venv/bin/python tests/shape_sweep.py --seed 5 --kill-resume  # and resume each one

Prints one line a run (seconds, exit code, verdict) and exits 1 if any run is a finding.
--out F.json writes the shapes, the verdicts, each run's last output line and the distinct
warnings of its run.log (a count of them on the line printed) and the methods no update
ever reached (every round returned nobody: named on the line); --keep DIR
keeps the scenario files and run folders (default: a temporary folder, removed); with the
real datasets they hold checkpoints of up to 1 GB a shape (5 to 8 GB a sweep of 24 with
--kill-resume), so remove them once read. Add a regression test in tests/test_*.py for
every finding fixed.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

CLUSTERING = ("flt", "pca_km_hc", "ifca", "fedsem", "fesem_soft", "cfl", "fedgroup", "pacfl")


def methods_pool(planted: bool, clusters: int) -> list:
    """Method entries a shape draws three of: defaults and the settings users change."""
    enc = {"dataset": "public", "epochs": 2}
    return [
        "fedavg",
        "fedprox",
        "local",
        *(["oracle"] if planted else []),
        {"name": "flt", "encoder": enc},
        {"name": "flt", "label": "flt_labels", "k": "labels", "encoder": enc},
        {"name": "flt", "label": "flt_paper", "relatedness": "paper", "encoder": enc},
        {"name": "flt", "label": "flt_tuned", "aggregation": "case1", "encoder": {**enc, "finetune_epochs": 1}},
        "ifca",
        {"name": "ifca", "label": "ifca_c", "clusters": clusters},
        {"name": "cfl", "warmup_rounds": 1},
        "fedsem",
        {"name": "fedsem", "label": "fedsem_all", "centers": clusters, "pool": "all"},
        {"name": "fesem_soft", "centers": clusters},
        {"name": "fedgroup", "groups": clusters},
        "pacfl",
        {"name": "pacfl", "label": "pacfl_c", "clusters": clusters},
        "pca_km_hc",
    ]


def dataset_choice(r: random.Random, data_root: Path | None) -> tuple[dict, str]:
    """(data section, model) for one shape."""
    choices = ["digits"]
    if data_root is not None:
        found = {"mnist": "mnist", "fashion_mnist": "fashion-mnist", "cifar10_jpg": "cifar10-jpg", "femnist": "femnist"}
        choices += [name for name, folder in found.items() if (data_root / folder).is_dir()]
    name = r.choice(choices)
    if name == "digits":
        return {"dataset": "digits"}, r.choice(["mlp", "mlp", "leaf_cnn"])
    root = data_root / "femnist" if name == "femnist" else data_root  # type: ignore[operator]
    model = "cifar_cnn" if name == "cifar10_jpg" else r.choice(["mlp", "leaf_cnn"])
    return {"dataset": name, "root": str(root)}, model


def shape(i: int, seed: int, data_root: Path | None) -> dict:
    """Scenario i of the sweep drawn with `seed`: a dict `flt run` takes as a file."""
    r = random.Random(seed * 100_003 + i)
    data, model = dataset_choice(r, data_root)
    kinds = ["writers", "structured", "clusters"] if data["dataset"] == "femnist" else []
    kind = r.choice(kinds or ["clusters", "clusters", "dirichlet", "iid", "structured"])
    m = r.choice([2, 3, 5, 8, 12, 20, 30])
    part: dict = {"kind": kind, "clients": m, "test_per_client": r.choice([5, 15]), "public_fraction": 0.2}
    if kind != "writers":
        part["samples_per_client"] = r.choice([10, 30, 60])
    if kind != "writers" and data["dataset"] != "digits":
        part["max_per_class"] = 300  # the structured sampler deals out every image: keep runs short
    clusters = r.choice([c for c in (1, 2, 3, 5) if c <= m])
    if kind in ("clusters", "structured"):
        part["clusters"] = clusters
    if kind == "clusters":
        per = r.choice([1, 2])
        part.update(classes_per_cluster=per, shared_classes=r.choice([0, 0, 1]) if per > 1 else 0)
        if r.random() < 0.3:
            part["shift"] = {"kind": r.choice(["rotate", "invert", "noise", "blur", "labels"])}
    if kind == "dirichlet":
        part["alpha"] = r.choice([0.05, 0.5, 5.0])
    out: dict = {
        "name": f"shape{i}",
        "seed": i,
        "data": data,
        "partition": part,
        "model": model,
        "train": {
            "rounds": r.choice([3, 5]),
            "participation": r.choice([0.1, 0.5, 1.0]),
            "local_epochs": 1,
            "batch_size": r.choice([5, 10, 64]),
            "lr": 0.05,
            "momentum": r.choice([0.0, 0.0, 0.5]),
        },
        "devices": {"processes": r.choice([1, 2, 3])},
        "methods": r.sample(methods_pool(kind == "clusters", max(clusters, 2)), 3),
        "population": population(r, kind, m, clusters, median_task_s(data, model, part.get("samples_per_client", 200))),
    }
    if out["devices"]["processes"] >= 2 and r.random() < 0.2:
        out["devices"]["crash"] = {1: 2}  # the run goes on without it
    return out


IN_SHAPE = {"digits": (1, 8, 8), "cifar10_jpg": (3, 32, 32)}  # the others: (1, 28, 28)


@functools.lru_cache
def parameters(model: str, dataset: str) -> int:
    from flt.models.nets import build_model

    net = build_model(model, IN_SHAPE.get(dataset, (1, 28, 28)), 62 if dataset == "femnist" else 10)
    return sum(p.numel() for p in net.parameters())


def median_task_s(data: dict, model: str, samples: int) -> float:
    """A median client's emulated task: FedScale's compute (3 x 20 ms a sample, one epoch),
    the model down at 20 and up at 5 Mbit/s (the default network's commonest tier)."""
    return 0.06 * samples + 4 * 8 * parameters(model, data["dataset"]) * (1 / 20e6 + 1 / 5e6)


def population(r: random.Random, kind: str, m: int, clusters: int, task_s: float) -> dict:
    pop: dict = {}
    if m >= 5 and r.random() < 0.3:
        pop["newcomers"] = [{"round": 2, "clients": [m - 1]}]
    if kind == "clusters" and clusters > 1 and m >= 5 and r.random() < 0.4:
        pop["drift"] = [
            r.choice(
                [
                    {"round": 2, "clients": [0], "kind": "resample"},
                    {"round": 2, "clients": [0, 1], "kind": "swap_labels", "labels": [0, 1]},
                ]
            )
        ]
    if r.random() < 0.3:
        pop["profiles"] = {
            "distribution": {"compute": {"dist": "lognormal", "median_ms_per_sample": 20.0, "sigma": 0.5}}
        }
        if r.random() < 0.5:  # some rounds keep a few clients, some most, some none (a fixed 3 s kept none)
            pop["deadline_s"] = round(r.choice([0.5, 1.0, 2.0, 4.0]) * task_s, 2)
        if r.random() < 0.5:
            pop["overcommit"] = 1.5
    return pop


def summary_problems(run_dir: Path) -> list[str]:
    """What does not hold together in a finished run's summary.json."""
    from flt.reports.summary import clustering

    path = run_dir / "summary.json"
    if not path.exists():
        return ["no summary.json"]
    problems = []
    for label, m in json.loads(path.read_text())["methods"].items():
        acc = m.get("final_accuracy")
        if not isinstance(acc, (int, float)) or not math.isfinite(acc):
            problems.append(f"{label}: final accuracy {acc}")
        ratio = m.get("bytes_vs_formula")
        if m.get("lost_clients") and ratio is not None and ratio <= 1.0:
            pass  # a lost device's clients never upload what the formula counts (docs/runs.md)
        elif ratio is not None and abs(ratio - 1.0) > 1e-9:
            problems.append(f"{label}: bytes {ratio:.6f} x its formula")
        found, _ = clustering(m)
        if found is not None and found < 1:  # None: a method that does not cluster
            problems.append(f"{label}: {found} clusters in the table")
    return problems


def run_one(scenario: Path, run_dir: Path, timeout: float) -> dict:
    tic = time.perf_counter()
    argv = [sys.executable, "-m", "flt.emulator.cli", "run", str(scenario), "--out", str(run_dir)]
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        code, err, out = res.returncode, res.stderr.strip().splitlines(), res.stdout.strip().splitlines()
    except subprocess.TimeoutExpired:
        code, err, out = None, [], []
    last = ((out if code == 0 else err) or [""])[-1][:300]  # the table's last row, or the error
    if code == 0:
        problems = summary_problems(run_dir)
    elif code == 2:
        one_line = len([x for x in err if x.startswith("error:")]) == 1 and "Traceback" not in "\n".join(err)
        problems = [] if one_line else ["exit 2 without one error line"]
    else:
        problems = [f"exit {code}" if code is not None else f"timed out after {timeout:.0f} s"]
    return {
        "seconds": round(time.perf_counter() - tic, 1),
        "exit": code,
        "problems": problems,
        "last_line": last,
        "warnings": warnings(run_dir),
        "untrained": untrained(run_dir) if code == 0 else [],
    }


def untrained(run_dir: Path) -> list[str]:
    """Methods that no client's update ever reached (every round returned 0): not findings
    (a deadline or a crash may cause it on purpose), but a shape that tested little of them."""
    idle = []
    for metrics in sorted(run_dir.glob("*/metrics.jsonl")):
        rounds = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if rounds and all(r.get("returned") == 0 for r in rounds):
            idle.append(metrics.parent.name)
    return idle


def warnings(run_dir: Path) -> list[str]:
    """The distinct warnings and errors in the run's run.log, without their times: not
    findings (a shape may be odd on purpose), but what a reader of the sweep should see."""
    path = run_dir / "run.log"
    lines = path.read_text().splitlines() if path.exists() else []
    said = [line.split(" ", 2)[2] for line in lines if " WARNING " in line or " ERROR " in line]
    return list(dict.fromkeys(said))


def kill_and_resume(
    scenario: Path, whole: Path, run_dir: Path, r: random.Random, timeout: float, whole_s: float = 0.0
) -> dict:
    """Run the shape again, stop it with SIGKILL or SIGTERM once a drawn method has
    recorded a drawn number of rounds (or, one time in three where `whole_s` is given, at a
    drawn moment of the `whole_s` seconds the uninterrupted run took: in its set-up, an
    encoder's training, between methods), `flt run --resume` it, and compare every record
    and the summary with the uninterrupted run in `whole` (wall-clock fields aside): a
    resumed run must end exactly where an uninterrupted one does."""
    from flt_command import results_without_timing  # beside this file

    summary = json.loads((whole / "summary.json").read_text())["methods"]
    method = r.choice(sorted(summary))
    after = r.randint(1, max(summary[method].get("rounds") or 1, 1))
    sig = r.choice([signal.SIGKILL, signal.SIGTERM])
    by_time = r.random() < 1 / 3 and whole_s > 0
    at_s = r.uniform(0.05, 1.0) * whole_s if by_time else None
    argv = [sys.executable, "-m", "flt.emulator.cli", "run", str(scenario), "--out", str(run_dir)]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics, tic = run_dir / method / "metrics.jsonl", time.perf_counter()
    while proc.poll() is None and time.perf_counter() - tic < min(at_s if by_time else timeout, timeout):
        if at_s is None and metrics.exists() and len(metrics.read_text().splitlines()) >= after:
            break
        time.sleep(0.02)
    killed = proc.poll() is None
    if killed:
        proc.send_signal(sig)
    proc.wait(timeout=60)
    point = f"at {at_s:.1f} s" if at_s is not None else f"after {after} of {method}'s rounds"
    where = f"{sig.name} {point}" if killed else "finished before the kill"
    argv = [sys.executable, "-m", "flt.emulator.cli", "run", "--resume", str(run_dir)]
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"resume": where, "resume_problems": [f"resume timed out after {timeout:.0f} s"]}
    made = ("config.yaml", "partition.npz", "public_indices.npy")  # what `flt run --resume` starts from
    if not all((run_dir / name).exists() for name in made):  # stopped before its folder was made
        refused = res.returncode == 2 and "not a run folder that can be resumed" in res.stderr
        problem = [] if refused else [f"resume of a folder-less run: exit {res.returncode}, {res.stderr[-200:]}"]
        return {"resume": where + ", before its run folder", "resume_problems": problem}
    if res.returncode != 0:
        return {"resume": where, "resume_problems": [f"resume exit {res.returncode}: {res.stderr.strip()[-200:]}"]}
    want, got = results_without_timing(whole), results_without_timing(run_dir)
    differ = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
    return {"resume": where, "resume_problems": [f"resumed {k} differs from the uninterrupted run's" for k in differ]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-root", type=Path, help="adds MNIST, Fashion-MNIST, CIFAR-10 JPEGs, FEMNIST found here")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a run may take")
    ap.add_argument(
        "--kill-resume", action="store_true", help="also stop each finished shape's second run and resume it"
    )
    ap.add_argument("--keep", type=Path, help="folder for the scenario files and run folders (kept: GBs)")
    ap.add_argument("--out", type=Path, help="JSON file for the shapes and verdicts")
    args = ap.parse_args()
    data_root = args.data_root.resolve() if args.data_root else None
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows = []
        for i in range(args.count):
            scen = shape(i, args.seed, data_root)
            path = work / f"shape{i}.yaml"
            path.write_text(yaml.safe_dump(scen, sort_keys=False))
            row = {"shape": i, **run_one(path, work / f"run{i}", args.timeout)}
            if args.kill_resume and row["exit"] == 0:
                kill = random.Random(f"kill {args.seed} {i}")  # apart from the shape's draws
                row.update(
                    kill_and_resume(path, work / f"run{i}", work / f"resumed{i}", kill, args.timeout, row["seconds"])
                )
                row["problems"] += row["resume_problems"]
            rows.append({**row, "scenario": scen})
            verdict = "ok" if not row["problems"] else "FINDING: " + "; ".join(row["problems"])
            verdict += f" (resumed: {row['resume']})" if "resume" in row else ""
            said = len(row["warnings"])
            verdict += f" [{said} warning{'s' * (said > 1)} in run.log]" if said else ""
            verdict += f" [never trained: {', '.join(row['untrained'])}]" if row["untrained"] else ""
            print(f"shape {i:3d}  {row['seconds']:6.1f} s  exit {row['exit']}  {verdict}  | {row['last_line'][:90]}")
    findings = [r for r in rows if r["problems"]]
    print(
        f"{len(rows)} shapes: {sum(r['exit'] == 0 for r in rows)} ran, {sum(r['exit'] == 2 for r in rows)} refused "
        f"with one line, {len(findings)} findings"
    )
    if args.out:
        meta = {"count": args.count, "seed": args.seed, "data_root": str(data_root) if data_root else None}
        args.out.write_text(json.dumps({**meta, "findings": len(findings), "runs": rows}, indent=1) + "\n")
    return 1 if findings else 0


if __name__ == "__main__":
    raise SystemExit(main())
