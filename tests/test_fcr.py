"""FCR's server side on synthetic centroids with known structure: the set distances
against a double loop, and clusterings that must not depend on the data's scale."""

import dataclasses

import numpy as np
import pytest
import torch
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.optimize import linear_sum_assignment
from scipy.spatial.distance import cdist, squareform
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
            elif kind == "matched":  # Hungarian on a rectangular cost: the smaller set all matched
                sq = d**2
                rows, cols = linear_sum_assignment(sq)
                out[i, j] = np.sqrt(sq[rows, cols].mean())
            elif kind == "energy":
                own_i, own_j = cdist(points[i], points[i]).mean(), cdist(points[j], points[j]).mean()
                out[i, j] = 2 * d.mean() - own_i - own_j
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
    # energy is a difference of means: torch.cdist's rounding (about 1e-7 here) does not cancel
    tol = 1e-6 if kind == "energy" else 1e-10
    np.testing.assert_allclose(got, slow_distance(points, kind), rtol=tol, atol=tol)


def test_matched_distance_scans_matchings_in_blocks_and_refuses_too_many_centroids():
    rng = np.random.default_rng(3)
    points = [rng.normal(size=(int(k), 4)) for k in rng.integers(3, 7, size=9)]
    u, mask = fcr.pad(points)
    d = torch.cdist(u.reshape(-1, 4), u.reshape(-1, 4)).view(9, 6, 9, 6)
    matchings = fcr.one_to_one(6, torch.device("cpu"))
    whole = fcr.matched_distance(d, mask, mask, matchings)
    blocks = fcr.matched_distance(d, mask, mask, matchings, budget=1)  # one matching at a time
    torch.testing.assert_close(whole, blocks)
    # a relabelling of a client's own centroids is no distance: the matching undoes it
    assert fcr.set_distance([points[0], points[0][::-1].copy()], "matched")[0, 1] == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match=r"matched.*at most 8"):
        fcr.set_distance([rng.normal(size=(9, 2)), rng.normal(size=(9, 2))], "matched")


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
    assert default_relate(sets).n_clusters == 1  # whitened, as FLT runs it


def test_clients_that_hold_different_classes_are_grouped_by_them():
    """No planted groups, but clients hold random halves of the classes (label skew, as
    with a Dirichlet alpha of 0.1): they differ by whole classes, so FCR groups clients
    with similar halves instead of calling them one population."""
    rng = np.random.default_rng(5)
    centres = rng.normal(size=(10, 16)) * 3
    sets = [centres[rng.choice(10, 5, replace=False)] + 0.25 * rng.normal(size=(5, 16)) for _ in range(40)]
    got = fcr.relate(sets, fcr.PRESETS["chamfer"])
    assert got.n_clusters > 1 and got.separation >= fcr.PRESETS["chamfer"].min_separation
    same = got.labels[:, None] == got.labels[None, :]
    np.fill_diagonal(same, False)
    assert got.distance[same].mean() < got.distance[got.labels[:, None] != got.labels[None, :]].mean()


def test_noisy_clusters_are_found_though_their_silhouette_is_low():
    """Few samples per client make every centroid noisy: the planted groups are still
    whole classes apart, but their silhouette falls below any fixed floor (0.24 here, as
    with 87 MNIST images per client), so a floor would call them one cluster."""
    sets, truth = planted(n_clients=200, classes=3, shared=1, seed=3, spread=2.5)
    got = fcr.relate(sets, fcr.PRESETS["chamfer"])
    assert got.n_clusters == 5
    assert adjusted_rand_score(truth, got.labels) == 1.0
    assert got.silhouette is not None and got.silhouette < 0.3
    assert got.separation is not None and got.separation >= fcr.PRESETS["chamfer"].min_separation


def test_a_negligible_difference_is_no_cluster_however_clean():
    """IID clients that differ only in how one of their k centroids came out (k-means
    merged other classes): two tight groups, a high silhouette, but a difference far
    below the distance between classes. One cluster."""
    rng = np.random.default_rng(11)
    centres = rng.normal(size=(5, 16)) * 3
    shift = np.zeros((5, 16))
    shift[4, 0] = 0.5
    sets = [centres + (i % 2) * shift + 0.01 * rng.normal(size=(5, 16)) for i in range(40)]
    two = fcr.relate(sets, fcr.PRESETS["chamfer"], n_clusters=2)
    assert two.silhouette is not None and two.silhouette > 0.5  # above any floor ever used
    got = fcr.relate(sets, fcr.PRESETS["chamfer"])
    assert got.n_clusters == 1
    assert got.separation is not None and got.separation < 0.05
    assert got.graph.all()


