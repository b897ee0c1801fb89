"""Checkpoints and `flt run --resume`: a killed run continues to exactly the results of an
uninterrupted one."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import torch
from flt_command import (  # tests/ is on sys.path under pytest
    QUICKSTART,
    fedavg_running,
    flt_run,
    results_without_timing,
)
from flt_command import flt as flt_cli

from flt.emulator import config
from flt.emulator.clock import EmulatedClock
from flt.emulator.config import parse_methods
from flt.emulator.population import Population, Schedule
from flt.reports.summary import finished_methods, read_metrics, split_timing
from flt.scenarios.partition import Partition
from flt.server import checkpoint
from flt.server.checkpoint import CheckpointError
from flt.server.federation import CheckpointPacer
from flt.server.strategies import STRATEGIES
from flt.server.strategies.base import Context
from flt.server.transport import Ledger

REPO = Path(__file__).resolve().parents[1]


# -- the checkpoint format ---------------------------------------------------------------
def test_checkpoint_round_trips_values_tensors_and_generators(tmp_path):
    np_rng, torch_rng = np.random.default_rng(5), torch.Generator().manual_seed(5)
    np_rng.random(3), torch.rand(3, generator=torch_rng)  # mid-stream, not at the seed
    ledger = Ledger()
    ledger.add(3, 7, "up", "model", 100, 20)
    state = {
        "round": 4,
        "loss": float("nan"),
        "name": "x",
        "none": None,
        "flag": True,
        "ids": {3, 1, 2},
        "pairs": {(0, "up"): [1, 2]},
        "by_client": {5: np.arange(3)},
        "scalar": np.int64(7),
        "models": torch.randn(2, 3),
        "labels": np.array([1, 0, 1]),
        "np_rng": np_rng,
        "torch_rng": torch_rng,
        "path": Path("/a/b"),
        "ledger": ledger,
        "nested": [{"t": torch.ones(2, dtype=torch.int64)}, (1, 2.5)],
    }
    checkpoint.save(tmp_path / "c.npz", state)
    back = checkpoint.load(tmp_path / "c.npz")

    assert back["round"] == 4 and np.isnan(back["loss"]) and back["name"] == "x" and back["none"] is None
    assert back["ids"] == {1, 2, 3} and back["pairs"] == {(0, "up"): [1, 2]} and back["flag"] is True
    assert np.array_equal(back["by_client"][5], np.arange(3)) and back["scalar"].dtype == np.int64
    assert torch.equal(back["models"], state["models"]) and np.array_equal(back["labels"], state["labels"])
    assert back["np_rng"].random() == np_rng.random()  # the stream goes on where it was
    assert torch.equal(torch.rand(4, generator=back["torch_rng"]), torch.rand(4, generator=torch_rng))
    assert back["path"] == Path("/a/b") and back["nested"][1] == (1, 2.5)
    assert torch.equal(back["nested"][0]["t"], torch.ones(2, dtype=torch.int64))
    assert back["ledger"].totals() == ledger.totals()
    with np.load(tmp_path / "c.npz", allow_pickle=False) as z:  # nothing in it needs pickle
        assert all(z[k].dtype != object for k in z.files)


def test_checkpoint_refuses_a_foreign_object_by_its_path(tmp_path):
    with pytest.raises(CheckpointError, match=r"state\['strategy'\]\['reducer'\]: a builtins.object"):
        checkpoint.save(tmp_path / "c.npz", {"strategy": {"reducer": object()}})
    assert not (tmp_path / "c.npz").exists()


def test_a_checkpoint_naming_a_project_function_as_a_class_is_refused():
    node = {"$object": "flt.server.checkpoint:save", "attrs": {"$dict": []}}
    with pytest.raises(CheckpointError, match=r"'flt\.server\.checkpoint:save', which is not a class"):
        checkpoint.unpack(node, {}, torch.device("cpu"))


def test_restore_keeps_a_live_defaultdict_and_fills_nested_objects(tmp_path):
    live = Ledger()
    saved = Ledger()
    saved.add(1, 2, "down", "model", 10, 1)
    checkpoint.save(tmp_path / "c.npz", {"ledger": saved})
    checkpoint.restore_vars(live, vars(checkpoint.load(tmp_path / "c.npz")["ledger"]))
    assert isinstance(live.rows, defaultdict) and live.totals() == saved.totals()
    live.add(2, 2, "down", "model", 5, 1)  # the default factory still works after a restore
    assert live.totals()["down"]["model"]["payload"] == 15


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_state_survives_a_checkpoint(tmp_path, name):
    ctx = Context(
        init=torch.randn(20, generator=torch.Generator().manual_seed(0)),
        n_clients=6,
        n_train=np.full(6, 10),
        device=torch.device("cpu"),
        seed=0,
        truth=np.zeros(6, dtype=np.int64),
        train={"local_epochs": 1, "batch_size": 10, "lr": 0.01},
    )
    params = parse_methods([name])[0].params
    before = STRATEGIES[name](ctx, **params)
    for value in list(vars(before).values()):  # moved on from construction: random streams drawn
        if isinstance(value, np.random.Generator):
            value.random(5)
        elif isinstance(value, torch.Generator):
            torch.rand(5, generator=value)
    checkpoint.save(tmp_path / "s.npz", before.state_dict())
    after = STRATEGIES[name](ctx, **params)
    after.load_state_dict(checkpoint.load(tmp_path / "s.npz"))
    assert set(vars(after)) == set(vars(before))
    for attr, value in before.state_dict().items():
        _assert_same(getattr(after, attr), value, attr)


def _assert_same(a, b, where):
    if isinstance(b, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(b, np.ndarray):
        assert np.array_equal(a, b), where
    elif isinstance(b, np.random.Generator):
        assert a.bit_generator.state == b.bit_generator.state, where
    elif isinstance(b, torch.Generator):
        assert torch.equal(a.get_state(), b.get_state()), where
    elif isinstance(b, dict):
        assert set(a) == set(b), where
        for k in b:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(b, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    elif hasattr(b, "__dict__") and not isinstance(b, type):
        _assert_same(vars(a), vars(b), where)
    else:
        assert a == b, where


def test_population_replays_arrivals_and_drift_then_takes_its_state():
    calls = []
    sched = Schedule(arrivals={2: np.array([4, 5])}, drift={3: [{"kind": "move", "client": 0, "partner": 1}]})
    pop = Population(
        6,
        0.5,
        0,
        schedule=sched,
        arrive=lambda r, c: calls.append(("arrive", r, c.tolist())),
        drift=lambda r, ch: calls.append(("drift", r, ch)),
    )
    saved = {"present": np.ones(6, dtype=bool), "clock": EmulatedClock(42.5).state_dict(), "target": 3}
    pop.load_state_dict(saved, upto=3)
    assert calls == [("arrive", 2, [4, 5]), ("drift", 3, sched.drift[3])]
    assert pop.present.all() and pop.clock.now_s == 42.5 and pop.target == 3


def test_wall_clock_fields_move_to_timing_at_any_depth():
    record = {
        "round": 3,
        "emulated_s": 9.0,
        "train_s": 0.2,
        "events": [{"kind": "drift"}, {"kind": "recluster", "seconds": 1.5, "encoder_cached": True}],
        "fcr": {"server_seconds": 0.1, "ari": 1.0},
    }
    clean, timing = split_timing(record)
    assert clean == {
        "round": 3,
        "emulated_s": 9.0,
        "events": [{"kind": "drift"}, {"kind": "recluster"}],
        "fcr": {"ari": 1.0},
    }
    assert timing == {
        "train_s": 0.2,
        "events": [{}, {"seconds": 1.5, "encoder_cached": True}],
        "fcr": {"server_seconds": 0.1},
    }


# -- end to end: a real kill, a real resume ------------------------------------------------
DYNAMIC = """\
name: resume_test
seed: 0
data: {dataset: digits}
partition: {kind: clusters, clients: 15, clusters: 3, classes_per_cluster: 2, samples_per_client: 40,
            test_per_client: 16, public_fraction: 0.2}
