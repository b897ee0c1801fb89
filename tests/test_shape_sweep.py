"""tests/shape_sweep.py (a probe, not a test): its shapes are seeded, valid and varied, and its verdict sees
what a finished run's summary gets wrong."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import shape_sweep  # tests/ is on sys.path under pytest
import yaml

from flt.emulator import config

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"


def test_shapes_are_seeded_valid_scenarios_that_cover_every_kind_and_method(tmp_path):
    shapes = [shape_sweep.shape(i, 0, SHARED) for i in range(300)]
    assert shapes[7] == shape_sweep.shape(7, 0, SHARED) and shapes[7] != shape_sweep.shape(7, 1, SHARED)
    labels = set()
    for i, s in enumerate(shapes):  # every shape passes validation: a refusal would test nothing
        path = tmp_path / f"s{i}.yaml"
        path.write_text(yaml.safe_dump(s))
        cfg = config.load(path, [])
        labels |= {m["label"] for m in cfg["methods"]}
    kinds = {s["partition"]["kind"] for s in shapes}
    assert {"clusters", "dirichlet", "iid", "structured"} <= kinds
    names = {m if isinstance(m, str) else m["name"] for s in shapes for m in s["methods"]}
    assert set(shape_sweep.CLUSTERING) | {"fedavg", "fedprox", "local", "oracle"} == names
    assert {"flt_labels", "flt_paper", "flt_tuned", "pacfl_c", "fedsem_all"} <= labels
    assert any("newcomers" in s["population"] for s in shapes) and any("drift" in s["population"] for s in shapes)
    assert any("crash" in s["devices"] for s in shapes)


def test_the_verdict_flags_an_inconsistent_summary(tmp_path):
    good = {"method": "fedsem", "final_accuracy": 50.0, "bytes_vs_formula": 1.0, "found_clusters": [0, 1]}
    bad = {
        "method": "fedsem",
        "final_accuracy": float("nan"),
        "bytes_vs_formula": 1.17,
        "clusters": 0,
        "found_clusters": [],
    }
    (tmp_path / "summary.json").write_text(json.dumps({"methods": {"a": good, "b": bad}}))
    problems = shape_sweep.summary_problems(tmp_path)
    assert problems == ["b: final accuracy nan", "b: bytes 1.170000 x its formula", "b: 0 clusters in the table"]
    assert shape_sweep.summary_problems(tmp_path / "nowhere") == ["no summary.json"]


def test_the_sweep_shows_each_distinct_warning_of_a_runs_log(tmp_path):
    (tmp_path / "run.log").write_text(
        "2026-12-07 01:00:00,000 INFO flt.run: started: flt run s.yaml\n"
        "2026-12-07 01:00:01,000 WARNING flt.emulator.population: a round trained nobody\n"
        "2026-12-07 01:00:02,000 ERROR flt.server: device dev-1 lost\n"
        "2026-12-07 01:00:03,000 WARNING flt.emulator.population: a round trained nobody\n"
        "2026-12-07 01:00:04,000 INFO flt.run: finished\n"
    )
    assert shape_sweep.warnings(tmp_path) == [
        "WARNING flt.emulator.population: a round trained nobody",
        "ERROR flt.server: device dev-1 lost",
    ]
    assert shape_sweep.warnings(tmp_path / "nowhere") == []


def test_the_sweep_names_methods_that_no_update_ever_reached(tmp_path):
    for label, returned in {"fedavg": [0, 0, 0], "flt": [0, 2, 0], "ifca": []}.items():
        (tmp_path / label).mkdir()
        lines = [json.dumps({"method": label, "round": i + 1, "returned": n}) for i, n in enumerate(returned)]
        (tmp_path / label / "metrics.jsonl").write_text("".join(f"{line}\n" for line in lines))
    assert shape_sweep.untrained(tmp_path) == ["fedavg"]  # flt trained once; ifca recorded no round yet


@pytest.mark.slow
def test_a_resume_that_ends_elsewhere_than_the_uninterrupted_run_is_a_finding(tmp_path):
    """The probe's --kill-resume on the quickstart: stopped and resumed, the run ends
    where the uninterrupted one did, so only the record tampered with here is flagged."""
    scen = yaml.safe_load((REPO / "scenarios" / "quickstart.yaml").read_text())
    scen["methods"], scen["train"]["rounds"] = ["fedavg", "local"], 3
    scenario = tmp_path / "shape.yaml"
    scenario.write_text(yaml.safe_dump(scen))
    whole = tmp_path / "whole"
    assert shape_sweep.run_one(scenario, whole, 600)["problems"] == []
    records = (whole / "local" / "metrics.jsonl").read_text().splitlines()
    first = json.loads(records[0])
    first["acc_mean"] += 1.0
    (whole / "local" / "metrics.jsonl").write_text("\n".join([json.dumps(first), *records[1:]]) + "\n")

    row = shape_sweep.kill_and_resume(scenario, whole, tmp_path / "again", random.Random(0), 600)
    assert row["resume"] == "SIGKILL after 2 of local's rounds"  # Random(0)'s draw: killed mid-run
    assert row["resume_problems"] == ["resumed local differs from the uninterrupted run's"], row
