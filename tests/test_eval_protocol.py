"""benchmarks/eval_cluster_classes.py re-tests a finished run's models under the FLT
authors' protocol. Its figures mean something only if it rebuilds the very models the run
evaluated: checked here by recomputing the run's own reported accuracy from the
checkpoint, the partition and the test set, for one global model (FedAvg) and for one
model per cluster (the oracle)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from flt_command import QUICKSTART, flt

from flt.models.flat import load_flat
from flt.models.nets import build_model
from flt.scenarios.datasets import load_dataset
from flt.scenarios.partition import Partition
from flt.server import checkpoint

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmark scripts are not a package
import eval_cluster_classes as protocol  # noqa: E402
import steps_vs_ceiling as steps  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("evalproto") / "run"
    sets = [
        "methods=[fedavg, oracle, local]",
        "train.rounds=3",
        "partition.shared_classes=1",
        "partition.classes_per_cluster=3",
    ]
    done = flt("run", str(QUICKSTART), "--out", str(out), *(a for s in sets for a in ("--set", s)))
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_recomputes_the_global_models_accuracy(run):
    got = protocol.evaluate(run / "fedavg")
    assert got["models"] == 1
    assert got["ours_recomputed"] == pytest.approx(got["reported_final"], abs=1e-6)
    # rings of three with one shared class: every class in one or two clusters' tests
    weights = np.bincount(np.concatenate(got["layout"]), minlength=10)
    assert set(weights.tolist()) == {1, 2}
    expect = np.dot(weights, got["per_class"]) / weights.sum()
    assert got["authors_protocol"] == pytest.approx(expect)


def test_recomputes_cluster_models_accuracy(run):
    """The oracle's five models, each client through its own: "ours" matches the run, and
    the authors' figure matches each planted cluster's model tested, by a separate path
    (the checkpoint's rows read directly), on every test image of its cluster's classes."""
    got = protocol.evaluate(run / "oracle")
    assert got["models"] == 5
    assert got["ours_recomputed"] == pytest.approx(got["reported_final"], abs=1e-6)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    state = checkpoint.load(run / "oracle" / "checkpoint.npz")["strategy"]
    test = load_dataset(cfg["data"]["dataset"], cfg["data"]["root"], train=False)
    model = build_model(cfg["model"], test.x.shape[1:], test.num_classes, cfg["train"]["inputs"])
    clusters = np.unique(Partition.load(run / "partition.npz").cluster)
    per_cluster = []
    for k, classes in zip(clusters, got["layout"], strict=True):
        load_flat(model, state["models"][int(np.searchsorted(state["groups"], k))].float())
        model.eval()
        with torch.no_grad():
            pred = model(torch.from_numpy(test.x).float() / 255).argmax(1).numpy()
        per_cluster.append([np.mean(pred[test.y == c] == c) * 100 for c in classes])
    np.testing.assert_allclose(got["per_cluster_classes"], per_cluster)
    assert got["authors_protocol"] == pytest.approx(np.mean(per_cluster))


def test_refuses_models_kept_on_the_devices(run):
    with pytest.raises(SystemExit, match="devices"):
        protocol.evaluate(run / "local")


def test_refuses_a_folder_without_a_checkpoint(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(SystemExit, match=r"checkpoint\.npz"):
        protocol.evaluate(tmp_path / "m")


def test_refuses_a_partition_without_planted_clusters(run, tmp_path):
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["partition"]["kind"] = "dirichlet"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "fedavg").mkdir()
    (tmp_path / "fedavg" / "checkpoint.npz").write_bytes((run / "fedavg" / "checkpoint.npz").read_bytes())
    with pytest.raises(SystemExit, match="dirichlet"):
        protocol.evaluate(tmp_path / "fedavg")


def test_sets_each_round_beside_the_ceiling_after_as_many_steps(run):
    """benchmarks/steps_vs_ceiling.py: round t of a run is t * E * ceil(n / B) SGD steps,
    read on the ceiling's curve in its passes of ceil(N / B) steps."""
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    part = Partition.load(run / "partition.npz")
    e, b = cfg["train"]["local_epochs"], cfg["train"]["batch_size"]
    per_round = e * math.ceil(np.median([len(a) for a in part.train]) / b)
    one = per_round / 10  # the passes of one round, with a pass of 10 steps
    ceiling = {
        "cluster_images": [10 * b - 3, 10 * b - 3],
        "curve": [{"epoch": one, "ours": 40.0}, {"epoch": 3 * one, "ours": 60.0}],
    }
    got = steps.matched(ceiling, run / "oracle")
    assert got["steps_per_round"] == per_round
    reported = [
        r["acc_mean"]
        for r in map(json.loads, (run / "oracle" / "metrics.jsonl").read_text().splitlines())
        if r.get("acc_mean") is not None
    ]
    assert [r["run"] for r in got["rows"]] == reported
    by_round = {r["round"]: r for r in got["rows"]}
    assert by_round[2]["passes"] == pytest.approx(2 * one)
    assert by_round[1]["ceiling"] == pytest.approx(40.0) and by_round[2]["ceiling"] == pytest.approx(50.0)
    assert by_round[3]["ceiling"] == pytest.approx(60.0)
    ceiling["curve"].pop()  # the ceiling stops at round 1's passes: nothing is read beyond it
    assert steps.matched(ceiling, run / "oracle")["rows"][-1]["ceiling"] is None


def test_steps_command_writes_its_tables_and_a_plot(run, tmp_path):
    ceiling = {"cluster_images": [100], "curve": [{"epoch": 0.5, "ours": 40.0}, {"epoch": 50.0, "ours": 90.0}]}
    (tmp_path / "c.json").write_text(json.dumps(ceiling))
    out = tmp_path / "steps.json"
    script = REPO / "benchmarks" / "steps_vs_ceiling.py"
    args = [sys.executable, str(script), str(tmp_path / "c.json"), str(run / "oracle"), "--out", str(out)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "steps a round" in done.stdout
    assert [r["round"] for r in json.loads(out.read_text())["runs"][0]["rows"]] == [1, 2, 3]
    assert out.with_suffix(".png").stat().st_size > 0
    missing = subprocess.run([*args[:3], str(run / "nothing")], capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "metrics.jsonl: missing" in missing.stderr
