"""What CURVE costs: S1-MNIST FedAvg seconds per round with devices.security curve and none.

Both settings run on loopback in one invocation, alternating (none, curve, none, curve,
...), so a change in the machine's load hits both alike. Each run is the real
`emulator.run.run_scenario` (server socket, `--processes` device processes, per-run keys
or tokens), evaluating only at the last round. The figure per run is the median of the
rounds' `train_s` (selection, training, aggregation; round 1, the warm-up, excluded); the
table gives, per setting, the least disturbed run (min) and the median over repeats, the
ratio curve / none, the CPU seconds of the server and its device processes per run (the
cost itself, far less sensitive to other jobs' load than wall time), and checks that both
settings reached the same accuracies (CURVE must not change a result).

    .venv/bin/python benchmarks/bench_curve.py                       # 10 rounds, 2 repeats each
    .venv/bin/python benchmarks/bench_curve.py --rounds 3 --repeats 1  # smoke test

Writes benchmarks/results/curve.json (change it with --out).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench_fedavg_s1 import median, resolve_data_root  # noqa: E402
from machine import machine_info  # noqa: E402

SETTINGS = ("none", "curve")


def one_run(args, data_root: Path, work: Path, security: str, repeat: int) -> dict:
    from flt.emulator import config
    from flt.emulator.run import run_scenario

    overrides = [
        f"train.rounds={args.rounds}",
        f"train.eval_every={args.rounds}",
        f"devices.processes={args.processes}",
        f"data.root={data_root}",
        f"seed={args.seed}",
        f"devices.security={security}",
    ]
    cfg = config.load(args.scenario, overrides, methods=["fedavg"])
    run_dir = work / f"{security}-{repeat}"
    cpu0 = _cpu_s()
    tic = time.perf_counter()
    run_scenario(cfg, str(run_dir), progress=lambda line: None)
    total = time.perf_counter() - tic
    cpu = _cpu_s() - cpu0  # this process and its device processes (reaped when the run ends)
    rows = [json.loads(x) for x in (run_dir / "fedavg" / "metrics.jsonl").read_text().splitlines() if x]
    train_s = [r.get("timing", r)["train_s"] for r in rows]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "security": summary["security"],
        "total_s": total,
        "cpu_s": cpu,
        "per_round_s": train_s,
        "median_round_s": median(train_s[1:] or train_s),
        "accuracies": [r.get("acc_mean") for r in rows],
    }


def _cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2, help="runs per setting, alternating (default 2)")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--data-root", help="folder holding MNIST (default: ../shared/data from the repo root)")
    p.add_argument("--scenario", default=str(REPO / "scenarios" / "s1_mnist.yaml"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "curve.json"))
    args = p.parse_args(argv)
    if args.rounds < 2 or args.repeats < 1:
        p.error("--rounds must be >= 2 (round 1 is a warm-up) and --repeats >= 1")
    logging.basicConfig(level=logging.ERROR)
    data_root = resolve_data_root(args.data_root)
    info = machine_info()
    work = Path(tempfile.mkdtemp(prefix="flt-bench-curve-"))
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    try:
        for repeat in range(args.repeats):
            for security in SETTINGS:
                run = one_run(args, data_root, work, security, repeat)
                runs[security].append(run)
                print(
                    f"{security:5s} #{repeat}: {run['median_round_s']:.3f} s/round "
                    f"(run {run['total_s']:.1f} s, mechanism {run['security']['mechanism']})",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info["loadavg_end"] = list(os.getloadavg())
    # wall seconds suffer from other jobs' load: the least disturbed run (min) is the
    # headline, the median is given too; CPU seconds (server + devices, whole run) are
    # the cost itself, far less sensitive to load
    per = {s: median([r["median_round_s"] for r in runs[s]]) for s in SETTINGS}
    best = {s: min(r["median_round_s"] for r in runs[s]) for s in SETTINGS}
    cpu = {s: median([r["cpu_s"] for r in runs[s]]) for s in SETTINGS}
    same = all(r["accuracies"] == runs["none"][0]["accuracies"] for s in SETTINGS for r in runs[s])
    result = {
        "benchmark": "curve",
        "machine": info,
        "args": vars(args),
        "runs": runs,
        "median_round_s": per,
        "min_round_s": best,
        "median_run_cpu_s": cpu,
        "curve_over_none_min": best["curve"] / best["none"],
        "curve_over_none_median": per["curve"] / per["none"],
        "extra_cpu_s_per_round": (cpu["curve"] - cpu["none"]) / args.rounds,
        "same_accuracies": same,
    }
    print(
        f"\nS1-MNIST FedAvg, {args.processes} device processes, {args.rounds} rounds x {args.repeats} "
        f"repeats, seconds per round (round 1 excluded)"
    )
    for s in SETTINGS:
        print(f"  {s:5s}  min {best[s]:.3f}  median {per[s]:.3f}  run CPU s (median) {cpu[s]:.1f}")
    print(
        f"  curve / none: {result['curve_over_none_min']:.3f} (min), {result['curve_over_none_median']:.3f} "
        f"(median); extra CPU {result['extra_cpu_s_per_round']:+.3f} s per round; same accuracies: {same}"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
