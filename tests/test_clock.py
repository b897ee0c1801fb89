"""Emulated time: FedScale's task-time arithmetic, round closing, the clock."""

import numpy as np
import pytest

from flt.emulator.clock import (
    EmulatedClock,
    close_round,
    compute_seconds,
    overcommit_count,
    task_seconds,
    task_times,
    transfer_seconds,
)
from flt.emulator.profiles import Profiles

MB = 1_000_000


def profiles(ms, up_mbit, down_mbit, latency_ms, windows=None, period_s=None):
    n = len(ms)
    return Profiles(
        ms_per_sample=np.asarray(ms, float),
        up_bps=np.asarray(up_mbit, float) * 1e6 / 8,
        down_bps=np.asarray(down_mbit, float) * 1e6 / 8,
        latency_s=np.asarray(latency_ms, float) / 1000,
        windows=windows if windows is not None else [np.zeros((0, 2))] * n,
        period_s=period_s,
    )


# --------------------------------------------------------------------------- arithmetic


def test_compute_seconds_fedscale_formula():
    # 3 * 10 samples * 60 steps * 10 ms = 18 s
    assert compute_seconds(10.0, 10, 60) == pytest.approx(18.0)
    np.testing.assert_allclose(compute_seconds(np.array([10.0, 20.0]), 10, np.array([60, 30])), [18.0, 18.0])
    assert compute_seconds(10.0, 10, 60, factor=1.0) == pytest.approx(6.0)


def test_transfer_seconds():
    # 1 MB at 1 Mbit/s = 8 s, plus 50 ms latency
    assert transfer_seconds(MB, 1e6 / 8, 0.05) == pytest.approx(8.05)
    assert transfer_seconds(MB, 1e6 / 8) == pytest.approx(8.0)
    assert transfer_seconds(0, 1e6 / 8, 0.05) == 0.0  # no message, no latency
    with pytest.raises(ValueError):
        transfer_seconds(MB, 0.0)


def test_task_seconds_hand_checked():
    p = profiles(ms=[10.0, 20.0], up_mbit=[1, 2], down_mbit=[8, 16], latency_ms=[50, 0])
    t = task_seconds(p, [0, 1], batch_size=10, steps=60, bytes_down=MB, bytes_up=MB)
    # client 0: down 1 MB @ 8 Mbit/s = 1 s + .05; compute 18 s; up 1 MB @ 1 Mbit/s = 8 s + .05
    # client 1: down 0.5 s; compute 36 s; up 4 s
    np.testing.assert_allclose(t, [27.1, 40.5])
    b = task_times(p, [1, 0], batch_size=10, steps=60, bytes_down=MB, bytes_up=MB)
    np.testing.assert_allclose(b.down_s, [0.5, 1.05])
    np.testing.assert_allclose(b.compute_s, [36.0, 18.0])
    np.testing.assert_allclose(b.up_s, [4.0, 8.05])
    # per-client steps and bytes
    t2 = task_seconds(p, [0, 1], batch_size=10, steps=np.array([60, 30]), bytes_down=np.array([MB, 0]), bytes_up=0)
    np.testing.assert_allclose(t2, [19.05, 18.0])


def test_task_seconds_scales_measured_compute():
    p = profiles(ms=[10.0, 40.0], up_mbit=[8, 8], down_mbit=[8, 8], latency_ms=[0, 0])
    t = task_times(
        p,
        [0, 1],
        batch_size=10,
        steps=60,
        bytes_down=0,
        bytes_up=0,
        measured_compute_s=2.0,
        reference_ms_per_sample=20.0,
    )
    np.testing.assert_allclose(t.compute_s, [1.0, 4.0])
    with pytest.raises(ValueError, match="reference_ms_per_sample"):
        task_seconds(p, [0], batch_size=10, steps=1, bytes_down=0, bytes_up=0, measured_compute_s=1.0)


# --------------------------------------------------------------------------- rounds


def test_no_deadline_waits_for_slowest():
    out = close_round([4, 5, 6], [10.0, 30.0, 20.0], start_s=100.0)
    assert out.kept.tolist() == [4, 6, 5]  # finishing order
    assert out.stragglers.size == 0 and out.dropouts.size == 0
    assert out.duration_s == 30.0


