"""benchmarks/ceiling_clusters.py: the centralised ceiling of a planted-cluster scenario.
Its figure is an upper reference only if each cluster's model sees exactly its cluster's
data (every distinct image its clients hold, nothing from another cluster) and is scored
the way the runs are."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flt_command import QUICKSTART

from flt.emulator import config
from flt.emulator.run import build_partition, hold_out_public, load_data
from flt.scenarios.partition import cluster_classes

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmark scripts are not a package
import ceiling_clusters as ceiling  # noqa: E402

SHARED = ["partition.shared_classes=1", "partition.classes_per_cluster=3", "partition.on_short=share"]


def test_pools_each_clusters_distinct_images_and_nothing_else():
    cfg = config.load(str(QUICKSTART), SHARED)
    train, test = load_data(cfg)
    part = build_partition(cfg, train, test, hold_out_public(cfg, len(train.y)))
    xs, ys = ceiling.cluster_data(train, part, np.unique(part.cluster))
    p = cfg["partition"]
    layout = cluster_classes(p["clusters"], p["classes_per_cluster"], 10, p["shared_classes"])
    assert len(xs) == len(layout)
    for k, (x, y) in enumerate(zip(xs, ys, strict=True)):
        held = np.unique(np.concatenate([part.train[c] for c in np.flatnonzero(part.cluster == k)]))
        assert len(x) == len(y) == len(held)  # each image once, however many clients hold it
        assert np.array_equal(x.numpy(), train.x[held])
        assert set(y.tolist()) == set(layout[k])


def ceiling_run(out: Path, *more: str, over: list[str] = SHARED) -> subprocess.CompletedProcess:
    sets = [a for s in over for a in ("--set", s)]
    args = [str(QUICKSTART), *sets, "--out", str(out), *more]
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "ceiling_clusters.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_prints_and_writes_a_curve_that_learns(tmp_path):
    out = tmp_path / "ceiling.json"
    done = ceiling_run(out, "--epochs", "3", "--eval-every", "1")
    got = json.loads(out.read_text())
    assert [r["epoch"] for r in got["curve"]] == [1, 2, 3]
    assert got["final"] == got["curve"][-1]
    # three classes a cluster: far above the 10-class chance of the untrained model
    assert got["final"]["authors_protocol"] > 80
    assert "epoch    3" in done.stdout
    assert out.with_suffix(".png").stat().st_size > 0
    assert got["config"]["partition"]["on_short"] == "share"  # the resolved scenario, --set included


def test_scores_only_the_clusters_it_trains(tmp_path):
    every, one = tmp_path / "every.json", tmp_path / "one.json"
    ceiling_run(every, "--epochs", "1")
    ceiling_run(one, "--epochs", "1", "--clusters", "2")
    every_got, one_got = json.loads(every.read_text()), json.loads(one.read_text())
    assert one_got["cluster_images"] == [every_got["cluster_images"][2]]
    assert one_got["layout"] == [every_got["layout"][2]]
    # the same seeds and data: cluster 2's model is the one trained beside the others
    assert one_got["final"]["per_cluster"] == pytest.approx([every_got["final"]["per_cluster"][2]])


def test_names_a_cluster_the_scenario_does_not_plant(tmp_path):
    sets = [a for s in SHARED for a in ("--set", s)]
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "ceiling_clusters.py"), str(QUICKSTART), *sets, "--clusters", "7"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "no planted cluster [7]" in done.stderr


def test_cuts_a_span_of_passes_at_each_whole_pass():
    assert ceiling.slices(0.0, 0.5) == [(0, 0.0, 0.5)]
    assert ceiling.slices(0.5, 1.0) == [(0, 0.5, 1.0), (1, 0.0, 0.5)]
    assert ceiling.slices(1.0, 2.0) == [(1, 0.0, 1.0), (2, 0.0, 1.0)]


class RecordingTrainer:
    """Stands in for CohortTrainer: returns the models unchanged, keeps what it was given."""

    def __init__(self):
        self.seen: list[list[int]] = []

    def train(self, models, xs, ys, tc, gens):
        assert tc.epochs == 1
        self.seen.append(xs[0].tolist())
        return models, None


def test_half_passes_train_every_image_once_a_pass_in_a_new_order():
    xs, ys = [torch.arange(10)], [torch.zeros(10, dtype=torch.long)]
    gens = [torch.Generator().manual_seed(0)]
    t = {"batch_size": 2, "lr": 0.1, "momentum": 0.0, "vectorize": "auto"}
    rec, models, orders = RecordingTrainer(), torch.zeros(1, 3), []
    for done in (0.0, 0.5, 1.0, 1.5):
        models, orders = ceiling.train_slices(rec, models, xs, ys, t, gens, done, 0.5, orders)
    assert [len(s) for s in rec.seen] == [5, 5, 5, 5]
    first, second = rec.seen[0] + rec.seen[1], rec.seen[2] + rec.seen[3]
    assert sorted(first) == sorted(second) == list(range(10))  # each pass covers the data once
    assert first != second  # and draws its own order


def test_evaluates_at_fractions_of_a_pass(tmp_path):
    out = tmp_path / "half.json"
    done = ceiling_run(out, "--epochs", "1", "--eval-every", "0.5", "--clusters", "0")
    got = json.loads(out.read_text())
    assert [r["epoch"] for r in got["curve"]] == [0.5, 1.0]
    assert "epoch  0.5" in done.stdout
    assert got["final"]["authors_protocol"] > 50  # two classes' worth of learning after one pass


STRUCTURED = ["partition.kind=structured", "partition.clusters=2", "partition.classes_per_cluster=5"]


def test_structured_partitions_are_scored_per_cluster_by_our_protocol_alone(tmp_path):
    """The structured sampler (S4) plants clusters without the ring layout the authors'
    protocol needs: the ceiling scores each cluster's clients on their own test shards."""
    out = tmp_path / "structured.json"
    done = ceiling_run(out, "--epochs", "2", "--eval-every", "1", over=STRUCTURED)
    got = json.loads(out.read_text())
    final = got["final"]
    assert final["authors_protocol"] is None and "authors'" not in done.stdout
    assert len(final["ours_per_cluster"]) == len(got["clusters"]) == 2
    # five classes a cluster: the models learn well above the untrained 10-class chance
    assert min(final["ours_per_cluster"]) > 60
    # clusters of similar size: the mean over clients lies between the clusters' means
    assert min(final["ours_per_cluster"]) <= final["ours"] <= max(final["ours_per_cluster"])