def test_more_clusters_than_clients_says_so_and_gives_one_a_client(caplog):
    sets, _ = planted(n_clients=8, n_clusters=2)
    with caplog.at_level("WARNING", logger="flt.server"):
        got = fcr.relate(sets, fcr.PRESETS["chamfer"], n_clusters=50)
    assert got.n_clusters == 8 and sorted(got.labels) == list(range(8))
    assert "50 clusters asked for 8 clients" in caplog.text


def test_a_lone_client_joins_its_nearest_group_instead_of_training_alone():
    sets, truth = planted(n_clients=60, seed=4)
    outlier = sets[0] + 40.0  # far from every class: the dendrogram's last merge
    alone = fcr.relate([outlier, *sets[1:]], fcr.PRESETS["chamfer"], n_clusters=6)
    assert np.bincount(alone.labels).min() == 1  # a cut that separates the groups leaves it alone
    got = fcr.relate([outlier, *sets[1:]], fcr.PRESETS["chamfer"])
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


def test_the_authors_matched_cut_links_by_threshold_and_needs_a_small_fixed_k():
    sets, truth = planted(n_clients=20)
    dist = fcr.set_distance(sets, "matched")
    same = truth[:, None] == truth[None, :]
    gamma = float(np.quantile(dist[same & ~np.eye(20, dtype=bool)], 0.9))
    got = fcr.relate(sets, fcr.Relatedness(space="embedding", distance="matched", gamma=gamma))
    np.testing.assert_array_equal(got.graph, fcr.hard_threshold(dist, gamma))
    assert got.graph[same].mean() > 0.9 and got.graph[~same].mean() < 0.1  # planted clusters are far apart
    for method in ("flt", "pca_km_hc"):
        for k in ("auto", "labels", 9):
            with pytest.raises(ConfigError, match=rf"methods\[0\]\({method}\).*matched.*at most 8"):
                parse_methods([{"name": method, "distance": "matched", "k": k}])
    spec = parse_methods([{"name": "pca_km_hc", "basis": "client", "distance": "matched", "gamma": 1.095, "k": 5}])[0]
    assert spec.params["distance"] == "matched"


def test_ward_linkage_on_a_with_a_given_number_of_clusters():
    # noisy sets: the clusters overlap more than in the default's cases, as on CIFAR-10
    sets, truth = planted(n_clients=50, spread=1.5, seed=2)
    how = dataclasses.replace(fcr.PRESETS["set"], linkage="ward")
    got = fcr.relate(sets, how, n_clusters=5)
    assert got.n_clusters == 5 and len(got.linkage) == 49
    assert adjusted_rand_score(truth, got.labels) > 0.9


# -- the default: energy distance between share-weighted sets, whitened, Ward, finest real cut --
def nested(n_per_group=12, supers=3, subs=2, k=5, dim=16, seed=0, sub_gap=1.0, super_gap=8.0, spread=0.1):
    """supers x subs planted groups, nested: groups of one super-group share a region of
    the space (CIFAR-10's vehicles and animals), each group holds its own two classes."""
    rng = np.random.default_rng(seed)
    sets, truth = [], []
    for a in range(supers):
        region = rng.normal(size=dim) * super_gap
        for b in range(subs):
            classes = region + rng.normal(size=(2, dim)) * sub_gap
            for _ in range(n_per_group):
                pick = classes[np.arange(k) % 2]
                sets.append(pick + spread * rng.normal(size=(k, dim)))
                truth.append(a * subs + b)
    return sets, np.array(truth)


def default_relate(sets, weights=None, **kw):
    """FCR's default as FLT runs it: whiten, then relate."""
    return fcr.relate(fcr.whiten(sets, weights), fcr.PRESETS["set"], weights=weights, **kw)


