"""The device's change test (devices/watch.py): calibrated on data that did not move,
sure on data that did, silent while the store does not change."""

import numpy as np
import pytest

from flt.devices import watch as w


@pytest.mark.slow
def test_the_neighbour_test_raises_few_false_alarms_on_fresh_draws_of_one_distribution():
    rng = np.random.default_rng(0)
    cov = rng.normal(size=(16, 16))
    ps = [w.knn_pvalue(rng.normal(size=(64, 16)) @ cov, rng.normal(size=(64, 16)) @ cov, s) for s in range(100)]
    alarms = sum(p < w.ALPHA for p in ps)
    assert alarms <= 4, alarms  # alpha = 0.01: 1 expected in 100 (P(X > 4) < 0.4 %)
    assert 0.3 < np.mean(ps) < 0.7  # roughly uniform under the null


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_the_neighbour_test_sees_a_moved_distribution_at_any_scale(scale):
    rng = np.random.default_rng(1)
    a = rng.normal(size=(64, 16)) * scale
    b = (rng.normal(size=(64, 16)) + np.eye(16)[0] * 1.0) * scale  # one unit along one axis
    assert w.knn_pvalue(a, b, 0) < w.ALPHA


class Counting:
    """An embedder (a fixed linear map) that counts its calls."""

    def __init__(self):
        self.calls = 0
        self.basis = np.random.default_rng(2).normal(size=(4 * 4, 8))

    def __call__(self, x):
        self.calls += 1
        return x.reshape(len(x), -1) @ self.basis


def images(shift: float, n: int = 100, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).random((n, 1, 4, 4)) + shift).astype(np.float32)


def test_watch_tests_only_after_a_change_and_flags_only_a_move():
    watch, emb = w.Watch(), Counting()
    watch.embedder = emb
    x = images(0.0)
    watch.remember(3, lambda: x, seed=5, testable=True)
    assert not watch.pending(3) and emb.calls == 0  # nothing changed: nothing to test, no cost
    watch.changed(3)
    assert watch.pending(3) and not watch.moved(3, images(0.0, seed=1))  # new draw, same distribution
    assert not watch.pending(3) and emb.calls == 2  # old and new sample, once per store
    watch.changed(3)
    assert watch.moved(3, images(0.5, seed=2))
    assert [c for c, _ in watch.tests] == [3, 3]


def test_without_a_kept_encoder_any_change_counts_as_a_move():
    watch = w.Watch()
    watch.remember(1, lambda: images(0.0), seed=0, testable=False)
    watch.changed(1)
    assert watch.moved(1, images(0.0))
    assert not watch.watched(2) and not watch.pending(2)  # never embedded: not the watch's
    watch.forgotten(4)  # a resumed device: it embedded before, its reference is gone
    watch.changed(4)
    assert watch.pending(4) and watch.moved(4, images(0.0))


def test_the_sample_is_fixed_per_seed_and_bounded():
    a, b = w.sample_index(600, 9), w.sample_index(600, 9)
    np.testing.assert_array_equal(a, b)
    assert len(a) == w.SAMPLE and len(set(a.tolist())) == w.SAMPLE
    np.testing.assert_array_equal(w.sample_index(10, 9), np.arange(10))


def test_a_reference_given_back_after_a_restart_tests_as_the_original_would():
    """What a checkpoint keeps (the embedded sample) and a resumed device gets back: its
    tests give the same p-values as the device that embedded, for a draw of the same
    distribution and for a move."""
    first, emb = w.Watch(), Counting()
    first.embedder = emb
    x = images(0.0)
    first.remember(3, lambda: x, seed=5, testable=True)
    kept = first.reference_sample(3)
    assert kept is not None and kept.shape == (len(x), 8)
    resumed = w.Watch()
    resumed.embedder = Counting()
    resumed.restored(3, kept, seed=5)
    for shift, seed in ((0.0, 1), (0.5, 2)):
        first.changed(3), resumed.changed(3)
        new = images(shift, seed=seed)
        assert first.moved(3, new) == resumed.moved(3, new) == (shift > 0)
    assert first.tests == resumed.tests  # the same p-values
    assert w.Watch().reference_sample(3) is None  # never embedded: nothing to keep
