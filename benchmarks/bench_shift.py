"""What a feature shift costs: the same FedAvg run with and without `partition.shift`.

Transforms run on the devices, on the float copy each task makes of a client's images,
so a shifted run should hold no more memory than a plain one (no per-client copy of the
dataset) and spend a little more time per round (the transform of each cohort's images).
Each variant is one `flt compare ... --methods fedavg` in a fresh process whose whole
process tree is sampled for PSS every 0.2 s (bench_scale.PeakPss); the table gives every
figure's ratio to the unshifted run measured in the same invocation.

    .venv/bin/python benchmarks/bench_shift.py                 # rotated MNIST, M = 400
    .venv/bin/python benchmarks/bench_shift.py --clients 2400  # IFCA's M

Writes benchmarks/results/shift.json (change it with --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
from bench_scale import run_watched  # noqa: E402
from machine import machine_info  # noqa: E402

# label, the partition.shift it sets ("null": none)
VARIANTS = (
    ("no shift", "null"),
    ("rotate 0/90/180/270 (exact)", "{kind: rotate}"),
    ("rotate 0/45/90/135 (bilinear)", "{kind: rotate, levels: [0, 45, 90, 135]}"),
    ("noise 0-0.6", "{kind: noise}"),
    ("blur sigma 0-2", "{kind: blur}"),
    ("labels (concept shift)", "{kind: labels}"),
)


def run_variant(args, shift: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "flt.emulator.cli", "compare", args.scenario, "--methods", "fedavg", "--out", str(out)]
    for s in (
        f"partition.shift={shift}",
        f"partition.clients={args.clients}",
        f"train.rounds={args.rounds}",
        f"train.eval_every={args.rounds}",
        f"train.participation={args.participation}",
        "train.local_epochs=1",
    ):
        cmd += ["--set", s]
    code, peak, wall = run_watched(cmd, out.with_suffix(".log"))
    if code != 0:
        sys.exit(f"{shift}: flt compare exited with {code}; see {out.with_suffix('.log')}")
    m = json.loads((out / "summary.json").read_text())["methods"]["fedavg"]
    return {
        "s_per_round": m["timing"]["s_per_round"],
        "peak_pss_mb": peak,
        "wall_s": wall,
        "final_accuracy": m["final_accuracy"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default=str(REPO / "scenarios" / "rotated_mnist.yaml"))
    ap.add_argument("--clients", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--participation", type=float, default=0.1)
    ap.add_argument("--repeat", type=int, default=3, help="runs per variant; the table gives medians (PSS peaks vary)")
    ap.add_argument("--out", default=str(HERE / "results" / "shift.json"))
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {label: [] for label, _ in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeat):  # interleaved, so a change in the machine's load hits every variant
            for i, (label, shift) in enumerate(VARIANTS):
                print(f"{label} (run {r + 1}/{args.repeat}) ...", flush=True)
                runs[label].append(run_variant(args, shift, Path(tmp) / f"v{i}-r{r}"))
    rows: dict[str, dict] = {
        label: {k: float(np.median([x[k] for x in rs])) for k in rs[0]} for label, rs in runs.items()
    }
    for label, rs in runs.items():
        rows[label]["pss_range_mb"] = [min(x["peak_pss_mb"] for x in rs), max(x["peak_pss_mb"] for x in rs)]
    base = rows["no shift"]
    print(f"\nFedAvg on {Path(args.scenario).name}, M = {args.clients}, rho = {args.participation}, E = 1")
    print(f"medians of {args.repeat} runs each (peak PSS: min-max in brackets)")
    print(f"{'variant':<32}{'s/round':>9}{'x plain':>9}{'peak PSS MB':>13}{'x plain':>9}{'range':>13}{'final acc':>11}")
    for label, r in rows.items():
        print(
            f"{label:<32}{r['s_per_round']:>9.3f}{r['s_per_round'] / base['s_per_round']:>9.2f}"
            f"{r['peak_pss_mb']:>13.0f}{r['peak_pss_mb'] / base['peak_pss_mb']:>9.2f}"
            f"{'{:.0f}-{:.0f}'.format(*r['pss_range_mb']):>13}{r['final_accuracy']:>11.2f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine_info(), "args": vars(args), "rows": rows, "runs": runs}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