def test_nested_groups_are_cut_at_the_finest_real_level():
    """Three well-separated regions, each holding two groups: the coarse cut has the
    higher silhouette (the old default merged groups), but each of the six groups is
    real, and the default finds all six."""
    sets, truth = nested()
    coarse = fcr.relate(sets, fcr.PRESETS["chamfer"])
    assert coarse.n_clusters < 6  # the silhouette prefers coarser groups
    got = default_relate(sets)
    assert got.n_clusters == 6
    assert adjusted_rand_score(truth, got.labels) == 1.0


def test_shares_shrink_a_k_means_artefact_to_what_it_is():
    """Two clients of one distribution (two classes, half and half): k-means gives one
    three centroids on class 0 and two on class 1, the other the reverse. Without shares
    they look like a 60/40 and a 40/60 mixture; with them, the energy distance left is
    the quantisation's, a fraction of it."""
    from sklearn.cluster import KMeans

    rng = np.random.default_rng(3)
    blobs = [c + rng.normal(size=(400, 16)) for c in rng.normal(size=(2, 16)) * 3]

    def summary(k0, k1):
        fits = [KMeans(k, n_init=3, random_state=0).fit(b) for k, b in ((k0, blobs[0]), (k1, blobs[1]))]
        points = np.concatenate([f.cluster_centers_ for f in fits])
        return points, np.concatenate([np.bincount(f.labels_) / 800 for f in fits])

    (a, wa), (b, wb) = summary(3, 2), summary(2, 3)
    plain = fcr.set_distance([a, b], "energy")[0, 1]
    weighted = fcr.set_distance([a, b], "energy", weights=[wa, wb])[0, 1]
    assert weighted < plain / 4


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_the_new_default_finds_planted_groups_at_any_scale(scale):
    sets, truth = planted(n_clients=80, classes=3, shared=1, seed=2, spread=1.0)
    got = default_relate([s * scale for s in sets])
    assert got.n_clusters == 5
    assert adjusted_rand_score(truth, got.labels) == 1.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_point_per_client_is_centred_not_whitened(seed):
    """k = 1: each client sends its mean embedding. Their pooled covariance is the spread
    between the clients, and whitening by it made all clients about equidistant (one
    cluster for five, here and on the quickstart)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(5, 64)) * 2
    truth = np.repeat(np.arange(5), 4)
    points = [centres[g][None] + rng.normal(size=(1, 64)) for g in truth]
    pooled = np.concatenate(points)
    np.testing.assert_allclose(np.concatenate(fcr.whiten(points)), pooled - pooled.mean(0), atol=1e-5)
    got = default_relate(points)
    assert got.n_clusters == 5 and adjusted_rand_score(truth, got.labels) == 1.0


def groups_with_one_odd_client(seed: int, offset: float) -> tuple[list[np.ndarray], np.ndarray]:
    """5 groups of 8 clients (3 centroids each, noise sd 0.5), and client 0's data shifted
    by `offset` noise-free sd (corrupted images, or a device that lies)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(5, 3, 16)) * 3
    truth = np.repeat(np.arange(5), 8)
    points = [centres[g] + 0.5 * rng.normal(size=(3, 16)) for g in truth]
    points[0] = points[0] + offset * rng.normal(size=(1, 16))
    return points, truth


@pytest.mark.parametrize("seed", [0, 2, 4])
@pytest.mark.parametrize("offset", [5.0, 20.0, 100.0, 1e6])
def test_one_odd_client_does_not_merge_every_group(seed, offset):
    """One client far off made C = 1 for all 40: moderately off, it inflated the largest
    within-cluster variance every split is scored against (now left out past Tukey's outer
    fence); farther, Ward split it off alone, at the top or inside the cut that holds the
    groups, and every such cut held it as a cluster of one, which the split rule never
    keeps (now set aside when it is alone at the top or its nearest neighbour is past the
    outer fence, the rest related, and it joins the nearest cluster)."""
    points, truth = groups_with_one_odd_client(seed, offset)
    got = default_relate(points)
    assert got.n_clusters == 5 and adjusted_rand_score(truth[1:], got.labels[1:]) == 1.0
    assert 0 <= got.labels[0] < 5


