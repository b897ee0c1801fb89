"""The emulated population: availability-aware sampling, deadlines, over-commitment,
arrival and drift schedules, FLT's re-clustering trigger, and a newcomer process joining
a live run."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flt.common.schema import ConfigError
from flt.emulator.config import parse_methods
from flt.emulator.population import Population, Schedule, schedule_from
from flt.emulator.profiles import Profiles
from flt.server.exchange import Exchange
from flt.server.strategies.base import Context, Result
from flt.server.strategies.flt import FLT
from flt.server.transport import Ledger

REPO = Path(__file__).resolve().parents[1]


def profiles(m, ms=10.0, windows=None, mbps=8.0):
    return Profiles(
        ms_per_sample=np.full(m, ms),
        up_bps=np.full(m, mbps * 1e6 / 8),
        down_bps=np.full(m, mbps * 1e6 / 8),
        latency_s=np.zeros(m),
        windows=windows or [np.zeros((0, 2))] * m,
        period_s=None,
    )


def test_an_offline_device_is_never_selected():
    m = 10
    windows = [np.zeros((0, 2))] * m
    offline = [1, 4, 7]
    for c in offline:  # online only later in the run
        windows = [*windows[:c], np.array([[1000.0, 2000.0]]), *windows[c + 1 :]]
    pop = Population(m, rho=1.0, seed=0, profiles=profiles(m, windows=windows), sampling="available")
    for rnd in range(1, 20):
        chosen = pop.select(rnd, np.arange(m))
        assert not set(offline) & set(chosen.tolist())
        assert len(chosen) == m - len(offline)


def _answered(who) -> Exchange:
    """What FLT's embed returns when every client in `who` answered (no bytes, no clock)."""
    return Exchange({int(c): None for c in who}, [int(c) for c in who], {"bytes": {}})


def test_a_straggler_past_the_deadline_is_dropped():
    m = 4
    pop = Population(m, rho=1.0, seed=0, profiles=profiles(m, ms=10.0), deadline_s=20.0)
    pop.select(1, np.arange(m))
    # 3 x 10 x steps x 10 ms = 0.3 s per step; 1 MB at 8 Mbit/s = 1 s each way
    steps = np.array([10, 60, 61, 70])
    kept, clock = pop.price("train", np.arange(m), 1_000_000, 1_000_000, 0, 10 * steps)  # batch 10
    assert sorted(kept.tolist()) == [0, 1]  # 5 s, 20 s (exactly at the deadline counts)
    assert clock["stragglers"] == 2  # 20.3 s and 23 s
    assert clock["duration_s"] == pytest.approx(20.0) and clock["emulated_s"] == pytest.approx(20.0)


def test_a_deadline_no_client_meets_is_said_once(caplog):
    """Found by tests/shape_sweep.py: a 3 s deadline under a CNN's upload trained nobody in
    any round, and only '0/3 returned' on the progress lines said so."""
    m = 4
    pop = Population(m, rho=1.0, seed=0, profiles=profiles(m, ms=10.0), deadline_s=2.0)
    steps = np.array([60, 61, 70, 80])  # 18 s and more each, past the deadline
    with caplog.at_level("WARNING", logger="flt.emulator.population"):
        for rnd in (1, 2):
            pop.select(rnd, np.arange(m))
            kept, clock = pop.price("train", np.arange(m), 1_000_000, 1_000_000, 0, 10 * steps)
            assert kept.size == 0 and clock["stragglers"] == m
        pop.price("train", np.arange(m), 1_000_000, 1_000_000, 0, np.full(m, 1))  # 1.03 s each: kept
    (said,) = [r.getMessage() for r in caplog.records]  # once, though two rounds kept nobody
    assert "population.deadline_s: no client of a round finished within 2 emulated s" in said
    assert "the fastest needed 20.0 s" in said


def test_overcommitment_draws_more_and_keeps_the_fastest():
    m = 20
    pop = Population(m, rho=0.25, seed=3, profiles=profiles(m), overcommit=1.4)
    chosen = pop.select(1, np.arange(m))
    assert len(chosen) == 7 and pop.target == 5
    steps = 10 + np.arange(len(chosen))
    kept, clock = pop.price("train", chosen, 0, 0, 0, 10 * steps)
    assert sorted(kept.tolist()) == sorted(chosen[:5].tolist()) and clock["stragglers"] == 2


