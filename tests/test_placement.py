"""Dynamic FCR's server side on synthetic centroids: a group of newcomers unlike every
cluster opens its own, a newcomer like a cluster joins it, a client whose data moved
follows it, nothing moves when nothing changed, and ids survive a re-clustering."""

import numpy as np
import pytest

from flt.server import fcr, placement
from flt.server.strategies.params import PRESETS

HOW = PRESETS["set"]
E, K = 16, 4  # embedding size, centroids per client


def client(group: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """K centroids near group's centre (groups sit on orthogonal axes, 10 apart)."""
    return ((np.eye(E)[group] * 10 + rng.normal(0, 1.0, (K, E))) * scale).astype(np.float32)


def place(groups: list[int], old: np.ndarray, fresh: np.ndarray, scale: float = 1.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    points = [client(g, rng, scale) for g in groups]
    found = fcr.relate(points, HOW)
    next_id = int(old.max()) + 1
    return placement.settle(found.distance, old, fresh, found.labels, HOW.silhouette_slack, next_id)


# 3 clusters of 6 incumbents, ids 0..2 in first-appearance order
INCUMBENTS = [0] * 6 + [1] * 6 + [2] * 6
OLD = np.repeat([0, 1, 2], 6)


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e4])
def test_a_group_of_newcomers_unlike_every_cluster_opens_its_own(scale):
    labels, how = place(INCUMBENTS + [3] * 4, np.append(OLD, [-1] * 4), np.arange(22) >= 18, scale)
    np.testing.assert_array_equal(labels[:18], OLD)  # incumbents keep their clusters (and models)
    assert set(labels[18:]) == {3} and how == "kept"  # a new id, above every old one


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e4])
def test_newcomers_like_a_cluster_join_it(scale):
    labels, _ = place([*INCUMBENTS, 1, 1, 2], np.append(OLD, [-1] * 3), np.arange(21) >= 18, scale)
    np.testing.assert_array_equal(labels, np.append(OLD, [1, 1, 2]))


def test_a_lone_newcomer_unlike_everyone_joins_the_nearest_cluster_rather_than_train_alone():
    labels, _ = place([*INCUMBENTS, 3], np.append(OLD, -1), np.arange(19) >= 18)
    assert labels[18] in (0, 1, 2) and (labels[:18] == OLD).all()


def test_clients_whose_data_moved_follow_it_and_nobody_else_moves():
    groups = list(INCUMBENTS)
    groups[0] = groups[1] = 2  # two clients of cluster 0 now hold cluster 2's kind of data
    fresh = np.zeros(18, bool)
    fresh[[0, 1]] = True
    labels, _ = place(groups, OLD, fresh)
    want = OLD.copy()
    want[[0, 1]] = 2
    np.testing.assert_array_equal(labels, want)


def test_a_client_that_re_embedded_unchanged_stays_and_a_static_population_keeps_everything():
    fresh = np.zeros(18, bool)
    fresh[[3, 9]] = True
    labels, how = place(INCUMBENTS, OLD, fresh)
    np.testing.assert_array_equal(labels, OLD)
    labels, how = place(INCUMBENTS, OLD, np.zeros(18, bool))
    np.testing.assert_array_equal(labels, OLD)
    assert how == "kept"


def test_when_the_old_clusters_no_longer_fit_the_re_run_wins_and_keeps_the_ids_it_can():
    # FCR once lumped groups 0 and 1 together (id 0) and group 2 apart (id 5); everyone
    # re-embeds: the re-run splits the lump, its larger part keeps id 0, the other is new
    groups = [0] * 8 + [1] * 4 + [2] * 6
    old = np.array([0] * 12 + [5] * 6)
    labels, how = place(groups, old, np.ones(18, bool))
    assert how == "kept"  # with no incumbent left, kept is the re-run (matched)
    np.testing.assert_array_equal(labels, [0] * 8 + [6] * 4 + [5] * 6)
    fresh = np.zeros(18, bool)  # no client re-embedded: the lump stays unless the
    labels, how = place(groups, old, fresh)  # silhouette says the re-run is clearly better
    assert how == "rerun" and len(set(labels[:12])) == 2 and set(labels[12:]) == {5}


def test_match_labels_renumbers_by_the_largest_overlap():
    old = np.array([0, 0, 0, 1, 1, 1, 2, 2, -1])
    new = np.array([4, 4, 4, 0, 0, 7, 3, 3, 3])  # the re-run's ids are arbitrary
    np.testing.assert_array_equal(placement.match_labels(old, new, next_id=3), [0, 0, 0, 1, 1, 3, 2, 2, 2])


def test_mean_distance_to_clusters_ignores_clusters_without_members():
    adj = np.array([[0, 1, 4], [1, 0, 3], [4, 3, 0]], float)
    labels = np.array([0, 2, 2])
    d = placement.mean_distance_to_clusters(adj, labels, np.array([0, 1]))
    assert d.shape == (3, 3) and np.isinf(d[:, 1]).all()
    np.testing.assert_allclose(d[2, [0, 2]], [4, 3])