def test_deadline_drops_exactly_the_stragglers():
    ids = np.array([10, 11, 12, 13, 14])
    dur = np.array([5.0, 25.0, 20.0, 20.0001, 60.0])
    out = close_round(ids, dur, start_s=0.0, deadline_s=20.0)
    assert sorted(out.kept.tolist()) == [10, 12]  # finishing exactly at the deadline counts
    assert out.stragglers.tolist() == [13, 11, 14]
    assert out.duration_s == 20.0  # the server waited for the stragglers until the deadline
    # everyone in time: the round ends with the slowest, before the deadline
    out = close_round(ids[:1], dur[:1], start_s=0.0, deadline_s=20.0)
    assert out.duration_s == 5.0


def test_overcommitment_keeps_k_fastest():
    rng = np.random.default_rng(0)
    ids = np.arange(100, 113)
    dur = rng.uniform(10, 100, ids.size)
    out = close_round(ids, dur, start_s=50.0, keep=10)
    fastest = ids[np.argsort(dur)[:10]]
    assert out.kept.tolist() == fastest.tolist()
    assert sorted(out.stragglers.tolist()) == sorted(set(ids.tolist()) - set(fastest.tolist()))
    assert out.duration_s == pytest.approx(np.sort(dur)[9])
    # ties broken by input order
    out = close_round([1, 2, 3], [5.0, 5.0, 5.0], start_s=0.0, keep=2)
    assert out.kept.tolist() == [1, 2] and out.stragglers.tolist() == [3]


def test_overcommitment_with_deadline_short_of_k():
    out = close_round([1, 2, 3, 4], [5.0, 8.0, 50.0, 70.0], start_s=0.0, deadline_s=30.0, keep=3)
    assert out.kept.tolist() == [1, 2]
    assert out.stragglers.tolist() == [3, 4]
    assert out.duration_s == 30.0


def test_window_ending_mid_task_is_a_dropout():
    # client 1's window closes at t=120 but its task ends at 100 + 30 = 130
    p = profiles(
        ms=[10, 10, 10],
        up_mbit=[8] * 3,
        down_mbit=[8] * 3,
        latency_ms=[0] * 3,
        windows=[np.zeros((0, 2)), np.array([[0.0, 120.0]]), np.array([[90.0, 200.0]])],
    )
    clients = np.array([0, 1, 2])
    start = 100.0
    assert p.online(clients, start).all()
    dur = np.array([40.0, 30.0, 20.0])
    out = close_round(clients, dur, start_s=start, online_until=p.online_until(clients, start))
    assert out.dropouts.tolist() == [1]
    assert out.kept.tolist() == [2, 0]
    assert out.duration_s == 40.0  # dropouts do not extend the round
    # a client offline at the round start drops out too
    out = close_round(clients, dur, start_s=250.0, online_until=p.online_until(clients, 250.0))
    assert out.dropouts.tolist() == [1, 2] and out.kept.tolist() == [0]


def test_nobody_kept():
    out = close_round([1, 2], [50.0, 60.0], start_s=0.0, deadline_s=10.0)
    assert out.kept.size == 0 and out.duration_s == 10.0
    out = close_round([1, 2], [50.0, 60.0], start_s=0.0, deadline_s=10.0, online_until=[1.0, 2.0])
    assert out.dropouts.tolist() == [1, 2] and out.duration_s == 10.0
    out = close_round([1, 2], [50.0, 60.0], start_s=0.0, online_until=[1.0, 2.0])
    assert out.duration_s == 2.0  # until the last client was lost
    out = close_round([], [], start_s=5.0)
    assert out.kept.size == 0 and out.duration_s == 0.0


def test_close_round_validation():
    with pytest.raises(ValueError):
        close_round([1, 2], [1.0], start_s=0.0)
    with pytest.raises(ValueError):
        close_round([1], [-1.0], start_s=0.0)
    with pytest.raises(ValueError):
        close_round([1], [1.0], start_s=0.0, keep=0)


# --------------------------------------------------------------------------- clock


def test_emulated_clock():
    c = EmulatedClock()
    assert c.now_s == 0.0
    assert c.advance(27.1) == pytest.approx(27.1)
    assert c.advance(close_round([0], [12.9], start_s=c.now_s).duration_s) == pytest.approx(40.0)
    with pytest.raises(ValueError):
        c.advance(-1)


def test_overcommit_count():
    assert overcommit_count(10, 1.3) == 13  # not 14 from float noise
    assert overcommit_count(10, 1.25) == 13
    assert overcommit_count(20, 1.0) == 20
    assert overcommit_count(0, 1.3) == 0
    with pytest.raises(ValueError):
        overcommit_count(10, 0.9)
