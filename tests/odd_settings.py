"""Run the quickstart with odd but plausible settings and flag every one that ends badly.

A probe for a maintainer, not a test (each case is a two-round `flt run`, 5-70 s; the
whole list takes about 20 minutes on 2 cores). A case passes when the run finishes
(exit 0) or stops with an `error:` line last (exit 2 or 3); it fails on a traceback, a
timeout, or any other exit code:

    .venv/bin/python tests/odd_settings.py                 # every case
    .venv/bin/python tests/odd_settings.py --only bind     # the cases whose text holds "bind"

The fixes it led to are regression-tested one by one in tests/test_config.py,
tests/test_validation.py and tests/test_end_to_end.py; add a case here when a new field
or method appears, and a test there when it finds something.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "scenarios" / "quickstart.yaml"
FLT1 = "{name: flt, encoder: {dataset: public, epochs: 1}"  # one pretraining epoch: fast

# each case: the --set values of one run (quickstart, two rounds)
CASES = [
    # partition
    "partition.clients=1 partition.clusters=1",
    "partition.clients=2 partition.clusters=5",
    "partition.classes_per_cluster=10 partition.clusters=1",
    "partition.samples_per_client=1",
    "partition.samples_per_client=2 partition.test_per_client=1",
    "partition.public_fraction=0",
    "partition.kind=dirichlet partition.alpha=0.001",
    "partition.kind=structured partition.delta=100",
    "seed=4294967295",
    "partition.kind=writers",
    "partition.kind=iid partition.clients=1",
    "partition.shared_classes=5",
    "partition.on_short=fail partition.samples_per_client=5000",
    "partition.on_short=share partition.samples_per_client=500",
    "partition.clusters=20 partition.classes_per_cluster=1",
    "partition.shift.kind=labels",
    "partition.shift.kind=rotate 'partition.shift.levels=[0, 90]'",
    "partition.shift.kind=noise 'partition.shift.levels=[0, 1, 2, 3, 1e9]'",
    "partition.shift.kind=blur 'partition.shift.levels=[0, 0, 0, 0, 100]'",
    "partition.shift.kind=invert 'partition.shift.levels=[0, 1, 0, 1, 2]'",
    # training
    "train.batch_size=1000",
    "train.participation=0.01",
    "train.eval_every=50",
    "train.lr=1e9",
    "train.lr=1e-30",
    "train.momentum=1",
    "train.target_accuracy=100",
    "model=leaf_cnn",
    "model=cifar_cnn",
    # devices
    "devices.processes=0",
    "devices.processes=30",
    "devices.threads=64",
    "devices.threads=2147483647",
    "devices.start=exec",
    "devices.round_timeout_s=0.001",
    "devices.start_timeout_s=0.01",
    "'devices.crash={0: 1, 1: 1}'",
    "'devices.crash={5: 1}'",
    "devices.security=on",
    "devices.bind=tcp://256.1.1.1:*",
    "devices.bind=tcp://127.0.0.1:99999",
    "devices.bind=ipc:///tmp/flt-odd-settings.sock",
    "devices.external=1 devices.start_timeout_s=2",
    "devices.accelerator=cuda",
    # population
    "'population.newcomers=[{round: 2, cluster: 4}]'",
    "'population.newcomers=[{round: 1, clients: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]}]'",
    "'population.drift=[{round: 2, clients: [0], to_cluster: 0}]'",
    "'population.drift=[{round: 2, clients: [0, 1], kind: swap_labels, labels: [0, 0]}]'",
    "population.sampling=available",
    "population.overcommit=100",
    "'population.profiles.distribution={compute: {dist: constant, ms_per_sample: 1}}' population.deadline_s=0.0001",
    "'population.profiles.distribution={compute: {dist: constant, ms_per_sample: 1}}' population.realtime=0.001",
    "'population.profiles.distribution={availability: {dist: windows, online_fraction: 0.01}}' "
    "population.sampling=available",
    "population.profiles.trace=/nonexistent.csv",
    "data.dataset=mnist data.root=/nonexistent",
    # methods
    f"'methods=[{FLT1}, clusters: 30}}]'",
    f"'methods=[{FLT1[:-1]}, latent: 1}}}}]'",
    f"'methods=[{FLT1}, k: 1}}]'",
    f"'methods=[{FLT1}, k: 500}}]'",
    f"'methods=[{FLT1}, k: labels}}]'",
    f"'methods=[{FLT1}, space: umap, umap: {{n_neighbors: 2, n_components: 50}}}}]'",
    f"'methods=[{FLT1}, space: umap, umap: {{metric: bogus}}}}]'",
    f"'methods=[{FLT1}, space: umap, umap: {{n_components: 2147483647}}}}]'",
    f"'methods=[{FLT1}, space: umap, k: 1}}]' partition.clients=2 partition.clusters=2",
    f"'methods=[{FLT1}, relatedness: paper}}]'",
    f"'methods=[{FLT1}, choose_clusters: silhouette, linkage: single}}]'",
    f"'methods=[{FLT1}, max_clusters: 1}}]'",
    f"'methods=[{FLT1}, recluster_every: 1}}]'",
    f"'methods=[{FLT1}, aggregation: case1, adjacency: soft}}]'",
    f"'methods=[{FLT1}}}]' partition.clients=2 partition.clusters=2",
    "'methods=[{name: ifca, clusters: 50}]'",
    "'methods=[{name: ifca, clusters: 99999999999999999999}]'",
    "'methods=[{name: ifca, warmup_rounds: 5}]'",
    "'methods=[{name: fedsem, centers: 50}]'",
    "'methods=[{name: fesem_soft, temperature: 1e-9}]'",
    "'methods=[{name: pacfl}]' partition.samples_per_client=3",
    "'methods=[{name: pacfl, threshold: 0}]'",
    "'methods=[{name: cfl, warmup_rounds: 0, min_cluster_size: 1}]'",
    "'methods=[{name: fedprox, mu: 1e9}]'",
    "'methods=[{name: fedgroup, groups: 30}]'",
    "'methods=[{name: pca_km_hc, components: 1000}]'",
    "'methods=[{name: local}]' partition.test_per_client=1",
    "'methods=[{name: oracle}]' partition.kind=dirichlet",
    "'methods=[{name: fedavg, pool: all}]' train.participation=1",
]


def run_case(case: str, out: Path, timeout: float) -> tuple[str, float, str]:
    """(verdict, seconds, last line) of one two-round run with these --set values."""
    sets = [arg for value in shlex.split(case) for arg in ("--set", value)]
    cmd = [sys.executable, "-m", "flt.emulator.cli", "run", str(QUICKSTART), "--set", "train.rounds=2", *sets]
    start = time.monotonic()
    try:
        res = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return "TIMEOUT", time.monotonic() - start, ""
    text = res.stdout + res.stderr
    lines = [line for line in text.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    errors = res.stderr.strip().splitlines()
    one_line_error = res.returncode in (2, 3) and bool(errors) and errors[-1].startswith("error:")
    ok = "Traceback" not in text and (res.returncode == 0 or one_line_error)
    return ("ok" if ok else f"BAD (exit {res.returncode})"), time.monotonic() - start, last


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="run only the cases whose text holds this")
    p.add_argument("--timeout", type=float, default=300, help="seconds a case may take")
    a = p.parse_args(argv)
    cases = [c for c in CASES if a.only in c]
    bad = 0
    with tempfile.TemporaryDirectory(prefix="flt-odd-") as tmp:
        for i, case in enumerate(cases, 1):
            verdict, took, last = run_case(case, Path(tmp) / str(i), a.timeout)
            bad += verdict != "ok"
            print(f"[{i:3d}/{len(cases)}] {verdict:14s} {took:5.0f} s  {case}\n      {last[:160]}", flush=True)
    print(f"{len(cases) - bad} of {len(cases)} cases ended cleanly")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
