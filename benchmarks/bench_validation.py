"""How fast a mistake answers: `flt` on invalid scenarios and --set values, and every --help.

Each case is a fresh `flt` process, as a user runs it; the figures are its wall time and
the peak resident memory of the `flt` processes so far (getrusage of the children, so a
case that forked a zygote or a device would show it). The reference, measured in the same
run, is what answering used to cost at the least: importing torch and scikit-learn (the
validation came after them, and after the device zygote was forked).

    .venv/bin/python benchmarks/bench_validation.py

Targets (issue 21): every invalid input under 1 s and 150 MB; every --help under 1 s.
Writes benchmarks/results/validation.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "scenarios" / "quickstart.yaml"


def cases(tmp: Path) -> list[tuple[str, list[str]]]:
    """(what, flt arguments): each must exit 2 with one line naming the field or file."""
    typo = tmp / "typo.yaml"
    typo.write_text(QUICKSTART.read_text().replace("participation:", "participaton:"))
    method = tmp / "method.yaml"
    method.write_text(QUICKSTART.read_text().replace("aggregation: case2", "aggregation: case3"))
    cross = tmp / "cross.yaml"
    cross.write_text("name: x\nmethods:\n  - {name: flt, linkage: ward_graph}\n")
    q = str(QUICKSTART)
    return [
        ("misspelled field in a file", ["run", str(typo)]),
        ("method parameter out of its choices", ["run", str(method)]),
        ("method cross-field rule", ["run", str(cross)]),
        ("--set below a minimum", ["run", q, "--set", "train.rounds=0"]),
        ("--set of an unknown field", ["run", q, "--set", "train.round=5"]),
        ("--set of a method parameter", ["run", q, "--set", "methods=[{name: ifca, clusters: 0}]"]),
        ("compare with an unknown method", ["compare", q, "--methods", "fedavgg"]),
        ("relate with a bad partition", ["relate", q, "--set", "partition.clients=0"]),
        ("missing scenario file", ["run", str(tmp / "nowhere.yaml")]),
        ("unsafe security", ["run", q, "--set", "devices.bind=tcp://0.0.0.0:5555", "--set", "devices.security=none"]),
    ]


def flt(args: list[str]) -> tuple[float, int, str]:
    tic = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "flt.emulator.cli", *args], capture_output=True, text=True)
    return time.perf_counter() - tic, res.returncode, res.stderr.strip().splitlines()[-1] if res.stderr else ""


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KB on Linux


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "validation.json"))
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for what, argv in cases(Path(tmp)):
            seconds, code, line = flt(argv)
            rows.append({"what": what, "seconds": seconds, "exit": code, "says": line[:100]})
    invalid_peak = peak_mb()  # the children's peak so far: measured before the reference runs
    tic = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, sklearn.cluster"], check=True)
    reference_s = time.perf_counter() - tic
    helps = []
    for cmd in ([], ["run"], ["compare"], ["relate"], ["suite"], ["report"], ["device"], ["keys"]):
        seconds, code, _ = flt([*cmd, "--help"])
        helps.append({"what": " ".join(["flt", *cmd, "--help"]), "seconds": seconds, "exit": code})

    print(f"reference: importing torch and scikit-learn takes {reference_s:.2f} s here")
    print(f"\n  {'invalid input':<40}{'s':>6}{'vs ref':>8}  exit  says")
    for r in rows:
        print(f"  {r['what']:<40}{r['seconds']:6.2f}{r['seconds'] / reference_s:8.2f}  {r['exit']:>4}  {r['says']}")
    print(f"  peak memory of any of these flt processes: {invalid_peak:.0f} MB")
    for h in helps:
        print(f"  {h['what']:<40}{h['seconds']:6.2f}{h['seconds'] / reference_s:8.2f}  {h['exit']:>4}")
    worst = max(r["seconds"] for r in rows)
    bad = [r["what"] for r in rows if r["exit"] != 2]
    print(f"\nworst invalid input {worst:.2f} s (target < 1 s), peak {invalid_peak:.0f} MB (target < 150 MB)")
    if bad:
        print(f"NOT A CLEAN EXIT 2: {bad}")
    if worst >= 1.0 or invalid_peak >= 150 or max(h["seconds"] for h in helps) >= 1.0:
        print("SLOWER THAN THE TARGET: validation no longer answers before the heavy imports")
    out = {"reference_import_s": reference_s, "invalid": rows, "invalid_peak_mb": invalid_peak, "help": helps}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
