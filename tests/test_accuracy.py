"""The accuracy figures: clients with no test sample, and recovery measured on the same
clients before and after a change."""

import math

import pytest

from flt.reports.summary import rounds_to_recover
from flt.server.federation import accuracy_stats


def test_a_client_with_no_test_sample_is_left_out_not_scored_zero():
    metrics = {0: {"correct": 9, "total": 10}, 1: {"correct": 8, "total": 10}, 2: {"correct": 0, "total": 0}}
    s = accuracy_stats(metrics)
    assert s["acc_mean"] == pytest.approx(85.0)
    assert s["n_eval"] == 2 and s["clients_without_test"] == 1
    assert s["acc_min"] == pytest.approx(80.0)
    nobody = accuracy_stats({2: {"correct": 0, "total": 0}})
    assert math.isnan(nobody["acc_mean"]) and nobody["clients_without_test"] == 1


def test_newcomers_are_reported_apart_from_the_incumbents():
    metrics = {c: {"correct": 10 if c < 4 else 2, "total": 10} for c in range(6)}
    s = accuracy_stats(metrics, newcomers=[4, 5])
    assert s["acc_incumbents"] == pytest.approx(100.0)
    assert s["acc_newcomers"] == pytest.approx(20.0)
    assert s["acc_mean"] == pytest.approx((4 * 100 + 2 * 20) / 6)
    assert "acc_incumbents" not in accuracy_stats(metrics)


def _round(r, mean, incumbents=None, mb=0):
    rec = {"round": r, "acc_mean": mean, "bytes": {"up": {"model": mb}, "down": {}}}
    if incumbents is not None:
        rec |= {"acc_incumbents": incumbents, "acc_newcomers": 10.0}
    return rec


def test_recovery_after_an_arrival_compares_the_same_clients():
    # the newcomers (at 10 %) drag the mean down, but the incumbents never dropped
    history = [_round(1, 90.0), _round(2, 90.0), _round(3, 70.0, 90.0), _round(4, 71.0, 90.0)]
    like = rounds_to_recover(history, 3, key="acc_incumbents")
    assert like["before"] == 90.0 and like["lowest"] == 90.0 and like["rounds_to_recover"] == 0
    assert like["measured_on"] == "incumbents" and like["newcomers_accuracy"] == 10.0
    mixed = rounds_to_recover(history, 3)
    assert mixed["lowest"] == 70.0 and mixed["rounds_to_recover"] is None


def test_a_level_that_never_leaves_the_band_recovers_at_once_and_a_dip_counts_from_its_bottom():
    wobble = [_round(1, 90.0), _round(2, 89.8), _round(3, 89.5), _round(4, 89.9)]
    r = rounds_to_recover(wobble, 2)
    assert r["lowest"] == 89.5 and r["rounds_to_recover"] == 0  # within 1 point throughout
    dip = [_round(1, 90.0), _round(2, 60.0), _round(3, 88.5), _round(4, 89.5)]
    assert rounds_to_recover(dip, 2)["rounds_to_recover"] == 2  # back in the band at round 4