model: mlp
train: {rounds: 6, participation: 0.4, local_epochs: 1, batch_size: 10, lr: 0.05}
devices: {processes: 1}
population:
  profiles: {distribution: {compute: {dist: lognormal, median_ms_per_sample: 20.0, sigma: 0.5}}}
  deadline_s: 12.0
  newcomers: [{round: 2, cluster: 2}]
  # clients 0 and 1 move; client 3 draws new data of its own distribution, which FLT's
  # change test on its device lets pass, after a resume too
  drift: [{round: 4, clients: [0, 1], to_cluster: 1}, {round: 4, clients: [3], kind: resample}]
methods:
  - {name: flt, encoder: {dataset: public, epochs: 5}, newcomers: nearest, recluster_flags: 1}
  - local
  - {name: ifca, clusters: 3}
"""


def kill_during(scenario: Path, out: Path, method: str, after_rounds: int, *sets: str) -> None:
    """Start a run and SIGKILL the server once `method` has recorded `after_rounds` rounds."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "flt.emulator.cli", "run", str(scenario), *sets, "--out", str(out)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics, deadline = out / method / "metrics.jsonl", time.monotonic() + 300
    while not metrics.exists() or len(metrics.read_text().splitlines()) < after_rounds:
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "the run never reached the round to kill it at"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resume")
    scenario = folder / "dynamic.yaml"
    scenario.write_text(DYNAMIC)
    whole = flt_cli("run", str(scenario), "--out", str(folder / "whole"))
    assert whole.returncode == 0, whole.stderr
    return scenario, results_without_timing(folder / "whole")