def test_a_threshold_graph_survives_setting_an_odd_client_aside():
    """With gamma, Case I trains on A~ = [A <= gamma]; relating the rest again after an odd
    client was set aside must not swap that graph for the clusters' (it once did)."""
    points, truth = groups_with_one_odd_client(0, 1e6)
    how = dataclasses.replace(fcr.PRESETS["set"], space="embedding", distance="matched", gamma=5.0)
    lone = fcr._relate(points, how, "auto", 20, None, None, None, None)
    assert lone.n_clusters == 1  # the odd client alone: the rest are related again
    got = fcr.relate(points, how)
    assert got.n_clusters == 5 and adjusted_rand_score(truth[1:], got.labels[1:]) == 1.0
    graph = fcr.hard_threshold(got.distance, 5.0)  # the groups linked, the odd client alone
    assert not np.array_equal(graph, fcr.cluster_graph(got.labels))
    np.testing.assert_array_equal(got.graph, graph)


def test_an_odd_client_alone_on_top_of_a_group_without_structure_leaves_one_cluster():
    points, _ = groups_with_one_odd_client(0, 0.0)
    rng = np.random.default_rng(1)
    iid = [points[1] + 0.5 * rng.normal(size=(3, 16)) for _ in range(20)]
    iid[0] = iid[0] + 100.0
    got = default_relate(iid)
    assert fcr.peeled(got.linkage, 20).tolist() == [0] and got.n_clusters == 1


def test_split_scores_are_about_one_for_noise_and_large_for_a_real_split():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 12))  # one homogeneous group
    adj = cdist(x, x, "sqeuclidean")
    left, right = np.flatnonzero(x[:, 0] < 0), np.flatnonzero(x[:, 0] >= 0)  # cut along a direction
    noise = fcr.split_score(adj, left, right, np.where(x[:, 0] < 0, 0, 1))
    assert 0.3 < noise < 2.0
    y = x.copy()
    y[right, 1] += 4.0  # the same halves, now 4 sd apart along another direction
    adj = cdist(y, y, "sqeuclidean")
    assert fcr.split_score(adj, left, right, np.where(y[:, 0] < 0, 0, 1)) > 4 * noise


