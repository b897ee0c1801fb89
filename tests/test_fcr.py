"""FCR's server side on synthetic centroids with known structure: the set distances
against a double loop, and clusterings that must not depend on the data's scale."""

import dataclasses

import numpy as np
import pytest
from scipy.spatial.distance import cdist
from sklearn.metrics import adjusted_rand_score

from flt.common.schema import ConfigError
from flt.emulator.config import parse_methods
from flt.server import fcr


def slow_distance(points, kind):
    m = len(points)
    out = np.zeros((m, m))
    for i in range(m):
        for j in range(m):
            d = cdist(points[i], points[j])
            if kind == "min":
                out[i, j] = d.min()
            elif kind == "chamfer":
                out[i, j] = (d.min(1).mean() + d.min(0).mean()) / 2
            else:
                out[i, j] = max(d.min(1).max(), d.min(0).max())
    np.fill_diagonal(out, 0.0)
    return out


@pytest.mark.parametrize("kind", fcr.DISTANCES)
@pytest.mark.parametrize("chunk", [256, 5, 1])
def test_set_distances_equal_a_double_loop(kind, chunk):
    rng = np.random.default_rng(7)
    points = [rng.normal(size=(int(k), 3)) * 3 for k in rng.integers(1, 6, size=12)]
    assert len({len(p) for p in points}) > 1  # varying k: padding is exercised
    got = fcr.set_distance(points, kind, chunk=chunk)
    assert np.isfinite(got).all()  # padding never leaks out as inf
    np.testing.assert_allclose(got, got.T)
    np.testing.assert_allclose(got, slow_distance(points, kind), rtol=1e-10, atol=1e-10)


def planted(n_clients=60, n_clusters=5, k=5, dim=16, classes=2, shared=0, seed=0, spread=0.25):
    """Clients of cluster c hold 'classes' (class centres) c*step .. c*step+classes-1 of a
    ring of n_clusters*step classes; each sends k centroids near its classes' centres."""
    rng = np.random.default_rng(seed)
    step = classes - shared
    centres = rng.normal(size=(n_clusters * step, dim)) * 3
    truth = rng.permutation(np.arange(n_clients) % n_clusters)
    sets = []
    for c in truth:
        own = (c * step + np.arange(classes)) % len(centres)
        pick = own[np.arange(k) % classes]
        sets.append(centres[pick] + spread * rng.normal(size=(k, dim)))
    return sets, truth


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_the_default_pipeline_does_not_depend_on_the_data_scale(scale):
    sets, truth = planted()
    ref = fcr.relate(sets, fcr.PRESETS["set"])
    got = fcr.relate([s * scale for s in sets], fcr.PRESETS["set"])
    assert got.n_clusters == 5
    assert adjusted_rand_score(truth, got.labels) == 1.0
    np.testing.assert_array_equal(got.labels, ref.labels)
    assert got.silhouette == pytest.approx(ref.silhouette)
    assert got.separation == pytest.approx(ref.separation)


def test_a_fixed_gamma_is_scale_dependent_which_is_why_it_is_not_the_default():
    sets, truth = planted()
    paper = fcr.Relatedness(space="embedding", distance="min", linkage="ward_graph", choose="gap", gamma=3.0)
    right = fcr.relate(sets, paper)
    assert adjusted_rand_score(truth, right.labels) == 1.0
    shrunk = fcr.relate([s * 1e-3 for s in sets], paper)  # every pair is now within gamma
    assert shrunk.graph.all()
    assert adjusted_rand_score(truth, shrunk.labels) < 0.5


def test_rings_of_shared_classes_are_separated_by_whole_set_distance():
    # S2-like: each cluster shares one class with its neighbour, so the single closest
    # centroid pair links neighbouring clusters, while the whole sets still differ
    sets, truth = planted(n_clients=75, classes=3, shared=1, seed=3)
    got = fcr.relate(sets, fcr.PRESETS["set"])
    assert got.n_clusters == 5
    assert adjusted_rand_score(truth, got.labels) == 1.0


def test_clients_without_structure_form_one_cluster():
    # IID: every client holds every class; its centroids differ from another's by noise
    rng = np.random.default_rng(5)
    centres = rng.normal(size=(10, 16)) * 3
    sets = [centres + 0.25 * rng.normal(size=(10, 16)) for _ in range(40)]
    got = fcr.relate(sets, fcr.PRESETS["set"])
    assert got.n_clusters == 1
    assert got.graph.all()  # everyone related to everyone: Case I becomes FedAvg


def test_clients_that_hold_different_classes_are_grouped_by_them():
    """No planted groups, but clients hold random halves of the classes (label skew, as
    with a Dirichlet alpha of 0.1): they differ by whole classes, so FCR groups clients
    with similar halves instead of calling them one population."""
    rng = np.random.default_rng(5)
    centres = rng.normal(size=(10, 16)) * 3
    sets = [centres[rng.choice(10, 5, replace=False)] + 0.25 * rng.normal(size=(5, 16)) for _ in range(40)]
    got = fcr.relate(sets, fcr.PRESETS["set"])
    assert got.n_clusters > 1 and got.separation >= fcr.PRESETS["set"].min_separation
    same = got.labels[:, None] == got.labels[None, :]
    np.fill_diagonal(same, False)
    assert got.distance[same].mean() < got.distance[got.labels[:, None] != got.labels[None, :]].mean()