def test_same_draws_for_every_method_and_seed_dependence():
    a = Population(100, 0.2, seed=1).select(5, np.arange(100))
    b = Population(100, 0.2, seed=1).select(5, np.arange(100))
    c = Population(100, 0.2, seed=2).select(5, np.arange(100))
    assert (a == b).all() and not (a == c).all() and len(a) == 20


def test_schedule_withholds_a_cluster_and_swaps_without_duplicates():
    truth = np.repeat(np.arange(4), 5)
    cfg = {
        "population": {
            "newcomers": [{"round": 5, "cluster": 3}],
            "drift": [{"round": 8, "clients": [0, 1], "to_cluster": 2}],
        }
    }
    sched = schedule_from(cfg, truth)
    assert sched.arrivals[5].tolist() == [15, 16, 17, 18, 19]
    pairs = [(c["client"], c["partner"]) for c in sched.drift[8]]
    assert [a for a, _ in pairs] == [0, 1]
    assert all(truth[b] == 2 for _, b in pairs) and len({b for _, b in pairs}) == 2
    pop = Population(20, 1.0, 0, schedule=sched)
    assert set(pop.candidates(1).tolist()) == set(range(15))


def test_an_event_reached_without_its_callback_says_which():
    pop = Population(6, 1.0, 0, schedule=Schedule(arrivals={3: np.array([4, 5])}))
    assert pop.before_round(2) == []  # built without it is fine
    with pytest.raises(RuntimeError, match="newcomer event at round 3 but no `arrive` callback"):
        pop.before_round(3)


def test_recluster_fires_exactly_when_flags_pass_lambda(tmp_path, monkeypatch):
    m, p = 8, 6
    ctx = Context(
        init=torch.zeros(p),
        n_clients=m,
        n_train=np.ones(m, dtype=np.int64),
        device=torch.device("cpu"),
        seed=0,
        truth=np.full(m, -1),
        train={},
    )
    params = parse_methods([{"name": "flt", "recluster_flags": 2}])[0].params
    flt = FLT(ctx, **params)
    calls = []

    def embed(fed, who, rnd, purpose):  # every client answers: its outstanding flag is cleared
        calls.append(("embed", list(who)))
        for c in who:
            flt.flag_round.pop(int(c), None)
        return _answered(who)

    monkeypatch.setattr(flt, "embed", embed)
    monkeypatch.setattr(flt, "relate", lambda clients, tag="", fresh=None: calls.append(("relate", tag)) or {})
    fed = SimpleNamespace(present=np.arange(m), transport=SimpleNamespace(ledger=Ledger()))

    def round_with_flags(rnd, flagged):
        results = {c: Result(torch.zeros(p), 1, {"flag": int(c in flagged)}) for c in range(m)}
        flt.observe(rnd, results)
        flt.aggregate(rnd, results)
        return flt.maintain(rnd, fed)

    assert round_with_flags(1, {0}) == []
    assert round_with_flags(2, {1}) == []  # 2 flags: not more than lambda = 2
    events = round_with_flags(3, {2})  # the third flag passes lambda
    assert [e["cause"] for e in events] == ["flags"] and events[0]["clients"] == [0, 1, 2]
    assert calls == [("embed", [0, 1, 2]), ("relate", "-round3")]
    assert round_with_flags(4, set()) == [] and not flt.flag_round