# -- choose 'halves': clusters drawn on one half of every client's data, tested on the other --
def small_clients(gap, seed, groups=3, per=200, k=3, dim=8, noise=1.0):
    """Many clients with few samples each: every client's summaries (its whole data and
    two halves, each half twice as noisy) scatter around its group's class centres, which
    sit `gap` apart; the groups overlap in any one client's summary."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(k, dim)) * 3
    centres = [base + gap * rng.normal(size=(k, dim)) for _ in range(groups)]
    truth = np.repeat(np.arange(groups), per)

    def draw(scale):
        return [centres[g] + scale * rng.normal(size=(k, dim)) for g in truth]

    m = len(truth)
    halves = fcr.whiten(draw(noise * 2**0.5) + draw(noise * 2**0.5))  # one whitening for both, as FLT
    shares = [np.full(k, 1 / k)] * m
    return fcr.whiten(draw(noise)), fcr.Halves(np.arange(m), halves[:m], halves[m:], shares, shares), truth


def test_a_held_out_z_is_noise_for_one_group_and_large_for_two():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 6))
    adj = cdist(x, x, "sqeuclidean")
    left, right = np.arange(60), np.arange(60, 120)  # any split not drawn on this data
    assert abs(fcr.heldout_z(adj, left, right)) < 3
    x[right, 0] += 1.5  # the two sides' means 1.5 noise sd apart
    adj = cdist(x, x, "sqeuclidean")
    assert fcr.heldout_z(adj, left, right) > 10
    assert fcr.heldout_z(adj, left, right) == fcr.heldout_z(adj, left, right)  # seeded


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_held_out_halves_find_groups_of_many_small_clients(seed):
    """900 clients whose summaries overlap across groups: the whole-data split score
    cannot tell any split from noise (one cluster), the held-out halves confirm them."""
    whole, halves, truth = small_clients(gap=0.8, seed=seed, per=300)
    splits = fcr.relate(whole, dataclasses.replace(fcr.PRESETS["set"], choose="splits"))
    got = fcr.relate(whole, fcr.PRESETS["set"], halves=halves)
    assert splits.n_clusters == 1
    assert got.n_clusters > 1 and got.chosen_by == "halves"
    assert adjusted_rand_score(truth, got.labels) > 0.15


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_held_out_halves_leave_clients_without_groups_as_one(seed):
    whole, halves, _ = small_clients(gap=0.0, seed=seed)
    assert fcr.relate(whole, fcr.PRESETS["set"], halves=halves).n_clusters == 1


@pytest.mark.parametrize("seed", [11, 13, 17, 21, 30])
def test_a_few_clients_of_one_population_split_off_by_chance_are_vetoed(seed):
    """20 IID clients with few samples each (noise dominates): in these draws the split
    rule alone passes a split of some clients off (the chance of a score above the bar),
    and held-out data calls it noise. Before the veto ran where noise dominates, these
    draws gave 2 or 4 clusters (3 of 20 such draws, and 6 of 25 quickstart partitions)."""
    whole, halves, _ = small_clients(gap=0.0, seed=seed, groups=1, per=20)
    assert fcr.HeldOut(halves, "energy", len(whole)).noise_dominates
    splits = fcr.relate(whole, dataclasses.replace(fcr.PRESETS["set"], choose="splits"))
    assert splits.n_clusters > 1
    got = fcr.relate(whole, fcr.PRESETS["set"], halves=halves)
    assert got.n_clusters == 1


def test_a_continuum_of_clients_is_not_split_by_held_out_data():
    """Clients that each differ for real (a writer's hand), with little sampling noise:
    any split of them is confirmed by held-out data, but they form no groups. The
    held-out test stays out (the noise does not dominate) and the split score, which
    judges splits against the clients' spread, finds one cluster."""
    rng = np.random.default_rng(4)
    base = rng.normal(size=(3, 8)) * 3
    own = [base + rng.normal(size=(3, 8)) for _ in range(200)]  # each client's own distribution

    def draw(scale):
        return [c + scale * rng.normal(size=(3, 8)) for c in own]

    halves = fcr.whiten(draw(0.3) + draw(0.3))
    shares = [np.full(3, 1 / 3)] * 200
    held = fcr.Halves(np.arange(200), halves[:200], halves[200:], shares, shares)
    cross = fcr.set_distance(held.a + held.b, "energy", weights=shares + shares)[:200, 200:]
    assert not fcr.noise_dominates(cross)
    # the held-out test alone would split them: the first halves' top split holds on the second
    da, db = fcr.set_distance(held.a, "energy"), fcr.set_distance(held.b, "energy")
    top = fcr._members(linkage(squareform(np.sqrt(da), checks=False), "ward"), 200, 1)[398]
    assert fcr.heldout_z(db, *top) >= fcr.PRESETS["set"].min_heldout
    assert fcr.relate(fcr.whiten(draw(0.2)), fcr.PRESETS["set"], halves=held).n_clusters == 1


def elongated_groups(seed, groups=3, per=40, k=3, dim=8, long=1.5):
    """Groups far apart whose clients' summaries vary by sampling noise alone, mostly along
    one direction (as a client's centroids shift with how many of its samples fall on
    each side of a class boundary). The split score judges a split against the spread
    inside the final clusters, and a piece of such a group is thin along that direction,
    so the pieces of each group pass it."""
    rng = np.random.default_rng(seed)
    centres = [rng.normal(size=(k, dim)) * 6 for _ in range(groups)]
    scale = np.full(dim, 0.3)
    scale[0] = long
    truth = np.repeat(np.arange(groups), per)

    def draw(factor):  # one shift of the whole set per client and draw, a little jitter per centroid
        shift = factor * rng.normal(size=(len(truth), 1, dim)) * scale
        return [centres[g] + shift[i] + 0.1 * rng.normal(size=(k, dim)) for i, g in enumerate(truth)]

    m = len(truth)
    halves = fcr.whiten(draw(2**0.5) + draw(2**0.5))
    shares = [np.full(k, 1 / k)] * m
    return fcr.whiten(draw(1.0)), fcr.Halves(np.arange(m), halves[:m], halves[m:], shares, shares), truth


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_held_out_halves_veto_pieces_of_one_group(seed):
    """Where clients differ by more than noise (here: between groups), the split rule's
    splits of a group into pieces are noise on held-out data, and the default drops them."""
    whole, halves, truth = elongated_groups(seed)
    splits = fcr.relate(whole, dataclasses.replace(fcr.PRESETS["set"], choose="splits"))
    no_veto = dataclasses.replace(fcr.PRESETS["set"], min_heldout_keep=float("-inf"))
    got = fcr.relate(whole, fcr.PRESETS["set"], halves=halves)
    assert not fcr.HeldOut(halves, "energy", len(whole)).noise_dominates
    assert splits.n_clusters > 3  # the split rule alone cuts the groups into pieces
    assert fcr.relate(whole, no_veto, halves=halves).n_clusters == splits.n_clusters
    assert got.n_clusters == 3 and got.chosen_by == "halves"
    assert adjusted_rand_score(truth, got.labels) == 1.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_groups_of_two_clients_are_not_vetoed_by_a_test_too_small_to_confirm_them(seed):
    """Two clients against two have 3 distinct relabellings: no permutation test can put
    them 3 standard deviations out, so a veto there merged real groups (10 clients in 5
    groups far apart: 1 or 3 clusters). The veto abstains where it has no room."""
    whole, halves, truth = elongated_groups(seed, groups=5, per=2)
    got = fcr.relate(whole, fcr.PRESETS["set"], halves=halves)
    assert got.n_clusters == 5 and adjusted_rand_score(truth, got.labels) == 1.0
    assert not fcr.can_reach(2, 3, 3.0) and not fcr.can_reach(2, 2, 3.0)
    assert fcr.can_reach(4, 4, 3.0) and fcr.can_reach(5, 5, 3.0)  # the quality suite's pieces: 4 a side


@pytest.mark.parametrize("groups, seed", [(5, 4), (6, 0), (6, 17), (8, 5)])
def test_a_pair_of_clients_is_not_merged_because_the_other_side_holds_several_groups(groups, seed):
    """A merge of one pair against three other pairs (2 vs 6: 28 relabellings, room enough)
    was tested side against side: relabellings that pick another real pair score as high
    as the split, so it scored 2.4 and real groups were merged (1 to 3 clusters, in 8 of
    20 seeds at each size). The veto now tests the merge's nearest pair of clusters."""
    whole, halves, truth = elongated_groups(seed, groups=groups, per=2)
    got = fcr.relate(whole, fcr.PRESETS["set"], halves=halves)
    assert got.n_clusters == groups and adjusted_rand_score(truth, got.labels) == 1.0


def test_nearest_clusters_are_the_pair_with_the_nearest_means():
    points = np.array([[0.0], [0.2], [5.0], [5.2], [9.0], [9.2], [30.0], [30.2]])
    squared = (points - points.T) ** 2
    final = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    a, b = fcr.nearest_clusters(squared, np.arange(4), np.arange(4, 8), final)  # {0,1} vs {2,3}
    assert a.tolist() == [2, 3] and b.tolist() == [4, 5]  # means 5.1 and 9.1, the closest across


@pytest.mark.slow  # numba compiles UMAP: about 14 s
def test_umap_gives_the_same_projection_each_time_when_its_graph_falls_apart():
    """Six groups far apart: UMAP's kNN graph has six pieces (> 2 x 2), where its default
    spectral initialisation placed them differently on every call, whatever the seed."""
    rng = np.random.default_rng(0)
    centroids = [rng.normal(size=(5, 16)) + 40.0 * (c % 6) for c in range(60)]
    first = np.concatenate(fcr.umap_project(centroids, seed=3))
    assert all(np.array_equal(first, np.concatenate(fcr.umap_project(centroids, seed=3))) for _ in range(2))
    assert first.shape == (300, 2)


def test_two_centroids_in_all_are_projected_keeping_their_distance():
    """UMAP's neighbour graph needs three points: two clients of one centroid each (k: 1)
    were a ValueError mid-run. PCA alone projects them, the distance kept."""
    a, b = np.array([[0.0, 0.0, 0.0]]), np.array([[3.0, 4.0, 0.0]])
    pa, pb = fcr.umap_project([a, b], n_components=2, seed=0)
    assert pa.shape == (1, 2) and np.linalg.norm(pa - pb) == pytest.approx(5.0, rel=1e-5)
    (alone,) = fcr.umap_project([a], n_components=2)
    assert alone.shape == (1, 1)


@pytest.mark.slow  # numba compiles UMAP: about 14 s
def test_umap_dimension_is_capped_at_what_the_centroids_span():
    """n_components above the centroids' dimension was scikit-learn's ValueError from UMAP's
    PCA initialisation, a traceback mid-run."""
    rng = np.random.default_rng(1)
    centroids = [rng.normal(size=(2, 3)) + 10.0 * (c % 2) for c in range(12)]
    proj = fcr.umap_project(centroids, n_components=50, seed=0)
    assert len(proj) == 12 and all(p.shape == (2, 3) and np.isfinite(p).all() for p in proj)


def test_the_held_out_test_does_not_depend_on_which_half_comes_first():
    whole, halves, truth = small_clients(gap=0.8, seed=0, per=300)
    swapped = fcr.Halves(halves.members, halves.b, halves.a, halves.b_weights, halves.a_weights)
    how = fcr.PRESETS["set"]
    one, other = fcr.HeldOut(halves, "energy", len(whole)), fcr.HeldOut(swapped, "energy", len(whole))
    assert one.clusters(how.min_heldout, how, 20) == other.clusters(how.min_heldout, how, 20) > 1
    groups = [np.flatnonzero(truth == g) for g in range(2)]
    assert one.separates(*groups, how.min_heldout_keep) and other.separates(*groups, how.min_heldout_keep)


def test_the_veto_tests_whole_data_splits_on_each_half():
    """Two sides of one group are not separated on held-out halves; two groups are; a side
    whose clients sent no halves cannot be tested and passes."""
    whole, halves, truth = elongated_groups(0)
    held = fcr.HeldOut(halves, "energy", len(whole))
    one_group = np.flatnonzero(truth == 0)
    assert not held.separates(one_group[::2], one_group[1::2], 3.0)
    assert held.separates(one_group, np.flatnonzero(truth == 1), 3.0)
    partial = fcr.Halves(
        halves.members[40:], halves.a[40:], halves.b[40:], halves.a_weights[40:], halves.b_weights[40:]
    )
    assert fcr.HeldOut(partial, "energy", len(whole)).separates(one_group, np.flatnonzero(truth == 1), 1e9)


def test_the_veto_threshold_is_a_scenario_field():
    from flt.server.strategies.params import flt_pipeline

    [entry] = parse_methods([{"name": "flt", "min_heldout_keep": 4.5}])
    assert flt_pipeline(entry.params).min_heldout_keep == 4.5
    with pytest.raises(ConfigError, match="min_heldout_keep"):
        parse_methods([{"name": "flt", "min_heldout_keep": -1}])


def test_without_halves_the_default_is_the_split_rule():
    sets, _ = nested()
    points = fcr.whiten(sets)
    splits = fcr.relate(points, dataclasses.replace(fcr.PRESETS["set"], choose="splits"))
    assert fcr.relate(points, fcr.PRESETS["set"], halves=None).labels.tolist() == splits.labels.tolist()


# -- after the cut: Lloyd's iterations on Ward's objective --------------------------------
def ward_objective(labels, squared):
    return sum(squared[np.ix_(labels == c, labels == c)].sum() / (2 * (labels == c).sum()) for c in np.unique(labels))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_refinement_moves_the_clients_wards_greedy_merges_misplaced(seed):
    """Noisy clients (as CIFAR-10's): Ward's early merges put a few clients with the
    wrong group and never revisit them; moving each to the nearest cluster mean does.
    The cut as it is stays available (refine False), and C is the cut's."""
    sets, truth = planted(n_clients=200, classes=3, shared=1, seed=seed, spread=2.5)
    points = fcr.whiten(sets)
    cut = fcr.relate(points, dataclasses.replace(fcr.PRESETS["set"], refine=False), n_clusters=5)
    got = fcr.relate(points, fcr.PRESETS["set"], n_clusters=5)
    assert adjusted_rand_score(cut.labels, fcluster(cut.linkage, 5, criterion="maxclust")) == 1.0
    assert got.n_clusters == 5
    assert adjusted_rand_score(truth, got.labels) >= adjusted_rand_score(truth, cut.labels)
    squared = got.distance**2  # energy: A is the root of a squared distance
    assert ward_objective(got.labels, squared) <= ward_objective(cut.labels, squared)
    if seed == 0:  # this draw: the cut 0.95, refined 0.99
        assert adjusted_rand_score(truth, cut.labels) < 0.96 < 0.98 < adjusted_rand_score(truth, got.labels)


def test_refinement_recovers_groups_from_a_corrupted_assignment():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=(40, 4)), rng.normal(size=(40, 4)) + 6])
    truth = np.repeat([0, 1], 40)
    wrong = truth.copy()
    wrong[[0, 1, 2, 50, 51]] = 1 - wrong[[0, 1, 2, 50, 51]]
    assert fcr.refine_ward(wrong, cdist(x, x, "sqeuclidean")).tolist() == truth.tolist()


