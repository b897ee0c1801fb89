"""benchmarks/gpu_leaf_cifar.sh, the script a GPU session runs with little time to spare:
the runs it names start, are packed into $OUT without their models, and RESUME=1
continues the same folders instead of starting new ones. Run here on the CPU with a tiny
federation (ACCEL=cpu), so a broken script is found before a GPU's minutes are spent."""

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import need_shared

REPO = Path(__file__).resolve().parents[1]
TINY = (
    "--set model=cifar_cnn --set partition.clients=10 --set train.rounds=2 --set train.local_epochs=1 "
    "--set partition.samples_per_client=20 --set partition.test_per_client=10"
)


def run_script(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    data = need_shared("cifar10-jpg")
    base = {
        "JOBS": "s1:fedavg s2:local",
        "ACCEL": "cpu",
        "DATA": str(data),
        "LIMIT": "600",
        "SNAP": "2",
        "OUT": str(tmp_path / "out"),
        "RUNS": str(tmp_path / "runs"),
        "PYTHON": sys.executable,
        "EXTRA": TINY,
    }
    return subprocess.run(
        ["bash", "benchmarks/gpu_leaf_cifar.sh"],
        cwd=REPO,
        env={**os.environ, **base, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def packed(tmp_path: Path) -> dict[str, bytes]:
    with tarfile.open(tmp_path / "out" / "leaf_cifar_runs.tgz") as tar:
        return {m.name.removeprefix("./"): tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


@pytest.mark.slow
def test_the_gpu_script_runs_packs_and_resumes_the_runs_it_names(tmp_path):
    first = run_script(tmp_path)
    assert first.returncode == 0, first.stderr
    for name in ("s1_fedavg", "s2_local"):
        assert f"=== {name}: exit 0" in first.stdout
    files = packed(tmp_path)
    metrics = {name: files[f"{name}/{name[3:]}/metrics.jsonl"] for name in ("s1_fedavg", "s2_local")}
    assert all(len(m.decode().splitlines()) == 2 for m in metrics.values())
    assert "model: cifar_cnn" in files["s1_fedavg/config.yaml"].decode()  # EXTRA comes after the script's sets
    assert not [n for n in files if n.endswith((".npz", ".lock")) or "checkpoint" in n]  # no models, no lock

    again = run_script(tmp_path, RESUME="1")
    assert again.returncode == 0, again.stderr
    logs = (tmp_path / "runs" / "s1_fedavg.log").read_text()
    assert "finished before the interruption: kept" in logs  # resumed in place, not started anew
    assert sorted(p.name for p in (tmp_path / "runs").iterdir() if p.is_dir()) == ["s1_fedavg", "s2_local"]
    assert {n: packed(tmp_path)[f"{n}/{n[3:]}/metrics.jsonl"] for n in metrics} == metrics