@pytest.fixture(scope="module")
def dynamic_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dynamic")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "flt.emulator.cli",
            "run",
            "scenarios/dynamic_digits.yaml",
            "--out",
            str(out),
            "--set",
            "train.rounds=14",
            "--set",
            "population.drift=[{round: 11, clients: [0, 1, 2], to_cluster: 2}]",
            "--set",  # every dynamic setting at its default
            "methods=[{name: flt, encoder: {dataset: public, epochs: 100}}]",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr + res.stdout
    rows = [json.loads(x) for x in (out / "flt" / "metrics.jsonl").read_text().splitlines()]
    return out, rows, json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_newcomers_join_as_a_new_process_get_a_model_and_are_evaluated(dynamic_run):
    out, rows, summary = dynamic_run
    assert [r["n_eval"] for r in rows[:9]] == [20] * 9  # cluster 4 withheld
    assert all(r["n_eval"] == 25 for r in rows[9:])  # joined at round 10
    arrival = next(e for e in rows[9]["events"] if e["kind"] == "arrival")
    assert arrival["clients"] == [20, 21, 22, 23, 24] and arrival["newcomers"] == "auto"
    # cluster 4 was never seen: it opens a cluster of its own, nobody else moves
    assert len(arrival["opened"]) == 1 and arrival["moved"] == [] and arrival["ari"] == 1.0
    assert set(arrival["start_models"].values()) <= {"nearest", "global"}
    # the start-model choice's candidates and losses are in FLT's byte formula too
    flt = summary["methods"]["flt"]
    assert flt["bytes_vs_formula"] == pytest.approx(1.0, abs=1e-12), (flt["expected"], flt["formula_payload_bytes"])
    assert "acc_newcomers" not in rows[8] and "acc_newcomers" in rows[9]  # apart from the incumbents
    first = summary["methods"]["flt"]["changes"][0]
    assert first["measured_on"] == "incumbents" and "newcomers_accuracy" in first
    newcomers = [n for n in summary["timing"]["device_exit_codes"] if n.startswith("new-")]
    assert len(newcomers) == 1 and summary["timing"]["device_exit_codes"][newcomers[0]] == 0
    assert (out / "logs" / f"{newcomers[0]}.log").exists()
    trained = {c for r in rows[9:] for c in range(20, 25)} and rows[9]["returned"] > 0
    assert trained


@pytest.mark.slow
def test_drift_is_noticed_by_the_devices_and_its_clients_move(dynamic_run):
    out, rows, summary = dynamic_run
    drift = next(e for e in rows[10]["events"] if e["kind"] == "drift")
    assert sorted(drift["clients"])[:3] == [0, 1, 2]
    assert not [e for r in rows[:10] for e in r["events"] if e["kind"] == "recluster"]  # no false alarm
    # each moved client's device tested its new data at once and said so: all are re-placed
    # at the end of the drift's own round, none waits to be selected
    assert drift["noticed"] == sorted(drift["clients"])
    reclusters = [e for r in rows[10:] for e in r["events"] if e["kind"] == "recluster"]
    assert [e["round"] for e in reclusters] == [11] and reclusters[0]["cause"] == "flags"
    assert reclusters[0]["clients"] == drift["noticed"] and reclusters[0]["moved"] == drift["noticed"]
    assert reclusters[0]["ari"] == 1.0  # against the truth after the drift
    with np.load(out / "flt" / "clusters_timeline.npz") as z:
        assert z["rounds"][0] == 0 and len(z["rounds"]) == 2 + len(reclusters)  # initial, arrival, each re-placement
    assert (out / "flt" / "clusters_timeline.png").is_file()
    changes = summary["methods"]["flt"]["changes"]
    assert [c["kind"] for c in changes] == ["arrival", "drift"]
    assert summary["methods"]["flt"]["emulated_s"] > 0


def test_label_swap_drift_trades_two_labels_on_the_device_and_raises_the_flag():
    from flt.common.wire import Message
    from flt.devices.device import Device, Images, _shard

    dev = Device("tcp://127.0.0.1:9", name="t")  # connect is lazy: no server needed here
    y = torch.tensor([0, 1, 2, 1, 0])
    x = Images(np.arange(5, dtype=np.uint8).reshape(5, 1, 1, 1), torch.device("cpu"))
    dev.splits = ((x, y), (x, y))
    idx = np.arange(5, dtype=np.int64)
    dev.shards[7] = _shard((x, y), (x, y), idx, idx)
    dev.hosted.add(7)
    dev.on_drift(Message("drift", client=7, meta={"label_swap": [0, 1]}, tensors={"train": idx, "test": idx}))
    assert dev.shards[7].y.tolist() == [1, 0, 2, 0, 1] and dev.shards[7].y_test.tolist() == [1, 0, 2, 0, 1]
    assert 7 in dev.flags
    dev.on_drift(
        Message("drift", client=7, meta={"label_swap": [0, 1], "flag": False}, tensors={"train": idx, "test": idx})
    )
    assert dev.shards[7].y.tolist() == y.tolist() and 7 not in dev.flags
    dev.sock.close(linger=0)