def test_noisy_clusters_are_found_though_their_silhouette_is_low():
    """Few samples per client make every centroid noisy: the planted groups are still
    whole classes apart, but their silhouette falls below any fixed floor (0.24 here, as
    with 87 MNIST images per client), so a floor would call them one cluster."""
    sets, truth = planted(n_clients=200, classes=3, shared=1, seed=3, spread=2.5)
    got = fcr.relate(sets, fcr.PRESETS["set"])
    assert got.n_clusters == 5
    assert adjusted_rand_score(truth, got.labels) == 1.0
    assert got.silhouette is not None and got.silhouette < 0.3
    assert got.separation is not None and got.separation >= fcr.PRESETS["set"].min_separation


def test_a_negligible_difference_is_no_cluster_however_clean():
    """IID clients that differ only in how one of their k centroids came out (k-means
    merged other classes): two tight groups, a high silhouette, but a difference far
    below the distance between classes. One cluster."""
    rng = np.random.default_rng(11)
    centres = rng.normal(size=(5, 16)) * 3
    shift = np.zeros((5, 16))
    shift[4, 0] = 0.5
    sets = [centres + (i % 2) * shift + 0.01 * rng.normal(size=(5, 16)) for i in range(40)]
    two = fcr.relate(sets, fcr.PRESETS["set"], n_clusters=2)
    assert two.silhouette is not None and two.silhouette > 0.5  # above any floor ever used
    got = fcr.relate(sets, fcr.PRESETS["set"])
    assert got.n_clusters == 1
    assert got.separation is not None and got.separation < 0.05
    assert got.graph.all()


def test_a_lone_client_joins_its_nearest_group_instead_of_training_alone():
    sets, truth = planted(n_clients=60, seed=4)
    outlier = sets[0] + 40.0  # far from every class: the dendrogram's last merge
    alone = fcr.relate([outlier, *sets[1:]], fcr.PRESETS["set"], n_clusters=6)
    assert np.bincount(alone.labels).min() == 1  # a cut that separates the groups leaves it alone
    got = fcr.relate([outlier, *sets[1:]], fcr.PRESETS["set"])
    assert np.bincount(got.labels).min() > 1  # no cluster of one: it joins a group
    assert got.n_clusters == 5
    assert adjusted_rand_score(truth[1:], got.labels[1:]) == 1.0


def test_folding_lone_clients_picks_the_cluster_nearest_on_average():
    adj = np.array(
        [
            [0.0, 1.0, 1.0, 5.0, 5.0],
            [1.0, 0.0, 1.0, 5.0, 5.0],
            [1.0, 1.0, 0.0, 5.0, 5.0],
            [5.0, 5.0, 5.0, 0.0, 6.0],
            [5.0, 5.0, 5.0, 6.0, 0.0],
        ]
    )
    # clients 3 and 4 are each alone; the only group is {0, 1, 2}
    np.testing.assert_array_equal(fcr.fold_singletons(np.array([0, 0, 0, 1, 2]), adj), [0, 0, 0, 0, 0])
    two = np.array([0, 0, 1, 1, 2])  # client 4 is nearer to {0, 1} (5) than to {2, 3} (5.5)
    np.testing.assert_array_equal(fcr.fold_singletons(two, adj), [0, 0, 1, 1, 0])


def test_a_given_number_of_clusters_is_respected():
    sets, truth = planted()
    got = fcr.relate(sets, fcr.PRESETS["set"], n_clusters=3)
    assert got.n_clusters == 3
    for block in range(5):  # a coarser cut keeps each planted cluster whole
        assert len(np.unique(got.labels[truth == block])) == 1
    assert got.labels[0] == 0  # canonical: labelled in order of first appearance


def test_the_clustering_graph_is_same_cluster_when_there_is_no_gamma():
    sets, truth = planted(n_clients=20)
    got = fcr.relate(sets, fcr.PRESETS["set"])
    np.testing.assert_array_equal(got.graph, (truth[:, None] == truth[None, :]).astype(np.float32))


def test_ward_on_the_graph_needs_gamma_and_the_scenario_says_so():
    with pytest.raises(ValueError, match="gamma"):
        fcr.relate(planted(n_clients=10)[0], fcr.Relatedness(linkage="ward_graph"))
    with pytest.raises(ConfigError, match=r"methods\[0\]\(flt\).*gamma"):
        parse_methods([{"name": "flt", "linkage": "ward_graph"}])
    spec = parse_methods([{"name": "flt", "relatedness": "paper"}])[0]
    assert spec.params["relatedness"] == "paper"
    with pytest.raises(ConfigError, match="distance"):
        parse_methods([{"name": "flt", "distance": "cosine"}])


def test_ward_linkage_on_a_with_a_given_number_of_clusters():
    # noisy sets: the clusters overlap more than in the default's cases, as on CIFAR-10
    sets, truth = planted(n_clients=50, spread=1.5, seed=2)
    how = dataclasses.replace(fcr.PRESETS["set"], linkage="ward")
    got = fcr.relate(sets, how, n_clusters=5)
    assert got.n_clusters == 5 and len(got.linkage) == 49
    assert adjusted_rand_score(truth, got.labels) > 0.9