@pytest.mark.slow
@pytest.mark.parametrize("method, after_rounds", [("flt", 2), ("local", 4)])
def test_a_killed_run_resumes_to_exactly_the_uninterrupted_results(uninterrupted, tmp_path, method, after_rounds):
    """Killed mid-FLT after the arrival, or mid-Local after the drift (FLT finished, IFCA
    not begun): arrivals and drift replay, Local's device-held models and the change
    test's references come back, and every record and the summary equal those of an
    uninterrupted run on 1 process (the killed one used 3)."""
    scenario, want = uninterrupted
    killed = tmp_path / "killed"
    kill_during(scenario, killed, method, after_rounds, "--set", "devices.processes=3")
    partial = json.loads((killed / "summary.json").read_text())  # rewritten after every round
    assert partial["methods"][method]["rounds"] >= after_rounds - 1  # the kill may fall just before it
    assert len(list(killed.glob("*/metrics.jsonl"))) < 3

    res = flt_cli("run", "--resume", str(killed))
    assert res.returncode == 0, res.stderr
    assert "(resumed)" in res.stdout and ("finished before the interruption" in res.stdout) == (method == "local")
    got = results_without_timing(killed)
    assert set(got) == set(want)
    for name in want:
        assert got[name] == want[name], name
    # the wall clock goes on from the checkpoint's round, not from 0 at the resume
    walls = [r["timing"]["wall_s"] for r in read_metrics(killed, method)]
    assert walls == sorted(walls), walls


@pytest.mark.slow
def test_resume_needs_a_run_folder(tmp_path):
    res = flt_cli("run", "--resume", str(tmp_path))
    assert res.returncode == 2 and "config.yaml" in res.stderr and "Traceback" not in res.stderr


def test_checkpoints_are_paced_to_a_share_of_the_run():
    """A checkpoint that cost 2 s waits until 20 s have passed since it (share 0.1); cheap
    ones come every round; the last round is always checkpointed."""
    now = [0.0]
    pacer = CheckpointPacer(share=0.1, clock=lambda: now[0])

    def write(seconds):
        return lambda: now.__setitem__(0, now[0] + seconds)

    pacer.save(write(2.0))  # 0 -> 2 s
    now[0] = 15.0
    assert not pacer.due() and pacer.due(final=True)
    now[0] = 22.0
    assert pacer.due()
    pacer.save(write(0.001))
    now[0] += 0.02
    assert pacer.due()