def test_schedule_swap_labels():
    sched = schedule_from(
        {"population": {"drift": [{"round": 3, "clients": [4, 5], "kind": "swap_labels", "labels": [1, 2]}]}},
        np.zeros(10, dtype=int),
    )
    assert sched.drift[3] == [
        {"kind": "swap_labels", "client": 4, "labels": [1, 2]},
        {"kind": "swap_labels", "client": 5, "labels": [1, 2]},
    ]


def test_schedule_resample_swaps_inside_each_clients_own_cluster():
    truth = np.repeat(np.arange(3), 4)  # clusters 0..2 hold clients 0-3, 4-7, 8-11
    sched = schedule_from({"population": {"drift": [{"round": 3, "clients": [0, 4, 5], "kind": "resample"}]}}, truth)
    pairs = [(ch["client"], ch["partner"]) for ch in sched.drift[3]]
    assert pairs == [(0, 3), (4, 6), (5, 7)]  # each cluster's last free clients, never another mover
    assert all(ch["kind"] == "move" and truth[ch["client"]] == truth[ch["partner"]] for ch in sched.drift[3])
    with pytest.raises(ConfigError, match=r"drift\[0\]: clients \[2\] have no planted cluster"):
        schedule_from({"population": {"drift": [{"round": 3, "clients": [2], "kind": "resample"}]}}, np.full(6, -1))
    with pytest.raises(ConfigError, match=r"drift\[0\]: cluster 1 has 0 clients free"):
        schedule_from({"population": {"drift": [{"round": 3, "clients": [4, 5, 6, 7], "kind": "resample"}]}}, truth)


def test_server_side_monitor_flags_a_client_whose_update_turns_away(tmp_path):
    m, p = 6, 5
    ctx = Context(
        init=torch.zeros(p),
        n_clients=m,
        n_train=np.ones(m, dtype=np.int64),
        device=torch.device("cpu"),
        seed=0,
        truth=np.full(m, -1),
        train={},
    )
    flt = FLT(ctx, **parse_methods([{"name": "flt", "monitor_cosine": 0.0, "recluster_flags": 0}])[0].params)
    flt.labels = np.zeros(m, dtype=np.int64)
    v = torch.tensor([1.0, 2.0, 0.5, -1.0, 0.3])
    updates = {c: v + 0.05 * c for c in range(m)}
    updates[4] = -v  # its data changed: it pulls the other way
    flt.aggregate(1, {c: Result(u, 1, {"flag": 0}) for c, u in updates.items()})
    assert set(flt.flag_round) == {4} and flt.monitored == {4}
    fed = SimpleNamespace(present=np.arange(m), transport=SimpleNamespace(ledger=Ledger()))
    flt.embed = lambda fed, who, rnd, purpose: _answered(who)
    flt.relate = lambda clients, tag="", fresh=None: {}
    assert [e["cause"] for e in flt.maintain(1, fed)] == ["monitor"]


@pytest.mark.slow
def test_realtime_mode_makes_devices_wait_and_the_deadline_drops_them_for_real(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "flt.emulator.cli",
            "run",
            "scenarios/quickstart.yaml",
            "--out",
            str(tmp_path),
            "--set",
            "methods=[fedavg]",
            "--set",
            "train.rounds=4",
            "--set",
            "population.realtime=0.05",
            "--set",
            "population.deadline_s=10",
            "--set",
            "population.profiles={distribution: {compute: {dist: lognormal, median_ms_per_sample: 40, sigma: 1.0}}}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    rows = [json.loads(x) for x in (tmp_path / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["selected"] - r["returned"] for r in rows) > 0  # late replies never counted
    assert "did not answer within 0" in res.stderr  # the real 0.5 s deadline
    assert all(r["round_s"] <= 10.0 + 1e-9 for r in rows)
