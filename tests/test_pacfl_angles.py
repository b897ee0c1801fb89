"""benchmarks/pacfl_angles.py, which docs/results.md quotes for why PACFL's principal angles
merge S2's rings: the pair kinds it sorts client pairs into, and which class pair gives a
pair's smallest angle."""

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmark scripts are not a package
import pacfl_angles  # noqa: E402


def images(rng, means: np.ndarray, per_class: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [n, 1, 4, 4] images scattered around each class's mean image, and labels."""
    y = np.repeat(np.arange(len(means)), per_class)
    x = means[y] + rng.normal(scale=8.0, size=(len(y), 16))
    return np.clip(x, 0, 255).astype(np.uint8).reshape(-1, 1, 4, 4), y


def test_pairs_are_sorted_into_same_neighbour_and_disjoint():
    truth = np.array([0, 0, 1, 2])
    holds = np.array([[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 0, 1, 1]], dtype=bool)
    kinds = pacfl_angles.pair_kinds(holds, truth)
    assert kinds[0, 1] == 0 and kinds[0, 2] == 1 and kinds[2, 3] == 2 and kinds[0, 3] == 2
    assert (np.diag(kinds) == -1).all() and (kinds == kinds.T).all()


def test_a_shared_class_gives_the_pair_its_smallest_angle():
    rng = np.random.default_rng(0)
    means = rng.uniform(0, 255, size=(3, 16))  # three classes with unrelated mean images
    x, y = images(rng, means, 30)
    shards = [np.flatnonzero(np.isin(y, [0, 1])), np.flatnonzero(np.isin(y, [1, 2])), np.flatnonzero(y == 2)]
    bases, classes = pacfl_angles.client_bases(x, y, shards, p=1, centred=False)
    assert [c.tolist() for c in classes] == [[0, 1], [1, 2], [2]]
    same = pacfl_angles.same_class_argmin(bases, classes)
    assert same[0, 1] and same[1, 2]  # they share class 1 / class 2: the minimum is met there
    assert not same[0, 2]  # no class in common: the minimum is between two classes


def test_keeping_only_the_own_classes_drops_the_others_bases():
    rng = np.random.default_rng(1)
    x, y = images(rng, rng.uniform(0, 255, size=(3, 16)), 20)
    shards = [np.arange(len(y))]
    bases, classes = pacfl_angles.client_bases(x, y, shards, p=2, centred=False, keep=[np.array([2])])
    assert classes[0].tolist() == [2, 2] and bases[0].shape == (2, 16)
    centred, _ = pacfl_angles.client_bases(x, y, shards, p=2, centred=True, keep=[np.array([2])])
    plain = bases[0][0] / np.linalg.norm(bases[0][0])
    # centring removes the class's mean image, which the uncentred leading vector follows
    mean = means_of(x, y, 2)
    assert abs(plain @ mean) > 0.99 > abs(centred[0][0] @ mean)


def means_of(x: np.ndarray, y: np.ndarray, c: int) -> np.ndarray:
    m = x[y == c].reshape(-1, 16).astype(np.float64).mean(0)
    return m / np.linalg.norm(m)
