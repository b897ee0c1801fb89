"""How a run grows with the number of clients M: seconds per round, FCR seconds, memory.

Runs the structured non-IID scale scenario (scenarios/s4_scale_mnist.yaml unless
--scenario names another) through the real CLI, once per M in --clients, with the same
methods, and samples the proportional set size (PSS) of the whole process tree (the
server and every device process) every 0.2 s: PSS counts a page shared by n processes
as 1/n in each, so shared pages count once, unlike RSS.

    .venv/bin/python benchmarks/bench_scale.py                       # M = 100, 600, 2400; 3 rounds
    python benchmarks/bench_scale.py --clients 2400 --rounds 100 --accelerator cuda

Prints per M and method: seconds per round (median), set-up seconds (FCR for FLT: encoder,
client embedding, server clustering), wall seconds, final accuracy and the tree's peak
PSS, with each figure's ratio to the smallest M measured in the same run. Writes
benchmarks/results/scale_<accelerator>.json and scale_<accelerator>.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from machine import machine_info  # noqa: E402


def tree_pss_mb(root: int) -> float:
    """PSS of `root` and all its descendants, in MB (from /proc/PID/smaps_rollup)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


class PeakPss(threading.Thread):
    def __init__(self, pid: int, every_s: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.every_s, self.peak, self.done = pid, every_s, 0.0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            self.peak = max(self.peak, tree_pss_mb(self.pid))


def run_watched(cmd: list[str], log_path: Path) -> tuple[int, float, float]:
    """Run `cmd` from the repository, output to `log_path`; (exit code, peak PSS MB of its
    process tree, wall seconds)."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        watch = PeakPss(proc.pid)
        watch.start()
        code = proc.wait()
        watch.done.set()
    return code, watch.peak, time.perf_counter() - t0


def run_one(args, m: int, out: Path) -> dict:
    sets = [
        f"partition.clients={m}",
        f"train.rounds={args.rounds}",
        f"train.eval_every={args.rounds}",
        f"devices.processes={args.processes}",
        f"devices.accelerator={args.accelerator}",
    ]
    cmd = [
        sys.executable,
        "-m",
        "flt.emulator.cli",
        "compare",
        args.scenario,
        "--out",
        str(out),
        "--methods",
        ",".join(args.methods),
    ]
    for s in sets + args.set:
        cmd += ["--set", s]
    code, peak, wall = run_watched(cmd, out.with_suffix(".log"))
    if code != 0:
        raise SystemExit(f"M={m}: flt run exited with {code}; see {out.with_suffix('.log')}")
    summary = json.loads((out / "summary.json").read_text())
    methods = {}
    for label, s in summary["methods"].items():
        t = s["timing"]
        methods[label] = {
            "s_per_round": t["s_per_round"],
            "setup_s": t["setup_s"],
            "wall_s": t["wall_s"],
            "fcr_server_s": (t.get("fcr") or {}).get("server_seconds"),
            "final_accuracy": s["final_accuracy"],
            "clusters": s.get("found_clusters"),
        }
    return {"clients": m, "peak_pss_mb": peak, "total_wall_s": wall, "methods": methods}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = [r["clients"] for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
    for label in rows[0]["methods"]:
        ax[0].plot(ms, [r["methods"][label]["s_per_round"] for r in rows], "o-", label=label)
        ax[1].plot(ms, [r["methods"][label]["setup_s"] for r in rows], "o-", label=label)
    ax[2].plot(ms, [r["peak_pss_mb"] / 1024 for r in rows], "o-", color="k")
    for a, title in zip(
        ax, ("seconds per round", "set-up seconds (FCR for FLT)", "peak PSS of the tree (GB)"), strict=True
    ):
        a.set_xscale("log")
        a.set_xlabel("clients M")
        a.set_title(title)
        a.grid(alpha=0.3)
    ax[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default=str(REPO / "scenarios" / "s4_scale_mnist.yaml"))
    ap.add_argument("--clients", nargs="+", type=int, default=[100, 600, 2400])
    ap.add_argument("--methods", nargs="+", default=["fedavg", "flt", "fedsem"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda", "auto"))
    ap.add_argument("--set", action="append", default=[], help="more scenario overrides, key=value")
    ap.add_argument("--work", default="/tmp/flt-bench-scale")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    print(
        f"{'M':>5} {'method':<10} {'s/round':>8} {'x M0':>6} {'set-up s':>9} {'x M0':>6} {'wall s':>8} "
        f"{'acc':>6} {'peak PSS MB':>11} {'x M0':>6}"
    )
    for m in args.clients:
        out = work / f"{Path(args.scenario).stem}_{args.accelerator}_m{m}"
        row = run_one(args, m, out)
        rows.append(row)
        base = rows[0]
        for label, r in row["methods"].items():
            b = base["methods"][label]
            print(
                f"{m:>5} {label:<10} {r['s_per_round']:>8.3f} {r['s_per_round'] / b['s_per_round']:>6.1f} "
                f"{r['setup_s']:>9.2f} {r['setup_s'] / max(b['setup_s'], 1e-9):>6.1f} {r['wall_s']:>8.1f} "
                f"{r['final_accuracy']:>6.2f} {row['peak_pss_mb']:>11.0f} "
                f"{row['peak_pss_mb'] / base['peak_pss_mb']:>6.2f}"
            )
    res = Path(args.out)
    res.mkdir(parents=True, exist_ok=True)
    stem = f"scale_{args.accelerator}"
    (res / f"{stem}.json").write_text(
        json.dumps({"machine": machine_info(), "args": vars(args), "results": rows}, indent=1)
    )
    plot(rows, res / f"{stem}.png")
    print(f"wrote {res / stem}.json and .png")


if __name__ == "__main__":
    main()