# -- a damaged run folder is named, not a traceback ------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    res = flt_run(str(QUICKSTART), str(out), "methods=[fedavg]", "train.rounds=3")
    assert res.returncode == 0, res.stderr
    return out


def damaged_copy(run: Path, tmp_path: Path, name: str, text: str, append: bool = False) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    path = copy / name
    path.write_text((path.read_text() if append else "") + text)
    return copy


def test_a_torn_last_record_is_left_out_of_the_report(finished_run, tmp_path):
    """A run killed while it wrote a record leaves half a line; `flt report` failed on it
    with a JSONDecodeError traceback."""
    copy = damaged_copy(finished_run, tmp_path, "fedavg/metrics.jsonl", '{"method": "fedavg", "rou', append=True)
    assert [r["round"] for r in read_metrics(copy, "fedavg")] == [1, 2, 3]
    res = flt_cli("report", str(copy), "--out", str(tmp_path / "report"))
    assert res.returncode == 0, res.stderr
    lines = (finished_run / "fedavg" / "metrics.jsonl").read_text().splitlines()
    (copy / "fedavg" / "metrics.jsonl").write_text("\n".join([lines[0], "{garbage", lines[2]]) + "\n")
    res = flt_cli("report", str(copy), "--out", str(tmp_path / "report2"))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "fedavg/metrics.jsonl: line 2 is not valid JSON" in res.stderr


@pytest.mark.parametrize("name", ["partition.npz", "public_indices.npy", "summary.json"])
def test_resume_names_a_damaged_file_of_the_run_folder(finished_run, tmp_path, name):
    copy = damaged_copy(finished_run, tmp_path, name, "xx\n")
    res = flt_cli("run", "--resume", str(copy))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"{copy / name}: not " in res.stderr


@pytest.mark.parametrize("damage", ["checkpoint", "records", "folder deleted"])
def test_a_method_that_cannot_resume_says_what_to_delete_and_then_runs_again(finished_run, tmp_path, damage):
    """A checkpoint cut short or records cut short ended the resume with a BadZipFile or
    RuntimeError traceback. Now one line names the file and the folder to delete; deleting
    it (also after the method finished) runs that method again, to the same records."""
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    method = copy / "fedavg"
    if damage != "folder deleted":
        (copy / "summary.json").unlink()  # as if killed mid-method: it resumes from its checkpoint
        damaged = method / ("checkpoint.npz" if damage == "checkpoint" else "metrics.jsonl")
        damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 3])
        res = flt_cli("run", "--resume", str(copy))
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert f"error: {damaged}: " in res.stderr and f"delete the folder {method} " in res.stderr.replace(
            "delete its folder", "delete the folder"
        )
    shutil.rmtree(method)
    res = flt_cli("run", "--resume", str(copy))
    assert res.returncode == 0, res.stderr
    assert "== fedavg ==" in res.stdout and "finished before" not in res.stdout
    assert results_without_timing(copy)["fedavg"] == results_without_timing(finished_run)["fedavg"]


def _alter_checkpoint(path: Path, how: str) -> None:
    """Rewrite a valid checkpoint with one value changed, as a hand edit or a bad disk could."""
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    state = json.loads(arrays["__state__"].tobytes())
    for key, arr in list(arrays.items()):
        if how == "model of another size" and arr.dtype == np.float32 and arr.ndim == 1:
            arrays[key] = arr[:10]
        if how == "mask of another length" and arr.dtype == bool:
            arrays[key] = arr[:3]
    if how == "round as text":
        state["$dict"][0][1] = "x"
    arrays["__state__"] = np.frombuffer(json.dumps(state).encode(), dtype=np.uint8)
    np.savez(path, **arrays)


