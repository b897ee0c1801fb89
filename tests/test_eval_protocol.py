"""benchmarks/eval_cluster_classes.py re-tests a finished run's global model under the FLT
authors' protocol. Its figures mean something only if it rebuilds the very model the run
evaluated: checked here by recomputing the run's own reported accuracy from the
checkpoint, the partition and the test set."""

import sys
from pathlib import Path

import numpy as np
import pytest
from flt_command import QUICKSTART, flt

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmark scripts are not a package
import eval_cluster_classes as protocol  # noqa: E402


@pytest.fixture(scope="module")
def fedavg_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("evalproto") / "run"
    sets = ["methods=[fedavg]", "train.rounds=3", "partition.shared_classes=1", "partition.classes_per_cluster=3"]
    done = flt("run", str(QUICKSTART), "--out", str(out), *(a for s in sets for a in ("--set", s)))
    assert done.returncode == 0, done.stderr[-2000:]
    return out / "fedavg"


def test_recomputes_the_runs_own_accuracy(fedavg_run):
    got = protocol.evaluate(fedavg_run)
    assert got["ours_recomputed"] == pytest.approx(got["reported_final"], abs=1e-6)
    # rings of three with one shared class: every class in one or two clusters' tests
    weights = np.bincount(np.concatenate(got["layout"]), minlength=10)
    assert set(weights.tolist()) == {1, 2}
    expect = np.dot(weights, got["per_class"]) / weights.sum()
    assert got["authors_protocol"] == pytest.approx(expect)


def test_refuses_a_method_without_one_global_model(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(SystemExit, match="checkpoint"):
        protocol.evaluate(tmp_path / "m")