def test_refinement_keeps_every_cluster_and_never_raises_the_objective():
    # a cluster whose two members sit at the centres of two other groups: the only step
    # moves both and would empty it, so it is not taken
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.normal(size=(10, 3)), rng.normal(size=(10, 3)) + 8, [[0, 0, 0], [8, 8, 8]]])
    labels = np.array([0] * 10 + [1] * 10 + [2, 2])
    assert fcr.refine_ward(labels, cdist(x, x, "sqeuclidean")).tolist() == labels.tolist()
    # a squared "distance" that is no Euclidean one (a Chamfer's): Lloyd's steps may not
    # descend there, and a step that does not is not taken
    rng = np.random.default_rng(2)
    for _ in range(20):
        a = rng.random((30, 30))
        a = a + a.T
        np.fill_diagonal(a, 0)
        start = rng.integers(0, 3, size=30)
        start[:3] = [0, 1, 2]
        out = fcr.refine_ward(start, a)
        assert len(np.unique(out)) == 3
        assert ward_objective(out, a) <= ward_objective(start, a)


def test_a_scenario_can_keep_the_cut_as_it_is():
    from flt.server.strategies.params import flt_pipeline

    assert flt_pipeline(parse_methods([{"name": "flt"}])[0].params).refine is True
    assert flt_pipeline(parse_methods([{"name": "flt", "refine_clusters": False}])[0].params).refine is False
    with pytest.raises(ConfigError, match="refine_clusters"):
        parse_methods([{"name": "flt", "refine_clusters": "yes"}])