@pytest.mark.parametrize(
    "how, words",
    [
        ("model of another size", r"FedAvg\.global_model: expected float32 of shape \(\.\.\., 159010\), found"),
        ("mask of another length", r"population\.present: expected 20 clients, found 3"),
        ("round as text", r"round: expected a round number, found 'x'"),
    ],
)
def test_an_altered_checkpoint_is_named_not_trained_from(finished_run, tmp_path, how, words):
    """A model of another size resumed and every client failed its task, round after round,
    to exit 0; a round that is text was a TypeError traceback; a participation mask of
    another length resumed without a word."""
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    (copy / "summary.json").unlink()  # as if killed mid-method: it resumes from its checkpoint
    _alter_checkpoint(copy / "fedavg" / "checkpoint.npz", how)
    res = flt_cli("run", "--resume", str(copy))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {copy / 'fedavg' / 'checkpoint.npz'}: damaged checkpoint ("), last
    assert re.search(words, last), last


def test_a_saved_value_must_fit_the_attribute_it_replaces():
    models = torch.zeros(1, 8)
    assert checkpoint.unlike(models, torch.zeros(4, 8)) is None  # more cluster models: fine
    assert checkpoint.unlike(models, torch.zeros(4, 9)) == "expected float32 of shape (..., 8), found float32 (4, 9)"
    assert checkpoint.unlike(models, np.zeros((1, 8), np.float32)) == "expected a Tensor, found ndarray"
    assert checkpoint.unlike(3, 4.5) is None and checkpoint.unlike(3, "3") == "expected a number, found str"
    assert checkpoint.unlike(True, 1) == "expected a bool, found int"  # a flag stays a flag
    assert checkpoint.unlike(defaultdict(int), {}) is None
    assert checkpoint.unlike([], {}) == "expected a list, found dict"
    assert checkpoint.unlike(np.zeros((0, 0)), np.ones((20, 20))) is None  # PACFL's adjacency, filled in later
    assert checkpoint.unlike(None, "anything") is None  # set later in the run: nothing to compare with


def test_a_method_stopped_between_its_last_checkpoint_and_its_summary_is_kept_on_resume(finished_run, tmp_path):
    """Stopped after the last round's checkpoint and before the summary counted that round
    (found by tests/shape_sweep.py, seed 8: SIGTERM after IFCA's third of three rounds):
    the resume ran no round, so the method's summary entry was never written and the
    method was missing from summary.json and the table."""
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    summary = json.loads((copy / "summary.json").read_text())
    summary["methods"]["fedavg"]["rounds"] = 2  # as on disk then: the entry of round 2
    (copy / "summary.json").write_text(json.dumps(summary))
    res = flt_cli("run", "--resume", str(copy))
    assert res.returncode == 0, res.stderr
    assert "== fedavg == (resumed)" in res.stdout and "fedavg " in res.stdout.splitlines()[-1]
    assert results_without_timing(copy) == results_without_timing(finished_run)


def test_a_run_stopped_before_its_first_summary_keeps_its_partition_notes_on_resume(finished_run, tmp_path):
    """The partition's notes (a class short of test images, ...) were taken from the old
    summary.json on a resume; a run stopped before its first summary resumed without them
    (found by tests/shape_sweep.py, seed 12 shape 14: SIGKILL at 7.5 s). They come from the
    saved partition now."""
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    saved = Partition.load(copy / "partition.npz")
    saved.notes = ["test class 0: 6 clients need 90 test images (15 each), only 45 available"]
    saved.save(copy / "partition.npz")
    (copy / "summary.json").unlink()  # as if stopped in the first method's rounds
    res = flt_cli("run", "--resume", str(copy))
    assert res.returncode == 0, res.stderr
    summary = json.loads((copy / "summary.json").read_text())
    assert summary["partition_notes"] == saved.notes and list(summary)[:3] == ["scenario", "methods", "partition_notes"]
    assert results_without_timing(copy)["fedavg"] == results_without_timing(finished_run)["fedavg"]


def test_a_new_run_into_a_folder_holding_another_runs_results_is_refused(finished_run, tmp_path):
    """`flt run --out` into a finished run's folder wrote its config and summary over the
    old ones and mixed the old method folders with the new run's."""
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    before = {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file()}
    res = flt_run(str(QUICKSTART), str(copy), "methods=[local]", "train.rounds=1", "seed=5")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"--out: {copy} already holds a run's results" in res.stderr and "--resume" in res.stderr
    assert {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file()} == before  # nothing written
    assert not (copy / "local").exists()


def test_a_folder_a_live_run_writes_is_refused_to_a_second_run_and_to_resume(tmp_path):
    """A second `flt run --out` into the folder of a run still in its first method (no
    summary.json yet) wrote its config and partition over the live run's and appended to
    its metrics; a `--resume` of it ran the same method twice into one file."""
    out = tmp_path / "live"
    live = fedavg_running(out)
    try:
        before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "summary.json"}
        second = flt_run(str(QUICKSTART), str(out), "methods=[local]", "train.rounds=1", "seed=5")
        again = flt_cli("run", "--resume", str(out))
        for res, option in ((second, "--out"), (again, "--resume")):
            assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
            assert f"{option}: {out} is in use by another flt run (process {live.pid})" in res.stderr
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name in before} == before
        assert not (out / "local").exists()
        assert live.poll() is None  # the live run goes on
    finally:
        live.kill()
        live.wait()
    from flt.common.files import folder_lock

    with folder_lock(out, "--out"):  # a killed run leaves no lock behind
        assert (out / ".lock").read_text() == f"{os.getpid()}\n"