def test_the_cut_with_one_more_cluster_says_why_it_was_not_taken():
    """Six nested groups: the cut of seven splits a real group, so its weakest split scores
    under the bar (the reason C is 6), and the report says so; with the bar lowered below
    that score, the split rule takes the seventh cluster (the number is the rule's own)."""
    sets, _ = nested()
    got = default_relate(sets)
    cut = got.next_cut
    assert got.n_clusters == 6 and cut["clusters"] == 7
    assert cut["weakest_split_score"] < fcr.PRESETS["set"].min_split
    assert cut["added_split_score"] >= cut["weakest_split_score"] and sum(cut["added_sizes"]) >= 2
    assert cut["heldout_z"] is None  # no halves were sent
    lower = dataclasses.replace(fcr.PRESETS["set"], choose="splits", min_split=cut["weakest_split_score"] - 1e-9)
    assert cut["smallest_cluster"] >= 2
    assert fcr.relate(fcr.whiten(sets), lower).n_clusters >= 7


def test_the_next_cut_reports_the_held_out_separation_of_the_split_it_adds():
    """Pieces of one group (elongated_groups) are vetoed by the halves: the cut with one
    cluster more adds a split whose held-out z on each half is noise, under the veto's bar."""
    whole, halves, _ = elongated_groups(0)
    got = fcr.relate(whole, fcr.PRESETS["set"], halves=halves)
    z = got.next_cut["heldout_z"]
    assert got.n_clusters == 3 and len(z) == 2
    assert got.next_cut["weakest_split_score"] >= fcr.PRESETS["set"].min_split  # the split rule alone takes it
    assert min(z) < fcr.PRESETS["set"].min_heldout_keep
    assert fcr.relate(whole, fcr.PRESETS["set"], n_clusters=4).next_cut is None  # C given, not chosen


def test_the_next_cut_of_identical_clients_is_the_dendrograms_own():
    """All distances zero: fcluster would give one cluster for 'two' on the tied heights;
    the report's cut is the two subtrees under the top merge, and it scores 0."""
    got = fcr.relate([np.ones((3, 4)) for _ in range(5)], fcr.PRESETS["set"])
    cut = got.next_cut
    assert got.n_clusters == 1 and cut["clusters"] == 2
    assert cut["smallest_cluster"] == min(cut["added_sizes"]) and sum(cut["added_sizes"]) == 5
    assert cut["weakest_split_score"] == 0.0