def test_a_file_system_without_locks_runs_unguarded_and_says_so(tmp_path, monkeypatch, caplog):
    import errno
    import fcntl

    from flt.common.files import folder_lock

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with folder_lock(tmp_path, "--out"):
        assert (tmp_path / ".lock").read_text() == f"{os.getpid()}\n"
    assert "--out: cannot lock" in caplog.text and "No locks available" in caplog.text


def test_a_lock_file_that_is_a_link_is_refused_not_written_through(tmp_path):
    from flt.common.errors import FltError
    from flt.common.files import folder_lock

    target = tmp_path / "elsewhere"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".lock").symlink_to(target)
    with pytest.raises(FltError, match="--out: cannot lock the folder"), folder_lock(tmp_path / "run", "--out"):
        pass
    assert not target.exists()


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch):
    from datetime import datetime

    from flt.emulator import run

    class Frozen(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 12, 1, 17, 0, 0)

    monkeypatch.setattr(run, "datetime", Frozen)
    monkeypatch.setattr(run.report, "command_line", lambda: "flt run x.yaml")
    cfg = config.load(QUICKSTART, [f"output={tmp_path}"])
    with ExitStack() as hold:
        folders = [run.make_run_dir(cfg, None, hold) for _ in range(3)]
    assert [f.name for f in folders] == [f"quickstart-20261201-170000{s}" for s in ("", "-2", "-3")]
    assert all((f / "config.yaml").is_file() for f in folders)


@pytest.mark.parametrize("text", ["[1, 2]", '{"methods": [1]}'])
def test_resume_names_a_summary_that_is_json_but_not_a_runs(tmp_path, text):
    """Valid JSON of the wrong shape was an AttributeError deep in resume."""
    (tmp_path / "summary.json").write_text(text)
    with pytest.raises(config.ConfigError, match=r"summary\.json: not a run's summary \(no 'methods' mapping\)"):
        finished_methods(tmp_path, config.load(QUICKSTART))


def test_resume_reruns_a_method_whose_summary_entry_is_not_a_mapping(tmp_path):
    (tmp_path / "summary.json").write_text('{"methods": {"fedavg": 3}}')
    assert finished_methods(tmp_path, config.load(QUICKSTART))["methods"] == {}
